"""quant under accelerate's ``Accelerator`` (bf16 mixed precision on the CPU): the loop, and a
checkpoint through ``save_state`` / ``load_state`` that resumes to the same losses."""

from __future__ import annotations

import pytest
import quant_recipes as qr
import torch

accelerate = pytest.importorskip("accelerate")


@pytest.fixture(autouse=True)
def _fresh_accelerator_state():
    """accelerate keeps one process-wide state; each test builds its Accelerator afresh."""
    from accelerate.state import AcceleratorState

    AcceleratorState._reset_state(reset_partial_state=True)
    yield
    AcceleratorState._reset_state(reset_partial_state=True)


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 64),
                               torch.nn.GELU(), torch.nn.Linear(64, 8))


def _batches(n):
    gen = torch.Generator().manual_seed(1)
    return [(x, x[:, :8] * 0.5) for x in (torch.randn(32, 64, generator=gen) for _ in range(n))]


def _setup(recipe="mxfp8"):
    acc = accelerate.Accelerator(cpu=True, mixed_precision="bf16")
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model, opt = qr.accelerate_prepare(acc, model, opt, recipe=recipe)
    return acc, model, opt


def _train(acc, model, opt, batches):
    losses = []
    for x, y in batches:
        out = model(x)  # accelerate's autocast; no autocast of quant's
        loss = (out.float() - y).pow(2).mean()
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_accelerate_trains_with_quantized_gemms_and_bf16_elsewhere():
    acc, model, opt = _setup()
    net = acc.unwrap_model(model)
    assert [type(m) for m in net][::2] == [qr.Linear, qr.Linear, torch.nn.Linear]
    assert net[0].bound_recipe == qr.MXFP8BlockScaling()
    head_dtypes = []
    net[4].register_forward_hook(lambda m, args, out: head_dtypes.append(out.dtype))
    qr.reset_gemm_paths()
    losses = _train(acc, model, opt, _batches(6))
    assert sum(qr.gemm_paths().values()) == 6 * (2 + 3)  # every GEMM of every step quantized
    assert head_dtypes == [torch.bfloat16] * 6  # the head ran under accelerate's bf16 autocast
    assert net[0].weight.dtype == torch.float32  # mixed precision: fp32 master weights
    assert losses[-1] < losses[0]


def test_save_state_and_load_state_resume_to_the_same_losses(tmp_path):
    batches = _batches(6)
    acc, model, opt = _setup()
    _train(acc, model, opt, batches[:3])
    acc.save_state(str(tmp_path / "ckpt"))
    want = _train(acc, model, opt, batches[3:])

    AcceleratorState = accelerate.state.AcceleratorState
    AcceleratorState._reset_state(reset_partial_state=True)
    acc, model, opt = _setup()
    acc.load_state(str(tmp_path / "ckpt"))
    got = _train(acc, model, opt, batches[3:])
    assert got == want
    assert type(acc.unwrap_model(model)[0]) is qr.Linear


def test_a_recipe_object_with_options_is_refused_and_a_name_takes_them():
    acc = accelerate.Accelerator(cpu=True, mixed_precision="bf16")
    with pytest.raises(TypeError, match="accelerate_prepare: options"):
        qr.accelerate_prepare(acc, _model(), recipe=qr.MXFP8BlockScaling(), margin=1)
    model = qr.accelerate_prepare(acc, _model().bfloat16(), recipe="nvfp4", disable_rht=True)
    assert acc.unwrap_model(model)[0].bound_recipe == qr.NVFP4BlockScaling(disable_rht=True)
