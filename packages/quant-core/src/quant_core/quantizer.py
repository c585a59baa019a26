"""The ``Quantizer`` base and opt-in value identity (`docs/behaviour.md` §1–§3).

Class annotations are the single source of truth for a quantizer's configuration: the four base
fields plus each subclass's own, in MRO order (base first). A class becomes a *value quantizer*
only by decorating it with :func:`value_quantizer`, which validates the fields at class creation,
or by overriding ``_value_fields()`` to name them (TransformerEngine's way, which opts in too).
Value quantizers are immutable, compare and hash by their value key, and can be rebuilt from it
without ``__init__``; every other quantizer (delayed scaling, a user subclass that did not opt in)
keeps identity semantics.
"""

from __future__ import annotations

import enum
import math
import typing
import warnings
from collections.abc import Callable
from typing import Any, ClassVar

import torch

from .inputs import check_shape
from .torch_compat import QuantizerMeta

_PRIMITIVES = (bool, int, float, str)

#: Callbacks run for every value-quantizer class, past and future (quant-dynamo registers here).
_value_class_hooks: list[Callable[[type], None]] = []
#: Every class that opted in, in definition order.
_value_classes: list[type] = []


class Quantizer(metaclass=QuantizerMeta):
    """A builder of quantized tensors, holding configuration only.

    Fields (constructor keywords carry the same names):
        rowwise_usage: produce the rowwise representation (forward GEMM layout).
        columnwise_usage: produce the columnwise representation (wgrad/dgrad layout).
        internal: what ``quantize`` and ``make_empty`` return, as in TransformerEngine: False
            (the default) a quantized tensor, the ``torch.Tensor`` subclass of the format
            (``quant_core.tensor``: ``Float8Tensor``, ``MXFP8Tensor``, ``Float8BlockwiseQTensor``,
            ``NVFP4Tensor``, each also its storage); True the plain storage object, with no
            wrapper to build (what the quantized modules use). A format without a tensor class
            always returns its storage.
        optimize_for_gemm: the result only feeds a GEMM; MXFP8/NVFP4 scales are then swizzled.
    """

    rowwise_usage: bool = True
    columnwise_usage: bool = True
    internal: bool = False
    optimize_for_gemm: bool = False

    #: The storage format this quantizer produces: its ``_storage_class``'s ``format``, set when
    #: the class is created ("high_precision" for a passthrough, which states it). A class
    #: attribute, so code that only sees a compiled graph's opaque wrapper (where ``isinstance``
    #: does not work) can still look the format up (``quant_core.storage.storage_class``).
    storage_format: ClassVar[str | None] = None
    #: The storage class ``quantize`` returns.
    _storage_class: ClassVar[type | None] = None
    #: Capability: ``quantize`` splits around a tensor-wide amax (``local_amax`` then
    #: ``quantize_with_amax``) that may be reduced across ranks in between (current scaling,
    #: NVFP4). The amax has :meth:`amax_numel` elements.
    reduces_amax: ClassVar[bool] = False
    #: Attributes beyond the fields and the base's helpers that traced code reads on this
    #: class's quantizers (quant-dynamo registers them as members with the torch API).
    traced_members: ClassVar[tuple[str, ...]] = ()

    #: Set on a class by :func:`value_quantizer`; they count only where ``_value_owner is cls``,
    #: so a subclass that did not opt in itself inherits them without becoming a value type.
    _value_field_names: ClassVar[tuple[str, ...] | None] = None
    _value_field_types: ClassVar[dict[str, type] | None] = None
    _value_owner: ClassVar[type | None] = None
    #: Every class's annotated fields and their resolved types, computed once at class creation
    #: (plain class attributes, so code traced by Dynamo reads them as constants).
    _field_names: ClassVar[tuple[str, ...]] = ()
    _field_type_hints: ClassVar[dict[str, Any] | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        _record_fields(cls)
        fmt = getattr(cls._storage_class, "format", None)
        if fmt is not None and "storage_format" not in cls.__dict__:
            cls.storage_format = fmt
        if _join_hook_names(cls) and _overridden_value_fields(cls) is not None:
            value_quantizer(cls)  # TransformerEngine's opt-in: an override naming the fields

    def __init__(self, **fields: Any) -> None:
        cls = type(self)
        if cls is Quantizer:
            raise TypeError(
                "Quantizer is the abstract base: build a format's quantizer (Float8Quantizer, "
                "Float8CurrentScalingQuantizer, MXFP8Quantizer, Float8BlockQuantizer, "
                "NVFP4Quantizer) or subclass it"
            )
        names = cls._field_names
        unknown = sorted(set(fields) - set(names))
        if unknown:
            raise TypeError(
                f"{type(self).__name__}() got unexpected keyword(s) {unknown}; "
                f"allowed: {list(names)}"
            )
        hints = cls._field_type_hints if cls._field_type_hints is not None else _field_types(cls)
        for name in names:
            value = fields[name] if name in fields else getattr(cls, name)
            object.__setattr__(self, name, _coerce(cls, name, hints[name], value))
        self._rebuild_derived_state()

    # ----------------------------------------------------------------- value identity
    @classmethod
    def value_fields(cls_or_self) -> tuple[str, ...] | None:
        """Field names of a class that opted in itself; ``None`` (identity semantics) otherwise.

        ``_value_fields`` (TransformerEngine's name) is the same hook: a class overriding either
        name overrides both. A class opts in by overriding it to return its value fields (read
        once, when the class is created, on an instance without state) as well as with
        :func:`value_quantizer`; returning ``None`` keeps identity semantics.
        """
        cls = cls_or_self if isinstance(cls_or_self, type) else type(cls_or_self)
        return cls._value_field_names if cls._value_owner is cls else None

    def _check_value_has_no_process_group(self) -> None:
        """Refuse a stored reduction group: it would compare equal to a groupless quantizer."""
        if getattr(self, "amax_reduction_group", None) is not None:
            raise TypeError(
                f"{type(self).__name__} holds an amax_reduction_group, which is not part of its "
                "value: it cannot be compared, hashed or baked into a compiled graph. Pass the "
                "group per call instead: quantizer.quantize(x, amax_reduction_group=group)."
            )

    def value_key(self) -> tuple[str, tuple[tuple[str, Any], ...]]:
        """``(qualified class name, ((field, value), ...))``; enum members keyed by ``.value``.
        ``_value_key`` (TransformerEngine's name) is the same hook."""
        names = self.value_fields()
        if names is None:
            raise TypeError(
                f"{type(self).__qualname__} is not a value quantizer (decorate it with "
                "@value_quantizer to opt in)"
            )
        self._check_value_has_no_process_group()
        key = self.__dict__.get("_value_key_cache")
        if key is None:  # fields never change after construction: compute once
            key = (type(self).__qualname__, tuple((n, _key_value(getattr(self, n))) for n in names))
            object.__setattr__(self, "_value_key_cache", key)
        return key

    _value_fields = value_fields
    _value_key = value_key

    def __eq__(self, other: object) -> bool:
        if self is other:
            return True
        if type(other) is not type(self) or self.value_fields() is None:
            return NotImplemented
        return self.value_key() == other.value_key()

    def __hash__(self) -> int:
        if self.value_fields() is None:
            return object.__hash__(self)
        return hash(self.value_key())

    def __setattr__(self, name: str, value: Any) -> None:
        if self.value_fields() is not None:
            raise AttributeError(
                f"{type(self).__name__} is an immutable value object (a compiled graph keeps a "
                f"reference to it and would silently go stale); instead of setting {name!r} use "
                f"q.replace({name}=...) or q.with_usage(rowwise=..., columnwise=...), which "
                "return new quantizers"
            )
        object.__setattr__(self, name, value)

    def __delattr__(self, name: str) -> None:
        if self.value_fields() is not None:
            raise AttributeError(f"{type(self).__name__} is immutable; cannot delete {name!r}")
        object.__delattr__(self, name)

    def __repr__(self) -> str:
        names = type(self)._field_names
        body = ", ".join(f"{n}={_field_repr(getattr(self, n, None))}" for n in names)
        return f"{type(self).__name__}({body})"

    def __reduce__(self):
        if self.value_fields() is None:
            return object.__reduce__(self)
        return (_rebuild_quantizer, (type(self), self.value_key()[1]))

    # ------------------------------------------------------------------ derived objects
    def _fields_dict(self) -> dict[str, Any]:
        return {n: getattr(self, n) for n in type(self)._field_names}

    def replace(self, **fields: Any) -> Quantizer:
        """A new quantizer of the same class with ``fields`` changed (value quantizers only)."""
        if self.value_fields() is None:
            raise TypeError(f"{type(self).__name__} is not a value quantizer; use copy()")
        return type(self)(**{**self._fields_dict(), **fields})

    def with_usage(self, rowwise: bool | None = None, columnwise: bool | None = None) -> Quantizer:
        """A new quantizer with the usage flags changed (``None`` keeps a flag)."""
        changes = {}
        if rowwise is not None:
            changes["rowwise_usage"] = rowwise
        if columnwise is not None:
            changes["columnwise_usage"] = columnwise
        return self.replace(**changes) if changes else self

    def derive(self, **fields: Any) -> Quantizer:
        """A quantizer like this one with ``fields`` changed: :meth:`replace` for a value
        quantizer. An identity quantizer returns itself (a user quantizer is used as given)
        unless its class knows how to rebuild itself sharing its live state."""
        return self.replace(**fields) if self.value_fields() is not None else self

    def get_usages(self) -> dict[str, bool]:
        return {"rowwise": self.rowwise_usage, "columnwise": self.columnwise_usage}

    def copy(self) -> Quantizer:
        """An equal, distinct quantizer (a non-value attribute such as a group is not carried)."""
        return type(self)(**self._fields_dict())

    def _rebuild_derived_state(self) -> None:
        """Rebuild non-value attributes from the fields (after ``__init__`` and reconstruction)."""

    # ------------------------------------------------------------------ allocation
    def inner_tensor_specs(self, shape) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """``{buffer: (shape, dtype)}`` of every buffer ``quantize`` produces for an input of
        ``shape`` with this quantizer's usages, in the storage's declaration order (absent
        directions omitted). The one allocation path: ``quantize``, ``make_empty`` and the custom
        ops' fake kernels all use it."""
        raise NotImplementedError(f"{type(self).__name__} does not describe its buffers")

    def _storage_tags(self) -> dict[str, Any]:
        """The storage's non-tensor tags (format dtype, layout flags)."""
        return {}

    def _cached_specs(self, shape: torch.Size):
        """:meth:`inner_tensor_specs` of a value quantizer, computed once per (quantizer, shape);
        ``None`` for an identity quantizer or a symbolic shape (traced code), never cached."""
        if self.value_fields() is None:
            return None
        try:
            key = (self, tuple(shape))
            specs = _SPECS.get(key)
        except TypeError:  # a SymInt dim is unhashable
            return None
        if specs is None:
            if len(_SPECS) >= _MAX_CACHED_SPECS:
                _SPECS.clear()
            specs = _SPECS[key] = self.inner_tensor_specs(shape)
        return specs

    def _make_storage(self, shape, dtype: torch.dtype, buffers: dict[str, torch.Tensor]):
        """The storage for an input of ``shape``/``dtype``; each buffer of
        :meth:`inner_tensor_specs` is taken from ``buffers``, viewed in its spec shape."""
        shape = shape if type(shape) is torch.Size else torch.Size(shape)
        specs = self._cached_specs(shape)
        concrete = specs is not None  # then a buffer already in its spec shape needs no view
        present = {}
        for name, (spec_shape, _) in (specs or self.inner_tensor_specs(shape)).items():
            buf = buffers[name]
            present[name] = buf if concrete and buf.shape == spec_shape else buf.view(spec_shape)
        tensor_class = self._storage_class.tensor_class
        if self.internal or tensor_class is None:
            return self._storage_class(
                shape=shape, dtype=dtype, quantizer=self, **self._storage_tags(), **present
            )
        return tensor_class(
            shape, dtype, quantizer=self, buffers=present,
            tags=tuple(self._storage_tags().items()),
        )

    def alloc_tensors(self, shape, device=None) -> dict[str, torch.Tensor]:
        """Zero-filled buffers per :meth:`inner_tensor_specs` (FakeTensors under fake mode)."""
        return {
            name: torch.zeros(s, dtype=d, device=device)
            for name, (s, d) in self.inner_tensor_specs(shape).items()
        }

    def shape_rule(self) -> tuple[str, int]:
        """``(format name, K multiple)``: the shape rule of ``quantize`` and ``make_empty``."""
        return type(self).__name__, 1

    def check_columnwise_input(self, x: torch.Tensor) -> None:
        """``ValueError`` unless a columnwise copy of the 2D input ``x [M, K]`` can be made, beyond
        :meth:`shape_rule` (its dtype, its rows): asked before quantizing, e.g. by a layer in
        forward for its backward's operands. The base takes every input."""

    def row_alignment(self) -> int:
        """The row count that closes this format's blocks along the rows (the columnwise
        direction's, and the fast GEMMs' row multiple): a caller that pads rows (a grouped GEMM
        padding each group) pads to a multiple of it. 16 for per-element scales, cuBLAS's row
        multiple."""
        return 16

    def make_empty(self, shape, *, dtype: torch.dtype = torch.float32, device=None):
        """What ``quantize`` returns (a quantized tensor, or with ``internal=True`` a storage) with
        exactly the buffers, shapes and dtypes it would produce for an input of ``shape`` and
        ``dtype``; every byte (padding included) is zero. Shapes that
        ``quantize`` refuses are refused here too, with the same message."""
        check_shape(shape, *self.shape_rule())
        return self._make_storage(shape, dtype, self.alloc_tensors(shape, device))

    # ------------------------------------------------------------------ the work
    def quantize(self, x: torch.Tensor, *, amax_reduction_group=None, backend: str | None = None):
        """Quantize ``x``: the format's quantized tensor, or with ``internal=True`` its storage."""
        raise NotImplementedError

    def __call__(self, x: torch.Tensor, **kwargs: Any):
        return self.quantize(x, **kwargs)

    def dequantize(self, storage, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Dequantize a storage this quantizer (or an equal one) produced."""
        return storage.dequantize(dtype=dtype)

    def quantize_decoded(self, x: torch.Tensor, *, rowwise: bool, columnwise: bool,
                         dtype: torch.dtype, rows: torch.Tensor | None = None,
                         backend: str | None = None):
        """``(rowwise values | None, columnwise values | None)`` of 2-D ``x`` in ``dtype``: what
        dequantizing each asked direction of :meth:`quantize` gives, made in one pass that
        writes no quantized bytes, for a consumer of values only (a high-precision GEMM of
        decoded operands); with ``rows`` (int32/int64 ``[P]``), of the tensor made of ``x``'s
        rows in that order, a zero row for each ``rows[p] < 0``. ``None`` where the format has
        no such pass: quantize, then dequantize."""
        return None

    def calibrate(self, x: torch.Tensor) -> None:
        """No-op: only delayed scaling records calibration statistics."""

    def is_requantization_safe(self) -> bool:
        """Whether quantizing the same input twice gives the same bits."""
        return False

    def decodes_exactly_to_bf16(self) -> bool:
        """Whether every value this quantizer's storages decode to (``gemm_value``) is a bf16
        value, so that a bf16 GEMM of the decoded operands multiplies the quantized values
        themselves (with fp32 accumulation: the definition up to the order of the sums)."""
        return False

    def rows_quantize_apart(self) -> bool:
        """Whether a row's rowwise bytes depend on that row alone (rowwise blocks one row tall,
        no tensor-wide amax), so that a caller may quantize rows where they are instead of in a
        padded or gathered copy (a grouped GEMM's input)."""
        return False

    def supports_only_rowwise_all_gather(self) -> bool:
        return False

    def amax_numel(self, rows: int | None = None) -> int:
        """The element count of :meth:`local_amax`'s result for an input of ``rows`` rows (the
        elements before the last dimension; only a format with one amax per row reads it), 0
        without :attr:`reduces_amax`."""
        return 0

    def lowerings(self) -> tuple[str, ...]:
        """The forms in which a compiled graph may run this quantizer's ``quantize`` (which of
        them, in which order of preference, quant-dynamo's ``QUANT_LOWERING`` decides, with the
        device; none: an opaque op):

        - ``"ops"``: the pure-torch reference (:mod:`quant_core.reference`), traced into the
          graph as torch ops that the compiler fuses with their neighbours, merges where two
          quantizations of one tensor are equal, and may recompute in backward. Only for rules
          written to compile to the reference's bytes (`numerics.md` §0).
        - ``"kernels"``: the backend's kernels, each launch recorded into the graph
          (:mod:`quant_core.kernel_capture`).

        A quantizer whose result depends on state outside its value (a delayed-scaling scale, a
        random seed) has none. The default is none.
        """
        return ()


# ---------------------------------------------------------------------- class machinery
#: Each value-identity hook under quant's name and TransformerEngine's: one hook, two names.
_HOOK_NAMES = (("value_fields", "_value_fields"), ("value_key", "_value_key"))


def _join_hook_names(cls: type) -> bool:
    """Give a hook ``cls`` overrides under one name the other name too, so that quant (which
    calls ``value_fields``/``value_key``) and TransformerEngine code (``_value_fields``/
    ``_value_key``) see the override. A hook ``cls`` inherits from a class below
    :class:`Quantizer` is reset to the base's: a subclass that did not opt in itself keeps
    identity semantics. True when ``cls`` overrides ``value_fields``."""
    for pair in _HOOK_NAMES:
        own = [name for name in pair if name in cls.__dict__]
        for name in pair:
            if own and name not in cls.__dict__:
                type.__setattr__(cls, name, cls.__dict__[own[0]])
            elif not own and _lookup(cls, name) is not Quantizer.__dict__[name]:
                type.__setattr__(cls, name, Quantizer.__dict__[name])
    return _overrides_value_fields(cls)


def _overrides_value_fields(cls: type) -> bool:
    base = Quantizer.__dict__["value_fields"]
    return cls.__dict__.get("value_fields", base) is not base


def _lookup(cls: type, name: str) -> Any:
    """``name`` as the MRO resolves it, unbound (what a class dict holds)."""
    return next(klass.__dict__[name] for klass in cls.__mro__ if name in klass.__dict__)


def _overridden_value_fields(cls: type) -> tuple[str, ...] | None:
    """What ``cls``'s own override of ``value_fields``/``_value_fields`` returns: called on the
    class (a classmethod) or on an instance without state (TransformerEngine's signature), since
    the names are a property of the class."""
    hook = cls.__dict__["value_fields"]
    try:
        if isinstance(hook, (classmethod, staticmethod)):
            names = cls.value_fields()
        else:
            names = hook(object.__new__(cls))
    except Exception as exc:
        raise TypeError(
            f"{cls.__qualname__}._value_fields() must return the class's value field names (or "
            f"None) without reading instance state; it is read once, when the class is created: "
            f"{type(exc).__name__}: {exc}"
        ) from exc
    if names is not None and not (
        isinstance(names, tuple) and all(isinstance(n, str) for n in names)
    ):
        raise TypeError(
            f"{cls.__qualname__}._value_fields() must return a tuple of field names or None, "
            f"got {names!r}"
        )
    return names


def _annotated_fields(cls: type) -> tuple[str, ...]:
    """Annotated field names of ``cls``, walking the MRO base first, in declaration order."""
    names: list[str] = []
    for klass in reversed(cls.__mro__):
        if not (isinstance(klass, type) and issubclass(klass, Quantizer)):
            continue
        for name, ann in klass.__dict__.get("__annotations__", {}).items():
            if name.startswith("_") or "ClassVar" in str(ann) or name in names:
                continue
            names.append(name)
    return tuple(names)


def _record_fields(cls: type) -> None:
    """Store ``cls``'s field names, and their types where they resolve now (else lazily)."""
    type.__setattr__(cls, "_field_names", _annotated_fields(cls))
    try:
        hints = _field_types(cls)
    except TypeError:
        hints = None  # resolved (or reported) when an instance is built or the class opts in
    type.__setattr__(cls, "_field_type_hints", hints)


def _field_types(cls: type) -> dict[str, Any]:
    try:
        hints = typing.get_type_hints(cls)
    except NameError as exc:
        raise TypeError(
            f"{cls.__qualname__}: cannot resolve a field annotation ({exc}); field types must be "
            "importable from the class's module (not local to a function)"
        ) from exc
    return {n: hints.get(n, Any) for n in _annotated_fields(cls)}


def _coerce(cls: type, name: str, typ: Any, value: Any) -> Any:
    """Check ``value`` against the field type; ints are accepted for float fields."""
    if isinstance(typ, type) and issubclass(typ, enum.Enum):
        if not isinstance(value, typ):
            raise TypeError(
                f"{cls.__name__}.{name} must be a {typ.__name__} member, got {value!r}"
            )
        return value
    if typ is bool:
        if not isinstance(value, bool):
            raise TypeError(f"{cls.__name__}.{name} must be a bool, got {value!r}")
        return value
    if typ is float:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise TypeError(f"{cls.__name__}.{name} must be a float, got {value!r}")
        if math.isnan(value):
            raise ValueError(f"{cls.__name__}.{name} must not be NaN (NaN breaks equality)")
        return float(value)
    if typ is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise TypeError(f"{cls.__name__}.{name} must be an int, got {value!r}")
        return value
    if typ is str and not isinstance(value, str):
        raise TypeError(f"{cls.__name__}.{name} must be a str, got {value!r}")
    return value


def _field_repr(value: Any) -> str:
    if isinstance(value, enum.Enum):
        return f"{type(value).__name__}.{value.name}"
    return repr(value)


#: ``{(value quantizer, shape): inner_tensor_specs}``; cleared when it reaches the bound.
_SPECS: dict[tuple, dict] = {}
_MAX_CACHED_SPECS = 4096


def _key_value(value: Any) -> Any:
    return value.value if isinstance(value, enum.Enum) else value


def value_quantizer(cls: type) -> type:
    """Class decorator: opt ``cls`` into value identity.

    Resolves the annotated fields with ``typing.get_type_hints``; every field must be ``int``,
    ``bool``, ``float``, ``str`` or an ``Enum`` whose member values are ``int`` or ``str``, else
    ``TypeError`` (derive such state in ``_rebuild_derived_state`` instead). Sets the class's own
    ``_value_field_names`` and notifies registered hooks (quant-dynamo).
    """
    if not (isinstance(cls, type) and issubclass(cls, Quantizer)):
        raise TypeError(f"@value_quantizer applies to Quantizer subclasses, not {cls!r}")
    if cls._value_owner is cls:
        return cls  # opted in already (by an override of _value_fields)
    types = _field_types(cls)
    if _overrides_value_fields(cls):
        types = _overridden_types(cls, types)
    for name, typ in types.items():
        ok = typ in _PRIMITIVES or (
            isinstance(typ, type)
            and issubclass(typ, enum.Enum)
            and all(isinstance(m.value, (int, str)) for m in typ)
        )
        if not ok:
            raise TypeError(
                f"{cls.__qualname__}.{name}: annotated type {typ!r} cannot be part of a value "
                "(allowed: int, bool, float, str, or an Enum with int/str values); remove the "
                "annotation and rebuild the attribute in _rebuild_derived_state()"
            )
    type.__setattr__(cls, "_value_field_names", tuple(types))
    type.__setattr__(cls, "_value_field_types", dict(types))
    type.__setattr__(cls, "_value_owner", cls)
    _value_classes.append(cls)
    for hook in list(_value_class_hooks):
        hook(cls)
    return cls


def _overridden_types(cls: type, types: dict[str, Any]) -> dict[str, Any]:
    """The field types of the value fields ``cls``'s ``_value_fields()`` override names."""
    names = _overridden_value_fields(cls)
    if names is None:
        raise TypeError(
            f"{cls.__qualname__}._value_fields() returns None (identity semantics), so it "
            "cannot opt in; remove the override"
        )
    unknown = [n for n in names if n not in types]
    if unknown:
        raise TypeError(
            f"{cls.__qualname__}._value_fields() names {', '.join(map(repr, unknown))}, which "
            f"{'is not an annotated field' if len(unknown) == 1 else 'are not annotated fields'}"
            f"; fields: {list(types)}"
        )
    return {n: types[n] for n in names}


def is_value_quantizer(obj_or_cls: Any) -> bool:
    """Whether ``obj_or_cls`` (a quantizer or a class) opted into value identity itself."""
    cls = obj_or_cls if isinstance(obj_or_cls, type) else type(obj_or_cls)
    return isinstance(cls, type) and issubclass(cls, Quantizer) and cls._value_owner is cls


def add_value_class_hook(hook: Callable[[type], None]) -> None:
    """Call ``hook(cls)`` for every value-quantizer class defined so far and from now on."""
    _value_class_hooks.append(hook)
    for cls in list(_value_classes):
        hook(cls)


def value_classes() -> tuple[type, ...]:
    """Every class that opted in, in definition order."""
    return tuple(_value_classes)


def _rebuild_quantizer(cls: type, items: tuple[tuple[str, Any], ...]) -> Quantizer:
    """Rebuild a value quantizer from its key items (pickle, FX reconstruction, the flat ops)
    through its constructor, so a rebuilt object passes exactly the validation of a constructed
    one. Enum fields are converted back by the field's annotated Enum type (never by name)."""
    types = cls._value_field_types if cls._value_owner is cls else None
    if types is None:
        raise TypeError(f"{cls.__qualname__} is not a value quantizer")
    fields = {}
    for name, value in items:
        if name not in types:
            raise TypeError(
                f"{cls.__qualname__} has no field {name!r} to rebuild; fields: {sorted(types)}"
            )
        typ = types[name]
        if isinstance(typ, type) and issubclass(typ, enum.Enum):
            value = typ(value)
        fields[name] = value
    return cls(**fields)


#: The rebuild under its public name, for the layers above (FX codegen); pickles hold
#: ``_rebuild_quantizer``, which stays for the files already saved.
rebuild_quantizer = _rebuild_quantizer


def warn_deprecated_group(cls_name: str) -> None:
    warnings.warn(
        f"{cls_name}(amax_reduction_group=...) is deprecated: a stored process group cannot be "
        "part of a value quantizer (it cannot be hashed or compiled). Pass it per call: "
        "quantizer.quantize(x, amax_reduction_group=group).",
        DeprecationWarning,
        stacklevel=3,
    )


_record_fields(Quantizer)
