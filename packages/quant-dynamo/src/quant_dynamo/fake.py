"""Fake (meta) outputs of ``quant::quantize``: exact buffer shapes and dtypes per format.

They come from the quantizer's own ``inner_tensor_specs`` (quant-core's one allocation path, the
same that ``quantize`` and ``make_empty`` use), in the storage's declaration order; an absent
direction is an empty uint8 tensor, as in the real kernel.
"""

from __future__ import annotations

from typing import Any

import torch

_U8 = torch.uint8


def quantize_buffers(x: torch.Tensor, q: Any) -> list[torch.Tensor]:
    """Empty tensors shaped like ``quant::quantize``'s outputs for ``q`` on ``x``.

    A quantizer of another family is quantized on the fake tensor itself (its ``quantize`` must
    then be traceable under FakeTensorMode).
    """
    try:
        specs = q.inner_tensor_specs(x.shape)
    except NotImplementedError:
        storage = q.quantize(x)
        return [
            x.new_empty((0,), dtype=_U8) if t is None else torch.empty_like(t)
            for t in storage.buffers().values()
        ]
    return [
        x.new_empty(specs[name][0], dtype=specs[name][1]) if name in specs
        else x.new_empty((0,), dtype=_U8)
        for name in q._storage_class._buffer_names
    ]
