"""``convert`` / ``unconvert`` on an existing model."""

from __future__ import annotations

import copy
import logging

import pytest
import quant_recipes as qr
import torch
from quant_recipes.moe import hf_experts


class Block(torch.nn.Module):
    def __init__(self, d: int) -> None:
        super().__init__()
        self.up = torch.nn.Linear(d, 4 * d)
        self.down = torch.nn.Linear(4 * d, d, bias=False)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


class Toy(torch.nn.Module):
    def __init__(self, d: int = 64, vocab: int = 96) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(vocab, d)
        self.blocks = torch.nn.ModuleList(Block(d) for _ in range(2))
        self.lm_head = torch.nn.Linear(d, vocab, bias=False)

    def forward(self, ids):
        h = self.embed(ids)
        for b in self.blocks:
            h = h + b(h)
        return self.lm_head(h)


def _model(dtype=torch.bfloat16):
    torch.manual_seed(0)
    return Toy().to(dtype)


def test_convert_shares_parameters_and_names_layers_by_fqn():
    model = _model()
    before = dict(model.named_parameters())
    keys = list(model.state_dict())
    qr.convert(model)
    for fqn in ("blocks.0.up", "blocks.0.down", "blocks.1.up", "blocks.1.down"):
        layer = model.get_submodule(fqn)
        assert type(layer) is qr.Linear and layer.name == fqn
    assert type(model.lm_head) is torch.nn.Linear  # the head stays in high precision
    after = dict(model.named_parameters())
    assert after.keys() == before.keys()
    assert all(after[k] is before[k] for k in before)  # the same Parameter objects
    assert list(model.state_dict()) == keys


def test_default_filter_keeps_the_output_layer_of_a_sequential_and_named_heads():
    seq = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.ReLU(), torch.nn.Linear(32, 32))
    qr.convert(seq)
    assert type(seq[0]) is qr.Linear and type(seq[2]) is torch.nn.Linear
    qr.convert(seq, filter=lambda fqn, m: True)
    assert type(seq[2]) is qr.Linear


class _LoraLinear(torch.nn.Module):
    """PEFT's LoRA layout: the base layer and, per adapter name, ``lora_A`` and ``lora_B``."""

    def __init__(self, d: int, r: int = 4) -> None:
        super().__init__()
        self.base_layer = torch.nn.Linear(d, d)
        self.lora_A = torch.nn.ModuleDict({"default": torch.nn.Linear(d, r, bias=False)})
        self.lora_B = torch.nn.ModuleDict({"default": torch.nn.Linear(r, d, bias=False)})

    def forward(self, x):
        return self.base_layer(x) + self.lora_B["default"](self.lora_A["default"](x))


def test_default_filter_keeps_lora_adapters_and_converts_their_base_layer(caplog):
    """Converting after the adapters were added quantizes what converting before does: the base
    layers, not the rank-r adapters (with FP8 they would be quantized, with MXFP8 refused)."""
    for recipe in (qr.Float8CurrentScaling(), qr.MXFP8BlockScaling()):
        model = torch.nn.Sequential(_LoraLinear(64), torch.nn.ReLU(), torch.nn.Linear(64, 8))
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="quant_recipes"):
            qr.convert(model, recipe=recipe)
        lora = model[0]
        assert type(lora.base_layer) is qr.Linear
        assert type(lora.lora_A["default"]) is torch.nn.Linear
        assert type(lora.lora_B["default"]) is torch.nn.Linear
        assert ("2 layers left as they are: the default filter keeps LoRA adapters (lora_A, "
                "lora_B) in high precision (0.lora_A.default, 0.lora_B.default)") in caplog.text
        assert "cannot take their shapes" not in caplog.text
    qr.convert(model, filter=lambda fqn, m: True)
    assert type(model[0].lora_A["default"]) is qr.Linear  # a filter that asks for them


def test_filter_receives_fqn_and_module():
    model = _model()
    seen = []
    qr.convert(model, filter=lambda fqn, m: seen.append((fqn, type(m))) or fqn.endswith("up"))
    assert ("blocks.1.down", torch.nn.Linear) in seen
    assert type(model.blocks[0].up) is qr.Linear
    assert type(model.blocks[0].down) is torch.nn.Linear


def test_layers_a_recipe_cannot_take_are_skipped_with_a_warning(caplog):
    seq = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.Linear(48, 64),
                              torch.nn.Linear(64, 64), torch.nn.Linear(64, 8))
    with caplog.at_level(logging.WARNING, logger="quant_recipes"):
        qr.convert(seq, recipe=qr.MXFP8BlockScaling(), filter=lambda fqn, m: True)
    # N = 48 (grad_output K) and K = 48 are not multiples of 32; N = 8 neither
    assert [type(m) is qr.Linear for m in seq] == [False, False, True, False]
    text = caplog.text
    assert "3 layers left as they are: MXFP8BlockScaling cannot take their shapes" in text
    assert "0 (in_features=64, out_features=48" in text
    assert "multiple of 32" in text


def test_converted_model_trains_under_autocast_and_the_optimizer_steps_the_same_tensors():
    model = _model(torch.float32)
    reference = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    qr.convert(model)
    ids = torch.randint(0, 96, (4, 16))
    with qr.autocast(recipe=qr.Float8CurrentScaling()):
        loss = model(ids).float().logsumexp(-1).mean()
    loss.backward()
    w = model.blocks[0].up.weight
    old = w.detach().clone()
    opt.step()  # the optimizer built before convert updates the converted layer's weight
    assert not torch.equal(w, old)
    with torch.no_grad():  # outside autocast a converted model computes what the original does
        assert torch.equal(qr.unconvert(copy.deepcopy(model))(ids), model(ids))
    assert reference.blocks[0].up.weight.shape == w.shape


def test_unconvert_restores_plain_linears_with_the_same_parameters():
    model = _model()
    before = dict(model.named_parameters())
    qr.unconvert(qr.convert(model))
    assert not any(isinstance(m, qr.Linear) for m in model.modules())
    assert all(p is before[k] for k, p in model.named_parameters())
    assert type(model.blocks[0].up) is torch.nn.Linear


def test_state_dict_round_trips_between_converted_and_plain_models():
    plain, converted = _model(), qr.convert(_model())
    converted.load_state_dict(plain.state_dict())
    plain.load_state_dict(converted.state_dict())


@pytest.mark.parametrize("bad", [object(), torch.nn.Linear(4, 4)])
def test_convert_refuses_what_it_cannot_convert(bad):
    with pytest.raises(TypeError, match="convert: "):
        qr.convert(bad)
    with pytest.raises(TypeError, match="recipe must be a quant_recipes.Recipe or its name"):
        qr.convert(torch.nn.Sequential(torch.nn.Linear(4, 4)), recipe=42)


def test_convert_takes_a_recipe_name():
    model = qr.convert(Toy(), recipe="mxfp8", always_quantize=True)
    assert model.blocks[0].up.bound_recipe == qr.MXFP8BlockScaling()
    model = qr.convert(Toy().bfloat16(), recipe="nvfp4", always_quantize=True)
    assert model.blocks[1].down.bound_recipe == qr.NVFP4BlockScaling()
    with pytest.raises(ValueError, match="unknown name 'fp8'"):
        qr.convert(Toy(), recipe="fp8")


def test_module_filter_fn_takes_torchaos_argument_order():
    """A torchao filter (module first) keeps the layers it refuses, as it does in torchao."""
    seen = []

    def module_filter_fn(mod, fqn):
        seen.append((type(mod).__name__, fqn))
        return isinstance(mod, torch.nn.Linear) and fqn != "blocks.0.up"

    model = qr.convert(Toy(), module_filter_fn=module_filter_fn)
    assert type(model.blocks[0].up) is torch.nn.Linear
    assert type(model.blocks[0].down) is qr.Linear and type(model.lm_head) is qr.Linear
    assert ("Linear", "blocks.1.up") in seen


def test_filter_and_module_filter_fn_exclude_each_other():
    model = Toy()
    with pytest.raises(TypeError, match="filter .* or module_filter_fn .*, not both"):
        qr.convert(model, filter=lambda fqn, m: True, module_filter_fn=lambda m, fqn: True)
    with pytest.raises(TypeError, match="module_filter_fn must be callable"):
        qr.convert(model, module_filter_fn="blocks")
    assert type(model.blocks[0].up) is torch.nn.Linear


def test_a_shared_layer_is_converted_at_every_name_and_stays_shared():
    lin = torch.nn.Linear(32, 32)
    seq = torch.nn.Sequential(lin, torch.nn.ReLU(), lin, torch.nn.ReLU(), lin)
    qr.convert(seq, filter=lambda fqn, m: True)
    assert type(seq[0]) is qr.Linear and seq[0] is seq[2] is seq[4]
    assert seq[0].weight is lin.weight
    qr.unconvert(seq)
    assert type(seq[0]) is torch.nn.Linear and seq[0] is seq[2] is seq[4]
    assert seq[0].weight is lin.weight


def test_a_shared_layer_stays_when_the_filter_refuses_one_of_its_names():
    class Tied(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(16, 16)
            self.mid = torch.nn.Linear(16, 16)
            self.lm_head = self.proj  # the same module under a head name

    model = qr.convert(Tied())
    assert type(model.proj) is torch.nn.Linear and model.proj is model.lm_head
    assert type(model.mid) is qr.Linear


class _SameForward(torch.nn.Linear):
    """A user's subclass that only adds an attribute."""

    tag = "mine"


class _OwnForward(torch.nn.Linear):
    def forward(self, x):
        return super().forward(x) * 2


def test_subclasses_that_keep_linear_forward_are_converted_the_others_are_logged(caplog):
    model = torch.nn.Sequential(_SameForward(16, 16), _OwnForward(16, 16), torch.nn.Linear(16, 8))
    with caplog.at_level(logging.INFO, logger="quant_recipes"):
        qr.convert(model)
    assert type(model[0]) is qr.Linear
    assert type(model[1]) is _OwnForward
    assert "1 layer left as it is: _OwnForward overrides nn.Linear.forward (1)" in caplog.text


def test_multihead_attention_still_runs_after_convert():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.MultiheadAttention(32, 4, batch_first=True))
    x = torch.randn(2, 5, 32)
    want = model[0](x, x, x)[0]
    qr.convert(model, filter=lambda fqn, m: True)
    assert type(model[0].out_proj) is qr.Linear  # NonDynamicallyQuantizableLinear keeps forward
    assert torch.equal(model[0](x, x, x)[0], want)  # attention reads out_proj's Parameters


def test_a_bare_linear_subclass_is_refused():
    with pytest.raises(TypeError, match="bare nn.Linear"):
        qr.convert(_SameForward(8, 8))


class Conv1D(torch.nn.Module):
    """As ``transformers.pytorch_utils.Conv1D``: ``x @ W + b`` with ``W [in, out]``."""

    def __init__(self, nf, nx):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(nx, nf))
        self.bias = torch.nn.Parameter(torch.zeros(nf))

    def forward(self, x):
        return x @ self.weight + self.bias


Conv1D.__module__ = "transformers.pytorch_utils"


def test_a_model_of_transposed_linears_is_refused_by_name_and_nothing_converted_is_a_warning(
        caplog):
    model = torch.nn.Sequential(Conv1D(32, 16), torch.nn.GELU(), Conv1D(16, 32))
    with caplog.at_level(logging.WARNING, logger="quant_recipes"):
        qr.convert(model)
    assert all(type(m) is not qr.Linear for m in model)
    text = caplog.text
    assert "2 layers left as they are: transformers Conv1D stores its weight [in, out]" in text
    assert "(0, 2)" in text
    assert "no layer of Sequential was converted" in text and "Conv1D x2, GELU x1" in text


def test_converting_something_does_not_warn_that_nothing_was_converted(caplog):
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 32))
    with caplog.at_level(logging.WARNING, logger="quant_recipes"):
        qr.convert(model)
    assert "no layer" not in caplog.text
    assert "1 layer left as it is: the default filter keeps output heads" in caplog.text


def test_a_lone_transformer_layer_converts_its_last_projection():
    """Its last Linear is its own feed-forward projection, not a model head."""
    layer = torch.nn.TransformerEncoderLayer(32, 4, dim_feedforward=64, batch_first=True)
    qr.convert(layer)
    assert type(layer.linear1) is qr.Linear and type(layer.linear2) is qr.Linear


class _WithOutputEmbeddings(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.body = torch.nn.Linear(32, 32)
        self.proj_out = torch.nn.Linear(32, 64)
        self.extra = torch.nn.Linear(64, 64)  # registered last, not the head

    def get_output_embeddings(self):
        return self.proj_out

    def forward(self, x):
        return self.proj_out(self.body(x))


def test_the_output_embedding_of_a_hugging_face_style_model_stays_in_high_precision():
    model = _WithOutputEmbeddings()
    qr.convert(model)
    assert type(model.proj_out) is torch.nn.Linear
    assert type(model.body) is qr.Linear and type(model.extra) is qr.Linear


def test_nvfp4_on_float32_layers_is_refused_at_convert_with_the_fix():
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 32))
    with pytest.raises(ValueError, match=r"layer '0' has torch.float32 parameters.*"
                                         r"torch.bfloat16.*disable_rht=True"):
        qr.convert(model, recipe=qr.NVFP4BlockScaling())
    qr.convert(model, recipe=qr.NVFP4BlockScaling(disable_rht=True))  # no transform: fp32 is fine
    assert type(model[0]) is qr.Linear
    bf16 = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)).bfloat16()
    qr.convert(bf16, recipe=qr.NVFP4BlockScaling())
    assert type(bf16[0]) is qr.Linear


def test_nvfp4_token_count_rule_names_the_fix_at_the_first_forward():
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 32)).bfloat16()
    qr.convert(model, recipe=qr.NVFP4BlockScaling())
    with pytest.raises(ValueError, match=r"M = 12 \(M is the number of tokens.*pad the batch"):
        with qr.autocast(recipe=qr.NVFP4BlockScaling()):
            model(torch.randn(3, 4, 32, dtype=torch.bfloat16))


def test_stateful_recipes_convert_float32_models():
    """The input-dtype probe runs on the meta device, where a delayed-scaling quantizer's state
    (on the CPU) cannot go: it must not stop the conversion."""
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 32))
    qr.convert(model, recipe=qr.DelayedScaling())
    assert type(model[0]) is qr.Linear


def test_converting_a_converted_model_again_does_not_claim_full_precision(caplog):
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), torch.nn.Linear(32, 32))
    qr.convert(model, filter=lambda fqn, m: True)
    with caplog.at_level(logging.WARNING, logger="quant_recipes"):
        qr.convert(model)
    assert "no layer" not in caplog.text


def _parametrized(kind):
    from torch.nn.utils import parametrizations

    return {"weight_norm": parametrizations.weight_norm,
            "spectral_norm": parametrizations.spectral_norm,
            "orthogonal": parametrizations.orthogonal}[kind](torch.nn.Linear(32, 32))


@pytest.mark.parametrize("kind", ["weight_norm", "spectral_norm", "orthogonal"])
def test_a_parametrized_linear_is_left_as_it_is_by_name(kind, caplog):
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), _parametrized(kind),
                                torch.nn.Linear(32, 32))
    parametrized = type(model[1])
    with caplog.at_level(logging.WARNING, logger="quant_recipes"):
        qr.convert(model, filter=lambda fqn, m: True)
    assert [type(m) for m in model] == [qr.Linear, parametrized, qr.Linear]
    assert "1 layer left as it is: its parameters are parametrized" in caplog.text
    assert "(1)" in caplog.text
    model.eval()  # spectral_norm's power iteration updates its vectors in training mode
    x = torch.randn(4, 32)
    with torch.no_grad():
        assert torch.equal(model(x), qr.unconvert(model)(x))


def test_a_linear_whose_weight_a_hook_computes_is_left_as_it_is(caplog):
    """``torch.nn.utils.weight_norm`` (the older API): ``weight`` is no Parameter but a tensor
    a forward pre-hook recomputes from ``weight_g`` and ``weight_v``."""
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        normed = torch.nn.utils.weight_norm(torch.nn.Linear(32, 32))
    model = torch.nn.Sequential(torch.nn.Linear(32, 32), normed)
    with caplog.at_level(logging.WARNING, logger="quant_recipes"):
        qr.convert(model, filter=lambda fqn, m: True)
    assert type(model[0]) is qr.Linear and model[1] is normed
    assert "1 layer left as it is: its weight is not a Parameter" in caplog.text


def test_an_unmaterialized_lazy_linear_is_left_as_it_is_and_converted_once_materialized(caplog):
    model = torch.nn.Sequential(torch.nn.LazyLinear(32), torch.nn.Linear(32, 32))
    with caplog.at_level(logging.WARNING, logger="quant_recipes"):
        qr.convert(model, filter=lambda fqn, m: True)
    assert isinstance(model[0], torch.nn.LazyLinear) and type(model[1]) is qr.Linear
    assert "1 layer left as it is: LazyLinear has not been materialized" in caplog.text
    model(torch.randn(4, 16))  # materializes the layer: an nn.Linear(16, 32)
    qr.convert(model, filter=lambda fqn, m: True)
    assert type(model[0]) is qr.Linear and model[0].in_features == 16


class _Experts(torch.nn.Module):
    """As a ``transformers`` experts module (``use_experts_implementation``): 3-D
    ``gate_up_proj [E, 2I, H]`` and ``down_proj [E, H, I]``; no ``in_features``."""

    is_concatenated, is_transposed, has_gate, has_bias = True, False, True, False

    def __init__(self, experts=4, hidden=32, inter=32):
        super().__init__()
        self.gate_up_proj = torch.nn.Parameter(torch.randn(experts, 2 * inter, hidden))
        self.down_proj = torch.nn.Parameter(torch.randn(experts, hidden, inter))


_Experts.__module__ = "transformers.models.fake.modeling_fake"


class _MoEBlock(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.gate = torch.nn.Linear(32, 4)
        self.proj = torch.nn.Linear(32, 32)
        self.experts = _Experts()


def _layer_types(model):
    return {fqn: type(m) for fqn, m in model.named_modules()}


def test_a_filter_that_raises_leaves_the_model_untouched_and_the_error_names_the_module():
    model = _MoEBlock()
    before = _layer_types(model)
    with pytest.raises(AttributeError, match="in_features") as raised:
        qr.convert(model, filter=lambda fqn, m: m.in_features >= 32)  # written for Linears
    assert _layer_types(model) == before
    if hasattr(raised.value, "add_note"):  # Python 3.11 and later
        assert any("'experts'" in note and "_Experts" in note
                   for note in getattr(raised.value, "__notes__", []))
    seen = []
    qr.convert(model, filter=lambda fqn, m: seen.append((fqn, type(m).__name__)) or True)
    assert seen == [("gate", "Linear"), ("proj", "Linear"), ("experts", "_Experts")]


def test_always_quantize_binds_experts_converted_before():
    model = qr.convert(_MoEBlock(), filter=lambda fqn, m: True)
    assert hf_experts.is_quantized_experts(model.experts)
    recipe = qr.Float8CurrentScaling()
    qr.convert(model, recipe=recipe, always_quantize=True)
    assert model.gate.bound_recipe == recipe and model.proj.bound_recipe == recipe
    assert model.experts._quant_up.bound_recipe == model.experts._quant_down.bound_recipe == recipe


def test_a_refusal_while_planning_leaves_the_model_untouched():
    """A layer the recipe refuses (NVFP4's transform takes bfloat16 inputs only) after layers
    it takes: none is converted."""
    model = torch.nn.Sequential(torch.nn.Linear(32, 32).bfloat16(), torch.nn.Linear(32, 32))
    with pytest.raises(ValueError, match="layer '1' has torch.float32 parameters"):
        qr.convert(model, recipe=qr.NVFP4BlockScaling(), filter=lambda fqn, m: True)
    assert [type(m) for m in model] == [torch.nn.Linear, torch.nn.Linear]
