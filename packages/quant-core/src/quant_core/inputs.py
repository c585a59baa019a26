"""Validation of high-precision inputs, shared by every quantizer."""

from __future__ import annotations

import torch

from .dtypes import INPUT_DTYPES


def as_2d(x: torch.Tensor, fmt: str, k_multiple: int = 1) -> torch.Tensor:
    """The contiguous ``[M, K]`` view of ``x`` (``M`` = product of the leading dims).

    Raises ``TypeError`` for a non-tensor or a dtype other than fp32/bf16/fp16, and ``ValueError``
    for a 0-d tensor or a last dim that is not a multiple of ``k_multiple`` (naming ``fmt``).
    Non-contiguous inputs are copied to a contiguous layout (same values, same result).
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{fmt}: expected a torch.Tensor, got {type(x).__name__}")
    if x.dtype not in INPUT_DTYPES:
        allowed = ", ".join(str(d) for d in INPUT_DTYPES)
        raise TypeError(f"{fmt}: input dtype must be one of {allowed}; got {x.dtype}")
    if x.dim() == 0:
        raise ValueError(f"{fmt}: input must have at least one dimension, got a 0-d tensor")
    k = x.shape[-1]
    if k % k_multiple:
        raise ValueError(
            f"{fmt}: the last dimension must be a multiple of {k_multiple}, got shape "
            f"{tuple(x.shape)} (K = {k})"
        )
    return x.contiguous().reshape(x.shape[:-1].numel(), k)


def transposed_shape(shape: torch.Size) -> tuple[int, ...]:
    """``[K, *leading]``: the shape of a columnwise buffer stored transposed."""
    return (shape[-1], *shape[:-1])
