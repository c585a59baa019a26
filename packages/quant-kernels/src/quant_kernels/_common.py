"""Launch plumbing shared by the kernel modules: interpreter detection and tile configs."""

from __future__ import annotations

import os

import torch


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


#: Tile configs per kernel: ``{name: {"gpu": {...}, "interp": {...}}}``; the benchmark may edit the
#: "gpu" entries in place to sweep them. Interpreter tiles are large to keep the grid small.
CONFIGS: dict[str, dict[str, dict[str, int]]] = {}


def config(name: str) -> dict[str, int]:
    """The tile config of kernel ``name`` for the current mode (a copy)."""
    return dict(CONFIGS[name]["interp" if interpreting() else "gpu"])


def launch_kwargs(cfg: dict[str, int]) -> dict[str, int]:
    """``num_warps`` / ``num_stages`` of a config, dropped in interpreter mode."""
    if interpreting():
        return {}
    return {k: v for k, v in cfg.items() if k in ("num_warps", "num_stages")}


def tile_args(cfg: dict[str, int]) -> dict[str, int]:
    """The constexpr tile sizes of a config (upper-case keys)."""
    return {k: v for k, v in cfg.items() if k.isupper()}


def as_i32(t: torch.Tensor) -> torch.Tensor:
    """View an fp32 tensor as int32 (for atomic max on the bits of non-negative floats)."""
    return t.view(torch.int32)



def tl_dtype(dtype: torch.dtype):
    """The ``triton.language`` dtype of a float torch dtype."""
    import triton.language as tl

    table = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
    return table[dtype]
