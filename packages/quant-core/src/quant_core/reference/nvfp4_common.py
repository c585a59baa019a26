"""What NVFP4's block-scale variants share (`numerics.md` §7): the E2M1 packing, the global
encode scale ``S_enc``, block amaxes, row-scaled amaxes, and the layout of a direction's data
and scales. The TE-default scaling (:mod:`.nvfp4`) and 4over6 (:mod:`.nvfp4_4over6`) both build
on this module and import nothing from each other; :mod:`.nvfp4_dispatch` picks between them.
"""

from __future__ import annotations

import torch

from .. import shapes
from ..constants import E2M1_MAX, FLT_MAX, NVFP4_GLOBAL_MAX
from ._rounding import nan_to_zero_abs
from .pad import zero_pad
from .swizzle import swizzle_scales

BLOCK = shapes.NVFP4_BLOCK

Buffers = tuple[torch.Tensor | None, torch.Tensor | None, torch.Tensor | None,
                torch.Tensor | None]


def f32(value: float, device) -> torch.Tensor:
    return torch.tensor(value, dtype=torch.float32, device=device)


def pack_e2m1(codes: torch.Tensor) -> torch.Tensor:
    """Pack codes ``[R, 2C]`` into bytes ``[R, C]``: ``byte = code[2j] | code[2j+1] << 4``."""
    return (codes[:, 0::2] | (codes[:, 1::2] << 4)).to(torch.uint8)


def unpack_e2m1(data: torch.Tensor) -> torch.Tensor:
    """Codes (int64) ``[R, 2C]`` of packed bytes ``[R, C]`` (low nibble first)."""
    b = data.to(torch.int64)
    return torch.stack([b & 0xF, b >> 4], dim=-1).reshape(data.shape[0], 2 * data.shape[1])


def global_encode_scale(amax: torch.Tensor, e4m3_max: int = 448) -> torch.Tensor:
    """``S_enc`` (fp32 ``(1,)``) of §7.2: ``fminf(fp32(6 * e4m3_max / amax), FLT_MAX)`` (2688 for
    the standard bound 448; 4over6 may bound by 256, §7.9), 1 if that is 0 or ``amax == 0``. Like
    TE's ``fminf``, a NaN amax gives FLT_MAX."""
    amax = amax.to(torch.float32)
    top = NVFP4_GLOBAL_MAX if e4m3_max == 448 else E2M1_MAX * e4m3_max
    s = torch.fmin(f32(top, amax.device) / amax, f32(FLT_MAX, amax.device))
    return torch.where((amax == 0) | (s == 0), torch.ones_like(s), s)


def blocks_amax(v: torch.Tensor, rows_per_block: int) -> torch.Tensor:
    """NaN-dropping amax of ``v`` ``[R, C]`` (C % 16 == 0, R % rows_per_block == 0) per block of
    ``rows_per_block x 16``, repeated back to one value per row: ``[R, C/16]``."""
    r, c = v.shape
    a = nan_to_zero_abs(v).reshape(r // rows_per_block, rows_per_block, c // BLOCK, BLOCK)
    a = a.amax(dim=(1, 3))
    return a.repeat_interleave(rows_per_block, dim=0)


def columnwise_block_amax(vt: torch.Tensor, tile_amax: torch.Tensor | None) -> torch.Tensor:
    """The block amaxes ``[K, Mp/16]`` of the columnwise ``vt`` ``[K, Mp]``: its own 1x16 blocks',
    or with 2D blocks the transposed amaxes ``tile_amax`` ``[Mp, K/16]`` of the 16x16 tiles."""
    if tile_amax is None:
        return blocks_amax(vt, 1)
    return tile_amax[::BLOCK].t().repeat_interleave(BLOCK, dim=0)


def row_amax(amax: torch.Tensor, rows: int, padded_rows: int) -> torch.Tensor:
    """A row-scaled amax ``(rows,)`` as fp32 ``[padded_rows, 1]`` (zero past ``rows``), to
    broadcast over the rows of a block-padded tensor."""
    if amax.shape != (rows,):
        raise ValueError(f"row-scaled NVFP4: the rowwise amax must hold one value per row, "
                         f"shape ({rows},), got {tuple(amax.shape)}")
    return zero_pad(amax.to(torch.float32).reshape(rows, 1), padded_rows, 1)


def direction_buffers(codes: torch.Tensor, e4m3: torch.Tensor, valid_rows: int,
                      valid_cols: int, scale_shape: tuple[int, int]
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """The packed data ``[valid_rows, ceil(valid_cols/2)]`` of E2M1 codes ``[R, C]`` (zero past
    ``valid_rows x valid_cols``; an odd last column's high nibble 0) and the E4M3 bytes
    ``[R, C/16]`` zero-padded to ``scale_shape``."""
    codes = codes[:valid_rows, :valid_cols]
    codes = zero_pad(codes, codes.shape[0], codes.shape[1] + valid_cols % 2)  # last nibble 0
    return pack_e2m1(codes), zero_pad(e4m3[:valid_rows], scale_shape[0], scale_shape[1])


def finish(row_data, row_scale, col_data, col_scale, *, swizzle: bool) -> Buffers:
    """The quantization's four buffers, the scales GEMM-swizzled with ``swizzle``, each
    contiguous (custom ops and checkpoints rely on the layout); a missing one stays ``None``."""
    if swizzle:
        row_scale = None if row_scale is None else swizzle_scales(row_scale)
        col_scale = None if col_scale is None else swizzle_scales(col_scale)
    return tuple(
        None if t is None else t.contiguous() for t in (row_data, row_scale, col_data, col_scale)
    )
