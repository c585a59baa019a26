"""``quant doctor``: versions, the compile API in use, backends, and per-format support."""

from __future__ import annotations

import importlib.metadata

import torch
from quant_core import backends

#: The formats' rows, in the order printed.
_FORMATS = ("FP8 per-tensor", "FP8 block 1x128/128x128", "MXFP8", "NVFP4")


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
    if forms and forms[0] == "ops":
        line += "; FP8 current scaling as torch ops first (QUANT_LOWERING=ops)"
    elif "ops" not in forms:
        line += ", kernels only (QUANT_LOWERING=kernels)"
    return line


def _has_kernels() -> bool:
    return any(name != "reference" for name in backends.available())


def _has_blockwise_api() -> bool:
    import torch.nn.functional as F

    scaling = getattr(F, "ScalingType", None)
    return hasattr(F, "scaled_mm") and scaling is not None and hasattr(scaling, "BlockWise1x128")


def format_support(capability: tuple[int, int] | None, *, kernels: bool | None = None,
                   blockwise_api: bool | None = None) -> list[tuple[str, str, str]]:
    """Per format: (name, GEMM path of ``quant_recipes.Linear``, why) on a GPU of ``capability``
    (None: CPU), given whether a kernel backend (quant-kernels) is installed and whether torch
    has cuBLAS's block-scaled FP8 GEMM (defaults: this process). Paths: ``native`` (FP8 tensor
    cores through cuBLAS), ``bf16-tc`` (exact bf16 dequantization, then bf16 tensor cores),
    ``emulated`` (dequantize to fp32, fp32 matmul). Quantization itself runs everywhere."""
    kernels = _has_kernels() if kernels is None else kernels
    blockwise_api = _has_blockwise_api() if blockwise_api is None else blockwise_api
    if capability is None:
        return [(name, "emulated", "no GPU: dequantize, then fp32 matmul (same bits)")
                for name in _FORMATS]
    where = f"sm_{capability[0]}{capability[1]}"
    rows = []
    if capability >= (8, 9):
        rows.append((_FORMATS[0], "native", f"{where}: torch._scaled_mm (FP8 tensor cores)"))
    else:
        rows.append((_FORMATS[0], "emulated", f"{where}; FP8 tensor cores need sm_89+"))
    if capability[0] == 9 and blockwise_api:
        rows.append((_FORMATS[1], "native", f"{where}: cuBLAS block-scaled FP8 (F.scaled_mm)"))
    elif capability[0] == 9:
        rows.append((_FORMATS[1], "emulated", f"{where}: this torch has no F.scaled_mm block "
                                              "scaling (torch >= 2.10 does)"))
    else:
        rows.append((_FORMATS[1], "emulated", f"{where}: cuBLAS's 1x128/128x128 FP8 GEMM "
                                              "runs on sm 9.x only"))
    for name in _FORMATS[2:]:
        if not kernels:
            rows.append((name, "emulated", f"{where}: install quant-kernels for the "
                                           "tensor-core path"))
        elif capability >= (10, 0):
            rows.append((name, "bf16-tc", f"{where}: exact bf16 dequantization + cuBLAS bf16 "
                                          "GEMM; this chip's MX/NVFP4 tensor cores are "
                                          "untested here, so not used yet"))
        else:
            rows.append((name, "bf16-tc", f"{where} has no {name} tensor cores: exact bf16 "
                                          "dequantization + cuBLAS bf16 GEMM"))
    return rows


def run_doctor() -> int:
    print(f"torch            {torch.__version__}")
    print(f"triton           {_version('triton')}")
    for dist in ("quant-core", "quant-kernels", "quant-dynamo", "quant-recipes"):
        print(f"{dist:16s} {_version(dist)}")
    print(f"compile API      {compile_mode()}")
    print(f"kernels in graph {lowering()}")
    print(f"backends         {', '.join(backends.available())}")
    capability = None
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
    print(f"{'format':26s} {'GEMM':9s} why (quantization runs on every device, same bytes)")
    for name, support, why in format_support(capability):
        print(f"{name:26s} {support:9s} {why}")
    return status
