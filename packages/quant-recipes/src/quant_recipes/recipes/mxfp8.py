"""MXFP8: 1x32 blocks with E8M0 scales (32x32 for linear weights with 2D quantization)."""

from __future__ import annotations

from dataclasses import dataclass, field

from quant_core import MXFP8Quantizer, Quantizer

from ..recipe import Format, Recipe, check_common, env_backward_override
from ..states import RecipeState, element_dtype


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
        return MXFP8Quantizer(element_dtype(r.fp8_format, self.forward), with_2d_quantization=two_d,
                              internal=True)


@dataclass(frozen=True)
class MXFP8BlockScaling(Recipe):
    """MXFP8: 1x32 blocks with E8M0 scales; 32x32 for linear weights with 2D quantization."""

    margin: int = 0
    fp8_format: Format = Format.E4M3
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: str | None = field(default_factory=env_backward_override)
    #: 32x32 blocks for linear weights (one scale per tile, shared by both directions).
    enable_2d_quantization: bool = False

    def __post_init__(self) -> None:
        check_common(self)
        if self.fp8_format not in (Format.E4M3, Format.HYBRID):
            raise ValueError(
                f"MXFP8BlockScaling.fp8_format must be E4M3 or HYBRID, got {self.fp8_format}"
            )

    state_class = MXFP8BlockScalingRecipeState

    def mxfp8(self) -> bool:
        return True
