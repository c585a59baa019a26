"""Offline SASS for sm_90 (``profiling.py sass``; no GPU needed): compile each quantize kernel
with Triton for Hopper at the package's GPU tile configs and count its machine instructions per
element handled by one thread, with an opcode histogram. Static counts of straight-line kernels
(one tile per program) equal the dynamic ones, so instructions per element is the figure to cut
before a GPU run when ncu shows a kernel issue- or pipe-bound."""

from __future__ import annotations

import collections
import os
import re
import subprocess
import tempfile

import triton
from quant_kernels import fp8_block as B
from quant_kernels import fp8_tensor as F
from quant_kernels import mxfp8 as X
from quant_kernels import nvfp4 as N
from quant_kernels import nvfp4_4over6 as S
from quant_kernels.configs import TABLE
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

TARGET = GPUTarget("cuda", 90, 32)
_BIN = os.path.join(os.path.dirname(triton.__file__), "backends/nvidia/bin")
NVDISASM = os.path.join(_BIN, "nvdisasm")
CUOBJDUMP = os.path.join(_BIN, "cuobjdump")
ALU = {"FMNMX", "IMNMX", "LOP3", "ISETP", "FSETP", "SEL", "FSEL", "SHF", "PRMT", "IADD3",
       "VIMNMX", "HMNMX2", "LEA", "F2FP", "PLOP3", "I2FP", "FLO", "POPC", "VABSDIFF"}


def compile_sass(fn, signature: dict, constexprs: dict, num_warps: int):
    """(kernel, SASS text, registers per thread) of ``fn`` compiled for sm_90; pointer and
    integer arguments get divisibility 16."""
    full = {a: ("constexpr" if a in constexprs else signature[a]) for a in fn.arg_names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, a in enumerate(fn.arg_names)
             if full[a] != "constexpr" and not full[a].startswith("fp")}
    k = triton.compile(ASTSource(fn, full, constexprs, attrs), target=TARGET,
                       options={"num_warps": num_warps})
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(k.asm["cubin"])
    sass = subprocess.run([NVDISASM, "-c", f.name], capture_output=True, text=True).stdout
    res = subprocess.run([CUOBJDUMP, "-res-usage", f.name], capture_output=True, text=True).stdout
    os.unlink(f.name)
    regs = re.search(r"REG:(\d+)", res)
    return k, sass, int(regs.group(1)) if regs else -1


def report(name: str, fn, signature: dict, constexprs: dict, num_warps: int,
           elems_per_program: int, top: int = 12) -> None:
    try:
        k, sass, regs = compile_sass(fn, signature, constexprs, num_warps)
    except Exception as e:  # noqa: BLE001 - report and go on with the next kernel
        print(f"{name}: FAILED {type(e).__name__}: {str(e)[:400]}")
        return
    ops = collections.Counter()
    for line in sass.splitlines():
        m = re.match(r"\s+/\*[0-9a-f]{4,}\*/\s+(@!?U?P\w+\s+)?([A-Z0-9_]+)", line)
        if m:
            ops[m.group(2)] += 1
    n = sum(ops.values())
    per = elems_per_program / (32 * num_warps)
    alu = sum(v for o, v in ops.items() if o in ALU)
    local = sum(v for o, v in ops.items() if o in ("STL", "LDL"))
    print(f"{name}: {n} instr, {n / per:.2f}/elem (ALU-pipe-ish {alu / per:.2f}), "
          f"smem {k.metadata.shared} B, local {local}, regs {regs}")
    print("   ", ", ".join(f"{o} {v / per:.2f}" for o, v in ops.most_common(top)))


#: (name, kernel, signature, constexprs, num_warps, elements per program)
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
_S46R = dict(x_ptr=BF, amax_ptr="*fp32", d_ptr="*i64", s_ptr="*u8", M="i32", K="i32", S_C="i32")
_S46C = dict(_S46R, MHW="i32")
_NVC = dict(x_ptr=BF, amax_ptr="*fp32", seed_ptr="*i64", d_ptr="*i64", s_ptr="*u8", M="i32",
            K="i32", MHW="i32", S_C="i32")


def _mx(row, col, cfg):
    c = dict(ROW=row, COL=col, TWO_D=False, SWIZZLE=False, IS_E4M3=True, BM=cfg["BM"],
             BK=cfg["BK"])
    return (f"mxfp8 row={row} col={col}", X._mxfp8_kernel, _MX, c, cfg["num_warps"],
            cfg["BM"] * cfg["BK"])


def _four_over_six(direction, kernel, signature, mse, **extra):
    """A 4over6 kernel at its GPU tile; its static count holds both division paths."""
    cfg = TABLE[f"nvfp4_4over6_{direction}"]["gpu"]
    tile = {k: v for k, v in cfg.items() if k != "num_warps"}
    elems = (cfg["BM"] if direction == "row" else 16 * cfg["G"]) * cfg["BK"]
    return (f"nvfp4 4over6 {direction} {'MSE' if mse else 'MAE'} (both division paths)", kernel,
            signature, dict(E=256, MSE=mse, TWO_D=False, SWIZZLE=False, **extra, **tile),
            cfg["num_warps"], elems)


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
     dict(DT=1, SR=False, TWO_D=False, SWIZZLE=False, ROW_SCALED=False, BM=32, BK=256), 8,
     32 * 256),
    ("nvfp4 col rht", N._nvfp4_col_kernel, _NVC,
     dict(RHT=True, MASK=0xD7E8, SR=False, TWO_D=False, SWIZZLE=False, G=4, BK=64), 4,
     4 * 16 * 64),
    _four_over_six("row", S._nvfp4_4over6_row_kernel, _S46R, False, ROW_SCALED=False),
    _four_over_six("col", S._nvfp4_4over6_col_kernel, _S46C, True),
]
