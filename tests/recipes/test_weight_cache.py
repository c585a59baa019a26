"""``cached_weights()``: each weight is quantized once while it is unchanged, and every change of
the Parameter (an optimizer step, fused or not, in any thread; ``load_state_dict``; ``.data``
assignment; an in-place refill or ``.data`` write after a step; ``invalidate_cached_weights()``)
quantizes it again; the results are the uncached run's bits."""

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


#: optimizers whose fused step updates the parameters in place without bumping their version
FUSED = {"adamw": torch.optim.AdamW, "adam": torch.optim.Adam,
         "sgd": lambda params, **kw: torch.optim.SGD(params, momentum=0.9, **kw)}


def _steps(layer, recipe, opt, n=3, micro_batches=2):
    """``n`` optimizer steps of ``micro_batches`` accumulated forwards each; the losses."""
    losses = []
    for x in _micro_batches(n * micro_batches):
        with qr.autocast(recipe=recipe):
            loss = layer(x).float().pow(2).mean()
        loss.backward()
        losses.append(loss.detach())
        if len(losses) % micro_batches == 0:
            opt.step()
            opt.zero_grad(set_to_none=True)
    return losses


def _same(a, b):
    return all(torch.equal(u, v) for u, v in zip(a, b, strict=True))


@pytest.mark.parametrize("optimizer", sorted(FUSED))
def test_a_fused_optimizer_step_quantizes_again(recipe_and_count, optimizer):
    recipe, calls = recipe_and_count

    def train():
        layer = _layer()
        return _steps(layer, recipe, FUSED[optimizer](layer.parameters(), lr=1e-2, fused=True))

    want = train()
    calls.clear()
    with qr.cached_weights():
        assert _same(train(), want)
    assert calls.count(W) == 3  # once per step: the micro-batches still share it


def test_a_weight_refilled_in_place_after_a_step_quantizes_again(recipe_and_count):
    """FSDP2's pattern: the optimizer steps the shards, and the next forward's all-gather copies
    them into the unsharded weight, keeping its storage and version."""
    recipe, _ = recipe_and_count

    def train():
        layer = _layer()
        shard = torch.nn.Parameter(layer.weight.detach().clone())
        opt = torch.optim.SGD([shard], lr=0.5)

        def step_shard():  # the gradient goes to the shard, as FSDP2's reduce-scatter does
            shard.grad = layer.weight.grad
            layer.weight.grad = None
            opt.step()
            opt.zero_grad(set_to_none=True)
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(layer.weight):
                layer.weight.copy_(shard)

        losses = []
        for x in _micro_batches(3):
            with qr.autocast(recipe=recipe):
                loss = layer(x).float().pow(2).mean()
            loss.backward()
            losses.append(loss.detach())
            step_shard()
        return losses

    want = train()
    with qr.cached_weights():
        assert _same(train(), want)


def test_data_writes_after_an_optimizer_step_are_seen(recipe_and_count):
    """Weight clipping and a teacher's hand-written EMA write through ``.data`` (no version
    bump) after the student's step; the teacher is in no optimizer. The step already made
    every cached copy stale."""
    recipe, _ = recipe_and_count

    def train():
        student, teacher = _layer(), _layer()
        teacher.weight.requires_grad_(False)
        opt = torch.optim.SGD(student.parameters(), lr=1e-2)
        losses = []
        for i, x in enumerate(_micro_batches(6)):
            with qr.autocast(recipe=recipe):
                target = teacher(x)  # a distillation target, as from an EMA teacher
                loss = (student(x) - target).float().pow(2).mean()
            loss.backward()
            losses.append(loss.detach())
            if i % 2:
                opt.step()
                opt.zero_grad(set_to_none=True)
                student.weight.data.clamp_(-0.1, 0.1)
                teacher.weight.data.mul_(0.5).add_(student.weight.data, alpha=0.5)
        return losses

    want = train()
    with qr.cached_weights():
        assert _same(train(), want)


def test_invalidate_cached_weights_after_writes_the_cache_cannot_see(recipe_and_count):
    """A hand-written update through ``.data`` with no optimizer bumps no version."""
    recipe, _ = recipe_and_count
    layer, x = _layer(), _micro_batches(1)
    with qr.cached_weights():
        _accumulate(layer, recipe, x)
        layer.weight.data.sub_(layer.weight.grad, alpha=0.5)
        qr.invalidate_cached_weights()
        got, _ = _accumulate(layer, recipe, x)
    fresh = _layer()
    fresh.load_state_dict(layer.state_dict())
    assert torch.equal(got[0], _accumulate(fresh, recipe, x)[0][0])


def test_a_step_or_an_invalidation_in_another_thread_reaches_this_threads_cache(
        recipe_and_count):
    """The optimizer may step where the forward does not run (DDP's communication hooks, the
    autograd engine's device threads)."""
    recipe, calls = recipe_and_count
    layer = _layer()
    opt = torch.optim.SGD(layer.parameters(), lr=0.5, fused=True)
    x = _micro_batches(1)
    with qr.cached_weights():
        _accumulate(layer, recipe, x)
        for act in (opt.step, qr.invalidate_cached_weights):
            t = threading.Thread(target=act)
            t.start()
            t.join()
            got, _ = _accumulate(layer, recipe, x)
    assert calls.count(W) == 3
    fresh = _layer()
    fresh.load_state_dict(layer.state_dict())
    assert torch.equal(got[0], _accumulate(fresh, recipe, x)[0][0])


def test_the_optimizer_hook_lives_as_long_as_a_context():
    from torch.optim.optimizer import _global_optimizer_post_hooks as hooks

    before = len(hooks)
    with qr.cached_weights():
        assert len(hooks) == before + 1
        with qr.cached_weights():
            assert len(hooks) == before + 1
    assert len(hooks) == before


def test_inference_mode_forwards_read_the_cache_and_inference_weights_are_not_cached(
        recipe_and_count):
    recipe, calls = recipe_and_count
    x = _micro_batches(1)[0]
    layer = _layer()
    with torch.no_grad(), qr.autocast(recipe=recipe):
        want = layer(x)
    calls.clear()
    with qr.cached_weights(), torch.inference_mode(), qr.autocast(recipe=recipe):
        assert torch.equal(layer(x), want) and torch.equal(layer(x), want)
        assert calls.count(W) == 1
        made = _layer()  # its weight is an inference tensor: no version to check
        assert torch.equal(made(x), want)
        made.weight.mul_(2)
        assert torch.equal(made(x), layer(x * 2))
