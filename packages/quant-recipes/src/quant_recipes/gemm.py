"""GEMMs on quantized operands, and which path ran.

Operands travel as buffer lists (a storage's buffers in declaration order, an absent one as an
empty tensor) plus integer metadata, so the GEMM is one custom op with plain types
(``quant_recipes::qgemm``) on every torch release. Paths:

- ``"scaled_mm"``: FP8 per-tensor operands on CUDA with compute capability >= 8.9, through
  ``torch._scaled_mm`` (fp32 accumulation in the tensor cores);
- ``"emulated"``: dequantize both operands to fp32 (exactly, with quant-core's backend) and
  multiply in fp32: every format on every device, the reference for the others;
- ``"high_precision"``: both operands unquantized.

FP8 block, MXFP8 and NVFP4 operands are emulated. :func:`gemm_paths` counts the paths that ran.
"""

from __future__ import annotations

import collections

import torch
from quant_core import (
    DType,
    backends,
)

HP, FP8, MXFP8, FP8_BLOCK, NVFP4 = range(5)
_FORMAT_NAMES = ("high_precision", "fp8", "mxfp8", "fp8_block", "nvfp4")

_PATHS: collections.Counter = collections.Counter()
_LAST: list[str] = []


def gemm_paths() -> dict[str, int]:
    """How many GEMMs ran on each path since the last :func:`reset_gemm_paths`."""
    return dict(_PATHS)


def last_gemm_path() -> str | None:
    return _LAST[-1] if _LAST else None


def reset_gemm_paths() -> None:
    _PATHS.clear()
    _LAST.clear()


def _record(path: str) -> None:
    _PATHS[path] += 1
    _LAST[:] = [path]


def quantizer_meta(q) -> list[int]:
    """``[format, dtype value, block_scaling_dim, swizzled]`` of a quantizer's storages."""
    fmt = q.storage_format  # not isinstance: torch 2.11 traces quantizers as opaque wrappers
    if fmt == "high_precision":
        return [HP, 0, 0, 0]
    if fmt not in _FORMAT_NAMES:
        raise TypeError(
            f"{type(q).__name__}.storage_format is {fmt!r}; a quantizer used by quant_recipes "
            f"must produce one of {', '.join(_FORMAT_NAMES)}"
        )
    swz = int(bool(q.optimize_for_gemm)) if fmt in ("mxfp8", "nvfp4") else 0
    dim = q.block_scaling_dim if fmt == "fp8_block" else 0
    return [_FORMAT_NAMES.index(fmt), q.dtype.value, dim, swz]


def dequantize(bufs: list[torch.Tensor], meta: list[int], m: int, k: int, columnwise: bool
               ) -> torch.Tensor:
    """The fp32 ``[m, k]`` value of an operand, from its rowwise or columnwise buffers.

    Columnwise NVFP4 with RHT stays in the transformed basis (as the GEMM consumes it).
    """
    fmt, dt, dim, swz = meta
    if fmt == HP:
        return bufs[0].reshape(m, k).to(torch.float32)
    dev = bufs[0].device if bufs[0].numel() else bufs[-1].device
    be = backends.get(None, dev)
    dtype = DType(dt)
    if fmt == FP8:
        data, transpose, scale_inv = bufs
        if columnwise and transpose.numel() or not data.numel():
            out = be.fp8_dequantize(transpose.reshape(k, m), scale_inv, fp8_dtype=dtype,
                                    dtype=torch.float32)
            return out.t()
        return be.fp8_dequantize(data.reshape(m, k), scale_inv, fp8_dtype=dtype,
                                 dtype=torch.float32)
    if fmt == MXFP8:
        rd, rs, cd, cs = bufs
        data, scale = (cd, cs) if columnwise else (rd, rs)
        return be.mxfp8_dequantize(data.reshape(m, k), scale, fp8_dtype=dtype,
                                   columnwise=columnwise, swizzled=bool(swz),
                                   dtype=torch.float32)
    if fmt == FP8_BLOCK:
        rd, rs, cd, cs = bufs
        data = cd.reshape(k, m) if columnwise else rd.reshape(m, k)
        return be.fp8_block_dequantize(data, cs if columnwise else rs, fp8_dtype=dtype,
                                       block_scaling_dim=dim, columnwise=columnwise,
                                       dtype=torch.float32)
    if fmt == NVFP4:
        rd, rs, cd, cs, ar, ac = bufs
        if columnwise:
            out = be.nvfp4_dequantize(cd.reshape(k, -1), cs, ac, swizzled=bool(swz),
                                      dtype=torch.float32)
            return out[:, :m].t()
        return be.nvfp4_dequantize(rd.reshape(m, k // 2), rs, ar, swizzled=bool(swz),
                                   dtype=torch.float32)
    raise ValueError(f"unknown operand format {fmt}")


def _scaled_mm_ok(a_meta, b_meta, device: torch.device, shape) -> bool:
    if a_meta[0] != FP8 or b_meta[0] != FP8 or device.type != "cuda":
        return False
    if not hasattr(torch, "_scaled_mm") or torch.cuda.get_device_capability(device) < (8, 9):
        return False
    if a_meta[1] == b_meta[1] == DType.E5M2.value:
        return False
    return all(d % 16 == 0 for d in shape)


def _operand_fp8(bufs, meta, m, k, columnwise, trans):
    """The FP8 matrix ``op(X)`` (``[rows, contraction]`` view for A, ``[contraction, cols]``
    column-major for B) without copies where the layout allows."""
    data, transpose, scale_inv = bufs
    fp8 = DType(meta[1]).torch_dtype
    # logical X is [m, k]; rowwise buffer is X, columnwise buffer is X^T (both row-major)
    mat = transpose.reshape(k, m).t() if columnwise and transpose.numel() else data.reshape(m, k)
    mat = mat.view(fp8)
    return (mat.t() if trans else mat), scale_inv


def qgemm_impl(a_bufs, a_meta, a_shape, a_col, transa, b_bufs, b_meta, b_shape, b_col, transb,
               bias, out_dtype):
    """``op(A) @ op(B) (+ bias)`` with ``op`` = transpose when ``trans``; A is ``a_shape``
    logically (``[m, k]``), from its columnwise buffers when ``a_col``."""
    (am, ak), (bm, bk) = a_shape, b_shape
    rows, inner = (ak, am) if transa else (am, ak)
    cols = bm if transb else bk
    dev = a_bufs[0].device if a_bufs[0].numel() else a_bufs[-1].device
    if a_meta[0] == HP and b_meta[0] == HP:
        path = "high_precision"
    elif _scaled_mm_ok(a_meta, b_meta, dev, (rows, inner, cols)):
        a, sa = _operand_fp8(a_bufs, a_meta, am, ak, a_col, transa)
        b, sb = _operand_fp8(b_bufs, b_meta, bm, bk, b_col, transb)
        if not a.is_contiguous():
            a = a.contiguous()
        if not b.t().is_contiguous():
            b = b.t().contiguous().t()
        out = torch._scaled_mm(a, b, scale_a=sa.reshape(()), scale_b=sb.reshape(()),
                               out_dtype=torch.float32)
        if bias is not None:
            out = out + bias.to(torch.float32)
        _record("scaled_mm")
        return out.to(out_dtype)
    else:
        path = "emulated"
    a = dequantize(a_bufs, a_meta, am, ak, a_col)
    b = dequantize(b_bufs, b_meta, bm, bk, b_col)
    out = (a.t() if transa else a) @ (b.t() if transb else b)
    if bias is not None:
        out = out + bias.to(torch.float32)
    _record(path)
    return out.to(out_dtype)


_lib = torch.library.Library("quant_recipes", "FRAGMENT")
_lib.define(
    "qgemm(Tensor[] a, int[] a_meta, SymInt[] a_shape, bool a_col, bool transa, "
    "Tensor[] b, int[] b_meta, SymInt[] b_shape, bool b_col, bool transb, Tensor? bias, "
    "ScalarType out_dtype) -> Tensor"
)


def _qgemm_cpu(a, a_meta, a_shape, a_col, transa, b, b_meta, b_shape, b_col, transb, bias,
               out_dtype):
    return qgemm_impl(list(a), list(a_meta), list(a_shape), a_col, transa, list(b), list(b_meta),
                      list(b_shape), b_col, transb, bias, out_dtype)


def _qgemm_fake(a, a_meta, a_shape, a_col, transa, b, b_meta, b_shape, b_col, transb, bias,
                out_dtype):
    rows = a_shape[1] if transa else a_shape[0]
    cols = b_shape[0] if transb else b_shape[1]
    dev = a[0].device
    return torch.empty((rows, cols), dtype=out_dtype, device=dev)


_lib.impl("qgemm", _qgemm_cpu, "CompositeExplicitAutograd")
torch.library.register_fake("quant_recipes::qgemm", _qgemm_fake, lib=_lib)


def qgemm(a_bufs, a_meta, a_shape, a_col, transa, b_bufs, b_meta, b_shape, b_col, transb,
          bias, out_dtype):
    """The GEMM as a custom op (recorded at run time, opaque to the compiler)."""
    return torch.ops.quant_recipes.qgemm(
        a_bufs, a_meta, list(a_shape), a_col, transa, b_bufs, b_meta, list(b_shape), b_col,
        transb, bias, out_dtype,
    )


__all__ = [
    "gemm_paths", "last_gemm_path", "reset_gemm_paths", "qgemm", "qgemm_impl", "dequantize",
    "quantizer_meta", "_FORMAT_NAMES",
]
