"""Shared element encoders and decoders: ONE ``@triton.jit`` helper per rounding rule.

Two paths per cast rule, chosen at import by the constexprs ``NATIVE_FP8`` / ``NATIVE`` (the
``_common.NATIVE_FP8_CASTS`` / ``NATIVE_BF16_CASTS`` switches): on a real GPU the hardware casts
(fp32 -> e4m3/e5m2, RNE satfinite; fp32 <-> bf16, RNE); under the
interpreter (whose fp8 cast rounds wrongly, `numerics.md` Known traps) software rounding (an exact
power-of-two grid add, integer bit tricks). tests/gpu/test_kernels_vs_reference.py sweeps both
paths over all 2^32 fp32 inputs. Maxima drop NaN (``abs_nan0``, or ``abs_for_max`` then
``nan_to_0``), never through a NaN-propagating maximum.
"""

from __future__ import annotations

import triton
import triton.language as tl
from quant_core import constants as C

from ._common import interpreting, native_bf16, native_fp8

#: Native casts in every kernel (False under the interpreter, or by the ``_common`` constants).
NATIVE_FP8 = tl.constexpr(native_fp8())
NATIVE = tl.constexpr(native_bf16())
#: Compiled for a GPU (inline PTX is available), not run by the interpreter.
ON_GPU = tl.constexpr(not interpreting())
#: The constants of ``quant_core.constants`` as constexprs (one definition for both sides).
FLT_MAX = tl.constexpr(C.FLT_MAX)
E4M3_MAX = tl.constexpr(C.E4M3_MAX)
E5M2_MAX = tl.constexpr(C.E5M2_MAX)
#: fp32(1/448), fp32(1/57344) (MXFP8 multiplies by these, §5) and fp32(1/6) (NVFP4, §7.3).
RCP_E4M3 = tl.constexpr(C.RCP_E4M3)
RCP_E5M2 = tl.constexpr(C.RCP_E5M2)
RCP_6 = tl.constexpr(C.RCP_E2M1_MAX)
#: 2688 = 6 * 448, NVFP4's per-tensor encode numerator, and fp32(1/2688) for decoding (§7, §8).
NVFP4_GLOBAL_MAX = tl.constexpr(C.NVFP4_GLOBAL_MAX)
RCP_2688 = tl.constexpr(C.RCP_NVFP4_GLOBAL_MAX)
#: fp32(1/1536): with ``RCP_2688``, the reciprocals of 4over6's error divisors ``6 * E`` (§7.9).
RCP_1536 = tl.constexpr(C.rcp_f32(1536.0))
#: The fp32 bit pattern of 2^-127 (E8M0 byte 0 decoded, §5).
POW2_MINUS_127_BITS = tl.constexpr(C.POW2_MINUS_127_BITS)


@triton.jit
def widen(x):
    """``float(x)``: exact fp32 of an fp32/bf16/fp16 tensor. Software path: bf16 is widened on
    its bits (the interpreter's bf16 -> fp32 cast mangles subnormals)."""
    if NATIVE:
        return x.to(tl.float32)
    elif x.dtype == tl.bfloat16:
        return ((x.to(tl.int16, bitcast=True).to(tl.int32) & 0xFFFF) << 16).to(tl.float32,
                                                                               bitcast=True)
    else:
        return x.to(tl.float32)


@triton.jit
def abs_nan0(x):
    """``|float(x)|`` with NaN mapped to 0 (NaN-dropping maxima, §10). Native path: one
    ``max.f32(|x|, 0)``, which returns the non-NaN operand (no ``propagate_nan``); the
    interpreter's numpy maximum propagates NaN, hence the ``tl.where`` there."""
    a = tl.abs(widen(x))
    if NATIVE:
        return tl.maximum(a, 0.0)
    else:
        return tl.where(a == a, a, 0.0)


@triton.jit
def abs_for_max(x):
    """``|float(x)|`` to feed NaN-dropping maxima (``tl.max`` / ``tl.maximum``), then
    ``nan_to_0``. Native path: NaN is kept, because ``max.f32`` returns the non-NaN operand (a
    max over a block is NaN only when every element is), and ``|.|`` folds into the max
    instruction; interpreter: NaN -> 0 (numpy's maximum propagates NaN)."""
    if NATIVE:
        return tl.abs(widen(x))
    else:
        return abs_nan0(x)


@triton.jit
def nan_to_0(t):
    """A maximum of ``abs_for_max`` values with the all-NaN case (NaN) mapped to 0."""
    if NATIVE:
        return tl.maximum(t, 0.0)
    else:
        return t


@triton.jit
def f32_bits(v):
    return v.to(tl.int32, bitcast=True)


@triton.jit
def f32_from_bits(b):
    return b.to(tl.float32, bitcast=True)


@triton.jit
def fp8_rne_sat(v, IS_E4M3: tl.constexpr):
    """``fp8_satfinite_rne(v)`` of fp32 ``v`` as its uint8 byte (§2), NaN -> an FP8 NaN (0x7F
    in software; the hardware's NaN natively): the native or the software encoder."""
    if NATIVE_FP8:
        return fp8_native(v, IS_E4M3)
    else:
        return fp8_soft(v, IS_E4M3)


@triton.jit
def fp8_native(v, IS_E4M3: tl.constexpr):
    """The hardware RNE satfinite cast alone (Triton lowers fp32 -> e4m3/e5m2 to
    ``cvt.rn.satfinite.e4m3x2/e5m2x2.f32``): ±Inf and overflow become ±max, NaN stays an FP8
    NaN (`numerics.md` §2: clamp + cast equals satfinite + RNE; NaN compares by NaN-ness, §10).
    GPU only: the interpreter's cast rounds wrongly."""
    if IS_E4M3:
        return v.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        return v.to(tl.float8e5).to(tl.uint8, bitcast=True)


@triton.jit
def fp8_rne_sat_t(v, IS_E4M3: tl.constexpr):
    """``fp8_rne_sat`` for bytes stored TRANSPOSED. Native path: clamp to ±max, cast, NaN ->
    0x7F by a select on the byte. Triton 3.6 on H200 writes garbage (0x7F) into a transposed
    1-byte store fed by the bare cast, or by the cast plus the select alone, on fp32 inputs
    (bench/RESULTS.md; akin to triton-lang/triton#11111); this form was byte-exact in every GPU
    check."""
    if NATIVE_FP8:
        if IS_E4M3:
            MAXV: tl.constexpr = E4M3_MAX
        else:
            MAXV: tl.constexpr = E5M2_MAX
        b = fp8_native(tl.minimum(tl.maximum(v, -MAXV), MAXV), IS_E4M3)
        return tl.where(v == v, b, tl.full(b.shape, 0x7F, tl.uint8))
    else:
        return fp8_soft(v, IS_E4M3)


@triton.jit
def fp8_soft(v, IS_E4M3: tl.constexpr):
    """Software ``fp8_satfinite_rne(v)`` of fp32 ``v`` as its uint8 byte (§2).

    Exact grid rounding, then a cast of an exactly representable value: ``|v|`` is clamped to
    the max (Inf too), rounded to the format's quantum by ``(a + c) - c`` with
    ``c = 2^(exponent(a) + 23 - MB)`` (floored at the subnormal quantum's ``c``): one IEEE add
    rounds to nearest-even at exactly the quantum, the subtraction is exact. The sign is put
    back on the bits (-0.0 kept) and NaN becomes 0x7F; the final cast to FP8 rounds nothing, so
    the interpreter's faulty fp8 rounding is never exercised.
    """
    if IS_E4M3:
        MAXV: tl.constexpr = E4M3_MAX
        CSHIFT: tl.constexpr = 20 << 23  # (23 - MB) << 23
        CMIN: tl.constexpr = 0x46800000  # 2^14 = subnormal quantum 2^-9 times 2^23
    else:
        MAXV: tl.constexpr = E5M2_MAX
        CSHIFT: tl.constexpr = 21 << 23
        CMIN: tl.constexpr = 0x43000000  # 2^7 = subnormal quantum 2^-16 times 2^23
    bits = f32_bits(v)
    a = tl.abs(v)
    a = tl.where(a < MAXV, a, MAXV)  # Inf and NaN -> max (NaN restored below)
    c = f32_from_bits(tl.maximum((f32_bits(a) & 0x7F800000) + CSHIFT, CMIN))
    r = (a + c) - c
    q = f32_from_bits(f32_bits(r) | (bits & -2147483648))
    if IS_E4M3:
        b = q.to(tl.float8e4nv).to(tl.uint8, bitcast=True)
    else:
        b = q.to(tl.float8e5).to(tl.uint8, bitcast=True)
    return tl.where(v != v, 0x7F, b.to(tl.int32)).to(tl.uint8)


@triton.jit
def fp8_decode(b, IS_E4M3: tl.constexpr):
    """fp32 value of FP8 byte(s) ``b`` (any int dtype holding 0..255); exact. Native path: the
    hardware widening (``cvt.rn.f16x2.e4m3x2`` / e5m2 -> f16, exact for all 256 codes, NaN and
    Inf kept), then f16 -> f32."""
    if NATIVE_FP8:
        if IS_E4M3:
            return b.to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)
        else:
            return b.to(tl.uint8).to(tl.float8e5, bitcast=True).to(tl.float32)
    b = b.to(tl.int32) & 0xFF
    if IS_E4M3:
        MB: tl.constexpr = 3
        BIAS: tl.constexpr = 7
        SUBQ: tl.constexpr = 0.001953125  # 2^-9
    else:
        MB: tl.constexpr = 2
        BIAS: tl.constexpr = 15
        SUBQ: tl.constexpr = 1.52587890625e-05  # 2^-16
    mag = b & 0x7F
    e = mag >> MB
    m = mag & ((1 << MB) - 1)
    normal = f32_from_bits(((e + (127 - BIAS)) << 23) | (m << (23 - MB)))
    val = tl.where(e == 0, m.to(tl.float32) * SUBQ, normal)
    if IS_E4M3:
        val = tl.where(mag == 0x7F, float("nan"), val)
    else:
        val = tl.where(e == 31, tl.where(m == 0, float("inf"), float("nan")), val)
    return f32_from_bits(f32_bits(val) | ((b & 0x80) << 24))  # sign bit (keeps -0.0)


@triton.jit
def e8m0_roundup(v):
    """E8M0 byte (int32) of fp32 ``v >= 0``, rounding UP with satfinite (§5 step 3)."""
    bits = f32_bits(v) & 0x7FFFFFFF
    e = bits >> 23
    m = bits & 0x7FFFFF
    up = (m > 0) & (e != 254) & ~((e == 0) & (m <= 0x400000))
    r = tl.where(up, e + 1, e)
    r = tl.where(bits == 0x7F800000, 254, r)
    return tl.where(bits > 0x7F800000, 255, r)


@triton.jit
def e8m0_encode_mult(e):
    """Encode multiplier ``2^(127 - e)`` of E8M0 byte ``e`` (254 -> 2^-127, 255 -> NaN)."""
    s = f32_from_bits((254 - e) << 23)
    s = tl.where(e == 254, f32_from_bits(tl.full(e.shape, POW2_MINUS_127_BITS, tl.int32)), s)
    return tl.where(e == 255, float("nan"), s)


@triton.jit
def e8m0_decode(e):
    """Decode scale ``2^(e - 127)`` of E8M0 byte ``e`` (0 -> 2^-127, 255 -> NaN)."""
    e = e.to(tl.int32) & 0xFF
    s = f32_from_bits(e << 23)
    s = tl.where(e == 0, f32_from_bits(tl.full(e.shape, POW2_MINUS_127_BITS, tl.int32)), s)
    return tl.where(e == 255, float("nan"), s)


@triton.jit
def e2m1_rne_with_value(v):
    """E2M1 code (int32, sign in bit 3) of fp32 ``v``: RNE, satfinite, NaN -> +6 (§7.4, §10),
    and the code's fp32 value (``e2m1_decode`` of it, without decoding).

    ``a = min(|v|, 6)`` is rounded onto the E2M1 grid by one IEEE add, ``(a + c) - c`` with
    ``c = 2^(exponent(a) + 22)`` floored at ``2^22`` (quantum 0.5 below 2, 1 in [2, 4), 2 from
    4), which ties to even exactly as E2M1 does. Scaled by 2^-126 the grid value's fp32 bits
    (subnormal for 0.5) are the code shifted left by 22; the value is the grid value with
    ``v``'s sign.
    """
    if NATIVE:  # min.f32 returns the non-NaN operand: NaN -> +FLT_MAX -> code 7, one op
        v = tl.minimum(v, FLT_MAX)
    a = tl.minimum(tl.abs(v), 6.0)
    c = f32_from_bits(tl.maximum((f32_bits(a) & 0x7F800000) + (22 << 23), 0x4A800000))
    r = (a + c) - c
    sign = f32_bits(v) & -2147483648
    code = (f32_bits(r * 1.1754943508222875e-38) >> 22) | ((sign >> 28) & 8)
    value = f32_from_bits(f32_bits(r) | sign)
    if NATIVE:
        return code, value
    else:
        nan = v != v
        return tl.where(nan, 7, code), tl.where(nan, 6.0, value)


@triton.jit
def e2m1_rne(v):
    """The E2M1 code of :func:`e2m1_rne_with_value`."""
    code, _ = e2m1_rne_with_value(v)
    return code


@triton.jit
def e2m1_sr(v, rbyte):
    """Stochastic E2M1 code of fp32 ``v`` with the random byte ``rbyte`` (int32 0..255), §7.8.

    ``t = fma(u, step, a)`` is exact to round once either way (``u * step`` is exact), then
    ``q = min(floor(t / step_t) * step_t, 6)`` (power-of-two steps, exact) lies on the grid and is
    coded by ``e2m1_rne``; NaN gives +6.
    """
    a = tl.abs(v)
    u = rbyte.to(tl.float32) * 0.00390625
    step = tl.where(a >= 4.0, 2.0, tl.where(a >= 2.0, 1.0, 0.5))
    t = tl.fma(u, step, a)
    step_t = tl.where(t >= 4.0, 2.0, tl.where(t >= 2.0, 1.0, 0.5))
    q = tl.minimum(tl.floor(t / step_t) * step_t, 6.0)
    neg = ((f32_bits(v) >> 31) & 1) != 0
    c = e2m1_rne(q)
    c = tl.where(neg, c | 8, c)
    return tl.where(v != v, 7, c)


@triton.jit
def e2m1_decode(c):
    """fp32 value of E2M1 code(s) ``c`` (int, 0..15)."""
    c = c.to(tl.int32)
    e = (c >> 1) & 3
    m = c & 1
    val = tl.where(e == 0, m.to(tl.float32) * 0.5, f32_from_bits(((e + 126) << 23) | (m << 22)))
    return f32_from_bits(f32_bits(val) | ((c & 8) << 28))  # sign bit (keeps -0.0)


@triton.jit
def bf16_rne(x):
    """fp32 ``x`` rounded to the nearest bf16 (ties to even), returned as an exact fp32 value."""
    b = f32_bits(x)
    r = (b + 0x7FFF + ((b >> 16) & 1)) & -65536
    r = tl.where((b & 0x7FFFFFFF) > 0x7F800000, b, r)
    return f32_from_bits(r)


@triton.jit
def bf16_round(x):
    """fp32 ``x`` rounded to bf16 (RNE) as an exact fp32 value: native cast or ``bf16_rne``."""
    if NATIVE:
        return x.to(tl.bfloat16).to(tl.float32)
    else:
        return bf16_rne(x)


@triton.jit
def mul_rn(a, b):
    """fp32 ``a * b`` rounded on its own: on the GPU an inline ``mul.rn.f32``, which neither the
    LLVM backend nor ptxas contracts into a following add (an FMA rounds once where the
    reference's separate torch ops round twice; ptxas sees through a plain register move and
    contracts a ``mul.f32``). Replaces Triton's ``enable_fp_fusion=False``, which torch cannot
    record into a compiled graph. The interpreter never contracts: ``a * b``."""
    if ON_GPU:
        return tl.inline_asm_elementwise("mul.rn.f32 $0, $1, $2;", "=f,f,f", [a, b],
                                         dtype=tl.float32, is_pure=True, pack=1)
    else:
        return a * b


#: ``div_rn_by`` divides by FMAs: compiled for a GPU (the interpreter's fma rounds twice).
FMA_DIVISION = tl.constexpr(not interpreting())
#: The smallest dividend magnitude (besides 0) for which ``div_rn_by`` is correctly rounded.
DIV_BY_MIN = tl.constexpr(2.0**-100)


@triton.jit
def div_rn_by(x, D: tl.constexpr):
    """``div_rn(x, D)`` for the constant divisors ``D`` 1536 and 2688 and ``|x| >= DIV_BY_MIN``
    (or 0, ±Inf, NaN), without a division on the GPU. With ``y = fp32(1/D)``: ``q0 = x * y`` is
    within 1.5 ulp of the quotient; one correction ``q1 = fma(fma(-q0, D, x), y, q0)`` (the
    inner remainder is exact) brings it within 1 ulp, and a second one rounds to the correctly
    rounded quotient (Markstein's theorem: ``y`` within half an ulp of ``1/D``, ``q1`` within
    one ulp, no underflow, which ``DIV_BY_MIN`` keeps away). ``x`` ±0 (whose corrections would
    add +0 to -0), ±Inf or NaN (a NaN remainder) returns ``q0``. tests/gpu sweeps every fp32
    input. The interpreter's fma is a multiply then an add: it divides (``FMA_DIVISION``).
    """
    if FMA_DIVISION:
        if D == 1536.0:
            y = RCP_1536
        else:
            tl.static_assert(D == 2688.0, "div_rn_by: D is 1536 or 2688")
            y = RCP_2688
        q0 = x * y
        q1 = tl.fma(tl.fma(-q0, D, x), y, q0)
        r1 = tl.fma(-q1, D, x)
        return tl.where((r1 == r1) & (x != 0.0), tl.fma(r1, y, q1), q0)
    else:
        return tl.math.div_rn(x, tl.full(x.shape, D, tl.float32))


@triton.jit
def to_out(x, OUT: tl.constexpr):
    """Cast fp32 ``x`` with RNE to the output dtype of code ``OUT`` (``_common.out_code``: 0 fp32,
    1 bf16, 2 fp16); bf16 through the native cast on GPU, else in software. An int code, not a
    ``tl.dtype``, so the launch can be recorded into an Inductor graph as a plain constant."""
    if OUT == 0:
        return x
    elif OUT == 2:
        return x.to(tl.float16)
    elif NATIVE:
        return x.to(tl.bfloat16)
    else:
        return (f32_bits(bf16_rne(x)) >> 16).to(tl.int16).to(tl.bfloat16, bitcast=True)


@triton.jit
def scale_from_amax(amax, eps, FP8_MAX: tl.constexpr, POW2: tl.constexpr,
                    VALUE_FOR_INF: tl.constexpr):
    """TE's ``compute_scale_from_amax`` (§3 step 3): ``amax < eps -> eps``; Inf, 0, NaN -> 1;
    else ``div_rn(fp8_max, amax)``, Inf -> ``VALUE_FOR_INF``, floored to a power of two (bits
    ``& 0xFF800000``) when ``POW2``.

    With ``POW2`` no division is done: both FP8 maxima are ``1.75 * 2^E``, so for
    ``a = m * 2^Ea`` (m in [1, 2)) the exponent of ``RN(fp8_max / a)`` is ``E - Ea``, minus one
    when ``m > 1.75``; RN never carries the quotient into the next binade (1.75 / m <= 1.75, and
    for m >= 1.75 + 2^-23 it stays below 1 - 2^-25). A biased exponent past 254 is exactly the
    overflow to Inf (subnormal ``a`` included), which takes ``VALUE_FOR_INF``'s power of two.

    ``eps`` is rounded to fp32 first (RNE, as Triton's own launcher passes a Python float):
    Inductor passes a recorded kernel's float arguments as fp64."""
    eps = tl.cast(eps, tl.float32)
    a = tl.where(amax < eps, eps, amax)
    if POW2:
        tl.static_assert((FP8_MAX == E4M3_MAX) or (FP8_MAX == E5M2_MAX))
        E: tl.constexpr = 8 if FP8_MAX == E4M3_MAX else 15
        b = f32_bits(a)
        sb = (E + 254) - (b >> 23) - ((b & 0x7FFFFF) > 0x600000).to(tl.int32)
        vinf = f32_from_bits(f32_bits(tl.full(a.shape, VALUE_FOR_INF, tl.float32)) & -8388608)
        s = tl.where(sb > 254, vinf, f32_from_bits(sb << 23))
    else:
        s = tl.math.div_rn(tl.full(a.shape, FP8_MAX, tl.float32), a)
        s = tl.where(s == float("inf"), VALUE_FOR_INF, s)
    bad = (a == float("inf")) | (a == 0.0) | (a != a)
    return tl.where(bad, 1.0, s)


@triton.jit
def scale_inverse(s, POW2: tl.constexpr):
    """``div_rn(1, s)``; for a power of two ``s`` (``POW2``) from the bits, exactly:
    ``2^(127 - e)``, with ``2^127 -> 2^-127`` (the subnormal 0x00400000)."""
    if POW2:
        e = f32_bits(s) >> 23
        return tl.where(e == 254, f32_from_bits(tl.full(s.shape, POW2_MINUS_127_BITS, tl.int32)),
                        f32_from_bits((254 - e) << 23))
    else:
        return tl.math.div_rn(1.0, s)


@triton.jit
def lowbias32(x):
    """Wellons' ``lowbias32`` bijection on uint32 ``x`` (multiplications wrap modulo 2^32)."""
    x = x ^ (x >> 16)
    x = x * tl.full(x.shape, 0x7FEB352D, tl.uint32)
    x = x ^ (x >> 15)
    x = x * tl.full(x.shape, 0x846CA68B, tl.uint32)
    return x ^ (x >> 16)


@triton.jit
def sr_seed_state(seed_ptr):
    """Seed-only prefix of ``sr_random_byte``: ``lowbias32(lowbias32(s_lo ^ IV) ^ s_hi)``."""
    seed = tl.load(seed_ptr)
    s_lo = (seed & 0xFFFFFFFF).to(tl.uint32)
    s_hi = ((seed >> 32) & 0xFFFFFFFF).to(tl.uint32)
    h = lowbias32(s_lo ^ tl.full(s_lo.shape, 0x9E3779B9, tl.uint32))
    return lowbias32(h ^ s_hi)


@triton.jit
def sr_random_byte(state, index):
    """Random byte (int32 0..255) of int64 element ``index`` >= 0 given ``sr_seed_state``;
    repeats ``quant_core.reference._rounding.sr_random_byte`` exactly."""
    i_lo = (index & 0xFFFFFFFF).to(tl.uint32)
    i_hi = ((index >> 32) & 0xFFFFFFFF).to(tl.uint32)
    h = lowbias32(state ^ i_hi)
    h = lowbias32(h ^ i_lo)
    return (h >> 24).to(tl.int32)
