"""Compiling the Triton kernels for an sm_90 target on a machine without a GPU (Triton's own
ptxas and cuobjdump): for checks that read what the compiler makes of a kernel, not what it
computes. Run in a process without ``TRITON_INTERPRET``."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile


def fake_target() -> None:
    """Make Triton compile for sm_90 when no GPU is present (the binary is never loaded)."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget

    class Target:
        def get_current_target(self):
            return GPUTarget("cuda", 90, 32)

        def get_active_torch_device(self):
            return torch.device("cpu")

        def get_current_device(self):
            return 0

        def get_current_stream(self, device=None):
            return 0

    if not torch.cuda.is_available():
        triton.runtime.driver.set_active(Target())


def resource_usage(compiled) -> dict[str, int]:
    """``{"REG": registers per thread, "STACK": stack frame bytes, ...}`` of a compiled kernel's
    cubin, from ``cuobjdump --dump-resource-usage``."""
    import triton

    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin",
                        "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(compiled.asm["cubin"])
        f.flush()
        out = subprocess.run([tool, "--dump-resource-usage", f.name], capture_output=True,
                             text=True, check=True).stdout
    line = next(ln for ln in out.splitlines() if "REG:" in ln)
    return {k: int(v) for k, v in (t.split(":")[:2] for t in line.split() if ":" in t)
            if v.isdigit()}


def run_as_script(path: str, min_ok: int, timeout: int = 900) -> None:
    """Run the test module ``path`` as a script in a process without ``TRITON_INTERPRET`` (real
    Triton compilation) and assert that it exits 0 and printed at least ``min_ok`` lines
    starting ``ok``: the checks ran, not only started."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, path], env=env, capture_output=True, text=True,
                         timeout=timeout)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count("ok  ") >= min_ok, run.stdout


def record_launches() -> list:
    """Replace ``launch`` in every imported quant_kernels module by a recorder, so that a
    backend call launches nothing; returns the list of ``(kernel, grid, args, kwargs)`` it
    appends to."""
    launches = []

    def record(kernel, grid, *args, **kwargs):
        launches.append((kernel, grid, args, kwargs))

    import quant_kernels.backend  # noqa: F401  (imports every kernel module)

    for name, mod in list(sys.modules.items()):
        if name.startswith("quant_kernels") and hasattr(mod, "launch"):
            mod.launch = record
    return launches
