"""Quantized tensors: the ``torch.Tensor`` wrapper subclass base of the format storages
(`behaviour.md` §1.5).

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
:data:`OPS` (the op table, `behaviour.md` §1.5); any other op raises
``NotImplementedError`` naming the op and the class. The table lives here, empty, and
:mod:`quant_core.tensor_ops` fills it (:func:`implements`); each format's tensor subclass
registers itself as its storage's ``tensor_class``.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from . import backends
from .storage import QuantizedStorage, storage_class, storage_formats

aten = torch.ops.aten

#: The op table: aten op (overload or packet) -> handler(func, *args, **kwargs), filled by
#: :func:`implements` (:mod:`quant_core.tensor_ops`).
OPS: dict[Any, Any] = {}

#: Said when a quantized tensor refuses to be flattened or cut into a flat piece: the wrappers
#: that do this to every parameter (bucketing, sharding) are the usual callers.
FLATTEN_HINT = (
    "If this is a quantized parameter (quantized_model_init): DistributedDataParallel and FSDP2's "
    "fully_shard flatten and shard parameters, which quantized parameters do not support. Keep "
    "the parameters in high precision for them; under FSDP2, "
    "quant_recipes.enable_fsdp_quantized_all_gather(model, recipe) before fully_shard still "
    "all-gathers the weights quantized."
)

#: The attribute holding a high-precision value preserved beside a quantized tensor (the
#: initial value of a ``quantized_model_init`` parameter).
HIGH_PRECISION_VALUE = "_high_precision_init_val"


def implements(*funcs):
    """Register the decorated ``handler(func, *args, **kwargs)`` for each aten op in ``funcs``."""
    def register(handler):
        for func in funcs:
            OPS[func] = handler
        return handler

    return register


def forget_high_precision_value(t: torch.Tensor) -> None:
    """Drop the high-precision value preserved beside a quantized tensor once its bytes change:
    it no longer describes them, and whatever starts from it (master weights) would discard the
    new value."""
    t.__dict__.pop(HIGH_PRECISION_VALUE, None)


class TensorContext:
    """The ``__tensor_flatten__`` context: quantizer, shape, nominal dtype and storage tags.

    Equality (what Dynamo's guard on the context tests) compares the quantizer with ``==``
    (value quantizers by value, stateful ones by identity), the dtype and the tags. ``shape`` is
    only carried for ``__tensor_unflatten__`` without an ``outer_size``: Dynamo guards shapes on
    the tensor itself, so ``dynamic=True`` keeps them symbolic. ``deepcopy`` returns the same
    object (it is immutable), so the guard never copies a stateful quantizer.
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


def traced(t: torch.Tensor) -> bool:
    """Whether ``t`` is a fake or functional tensor (``torch.compile`` is tracing)."""
    from torch._subclasses.fake_tensor import is_fake

    return is_fake(t) or torch._is_functional_tensor(t)


class QuantizedTensor(torch.Tensor):
    """Base of the quantized tensor subclasses (one per format that has one: its storage's
    ``tensor_class``).

    Built with ``torch.Tensor._make_wrapper_subclass``: the logical shape, the nominal dtype,
    the device of the buffers and ``requires_grad`` as given; the buffers, tags and quantizer are
    plain attributes, as on the storage. The storage's ``__init__`` is never called.
    """

    #: The storage class this tensor class also is; defining the subclass makes it that
    #: storage's ``tensor_class``.
    _storage_type: ClassVar[type[QuantizedStorage]]
    #: Rows of the 2D view ``[M, K]`` a piece must start at (and span, but for the last piece)
    #: for ``split``/``cat`` along dim 0 to give the bytes of quantizing the piece.
    _row_block: ClassVar[int] = 1

    __torch_function__ = torch._C._disabled_torch_function_impl

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        storage = cls.__dict__.get("_storage_type")
        if storage is not None:
            storage.tensor_class = cls

    @staticmethod
    def __new__(cls, shape, dtype: torch.dtype, *, quantizer, buffers: dict[str, Any],
                tags, requires_grad: bool = False, device=None):
        """``tags``: a dict or ``(name, value)`` pairs. Traced code passes pairs: a graph that
        builds the tensor writes its arguments as Python source, and a tuple of pairs is written
        with its enum members by name (a dict only by ``repr``, which is not source)."""
        tags = dict(tags)
        if device is None:
            device = next(t.device for t in buffers.values() if t is not None)
        self = torch.Tensor._make_wrapper_subclass(
            cls, shape, dtype=dtype, device=device, requires_grad=requires_grad
        )
        self._dtype = dtype
        self.quantizer = quantizer
        for name in cls._storage_type.buffer_names:
            setattr(self, name, buffers.get(name))
        for name in cls._storage_type.tag_names:
            setattr(self, name, tags.get(name, cls._storage_type.tag_defaults.get(name)))
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
                   buffers=storage.buffers(), tags=tags_of(storage),
                   requires_grad=requires_grad)

    def as_storage(self) -> QuantizedStorage:
        """A plain storage object with the same buffers, tags and quantizer (no copy)."""
        return self._storage_type(shape=self.shape, dtype=self._dtype, quantizer=self.quantizer,
                                  **self.buffers(), **tags_of(self))

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The storage's ``dequantize`` (a plain tensor). With ``requires_grad`` (a quantized
        parameter) the gradient passes straight through to this tensor."""
        if self.requires_grad and torch.is_grad_enabled():
            return _Dequantize.apply(self, dtype)
        return self._storage_type.dequantize(self, dtype)

    # ------------------------------------------------------------------ ``.data``
    @property
    def data(self) -> QuantizedTensor:
        """A detached tensor over the same buffers (as ``torch.Tensor.data``)."""
        return torch._C.TensorBase.data.__get__(self)

    @data.setter
    def data(self, value: torch.Tensor) -> None:
        """Replace what this tensor holds, in place (``param.data = new``, and how
        ``Module.to``/``half()`` convert parameters): a quantized tensor of this class is adopted
        as it is (buffers, quantizer, tags, nominal dtype); this tensor's own dequantization
        (``self.to(dtype)``) changes only the nominal dtype, keeping the bytes; any other
        high-precision tensor is quantized with this tensor's quantizer. The shape must stay.
        A preserved high-precision value is dropped. (``torch.Tensor``'s own setter would swap
        the tensor underneath and leave the quantized buffers stale.)"""
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{type(self).__name__}.data must be a tensor, got "
                            f"{type(value).__name__}")
        if tuple(value.shape) != tuple(self.shape):
            raise ValueError(f"{type(self).__name__}.data = a tensor of shape "
                             f"{tuple(value.shape)}: a quantized tensor keeps its shape "
                             f"{tuple(self.shape)}")
        if isinstance(value, QuantizedTensor):
            if type(value) is not type(self):
                raise TypeError(f"{type(self).__name__}.data = a {type(value).__name__}: "
                                "assign a tensor of the same format, or a high-precision "
                                "tensor to quantize")
            new = value
        elif _dequantization_of(value) is self:
            new = type(self)(self.shape, value.dtype, quantizer=self.quantizer,
                             buffers=self.buffers(), tags=tags_of(self))
        else:
            new = self.quantizer.quantize(value.detach())
            if not isinstance(new, QuantizedTensor):  # an internal quantizer gives a storage
                new = QuantizedTensor.from_storage(new)
        torch._C.TensorBase.data.__set__(self, new)  # the wrapper's dtype and device
        self._dtype = new._dtype
        self.quantizer = new.quantizer
        for name in self._storage_type.buffer_names:
            setattr(self, name, getattr(new, name))
        for name in self._storage_type.tag_names:
            setattr(self, name, getattr(new, name))
        forget_high_precision_value(self)

    def _backend(self):
        # traced buffers (fake/functional) take the pure-torch reference, which traces; every
        # backend produces its bytes (contract 3)
        if any(traced(t) for t in self.buffers().values() if t is not None):
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
        names = [n for n in self._storage_type.buffer_names if getattr(self, n) is not None]
        tags = tuple(tags_of(self).items())
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
                           self.buffers(), tags_of(self), self.requires_grad))

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        return _dispatch(cls, func, args, kwargs or {})

    # ------------------------------------------------------------------ per-format layout
    def _layout(self) -> dict[str, tuple[str, int, int, int] | None]:
        """``{buffer: (nd, axis, unit, pad)}``: how the rows of the 2D view run through each
        buffer. ``nd`` is "rows" (``[*lead, n]``, viewed ``[M, n]``), "cols_t" (``[K, *lead]``,
        viewed ``[K, M]``) or "2d"; ``axis`` of that 2D view holds ``unit`` rows per index and
        is padded to a multiple of ``pad``. ``None``: shared by every row (per-tensor)."""
        raise NotImplementedError

    def _piece_rows(self) -> int:
        """The row block of ``split``/``cat`` along dim 0 for this tensor's buffers."""
        return self._row_block

    def _split_refusal(self) -> str | None:
        """Why this tensor cannot be split or concatenated along dim 0 at all (else None)."""
        return "dim 0 of a 1D tensor is its block axis" if self.dim() == 1 else None

    def _reshaped_buffers(self, shape) -> dict[str, torch.Tensor | None] | None:
        """The buffers viewed for a ``shape`` with another last dimension, where the format
        allows it (one scale, no transposed buffer); else None."""
        return None

    def _transposed_buffers(self) -> dict[str, torch.Tensor | None]:
        """The buffers of the 2D transpose, exactly; ``NotImplementedError`` where the format's
        buffers are not the transpose's layout."""
        raise NotImplementedError(
            f"{type(self).__name__}: its columnwise buffers are not the rowwise layout of the "
            "transpose (only Float8Tensor, one scale for the whole tensor, swaps its rowwise and "
            "columnwise data exactly); call .dequantize() first, or quantize the transpose"
        )


class _Dequantize(torch.autograd.Function):
    """``dequantize`` of a tensor that requires grad: the gradient passes straight through."""

    @staticmethod
    def forward(ctx, t, dtype):
        return t._storage_type.dequantize(t, dtype)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def _dispatch(cls: type, func, args: tuple, kwargs: dict) -> Any:
    """Run ``func`` through :data:`OPS`; ``NotImplementedError`` for an op it lacks or a use it
    refuses (with :data:`FLATTEN_HINT` when the op flattens the tensor)."""
    try:
        handler = OPS.get(func) or OPS.get(func.overloadpacket)
        if handler is None:
            name = next((type(a).__name__ for a in _flat(args)
                         if isinstance(a, QuantizedTensor)), cls.__name__)
            raise NotImplementedError(
                f"{name} does not support {func}: a quantized tensor implements "
                f"{', '.join(sorted(str(op) for op in OPS))}; call .dequantize() for a "
                "high-precision tensor first"
            )
        return handler(func, *args, **kwargs)
    except NotImplementedError as exc:
        if _flattens(func, args, kwargs):
            raise NotImplementedError(f"{exc}\n{FLATTEN_HINT}") from None
        raise


def _flattens(func, args: tuple, kwargs: dict) -> bool:
    """Whether ``func`` views or reshapes a multi-dimensional tensor into one dimension."""
    if func.overloadpacket not in (aten.view, aten._unsafe_view, aten.reshape, aten.as_strided,
                                   aten.flatten):
        return False
    t = args[0] if args else None
    shape = args[1] if len(args) > 1 else kwargs.get("size", kwargs.get("shape"))
    return (isinstance(t, torch.Tensor) and t.dim() > 1
            and (func.overloadpacket is aten.flatten
                 or (isinstance(shape, (list, tuple)) and len(shape) == 1)))


def _flat(args):
    for a in args:
        if isinstance(a, (list, tuple)):
            yield from a
        else:
            yield a


def _rebuild(cls, shape, dtype, quantizer, buffers, tags, requires_grad):
    """Unpickle a quantized tensor (``__reduce_ex__``)."""
    return cls(torch.Size(shape), dtype, quantizer=quantizer, buffers=buffers, tags=tags,
               requires_grad=requires_grad)


def allow_weights_only_load(quantizer_classes, enums, renamed=()) -> None:
    """Let ``torch.load(weights_only=True)``, torch's default since 2.6, rebuild quantized tensors
    made by ``quantizer_classes`` (value quantizers: rebuilt through their constructor from
    primitive fields) with tags of ``enums``; ``renamed``: ``(class, former path)`` pairs a
    pickle may still name. A delayed-scaling quantizer pickles its tensors' state object and
    still needs ``weights_only=False``."""
    from .quantizer import _rebuild_quantizer

    add = getattr(torch.serialization, "add_safe_globals", None)
    if add is not None:
        add([_rebuild, _rebuild_quantizer, *tensor_classes(), *quantizer_classes, *enums,
             *renamed])


def _dequantization_of(t: torch.Tensor):
    """The quantized tensor ``t`` is the unmodified dequantization of (``q.to(dtype)``), else
    None."""
    source = getattr(t, "_dequantized_from", None)
    if source is None or source[1] != t._version:
        return None
    return source[0]()


def tags_of(obj) -> dict[str, Any]:
    return {name: getattr(obj, name) for name in type(obj).tag_names}


def tensor_classes() -> tuple[type[QuantizedTensor], ...]:
    """The tensor class of every registered format that has one."""
    return tuple(c.tensor_class for c in map(storage_class, storage_formats())
                 if c.tensor_class is not None)


def tensor_class(storage_type: type) -> type[QuantizedTensor]:
    """The tensor class of ``storage_type`` (or of a tensor class itself); ``TypeError`` if
    the format has none."""
    cls = getattr(storage_type, "tensor_class", None)
    if cls is None:
        raise TypeError(f"{storage_type.__name__} has no quantized tensor class; formats with "
                        f"one: {[c.__name__ for c in tensor_classes()]}")
    return cls


def wrap(storage: QuantizedStorage) -> QuantizedStorage:
    """``storage`` as its tensor class if it is not one already and its format has one."""
    if isinstance(storage, QuantizedTensor) or type(storage).tensor_class is None:
        return storage
    return QuantizedTensor.from_storage(storage)
