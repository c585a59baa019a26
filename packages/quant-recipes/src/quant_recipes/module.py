"""``QuantizedModule``: how a module gets its quantizers (`behaviour.md` §8, §9.1).

Eager: quantizers are cached on ``(recipe key, roles, num_gemms, device)``, where the recipe key
is the recipe value for built-in recipes, and for a ``CustomRecipe`` its factory's semantic key
(:func:`~quant_recipes.quantizer_factory`) or else the recipe *instance*. They are rebuilt exactly
when that key changes; a rebuild inherits delayed-scaling buffers (same tensor objects) from the
previous state. Value quantizers are interned (one object per value), so compiled-code guards
hit the identity fast path.

Under ``torch.compile`` the quantizers are a pure function of the active recipe and the roles,
so they are built at trace time and baked into the graph as constants; the cache is not touched
(it would otherwise be a guarded, mutated attribute that forces recompiles).
"""

from __future__ import annotations

import weakref
from typing import Any

import torch
from quant_core import Quantizer, is_value_quantizer

from . import delayed_checkpoint
from .autocast import Frame, current_frame
from .checkpointing import in_backward
from .compiling import (
    DERIVES_IN_GRAPH,
    compiling,
    dynamo,
    is_compiled_value,
    raise_error,
    trace_time_constant,
)
from .recipe import BUILT_HOOKS, LINEAR_SLOTS
from .recipe_names import as_recipe
from .recipes import Recipe
from .role import QuantizerRole
from .states import RecipeState, delayed_states

#: One object per quantizer value (eager interning).
_INTERN: dict[Quantizer, Quantizer] = {}
#: Per module: the autocast frame of its last forward outside backward (eager), for the
#: activation-checkpoint recompute. Kept beside the module (not on it) so deepcopy, pickle and
#: state_dict never see a frame's process group.
_FORWARD_FRAMES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def module_frame(module: torch.nn.Module) -> Frame | None:
    """The frame ``module`` runs under: the active one; but for a forward run by the autograd
    engine during backward (an activation-checkpoint recompute), the frame of the module's own
    last eager forward, whatever region backward runs in (`behaviour.md` §7): ``None`` when
    that forward was outside every region or under ``enabled=False``. Eager forwards outside
    backward record their frame for that purpose."""
    frame = current_frame()
    if frame is None:  # outside every autocast: a bound recipe
        frame = getattr(module, "_bound_frame", None)
    elif not (frame.enabled or frame.calibrating):  # an enabled=False region: none
        frame = None
    if compiling():
        return frame
    if in_backward():
        return _FORWARD_FRAMES.get(module, frame)
    _FORWARD_FRAMES[module] = frame
    return frame


def intern(q: Quantizer) -> Quantizer:
    """The canonical object equal to value quantizer ``q`` (``q`` itself for others)."""
    if compiling() or not is_value_quantizer(q):
        return q
    return _INTERN.setdefault(q, q)


def recipe_key(recipe: Recipe) -> tuple:
    """Cache key of a recipe: its value, or a CustomRecipe's factory key / instance identity."""
    if recipe.custom():
        fkey = recipe.qfactory_key
        if fkey is not None:
            return ("factory", fkey, recipe.fp8_format, recipe.quantization_alignment)
        return ("instance", id(recipe))
    return ("value", recipe)


class QuantizerSet:
    """The quantizers of one cache entry, with interned usage variants."""

    __slots__ = ("key", "recipe", "fwd_state", "bwd_state", "fwd", "bwd", "_variants")

    def __init__(self, key, recipe, fwd_state, bwd_state, fwd, bwd) -> None:
        self.key = key
        self.recipe = recipe  # keeps a keyed-by-id CustomRecipe alive
        self.fwd_state = fwd_state
        self.bwd_state = bwd_state
        self.fwd = fwd if isinstance(fwd, LazySlots) else tuple(fwd)
        self.bwd = bwd if isinstance(bwd, LazySlots) else tuple(bwd)
        self._variants: dict[Any, Quantizer] = {}

    def variant(self, q: Quantizer, **fields: Any) -> Quantizer:
        """``q`` with ``fields`` changed (cached per ``(id(q), fields)``; value ones interned)."""
        if compiling():
            if not DERIVES_IN_GRAPH:
                # torch 2.10 cannot run a baked quantizer's methods at trace time: keep q. Only
                # usage flags differ under compile, and the GEMMs read the same buffers of the
                # full-usage quantizer, so outputs and gradients keep eager's bits.
                dynamo()  # without quant-dynamo: NEEDS_DYNAMO
                return q
            return derive(q, **fields)
        key = (id(q), tuple(sorted(fields.items())))
        v = self._variants.get(key)
        if v is None:
            v = intern(derive(q, **fields))
            self._variants[key] = v
        return v


@trace_time_constant
def derivation(q: Quantizer, fields: tuple) -> tuple[bool, bool, tuple]:
    """What :func:`derive` of ``q`` with ``fields`` (``(name, value)`` pairs) does, as plain
    data: ``(changed, by_replace, dropped)``: whether it gives another quantizer, whether
    through ``q.replace`` (a value quantizer) rather than ``q.derive``, and the names of the
    fields ``q`` lacks (derive drops them). A pure function of values, which compiled code bakes
    (:func:`~.compiling.trace_time_constant`): derive's body traced costs every layer call
    hundreds of traced instructions."""
    dropped = tuple(k for k, _ in fields if not hasattr(q, k))
    changed = any(getattr(q, k) != v for k, v in fields if k not in dropped)
    return changed, changed and is_value(q), dropped


def derive(q: Quantizer, **fields: Any) -> Quantizer:
    """A quantizer like ``q`` with ``fields`` changed; fields ``q`` lacks are dropped."""
    changed, by_replace, dropped = derivation(q, tuple(fields.items()))
    if not changed:
        return q
    if dropped:  # a new dict only where q lacks a field: building one costs a trace
        fields = {k: v for k, v in fields.items() if k not in dropped}
    return q.replace(**fields) if by_replace else q.derive(**fields)


#: The roles of the slots a dense Linear reads: forward input and weight, backward output
#: gradient (no built-in recipe's quantizer depends on a role's name or on the unread slots).
_LINEAR_FWD_ROLES = (QuantizerRole("linear", "input"), QuantizerRole("linear", "weight"), None)
_LINEAR_BWD_ROLES = (QuantizerRole("linear", "grad_output"), None)


def keep_linear_slots(recipe: Recipe) -> None:
    """Keep on a built-in ``recipe`` object the interned quantizers a dense Linear reads (a
    :class:`QuantizerSet` of its input, weight and output-gradient slots), made once per recipe
    object when it is built (``recipe.BUILT_HOOKS``), so that compiled code reads them instead
    of tracing the recipe states that make them: equal recipes give the same interned objects,
    so their graphs are shared. Not for a CustomRecipe (its factory may answer per role) or
    delayed scaling (live state); a recipe whose slots cannot be made is left to raise where a
    layer asks for them."""
    if recipe.custom() or recipe.delayed():
        return
    try:
        fwd = RecipeState.create(recipe, mode="forward", num_quantizers=3,
                                 roles=_LINEAR_FWD_ROLES)
        bwd = RecipeState.create(recipe, mode="backward", num_quantizers=2,
                                 roles=_LINEAR_BWD_ROLES)
        qset = QuantizerSet(recipe_key(recipe), recipe, None, None,
                            (intern(fwd._make(0)), intern(fwd._make(1))), (intern(bwd._make(0)),))
    except (TypeError, ValueError):
        return
    object.__setattr__(recipe, LINEAR_SLOTS, qset)


BUILT_HOOKS.append(keep_linear_slots)


def kept_linear_slots(module: QuantizedModule, roles_of: type, recipe: Recipe,
                      num_gemms: int) -> QuantizerSet | None:
    """The quantizers ``recipe`` keeps (:func:`keep_linear_slots`) for ``module``, a layer of
    one GEMM whose input, weight and output-gradient roles are class ``roles_of``'s own (a
    subclass that answers or precomputes other roles builds its own); None otherwise."""
    cls = type(module)
    if (num_gemms != 1 or cls.get_quantizer_roles is not roles_of.get_quantizer_roles
            or cls._roles_changed is not roles_of._roles_changed):
        return None
    return getattr(recipe, LINEAR_SLOTS, None)


class LazySlots:
    """A recipe state's quantizers, each made when first read (``slots[i]``, ``slots[a:b]``).
    While tracing, a layer reads three of a state's five slots, and every quantizer made is
    traced code: the others are never made."""

    __slots__ = ("_state", "_made")

    def __init__(self, state: RecipeState) -> None:
        self._state = state
        self._made: dict[int, Quantizer] = {}

    def __len__(self) -> int:
        return self._state.num_quantizers

    def __getitem__(self, i):
        if isinstance(i, slice):  # by hand: Dynamo before torch 2.13 cannot trace slice.indices
            n = len(self)
            start = 0 if i.start is None else (i.start + n if i.start < 0 else i.start)
            stop = n if i.stop is None else (i.stop + n if i.stop < 0 else min(i.stop, n))
            return tuple(self[j] for j in range(start, stop, 1 if i.step is None else i.step))
        if i < 0:
            i += self._state.num_quantizers
        q = self._made.get(i)
        if q is None:
            q = self._made[i] = self._state._make(i)
        return q

    def __iter__(self):
        return (self[i] for i in range(len(self)))


def is_value(q: Quantizer) -> bool:
    """Whether ``q`` has value semantics (while tracing: is a registered value quantizer)."""
    if compiling():  # only registered value quantizers compile
        return is_compiled_value(q)
    return is_value_quantizer(q)


def check_bindable(recipe: Recipe, who: str = "bound_recipe") -> None:
    """``TypeError``/``ValueError`` naming ``who`` unless ``recipe`` can be a module's bound
    recipe: a recipe without state that autocast's region exits update (not ``DelayedScaling``)."""
    if not isinstance(recipe, Recipe):
        raise TypeError(f"{who} must be a quant_recipes.Recipe, a recipe name or None, got "
                        f"{recipe!r}")
    if recipe.delayed():
        raise ValueError(f"{who}: DelayedScaling updates its scales when an autocast "
                         "region exits, so it needs autocast; bind a stateless recipe "
                         "(Float8CurrentScaling, ...) or use autocast")


def check_operands(module: torch.nn.Module, x: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None, quantized_weight: bool) -> None:
    """``RuntimeError`` naming the layer and both tensors where the quantized GEMM cannot take
    them, as ``nn.Linear`` refuses them: an input, weight and bias not on one device, or one that
    is not floating point. Floating dtypes may differ (unlike ``nn.Linear``): each operand is
    quantized from its own dtype and the output has the input's dtype (``torch.autocast``'s where
    it is on). Metadata only: no host sync, and static under ``torch.compile``."""
    # written out, not a loop over the three: Dynamo traces every iteration of a loop
    device = x.device
    if not x.is_floating_point():
        raise _not_floating(module, "input", x)
    if weight.device != device:
        raise _elsewhere(module, "weight", weight, device)
    if not (quantized_weight or weight.is_floating_point()):
        raise _not_floating(module, "weight", weight)
    if bias is not None:
        if bias.device != device:
            raise _elsewhere(module, "bias", bias, device)
        if not bias.is_floating_point():
            raise _not_floating(module, "bias", bias)


def _elsewhere(module: torch.nn.Module, what: str, t: torch.Tensor,
               device: torch.device) -> RuntimeError:
    return RuntimeError(f"{_label(module)}: input is on {device} but {what} on {t.device}; "
                        "move the module or the input so that both are on one device")


def _not_floating(module: torch.nn.Module, what: str, t: torch.Tensor) -> RuntimeError:
    return RuntimeError(f"{_label(module)}: the {what} is {t.dtype}; a quantized Linear takes "
                        "floating-point operands, as nn.Linear does")


def _label(module: torch.nn.Module) -> str:
    """How a message names ``module``: its class and, when it has one, its name."""
    name = getattr(module, "name", "")
    return f"{type(module).__name__} {name!r}" if name else type(module).__name__


class QuantizedModule(torch.nn.Module):
    """Base of modules that quantize their GEMM operands inside :func:`autocast`. It is
    cooperative: positional and other keyword arguments go to the next class in the MRO (the
    ``torch.nn`` module a subclass also is, such as ``nn.Linear``)."""

    def __init__(self, *args: Any, name: str = "", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.name = name
        self._output_quantizer_role: QuantizerRole | None = None
        self._grad_input_quantizer_role: QuantizerRole | None = None
        self._qset: QuantizerSet | None = None
        self.quantizer_builds = 0

    # -------------------------------------------------------------- bound recipe
    @property
    def bound_recipe(self) -> Recipe | None:
        """The recipe the module quantizes with outside every :func:`autocast` (``None``: high
        precision there, the default). An enclosing autocast still decides: its recipe, or
        ``enabled=False``."""
        frame = getattr(self, "_bound_frame", None)
        return None if frame is None else frame.recipe

    @bound_recipe.setter
    def bound_recipe(self, recipe: Recipe | str | None) -> None:
        """A recipe, its name (``"fp8_block"``, as :func:`~quant_recipes.recipe` takes it) or
        ``None``."""
        if isinstance(recipe, str):
            recipe = as_recipe(recipe, "bound_recipe")
        if recipe is not None:
            check_bindable(recipe)
        self._bound_frame = None if recipe is None else Frame(True, recipe, False, None)

    # -------------------------------------------------------------- roles
    def get_quantizer_roles(self, *, fwd: bool, num_quantizers: int):
        """One role (or ``None``) per slot; the base module has none (``None``)."""
        return None

    @property
    def output_quantizer_role(self) -> QuantizerRole | None:
        return self._output_quantizer_role

    @output_quantizer_role.setter
    def output_quantizer_role(self, role: QuantizerRole | None) -> None:
        if role != self._output_quantizer_role:
            self._output_quantizer_role = role
            self._roles_changed()

    @property
    def grad_input_quantizer_role(self) -> QuantizerRole | None:
        return self._grad_input_quantizer_role

    @grad_input_quantizer_role.setter
    def grad_input_quantizer_role(self, role: QuantizerRole | None) -> None:
        if role != self._grad_input_quantizer_role:
            self._grad_input_quantizer_role = role
            self._roles_changed()

    def _roles_changed(self) -> None:
        """Hook for subclasses that precompute their roles."""

    # -------------------------------------------------------------- quantizers
    def quantizers(self, frame: Frame, *, num_gemms: int = 1,
                   device: torch.device | None = None) -> QuantizerSet:
        """The forward and backward quantizers for ``frame``'s recipe."""
        recipe = frame.recipe
        if compiling():
            if recipe.delayed():
                raise_error(
                    RuntimeError,
                    "DelayedScaling is not supported under torch.compile (live amax/scale state); "
                    "use a stateless recipe such as Float8CurrentScaling",
                )
            qset = self._kept_slots(recipe, num_gemms)
            if qset is not None:
                return qset
        fwd_roles = self.get_quantizer_roles(fwd=True, num_quantizers=3 * num_gemms)
        bwd_roles = self.get_quantizer_roles(fwd=False, num_quantizers=2 * num_gemms)
        if compiling():
            return self._build(None, recipe, fwd_roles, bwd_roles, num_gemms, device, None)
        key = (recipe_key(recipe), fwd_roles, bwd_roles, num_gemms,
               device if recipe.delayed() or recipe.custom() else None)
        qset = self._qset
        if qset is not None and qset.key == key and (
            key[0][0] != "instance" or qset.recipe is recipe
        ):
            return qset
        qset = self._build(key, recipe, fwd_roles, bwd_roles, num_gemms, device, qset)
        self._qset = qset
        self.quantizer_builds += 1
        return qset

    def _kept_slots(self, recipe: Recipe, num_gemms: int) -> QuantizerSet | None:
        """While tracing: the quantizer set ``recipe`` keeps for this module's roles
        (:func:`keep_linear_slots`), or None to build one; the base module keeps none."""
        return None

    def _build(self, key, recipe, fwd_roles, bwd_roles, num_gemms, device, old) -> QuantizerSet:
        states = []
        quantizers = []
        for mode, n, roles in (("forward", 3 * num_gemms, fwd_roles),
                               ("backward", 2 * num_gemms, bwd_roles)):
            if roles is not None and len(roles) != n:
                raise ValueError(
                    f"{type(self).__name__}.get_quantizer_roles returned {len(roles)} roles for "
                    f"{n} {mode} slots"
                )
            state = RecipeState.create(recipe, mode=mode, num_quantizers=n, device=device,
                                       roles=roles)
            states.append(state)
            if key is None and not recipe.custom():
                # while tracing, a built-in recipe's slot is made when a layer first reads it
                # (a CustomRecipe's factory answers for every slot at once, as eagerly);
                # LazySlots(state) spelled out, which Dynamo traces in fewer instructions
                slots = object.__new__(LazySlots)
                slots.__init__(state)
                quantizers.append(slots)
                continue
            if old is not None:
                state.inherit_state_from(old.fwd_state if mode == "forward" else old.bwd_state)
            quantizers.append([intern(q) for q in state.make_quantizers()])
            delayed_checkpoint.apply_pending(self, mode, state)  # a delayed state loaded early
        qset = object.__new__(QuantizerSet)  # QuantizerSet(...), cheaper to trace
        qset.__init__(key, recipe, states[0], states[1], quantizers[0], quantizers[1])
        return qset

    # -------------------------------------------------------------- state_dict
    def _save_to_state_dict(self, destination, prefix, keep_vars) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        delayed_checkpoint.save(self, destination, prefix, keep_vars)

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                              unexpected_keys, error_msgs) -> None:
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs)
        delayed_checkpoint.load(self, state_dict, prefix, unexpected_keys, error_msgs)

    def delayed_states(self, qset: QuantizerSet):
        """``(forward, backward)`` delayed-scaling states behind ``qset`` (eager)."""
        return delayed_states(qset.fwd_state), delayed_states(qset.bwd_state)
