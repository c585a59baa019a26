"""torch.compile(fullgraph=True): built-in recipes and the nested-CustomRecipe test
(behaviour.md §10.1 tests 1-2). Skipped without quant-dynamo or the opaque-object API."""

from __future__ import annotations

import re

import formats
import pytest
import quant_recipes as qr
import torch
from quant_core import DType, Float8CurrentScalingQuantizer, value_quantizer

quant_dynamo = pytest.importorskip("quant_dynamo", reason="compile tests need quant-dynamo")
if not quant_dynamo.compile_supported():
    pytest.skip(f"no opaque-object API on torch {torch.__version__}", allow_module_level=True)

from torch._dynamo.testing import CompileCounterWithBackend  # noqa: E402

#: Every format's built-in recipe (tests/formats.py).
RECIPES = {name: make() for name, make in formats.default_recipes().items()}


def _linear_under(recipe, in_features=64, out_features=32, dtype=torch.bfloat16):
    """A fresh Linear (seeded) and ``fn(x)`` running it under ``autocast(recipe=recipe)``."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    m = qr.Linear(in_features, out_features, dtype=dtype)

    def fn(x):
        with qr.autocast(recipe=recipe):
            return m(x)

    return m, fn


def _step(fn, m, x, seed):
    torch.manual_seed(seed)
    x = x.clone().requires_grad_()
    m.zero_grad(set_to_none=True)
    y = fn(x)
    (y.float() * torch.linspace(-1, 2, y.shape[-1])).sum().backward()
    return y.detach(), x.grad, m.weight.grad, m.bias.grad


def test_compiled_two_dim_output_is_not_regenerated():
    """The compiled Linear's 2-D output is a graph output of its own, not an alias of
    an intermediate that the compiled function rebuilds with ``aten._unsafe_view`` per call."""
    m, fn = _linear_under(RECIPES["current"])
    x = torch.randn(16, 64, dtype=torch.bfloat16, requires_grad=True)
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    compiled(x)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        y = compiled(x)
    assert [e.name for e in prof.events()].count("aten::_unsafe_view") == 0
    assert torch.equal(y, fn(x))


@pytest.mark.parametrize("backend", ["aot_eager", "inductor"])
@pytest.mark.parametrize("name", list(RECIPES))
def test_linear_fullgraph_matches_eager(name, backend):
    if backend == "inductor" and name not in ("current", "mxfp8"):
        pytest.skip("Inductor is exercised on two recipes to keep compile costs low")
    m, fn = _linear_under(RECIPES[name])
    counter = CompileCounterWithBackend(backend)
    compiled = torch.compile(fn, backend=counter, fullgraph=True)
    x = torch.randn(32, 64, dtype=torch.bfloat16)
    steps = 20 if backend == "aot_eager" else 3
    for i in range(steps):
        xi = x * (1 + i / 10)
        got = _step(compiled, m, xi, seed=i)
        ref = _step(fn, m, xi, seed=i)
        for a, b in zip(got, ref, strict=True):
            assert torch.equal(a, b)
    assert counter.frame_count == 1


@value_quantizer
class ToyQuantizer(Float8CurrentScalingQuantizer):
    """Current scaling that logs its tag whenever it quantizes."""

    tag: str = ""

    def quantize(self, x, **kwargs):
        LOG.append((self.tag, tuple(x.shape)))
        return super().quantize(x, **kwargs)


LOG: list = []


def _factory(tag):
    made = {
        kind: ToyQuantizer(DType.E5M2 if kind == "grad_output" else DType.E4M3,
                           tag=f"{tag}:{kind}")
        for kind in ("input", "weight", "output", "grad_output", "grad_input")
    }

    def qfactory(role):
        if role is None:
            return qr.IdentityQuantizer()
        return made[role.tensor_type]

    return qfactory


def test_autocast_nested_custom():
    torch._dynamo.reset()
    torch.manual_seed(0)
    m = qr.Linear(32, 32)
    r0, r1, r2 = (qr.CustomRecipe(qfactory=_factory(t)) for t in ("R0", "R1", "R2"))

    def fn(x):
        with qr.autocast(recipe=r0):
            y = m(x)
            with qr.autocast(recipe=r1):
                y = m(y)
        with qr.autocast(recipe=r2):
            y = m(y)
        return y

    x = torch.randn(16, 32)
    counter = CompileCounterWithBackend("aot_eager")
    results = []
    for f in (torch.compile(fn, backend=counter, fullgraph=True), fn):
        LOG.clear()
        xi = x.clone().requires_grad_()
        m.zero_grad(set_to_none=True)
        y = f(xi)
        fwd_log = list(LOG)
        LOG.clear()
        y.sum().backward()
        bwd_log = list(LOG)
        assert [t for t, _ in fwd_log] == [
            "R0:input", "R0:weight", "R1:input", "R1:weight", "R2:input", "R2:weight"]
        assert [t for t, _ in bwd_log] == ["R2:grad_output", "R1:grad_output", "R0:grad_output"]
        results.append((y.detach(), xi.grad, m.weight.grad, m.bias.grad))
    for a, b in zip(*results, strict=True):
        assert torch.equal(a, b)
    assert counter.frame_count == 1


def test_qdq_with_identity_quantizer_does_not_alias_its_input():
    """``quant::qdq`` with ``IdentityQuantizer`` returned its input object (a
    custom op's output may not alias an input: in-place ops on the result changed ``x``)."""
    quant_dynamo = pytest.importorskip("quant_dynamo")
    x = torch.randn(8, 16)
    before = x.clone()
    y = quant_dynamo.qdq(x, qr.IdentityQuantizer())
    assert torch.equal(y, x) and y.untyped_storage().data_ptr() != x.untyped_storage().data_ptr()
    y.add_(1.0)
    assert torch.equal(x, before)


@pytest.mark.parametrize("name", list(RECIPES))
def test_dynamic_shapes_with_a_recipe_from_outside(name):
    """``dynamic=True`` with a recipe captured from outside the compiled function
    (its float fields, e.g. ``amax_epsilon``, must stay constants of the quantizers): one graph
    for every batch size, equal to eager."""
    m, fn = _linear_under(RECIPES[name])
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True, dynamic=True)
    for i, rows in enumerate((32, 48, 80)):
        x = torch.randn(rows, 64, dtype=torch.bfloat16)
        got = _step(compiled, m, x, seed=i)
        ref = _step(fn, m, x, seed=i)
        for a, b in zip(got, ref, strict=True):
            assert torch.equal(a, b)
    # one graph for all three batch sizes (Dynamo may restart the analysis of the first one to
    # specialise a float, which a frame counter would count twice)
    assert len(torch._dynamo.eval_frame._debug_get_cache_entry_list(fn.__code__)) == 1


def test_no_recompile_after_the_first_eager_autocast_of_a_thread():
    """A graph compiled before the thread ever entered autocast eagerly must not guard on the
    thread state's absence (it recompiled once the eager region created it)."""
    import threading

    _, fn = _linear_under(qr.Float8CurrentScaling(), 32, 16, torch.float32)
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    x = torch.randn(16, 32)
    errors = []

    def run():  # a fresh thread: no autocast state yet
        try:
            compiled(x)
            fn(x)
            compiled(x)
        except Exception as exc:  # surfaced below
            errors.append(exc)

    torch._dynamo.reset()
    t = threading.Thread(target=run)
    t.start()
    t.join()
    assert not errors
    assert len(torch._dynamo.eval_frame._debug_get_cache_entry_list(fn.__code__)) == 1


def _delayed_quantizer(role):
    from quant_core import Float8Quantizer

    return Float8Quantizer(torch.ones(1), torch.zeros(1), DType.E4M3)


@pytest.mark.parametrize(
    "factory,message",
    [
        (lambda role: None, "returned None for slot 0 (role 'linear|input')"),
        (lambda role: "x", "got str for slot 0 (role 'linear|input')"),
        (_delayed_quantizer, "Float8Quantizer has identity semantics"),
    ],
    ids=["none", "not-a-quantizer", "delayed"],
)
def test_custom_recipe_factory_errors_under_compile(factory, message):
    """The intended message reaches a fullgraph caller (before, a dataclass
    repr tripped Dynamo first, and a delayed quantizer was called a subclass without identity)."""
    _, fn = _linear_under(qr.CustomRecipe(qfactory=factory), 32, 16, torch.float32)
    with pytest.raises(Exception, match=re.escape(message)) as info:
        torch.compile(fn, backend="aot_eager", fullgraph=True)(torch.randn(16, 32))
    assert str(info.value).startswith("CustomRecipe.qfactory ")  # quant's message comes first


#: A Linear under Float8CurrentScaling in a fresh process, compiled with fullgraph=True; the
#: prelude runs first (before torch is imported).
_FRESH_PROCESS = """
{prelude}
import torch
import quant_recipes as qr  # quant_dynamo is never imported by hand here
lin = qr.Linear(64, 32)
recipe = qr.Float8CurrentScaling()
def fwd(x):
    with qr.autocast(recipe=recipe):
        return lin(x)
x = torch.randn(16, 64)
assert fwd(x).shape == (16, 32)  # eager use
try:
    y = torch.compile(fwd, backend="aot_eager", fullgraph=True)(x)
    print("equal" if torch.equal(y, fwd(x)) else "differs")
except Exception as exc:
    print(str(exc))
"""


def _fresh_process(prelude: str = "") -> str:
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", _FRESH_PROCESS.format(prelude=prelude)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def test_first_compile_in_a_fresh_process_without_importing_quant_dynamo():
    """The value classes must be registered before Dynamo first sees one: a user who imports
    only quant_recipes got 'Failed to convert args/kwargs to proxy' (quant_dynamo was imported
    lazily, mid-trace, after Dynamo had wrapped the quantizer as a plain object)."""
    assert _fresh_process().strip().endswith("equal")


def test_compiling_without_quant_dynamo_names_the_install_command():
    """An unguarded function-local import ran first and gave a bare
    ModuleNotFoundError instead of the intended message."""
    out = _fresh_process('import sys; sys.modules["quant_dynamo"] = None  # not installed')
    assert "compiling a quant_recipes module needs quant-dynamo" in out
    assert "pip install ./packages/quant-dynamo" in out
    # quant's message is the first thing the caller reads, not Dynamo's report around it
    assert out.startswith("compiling a quant_recipes module needs quant-dynamo")


def _delayed_inside(m):
    def fn(x):
        with qr.autocast(recipe=qr.DelayedScaling()):
            return m(x)

    return fn


def _delayed_outside(m):
    recipe = qr.DelayedScaling()

    def fn(x):
        return m(x)

    def run(x):
        with qr.autocast(recipe=recipe):
            return torch.compile(fn, backend="eager", fullgraph=True)(x)

    return run


@pytest.mark.parametrize("where", [_delayed_inside, _delayed_outside], ids=["inside", "outside"])
def test_delayed_scaling_under_fullgraph_compile_raises_quants_error_first(where):
    """A refusal in traced code used to reach a fullgraph caller as Dynamo's "Observed
    exception" report, with quant's message deep in its debug context. It is raised at trace
    time now, as an error Dynamo passes through: its text starts with quant's message, and it is
    the error class eager code raises for the same mistake."""
    from quant_recipes.compiling import CompileError

    torch._dynamo.reset()
    m = qr.Linear(32, 16)
    run = where(m)
    if where is _delayed_inside:
        run = torch.compile(run, backend="eager", fullgraph=True)
    with pytest.raises(RuntimeError) as info:
        run(torch.randn(8, 32))
    assert str(info.value).startswith("DelayedScaling is not supported under torch.compile")
    assert isinstance(info.value, CompileError)


#: The quantizer class each run of :func:`_usage_flags`'s body saw. Where Dynamo traces the body
#: instead, each run of the compiled code appends (Dynamo replays the traced append).
_BODY_RUNS: list[str] = []


@qr.compiling.trace_time_constant
def _usage_flags(q) -> list[int]:
    """``[rowwise, columnwise]`` usage of ``q`` as ints, recording each run of this body."""
    _BODY_RUNS.append(type(q).__qualname__)
    return [int(q.rowwise_usage), int(q.columnwise_usage)]


@pytest.mark.skipif(
    quant_dynamo.status()["mode"] not in ("opaque_value", "opaque_value_base"),
    reason=f"torch {torch.__version__} traces trace_time_constant functions",
)
def test_trace_time_constant_runs_at_trace_time_on_the_real_quantizer():
    """Compiled code calls a ``trace_time_constant`` function once per call site at trace time,
    with the value quantizer itself (an argument of the compiled function, or one made in traced
    code), and bakes the result: running the compiled code again does not run the body. A
    quantizer of another value recompiles and computes it afresh; results equal eager ones."""

    def fn(x, q):
        given = _usage_flags(q)
        made = _usage_flags(Float8CurrentScalingQuantizer(rowwise_usage=False))
        return x * given[0] + x * (2 * given[1]) + x * (4 * made[0]) + x * (8 * made[1])

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(fn, backend=counter, fullgraph=True)
    x = torch.arange(4.0)  # small integers: every sum below is exact
    name = Float8CurrentScalingQuantizer.__qualname__
    q, other = Float8CurrentScalingQuantizer(), Float8CurrentScalingQuantizer(
        columnwise_usage=False)
    _BODY_RUNS.clear()
    assert torch.equal(compiled(x, q), x * 11)
    assert _BODY_RUNS == [name, name]  # at trace time, on the real quantizers
    assert torch.equal(compiled(x, q), x * 11)
    assert _BODY_RUNS == [name, name] and counter.frame_count == 1
    assert torch.equal(compiled(x, other), x * 9)
    assert _BODY_RUNS == [name] * 4 and counter.frame_count == 2  # recompiled for its value
    assert torch.equal(fn(x, other), x * 9)
    assert _BODY_RUNS == [name] * 6  # eagerly, the body runs at every call
