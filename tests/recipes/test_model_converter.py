"""``QuantConverter`` against the torchtitan-style converter protocol: ``convert(model)`` once
before training, ``post_optimizer_hook(model)`` after each step, and a loop with no quant
context in it."""

from __future__ import annotations

import pytest
import quant_recipes as qr
import torch
from quant_recipes.model_converter import QuantConverter


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 64),
                               torch.nn.GELU(), torch.nn.Linear(64, 8))


def _train(model, steps, hook=None):
    """A framework's loop: no autocast, the hook after every optimizer step."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(steps):
        x = torch.randn(32, 64, generator=gen)
        loss = model(x).float().pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        if hook is not None:
            hook(model)
        losses.append(loss.item())
    return losses


def test_a_converted_model_trains_quantized_in_a_loop_without_autocast():
    converter = QuantConverter("mxfp8")
    model = converter.convert(_model())
    assert [type(m) for m in model][::2] == [qr.Linear, qr.Linear, torch.nn.Linear]
    qr.reset_gemm_paths()
    losses = _train(model, 4, converter.post_optimizer_hook)
    # per step: the first layer's fprop and wgrad (its input needs no gradient), the second's
    # fprop, dgrad and wgrad
    assert sum(qr.gemm_paths().values()) == 4 * (2 + 3)
    # the same as the same loop inside autocast with the recipe
    plain = qr.convert(_model())
    with qr.autocast(recipe=qr.MXFP8BlockScaling()):
        assert _train(plain, 4) == losses


def test_options_go_to_the_named_recipe_and_not_to_an_object():
    assert QuantConverter("nvfp4", disable_rht=True).recipe == qr.NVFP4BlockScaling(
        disable_rht=True)
    with pytest.raises(TypeError, match="QuantConverter: options \\['disable_rht'\\] are for a "
                                        "recipe name"):
        QuantConverter(qr.NVFP4BlockScaling(), disable_rht=True)
    with pytest.raises(TypeError, match="recipe must be a quant_recipes.Recipe or its name"):
        QuantConverter(3)
