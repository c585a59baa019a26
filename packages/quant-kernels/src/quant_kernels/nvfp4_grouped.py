"""Per-group NVFP4 of grouped rows (mixture-of-experts GEMM operands, `numerics.md` §7): every
group of rows of one tensor quantized with its own amaxes, one quantize launch per direction. The
TE-default kernels of :mod:`.nvfp4` with one amax per row (rowwise) and one per 16-row group
(columnwise); the groups' amaxes come from one pass of the grouped FP8 cast's amax kernel (one
per 16-row block after the RHT, reduced to groups on the device). Mirrors
``reference.nvfp4_group_quantize``."""

from __future__ import annotations

import torch
from quant_core import shapes
from quant_core.inputs import check_rht_input
from quant_core.reference.nvfp4_grouped import Grouped, check_group_quantize, group_amax

from . import fp8_grouped
from ._common import launch
from .configs import launch_config
from .nvfp4 import _nvfp4_col_kernel, _nvfp4_row_kernel, _pairs, _rht_amax_kernel
from .nvfp4_common import col_buffers, col_data, col_grid, row_buffers, row_grid


def _rht_block_amaxes(x: torch.Tensor, rht_sign_mask: int) -> torch.Tensor:
    """fp32 ``(M/16,)``: the NaN-dropping ``max|RHT|`` of each 16-row group of bf16 ``x``."""
    m, k = x.shape
    out = torch.zeros(m // shapes.NVFP4_BLOCK, dtype=torch.float32, device=x.device)
    if m and k:
        cfg, kw = launch_config("nvfp4_col")
        launch(_rht_amax_kernel, col_grid(m, k, cfg), x, out.view(torch.int32), m, k,
               MASK=int(rht_sign_mask), BLOCKS=True, **kw)
    return out


def nvfp4_group_quantize(
    x: torch.Tensor, grp: torch.Tensor, *, groups: int, rowwise: bool, columnwise: bool,
    with_rht: bool, rht_sign_mask: int, with_2d_quantization: bool, stochastic_rounding: bool,
    rng_seed: torch.Tensor | None, swizzle: bool,
) -> Grouped:
    """``(row_data, row_scale, col_data, col_scale, amax_row [groups], amax_col [groups])``:
    ``nvfp4_quantize``'s buffers of ``x [M, K]`` (the same shapes and flags) with each group of
    rows (``grp [M]`` the group of each row, every group starting at a multiple of 16 rows)
    quantized with its own fp32 amaxes; stochastic rounding numbers the elements of ``x`` as one
    tensor. A direction not asked for is ``None``. Nothing is read back to the host. Refuses
    what the reference refuses, with its messages."""
    check_group_quantize(x, grp, groups, columnwise=columnwise, with_rht=with_rht,
                         with_2d_quantization=with_2d_quantization,
                         stochastic_rounding=stochastic_rounding, rng_seed=rng_seed)
    m, k = x.shape
    if columnwise and with_rht:
        check_rht_input(x)
    x = x.contiguous()
    grp = grp.to(torch.int64)
    dev = x.device
    seed = (rng_seed.to(device=dev, dtype=torch.int64).reshape(1) if stochastic_rounding
            else torch.zeros(1, dtype=torch.int64, device=dev))
    flags = dict(SR=bool(stochastic_rounding), TWO_D=bool(with_2d_quantization),
                 SWIZZLE=bool(swizzle))
    # each group's NaN-dropping max|x| in one pass (the grouped FP8 cast's amax kernel)
    plain = fp8_grouped.group_amax(x, groups, grp) if rowwise or (
        columnwise and not with_rht) else None
    rd = rs = cd = cs = amax_r = amax_c = None
    if rowwise:
        amax_r = plain
        rd, rs = row_buffers(m, k, dev)
        if m and k:
            cfg, kw = launch_config("nvfp4_row")
            xp, dt = _pairs(x)
            launch(_nvfp4_row_kernel, row_grid(m, k, cfg), xp, amax_r[grp], seed, rd, rs, m, k,
                   rs.shape[1], DT=dt, ROW_SCALED=True, **flags, **kw)
    if columnwise:
        if with_rht:
            amax_c = group_amax(_rht_block_amaxes(x, rht_sign_mask), grp[::shapes.NVFP4_BLOCK],
                                groups)
        else:
            amax_c = plain.clone()
        cdw, cs, mhw = col_buffers(m, k, dev)
        if m and k:
            cfg, kw = launch_config("nvfp4_col")
            launch(_nvfp4_col_kernel, col_grid(m, k, cfg), x, amax_c[grp], seed,
                   cdw.view(torch.int64), cs, m, k, mhw, cs.shape[1], RHT=bool(with_rht),
                   MASK=int(rht_sign_mask), COL_SCALED=True, **flags, **kw)
        cd = col_data(cdw, m, k)
    return rd, rs, cd, cs, amax_r, amax_c
