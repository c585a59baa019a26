"""On every torch release, a compiled quantized ``Linear`` gives eager's bits, forward and
backward: with ``fullgraph=True`` where quant-dynamo has an opaque-object API, and through graph
breaks where it has none (torch 2.9: `docs/torch-versions.md` §3)."""

from __future__ import annotations

import formats
import pytest
import quant_dynamo
import quant_recipes as qr
import torch

#: Every format's built-in recipe (tests/formats.py).
RECIPES = {name: make() for name, make in formats.default_recipes().items()}


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_compiled_linear_equals_eager(name):
    recipe = RECIPES[name]
    torch.manual_seed(0)
    layer = qr.Linear(64, 32, dtype=torch.bfloat16)

    def step(x):
        with qr.autocast(recipe=recipe):
            return layer(x)

    x = torch.randn(32, 64, dtype=torch.bfloat16, requires_grad=True)
    eager = step(x)
    eager.float().sum().backward()
    grads = (x.grad, layer.weight.grad)
    x.grad = layer.weight.grad = None

    torch._dynamo.reset()
    fullgraph = quant_dynamo.status()["mode"] != "none"
    compiled = torch.compile(step, backend="aot_eager", fullgraph=fullgraph)(x)
    compiled.float().sum().backward()
    assert torch.equal(compiled, eager)
    assert torch.equal(x.grad, grads[0]) and torch.equal(layer.weight.grad, grads[1])


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_compiled_inference_equals_eager(name):
    """Without gradients the module narrows its quantizers' usages (derived inside the graph
    where the API allows it; torch 2.10 keeps the full-usage quantizer): same bits either way."""
    recipe = RECIPES[name]
    layer = qr.Linear(64, 32, dtype=torch.bfloat16)

    def step(x):
        with qr.autocast(recipe=recipe):
            return layer(x)

    x = torch.randn(32, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        eager = step(x)
        torch._dynamo.reset()
        fullgraph = quant_dynamo.status()["mode"] != "none"
        compiled = torch.compile(step, backend="aot_eager", fullgraph=fullgraph)(x)
    assert torch.equal(compiled, eager)


def test_autocast_entered_outside_the_compiled_function_is_followed():
    """A compiled Linear called inside autocast
    regions entered eagerly, with the recipe swapped between calls, in this thread and in
    another one, gives eager's bits for the recipe active in the calling thread."""
    import threading

    torch.manual_seed(0)
    layer = qr.Linear(64, 32, dtype=torch.bfloat16)
    x = torch.randn(32, 64, dtype=torch.bfloat16)
    torch._dynamo.reset()
    fullgraph = quant_dynamo.status()["mode"] != "none"
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=fullgraph)
    with torch.no_grad():
        for name in ("current", "mxfp8", "current"):
            with qr.autocast(recipe=RECIPES[name]):
                assert torch.equal(compiled(x), layer(x)), name
        assert torch.equal(compiled(x), layer(x))  # no autocast: plain linear
        results = {}

        def other_thread():
            with torch.no_grad(), qr.autocast(recipe=RECIPES["block"]):
                results["got"], results["want"] = compiled(x), layer(x)

        with qr.autocast(recipe=RECIPES["mxfp8"]):  # the main thread's recipe stays its own
            t = threading.Thread(target=other_thread)
            t.start()
            t.join(timeout=120)
            assert torch.equal(compiled(x), layer(x))
    assert torch.equal(results["got"], results["want"])
    with torch.no_grad(), qr.autocast(recipe=RECIPES["block"]):
        assert torch.equal(results["want"], layer(x))
