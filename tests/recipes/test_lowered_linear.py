"""A compiled quantized Linear whose ops are lowered to backend kernels (quant_dynamo.capture):
forward and backward equal eager mode bitwise, and the lowered ops leave the graph.

A capturable stand-in backend made of the reference's functions plays Triton's part on the CPU
(the interpreter's kernels cannot be recorded); the GPU check is tests/gpu/test_compile_cuda.py.
"""

from __future__ import annotations

import re
import types

import formats
import pytest
import quant_recipes as qr
import torch
from quant_core import backends, reference

quant_dynamo = pytest.importorskip("quant_dynamo", reason="compile tests need quant-dynamo")
if not (quant_dynamo.compile_supported() and quant_dynamo.capture.supported()):
    pytest.skip(f"no opaque-object API or wrap_triton on torch {torch.__version__}",
                allow_module_level=True)

from functorch.compile import make_boxed_func  # noqa: E402
from torch._dynamo.backends.common import aot_autograd  # noqa: E402

#: Every format's built-in recipe (tests/formats.py).
RECIPES = {name: make() for name, make in formats.default_recipes().items()}


@pytest.fixture
def traced_backend(cpu_kernel_device):
    fns = {name: getattr(reference, name) for name in backends.FUNCTIONS}
    backends.register(types.SimpleNamespace(name="traced_reference", priority=1000,
                                            supports=lambda device: True, capturable=True, **fns))
    yield
    backends.unregister("traced_reference")


def _step(fn, m, x):
    torch.manual_seed(1)  # NVFP4's stochastic rounding draws its seeds from torch's generator
    x = x.clone().requires_grad_()
    m.zero_grad(set_to_none=True)
    y = fn(x)
    (y.float() * torch.linspace(-1, 2, y.shape[-1])).sum().backward()
    return y.detach(), x.grad, m.weight.grad, m.bias.grad


@pytest.mark.parametrize("name", list(RECIPES))
def test_lowered_linear_matches_eager(traced_backend, name):
    torch._dynamo.reset()
    torch.manual_seed(0)
    m = qr.Linear(128, 64, dtype=torch.bfloat16)

    def fn(x):
        with qr.autocast(recipe=RECIPES[name]):
            return m(x)

    graphs: list[str] = []

    def keep(gm, example_inputs):
        graphs.append(gm.code)
        return make_boxed_func(gm)

    compiled = torch.compile(fn, backend=aot_autograd(fw_compiler=keep, bw_compiler=keep),
                             fullgraph=True)
    for i in range(2):
        x = torch.randn(32, 128, dtype=torch.bfloat16) * (1 + i)
        got, want = _step(compiled, m, x), _step(fn, m, x)
        for what, a, b in zip(("y", "x.grad", "w.grad", "b.grad"), got, want, strict=True):
            assert torch.equal(a, b), f"{name} step {i}: {what} differs"
    code = "\n".join(graphs)
    opaque = [line for line in code.splitlines() if "quant.quantize" in line]
    # every quantize is lowered but NVFP4's stochastically rounded gradient (torch's generator)
    assert all(re.search(r"stochastic_rounding\W+True", line) for line in opaque), opaque
    assert len(opaque) == (1 if name == "nvfp4" else 0)
    if name in ("mxfp8", "nvfp4"):  # the backend's GEMM is a fast path: lowered too
        assert "qgemm" not in code
    else:  # the cuBLAS paths need CUDA: the emulated GEMM stays an opaque op
        assert "qgemm" in code
