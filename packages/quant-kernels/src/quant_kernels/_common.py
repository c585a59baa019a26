"""Launch plumbing shared by the kernel modules: interpreter detection, output dtype codes and
:func:`launch` (direct, or recorded into a compiled graph). Tile configs: :mod:`.configs`."""

from __future__ import annotations

import os

import torch
from quant_core.dtypes import DType
from quant_core.kernel_capture import capturing

from . import _launcher

#: Triton decides at ``@triton.jit`` time (this package's import) whether a kernel is interpreted.
_INTERPRETING = os.environ.get("TRITON_INTERPRET") == "1"


def interpreting() -> bool:
    """True when this package's kernels run through Triton's CPU interpreter
    (``TRITON_INTERPRET=1`` when it was imported: Triton fixes that at ``@triton.jit`` time)."""
    return _INTERPRETING


#: Native hardware casts on real GPUs (never under the interpreter, whose fp8 cast rounds wrongly:
#: `numerics.md`, Known traps). tests/gpu/test_kernels_vs_reference.py sweeps the native AND the
#: software encoders over all 2^32 fp32 inputs; if a native one ever mismatches, set its constant
#: to False and every kernel falls back to the software rounding helpers of `_rounding` for that
#: rule.
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


def launch(kernel, grid, *args, **kwargs) -> None:
    """``kernel[grid](*args, **kwargs)``. Inside ``quant_core.kernel_capture.capture()`` the launch
    is recorded into the graph being traced (``torch.library.wrap_triton``) instead, so compiled
    code launches the same kernel with the same constants. On a GPU, a launch whose argument key
    was seen before goes straight to the compiled kernel (:mod:`._launcher`)."""
    if capturing():
        from torch.library import wrap_triton

        wrap_triton(kernel)[grid](*args, **kwargs)
    elif _INTERPRETING:
        kernel[grid](*args, **kwargs)
    else:
        _launcher.launch(kernel, grid, args, kwargs)


def fp8_data(shape: tuple[int, ...], fp8_dtype: DType,
             device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A new FP8 data buffer: ``(kernel argument, uint8 data)``. Storages hold uint8 data
    (`numerics.md` §9); kernels store their bytes bitcast to the argument's element type.

    Recorded into a compiled graph, the buffer is torch's FP8 dtype and the data a uint8 view of
    it: a GEMM's FP8 view of that data is then the buffer itself in Inductor's code, where a
    uint8 buffer costs an ``aten.view.dtype`` call per GEMM operand on every step."""
    if capturing():
        buf = torch.empty(shape, dtype=fp8_dtype.torch_dtype, device=device)
        return buf, buf.view(torch.uint8)
    buf = torch.empty(shape, dtype=torch.uint8, device=device)
    return buf, buf


#: Output dtype codes of ``_rounding.to_out`` (a plain int constexpr, see there).
OUT_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def out_code(dtype: torch.dtype) -> int:
    """The ``to_out`` code of a float output dtype (fp32, bf16 or fp16)."""
    if dtype not in OUT_CODES:
        allowed = ", ".join(str(d) for d in OUT_CODES)
        raise ValueError(f"dtype must be one of {allowed}, got {dtype}")
    return OUT_CODES[dtype]
