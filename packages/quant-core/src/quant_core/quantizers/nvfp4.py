"""NVFP4: E2M1 elements, E4M3 1x16 or 16x16 block scales, an fp32 tensor amax (numerics §7)."""

from __future__ import annotations

import torch

from .. import backends
from ..constants import RHT_DEFAULT_SIGN_MASK
from ..distributed import reduce_amax
from ..dtypes import DType
from ..inputs import as_2d, check_rht_input
from ..quantizer import Quantizer, value_quantizer, warn_deprecated_group
from ..shapes import (
    NVFP4_BLOCK,
    m_k,
    nvfp4_columnwise_data_shape,
    nvfp4_columnwise_scale_shape,
    nvfp4_rowwise_scale_shape,
)
from ..storage import NVFP4TensorStorage

#: The spec's fixed RHT sign vector as a mask (bit i set where s_i == -1): 0xD7E8 = 55272.
DEFAULT_RHT_SIGN_MASK = RHT_DEFAULT_SIGN_MASK


@value_quantizer
class NVFP4Quantizer(Quantizer):
    """NVFP4 with optional RHT (columnwise only, post-RHT amax), 2D 16x16 blocks and stochastic
    rounding. K must be a multiple of 16; RHT also needs bf16 input and M a multiple of 16.

    ``rht_matrix_random_sign_mask_t`` is the value field for the RHT signs; the 16x16 bf16 matrix
    is derived state built lazily per device (:meth:`rht_matrix`). The optional TE variants
    row-scaled NVFP4 and 4over6 are fields for parity but are not implemented (``True`` raises).
    """

    storage_format = "nvfp4"
    _storage_class = NVFP4TensorStorage
    reduces_amax = True
    #: Read by traced code beyond the fields (registered as members with the torch API).
    traced_members = ("with_random_sign_mask",)

    dtype: DType = DType.E2M1
    with_rht: bool = False
    with_post_rht_amax: bool = False
    with_amax_reduction: bool = False
    with_2d_quantization: bool = False
    stochastic_rounding: bool = False
    row_scaled_nvfp4: bool = False
    nvfp4_use_4over6: bool = False
    nvfp4_e4m3_max: int = 448
    nvfp4_4over6_err_mode: str = "MAE"
    rht_matrix_random_sign_mask_t: int = DEFAULT_RHT_SIGN_MASK

    def __init__(self, dtype: DType = DType.E2M1, *, amax_reduction_group=None,
                 with_random_sign_mask: bool | None = None, **fields) -> None:
        if dtype is not DType.E2M1:
            raise ValueError(f"NVFP4Quantizer dtype must be DType.E2M1, got {dtype!r}")
        if with_random_sign_mask is not None:
            if "rht_matrix_random_sign_mask_t" in fields:
                raise TypeError(
                    "pass either with_random_sign_mask or rht_matrix_random_sign_mask_t, not both"
                )
            fields["rht_matrix_random_sign_mask_t"] = (
                DEFAULT_RHT_SIGN_MASK if with_random_sign_mask else 0
            )
        super().__init__(dtype=dtype, **fields)
        self._validate()
        if amax_reduction_group is not None:
            warn_deprecated_group(type(self).__name__)
            object.__setattr__(self, "amax_reduction_group", amax_reduction_group)

    def _validate(self) -> None:
        if self.row_scaled_nvfp4 or self.nvfp4_use_4over6:
            raise NotImplementedError(
                "row_scaled_nvfp4 and nvfp4_use_4over6 are optional NVFP4 variants this "
                "project does not implement yet"
            )
        if self.nvfp4_e4m3_max != 448:
            raise ValueError(
                f"nvfp4_e4m3_max must be 448 without 4over6, got {self.nvfp4_e4m3_max}"
            )
        if self.nvfp4_4over6_err_mode not in ("MAE", "MSE"):
            raise ValueError(
                f"nvfp4_4over6_err_mode must be 'MAE' or 'MSE', got {self.nvfp4_4over6_err_mode!r}"
            )
        if self.with_rht and not self.with_post_rht_amax:
            raise ValueError(
                "with_rht=True needs with_post_rht_amax=True (a pre-RHT amax is not supported)"
            )
        if not 0 <= self.rht_matrix_random_sign_mask_t < 2**16:
            raise ValueError(
                "rht_matrix_random_sign_mask_t must be a 16-bit mask, got "
                f"{self.rht_matrix_random_sign_mask_t}"
            )

    @property
    def with_random_sign_mask(self) -> bool:
        return self.rht_matrix_random_sign_mask_t != 0

    def rht_matrix(self, device: torch.device | str = "cpu") -> torch.Tensor:
        """The 16x16 bf16 RHT matrix ``diag(s) H16 / 4`` on ``device`` (cached per device)."""
        from ..reference.rht import rht_matrix

        return rht_matrix(self.rht_matrix_random_sign_mask_t, torch.device(device))

    def shape_rule(self) -> tuple[str, int]:
        return "NVFP4", NVFP4_BLOCK

    def quantize(self, x, *, amax_reduction_group=None, backend=None,
                 generator: torch.Generator | None = None):
        """Quantize ``x``; stochastic rounding draws its seed from ``generator`` (default: torch's
        default generator for ``x.device``), so results are reproducible from the seed state."""
        x2d, be = self._prepare(x, backend, generator)
        amax_r, amax_c = self._amaxes(x2d, be)
        if self.with_amax_reduction:
            group = amax_reduction_group or getattr(self, "amax_reduction_group", None)
            amax_r, amax_c = self._split(reduce_amax(self._joined(amax_r, amax_c), group))
        return self._quantize(x, x2d, be, amax_r, amax_c, generator)

    def amax_numel(self) -> int:
        """One amax per usage (rowwise, columnwise)."""
        return int(self.rowwise_usage) + int(self.columnwise_usage)

    def local_amax(self, x: torch.Tensor, *, backend=None) -> torch.Tensor:
        """fp32 ``(n,)``: this rank's amaxes, rowwise then columnwise (post-RHT with RHT), one
        per usage: the values an amax reduction combines."""
        x2d, be = self._prepare(x, backend, None)
        return self._joined(*self._amaxes(x2d, be))

    def quantize_with_amax(self, x: torch.Tensor, amax: torch.Tensor, *, backend=None,
                           generator: torch.Generator | None = None):
        """Quantize ``x`` with the amaxes ``amax`` (as :meth:`local_amax` returns them, e.g.
        reduced over the ranks): the steps of :meth:`quantize` after its reduction."""
        x2d, be = self._prepare(x, backend, generator)
        return self._quantize(x, x2d, be, *self._split(amax), generator)

    @staticmethod
    def _joined(amax_r, amax_c) -> torch.Tensor:
        """The present amaxes (one per usage) as one tensor, for one reduction."""
        return torch.cat([a for a in (amax_r, amax_c) if a is not None])

    def _split(self, amax: torch.Tensor):
        """``(amax_r, amax_c)`` of :meth:`_joined`'s layout, each with its own storage (they
        become distinct storage buffers)."""
        parts = iter(amax.to(torch.float32).reshape(-1).split(1))
        amax_r = next(parts).clone() if self.rowwise_usage else None
        amax_c = next(parts).clone() if self.columnwise_usage else None
        return amax_r, amax_c

    def _prepare(self, x, backend, generator):
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator or None, got {generator!r}")
        x2d = as_2d(x, *self.shape_rule())
        if self.with_rht and self.columnwise_usage:
            check_rht_input(x2d)
        return x2d, backends.get(backend, x.device)

    def _amaxes(self, x2d, be):
        return be.nvfp4_amax(
            x2d, rowwise=self.rowwise_usage, columnwise=self.columnwise_usage,
            with_rht=self.with_rht and self.columnwise_usage,
            rht_sign_mask=self.rht_matrix_random_sign_mask_t,
        )

    def _quantize(self, x, x2d, be, amax_r, amax_c, generator):
        seed = None
        if self.stochastic_rounding:
            seed = torch.randint(
                0, 2**31 - 1, (1,), generator=generator, dtype=torch.int64, device=x.device
            )
        rd, rs, cd, cs = be.nvfp4_quantize(
            x2d, amax_r, amax_c, rowwise=self.rowwise_usage, columnwise=self.columnwise_usage,
            with_rht=self.with_rht and self.columnwise_usage,
            rht_sign_mask=self.rht_matrix_random_sign_mask_t,
            with_2d_quantization=self.with_2d_quantization,
            stochastic_rounding=self.stochastic_rounding, rng_seed=seed,
            swizzle=self.optimize_for_gemm,
        )
        return self._make_storage(x.shape, x.dtype, {
            "_rowwise_data": rd, "_rowwise_scale_inv": rs,
            "_columnwise_data": cd, "_columnwise_scale_inv": cs,
            "_amax_rowwise": amax_r, "_amax_columnwise": amax_c,
        })

    def inner_tensor_specs(self, shape):
        m, k = m_k(shape)
        specs = {}
        if self.rowwise_usage:
            specs["_rowwise_data"] = ((*shape[:-1], k // 2), torch.uint8)
            specs["_rowwise_scale_inv"] = (nvfp4_rowwise_scale_shape(m, k), torch.uint8)
        if self.columnwise_usage:
            specs["_columnwise_data"] = (nvfp4_columnwise_data_shape(m, k), torch.uint8)
            specs["_columnwise_scale_inv"] = (nvfp4_columnwise_scale_shape(m, k), torch.uint8)
        if self.rowwise_usage:
            specs["_amax_rowwise"] = ((1,), torch.float32)
        if self.columnwise_usage:
            specs["_amax_columnwise"] = ((1,), torch.float32)
        return specs

    def _storage_tags(self):
        return {"_fp4_dtype": self.dtype, "_with_gemm_swizzled_scales": self.optimize_for_gemm}

    def is_requantization_safe(self) -> bool:
        return not self.stochastic_rounding

    def lowerings(self) -> tuple[str, ...]:
        """The backend's kernels, recorded into the graph; none with stochastic rounding, whose
        seed must come from torch's generator as in eager mode (not from Inductor's own random
        numbers)."""
        return () if self.stochastic_rounding else ("kernels",)
