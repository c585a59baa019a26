"""NVFP4: E2M1 elements with E4M3 block scales, RHT and stochastic rounding of gradients."""

from __future__ import annotations

from dataclasses import dataclass, field

from quant_core import DType, NVFP4Quantizer, Quantizer

from ..recipe import (
    Format,
    QParams,
    Recipe,
    check_common,
    env_backward_override,
    env_flag,
    fill_unset,
)
from ..states import RecipeState

_4OVER6_SCOPES = ("none", "weights", "activations", "all")
_GRADIENTS = ("grad_output", "grad_input")


def _in_scope(scope: str, kind: str) -> bool:
    """Whether a non-gradient slot of ``kind`` falls in a 4over6 scope."""
    return {"none": False, "all": True, "weights": kind == "weight",
            "activations": kind != "weight"}[scope]


class NVFP4BlockScalingRecipeState(RecipeState):
    """Role dispatch on the fp4 QParams; 4over6 on the non-gradient slots its scope selects
    (``nvfp4_4over6``), under the 256 bound where ``nvfp4_4over6_e4m3_use_256`` selects them
    too. A 4over6 slot whose QParams ask for RHT or stochastic rounding is refused, as in
    TransformerEngine. With ``row_scaled_activation`` the forward non-weight slots are
    row-scaled and rowwise only."""

    def _make(self, i: int) -> Quantizer:
        r = self.recipe
        kind = self._slot_tensor_type(i)
        qp = r.fp4_quant_bwd_grad if kind in _GRADIENTS else (
            r.fp4_quant_fwd_weight if kind == "weight" else r.fp4_quant_fwd_inp
        )
        four_over_six = kind not in _GRADIENTS and _in_scope(r.nvfp4_4over6, kind)
        if four_over_six and (qp.random_hadamard_transform or qp.stochastic_rounding):
            raise ValueError(
                f"NVFP4BlockScaling(nvfp4_4over6={r.nvfp4_4over6!r}): the {kind} slot uses "
                "RHT or stochastic rounding, which 4over6 does not support (disable_rht=True, "
                "or a scope that leaves it out)"
            )
        bound = 256 if four_over_six and _in_scope(r.nvfp4_4over6_e4m3_use_256, kind) else 448
        row_scaled = r.row_scaled_activation and kind not in (*_GRADIENTS, "weight")
        return NVFP4Quantizer(
            DType.E2M1, with_rht=qp.random_hadamard_transform,
            with_post_rht_amax=qp.random_hadamard_transform,
            with_2d_quantization=qp.fp4_2d_quantization,
            stochastic_rounding=qp.stochastic_rounding, nvfp4_use_4over6=four_over_six,
            nvfp4_e4m3_max=bound, nvfp4_4over6_err_mode=r.nvfp4_4over6_err_mode,
            row_scaled_nvfp4=row_scaled, columnwise_usage=not row_scaled, internal=True,
        )


@dataclass(frozen=True)
class NVFP4BlockScaling(Recipe):
    """NVFP4: E2M1 elements with E4M3 1x16 block scales (16x16 for weights in 2D mode), RHT on
    the columnwise input and gradient, stochastic rounding of gradients.

    ``fp4_quant_*`` default to: input ``QParams(random_hadamard_transform=not disable_rht)``,
    weight ``QParams(fp4_2d_quantization=not disable_2d_quantization)``, gradient
    ``QParams(random_hadamard_transform=not disable_rht,
    stochastic_rounding=not disable_stochastic_rounding)``.
    """

    #: No Random Hadamard Transform on the columnwise input and gradient.
    disable_rht: bool = field(default_factory=env_flag("NVTE_NVFP4_DISABLE_RHT"))
    #: Round gradients to nearest instead of stochastically.
    disable_stochastic_rounding: bool = field(
        default_factory=env_flag("NVTE_NVFP4_DISABLE_STOCHASTIC_ROUNDING")
    )
    #: 1x16 instead of 16x16 blocks for weights.
    disable_2d_quantization: bool = field(
        default_factory=env_flag("NVTE_NVFP4_DISABLE_2D_QUANTIZATION")
    )
    #: Row-scaled NVFP4 for the forward non-weight tensors (`numerics.md` §7.9): one amax per
    #: row, rowwise only, so it needs a ``backward_override`` (the backward GEMMs read the
    #: rowwise forms or the originals) and an input QParams without RHT, 2D blocks or
    #: stochastic rounding (``disable_rht=True``).
    row_scaled_activation: bool = field(
        default_factory=env_flag("NVTE_NVFP4_ROW_SCALED_ACTIVATION"))
    #: 4over6 block scaling (`numerics.md` §7.9) for the forward tensors of a scope: ``"none"``,
    #: ``"weights"``, ``"activations"`` or ``"all"`` (gradients never).
    nvfp4_4over6: str = "none"
    #: The 4over6 tensors that use 256 as the global E4M3 bound (the others keep 448), by scope.
    nvfp4_4over6_e4m3_use_256: str = "all"
    nvfp4_4over6_err_mode: str = "MAE"
    fp4_format: Format = Format.E2M1
    fp8_format: Format = Format.E4M3
    fp4_quant_fwd_inp: QParams | None = None
    fp4_quant_fwd_weight: QParams | None = None
    fp4_quant_bwd_grad: QParams | None = None
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: str | None = field(default_factory=env_backward_override)

    def __post_init__(self) -> None:
        check_common(self)
        if self.fp4_format is not Format.E2M1:
            raise ValueError(f"NVFP4BlockScaling.fp4_format must be E2M1, got {self.fp4_format}")
        for name in ("nvfp4_4over6", "nvfp4_4over6_e4m3_use_256"):
            if getattr(self, name) not in _4OVER6_SCOPES:
                raise ValueError(
                    f"NVFP4BlockScaling.{name} must be one of {_4OVER6_SCOPES}, "
                    f"got {getattr(self, name)!r}"
                )
        if self.nvfp4_4over6_err_mode not in ("MAE", "MSE"):
            raise ValueError(
                "NVFP4BlockScaling.nvfp4_4over6_err_mode must be 'MAE' or 'MSE', "
                f"got {self.nvfp4_4over6_err_mode!r}"
            )
        defaults = {
            "fp4_quant_fwd_inp": QParams(random_hadamard_transform=not self.disable_rht),
            "fp4_quant_fwd_weight": QParams(fp4_2d_quantization=not self.disable_2d_quantization),
            "fp4_quant_bwd_grad": QParams(
                random_hadamard_transform=not self.disable_rht,
                stochastic_rounding=not self.disable_stochastic_rounding,
            ),
        }
        fill_unset(self, defaults)
        if self.row_scaled_activation:
            self._check_row_scaled()

    def _check_row_scaled(self) -> None:
        """Refuse, at construction, what a row-scaled activation cannot do."""
        if self.backward_override is None:
            raise ValueError(
                "NVFP4BlockScaling(row_scaled_activation=True) needs backward_override="
                "'dequantized' or 'high_precision': row-scaled tensors have no columnwise form "
                "for the backward GEMMs"
            )
        qp = self.fp4_quant_fwd_inp
        refused = [name for name in ("random_hadamard_transform", "fp4_2d_quantization",
                                     "stochastic_rounding") if getattr(qp, name)]
        if refused:
            raise ValueError(
                "NVFP4BlockScaling(row_scaled_activation=True): fp4_quant_fwd_inp has "
                f"{', '.join(f'{n}=True' for n in refused)}, which row-scaled NVFP4 does not "
                "take (disable_rht=True, or QParams() for the input)"
            )

    state_class = NVFP4BlockScalingRecipeState

    def nvfp4(self) -> bool:
        return True
