"""Shared by the CPU and GPU tests of routed tokens: a converted Hugging Face experts block, a
projection given a routing or the gathered copy, and a block with and without activation
checkpointing."""

from __future__ import annotations

import pytest
import quant_recipes as qr
import torch
from quant_recipes.moe.routes import gather_tokens


def qwen3_moe_experts(recipe, *, hidden: int, expert_width: int, experts: int = 8,
                      top_k: int = 2, device="cpu"):
    """The experts block of a one-layer bf16 Qwen3-MoE from a config, converted under
    ``recipe``."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=64, hidden_size=hidden, intermediate_size=2 * expert_width,
        moe_intermediate_size=expert_width, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, num_experts=experts, num_experts_per_tok=top_k,
        decoder_sparse_step=1)
    torch.manual_seed(0)
    model = transformers.Qwen3MoeForCausalLM(cfg).to(device, torch.bfloat16)
    qr.convert(model, recipe=recipe)
    return model.model.layers[0].mlp.experts


def in_place_and_on_a_copy(proj, offs, routes, recipe):
    """``(in_place, on_a_copy)``: ``fn(x, w)`` projecting the tokens ``x`` through ``routes``
    (read where they lie), and projecting their gathered copy, under ``recipe`` (None: high
    precision)."""
    def in_place(x, w):
        with qr.autocast(enabled=recipe is not None, recipe=recipe):
            return proj.project(x, offs, w, None, {}, routes)

    def on_a_copy(x, w):
        with qr.autocast(enabled=recipe is not None, recipe=recipe):
            return proj.project(gather_tokens(x, routes), offs, w, None, {})

    return in_place, on_a_copy


def plain_and_checkpointed(experts, h, ids, w, recipe, inside: bool):
    """``[(results, paths)]`` of ``experts`` run plainly and under activation checkpointing
    (backward inside the autocast of ``recipe``, or outside it): results are the output and the
    input, gate/up and down gradients; paths the grouped GEMM paths taken."""
    from torch.utils.checkpoint import checkpoint

    runs = []
    for checkpointed in (False, True):
        experts.zero_grad(set_to_none=True)
        qr.reset_grouped_gemm_paths()
        x = h.clone().requires_grad_()
        with qr.autocast(enabled=recipe is not None, recipe=recipe):
            y = (checkpoint(experts, x, ids, w, use_reentrant=False) if checkpointed
                 else experts(x, ids, w))
            loss = y.float().pow(2).sum()
            if inside:
                loss.backward()
        if not inside:
            loss.backward()
        runs.append(((y, x.grad, experts.gate_up_proj.grad, experts.down_proj.grad),
                     set(qr.grouped_gemm_paths())))
    return runs
