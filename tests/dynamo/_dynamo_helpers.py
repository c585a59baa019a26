"""Shared quantizers, inputs and version gates for tests/dynamo."""

from __future__ import annotations

import contextlib

import pytest
import quant_dynamo
import torch
from quant_core import (
    DType,
    Float8BlockQuantizer,
    Float8CurrentScalingQuantizer,
    MXFP8Quantizer,
    NVFP4Quantizer,
)

MODE = quant_dynamo.status()["mode"]
HAS_API = quant_dynamo.compile_supported()

#: fullgraph=True is promised only where torch has the opaque-object API.
requires_api = pytest.mark.skipif(
    not HAS_API,
    reason=f"torch {torch.__version__} has no opaque-object API (mode 'none'): quantizers cannot "
    "be custom-op arguments, so fullgraph=True is not promised (docs/torch-versions.md §3)",
)
#: Lowering ops into compiled graphs needs register_torch_dispatch and wrap_triton.
requires_lowering = pytest.mark.skipif(
    not quant_dynamo.capture.supported(),
    reason=f"torch {torch.__version__} lacks register_torch_dispatch / wrap_triton",
)
#: torch 2.10 rebuilds a value with repr() and only its own class name in scope: no nesting.
requires_nesting = pytest.mark.skipif(
    MODE in ("none", "repr"),
    reason=f"mode {MODE!r}: nested value types need __fx_repr__ (torch >= 2.11)",
)


def quantizers() -> dict[str, object]:
    """The four tensorless quantizers of TE's test_quantizer_value_object."""
    return {
        "mxfp8": MXFP8Quantizer(DType.E4M3),
        "float8_blockwise": Float8BlockQuantizer(
            DType.E4M3, rowwise_usage=True, columnwise_usage=True, force_pow_2_scales=True
        ),
        "float8_current_scaling": Float8CurrentScalingQuantizer(DType.E4M3, amax_epsilon=0.0),
        "nvfp4": NVFP4Quantizer(
            DType.E2M1, rowwise_usage=True, columnwise_usage=True, with_rht=True,
            with_post_rht_amax=True,
        ),
    }


QUANTIZER_IDS = list(quantizers())


def make_input(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(128, 256, generator=g).to(torch.bfloat16)


def assert_bitwise(a: torch.Tensor, b: torch.Tensor) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape
    torch.testing.assert_close(a, b, atol=0, rtol=0, equal_nan=True)


def run_in_fresh_process(code: str) -> None:
    """Run ``code`` in a new Python process (nothing of this one loaded); fail with its stderr
    unless it exits 0."""
    import subprocess
    import sys

    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]


@contextlib.contextmanager
def capturable_reference(**functions):
    """A capturable CPU backend made of the reference's functions (``functions`` replace some),
    preferred on the CPU. With the CPU among the kernel devices (the ``cpu_kernel_device``
    fixture) lowering to kernels there records the reference's ops (Triton's interpreter cannot
    be recorded)."""
    import types

    from quant_core import backends, reference

    fns = {name: getattr(reference, name) for name in backends.FUNCTIONS} | functions
    backend = types.SimpleNamespace(name="traced_reference", priority=1000, capturable=True,
                                    supports=lambda device: True, **fns)
    backends.register(backend)
    try:
        yield backend
    finally:
        backends.unregister("traced_reference")
