"""``autocast``: a stack of immutable frames that ``torch.compile`` can trace (`behaviour.md` §7).

Each thread has its own stack (a list in a ``threading.local``, as ``torch.autocast`` keeps its
state per thread) of :class:`Frame` named tuples; entering pushes, exiting truncates to the depth
at entry, so the exact enclosing state returns (also on exceptions). The innermost frame decides
for modules called inside it. Plain Python objects and list mutations only: no contextlib
generator, no warnings, nothing Dynamo cannot trace (it traces ``threading.local`` attributes;
it cannot trace ``contextvars``).

Regions must therefore nest on a thread. Asyncio tasks that enter autocast and await inside it
interleave their regions on one thread; an eager exit that finds another region's frame above
its own (entered later, still active) removes only its own frame and raises ``RuntimeError``,
instead of dropping the other region's frame (whose modules would then run under the wrong
recipe). Give each such task its own thread, or enter autocast outside the tasks.

The default recipe is :class:`Float8CurrentScaling` (stateless, runs everywhere); it is never
the stateful ``DelayedScaling``. ``DelayedScaling`` is eager-only: entering an autocast with it
while ``torch.compile`` traces raises ``RuntimeError``.
"""

from __future__ import annotations

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
    """Per thread: ``stack``, the frames of the active autocast regions (outermost first), and
    ``region``, the delayed-scaling bookkeeping of the active outermost region (eager only).

    Both exist from a thread's first access on, so a graph compiled before any eager autocast
    ran does not guard on their absence (and recompile once they appear).
    """

    def __init__(self) -> None:
        self.stack: list[Frame] = []
        self.region: list[Region] = []


_LOCAL = _ThreadState()
_DEFAULT: list[Recipe] = []


def _stack() -> list[Frame]:
    return _LOCAL.stack


def _region() -> list[Region]:
    return _LOCAL.region


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
    """The innermost active frame of this thread, or ``None`` outside every autocast."""
    stack = _stack()
    return stack[-1] if stack else None


def current_region() -> Region | None:
    region = _region()
    return region[-1] if region else None


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
    An instance can be active once at a time; nest new instances. The state is per thread.
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
        depth = len(stack)
        frame = Frame(bool(self.enabled), recipe, bool(self.calibrating),
                      self.amax_reduction_group)
        stack.append(frame)
        self._depth = depth
        self._frame = frame
        if depth == 0 and not compiling():
            region = _region()
            region.clear()
            region.append(Region())
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        depth = self._depth
        self._depth = -1
        stack = _stack()
        if not compiling():  # find the frame itself: an earlier out-of-order exit shifts depths
            depth = _position(stack, self._frame, depth)
            if depth < len(stack) - 1:
                _exit_out_of_order(stack, depth)
        del stack[depth:]
        if depth == 0 and not compiling():
            regions = _region()
            region = regions.pop() if regions else None
            if (
                region is not None
                and exc_type is None
                and self.enabled
                and torch.is_grad_enabled()
            ):
                update_registered(region.forward)


def _position(stack: list[Frame], frame: Frame | None, depth: int) -> int:
    """Where ``frame`` is in ``stack``, by identity (equal frames are distinct regions); the
    depth at entry when it is gone."""
    for i in range(len(stack) - 1, -1, -1):
        if stack[i] is frame:
            return i
    return min(depth, len(stack))


def _exit_out_of_order(stack: list[Frame], depth: int) -> None:
    """An exit with other regions' frames above its own (at ``depth``): remove only its own
    frame and raise, leaving the later regions active."""
    del stack[depth]
    raise RuntimeError(
        "quant_recipes.autocast: this region exited while a region entered after it on the same "
        "thread was still active. autocast state is per thread (as torch.autocast's); asyncio "
        "tasks that enter autocast and await inside it interleave their regions, so modules of "
        "one task would run under another's recipe. Run such tasks in threads of their own, or "
        "enter autocast outside the tasks."
    )
