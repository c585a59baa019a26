"""The Blackwell (sm_100+) routes of MXFP8 and NVFP4 GEMMs through ``F.scaled_mm``'s block
scaling: the routing decision, the arguments against torch's own shape contract (its meta
kernel checks the scales' dtype, count and swizzle), the scale layout, and the fallback. No
Blackwell GPU runs here: ``quant doctor`` says the routes are not verified."""

from __future__ import annotations

import pytest
import quant_core as qc
import torch
from quant_recipes import gemm_fast

QUANTIZERS = {"mxfp8": qc.MXFP8Quantizer, "nvfp4": qc.NVFP4Quantizer}
BLOCK = {"mxfp8": 32, "nvfp4": 16}


def _torch_has_block_scaling() -> bool:
    f = torch.nn.functional
    return (hasattr(f, "scaled_mm") and hasattr(getattr(f, "ScalingType", None), "BlockWise1x32")
            and hasattr(torch, "float4_e2m1fn_x2") and hasattr(torch, "float8_e8m0fnu"))


needs_api = pytest.mark.skipif(not _torch_has_block_scaling(),
                               reason="this torch has no MX/NVFP4 block scaling in F.scaled_mm")


@pytest.fixture
def gpu(monkeypatch):
    def set_capability(cap):
        monkeypatch.setattr(gemm_fast, "_cuda_capability",
                            lambda device: cap if device.type == "cuda" else None)
    return set_capability


def _operands(fmt, rows=(128, 64), k=128, swizzled=False):
    q = QUANTIZERS[fmt](internal=True, optimize_for_gemm=swizzled)
    g = torch.Generator().manual_seed(0)
    a = q.quantize(torch.randn(rows[0], k, generator=g, dtype=torch.bfloat16))
    b = q.quantize(torch.randn(rows[1], k, generator=g, dtype=torch.bfloat16))
    return a.gemm_operand(False), b.gemm_operand(False)


@needs_api
def test_blackwell_routes_mx_and_nvfp4_to_cublas_and_says_they_are_not_verified(gpu):
    gpu((10, 0))
    routes = {r.format: r for r in gemm_fast.routes("cuda")}
    for fmt in ("mxfp8", "nvfp4"):
        assert routes[fmt].path == f"scaled_mm_{fmt}" and routes[fmt].available
        assert routes[fmt].note.startswith(gemm_fast.NOT_VERIFIED)
    gpu((9, 0))
    routes = {r.format: r for r in gemm_fast.routes("cuda")}
    assert all(not routes[f].path.startswith("scaled_mm_") for f in ("mxfp8", "nvfp4"))


def test_hopper_and_the_cpu_give_the_reason(gpu):
    gpu((9, 0))
    assert "need sm_100+" in gemm_fast._native_block_problem(torch.device("cuda"))
    assert gemm_fast._native_block_problem(torch.device("cpu")) == (
        "no MXFP8/NVFP4 tensor cores on cpu")


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
@pytest.mark.parametrize("transposed", [False, True])
def test_unswizzled_scales_are_padded_and_swizzled_into_the_storages_own_layout(fmt, transposed):
    """The route swizzles a plain scale matrix into exactly the bytes a storage quantized with
    optimize_for_gemm=True holds (the layout cuBLAS reads), for row and transposed operands."""
    x = torch.randn(96, 128, generator=torch.Generator().manual_seed(1), dtype=torch.bfloat16)
    plain = QUANTIZERS[fmt](internal=True).quantize(x).gemm_operand(transposed)
    swz = QUANTIZERS[fmt](internal=True, optimize_for_gemm=True).quantize(x).gemm_operand(
        transposed)
    assert swz.swizzled and not plain.swizzled
    got = gemm_fast.swizzled_scale(plain, BLOCK[fmt])
    assert torch.equal(got, gemm_fast.swizzled_scale(swz, BLOCK[fmt]))


def _on_meta(op):
    fields = {f: getattr(op, f) for f in op.__dataclass_fields__}
    for name in ("data", "scale", "amax"):
        if fields[name] is not None:
            fields[name] = fields[name].to("meta")
    return type(op)(**fields)


@needs_api
@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
@pytest.mark.parametrize("swizzled", [False, True])
def test_the_arguments_satisfy_torchs_scaled_mm_contract(fmt, swizzled, monkeypatch):
    """torch's meta kernel of ``F.scaled_mm`` checks the scales' dtype, element count
    (``roundup(rows, 128) * roundup(ceil(K / block), 4)``) and swizzle: the route's arguments,
    on meta tensors, pass it and give the output's shape and dtype."""
    monkeypatch.setattr(gemm_fast, "_native_block_problem", lambda device: None)
    ra, rb = _operands(fmt, swizzled=swizzled)
    gemm = {"mxfp8": gemm_fast._native_mxfp8, "nvfp4": gemm_fast._native_nvfp4}[fmt]
    out = gemm(_on_meta(ra), _on_meta(rb), None, torch.bfloat16)
    assert out.shape == (128, 64) and out.dtype == torch.bfloat16 and out.device.type == "meta"


@pytest.mark.parametrize("fmt", ["mxfp8", "nvfp4"])
def test_operands_the_route_does_not_take_fall_back_to_the_next_path(fmt, monkeypatch):
    """Rows that are not a multiple of 16: the block-scaled route declines (it would not call
    cuBLAS) and ``fast_gemm`` takes the format's next path, here the CPU's."""
    monkeypatch.setattr(gemm_fast, "_native_block_problem", lambda device: None)

    def refuse(*args, **kwargs):
        raise AssertionError("F.scaled_mm must not be called for unaligned operands")

    monkeypatch.setattr(gemm_fast.F, "scaled_mm", refuse, raising=False)
    ra, rb = _operands(fmt, rows=(24, 64))
    out, path = gemm_fast.fast_gemm(ra, rb, None, torch.float32)
    assert out.shape == (24, 64) and not path.startswith("scaled_mm_")
