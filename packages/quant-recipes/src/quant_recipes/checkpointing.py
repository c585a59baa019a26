"""Activation checkpointing of compiled modules under the forward's autocast frame
(`behaviour.md` §7).

An activation checkpoint recomputes its function in backward. Eager quant modules find their
forward's frame themselves (:func:`~quant_recipes.module.module_frame`). A module compiled on
its own cannot: compiled code reads the autocast state of the thread running backward
(autograd's device thread on a GPU, which holds no region), so a checkpoint *around* it would
recompute it in high precision. :func:`in_forward_frame` wraps a checkpoint function so that
its recompute re-enters the frame active when the checkpoint ran (reentrant or not);
:func:`checkpoint_contexts` does the same as a non-reentrant checkpoint's ``context_fn``.
:func:`wire_hf_checkpointing` (called by :func:`~quant_recipes.convert`) wraps the checkpoint
function of Hugging Face's gradient checkpointing, whenever it is enabled.
"""

from __future__ import annotations

import contextlib
import inspect
from typing import Any

import torch

from .autocast import Frame, autocast, current_frame
from .compiling import compiling


def in_backward() -> bool:
    """Whether the autograd engine is running a backward pass on this thread."""
    return torch._C._current_graph_task_id() != -1


def recompute_context(frame: Frame | None):
    """The context a recompute runs in to see ``frame``: the region re-entered (a delayed-scaling
    layer registers nothing with it in backward: :mod:`.delayed_recompute`), or nothing for
    ``None``."""
    if frame is None:
        return contextlib.nullcontext()
    return autocast(frame.enabled, recipe=frame.recipe, calibrating=frame.calibrating,
                    amax_reduction_group=frame.amax_reduction_group)


def checkpoint_contexts():
    """``torch.utils.checkpoint``'s ``context_fn`` (non-reentrant) for modules compiled on their
    own: ``(forward context, recompute context)``, the second re-entering the innermost frame
    active now, so that the recompute in backward runs under the forward's recipe.
    ``checkpoint(layer, x, use_reentrant=False, context_fn=checkpoint_contexts)``; for any
    checkpoint function, reentrant included, :func:`in_forward_frame`."""
    return contextlib.nullcontext(), recompute_context(current_frame())


class _Recompute:
    """``function`` run plainly in forward, under ``frame`` when the autograd engine runs it
    in backward (the recompute)."""

    def __init__(self, function, frame: Frame) -> None:
        self.function, self.frame = function, frame

    def __call__(self, *args, **kwargs):
        if not in_backward():
            return self.function(*args, **kwargs)
        with recompute_context(self.frame):
            return self.function(*args, **kwargs)


class in_forward_frame:  # noqa: N801  (used like a function: in_forward_frame(checkpoint))
    """A checkpoint function (``checkpoint_fn(function, *args, **kwargs)``, such as
    ``functools.partial(torch.utils.checkpoint.checkpoint, use_reentrant=False)``) whose
    recompute runs under the autocast frame active when it was called, reentrant or not.
    Traced by ``torch.compile``, it is ``checkpoint_fn`` itself: the recompute then runs in
    the compiled backward, under the forward's frame. Wrapping twice wraps once; picklable
    when ``checkpoint_fn`` is."""

    def __new__(cls, checkpoint_fn):
        if isinstance(checkpoint_fn, cls):
            return checkpoint_fn
        if not callable(checkpoint_fn):
            raise TypeError(f"in_forward_frame: checkpoint_fn must be callable, got "
                            f"{checkpoint_fn!r}")
        self = super().__new__(cls)
        self.checkpoint_fn = checkpoint_fn
        return self

    def __call__(self, function, *args, **kwargs):
        frame = None if compiling() else current_frame()
        if frame is None:
            return self.checkpoint_fn(function, *args, **kwargs)
        return self.checkpoint_fn(_Recompute(function, frame), *args, **kwargs)

    def __reduce__(self):
        return type(self), (self.checkpoint_fn,)

    def __repr__(self) -> str:
        return f"in_forward_frame({self.checkpoint_fn!r})"


def _wrap_checkpoint_functions(model: torch.nn.Module) -> None:
    for m in model.modules():
        fn = m.__dict__.get("_gradient_checkpointing_func")
        if fn is not None:
            m._gradient_checkpointing_func = in_forward_frame(fn)


class _WiredSetter:
    """A model's ``_set_gradient_checkpointing``: its class's, then every checkpoint function it
    gave the model's modules wrapped with :func:`in_forward_frame`. An object holding the model
    (not a bound method), so that ``deepcopy`` and pickle give the copy its own."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model

    def __call__(self, *args, **kwargs) -> Any:
        out = type(self.model)._set_gradient_checkpointing(self.model, *args, **kwargs)
        _wrap_checkpoint_functions(self.model)
        return out


def wire_hf_checkpointing(model: torch.nn.Module) -> None:
    """Make Hugging Face ``transformers`` gradient checkpointing of ``model`` recompute under
    the forward's frame, whether it is enabled already or later: the checkpoint functions its
    modules hold are wrapped with :func:`in_forward_frame`, and so are those that
    ``gradient_checkpointing_enable`` / ``activation_checkpointing_enable`` give them later
    (through an instance ``_set_gradient_checkpointing``, which ``deepcopy`` and pickle
    carry). Models of transformers' old checkpointing format
    (``_set_gradient_checkpointing(module, value)``) and modules that are not ``transformers``
    models are left as they are."""
    for m in model.modules():
        setter = getattr(type(m), "_set_gradient_checkpointing", None)
        if setter is None or "value" in inspect.signature(setter).parameters:
            continue
        if not isinstance(m.__dict__.get("_set_gradient_checkpointing"), _WiredSetter):
            m._set_gradient_checkpointing = _WiredSetter(m)
        _wrap_checkpoint_functions(m)
