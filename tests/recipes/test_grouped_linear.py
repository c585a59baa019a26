"""GroupedLinear: each expert group equals the dense quantized Linear on that group's rows, bit
for bit (forward and backward, every built-in recipe), ragged and empty groups, CustomRecipe
roles, fullgraph compile without recompiles, checkpointing, state_dict, deepcopy, wrong inputs.

The oracle is ``qr.Linear`` (tested against the reference elsewhere), run once per group on the
group's rows padded with zero rows to the alignment the contract states (ALIGN below), and, for
recipes whose dense Linear takes any row count and draws no random bits, on the unpadded rows.
"""

from __future__ import annotations

import copy

import formats
import pytest
import quant_recipes as qr
import torch
from quant_core import MXFP8Quantizer
from quant_recipes.identity import IdentityQuantizer
from quant_recipes.moe import gemm as grouped_gemm
from torch.utils.checkpoint import checkpoint

E, K, N = 4, 128, 64
COUNTS = [5, 0, 37, 22]  # ragged, one empty group, none a multiple of a block
#: The row multiple of each recipe's groups (behaviour.md, GroupedLinear).
ALIGN = {"fp8": 16, "fp8_block": 128, "mxfp8": 32, "nvfp4": 16}

RECIPES = {**formats.recipes(),
           "current_dequantized": lambda: qr.Float8CurrentScaling(backward_override="dequantized"),
           "mxfp8_high_precision": lambda: qr.MXFP8BlockScaling(
               backward_override="high_precision")}
#: Recipes whose dense Linear takes any row count and rounds to nearest: padding is invisible.
UNPADDED = {"current": qr.Float8CurrentScaling, "block": qr.Float8BlockScaling,
            "mxfp8": qr.MXFP8BlockScaling,
            "nvfp4_plain": lambda: qr.NVFP4BlockScaling(disable_rht=True,
                                                        disable_stochastic_rounding=True)}


def _align(recipe) -> int:
    if recipe is None:
        return 1
    if recipe.custom():
        return recipe.quantization_alignment
    return ALIGN[formats.format_of(_recipe_id(recipe)).name]


def _recipe_id(recipe) -> str:
    return {qr.Float8CurrentScaling: "current", qr.Float8BlockScaling: "block",
            qr.MXFP8BlockScaling: "mxfp8", qr.NVFP4BlockScaling: "nvfp4"}[type(recipe)]


def _data(counts, dtype=torch.bfloat16, bias=True, seed=0):
    torch.manual_seed(seed)
    m = qr.GroupedLinear(E, K, N, bias=bias, dtype=dtype, name="experts")
    x = torch.randn(sum(counts), K, dtype=dtype)
    gy = torch.randn(sum(counts), N, dtype=dtype)
    dense = [qr.Linear(K, N, bias=bias, dtype=dtype) for _ in range(E)]
    with torch.no_grad():
        for g, d in enumerate(dense):
            d.weight.copy_(m.weight[g])
            if bias:
                d.bias.copy_(m.bias[g])
    return m, x, gy, dense


def _grouped(m, x, gy, counts, recipe, **kw):
    x = x.clone().requires_grad_()
    m.zero_grad(set_to_none=True)
    with qr.autocast(enabled=recipe is not None, recipe=recipe):
        y = m(x, counts=torch.tensor(counts), **kw)
    y.backward(gy)
    return y.detach(), x.grad, m.weight.grad, None if m.bias is None else m.bias.grad


def _dense(dense, x, gy, counts, recipe, align):
    """Per group: the dense Linear on the group's rows padded to ``align``; the real rows."""
    ys, dxs, dws, dbs, s = [], [], [], [], 0
    for d, c in zip(dense, counts, strict=True):
        if c == 0:  # nothing to run: no output rows, zero weight gradient
            dws.append(torch.zeros_like(d.weight))
            dbs.append(None if d.bias is None else torch.zeros_like(d.bias))
            continue
        rows = -(-c // align) * align
        xg = torch.zeros(rows, K, dtype=x.dtype)
        xg[:c] = x[s:s + c]
        xg.requires_grad_()
        gg = torch.zeros(rows, N, dtype=gy.dtype)
        gg[:c] = gy[s:s + c]
        d.zero_grad(set_to_none=True)
        with qr.autocast(enabled=recipe is not None, recipe=recipe):
            yg = d(xg)
        yg.backward(gg)
        ys.append(yg.detach()[:c])
        dxs.append(xg.grad[:c])
        dws.append(d.weight.grad)
        dbs.append(None if d.bias is None else d.bias.grad)
        s += c
    db = None if dbs[0] is None else torch.stack(dbs)
    return torch.cat(ys), torch.cat(dxs), torch.stack(dws), db


def _assert_equal(got, want):
    for name, a, b in zip(("y", "dx", "dw", "db"), got, want, strict=True):
        assert (a is None) == (b is None), name
        if a is not None:
            assert torch.equal(a, b), f"{name}: max diff {(a.float() - b.float()).abs().max()}"


@pytest.mark.parametrize("rid", list(RECIPES))
def test_each_group_equals_the_dense_linear(rid):
    m, x, gy, dense = _data(COUNTS)
    recipe = RECIPES[rid]()
    qr.reset_grouped_gemm_paths()
    torch.manual_seed(7)  # stochastic rounding: one seed per group's gradient, in group order
    got = _grouped(m, x, gy, COUNTS, recipe)
    assert qr.grouped_gemm_paths() == {"per_group": 3}  # fprop, dgrad, wgrad
    torch.manual_seed(7)
    _assert_equal(got, _dense(dense, x, gy, COUNTS, recipe, _align(recipe)))


@pytest.mark.parametrize("rid", list(UNPADDED))
def test_padding_is_invisible(rid):
    m, x, gy, dense = _data(COUNTS)
    recipe = UNPADDED[rid]()
    _assert_equal(_grouped(m, x, gy, COUNTS, recipe), _dense(dense, x, gy, COUNTS, recipe, 1))


@pytest.mark.parametrize("rid", list(UNPADDED))
def test_padding_in_fp32_within_the_accumulation_bound(rid):
    """In fp32 a padded group and the dense Linear on its unpadded rows sum the same products,
    but the CPU's fp32 GEMM picks its kernel, and with it the order of the sums, by the row
    count (which row counts change it depends on the CPU): the emulated GEMMs (one fp32 GEMM of
    the decoded operands) may differ in the last bits, per output within ``(n + 2) 2^-24`` of
    the quantized products' magnitudes. An FP8 element lies within ``2^-4`` of its value, hence
    the ``(1 + 2^-4)^2``; rounding to NVFP4's E2M1 grid at most doubles a magnitude (a value
    just over a quarter of the block's scale rounds to half of it), and its E4M3 block scale
    rounds by at most ``2^-4`` more."""
    m, x, gy, dense = _data(COUNTS, dtype=torch.float32)
    recipe = UNPADDED[rid]()
    growth = 2 * (1 + 2**-4) if rid.startswith("nvfp4") else 1 + 2**-4
    got = _grouped(m, x, gy, COUNTS, recipe)
    want = _dense(dense, x, gy, COUNTS, recipe, 1)
    for name, a, b, (mag, n) in zip(("y", "dx", "dw", "db"), got, want,
                                    _magnitudes(m, x, gy, COUNTS), strict=True):
        err = (a.double() - b.double()).abs()
        bound = (n + 2) * 2**-24 * growth**2 * mag
        assert bool((err <= bound).all()), f"{name}: {float((err - bound).max())} over the bound"


def test_fp32_and_no_bias():
    m, x, gy, dense = _data(COUNTS, dtype=torch.float32, bias=False)
    recipe = qr.MXFP8BlockScaling()
    _assert_equal(_grouped(m, x, gy, COUNTS, recipe), _dense(dense, x, gy, COUNTS, recipe, 32))


def _magnitudes(m, x, gy, counts):
    """Per output of ``(y, dx, dw, db)``: ``(S, n)``, the sum of the products' magnitudes and
    their count (the contraction length), group by group."""
    w, s, parts = m.weight.double().abs(), 0, ([], [], [], [])
    for g, c in enumerate(counts):
        xa, ga = x[s:s + c].double().abs(), gy[s:s + c].double().abs()
        parts[0].append(xa @ w[g].T + m.bias[g].double().abs())
        parts[1].append(ga @ w[g])
        parts[2].append(ga.T @ xa)
        parts[3].append(ga.sum(0))
        s += c
    return ((torch.cat(parts[0]), K + 1), (torch.cat(parts[1]), N),
            (torch.stack(parts[2]), max(counts)), (torch.stack(parts[3]), max(counts)))


def test_outside_autocast_is_the_high_precision_linear():
    """The grouped high-precision GEMMs (fp32 products, one rounding) against the dense bf16
    Linear: the same exact products summed in fp32 in another order (the CPU's bf16 GEMM picks
    its blocking by shape and torch release), then one rounding to bf16, so per output
    ``|Δ| <= 2^-8 |want| + (n + 2) 2^-24 S``."""
    m, x, gy, dense = _data(COUNTS)
    got = _grouped(m, x, gy, COUNTS, None)
    want = _dense(dense, x, gy, COUNTS, None, 1)
    for name, a, b, (mag, n) in zip(("y", "dx", "dw", "db"), got, want,
                                    _magnitudes(m, x, gy, COUNTS), strict=True):
        err = (a.double() - b.double()).abs()
        bound = 2**-8 * b.double().abs() + (n + 2) * 2**-24 * mag
        assert bool((err <= bound).all()), f"{name}: {float((err - bound).max())} over the bound"


def test_offsets_equal_counts():
    m, x, _, _ = _data(COUNTS)
    offs = torch.tensor(COUNTS).cumsum(0).to(torch.int32)
    with torch.no_grad(), qr.autocast(recipe=qr.Float8CurrentScaling()):
        assert torch.equal(m(x, offs), m(x, counts=torch.tensor(COUNTS, dtype=torch.int32)))


def test_no_rows_at_all():
    m, _, _, _ = _data(COUNTS)
    x = torch.zeros(0, K, dtype=torch.bfloat16, requires_grad=True)
    with qr.autocast(recipe=qr.NVFP4BlockScaling()):
        y = m(x, counts=torch.zeros(E, dtype=torch.int64))
    y.sum().backward()
    assert y.shape == (0, N) and x.grad.shape == (0, K)
    assert not m.weight.grad.any() and not m.bias.grad.any()


def test_custom_recipe_sees_grouped_linear_roles():
    seen = []

    def factory(role):
        seen.append(role)
        return formats.quantizer("current")

    m, x, gy, _ = _data(COUNTS)
    _grouped(m, x, gy, COUNTS, qr.CustomRecipe(qfactory=factory, quantization_alignment=16))
    roles = {(r.module_type, r.tensor_type, r.name) for r in seen if r is not None}
    assert roles == {("grouped_linear", t, "experts") for t in ("input", "weight", "grad_output")}


def test_custom_recipe_alignment_pads_groups():
    m, x, gy, dense = _data(COUNTS)
    recipe = qr.CustomRecipe(qfactory=lambda role: formats.quantizer("mxfp8"),
                             quantization_alignment=64)
    _assert_equal(_grouped(m, x, gy, COUNTS, recipe), _dense(dense, x, gy, COUNTS, recipe, 64))


def test_grouped_mm_path(monkeypatch):
    monkeypatch.setattr(grouped_gemm, "GROUPED_MM_DEVICES", {"cpu", "cuda"})
    if not grouped_gemm.grouped_mm_available("cpu"):
        pytest.skip("torch._grouped_mm does not run on this CPU")
    m, x, gy, _ = _data(COUNTS, bias=False)
    for recipe in (qr.MXFP8BlockScaling(), None):
        qr.reset_grouped_gemm_paths()
        got = _grouped(m, x, gy, COUNTS, recipe)
        assert qr.grouped_gemm_paths() == {"grouped_mm": 3}
        monkeypatch.setattr(grouped_gemm, "GROUPED_MM_DEVICES", set())
        want = _grouped(m, x, gy, COUNTS, recipe)
        monkeypatch.setattr(grouped_gemm, "GROUPED_MM_DEVICES", {"cpu", "cuda"})
        for a, b in zip(got[:3], want[:3], strict=True):  # only the fp32 accumulation order
            torch.testing.assert_close(a, b, rtol=1e-2, atol=1e-2)
    qr.reset_grouped_gemm_paths()  # NVFP4's per-tensor factors scale the product: per group
    _grouped(m, x, gy, COUNTS, formats.recipe("nvfp4_no_sr"))
    assert qr.grouped_gemm_paths() == {"per_group": 3}


def test_grouped_mm_backward_releases_the_rowwise_gradient_before_the_weight_gradient(
        monkeypatch):
    """MXFP8 on the ``"grouped_mm"`` path: the output gradient's decoded rowwise values (bf16,
    the gradient's size) are released after the input gradient, before the weight gradient
    decodes the input; the results are unchanged."""
    import weakref

    monkeypatch.setattr(grouped_gemm, "GROUPED_MM_DEVICES", {"cpu", "cuda"})
    if not grouped_gemm.grouped_mm_available("cpu"):
        pytest.skip("torch._grouped_mm does not run on this CPU")
    m, x, gy, _ = _data(COUNTS, bias=False)
    want = _grouped(m, x, gy, COUNTS, qr.MXFP8BlockScaling())
    rowwise, alive = [], []
    pair, decoded = grouped_gemm._decoded_pair, grouped_gemm._decoded

    def spy_pair(t, q, row, col, *args):
        out = pair(t, q, row, col, *args)
        if row and col:  # the output gradient's two forms
            rowwise.append(weakref.ref(out[0]))
        return out

    def spy_decoded(t, q, columnwise, *args):
        if rowwise:  # the weight's values (input gradient), then the input's (weight gradient)
            alive.append(rowwise[-1]() is not None)
        return decoded(t, q, columnwise, *args)

    monkeypatch.setattr(grouped_gemm, "_decoded_pair", spy_pair)
    monkeypatch.setattr(grouped_gemm, "_decoded", spy_decoded)
    got = _grouped(m, x, gy, COUNTS, qr.MXFP8BlockScaling())
    for a, b in zip(got[:3], want[:3], strict=True):  # y, dx, dw
        assert torch.equal(a, b)
    assert len(rowwise) == 1 and alive == [True, False]


@pytest.mark.parametrize("recipe", [qr.MXFP8BlockScaling(), None], ids=["mxfp8", "off"])
def test_grouped_mm_forward_reads_the_rows_where_they_are(monkeypatch, recipe):
    """Rowwise blocks one row tall: the forward GEMM multiplies the rows in place (no padded
    copy in, no gather of a padded output back), with the bytes and sums of the padded form;
    no rows at all still give an empty output."""
    monkeypatch.setattr(grouped_gemm, "GROUPED_MM_DEVICES", {"cpu", "cuda"})
    if not grouped_gemm.grouped_mm_available("cpu"):
        pytest.skip("torch._grouped_mm does not run on this CPU")
    m, x, gy, _ = _data(COUNTS, bias=False)
    padded = []  # a padded layout read: copied (high precision) or through its row index
    real = grouped_gemm.fp8.padded
    monkeypatch.setattr(grouped_gemm.fp8, "padded",
                        lambda t, lay, *rows: padded.append(1) or real(t, lay, *rows))
    decoded = MXFP8Quantizer.quantize_decoded
    monkeypatch.setattr(MXFP8Quantizer, "quantize_decoded", lambda self, t, **k: (
        padded.append(1) if k.get("rows") is not None else None) or decoded(self, t, **k))
    with qr.autocast(enabled=recipe is not None, recipe=recipe):
        got = m(x, counts=torch.tensor(COUNTS))
        assert not padded
        for cls in (MXFP8Quantizer, IdentityQuantizer):  # as if rows were quantized together
            monkeypatch.setattr(cls, "rows_quantize_apart", lambda self: False)
        want = m(x, counts=torch.tensor(COUNTS))
        assert padded
        monkeypatch.undo()
        monkeypatch.setattr(grouped_gemm, "GROUPED_MM_DEVICES", {"cpu", "cuda"})
        empty = m(x[:0], counts=torch.zeros(len(COUNTS), dtype=torch.int64))
    assert torch.equal(got, want)
    assert empty.shape == (0, N)


@pytest.mark.parametrize("two_d", [False, True], ids=["1x32", "32x32"])
def test_grouped_mm_decodes_mxfp8_in_one_pass_without_bytes(monkeypatch, two_d):
    """On the ``"grouped_mm"`` route MXFP8 operands are only multiplied as bf16 values, so no
    FP8 bytes are made (``quantize_decoded``, one pass per operand, reading the rows of a padded
    operand through the layout's row index: no padded copy either): the same values, outputs
    and gradients as padding, quantizing and then dequantizing."""
    monkeypatch.setattr(grouped_gemm, "GROUPED_MM_DEVICES", {"cpu", "cuda"})
    if not grouped_gemm.grouped_mm_available("cpu"):
        pytest.skip("torch._grouped_mm does not run on this CPU")
    m, x, gy, _ = _data(COUNTS, bias=False)
    recipe = qr.MXFP8BlockScaling(enable_2d_quantization=two_d)
    byte_calls = []
    real_quantize = MXFP8Quantizer.quantize
    monkeypatch.setattr(MXFP8Quantizer, "quantize",
                        lambda self, *a, **k: byte_calls.append(1) or real_quantize(self, *a, **k))
    padded = []
    real_padded = grouped_gemm.fp8.padded
    monkeypatch.setattr(grouped_gemm.fp8, "padded",
                        lambda t, lay, *rows: padded.append(1) or real_padded(t, lay, *rows))
    qr.reset_grouped_gemm_paths()
    got = _grouped(m, x, gy, COUNTS, recipe)
    assert qr.grouped_gemm_paths() == {"grouped_mm": 3} and not byte_calls and not padded
    monkeypatch.setattr(MXFP8Quantizer, "quantize_decoded", lambda self, *a, **k: None)
    want = _grouped(m, x, gy, COUNTS, recipe)
    assert byte_calls and padded
    _assert_equal(got, want)


@pytest.mark.parametrize("n, path", [(256, "grouped_mm"), (64, "per_group")])
def test_fp8_blocks_take_grouped_mm_when_the_experts_close_the_weight_blocks(monkeypatch, n,
                                                                             path):
    """FP8 blocks (power-of-2 scales: exact in bf16) take one ``torch._grouped_mm`` per GEMM
    when every expert's rows close the 128-row weight blocks (all experts quantize as one
    tensor); otherwise one GEMM per group. Either way the per-group path's result up to the
    order of the fp32 sums."""
    monkeypatch.setattr(grouped_gemm, "GROUPED_MM_DEVICES", {"cpu", "cuda"})
    if not grouped_gemm.grouped_mm_available("cpu"):
        pytest.skip("torch._grouped_mm does not run on this CPU")
    torch.manual_seed(0)
    m = qr.GroupedLinear(len(COUNTS), 128, n, dtype=torch.bfloat16)
    x = torch.randn(sum(COUNTS), 128, dtype=torch.bfloat16, requires_grad=True)
    gy = torch.randn(sum(COUNTS), n, dtype=torch.bfloat16)
    recipe = qr.Float8BlockScaling()
    results = []
    for devices in ({"cpu", "cuda"}, set()):
        monkeypatch.setattr(grouped_gemm, "GROUPED_MM_DEVICES", devices)
        x.grad = m.weight.grad = None
        qr.reset_grouped_gemm_paths()
        with qr.autocast(recipe=recipe):
            y = m(x, counts=torch.tensor(COUNTS))
        y.backward(gy)
        results.append(((y.detach(), x.grad, m.weight.grad), qr.grouped_gemm_paths()))
    (got, paths), (want, want_paths) = results
    assert paths == {path: 3} and want_paths == {"per_group": 3}
    for a, b in zip(got, want, strict=True):
        torch.testing.assert_close(a, b, rtol=2**-7, atol=1e-3)


@pytest.mark.parametrize("rid", ["current", "nvfp4_no_sr", "off"])
def test_compile_fullgraph_without_recompiles(rid):
    quant_dynamo = pytest.importorskip("quant_dynamo")
    if not quant_dynamo.compile_supported():
        pytest.skip("this torch cannot bake quantizers into graphs")
    if not quant_dynamo.DERIVES_IN_GRAPH:
        pytest.skip("torch 2.10 reads no member of a baked quantizer (grouped ops need its key)")
    from torch._dynamo.testing import CompileCounterWithBackend

    torch._dynamo.reset()
    m, x, gy, _ = _data(COUNTS)
    recipe = RECIPES[rid]() if rid != "off" else None

    def step(x, counts):
        with qr.autocast(enabled=recipe is not None, recipe=recipe):
            return m(x, counts=counts)

    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, fullgraph=True, backend=counter)
    for counts in (COUNTS, [16, 16, 16, 16], [0, 0, 64, 0], [1, 2, 3, 58]):
        results = []
        for fn in (compiled, step):
            xi = x.clone().requires_grad_()
            m.zero_grad(set_to_none=True)
            y = fn(xi, torch.tensor(counts))
            y.backward(gy)
            results.append((y.detach(), xi.grad, m.weight.grad, m.bias.grad))
        _assert_equal(*results)
    assert counter.frame_count == 1


@pytest.mark.parametrize("inside", [True, False])
def test_activation_checkpointing(inside):
    m, x, gy, _ = _data(COUNTS)
    recipe = qr.MXFP8BlockScaling() if inside else None
    want = _grouped(m, x, gy, COUNTS, recipe)
    xi = x.clone().requires_grad_()
    m.zero_grad(set_to_none=True)
    with qr.autocast(enabled=inside, recipe=recipe):
        y = checkpoint(m, xi, counts=torch.tensor(COUNTS), use_reentrant=False)
    y.backward(gy)  # the recompute runs outside the region, under the forward's frame
    _assert_equal((y.detach(), xi.grad, m.weight.grad, m.bias.grad), want)


def test_state_dict_and_deepcopy():
    m, x, _, _ = _data(COUNTS)
    assert set(m.state_dict()) == {"weight", "bias"}
    assert m.weight.shape == (E, N, K) and m.bias.shape == (E, N)
    fresh = qr.GroupedLinear(E, K, N, bias=True, dtype=torch.bfloat16)
    fresh.load_state_dict(m.state_dict(), strict=True)
    twin = copy.deepcopy(m)
    counts = torch.tensor(COUNTS)
    with torch.no_grad(), qr.autocast(recipe=qr.Float8BlockScaling()):
        want = m(x, counts=counts)
        assert torch.equal(fresh(x, counts=counts), want)
        assert torch.equal(twin(x, counts=counts), want)
    assert twin.weight is not m.weight


def test_delayed_scaling_is_refused():
    m, x, _, _ = _data(COUNTS)
    with pytest.raises(ValueError, match="DelayedScaling"), qr.autocast(
            recipe=qr.DelayedScaling()):
        m(x, counts=torch.tensor(COUNTS))


@pytest.mark.parametrize("kwargs, error, match", [
    ({"counts": torch.tensor([5, 0, 37, 21])}, ValueError, "counts must sum"),
    ({"counts": torch.tensor([5, -1, 38, 22])}, ValueError, "counts must be non-negative"),
    ({"counts": torch.tensor([5.0, 0, 37, 22])}, TypeError, "counts must be an int32"),
    ({"counts": torch.tensor([64])}, ValueError, r"counts must have shape \(4,\)"),
    ({"counts": torch.tensor([5, 0, 37, 22], device="meta")}, ValueError, "counts is on meta"),
    ({"offs": torch.tensor([5, 4, 42, 64])}, ValueError, "offs must be non-decreasing"),
    ({"offs": torch.tensor([5, 5, 42, 63])}, ValueError, "offs must end"),
    ({}, TypeError, "exactly one of offs"),
    ({"offs": torch.tensor([5, 5, 42, 64]), "counts": torch.tensor(COUNTS)}, TypeError,
     "exactly one of offs"),
])
def test_wrong_inputs_name_the_argument(kwargs, error, match):
    m, x, _, _ = _data(COUNTS)
    with pytest.raises(error, match=match):
        m(x, **kwargs)


def test_wrong_x():
    m, x, _, _ = _data(COUNTS)
    with pytest.raises(ValueError, match="x must be"):
        m(x[:, :64], counts=torch.tensor(COUNTS))
    with pytest.raises(TypeError, match="floating-point"):
        m(x.to(torch.int32), counts=torch.tensor(COUNTS))
    with pytest.raises(ValueError, match="num_experts must be"):
        qr.GroupedLinear(0, K, N)


def _fsdp2_worker(rank: int, port: int, out) -> None:
    """Two ranks, each its own batch, the experts' weight sharded over experts (dim 0)."""
    from _dist_helpers import init
    from torch.distributed.fsdp import fully_shard

    device = init(rank, port)
    try:
        recipe = qr.Float8CurrentScaling()
        counts = [COUNTS, [16, 16, 16, 16]]
        batches = [torch.randn(sum(c), K, generator=torch.Generator().manual_seed(r))
                   for r, c in enumerate(counts)]

        def step(m, r):
            with qr.autocast(recipe=recipe):
                loss = m(batches[r].to(device), counts=torch.tensor(counts[r], device=device))
            loss.float().pow(2).sum().backward()

        torch.manual_seed(0)
        ref = qr.GroupedLinear(E, K, N, bias=True, device=device)
        grads = []
        for r in range(2):  # the unsharded module on one process, each rank's batch in turn
            ref.zero_grad(set_to_none=True)
            step(ref, r)
            grads.append([p.grad.clone() for p in ref.parameters()])
        torch.manual_seed(0)
        model = fully_shard(qr.GroupedLinear(E, K, N, bias=True, device=device))
        step(model, rank)
        got = [p.grad.full_tensor() for p in model.parameters()]
        out[rank] = all(torch.equal(g, (a + b) / 2)
                        for g, a, b in zip(got, *grads, strict=True))
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.timeout(180)
def test_fsdp2_gradients_equal_the_unsharded_module():
    pytest.importorskip("torch.distributed.fsdp", reason="this torch has no FSDP2")
    from _dist_helpers import spawn

    out = spawn(_fsdp2_worker)
    assert out[0] and out[1]


def test_opcheck_grouped_ops():
    """``torch.library.opcheck`` of ``grouped_fprop`` / ``grouped_bprop`` under a recipe and in
    high precision, with and without bias."""
    quant_dynamo = pytest.importorskip("quant_dynamo")
    if not quant_dynamo.DERIVES_IN_GRAPH:
        pytest.skip("torch 2.10 reads no member of a baked quantizer (grouped ops need its key)")
    from quant_core import DType, Float8CurrentScalingQuantizer
    from quant_recipes.identity import IdentityQuantizer
    from quant_recipes.moe.fp8 import layout
    from quant_recipes.moe.ops import quantizer_spec

    m, x, gy, _ = _data(COUNTS)
    w, b = m.weight.detach(), m.bias.detach()
    lay = layout(torch.tensor(COUNTS).cumsum(0), x.shape[0], 16).tensors()
    e4m3, e5m2 = (Float8CurrentScalingQuantizer(dtype=d) for d in (DType.E4M3, DType.E5M2))
    for qx, qw, qg, align in ((IdentityQuantizer(),) * 3 + (16,), (e4m3, e4m3, e5m2, 16)):
        specs = [quantizer_spec(q) for q in (qx, qw)]
        for bias in (b, None):
            torch.library.opcheck(torch.ops.quant_recipes.grouped_fprop.default,
                                  (x, lay, w, bias, specs, align))
        torch.library.opcheck(torch.ops.quant_recipes.grouped_fprop.default,
                              (x, lay, w, None, specs, align, True))
        bspecs = [quantizer_spec(q) for q in (qg, qx, qw)]
        torch.library.opcheck(torch.ops.quant_recipes.grouped_bprop.default,
                              (gy, x, lay, w, bspecs, True, align, True, True, True))
        torch.library.opcheck(torch.ops.quant_recipes.grouped_bprop.default,
                              (gy, x, lay, w, bspecs, True, align, True, True, True, True, True))
        # the rows read where they lie: x_rows into fewer tokens
        tokens, x_rows = x[:20], torch.arange(x.shape[0]) % 20
        torch.library.opcheck(torch.ops.quant_recipes.grouped_fprop.default,
                              (tokens, lay, w, None, specs, align, False, x_rows))
        torch.library.opcheck(torch.ops.quant_recipes.grouped_bprop.default,
                              (gy, tokens, lay, w, bspecs, True, align, True, True, False, False,
                               False, x_rows))


def test_opcheck_grouped_ops_on_the_grouped_mm_route(monkeypatch):
    """``torch.library.opcheck`` of the grouped ops with MXFP8 operands (1x32, and 32x32 weight
    tiles) on the ``"grouped_mm"`` route, whose operands are quantized straight into values."""
    quant_dynamo = pytest.importorskip("quant_dynamo")
    if not quant_dynamo.DERIVES_IN_GRAPH:
        pytest.skip("torch 2.10 reads no member of a baked quantizer (grouped ops need its key)")
    monkeypatch.setattr(grouped_gemm, "GROUPED_MM_DEVICES", {"cpu", "cuda"})
    if not grouped_gemm.grouped_mm_available("cpu"):
        pytest.skip("torch._grouped_mm does not run on this CPU")
    from quant_recipes.moe.fp8 import layout
    from quant_recipes.moe.ops import quantizer_spec

    m, x, gy, _ = _data(COUNTS)
    w = m.weight.detach()
    lay = layout(torch.tensor(COUNTS).cumsum(0), x.shape[0], 32).tensors()
    for qw in (MXFP8Quantizer(), MXFP8Quantizer(with_2d_quantization=True)):
        qx = qg = MXFP8Quantizer()
        qr.reset_grouped_gemm_paths()
        torch.library.opcheck(torch.ops.quant_recipes.grouped_fprop.default,
                              (x, lay, w, None, [quantizer_spec(q) for q in (qx, qw)], 32))
        torch.library.opcheck(torch.ops.quant_recipes.grouped_bprop.default,
                              (gy, x, lay, w, [quantizer_spec(q) for q in (qg, qx, qw)], True,
                               32, True, True, False))
        tokens, x_rows = x[:20], torch.arange(x.shape[0]) % 20  # rows read where they lie
        torch.library.opcheck(torch.ops.quant_recipes.grouped_fprop.default,
                              (tokens, lay, w, None, [quantizer_spec(q) for q in (qx, qw)], 32,
                               False, x_rows))
        torch.library.opcheck(torch.ops.quant_recipes.grouped_bprop.default,
                              (gy, tokens, lay, w, [quantizer_spec(q) for q in (qg, qx, qw)],
                               True, 32, True, True, False, False, False, x_rows))
        assert set(qr.grouped_gemm_paths()) == {"grouped_mm"}
