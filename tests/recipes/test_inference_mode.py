"""``torch.inference_mode()``: quantized layers run under it (as Lightning's ``test``,
``validate`` and ``predict`` do) and give the bits of a ``no_grad`` forward. Inference tensors
have no version counter, so nothing that reads one may be asked for it.

Per recipe: a Linear inside autocast, a model converted with ``always_quantize=True``, a weight
quantized at init, a GroupedLinear, and column- and row-parallel layers on a one-rank mesh."""

from __future__ import annotations

import formats
import pytest
import quant_recipes as qr
import torch

#: every recipe of every format (tests/formats.py), the CPU running their reference emulation
RECIPES = formats.recipes()


def _x(*shape):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)


def _both(run):
    """``run()`` under no_grad, then under inference_mode: the two outputs. ``run`` makes its
    inputs, so that under inference_mode they are inference tensors, as every activation is."""
    with torch.no_grad():
        want = run()
    with torch.inference_mode():
        got = run()
    assert got.is_inference()
    return got, want


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_a_linear_runs_under_inference_mode(name):
    recipe = RECIPES[name]()
    torch.manual_seed(0)
    layer = qr.Linear(64, 32, dtype=torch.bfloat16)

    def run():
        x = _x(16, 64)
        with qr.autocast(recipe=recipe):
            return layer(x) + layer(x)  # a second reader of the same input

    got, want = _both(run)
    assert torch.equal(got, want)


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_an_always_quantize_model_runs_under_inference_mode(name):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 64),
                                torch.nn.GELU(), torch.nn.Linear(64, 32))
    model = qr.convert(model.to(torch.bfloat16), recipe=RECIPES[name](), always_quantize=True)
    assert isinstance(model[2], qr.Linear)  # reads an activation (the head stays unconverted)
    got, want = _both(lambda: model(_x(16, 64)))
    assert torch.equal(got, want)


@pytest.mark.parametrize("name", sorted(formats.default_recipes()))
def test_a_quantized_weight_runs_under_inference_mode(name):
    recipe = RECIPES[name]()
    torch.manual_seed(0)
    with qr.quantized_model_init(recipe):
        layer = qr.Linear(64, 32, dtype=torch.bfloat16)

    def run():
        with qr.autocast(recipe=recipe):
            return layer(_x(16, 64))

    got, want = _both(run)
    assert torch.equal(got, want)
    got, want = _both(lambda: layer(_x(16, 64)))  # outside autocast: the dequantized weight
    assert torch.equal(got, want)


@pytest.mark.parametrize("name", sorted(formats.default_recipes()))
def test_a_grouped_linear_runs_under_inference_mode(name):
    recipe = RECIPES[name]()
    torch.manual_seed(0)
    layer = qr.GroupedLinear(2, 128, 64, dtype=torch.bfloat16)

    def run():
        with qr.autocast(recipe=recipe):
            return layer(_x(64, 128), counts=torch.tensor([32, 32]))

    got, want = _both(run)
    assert torch.equal(got, want)


@pytest.mark.parametrize("name", sorted(formats.default_recipes()))
def test_tensor_parallel_layers_run_under_inference_mode(name, tmp_path):
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    recipe = RECIPES[name]()
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0,
                            world_size=1)
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(qr.Linear(128, 128, dtype=torch.bfloat16),
                                    qr.Linear(128, 64, dtype=torch.bfloat16))
        parallelize_module(model, init_device_mesh("cpu", (1,)),
                           {"0": qr.QuantColwiseParallel(), "1": qr.QuantRowwiseParallel()})
        def run():
            with qr.autocast(recipe=recipe):
                return model(_x(32, 128))

        got, want = _both(run)
        assert torch.equal(got, want)
    finally:
        dist.destroy_process_group()
