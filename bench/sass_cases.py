"""Kernel configurations for bench/sass_report.py: (name, kernel, signature, constexprs,
num_warps, elements per program), at the package's GPU tile configs."""

from __future__ import annotations

from quant_kernels import fp8_block as B
from quant_kernels import fp8_tensor as F
from quant_kernels import mxfp8 as X
from quant_kernels import nvfp4 as N
from quant_kernels.configs import TABLE

BF = "*bf16"
_MX = dict(x_ptr=BF, rd_ptr="*u8", rs_ptr="*u8", cd_ptr="*u8", cs_ptr="*u8", M="i32", K="i32",
           RS_C="i32", CS_C="i32", CS_SW_C="i32")
_BLK = dict(x_ptr=BF, rd_ptr="*u8", rs_ptr="*fp32", cd_ptr="*u8", cs_ptr="*fp32", M="i32",
            K="i32", RS_C="i32", CS_C="i32", eps="fp32")
_BLKC = dict(IS_E4M3=True, FP8_MAX=448.0, POW2=True, VINF=3.3895313892515355e38, BK=128)
_CAST = dict(x_ptr=BF, scale_ptr="*fp32", data_ptr="*u8", t_ptr="*u8", scale_inv_ptr="*fp32",
             amax_bits_ptr="*i32", M="i32", K="i32")
_NVR = dict(xp_ptr="*i32", amax_ptr="*fp32", seed_ptr="*i64", d_ptr="*u8", s_ptr="*u8", M="i32",
            K="i32", S_C="i32")
_NVC = dict(x_ptr=BF, amax_ptr="*fp32", seed_ptr="*i64", d_ptr="*i64", s_ptr="*u8", M="i32",
            K="i32", MHW="i32", S_C="i32")


def _mx(row, col, cfg):
    c = dict(ROW=row, COL=col, TWO_D=False, SWIZZLE=False, IS_E4M3=True, BM=cfg["BM"],
             BK=cfg["BK"])
    return (f"mxfp8 row={row} col={col}", X._mxfp8_kernel, _MX, c, cfg["num_warps"],
            cfg["BM"] * cfg["BK"])


CASES = [
    ("fp8_cast row+col", F._fp8_cast_kernel, _CAST,
     dict(ROW=True, COL=True, AMAX=False, IS_E4M3=True, BM=32, BK=128), 4, 32 * 128),
    _mx(True, False, TABLE["mxfp8"]["gpu"]),
    _mx(False, True, TABLE["mxfp8_col"]["gpu"]),
    _mx(True, True, TABLE["mxfp8_col"]["gpu"]),
    ("fp8_block 1x128 row", B._fp8_block_kernel, _BLK,
     dict(_BLKC, ROW=True, COL=False, TWO_D=False, BM=64, SLAB=64), 8, 64 * 128),
    ("fp8_block 1x128 row+col", B._fp8_block_kernel, _BLK,
     dict(_BLKC, ROW=True, COL=True, TWO_D=False, BM=128, SLAB=32), 4, 128 * 128),
    ("fp8_block 128x128", B._fp8_block_kernel, _BLK,
     dict(_BLKC, ROW=True, COL=True, TWO_D=True, BM=128, SLAB=64), 8, 128 * 128),
    ("nvfp4 row", N._nvfp4_row_kernel, _NVR,
     dict(DT=1, SR=False, TWO_D=False, SWIZZLE=False, BM=32, BK=256), 8, 32 * 256),
    ("nvfp4 col rht", N._nvfp4_col_kernel, _NVC,
     dict(RHT=True, MASK=0xD7E8, SR=False, TWO_D=False, SWIZZLE=False, G=4, BK=64), 4,
     4 * 16 * 64),
]
