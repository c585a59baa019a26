"""``quant doctor``: versions, the compile API in use, backends, and per-format support."""

from __future__ import annotations

import importlib.metadata

import torch
from quant_core import backends

#: (format, minimum compute capability of the native GEMM instruction, upper bound or None)
_FORMATS = (
    ("FP8 per-tensor", (8, 9), None),
    ("FP8 block 1x128/128x128", (9, 0), None),
    ("MXFP8", (10, 0), (12, 0)),
    ("NVFP4", (10, 0), None),
)


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


def format_support(capability: tuple[int, int] | None) -> list[tuple[str, str, str]]:
    """Per format: (name, GEMM path of ``quant_recipes.Linear``, why) on a GPU of ``capability``
    (None: CPU). Quantization itself runs everywhere with the same bytes."""
    rows = []
    for name, low, high in _FORMATS:
        has = capability is not None and capability >= low and (high is None or capability < high)
        where = "no GPU" if capability is None else f"sm_{capability[0]}{capability[1]}"
        if has and name == "FP8 per-tensor":
            rows.append((name, "native", f"{where}: torch._scaled_mm (FP8 tensor cores)"))
        elif has:
            rows.append((name, "emulated", f"{where} has the instruction, but this release "
                                           "emulates the GEMM (dequantize, then matmul)"))
        else:
            need = f"sm_{low[0]}{low[1]}" + (f" to below sm_{high[0]}{high[1]}" if high else "+")
            rows.append((name, "emulated", f"{where}; native needs {need}: same bits, "
                                           "dequantize-then-matmul GEMM"))
    return rows


def run_doctor() -> int:
    print(f"torch            {torch.__version__}")
    print(f"triton           {_version('triton')}")
    for dist in ("quant-core", "quant-kernels", "quant-dynamo", "quant-recipes"):
        print(f"{dist:16s} {_version(dist)}")
    print(f"compile API      {compile_mode()}")
    print(f"backends         {', '.join(backends.available())}")
    capability = None
    if torch.cuda.is_available():
        capability = torch.cuda.get_device_capability()
        name = torch.cuda.get_device_name()
        print(f"GPU              {name} (compute capability {capability[0]}.{capability[1]})")
        print(f"backend on GPU   {backends.get(None, 'cuda').name}")
    else:
        print("GPU              none")
    print(f"backend on CPU   {backends.get(None, 'cpu').name}")
    print()
    print(f"{'format':26s} {'GEMM':9s} why (quantization runs on every device, same bytes)")
    for name, support, why in format_support(capability):
        print(f"{name:26s} {support:9s} {why}")
    return 0
