"""What a quantized Linear saves for backward (issue 14): only what the backward GEMMs read.

The backward GEMMs use both forward operands transposed: dgrad reads the weight's columnwise
copy, wgrad the input's. So per recipe the saved tensors must be exactly the columnwise buffers
of the input and of the weight (named below per storage, independently of the code), nothing of
an operand whose gradient partner is not needed, and all of them for the "dequantized" override.
"""

from __future__ import annotations

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
RECIPES = {
    "current": qr.Float8CurrentScaling,
    "block": qr.Float8BlockScaling,
    "mxfp8": qr.MXFP8BlockScaling,
    "nvfp4": qr.NVFP4BlockScaling,
}


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


def test_dequantized_override_keeps_the_rowwise_forms():
    """``backward_override="dequantized"`` runs the backward GEMMs on the rowwise forms."""
    torch.manual_seed(0)
    recipe = qr.Float8CurrentScaling(backward_override="dequantized")
    m = qr.Linear(64, 32, bias=False, dtype=torch.bfloat16)
    x = torch.randn(32, 64, dtype=torch.bfloat16, requires_grad=True)
    y, saved = _saved_in_forward(m, x, recipe)
    assert any(t.shape == (32, 64) and t.dtype == torch.uint8 for t in saved)  # x's data
    y.float().sum().backward()
    assert x.grad is not None and m.weight.grad is not None
