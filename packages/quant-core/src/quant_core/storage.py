"""Storage objects: the buffers a quantizer produces (`numerics.md` §9).

A storage is a plain Python object holding its buffers (``None`` for a direction not produced),
the logical shape and high-precision dtype of the input, the format tags, and the quantizer that
made it. ``dequantize(dtype=...)`` inverts it on any device through the backend registry.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from . import backends
from .dtypes import INPUT_DTYPES
from .operand import GemmOperand
from .shapes import m_k


def absent_buffer(like: torch.Tensor) -> torch.Tensor:
    """The stand-in for an absent buffer in a buffer list (positions stay stable): an empty
    uint8 tensor on ``like``'s device. A buffer list holds one per absent direction."""
    return like.new_empty((0,), dtype=torch.uint8)


class QuantizedStorage:
    """Base of the four storages.

    Subclasses list their tensor buffers in ``_buffer_names`` (declaration order is the order of
    ``prepare_for_saving``) and their non-tensor tags in ``_tag_names``.
    """

    _buffer_names: ClassVar[tuple[str, ...]] = ()
    _tag_names: ClassVar[tuple[str, ...]] = ()

    def __init__(self, *, shape, dtype: torch.dtype, quantizer, **kwargs: Any) -> None:
        self.shape = shape if type(shape) is torch.Size else torch.Size(shape)
        self._dtype = dtype
        self.quantizer = quantizer
        for name in self._buffer_names + self._tag_names:
            setattr(self, name, kwargs.pop(name, None))
        if kwargs:
            raise TypeError(
                f"{type(self).__name__}: unexpected buffers {sorted(kwargs)}; "
                f"allowed: {list(self._buffer_names + self._tag_names)}"
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
        return {name: getattr(self, name) for name in self._buffer_names}

    def buffer_list(self, like: torch.Tensor) -> list[torch.Tensor]:
        """The buffers in declaration order as a plain tensor list (what custom ops pass and
        return), an absent one as :func:`absent_buffer` on ``like``'s device."""
        return [absent_buffer(like) if t is None else t for t in self.buffers().values()]

    def prepare_for_saving(self) -> list[torch.Tensor | None]:
        """The buffers in declaration order, for ``ctx.save_for_backward``; fields become None."""
        saved = list(self.buffers().values())
        for name in self._buffer_names:
            setattr(self, name, None)
        return saved

    def restore_from_saved(self, tensors: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
        """Take this storage's buffers back from the front of ``tensors``; return the rest."""
        n = len(self._buffer_names)
        for name, t in zip(self._buffer_names, tensors[:n], strict=True):
            setattr(self, name, t)
        return tensors[n:]

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

    def gemm_operand(self, transposed: bool) -> GemmOperand | None:
        """This tensor as a GEMM row operand (``quant_core.operand``): the 2D view ``X [m, k]``
        itself, or ``Xᵀ`` when ``transposed`` (the contraction runs over ``m``), as views of the
        buffers of the direction whose blocks run along the contraction. ``None`` when those
        buffers are absent, or when the format cannot hand out that operand without a copy."""
        return None

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        raise NotImplementedError

    def __repr__(self) -> str:
        present = [n for n, t in self.buffers().items() if t is not None]
        return (
            f"{type(self).__name__}(shape={tuple(self.shape)}, dtype={self._dtype}, "
            f"buffers={present}, quantizer={self.quantizer!r})"
        )


def _pick(storage: QuantizedStorage, rowwise: str, columnwise: str) -> tuple[torch.Tensor, bool]:
    """The rowwise buffer if present, else the columnwise one; with a flag for which."""
    data = getattr(storage, rowwise)
    if data is not None:
        return data, False
    data = getattr(storage, columnwise)
    if data is None:
        raise RuntimeError(f"{type(storage).__name__} holds neither rowwise nor columnwise data")
    return data, True


class Float8TensorStorage(QuantizedStorage):
    """Per-tensor FP8 (current or delayed scaling): ``_data`` ``[shape]``, ``_transpose``
    ``[K, *leading]`` (byte transpose), ``_scale_inv`` fp32 ``(1,)``."""

    _buffer_names = ("_data", "_transpose", "_scale_inv")
    _tag_names = ("_fp8_dtype",)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = self._out_dtype(dtype)
        data, columnwise = _pick(self, "_data", "_transpose")
        out = self._backend().fp8_dequantize(
            data, self._scale_inv, fp8_dtype=self._fp8_dtype, dtype=dtype
        )
        return out.movedim(0, -1).contiguous() if columnwise else out

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


class MXFP8TensorStorage(QuantizedStorage):
    """MXFP8: rowwise and columnwise data ``[shape]`` (not transposed) with padded E8M0 scales."""

    _buffer_names = (
        "_rowwise_data", "_rowwise_scale_inv", "_columnwise_data", "_columnwise_scale_inv",
    )
    _tag_names = ("_fp8_dtype", "_with_gemm_swizzled_scales")

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = self._out_dtype(dtype)
        data, columnwise = _pick(self, "_rowwise_data", "_columnwise_data")
        scale = self._columnwise_scale_inv if columnwise else self._rowwise_scale_inv
        out = self._backend().mxfp8_dequantize(
            data.reshape(m_k(self.shape)), scale, fp8_dtype=self._fp8_dtype,
            columnwise=columnwise, swizzled=bool(self._with_gemm_swizzled_scales), dtype=dtype,
        )
        return out.reshape(self.shape)

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


class Float8BlockwiseQTensorStorage(QuantizedStorage):
    """FP8 1x128 / 128x128 blocks: rowwise ``[shape]``, columnwise ``[K, *leading]``, fp32
    scale-inverses in the GEMM-ready layouts."""

    _buffer_names = (
        "_rowwise_data", "_rowwise_scale_inv", "_columnwise_data", "_columnwise_scale_inv",
    )
    _tag_names = ("_fp8_dtype", "_is_2D_scaled")

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = self._out_dtype(dtype)
        data, columnwise = _pick(self, "_rowwise_data", "_columnwise_data")
        m, k = m_k(self.shape)
        scale = self._columnwise_scale_inv if columnwise else self._rowwise_scale_inv
        data2d = data.reshape(k, m) if columnwise else data.reshape(m, k)
        out = self._backend().fp8_block_dequantize(
            data2d, scale, fp8_dtype=self._fp8_dtype,
            block_scaling_dim=2 if self._is_2D_scaled else 1, columnwise=columnwise, dtype=dtype,
        )
        return out.reshape(self.shape)

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


class NVFP4TensorStorage(QuantizedStorage):
    """NVFP4: packed E2M1 data (two codes a byte, low nibble first), E4M3 block scales and the
    per-tensor amaxes ``_amax_rowwise`` / ``_amax_columnwise`` (fp32 ``(1,)``)."""

    _buffer_names = (
        "_rowwise_data", "_rowwise_scale_inv", "_columnwise_data", "_columnwise_scale_inv",
        "_amax_rowwise", "_amax_columnwise",
    )
    _tag_names = ("_fp4_dtype", "_with_gemm_swizzled_scales")

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Dequantize the rowwise data (`numerics.md` §8); columnwise NVFP4 may live in the RHT
        basis, so, as in TransformerEngine, it is not dequantized."""
        dtype = self._out_dtype(dtype)
        if self._rowwise_data is None:
            raise NotImplementedError(
                "NVFP4 dequantization needs rowwise data; this storage holds only the "
                "columnwise form (quantize with rowwise_usage=True)"
            )
        m, k = m_k(self.shape)
        out = self._backend().nvfp4_dequantize(
            self._rowwise_data.reshape(m, k // 2), self._rowwise_scale_inv, self._amax_rowwise,
            swizzled=bool(self._with_gemm_swizzled_scales), dtype=dtype,
        )
        return out.reshape(self.shape)

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
                           rows, kk,
                           swz, amax=amax)


__all__ = [
    "QuantizedStorage", "Float8TensorStorage", "MXFP8TensorStorage",
    "Float8BlockwiseQTensorStorage", "NVFP4TensorStorage",
]
