"""Lowering the ``quant`` ops to backend kernels in compiled graphs (quant_dynamo.capture).

On the CPU, Triton's interpreter cannot be recorded (torch's ``wrap_triton`` only records
compiled kernels), so the mechanism is checked with a capturable stand-in backend whose functions
are the reference's torch ops: under aot_eager the lowered graph runs the same ops, so its bytes
must equal the eager op's, and no ``quant.quantize`` call may remain in the graph. The Triton
lowering itself is checked on the GPU (tests/gpu/test_compile_cuda.py).
"""

from __future__ import annotations

import formats
import pytest
import quant_dynamo
import torch
from _dynamo_helpers import capturable_reference, requires_api, requires_lowering
from functorch.compile import make_boxed_func
from quant_core import (
    NVFP4Quantizer,
    backends,
)
from quant_core.kernel_capture import NotCapturable, capture, capturing
from torch._dynamo.backends.common import aot_autograd

pytestmark = [requires_api, requires_lowering]

#: One quantizer per format (tests/formats.py), NVFP4 with the RHT.
QUANTIZERS = {name: make(columnwise_usage=True)
              for name, make in formats.default_quantizers().items()}
QUANTIZERS["nvfp4"] = formats.quantizer("nvfp4_rht", columnwise_usage=True)
QUANTIZERS["nvfp4_4over6"] = NVFP4Quantizer(columnwise_usage=True, with_rht=False,
                                            nvfp4_use_4over6=True, nvfp4_e4m3_max=256)
QUANTIZERS["nvfp4_4over6_2d_mse"] = NVFP4Quantizer(
    columnwise_usage=True, with_rht=False, with_2d_quantization=True, nvfp4_use_4over6=True,
    nvfp4_e4m3_max=256, nvfp4_4over6_err_mode="MSE")
QUANTIZERS["nvfp4_row_scaled"] = NVFP4Quantizer(columnwise_usage=False, with_rht=False,
                                                row_scaled_nvfp4=True)


@pytest.fixture
def traced_backend(cpu_kernel_device):
    """A capturable CPU backend made of the reference's functions, preferred on the CPU, with
    the CPU among the kernel devices."""
    with capturable_reference() as backend:
        yield backend


def _compile_graphs(fn):
    """``fn`` compiled with aot_eager, and the list its forward graphs' code is appended to."""
    graphs: list[str] = []

    def forward(gm, example_inputs):
        graphs.append(gm.code)
        return make_boxed_func(gm)

    torch._dynamo.reset()
    return torch.compile(fn, backend=aot_autograd(fw_compiler=forward), fullgraph=True), graphs


def _x():
    torch.manual_seed(0)
    return torch.randn(64, 128, dtype=torch.bfloat16)


@pytest.mark.parametrize("name", list(QUANTIZERS))
def test_quantize_is_lowered_with_the_eager_bytes(traced_backend, name):
    q, x = QUANTIZERS[name], _x()
    compiled, graphs = _compile_graphs(lambda t: quant_dynamo.quantize(t, q))
    got, want = compiled(x), quant_dynamo.quantize(x, q)
    assert [t.shape for t in got] == [t.shape for t in want]
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert "quant.quantize" not in graphs[0]


@pytest.mark.parametrize("name", list(QUANTIZERS))
def test_qdq_is_lowered_with_the_eager_bytes(traced_backend, name):
    q, x = QUANTIZERS[name], _x()
    compiled, graphs = _compile_graphs(lambda t: quant_dynamo.qdq(t, q))
    assert torch.equal(compiled(x), quant_dynamo.qdq(x, q))
    assert "quant.qdq" not in graphs[0]


def test_stochastic_rounding_stays_opaque(traced_backend):
    """Its seed must come from torch's generator, as in eager mode."""
    q = NVFP4Quantizer(stochastic_rounding=True)
    compiled, graphs = _compile_graphs(lambda t: quant_dynamo.quantize(t, q))
    compiled(_x())
    assert "quant.quantize" in graphs[0]


def test_a_backend_that_cannot_record_keeps_the_op():
    """The reference (the CPU's default) is not capturable: Inductor could reorder its fp32
    arithmetic, so the op stays opaque."""
    assert not getattr(backends.get(None, "cpu"), "capturable", False)
    q = QUANTIZERS["current"]
    compiled, graphs = _compile_graphs(lambda t: quant_dynamo.quantize(t, q))
    x = _x()
    assert all(torch.equal(a, b) for a, b in zip(compiled(x), quant_dynamo.quantize(x, q),
                                                 strict=True))
    assert "quant.quantize" in graphs[0]


def test_quant_lowering_0_keeps_every_op(traced_backend, monkeypatch):
    monkeypatch.setenv("QUANT_LOWERING", "0")
    q = QUANTIZERS["mxfp8"]
    compiled, graphs = _compile_graphs(lambda t: quant_dynamo.quantize(t, q))
    compiled(_x())
    assert "quant.quantize" in graphs[0]


def test_a_launch_that_cannot_be_recorded_keeps_the_op(traced_backend):
    """A body that raises ``NotCapturable`` while being recorded falls back to the opaque op,
    which then runs (eagerly, uncaptured) with the eager bytes."""
    real, refused = traced_backend.fp8_current_quantize, []

    def refuse_while_capturing(*args, **kwargs):
        if capturing():
            refused.append(True)
            raise NotCapturable("test")
        return real(*args, **kwargs)

    traced_backend.fp8_current_quantize = refuse_while_capturing  # the registered object
    q = QUANTIZERS["current"]
    compiled, graphs = _compile_graphs(lambda t: quant_dynamo.quantize(t, q))
    x = _x()
    got = compiled(x)  # compiles now, with the refusing backend in place
    assert refused, "the lowering was never attempted"
    assert "quant.quantize" in graphs[0]
    assert all(torch.equal(a, b) for a, b in zip(got, quant_dynamo.quantize(x, q), strict=True))


def test_capture_is_thread_local_and_reentrant():
    import threading

    seen = []
    with capture():
        with capture():
            assert capturing()
        assert capturing()
        t = threading.Thread(target=lambda: seen.append(capturing()))
        t.start()
        t.join()
    assert not capturing() and seen == [False]
