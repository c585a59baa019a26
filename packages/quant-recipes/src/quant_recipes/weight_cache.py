"""``cached_weights()``: each weight quantized once per optimizer step, not once per forward.

Inside the context, a Linear's eager forward keeps the quantization of its weight (a Parameter)
and reuses it while the Parameter is unchanged: the micro-batches of gradient accumulation and
the recomputed forward of activation checkpointing then quantize each weight once instead of
once per forward. The reuse changes no bit, for the reason `quant_recipes.reuse` states (a value
quantizer given the same, unmodified tensor produces the same bytes), and it is limited to the
same quantizers (``Quantizer.is_requantization_safe``: not stochastic rounding, not delayed
scaling).

A cached quantization is dropped when its Parameter changes. Any in-place change (the optimizer's
step, ``load_state_dict``, ``copy_``) bumps the tensor's version, and ``.data`` assignment
changes its storage. The entry holds a reference to the storage it was made from, so a freed
storage's address cannot come back under the same key. Leaving the context frees every cached
copy. Until then they are held, one per weight and quantizer: the FP8 formats' rowwise and
columnwise copies are 2 bytes per parameter, kept through the optimizer step.

The cache is per thread, and only eager code reads it. A compiled graph quantizes its weights in
every call: Dynamo cannot guard on a tensor's version.
"""

from __future__ import annotations

import contextlib
import threading
import weakref
from collections.abc import Callable, Iterator

import torch
from quant_core import Quantizer

from .reuse import contents_key

_state = threading.local()


@contextlib.contextmanager
def cached_weights() -> Iterator[None]:
    """Quantize each weight once while it is unchanged, for the duration of the context (see the
    module docstring); nesting keeps the outer context's cache."""
    outer = getattr(_state, "cache", None)
    if outer is None:  # id(weight) -> (weakref to it, {id(quantizer): entry})
        _state.cache = {}
    try:
        yield
    finally:
        if outer is None:
            _state.cache = None


def active() -> bool:
    """Whether this thread is inside :func:`cached_weights`."""
    return getattr(_state, "cache", None) is not None


def cached_quantization(w: torch.Tensor, q: Quantizer, group,
                        quantize: Callable[[], list[torch.Tensor]]) -> list[torch.Tensor]:
    """``quantize()`` (``q``'s buffers of the weight ``w`` under amax reduction ``group``), or
    the buffers this thread's cache made from ``w`` at its current version and storage with the
    same quantizer object and group."""
    cache = getattr(_state, "cache", None)
    if cache is None or not q.is_requantization_safe():
        return quantize()
    storage = w.untyped_storage()  # held by the entry: its address cannot come back meanwhile
    key = contents_key(w, group)
    k = id(w)  # a tensor is no dict key: its == is elementwise
    slot = cache.get(k)
    if slot is None or slot[0]() is not w:

        def release(_ref, cache=cache, k=k):  # the weight died: its copies go with it
            if cache.get(k, (None,))[0] is _ref:
                del cache[k]

        slot = cache[k] = (weakref.ref(w, release), {})
    entry = slot[1].get(id(q))
    if entry is not None and entry[0] is q and entry[1] == key:
        return list(entry[3])
    buffers = quantize()
    slot[1][id(q)] = (q, key, storage, tuple(buffers))
    return buffers
