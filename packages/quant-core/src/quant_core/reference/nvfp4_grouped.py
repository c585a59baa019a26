"""Reference per-group NVFP4 (mixture-of-experts GEMM operands, `numerics.md` §7): every group of
rows of one tensor quantized with its own amaxes, in one call.

``x [M, K]`` holds the groups' rows end to end, ``grp [M]`` the group of each row; every group
starts at a multiple of 16 rows (the padded layout of a grouped layer), so no 16-row block, RHT
or 16x16 tile crosses a group. Group ``g``'s amaxes are those :func:`.nvfp4.nvfp4_amax` gives
its rows alone (the columnwise one after the RHT with RHT), its ``S_enc`` follows from them, and
its bytes are those :func:`.nvfp4.nvfp4_base_quantize` writes for its rows alone with those
amaxes. One exception: stochastic rounding draws one stream for the whole tensor, numbered as
``nvfp4_base_quantize`` numbers the elements of ``x`` (rowwise ``m * K + k``, columnwise
``M * K + k * M + m``), so its random bytes are not those of one call per group.
"""

from __future__ import annotations

import torch

from .. import shapes
from ..inputs import check_input_dtype, check_k_multiple, check_nvfp4_variant
from ._rounding import nan_to_zero_abs
from .nvfp4 import _quantize_direction
from .nvfp4_common import BLOCK, blocks_amax, columnwise_block_amax, finish
from .rht import rht_columnwise

Grouped = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None,
                torch.Tensor | None, torch.Tensor | None, torch.Tensor | None]


def check_groups(x: torch.Tensor, grp: torch.Tensor, groups: int, what: str) -> None:
    """``ValueError`` unless ``x`` has whole 16-row blocks and ``grp`` one group per row."""
    if x.shape[0] % BLOCK:
        raise ValueError(f"{what}: x must hold whole 16-row blocks (every group starts at a "
                         f"multiple of 16 rows), got {x.shape[0]} rows")
    if grp.dim() != 1 or grp.shape[0] != x.shape[0] or grp.dtype not in (torch.int32,
                                                                         torch.int64):
        raise ValueError(f"{what}: grp must be an int32/int64 [M] tensor, the group of each "
                         f"row of x, got {grp.dtype} {tuple(grp.shape)}")
    if groups < 1:
        raise ValueError(f"{what}: groups must be at least 1, got {groups}")


def check_group_quantize(x: torch.Tensor, grp: torch.Tensor, groups: int, *, columnwise: bool,
                         with_rht: bool, with_2d_quantization: bool, stochastic_rounding: bool,
                         rng_seed: torch.Tensor | None) -> None:
    """What every backend's ``nvfp4_group_quantize`` refuses, with the same messages: the
    variant flags, the input dtype, K a multiple of 16, whole 16-row blocks and one group per
    row."""
    what = "nvfp4_group_quantize"
    check_nvfp4_variant(columnwise=columnwise, with_rht=with_rht,
                        with_2d_quantization=with_2d_quantization,
                        stochastic_rounding=stochastic_rounding, rng_seed=rng_seed)
    check_input_dtype(x, what)
    check_k_multiple(x.shape[1], BLOCK, "NVFP4")
    check_groups(x, grp, groups, what)


def group_amax(values: torch.Tensor, grp: torch.Tensor, groups: int) -> torch.Tensor:
    """fp32 ``[groups]``: NaN-dropping ``max|values|`` over the entries of each group
    (``values`` one per entry of ``grp``), 0 for a group without entries."""
    out = torch.zeros(groups, dtype=torch.float32, device=values.device)
    return out.scatter_reduce(0, grp, values.to(torch.float32), "amax")


def _row_amax(v: torch.Tensor) -> torch.Tensor:
    """NaN-dropping ``max|v|`` of each row of ``v [R, C]`` (0 for an empty row)."""
    return nan_to_zero_abs(v).amax(dim=1) if v.shape[1] else v.new_zeros(v.shape[0])


def nvfp4_group_quantize(
    x: torch.Tensor, grp: torch.Tensor, *, groups: int, rowwise: bool, columnwise: bool,
    with_rht: bool, rht_sign_mask: int, with_2d_quantization: bool, stochastic_rounding: bool,
    rng_seed: torch.Tensor | None, swizzle: bool,
) -> Grouped:
    """``(row_data, row_scale, col_data, col_scale, amax_row [groups], amax_col [groups])``:
    the buffers of ``nvfp4_quantize`` for ``x [M, K]`` (the same shapes and flags) with each
    group's rows quantized with the group's own amaxes (module docstring); a direction not
    asked for is ``None``."""
    check_group_quantize(x, grp, groups, columnwise=columnwise, with_rht=with_rht,
                         with_2d_quantization=with_2d_quantization,
                         stochastic_rounding=stochastic_rounding, rng_seed=rng_seed)
    m, k = x.shape
    grp = grp.to(torch.int64)
    xf = x.to(torch.float32)
    tile_amax = blocks_amax(xf, BLOCK) if with_2d_quantization else None
    plain = group_amax(_row_amax(xf), grp, groups) if rowwise or (
        columnwise and not with_rht) else None
    row_data = row_scale = col_data = col_scale = amax_r = amax_c = None
    if rowwise:
        amax_r = plain
        blk = tile_amax if with_2d_quantization else blocks_amax(xf, 1)
        row_data, row_scale = _quantize_direction(
            xf, m, k, amax_r[grp][:, None], blk, shapes.nvfp4_rowwise_scale_shape(m, k),
            0 if stochastic_rounding else None, rng_seed)
    if columnwise:
        vt = rht_columnwise(x, rht_sign_mask).to(torch.float32) if with_rht else xf.t()
        amax_c = group_amax(_row_amax(vt.t()), grp, groups) if with_rht else plain.clone()
        col_data, col_scale = _quantize_direction(
            vt, k, m, amax_c[grp[::BLOCK]][None, :], columnwise_block_amax(vt, tile_amax),
            shapes.nvfp4_columnwise_scale_shape(m, k),
            m * k if stochastic_rounding else None, rng_seed)
    return (*finish(row_data, row_scale, col_data, col_scale, swizzle=swizzle), amax_r, amax_c)
