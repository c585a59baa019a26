"""Fake (meta) outputs of ``quant::quantize``: exact buffer shapes and dtypes.

They come from the quantizer's own ``inner_tensor_specs`` (quant-core's one allocation path, the
same that ``quantize`` and ``make_empty`` use), in the storage's declaration order; an absent
direction is an empty uint8 tensor, as in the real kernel.
"""

from __future__ import annotations

from typing import Any

import torch
from quant_core.storage import absent_buffer


def fake_buffers(x: torch.Tensor, q: Any) -> list[torch.Tensor]:
    """Empty tensors shaped like ``quant::quantize``'s outputs for ``q`` on ``x``.

    A quantizer of another family is quantized on the fake tensor itself (its ``quantize`` must
    then be traceable under FakeTensorMode).
    """
    try:
        specs = q.inner_tensor_specs(x.shape)
    except NotImplementedError:
        return [torch.empty_like(t) for t in q.quantize(x).buffer_list(x)]
    return [
        x.new_empty(specs[name][0], dtype=specs[name][1]) if name in specs
        else absent_buffer(x)
        for name in q._storage_class.buffer_names
    ]
