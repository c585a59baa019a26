"""Recipe states: a recipe turned into one quantizer per slot (`behaviour.md` §5, §9).

Every quantizer built here has ``internal=True``: the modules read buffers, so ``quantize``
returns the plain storage and pays for no tensor wrapper. Slot layout: forward ``[input, weight,
output]`` per GEMM, backward ``[grad_output, grad_input]`` per GEMM. ``roles`` (one per slot,
entries may be ``None``) select the quantizer of a slot; without a known ``tensor_type`` the
slot's position decides.
"""

from __future__ import annotations

import torch
from quant_core import (
    DType,
    Float8BlockQuantizer,
    Float8CurrentScalingQuantizer,
    Float8Quantizer,
    MXFP8Quantizer,
    NVFP4Quantizer,
    Quantizer,
)

from .compiling import compiling, dynamo, is_compiled_value
from .recipes import DelayedScalingRequest, Format, Recipe
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
        """The state class for ``recipe``'s kind (dispatch on the recipe predicates)."""
        if not isinstance(recipe, Recipe):
            raise TypeError(f"recipe must be a quant_recipes.Recipe, got {recipe!r}")
        for predicate, cls in _STATE_CLASSES:
            if getattr(recipe, predicate)():
                return cls(recipe, mode=mode, num_quantizers=num_quantizers, device=device,
                           roles=roles)
        raise TypeError(f"no recipe state for {type(recipe).__name__}")

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
        role = self.roles[i] if self.roles is not None else None
        if role is not None and role.tensor_type in KNOWN_TENSOR_TYPES:
            return role.tensor_type
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


def _dtype(fmt: Format, forward: bool) -> DType:
    return fmt.fwd_dtype if forward else fmt.bwd_dtype


def _default_device(device):
    return torch.device(device) if device is not None else torch.device("cpu")


class DelayedScalingRecipeState(RecipeState):
    """``scale = ones(n)``, ``amax_history = zeros(L, n)``; slot i is a ``Float8Quantizer``
    viewing ``scale[i]`` and ``amax_history[0][i]``."""

    _persistent_state_buffers = ("scale", "amax_history")

    def __init__(self, recipe, **kwargs) -> None:
        super().__init__(recipe, **kwargs)
        dev = _default_device(self.device)
        self.dtype = _dtype(recipe.fp8_format, self.forward)
        self.scale = torch.ones(self.num_quantizers, dtype=torch.float32, device=dev)
        self.amax_history = torch.zeros(
            recipe.amax_history_len, self.num_quantizers, dtype=torch.float32, device=dev
        )

    @property
    def has_delayed_scaling(self) -> bool:
        return True

    @property
    def fp8_max(self) -> float:
        return self.dtype.max

    def _make(self, i: int) -> Quantizer:
        return Float8Quantizer(self.scale[i], self.amax_history[0][i].view(1), self.dtype,
                               internal=True)


class Float8CurrentScalingRecipeState(RecipeState):
    """``Float8CurrentScalingQuantizer`` per slot, settings from the tensor class's QParams."""

    def _make(self, i: int) -> Quantizer:
        r = self.recipe
        kind = self._slot_tensor_type(i)
        qp = {"weight": r.fp8_quant_fwd_weight}.get(kind, r.fp8_quant_fwd_inp)
        if not self.forward:
            qp = r.fp8_quant_bwd_grad
        return Float8CurrentScalingQuantizer(
            _dtype(r.fp8_format, self.forward), force_pow_2_scales=qp.power_2_scale,
            amax_epsilon=qp.amax_epsilon, internal=True,
        )


class MXFP8BlockScalingRecipeState(RecipeState):
    """``MXFP8Quantizer`` per slot; 2D blocks only for linear weights in forward."""

    def _make(self, i: int) -> Quantizer:
        r = self.recipe
        role = self._slot_role(i)
        two_d = (
            r.enable_2d_quantization
            and self.forward
            and role.module_type in ("linear", "grouped_linear")
            and role.tensor_type == "weight"
        )
        return MXFP8Quantizer(_dtype(r.fp8_format, self.forward), with_2d_quantization=two_d,
                              internal=True)


class Float8BlockScalingRecipeState(RecipeState):
    """Role dispatch: weight -> ``w_block_scaling_dim``; gradients -> ``grad_block_scaling_dim``
    (backward dtype); anything else -> ``x_block_scaling_dim``."""

    def _make(self, i: int) -> Quantizer:
        r = self.recipe
        kind = self._slot_tensor_type(i)
        if kind in ("grad_output", "grad_input"):
            qp, dim, fwd = r.fp8_quant_bwd_grad, r.grad_block_scaling_dim, False
        elif kind == "weight":
            qp, dim, fwd = r.fp8_quant_fwd_weight, r.w_block_scaling_dim, True
        else:
            qp, dim, fwd = r.fp8_quant_fwd_inp, r.x_block_scaling_dim, True
        return Float8BlockQuantizer(
            _dtype(r.fp8_format, fwd), block_scaling_dim=dim, amax_epsilon=qp.amax_epsilon,
            force_pow_2_scales=qp.power_2_scale, internal=True,
        )


class NVFP4BlockScalingRecipeState(RecipeState):
    """Role dispatch on the fp4 QParams (the recipe refuses row scaling and 4over6 at
    construction, so every slot is plain NVFP4)."""

    def _make(self, i: int) -> Quantizer:
        r = self.recipe
        kind = self._slot_tensor_type(i)
        qp = r.fp4_quant_bwd_grad if kind in ("grad_output", "grad_input") else (
            r.fp4_quant_fwd_weight if kind == "weight" else r.fp4_quant_fwd_inp
        )
        return NVFP4Quantizer(
            DType.E2M1, with_rht=qp.random_hadamard_transform,
            with_post_rht_amax=qp.random_hadamard_transform,
            with_2d_quantization=qp.fp4_2d_quantization,
            stochastic_rounding=qp.stochastic_rounding,
            nvfp4_4over6_err_mode=r.nvfp4_4over6_err_mode, internal=True,
        )


def _is_quantizer(q) -> bool:
    """``isinstance(q, Quantizer)``, also for the opaque wrapper torch 2.11 traces a prebuilt
    value quantizer as (``isinstance`` is False there; quant-dynamo's registry knows it)."""
    if isinstance(q, Quantizer):
        return True
    if compiling():
        return is_compiled_value(q)
    return False


def _check_compilable(q: Quantizer, slot: str) -> None:
    """Under torch.compile: a factory's quantizer must be a registered value quantizer; say why
    not (stateful delayed scaling, or a subclass that did not opt in) before tracing trips."""
    if not is_compiled_value(q):
        why = dynamo().registration.identity_quantizer_message(type(q))
        raise TypeError(
            f"CustomRecipe.qfactory returned {type(q).__name__} for {slot} under "
            f"torch.compile: {why}"
        )


class CustomRecipeState(RecipeState):
    """Quantizers from ``recipe.qfactory(role)``, called once per slot with that slot's role
    (``None`` for a slot without one). Delayed-scaling requests share one inner
    :class:`DelayedScalingRecipeState`."""

    def __init__(self, recipe, **kwargs) -> None:
        super().__init__(recipe, **kwargs)
        self._inherited_inner: DelayedScalingRecipeState | None = None
        self._inner: DelayedScalingRecipeState | None = None

    def make_quantizers(self) -> list[Quantizer]:
        roles = self.roles if self.roles is not None else (QuantizerRole(),) * self.num_quantizers
        raw = [self.recipe.qfactory(roles[i]) for i in range(self.num_quantizers)]
        for i, q in enumerate(raw):
            # the role as its str(): a dataclass repr cannot be traced by Dynamo, and the
            # message must survive tracing intact (it is what a compiled caller sees)
            slot = f"slot {i} (role {str(roles[i])!r})"
            if q is None:
                raise ValueError(
                    f"CustomRecipe.qfactory returned None for {slot}; "
                    "return quant_recipes.IdentityQuantizer() to keep a tensor in high precision"
                )
            if not (isinstance(q, DelayedScalingRequest) or _is_quantizer(q)):
                raise TypeError(
                    f"CustomRecipe.qfactory must return a Quantizer or a DelayedScalingRequest, "
                    f"got {type(q).__name__} for {slot}"
                )
            if compiling() and isinstance(q, Quantizer):
                _check_compilable(q, slot)
        requests = [i for i, q in enumerate(raw) if isinstance(q, DelayedScalingRequest)]
        if not requests:
            return raw
        if compiling():
            raise RuntimeError(
                "a CustomRecipe qfactory returned a DelayedScalingRequest under torch.compile: "
                "delayed scaling holds live tensor state and runs in eager mode only"
            )
        first = raw[requests[0]]
        for i in requests[1:]:
            if raw[i] != first:
                raise ValueError(
                    "every DelayedScalingRequest of one recipe state must have identical "
                    f"parameters; slot {requests[0]} has {first}, slot {i} has {raw[i]}"
                )
        inner_recipe = first.to_recipe()
        old = self._inherited_inner
        if (
            old is not None
            and old.num_quantizers == len(requests)
            and old.recipe == inner_recipe
            and old.mode == self.mode
        ):
            inner = old
        else:
            inner = DelayedScalingRecipeState(
                inner_recipe, mode=self.mode, num_quantizers=len(requests), device=self.device
            )
            inner.inherit_state_from(old)
        self._inner = inner
        delayed = inner.make_quantizers()
        for j, i in enumerate(requests):
            raw[i] = delayed[j]
        return raw

    def inherit_state_from(self, old: RecipeState | None) -> None:
        """Keep the predecessor's inner delayed-scaling state for :meth:`make_quantizers`."""
        if isinstance(old, CustomRecipeState):
            self._inherited_inner = old._inner or old._inherited_inner
        elif isinstance(old, DelayedScalingRecipeState):
            self._inherited_inner = old

    @property
    def has_delayed_scaling(self) -> bool:
        return self._inner is not None

    _has_delayed_scaling = has_delayed_scaling

    @property
    def inner_delayed_scaling_state(self) -> DelayedScalingRecipeState | None:
        return self._inner

    @property
    def _inner_delayed_scaling_recipe(self):
        return None if self._inner is None else self._inner.recipe

    @property
    def scale(self) -> torch.Tensor | None:
        return None if self._inner is None else self._inner.scale

    @property
    def amax_history(self) -> torch.Tensor | None:
        return None if self._inner is None else self._inner.amax_history

    @property
    def quantization_alignment(self) -> int:
        return self.recipe.quantization_alignment


def delayed_states(state: RecipeState | None) -> list[DelayedScalingRecipeState]:
    """The delayed-scaling state(s) behind ``state`` (itself or a CustomRecipe's inner one)."""
    if isinstance(state, DelayedScalingRecipeState):
        return [state]
    if isinstance(state, CustomRecipeState) and state._inner is not None:
        return [state._inner]
    return []


_STATE_CLASSES = (
    ("delayed", DelayedScalingRecipeState),
    ("float8_current_scaling", Float8CurrentScalingRecipeState),
    ("mxfp8", MXFP8BlockScalingRecipeState),
    ("float8_block_scaling", Float8BlockScalingRecipeState),
    ("nvfp4", NVFP4BlockScalingRecipeState),
    ("custom", CustomRecipeState),
)
