"""quant's Linear under tensor and sequence parallelism (``QuantColwiseParallel``,
``QuantRowwiseParallel``, ``PrepareQuantModuleInput``) on 2 gloo ranks, against the same module
in one process.

Every case runs a step whose loss is linear in the output (``(y * g).sum()`` with a fixed ``g``),
so the output gradient is ``g`` in both runs and each GEMM's operands can be compared on their
own. What is bitwise: every GEMM whose contraction runs over a dimension each rank holds whole
(the column-parallel forward, every weight gradient, the row-parallel input gradient) and the
bias gradient of a replicated-output row-parallel layer, since each rank quantizes its pieces with
the scales of the unsharded tensor (amaxes all-reduced over the group) and the emulated GEMM
computes each output element alone.
What is bounded: the two results that are sums of the ranks' partial products (the row-parallel
output, all-reduced or reduce-scattered, and the input gradient of the column-parallel layers):
each rank rounds its partial sum to bf16 and the reduction rounds again, so per element
``|tp - ref| <= (world + 2) * 2**-9 * S`` where ``S = |A| @ |B|`` (the sum of the magnitudes
of the products; the quantized operands' magnitudes are bounded by twice the high-precision
ones', hence ``2**-8`` below), plus the bias in ``S`` where it is added after the reduction.
And the column-parallel bias gradients: the fp32 column sums of the same M output-gradient
values, which torch adds in another order for a narrower slice (at some widths), each rounded
once to bf16: ``|tp - ref| <= (2**-7 + 2 * M * 2**-24) * S`` with ``S`` the column's sum of
``|g|`` (the two fp32 sums are within ``(M - 1) * 2**-24 * S`` of the exact one, each rounding
within ``2**-8`` of its value).
NVFP4's default recipe rounds its gradients stochastically: a rank quantizing its shard of a
gradient draws other random bits than one process quantizing the whole gradient, so the GEMMs
reading the column-parallel layers' quantized gradients are compared by relative error (0.25,
the spread of two stochastic roundings at these widths is about 0.1); everything else is as
above.
"""

from __future__ import annotations

import contextlib
import copy
import os
import warnings
from typing import NamedTuple

import formats
import pytest
import quant_recipes as qr
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _dist_helpers import init, spawn
from test_nvfp4_row_scaled import row_scaled_recipe
from torch.utils._python_dispatch import TorchDispatchMode

WORLD = 2
D, H, S, HEAD = 64, 256, 256, 64  # 128 output features / input features per rank
DTYPE = torch.bfloat16  # NVFP4's Hadamard transform takes bf16

#: recipe id -> factory: every format's built-in recipe, and NVFP4 without stochastic rounding
RECIPES = formats.recipes("nvfp4_no_sr", defaults=True, qualified=True)
#: The older and newer torch releases' sessions (``QUANT_TEST_SCOPE=compat``) run one recipe:
#: what differs between releases is DTensor and the compiler, not the formats.
SCOPE = ("fp8_current",) if os.environ.get("QUANT_TEST_SCOPE") == "compat" else tuple(RECIPES)
#: Recipes of the cases beyond every format's: row-scaled NVFP4 activations.
EXTRA = {"nvfp4_row_scaled": row_scaled_recipe}


def _bound(tp, ref, s):
    """Whether ``tp`` is within the reduction bound of the module docstring of ``ref``."""
    return bool(((tp.float() - ref.float()).abs() <= (WORLD + 2) * 2.0 ** -8 * s + 1e-30).all())


def _bias_bound(tp, ref, g):
    """Whether the column-parallel bias gradient ``tp`` is within the module docstring's bound
    of ``ref``, the output gradient being ``g`` ``[..., N]``."""
    g = g.float().reshape(-1, g.shape[-1])
    s = g.abs().sum(0)
    return bool(((tp.float() - ref.float()).abs()
                 <= (2.0 ** -7 + 2 * g.shape[0] * 2.0 ** -24) * s + 1e-30).all())


def _close(tp, ref, rel=0.25):
    return bool((tp.float() - ref.float()).norm() <= rel * ref.float().norm())


class _Block(torch.nn.Module):
    """``keep``: hold the outputs of the layers, with their gradients, for the bounds (the
    reference only: ``retain_grad`` does not compile)."""

    keep = False

    def _kept(self, name, t):
        if self.keep and t.requires_grad:
            t.retain_grad()
            self.kept[name] = t
        return t


class MLP(_Block):
    def __init__(self, hidden=H, dtype=DTYPE):
        super().__init__()
        self.up = qr.Linear(D, hidden, dtype=dtype)
        self.down = qr.Linear(hidden, D, dtype=dtype)

    def forward(self, x):
        self.kept = {}
        h = self._kept("down", F.gelu(self._kept("up", self.up(x))))
        return self.down(h)


class Attention(_Block):
    """q, k, v column-parallel (whole heads per rank), the output projection row-parallel."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v = (qr.Linear(D, H, bias=False, dtype=DTYPE) for _ in range(3))
        self.o = qr.Linear(H, D, dtype=DTYPE)

    def forward(self, x):
        self.kept = {}
        b, s, _ = x.shape
        q, k, v = (self._kept(n, getattr(self, n)(x)).view(b, s, -1, HEAD).transpose(1, 2)
                   for n in "qkv")
        a = torch.softmax((q.float() @ k.float().transpose(-1, -2)) / HEAD ** 0.5, -1)
        a = (a @ v.float()).to(DTYPE).transpose(1, 2).reshape(b, s, -1)
        return self.o(self._kept("o", a))


def _styles(kind: str):
    from torch.distributed.tensor import Shard

    if kind == "mlp":
        return {"up": qr.QuantColwiseParallel(), "down": qr.QuantRowwiseParallel()}
    if kind == "attention":
        return {n: qr.QuantColwiseParallel() for n in "qkv"} | {"o": qr.QuantRowwiseParallel()}
    # sequence parallel: the block's input and output sharded along the sequence
    return {"": qr.PrepareQuantModuleInput(input_layouts=Shard(1)),
            **{n: qr.QuantColwiseParallel() for n in "qkv"},
            "o": qr.QuantRowwiseParallel(output_layouts=Shard(1))}


class count_gathers(TorchDispatchMode):  # noqa: N801  (a context manager)
    """Bytes that the all-gathers under it receive, counted at the functional collective every
    gather here goes through (DTensor's redistribution and PrepareQuantModuleInput alike)."""

    def __init__(self):
        super().__init__()
        self.bytes = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func is torch.ops._c10d_functional.all_gather_into_tensor.default:
            self.bytes += out.numel() * out.element_size()
        return out


def _run(model, recipe, x, g, compiled, probe=None):
    def step(t):
        with qr.autocast(recipe=recipe):
            return model(t)

    fn = torch.compile(step, backend="aot_eager", fullgraph=True) if compiled else step
    x = x.detach().clone().requires_grad_()
    torch.manual_seed(7)  # NVFP4's stochastic rounding: the same stream in every run
    with probe or contextlib.nullcontext():  # the forward's gathers
        y = fn(x)
    (y.float() * g).sum().backward()
    return y.detach(), x.grad


def _compare(kind, name, ref, tp, x, g, rank, compiled):
    """Per check, whether it held (see the module docstring for which are bitwise)."""
    from torch.distributed.tensor import DTensor

    recipe = (RECIPES | EXTRA)[name]()
    seq = kind == "sequence"
    mine = slice(rank * (S // WORLD), (rank + 1) * (S // WORLD))
    y_ref, dx_ref = _run(ref, recipe, x, g, False)
    probe = count_gathers()
    y_tp, dx_tp = _run(tp, recipe, x[:, mine] if seq else x, g[:, mine] if seq else g, compiled,
                       None if compiled else probe)  # a dispatch mode does not compile
    if seq:
        y_ref, dx_ref = y_ref[:, mine], dx_ref[:, mine]
    sr = name == "nvfp4"  # stochastic rounding of the column-parallel gradients
    out = {"collective bytes": probe.bytes}
    row, cols = ("down", ("up",)) if kind == "mlp" else ("o", "qkv")
    kept = ref.kept
    r_row = getattr(ref, row)
    # |A| @ |B| of the reduced results, from the reference's operands (module docstring)
    s_y = kept[row].float().abs() @ r_row.weight.float().abs().t() + r_row.bias.float().abs()
    s_dx = sum(kept[n].grad.float().abs() @ getattr(ref, n).weight.float().abs() for n in cols)
    if seq:
        s_y, s_dx = s_y[:, mine], s_dx[:, mine]
    out["output (reduced)"] = _bound(y_tp, y_ref, s_y)
    out["input grad (reduced)"] = _close(dx_tp, dx_ref) if sr else _bound(dx_tp, dx_ref, s_dx)
    for n in (row, *cols):
        r, t = getattr(ref, n), getattr(tp, n)
        dim = 1 if n == row else 0
        for p in ("weight", "bias"):
            rp, tpp = getattr(r, p), getattr(t, p)
            if rp is None:
                continue
            assert isinstance(tpp, DTensor), (n, p)
            # the gradient in the parameter's own placements (torch 2.10 returns an unevenly
            # sharded row-parallel weight's gradient replicated)
            tg = tpp.grad.redistribute(tpp.device_mesh, tpp.placements).to_local()
            want = rp.grad if (p == "bias" and dim == 1) else rp.grad.chunk(WORLD, dim)[rank]
            if sr and dim == 0:
                out[f"{n}.{p}.grad"] = _close(tg, want)
            elif p == "bias" and dim == 0:  # the column sums of this rank's slice
                out[f"{n}.{p}.grad"] = _bias_bound(tg, want, kept[n].grad.chunk(WORLD, -1)[rank])
            elif seq and p == "bias" and dim == 1:
                # summed over each rank's tokens, then across the ranks (fp32, one rounding)
                out[f"{n}.{p}.grad"] = _bound(tg, want, g.abs().sum((0, 1)))
            else:
                out[f"{n}.{p}.grad"] = torch.equal(tg, want)
    return out


def _outcome(fn) -> str:
    """``fn()``'s refusal as ``"<error type>: <message>"``, or "did not raise"."""
    try:
        fn()
    except (TypeError, ValueError) as e:
        return f"{type(e).__name__}: {e}"
    return "did not raise"


def _refusals(mesh):
    """Each refusal's message, or a note that it did not raise."""
    from torch.distributed.tensor.parallel import parallelize_module

    got = {}

    def attempt(key, fn):
        got[key] = _outcome(fn)

    # FP8 128x128 weight blocks over 64 output rows per rank, checked at parallelize time
    attempt("colwise blocks", lambda: parallelize_module(
        qr.Linear(64, 128, name="proj"), mesh,
        qr.QuantColwiseParallel(recipe=qr.Float8BlockScaling())))
    # MXFP8 1x32 blocks over 24 input features per rank, checked at the first forward

    def row_forward():
        layer = parallelize_module(qr.Linear(48, 64), mesh, qr.QuantRowwiseParallel())
        with qr.autocast(recipe=qr.MXFP8BlockScaling()):
            layer(torch.randn(32, 24))

    attempt("rowwise blocks", row_forward)

    def delayed():
        layer = parallelize_module(qr.Linear(64, 64), mesh, qr.QuantColwiseParallel())
        with qr.autocast(recipe=qr.DelayedScaling()):
            layer(torch.randn(32, 64))

    attempt("delayed", delayed)
    attempt("plain nn.Linear", lambda: parallelize_module(
        torch.nn.Linear(64, 64), mesh, qr.QuantColwiseParallel()))
    # the FSDP2 quantized all-gather, enabled before or after parallelizing
    recipe = qr.Float8CurrentScaling()
    attempt("quantized all-gather, then TP", lambda: parallelize_module(
        qr.enable_fsdp_quantized_all_gather(torch.nn.Sequential(qr.Linear(64, 64)), recipe),
        mesh, {"0": qr.QuantColwiseParallel()}))
    attempt("TP, then quantized all-gather", lambda: qr.enable_fsdp_quantized_all_gather(
        parallelize_module(torch.nn.Sequential(qr.Linear(64, 64)), mesh,
                           {"0": qr.QuantColwiseParallel()}), recipe))
    return got


class Sizes(NamedTuple):
    """An MLP case's hidden width, tokens per sequence (two sequences) and dtype."""

    hidden: int = H
    tokens: int = 32
    dtype: torch.dtype = DTYPE


def _cases(mesh, rank, cases) -> dict:
    """Per case, :func:`_compare`'s checks and what the gathers moved. ``cases``: ``(kind,
    recipe id, compiled)``, or with a fourth entry an MLP's :class:`Sizes`."""
    from torch.distributed.tensor.parallel import parallelize_module

    results = {}
    for case in cases:
        kind, name, compiled, *sizes = case
        sizes = sizes[0] if sizes else Sizes()
        torch.manual_seed(0)
        ref = MLP(sizes.hidden, sizes.dtype) if kind == "mlp" else Attention()
        ref.keep = True
        tp = MLP(sizes.hidden, sizes.dtype) if kind == "mlp" else Attention()
        tp.load_state_dict(ref.state_dict())
        parallelize_module(tp, mesh, _styles(kind))
        gen = torch.Generator().manual_seed(1)
        shape = (2, sizes.tokens, D) if kind != "sequence" else (1, S, D)
        x = torch.randn(shape, generator=gen).to(sizes.dtype)
        g = torch.randn(shape, generator=gen)
        qr.reset_tensor_parallel_gather_bytes()
        torch._dynamo.reset()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            res = _compare(kind, name, ref, tp, x, g, rank, compiled)
        res["counted"] = qr.tensor_parallel_gather_bytes()
        res["warnings"] = [str(w.message) for w in caught
                           if "PrepareQuantModuleInput" in str(w.message)]
        # the optimizer steps the DTensor parameters; state_dict keys are nn.Linear's
        torch.optim.AdamW(tp.parameters()).step()
        res["keys"] = sorted(tp.state_dict()) == sorted(ref.state_dict())
        results[case] = res
    return results


def _worker(rank, port, cases, out):
    init(rank, port, WORLD)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (WORLD,))
        results = _cases(mesh, rank, cases)
        results["refusals"] = _refusals(mesh)
        out[rank] = results
    finally:
        dist.destroy_process_group()


def _compile_supported() -> bool:
    try:
        import quant_dynamo
    except ImportError:
        return False
    return quant_dynamo.compile_supported()


#: bytes the forward's one input gather moves for S x D tokens: quantized where a plan applies
GATHER = {
    "fp8_current": ("quantized", S * D),  # the data; the one scale is equal on every rank
    # rowwise and columnwise data, their E8M0 scales (rows padded to 128 x 4, 32-row blocks x K
    # padded to 4 x 128)
    "mxfp8": ("quantized", 2 * S * D + S * 4 + 8 * 128),
    "fp8_block": ("high_precision", 2 * S * D),  # 1x128 input: columnwise stored transposed
    "nvfp4": ("high_precision", 2 * S * D),  # 1x16 input with RHT, likewise
    "nvfp4_no_sr": ("high_precision", 2 * S * D),
}


@pytest.mark.timeout(400)
def test_tensor_parallel_equals_the_single_process_module():
    """Column-then-row MLP, attention block and its sequence-parallel form, eager under every
    built-in stateless recipe; compiled (fullgraph, aot_eager) the MLP under every recipe, the
    attention block and the sequence-parallel form under one each; the refusals."""
    cases = [(k, n, False) for k in ("mlp", "attention", "sequence") for n in SCOPE]
    if _compile_supported():
        cases += [("mlp", n, True) for n in SCOPE]
        if SCOPE == tuple(RECIPES):
            cases += [("attention", "nvfp4", True), ("sequence", "mxfp8", True)]
    out = spawn(_worker, cases, world=WORLD)
    for rank in range(WORLD):
        res = out[rank]
        for key in cases:
            kind, name, compiled = key
            r = dict(res[key])
            counted, warned, keys = r.pop("counted"), r.pop("warnings"), r.pop("keys")
            collective = r.pop("collective bytes")
            assert all(r.values()), (rank, key, r)
            assert keys, key
            if kind != "sequence":
                assert counted == {} and collective == 0, (key, counted, collective)
                continue
            if compiled:  # compiled graphs gather the high-precision input (behaviour.md)
                assert counted == {}, (key, counted)  # a graph's gathers are not counted
                continue
            what, nbytes = GATHER[name]
            assert counted == {what: nbytes}, (key, counted)
            assert collective == nbytes, (key, collective, nbytes)
            if what == "quantized":
                assert nbytes < 0.6 * 2 * (2 * S * D) or name == "mxfp8", name
                assert not warned, (key, warned)
            else:
                assert name == "nvfp4_no_sr" or warned, key  # one warning per reason
        ref = res["refusals"]
        assert "ValueError" in ref["colwise blocks"] and "'proj'" in ref["colwise blocks"]
        assert "out_features=128 over 2 ranks into 64" in ref["colwise blocks"]
        assert "block of 128" in ref["colwise blocks"], ref["colwise blocks"]
        assert "in_features=48 over 2 ranks into 24" in ref["rowwise blocks"], ref
        assert "block of 32" in ref["rowwise blocks"], ref
        assert ref["delayed"].startswith("ValueError") and "DelayedScaling" in ref["delayed"]
        assert ref["plain nn.Linear"].startswith("TypeError"), ref
        assert "does not compose with tensor parallelism" in ref["quantized all-gather, then TP"]
        assert ref["TP, then quantized all-gather"].startswith("TypeError"), ref


def _fully_shard():
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        from torch.distributed._composable.fsdp import fully_shard
    return fully_shard


def _fsdp_tp_worker(rank, port, cases, out):
    """2x2 mesh: FSDP2 over "dp" (each dp rank its own batch), TP over "tp"."""
    init(rank, port, 2 * WORLD)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import parallelize_module

        mesh = init_device_mesh("cpu", (2, WORLD), mesh_dim_names=("dp", "tp"))
        dp_rank = rank // WORLD
        results = {}
        for name, compiled in cases:
            recipe = RECIPES[name]()
            gen = torch.Generator().manual_seed(1)
            xs = [torch.randn(2, 32, D, generator=gen).to(DTYPE) for _ in range(2)]
            g = torch.randn(2, 32, D, generator=gen)
            torch.manual_seed(0)
            ref = MLP()
            ref.keep = True
            model = MLP()
            model.load_state_dict(ref.state_dict())
            ref_y, ref_grads = [], []
            for x in xs:  # the unsharded model on one process, each dp rank's batch in turn
                ref.zero_grad(set_to_none=True)
                ref_y.append(_run(ref, recipe, x, g, False)[0])
                ref_grads.append({n: p.grad for n, p in ref.named_parameters()})
            s_y = (ref.kept["down"].float().abs() @ ref.down.weight.float().abs().t()
                   + ref.down.bias.float().abs())  # the last batch's: dp rank 1
            # FSDP2 averages the dp ranks' gradients in their dtype
            mean = {n: (ref_grads[0][n] + ref_grads[1][n]) / 2 for n in ref_grads[0]}
            parallelize_module(model, mesh["tp"], _styles("mlp"))
            for layer in (model.up, model.down):
                if compiled:  # each layer one graph, as with FSDP2 alone (test_fsdp2.py)
                    layer.compile(fullgraph=True, backend="aot_eager")
                _fully_shard()(layer, mesh=mesh["dp"])
            _fully_shard()(model, mesh=mesh["dp"])
            y, _ = _run(model, recipe, xs[dp_rank], g, False)
            res = {f"{n}.grad": torch.equal(p.grad.full_tensor(), mean[n])
                   for n, p in model.named_parameters()}
            if dp_rank == 1:
                res["output (reduced)"] = _bound(y, ref_y[1], s_y)
            torch.optim.AdamW(model.parameters()).step()
            results[(name, compiled)] = res
        out[rank] = results
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(300)
def test_fsdp2_and_tensor_parallel_on_a_2x2_mesh():
    """FSDP2 (plain all-gather; the quantized one is refused with TP, see the refusals) on one
    mesh dimension, TP on the other, eager under every recipe and with the layers compiled:
    every gradient equals the dp-mean of the single-process gradients bit for bit, the output
    is within the reduction bound."""
    try:
        _fully_shard()
    except ImportError:
        pytest.skip("this torch has no FSDP2")
    # NVFP4's default stochastic rounding draws each rank's own bits for a gradient shard, so it
    # is not bitwise; "nvfp4_no_sr" covers the format
    cases = [(name, False) for name in SCOPE if name != "nvfp4"]
    if _compile_supported():
        cases += [("fp8_current", True)]
    out = spawn(_fsdp_tp_worker, cases, world=2 * WORLD)
    for rank in range(2 * WORLD):
        for key in cases:
            assert all(out[rank][key].values()), (rank, key, out[rank][key])


def _unconvert_worker(rank, port, out):
    """``unconvert`` on a tensor-parallel model and on a ``fully_shard`` one: refused, naming
    the layer, with the model left as it was (it still runs)."""
    init(rank, port, WORLD)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import parallelize_module

        mesh = init_device_mesh("cpu", (WORLD,))
        got = {}
        for kind in ("tensor parallel", "fully_shard"):
            torch.manual_seed(0)
            model = torch.nn.Sequential(qr.Linear(D, D, dtype=DTYPE), MLP())
            if kind == "tensor parallel":
                parallelize_module(model[1], mesh, _styles("mlp"))
            else:
                _fully_shard()(model[1], mesh=mesh)
            types = [type(m) for m in model.modules()]
            try:
                qr.unconvert(model)
            except ValueError as e:
                got[kind] = str(e)
            else:
                got[kind] = "did not raise"
            got[kind, "untouched"] = [type(m) for m in model.modules()] == types
            x = torch.randn(2, 8, D).to(DTYPE)
            try:
                got[kind, "runs"] = model(x).shape == x.shape
            except RuntimeError as e:
                got[kind, "runs"] = str(e)
        out[rank] = got
    finally:
        dist.destroy_process_group()


# --------------------------------------------------- widths, row scaling, refusals, what is saved
#: Cases beyond the main test's: uneven shards (99 features over 2 ranks: 50 and 49, as DTensor
#: splits them) under FP8 current scaling (one scale per tensor: no alignment); a width whose
#: fp32 column sums (the bias gradient) torch adds in another order on the narrower slice (98,
#: fp32 parameters, whose gradient keeps every bit of the sum); row-scaled NVFP4 activations
#: (the row-parallel input's per-row amaxes reduced elementwise over the group).
UNEVEN, BIAS_ORDER = Sizes(hidden=99), Sizes(hidden=98, dtype=torch.float32)
EDGE = [("mlp", "fp8_current", False, UNEVEN), ("mlp", "fp8_current", False, BIAS_ORDER),
        ("mlp", "nvfp4_row_scaled", False)]
EDGE_COMPILED = [("mlp", "fp8_current", True, UNEVEN), ("mlp", "nvfp4_row_scaled", True)]


def _more_refusals(mesh):
    """Each refusal's message, or a note that it did not raise."""
    from torch.distributed.tensor.parallel import parallelize_module

    got = {}

    def attempt(key, fn):
        got[key] = _outcome(fn)

    custom = qr.CustomRecipe(qfactory=lambda role: qr.DelayedScalingRequest())

    def custom_delayed():
        layer = parallelize_module(qr.Linear(64, 64, name="proj"), mesh,
                                   qr.QuantColwiseParallel())
        with qr.autocast(recipe=custom):
            layer(torch.randn(32, 64))

    attempt("custom delayed", custom_delayed)
    attempt("custom delayed, at parallelize", lambda: parallelize_module(
        qr.Linear(64, 64, name="proj"), mesh, qr.QuantRowwiseParallel(recipe=custom)))

    def custom_stateless():
        from quant_core import Float8CurrentScalingQuantizer

        values = qr.CustomRecipe(qfactory=lambda role: Float8CurrentScalingQuantizer())
        layer = parallelize_module(qr.Linear(64, 64, name="proj"), mesh,
                                   qr.QuantColwiseParallel(recipe=values))
        with qr.autocast(recipe=values):
            layer(torch.randn(32, 64))

    attempt("custom stateless", custom_stateless)
    # 99 over 2 ranks: 50 and 49, whole 32-blocks on neither
    attempt("uneven blocks", lambda: parallelize_module(
        qr.Linear(64, 99, name="proj"), mesh,
        qr.QuantColwiseParallel(recipe=qr.MXFP8BlockScaling())))
    return got


def _saved_for_backward(mesh, rank) -> dict:
    """Per (recipe, style, switch): whether a layer with ``switch=False`` saves its operand as
    is (the local weight shard, or the local input) and of the other operand only its
    columnwise copy, and gives the bits of the same layer saving both copies (checked too)."""
    from test_saved_for_backward import COLUMNWISE, _signature
    from torch.distributed.tensor.parallel import parallelize_module

    out = {}
    for name in ("fp8_current", "mxfp8"):
        for style in ("colwise", "rowwise"):
            k, n = (128, 256) if style == "colwise" else (256, 64)
            torch.manual_seed(0)
            x = torch.randn(32, k, dtype=DTYPE)
            if style == "rowwise":  # this rank's slice of the input features
                x = x.chunk(WORLD, -1)[rank].contiguous()
            layers = {}
            for switch in ("", "save_weight_copy", "save_input_copy"):
                torch.manual_seed(1)
                layer = qr.Linear(k, n, bias=False, dtype=DTYPE,
                                  **({switch: False} if switch else {}))
                parallelize_module(layer, mesh, qr.QuantColwiseParallel() if style == "colwise"
                                   else qr.QuantRowwiseParallel())
                layers[switch] = layer
            results = {}
            for switch, layer in layers.items():
                saved = []

                def pack(t, saved=saved):
                    saved.append(t)
                    return t

                xi = x.clone().requires_grad_()
                with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
                    with qr.autocast(recipe=RECIPES[name]()):
                        y = layer(xi)
                y.float().pow(2).sum().backward()
                results[switch] = (y.detach(), xi.grad, layer.weight.grad.to_local())
                w = layer.weight.to_local()
                # the operand saved as is, the other one's index (0 the input, 1 the weight)
                operands = {"save_weight_copy": (w, 0), "save_input_copy": (xi, 1)}
                kept, other = operands.get(switch, (None, None))

                def same(t, kept=kept):
                    return (kept is not None and t.shape == kept.shape
                            and t.data_ptr() == kept.data_ptr())

                fwd = layer._qset.fwd
                which = (0, 1) if kept is None else (other,)
                want = []
                for i in which:
                    storage = fwd[i].quantize((xi, w)[i].detach())
                    want += [getattr(storage, b) for b in COLUMNWISE[type(storage).__name__]]
                out[(name, style, switch or "both copies")] = (
                    (kept is None or any(same(t) for t in saved))
                    and _signature([t for t in saved if not same(t)]) == _signature(want))
            for switch in ("save_weight_copy", "save_input_copy"):
                out[(name, style, switch, "bits")] = all(
                    torch.equal(a, b) for a, b in zip(results[switch], results[""], strict=True))
    return out


def _accumulation(mesh, rank) -> dict:
    """Per style, the ``use_fast_accum`` of each cuBLAS call of a Float8CurrentScaling step
    (fprop, dgrad, wgrad), through an emulated ``torch._scaled_mm`` (the FP8 path forced on)."""
    from _scaled_mm import recorded_scaled_mm
    from torch.distributed.tensor.parallel import parallelize_module

    with recorded_scaled_mm() as calls:
        out = {}
        for style in ("colwise", "rowwise"):
            k, n = (128, 256) if style == "colwise" else (256, 64)
            torch.manual_seed(0)
            x = torch.randn(32, k, dtype=DTYPE)
            if style == "rowwise":
                x = x.chunk(WORLD, -1)[rank].contiguous()
            layer = qr.Linear(k, n, bias=False, dtype=DTYPE)
            parallelize_module(layer, mesh, qr.QuantColwiseParallel() if style == "colwise"
                               else qr.QuantRowwiseParallel())
            calls.clear()
            xi = x.clone().requires_grad_()
            with qr.autocast(recipe=qr.Float8CurrentScaling()):
                y = layer(xi)
            y.float().pow(2).sum().backward()
            out[style] = list(calls)
        return out


def _under_torch_autocast(mesh, rank) -> dict:
    """Per style, an fp32 layer with a bias under ``torch.autocast`` (bf16) and Float8
    CurrentScaling: the output's dtype, whether the column-parallel output equals the single
    process's (its columns), and the gradients' dtypes."""
    from torch.distributed.tensor.parallel import parallelize_module

    out = {}
    for style in ("colwise", "rowwise"):
        torch.manual_seed(0)
        full = qr.Linear(128, 128)
        x = torch.randn(32, 128)
        layer = copy.deepcopy(full)
        parallelize_module(layer, mesh, qr.QuantColwiseParallel() if style == "colwise"
                           else qr.QuantRowwiseParallel())
        xl = x if style == "colwise" else x.chunk(WORLD, -1)[rank].contiguous()
        xi = xl.clone().requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16), qr.autocast():
            y = layer(xi)
            want = full(x)
        y = y.to_local() if hasattr(y, "to_local") else y
        y.float().pow(2).sum().backward()
        got = {"dtype": str(y.dtype), "grads": sorted({str(p.grad.dtype) for p in
                                                        layer.parameters()} | {str(xi.grad.dtype)})}
        if style == "colwise":
            got["equal"] = torch.equal(y, want.chunk(WORLD, -1)[rank])
        out[style] = got
    return out


def _edge_worker(rank, port, cases, out):
    """Each part on its own: one that raises is recorded (its test fails with the error) and
    the others still run."""
    init(rank, port, WORLD)
    try:
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (WORLD,))
        parts = {case: lambda case=case: _cases(mesh, rank, [case])[case] for case in cases}
        parts["refusals"] = lambda: _more_refusals(mesh)
        parts["saved"] = lambda: _saved_for_backward(mesh, rank)
        parts["accumulation"] = lambda: _accumulation(mesh, rank)
        parts["torch.autocast"] = lambda: _under_torch_autocast(mesh, rank)
        results = {}
        for key, part in parts.items():
            try:
                results[key] = part()
            except Exception as e:  # noqa: BLE001  (reported by the test that reads it)
                results[key] = f"{type(e).__name__}: {e}"
        out[rank] = results
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(120)
def test_unconvert_refuses_parallelized_layers_by_name_and_leaves_the_model_as_it_was():
    out = spawn(_unconvert_worker, world=WORLD)
    for rank in range(WORLD):
        got = out[rank]
        assert all(v is True for k, v in got.items() if isinstance(k, tuple)), got
        tp, fsdp = got["tensor parallel"], got["fully_shard"]
        assert tp.startswith(
            "unconvert: layer '1.up' is tensor-parallel (QuantColwiseParallel)"), tp
        assert "unconvert the model before parallelize_module" in tp, tp
        assert fsdp.startswith("unconvert: layer '1.up' has DTensor parameters"), fsdp
        assert "before fully_shard" in fsdp, fsdp


@pytest.fixture(scope="module")
def edge():
    """``(cases, rank -> results)`` of one 2-rank run of the tests below."""
    cases = list(EDGE)
    if _compile_supported() and SCOPE == tuple(RECIPES):
        cases += EDGE_COMPILED
    return cases, spawn(_edge_worker, cases, world=WORLD)


def _assert_cases(edge, selected):
    cases, out = edge
    keys = [c for c in cases if selected(c)]
    assert keys
    for rank in range(WORLD):
        for key in keys:
            assert isinstance(out[rank][key], dict), (rank, key, out[rank][key])
            r = dict(out[rank][key])
            assert r.pop("counted") == {} and r.pop("collective bytes") == 0, key
            assert r.pop("keys"), key
            r.pop("warnings")
            assert all(r.values()), (rank, key, r)


@pytest.mark.timeout(600)
def test_uneven_shards_under_a_per_tensor_scale(edge):
    """99 features over 2 ranks (50 and 49): FP8 current scaling's one scale per tensor needs no
    alignment, and the results are the single process's as for even shards (eager and
    compiled); a block format whose blocks the shards split is refused, with the shard sizes."""
    _assert_cases(edge, lambda c: c[3:] == (UNEVEN,))
    for rank in range(WORLD):
        assert isinstance(edge[1][rank]["refusals"], dict), edge[1][rank]["refusals"]
        msg = edge[1][rank]["refusals"]["uneven blocks"]
        assert msg.startswith("ValueError") and "'proj'" in msg, msg
        assert "out_features=99 over 2 ranks into 50/49 per rank" in msg, msg
        assert "block of 32" in msg, msg


@pytest.mark.timeout(600)
def test_column_parallel_bias_gradient_is_within_its_bound(edge):
    """At 98 features (49 per rank) torch sums a column-parallel layer's bias gradient columns
    in another order than over the 98 columns of one process (fp32: other last bits): within
    the module docstring's bound, the rest as for every width."""
    _assert_cases(edge, lambda c: c[3:] == (BIAS_ORDER,))


@pytest.mark.timeout(600)
def test_row_parallel_layer_under_row_scaled_nvfp4(edge):
    """Row-scaled NVFP4 activations: the row-parallel layer's input holds a slice of each row,
    its per-row amaxes are all-reduced elementwise, so its weight gradient (the decoded input)
    is the single process's bit for bit (eager and compiled), the rest as for every recipe."""
    _assert_cases(edge, lambda c: c[1] == "nvfp4_row_scaled")


@pytest.mark.timeout(600)
def test_custom_recipe_with_delayed_scaling_is_refused(edge):
    """A CustomRecipe whose factory requests delayed scaling gets per-process scales, as
    DelayedScaling does: refused at the forward, or at parallelize_module given the recipe; one
    whose factory returns value quantizers runs."""
    for rank in range(WORLD):
        got = edge[1][rank]["refusals"]
        assert isinstance(got, dict), got
        for key in ("custom delayed", "custom delayed, at parallelize"):
            msg = got[key]
            assert msg.startswith("ValueError") and "'proj'" in msg, (key, msg)
            assert "CustomRecipe" in msg and "delayed scaling" in msg, (key, msg)
        assert got["custom stateless"] == "did not raise", got["custom stateless"]


@pytest.mark.timeout(600)
def test_save_weight_copy_and_save_input_copy(edge):
    """``save_weight_copy=False`` / ``save_input_copy=False`` on a parallelized layer: as on a
    plain Linear, the local weight shard or the local input is saved as is and its columnwise
    copy made in backward, with the same bits."""
    for rank in range(WORLD):
        saved = edge[1][rank]["saved"]
        assert isinstance(saved, dict), saved
        assert len(saved) == 2 * 2 * 5 and all(saved.values()), (rank, saved)


@pytest.mark.timeout(600)
def test_parallel_layers_pass_each_gemms_accumulation_to_cublas(edge):
    """Colwise and rowwise layers multiply forward with fast accumulation and backward with
    the split accumulator, as Float8CurrentScaling's MMParams say."""
    _, out = edge
    for rank in range(WORLD):
        assert out[rank]["accumulation"] == {"colwise": [True, False, False],
                                             "rowwise": [True, False, False]}, out[rank]


@pytest.mark.timeout(600)
def test_parallel_layers_under_torch_autocast(edge):
    """fp32 layers under torch.autocast give bf16 outputs, as a Linear does there, the column-
    parallel one its columns of the single process's; the gradients keep the fp32 dtypes."""
    _, out = edge
    for rank in range(WORLD):
        got = out[rank]["torch.autocast"]
        assert isinstance(got, dict), got
        assert got["colwise"] == {"dtype": "torch.bfloat16", "grads": ["torch.float32"],
                                  "equal": True}, got
        assert got["rowwise"] == {"dtype": "torch.bfloat16", "grads": ["torch.float32"]}, got
