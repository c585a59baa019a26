"""One quantization per (tensor, quantizer value) in eager mode: consecutive layers that read one
activation under equal quantizers (a block's q, k and v projections; gate and up) share its
quantized buffers, and so one copy saved for backward.

This is legal because a value quantizer is a pure function of its value: an equal quantizer
given the same, unmodified tensor produces the same bytes (`docs/behaviour.md`), so the second
quantization is the first one's result. Only quantizers whose requantization gives the same bits
share (``Quantizer.is_requantization_safe``: not stochastic rounding, not delayed scaling), and
the tensor must be the same object at the same version (an in-place change bumps it).

Only the last quantization of an activation (not a parameter) is remembered, per thread, and
only while the tensor lives: consecutive readers of one tensor share it, and nothing outlives
the tensor. Compiled graphs get the same sharing from the compiler (equal quantizations trace
equal ops, which its common-subexpression elimination merges); this module is for eager code.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Callable

import torch
from quant_core import Quantizer

_last = threading.local()


def contents_key(x: torch.Tensor, group) -> tuple:
    """What a remembered quantization of ``x`` under amax reduction ``group`` is valid for: the
    tensor's version (an in-place change bumps it), its memory and layout, and the group."""
    return (x._version, x.data_ptr(), tuple(x.shape), tuple(x.stride()), x.dtype, x.device,
            id(group))


def shared_quantization(x: torch.Tensor, q: Quantizer, group,
                        quantize: Callable[[], list[torch.Tensor]]) -> list[torch.Tensor]:
    """``quantize()`` (``q``'s buffers of ``x`` under amax reduction ``group``), or the buffers
    of the previous call on this thread when it had the same tensor at the same version, the
    same quantizer object and the same group."""
    if isinstance(x, torch.nn.Parameter) or not q.is_requantization_safe():
        return quantize()
    # the quantizer by identity: equal value quantizers are one interned object in the modules
    # (and comparing a deprecated group-holding quantizer by value raises)
    key = contents_key(x, group)
    entry = getattr(_last, "entry", None)
    if entry is not None and entry[0]() is x and entry[1] == key and entry[3] is q:
        return list(entry[2])
    buffers = quantize()
    state = _last

    def release(_ref, state=state):  # the tensor died: its quantization goes with it
        if getattr(state, "entry", None) is not None and state.entry[0] is _ref:
            state.entry = None

    _last.entry = (weakref.ref(x, release), key, tuple(buffers), q)
    return buffers


def forget() -> None:
    """Drop this thread's remembered quantization (its buffers may then be freed)."""
    _last.entry = None
