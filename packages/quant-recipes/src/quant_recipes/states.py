"""Recipe states: a recipe turned into one quantizer per slot (`behaviour.md` §5, §9). This
module holds the base; each recipe module (:mod:`quant_recipes.recipes`) holds its recipe's state.

Every quantizer built here has ``internal=True``: the modules read buffers, so ``quantize``
returns the plain storage and pays for no tensor wrapper. Slot layout: forward ``[input, weight,
output]`` per GEMM, backward ``[grad_output, grad_input]`` per GEMM. ``roles`` (one per slot,
entries may be ``None``) select the quantizer of a slot; without a known ``tensor_type`` the
slot's position decides.
"""

from __future__ import annotations

import torch
from quant_core import DType, Quantizer

from .recipe import Format, Recipe
from .role import BACKWARD_SLOT_TYPES, FORWARD_SLOT_TYPES, KNOWN_TENSOR_TYPES, QuantizerRole

_MODES = ("forward", "backward")


class RecipeState:
    """Per-slot quantizers of one recipe for one direction of one module."""

    #: Attributes holding tensors that survive a rebuild (:meth:`inherit_state_from`).
    _persistent_state_buffers: tuple[str, ...] = ()

    def __init__(self, recipe: Recipe, *, mode: str, num_quantizers: int, device=None,
                 roles=None) -> None:
        if mode not in _MODES:
            raise ValueError(f"mode must be 'forward' or 'backward', got {mode!r}")
        if isinstance(num_quantizers, bool) or not isinstance(num_quantizers, int) or (
            num_quantizers < 1
        ):
            raise ValueError(f"num_quantizers must be an int >= 1, got {num_quantizers!r}")
        if roles is not None:
            roles = tuple(roles)
            if len(roles) != num_quantizers:
                raise ValueError(
                    f"roles has {len(roles)} entries but num_quantizers is {num_quantizers}"
                )
            for r in roles:
                if r is not None and not isinstance(r, QuantizerRole):
                    raise TypeError(f"roles entries must be QuantizerRole or None, got {r!r}")
        self.recipe = recipe
        self.mode = mode
        self.num_quantizers = num_quantizers
        self.device = device
        self.roles = roles

    @staticmethod
    def create(recipe: Recipe, *, mode: str = "forward", num_quantizers: int = 1, device=None,
               roles=None) -> RecipeState:
        """The state of ``recipe`` (its class's ``state_class``)."""
        if not isinstance(recipe, Recipe):
            raise TypeError(f"recipe must be a quant_recipes.Recipe, got {recipe!r}")
        cls = type(recipe).state_class
        if cls is None:
            raise TypeError(f"no recipe state for {type(recipe).__name__} (a Recipe subclass "
                            "names its RecipeState subclass as state_class)")
        if cls.__new__ is not object.__new__:
            return cls(recipe, mode=mode, num_quantizers=num_quantizers, device=device,
                       roles=roles)
        # cls(...) spelled out: the same object, and Dynamo traces these two calls in about half
        # the instructions of a user class's construction
        state = object.__new__(cls)
        state.__init__(recipe, mode=mode, num_quantizers=num_quantizers, device=device,
                       roles=roles)
        return state

    @property
    def forward(self) -> bool:
        return self.mode == "forward"

    def _slot_role(self, i: int) -> QuantizerRole:
        """The role given for slot ``i`` (the same object), else a bare ``QuantizerRole()``."""
        if self.roles is not None and self.roles[i] is not None:
            return self.roles[i]
        return QuantizerRole()

    def _slot_tensor_type(self, i: int) -> str:
        """The slot's known ``tensor_type``, else its positional type."""
        roles = self.roles
        role = None if roles is None else roles[i]
        if role is not None:
            tensor_type = role.tensor_type
            if tensor_type in KNOWN_TENSOR_TYPES:
                return tensor_type
        types = FORWARD_SLOT_TYPES if self.forward else BACKWARD_SLOT_TYPES
        return types[i % len(types)]

    def make_quantizers(self) -> list[Quantizer]:
        """One quantizer per slot."""
        return [self._make(i) for i in range(self.num_quantizers)]

    def _make(self, i: int) -> Quantizer:
        raise NotImplementedError

    def inherit_state_from(self, old: RecipeState | None) -> None:
        """Rebind persistent buffers of ``old`` whose type, shape and dtype match (same objects)."""
        if old is None:
            return
        for name in self._persistent_state_buffers:
            mine, theirs = getattr(self, name, None), getattr(old, name, None)
            if (
                isinstance(mine, torch.Tensor)
                and isinstance(theirs, torch.Tensor)
                and mine.shape == theirs.shape
                and mine.dtype == theirs.dtype
            ):
                setattr(self, name, theirs)

    @property
    def has_delayed_scaling(self) -> bool:
        return False

    def delayed_states(self) -> list[RecipeState]:
        """The delayed-scaling state(s) behind this one (itself, or a CustomRecipe's inner
        one): what the amax-history update after a step visits."""
        return []


def element_dtype(fmt: Format, forward: bool) -> DType:
    return fmt.fwd_dtype if forward else fmt.bwd_dtype


def default_device(device):
    return torch.device(device) if device is not None else torch.device("cpu")




def delayed_states(state: RecipeState | None) -> list[RecipeState]:
    """The delayed-scaling state(s) behind ``state`` (:meth:`RecipeState.delayed_states`)."""
    return [] if state is None else state.delayed_states()
