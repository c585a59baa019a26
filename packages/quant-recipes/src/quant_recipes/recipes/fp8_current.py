"""FP8 current scaling: per-tensor FP8 with the scale from each tensor's own amax."""

from __future__ import annotations

from dataclasses import dataclass, field

from quant_core import Float8CurrentScalingQuantizer, Quantizer

from ..recipe import (
    FP8_QPARAM_FIELDS,
    NO_SPLIT,
    SPLIT,
    Format,
    MMParams,
    QParams,
    Recipe,
    check_common,
    env_backward_override,
    env_flag,
    fill_unset,
)
from ..states import RecipeState, element_dtype


class Float8CurrentScalingRecipeState(RecipeState):
    """``Float8CurrentScalingQuantizer`` per slot, settings from the tensor class's QParams."""

    def _make(self, i: int) -> Quantizer:
        r = self.recipe
        kind = self._slot_tensor_type(i)
        qp = {"weight": r.fp8_quant_fwd_weight}.get(kind, r.fp8_quant_fwd_inp)
        if not self.forward:
            qp = r.fp8_quant_bwd_grad
        return Float8CurrentScalingQuantizer(
            element_dtype(r.fp8_format, self.forward), force_pow_2_scales=qp.power_2_scale,
            amax_epsilon=qp.amax_epsilon, internal=True,
        )


@dataclass(frozen=True)
class Float8CurrentScaling(Recipe):
    """Per-tensor FP8 with the scale from each tensor's own amax.

    ``fp8_quant_fwd_inp`` / ``_fwd_weight`` / ``_bwd_grad`` default to
    ``QParams(power_2_scale=use_power_2_scales)``; their ``power_2_scale`` and ``amax_epsilon``
    are what the quantizers use (TE ignores ``amax_epsilon``; with the defaults both agree).
    """

    #: Round every scale down to a power of two (``NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES``).
    use_power_2_scales: bool = field(
        default_factory=env_flag("NVTE_FP8_CURRENT_SCALING_POWER_2_SCALES")
    )
    fp8_format: Format = Format.HYBRID
    fp8_quant_fwd_inp: QParams | None = None
    fp8_quant_fwd_weight: QParams | None = None
    fp8_quant_bwd_grad: QParams | None = None
    fp8_gemm_fprop: MMParams = field(default_factory=lambda: NO_SPLIT)
    fp8_gemm_dgrad: MMParams = field(default_factory=lambda: SPLIT)
    fp8_gemm_wgrad: MMParams = field(default_factory=lambda: SPLIT)
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: str | None = field(default_factory=env_backward_override)

    def __post_init__(self) -> None:
        check_common(self)
        if self.fp8_format is Format.E2M1:
            raise ValueError("Float8CurrentScaling.fp8_format must be an FP8 format, got E2M1")
        pow2 = self.use_power_2_scales
        fill_unset(self, {name: QParams(power_2_scale=pow2) for name in FP8_QPARAM_FIELDS})

    state_class = Float8CurrentScalingRecipeState

    def float8_current_scaling(self) -> bool:
        return True

    def float8_per_tensor_scaling(self) -> bool:
        return True
