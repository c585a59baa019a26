"""GEMM scale swizzle (numerics.md §5) against the explicit offset formula."""

from __future__ import annotations

import pytest
import torch
from quant_core.reference import swizzle_scales, unswizzle_scales
from quant_core.shapes import roundup


def offset_formula(i: int, j: int, cols: int) -> int:
    """§5: tile = (i // 128) * ceil(C/4) + j // 4; offset = tile*512 + (r%32)*16 + (r//32)*4 + c."""
    r, c = i % 128, j % 4
    tile = (i // 128) * (cols // 4) + j // 4
    return tile * 512 + (r % 32) * 16 + (r // 32) * 4 + c


def swizzle_by_loop(s: torch.Tensor) -> torch.Tensor:
    rows, cols = s.shape
    out = torch.empty(rows * cols, dtype=s.dtype)
    for i in range(rows):
        for j in range(cols):
            out[offset_formula(i, j, cols)] = s[i, j]
    return out.reshape(rows, cols)


def swizzle_by_index(s: torch.Tensor) -> torch.Tensor:
    """The same formula evaluated on index grids (fast, for large shapes)."""
    rows, cols = s.shape
    i = torch.arange(rows).reshape(-1, 1)
    j = torch.arange(cols).reshape(1, -1)
    r, c = i % 128, j % 4
    offset = ((i // 128) * (cols // 4) + j // 4) * 512 + (r % 32) * 16 + (r // 32) * 4 + c
    out = torch.empty(rows * cols, dtype=s.dtype)
    out[offset.reshape(-1)] = s.reshape(-1)
    return out.reshape(rows, cols)


def padded_random_scales(rows: int, cols: int, seed: int = 0) -> torch.Tensor:
    """Random bytes ``[rows, cols]`` zero-padded to ``[roundup(rows,128), roundup(cols,4)]``."""
    g = torch.Generator().manual_seed(seed)
    s = torch.zeros(roundup(rows, 128), roundup(cols, 4), dtype=torch.uint8)
    s[:rows, :cols] = torch.randint(0, 256, (rows, cols), generator=g, dtype=torch.uint8)
    return s


def test_hand_offsets_in_one_and_four_tiles():
    # ids[i, j] = unique value, read back at the offsets the formula gives by hand.
    ids = torch.arange(256 * 8, dtype=torch.int32).reshape(256, 8)
    flat = swizzle_scales(ids).reshape(-1)
    assert flat[0] == ids[0, 0]
    assert flat[1] == ids[0, 1]  # c = 1
    assert flat[4] == ids[32, 0]  # r // 32 = 1 -> +4
    assert flat[16] == ids[1, 0]  # r % 32 = 1 -> +16
    assert flat[16 + 4 + 2] == ids[33, 2]  # r = 33: 1*16 + 1*4 + 2
    assert flat[512] == ids[0, 4]  # tile 1 = (0, 1)
    assert flat[2 * 512] == ids[128, 0]  # tile 2 = (1, 0): ceil(8/4) = 2 tiles per tile-row
    assert flat[3 * 512 + 16 + 4 + 2] == ids[128 + 33, 4 + 2]
    assert flat[511] == ids[127, 3]  # r = 127: 31*16 + 3*4 + 3


@pytest.mark.parametrize("rows,cols", [(128, 4), (256, 8), (300, 9), (63, 1023), (1, 1)])
def test_matches_offset_formula_on_padded_shapes(rows, cols):
    s = padded_random_scales(rows, cols)
    assert torch.equal(swizzle_scales(s), swizzle_by_index(s))


def test_matches_scalar_loop():
    s = padded_random_scales(300, 9, seed=1)  # -> [384, 12]
    assert s.shape == (384, 12)
    assert torch.equal(swizzle_scales(s), swizzle_by_loop(s))


@pytest.mark.parametrize("rows,cols", [(300, 9), (63, 1023), (0, 4)])
def test_reshape_permute_equivalence_and_round_trip(rows, cols):
    s = padded_random_scales(rows, cols, seed=2)
    r, c = s.shape
    view = s.reshape(r // 128, 4, 32, c // 4, 4).permute(0, 3, 2, 1, 4).reshape(-1)
    swizzled = swizzle_scales(s)
    assert swizzled.shape == s.shape
    assert torch.equal(swizzled.reshape(-1), view)
    assert torch.equal(unswizzle_scales(swizzled), s)


def test_any_dtype():
    s = torch.randn(128, 8)
    assert torch.equal(swizzle_scales(s), swizzle_by_index(s))
    assert torch.equal(unswizzle_scales(swizzle_scales(s)), s)


@pytest.mark.parametrize("shape", [(100, 4), (128, 6), (128,)])
def test_unpadded_shape_raises(shape):
    with pytest.raises(ValueError):
        swizzle_scales(torch.zeros(shape, dtype=torch.uint8))
    with pytest.raises(ValueError):
        unswizzle_scales(torch.zeros(shape, dtype=torch.uint8))
