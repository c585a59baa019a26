"""What a quantized Linear saves for backward: only what the backward GEMMs read.

The backward GEMMs use both forward operands transposed: dgrad reads the weight's columnwise
copy, wgrad the input's. So per recipe the saved tensors must be exactly the columnwise buffers
of the input and of the weight (named below per storage, independently of the code), nothing of
an operand whose gradient partner is not needed, and all of them for the "dequantized" override.
"""

from __future__ import annotations

import dataclasses

import formats
import pytest
import quant_recipes as qr
import torch

#: The buffers of each storage that a columnwise (transposed) use reads.
COLUMNWISE = {
    "Float8TensorStorage": ("_transpose", "_scale_inv"),
    "MXFP8TensorStorage": ("_columnwise_data", "_columnwise_scale_inv"),
    "Float8BlockwiseQTensorStorage": ("_columnwise_data", "_columnwise_scale_inv"),
    "NVFP4TensorStorage": ("_columnwise_data", "_columnwise_scale_inv", "_amax_columnwise"),
}
#: Every format's built-in recipe (tests/formats.py), as factories.
RECIPES = formats.default_recipes()


def _signature(tensors) -> list[tuple[tuple[int, ...], torch.dtype]]:
    return sorted(((tuple(t.shape), t.dtype) for t in tensors if t.numel()), key=str)


def _saved_in_forward(m, x, recipe):
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with qr.autocast(recipe=recipe):
            y = m(x)
    return y, saved


def _expected(m, x, names_of, which):
    """The columnwise buffers of the input and/or weight storages the module's quantizers make."""
    fwd = m._qset.fwd
    out = []
    for i, t in ((0, x), (1, m.weight)):
        if i not in which:
            continue
        storage = fwd[i].quantize(t.detach())
        out += [getattr(storage, n) for n in names_of[type(storage).__name__]]
    return _signature(out)


@pytest.mark.parametrize("name", list(RECIPES))
@pytest.mark.parametrize("grads", ["both", "input_only", "weight_only"])
def test_only_the_columnwise_copies_are_saved(name, grads):
    torch.manual_seed(0)
    m = qr.Linear(64, 32, bias=False, dtype=torch.bfloat16)
    x = torch.randn(32, 64, dtype=torch.bfloat16)
    x.requires_grad_(grads in ("both", "input_only"))
    m.weight.requires_grad_(grads in ("both", "weight_only"))
    y, saved = _saved_in_forward(m, x, RECIPES[name]())
    # wgrad (weight needs grad) reads the input's copy; dgrad (input needs grad) the weight's
    which = {0} if grads == "weight_only" else {1} if grads == "input_only" else {0, 1}
    assert _signature(saved) == _expected(m, x, COLUMNWISE, which)
    y.float().sum().backward()  # and backward runs on what was kept


#: The buffers of each storage that a rowwise use reads.
ROWWISE = {
    "Float8TensorStorage": ("_data", "_scale_inv"),
    "MXFP8TensorStorage": ("_rowwise_data", "_rowwise_scale_inv"),
    "Float8BlockwiseQTensorStorage": ("_rowwise_data", "_rowwise_scale_inv"),
    "NVFP4TensorStorage": ("_rowwise_data", "_rowwise_scale_inv", "_amax_rowwise"),
}


@pytest.mark.parametrize("name", list(RECIPES))
def test_dequantized_override_keeps_only_the_rowwise_forms(name):
    """``backward_override="dequantized"`` runs the backward GEMMs on the rowwise forms, so
    those are all that is saved: forward makes no columnwise copy no GEMM would read."""
    torch.manual_seed(0)
    recipe = dataclasses.replace(RECIPES[name](), backward_override="dequantized")
    m = qr.Linear(64, 32, bias=False, dtype=torch.bfloat16)
    x = torch.randn(32, 64, dtype=torch.bfloat16, requires_grad=True)
    y, saved = _saved_in_forward(m, x, recipe)
    assert _signature(saved) == _expected(m, x, ROWWISE, {0, 1})
    y.float().sum().backward()
    assert x.grad is not None and m.weight.grad is not None


def test_high_precision_override_saves_the_originals_only():
    torch.manual_seed(0)
    m = qr.Linear(64, 32, bias=False, dtype=torch.bfloat16)
    x = torch.randn(32, 64, dtype=torch.bfloat16, requires_grad=True)
    _, saved = _saved_in_forward(m, x, qr.Float8CurrentScaling(backward_override="high_precision"))
    assert len(saved) == 2 and saved[0] is x and saved[1] is m.weight


def _grads(m, x, recipe, seed=0):
    torch.manual_seed(seed)  # NVFP4's stochastic rounding of the gradient
    x = x.detach().clone().requires_grad_()
    m.zero_grad(set_to_none=True)
    with qr.autocast(recipe=recipe):
        y = m(x)
    y.float().pow(2).sum().backward()
    return y.detach(), x.grad, m.weight.grad


#: ``Linear`` switch -> (the operand it keeps as is, the other operand's index in ``_expected``).
REQUANTIZED = {"save_weight_copy": (lambda m, x: m.weight, 0),
               "save_input_copy": (lambda m, x: x, 1)}


@pytest.mark.parametrize("switch", sorted(REQUANTIZED))
@pytest.mark.parametrize("name", list(RECIPES))
def test_an_operand_requantized_in_backward_is_saved_as_is_and_gives_the_same_bits(name, switch):
    """``save_weight_copy=False`` / ``save_input_copy=False``: the weight (a parameter, no new
    memory) or the input itself is saved instead of its quantized copy (as torchao does for the
    input), and backward's copy has the forward copy's bytes."""
    torch.manual_seed(0)
    saving = qr.Linear(128, 64, bias=False, dtype=torch.bfloat16)
    requant = qr.Linear(128, 64, bias=False, dtype=torch.bfloat16, **{switch: False})
    requant.load_state_dict(saving.state_dict())
    x = torch.randn(32, 128, dtype=torch.bfloat16, requires_grad=True)
    kept_of, other = REQUANTIZED[switch]
    kept = kept_of(requant, x)
    _, saved = _saved_in_forward(requant, x, RECIPES[name]())
    assert any(t is kept for t in saved)
    assert _signature([t for t in saved if t is not kept]) == _expected(
        requant, x, COLUMNWISE, which=(other,))
    for a, b in zip(_grads(saving, x, RECIPES[name]()), _grads(requant, x, RECIPES[name]()),
                    strict=True):
        assert torch.equal(a, b)


def test_input_and_weight_both_requantized_save_no_copy_at_all():
    torch.manual_seed(0)
    m = qr.Linear(64, 32, bias=False, save_input_copy=False, save_weight_copy=False)
    x = torch.randn(16, 64, requires_grad=True)
    _, saved = _saved_in_forward(m, x, qr.Float8CurrentScaling())
    assert all(t is x or t is m.weight for t in saved) and len(saved) == 2
    assert "save_weight_copy=False, save_input_copy=False" in repr(m)


@pytest.mark.parametrize("switch", sorted(REQUANTIZED))
def test_delayed_scaling_keeps_the_copy(switch):
    """A delayed-scaling scale changes when the region exits, before backward: requantizing
    would not give the forward's bytes, so the copy is saved."""
    m = qr.Linear(64, 32, bias=False, **{switch: False})
    x = torch.randn(16, 64, requires_grad=True)
    _, saved = _saved_in_forward(m, x, qr.DelayedScaling())
    assert not any(t is REQUANTIZED[switch][0](m, x) for t in saved)
    assert f"{switch}=False" in repr(m)


@pytest.mark.parametrize("switch", sorted(REQUANTIZED))
@pytest.mark.parametrize("name", ["current", "mxfp8", "block"])
def test_an_operand_requantized_in_backward_compiles_to_the_same_bits(name, switch):
    """Compiled and eager, the requantizing layer gives the saving layer's eager bits."""
    dynamo = pytest.importorskip("quant_dynamo")
    if not dynamo.compile_supported():
        pytest.skip("no opaque-object API on this torch")
    torch.manual_seed(0)
    m = qr.Linear(128, 64, bias=False, dtype=torch.bfloat16, **{switch: False})
    saving = qr.Linear(128, 64, bias=False, dtype=torch.bfloat16)
    saving.load_state_dict(m.state_dict())
    x = torch.randn(32, 128, dtype=torch.bfloat16)
    recipe = RECIPES[name]()

    def fn(t):
        with qr.autocast(recipe=recipe):
            return m(t)

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    want = _grads(saving, x, recipe)
    for f in (fn, compiled):
        t = x.clone().requires_grad_()
        m.zero_grad(set_to_none=True)
        y = f(t)
        y.float().pow(2).sum().backward()
        for a, b in zip((y.detach(), t.grad, m.weight.grad), want, strict=True):
            assert torch.equal(a, b)
