"""A converted Hugging Face Llama under ``transformers.Trainer`` (accelerate, bf16 mixed
precision, CPU) and PEFT's LoRA, and its checkpoints loading into a plain model."""

from __future__ import annotations

import pytest
import quant_recipes as qr
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("accelerate")

VOCAB, SEQ = 256, 16


def _llama(seed=0):
    cfg = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=False)
    torch.manual_seed(seed)
    return transformers.LlamaForCausalLM(cfg)


class _Tokens(torch.utils.data.Dataset):
    def __init__(self, n=64):
        gen = torch.Generator().manual_seed(1)
        # learnable in a few steps: 8 of the 256 tokens, the second half repeating the first
        base = torch.randint(0, 8, (n, SEQ // 2), generator=gen)
        self.ids = torch.cat([base, base], dim=1)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def _train(model, tmp_path, steps=24):
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=steps, per_device_train_batch_size=4,
        learning_rate=1e-2, logging_steps=1, report_to=[], save_strategy="no", use_cpu=True,
        bf16=True, seed=0, data_seed=0, disable_tqdm=True)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=_Tokens())
    trainer.train()
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


def test_trainer_trains_a_converted_model_like_bf16(tmp_path):
    qr.reset_gemm_paths()
    model = qr.convert(_llama(), recipe=qr.Float8CurrentScaling(), always_quantize=True)
    losses = _train(model, tmp_path / "quant")
    assert sum(qr.gemm_paths().values()) > 0  # the Trainer's loop ran quantized GEMMs
    bf16 = _train(_llama(), tmp_path / "bf16")
    assert len(losses) == len(bf16) == 24
    # it learns, step by step as bf16 does
    assert sum(losses[-4:]) < 0.6 * sum(losses[:4]), losses
    assert all(abs(a - b) / b < 0.05 for a, b in zip(losses, bf16, strict=True)), (losses, bf16)


def test_a_converted_checkpoint_and_an_unconverted_one_load_into_a_plain_model(tmp_path):
    model = qr.convert(_llama(), recipe=qr.MXFP8BlockScaling(), always_quantize=True)
    model.save_pretrained(tmp_path / "converted")
    qr.unconvert(model)
    model.save_pretrained(tmp_path / "plain")
    want = model.state_dict()
    for folder in ("converted", "plain"):
        loaded = transformers.LlamaForCausalLM.from_pretrained(tmp_path / folder)
        got = loaded.state_dict()
        assert got.keys() == want.keys()
        assert all(torch.equal(got[k], want[k]) for k in want)


def test_lora_trains_only_the_adapters_of_quantized_layers():
    peft = pytest.importorskip("peft")
    model = qr.convert(_llama(), recipe=qr.Float8CurrentScaling(), always_quantize=True)
    base = {k: v.detach().clone() for k, v in model.state_dict().items()}
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    wrapped = lora.base_model.model.model.layers[0].self_attn.q_proj
    assert type(wrapped.base_layer) is qr.Linear  # PEFT took the quantized layer as a Linear
    trainable = [n for n, p in lora.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    opt = torch.optim.AdamW([p for p in lora.parameters() if p.requires_grad], lr=1e-2)
    qr.reset_gemm_paths()
    batch = _Tokens()[0]
    for _ in range(3):
        loss = lora(input_ids=batch["input_ids"][None], labels=batch["labels"][None]).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert sum(qr.gemm_paths().values()) > 0
    after = lora.base_model.model.state_dict()
    for k, v in base.items():  # the quantized base layers did not move
        key = k if k in after else k.replace(".weight", ".base_layer.weight")
        assert torch.equal(after[key], v), k


@pytest.mark.parametrize("recipe", [qr.Float8CurrentScaling, qr.MXFP8BlockScaling])
def test_convert_after_get_peft_model_quantizes_the_base_layers_as_before(recipe, caplog):
    """The order of ``convert`` and ``get_peft_model`` does not matter with the default filter:
    either way the base layers are quantized and the LoRA adapters stay in high precision."""
    peft = pytest.importorskip("peft")
    config = peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"])
    first = peft.get_peft_model(qr.convert(_llama(), recipe=recipe(), always_quantize=True),
                                config)
    with caplog.at_level("WARNING", logger="quant_recipes"):
        then = qr.convert(peft.get_peft_model(_llama(), config), recipe=recipe(),
                          always_quantize=True)
    kinds = [{n: type(m) for n, m in model.named_modules()} for model in (first, then)]
    assert kinds[0] == kinds[1]
    assert kinds[1]["base_model.model.model.layers.0.self_attn.q_proj.base_layer"] is qr.Linear
    assert kinds[1]["base_model.model.model.layers.0.self_attn.q_proj.lora_A.default"] is (
        torch.nn.Linear)
    assert "8 layers left as they are: the default filter keeps LoRA adapters" in caplog.text
    assert "cannot take their shapes" not in caplog.text
