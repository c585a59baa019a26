"""Delayed scaling in eager mode: history roll and scale update (numerics.md §4, kernel_bulk)."""

from __future__ import annotations

import pytest
import quant_recipes as qr
import torch


def _step(m, recipe, xmax):
    x = torch.zeros(4, 8)
    x[0, 0] = xmax
    x.requires_grad_()
    with qr.autocast(recipe=recipe):
        y = m(x)
    y.sum().backward()  # grad_output is all ones: amax 1
    return m._qset.fwd_state, m._qset.bwd_state


def _module():
    m = qr.Linear(8, 4, bias=False)
    with torch.no_grad():
        m.weight.fill_(0.25)
        m.weight[0, 0] = -0.5
    return m


def test_history_roll_and_scale_update_max():
    recipe = qr.DelayedScaling(amax_history_len=3)
    m = _module()
    fwd, bwd = _step(m, recipe, 2.0)
    # last = [2, .5, 0]: slots 0 and 1 roll, slot 2 (output, never quantized) does not
    assert fwd.amax_history.tolist() == [[0, 0, 0], [0, 0, 0], [2, 0.5, 0]]
    assert fwd.scale.tolist() == [224.0, 896.0, 1.0]
    # backward (E5M2 under HYBRID): grad_output amax 1 -> 57344; grad_input slot untouched
    assert bwd.amax_history[-1].tolist() == [1.0, 0.0]
    assert bwd.scale.tolist() == [57344.0, 1.0]
    _step(m, recipe, 4.0)
    assert fwd.amax_history[:, 0].tolist() == [0, 2, 4]
    assert fwd.scale.tolist() == [112.0, 896.0, 1.0]
    _step(m, recipe, 1.0)  # max over the window [1, 2, 4] is still 4
    assert fwd.amax_history[:, 0].tolist() == [0, 4, 1]
    assert fwd.scale[0].item() == 112.0
    _step(m, recipe, 1.0)  # window [1, 4, 1]
    assert fwd.scale[0].item() == 112.0
    _step(m, recipe, 1.0)  # window [1, 1, 1]
    assert fwd.scale[0].item() == 448.0


def test_most_recent_and_margin():
    recipe = qr.DelayedScaling(amax_history_len=2, amax_compute_algo="most_recent", margin=1)
    m = _module()
    fwd, _ = _step(m, recipe, 4.0)
    assert fwd.scale[0].item() == 448.0 / 2 / 4
    _step(m, recipe, 1.0)
    assert fwd.scale[0].item() == 448.0 / 2 / 1


def test_scale_used_by_the_next_step():
    recipe = qr.DelayedScaling(amax_history_len=4)
    m = _module()
    _step(m, recipe, 2.0)
    q = m._qset.fwd[0]
    x = torch.full((2, 8), 1.0)
    storage = q.quantize(x)
    assert storage._scale_inv.item() == pytest.approx(1 / 224.0)


def test_no_update_without_grad_or_inside_nested_exit():
    recipe = qr.DelayedScaling(amax_history_len=2)
    m = _module()
    with qr.autocast(recipe=recipe):
        with qr.autocast(recipe=recipe):
            m(torch.ones(2, 8))
        state = m._qset.fwd_state
        assert state.scale.tolist() == [1.0, 1.0, 1.0]  # inner exit: no update
    assert state.scale[0].item() == 448.0
    with torch.no_grad(), qr.autocast(recipe=recipe):
        m(torch.full((2, 8), 2.0))
    assert state.scale[0].item() == 448.0  # no update without grad


def test_delayed_under_compile_raises():
    def f(x):
        with qr.autocast(recipe=qr.DelayedScaling()):
            return x + 1

    with pytest.raises(Exception, match="DelayedScaling is not supported under torch.compile"):
        torch.compile(f, backend="eager", fullgraph=True)(torch.ones(2))


def test_calibration_and_training_keep_delayed_state_out_of_autograd():
    """Calibrating (or training) on inputs that require grad made
    ``amax_history`` and then ``scale`` require grad (CopySlices), keeping every past step's
    graph alive."""
    recipe = qr.DelayedScaling(amax_history_len=4)
    m = _module()
    x = torch.randn(4, 8, requires_grad=True)
    with qr.autocast(enabled=False, calibrating=True, recipe=recipe):
        m(x * 2)
    fwd, bwd = _step(m, recipe, 3.0)
    _step(m, recipe, 5.0)
    for state in (fwd, bwd):
        for t in (state.amax_history, state.scale):
            assert not t.requires_grad and t.grad_fn is None
    assert fwd.amax_history.abs().sum() > 0


def _train(m, recipe, steps, seed):
    g = torch.Generator().manual_seed(seed)
    outs = []
    for i in range(steps):
        x = (torch.randn(4, 8, generator=g) * (1 + i)).requires_grad_()
        with qr.autocast(recipe=recipe):
            y = m(x)
        y.sum().backward()
        outs.append(y.detach())
    return outs


def test_resume_from_state_dict_continues_bitwise():
    """The amax history and scales were not in state_dict, so a resumed model's
    next steps differed (by up to 0.8) from the uninterrupted run."""
    import io

    recipe = qr.DelayedScaling(amax_history_len=4)
    m = _module()
    _train(m, recipe, 3, seed=0)
    buf = io.BytesIO()
    torch.save(m.state_dict(), buf)
    keys = set(m.state_dict())
    assert {k for k in keys if k.startswith("_delayed_scaling.")} == {
        f"_delayed_scaling.{d}.{n}" for d in ("forward", "backward")
        for n in ("scale", "amax_history")
    }
    resumed = qr.Linear(8, 4, bias=False)
    buf.seek(0)
    resumed.load_state_dict(torch.load(buf))  # strict; before its first forward
    want = _train(m, recipe, 2, seed=1)
    got = _train(resumed, recipe, 2, seed=1)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    assert torch.equal(resumed._qset.fwd_state.amax_history, m._qset.fwd_state.amax_history)
    assert torch.equal(resumed._qset.bwd_state.scale, m._qset.bwd_state.scale)


def test_load_into_a_module_with_live_state_copies_in_place():
    recipe = qr.DelayedScaling(amax_history_len=4)
    a, b = _module(), _module()
    _train(a, recipe, 2, seed=0)
    _train(b, recipe, 1, seed=5)
    scale = b._qset.fwd_state.scale
    b.load_state_dict(a.state_dict())
    assert b._qset.fwd_state.scale is scale  # the quantizers' views stay valid
    assert torch.equal(scale, a._qset.fwd_state.scale)


def test_keys_are_nn_linear_keys_without_delayed_state():
    """Only delayed scaling adds keys: a plain nn.Linear checkpoint loads strictly either way."""
    m = qr.Linear(8, 4)
    with qr.autocast(recipe=qr.Float8CurrentScaling()):
        m(torch.randn(2, 8))
    assert set(m.state_dict()) == set(torch.nn.Linear(8, 4).state_dict())
    d = _module()
    _train(d, qr.DelayedScaling(), 1, seed=0)
    d.load_state_dict(torch.nn.Linear(8, 4, bias=False).state_dict())  # strict, no error
    plain = torch.nn.Linear(8, 4, bias=False)
    result = plain.load_state_dict(d.state_dict(), strict=False)
    assert sorted(result.unexpected_keys) == sorted(k for k in d.state_dict() if "_delayed" in k)


def test_history_length_mismatch_is_an_error_naming_the_key():
    a = _module()
    _train(a, qr.DelayedScaling(amax_history_len=4), 1, seed=0)
    b = _module()
    _train(b, qr.DelayedScaling(amax_history_len=8), 1, seed=0)
    with pytest.raises(RuntimeError, match=r"_delayed_scaling.forward.amax_history.*\(4, 3\)"):
        b.load_state_dict(a.state_dict())
    fresh = _module()
    fresh.load_state_dict(a.state_dict())
    with pytest.raises(RuntimeError, match="amax_history_len"):
        _train(fresh, qr.DelayedScaling(amax_history_len=8), 1, seed=0)


def test_pending_state_survives_a_save_before_the_first_forward_and_deepcopy():
    import copy

    a = _module()
    _train(a, qr.DelayedScaling(), 2, seed=0)
    fresh = _module()
    fresh.load_state_dict(a.state_dict())
    again = copy.deepcopy(fresh).state_dict()
    for k, v in a.state_dict().items():
        assert torch.equal(again[k], v)
