"""Fake (meta) outputs of ``quant::quantize``: exact buffer shapes and dtypes per format.

Mirrors what each quantizer's ``quantize`` allocates (`numerics.md` §3–§7, shapes from
:mod:`quant_core.shapes`): every buffer is uint8 (FP8 data as raw bytes, E8M0/E4M3 scales as
bytes) except FP8 scale-inverses and NVFP4 amaxes, which are fp32. An absent direction is an empty
uint8 tensor, as in the real kernel.
"""

from __future__ import annotations

from typing import Any

import torch
from quant_core import shapes
from quant_core.quantizers import (
    Float8BlockQuantizer,
    Float8CurrentScalingQuantizer,
    Float8Quantizer,
    MXFP8Quantizer,
    NVFP4Quantizer,
)

_U8 = torch.uint8
_F32 = torch.float32


def _m_k(x: torch.Tensor) -> tuple[int, int]:
    k = x.shape[-1]
    return (x.numel() // k if k else 0), k


def _transposed(shape: torch.Size) -> tuple[int, ...]:
    return (shape[-1], *shape[:-1])


def _specs(x: torch.Tensor, q: Any) -> list[tuple[tuple[int, ...], torch.dtype] | None]:
    """``(shape, dtype)`` per buffer in storage order, ``None`` where absent."""
    m, k = _m_k(x)
    row, col = q.rowwise_usage, q.columnwise_usage
    shape = tuple(x.shape)
    if isinstance(q, (Float8CurrentScalingQuantizer, Float8Quantizer)):
        return [(shape, _U8) if row else None, (_transposed(x.shape), _U8) if col else None,
                ((1,), _F32)]
    if isinstance(q, MXFP8Quantizer):
        return [
            (shape, _U8) if row else None,
            (shapes.mxfp8_rowwise_scale_shape(m, k), _U8) if row else None,
            (shape, _U8) if col else None,
            (shapes.mxfp8_columnwise_scale_shape(m, k), _U8) if col else None,
        ]
    if isinstance(q, Float8BlockQuantizer):
        dim = q.block_scaling_dim
        return [
            (shape, _U8) if row else None,
            (shapes.fp8_block_rowwise_scale_shape(m, k, dim), _F32) if row else None,
            (_transposed(x.shape), _U8) if col else None,
            (shapes.fp8_block_columnwise_scale_shape(m, k, dim), _F32) if col else None,
        ]
    if isinstance(q, NVFP4Quantizer):
        return [
            ((*x.shape[:-1], k // 2), _U8) if row else None,
            (shapes.nvfp4_rowwise_scale_shape(m, k), _U8) if row else None,
            (shapes.nvfp4_columnwise_data_shape(m, k), _U8) if col else None,
            (shapes.nvfp4_columnwise_scale_shape(m, k), _U8) if col else None,
            ((1,), _F32) if row else None,
            ((1,), _F32) if col else None,
        ]
    raise NotImplementedError


def quantize_buffers(x: torch.Tensor, q: Any) -> list[torch.Tensor]:
    """Empty tensors shaped like ``quant::quantize``'s outputs for ``q`` on ``x``.

    A quantizer of another family is quantized on the fake tensor itself (its ``quantize`` must
    then be traceable under FakeTensorMode).
    """
    try:
        specs = _specs(x, q)
    except NotImplementedError:
        storage = q.quantize(x)
        return [
            x.new_empty((0,), dtype=_U8) if t is None else torch.empty_like(t)
            for t in storage.buffers().values()
        ]
    return [
        x.new_empty((0,), dtype=_U8) if s is None else x.new_empty(s[0], dtype=s[1])
        for s in specs
    ]
