"""Launch plumbing shared by the kernel modules: interpreter detection and tile configs."""

from __future__ import annotations

import os

import torch


def interpreting() -> bool:
    """True when Triton runs kernels through its CPU interpreter (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


#: Native hardware casts on real GPUs (never under the interpreter, whose fp8 cast rounds wrongly:
#: `numerics.md`, Known traps). bench/check_gpu.py sweeps the native AND the software encoders
#: over all 2^32 fp32 inputs; if a native one ever mismatches, set its constant to False and every
#: kernel falls back to the software rounding helpers of `_rounding` for that rule.
#: FP8: ``cvt.rn.satfinite.e4m3x2/e5m2x2.f32`` alone (it saturates Inf and overflow, keeps NaN).
NATIVE_FP8_CASTS = True
#: bf16: ``cvt.rn.bf16.f32`` (RNE) for bf16 outputs and the RHT rounding, plain bf16 -> fp32
#: widening, and ``max.f32(|x|, 0)`` (returns the non-NaN operand) for NaN-dropping maxima.
NATIVE_BF16_CASTS = True


def native_fp8() -> bool:
    """True when kernels use the native fp32 -> e4m3/e5m2 cast."""
    return NATIVE_FP8_CASTS and not interpreting()


def native_bf16() -> bool:
    """True when kernels use the native bf16 casts and NaN-dropping hardware max."""
    return NATIVE_BF16_CASTS and not interpreting()


#: Tile configs per kernel: ``{name: {"gpu": {...}, "interp": {...}}}``; the benchmark may edit the
#: "gpu" entries in place to sweep them. Interpreter tiles are large to keep the grid small.
CONFIGS: dict[str, dict[str, dict[str, int]]] = {}


def config(name: str) -> dict[str, int]:
    """The tile config of kernel ``name`` for the current mode (a copy)."""
    return dict(CONFIGS[name]["interp" if interpreting() else "gpu"])


def launch_kwargs(cfg: dict[str, int]) -> dict[str, int]:
    """``num_warps`` / ``num_stages`` / ``maxnreg`` of a config, dropped in interpreter mode."""
    if interpreting():
        return {}
    return {k: v for k, v in cfg.items() if k in ("num_warps", "num_stages", "maxnreg")}


def unfused() -> dict[str, bool]:
    """Launch option keeping every fp32 multiply and add separately rounded (no FMA contraction),
    for kernels whose epilogue must round like the reference's separate torch ops."""
    return {} if interpreting() else {"enable_fp_fusion": False}


def tile_args(cfg: dict[str, int]) -> dict[str, int]:
    """The constexpr tile sizes of a config (upper-case keys)."""
    return {k: v for k, v in cfg.items() if k.isupper()}


def tl_dtype(dtype: torch.dtype):
    """The ``triton.language`` dtype of a float torch dtype."""
    import triton.language as tl

    table = {torch.float32: tl.float32, torch.bfloat16: tl.bfloat16, torch.float16: tl.float16}
    return table[dtype]
