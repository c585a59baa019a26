"""FP8 block scaling's grouped GEMMs on FP8 tensor cores (quant_recipes.moe.fp8_block_gemm):
a layer's three GEMMs take ``"fp8_block_grouped_gemm"`` where it applies and equal the per-group
path (the dense Linear's GEMMs on each padded group) up to the
order of the fp32 sums.

On the CPU the path runs on the reference backend (whose definitions the kernels are held to in
tests/kernels/test_fp8_block_grouped_gemm.py) and, under ``TRITON_INTERPRET=1``, on the Triton
kernels through the interpreter. That nothing is read on the host:
tests/recipes/test_grouped_host_reads.py."""

from __future__ import annotations

import pytest
import quant_recipes as qr
import torch
from _alive import log_alive_at, track_first_output
from quant_core import Float8BlockQuantizer, backends
from quant_core.dtypes import DType
from quant_recipes.moe import fp8_block_gemm

E, K, N = 4, 256, 384
COUNTS = [0, 37, 1, 200]  # an empty group, a group of one row, one of more than a block


@pytest.fixture
def on_cpu(monkeypatch):
    monkeypatch.setattr(fp8_block_gemm, "DEVICES", {"cpu"})


def _data(counts=COUNTS, n=N):
    torch.manual_seed(0)
    m = qr.GroupedLinear(len(counts), K, n, dtype=torch.bfloat16)
    x = (torch.randn(sum(counts), K) * torch.logspace(-2, 2, sum(counts))[:, None]).to(
        torch.bfloat16)
    return m, x, torch.randn(sum(counts), n, dtype=torch.bfloat16)


def _step(recipe, counts=COUNTS, n=N):
    m, x, gy = _data(counts, n)
    x.requires_grad_()
    offs = torch.tensor(counts).cumsum(0)
    qr.reset_grouped_gemm_paths()
    with qr.autocast(recipe=recipe):
        y = m(x, offs)
    y.backward(gy)
    return (y.detach(), x.grad, m.weight.grad), qr.grouped_gemm_paths()


def _assert_within_the_accumulation_bound(got, want):
    """Per output of ``(y, dx, dw)``: ``|Δ| <= 2^-7 |want| + (n + 2) 2^-24 (1 + 2^-4)^2 S``,
    ``S`` the sum of the products' magnitudes over the contraction of length ``n`` (each FP8
    element within ``2^-4`` of its value): the same exact products summed in another order,
    then one bf16 rounding each."""
    m, x, gy = _data()
    w, xa, ga, s = m.weight.double().abs(), x.double().abs(), gy.double().abs(), 0
    mags = ([], [], [])
    for g, c in enumerate(COUNTS):
        mags[0].append(xa[s:s + c] @ w[g].T)
        mags[1].append(ga[s:s + c] @ w[g])
        mags[2].append(ga[s:s + c].T @ xa[s:s + c])
        s += c
    sizes = (K, N, max(COUNTS))
    for name, a, b, mag, n in zip(("y", "dx", "dw"), got, want,
                                  (torch.cat(mags[0]), torch.cat(mags[1]), torch.stack(mags[2])),
                                  sizes, strict=True):
        err = (a.double() - b.double()).abs()
        bound = 2**-7 * b.double().abs() + (n + 2) * 2**-24 * (1 + 2**-4) ** 2 * mag
        assert bool((err <= bound).all()), f"{name}: {float((err - bound).max())} over the bound"


def test_every_gemm_one_block_scaled_launch_equal_to_the_per_group_path(on_cpu, impl,
                                                                        monkeypatch):
    got, paths = _step(qr.Float8BlockScaling())
    assert paths == {"fp8_block_grouped_gemm": 3}
    monkeypatch.setattr(fp8_block_gemm, "DEVICES", set())
    with backends.using("reference"):
        want, want_paths = _step(qr.Float8BlockScaling())
    assert want_paths == {"per_group": 3}
    _assert_within_the_accumulation_bound(got, want)



@pytest.mark.parametrize("recipe, n, want", [
    # a width that splits a weight block
    (lambda: qr.Float8BlockScaling(), 200, {"per_group": 3}),
    # fp32 scales: the block scalings would round
    (lambda: qr.Float8BlockScaling(use_f32_scales=True), N, {"per_group": 3}),
    # backward reads rowwise forms transposed: only the forward GEMM takes the path
    (lambda: qr.Float8BlockScaling(backward_override="dequantized"), N,
     {"fp8_block_grouped_gemm": 1, "per_group": 2}),
])
def test_other_layouts_keep_the_other_paths(on_cpu, recipe, n, want):
    _, paths = _step(recipe(), n=n)
    assert paths == want


def test_groups_padded_to_fewer_rows_than_a_block_keep_the_per_group_path(on_cpu):
    """A ``CustomRecipe`` padding groups to 16 rows: a 128-row block would cross groups."""
    from quant_core import Float8BlockQuantizer

    def factory(role):
        dim = 2 if role is not None and role.tensor_type == "weight" else 1
        return Float8BlockQuantizer(block_scaling_dim=dim)

    _, paths = _step(qr.CustomRecipe(qfactory=factory, quantization_alignment=16))
    assert paths == {"per_group": 3}


def test_transposed_experts_are_the_transposed_bytes_and_scales(impl):
    """The input gradient's weight operand: each expert's columnwise copy, the transpose of its
    rowwise bytes and 128x128 scales (what ``_experts`` gives, transposed)."""
    torch.manual_seed(0)
    w = torch.randn(3, 256, 384, dtype=torch.bfloat16) * torch.tensor([1e-3, 1.0, 300.0])[
        :, None, None]
    qw = Float8BlockQuantizer(DType.E4M3, block_scaling_dim=2)
    wd, sw = fp8_block_gemm._experts(w, qw)
    wt, swt = fp8_block_gemm._experts_t(w, qw)
    assert wt.is_contiguous() and torch.equal(wt, wd.transpose(1, 2))
    assert torch.equal(swt, sw.transpose(1, 2))


def test_transposed_experts_are_the_quantize_output_itself(impl, monkeypatch):
    """The input gradient's weight operand is the bytes one quantize writes, each expert's rows
    transposed on their own (the backend's column groups): no ``[K, E·N]`` copy made first and
    then moved, which held the weight's FP8 bytes twice at a Mixtral layer's input gradient."""
    torch.manual_seed(2)
    w = torch.randn(3, 256, 384, dtype=torch.bfloat16)
    qw = Float8BlockQuantizer(DType.E4M3, block_scaling_dim=2)
    be = backends.get(None, w.device)
    made, real = [], be.fp8_block_quantize
    monkeypatch.setattr(be, "fp8_block_quantize",
                        lambda *a, **kw: made.append(real(*a, **kw)) or made[-1])
    wt, _ = fp8_block_gemm._experts_t(w, qw)
    assert len(made) == 1 and wt.data_ptr() == made[0][2].data_ptr()
    assert wt.shape == (3, 384, 256) and wt.is_contiguous()


def test_no_padded_copy_of_any_operand(on_cpu, impl, monkeypatch):
    """1x128 blocks: the forward GEMM reads each group's rows in place, and backward's padded
    operands (the gradient's and the input's column blocks) are quantized through the layout's
    row index: no padded copy is made."""
    calls = []
    real = fp8_block_gemm.fp8.padded
    monkeypatch.setattr(fp8_block_gemm.fp8, "padded",
                        lambda t, lay, *rows: calls.append(t.shape[1]) or real(t, lay, *rows))
    _, paths = _step(qr.Float8BlockScaling())
    assert paths == {"fp8_block_grouped_gemm": 3}
    assert calls == []


def test_the_input_gradients_operands_are_released_before_the_weight_gradient(on_cpu,
                                                                            monkeypatch):
    """The weight's transposed bytes and the gradient's rowwise bytes are released once the
    input gradient is made, before the weight gradient quantizes the input and makes its
    ``[E, N, K]`` output (at a Mixtral layer's gate/up: 0.875 GiB of weight bytes and 0.44 GiB
    of gradient bytes)."""
    made = []
    track_first_output(monkeypatch, fp8_block_gemm, "_experts_t", made)
    # the output gradient's rowwise bytes
    track_first_output(monkeypatch, fp8_block_gemm, "_padded_rows", made,
                       lambda q, t, lay, rowwise, *_: rowwise and t.shape[1] == N)
    with backends.using("reference"):
        alive = log_alive_at(monkeypatch, backends.get(None, torch.device("cpu")),
                             "fp8_block_grouped_tokens_gemm", made)
        _, paths = _step(qr.Float8BlockScaling())
    assert paths == {"fp8_block_grouped_gemm": 3}
    assert len(made) == 2 and alive == [[False, False]]
