"""The 16x16 Random Hadamard Transform of NVFP4's columnwise direction (`numerics.md` §7.6).

``R = diag(s) · H16 / 4`` with ``H_ij = (-1)^popcount(i & j)`` and the sign vector ``s`` encoded
by the 16-bit mask ``Σ_i [s_i == -1] · 2^i``. The transform maps each group ``v`` of 16
consecutive rows of one column of ``x`` (16 consecutive elements of a row of ``xᵀ``) to
``v · R``: the exact sum, rounded once to fp32 (RNE, overflow to ±Inf), then to bf16 (RNE); a
sum of ±0 terms is +0.
"""

from __future__ import annotations

import functools

import torch

from ..inputs import check_rht_input
from ..kernel_capture import capturing

RHT_SIZE = 16
#: TE's fixed sign vector (``with_random_sign_mask=True``); all ones is mask 0.
DEFAULT_SIGNS = (1, 1, 1, -1, 1, -1, -1, -1, -1, -1, -1, 1, -1, 1, -1, -1)


def mask_to_signs(sign_mask: int) -> tuple[int, ...]:
    """The sign vector ``s`` (16 entries ±1) of a 16-bit mask: ``s_i = -1`` iff bit ``i`` is set."""
    if not 0 <= int(sign_mask) < 1 << RHT_SIZE:
        raise ValueError(f"RHT sign mask must be a 16-bit integer, got {sign_mask!r}")
    return tuple(-1 if (int(sign_mask) >> i) & 1 else 1 for i in range(RHT_SIZE))


def signs_to_mask(signs) -> int:
    """The 16-bit mask ``Σ_i [s_i == -1] · 2^i`` of a sign vector of 16 entries ±1."""
    signs = [int(s) for s in signs]
    if len(signs) != RHT_SIZE or any(s not in (1, -1) for s in signs):
        raise ValueError(f"RHT signs must be 16 entries of ±1, got {signs!r}")
    return sum(1 << i for i, s in enumerate(signs) if s == -1)


@functools.cache
def rht_matrix(sign_mask: int, device) -> torch.Tensor:
    """``R = diag(s) · H16 / 4`` as bf16 ``[16, 16]`` (entries ±0.25, exact), cached per call key.

    Treat the result as read-only: it is shared between callers.
    """
    signs = torch.tensor(mask_to_signs(sign_mask), dtype=torch.float32, device=device)
    i = torch.arange(RHT_SIZE, device=device)
    both = i[:, None] & i[None, :]
    parity = (both ^ (both >> 1) ^ (both >> 2) ^ (both >> 3)) & 1  # popcount(i & j) mod 2
    h = 1.0 - 2.0 * parity.to(torch.float32)
    return (signs[:, None] * h * 0.25).to(torch.bfloat16)


def rht_columnwise(x: torch.Tensor, sign_mask: int) -> torch.Tensor:
    """The RHT of ``xᵀ``: bf16 ``[K, M]`` from bf16 ``x`` ``[M, K]`` with ``M % 16 == 0``.

    ``out[k, 16g + j] = bf16(fp32(Σ_i x[16g + i, k] · R[i, j]))`` with the sum exact.
    """
    check_rht_input(x)
    m, k = x.shape
    # Traced (Dynamo, or a lowering's capture) R is built in the graph: a cached tensor made
    # while tracing is a fake tensor of that trace, and Dynamo does not honour the cache wrapper.
    traced = torch.compiler.is_compiling() or capturing()
    build = rht_matrix.__wrapped__ if traced else rht_matrix
    r = build(int(sign_mask), x.device).to(torch.float64)
    v = x.t().to(torch.float64).reshape(k, m // RHT_SIZE, RHT_SIZE)
    # §7.6: the exact sum of the 16 products, rounded once to fp32, then to bf16. Each product
    # x_i * (±0.25) is exact in fp64, and so is any partial sum of them unless the group's
    # magnitudes span more than 2^45 (then fp64 can differ from the exact sum only on an fp32
    # rounding tie), so the order of the fp64 matmul's reduction is free and nothing overflows.
    acc = v @ r
    # An exact sum of ±0 terms (or one that cancels to zero) is +0, as from an accumulator that
    # starts at +0; a reduction over -0 terms alone would give -0.
    acc = torch.where(acc == 0, torch.zeros_like(acc), acc)
    return acc.to(torch.float32).to(torch.bfloat16).reshape(k, m)
