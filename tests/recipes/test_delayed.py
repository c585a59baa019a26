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
    """Issue 12 item 11: calibrating (or training) on inputs that require grad made
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
