"""quant's Linear under tensor and sequence parallelism (``QuantColwiseParallel``,
``QuantRowwiseParallel``, ``PrepareQuantModuleInput``) on 2 gloo ranks, against the same module
in one process.

Every case runs a step whose loss is linear in the output (``(y * g).sum()`` with a fixed ``g``),
so the output gradient is ``g`` in both runs and each GEMM's operands can be compared on their
own. What is bitwise: every GEMM whose contraction runs over a dimension each rank holds whole
(the column-parallel forward, every weight gradient, the row-parallel input gradient) and the
bias gradients, since each rank quantizes its pieces with the scales of the unsharded tensor
(amaxes all-reduced over the group) and the emulated GEMM computes each output element alone.
What is bounded: the two results that are sums of the ranks' partial products (the row-parallel
output, all-reduced or reduce-scattered, and the input gradient of the column-parallel layers):
each rank rounds its partial sum to bf16 and the reduction rounds again, so per element
``|tp - ref| <= (world + 2) * 2**-9 * S`` where ``S = |A| @ |B|`` (the sum of the magnitudes
of the products; the quantized operands' magnitudes are bounded by twice the high-precision
ones', hence ``2**-8`` below), plus the bias in ``S`` where it is added after the reduction.
NVFP4's default recipe rounds its gradients stochastically: a rank quantizing its shard of a
gradient draws other random bits than one process quantizing the whole gradient, so the GEMMs
reading the column-parallel layers' quantized gradients are compared by relative error (0.25,
the spread of two stochastic roundings at these widths is about 0.1); everything else is as
above.
"""

from __future__ import annotations

import contextlib
import os
import warnings

import formats
import pytest
import quant_recipes as qr
import torch
import torch.distributed as dist
import torch.nn.functional as F
from _dist_helpers import init, spawn
from torch.utils._python_dispatch import TorchDispatchMode

WORLD = 2
D, H, S, HEAD = 64, 256, 256, 64  # 128 output features / input features per rank
DTYPE = torch.bfloat16  # NVFP4's Hadamard transform takes bf16

#: recipe id -> factory: every format's built-in recipe, and NVFP4 without stochastic rounding
RECIPES = formats.recipes("nvfp4_no_sr", defaults=True, qualified=True)
#: The older and newer torch releases' sessions (``QUANT_TEST_SCOPE=compat``) run one recipe:
#: what differs between releases is DTensor and the compiler, not the formats.
SCOPE = ("fp8_current",) if os.environ.get("QUANT_TEST_SCOPE") == "compat" else tuple(RECIPES)


def _bound(tp, ref, s):
    """Whether ``tp`` is within the reduction bound of the module docstring of ``ref``."""
    return bool(((tp.float() - ref.float()).abs() <= (WORLD + 2) * 2.0 ** -8 * s + 1e-30).all())


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
    def __init__(self):
        super().__init__()
        self.up = qr.Linear(D, H, dtype=DTYPE)
        self.down = qr.Linear(H, D, dtype=DTYPE)

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

    recipe = RECIPES[name]()
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
            tg = tpp.grad.to_local()
            want = rp.grad if (p == "bias" and dim == 1) else rp.grad.chunk(WORLD, dim)[rank]
            if sr and dim == 0:
                out[f"{n}.{p}.grad"] = _close(tg, want)
            elif seq and p == "bias" and dim == 1:
                # summed over each rank's tokens, then across the ranks (fp32, one rounding)
                out[f"{n}.{p}.grad"] = _bound(tg, want, g.abs().sum((0, 1)))
            else:
                out[f"{n}.{p}.grad"] = torch.equal(tg, want)
    return out


def _refusals(mesh):
    """Each refusal's message, or a note that it did not raise."""
    from torch.distributed.tensor.parallel import parallelize_module

    got = {}

    def attempt(key, fn):
        try:
            fn()
        except (TypeError, ValueError) as e:
            got[key] = f"{type(e).__name__}: {e}"
        else:
            got[key] = "did not raise"

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


def _worker(rank, port, cases, out):
    init(rank, port, WORLD)
    try:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import parallelize_module

        mesh = init_device_mesh("cpu", (WORLD,))
        results = {}
        for kind, name, compiled in cases:
            torch.manual_seed(0)
            ref = MLP() if kind == "mlp" else Attention()
            ref.keep = True
            tp = MLP() if kind == "mlp" else Attention()
            tp.load_state_dict(ref.state_dict())
            parallelize_module(tp, mesh, _styles(kind))
            gen = torch.Generator().manual_seed(1)
            shape = (2, 32, D) if kind != "sequence" else (1, S, D)
            x = torch.randn(shape, generator=gen).to(DTYPE)
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
            results[(kind, name, compiled)] = res
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
