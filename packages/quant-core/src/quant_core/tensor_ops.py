"""The handlers of the quantized tensors' op table (`behaviour.md` §1.5), registered onto
:data:`quant_core.tensor.OPS`, which ``__torch_dispatch__`` of
:class:`quant_core.tensor.QuantizedTensor` reads; every other op raises ``NotImplementedError``
naming the op and the class.

Handlers take ``(func, *args, **kwargs)`` and read the format only through the tensor's hooks
(``_layout``, ``_piece_rows``, ``_split_refusal``, ``_reshaped_buffers``,
``_transposed_buffers``), so the table holds no per-format branch.
"""

from __future__ import annotations

import math
import weakref

import torch

from .dtypes import INPUT_DTYPES
from .reference.pad import zero_pad
from .shapes import ceil_div, m_k, roundup
from .tensor import (
    OPS,
    QuantizedTensor,
    forget_high_precision_value,
    tags_of,
    traced,
    wrap,
)

aten = torch.ops.aten


def _like(t: QuantizedTensor, shape=None, buffers=None, piece: bool | None = None
          ) -> QuantizedTensor:
    """A tensor of ``t``'s class, quantizer and tags with ``shape`` and ``buffers`` (default:
    ``t``'s); a piece of a larger tensor (``piece``, default: whether ``t`` is one) refuses to
    be written into."""
    out = type(t)(t.shape if shape is None else shape, t._dtype, quantizer=t.quantizer,
                  buffers=t.buffers() if buffers is None else buffers, tags=tags_of(t))
    if getattr(t, "_piece", False) if piece is None else piece:
        out._piece = True
    return out


def _detach(func, t):
    return _like(t)


def _nd_shaped(buf: torch.Tensor, nd: str, shape) -> torch.Tensor:
    """``buf`` of layout ``nd`` (see ``_layout``) shaped for a tensor of ``shape`` with the same
    K: a view of a contiguous buffer."""
    if nd == "rows":
        return buf.reshape(*shape[:-1], buf.shape[-1])
    if nd == "cols_t":
        return buf.reshape(buf.shape[0], *shape[:-1])
    return buf


def _view(func, t, size):
    shape = torch.Size(torch._prims_common.infer_size(size, t.numel()))
    if len(shape) and t.dim() and shape[-1] == t.shape[-1]:
        layout = t._layout()
        return _like(t, shape, {
            name: buf if buf is None or layout[name] is None
            else _nd_shaped(buf, layout[name][0], shape)
            for name, buf in t.buffers().items()
        })
    buffers = t._reshaped_buffers(shape) if len(shape) else None
    if buffers is not None:
        return _like(t, shape, buffers)
    raise NotImplementedError(
        f"{func} of {type(t).__name__} from {tuple(t.shape)} to {tuple(shape)}: a view must keep "
        "the last dimension (the block axis); only a Float8Tensor without its transpose "
        "(update_usage(columnwise=False)) views freely. Call .dequantize() first."
    )


def _as_strided(func, t, size, stride, storage_offset=None):
    """The identity only (its own size, contiguous strides, offset 0: what FSDP2 asks of an
    unsharded parameter): an alias. A quantized tensor has no element strides to remap."""
    contiguous = torch._prims_common.make_contiguous_strides_for(t.shape)
    if tuple(size) == tuple(t.shape) and tuple(stride) == tuple(contiguous) and not storage_offset:
        return _like(t)
    raise NotImplementedError(
        f"{func} of {type(t).__name__} to size {tuple(size)}, stride {tuple(stride)}, offset "
        f"{storage_offset}: only its own size with contiguous strides and offset 0 (an alias); "
        "call .dequantize() first"
    )


def _transpose(func, t, *dims):
    if t.dim() < 2:
        return _like(t)
    d0, d1 = ((0, 1) if not dims else (dims[0] % t.dim(), dims[1] % t.dim()))
    if t.dim() != 2 or d0 == d1:
        if d0 == d1:
            return _like(t)
        raise NotImplementedError(f"{func} of {type(t).__name__}: only 2D tensors transpose")
    try:
        buffers = t._transposed_buffers()
    except NotImplementedError as exc:
        raise NotImplementedError(f"{func} of {exc}") from None
    return _like(t, (t.shape[1], t.shape[0]), buffers)


def _permute(func, t, dims):
    dims = [d % max(t.dim(), 1) for d in dims]
    if dims == sorted(dims):
        return _like(t)
    if len(dims) != 2:
        raise NotImplementedError(f"{func} of {type(t).__name__}: only 2D tensors transpose")
    return _transpose(func, t, *dims)


def _to_copy(func, t, *, dtype=None, device=None, **kwargs):
    device = t.device if device is None else torch.device(device)
    if (dtype is None or dtype == t._dtype) and device != t.device:
        moved = {n: None if b is None else b.to(device) for n, b in t.buffers().items()}
        return type(t)(t.shape, t._dtype, quantizer=t.quantizer, buffers=moved,
                       tags=tags_of(t), device=device)
    out = _dequantized(t, dtype).to(device)
    if device == t.device and dtype in INPUT_DTYPES and not traced(out):
        # assigned back (``t.data = t.to(dtype)``: Module.to), it changes the nominal dtype only
        out._dequantized_from = (weakref.ref(t), out._version)
    return out


def _dequantized(t: QuantizedTensor, dtype) -> torch.Tensor:
    """``t`` dequantized to ``dtype`` (None: the nominal one); a dtype ``dequantize`` does not
    produce (float64, integers) is cast from the fp32 result."""
    if dtype is None or dtype in INPUT_DTYPES:
        return t._storage_type.dequantize(t, dtype)
    return t._storage_type.dequantize(t, torch.float32).to(dtype)


def _buffers_like_quantized(dst: QuantizedTensor, src) -> dict[str, torch.Tensor]:
    """The buffers of ``src`` (quantized to ``dst``'s format) for each buffer ``dst`` holds."""
    if isinstance(src, QuantizedTensor) and type(src) is type(dst) and (
        src.quantizer == dst.quantizer and tags_of(src) == tags_of(dst)
    ) and all((getattr(src, n) is None) == (b is None) for n, b in dst.buffers().items()):
        return src.buffers()
    if isinstance(src, QuantizedTensor):
        src = _dequantized(src, dst._dtype)
    new = dst.quantizer.quantize(src.to(device=dst.device, dtype=dst._dtype))
    missing = {n for n, b in dst.buffers().items() if b is not None and getattr(new, n) is None}
    if missing and hasattr(new, "update_usage"):  # per-tensor FP8: the exact byte transpose
        new.update_usage(rowwise=True if "_data" in missing else None,
                         columnwise=True if "_transpose" in missing else None)
    return new.buffers()


def _copy_(func, dst, src, non_blocking=False):
    if not isinstance(dst, QuantizedTensor):  # a high-precision destination: dequantize
        return dst.copy_(_dequantized(src, dst.dtype))
    if getattr(dst, "_piece", False):
        raise NotImplementedError(
            f"copy_ into a piece (a slice, split or narrow) of a {type(dst).__name__}: the piece "
            "shares its scales, amaxes and columnwise copy with the rest of the tensor, which "
            "quantizing the source alone would change or leave stale. Copy into the whole "
            "tensor (its dequantized value with the piece replaced), or quantize the piece "
            "on its own")
    if tuple(src.shape) != tuple(dst.shape):
        raise ValueError(f"copy_ into {type(dst).__name__} of shape {tuple(dst.shape)} needs a "
                         f"source of the same shape, got {tuple(src.shape)}")
    new = _buffers_like_quantized(dst, src)
    for name, buf in dst.buffers().items():
        if buf is None:
            continue
        if new.get(name) is None:
            raise RuntimeError(f"copy_ into {type(dst).__name__}: its quantizer does not produce "
                               f"{name}, which the destination holds")
        buf.copy_(new[name], non_blocking)
    forget_high_precision_value(dst)
    return dst


def _make_empty(func, t, size=None, **kwargs):
    dtype = kwargs.get("dtype") or t._dtype
    device = kwargs.get("device") or t.device
    out = t.quantizer.make_empty(t.shape if size is None else size, dtype=dtype, device=device)
    return wrap(out)


def _clone(func, t, memory_format=None):
    return _like(t, buffers={
        n: None if b is None else b.clone(memory_format=torch.contiguous_format)
        for n, b in t.buffers().items()
    }, piece=False)


def _is_same_size(func, a, b):
    return tuple(a.shape) == tuple(b.shape)


# ---------------------------------------------------------------------- split / cat (dim 0)
def _check_dim0(func, t, dim) -> None:
    if dim % max(t.dim(), 1) != 0:
        raise NotImplementedError(f"{func} of {type(t).__name__} along dim {dim}: quantized "
                                  "tensors split and concatenate along dim 0 only")
    why = t._split_refusal()
    if why is not None:
        raise NotImplementedError(f"{func} of {type(t).__name__}: {why}; call .dequantize() "
                                  "first")


def _as_2d(buf: torch.Tensor, nd: str, m: int) -> torch.Tensor:
    if nd == "rows":
        return buf.reshape(m, buf.shape[-1])
    if nd == "cols_t":
        return buf.reshape(buf.shape[0], m)
    return buf


def _padded(piece: torch.Tensor, axis: int, length: int) -> torch.Tensor:
    """2D ``piece`` zero-padded along ``axis`` to ``length`` (itself when already that long)."""
    if piece.shape[axis] == length:
        return piece
    rows, cols = piece.shape
    return zero_pad(piece, length, cols) if axis == 0 else zero_pad(piece, rows, length)


def _rows(func, t: QuantizedTensor, start: int, end: int) -> QuantizedTensor:
    """Rows ``start:end`` of dim 0: buffers are views of ``t``'s, scales re-padded (copies)
    where the piece's padding differs."""
    shape = (end - start, *t.shape[1:])
    whole = start == 0 and end == t.shape[0]
    piece = None if whole else True
    if t.dim() == 1:  # only a Float8Tensor gets here: one scale, both buffers are [K]
        return _like(t, shape, {n: None if b is None else (b if n == "_scale_inv"
                                                           else b[start:end])
                                for n, b in t.buffers().items()}, piece=piece)
    inner = math.prod(t.shape[1:-1])
    m, _ = m_k(t.shape)
    r0, r1 = start * inner, end * inner
    block = t._piece_rows()
    if r0 % block or ((r1 - r0) % block and r1 != m):
        raise NotImplementedError(
            f"{func} of {type(t).__name__}: rows {start}:{end} of dim 0 are M rows {r0}:{r1} "
            f"of {m}, which do not fall on its {block}-row blocks; a piece must start at a "
            f"multiple of {block} and span one (but for the last piece)"
        )
    layout, bufs = t._layout(), {}
    for name, buf in t.buffers().items():
        spec = layout[name]
        if buf is None or spec is None:
            bufs[name] = buf
            continue
        nd, axis, unit, pad = spec
        lo, hi = r0 // unit, ceil_div(r1, unit)
        rows = _padded(_as_2d(buf, nd, m).narrow(axis, lo, hi - lo), axis, roundup(hi - lo, pad))
        bufs[name] = _nd_shaped(rows, nd, shape)
    return _like(t, shape, bufs, piece=piece)


def _split_sizes(func, t, sizes, dim=0):
    _check_dim0(func, t, dim)
    out, start = [], 0
    for n in sizes:
        out.append(_rows(func, t, start, start + n))
        start += n
    return out


def _split(func, t, split_size, dim=0):
    n = t.shape[0] if t.dim() else 0
    sizes = [min(split_size, n - i) for i in range(0, n, split_size)] if split_size else [n]
    return _split_sizes(func, t, sizes or [0], dim)


def _slice(func, t, dim=0, start=None, end=None, step=1):
    _check_dim0(func, t, dim)
    if step != 1:
        raise NotImplementedError(f"{func} of {type(t).__name__} with step {step}: only step 1")
    start, end, _ = slice(start, end).indices(t.shape[0])
    return _rows(func, t, start, max(start, end))


def _narrow(func, t, dim, start, length):
    return _slice(func, t, dim, start, start + length)


def _cat(func, tensors, dim=0):
    tensors = list(tensors)
    first = tensors[0]
    if not all(isinstance(t, QuantizedTensor) for t in tensors):
        raise NotImplementedError(f"{func}: cannot concatenate a quantized tensor with a "
                                  "high-precision one; dequantize or quantize first")
    for t in tensors:
        _check_dim0(func, t, dim)
        if type(t) is not type(first) or t.quantizer != first.quantizer or (
            tags_of(t) != tags_of(first) or t._dtype != first._dtype
            or tuple(t.shape[1:]) != tuple(first.shape[1:])
            or any((a is None) != (b is None) for a, b in zip(
                t.buffers().values(), first.buffers().values(), strict=True))
        ):
            raise ValueError(f"{func}: the pieces must share class, quantizer, dtype, tags, "
                             f"trailing shape and present buffers; got {first!r} and {t!r}")
    shape = (sum(t.shape[0] for t in tensors), *first.shape[1:])
    layout, bufs = first._layout(), {}
    if first.dim() == 1:
        layout = {n: (None if n == "_scale_inv" else ("2d", 0, 1, 1)) for n in layout}
    m, _ = m_k(shape)
    for t in tensors[:-1]:
        rows, block = m_k(t.shape)[0] if t.dim() > 1 else 1, t._piece_rows()
        if rows % block:
            raise NotImplementedError(f"{func} of {type(t).__name__}: every piece but the last "
                                      f"must hold a multiple of {block} rows, got {rows}")
    for name, buf in first.buffers().items():
        spec = layout[name]
        if buf is None:
            bufs[name] = None
        elif spec is None:
            _check_shared(func, name, tensors)
            bufs[name] = buf
        else:
            nd, axis, unit, pad = spec
            parts = []
            for t in tensors:
                mt = m_k(t.shape)[0] if t.dim() > 1 else t.shape[0]
                part = _as_2d(getattr(t, name), nd, mt)
                parts.append(part.narrow(axis, 0, ceil_div(mt, unit)))
            whole = _padded(torch.cat(parts, axis), axis, roundup(ceil_div(m, unit), pad))
            bufs[name] = _nd_shaped(whole, nd, shape)
    return _like(first, shape, bufs)


def _check_shared(func, name: str, tensors) -> None:
    """The per-tensor buffers (FP8 scale, NVFP4 amaxes) must agree across the pieces (checked
    in eager mode; a traced graph cannot branch on data)."""
    first = getattr(tensors[0], name)
    if traced(first):
        return
    for t in tensors[1:]:
        if not torch.equal(getattr(t, name), first):
            raise ValueError(f"{func}: the pieces' {name} differ; pieces of one quantized "
                             "tensor share it (concatenate the dequantized tensors instead)")


OPS.update({
    aten.detach.default: _detach,
    aten.alias.default: _detach,
    aten.view.default: _view,
    aten._unsafe_view.default: _view,
    aten.as_strided.default: _as_strided,
    aten.reshape.default: _view,
    aten.t.default: _transpose,
    aten.transpose.int: _transpose,
    aten.permute.default: _permute,
    aten._to_copy.default: _to_copy,
    aten.copy_.default: _copy_,
    aten.empty_like.default: _make_empty,
    aten.zeros_like.default: _make_empty,
    aten.new_empty.default: _make_empty,
    aten.new_zeros.default: _make_empty,
    aten.clone.default: _clone,
    aten.is_same_size.default: _is_same_size,
    aten.split.Tensor: _split,
    aten.split_with_sizes.default: _split_sizes,
    aten.slice.Tensor: _slice,
    aten.narrow.default: _narrow,
    aten.cat.default: _cat,
})
