"""``shared_activations()``: in eager code, consecutive layers that read one activation under
equal quantizers (a block's q, k and v projections; gate and up) share its quantized buffers,
and so one copy saved for backward.

A value quantizer is a pure function of its value: an equal quantizer given the same, unmodified
tensor produces the same bytes (`docs/behaviour.md`), so the second quantization is the first
one's result. Whether the tensor is unmodified is read from its version counter, which every
in-place op bumps (under ``no_grad`` and through ``detach()`` views too) but which writes through
``.data``, a NumPy view, DLPack or ``torch.autograd._unsafe_preserve_version_counter`` leave as it
was. Nothing cheaper than reading the tensor again sees those writes, and user code runs between
two layers, so sharing is off by default: each layer quantizes its own input. Inside the context
the caller promises that no such write reaches a tensor between two layers that read it.

Inside it, only the last quantization of an activation (not a parameter) is remembered, per
thread, and only while the tensor lives: the next reader shares it when it gets the same tensor
object at the same version, data pointer and layout, the same quantizer object and amax group.
Only quantizers whose requantization gives the same bits share
(``Quantizer.is_requantization_safe``: not stochastic rounding, not delayed scaling), and never
an inference tensor (it has no version counter). Compiled graphs share without the context:
equal quantizations trace equal ops, which the compiler's common-subexpression elimination
merges, and the graph sees every write it contains.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator

import torch
from quant_core import Quantizer

_last = threading.local()


def contents_key(x: torch.Tensor, group) -> tuple | None:
    """What a remembered quantization of ``x`` under amax reduction ``group`` is valid for: the
    tensor's version (an in-place change bumps it), its memory and layout, and the group; None
    for an inference tensor, which has no version."""
    if x.is_inference():
        return None
    return (x._version, x.data_ptr(), tuple(x.shape), tuple(x.stride()), x.dtype, x.device,
            id(group))


@contextlib.contextmanager
def shared_activations() -> Iterator[None]:
    """Let consecutive eager layers that read one unmodified activation share its quantization,
    for the duration of the context (see the module docstring for the promise it asks)."""
    outer = getattr(_last, "on", False)
    _last.on = True
    try:
        yield
    finally:
        _last.on = outer
        if not outer:
            forget()


def shared_quantization(x: torch.Tensor, q: Quantizer, group,
                        quantize: Callable[[], list[torch.Tensor]]) -> list[torch.Tensor]:
    """``quantize()`` (``q``'s buffers of ``x`` under amax reduction ``group``), or, inside
    :func:`shared_activations`, the buffers of the previous call on this thread when it had the
    same tensor at the same version, the same quantizer object and the same group."""
    if (not getattr(_last, "on", False) or isinstance(x, torch.nn.Parameter)
            or not q.is_requantization_safe()):
        return quantize()
    key = contents_key(x, group)
    if key is None:
        return quantize()
    # the quantizer by identity: equal value quantizers are one interned object in the modules
    # (and comparing a deprecated group-holding quantizer by value raises)
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
