"""Quantized parameters (``quantized_model_init``): a Linear whose weight is stored quantized
computes what the high-precision Linear computes under the same recipe, bit for bit (the weight
quantized once at init is the weight quantized in forward); state_dict, deepcopy and a training
step through ``MasterWeights`` keep the contract."""

from __future__ import annotations

import copy
import io

import formats
import pytest
import quant_recipes as qr
import torch
from quant_core.tensor import QuantizedTensor

#: Every format's built-in recipe (tests/formats.py), by qualified id.
RECIPES = {name: make() for name, make in formats.default_recipes(qualified=True).items()}


def _models(recipe, **init):
    """(high-precision model, quantized-parameter model) built from the same seed."""
    def build():
        torch.manual_seed(0)
        return torch.nn.Sequential(qr.Linear(64, 96, dtype=torch.bfloat16),
                                   qr.Linear(96, 32, bias=False, dtype=torch.bfloat16))

    hp = build()
    with qr.quantized_model_init(recipe, **init):
        quantized = build()
    return hp, quantized


def _step(model, recipe, x):
    x = x.clone().requires_grad_()
    torch.manual_seed(1)  # NVFP4's stochastic rounding of gradients draws the same seeds
    with qr.autocast(recipe=recipe):
        y = model(x)
    y.float().pow(2).sum().backward()
    return y, x.grad


@pytest.mark.parametrize("name", RECIPES)
def test_quantized_parameters_compute_the_high_precision_layer(name):
    recipe = RECIPES[name]
    hp, quantized = _models(recipe, preserve_high_precision_init_val=True)
    for a, b in zip(hp, quantized, strict=True):
        assert isinstance(b.weight, QuantizedTensor) and b.weight.requires_grad
        assert torch.equal(qr.get_high_precision_init_val(b.weight), a.weight)
        assert b.weight.quantizer.storage_format == {"fp8_current": "fp8"}.get(name, name)
    x = torch.randn(32, 64, dtype=torch.bfloat16)
    y0, dx0 = _step(hp, recipe, x)
    y1, dx1 = _step(quantized, recipe, x)
    assert torch.equal(y0, y1) and torch.equal(dx0, dx1)
    for a, b in zip(hp.parameters(), quantized.parameters(), strict=True):
        assert type(b.grad) is torch.Tensor and b.grad.dtype == a.grad.dtype
        assert torch.equal(a.grad, b.grad)


def test_outside_autocast_the_weight_is_dequantized():
    _, quantized = _models(RECIPES["fp8_current"])
    layer = quantized[1]
    x = torch.randn(4, 96, dtype=torch.bfloat16)
    layer(x).sum().backward()
    w = layer.weight.dequantize(dtype=torch.bfloat16)
    assert torch.equal(layer(x), torch.nn.functional.linear(x, w))
    assert layer.weight.grad is not None and layer.weight.grad.shape == w.shape


def test_another_recipe_is_refused():
    _, quantized = _models(RECIPES["fp8_current"])
    with qr.autocast(recipe=qr.Float8BlockScaling()), pytest.raises(
            ValueError, match="quantized by Float8CurrentScalingQuantizer"):
        quantized(torch.randn(4, 64, dtype=torch.bfloat16))


def test_delayed_scaling_is_refused():
    with pytest.raises(ValueError, match="DelayedScaling"), \
            qr.quantized_model_init(qr.DelayedScaling()):
        pass


def test_disabled_and_nested_regions():
    with qr.quantized_model_init(qr.Float8CurrentScaling()):
        with qr.quantized_model_init(enabled=False):
            plain = qr.Linear(32, 32)
        quantized = qr.Linear(32, 32)
    assert type(plain.weight) is torch.nn.Parameter
    assert isinstance(quantized.weight, QuantizedTensor)
    assert type(qr.Linear(32, 32).weight) is torch.nn.Parameter  # the region has exited


def _buffers_equal(a, b):
    return all((x is None and y is None) or torch.equal(x, y)
               for x, y in zip(a.buffers().values(), b.buffers().values(), strict=True))


@pytest.mark.parametrize("name", ["fp8_current", "mxfp8"])
def test_state_dict_round_trip(name):
    recipe = RECIPES[name]
    _, src = _models(recipe)
    blob = io.BytesIO()
    torch.save(src.state_dict(), blob)
    blob.seek(0)
    state = torch.load(blob, weights_only=False)
    torch.manual_seed(5)
    with qr.quantized_model_init(recipe):
        dst = torch.nn.Sequential(qr.Linear(64, 96, dtype=torch.bfloat16),
                                  qr.Linear(96, 32, bias=False, dtype=torch.bfloat16))
    assert not _buffers_equal(src[0].weight, dst[0].weight)
    dst.load_state_dict(state)
    for a, b in zip(src, dst, strict=True):
        assert isinstance(b.weight, QuantizedTensor) and _buffers_equal(a.weight, b.weight)
    assert torch.equal(src[0].bias, dst[0].bias)
    # a high-precision state dict loads by quantizing
    hp, _ = _models(recipe)
    dst.load_state_dict(hp.state_dict())
    expected = dst[0].weight.quantizer.quantize(hp[0].weight.detach())
    assert _buffers_equal(expected, dst[0].weight)


def test_deepcopy_is_independent():
    _, src = _models(RECIPES["fp8_block"])
    dup = copy.deepcopy(src)
    assert isinstance(dup[0].weight, QuantizedTensor) and _buffers_equal(src[0].weight,
                                                                        dup[0].weight)
    qr.requantize_(dup[0].weight, torch.zeros(96, 64, dtype=torch.bfloat16))
    assert not _buffers_equal(src[0].weight, dup[0].weight)


@pytest.mark.parametrize("preserve", [True, False])
def test_training_step_updates_the_master_and_requantizes(preserve):
    """The optimizer steps the fp32 master (started from the preserved init value, else the
    dequantized weight) with the high-precision layer's gradient; the weight is then the
    master quantized. Expected values: SGD run on copies of the expected starts."""
    recipe = RECIPES["fp8_current"]
    hp, quantized = _models(recipe, preserve_high_precision_init_val=preserve)
    starts = [hp[i].weight.detach().float() if preserve
              else quantized[i].weight.dequantize(dtype=torch.float32).detach() for i in (0, 1)]
    masters = qr.MasterWeights(quantized)
    opt = torch.optim.SGD(masters.parameters(), lr=0.1)
    x = torch.randn(32, 64, dtype=torch.bfloat16)
    _step(quantized, recipe, x)
    _step(hp, recipe, x)
    expected = [torch.nn.Parameter(s.clone()) for s in starts]
    expected.append(torch.nn.Parameter(hp[0].bias.detach().clone()))
    for e, g in zip(expected, (hp[0].weight.grad, hp[1].weight.grad, hp[0].bias.grad),
                    strict=True):
        e.grad = g.to(e.dtype)
    torch.optim.SGD(expected, lr=0.1).step()
    masters.step(opt)
    for i, (p, master) in enumerate(masters.pairs):
        assert p is quantized[i].weight and p.grad is None and master.dtype == torch.float32
        assert torch.equal(master, expected[i])
        assert _buffers_equal(p.quantizer.quantize(master.detach()), p)
    assert torch.equal(quantized[0].bias, expected[2])


@pytest.mark.parametrize("name", RECIPES)
def test_compiled_equals_eager(name):
    """A compiled forward and backward with quantized parameters (fullgraph) give eager's bits."""
    _needs_compile_support()
    recipe = RECIPES[name]
    _, model = _models(recipe)

    def forward(x):
        with qr.autocast(recipe=recipe):
            return model(x)

    x = torch.randn(32, 64, dtype=torch.bfloat16)
    runs = []
    for fn in (forward, torch.compile(forward, fullgraph=True)):
        torch.manual_seed(1)
        y = fn(x)
        y.float().pow(2).sum().backward()
        runs.append([y.detach(), *(p.grad for p in model.parameters())])
        model.zero_grad(set_to_none=True)
    for a, b in zip(*runs, strict=True):
        assert torch.equal(a, b)


def _needs_compile_support():
    quant_dynamo = pytest.importorskip("quant_dynamo", reason="compiling needs quant-dynamo")
    if not quant_dynamo.compile_supported():
        pytest.skip(f"no opaque-object API on torch {torch.__version__}: quant compiles from 2.10")


@pytest.mark.parametrize("compiled", [False, True])
def test_a_weight_quantized_in_another_element_format_is_refused_compiled_too(compiled):
    """An E4M3 weight under a recipe whose weights are E5M2: its bytes would decode as E5M2
    (NaN outputs); compiled code refuses it as eager code does."""
    if compiled:
        _needs_compile_support()
        quant_dynamo = pytest.importorskip("quant_dynamo")
        if not quant_dynamo.DERIVES_IN_GRAPH:
            pytest.skip("torch 2.10 cannot derive a quantizer's tags in a graph")
    _, quantized = _models(qr.Float8CurrentScaling())  # HYBRID: E4M3 weights
    e5m2 = qr.Float8CurrentScaling(fp8_format=qr.Format.E5M2)

    def forward(x):
        with qr.autocast(recipe=e5m2):
            return quantized(x)

    fn = torch.compile(forward, fullgraph=True, backend="aot_eager") if compiled else forward
    torch._dynamo.reset()
    # compiled, Dynamo wraps the ValueError ("Observed exception") with its message inside
    with pytest.raises(Exception, match=r"(?s)the weight is quantized by .*_fp8_dtype"
                                        if compiled else "the weight is quantized by"):
        fn(torch.randn(4, 64, dtype=torch.bfloat16))


def test_master_weights_start_from_a_loaded_checkpoint_not_the_preserved_init():
    """After ``load_state_dict`` the preserved initial value no longer describes the weight:
    the masters start from the loaded weights, and the first step requantizes from them."""
    recipe = RECIPES["fp8_current"]
    _, trained = _models(recipe)
    qr.requantize_(trained[0].weight, torch.full((96, 64), 0.25, dtype=torch.bfloat16))
    _, fresh = _models(recipe, preserve_high_precision_init_val=True)
    fresh.load_state_dict(trained.state_dict())
    assert qr.get_high_precision_init_val(fresh[0].weight) is None
    masters = qr.MasterWeights(fresh)
    assert torch.equal(masters.pairs[0][1], trained[0].weight.dequantize(dtype=torch.float32))
    masters.step(torch.optim.SGD(masters.parameters(), lr=0.1))  # no gradients: no change
    assert _buffers_equal(fresh[0].weight, trained[0].weight)


def test_reset_parameters_replaces_the_preserved_init_value():
    with qr.quantized_model_init(RECIPES["fp8_current"], preserve_high_precision_init_val=True):
        layer = qr.Linear(64, 32, dtype=torch.bfloat16)
    before = qr.get_high_precision_init_val(layer.weight).clone()
    layer.reset_parameters()
    after = qr.get_high_precision_init_val(layer.weight)
    assert not torch.equal(before, after)
    assert _buffers_equal(layer.weight.quantizer.quantize(after), layer.weight)


def _train(model, masters, opt, steps, seed):
    torch.manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(16, 64, dtype=torch.bfloat16)
        _step(model, RECIPES["fp8_current"], x)
        masters.step(opt)
        opt.zero_grad(set_to_none=True)


def test_a_checkpoint_with_the_masters_resumes_bit_for_bit(tmp_path):
    def build():
        _, model = _models(RECIPES["fp8_current"], preserve_high_precision_init_val=True)
        masters = qr.MasterWeights(model)
        return model, masters, torch.optim.AdamW(masters.parameters(), lr=1e-2)

    straight = build()
    _train(*straight, steps=1, seed=1)
    _train(*straight, steps=2, seed=2)

    first = build()
    _train(*first, steps=1, seed=1)
    torch.save({"model": first[0].state_dict(), "masters": first[1].state_dict(),
                "opt": first[2].state_dict()}, tmp_path / "ckpt.pt")
    resumed = build()
    ckpt = torch.load(tmp_path / "ckpt.pt", weights_only=False)
    resumed[0].load_state_dict(ckpt["model"])
    resumed[1].load_state_dict(ckpt["masters"])
    resumed[2].load_state_dict(ckpt["opt"])
    _train(*resumed, steps=2, seed=2)
    for (p, m), (q, n) in zip(straight[1].pairs, resumed[1].pairs, strict=True):
        assert torch.equal(m, n) and _buffers_equal(p, q)


def test_master_weights_load_refuses_mismatched_names():
    _, model = _models(RECIPES["fp8_current"])
    masters = qr.MasterWeights(model)
    with pytest.raises(KeyError, match=r"missing \['1.weight'\], unexpected \['x'\]"):
        masters.load_state_dict({"0.weight": masters.state_dict()["0.weight"], "x": None})


@pytest.mark.parametrize("wrapper", ["ddp", "fully_shard"])
def test_ddp_and_fully_shard_over_quantized_parameters_say_what_to_do(wrapper, tmp_path):
    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0,
                            world_size=1)
    try:
        _, model = _models(RECIPES["fp8_current"])
        with pytest.raises(NotImplementedError, match="enable_fsdp_quantized_all_gather"):
            if wrapper == "ddp":
                torch.nn.parallel.DistributedDataParallel(model)
            else:
                try:
                    from torch.distributed.fsdp import fully_shard
                except ImportError:
                    pytest.skip("this torch has no FSDP2")
                fully_shard(model)
                with qr.autocast(recipe=RECIPES["fp8_current"]):
                    model(torch.randn(4, 64, dtype=torch.bfloat16)).float().sum().backward()
    finally:
        dist.destroy_process_group()
