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


def _assert_same_training(got, want):
    """The first step's loss bitwise (the same quantizers, GEMMs and values), the later ones
    within 1%: the same script run alone in a fresh process beside a loaded test session gave
    another third loss once in 150 runs (torch's fp32 CPU arithmetic is not bitwise
    reproducible under load), and each FP8-quantized layer turns a last-bit difference into a
    quantization step that the following steps grow."""
    assert got[0] == want[0]
    torch.testing.assert_close(got, want, rtol=1e-2, atol=0)


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
        _assert_same_training(_train(plain, 4), losses)


def test_options_go_to_the_named_recipe_and_not_to_an_object():
    assert QuantConverter("nvfp4", disable_rht=True).recipe == qr.NVFP4BlockScaling(
        disable_rht=True)
    with pytest.raises(TypeError, match="QuantConverter: options \\['disable_rht'\\] are for a "
                                        "recipe name"):
        QuantConverter(qr.NVFP4BlockScaling(), disable_rht=True)
    with pytest.raises(TypeError, match="recipe must be a quant_recipes.Recipe or its name"):
        QuantConverter(3)


def _quant_model():
    """As the README's first example: built from quant's ``Linear``, the last one included."""
    torch.manual_seed(0)
    return torch.nn.Sequential(qr.Linear(64, 64), torch.nn.GELU(), qr.Linear(64, 64),
                               torch.nn.GELU(), qr.Linear(64, 32))


@pytest.mark.parametrize("build", [_quant_model, lambda: qr.convert(_model())],
                         ids=["built_from_quant_linear", "converted_before"])
def test_the_quant_layers_a_model_already_has_train_quantized_in_the_loop(build):
    converter = QuantConverter("mxfp8")
    model = converter.convert(build())
    recipe = qr.MXFP8BlockScaling()
    quant = [m for m in model if isinstance(m, qr.Linear)]
    assert quant and all(m.bound_recipe == recipe for m in quant)
    qr.reset_gemm_paths()
    losses = _train(model, 2, converter.post_optimizer_hook)
    assert sum(qr.gemm_paths().values()) == 2 * (2 + 3 * (len(quant) - 1))
    with qr.autocast(recipe=recipe):  # the same as the same loop inside autocast
        _assert_same_training(_train(build(), 2), losses)


def _stub_torchtitan(monkeypatch):
    """A ``torchtitan.protocols.model_converter`` whose ``register_model_converter`` records its
    calls and refuses a name twice, as torchtitan's does."""
    import sys
    import types

    registry = {}

    def register_model_converter(converter_cls, name):
        assert name not in registry, f"A model converter '{name}' is already registered."
        registry[name] = converter_cls

    mod = types.ModuleType("torchtitan.protocols.model_converter")
    mod.register_model_converter = register_model_converter
    for name in ("torchtitan", "torchtitan.protocols"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "torchtitan.protocols.model_converter", mod)
    return registry


def test_importing_the_module_registers_the_converters_with_torchtitan(monkeypatch):
    import importlib.util

    import quant_recipes.model_converter as imported

    registry = _stub_torchtitan(monkeypatch)
    # a fresh import of the module (as `experimental.custom_import` does in a torchtitan job),
    # beside the one already imported, whose classes other tests hold
    spec = importlib.util.spec_from_file_location("quant_recipes._model_converter_fresh",
                                                  imported.__file__)
    mc = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mc)
    assert sorted(registry) == ["quant_fp8_block", "quant_fp8_current", "quant_mxfp8",
                                "quant_nvfp4"]
    # torchtitan builds a converter from (job_config, parallel_dims)
    converter = registry["quant_mxfp8"](object(), object())
    assert isinstance(converter, mc.QuantConverter)
    assert converter.recipe == qr.MXFP8BlockScaling()
    model = converter.convert(_model())
    assert type(model[0]) is qr.Linear and model[0].bound_recipe == qr.MXFP8BlockScaling()
    converter.post_optimizer_hook(model)


def test_without_torchtitan_nothing_is_registered(monkeypatch):
    import sys

    from quant_recipes.model_converter import register_with_torchtitan

    monkeypatch.setitem(sys.modules, "torchtitan", None)  # import raises ImportError
    assert register_with_torchtitan() is False
