"""NVFP4 (`numerics.md` §7): E2M1 elements, E4M3 1x16 or 16x16 block scales and an fp32
tensor amax; the storage, its tensor and the quantizer."""

from __future__ import annotations

import torch

from .. import backends
from ..constants import (
    DEFAULT_RHT_SIGN_MASK,
    NVFP4_4OVER6_E4M3_BOUNDS,
    NVFP4_4OVER6_ERROR_MODES,
)
from ..distributed import reduce_amax
from ..dtypes import DType
from ..inputs import as_2d, check_rht_input
from ..operand import GemmOperand
from ..quantizer import Quantizer, value_quantizer, warn_deprecated_group
from ..reference.nvfp4_common import pack_e2m1, unpack_e2m1
from ..reference.pad import zero_pad
from ..shapes import (
    NVFP4_BLOCK,
    m_k,
    nvfp4_columnwise_data_shape,
    nvfp4_columnwise_scale_shape,
    nvfp4_rowwise_scale_shape,
)
from ..sharding import ShardPlan, row_blocks_refusal
from ..storage import QuantizedStorage, present_buffers
from ..tensor import QuantizedTensor
from ._swizzled import split_refusal, swizzled_shard_refusal


class NVFP4TensorStorage(QuantizedStorage):
    """NVFP4: packed E2M1 data (two codes a byte, low nibble first), E4M3 block scales and the
    per-tensor amaxes ``_amax_rowwise`` / ``_amax_columnwise`` (fp32 ``(1,)``; a row-scaled
    tensor's ``_amax_rowwise`` holds one per row, ``(M,)``, and it has no columnwise form)."""

    format = "nvfp4"
    buffer_names = (
        "_rowwise_data", "_rowwise_scale_inv", "_columnwise_data", "_columnwise_scale_inv",
        "_amax_rowwise", "_amax_columnwise",
    )
    #: ``_nvfp4_e4m3_max``: the global E4M3 bound the quantization used (448; 4over6 may use
    #: 256), which dequantization divides by. ``_row_scaled_nvfp4``: one amax per row.
    tag_types = {"_fp4_dtype": DType, "_with_gemm_swizzled_scales": bool, "_nvfp4_e4m3_max": int,
                 "_row_scaled_nvfp4": bool}
    tag_defaults = {"_nvfp4_e4m3_max": 448, "_row_scaled_nvfp4": False}
    rowwise_data_name, columnwise_data_name = "_rowwise_data", "_columnwise_data"
    rowwise_only_names = ("_rowwise_data", "_rowwise_scale_inv", "_amax_rowwise")

    def _decode(self, columnwise, dtype):
        """Columnwise: the transposed codes decode to ``[k, m]`` in the quantizer's basis (the
        RHT one when it applied the transform), returned transposed."""
        m, k = m_k(self.shape)
        opts = dict(swizzled=bool(self._with_gemm_swizzled_scales), dtype=dtype,
                    e4m3_max=int(self._nvfp4_e4m3_max))
        be = self._backend()
        if columnwise:
            cd = self._columnwise_data
            out = be.nvfp4_dequantize(cd.reshape(k, cd.shape[-1]), self._columnwise_scale_inv,
                                      self._amax_columnwise, **opts)
            return out[:, :m].t()
        return be.nvfp4_dequantize(self._rowwise_data.reshape(m, k // 2), self._rowwise_scale_inv,
                                   self._amax_rowwise, **opts)

    def dequantize(self, dtype: torch.dtype | None = None) -> torch.Tensor:
        """Dequantize the rowwise data (`numerics.md` §8). The columnwise data may live in the
        RHT basis (its GEMM cancels the transform), so, as in TransformerEngine, it is not
        dequantized: :meth:`gemm_value` reads it in that basis."""
        if self._rowwise_data is None:
            self._out_dtype(dtype)
            raise NotImplementedError(
                "NVFP4 dequantization needs rowwise data; this storage holds only the "
                "columnwise form (quantize with rowwise_usage=True)"
            )
        return super().dequantize(dtype)

    def gemm_operand(self, transposed: bool) -> GemmOperand | None:
        """Rowwise ``[m, k/2]`` or columnwise ``[k, ceil(m/2)]`` packed data (columnwise in the
        RHT basis when the quantizer applied it: both wgrad operands share the transform, which
        cancels) with that direction's scales and amax (a row-scaled tensor's: one per row,
        the factor of each output row). Scales under another global bound than 448 (4over6's
        256) are not a GEMM operand of this form (``None``: the GEMM is emulated)."""
        if self._nvfp4_e4m3_max != 448:
            return None
        m, k = m_k(self.shape)
        swz = bool(self._with_gemm_swizzled_scales)
        if transposed:
            data, scale, amax, rows, kk = (self._columnwise_data, self._columnwise_scale_inv,
                                           self._amax_columnwise, k, m)
        else:
            data, scale, amax, rows, kk = (self._rowwise_data, self._rowwise_scale_inv,
                                           self._amax_rowwise, m, k)
        if data is None or amax is None or amax.numel() not in (1, rows):
            return None
        return GemmOperand("nvfp4", data.reshape(rows, data.shape[-1]), scale, self._fp4_dtype,
                           rows, kk, swz, amax=amax)

    @classmethod
    def shard_plan(cls, q, shape, world, columnwise):
        """2D 16x16 weight blocks (the recipe's default), without stochastic rounding, in row
        blocks of 128: packed data and scale rows; the tensor amax is all-reduced and travels
        as metadata. The columnwise copy is the transposed codes with the transposed scales."""
        refusal = swizzled_shard_refusal(q)
        if refusal:
            return refusal
        if not q.with_2d_quantization or q.with_rht:
            return ("NVFP4 1x16 weight blocks: the columnwise copy is stored transposed and does "
                    "not gather along dim 0; use 2D 16x16 weight blocks (the recipe's default)")
        if q.stochastic_rounding:
            return "NVFP4 stochastic rounding: each rank's bytes depend on its random stream"
        if q.nvfp4_use_4over6:
            return ("NVFP4 4over6: the columnwise copy picks its candidates from the transposed "
                    "tiles, so it is not a function of the gathered rowwise bytes")
        if q.row_scaled_nvfp4:
            return "row-scaled NVFP4: it has no columnwise form for the weight's backward GEMM"
        refusal = row_blocks_refusal("NVFP4", shape, world)
        if refusal:
            return refusal
        row = q.replace(rowwise_usage=True, columnwise_usage=False, with_amax_reduction=False)
        return ShardPlan(row, ("_rowwise_data", "_rowwise_scale_inv"), ("_amax_rowwise",), True,
                         rows_independent=False)

    @classmethod
    def columnwise_from_rowwise(cls, s, q) -> dict[str, torch.Tensor]:
        """With 2D 16x16 blocks and no RHT: the transposed codes with the transposed scales."""
        if (not q.with_2d_quantization or q.with_rht or q.nvfp4_use_4over6
                or q.row_scaled_nvfp4 or s._with_gemm_swizzled_scales):
            return super().columnwise_from_rowwise(s, q)
        m, k = m_k(s.shape)
        codes = unpack_e2m1(s._rowwise_data.reshape(m, k // 2))  # [m, k]
        codes = zero_pad(codes, m + m % 2, k).t()  # [k, m even], the last nibble 0
        per_block = s._rowwise_scale_inv[:m:NVFP4_BLOCK, :k // NVFP4_BLOCK]  # [ceil(m/16), k/16]
        cs = per_block.t().repeat_interleave(NVFP4_BLOCK, dim=0)  # [k, ceil(m/16)]
        return {**present_buffers(cls, s), "_columnwise_data": pack_e2m1(codes.contiguous()),
                "_columnwise_scale_inv": zero_pad(cs, *nvfp4_columnwise_scale_shape(m, k)),
                "_amax_columnwise": s._amax_rowwise.clone()}


class NVFP4Tensor(QuantizedTensor, NVFP4TensorStorage):
    """NVFP4 as a tensor (the per-tensor amaxes are shared by every piece of a split; a
    row-scaled tensor's per-row amaxes split with their rows)."""

    _storage_type = NVFP4TensorStorage
    _row_block = 16

    def _layout(self):
        return {"_rowwise_data": ("rows", 0, 1, 1), "_rowwise_scale_inv": ("2d", 0, 1, 128),
                "_columnwise_data": ("2d", 1, 2, 1), "_columnwise_scale_inv": ("2d", 1, 16, 4),
                "_amax_rowwise": ("2d", 0, 1, 1) if self._row_scaled_nvfp4 else None,
                "_amax_columnwise": None}

    def _split_refusal(self):
        return split_refusal(self)


@value_quantizer
class NVFP4Quantizer(Quantizer):
    """NVFP4 with optional RHT (columnwise only, post-RHT amax), 2D 16x16 blocks and stochastic
    rounding. K must be a multiple of 16; RHT also needs bf16 input and M a multiple of 16.

    ``rht_matrix_random_sign_mask_t`` is the value field for the RHT signs; the 16x16 bf16 matrix
    is derived state built lazily per device (:meth:`rht_matrix`). ``nvfp4_use_4over6``
    selects each block's scale between map-to-6 and map-to-4 (`numerics.md` §7.9) under the
    global bound ``nvfp4_e4m3_max`` (256 or 448) by ``nvfp4_4over6_err_mode`` ("MAE"/"MSE"); it
    takes no RHT and no stochastic rounding. ``row_scaled_nvfp4`` gives each row its own amax
    and ``S_enc`` (`numerics.md` §7.9): rowwise only (``columnwise_usage=False``), 1x16 blocks,
    round to nearest, no RHT and no ``with_amax_reduction`` (a group of ranks that hold other
    rows leaves the rows' amaxes alone); ranks that hold other columns of the same rows combine
    them elementwise between :meth:`local_amax` and :meth:`quantize_with_amax`.
    """

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
        if self.row_scaled_nvfp4:
            refused = [name for name in ("columnwise_usage", "with_rht", "with_2d_quantization",
                                         "stochastic_rounding", "with_amax_reduction")
                       if getattr(self, name)]
            if refused:
                raise ValueError(
                    f"row_scaled_nvfp4=True is rowwise only, with 1x16 blocks rounded to nearest "
                    f"and one amax per row; it takes no {', '.join(f'{n}=True' for n in refused)}"
                )
        if self.nvfp4_use_4over6:
            if self.with_rht or self.stochastic_rounding:
                raise ValueError(
                    "nvfp4_use_4over6=True takes neither with_rht=True nor "
                    "stochastic_rounding=True (4over6 rounds to nearest, without the transform)"
                )
            if self.nvfp4_e4m3_max not in NVFP4_4OVER6_E4M3_BOUNDS:
                raise ValueError(
                    f"nvfp4_e4m3_max must be 256 or 448 with 4over6, got {self.nvfp4_e4m3_max}"
                )
        elif self.nvfp4_e4m3_max != 448:
            raise ValueError(
                f"nvfp4_e4m3_max must be 448 without 4over6, got {self.nvfp4_e4m3_max}"
            )
        if self.nvfp4_4over6_err_mode not in NVFP4_4OVER6_ERROR_MODES:
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

    def check_columnwise_input(self, x: torch.Tensor) -> None:
        """With RHT, the Hadamard transform of the columnwise copy needs a bfloat16 input with
        rows a multiple of 16 (:func:`~quant_core.inputs.check_rht_input`)."""
        if self.with_rht:
            check_rht_input(x)

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

    def amax_numel(self, rows: int | None = None) -> int:
        """One amax per usage (rowwise, columnwise); a row-scaled quantizer's: one per row of
        an input of ``rows`` rows (``ValueError`` without ``rows``)."""
        if self.row_scaled_nvfp4:
            if rows is None:
                raise ValueError("row_scaled_nvfp4=True has one amax per row: amax_numel needs "
                                 "the input's rows")
            return rows
        return int(self.rowwise_usage) + int(self.columnwise_usage)

    def local_amax(self, x: torch.Tensor, *, backend=None) -> torch.Tensor:
        """fp32 ``(n,)``: this rank's amaxes, rowwise then columnwise (post-RHT with RHT), one
        per usage (row-scaled: one per row): the values an amax reduction combines."""
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
        become distinct storage buffers); row-scaled: every element is a row's amax."""
        amax = amax.to(torch.float32).reshape(-1)
        if self.row_scaled_nvfp4:
            return amax.clone(), None
        parts = iter(amax.split(1))
        amax_r = next(parts).clone() if self.rowwise_usage else None
        amax_c = next(parts).clone() if self.columnwise_usage else None
        return amax_r, amax_c

    def _prepare(self, x, backend, generator):
        if generator is not None and not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator or None, got {generator!r}")
        x2d = as_2d(x, *self.shape_rule())
        if self.columnwise_usage:
            self.check_columnwise_input(x2d)
        return x2d, backends.get(backend, x.device)

    def _amaxes(self, x2d, be):
        return be.nvfp4_amax(
            x2d, rowwise=self.rowwise_usage, columnwise=self.columnwise_usage,
            with_rht=self.with_rht and self.columnwise_usage,
            rht_sign_mask=self.rht_matrix_random_sign_mask_t,
            **self._row_scaled(),
        )

    def _row_scaled(self) -> dict[str, bool]:
        """The backend keyword of the row-scaled variant, passed only when it is on (a backend
        written before the variant existed takes the other quantizers' calls unchanged)."""
        return {"row_scaled": True} if self.row_scaled_nvfp4 else {}

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
            swizzle=self.optimize_for_gemm, four_over_six=self.nvfp4_use_4over6,
            e4m3_max=self.nvfp4_e4m3_max, err_mode=self.nvfp4_4over6_err_mode,
            **self._row_scaled(),
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
            specs["_amax_rowwise"] = ((m,) if self.row_scaled_nvfp4 else (1,), torch.float32)
        if self.columnwise_usage:
            specs["_amax_columnwise"] = ((1,), torch.float32)
        return specs

    def _storage_tags(self):
        return {"_fp4_dtype": self.dtype, "_with_gemm_swizzled_scales": self.optimize_for_gemm,
                "_nvfp4_e4m3_max": self.nvfp4_e4m3_max,
                "_row_scaled_nvfp4": self.row_scaled_nvfp4}

    def is_requantization_safe(self) -> bool:
        return not self.stochastic_rounding

    def lowerings(self) -> tuple[str, ...]:
        """The backend's kernels, recorded into the graph (4over6 and row scaling included);
        none with stochastic rounding, whose seed must come from torch's generator as in eager
        mode (not from Inductor's own random numbers)."""
        if self.stochastic_rounding:
            return ()
        return ("kernels",)
