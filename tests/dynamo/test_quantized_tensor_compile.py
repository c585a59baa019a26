"""Quantized tensors as inputs of compiled functions (behaviour.md §1.5, §11): the
quantizer sits in the ``__tensor_flatten__`` context, so Dynamo guards on its value: one compile
per distinct quantizer value, none for an equal quantizer on a new tensor, zero graph breaks with
``fullgraph=True``, compiled results bitwise equal to eager, and a stored group refused."""

from __future__ import annotations

import formats
import pytest
import quant_dynamo  # noqa: F401  (compile support, as users import it)
import torch
from quant_core import (
    Float8CurrentScalingQuantizer,
    Float8Quantizer,
    MXFP8Quantizer,
    NVFP4Quantizer,
)
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters

#: One quantizer factory per format (tests/formats.py): ``make(**overrides)``.
QUANTIZERS = formats.default_quantizers()
BACKENDS = ["eager", "aot_eager"]


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()


def _x(seed=0, shape=(64, 128)):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(shape, generator=g) * 2).to(torch.bfloat16)


def _dequantize_twice(t):
    return t.dequantize(torch.float32) * 2


def _to_fp16_plus_one(t):
    return t.to(torch.float16) + 1


def _no_graph_breaks() -> None:
    assert not counters["graph_break"], dict(counters["graph_break"])


class _Compiled:
    """``fn`` compiled with ``fullgraph=True`` on ``backend``; each call checks the result
    bitwise against eager ``fn`` and counts compiles."""

    def __init__(self, fn, backend):
        self.fn, self.counter = fn, CompileCounterWithBackend(backend)
        self.compiled = torch.compile(fn, backend=self.counter, fullgraph=True)

    def __call__(self, t):
        torch.testing.assert_close(self.compiled(t), self.fn(t), rtol=0, atol=0)

    @property
    def compiles(self) -> int:
        return self.counter.frame_count


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(QUANTIZERS))
def test_one_compile_per_quantizer_value(name, backend):
    f = _Compiled(_dequantize_twice, backend)
    q = QUANTIZERS[name]()
    for seed in range(3):  # new tensors, equal (here: the same) quantizer: one compile
        f(q.quantize(_x(seed)))
    f(QUANTIZERS[name]().quantize(_x(5)))  # an equal, distinct quantizer: no recompile
    assert f.compiles == 1
    changed = QUANTIZERS[name](columnwise_usage=False)  # a changed config: one recompile
    for seed in range(2):
        f(changed.quantize(_x(seed)))
    assert f.compiles == 2
    _no_graph_breaks()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", list(QUANTIZERS))
def test_to_dtype_then_plain_ops_compile_bitwise(name, backend):
    f = _Compiled(_to_fp16_plus_one, backend)
    f(QUANTIZERS[name]().quantize(_x()))
    assert f.compiles == 1
    _no_graph_breaks()


@pytest.mark.parametrize("name", ["current", "mxfp8"])
def test_inductor_dequantizes_bitwise(name):
    f = _Compiled(_dequantize_twice, "inductor")
    q = QUANTIZERS[name]()
    for seed in range(2):
        f(q.quantize(_x(seed)))
    assert f.compiles == 1
    _no_graph_breaks()


@pytest.mark.parametrize("backend", BACKENDS)
def test_ops_of_the_table_trace(backend):
    """View, transpose, split and cat inside a compiled function (quantized in, plain out)."""

    def fn(t):
        a, b = t.view(2, 32, 128).split(1)
        return torch.cat([a, b]).view(64, 128).t().dequantize(torch.float32)

    t = Float8CurrentScalingQuantizer().quantize(_x())
    _Compiled(fn, backend)(t)
    torch.testing.assert_close(fn(t), t.dequantize(torch.float32).t(), rtol=0, atol=0)
    _no_graph_breaks()


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_stateful_quantizer_keeps_identity(backend):
    """Delayed scaling compares by identity: the same object never recompiles, another one
    (equal tensors, a distinct object) does; Dynamo's guard does not copy it."""
    f = _Compiled(_dequantize_twice, backend)
    q = Float8Quantizer(torch.full((1,), 4.0), torch.zeros(1))
    for seed in range(2):
        f(q.quantize(_x(seed)))
    assert f.compiles == 1
    f(Float8Quantizer(torch.full((1,), 4.0), torch.zeros(1)).quantize(_x()))
    assert f.compiles == 2
    _no_graph_breaks()


@pytest.mark.parametrize("cls", [Float8CurrentScalingQuantizer, NVFP4Quantizer])
def test_a_stored_group_is_refused(cls):
    with pytest.warns(DeprecationWarning):
        q = cls(amax_reduction_group=object())
    t = q.quantize(_x())
    f = torch.compile(_dequantize_twice, backend="eager", fullgraph=True)
    # the seed's TypeError, raised by __tensor_flatten__ while Dynamo wraps the input (Dynamo
    # re-raises it as its InternalTorchDynamoError, a RuntimeError, with the same message)
    with pytest.raises((TypeError, RuntimeError), match="TypeError: .* holds an "
                       "amax_reduction_group, which is not part of its value|^.* holds an "
                       "amax_reduction_group, which is not part of its value"):
        f(t)


def test_a_quantized_parameter_gets_its_gradient_compiled():
    p = torch.nn.Parameter(MXFP8Quantizer().quantize(_x()))

    def fn(w):
        return (w.dequantize(torch.float32) * 3).sum()

    f = torch.compile(fn, backend="aot_eager", fullgraph=True)
    f(p).backward()
    assert p.grad is not None and torch.all(p.grad == 3)
    _no_graph_breaks()


@pytest.mark.parametrize("name", list(QUANTIZERS))
def test_a_compiled_function_returns_a_quantized_tensor(name):
    def fn(t):
        return t.split(128)[1].detach()

    t = QUANTIZERS[name]().quantize(_x(shape=(256, 128)))
    out = torch.compile(fn, backend="aot_eager", fullgraph=True)(t)
    assert type(out) is type(t) and out.shape == (128, 128)
    for buf, ref in zip(out.buffer_list(_x()), fn(t).buffer_list(_x()), strict=True):
        assert torch.equal(buf, ref)
    _no_graph_breaks()


@pytest.mark.parametrize("name", list(QUANTIZERS))
def test_dynamic_shapes_stay_bitwise(name):
    """With ``dynamic=True`` the shapes may stay symbolic (how many compiles a padded layout
    takes varies by release); the results are eager's bits either way."""
    f = torch.compile(_dequantize_twice, backend="aot_eager", fullgraph=True, dynamic=True)
    q = QUANTIZERS[name]()
    for m in (64, 96, 128):
        t = q.quantize(_x(m, (m, 128)))
        torch.testing.assert_close(f(t), _dequantize_twice(t), rtol=0, atol=0)
    _no_graph_breaks()


def _needs_method_calls_in_graphs() -> None:
    """Compiled code calls ``q.quantize`` on a captured quantizer where torch traces a value
    object's methods: not without the opaque-object API, and not on 2.11, whose value objects
    expose only their registered members (compiled code calls ``quant_dynamo.quantize`` there)."""
    mode = quant_dynamo.status()["mode"]
    if mode in ("none", "opaque_value_base"):
        pytest.skip(f"mode {mode!r}: compiled code cannot call a captured quantizer's methods")


@pytest.mark.parametrize("name", list(QUANTIZERS))
def test_quantizing_to_a_tensor_inside_a_compiled_function(name):
    """``q.quantize(x)`` with the default ``internal=False`` builds a quantized tensor in the
    traced code; the graph that builds it must be valid Python (its tags hold enum members)."""
    _needs_method_calls_in_graphs()
    q, x = QUANTIZERS[name](), _x()
    fn = torch.compile(lambda a: q.quantize(a).dequantize(), fullgraph=True, backend="aot_eager")
    assert torch.equal(fn(x), q.quantize(x).dequantize())


def test_a_fresh_process_compiles_a_quantize_before_any_eager_one():
    """The backend registry is loaded with quant-dynamo, not lazily inside the first trace
    (entry points and the choice of a backend do not trace)."""
    from _dynamo_helpers import run_in_fresh_process

    _needs_method_calls_in_graphs()
    run_in_fresh_process(
        "import torch, quant_dynamo\n"
        "from quant_core import MXFP8Quantizer\n"
        "q = MXFP8Quantizer(internal=True)\n"
        "fn = torch.compile(lambda a: q.quantize(a).dequantize(), fullgraph=True,\n"
        "                   backend='aot_eager')\n"
        "x = torch.randn(32, 64)\n"
        "assert torch.equal(fn(x), q.quantize(x).dequantize())\n"
    )
