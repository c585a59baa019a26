"""One quantized ``Linear`` compiled on its own (``aot_eager``), run plainly or through a
checkpoint function inside an autocast region: the case every test of a checkpoint around a
compiled module compares against the uncheckpointed run."""

from __future__ import annotations

import quant_recipes as qr
import torch


def compiled_layer_grads(recipe, checkpoint_fn=None, backward_inside: bool = False):
    """``(output, input grad, weight grad, bias grad)`` of a bf16 ``qr.Linear(64, 32)``
    compiled on its own, called as ``checkpoint_fn(compiled, x)`` (plainly for ``None``) inside
    ``autocast(recipe=recipe)``, ``backward`` inside or after the region."""
    torch.manual_seed(0)
    layer = qr.Linear(64, 32, dtype=torch.bfloat16)
    x = torch.randn(32, 64, dtype=torch.bfloat16, requires_grad=True)
    torch._dynamo.reset()
    compiled = torch.compile(layer, backend="aot_eager")
    with qr.autocast(recipe=recipe):
        y = compiled(x) if checkpoint_fn is None else checkpoint_fn(compiled, x)
        if backward_inside:
            y.float().pow(2).sum().backward()
    if not backward_inside:
        y.float().pow(2).sum().backward()
    return y, x.grad, layer.weight.grad, layer.bias.grad
