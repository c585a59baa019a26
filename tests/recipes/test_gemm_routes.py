"""``gemm_fast.routes``: per operand format, the GEMM route on a device, built from the table
``fast_gemm`` dispatches on; the path it names is the one ``fast_gemm`` records."""

from __future__ import annotations

import formats
import pytest
import torch
from installed import TRITON_BACKEND
from quant_core import backends
from quant_recipes import gemm_fast

#: format -> its default quantizer (tests/formats.py)
QUANTIZERS = {fmt: make() for fmt, make in formats.default_quantizers(key="name").items()}


@pytest.fixture
def gpu(monkeypatch):
    """Pretend the CUDA device has compute capability ``cap`` (the probes read it, nothing
    launches)."""
    def set_capability(cap):
        monkeypatch.setattr(gemm_fast, "_cuda_capability",
                            lambda device: cap if device.type == "cuda" else None)
    return set_capability


def _by_format(device):
    return {r.format: r for r in gemm_fast.routes(device)}


def test_one_route_per_format_of_the_dispatch_table():
    assert [r.format for r in gemm_fast.routes("cpu")] == list(gemm_fast._PATHS)
    assert set(gemm_fast._PATHS) == set(QUANTIZERS)


@pytest.mark.parametrize("fmt", list(QUANTIZERS))
def test_the_route_names_the_path_fast_gemm_records(fmt):
    """On the CPU: the path ``fast_gemm`` takes (or ``None``, emulated by the caller) is the
    route's."""
    backends._choice_cache.clear()
    q = QUANTIZERS[fmt]
    x = q.quantize(torch.randn(128, 128)).gemm_operand(False)
    w = q.quantize(torch.randn(128, 128)).gemm_operand(False)
    route = _by_format("cpu")[fmt]
    ran = gemm_fast.fast_gemm(x, w, None, torch.bfloat16)
    assert (ran[1] if ran is not None else "emulated") == route.path
    assert route.available == (route.path != "emulated")
    if not route.available:
        assert route.runs == gemm_fast.EMULATED and route.note  # why, in words


def test_hopper_routes(gpu):
    gpu((9, 0))
    routes = _by_format("cuda")
    assert routes["fp8"].path == "scaled_mm" and routes["fp8"].available
    assert "E5M2" in routes["fp8"].note  # the operands it takes
    if routes["fp8_block"].available:
        assert routes["fp8_block"].path == "scaled_mm_blockwise"
    else:  # a torch without block scaling in F.scaled_mm
        assert "F.scaled_mm" in routes["fp8_block"].note
    if TRITON_BACKEND:
        from quant_kernels import _gemm

        assert routes["mxfp8"].path == "triton_mxfp8" and routes["nvfp4"].path == "triton_nvfp4"
        # the backend says what its GEMMs run: dequantization + cuBLAS on GPUs
        assert routes["mxfp8"].runs == _gemm.IMPLEMENTATIONS[_gemm.default_implementation()]


def test_older_gpus_and_the_reference_backend_are_emulated_with_the_reason(gpu, monkeypatch):
    gpu((8, 9))
    routes = _by_format("cuda")
    assert routes["fp8"].available
    assert not routes["fp8_block"].available and "sm 9.x only" in routes["fp8_block"].note
    gpu((8, 0))
    assert "sm_89+" in _by_format("cuda")["fp8"].note
    monkeypatch.setenv("QUANT_BACKEND", "reference")
    backends._choice_cache.clear()
    try:
        routes = _by_format("cuda")
    finally:
        backends._choice_cache.clear()
    assert routes["mxfp8"].path == routes["nvfp4"].path == "emulated"
    assert "reference backend" in routes["mxfp8"].note


def test_a_bad_quant_backend_is_the_reason_not_an_error(monkeypatch):
    monkeypatch.setenv("QUANT_BACKEND", "bogus")
    backends._choice_cache.clear()
    routes = _by_format("cpu")
    assert "QUANT_BACKEND='bogus'" in routes["nvfp4"].note and not routes["nvfp4"].available
