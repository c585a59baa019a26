"""The compressed-tensors export (``quant_recipes.export``): the exported FP8 weights are the
bytes the recipe's weight quantizer makes in training, their scales dequantize them exactly as
quant does, and the ``quantization_config`` is compressed-tensors' ``float-quantized`` layout
(the FP8_DYNAMIC-like per-tensor scheme and the FP8_BLOCK scheme of
vllm-project/compressed-tensors ``quant_scheme.py``)."""

from __future__ import annotations

import json

import pytest
import quant_recipes as qr
import torch
from quant_core import DType, Float8BlockQuantizer, Float8CurrentScalingQuantizer

#: The weight quantizer each exportable recipe's defaults make, built here from quant-core.
WEIGHT_QUANTIZERS = {
    "fp8_current": Float8CurrentScalingQuantizer(DType.E4M3),
    "fp8_block": Float8BlockQuantizer(DType.E4M3, block_scaling_dim=2),
}
#: The ``weights`` / ``input_activations`` entries compressed-tensors' presets spell.
WEIGHTS = {
    "fp8_current": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor",
                    "dynamic": False},
    "fp8_block": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "block",
                  "dynamic": False, "block_structure": [128, 128]},
}
INPUTS = {
    "fp8_current": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "tensor",
                    "dynamic": True},
    "fp8_block": {"num_bits": 8, "type": "float", "symmetric": True, "strategy": "group",
                  "dynamic": True, "group_size": 128},
}


class Tiny(torch.nn.Module):
    """Two quant Linear layers (one with partial 128-blocks both ways), a norm, an embedding
    and a head left in high precision."""

    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Embedding(16, 320, dtype=torch.bfloat16)
        self.up = qr.Linear(320, 200, dtype=torch.bfloat16, name="up")
        self.norm = torch.nn.LayerNorm(200, dtype=torch.bfloat16)
        self.down = qr.Linear(200, 256, bias=False, dtype=torch.bfloat16, name="down")
        self.lm_head = torch.nn.Linear(256, 16, bias=False, dtype=torch.bfloat16)


def _model(seed=0):
    torch.manual_seed(seed)
    return Tiny()


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(torch.uint8)


def _dequantized(weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``weight * weight_scale`` as a compressed-tensors loader reads it: one scale, or one per
    128x128 block."""
    n, k = weight.shape
    if scale.numel() > 1:
        scale = scale.repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)[:, :k]
    return weight.float() * scale


@pytest.mark.parametrize("name", list(WEIGHT_QUANTIZERS))
def test_weights_are_the_training_bytes_and_dequantize_as_quant_does(name):
    model = _model()
    state, _ = qr.compressed_tensors_state_dict(model, name)
    for layer in ("up", "down"):
        w = getattr(model, layer).weight.detach()
        s = WEIGHT_QUANTIZERS[name].quantize(w)
        data = s._data if name == "fp8_current" else s._rowwise_data
        assert state[f"{layer}.weight"].dtype == torch.float8_e4m3fn
        assert state[f"{layer}.weight"].shape == w.shape
        assert torch.equal(_bytes(state[f"{layer}.weight"]), _bytes(data))
        scale = state[f"{layer}.weight_scale"]
        assert scale.dtype == torch.float32
        n, k = w.shape
        assert scale.shape == ((1,) if name == "fp8_current" else (-(-n // 128), -(-k // 128)))
        assert torch.equal(_dequantized(state[f"{layer}.weight"], scale),
                           s.dequantize(dtype=torch.float32))


@pytest.mark.parametrize("name", list(WEIGHT_QUANTIZERS))
def test_a_weight_stored_quantized_is_exported_as_it_is(name):
    recipe = qr.recipe(name)
    with qr.quantized_model_init(recipe):
        model = _model()
    state, _ = qr.compressed_tensors_state_dict(model, recipe)
    w = model.up.weight
    data = w._data if name == "fp8_current" else w._rowwise_data
    assert torch.equal(_bytes(state["up.weight"]), _bytes(data))
    assert torch.equal(_dequantized(state["up.weight"], state["up.weight_scale"]),
                       w.dequantize(dtype=torch.float32))


def test_a_weight_stored_quantized_for_another_recipe_is_refused():
    with qr.quantized_model_init(qr.Float8BlockScaling()):
        model = _model()
    with pytest.raises(ValueError, match="'up'.*stored quantized.*Float8BlockQuantizer"):
        qr.compressed_tensors_state_dict(model, "fp8_current")


@pytest.mark.parametrize("name", list(WEIGHT_QUANTIZERS))
def test_the_config_and_the_unquantized_tensors(name):
    model = _model()
    state, config = qr.compressed_tensors_state_dict(model, name)
    assert config == {
        "quant_method": "compressed-tensors", "format": "float-quantized",
        "quantization_status": "compressed", "kv_cache_scheme": None,
        "config_groups": {"group_0": {
            "targets": ["Linear"], "weights": WEIGHTS[name], "input_activations": INPUTS[name],
            "output_activations": None, "format": "float-quantized"}},
        "ignore": ["embed", "lm_head", "norm"],
    }
    expected = {"up.weight", "up.weight_scale", "up.bias", "down.weight", "down.weight_scale",
                "embed.weight", "norm.weight", "norm.bias", "lm_head.weight"}
    assert set(state) == expected
    for key, t in model.state_dict().items():
        if key not in ("up.weight", "down.weight"):
            assert state[key].dtype == t.dtype and torch.equal(state[key], t), key


def test_a_layer_the_recipe_keeps_in_high_precision_is_ignored():
    fp8 = Float8CurrentScalingQuantizer(DType.E4M3, internal=True)

    def factory(role):
        return qr.IdentityQuantizer() if role is not None and role.name == "down" else fp8

    model = _model()
    state, config = qr.compressed_tensors_state_dict(model, qr.CustomRecipe(qfactory=factory))
    assert "down.weight_scale" not in state
    assert state["down.weight"].dtype == torch.bfloat16
    assert config["ignore"] == ["down", "embed", "lm_head", "norm"]


def test_each_layer_exports_under_its_bound_recipe_without_one_given():
    model = _model()
    model.down.bound_recipe = qr.Float8BlockScaling()
    state, config = qr.compressed_tensors_state_dict(model)  # up: the default recipe
    assert state["up.weight_scale"].shape == (1,)
    assert state["down.weight_scale"].shape == (2, 2)
    groups = sorted(config["config_groups"].values(), key=lambda g: g["targets"])
    assert [g["targets"] for g in groups] == [["down"], ["up"]]
    assert [g["weights"]["strategy"] for g in groups] == ["block", "tensor"]


@pytest.mark.parametrize("recipe, says", [
    ("mxfp8", "MXFP8BlockScaling.*'up'.*'mxfp8'"),
    ("nvfp4", "NVFP4BlockScaling.*'up'.*'nvfp4'"),
    ("delayed", "DelayedScaling.*'up'.*delayed scaling"),
    (qr.Float8BlockScaling(w_block_scaling_dim=1), "Float8BlockScaling.*'up'.*1x128 weight"),
    (qr.Float8CurrentScaling(fp8_format=qr.Format.E5M2), "Float8CurrentScaling.*'up'.*E5M2"),
], ids=["mxfp8", "nvfp4", "delayed", "block1d", "e5m2"])
def test_a_recipe_without_a_layout_is_refused_by_name(recipe, says):
    with pytest.raises(ValueError, match=says):
        qr.compressed_tensors_state_dict(_model(), recipe)


def test_grouped_layers_and_models_without_quant_layers_are_refused():
    model = torch.nn.Sequential(qr.GroupedLinear(2, 128, 128))
    with pytest.raises(ValueError, match="GroupedLinear '0'"):
        qr.compressed_tensors_state_dict(model, "fp8_current")
    with pytest.raises(ValueError, match="no quant_recipes.Linear"):
        qr.compressed_tensors_state_dict(torch.nn.Linear(128, 128), "fp8_current")


def test_saved_files_round_trip(tmp_path):
    safetensors = pytest.importorskip("safetensors.torch")
    model = _model()
    model.lm_head.weight = model.embed.weight  # tied, as many language models are
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "tiny"}))
    config = qr.save_compressed_tensors(model, tmp_path, "fp8_block")
    state, expected_config = qr.compressed_tensors_state_dict(model, "fp8_block")
    assert config == expected_config
    loaded = safetensors.load_file(tmp_path / "model.safetensors")
    assert set(loaded) == set(state)
    for key, t in state.items():
        assert loaded[key].dtype == t.dtype and torch.equal(_bytes(loaded[key]), _bytes(t)), key
    written = json.loads((tmp_path / "config.json").read_text())
    assert written == {"model_type": "tiny", "quantization_config": config}
