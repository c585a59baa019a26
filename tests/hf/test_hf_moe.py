"""Hugging Face mixture-of-experts models (Mixtral, Qwen3-MoE) built from a config (random
weights, no download), converted with ``quant_recipes.convert``: their experts modules run on
quant's grouped GEMMs, each expert equal bit for bit to the dense quantized Linear on its tokens,
and the models train eagerly and compiled.

The oracle of the per-expert test is ``qr.Linear`` run once per expert on the rows routed to it
(in token order), with the module's own activation, the routing weights and the per-token sum
written out here."""

from __future__ import annotations

import copy
import io

import pytest
import quant_recipes as qr
import torch
from quant_recipes.moe import hf_experts

transformers = pytest.importorskip("transformers")

VOCAB, SEQ, BATCH, EXPERTS, TOP_K = 256, 16, 2, 4, 2
HIDDEN, INTERMEDIATE = 128, 128


def _mixtral(seed: int = 0, dtype=torch.bfloat16):
    cfg = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        num_local_experts=EXPERTS, num_experts_per_tok=TOP_K, max_position_embeddings=64)
    torch.manual_seed(seed)
    return transformers.MixtralForCausalLM(cfg).to(dtype)


def _qwen3_moe(seed: int = 0):
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=256,
        moe_intermediate_size=INTERMEDIATE, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, num_experts=EXPERTS, num_experts_per_tok=TOP_K,
        decoder_sparse_step=1, max_position_embeddings=64)
    torch.manual_seed(seed)
    return transformers.Qwen3MoeForCausalLM(cfg).to(torch.bfloat16)


def _gpt_oss(seed: int = 0, dtype=torch.bfloat16):
    """GPT-OSS stores its expert weights transposed (``[experts, in, out]``), with biases and
    gate/up interleaved (its own ``_apply_gate``)."""
    cfg = transformers.GptOssConfig(
        vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=INTERMEDIATE,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        num_local_experts=EXPERTS, num_experts_per_tok=TOP_K, max_position_embeddings=64,
        layer_types=["full_attention", "sliding_attention"], sliding_window=8)
    torch.manual_seed(seed)
    model = transformers.GptOssForCausalLM(cfg)
    with torch.no_grad():  # transformers initialises the expert biases to zero
        for p in model.parameters():
            if p.dim() == 2 and p.shape[0] == EXPERTS:
                p.normal_(0, 0.02)
    return model.to(dtype)


MODELS = {"mixtral": _mixtral, "qwen3_moe": _qwen3_moe, "gpt_oss": _gpt_oss}


def _ids():
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(1))


def _experts(model):
    return [(fqn, m) for fqn, m in model.named_modules() if fqn.endswith("mlp.experts")]


def _routing(tokens: int, seed: int = 3):
    """Top-k expert ids (distinct per token; expert 3 gets no token) and their weights."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(EXPERTS - 1, generator=gen)[:TOP_K]
                       for _ in range(tokens)])
    weights = torch.rand(tokens, TOP_K, generator=gen).softmax(-1)
    return ids, weights


@pytest.mark.parametrize("name", list(MODELS))
def test_convert_turns_the_experts_into_grouped_gemms(name):
    model = MODELS[name]()
    keys = list(model.state_dict())
    params = {fqn: p for fqn, p in model.named_parameters()}
    hf_class = type(_experts(model)[0][1])
    qr.convert(model, recipe=qr.Float8CurrentScaling())
    assert list(model.state_dict()) == keys
    assert all(p is params[fqn] for fqn, p in model.named_parameters())
    experts = _experts(model)
    assert len(experts) == 2
    for fqn, m in experts:
        assert isinstance(m, hf_class) and hf_experts.is_quantized_experts(m)
        assert m._quant_up.name == f"{fqn}.gate_up_proj"
        assert m._quant_down.name == f"{fqn}.down_proj"
    qr.unconvert(model)
    assert all(type(m) is hf_class for _, m in _experts(model))
    assert list(model.state_dict()) == keys


@pytest.mark.parametrize("name", ["mixtral", "gpt_oss"])
def test_outside_autocast_equals_the_transformers_forward(name):
    """fp32: the grouped high-precision path (fp32 products) against transformers' own loop;
    they differ by the order of the k-way sum and of index_add_ only."""
    ref = MODELS[name](dtype=torch.float32)
    model = qr.convert(copy.deepcopy(ref))
    x = torch.randn(SEQ, HIDDEN, generator=torch.Generator().manual_seed(2))
    ids, w = _routing(SEQ)
    (_, mine), (_, theirs) = _experts(model)[0], _experts(ref)[0]
    torch.testing.assert_close(mine(x, ids, w), theirs(x, ids, w), rtol=1e-5, atol=1e-6)


def _dense_oracle(m, x, ids, w, recipe):
    """Per expert, ``qr.Linear`` on the rows routed to it (token order), with the module's own
    gate; combined per token (the weighted fp32 sum in route order)."""
    up, down = m.gate_up_proj, m.down_proj
    if m.is_transposed:
        up, down = up.transpose(1, 2), down.transpose(1, 2)
    rows = torch.zeros(x.shape[0], TOP_K, x.shape[1], dtype=x.dtype)
    for e in range(EXPERTS):
        token, slot = torch.where(ids == e)
        if token.numel() == 0:
            continue
        lin_up = qr.Linear(up.shape[2], up.shape[1], bias=m.has_bias, dtype=x.dtype)
        lin_down = qr.Linear(down.shape[2], down.shape[1], bias=m.has_bias, dtype=x.dtype)
        with torch.no_grad():
            lin_up.weight.copy_(up[e])
            lin_down.weight.copy_(down[e])
            if m.has_bias:
                lin_up.bias.copy_(m.gate_up_proj_bias[e])
                lin_down.bias.copy_(m.down_proj_bias[e])
        with qr.autocast(recipe=recipe):
            y = lin_down(m._apply_gate(lin_up(x[token])))
        rows[token, slot] = y
    # each route's product with its routing weight (in the rows' dtype) in fp32, added in route
    # order in fp32, rounded once
    wr = w.to(rows.dtype).float()
    acc = rows[:, 0].float() * wr[:, 0, None]
    for slot in range(1, TOP_K):
        acc = acc + rows[:, slot].float() * wr[:, slot, None]
    return acc.to(rows.dtype)


@pytest.mark.parametrize("model", ["mixtral", "gpt_oss"])
@pytest.mark.parametrize("recipe", [qr.Float8CurrentScaling(), qr.MXFP8BlockScaling()],
                         ids=["fp8_current", "mxfp8"])
def test_each_expert_equals_the_dense_linear(recipe, model):
    model = qr.convert(MODELS[model](), recipe=recipe)
    _, m = _experts(model)[0]
    x = torch.randn(SEQ, HIDDEN, generator=torch.Generator().manual_seed(2)).bfloat16()
    ids, w = _routing(SEQ)
    with torch.no_grad(), qr.autocast(recipe=recipe):
        got = m(x, ids, w)
    assert torch.equal(got, _dense_oracle(m, x, ids, w, recipe))


def test_expert_ids_out_of_range_are_refused():
    _, m = _experts(qr.convert(_mixtral()))[0]
    ids, w = _routing(4)
    ids[1, 0] = EXPERTS  # transformers' expert-parallel sentinel
    with pytest.raises(ValueError, match=r"top_k_index must hold expert ids in \[0, 4\)"):
        m(torch.randn(4, HIDDEN).bfloat16(), ids, w)


@pytest.mark.parametrize("name", list(MODELS))
def test_training_reduces_the_loss(name):
    recipe = qr.Float8CurrentScaling()
    model = qr.convert(MODELS[name](), recipe=recipe)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    ids = _ids()
    losses = []
    qr.reset_grouped_gemm_paths()
    for _ in range(6):
        opt.zero_grad(set_to_none=True)
        with qr.autocast(recipe=recipe):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert sum(qr.grouped_gemm_paths().values()) == 6 * 2 * 2 * 3  # steps x layers x proj x GEMMs
    for _, m in _experts(model):
        assert m.gate_up_proj.grad is not None and m.down_proj.grad.abs().sum() > 0
    assert all(torch.isfinite(torch.tensor(losses)))
    assert losses[-1] < losses[0] - 0.1, losses


def test_compiled_equals_eager_without_recompiles():
    """The experts module compiled with ``fullgraph=True``: the routing changes every call (so
    do the group sizes) and nothing recompiles; outputs and gradients equal eager bitwise
    (aot_eager runs eager's kernels)."""
    recipe = qr.Float8CurrentScaling()
    model = qr.convert(_mixtral(), recipe=recipe)
    _, m = _experts(model)[0]
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(m, backend=counter, fullgraph=True)
    for seed in (3, 4, 5):
        x = torch.randn(SEQ, HIDDEN, generator=torch.Generator().manual_seed(seed)).bfloat16()
        ids, w = _routing(SEQ, seed)
        out = {}
        for what, fn in (("eager", m), ("compiled", compiled)):
            m.zero_grad(set_to_none=True)
            xx = x.clone().requires_grad_()
            with qr.autocast(recipe=recipe):
                y = fn(xx, ids, w)
            y.float().pow(2).sum().backward()
            out[what] = (y, xx.grad, m.gate_up_proj.grad, m.down_proj.grad)
        for a, b in zip(out["eager"], out["compiled"], strict=True):
            assert torch.equal(a, b)
    assert counter.frame_count == 1


def test_deepcopy_pickle_and_state_dict_round_trip():
    model = qr.convert(_mixtral(), recipe=qr.Float8CurrentScaling())
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    for other in (copy.deepcopy(model), torch.load(buf, weights_only=False)):
        _, m = _experts(other)[0]
        assert hf_experts.is_quantized_experts(m)
        assert m._quant_up.name == "model.layers.0.mlp.experts.gate_up_proj"
        for key, value in model.state_dict().items():
            assert torch.equal(value, other.state_dict()[key]), key
    fresh = qr.convert(_mixtral(seed=1))
    fresh.load_state_dict(model.state_dict())
    ids = _ids()
    recipe = qr.Float8CurrentScaling()
    with torch.no_grad(), qr.autocast(recipe=recipe):
        assert torch.equal(fresh(input_ids=ids).logits, model(input_ids=ids).logits)


def test_dynamic_token_counts_compile_once():
    """``dynamic=True``: batches of other token counts run the graphs the first one built."""
    from torch._dynamo.testing import CompileCounterWithBackend

    recipe = qr.Float8CurrentScaling()
    _, m = _experts(qr.convert(_mixtral(), recipe=recipe))[0]
    torch._dynamo.reset()
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(m, backend=counter, fullgraph=True, dynamic=True)
    frames = []
    for tokens in (16, 24, 40):
        x = torch.randn(tokens, HIDDEN, generator=torch.Generator().manual_seed(tokens))
        ids, w = _routing(tokens, tokens)
        with torch.no_grad(), qr.autocast(recipe=recipe):
            assert torch.equal(compiled(x.bfloat16(), ids, w), m(x.bfloat16(), ids, w))
        frames.append(counter.frame_count)
    assert frames[1:] == frames[:1] * 2


def test_always_quantize_binds_the_recipe_to_the_experts():
    recipe = qr.Float8CurrentScaling()
    model = qr.convert(_mixtral(), recipe=recipe, always_quantize=True)
    ids = _ids()
    with torch.no_grad():
        bound = model(input_ids=ids).logits
        with qr.autocast(recipe=recipe):
            inside = model(input_ids=ids).logits
        with qr.autocast(enabled=False):
            off = model(input_ids=ids).logits
    assert torch.equal(bound, inside) and not torch.equal(bound, off)


def test_gradient_checkpointing_gives_the_same_gradients():
    """transformers' own activation checkpointing recomputes each decoder layer (experts
    included) in backward, outside the autocast region: the same loss and gradients."""
    recipe = qr.Float8CurrentScaling()
    ids = _ids()
    grads, calls = [], []
    for checkpointed in (False, True):
        model = qr.convert(_mixtral(), recipe=recipe)
        model.train()
        if checkpointed:
            model.activation_checkpointing_enable({"use_reentrant": False})
        ran = []
        _experts(model)[0][1].register_forward_pre_hook(lambda *_, ran=ran: ran.append(1))
        with qr.autocast(recipe=recipe):
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        grads.append([loss.detach()] + [p.grad for p in model.parameters()])
        calls.append(len(ran))
    assert calls == [1, 2]  # the checkpointed experts ran again in backward
    assert all(torch.equal(a, b) for a, b in zip(*grads, strict=True))
