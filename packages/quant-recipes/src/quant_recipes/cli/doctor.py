"""``quant doctor``: versions, the compile API in use, backends, and per format the GEMM that runs
(``quant_recipes.gemm_fast.routes``)."""

from __future__ import annotations

import importlib.metadata

import torch
from quant_core import backends

from ..gemm_fast import routes


def _version(dist: str) -> str:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def compile_mode() -> str:
    """The opaque-object API quant-dynamo uses here, or why there is none."""
    try:
        import quant_dynamo
    except ImportError:
        return "none (quant-dynamo is not installed: torch.compile falls back to tracing)"
    return str(quant_dynamo.status()["mode"])


def lowering() -> str:
    """Whether compiled graphs launch the quant kernels from Inductor's code, or why not."""
    try:
        from quant_dynamo import capture
    except ImportError:
        return "no (quant-dynamo is not installed)"
    if not capture.supported():
        return f"no (torch {torch.__version__} lacks wrap_triton / register_torch_dispatch)"
    if not capture.enabled():
        return "no (QUANT_LOWERING=0)"
    forms = capture.forms()
    line = "yes on " + ", ".join(sorted(capture.KERNEL_DEVICES)) + " with a capturable backend"
    if forms != capture.forms(columnwise=True):
        line += ("; FP8 current scaling's rowwise casts as torch ops, columnwise copies as "
                 "kernels (QUANT_LOWERING=mixed, the default)")
    elif forms and forms[0] == "ops":
        line += "; FP8 current scaling as torch ops first (QUANT_LOWERING=ops)"
    elif "ops" not in forms:
        line += ", kernels only (QUANT_LOWERING=kernels)"
    return line


def gemm_lines(device: torch.device | str) -> list[str]:
    """The GEMM table of ``device``: per row of ``gemm_fast.routes``, the format, the path name
    ``gemm_paths()`` reports and what runs, then the operands it takes or why it is emulated."""
    lines = [f"{'format':10s} {'path':20s} runs"]
    for r in routes(device):
        lines.append(f"{r.format:10s} {r.path:20s} {r.runs}")
        if r.note:
            lines.append(f"{'':13s}{'takes' if r.available else 'why'}: {r.note}")
    return lines


def variant_lines(device: torch.device | str) -> list[str]:
    """NVFP4's optional variants and the grouped GEMMs on ``device``: what runs them."""
    from ..moe.fp8_gemm import describe
    from ..moe.gemm import grouped_mm_available

    grouped = ("all groups quantized at once and one torch._grouped_mm per GEMM where every "
               "operand decodes exactly to bf16 and none scales by a tensor-wide amax (MXFP8, "
               "FP8 blocks), else one GEMM per group"
               if grouped_mm_available(torch.device(device)) else "one GEMM per group")
    return [
        "nvfp4 4over6     NVFP4BlockScaling(nvfp4_4over6=...): global bound 256 or 448, MAE or "
        "MSE; GEMMs as NVFP4 under 448, emulated under 256",
        "nvfp4 row-scaled NVFP4BlockScaling(row_scaled_activation=True): one amax per row, "
        "rowwise only (needs backward_override); GEMMs with per-row factors",
        f"GroupedLinear    {grouped}",
        f"{'':17s}FP8 current scaling: {describe(device)}",
    ]


def run_doctor() -> int:
    print(f"torch            {torch.__version__}")
    print(f"triton           {_version('triton')}")
    for dist in ("quant-core", "quant-kernels", "quant-dynamo", "quant-recipes"):
        print(f"{dist:16s} {_version(dist)}")
    print(f"compile API      {compile_mode()}")
    print(f"kernels in graph {lowering()}")
    print(f"backends         {', '.join(backends.available())}")
    status = 0
    devices = ["cpu"]
    if torch.cuda.is_available():
        capability = torch.cuda.get_device_capability()
        name = torch.cuda.get_device_name()
        print(f"GPU              {name} (compute capability {capability[0]}.{capability[1]})")
        devices.insert(0, "cuda")
    else:
        print("GPU              none")
    for device in devices:
        label = f"backend on {'GPU' if device == 'cuda' else 'CPU'}"
        problem = backends.environment_problem(device)
        if problem is None:
            print(f"{label:16s} {backends.get(None, device).name}")
        else:
            print(f"{label:16s} none: {problem}")
            status = 1
    print()
    print(f"GEMMs on {devices[0]} (quantization runs on every device, same bytes)")
    for line in gemm_lines(devices[0]):
        print(line)
    print()
    for line in variant_lines(devices[0]):
        print(line)
    return status
