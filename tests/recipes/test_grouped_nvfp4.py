"""NVFP4's grouped GEMMs (quant_recipes.moe.nvfp4_gemm): a layer's three GEMMs take
``"nvfp4_grouped_gemm"`` where it applies and equal the per-group path (the dense Linear's
quantize calls and GEMMs on each padded group) up to the order of the fp32 sums; with
stochastic rounding they draw one stream over all groups.

On the CPU the path runs on the reference backend (whose definitions the kernels are held to in
tests/kernels/test_nvfp4_grouped*.py) and, under ``TRITON_INTERPRET=1``, on the Triton kernels
through the interpreter. That nothing is read on the host:
tests/recipes/test_grouped_host_reads.py."""

from __future__ import annotations

import pytest
import quant_recipes as qr
import torch
from _alive import log_alive_at, track_first_output
from quant_core import NVFP4Quantizer, backends
from quant_recipes.moe import nvfp4_gemm

E, K, N = 4, 64, 96
COUNTS = [0, 37, 1, 50]  # an empty group, a group of one row, groups past one 16-row block
RNE = qr.NVFP4BlockScaling(disable_stochastic_rounding=True)


@pytest.fixture
def on_cpu(monkeypatch):
    monkeypatch.setattr(nvfp4_gemm, "DEVICES", {"cpu"})


def _step(recipe, counts=COUNTS, seed=0):
    torch.manual_seed(0)
    m = qr.GroupedLinear(len(counts), K, N, dtype=torch.bfloat16)
    x = (torch.randn(sum(counts), K) * torch.logspace(-2, 2, sum(counts))[:, None]).to(
        torch.bfloat16).requires_grad_()
    gy = torch.randn(sum(counts), N, dtype=torch.bfloat16)
    offs = torch.tensor(counts).cumsum(0)
    qr.reset_grouped_gemm_paths()
    torch.manual_seed(seed)
    with qr.autocast(recipe=recipe):
        y = m(x, offs)
    y.backward(gy)
    return (y.detach(), x.grad, m.weight.grad), qr.grouped_gemm_paths()


def _assert_equal_up_to_order(got, want, impl):
    for a, b in zip(got, want, strict=True):
        if impl == "reference":  # the same sums in the same order on the CPU
            assert torch.equal(a, b)
        # the same exact products and factors, summed in another order, one rounding
        torch.testing.assert_close(a, b, rtol=2**-7, atol=1e-5)


def _per_group(recipe, monkeypatch):
    monkeypatch.setattr(nvfp4_gemm, "DEVICES", set())
    with backends.using("reference"):
        want, paths = _step(recipe)
    assert paths == {"per_group": 3}
    return want


def test_every_gemm_one_launch_equal_to_the_per_group_path(on_cpu, impl, monkeypatch):
    got, paths = _step(RNE)
    assert paths == {"nvfp4_grouped_gemm": 3}
    _assert_equal_up_to_order(got, _per_group(RNE, monkeypatch), impl)


def test_1x16_weights_and_no_rht_too(on_cpu, impl, monkeypatch):
    recipe = qr.NVFP4BlockScaling(disable_stochastic_rounding=True, disable_rht=True,
                                  disable_2d_quantization=True)
    got, paths = _step(recipe)
    assert paths == {"nvfp4_grouped_gemm": 3}
    _assert_equal_up_to_order(got, _per_group(recipe, monkeypatch), impl)


def test_stochastic_rounding_one_stream_over_the_groups(on_cpu, impl, monkeypatch):
    recipe = qr.NVFP4BlockScaling()
    (y, dx, dw), paths = _step(recipe)
    assert paths == {"nvfp4_grouped_gemm": 3}
    again, _ = _step(recipe)
    assert all(torch.equal(a, b) for a, b in zip((y, dx, dw), again, strict=True))
    other, _ = _step(recipe, seed=1)
    assert not torch.equal(dx, other[1])  # the gradient's random bytes follow torch's seed
    y_rne, dx_rne, dw_rne = _per_group(RNE, monkeypatch)
    assert torch.equal(y, y_rne.to(y.dtype)) or torch.allclose(y, y_rne, rtol=2**-7, atol=1e-5)
    for a, b in ((dx, dx_rne), (dw, dw_rne)):  # unbiased rounding: close to round-to-nearest
        assert (a.float() - b.float()).norm() <= 0.25 * b.float().norm()



def test_falls_back_where_the_path_does_not_apply(on_cpu, monkeypatch):
    with backends.using("reference"):
        _, paths = _step(qr.NVFP4BlockScaling(backward_override="high_precision"))
        assert "per_group" in paths and paths.get("nvfp4_grouped_gemm") == 1
        _, paths = _step(qr.NVFP4BlockScaling(nvfp4_4over6="weights"))
        assert paths == {"per_group": 3}


@pytest.mark.parametrize("tiles", [True, False], ids=["16x16", "1x16"])
def test_transposed_experts_equal_quantizing_each_transpose(impl, tiles):
    """The input gradient's weight operand, from the columnwise copy of the weight's one
    quantize: the bytes, scales (their padding zero) and amaxes of quantizing each ``wᵀ``."""
    torch.manual_seed(0)
    w = torch.randn(3, N, K, dtype=torch.bfloat16) * torch.tensor([1e-3, 1.0, 300.0])[
        :, None, None]
    qw = NVFP4Quantizer(with_2d_quantization=tiles)
    want = nvfp4_gemm._experts(w.transpose(1, 2), qw)
    got = nvfp4_gemm._experts_t(w, qw)
    assert got[0].is_contiguous()
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape and torch.equal(a, b)


def test_the_input_gradients_operands_are_released_before_the_weight_gradient(on_cpu,
                                                                            monkeypatch):
    """The weight's transposed FP4 bytes and the gradient's rowwise bytes are released once the
    input gradient is made, before the weight gradient quantizes the input and makes its
    ``[E, N, K]`` output."""
    made = []
    track_first_output(monkeypatch, nvfp4_gemm, "_experts_t", made)
    # the output gradient, quantized in both layouts at once
    track_first_output(monkeypatch, nvfp4_gemm, "_quantize", made,
                       lambda t, grp, groups, q, rowwise, columnwise: rowwise and columnwise)
    with backends.using("reference"):
        alive = log_alive_at(monkeypatch, backends.get(None, torch.device("cpu")),
                             "nvfp4_grouped_tokens_gemm", made)
        _, paths = _step(RNE)
    assert paths == {"nvfp4_grouped_gemm": 3}
    assert len(made) == 2 and alive == [[False, False]]
