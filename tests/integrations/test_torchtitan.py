"""quant in torchtitan 0.3's model-config tree: ``QuantLinearConverter`` rewrites the Llama 3
debug model's config, torchtitan builds and initializes the model, and it trains a few steps
on the CPU with the losses of the stock model converted by ``quant_recipes.convert``, and
resumes from its ``state_dict``.

The ``torchtitan`` session installs torchtitan (``QUANT_TORCHTITAN_SESSION=1``): there an import
failure fails the tests; elsewhere they skip."""

from __future__ import annotations

import copy
import logging
import os

import pytest
import quant_recipes as qr
import torch

if os.environ.get("QUANT_TORCHTITAN_SESSION"):
    import torchtitan  # noqa: F401  (the session that installs it: it must import)
else:
    pytest.importorskip("torchtitan.components.quantization")

from quant_recipes.torchtitan_converter import QuantLinear, QuantLinearConverter  # noqa: E402
from torchtitan.models.common.linear import Linear as TitanLinear  # noqa: E402
from torchtitan.models.llama3 import model_registry  # noqa: E402

RECIPE = "mxfp8"
SEQ = 32


def _linears(config) -> dict[str, object]:
    return {fqn: c for fqn, c, _, _ in config.traverse(TitanLinear.Config)}


def test_converter_rewrites_every_linear_config_but_the_head():
    config = model_registry("debugmodel").model
    stock = _linears(config)
    converted = _linears(QuantLinearConverter.Config(recipe=RECIPE).build().convert(config))
    assert converted.keys() == stock.keys() and len(stock) == 31
    quant = {fqn for fqn, c in converted.items() if isinstance(c, QuantLinear.Config)}
    assert quant == stock.keys() - {"lm_head"}
    for fqn in quant:
        old, new = stock[fqn], converted[fqn]
        assert (new.recipe, new.name) == (RECIPE, fqn)
        assert (new.in_features, new.out_features, new.bias) == (
            old.in_features, old.out_features, old.bias)
        assert new.param_init is old.param_init and new.sharding_config is old.sharding_config


def test_filter_fqns_and_unquantizable_widths_stay_torchtitan_linears(caplog):
    config = model_registry("debugmodel").model
    config.layers[0].feed_forward.w2.in_features = 760  # not a multiple of MXFP8's 32
    conv = QuantLinearConverter.Config(recipe="mxfp8", filter_fqns=["attention"])
    with caplog.at_level(logging.INFO, "quant_recipes.torchtitan_converter"):
        out = _linears(conv.build().convert(config))
    kept = {fqn for fqn, c in out.items() if not isinstance(c, QuantLinear.Config)}
    attention = {fqn for fqn in out if ".attention." in fqn}
    assert kept == {"lm_head", "layers.0.feed_forward.w2"} | attention
    assert any("layers.0.feed_forward.w2 left as it is" in r.getMessage()
               and r.levelno == logging.WARNING for r in caplog.records)


def test_converting_twice_changes_nothing():
    conv = QuantLinearConverter.Config(recipe=RECIPE).build()
    once = conv.convert(model_registry("debugmodel").model)
    before = _linears(once)
    after = _linears(conv.convert(once))
    assert after.keys() == before.keys()
    assert all(after[fqn] is before[fqn] for fqn in before)


@pytest.mark.parametrize("recipe, match", [
    ("fp9", "^QuantLinearConverter.Config.recipe: unknown name 'fp9'"),
    ("delayed", "^QuantLinearConverter.Config.recipe: DelayedScaling .* needs autocast"),
])
def test_a_recipe_it_cannot_bind_is_refused_when_the_converter_is_built(recipe, match):
    with pytest.raises(ValueError, match=match):
        QuantLinearConverter.Config(recipe=recipe).build()


def _one_layer_model(converters):
    """The debug model with one transformer block, built as torchtitan builds it (meta device,
    ``to_empty``, ``init_states``); the block's attention and what feeds it are frozen, since
    FlexAttention has no backward on the CPU."""
    config = model_registry("debugmodel", converters=converters).model
    config.layers = config.layers[:1]
    torch.manual_seed(0)
    with torch.device("meta"):
        model = config.build()
    model.to_empty(device="cpu")
    model.init_states(buffer_device=torch.device("cpu"))
    for part in (model.tok_embeddings, model.layers["0"].attention_norm,
                 model.layers["0"].attention):
        part.requires_grad_(False)
    return model


def _losses(model, steps: int) -> list[float]:
    """``steps`` AdamW steps on one batch of tokens (the loss falls as the model learns it)."""
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    pos = torch.arange(SEQ).expand(2, SEQ)
    masks = model.get_attention_masks(pos)
    tokens = torch.randint(0, 2048, (2, SEQ + 1), generator=torch.Generator().manual_seed(0))
    losses = []
    for _ in range(steps):
        logits = model(tokens[:, :-1], attention_masks=masks, positions=pos)
        loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_the_built_model_trains_as_quant_convert_and_resumes_from_its_state_dict():
    model = _one_layer_model([QuantLinearConverter.Config(recipe=RECIPE)])
    w1 = model.layers["0"].feed_forward.w1
    assert isinstance(w1, QuantLinear) and isinstance(w1, qr.Linear)
    assert w1.bound_recipe == qr.recipe(RECIPE) and w1.name == "layers.0.feed_forward.w1"
    assert type(model.lm_head) is TitanLinear

    stock = _one_layer_model(None)
    stock.load_state_dict(model.state_dict())
    qr.convert(stock, recipe=RECIPE, always_quantize=True)
    saved = copy.deepcopy(model.state_dict())

    losses = _losses(model, 3)
    assert losses == _losses(stock, 3)
    assert losses[-1] < losses[0]

    resumed = _one_layer_model([QuantLinearConverter.Config(recipe=RECIPE)])
    resumed.load_state_dict(model.state_dict())
    assert _losses(resumed, 1) == _losses(model, 1)
    assert not torch.equal(saved["layers.0.feed_forward.w1.weight"],
                           model.state_dict()["layers.0.feed_forward.w1.weight"])


def test_a_converted_feed_forward_compiles_in_one_graph_with_eager_bytes():
    """torchtitan compiles each block; quant's layers inside compile with ``fullgraph=True``
    and give eager's output and input gradient bit for bit."""
    pytest.importorskip("quant_dynamo")
    ff = _one_layer_model([QuantLinearConverter.Config(recipe=RECIPE)]).layers["0"].feed_forward
    x = torch.randn(2, SEQ, 256, generator=torch.Generator().manual_seed(2), requires_grad=True)
    eager = ff(x)
    eager.sum().backward()
    eager_grad, x.grad = x.grad, None
    compiled = torch.compile(ff, backend="aot_eager", fullgraph=True)(x)
    compiled.sum().backward()
    assert torch.equal(compiled, eager) and torch.equal(x.grad, eager_grad)
