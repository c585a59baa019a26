"""Quantized tensors: ``torch.Tensor`` wrapper subclasses around the four storages (DESIGN
contract 7, `behaviour.md` §1.5).

``Float8Tensor``, ``MXFP8Tensor``, ``Float8BlockwiseQTensor`` and ``NVFP4Tensor`` are each a
wrapper subclass *and* their storage (multiple inheritance): the tensor reports the logical
shape, the nominal high-precision dtype and the buffers' device, and every storage API
(``buffers``, ``buffer_list``, ``dequantize``, ``gemm_operand``, ``update_usage``, the ``_data``
... attributes, ``quantizer``) works unchanged. ``quantize`` returns one when the quantizer's
``internal`` is False.

``__tensor_flatten__`` returns the names of the present buffers and a :class:`TensorContext`
holding the quantizer (a value quantizer compares by value, a stateful one by identity and is
never copied), the shape, the nominal dtype and the storage tags; a quantizer holding a stored
``amax_reduction_group`` is refused there. ``__torch_dispatch__`` implements the ops of
:data:`OPS` (the op table, documented in `behaviour.md` §1.5); any other op raises
``NotImplementedError`` naming the op and the class.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch

from . import backends
from .shapes import ceil_div, m_k, roundup
from .storage import (
    Float8BlockwiseQTensorStorage,
    Float8TensorStorage,
    MXFP8TensorStorage,
    NVFP4TensorStorage,
    QuantizedStorage,
)

aten = torch.ops.aten


class TensorContext:
    """The ``__tensor_flatten__`` context: quantizer, shape, nominal dtype and storage tags.

    Equality compares the quantizer with ``==`` (value quantizers by value, stateful ones by
    identity), the dtype and the tags; ``shape`` is carried for ``__tensor_unflatten__`` without
    an ``outer_size`` and compared only by :meth:`QuantizedTensor.__metadata_guard__`'s caller
    through the tensor's own size guards. ``deepcopy`` returns the same object (it is immutable),
    so Dynamo's guard never copies a stateful quantizer.
    """

    __slots__ = ("quantizer", "shape", "dtype", "tags")

    def __init__(self, quantizer, shape: tuple[int, ...], dtype: torch.dtype,
                 tags: tuple[tuple[str, Any], ...]) -> None:
        self.quantizer, self.shape, self.dtype, self.tags = quantizer, shape, dtype, tags

    def _key(self) -> tuple:
        return (self.quantizer, self.dtype, self.tags)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, TensorContext) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __deepcopy__(self, memo: dict) -> TensorContext:
        return self

    def __repr__(self) -> str:
        return (f"TensorContext(quantizer={self.quantizer!r}, shape={self.shape}, "
                f"dtype={self.dtype}, tags={self.tags})")


def _traced(t: torch.Tensor) -> bool:
    """Whether ``t`` is a fake or functional tensor (``torch.compile`` is tracing)."""
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(t) or torch._is_functional_tensor(t)


class QuantizedTensor(torch.Tensor):
    """Base of the quantized tensor subclasses (one per storage class, :data:`TENSOR_CLASSES`).

    Built with ``torch.Tensor._make_wrapper_subclass``: the logical shape, the nominal dtype,
    the device of the buffers and ``requires_grad`` as given; the buffers, tags and quantizer are
    plain attributes, as on the storage. The storage's ``__init__`` is never called.
    """

    #: The storage class this tensor class also is.
    _storage_type: ClassVar[type[QuantizedStorage]]
    #: Rows of the 2D view ``[M, K]`` a piece must start at (and span, but for the last piece)
    #: for ``split``/``cat`` along dim 0 to give the bytes of quantizing the piece.
    _row_block: ClassVar[int] = 1

    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, shape, dtype: torch.dtype, *, quantizer, buffers: dict[str, Any],
                tags: dict[str, Any], requires_grad: bool = False, device=None):
        if device is None:
            device = next(t.device for t in buffers.values() if t is not None)
        self = torch.Tensor._make_wrapper_subclass(
            cls, shape, dtype=dtype, device=device, requires_grad=requires_grad
        )
        self._dtype = dtype
        self.quantizer = quantizer
        for name in cls._storage_type._buffer_names:
            setattr(self, name, buffers.get(name))
        for name in cls._storage_type._tag_names:
            setattr(self, name, tags.get(name))
        return self

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        """Everything is set in ``__new__`` (the storage's ``__init__`` would set ``shape``)."""

    # ------------------------------------------------------------------ storage interface
    @staticmethod
    def from_storage(storage: QuantizedStorage, *, requires_grad: bool = False
                     ) -> QuantizedTensor:
        """The tensor of ``storage``'s format sharing its buffers, tags and quantizer (no copy).
        ``TypeError`` for a storage class without a tensor class."""
        cls = tensor_class(type(storage))
        return cls(storage.shape, storage.dtype, quantizer=storage.quantizer,
                   buffers=storage.buffers(), tags=_tags_of(storage),
                   requires_grad=requires_grad)

    def as_storage(self) -> QuantizedStorage:
        """A plain storage object with the same buffers, tags and quantizer (no copy)."""
        return self._storage_type(shape=self.shape, dtype=self._dtype, quantizer=self.quantizer,
                                  **self.buffers(), **_tags_of(self))

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The storage's ``dequantize`` (a plain tensor). With ``requires_grad`` (a quantized
        parameter) the gradient passes straight through to this tensor."""
        if self.requires_grad and torch.is_grad_enabled():
            return _Dequantize.apply(self, dtype)
        return self._storage_type.dequantize(self, dtype)

    def _backend(self):
        # traced buffers (fake/functional) take the pure-torch reference, which traces; every
        # backend produces its bytes (contract 3)
        if any(_traced(t) for t in self.buffers().values() if t is not None):
            return backends.get("reference", self.device)
        return backends.get(None, self.device)

    def __repr__(self, *, tensor_contents=None) -> str:
        present = [n for n, t in self.buffers().items() if t is not None]
        grad = ", requires_grad=True" if self.requires_grad else ""
        return (f"{type(self).__name__}(shape={tuple(self.shape)}, dtype={self._dtype}, "
                f"buffers={present}, quantizer={self.quantizer!r}{grad})")

    # ------------------------------------------------------------------ traceable subclass
    def __tensor_flatten__(self) -> tuple[list[str], TensorContext]:
        """``(names of the present buffers, TensorContext)``; ``TypeError`` for a quantizer
        holding a stored ``amax_reduction_group`` (it must never reach a compiled graph)."""
        check = getattr(self.quantizer, "_check_value_has_no_process_group", None)
        if check is not None:
            check()
        names = [n for n in self._storage_type._buffer_names if getattr(self, n) is not None]
        tags = tuple(_tags_of(self).items())
        return names, TensorContext(self.quantizer, tuple(self.shape), self._dtype, tags)

    @classmethod
    def __tensor_unflatten__(cls, inner: dict[str, torch.Tensor], ctx: TensorContext,
                             outer_size=None, outer_stride=None) -> QuantizedTensor:
        shape = ctx.shape if outer_size is None else outer_size
        return cls(shape, ctx.dtype, quantizer=ctx.quantizer, buffers=inner, tags=dict(ctx.tags))

    @classmethod
    def __metadata_guard__(cls, orig: TensorContext, other: TensorContext) -> bool:
        """Dynamo's guard on the context: the quantizer's value, dtype and tags (shapes are
        guarded on the tensor itself)."""
        return orig == other

    def __reduce_ex__(self, protocol):
        return (_rebuild, (type(self), tuple(self.shape), self._dtype, self.quantizer,
                           self.buffers(), _tags_of(self), self.requires_grad))

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        handler = OPS.get(func) or OPS.get(func.overloadpacket)
        if handler is None:
            name = next((type(a).__name__ for a in _flat(args) if isinstance(a, QuantizedTensor)),
                        cls.__name__)
            raise NotImplementedError(
                f"{name} does not support {func}: a quantized tensor implements "
                f"{', '.join(sorted(_OP_NAMES))}; call .dequantize() for a high-precision "
                "tensor first"
            )
        return handler(func, *args, **(kwargs or {}))

    # ------------------------------------------------------------------ layout (per format)
    def _layout(self) -> dict[str, tuple[str, int, int, int] | None]:
        """``{buffer: (nd, axis, unit, pad)}``: how the rows of the 2D view run through each
        buffer. ``nd`` is "rows" (``[*lead, n]``, viewed ``[M, n]``), "cols_t" (``[K, *lead]``,
        viewed ``[K, M]``) or "2d"; ``axis`` of that 2D view holds ``unit`` rows per index and
        is padded to a multiple of ``pad``. ``None``: shared by every row (per-tensor)."""
        raise NotImplementedError

    def _split_refusal(self) -> str | None:
        """Why this tensor cannot be split or concatenated along dim 0 at all (else None)."""
        return None


class _Dequantize(torch.autograd.Function):
    """``dequantize`` of a tensor that requires grad: the gradient passes straight through."""

    @staticmethod
    def forward(ctx, t, dtype):
        return t._storage_type.dequantize(t, dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _rebuild(cls, shape, dtype, quantizer, buffers, tags, requires_grad):
    """Unpickle a quantized tensor (``__reduce_ex__``)."""
    return cls(torch.Size(shape), dtype, quantizer=quantizer, buffers=buffers, tags=tags,
               requires_grad=requires_grad)


def _tags_of(obj) -> dict[str, Any]:
    return {name: getattr(obj, name) for name in type(obj)._tag_names}


def _flat(args):
    for a in args:
        if isinstance(a, (list, tuple)):
            yield from a
        else:
            yield a


# ---------------------------------------------------------------------- the four formats
class Float8Tensor(QuantizedTensor, Float8TensorStorage):
    """Per-tensor FP8 (current or delayed scaling) as a tensor."""

    _storage_type = Float8TensorStorage

    def _layout(self):
        return {"_data": ("rows", 0, 1, 1), "_transpose": ("cols_t", 1, 1, 1),
                "_scale_inv": None}


class MXFP8Tensor(QuantizedTensor, MXFP8TensorStorage):
    """MXFP8 as a tensor."""

    _storage_type = MXFP8TensorStorage
    _row_block = 32

    def _layout(self):
        return {"_rowwise_data": ("rows", 0, 1, 1), "_rowwise_scale_inv": ("2d", 0, 1, 128),
                "_columnwise_data": ("rows", 0, 1, 1),
                "_columnwise_scale_inv": ("2d", 0, 32, 4)}

    def _split_refusal(self):
        return _swizzle_refusal(self)


class Float8BlockwiseQTensor(QuantizedTensor, Float8BlockwiseQTensorStorage):
    """FP8 1x128 / 128x128 blocks as a tensor."""

    _storage_type = Float8BlockwiseQTensorStorage
    _row_block = 128

    def _layout(self):
        if self._is_2D_scaled:
            return {"_rowwise_data": ("rows", 0, 1, 1), "_rowwise_scale_inv": ("2d", 0, 128, 1),
                    "_columnwise_data": ("cols_t", 1, 1, 1),
                    "_columnwise_scale_inv": ("2d", 1, 128, 4)}
        return {"_rowwise_data": ("rows", 0, 1, 1), "_rowwise_scale_inv": ("2d", 1, 1, 4),
                "_columnwise_data": ("cols_t", 1, 1, 1),
                "_columnwise_scale_inv": ("2d", 0, 128, 1)}


class NVFP4Tensor(QuantizedTensor, NVFP4TensorStorage):
    """NVFP4 as a tensor (the per-tensor amaxes are shared by every piece of a split)."""

    _storage_type = NVFP4TensorStorage
    _row_block = 16

    def _layout(self):
        return {"_rowwise_data": ("rows", 0, 1, 1), "_rowwise_scale_inv": ("2d", 0, 1, 128),
                "_columnwise_data": ("2d", 1, 2, 1), "_columnwise_scale_inv": ("2d", 1, 16, 4),
                "_amax_rowwise": None, "_amax_columnwise": None}

    def _split_refusal(self):
        return _swizzle_refusal(self)


def _swizzle_refusal(t) -> str | None:
    if t._with_gemm_swizzled_scales:
        return "its scales are GEMM-swizzled in 128x4 tiles (quantize with optimize_for_gemm=False)"
    return None


#: storage class -> tensor class.
TENSOR_CLASSES: dict[type, type[QuantizedTensor]] = {
    Float8TensorStorage: Float8Tensor,
    MXFP8TensorStorage: MXFP8Tensor,
    Float8BlockwiseQTensorStorage: Float8BlockwiseQTensor,
    NVFP4TensorStorage: NVFP4Tensor,
}


def tensor_class(storage_class: type) -> type[QuantizedTensor]:
    """The tensor class of ``storage_class`` (or of a tensor class itself); ``TypeError`` if
    the format has none."""
    for klass in storage_class.__mro__:
        if klass in TENSOR_CLASSES:
            return TENSOR_CLASSES[klass]
    raise TypeError(f"{storage_class.__name__} has no quantized tensor class; known storages: "
                    f"{[c.__name__ for c in TENSOR_CLASSES]}")


def wrap(storage: QuantizedStorage) -> QuantizedStorage:
    """``storage`` as its tensor class if it is not one already and its format has one."""
    if isinstance(storage, QuantizedTensor):
        return storage
    for klass in type(storage).__mro__:
        if klass in TENSOR_CLASSES:
            return QuantizedTensor.from_storage(storage)
    return storage


# ---------------------------------------------------------------------- the op table
def _like(t: QuantizedTensor, shape=None, buffers=None, *, quantizer=None) -> QuantizedTensor:
    """A tensor of ``t``'s class and tags with ``shape`` and ``buffers`` (default: ``t``'s)."""
    return type(t)(t.shape if shape is None else shape, t._dtype,
                   quantizer=t.quantizer if quantizer is None else quantizer,
                   buffers=t.buffers() if buffers is None else buffers, tags=_tags_of(t))


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
    if isinstance(t, Float8Tensor) and t._transpose is None and len(shape):
        return _like(t, shape, {**t.buffers(), "_data": None if t._data is None
                                else t._data.view(shape)})
    raise NotImplementedError(
        f"{func} of {type(t).__name__} from {tuple(t.shape)} to {tuple(shape)}: a view must keep "
        "the last dimension (the block axis); only a Float8Tensor without its transpose "
        "(update_usage(columnwise=False)) views freely. Call .dequantize() first."
    )


def _transpose(func, t, *dims):
    if t.dim() < 2:
        return _like(t)
    d0, d1 = ((0, 1) if not dims else (dims[0] % t.dim(), dims[1] % t.dim()))
    if t.dim() != 2 or d0 == d1:
        if d0 == d1:
            return _like(t)
        raise NotImplementedError(f"{func} of {type(t).__name__}: only 2D tensors transpose")
    if not isinstance(t, Float8Tensor):
        raise NotImplementedError(
            f"{func} of {type(t).__name__}: its columnwise buffers are not the rowwise layout "
            "of the transpose (only Float8Tensor, one scale for the whole tensor, swaps its "
            "rowwise and columnwise data exactly); call .dequantize() first, or quantize the "
            "transpose"
        )
    return _like(t, (t.shape[1], t.shape[0]), {**t.buffers(), "_data": t._transpose,
                                               "_transpose": t._data})


def _permute(func, t, dims):
    dims = [d % max(t.dim(), 1) for d in dims]
    if dims == sorted(dims):
        return _like(t)
    return _transpose(func, t, *dims[:2]) if len(dims) == 2 else _transpose(func, t, 0, 2)


def _to_copy(func, t, *, dtype=None, device=None, **kwargs):
    device = t.device if device is None else torch.device(device)
    if (dtype is None or dtype == t._dtype) and device != t.device:
        moved = {n: None if b is None else b.to(device) for n, b in t.buffers().items()}
        return type(t)(t.shape, t._dtype, quantizer=t.quantizer, buffers=moved,
                       tags=_tags_of(t), device=device)
    return t._storage_type.dequantize(t, dtype).to(device)


def _buffers_like_quantized(dst: QuantizedTensor, src) -> dict[str, torch.Tensor]:
    """The buffers of ``src`` (quantized to ``dst``'s format) for each buffer ``dst`` holds."""
    if isinstance(src, QuantizedTensor) and type(src) is type(dst) and (
        src.quantizer == dst.quantizer and _tags_of(src) == _tags_of(dst)
    ) and all((getattr(src, n) is None) == (b is None) for n, b in dst.buffers().items()):
        return src.buffers()
    if isinstance(src, QuantizedTensor):
        src = src._storage_type.dequantize(src, dst._dtype)
    new = dst.quantizer.quantize(src.to(device=dst.device, dtype=dst._dtype))
    if isinstance(dst, Float8Tensor) and dst._transpose is not None and new._transpose is None:
        new.update_usage(columnwise=True)  # the exact byte transpose
    return new.buffers()


def _copy_(func, dst, src, non_blocking=False):
    if not isinstance(dst, QuantizedTensor):  # a high-precision destination: dequantize
        return dst.copy_(src._storage_type.dequantize(src, dst.dtype if dst.dtype.is_floating_point
                                                      else None))
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
    })


def _is_same_size(func, a, b):
    return tuple(a.shape) == tuple(b.shape)


# ---------------------------------------------------------------------- split / cat (dim 0)
def _check_dim0(func, t, dim) -> None:
    if dim % max(t.dim(), 1) != 0:
        raise NotImplementedError(f"{func} of {type(t).__name__} along dim {dim}: quantized "
                                  "tensors split and concatenate along dim 0 only")
    why = t._split_refusal()
    if why is None and t.dim() == 1 and not isinstance(t, Float8Tensor):
        why = "dim 0 of a 1D tensor is its block axis"
    if why is not None:
        raise NotImplementedError(f"{func} of {type(t).__name__}: {why}; call .dequantize() "
                                  "first")


def _row_block(t: QuantizedTensor) -> int:
    if isinstance(t, Float8BlockwiseQTensor) and not t._is_2D_scaled and (
        t._columnwise_data is None
    ):
        return 1  # 1x128 rowwise blocks: any row
    return t._row_block


def _as_2d(buf: torch.Tensor, nd: str, m: int) -> torch.Tensor:
    if nd == "rows":
        return buf.reshape(m, buf.shape[-1])
    if nd == "cols_t":
        return buf.reshape(buf.shape[0], m)
    return buf


def _padded(piece: torch.Tensor, axis: int, length: int) -> torch.Tensor:
    """``piece`` zero-padded along ``axis`` to ``length`` (itself when already that long)."""
    if piece.shape[axis] == length:
        return piece
    shape = list(piece.shape)
    shape[axis] = length
    out = piece.new_zeros(shape)
    out.narrow(axis, 0, piece.shape[axis]).copy_(piece)
    return out


def _rows(func, t: QuantizedTensor, start: int, end: int) -> QuantizedTensor:
    """Rows ``start:end`` of dim 0: buffers are views of ``t``'s, scales re-padded (copies)
    where the piece's padding differs."""
    shape = (end - start, *t.shape[1:])
    if t.dim() == 1:  # Float8Tensor only: per-tensor scale, both buffers are [K]
        return _like(t, shape, {n: None if b is None else (b if n == "_scale_inv"
                                                           else b[start:end])
                                for n, b in t.buffers().items()})
    inner = math.prod(t.shape[1:-1])
    m, _ = m_k(t.shape)
    r0, r1 = start * inner, end * inner
    block = _row_block(t)
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
        piece = _padded(_as_2d(buf, nd, m).narrow(axis, lo, hi - lo), axis, roundup(hi - lo, pad))
        bufs[name] = _nd_shaped(piece, nd, shape)
    return _like(t, shape, bufs)


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
            _tags_of(t) != _tags_of(first) or t._dtype != first._dtype
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
        rows, block = m_k(t.shape)[0] if t.dim() > 1 else 1, _row_block(t)
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
    if _traced(first):
        return
    for t in tensors[1:]:
        if not torch.equal(getattr(t, name), first):
            raise ValueError(f"{func}: the pieces' {name} differ; pieces of one quantized "
                             "tensor share it (concatenate the dequantized tensors instead)")


#: The op table: aten op (overload or packet) -> handler(func, *args, **kwargs).
OPS: dict[Any, Any] = {
    aten.detach.default: _detach,
    aten.alias.default: _detach,
    aten.view.default: _view,
    aten._unsafe_view.default: _view,
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
}
_OP_NAMES = {str(op) for op in OPS}


__all__ = [
    "QuantizedTensor", "Float8Tensor", "MXFP8Tensor", "Float8BlockwiseQTensor", "NVFP4Tensor",
    "TENSOR_CLASSES", "TensorContext", "tensor_class", "wrap", "OPS",
]
