"""``autocast``: a stack of immutable frames that ``torch.compile`` can trace (`behaviour.md` §7).

The state is per thread and per asyncio task. Eager code keeps each context's frames in a
``contextvars.ContextVar`` (a task starts with the frames of the code that created it, as
``decimal``'s contexts do; a new thread starts with none, as ``torch.autocast``'s state is per
thread). Dynamo cannot trace ``contextvars``, so each thread also keeps a copy of the stack in a
``threading.local``: the list compiled code reads and guards on, and pushes to and truncates
when it enters and exits a region itself. Every eager enter and exit writes the entering
context's frames into that copy. Plain Python objects and list mutations only: no contextlib
generator, no warnings, nothing Dynamo cannot trace.

Asyncio tasks that enter autocast and await inside it interleave their regions on one thread.
Eager modules still run under their own task's frames. The thread's copy can then hold another
task's frames, which compiled code cannot tell apart: the thread is marked, and a compiled
module traced or run there while another task's regions are active raises ``RuntimeError``
(its guard on the mark fails, and the trace raises) instead of running under another task's
recipe. The mark clears when the thread's active regions are one context's again.

The default recipe is :class:`Float8CurrentScaling` (stateless, runs everywhere); it is never
the stateful ``DelayedScaling``. ``DelayedScaling`` is eager-only: entering an autocast with it
while ``torch.compile`` traces raises ``RuntimeError``.
"""

from __future__ import annotations

import contextvars
import threading
from typing import Any, NamedTuple

import torch

from .compiling import compiling, raise_error
from .delayed import Region, update_registered
from .recipe_names import recipe as named_recipe
from .recipes import Float8CurrentScaling, Recipe


class Frame(NamedTuple):
    """One autocast level: what modules inside it see."""

    enabled: bool
    recipe: Recipe | None
    calibrating: bool
    amax_reduction_group: Any


class _ThreadState(threading.local):
    """Per thread: ``stack``, the copy of the active frames that compiled code reads (outermost
    first); ``eager``, the ids of the frames that eager code entered on this thread and has not
    exited, in every context; ``interleaved``, whether regions of several contexts (asyncio
    tasks) are active at once on this thread.

    All exist from a thread's first access on, so a graph compiled before any eager autocast
    ran does not guard on their absence (and recompile once they appear).
    """

    def __init__(self) -> None:
        self.stack: list[Frame] = []
        self.eager: set[int] = set()
        self.interleaved = False


_LOCAL = _ThreadState()
#: Per context (thread, asyncio task): the frames eager code entered, outermost first, and the
#: outermost region's frame with its delayed-scaling bookkeeping (eager only).
_FRAMES: contextvars.ContextVar[tuple[Frame, ...]] = contextvars.ContextVar(
    "quant_autocast_frames", default=())
_REGION: contextvars.ContextVar[tuple[Frame, Region] | None] = contextvars.ContextVar(
    "quant_autocast_region", default=None)
_DEFAULT: list[Recipe] = []

INTERLEAVED = (
    "quant_recipes.autocast: autocast regions of several asyncio tasks are active at once on "
    "this thread, and compiled code reads the thread's autocast state, not the task's (Dynamo "
    "cannot trace contextvars), so a compiled module cannot tell which task's recipe is its "
    "own. Run such tasks in threads of their own, enter autocast outside the tasks, or run "
    "the modules eagerly (eager modules follow their task's regions).")


def _stack() -> list[Frame]:
    return _LOCAL.stack


def _own(frames, eager: set[int]) -> list[Frame]:
    """The frames of ``frames`` that eager code entered on this thread and has not exited."""
    return [f for f in frames if id(f) in eager]


def _in_step(ctx: tuple[Frame, ...], thread: list[Frame], eager: set[int]) -> bool:
    """The thread's copy holds this context's eager frames and no other context's (frames
    that compiled code pushed may stand among them)."""
    own = _own(thread, eager)
    mine = _own(ctx, eager)
    return len(own) == len(mine) and all(a is b for a, b in zip(own, mine, strict=True))


def default_recipe() -> Recipe:
    """``Float8CurrentScaling()``, built on first use (its env defaults read then) and reused.
    While compiling it is built but not stored: a new global object made during tracing would
    have to be rebuilt after the graph, which Dynamo cannot do for dataclass fields."""
    if _DEFAULT:
        return _DEFAULT[0]
    recipe = Float8CurrentScaling()
    if not compiling():
        _DEFAULT.append(recipe)
    return recipe


def current_frame() -> Frame | None:
    """The innermost active frame of this thread and task, or ``None`` outside every
    autocast."""
    if compiling():
        if _LOCAL.interleaved:
            raise_error(RuntimeError, INTERLEAVED)
        stack = _stack()
        return stack[-1] if stack else None
    ctx, stack = _FRAMES.get(), _LOCAL.stack
    if len(ctx) == len(stack) and (not ctx or ctx[-1] is stack[-1]):  # the common case
        return ctx[-1] if ctx else None
    eager = _LOCAL.eager
    if _in_step(ctx, stack, eager):
        return stack[-1] if stack else None
    _LOCAL.interleaved = True  # another task's regions hold the thread's copy
    mine = _own(ctx, eager)
    return mine[-1] if mine else None


def current_region() -> Region | None:
    """The delayed-scaling bookkeeping of this context's active outermost region on this
    thread (eager), or ``None``."""
    region = _REGION.get()
    return region[1] if region is not None and id(region[0]) in _LOCAL.eager else None


def _check_recipe_support(recipe: Recipe) -> None:
    if not isinstance(recipe, Recipe):
        raise TypeError(f"autocast(recipe=...) must be a quant_recipes.Recipe or its name, got "
                        f"{recipe!r}")
    if recipe.delayed() and compiling():
        raise_error(
            RuntimeError,
            "DelayedScaling is not supported under torch.compile: it keeps live amax/scale "
            "tensors updated between steps. Use Float8CurrentScaling (or another stateless "
            "recipe) in compiled code, or run this region eagerly.",
        )


class autocast:  # noqa: N801  (TransformerEngine's name)
    """Quantize the modules called inside with ``recipe`` (default ``Float8CurrentScaling()``),
    a :class:`~quant_recipes.Recipe` or a name :func:`~quant_recipes.recipe` knows (``"mxfp8"``,
    resolved when the instance is made).

    ``enabled=False`` turns quantization off inside (also within an enabled region);
    ``calibrating=True`` runs high precision while delayed-scaling quantizers record amaxes;
    ``amax_reduction_group`` is passed to every quantize call (amax all-reduced with MAX).
    An instance can be active once at a time; nest new instances. The state is per thread and
    per asyncio task.
    """

    __slots__ = ("enabled", "recipe", "calibrating", "amax_reduction_group", "_depth",
                 "_frame")

    def __init__(self, enabled: bool = True, *, recipe: Recipe | str | None = None,
                 calibrating: bool = False, amax_reduction_group=None) -> None:
        self.enabled = enabled
        self.recipe = named_recipe(recipe) if isinstance(recipe, str) else recipe
        self.calibrating = calibrating
        self.amax_reduction_group = amax_reduction_group
        self._depth = -1
        self._frame = None

    def __enter__(self) -> autocast:
        if self._depth >= 0:
            raise RuntimeError(
                "this autocast instance is already active; nest a new autocast(...) instead"
            )
        recipe = self.recipe
        if recipe is None and (self.enabled or self.calibrating):
            recipe = default_recipe()
        if recipe is not None:
            _check_recipe_support(recipe)
        stack = _stack()
        frame = Frame(bool(self.enabled), recipe, bool(self.calibrating),
                      self.amax_reduction_group)
        self._frame = frame
        if compiling():
            self._depth = len(stack)
            stack.append(frame)
            return self
        ctx, eager = _FRAMES.get(), _LOCAL.eager
        if not _in_step(ctx, stack, eager):  # another task's regions: the thread takes ours
            _LOCAL.interleaved = True
            stack[:] = _own(ctx, eager)
        self._depth = len(stack)
        stack.append(frame)
        eager.add(id(frame))
        _FRAMES.set((*ctx, frame))
        if not _own(ctx, eager):  # this context's outermost region on this thread
            _REGION.set((frame, Region()))
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        depth, frame = self._depth, self._frame
        self._depth = -1
        self._frame = None
        stack = _stack()
        if compiling():
            del stack[depth:]
            return
        ctx, eager = _FRAMES.get(), _LOCAL.eager
        in_step = _in_step(ctx, stack, eager)
        mine = _own(ctx, eager)
        if not any(f is frame for f in mine):  # exited in another context than it entered
            mine = _own(stack, eager)
        at = _position(mine, frame)
        later = at < len(mine) - 1  # regions of this context entered after it, still active
        eager.discard(id(frame))
        _FRAMES.set(tuple(f for f in ctx if f is not frame))
        rest = [f for f in mine if f is not frame]
        where = _position(stack, frame)
        if not in_step:
            stack[:] = rest
        else:  # an out-of-order exit removes its own frame only
            del stack[where:where + 1 if later else len(stack)]
        if eager == {id(f) for f in rest}:  # no other context's region is left on the thread
            _LOCAL.interleaved = False
        if later:
            _exit_out_of_order()
        region = _REGION.get()
        if region is not None and region[0] is frame:
            _REGION.set(None)
            if exc_type is None and self.enabled and torch.is_grad_enabled():
                update_registered(region[1].forward)


def _position(stack: list[Frame], frame: Frame | None) -> int:
    """Where ``frame`` is in ``stack``, by identity (equal frames are distinct regions); the
    stack's length when it is not there."""
    for i in range(len(stack) - 1, -1, -1):
        if stack[i] is frame:
            return i
    return len(stack)


def _exit_out_of_order() -> None:
    """An exit with later regions of its own context still active above it: only its own
    frame was removed; raise, leaving the later regions active."""
    raise RuntimeError(
        "quant_recipes.autocast: this region exited while a region entered after it in the "
        "same thread and task was still active. Regions nest: exit them in the reverse order "
        "of entering them."
    )
