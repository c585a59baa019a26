"""The numeric constants of the formats, each defined once (`numerics.md` §1-§8).

The reference imports them as Python numbers, the Triton kernels as ``tl.constexpr`` of the same
values (``quant_kernels._rounding``). Reciprocals are derived, never hand-typed: ``rcp_f32(v)``
is the fp32 value of ``1 / v`` rounded to nearest-even, as a Python float.
"""

from __future__ import annotations

import struct

#: Largest finite fp32, (2 - 2^-23) * 2^127.
FLT_MAX = 3.4028234663852886e38
#: Largest finite FP8 values: E4M3 (fn) and E5M2.
E4M3_MAX = 448.0
E5M2_MAX = 57344.0
#: Largest E2M1 (FP4) value.
E2M1_MAX = 6.0
#: NVFP4's per-tensor encode numerator: ``s_enc = 2688 / amax`` with ``2688 = 6 * 448`` (§7.2).
NVFP4_GLOBAL_MAX = E2M1_MAX * E4M3_MAX
#: 4over6's global E4M3 bound: ``s_enc = 6 * 256 / amax``, so that a map-to-4 block scale (1.5x
#: the map-to-6 one) still fits E4M3 (§7.9).
NVFP4_4OVER6_E4M3_MAX = 256.0
#: 4over6's map-to-4 block scale: ``1.5`` times the map-to-6 one, mapping the block amax to 4.
NVFP4_4OVER6_MAP4 = 1.5
#: The global E4M3 bounds 4over6 takes (its own 256, or the standard 448) and its error metrics
#: (absolute or squared error per element, §7.9).
NVFP4_4OVER6_E4M3_BOUNDS = (256, 448)
NVFP4_4OVER6_ERROR_MODES = ("MAE", "MSE")
#: The fp32 bit pattern of 2^-127 (a subnormal): E8M0 byte 0 decoded (§5).
POW2_MINUS_127_BITS = 0x00400000
#: The RHT's fixed sign vector as a 16-bit mask, bit i set where s_i == -1 (§7.6): 55272.
DEFAULT_RHT_SIGN_MASK = 0xD7E8


def rcp_f32(v: float) -> float:
    """``fp32(1 / v)`` (round to nearest-even) as a Python float."""
    return struct.unpack("<f", struct.pack("<f", 1.0 / v))[0]


#: Multipliers the kernels use instead of divisions where the reference's rounding allows it.
RCP_E4M3 = rcp_f32(E4M3_MAX)
RCP_E5M2 = rcp_f32(E5M2_MAX)
RCP_E2M1_MAX = rcp_f32(E2M1_MAX)
RCP_NVFP4_GLOBAL_MAX = rcp_f32(NVFP4_GLOBAL_MAX)
