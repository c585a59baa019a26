"""Per-tensor FP8 (current and delayed scaling) against the reference, bitwise."""

from __future__ import annotations

import pytest
import torch
from _kernels_util import DEVICE, assert_all_same, assert_same, make_input
from quant_core import reference as ref
from quant_core.dtypes import DType
from quant_core.kernel_capture import capture
from quant_kernels._common import fp8_data
from quant_kernels.backend import BACKEND as B

SHAPES = [(70, 96), (5, 33), (0, 64)]


@pytest.mark.parametrize("fp8", [DType.E4M3, DType.E5M2])
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("eps", [0.0, 1e-3])
def test_current_scale(fp8, pow2, eps):
    for v in (0.0, 1e-30, 1e-4, 0.3, 448.0, 3e38, float("inf"), float("nan"), 2.0**-149):
        a = torch.tensor([v])
        kw = dict(fp8_dtype=fp8, force_pow_2_scales=pow2, amax_epsilon=eps)
        assert_same(B.current_scale(a.to(DEVICE), **kw), ref.current_scale(a, **kw), what=str(v))


def test_amax_persistent_loop():
    x = make_input(300, 96, torch.bfloat16, seed=4)  # 7 tiles over 2 programs: loops
    assert_same(B.amax(x.to(DEVICE)), ref.amax(x))


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_amax(shape, dtype):
    x = make_input(*shape, dtype, seed=1)
    assert_same(B.amax(x.to(DEVICE)), ref.amax(x))


@pytest.mark.parametrize("fp8", [DType.E4M3, DType.E5M2])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_current_scaling(fp8, shape, dtype):
    x = make_input(*shape, dtype, seed=2)
    a = B.amax(x.to(DEVICE))
    scale = B.current_scale(a, fp8_dtype=fp8, force_pow_2_scales=False, amax_epsilon=0.0)
    for rw, cw in ((True, True), (False, True)):
        got = B.fp8_quantize(x.to(DEVICE), scale, fp8_dtype=fp8, rowwise=rw, columnwise=cw)
        want = ref.fp8_quantize(x, scale.cpu(), fp8_dtype=fp8, rowwise=rw, columnwise=cw)
        assert_all_same(got, want, fp8, ("data", "transpose", "scale_inv"))
    for d in (torch.float32, torch.bfloat16, torch.float16):
        assert_same(B.fp8_dequantize(got[1].to(DEVICE), got[2], fp8_dtype=fp8, dtype=d),
                    ref.fp8_dequantize(want[1], want[2], fp8_dtype=fp8, dtype=d))


@pytest.mark.parametrize("fp8", [DType.E4M3, DType.E5M2])
@pytest.mark.parametrize("pow2", [False, True])
@pytest.mark.parametrize("eps", [0.0, 1e-3])
@pytest.mark.parametrize("shape", [*SHAPES, (300, 96)])  # (300, 96): partials of 2 programs
def test_fused_current_scaling(fp8, pow2, eps, shape):
    """The two-launch path (amax partials, then a cast that derives the scale per program) gives
    the bytes of the reference's amax -> current_scale -> fp8_quantize."""
    x = make_input(*shape, torch.bfloat16, seed=5)
    kw = dict(fp8_dtype=fp8, force_pow_2_scales=pow2, amax_epsilon=eps)
    for rw, cw in ((True, True), (True, False), (False, True)):
        got = B.fp8_current_quantize(x.to(DEVICE), rowwise=rw, columnwise=cw, **kw)
        want = ref.fp8_current_quantize(x, rowwise=rw, columnwise=cw, **kw)
        assert_all_same(got, want, fp8, ("data", "transpose", "scale_inv"))


@pytest.mark.parametrize("special", [float("nan"), float("inf"), 0.0, 1e-30])
def test_fused_current_scaling_special_amax(special):
    """NaN is dropped from the amax, Inf and 0 give scale 1, a tiny amax meets the epsilon."""
    x = make_input(70, 96, torch.float32, seed=6)
    x = torch.full_like(x, 0.0) + special if special in (0.0, 1e-30) else x
    x[3, 5] = special
    for eps in (0.0, 1e-3):
        kw = dict(fp8_dtype=DType.E4M3, force_pow_2_scales=False, amax_epsilon=eps,
                  rowwise=True, columnwise=True)
        assert_all_same(B.fp8_current_quantize(x.to(DEVICE), **kw),
                        ref.fp8_current_quantize(x, **kw), DType.E4M3,
                        ("data", "transpose", "scale_inv"))


@pytest.mark.parametrize("given", [0.0, 1e-30, 3.5, 1e5, float("inf"), float("nan")])
@pytest.mark.parametrize("fp8", [DType.E4M3, DType.E5M2])
def test_current_scaling_with_a_given_amax(fp8, given):
    """With ``amax_in`` the scale comes from it (an amax reduced over ranks, or forward's),
    not from ``x``: the reference's bytes, values past the format's range saturated; Inf and
    NaN give scale 1, as from x's own amax."""
    x = make_input(70, 96, torch.bfloat16, seed=7)
    amax_in = torch.tensor([given])
    for eps in (0.0, 1e-3):
        kw = dict(fp8_dtype=fp8, force_pow_2_scales=False, amax_epsilon=eps, rowwise=True,
                  columnwise=True)
        got = B.fp8_current_quantize(x.to(DEVICE), amax_in=amax_in.to(DEVICE), **kw)
        want = ref.fp8_current_quantize(x, amax_in=amax_in, **kw)
        assert_all_same(got, want, fp8, ("data", "transpose", "scale_inv"))
        scale = ref.current_scale(amax_in, fp8_dtype=fp8, force_pow_2_scales=False,
                                  amax_epsilon=eps)
        assert_all_same(want, ref.fp8_quantize(x, scale, fp8_dtype=fp8, rowwise=True,
                                               columnwise=True), fp8,
                        ("data", "transpose", "scale_inv"))


@pytest.mark.parametrize("scale", [1.0, 0.3, 2.0**-20, 3e5])
def test_delayed_scaling_accumulates_amax(scale):
    x = make_input(40, 64, torch.bfloat16, seed=3)
    s = torch.tensor([scale])
    for prior in (0.0, 1e30):
        got_amax = torch.tensor([prior], device=DEVICE)
        want_amax = torch.tensor([prior])
        got = B.fp8_quantize(x.to(DEVICE), s.to(DEVICE), fp8_dtype=DType.E4M3, rowwise=True,
                             columnwise=False, amax_out=got_amax)
        want = ref.fp8_quantize(x, s, fp8_dtype=DType.E4M3, rowwise=True, columnwise=False,
                                amax_out=want_amax)
        assert_all_same(got, want, DType.E4M3, ("data", "transpose", "scale_inv"))
        assert_same(got_amax, want_amax)


def test_fp8_data_is_a_torch_fp8_buffer_when_recorded():
    """Recorded into a graph the kernels write a torch FP8 buffer, and storages get a uint8 view
    of it (the GEMM's FP8 view is then the buffer itself); eager launches write uint8 buffers."""
    dev = torch.device(DEVICE)
    arg, data = fp8_data((3, 32), DType.E5M2, dev)
    assert arg.dtype == data.dtype == torch.uint8 and arg is data
    with capture():
        arg, data = fp8_data((3, 32), DType.E5M2, dev)
    assert (arg.dtype, data.dtype) == (torch.float8_e5m2, torch.uint8)
    assert data.untyped_storage().data_ptr() == arg.untyped_storage().data_ptr()


@pytest.mark.parametrize("fp8", [DType.E4M3, DType.E5M2])
@pytest.mark.parametrize("rw,cw", [(True, True), (True, False), (False, True)])
def test_recorded_cast_stores_reference_bytes(fp8, rw, cw):
    """Kernels storing through torch FP8 pointers (recorded launches; eager here, since a launch
    outside a trace runs) write the reference's bytes, rowwise and transposed."""
    x = make_input(300, 96, torch.bfloat16, seed=7)
    kw = dict(fp8_dtype=fp8, force_pow_2_scales=False, amax_epsilon=0.0, rowwise=rw,
              columnwise=cw)
    with capture():
        got = B.fp8_current_quantize(x.to(DEVICE), **kw)
    assert all(t is None or t.dtype == torch.uint8 for t in got[:2])
    assert_all_same(got, ref.fp8_current_quantize(x, **kw), fp8,
                    ("data", "transpose", "scale_inv"))
