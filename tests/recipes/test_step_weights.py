"""``quantize_weights_per_step``: forwards, eager and compiled, read the weights quantized after
the last optimizer step and give the bits of quantizing in forward; every change the contract
names refreshes or drops the kept copies."""

from __future__ import annotations

import copy
import pickle
import threading

import formats
import pytest
import quant_recipes as qr
import torch
import torch._dynamo.testing
import torch.utils.checkpoint
from _counting import count_quantizations

try:
    from quant_dynamo import compile_supported
except ImportError:  # quant-recipes alone: the eager tests run, the compiled ones skip
    def compile_supported() -> bool:
        return False

#: The tests that compile: they need quant-dynamo and a torch with the opaque-object API
compiles = pytest.mark.skipif(not compile_supported(),
                              reason="no quant-dynamo, or no opaque-object API on this torch")

#: recipe -> (factory, the class of its quantizers): one built-in recipe per format
RECIPES = {name: (make, type(formats.format_of(name).quantizer()))
           for name, make in formats.default_recipes().items()}

W1, W2 = (256, 128), (384, 256)  # the two layers' weight shapes (whole blocks of every format)
X = (16, 128)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    """Each test compiles new models of the same classes: start from no cached frames."""
    torch._dynamo.reset()


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(qr.Linear(128, 256, dtype=torch.bfloat16),
                               qr.Linear(256, 384, bias=False, dtype=torch.bfloat16))


def _batches(n):
    gen = torch.Generator().manual_seed(1)
    return [torch.randn(*X, generator=gen).to(torch.bfloat16).requires_grad_() for _ in range(n)]


def _train(model, recipe, steps=2, micro=2, call=None):
    """``steps`` SGD steps of ``micro`` accumulated micro-batches: the outputs, the input
    gradients and the final weights."""
    call = call or model
    opt = torch.optim.SGD(model.parameters(), lr=0.25)
    outs = []
    for xs in [_batches(micro) for _ in range(steps)]:
        for x in xs:
            with qr.autocast(recipe=recipe):
                y = call(x)
            y.float().pow(2).sum().backward()
            outs += [y.detach(), x.grad]
        opt.step()
        opt.zero_grad(set_to_none=True)
    return outs + [p.detach() for p in model.parameters()]


def _equal(a, b):
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


@pytest.fixture(params=sorted(RECIPES))
def recipe_and_count(request, monkeypatch):
    make, quantizer_cls = RECIPES[request.param]
    return make(), count_quantizations(monkeypatch, quantizer_cls)


def test_eager_training_quantizes_each_weight_once_per_step_and_changes_no_bit(
        recipe_and_count):
    recipe, calls = recipe_and_count
    want = _train(_model(), recipe)
    assert calls.count(W1) == calls.count(W2) == 4  # one per forward without the handle
    calls.clear()
    model = _model()
    handle = qr.quantize_weights_per_step(model, recipe)
    assert len(handle) == 2
    got = _train(model, recipe)
    handle.remove()
    # made at the start and after each of the two steps; no forward quantized a weight
    assert calls.count(W1) == calls.count(W2) == 3
    assert _equal(got, want)


@compiles
def test_compiled_training_reads_the_kept_weights_without_recompiling(recipe_and_count):
    recipe, calls = recipe_and_count
    want = _train(_model(), recipe)
    calls.clear()
    model = _model()
    frames = torch._dynamo.testing.CompileCounter()
    compiled = torch.compile(model, backend=frames, fullgraph=True)
    handle = qr.quantize_weights_per_step(model, recipe)
    got = _train(model, recipe, call=compiled)
    handle.remove()
    assert frames.frame_count == 1
    # the graph quantizes the inputs only: its traced calls and runs quantize no weight
    assert calls.count(W1) == calls.count(W2) == 3
    assert _equal(got, want)


@compiles
def test_backward_reads_the_kept_copy_where_the_layer_saves_no_weight_copy(monkeypatch):
    recipe = qr.Float8CurrentScaling()
    calls = count_quantizations(monkeypatch, type(formats.format_of("current").quantizer()))

    def lean():
        model = _model()
        for layer in model:
            layer.save_weight_copy = False
        return model

    want = _train(lean(), recipe, steps=1, micro=1)
    assert calls.count(W1) == 2  # forward's rowwise copy, backward's columnwise copy
    calls.clear()
    model = lean()
    handle = qr.quantize_weights_per_step(model, recipe)
    got = _train(model, recipe, steps=1, micro=1,
                 call=torch.compile(model, backend="aot_eager", fullgraph=True))
    handle.remove()
    assert calls.count(W1) == calls.count(W2) == 2  # made at the start and after the step
    assert _equal(got, want)


def test_a_recomputed_forward_reads_the_kept_weight(monkeypatch):
    recipe = qr.Float8CurrentScaling()
    calls = count_quantizations(monkeypatch, type(formats.format_of("current").quantizer()))
    model = _model()
    handle = qr.quantize_weights_per_step(model, recipe)
    calls.clear()
    x = _batches(1)[0]
    with qr.autocast(recipe=recipe):
        y = torch.utils.checkpoint.checkpoint(model, x, use_reentrant=False)
    y.float().sum().backward()
    handle.remove()
    assert calls.count(W1) == calls.count(W2) == 0
    plain = _model()
    with qr.autocast(recipe=recipe):
        want = plain(x)
    assert torch.equal(y, want)


def _kept_model(recipe):
    model = _model()
    handle = qr.quantize_weights_per_step(model, recipe)
    return model, handle


def _changed_model(change):
    """A model with other weights: ``change(p)`` applied in place to each parameter."""
    model = _model()
    with torch.no_grad():
        for p in model.parameters():
            change(p)
    return model


def _forward(model, recipe, x=None):
    with qr.autocast(recipe=recipe):
        return model(_batches(1)[0] if x is None else x)


@compiles
def test_load_state_dict_and_invalidate_refresh_the_kept_weights():
    recipe = qr.Float8CurrentScaling()
    model, handle = _kept_model(recipe)
    other = _changed_model(lambda p: p.mul_(-2))
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    x = _batches(1)[0]
    model.load_state_dict(other.state_dict())
    with qr.autocast(recipe=recipe):
        got = compiled(x)
    assert torch.equal(got, _forward(other, recipe, x))
    with torch.no_grad():  # a write the compiled graph cannot see, then the documented call
        model[0].weight.mul_(3)
        other[0].weight.mul_(3)
    qr.invalidate_cached_weights()
    with qr.autocast(recipe=recipe):
        got = compiled(x)
    assert torch.equal(got, _forward(other, recipe, x))
    handle.remove()


def _kept_addresses(model):
    return [[b.data_ptr() for b in m._step_weight.buffers] for m in model]


def test_a_refresh_writes_into_the_kept_buffers(recipe_and_count):
    """The kept buffers keep their addresses from step to step (a CUDA graph of a compiled
    layer reads them where it recorded them), and hold the new step's bytes."""
    recipe, _ = recipe_and_count
    model, handle = _kept_model(recipe)
    before = _kept_addresses(model)
    first = [[b.clone() for b in m._step_weight.buffers] for m in model]
    _train(model, recipe, steps=2, micro=1)
    assert _kept_addresses(model) == before
    want, want_handle = _kept_model(recipe)  # a fresh keep of the trained weights
    want.load_state_dict(model.state_dict())
    for m, w, old in zip(model, want, first, strict=True):
        assert _equal(m._step_weight.buffers, w._step_weight.buffers)
        assert not _equal(m._step_weight.buffers, old)
    handle.remove()
    want_handle.remove()


def test_a_backward_that_saved_the_old_bytes_refuses_them_after_a_refresh():
    recipe = qr.Float8CurrentScaling()
    model, handle = _kept_model(recipe)
    x = _batches(1)[0]
    with qr.autocast(recipe=recipe):
        y = model(x)
    with torch.no_grad():
        model[0].weight.mul_(2)
    handle.refresh()
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.float().sum().backward()
    handle.remove()


def test_eager_forwards_see_in_place_writes_and_data_assignment():
    recipe = qr.Float8CurrentScaling()
    model, handle = _kept_model(recipe)
    plain = _model()
    with torch.no_grad():
        model[0].weight.mul_(0.5)
        plain[0].weight.mul_(0.5)
    assert torch.equal(_forward(model, recipe), _forward(plain, recipe))
    model[1].weight.data = plain[1].weight.data.flip(0)
    plain[1].weight.data = plain[1].weight.data.flip(0)
    assert torch.equal(_forward(model, recipe), _forward(plain, recipe))
    handle.remove()


def test_conversions_copies_and_pickles_drop_the_kept_weights():
    recipe = qr.Float8CurrentScaling()
    model, handle = _kept_model(recipe)
    assert copy.deepcopy(model)[0]._step_weight is None
    assert pickle.loads(pickle.dumps(model))[1]._step_weight is None
    assert model[0]._step_weight is not None
    model.float()
    assert len(handle) == 0
    plain = _model().float()
    assert torch.equal(_forward(model, recipe, _batches(1)[0].float()),
                       _forward(plain, recipe, _batches(1)[0].float()))
    handle.refresh()
    assert len(handle) == 2
    assert torch.equal(_forward(model, recipe, _batches(1)[0].float()),
                       _forward(plain, recipe, _batches(1)[0].float()))
    handle.remove()


@compiles
def test_functional_call_uses_the_weights_it_is_given():
    recipe = qr.Float8CurrentScaling()
    model, handle = _kept_model(recipe)
    other = _changed_model(lambda p: p.add_(1))
    params = dict(other.named_parameters())
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True)
    x = _batches(1)[0]
    want = _forward(other, recipe, x)
    with qr.autocast(recipe=recipe):
        assert torch.equal(torch.func.functional_call(model, params, (x,)), want)
        assert torch.equal(torch.func.functional_call(compiled, params, (x,)), want)
    handle.remove()


def test_no_grad_and_frozen_inputs_quantize_in_forward(monkeypatch):
    recipe = qr.Float8CurrentScaling()
    calls = count_quantizations(monkeypatch, type(formats.format_of("current").quantizer()))
    model, handle = _kept_model(recipe)
    calls.clear()
    with torch.no_grad():  # no input gradient: the rowwise copy alone, quantized in forward
        _forward(model, recipe)
    assert calls.count(W1) == calls.count(W2) == 1
    _forward(model, recipe, _batches(1)[0].detach())  # the first layer's input needs none
    assert calls.count(W1) == 2 and calls.count(W2) == 1
    handle.remove()
    calls.clear()
    _forward(model, recipe)
    assert calls.count(W1) == calls.count(W2) == 1
    assert model[0]._step_weight is None


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=compiles)])
def test_another_recipe_quantizes_in_forward(compiled):
    model, handle = _kept_model(qr.Float8CurrentScaling())
    plain = _model()
    call = torch.compile(model, backend="aot_eager", fullgraph=True) if compiled else model
    x = _batches(1)[0]
    for other in (qr.MXFP8BlockScaling(), qr.Float8BlockScaling()):
        with qr.autocast(recipe=other):
            got = call(x)
        assert torch.equal(got, _forward(plain, other, x))
    handle.remove()


def test_delayed_scaling_keeps_nothing():
    model = _model()
    assert len(qr.quantize_weights_per_step(model, qr.DelayedScaling())) == 0
    handle = qr.quantize_weights_per_step(model, "fp8_current")
    assert len(handle) == 2
    handle.remove()


def test_grouped_experts_off_the_quantize_once_path_keep_nothing():
    # on the CPU the grouped layer runs its GEMMs per group (tests/recipes/test_grouped_fp8.py
    # runs the quantize-once path, whose weights are kept): it quantizes in forward, to the
    # same output
    torch.manual_seed(0)
    model = torch.nn.ModuleDict({"dense": qr.Linear(64, 64, bias=False),
                                 "experts": qr.GroupedLinear(4, 64, 32)})
    x = torch.randn(40, 64)
    counts = torch.tensor([8, 0, 20, 12])

    def run():
        with qr.autocast(recipe="fp8_current"):
            return model["experts"](model["dense"](x), counts=counts)

    want = run()
    handle = qr.quantize_weights_per_step(model, "fp8_current")
    assert len(handle) == 1
    assert getattr(model["experts"], "_step_weight", None) is None
    assert torch.equal(run(), want)
    handle.remove()


def test_a_step_in_another_thread_refreshes_only_its_weights(monkeypatch):
    from quant_recipes import step_weights

    recipe = qr.Float8CurrentScaling()
    model, handle = _kept_model(recipe)
    kept, refreshed = step_weights._keep, []
    monkeypatch.setattr(step_weights, "_keep", lambda layer, *a: refreshed.append(layer)
                        or kept(layer, *a))
    first = [b.clone() for b in model[0]._step_weight.buffers]
    opt = torch.optim.SGD(model[0].parameters(), lr=0.1)
    _forward(model, recipe).float().sum().backward()
    t = threading.Thread(target=opt.step)
    t.start()
    t.join()
    assert refreshed == [model[0]]
    assert not _equal(model[0]._step_weight.buffers, first)
    handle.remove()


def test_bad_arguments_are_refused():
    with pytest.raises(TypeError, match="model must be a torch.nn.Module"):
        qr.quantize_weights_per_step(object())
    with pytest.raises(ValueError, match="quantize_weights_per_step"):
        qr.quantize_weights_per_step(_model(), "fp9")


@compiles
def test_dynamic_shapes_and_a_frozen_layer_keep_the_bits():
    recipe = qr.Float8CurrentScaling()

    def frozen_first():
        model = _model()
        model[0].requires_grad_(False)
        return model

    plain, model = frozen_first(), frozen_first()
    handle = qr.quantize_weights_per_step(model, recipe)
    assert list(model.state_dict()) == list(plain.state_dict())  # nothing kept is state
    compiled = torch.compile(model, backend="aot_eager", fullgraph=True, dynamic=True)
    opt = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.25)
    ref_opt = torch.optim.SGD([p for p in plain.parameters() if p.requires_grad], lr=0.25)
    gen = torch.Generator().manual_seed(3)
    for rows in (16, 48, 32):
        x = torch.randn(rows, 128, generator=gen).to(torch.bfloat16).requires_grad_()
        outs = []
        for net, o in ((compiled, opt), (plain, ref_opt)):
            with qr.autocast(recipe=recipe):
                y = net(x)
            y.float().pow(2).sum().backward()
            outs.append((y.detach(), x.grad.clone()))
            x.grad = None
            o.step()
            o.zero_grad(set_to_none=True)
        assert torch.equal(outs[0][0], outs[1][0]) and torch.equal(outs[0][1], outs[1][1])
    assert model[0]._step_weight is not None  # frozen: never stepped, still kept
    handle.remove()


def test_two_threads_training_their_own_models_keep_the_bits():
    """Each thread's optimizer steps refresh its own model's weights only, while the other
    thread's forwards read theirs."""
    recipe = qr.Float8CurrentScaling()
    want = _train(_model(), recipe, steps=3)
    got, errors = {}, []
    # built here: _model() seeds and draws from torch's global generator, which two threads
    # drawing at once would interleave
    models = [_model() for _ in range(2)]

    def worker(i):
        try:
            model = models[i]
            handle = qr.quantize_weights_per_step(model, recipe)
            got[i] = _train(model, recipe, steps=3)
            handle.remove()
        except Exception as e:  # noqa: BLE001 - reported by the main thread
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert _equal(got[0], want) and _equal(got[1], want)
