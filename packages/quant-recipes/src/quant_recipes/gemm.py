"""GEMMs on quantized operands, and which path ran (architecture.md contract 6).

Operands travel as buffer lists (a storage's buffers in declaration order, an absent one as an
empty tensor) plus integer metadata, so the GEMM is one custom op with plain types
(``quant_recipes::qgemm``) on every torch release. Inside it the buffers become a storage again,
the storage hands out its GEMM operand for the role (``gemm_operand``), and
:func:`quant_recipes.gemm_fast.fast_gemm` runs the fastest path for the pair: cuBLAS scaled GEMMs
for FP8 per-tensor and FP8 blocks, the backend's GEMM for MXFP8 and NVFP4 (Triton on CUDA). Other
pairs (mixed formats, a transposed use of rowwise blocks, unaligned shapes) are ``"emulated"``:
both operands dequantized to fp32 with quant-core's backend, then an fp32 matmul; both
unquantized is ``"high_precision"``. :func:`gemm_paths` counts the paths that ran.
"""

from __future__ import annotations

import collections

import torch
from quant_core import (
    DType,
    Float8BlockwiseQTensorStorage,
    Float8TensorStorage,
    MXFP8TensorStorage,
    NVFP4TensorStorage,
    backends,
)
from quant_core.kernel_capture import NotCapturable
from quant_core.storage import absent_buffer

from .compiling import available, dynamo
from .gemm_fast import fast_gemm

HP, FP8, MXFP8, FP8_BLOCK, NVFP4 = range(5)
_FORMAT_NAMES = ("high_precision", "fp8", "mxfp8", "fp8_block", "nvfp4")

_PATHS: collections.Counter = collections.Counter()
_COMPILED: collections.Counter = collections.Counter()
_LAST: list[str] = []


def gemm_paths() -> dict[str, int]:
    """How many GEMMs chose each path since the last :func:`reset_gemm_paths`.

    Counted where the path is decided, in Python, each time the GEMM op runs: eagerly, in
    compiled code where the GEMM stays an opaque op, and once per GEMM at CUDA-graph capture
    (``torch.cuda.graph``). A graph replay runs the captured kernels without Python and counts
    nothing: the capture's count says which paths every replay takes. Likewise a fast-path GEMM
    lowered into a compiled graph (CUDA under Inductor, :func:`quant_dynamo.lower_to_kernels`)
    runs no Python per call and is not counted here: :func:`compiled_gemm_paths` has those.
    """
    return dict(_PATHS)


def compiled_gemm_paths() -> dict[str, int]:
    """The paths of the GEMMs lowered into compiled graphs since the last
    :func:`reset_gemm_paths`: one count per GEMM of a graph, recorded when the graph was traced
    (where the path is decided); every later call of that graph takes the same paths."""
    return dict(_COMPILED)


def last_gemm_path() -> str | None:
    return _LAST[-1] if _LAST else None


def reset_gemm_paths() -> None:
    """Forget the paths of :func:`gemm_paths` and :func:`compiled_gemm_paths`."""
    _PATHS.clear()
    _COMPILED.clear()
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
            out = be.nvfp4_dequantize(cd.reshape(k, cd.shape[-1]), cs, ac, swizzled=bool(swz),
                                      dtype=torch.float32)
            return out[:, :m].t()
        return be.nvfp4_dequantize(rd.reshape(m, k // 2), rs, ar, swizzled=bool(swz),
                                   dtype=torch.float32)
    raise ValueError(f"unknown operand format {fmt}")


#: The storage class behind each operand format's buffer list.
_STORAGE_CLASSES = {FP8: Float8TensorStorage, MXFP8: MXFP8TensorStorage,
                    FP8_BLOCK: Float8BlockwiseQTensorStorage, NVFP4: NVFP4TensorStorage}
#: Buffer names only a rowwise use reads (per-tensor FP8's one scale serves both directions),
#: and the names of the columnwise data.
_ROWWISE_ONLY = ("_data", "_rowwise_data", "_rowwise_scale_inv", "_amax_rowwise")
_COLUMNWISE_DATA = ("_transpose", "_columnwise_data")


def for_transposed_use(bufs: list[torch.Tensor], meta: list[int]) -> list[torch.Tensor]:
    """``bufs`` as a GEMM that uses the operand transposed (from its columnwise direction) reads
    them: the rowwise data, scales and amax become empty tensors when the columnwise copy exists
    (the backward GEMMs of a Linear read only that copy, so saving the rest wastes memory).
    High-precision operands and operands without a columnwise copy are returned as they are."""
    if meta[0] == HP:
        return bufs
    names = _STORAGE_CLASSES[meta[0]]._buffer_names
    if not any(t.numel() for n, t in zip(names, bufs, strict=True) if n in _COLUMNWISE_DATA):
        return bufs
    return [absent_buffer(t) if n in _ROWWISE_ONLY else t
            for n, t in zip(names, bufs, strict=True)]


def _storage(bufs: list[torch.Tensor], meta: list[int], shape):
    """The storage object of a quantized operand's buffer list (absent buffers are empty)."""
    fmt, dt, dim, swz = meta
    cls = _STORAGE_CLASSES[fmt]
    tags = {
        FP8: {"_fp8_dtype": DType(dt)},
        MXFP8: {"_fp8_dtype": DType(dt), "_with_gemm_swizzled_scales": bool(swz)},
        FP8_BLOCK: {"_fp8_dtype": DType(dt), "_is_2D_scaled": dim == 2},
        NVFP4: {"_fp4_dtype": DType(dt), "_with_gemm_swizzled_scales": bool(swz)},
    }[fmt]
    names = cls._buffer_names
    buffers = {name: t if t.numel() else None for name, t in zip(names, bufs, strict=True)}
    return cls(shape=shape, dtype=torch.float32, quantizer=None, **buffers, **tags)


def operand(bufs, meta, shape, transposed: bool, columnwise: bool):
    """The row operand (``quant_core.GemmOperand``) of ``X`` (``Xᵀ`` when ``transposed``), or
    None when its storage cannot hand it out for this use. Block formats serve a transposed use
    from their columnwise buffers only: a transposed rowwise form (``backward_override=
    "dequantized"``) has its blocks across the contraction and is emulated."""
    if meta[0] == HP or (meta[0] != FP8 and columnwise != transposed):
        return None
    return _storage(bufs, meta, shape).gemm_operand(transposed)


def _fast(a_bufs, a_meta, a_shape, a_col, transa, b_bufs, b_meta, b_shape, b_col, transb, bias,
          out_dtype):
    """``(out, path)`` of the fast path for these operands, or None (see :func:`operand`)."""
    ra = operand(a_bufs, a_meta, a_shape, transa, a_col)
    rb = operand(b_bufs, b_meta, b_shape, not transb, b_col)
    return fast_gemm(ra, rb, bias, out_dtype) if ra is not None and rb is not None else None


def qgemm_impl(a_bufs, a_meta, a_shape, a_col, transa, b_bufs, b_meta, b_shape, b_col, transb,
               bias, out_dtype):
    """``op(A) @ op(B) (+ bias)`` with ``op`` = transpose when ``trans``; A is ``a_shape``
    logically (``[m, k]``), from its columnwise buffers when ``a_col``."""
    (am, ak), (bm, bk) = a_shape, b_shape
    if a_meta[0] == HP and b_meta[0] == HP:
        path = "high_precision"
    else:
        path = "emulated"
        fast = _fast(a_bufs, a_meta, a_shape, a_col, transa, b_bufs, b_meta, b_shape, b_col,
                     transb, bias, out_dtype)
        if fast is not None:
            out, path = fast
            _record(path)
            return out
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


def _qgemm_lowered(a, a_meta, a_shape, a_col, transa, b, b_meta, b_shape, b_col, transb, bias,
                   out_dtype):
    """The body recorded into a compiled graph: a fast path only (cuBLAS or the backend's GEMM
    kernel); the emulated and high-precision paths stay in the opaque op (``NotCapturable``)."""
    fast = _fast(list(a), list(a_meta), list(a_shape), a_col, transa, list(b), list(b_meta),
                 list(b_shape), b_col, transb, bias, out_dtype)
    if fast is None:
        raise NotCapturable("no fast GEMM path for these operands")
    _COMPILED[fast[1]] += 1
    return fast[0]


_lib.impl("qgemm", _qgemm_cpu, "CompositeExplicitAutograd")
torch.library.register_fake("quant_recipes::qgemm", _qgemm_fake, lib=_lib)
if available():
    dynamo().lower_to_kernels(torch.ops.quant_recipes.qgemm.default, _qgemm_lowered,
                              lambda a, *args: a[0].device)


def qgemm(a_bufs, a_meta, a_shape, a_col, transa, b_bufs, b_meta, b_shape, b_col, transb,
          bias, out_dtype):
    """The GEMM as a custom op (recorded at run time, opaque to the compiler)."""
    return torch.ops.quant_recipes.qgemm(
        a_bufs, a_meta, list(a_shape), a_col, transa, b_bufs, b_meta, list(b_shape), b_col,
        transb, bias, out_dtype,
    )


__all__ = [
    "gemm_paths", "last_gemm_path", "reset_gemm_paths", "qgemm", "qgemm_impl", "dequantize",
    "quantizer_meta", "operand", "for_transposed_use", "_FORMAT_NAMES",
]
