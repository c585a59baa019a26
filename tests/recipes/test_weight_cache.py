"""``cached_weights()``: each weight is quantized once while it is unchanged, and every change of
the Parameter (an optimizer step, ``load_state_dict``, ``.data`` assignment) quantizes it again;
the results are the uncached run's bits."""

from __future__ import annotations

import threading

import formats
import pytest
import quant_recipes as qr
import torch
from _counting import count_quantizations
from torch.utils.checkpoint import checkpoint

#: recipe -> (factory, the class of its quantizers), from tests/formats.py
RECIPES = {name: (make, type(formats.format_of(name).quantizer()))
           for name, make in formats.recipes("current", "mxfp8").items()}


@pytest.fixture(params=sorted(RECIPES))
def recipe_and_count(request, monkeypatch):
    """The recipe, and the shapes its quantizer class is asked to quantize, in order."""
    recipe_cls, quantizer_cls = RECIPES[request.param]
    return recipe_cls(), count_quantizations(monkeypatch, quantizer_cls)

W = (32, 64)  # the layer's weight shape


def _layer():
    torch.manual_seed(0)
    return qr.Linear(64, 32, bias=False, dtype=torch.bfloat16)


def _micro_batches(n=3):
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(16, 64, generator=gen).to(torch.bfloat16) for _ in range(n)]


def _accumulate(layer, recipe, xs):
    outs = []
    for x in xs:
        with qr.autocast(recipe=recipe):
            y = layer(x)
        y.float().pow(2).sum().backward()
        outs.append(y.detach())
    return outs, layer.weight.grad.clone()


def test_micro_batches_quantize_the_weight_once_and_change_no_bit(recipe_and_count):
    recipe, calls = recipe_and_count
    plain = _layer()
    want, want_grad = _accumulate(plain, recipe, _micro_batches())
    assert calls.count(W) == 3  # one per forward without the cache
    calls.clear()
    layer = _layer()
    with qr.cached_weights():
        got, got_grad = _accumulate(layer, recipe, _micro_batches())
    assert calls.count(W) == 1
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert torch.equal(got_grad, want_grad)


def test_an_optimizer_step_load_state_dict_and_data_assignment_quantize_again(recipe_and_count):
    recipe, calls = recipe_and_count
    layer, fresh = _layer(), _layer()
    opt = torch.optim.SGD(layer.parameters(), lr=0.5)
    x = _micro_batches(1)
    with qr.cached_weights():
        _accumulate(layer, recipe, x)
        opt.step()  # in place: the weight's version changes
        layer.zero_grad(set_to_none=True)
        got, _ = _accumulate(layer, recipe, x)
        assert calls.count(W) == 2
        fresh.load_state_dict(layer.state_dict())
        assert torch.equal(got[0], _accumulate(fresh, recipe, x)[0][0])  # the stepped weight
        layer.load_state_dict(_layer().state_dict())  # copy_ back to the initial weight
        layer.zero_grad(set_to_none=True)
        after_load, _ = _accumulate(layer, recipe, x)
        assert calls.count(W) == 4
        layer.weight.data = torch.zeros_like(layer.weight)  # a new storage, same version
        layer.zero_grad(set_to_none=True)
        zeros, _ = _accumulate(layer, recipe, x)
        assert calls.count(W) == 5 and not zeros[0].any()
    assert torch.equal(after_load[0], _accumulate(_layer(), recipe, x)[0][0])


def test_without_the_context_nothing_is_kept(recipe_and_count):
    recipe, calls = recipe_and_count
    layer = _layer()
    with qr.cached_weights():
        _accumulate(layer, recipe, _micro_batches(1))
    assert not qr.weight_cache.active()
    _accumulate(layer, recipe, _micro_batches(1))
    assert calls.count(W) == 2


def test_activation_checkpointing_recomputes_without_quantizing_the_weight_again(
        recipe_and_count):
    recipe, calls = recipe_and_count
    layer = _layer()
    x = _micro_batches(1)[0].requires_grad_()

    def run():
        with qr.autocast(recipe=recipe):
            return checkpoint(layer, x, use_reentrant=False)

    with qr.cached_weights():
        run().float().pow(2).sum().backward()
    assert calls.count(W) == 1  # forward; the recomputed forward reads the cache


def test_delayed_scaling_is_never_cached():
    """A delayed-scaling scale changes at every region exit: its quantizer is not cached."""
    layer = qr.Linear(64, 32, bias=False)
    x = torch.randn(16, 64)
    with qr.cached_weights():
        with qr.autocast(recipe=qr.DelayedScaling()):
            a = layer(x)
        with qr.autocast(recipe=qr.DelayedScaling()):
            b = layer(x)
    assert not torch.equal(a, b)  # the second forward used the updated scale


def test_the_cache_is_per_thread():
    seen = []

    def worker():
        seen.append(qr.weight_cache.active())

    with qr.cached_weights():
        t = threading.Thread(target=worker)
        t.start()
        t.join()
        assert qr.weight_cache.active()
    assert seen == [False]


def test_a_dead_weight_releases_its_copies():
    with qr.cached_weights():
        layer = _layer()
        with qr.autocast(recipe=qr.Float8CurrentScaling()):
            layer(_micro_batches(1)[0])
        assert len(qr.weight_cache._state.cache) == 1
        del layer
        assert qr.weight_cache._state.cache == {}
