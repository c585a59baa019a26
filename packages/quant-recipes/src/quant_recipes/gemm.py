"""GEMMs on quantized operands, and which path ran (architecture.md contract 6).

Operands travel as buffer lists (a storage's buffers in declaration order, an absent one as an
empty tensor) plus integer metadata (:func:`quantizer_meta`: the format's index, then the
storage's tags as integers), so the GEMM is one custom op with plain types
(``quant_recipes::qgemm``) on every torch release. Inside it the buffers become a storage again
(``from_wire``), the storage hands out its GEMM operand for the role (``gemm_operand``), and
:func:`quant_recipes.gemm_fast.fast_gemm` runs the fastest path for the pair: cuBLAS scaled GEMMs
for FP8 per-tensor and FP8 blocks, the backend's GEMM for MXFP8 and NVFP4 (Triton on CUDA). Other
pairs (mixed formats, a transposed use of rowwise blocks, unaligned shapes) are ``"emulated"``:
both operands decoded to fp32 by their storages (``gemm_value``), then an fp32 matmul; both
unquantized is ``"high_precision"``. :func:`gemm_paths` counts the paths that ran.
"""

from __future__ import annotations

import collections

import torch
from quant_core.kernel_capture import NotCapturable
from quant_core.storage import format_at, format_index, storage_class, storage_formats

from .compiling import available, compiling, dynamo, trace_time_constant
from .gemm_fast import fast_gemm

#: The format index of an unquantized operand (a quantized format's is 1 + its position in
#: ``quant_core.storage_formats()``).
HP = 0
#: The metadata of an unquantized operand.
HP_META = [HP]

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


def is_high_precision(q) -> bool:
    """Whether ``q`` leaves its tensor unquantized (its operands travel as ``[tensor]``)."""
    # not isinstance: torch 2.11 traces quantizers as opaque wrappers
    return q.storage_format == "high_precision"


@trace_time_constant
def quantizer_meta(q) -> list[int]:
    """``[format index, *storage tags as integers]`` of a quantizer's storages (a pure function
    of the quantizer's value: compiled code bakes it, :func:`~.compiling.trace_time_constant`)."""
    fmt = q.storage_format
    if fmt == "high_precision":
        return list(HP_META)
    index = format_index(fmt)
    if index is None:
        raise TypeError(
            f"{type(q).__name__}.storage_format is {fmt!r}; a quantizer used by quant_recipes "
            f"must produce one of high_precision, {', '.join(storage_formats())}"
        )
    return [1 + index, *storage_class(fmt).wire_tags(q._storage_tags())]


@trace_time_constant
def _storage_type(meta: list[int]):
    return storage_class(format_at(meta[0] - 1))


def _storage(bufs: list[torch.Tensor], meta: list[int], shape):
    """The storage object of a quantized operand's buffer list (absent buffers are empty)."""
    return _storage_type(meta).from_wire(bufs, meta[1:], shape)


def dequantize(bufs: list[torch.Tensor], meta: list[int], m: int, k: int, columnwise: bool,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The ``[m, k]`` value of an operand in ``dtype`` (fp32 by default), from its rowwise or
    columnwise buffers (the storage's ``gemm_value``: columnwise NVFP4 with RHT stays in the
    transformed basis, as the GEMM consumes it)."""
    if meta[0] == HP:
        return bufs[0].reshape(m, k).to(dtype)
    if not m * k:  # no element: its buffers may all be empty, which the wire calls absent
        return torch.zeros((m, k), dtype=dtype, device=bufs[0].device)
    return _storage(bufs, meta, (m, k)).gemm_value(columnwise, dtype)


def unread_by_transposed_use(bufs: list[torch.Tensor], meta: list[int]) -> tuple[int, ...]:
    """The positions in ``bufs`` that a GEMM using the operand transposed does not read (the
    storage's ``unread_by_transposed_use``); none for a high-precision operand. Traced code
    reads the positions off the storage class at trace time (the buffers come from quant's
    ops, whose count the storage fixes)."""
    if meta[0] == HP:
        return ()
    if not compiling():
        return _storage_type(meta).unread_by_transposed_use(bufs)
    columnwise, unread = _transposed_reads(meta)
    return unread if bufs[columnwise].numel() else ()


@trace_time_constant
def _transposed_reads(meta: list[int]) -> tuple[int, tuple[int, ...]]:
    """``(the columnwise data's position, the positions a transposed use does not read when the
    columnwise data is present)`` in a buffer list of ``meta``'s storage."""
    cls = _storage_type(meta)
    return cls._columnwise_position, cls._rowwise_only_positions


def for_transposed_use(bufs: list[torch.Tensor], meta: list[int]) -> list[torch.Tensor]:
    """``bufs`` as a GEMM that uses the operand transposed (from its columnwise direction) reads
    them (the storage's ``for_transposed_use``); high-precision operands as they are."""
    return bufs if meta[0] == HP else _storage_type(meta).for_transposed_use(bufs)


def operand(bufs, meta, shape, transposed: bool, columnwise: bool):
    """The row operand (``quant_core.GemmOperand``) of ``X`` (``Xᵀ`` when ``transposed``), or
    None when its storage cannot hand it out for this use. Unless the format's directions are
    interchangeable (one scale), a transposed use is served from the columnwise buffers only:
    a transposed rowwise form (``backward_override="dequantized"``) has its blocks across the
    contraction and is emulated."""
    if meta[0] == HP:
        return None
    if columnwise != transposed and not _storage_type(meta).directions_interchangeable:
        return None
    return _storage(bufs, meta, shape).gemm_operand(transposed)


def _fast(a_bufs, a_meta, a_shape, a_col, transa, b_bufs, b_meta, b_shape, b_col, transb, bias,
          out_dtype, fast_accum):
    """``(out, path)`` of the fast path for these operands, or None (see :func:`operand`)."""
    ra = operand(a_bufs, a_meta, a_shape, transa, a_col)
    rb = operand(b_bufs, b_meta, b_shape, not transb, b_col)
    if ra is None or rb is None:
        return None
    return fast_gemm(ra, rb, bias, out_dtype, fast_accum)


def qgemm_impl(a_bufs, a_meta, a_shape, a_col, transa, b_bufs, b_meta, b_shape, b_col, transb,
               bias, out_dtype, fast_accum=False):
    """``op(A) @ op(B) (+ bias)`` with ``op`` = transpose when ``trans``; A is ``a_shape``
    logically (``[m, k]``), from its columnwise buffers when ``a_col``. ``fast_accum``: an FP8
    per-tensor GEMM on FP8 tensor cores may accumulate at their own width (the recipe's
    ``MMParams``); every other path accumulates in fp32."""
    (am, ak), (bm, bk) = a_shape, b_shape
    if a_meta[0] == HP and b_meta[0] == HP:
        path = "high_precision"
    else:
        path = "emulated"
        fast = _fast(a_bufs, a_meta, a_shape, a_col, transa, b_bufs, b_meta, b_shape, b_col,
                     transb, bias, out_dtype, fast_accum)
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
    "ScalarType out_dtype, bool fast_accum=False) -> Tensor"
)


def _qgemm_cpu(a, a_meta, a_shape, a_col, transa, b, b_meta, b_shape, b_col, transb, bias,
               out_dtype, fast_accum=False):
    return qgemm_impl(list(a), list(a_meta), list(a_shape), a_col, transa, list(b), list(b_meta),
                      list(b_shape), b_col, transb, bias, out_dtype, fast_accum)


def _qgemm_fake(a, a_meta, a_shape, a_col, transa, b, b_meta, b_shape, b_col, transb, bias,
                out_dtype, fast_accum=False):
    rows = a_shape[1] if transa else a_shape[0]
    cols = b_shape[0] if transb else b_shape[1]
    dev = a[0].device
    return torch.empty((rows, cols), dtype=out_dtype, device=dev)


def _qgemm_lowered(a, a_meta, a_shape, a_col, transa, b, b_meta, b_shape, b_col, transb, bias,
                   out_dtype, fast_accum=False):
    """The body recorded into a compiled graph: a fast path only (cuBLAS or the backend's GEMM
    kernel); the emulated and high-precision paths stay in the opaque op (``NotCapturable``)."""
    fast = _fast(list(a), list(a_meta), list(a_shape), a_col, transa, list(b), list(b_meta),
                 list(b_shape), b_col, transb, bias, out_dtype, fast_accum)
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
          bias, out_dtype, fast_accum=False):
    """The GEMM as a custom op (recorded at run time, opaque to the compiler)."""
    return torch.ops.quant_recipes.qgemm(
        a_bufs, a_meta, list(a_shape), a_col, transa, b_bufs, b_meta, list(b_shape), b_col,
        transb, bias, out_dtype, fast_accum,
    )
