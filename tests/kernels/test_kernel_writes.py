"""No quantize kernel reads, to torch's TTIR analysis, as writing its input.

Compiled graphs record the kernels' launches (quant_dynamo.capture); a kernel torch reads as
writing its input gets a copy of the input per call and turns CUDA graphs off. The check
(bench/check_kernel_writes.py) compiles real TTIR, which the interpreter cannot give, so it runs
in a subprocess without ``TRITON_INTERPRET`` (for an sm_90 target; no GPU needed).
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

SCRIPT = pathlib.Path(__file__).resolve().parents[2] / "bench" / "check_kernel_writes.py"


def test_no_quantize_kernel_writes_its_input():
    wrap = pytest.importorskip("torch._higher_order_ops.triton_kernel_wrap")
    if not any(hasattr(wrap, f) for f in ("identify_accessed_tensors",
                                          "identify_mutated_tensors")):
        pytest.skip("this torch has no TTIR mutation analysis")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, str(SCRIPT)], env=env, capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count("ok  ") >= 9, run.stdout
