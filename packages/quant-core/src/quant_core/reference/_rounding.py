"""Every rounding rule of the reference: one helper per rule, mirroring the kernels'
``quant_kernels._rounding`` one to one (`numerics.md`).

- Widening (§0): :func:`to_fp32`, the fp32 value of an input read from its stored bits (kernels:
  ``widen``).
- FP8 cast (§2): :func:`fp8_encode`, :func:`fp8_decode` (kernels: ``fp8_rne_sat``,
  ``fp8_decode``).
- fp32 bits and NaN-dropping maxima (§10): :func:`f32_bits`, :func:`f32_from_bits`,
  :func:`nan_to_zero_abs` (kernels: ``f32_bits``, ``f32_from_bits``, ``abs_nan0``).
- E8M0 scales (§5): :func:`e8m0_roundup`, :func:`e8m0_to_encode_multiplier`,
  :func:`e8m0_to_scale` (kernels: ``e8m0_roundup``, ``e8m0_encode_mult``, ``e8m0_decode``).
- E2M1 elements (§7.4, §7.8): :func:`e2m1_encode`, :func:`sr_round_e2m1`, :func:`e2m1_decode`
  (kernels: ``e2m1_rne``, ``e2m1_sr``, ``e2m1_decode``).
- Scales from amaxes (§3 step 3, §6): :func:`compute_scale_from_amax` and the correctly rounded
  division :func:`div_rn` (kernels: ``scale_from_amax``, ``scale_inverse``).
- Stochastic rounding's random bytes (§7.8): :func:`sr_random_byte` over Wellons' ``lowbias32``
  (kernels: ``lowbias32``, ``sr_seed_state``, ``sr_random_byte``). The random byte of an element
  is a pure function of ``(seed, index)`` so that every backend draws the same bytes: a Triton
  kernel repeats :func:`sr_random_byte` with ``uint32`` arithmetic (whose multiplications wrap
  modulo 2^32 by themselves) and gets the reference's bytes.

These functions are also what compiled graphs run where a quantizer's lowering is ``"ops"``
(:meth:`quant_core.Quantizer.lowerings`): Inductor compiles them into its own kernels, fused with
their neighbours, so each is written to compile to the same bytes. Inputs are read through
:func:`to_fp32`, a clamp is written as comparisons (no NaN-propagating maximum next to an FP8
store, numerics.md "Known traps"), a division is an fp64 division rounded once (Inductor's fp32
``/`` is approximate on CUDA), and no rule multiplies and then adds (a compiler may contract the
two into one FMA).

The kernels' cast helpers that add no rule (``bf16_rne``, ``bf16_round``, ``to_out``,
``mul_rn``) have no counterpart: torch's casts are exact or round to nearest-even, and
torch never contracts a multiply into a following add.
"""

from __future__ import annotations

import torch

from ..constants import POW2_MINUS_127_BITS
from ..dtypes import DType, check_fp8

#: The byte every FP8 NaN is written as (E4M3 and E5M2 alike: sign 0, all exponent and mantissa
#: bits set).
CANONICAL_NAN = 0x7F


def fp8_encode(v: torch.Tensor, fp8_dtype: DType) -> torch.Tensor:
    """``fp8_satfinite_rne(v)`` of fp32 ``v`` as raw uint8 bytes (§2): clamp to ±max, RNE cast.

    ``clamp`` keeps NaN and maps ±Inf to ±max, so clamp + torch's RNE cast equals the hardware's
    ``cvt.rn.satfinite``; the clamp is needed on every torch (pre-2.13 E4M3 casts give NaN above
    480, E5M2 casts overflow to Inf).
    """
    check_fp8(fp8_dtype, "fp8_dtype")
    if v.dtype != torch.float32:
        raise TypeError(f"fp8_encode expects fp32 values, got {v.dtype}")
    fmax = fp8_dtype.max
    # the clamp as comparisons, which NaN fails (it stays NaN): a compiled clamp is a
    # NaN-propagating maximum, which Triton mis-lowers next to a transposed FP8 store
    clamped = torch.where(v > fmax, fmax, torch.where(v < -fmax, -fmax, v))
    data = clamped.to(fp8_dtype.torch_dtype).view(torch.uint8)
    # NaN becomes the canonical positive NaN 0x7F: the sign of a NaN differs between CPU and CUDA
    # arithmetic, and one byte per NaN keeps every backend's buffers bytewise comparable.
    return torch.where(torch.isnan(v), torch.full_like(data, CANONICAL_NAN), data)


def fp8_decode(data: torch.Tensor, fp8_dtype: DType) -> torch.Tensor:
    """fp32 values of raw FP8 bytes."""
    check_fp8(fp8_dtype, "fp8_dtype")
    return data.view(fp8_dtype.torch_dtype).to(torch.float32)


def f32_bits(v: torch.Tensor) -> torch.Tensor:
    """The IEEE bits of fp32 ``v`` as int64 in ``[0, 2^32)``."""
    return v.contiguous().view(torch.int32).to(torch.int64) & 0xFFFFFFFF


def f32_from_bits(bits: torch.Tensor) -> torch.Tensor:
    """fp32 values whose IEEE bits are ``bits`` (int64 in ``[0, 2^32)``)."""
    b = bits & 0xFFFFFFFF
    b = torch.where(b >= 2**31, b - 2**32, b)
    return b.to(torch.int32).view(torch.float32)


def to_fp32(x: torch.Tensor) -> torch.Tensor:
    """``float(x)`` of an fp32, bf16 or fp16 tensor, computed from the stored bits of bf16 and
    fp16 (exact: every bf16 and fp16 value is an fp32 value).

    Reading the bits pins the value a compiler must use. Inductor computes a fused producer of a
    low-precision tensor in fp32 and may skip its rounding to the stored dtype, so a
    quantization fused with its producer would otherwise read other values than eager mode does.
    """
    if x.dtype == torch.float32:
        return x
    if x.dtype == torch.bfloat16:  # bf16 is the upper half of an fp32
        return (x.contiguous().view(torch.int16).to(torch.int32) << 16).view(torch.float32)
    if x.dtype != torch.float16:
        raise TypeError(f"to_fp32 expects fp32, bf16 or fp16, got {x.dtype}")
    bits = x.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF
    exponent, mantissa = (bits >> 10) & 0x1F, bits & 0x3FF
    # normal: rebias the exponent (15 -> 127); Inf/NaN: all-ones exponent; both keep the mantissa
    wide = torch.where(exponent == 0x1F, torch.full_like(bits, 0xFF), exponent + 112)
    normal = (wide << 23) | (mantissa << 13)
    subnormal = (mantissa.to(torch.float32) * 2.0**-24).view(torch.int32)  # m * 2^-24: exact
    magnitude = torch.where(exponent == 0, subnormal, normal)
    # the sign as a bit, not a negation: a compiled negation is 0 - x, which loses -0.0
    return (magnitude | ((bits & 0x8000) << 16)).view(torch.float32)


def nan_to_zero_abs(x: torch.Tensor) -> torch.Tensor:
    """``|float(x)|`` with NaN mapped to 0, so maxima drop NaN as TE's ``fmaxf`` does (§10)."""
    a = to_fp32(x).abs()
    return torch.where(torch.isnan(a), torch.zeros_like(a), a)


E8M0_NAN = 255


def e8m0_roundup(v: torch.Tensor) -> torch.Tensor:
    """E8M0 byte of fp32 ``v >= 0``, rounding UP with satfinite (``cvt.rp.satfinite.ue8m0``).

    NaN -> 255, Inf -> 254, 0 -> 0; else the biased exponent ``E`` plus one when the mantissa is
    non-zero, except at ``E == 254`` (saturate) and for subnormals ``<= 2^-127`` (byte 0).
    Built from the bits: torch's e8m0 cast rounds to nearest.
    """
    bits = f32_bits(v.to(torch.float32)) & 0x7FFFFFFF
    exponent, mantissa = bits >> 23, bits & 0x7FFFFF
    bump = (mantissa > 0) & (exponent != 254) & ~((exponent == 0) & (mantissa <= 0x400000))
    e = exponent + bump.to(torch.int64)
    e = torch.where(v == 0, torch.zeros_like(e), e)
    e = torch.where(torch.isinf(v), torch.full_like(e, 254), e)
    e = torch.where(torch.isnan(v), torch.full_like(e, E8M0_NAN), e)
    return e.to(torch.uint8)


def _pow2(biased: torch.Tensor) -> torch.Tensor:
    """fp32 ``2^(biased - 127)`` for int64 ``biased`` in ``[0, 254]``, from exponent bits;
    ``biased == 0`` is the subnormal 2^-127 (the plain ``biased << 23`` would give 0)."""
    bits = torch.where(biased >= 1, biased << 23, torch.full_like(biased, POW2_MINUS_127_BITS))
    return f32_from_bits(bits)


def e8m0_to_encode_multiplier(e: torch.Tensor) -> torch.Tensor:
    """``s_inv = 2^(127 - e)``: 0 -> 2^127, 254 -> 2^-127 (subnormal), 255 -> NaN."""
    e = e.to(torch.int64)
    s_inv = _pow2((254 - e).clamp(min=0))
    return torch.where(e == E8M0_NAN, torch.full_like(s_inv, float("nan")), s_inv)


def e8m0_to_scale(e: torch.Tensor) -> torch.Tensor:
    """Decode scale ``2^(e - 127)``: 0 -> 2^-127 (subnormal), 255 -> NaN."""
    e = e.to(torch.int64)
    scale = _pow2(e.clamp(max=254))
    return torch.where(e == E8M0_NAN, torch.full_like(scale, float("nan")), scale)


#: E2M1 magnitudes of codes 0..7, then the negative codes 8..15 (bit 3 is the sign).
_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def e2m1_encode(v: torch.Tensor) -> torch.Tensor:
    """E2M1 RNE satfinite codes (int64 0..15) of fp32 ``v`` (§7.4).

    Interval table of the ties-to-even rule: ``[0, 0.25]``→0, ``(0.25, 0.75)``→0.5,
    ``[0.75, 1.25]``→1, ``(1.25, 1.75)``→1.5, ``[1.75, 2.5]``→2, ``(2.5, 3.5)``→3, ``[3.5, 5]``→4,
    ``(5, ∞]``→6. Bit 3 is the sign bit of ``v`` (-0.0 gives 0x8); NaN gives +6 (0x7).
    """
    a = v.abs()
    mag = (
        (a > 0.25).to(torch.int64)
        + (a >= 0.75)
        + (a > 1.25)
        + (a >= 1.75)
        + (a > 2.5)
        + (a >= 3.5)
        + (a > 5.0)
    )
    code = mag + torch.signbit(v).to(torch.int64) * 8
    return torch.where(torch.isnan(v), torch.full_like(code, 7), code)


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


def e2m1_decode(codes: torch.Tensor) -> torch.Tensor:
    """fp32 values of E2M1 codes 0..15 (integer tensor)."""
    table = torch.tensor(_E2M1_VALUES, dtype=torch.float32, device=codes.device)
    table = torch.cat([table, -table])
    return table[codes.to(torch.int64)]


#: ``bits(scale) & POW2_MASK`` floors a positive fp32 to a power of two (keeps sign and exponent).
POW2_MASK = 0xFF800000


def div_rn(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``fp32(a / b)``, correctly rounded, for fp32 tensors (``__fdiv_rn``).

    Computed as an fp64 division rounded once to fp32: exact for division because 53 >= 2*24 + 2
    makes the double rounding innocuous. This keeps the result correct where fp32 division is not
    (Triton's and so Inductor's fp32 ``/`` is approximate on CUDA). Never write ``c / tensor``
    with a Python ``c``: torch evaluates it as ``reciprocal(tensor) * c``, two roundings.
    """
    return (a.to(torch.float64) / b.to(torch.float64)).to(torch.float32)


def compute_scale_from_amax(
    amax_: torch.Tensor,
    fp8_max: float,
    *,
    force_pow_2_scales: bool,
    amax_epsilon: float,
    value_for_inf: float,
) -> torch.Tensor:
    """TE's ``compute_scale_from_amax`` (§3 step 3), elementwise over an fp32 amax tensor.

    ``amax < eps`` becomes ``eps``; Inf, 0 or NaN give 1.0; else ``fp32(fp8_max / amax)``, Inf
    replaced by ``value_for_inf``, then floored to a power of two (mask 0xFF800000) if asked.
    """
    a = amax_.to(torch.float32)
    eps = torch.full_like(a, amax_epsilon)  # the fp32 epsilon, as TE's float parameter
    a = torch.where(a < eps, eps, a)
    scale = div_rn(torch.full_like(a, fp8_max), a)
    scale = torch.where(torch.isinf(scale), torch.full_like(scale, value_for_inf), scale)
    if force_pow_2_scales:
        scale = f32_from_bits(f32_bits(scale) & POW2_MASK)
    unscalable = torch.isinf(a) | (a == 0) | torch.isnan(a)
    return torch.where(unscalable, torch.ones_like(scale), scale)


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
