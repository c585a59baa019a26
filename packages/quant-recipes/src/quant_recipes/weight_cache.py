"""``cached_weights()``: each weight quantized once per optimizer step, not once per forward.

Inside the context, a Linear's eager forward keeps the quantization of its weight (a Parameter)
and reuses it until the weight may have changed: the micro-batches of gradient accumulation and
the recomputed forward of activation checkpointing then quantize each weight once instead of
once per forward. The reuse changes no bit: a value quantizer given the same, unmodified tensor
produces the same bytes. It is limited to the quantizers whose requantization gives the same
bits (``Quantizer.is_requantization_safe``: not stochastic rounding, not delayed scaling).

A cached quantization is used again only while all of these hold:

- no ``torch.optim.Optimizer`` finished a ``step()`` since it was made, in any thread (a global
  step post-hook, registered while a context is open). This is what sees the updates that leave
  the tensor's version as it was: fused optimizers (``fused=True``), FSDP2 (it refills the
  unsharded weight in place, version preserved, from the shards the step updated),
  ``ZeroRedundancyOptimizer`` (the other ranks' shards arrive by broadcast), and ``.data`` or
  NumPy writes made after the step (weight clipping, an EMA);
- the weight's version is unchanged (every in-place op on it, ``copy_``, ``load_state_dict``);
- its storage, address and layout are unchanged (``.data`` assignment). The entry holds the
  storage, so a freed storage's address cannot come back under the same key.

Writes that bypass the version counter (through ``.data``, a NumPy view, DLPack,
``torch.autograd._unsafe_preserve_version_counter``, a collective into the weight) are not seen
between two steps: hand-written updates without an optimizer, a functional optimizer (such as
``ZeroRedundancyOptimizer(overlap_with_ddp=True)``'s, run from DDP's communication hook), or a
broadcast of your own. After such a write call :func:`invalidate_cached_weights`. Checking the
weight's contents instead would read every weight in every forward and wait for the device to
report the result, which costs more than the quantization the cache saves.

Leaving the context frees every cached copy. Until then they are held, one per weight and
quantizer (a copy made before a step until the weight is next quantized): the FP8 formats'
rowwise and columnwise copies are 2 bytes per parameter. The cache is per thread, and only eager
code reads it: Dynamo cannot guard on a tensor's version, so a compiled graph quantizes its
weights in every call (:func:`~quant_recipes.quantize_weights_per_step` keeps them from one
optimizer step to the next for compiled code too). Inference tensors (weights made under
``torch.inference_mode``) have no version and are not cached.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
import weakref
from collections.abc import Callable, Iterator

import torch
from quant_core import Quantizer
from torch.optim.optimizer import register_optimizer_step_post_hook

from .reuse import contents_key

_state = threading.local()
_steps = itertools.count(1)  # next() is atomic: steps in several threads each get a new count
_step = 0  # the count of the last optimizer step or invalidation, process-wide
_hook_lock = threading.Lock()
_hook = None  # the optimizer step post-hook, while any thread is inside cached_weights()
_open = 0  # how many threads are inside cached_weights()


def invalidate_cached_weights() -> None:
    """Quantize every weight again at its next use, in every thread's :func:`cached_weights`,
    and refresh the weights :func:`~quant_recipes.quantize_weights_per_step` keeps: call it after
    changing a weight in a way the caches do not see (a write that bypasses the version counter
    outside an optimizer step, see the module docstring; for compiled code, any write outside an
    optimizer step)."""
    global _step
    _step = next(_steps)
    from .step_weights import refresh_all

    refresh_all()


def _stepped(_optimizer, _args, _kwargs) -> None:
    invalidate_cached_weights()


@contextlib.contextmanager
def cached_weights() -> Iterator[None]:
    """Quantize each weight once while it is unchanged, for the duration of the context (see the
    module docstring for what counts as a change); nesting keeps the outer context's cache."""
    global _hook, _open
    if getattr(_state, "cache", None) is not None:
        yield
        return
    with _hook_lock:
        if _open == 0:
            _hook = register_optimizer_step_post_hook(_stepped)
        _open += 1
    _state.cache = {}  # id(weight) -> (weakref to it, {id(quantizer): entry})
    try:
        yield
    finally:
        _state.cache = None
        with _hook_lock:
            _open -= 1
            if _open == 0:
                _hook.remove()
                _hook = None


def active() -> bool:
    """Whether this thread is inside :func:`cached_weights`."""
    return getattr(_state, "cache", None) is not None


def cached_quantization(w: torch.Tensor, q: Quantizer, group,
                        quantize: Callable[[], list[torch.Tensor]]) -> list[torch.Tensor]:
    """``quantize()`` (``q``'s buffers of the weight ``w`` under amax reduction ``group``), or
    the buffers this thread's cache made from ``w`` with the same quantizer object and group
    since the last optimizer step, at ``w``'s current version and storage."""
    cache = getattr(_state, "cache", None)
    if cache is None or not q.is_requantization_safe():
        return quantize()
    key = contents_key(w, group)
    if key is None:  # an inference tensor: no version to tell a change by
        return quantize()
    key += (_step,)  # read before quantizing: a step meanwhile makes the entry stale
    storage = w.untyped_storage()  # held by the entry: its address cannot come back meanwhile
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
