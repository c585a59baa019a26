"""FP8 block scaling: 1x128 or 128x128 blocks with fp32 scales."""

from __future__ import annotations

from dataclasses import dataclass, field

from quant_core import Float8BlockQuantizer, Quantizer

from ..recipe import (
    FP8_QPARAM_FIELDS,
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
            element_dtype(r.fp8_format, fwd), block_scaling_dim=dim, amax_epsilon=qp.amax_epsilon,
            force_pow_2_scales=qp.power_2_scale, internal=True,
        )


@dataclass(frozen=True)
class Float8BlockScaling(Recipe):
    """FP8 1x128 (dim 1) or 128x128 (dim 2) blocks with fp32 scales.

    ``fp8_quant_*`` default to ``QParams(power_2_scale=not use_f32_scales)``.
    """

    #: Keep fp32 scales instead of powers of two (``NVTE_FP8_BLOCK_SCALING_FP32_SCALES``).
    use_f32_scales: bool = field(default_factory=env_flag("NVTE_FP8_BLOCK_SCALING_FP32_SCALES"))
    fp8_format: Format = Format.E4M3
    fp8_quant_fwd_inp: QParams | None = None
    fp8_quant_fwd_weight: QParams | None = None
    fp8_quant_bwd_grad: QParams | None = None
    #: Block shape per tensor type: 1 is 1x128, 2 is 128x128 (at most one of the three is 2).
    x_block_scaling_dim: int = 1
    w_block_scaling_dim: int = 2
    grad_block_scaling_dim: int = 1
    fp8_gemm_fprop: MMParams = field(default_factory=lambda: SPLIT)
    fp8_gemm_dgrad: MMParams = field(default_factory=lambda: SPLIT)
    fp8_gemm_wgrad: MMParams = field(default_factory=lambda: SPLIT)
    fp8_dpa: bool = False
    fp8_mha: bool = False
    backward_override: str | None = field(default_factory=env_backward_override)

    def __post_init__(self) -> None:
        check_common(self)
        if self.fp8_format is Format.E2M1:
            raise ValueError("Float8BlockScaling.fp8_format must be an FP8 format, got E2M1")
        dims = {
            "x_block_scaling_dim": self.x_block_scaling_dim,
            "w_block_scaling_dim": self.w_block_scaling_dim,
            "grad_block_scaling_dim": self.grad_block_scaling_dim,
        }
        for name, dim in dims.items():
            if dim not in (1, 2):
                raise ValueError(f"Float8BlockScaling.{name} must be 1 or 2, got {dim!r}")
        names = list(dims)
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                if dims[a] == 2 and dims[b] == 2:
                    raise ValueError(
                        f"Float8BlockScaling: {a}=2 with {b}=2 is a 2D-by-2D block GEMM, "
                        "which is not supported"
                    )
        for name in ("fp8_gemm_fprop", "fp8_gemm_dgrad", "fp8_gemm_wgrad"):
            if not getattr(self, name).use_split_accumulator:
                raise ValueError(f"Float8BlockScaling.{name}: split accumulator is required")
        pow2 = not self.use_f32_scales
        fill_unset(self, {name: QParams(power_2_scale=pow2) for name in FP8_QPARAM_FIELDS})

    state_class = Float8BlockScalingRecipeState

    def float8_block_scaling(self) -> bool:
        return True
