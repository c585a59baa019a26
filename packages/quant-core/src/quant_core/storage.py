"""Storage objects: the buffers a quantizer produces (`numerics.md` §9).

A storage is a plain Python object holding its buffers (``None`` for a direction not produced),
the logical shape and high-precision dtype of the input, the format tags, and the quantizer that
made it. ``dequantize(dtype=...)`` inverts it on any device through the backend registry.
"""

from __future__ import annotations

import enum
from typing import Any, ClassVar

import torch

from . import backends
from .dtypes import INPUT_DTYPES, DType
from .operand import GemmOperand
from .reference._pad import zero_pad
from .reference.nvfp4 import pack_e2m1, unpack_e2m1
from .shapes import (
    FP8_BLOCK,
    MXFP8_BLOCK,
    NVFP4_BLOCK,
    ceil_div,
    fp8_block_columnwise_scale_shape,
    m_k,
    mxfp8_columnwise_scale_shape,
    nvfp4_columnwise_scale_shape,
)
from .sharding import ShardPlan, row_blocks_refusal


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
    - ``tag_types``: its non-tensor tags and their types (an ``enum.Enum`` or ``bool``), in the
      order they cross a custom-op boundary as integers (:meth:`wire_tags`, :meth:`from_wire`);
      ``tag_names`` is derived from it.
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
    rowwise_data_name: ClassVar[str | None] = None
    columnwise_data_name: ClassVar[str | None] = None
    rowwise_only_names: ClassVar[tuple[str, ...]] = ()
    directions_interchangeable: ClassVar[bool] = False
    #: The ``torch.Tensor`` subclass of this format (set when one is defined), or None.
    tensor_class: ClassVar[type | None] = None

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if "tag_types" in cls.__dict__:
            cls.tag_names = tuple(cls.tag_types)
        name = cls.__dict__.get("format")
        if name is not None:
            known = _FORMATS.get(name)
            if known is not None and known.__qualname__ != cls.__qualname__:
                raise TypeError(f"storage format {name!r} is already {known.__qualname__}; "
                                f"{cls.__qualname__} must name another format")
            _FORMATS[name] = cls

    def __init__(self, *, shape, dtype: torch.dtype, quantizer, **kwargs: Any) -> None:
        self.shape = shape if type(shape) is torch.Size else torch.Size(shape)
        self._dtype = dtype
        self.quantizer = quantizer
        for name in self.buffer_names + self.tag_names:
            setattr(self, name, kwargs.pop(name, None))
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
        ``tag_names`` order: an enum member by its value, a flag as 0 or 1."""
        return [int(v.value) if isinstance(v, enum.Enum) else int(bool(v))
                for v in (tags[n] for n in cls.tag_names)]

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
    def for_transposed_use(cls, bufs: list[torch.Tensor]) -> list[torch.Tensor]:
        """``bufs`` as a use from the columnwise direction reads them: the rowwise-only buffers
        become empty when the columnwise data is present (the backward GEMMs of a Linear read
        only that copy, so saving the rest wastes memory); otherwise ``bufs`` as they are."""
        names = cls.buffer_names
        if not bufs[names.index(cls.columnwise_data_name)].numel():
            return bufs
        return [absent_buffer(t) if n in cls.rowwise_only_names else t
                for n, t in zip(names, bufs, strict=True)]

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

    def gemm_value(self, columnwise: bool) -> torch.Tensor:
        """The fp32 ``[m, k]`` value a GEMM reads from the rowwise or the columnwise direction
        (the emulated GEMM's operand): the dequantization, in the basis the format's GEMM
        consumes (columnwise NVFP4 with RHT stays in the transformed basis)."""
        return self._decode(columnwise, torch.float32)

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


def storage_formats() -> tuple[str, ...]:
    """The registered format names, in definition order."""
    return tuple(_FORMATS)


def storage_class(format: str) -> type[QuantizedStorage]:
    """The storage class of ``format``; ``TypeError`` naming the registered formats."""
    cls = _FORMATS.get(format)
    if cls is None:
        raise TypeError(f"storage format {format!r} is not registered; registered: "
                        f"{', '.join(_FORMATS)}")
    return cls


def _swizzle_refusal(q) -> str | None:
    return ("GEMM-swizzled scales do not concatenate along dim 0"
            if q.optimize_for_gemm else None)


class Float8TensorStorage(QuantizedStorage):
    """Per-tensor FP8 (current or delayed scaling): ``_data`` ``[shape]``, ``_transpose``
    ``[K, *leading]`` (byte transpose), ``_scale_inv`` fp32 ``(1,)``."""

    format = "fp8"
    buffer_names = ("_data", "_transpose", "_scale_inv")
    tag_types = {"_fp8_dtype": DType}
    rowwise_data_name, columnwise_data_name = "_data", "_transpose"
    rowwise_only_names = ("_data",)
    directions_interchangeable = True

    def _decode(self, columnwise, dtype):
        m, k = m_k(self.shape)
        if columnwise and self._transpose is not None or self._data is None:
            out = self._backend().fp8_dequantize(self._transpose.reshape(k, m), self._scale_inv,
                                                 fp8_dtype=self._fp8_dtype, dtype=dtype)
            return out.t()
        return self._backend().fp8_dequantize(self._data.reshape(m, k), self._scale_inv,
                                              fp8_dtype=self._fp8_dtype, dtype=dtype)

    def update_usage(self, rowwise: bool | None = None, columnwise: bool | None = None) -> None:
        """Drop a direction, or build the transpose from ``_data`` (exact: the scale is shared)."""
        if columnwise and self._transpose is None:
            if self._data is None:
                raise RuntimeError("cannot build the transpose: no rowwise data")
            self._transpose = self._data.movedim(-1, 0).contiguous()
        if rowwise and self._data is None:
            if self._transpose is None:
                raise RuntimeError("cannot build rowwise data: no transpose")
            self._data = self._transpose.movedim(0, -1).contiguous()
        if rowwise is False:
            self._data = None
        if columnwise is False:
            self._transpose = None

    def gemm_operand(self, transposed: bool) -> GemmOperand | None:
        """One scale for the whole tensor: either buffer serves either role, the rowwise data
        viewed transposed or the byte transpose as it is."""
        m, k = m_k(self.shape)
        if self._data is None and self._transpose is None:
            return None
        x = self._data.reshape(m, k) if self._data is not None else None
        xt = self._transpose.reshape(k, m) if self._transpose is not None else None
        if transposed:
            data, rows, kk = (xt if xt is not None else x.t()), k, m
        else:
            data, rows, kk = (x if x is not None else xt.t()), m, k
        return GemmOperand("fp8", data, self._scale_inv, self._fp8_dtype, rows, kk)

    @classmethod
    def shard_plan(cls, q, shape, world, columnwise):
        """Any row split: the data bytes are gathered (rows past the weight's, FSDP2's padding,
        dropped); the one ``scale_inv`` comes from the amax all-reduced over the group, equal on
        every rank, so it travels as metadata. The transpose is built from the data."""
        row = q.replace(rowwise_usage=True, columnwise_usage=False, with_amax_reduction=False)
        return ShardPlan(row, ("_data",), ("_scale_inv",), True, trimmed=("_data",))

    @classmethod
    def columnwise_from_rowwise(cls, s, q) -> dict[str, torch.Tensor]:
        """The byte transpose of the data (exact: one scale)."""
        m, k = m_k(s.shape)
        return {**_present(cls, s), "_transpose": s._data.reshape(m, k).t().contiguous()}


class MXFP8TensorStorage(QuantizedStorage):
    """MXFP8: rowwise and columnwise data ``[shape]`` (not transposed) with padded E8M0 scales."""

    format = "mxfp8"
    buffer_names = (
        "_rowwise_data", "_rowwise_scale_inv", "_columnwise_data", "_columnwise_scale_inv",
    )
    tag_types = {"_fp8_dtype": DType, "_with_gemm_swizzled_scales": bool}
    rowwise_data_name, columnwise_data_name = "_rowwise_data", "_columnwise_data"
    rowwise_only_names = ("_rowwise_data", "_rowwise_scale_inv")

    def _decode(self, columnwise, dtype):
        data, scale = ((self._columnwise_data, self._columnwise_scale_inv) if columnwise
                       else (self._rowwise_data, self._rowwise_scale_inv))
        return self._backend().mxfp8_dequantize(
            data.reshape(m_k(self.shape)), scale, fp8_dtype=self._fp8_dtype,
            columnwise=columnwise, swizzled=bool(self._with_gemm_swizzled_scales), dtype=dtype,
        )

    def gemm_operand(self, transposed: bool) -> GemmOperand | None:
        """Rowwise data with its ``[rows, K/32]`` scales, or the columnwise data viewed
        transposed with the transposed scale matrix (swizzled: the raw bytes viewed in the
        transposed shape, whose swizzle they already hold)."""
        m, k = m_k(self.shape)
        swz = bool(self._with_gemm_swizzled_scales)
        if transposed:
            if self._columnwise_data is None:
                return None
            scale = self._columnwise_scale_inv  # [roundup(m/32, 4), roundup(k, 128)]
            scale = scale.reshape(scale.shape[1], scale.shape[0]) if swz else scale.t()
            return GemmOperand("mxfp8", self._columnwise_data.reshape(m, k).t(), scale,
                               self._fp8_dtype, k, m, swz)
        if self._rowwise_data is None:
            return None
        return GemmOperand("mxfp8", self._rowwise_data.reshape(m, k), self._rowwise_scale_inv,
                           self._fp8_dtype, m, k, swz)

    @classmethod
    def shard_plan(cls, q, shape, world, columnwise):
        """Row blocks of 128 (the rowwise scales pad rows to 128, the columnwise ones pad 32-row
        blocks to 4): the rowwise data and scales; with 2D 32x32 blocks the columnwise copy is
        rebuilt from them, with 1x32 blocks it is gathered too (it differs from the rowwise
        bytes)."""
        refusal = _swizzle_refusal(q) or row_blocks_refusal("MXFP8", shape, world)
        if refusal:
            return refusal
        names = ("_rowwise_data", "_rowwise_scale_inv")
        if columnwise and not q.with_2d_quantization:
            return ShardPlan(q.with_usage(True, True),
                             names + ("_columnwise_data", "_columnwise_scale_inv"), (), False)
        return ShardPlan(q.replace(rowwise_usage=True, columnwise_usage=False), names, (), False)

    @classmethod
    def columnwise_from_rowwise(cls, s, q) -> dict[str, torch.Tensor]:
        """With 2D 32x32 blocks the columnwise bytes are the rowwise ones, and each block's
        scale serves its 32 columns."""
        if not q.with_2d_quantization or s._with_gemm_swizzled_scales:
            return super().columnwise_from_rowwise(s, q)
        m, k = m_k(s.shape)
        per_block = s._rowwise_scale_inv[:m:MXFP8_BLOCK, :k // MXFP8_BLOCK]
        cs = per_block.repeat_interleave(MXFP8_BLOCK, dim=1)
        return {**_present(cls, s), "_columnwise_data": s._rowwise_data,
                "_columnwise_scale_inv": zero_pad(cs, *mxfp8_columnwise_scale_shape(m, k))}


class Float8BlockwiseQTensorStorage(QuantizedStorage):
    """FP8 1x128 / 128x128 blocks: rowwise ``[shape]``, columnwise ``[K, *leading]``, fp32
    scale-inverses in the GEMM-ready layouts."""

    format = "fp8_block"
    buffer_names = (
        "_rowwise_data", "_rowwise_scale_inv", "_columnwise_data", "_columnwise_scale_inv",
    )
    tag_types = {"_fp8_dtype": DType, "_is_2D_scaled": bool}
    rowwise_data_name, columnwise_data_name = "_rowwise_data", "_columnwise_data"
    rowwise_only_names = ("_rowwise_data", "_rowwise_scale_inv")

    def _decode(self, columnwise, dtype):
        m, k = m_k(self.shape)
        data = (self._columnwise_data.reshape(k, m) if columnwise
                else self._rowwise_data.reshape(m, k))
        return self._backend().fp8_block_dequantize(
            data, self._columnwise_scale_inv if columnwise else self._rowwise_scale_inv,
            fp8_dtype=self._fp8_dtype, block_scaling_dim=2 if self._is_2D_scaled else 1,
            columnwise=columnwise, dtype=dtype,
        )

    def gemm_operand(self, transposed: bool) -> GemmOperand | None:
        """Rowwise ``[m, k]`` or columnwise ``[k, m]`` data (both K-contiguous) with the
        GEMM-ready scales of that direction."""
        m, k = m_k(self.shape)
        dim = 2 if self._is_2D_scaled else 1
        if transposed:
            if self._columnwise_data is None:
                return None
            return GemmOperand("fp8_block", self._columnwise_data.reshape(k, m),
                               self._columnwise_scale_inv, self._fp8_dtype, k, m,
                               block_scaling_dim=dim)
        if self._rowwise_data is None:
            return None
        return GemmOperand("fp8_block", self._rowwise_data.reshape(m, k), self._rowwise_scale_inv,
                           self._fp8_dtype, m, k, block_scaling_dim=dim)

    @classmethod
    def shard_plan(cls, q, shape, world, columnwise):
        """2D 128x128 weight blocks in row blocks of 128: data and the block scale rows; the
        columnwise copy is the byte transpose with the transposed scales."""
        if q.block_scaling_dim != 2:
            return ("FP8 1x128 weight blocks: the columnwise copy (128x1 blocks along dim 0) is "
                    "stored transposed and does not gather along dim 0; use 2D weight blocks "
                    "(Float8BlockScaling(w_block_scaling_dim=2), the default)")
        refusal = row_blocks_refusal("FP8 128x128 blocks", shape, world)
        if refusal:
            return refusal
        return ShardPlan(q.replace(rowwise_usage=True, columnwise_usage=False),
                         ("_rowwise_data", "_rowwise_scale_inv"), (), False)

    @classmethod
    def columnwise_from_rowwise(cls, s, q) -> dict[str, torch.Tensor]:
        """With 2D blocks each 128x128 scale serves rows and columns alike."""
        if not s._is_2D_scaled:
            return super().columnwise_from_rowwise(s, q)
        m, k = m_k(s.shape)
        rs = s._rowwise_scale_inv[:, :ceil_div(k, FP8_BLOCK)]
        return {**_present(cls, s),
                "_columnwise_data": s._rowwise_data.reshape(m, k).t().contiguous(),
                "_columnwise_scale_inv": zero_pad(rs.t(),
                                                  *fp8_block_columnwise_scale_shape(m, k, 2))}


class NVFP4TensorStorage(QuantizedStorage):
    """NVFP4: packed E2M1 data (two codes a byte, low nibble first), E4M3 block scales and the
    per-tensor amaxes ``_amax_rowwise`` / ``_amax_columnwise`` (fp32 ``(1,)``)."""

    format = "nvfp4"
    buffer_names = (
        "_rowwise_data", "_rowwise_scale_inv", "_columnwise_data", "_columnwise_scale_inv",
        "_amax_rowwise", "_amax_columnwise",
    )
    tag_types = {"_fp4_dtype": DType, "_with_gemm_swizzled_scales": bool}
    rowwise_data_name, columnwise_data_name = "_rowwise_data", "_columnwise_data"
    rowwise_only_names = ("_rowwise_data", "_rowwise_scale_inv", "_amax_rowwise")

    def _decode(self, columnwise, dtype):
        """Columnwise: the transposed codes decode to ``[k, m]`` in the quantizer's basis (the
        RHT one when it applied the transform), returned transposed."""
        m, k = m_k(self.shape)
        swz = bool(self._with_gemm_swizzled_scales)
        be = self._backend()
        if columnwise:
            cd = self._columnwise_data
            out = be.nvfp4_dequantize(cd.reshape(k, cd.shape[-1]), self._columnwise_scale_inv,
                                      self._amax_columnwise, swizzled=swz, dtype=dtype)
            return out[:, :m].t()
        return be.nvfp4_dequantize(self._rowwise_data.reshape(m, k // 2), self._rowwise_scale_inv,
                                   self._amax_rowwise, swizzled=swz, dtype=dtype)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Dequantize the rowwise data (`numerics.md` §8). The columnwise data may live in the
        RHT basis (its GEMM cancels the transform), so, as in TransformerEngine, it is not
        dequantized: :meth:`gemm_value` reads it in that basis."""
        if self._rowwise_data is None:
            self._out_dtype(dtype)
            raise NotImplementedError(
                "NVFP4 dequantization needs rowwise data; this storage holds only the "
                "columnwise form (quantize with rowwise_usage=True)"
            )
        return super().dequantize(dtype)

    def gemm_operand(self, transposed: bool) -> GemmOperand | None:
        """Rowwise ``[m, k/2]`` or columnwise ``[k, ceil(m/2)]`` packed data (columnwise in the
        RHT basis when the quantizer applied it: both wgrad operands share the transform, which
        cancels) with that direction's scales and amax. Row-scaled amaxes are not a GEMM
        operand of this form (``None``)."""
        m, k = m_k(self.shape)
        swz = bool(self._with_gemm_swizzled_scales)
        if transposed:
            data, scale, amax, rows, kk = (self._columnwise_data, self._columnwise_scale_inv,
                                           self._amax_columnwise, k, m)
        else:
            data, scale, amax, rows, kk = (self._rowwise_data, self._rowwise_scale_inv,
                                           self._amax_rowwise, m, k)
        if data is None or amax is None or amax.numel() != 1:
            return None
        return GemmOperand("nvfp4", data.reshape(rows, data.shape[-1]), scale, self._fp4_dtype,
                           rows, kk, swz, amax=amax)

    @classmethod
    def shard_plan(cls, q, shape, world, columnwise):
        """2D 16x16 weight blocks (the recipe's default), without stochastic rounding, in row
        blocks of 128: packed data and scale rows; the tensor amax is all-reduced and travels
        as metadata. The columnwise copy is the transposed codes with the transposed scales."""
        refusal = _swizzle_refusal(q)
        if refusal:
            return refusal
        if not q.with_2d_quantization or q.with_rht:
            return ("NVFP4 1x16 weight blocks: the columnwise copy is stored transposed and does "
                    "not gather along dim 0; use 2D 16x16 weight blocks (the recipe's default)")
        if q.stochastic_rounding:
            return "NVFP4 stochastic rounding: each rank's bytes depend on its random stream"
        refusal = row_blocks_refusal("NVFP4", shape, world)
        if refusal:
            return refusal
        row = q.replace(rowwise_usage=True, columnwise_usage=False, with_amax_reduction=False)
        return ShardPlan(row, ("_rowwise_data", "_rowwise_scale_inv"), ("_amax_rowwise",), True)

    @classmethod
    def columnwise_from_rowwise(cls, s, q) -> dict[str, torch.Tensor]:
        """With 2D 16x16 blocks and no RHT: the transposed codes with the transposed scales."""
        if not q.with_2d_quantization or q.with_rht or s._with_gemm_swizzled_scales:
            return super().columnwise_from_rowwise(s, q)
        m, k = m_k(s.shape)
        codes = unpack_e2m1(s._rowwise_data.reshape(m, k // 2))  # [m, k]
        codes = zero_pad(codes, m + m % 2, k).t()  # [k, m even], the last nibble 0
        per_block = s._rowwise_scale_inv[:m:NVFP4_BLOCK, :k // NVFP4_BLOCK]  # [ceil(m/16), k/16]
        cs = per_block.t().repeat_interleave(NVFP4_BLOCK, dim=0)  # [k, ceil(m/16)]
        return {**_present(cls, s), "_columnwise_data": pack_e2m1(codes.contiguous()),
                "_columnwise_scale_inv": zero_pad(cs, *nvfp4_columnwise_scale_shape(m, k)),
                "_amax_columnwise": s._amax_rowwise.clone()}


def _present(cls: type[QuantizedStorage], s) -> dict[str, torch.Tensor]:
    """The present buffers of ``s`` by attribute reads only (``s`` may be a quantized tensor
    that Dynamo traces, whose method calls it takes for tensor methods)."""
    return {n: getattr(s, n) for n in cls.buffer_names if getattr(s, n) is not None}


__all__ = [
    "QuantizedStorage", "Float8TensorStorage", "MXFP8TensorStorage",
    "Float8BlockwiseQTensorStorage", "NVFP4TensorStorage", "absent_buffer", "storage_class",
    "storage_formats",
]
