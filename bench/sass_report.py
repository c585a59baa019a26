"""Offline SASS report for sm_90 (no GPU needed): compile a kernel with Triton for Hopper and
count its machine instructions per element handled by one thread, with an opcode histogram.

ncu (bench/ncu_run.sh, 2026-11-29) showed the quantize kernels issue-/pipe-bound (SM throughput
80-92%, DRAM 35-74%), so instructions per element is the figure to cut before a GPU run. Static
counts of straight-line kernels (one tile per program) equal the dynamic ones.
Run: ``PYTHONPATH=packages/quant-core/src:packages/quant-kernels/src``
``python bench/sass_report.py [name filter]``
"""

from __future__ import annotations

import collections
import os
import re
import subprocess
import sys
import tempfile

import triton
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


def main() -> None:
    sys.path[:0] = [os.path.dirname(__file__)]
    from sass_cases import CASES

    flt = sys.argv[1] if len(sys.argv) > 1 else ""
    for case in CASES:
        if flt in case[0]:
            report(*case)


if __name__ == "__main__":
    main()
