"""Storage objects: the buffers a quantizer produces (`numerics.md` §9).

A storage is a plain Python object holding its buffers (``None`` for a direction not produced),
the logical shape and high-precision dtype of the input, the format tags, and the quantizer that
made it. ``dequantize(dtype=...)`` inverts it on any device through the backend registry.
"""

from __future__ import annotations

from typing import Any, ClassVar

import torch

from . import backends
from .shapes import m_k


class QuantizedStorage:
    """Base of the four storages.

    Subclasses list their tensor buffers in ``_buffer_names`` (declaration order is the order of
    ``prepare_for_saving``) and their non-tensor tags in ``_tag_names``.
    """

    _buffer_names: ClassVar[tuple[str, ...]] = ()
    _tag_names: ClassVar[tuple[str, ...]] = ()

    def __init__(self, *, shape, dtype: torch.dtype, quantizer, **kwargs: Any) -> None:
        self.shape = torch.Size(shape)
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
        dtype = dtype or self._dtype
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


class MXFP8TensorStorage(QuantizedStorage):
    """MXFP8: rowwise and columnwise data ``[shape]`` (not transposed) with padded E8M0 scales."""

    _buffer_names = (
        "_rowwise_data", "_rowwise_scale_inv", "_columnwise_data", "_columnwise_scale_inv",
    )
    _tag_names = ("_fp8_dtype", "_with_gemm_swizzled_scales")

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = dtype or self._dtype
        data, columnwise = _pick(self, "_rowwise_data", "_columnwise_data")
        scale = self._columnwise_scale_inv if columnwise else self._rowwise_scale_inv
        out = self._backend().mxfp8_dequantize(
            data.reshape(-1, self.shape[-1]), scale, fp8_dtype=self._fp8_dtype,
            columnwise=columnwise, swizzled=bool(self._with_gemm_swizzled_scales), dtype=dtype,
        )
        return out.reshape(self.shape)


class Float8BlockwiseQTensorStorage(QuantizedStorage):
    """FP8 1x128 / 128x128 blocks: rowwise ``[shape]``, columnwise ``[K, *leading]``, fp32
    scale-inverses in the GEMM-ready layouts."""

    _buffer_names = (
        "_rowwise_data", "_rowwise_scale_inv", "_columnwise_data", "_columnwise_scale_inv",
    )
    _tag_names = ("_fp8_dtype", "_is_2D_scaled")

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        dtype = dtype or self._dtype
        data, columnwise = _pick(self, "_rowwise_data", "_columnwise_data")
        m, k = m_k(self.shape)
        scale = self._columnwise_scale_inv if columnwise else self._rowwise_scale_inv
        data2d = data.reshape(k, m) if columnwise else data.reshape(m, k)
        out = self._backend().fp8_block_dequantize(
            data2d, scale, fp8_dtype=self._fp8_dtype,
            block_scaling_dim=2 if self._is_2D_scaled else 1, columnwise=columnwise, dtype=dtype,
        )
        return out.reshape(self.shape)


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
        dtype = dtype or self._dtype
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


__all__ = [
    "QuantizedStorage", "Float8TensorStorage", "MXFP8TensorStorage",
    "Float8BlockwiseQTensorStorage", "NVFP4TensorStorage",
]
