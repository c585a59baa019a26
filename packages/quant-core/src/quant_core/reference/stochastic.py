"""Stochastic rounding of NVFP4 elements (`numerics.md` §7.8) and its counter-based random bytes.

The random byte of an element is a pure function of ``(seed, index)`` so that every backend draws
the same bytes: a Triton kernel repeats :func:`sr_random_byte` with ``uint32`` arithmetic (whose
multiplications wrap modulo 2^32 by themselves) and gets the reference's bytes.
"""

from __future__ import annotations

import torch

_M32 = 0xFFFFFFFF
_M16 = 0xFFFF
#: Multipliers of Wellons' ``lowbias32`` integer hash.
_C1 = 0x7FEB352D
_C2 = 0x846CA68B
#: Starting value of the hash chain (the 32-bit golden ratio).
_IV = 0x9E3779B9


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """``(x * c) mod 2^32`` for int64 ``x`` in ``[0, 2^32)`` and a 32-bit constant ``c``.

    ``x = hi * 2^16 + lo`` gives ``x * c = lo * c + (hi * c) * 2^16``; only the low 16 bits of
    ``hi * c`` survive the shift modulo 2^32. Both partial products stay below 2^48 (no int64
    overflow).
    """
    lo = x & _M16
    hi = x >> 16
    return (lo * c + (((hi * c) & _M16) << 16)) & _M32


def _lowbias32(x: torch.Tensor) -> torch.Tensor:
    """Wellons' ``lowbias32`` bijection of 32-bit values (int64 in, int64 in ``[0, 2^32)`` out)."""
    x = x ^ (x >> 16)
    x = _mul32(x, _C1)
    x = x ^ (x >> 15)
    x = _mul32(x, _C2)
    return x ^ (x >> 16)


def sr_random_byte(seed: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """The random byte (int64 in ``[0, 256)``) of element ``index`` for ``seed`` (int64 ``(1,)``).

    Exact formula, all values 32-bit unsigned, ``*`` wrapping modulo 2^32, ``>>`` logical::

        lowbias32(x): x ^= x >> 16; x *= 0x7FEB352D; x ^= x >> 15; x *= 0x846CA68B; x ^= x >> 16
        s_lo, s_hi = seed & 0xFFFFFFFF, (seed >> 32) & 0xFFFFFFFF    # two's-complement int64 bits
        i_lo, i_hi = index & 0xFFFFFFFF, (index >> 32) & 0xFFFFFFFF  # index >= 0
        h = lowbias32(s_lo ^ 0x9E3779B9)
        h = lowbias32(h ^ s_hi)
        h = lowbias32(h ^ i_hi)
        h = lowbias32(h ^ i_lo)
        byte = h >> 24

    The first two steps depend on the seed only (a kernel computes them once per program).
    ``index`` may have any shape; the result has its shape.
    """
    seed = seed.to(torch.int64).reshape(-1)[:1]
    index = index.to(torch.int64)
    h = _lowbias32((seed & _M32) ^ _IV)
    h = _lowbias32(h ^ ((seed >> 32) & _M32))
    h = _lowbias32(h ^ ((index >> 32) & _M32))
    h = _lowbias32(h ^ (index & _M32))
    return (h >> 24).reshape(index.shape)


def sr_round_e2m1(v: torch.Tensor, rbyte: torch.Tensor) -> torch.Tensor:
    """Stochastic rounding of scaled fp32 ``v`` onto the E2M1 grid; returns fp32 grid values.

    §7.8 software definition: ``u = rbyte / 256``, ``a = |v|``, ``step = 2 | 1 | 0.5`` for
    ``a >= 4 | a >= 2 | else``, ``t = fma(u, step, a)``, ``step_t`` from ``t`` alike,
    ``q = min(floor(t / step_t) * step_t, 6)`` with the sign of ``v`` (-0.0 kept); NaN gives +6.
    """
    a = v.abs()
    u = rbyte.to(torch.float32) * (1.0 / 256.0)  # exact: a byte times 2^-8
    half = torch.full_like(a, 0.5)
    step = torch.where(a >= 4.0, 2.0, torch.where(a >= 2.0, 1.0, half))
    # fma(u, step, a) rounds the exact u*step + a once. u has at most 8 significant bits and step
    # is a power of two, so u*step is exact in fp32 (no rounding, no underflow: it is 0 or
    # >= 2^-9); hence the one rounding of the fp32 add below equals the fma.
    t = a + u * step
    step_t = torch.where(t >= 4.0, 2.0, torch.where(t >= 2.0, 1.0, half))
    # t / step_t divides by a power of two (exact; t < 2 when step_t = 0.5, Inf stays Inf).
    q = torch.clamp(torch.floor(t / step_t) * step_t, max=6.0)
    q = torch.where(torch.signbit(v), -q, q)
    return torch.where(torch.isnan(v), torch.full_like(q, 6.0), q)
