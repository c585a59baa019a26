"""Hugging Face ``transformers`` mixture-of-experts blocks on quant's grouped GEMMs.

``transformers`` (5.x) stores the experts of an MoE layer (Mixtral, Qwen2/3-MoE, OLMoE,
DeepSeek-V3 and most others) in one module whose class it decorates with
``use_experts_implementation``: 3-D parameters ``gate_up_proj [E, 2I, H]`` (or ``up_proj [E, I,
H]`` without a gate) and ``down_proj [E, H, I]``, optional biases ``*_bias [E, N]``, and
``forward(hidden_states [T, H], top_k_index [T, k], top_k_weights [T, k])``. Those weights are
laid out as :class:`~quant_recipes.GroupedLinear` lays out its own (``[experts, out, in]``), or
transposed (``[experts, in, out]``, GPT-OSS), which the projections read as a transposed view.

:func:`quantize_experts` turns such a module, in place, into one whose two projections run as
quant's grouped GEMMs (:class:`~quant_recipes.moe.linear.GroupedProjection`, named
``<fqn>.gate_up_proj`` / ``<fqn>.up_proj`` and ``<fqn>.down_proj`` for the recipe's roles): its
class becomes a subclass of the original one (``isinstance`` checks still hold), its Parameters
and ``state_dict`` keys are unchanged. The forward sorts the ``T * k`` (token, expert) pairs by
expert (stable: token order within an expert), runs gate/up, the module's own gate (which knows
whether gate and up are concatenated or interleaved) or activation, down, the post-expert norm
where the module has one, and sums each token's ``k`` rows weighted by the router
(:func:`~.routes.combine_routes`). :func:`restore_experts` undoes it.

Left as they are (:func:`unsupported_reason`): expert-parallel modules (their sentinel rows).
"""

from __future__ import annotations

import torch

from ..compiling import compiling
from .gemm import check_on_device
from .linear import GroupedProjection
from .routes import combine_routes, route

#: quant's subclass of each Hugging Face experts class, built on first use.
_QUANTIZED: dict[type, type] = {}


def _up_name(m: torch.nn.Module) -> str:
    return "gate_up_proj" if getattr(m, "has_gate", True) else "up_proj"


def _is_expert_weight(p) -> bool:
    return isinstance(p, torch.nn.Parameter) and p.dim() == 3


def is_hf_experts(m: torch.nn.Module) -> bool:
    """A ``transformers`` experts module (``use_experts_implementation``), not yet converted."""
    return (type(m).__module__.startswith("transformers")
            and hasattr(m, "is_concatenated") and hasattr(m, "is_transposed")
            and _is_expert_weight(getattr(m, _up_name(m), None))
            and _is_expert_weight(getattr(m, "down_proj", None)))


def is_quantized_experts(m: torch.nn.Module) -> bool:
    return isinstance(m, _QuantizedExperts)


def unsupported_reason(m: torch.nn.Module) -> str | None:
    """Why :func:`quantize_experts` leaves the experts module ``m`` as it is, or None."""
    if getattr(m, "_is_expert_parallel", False):
        return "expert-parallel transformers experts are not supported"
    return None


def projection_shapes(m: torch.nn.Module) -> dict[str, tuple[int, int]]:
    """``{parameter name: (in_features, out_features)}`` of the two projections."""
    return {name: tuple(projection_weight(m, name).shape[:0:-1])
            for name in (_up_name(m), "down_proj")}


def projections(m: torch.nn.Module) -> tuple[tuple[GroupedProjection, str], ...]:
    """``(projection, its Parameter's name)`` of a converted experts module's two projections."""
    return (m._quant_up, _up_name(m)), (m._quant_down, "down_proj")


def projection_weight(m: torch.nn.Module, name: str) -> torch.Tensor:
    """Parameter ``name`` as ``[experts, out, in]`` (a transposed view where it is stored
    ``[experts, in, out]``)."""
    w = getattr(m, name)
    return w.transpose(1, 2) if m.is_transposed else w


def quantize_experts(m: torch.nn.Module, fqn: str, bound_recipe=None) -> torch.nn.Module:
    """Turn the experts module ``m`` (named ``fqn`` in its model) into quant's grouped form, in
    place; ``bound_recipe`` quantizes outside autocast (``convert(always_quantize=True)``).
    Returns ``m``."""
    num_experts = getattr(m, _up_name(m)).shape[0]
    projections = {}
    for attr, name in (("_quant_up", _up_name(m)), ("_quant_down", "down_proj")):
        k, n = projection_shapes(m)[name]
        projections[attr] = GroupedProjection(num_experts, k, n, name=f"{fqn}.{name}")
        projections[attr].bound_recipe = bound_recipe
    m.__class__ = _quantized_class(type(m))  # only once nothing else can raise
    for attr, proj in projections.items():
        setattr(m, attr, proj)
    return m


def restore_experts(m: torch.nn.Module) -> torch.nn.Module:
    """The original ``transformers`` experts module again (same Parameters). Returns ``m``."""
    del m._quant_up, m._quant_down
    m.__class__ = m.hf_class
    return m


def _quantized_class(hf_class: type) -> type:
    if hf_class not in _QUANTIZED:
        _QUANTIZED[hf_class] = type(f"Quantized{hf_class.__name__}",
                                    (_QuantizedExperts, hf_class),
                                    {"__module__": __name__, "hf_class": hf_class})
    return _QUANTIZED[hf_class]


def _rebuild(hf_class: type, state: dict) -> torch.nn.Module:
    """Unpickling and ``deepcopy``: a quantized experts module of ``hf_class`` with ``state``
    (the subclass is built at run time, so pickle cannot name it)."""
    m = object.__new__(_quantized_class(hf_class))
    m.__setstate__(state)
    return m


def _check_ids(ids: torch.Tensor, num_experts: int, who: str) -> None:
    """Expert ids in ``[0, num_experts)`` (:func:`~.gemm.check_on_device`)."""
    check_on_device((ids >= 0) & (ids < num_experts), lambda: (
        f"{who}: top_k_index must hold expert ids in [0, {num_experts}), got "
        f"{ids.min().item()}..{ids.max().item()}"))


class _QuantizedExperts:
    """The forward of a converted ``transformers`` experts module (mixed in first)."""

    #: The ``transformers`` class this one extends.
    hf_class: type

    def __reduce_ex__(self, protocol):
        return _rebuild, (self.hf_class, self.__dict__.copy())

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor,
                top_k_weights: torch.Tensor) -> torch.Tensor:
        num_experts = self._quant_up.num_experts
        if not compiling():
            _check_ids(top_k_index, num_experts, type(self).__name__)
        sorted_ids, routes = route(top_k_index)
        experts = torch.arange(num_experts, device=sorted_ids.device, dtype=sorted_ids.dtype)
        offs = torch.searchsorted(sorted_ids, experts, right=True)
        up_name = _up_name(self)
        bias = getattr(self, f"{up_name}_bias", None) if self.has_bias else None
        w = projection_weight(self, up_name)
        self._quant_up.check_input(hidden_states, w)  # offs are right by construction
        layouts = {}  # the two projections run over the same rows: one padded layout
        # the routed rows are hidden_states[routes.rows]: the grouped quantize reads them there
        h = self._quant_up.project(hidden_states, offs, w, bias, layouts, routes,
                                   param=getattr(self, up_name))
        h = self._apply_gate(h) if self.has_gate else self.act_fn(h)
        bias = getattr(self, "down_proj_bias", None) if self.has_bias else None
        y = self._quant_down.project(h, offs, projection_weight(self, "down_proj"), bias, layouts,
                                     param=self.down_proj)
        if getattr(self, "has_post_expert_norm", False):
            y = self.post_expert_norm(y)
        return combine_routes(y, top_k_weights.to(y.dtype), routes).to(hidden_states.dtype)
