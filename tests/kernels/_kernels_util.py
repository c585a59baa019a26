"""Inputs with special values and bitwise comparisons for the kernel tests."""

from __future__ import annotations

import contextlib
import os

import torch
from quant_core.dtypes import DType

#: CUDA when present, else the CPU through Triton's interpreter (conftest skips otherwise).
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"

_INT_VIEW = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}


def make_input(m: int, k: int, dtype: torch.dtype, seed: int = 0, device: str = "cpu",
               specials: bool = True) -> torch.Tensor:
    """Random ``[m, k]`` of ``dtype`` with NaN, ±Inf, -0.0, subnormals, values above the FP8
    maxima, tiny and all-zero blocks planted in the first rows (when they exist)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g) * torch.exp2(torch.randint(-8, 9, (m, 1), generator=g))
    if specials and m >= 4 and k >= 32:
        x[0, :12] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-40,
                                  -2e-45, 500.0, 6e4, 3e38, 2.0**-133, 6e-8, -3e-5])
        x[1, :] = 0.0
        x[1, 5] = -0.0
        x[2, :32] = 1e-39  # a block of fp32 subnormals only
        x[3, 32:] = float("nan") if k > 32 else x[3, 32:]
    if specials and m >= 40 and k >= 64:
        x[16:40, 32:64] = 0.0
    return x.to(dtype).to(device)


def fp8_nan(data: torch.Tensor, fp8_dtype: DType) -> torch.Tensor:
    return torch.isnan(data.view(fp8_dtype.torch_dtype).float())


def assert_same(got, want, fp8_dtype: DType | None = None, what: str = "") -> None:
    """Bitwise equality; FP8 bytes (``fp8_dtype`` given) and float outputs compare NaN by
    NaN-ness; fp32 buffers compare through an int32 view."""
    if want is None:
        assert got is None, what
        return
    assert got is not None, what
    assert got.shape == want.shape and got.dtype == want.dtype, (what, got.shape, want.shape)
    got, want = got.cpu(), want.cpu()
    if fp8_dtype is not None and want.dtype == torch.uint8:
        gn, wn = fp8_nan(got, fp8_dtype), fp8_nan(want, fp8_dtype)
        assert torch.equal(gn, wn), f"{what}: NaN positions differ"
        bad = (got != want) & ~wn
        assert not bad.any(), f"{what}: {int(bad.sum())} bytes differ, first at {bad.nonzero()[0]}"
    elif want.dtype in _INT_VIEW:
        gn, wn = torch.isnan(got), torch.isnan(want)
        assert torch.equal(gn, wn), f"{what}: NaN positions differ"
        gi, wi = got.view(_INT_VIEW[want.dtype]), want.view(_INT_VIEW[want.dtype])
        bad = (gi != wi) & ~wn
        assert not bad.any(), f"{what}: {int(bad.sum())} values differ, first at {bad.nonzero()[0]}"
    else:
        assert torch.equal(got, want), f"{what}: buffers differ"


def assert_all_same(got: tuple, want: tuple, fp8_dtype: DType | None, names: tuple) -> None:
    for g, w, n in zip(got, want, names, strict=True):
        assert_same(g, w, fp8_dtype, n)


#: The grouped GEMM kernels' load forms, as ``(tma, COLS_FASTEST)`` and their test ids.
GROUPED_LOAD_FORMS = [(1, 1), (0, 1), (1, 0)]
GROUPED_LOAD_IDS = ["tma", "pointer_loads", "tma_rows_first"]
#: the FP8 grouped GEMMs' forms: also the rows kernel multiplying two promoted chunks a step,
#: and every tile as two halves
FP8_GROUPED_LOAD_FORMS = [*GROUPED_LOAD_FORMS, (1, 1, 2), (1, 1, 1, 2)]
FP8_GROUPED_LOAD_IDS = [*GROUPED_LOAD_IDS, "tma_two_chunks", "tma_halves"]


@contextlib.contextmanager
def grouped_load_form(names, tma: int, cols_fastest: int, chunks: int = 1, split: int = 1):
    """The grouped GEMM launches ``names`` (their tile configs) with tiles loaded by the tensor
    memory accelerator (``tma``) or by masked pointer loads; with ``cols_fastest`` the programs
    in the default order (the rows kernel's column tile first, the contraction kernel's sharing
    a row tile), else in the other one; ``chunks`` 2: the rows kernels' main-loop steps
    multiply two promoted chunks (on a GPU in the long-contraction config's 128 x 128 tiles);
    ``split`` 2: every tile multiplied as two halves of its columns."""
    from quant_kernels import configs
    from quant_kernels._common import interpreting

    mode = "interp" if interpreting() else "gpu"
    with contextlib.ExitStack() as stack:
        for name in names:
            cfg = {**configs.config(name), "tma": tma}
            if "COLS_FASTEST" in cfg:
                cfg["COLS_FASTEST"] = cols_fastest
            elif "tokens" in name:
                cfg["ROWS_FASTEST"] = 1 - cols_fastest
            if "rows" in name:
                cfg["CHUNKS"] = chunks
                if chunks == 2 and mode == "gpu":
                    cfg.update(BN=128, num_stages=3)
            if "SPLIT" in cfg or split != 1:  # whole tiles too where the config splits them
                cfg["SPLIT"] = split
                if split != 1 and "rows" in name:
                    cfg["CHUNKS"] = 1
            stack.enter_context(configs.overridden(name, cfg, mode=mode))
        yield
