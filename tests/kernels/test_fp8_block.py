"""FP8 block scaling (1x128, 128x1, 128x128) against the reference, bitwise."""

from __future__ import annotations

import pytest
import torch
from _kernels_util import DEVICE, assert_all_same, assert_same, make_input
from quant_core import reference as ref
from quant_core.dtypes import DType
from quant_core.kernel_capture import capture
from quant_kernels.backend import BACKEND as B

NAMES = ("row_data", "row_scale_inv", "col_data", "col_scale_inv")


@pytest.mark.parametrize("dim", [1, 2])
@pytest.mark.parametrize("shape,dtype,fp8", [((200, 300), torch.float32, DType.E4M3),
                                             ((130, 128), torch.bfloat16, DType.E5M2),
                                             ((7, 140), torch.float16, DType.E4M3),
                                             ((0, 128), torch.bfloat16, DType.E4M3)])
@pytest.mark.parametrize("pow2,eps", [(True, 0.0), (False, 1e-30)])
def test_fp8_block_quantize_dequantize(dim, shape, dtype, fp8, pow2, eps):
    x = make_input(*shape, dtype, seed=5)
    for rw, cw in ((True, True), (True, False), (False, True)):
        kw = dict(fp8_dtype=fp8, block_scaling_dim=dim, force_pow_2_scales=pow2,
                  amax_epsilon=eps, rowwise=rw, columnwise=cw)
        got = B.fp8_block_quantize(x.to(DEVICE), **kw)
        want = ref.fp8_block_quantize(x, **kw)
        assert_all_same(got, want, fp8, NAMES)
        if rw and cw:
            for cwise, (d, s) in ((False, got[:2]), (True, got[2:])):
                kw2 = dict(fp8_dtype=fp8, block_scaling_dim=dim, columnwise=cwise, dtype=dtype)
                assert_same(B.fp8_block_dequantize(d, s, **kw2),
                            ref.fp8_block_dequantize(d.cpu(), s.cpu(), **kw2))


def test_fp8_block_extremes():
    """All-max tile (scale from the dtype max) and an all-zero tile with a tiny epsilon."""
    x = torch.full((128, 256), torch.finfo(torch.bfloat16).max, dtype=torch.bfloat16)
    x[:, 128:] = 0.0
    for pow2 in (True, False):
        kw = dict(fp8_dtype=DType.E4M3, block_scaling_dim=2, force_pow_2_scales=pow2,
                  amax_epsilon=1e-38, rowwise=True, columnwise=True)
        assert_all_same(B.fp8_block_quantize(x.to(DEVICE), **kw),
                        ref.fp8_block_quantize(x, **kw), DType.E4M3, NAMES)


@pytest.mark.parametrize("dim,rw,cw", [(1, True, True), (1, True, False), (1, False, True),
                                       (2, True, True)])
def test_recorded_block_cast_stores_reference_bytes(dim, rw, cw):
    """Through torch FP8 pointers (``fp8_data`` of a recorded launch; run eagerly here) the
    kernel's row-only, column and 2D paths write the reference's bytes."""
    x = make_input(200, 256, torch.bfloat16, seed=8)
    kw = dict(fp8_dtype=DType.E4M3, block_scaling_dim=dim, force_pow_2_scales=True,
              amax_epsilon=0.0, rowwise=rw, columnwise=cw)
    with capture():
        got = B.fp8_block_quantize(x.to(DEVICE), **kw)
    assert all(t is None or t.dtype in (torch.uint8, torch.float32) for t in got)
    assert_all_same(got, ref.fp8_block_quantize(x, **kw), DType.E4M3, NAMES)


@pytest.mark.parametrize("dim", [1, 2])
@pytest.mark.parametrize("rw,cw", [(True, True), (True, False), (False, True)])
@pytest.mark.parametrize("dtype,fp8,pow2,eps,index", [
    (torch.bfloat16, DType.E4M3, True, 0.0, torch.int32),
    (torch.float32, DType.E5M2, False, 1e-30, torch.int64)])
def test_gathered_rows_equal_quantizing_the_gathered_tensor(dim, rw, cw, dtype, fp8, pow2, eps,
                                                            index):
    """``rows``: the bytes of quantizing ``x[rows]`` with zero rows where ``rows < 0`` (a grouped
    operand's padded layout), read through the index; rows out of order, repeated, none."""
    x = make_input(150, 256, dtype, seed=9)
    rows = torch.cat([torch.arange(37), torch.full((91,), -1), torch.arange(149, 36, -1),
                      torch.tensor([5, 5, -1])]).to(index)
    kw = dict(fp8_dtype=fp8, block_scaling_dim=dim, force_pow_2_scales=pow2,
              amax_epsilon=eps, rowwise=rw, columnwise=cw)
    padded = torch.where((rows >= 0)[:, None], x[rows.clamp(min=0).long()], 0)
    want = ref.fp8_block_quantize(padded, **kw)
    assert_all_same(ref.fp8_block_quantize(x, rows=rows, **kw), want, fp8, NAMES)
    got = B.fp8_block_quantize(x.to(DEVICE), rows=rows.to(DEVICE), **kw)
    assert_all_same(got, want, fp8, NAMES)
    none = B.fp8_block_quantize(x[:0].to(DEVICE), rows=torch.full((128,), -1, device=DEVICE),
                                **kw)
    assert_all_same(none, ref.fp8_block_quantize(x.new_zeros(128, 256), **kw), fp8, NAMES)


@pytest.mark.parametrize("dim", [1, 2])
@pytest.mark.parametrize("rw", [True, False])
@pytest.mark.parametrize("groups,k", [(3, 256), (1, 200), (2, 130)])
def test_column_groups_transpose_each_group_on_its_own(dim, rw, groups, k):
    """``groups``: the columnwise bytes of each group of rows (an expert's weight) transposed on
    their own, ``[E, K, M / E]``, the same bytes and scales as the whole ``[K, M]``'s columns of
    that group; ragged columns; through a row index too (1D only: 2D weights are read whole)."""
    x = make_input(groups * 128, k, torch.bfloat16, seed=11)
    kw = dict(fp8_dtype=DType.E4M3, block_scaling_dim=dim, force_pow_2_scales=True,
              amax_epsilon=0.0, rowwise=rw, columnwise=True)
    whole = ref.fp8_block_quantize(x, **kw)
    want = (*whole[:2], whole[2].view(k, groups, 128).transpose(0, 1).contiguous(), whole[3])
    assert_all_same(ref.fp8_block_quantize(x, groups=groups, **kw), want, DType.E4M3, NAMES)
    assert_all_same(B.fp8_block_quantize(x.to(DEVICE), groups=groups, **kw), want, DType.E4M3,
                    NAMES)
    if dim == 1:
        rows = torch.arange(groups * 128 - 1, -1, -1)
        flipped = ref.fp8_block_quantize(x.flip(0), groups=groups, **kw)
        got = B.fp8_block_quantize(x.to(DEVICE), rows=rows.to(DEVICE), groups=groups, **kw)
        assert_all_same(got, flipped, DType.E4M3, NAMES)


@pytest.mark.parametrize("groups", [-1, 3, 5])
def test_column_groups_clear_errors(groups):
    """Groups that do not split the rows into equal groups of whole 128-row blocks."""
    x = make_input(256, 128, torch.bfloat16, seed=2).to(DEVICE)
    kw = dict(fp8_dtype=DType.E4M3, block_scaling_dim=2, force_pow_2_scales=True,
              amax_epsilon=0.0, rowwise=False, columnwise=True)
    for impl in (B.fp8_block_quantize, ref.fp8_block_quantize):
        with pytest.raises(ValueError, match="groups must be 0 or split the 256 rows"):
            impl(x, groups=groups, **kw)


def test_gathered_rows_clear_errors():
    x = make_input(16, 128, torch.bfloat16, seed=1).to(DEVICE)
    kw = dict(fp8_dtype=DType.E4M3, block_scaling_dim=1, force_pow_2_scales=True,
              amax_epsilon=0.0, rowwise=True, columnwise=False)
    for impl in (B.fp8_block_quantize, ref.fp8_block_quantize):
        with pytest.raises(TypeError, match="rows must be a 1D int32/int64"):
            impl(x, rows=torch.zeros(4, dtype=torch.float32, device=DEVICE), **kw)


class _Allocations(torch.utils._python_dispatch.TorchDispatchMode):
    """Counts the fills launched and fills every fp32 ``empty`` with NaN, so that a scale
    entry the kernel leaves unwritten differs from the reference's."""

    FILLS = {torch.ops.aten.zeros.default, torch.ops.aten.zero_.default,
             torch.ops.aten.fill_.Scalar, torch.ops.aten.new_zeros.default}

    def __init__(self):
        super().__init__()
        self.fills = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        self.fills += func in self.FILLS
        if func is torch.ops.aten.empty.memory_format and out.dtype == torch.float32:
            out.fill_(float("nan"))
        return out


@pytest.mark.parametrize("dim", [1, 2])
@pytest.mark.parametrize("shape", [(256, 512), (200, 300), (130, 140), (7, 1100)])
def test_scale_layouts_are_filled_only_where_they_pad(dim, shape):
    """The scale-inverse layouts hold the reference's bytes even where their memory starts as
    NaN, and are zero-filled only where they pad (1x128: the rows, or columns, to a multiple
    of 4; 128x128: the blocks): a layout without padding costs no fill launch."""
    x = make_input(*shape, torch.bfloat16, seed=9)
    kw = dict(fp8_dtype=DType.E4M3, block_scaling_dim=dim, force_pow_2_scales=False,
              amax_epsilon=0.0, rowwise=True, columnwise=True)
    with _Allocations() as mode:
        got = B.fp8_block_quantize(x.to(DEVICE), **kw)
    assert_all_same(got, ref.fp8_block_quantize(x, **kw), DType.E4M3, NAMES)
    m, k = shape
    padded = ([m, k] if dim == 1 else [-(-k // 128), -(-m // 128)])
    assert mode.fills == sum(n % 4 != 0 for n in padded)
