"""A mixture-of-experts step reads nothing on the host: no group bound, no count, no check
(each would stall the host once per GEMM on a GPU and keep the step out of a CUDA graph).

On the CPU, with the grouped GEMMs on their batched paths: FP8 current scaling through the
Triton backend's grouped kernels (``OWN_KERNEL_MIN_EXPERTS`` 0; the interpreter stands in for
the GPU; the reference backend's grouped GEMM is a definition that reads the bounds), FP8 blocks
and NVFP4 through their grouped kernels the same way (with expert biases too), MXFP8 and FP8
blocks through ``torch._grouped_mm``."""

from __future__ import annotations

import contextlib
import os

import pytest
import quant_recipes as qr
import torch
from _host_reads import HostReads
from installed import require_triton_backend
from quant_core import backends
from quant_recipes.moe import fp8_block_gemm, nvfp4_gemm
from quant_recipes.moe import fp8_gemm as grouped_fp8_gemm
from quant_recipes.moe import gemm as grouped_gemm

COUNTS = [0, 37, 1, 90]
K, N = 128, 256


def _step(recipe, offs, bias=False):
    torch.manual_seed(0)
    m = qr.GroupedLinear(len(COUNTS), K, N, bias=bias, dtype=torch.bfloat16)
    x = torch.randn(sum(COUNTS), K, dtype=torch.bfloat16, requires_grad=True)
    gy = torch.randn(sum(COUNTS), N, dtype=torch.bfloat16)
    with HostReads() as reads:
        with qr.autocast(recipe=recipe) if recipe is not None else contextlib.nullcontext():
            y = m(x, offs)
        y.backward(gy)
    return reads.reads


def _grouped_mm_on_cpu(monkeypatch):
    monkeypatch.setattr(grouped_gemm, "GROUPED_MM_DEVICES", {"cpu", "cuda"})
    if not grouped_gemm.grouped_mm_available("cpu"):
        pytest.skip("torch._grouped_mm does not run on this CPU")


@pytest.mark.parametrize("recipe", ["mxfp8", "fp8_block"])
def test_block_recipes_read_nothing_on_the_host(monkeypatch, recipe):
    _grouped_mm_on_cpu(monkeypatch)
    offs = torch.tensor(COUNTS).cumsum(0)
    qr.reset_grouped_gemm_paths()
    # offs on the CPU are checked on the CPU (no device to wait for): a GPU checks on the device
    monkeypatch.setattr(qr.GroupedLinear, "offsets", lambda self, x, offs, counts: offs)
    assert _step(qr.recipe(recipe), offs) == []
    assert qr.grouped_gemm_paths() == {"grouped_mm": 3}


def test_the_host_read_detector_sees_the_per_group_path(monkeypatch):
    """The detector fails where it should: the per-group path reads the group bounds."""
    monkeypatch.setattr(qr.GroupedLinear, "offsets", lambda self, x, offs, counts: offs)
    reads = _step(qr.recipe("mxfp8"), torch.tensor(COUNTS).cumsum(0))
    assert reads and any("tolist" in r for r in reads)


ON_KERNELS = pytest.mark.skipif(
    os.environ.get("TRITON_INTERPRET") != "1",
    reason="the grouped kernels run here through Triton's interpreter (TRITON_INTERPRET=1)")


@ON_KERNELS
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("recipe, route, path", [
    ("fp8_block", fp8_block_gemm, "fp8_block_grouped_gemm"),
    ("nvfp4", nvfp4_gemm, "nvfp4_grouped_gemm")])
def test_block_scaled_grouped_kernels_read_nothing_on_the_host(monkeypatch, recipe, route, path,
                                                              bias):
    require_triton_backend()
    monkeypatch.setattr(route, "DEVICES", {"cpu", "cuda"})
    monkeypatch.setattr(qr.GroupedLinear, "offsets", lambda self, x, offs, counts: offs)
    qr.reset_grouped_gemm_paths()
    with backends.using("triton"):
        assert _step(qr.recipe(recipe), torch.tensor(COUNTS).cumsum(0), bias) == []
    assert qr.grouped_gemm_paths() == {path: 3}


@ON_KERNELS
@pytest.mark.parametrize("bias", [False, True])
def test_fp8_current_reads_nothing_on_the_host(monkeypatch, bias):
    """With the default routes, also in a layer of a few experts (HYBRID's E5M2 gradients)."""
    require_triton_backend()
    monkeypatch.setattr(grouped_fp8_gemm, "SCALED_GROUPED_MM_DEVICES", {"cpu", "cuda"})
    monkeypatch.setattr(grouped_fp8_gemm, "_runs", lambda device_type, dtype: False)
    monkeypatch.setattr(qr.GroupedLinear, "offsets", lambda self, x, offs, counts: offs)
    qr.reset_grouped_gemm_paths()
    with backends.using("triton"):
        assert _step(qr.recipe("fp8_current"), torch.tensor(COUNTS).cumsum(0), bias) == []
    assert qr.grouped_gemm_paths() == {"fp8_grouped_gemm": 3}


@ON_KERNELS
@pytest.mark.parametrize("recipe", ["mxfp8", None])
def test_a_biased_grouped_mm_layer_reads_nothing_on_the_host(monkeypatch, recipe):
    """The forward GEMM with a bias on the backend's grouped rows GEMM (MXFP8, and the
    high-precision layer outside autocast), the backward on ``torch._grouped_mm``."""
    require_triton_backend()
    _grouped_mm_on_cpu(monkeypatch)
    monkeypatch.setattr(qr.GroupedLinear, "offsets", lambda self, x, offs, counts: offs)
    qr.reset_grouped_gemm_paths()
    with backends.using("triton"):
        assert _step(recipe and qr.recipe(recipe), torch.tensor(COUNTS).cumsum(0), True) == []
    assert qr.grouped_gemm_paths() == {"decoded_grouped_gemm": 1, "grouped_mm": 2}
