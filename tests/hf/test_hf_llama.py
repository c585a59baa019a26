"""A Hugging Face ``LlamaForCausalLM`` end to end: built from a config
(random weights, no download), converted with ``quant_recipes.convert``, trained eagerly and
compiled under each recipe. Runs in its own nox session (``nox -s hf``): transformers is a test
dependency only."""

from __future__ import annotations

import formats
import pytest
import quant_recipes as qr
import torch
from compiled_checkpoint import compiled_layer_grads

transformers = pytest.importorskip("transformers")
quant_dynamo = pytest.importorskip("quant_dynamo")

#: Every format's built-in recipe (tests/formats.py), by qualified id.
RECIPES = {name: make() for name, make in formats.default_recipes(qualified=True).items()}
VOCAB, SEQ, BATCH = 256, 16, 2  # 32 tokens: a multiple of 16 (NVFP4's RHT)


def _llama(seed: int = 0):
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg).to(torch.bfloat16)


def _batch():
    gen = torch.Generator().manual_seed(1)
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)


def _loss(model, ids, recipe):
    with qr.autocast(recipe=recipe):
        return model(input_ids=ids, labels=ids).loss


def test_convert_quantizes_every_projection_but_the_head():
    model = qr.convert(_llama(), recipe=qr.Float8BlockScaling())
    converted = [fqn for fqn, m in model.named_modules() if isinstance(m, qr.Linear)]
    assert len(converted) == 2 * 7  # q, k, v, o, gate, up, down per layer
    assert type(model.lm_head) is torch.nn.Linear
    assert model.get_submodule("model.layers.0.self_attn.q_proj").name == (
        "model.layers.0.self_attn.q_proj")


@pytest.mark.parametrize("name", list(RECIPES))
def test_training_reduces_the_loss(name):
    model = qr.convert(_llama(), recipe=RECIPES[name])
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = _batch()
    losses = []
    for _ in range(6):
        opt.zero_grad(set_to_none=True)
        loss = _loss(model, ids, RECIPES[name])
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0] - 0.1, losses


def _graph_breaks(fn, *args) -> int:
    torch._dynamo.reset()
    explanation = torch._dynamo.explain(fn)(*args)
    return explanation.graph_break_count


@pytest.mark.parametrize("name", ["fp8_current", "mxfp8"])
def test_convert_adds_no_graph_break(name):
    """Counted with and without ``convert``: whatever breaks the model's own code causes, the
    quantized layers add none."""
    ids = _batch()
    plain = _llama()
    converted = qr.convert(_llama(), recipe=RECIPES[name])
    base = _graph_breaks(lambda i: _loss(plain, i, RECIPES[name]), ids)
    assert _graph_breaks(lambda i: _loss(converted, i, RECIPES[name]), ids) == base


@pytest.mark.parametrize("name", ["fp8_current", "nvfp4"])
def test_compiled_equals_eager(name):
    """aot_eager runs the same kernels as eager mode: loss and gradients equal bitwise."""
    ids = _batch()
    eager_model, compiled_model = (qr.convert(_llama(), recipe=RECIPES[name]) for _ in range(2))
    torch._dynamo.reset()
    compiled = torch.compile(lambda i: _loss(compiled_model, i, RECIPES[name]),
                             backend="aot_eager")
    torch.manual_seed(2)  # NVFP4's stochastic rounding draws from torch's generator
    want = _loss(eager_model, ids, RECIPES[name])
    want.backward()
    torch.manual_seed(2)
    got = compiled(ids)
    got.backward()
    assert torch.equal(got, want)
    for (fqn, a), b in zip(compiled_model.named_parameters(), eager_model.parameters(),
                           strict=True):
        assert torch.equal(a.grad, b.grad), fqn


def test_save_pretrained_round_trips(tmp_path):
    model = qr.convert(_llama(), recipe=qr.MXFP8BlockScaling())
    model.save_pretrained(tmp_path)
    # .to(bf16) as _llama() does: it also casts the non-persistent rotary buffer
    loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path).to(torch.bfloat16)
    theirs = loaded.state_dict()
    for key, value in model.state_dict().items():
        assert torch.equal(value, theirs[key]), key
    qr.convert(loaded, recipe=qr.MXFP8BlockScaling())
    ids = _batch()
    assert torch.equal(_loss(loaded, ids, qr.MXFP8BlockScaling()),
                       _loss(model, ids, qr.MXFP8BlockScaling()))


def test_convert_of_gpt2_says_that_its_conv1d_projections_are_not_converted(caplog):
    """GPT-2 builds its projections from ``transformers.pytorch_utils.Conv1D`` (weight stored
    ``[in, out]``): convert must say, by name, that it left them, and that nothing converted."""
    import logging

    cfg = transformers.GPT2Config(vocab_size=VOCAB, n_positions=64, n_embd=64, n_layer=1,
                                  n_head=2)
    model = transformers.GPT2LMHeadModel(cfg)
    with caplog.at_level(logging.WARNING, logger="quant_recipes"):
        qr.convert(model)
    text = caplog.text
    assert "4 layers left as they are: transformers Conv1D" in text
    assert "transformer.h.0.attn.c_attn" in text
    assert "1 layer left as it is: the default filter keeps output heads" in text  # lm_head
    assert "no layer of GPT2LMHeadModel was converted" in text and "Conv1D x4" in text


@pytest.mark.parametrize("enable_first", [False, True])
@pytest.mark.parametrize("reentrant", [False, True])
def test_hf_checkpointing_recomputes_a_compiled_module_under_the_forwards_frame(
        enable_first, reentrant):
    """The checkpoint function transformers gives its layers (enabled before or after
    ``convert``) recomputes a module compiled on its own under the forward's recipe, as
    transformers' layers that checkpoint their ``__call__`` need: the uncheckpointed
    gradients (a plain checkpoint recomputes in high precision)."""
    model = _llama()
    kwargs = {"use_reentrant": reentrant}
    if enable_first:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    qr.convert(model, recipe=qr.MXFP8BlockScaling())
    if not enable_first:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    checkpoint_fn = model.model.layers[0]._gradient_checkpointing_func
    want = compiled_layer_grads(qr.MXFP8BlockScaling())
    got = compiled_layer_grads(qr.MXFP8BlockScaling(), checkpoint_fn)
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g, w)


def test_hf_checkpointing_of_compiled_layers_gives_the_uncheckpointed_gradients():
    """Gradient checkpointing with every decoder layer compiled (``layer.compile()``), the way
    people train: the same loss and gradients as without checkpointing. transformers 5.24 and
    later checkpoint ``forward`` (traced inside the compiled layer); earlier versions
    checkpoint ``__call__`` around it, the case the wiring above handles."""
    recipe = qr.MXFP8BlockScaling()
    ids = _batch()
    runs = []
    for checkpointed in (False, True):
        torch._dynamo.reset()
        model = qr.convert(_llama(), recipe=recipe)
        model.train()
        if checkpointed:
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False})
        for layer in model.model.layers:
            layer.compile(backend="aot_eager")
        loss = _loss(model, ids, recipe)
        loss.backward()
        runs.append([loss.detach()] + [p.grad for p in model.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*runs, strict=True))


def test_the_checkpointing_wiring_survives_deepcopy_and_pickle():
    """The wiring lives on the model as a bound method: a deep copy and an unpickled model
    enable checkpointing on themselves, with the wrapped checkpoint function."""
    import copy
    import functools
    import io
    import pickle
    model = qr.convert(_llama(), recipe=qr.Float8CurrentScaling())
    buf = io.BytesIO()
    torch.save(model, buf)  # before enabling: transformers' input-grad hook is a local function
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    clone = copy.deepcopy(model)
    clone.gradient_checkpointing_disable()
    assert model.model.layers[0].gradient_checkpointing
    assert not clone.model.layers[0].gradient_checkpointing
    loaded.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    for m in (model, loaded):
        assert isinstance(m.model.layers[0]._gradient_checkpointing_func, qr.in_forward_frame)
    fn = qr.in_forward_frame(functools.partial(torch.utils.checkpoint.checkpoint,
                                               use_reentrant=False))
    assert pickle.loads(pickle.dumps(fn)).checkpoint_fn.keywords == {"use_reentrant": False}
    assert qr.in_forward_frame(fn) is fn
