"""Storage objects: the buffers a quantizer produces (`numerics.md` §9), and the registry of
formats.

A storage is a plain Python object holding its buffers (``None`` for a direction not produced),
the logical shape and high-precision dtype of the input, the format tags, and the quantizer that
made it. ``dequantize(dtype=...)`` inverts it on any device through the backend registry. This
module holds the base every format's storage derives from (:mod:`quant_core.formats`); a
storage class with a ``format`` name registers itself (:func:`storage_class`).
"""

from __future__ import annotations

import enum
from typing import Any, ClassVar

import torch

from . import backends
from .dtypes import INPUT_DTYPES
from .operand import GemmOperand
from .sharding import ShardPlan


def absent_buffer(like: torch.Tensor) -> torch.Tensor:
    """The stand-in for an absent buffer in a buffer list (positions stay stable): an empty
    uint8 tensor on ``like``'s device. A buffer list holds one per absent direction."""
    return like.new_empty((0,), dtype=torch.uint8)


class QuantizedStorage:
    """Base of the format storages: what every layer above quant-core asks a format.

    A format's storage class declares (class attributes):

    - ``format``: its public name ("fp8", "mxfp8", ...), the key of :func:`storage_class` and the
      ``storage_format`` of its quantizers. Defining a subclass with a ``format`` registers it.
    - ``buffer_names``: its tensor buffers, in the order of ``buffer_list``, the custom ops'
      outputs and ``prepare_for_saving``.
    - ``tag_types``: its non-tensor tags and their types (an ``enum.Enum``, ``bool`` or ``int``),
      in the order they cross a custom-op boundary as integers (:meth:`wire_tags`,
      :meth:`from_wire`); ``tag_names`` is derived from it, and ``tag_defaults`` holds the value
      of a tag a storage was built without (a pickle from before the tag existed).
    - ``rowwise_data_name`` / ``columnwise_data_name``: the data buffer of each direction;
      ``rowwise_only_names``: the buffers a use of the columnwise direction does not read.
    - ``directions_interchangeable``: either direction's buffers serve either GEMM role (one
      scale for the whole tensor), so a GEMM may read the one that is present.

    and implements ``_decode`` (one direction's value), ``gemm_operand`` and, where the format
    shards under FSDP2, ``shard_plan`` and ``columnwise_from_rowwise``.
    """

    format: ClassVar[str | None] = None
    buffer_names: ClassVar[tuple[str, ...]] = ()
    tag_types: ClassVar[dict[str, type]] = {}
    tag_names: ClassVar[tuple[str, ...]] = ()
    tag_defaults: ClassVar[dict[str, Any]] = {}
    rowwise_data_name: ClassVar[str | None] = None
    columnwise_data_name: ClassVar[str | None] = None
    rowwise_only_names: ClassVar[tuple[str, ...]] = ()
    directions_interchangeable: ClassVar[bool] = False
    #: Derived (``__init_subclass__``): the position of ``columnwise_data_name`` and of each of
    #: ``rowwise_only_names`` in ``buffer_names``.
    _columnwise_position: ClassVar[int | None] = None
    _rowwise_only_positions: ClassVar[tuple[int, ...]] = ()
    #: The ``torch.Tensor`` subclass of this format (set when one is defined), or None.
    tensor_class: ClassVar[type | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "tag_types" in cls.__dict__:
            cls.tag_names = tuple(cls.tag_types)
        # for_transposed_use's positions in a buffer list, computed once: traced code reads
        # them as class constants instead of searching the names on every call
        names = cls.buffer_names
        cls._columnwise_position = (names.index(cls.columnwise_data_name)
                                    if cls.columnwise_data_name in names else None)
        cls._rowwise_only_positions = tuple(i for i, n in enumerate(names)
                                            if n in cls.rowwise_only_names)
        name = cls.__dict__.get("format")
        if name is not None:
            known = _FORMATS.get(name)
            if known is not None and known.__qualname__ != cls.__qualname__:
                raise TypeError(f"storage format {name!r} is already {known.__qualname__}; "
                                f"{cls.__qualname__} must name another format")
            _FORMATS[name] = cls
            if name not in _INDEX:
                _INDEX[name] = len(_NAMES)
                _NAMES.append(name)

    def __init__(self, *, shape, dtype: torch.dtype, quantizer, **kwargs: Any) -> None:
        self.shape = shape if type(shape) is torch.Size else torch.Size(shape)
        self._dtype = dtype
        self.quantizer = quantizer
        for name in self.buffer_names + self.tag_names:
            setattr(self, name, kwargs.pop(name, self.tag_defaults.get(name)))
        if kwargs:
            raise TypeError(
                f"{type(self).__name__}: unexpected buffers {sorted(kwargs)}; "
                f"allowed: {list(self.buffer_names + self.tag_names)}"
            )

    @property
    def dtype(self) -> torch.dtype:
        """The nominal high-precision dtype (the dtype ``dequantize`` returns by default)."""
        return self._dtype

    @property
    def device(self) -> torch.device:
        for t in self.buffers().values():
            if t is not None:
                return t.device
        raise RuntimeError(f"{type(self).__name__} holds no buffer")

    def buffers(self) -> dict[str, torch.Tensor | None]:
        """Every buffer by name, in declaration order (``None`` where absent)."""
        return {name: getattr(self, name) for name in self.buffer_names}

    def tags(self) -> dict[str, Any]:
        """Every tag by name, in declaration order."""
        return {name: getattr(self, name) for name in self.tag_names}

    def buffer_list(self, like: torch.Tensor) -> list[torch.Tensor]:
        """The buffers in declaration order as a plain tensor list (what custom ops pass and
        return), an absent one as :func:`absent_buffer` on ``like``'s device."""
        return [absent_buffer(like) if t is None else t for t in self.buffers().values()]

    def prepare_for_saving(self) -> list[torch.Tensor | None]:
        """The buffers in declaration order, for ``ctx.save_for_backward``; fields become None."""
        saved = list(self.buffers().values())
        for name in self.buffer_names:
            setattr(self, name, None)
        return saved

    def restore_from_saved(self, tensors: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """Take this storage's buffers back from the front of ``tensors``; return the rest."""
        n = len(self.buffer_names)
        for name, t in zip(self.buffer_names, tensors[:n], strict=True):
            setattr(self, name, t)
        return tensors[n:]

    # ------------------------------------------------------------ the custom-op boundary
    @classmethod
    def wire_tags(cls, tags: dict[str, Any]) -> list[int]:
        """``tags`` (a storage's, or a quantizer's ``_storage_tags()``) as integers in
        ``tag_names`` order: an enum member by its value, a flag as 0 or 1, an int as itself."""
        def wire(name: str) -> int:
            v = tags[name]
            if isinstance(v, enum.Enum):
                return int(v.value)
            return int(v) if cls.tag_types[name] is int else int(bool(v))

        return [wire(n) for n in cls.tag_names]

    @classmethod
    def from_wire(cls, bufs: list[torch.Tensor], wire_tags: list[int], shape,
                  dtype: torch.dtype = torch.float32) -> QuantizedStorage:
        """The storage of a buffer list (an empty tensor for an absent buffer) and the integers
        of :meth:`wire_tags`, without a quantizer."""
        tags = {name: typ(v) for (name, typ), v in zip(cls.tag_types.items(), wire_tags,
                                                         strict=True)}
        buffers = {name: t if t.numel() else None
                   for name, t in zip(cls.buffer_names, bufs, strict=True)}
        return cls(shape=shape, dtype=dtype, quantizer=None, **buffers, **tags)

    @classmethod
    def unread_by_transposed_use(cls, bufs: list[torch.Tensor]) -> tuple[int, ...]:
        """The positions in ``bufs`` that a use from the columnwise direction does not read: the
        rowwise-only buffers when the columnwise data is present, else none."""
        if not bufs[cls._columnwise_position].numel():
            return ()
        if len(bufs) != len(cls.buffer_names):
            raise ValueError(f"{cls.__name__}: {len(bufs)} buffers, expected "
                             f"{len(cls.buffer_names)} ({', '.join(cls.buffer_names)})")
        return cls._rowwise_only_positions

    @classmethod
    def for_transposed_use(cls, bufs: list[torch.Tensor]) -> list[torch.Tensor]:
        """``bufs`` as a use from the columnwise direction reads them: the buffers of
        :meth:`unread_by_transposed_use` empty (the backward GEMMs of a Linear read only the
        columnwise copy, so saving the rest wastes memory)."""
        unread = cls.unread_by_transposed_use(bufs)
        if not unread:
            return bufs
        kept = list(bufs)
        for i in unread:
            kept[i] = absent_buffer(kept[i])
        return kept

    # ------------------------------------------------------------------ values
    def _backend(self):
        return backends.get(None, self.device)

    def _out_dtype(self, dtype) -> torch.dtype:
        """``dtype`` (default: the nominal one) if it is a float dtype dequantization can produce;
        an integer dtype silently gave zeros, a string an unrelated device error."""
        dtype = self._dtype if dtype is None else dtype
        if dtype not in INPUT_DTYPES:
            allowed = ", ".join(str(d) for d in INPUT_DTYPES)
            raise TypeError(f"dequantize(dtype=...) must be one of {allowed}, got {dtype!r}")
        return dtype

    def _has(self, name: str | None) -> bool:
        return name is not None and getattr(self, name) is not None

    def _decode(self, columnwise: bool, dtype: torch.dtype) -> torch.Tensor:
        """The ``[m, k]`` value held by one direction's buffers, in ``dtype``."""
        raise NotImplementedError(f"{type(self).__name__} does not decode its buffers")

    def gemm_value(self, columnwise: bool, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The ``[m, k]`` value a GEMM reads from the rowwise or the columnwise direction (the
        emulated GEMM's operand), in ``dtype`` (fp32 by default; a narrower one rounds unless
        the quantizer ``decodes_exactly_to_bf16``): the dequantization, in the basis the
        format's GEMM consumes (columnwise NVFP4 with RHT stays in the transformed basis)."""
        return self._decode(columnwise, dtype)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """The high-precision tensor (``dtype``, default the nominal one) of the rowwise data,
        else of the columnwise data."""
        dtype = self._out_dtype(dtype)
        columnwise = not self._has(self.rowwise_data_name)
        if columnwise and not self._has(self.columnwise_data_name):
            raise RuntimeError(f"{type(self).__name__} holds neither rowwise nor columnwise data")
        return self._decode(columnwise, dtype).reshape(self.shape)

    def gemm_operand(self, transposed: bool) -> GemmOperand | None:
        """This tensor as a GEMM row operand (``quant_core.operand``): the 2D view ``X [m, k]``
        itself, or ``Xᵀ`` when ``transposed`` (the contraction runs over ``m``), as views of the
        buffers of the direction whose blocks run along the contraction. ``None`` when those
        buffers are absent, or when the format cannot hand out that operand without a copy."""
        return None

    # ------------------------------------------------------------------ FSDP2
    @classmethod
    def shard_plan(cls, q, shape, world: int, columnwise: bool) -> ShardPlan | str:
        """How a weight of ``shape`` quantized by ``q`` all-gathers along dim 0 over ``world``
        ranks (:class:`quant_core.sharding.ShardPlan`), or why it does not (a sentence).
        ``columnwise``: the gathered weight also needs its columnwise copy."""
        return f"format {cls.format!r} has no quantized all-gather"

    @classmethod
    def columnwise_from_rowwise(cls, s, q) -> dict[str, torch.Tensor]:
        """The present buffers of ``s`` (a storage of this format holding only its rowwise
        direction) plus the columnwise copy built from them, exactly as ``q`` (equal to the
        storage's quantizer up to usages) would have produced it; ``ValueError`` where the
        columnwise bytes are not a function of the rowwise ones. A classmethod reading ``s`` by
        attributes only, so that compiled code can pass a traced quantized tensor."""
        raise ValueError(
            f"{cls.__name__} holds no columnwise copy and it cannot be built from the "
            "rowwise one (it is quantized along the other dimension); quantize the weight with "
            "columnwise_usage=True"
        )

    def __repr__(self) -> str:
        present = [n for n, t in self.buffers().items() if t is not None]
        return (
            f"{type(self).__name__}(shape={tuple(self.shape)}, dtype={self._dtype}, "
            f"buffers={present}, quantizer={self.quantizer!r})"
        )


#: format name -> storage class, in definition order.
_FORMATS: dict[str, type[QuantizedStorage]] = {}
#: Each registered format's position in :func:`storage_formats` (registration order).
_INDEX: dict[str, int] = {}
_NAMES: list[str] = []


def storage_formats() -> tuple[str, ...]:
    """The registered format names, in definition order."""
    return tuple(_FORMATS)


def format_index(format: str) -> int | None:
    """The position of ``format`` in :func:`storage_formats`, ``None`` if it is not registered:
    one dictionary read (code that Dynamo traces calls it per quantize)."""
    return _INDEX.get(format)


def format_at(index: int) -> str:
    """The registered format at ``index`` of :func:`storage_formats` (one list read)."""
    return _NAMES[index]


def storage_class(format: str) -> type[QuantizedStorage]:
    """The storage class of ``format``; ``TypeError`` naming the registered formats."""
    cls = _FORMATS.get(format)
    if cls is None:
        raise TypeError(f"storage format {format!r} is not registered; registered: "
                        f"{', '.join(_FORMATS)}")
    return cls


def present_buffers(cls: type[QuantizedStorage], s) -> dict[str, torch.Tensor]:
    """The present buffers of ``s`` by attribute reads only (``s`` may be a quantized tensor
    that Dynamo traces, whose method calls it takes for tensor methods)."""
    return {n: getattr(s, n) for n in cls.buffer_names if getattr(s, n) is not None}
