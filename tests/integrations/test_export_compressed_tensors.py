"""A model quant exported (``quant_recipes.export``) loads through the consumers' own code:
transformers' compressed-tensors integration reads ``config.json``'s ``quantization_config``
and compressed-tensors decompresses the FP8 weights with their scales. The weights it gives
back are the values quant's weight quantizer made in training, bit for bit, and every other
tensor is the trained one."""

from __future__ import annotations

import pytest
import quant_recipes as qr
import torch

pytest.importorskip("compressed_tensors")
transformers = pytest.importorskip("transformers")


def _llama(intermediate: int):
    """A two-layer Llama from a config (no download); ``intermediate`` not a multiple of 128
    leaves partial 128x128 weight blocks."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=256, hidden_size=256, intermediate_size=intermediate, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    return transformers.LlamaForCausalLM(config).to(torch.bfloat16)


def _train_step(model, recipe):
    """One optimizer step under the recipe, so that the exported weights are trained ones."""
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    with qr.autocast(recipe=qr.recipe(recipe)):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    opt.step()


def _load(directory):
    """The checkpoint as a serving stack loads it, decompressed to bf16 weights."""
    config = transformers.CompressedTensorsConfig(dequantize=True)
    return transformers.AutoModelForCausalLM.from_pretrained(
        directory, quantization_config=config, dtype=torch.bfloat16)


@pytest.mark.parametrize("recipe, intermediate, per_channel", [
    ("fp8_current", 384, False), ("fp8_current", 384, True), ("fp8_block", 384, False),
    ("fp8_block", 320, False)])
def test_transformers_loads_the_trained_weights_bit_for_bit(recipe, intermediate, per_channel,
                                                            tmp_path):
    model = _llama(intermediate)
    qr.convert(model, recipe=recipe)
    _train_step(model, recipe)
    config = qr.export.save_compressed_tensors(model, tmp_path, recipe, per_channel=per_channel)
    loaded = _load(tmp_path).state_dict()
    if per_channel:  # compressed-tensors' channel layout: a [N, 1] scale per weight
        from safetensors.torch import load_file

        (group,) = config["config_groups"].values()
        assert group["weights"]["strategy"] == "channel"
        scales = load_file(tmp_path / "model.safetensors")
        assert scales["model.layers.0.mlp.gate_proj.weight_scale"].shape == (intermediate, 1)

    quantized = {name: m for name, m in model.named_modules() if isinstance(m, qr.Linear)}
    assert len(quantized) == 2 * 7  # q, k, v, o, gate, up, down per layer; lm_head left out
    for name, layer in quantized.items():
        q = layer.weight_quantizer(qr.recipe(recipe))
        want = q.quantize(layer.weight.detach()).dequantize(dtype=torch.bfloat16)
        assert torch.equal(loaded[f"{name}.weight"], want), name
    for key, value in model.state_dict().items():
        if key.rsplit(".", 1)[0] not in quantized:  # norms, embeddings, the head
            assert torch.equal(loaded[key], value), key
    assert config["ignore"] == ["lm_head", "model.embed_tokens", "model.layers.0.input_layernorm",
                                "model.layers.0.post_attention_layernorm",
                                "model.layers.1.input_layernorm",
                                "model.layers.1.post_attention_layernorm", "model.norm"]


def test_per_channel_is_refused_for_weights_with_other_scales():
    model = _llama(384)
    qr.convert(model, recipe="fp8_block")
    with pytest.raises(ValueError, match="per_channel=True repeats a per-tensor scale"):
        qr.export.compressed_tensors_state_dict(model, "fp8_block", per_channel=True)


def test_a_wrong_scale_is_seen(tmp_path):
    """The comparison above can fail: a checkpoint whose scales are their reciprocals (the
    quantize scale, not the dequantization multiplier) loads to other weights."""
    from safetensors.torch import load_file, save_file

    model = _llama(384)
    qr.convert(model, recipe="fp8_current")
    qr.export.save_compressed_tensors(model, tmp_path, "fp8_current")
    path = tmp_path / "model.safetensors"
    state = load_file(path)
    state = {k: (1 / v if k.endswith("weight_scale") else v) for k, v in state.items()}
    save_file(state, path, metadata={"format": "pt"})
    layer = model.model.layers[0].self_attn.q_proj
    want = layer.weight_quantizer(qr.recipe("fp8_current")).quantize(
        layer.weight.detach()).dequantize(dtype=torch.bfloat16)
    assert not torch.equal(_load(tmp_path).state_dict()["model.layers.0.self_attn.q_proj.weight"],
                           want)


def test_quant_export_writes_a_servable_checkpoint_of_a_saved_model(tmp_path, capsys):
    """``quant export SOURCE OUT --recipe fp8_block``: a checkpoint saved with
    ``save_pretrained`` (bf16 weights, a generation config) becomes a compressed-tensors one
    whose decompressed weights are the recipe's quantization of the saved weights; the other
    files come along."""
    from quant_recipes.cli import main

    model = _llama(320)
    model.save_pretrained(tmp_path / "trained")
    assert (tmp_path / "trained" / "generation_config.json").exists()
    assert main(["export", str(tmp_path / "trained"), str(tmp_path / "served"),
                 "--recipe", "fp8_block"]) == 0
    assert "wrote" in capsys.readouterr().out
    assert (tmp_path / "served" / "generation_config.json").exists()
    loaded = _load(tmp_path / "served").state_dict()
    q = qr.Linear(1, 1).weight_quantizer(qr.recipe("fp8_block"))
    for key, value in model.state_dict().items():
        layer = key.rsplit(".", 1)[0]
        if key.endswith("proj.weight"):  # the converted layers: their quantized values
            value = q.quantize(value).dequantize(dtype=torch.bfloat16)
        assert torch.equal(loaded[key], value), (layer, key)
    # a second export into the same directory is refused unless asked for
    assert main(["export", str(tmp_path / "trained"), str(tmp_path / "served"),
                 "--recipe", "fp8_block"]) == 2
    assert "--overwrite" in capsys.readouterr().err


@pytest.mark.parametrize("argv, message", [
    (["export", "{missing}", "{out}", "--recipe", "fp8_block"], "no config.json"),
    (["export", "{src}", "{out}", "--recipe", "fp8_blocks"], "unknown name 'fp8_blocks'"),
    (["export", "{src}", "{out}", "--recipe", "mxfp8"], "MXFP8"),
    (["export", "{src}", "{src}", "--recipe", "fp8_block", "--overwrite"], "another directory"),
])
def test_quant_export_refuses_with_what_is_wrong(argv, message, tmp_path, capsys):
    from quant_recipes.cli import main

    _llama(256).save_pretrained(tmp_path / "src")
    paths = {"missing": tmp_path / "nothing", "src": tmp_path / "src", "out": tmp_path / "out"}
    capsys.readouterr()
    assert main([a.format(**paths) for a in argv]) == 2
    err = capsys.readouterr().err  # after transformers' progress bars, where it loads
    assert any(line.startswith("quant export: ") and message in line
               for line in err.splitlines()), err
