"""quant's Linear under FSDP2 (``fully_shard``) on 2 ranks.

The bf16 all-gather: it trains, and quantizing the weight again in backward
(``save_weight_copy=False``, the FSDP2-friendly mode: the gathered weight is freed after forward)
gives the same sharded gradients as keeping the copy.

The weight all-gather in the quantized format (``enable_fsdp_quantized_all_gather``): per recipe,
each rank's loss and its shard of every gradient equal, bit for bit, the single-process run of
the unsharded model (the GEMMs are the reference emulation on CPU, so equal operands give equal
bits), and the bytes all-gathered are the quantized ones (counted at FSDP2's collective,
``torch.distributed.all_gather_single`` / ``all_gather_into_tensor``).

``QUANT_DIST_BACKEND=nccl`` runs the same on one GPU per rank (bench/device.sh fsdp2); the default
is gloo on the CPU.
"""

from __future__ import annotations

import io
import warnings

import formats
import pytest
import quant_recipes as qr
import torch
import torch.distributed as dist
from _dist_helpers import init, spawn
from _fsdp_counting import count_all_gathers


def _fully_shard():
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:
        from torch.distributed._composable.fsdp import fully_shard
    return fully_shard


def _worker(rank: int, port: int, out) -> None:
    device = init(rank, port)
    try:
        grads = {}
        for save in (True, False):
            torch.manual_seed(0)
            model = torch.nn.Sequential(*(qr.Linear(64, 64, bias=False, save_weight_copy=save,
                                                    device=device) for _ in range(2)))
            for layer in model:
                _fully_shard()(layer)
            _fully_shard()(model)
            x = torch.randn(32, 64, generator=torch.Generator().manual_seed(rank)).to(device)
            with qr.autocast(recipe=qr.Float8CurrentScaling()):
                model(x).pow(2).sum().backward()
            grads[save] = [p.grad.to_local().clone() for p in model.parameters()]
        out[rank] = all(torch.equal(a, b) for a, b in zip(grads[True], grads[False],
                                                          strict=True))
    finally:
        dist.destroy_process_group()


def _spawn(worker, *args):
    """Run ``worker(rank, port, *args, out)`` on 2 ranks; returns ``out`` (rank -> result)."""
    try:
        _fully_shard()
    except ImportError:
        pytest.skip("this torch has no FSDP2")
    return spawn(worker, *args)


@pytest.mark.timeout(180)
def test_fsdp2_requantized_weight_gives_the_same_gradients():
    out = _spawn(_worker)
    assert out[0] and out[1]


D_IN, D_OUT, TOKENS = 64, 256, 32  # 128 weight rows per rank: every block format shards


def _up(a: int, b: int) -> int:
    return -(-a // b) * b


#: recipe -> bytes one all-gather of an [M, K] weight moves: data and scales as the format lays
#: them out, numerics.md
ALL_GATHER_BYTES = {
    "fp8_current": lambda m, k: m * k,
    "fp8_block": lambda m, k: m * k + 4 * (m // 128) * _up(-(-k // 128), 4),
    # 1x32 blocks: the columnwise copy (32x1 blocks) differs and is gathered too
    "mxfp8": lambda m, k: 2 * m * k + m * _up(k // 32, 4) + _up(m // 32, 4) * _up(k, 128),
    "mxfp8_2d": lambda m, k: m * k + m * _up(k // 32, 4),
    "nvfp4": lambda m, k: m * k // 2 + m * _up(k // 16, 4),
}
#: recipe -> (factory, all-gather bytes): every format whose weights all-gather quantized
#: (tests/formats.py), and MXFP8 with 2D blocks
RECIPES = {
    name: (make, ALL_GATHER_BYTES[name])
    for name, make in formats.recipes("mxfp8_2d", defaults=True, qualified=True).items()
    if formats.format_of(name).fsdp2_quantized
}


def _model(shapes, device, dtype):
    torch.manual_seed(0)
    model = torch.nn.Sequential(*(qr.Linear(k, m, bias=False, device=device, dtype=dtype)
                                  for m, k in shapes))
    with torch.no_grad():  # rank 0's shard holds the tensor amax, far from rank 1's
        for layer in model:
            layer.weight[:4] *= 8
    return model


def _step(model, recipe, x, seed):
    torch.manual_seed(seed)  # NVFP4 gradients round stochastically: the same draws in both runs
    with qr.autocast(recipe=recipe):
        loss = model(x).float().pow(2).sum()
    loss.backward()
    return loss.detach()


def _quantized_worker(rank: int, port: int, cases: list[tuple], out) -> None:
    """Per case ``(recipe name, weight shapes [M, K], compile the layers)``: the FSDP2 step
    with the quantized all-gather against the unsharded single-process step."""
    device = init(rank, port)
    dtype = torch.bfloat16  # NVFP4's RHT (inputs, gradients) takes bf16
    try:
        results = {}
        for name, shapes, compiled in cases:
            make, _ = RECIPES[name]
            recipe = make()
            xs = [torch.randn(TOKENS, D_IN, generator=torch.Generator().manual_seed(r))
                  .to(device, dtype) for r in range(2)]
            # the reference: the unsharded model on one process, each rank's batch in turn
            ref = _model(shapes, device, dtype)
            ref_losses, ref_grads = [], []
            for r in range(2):
                ref.zero_grad(set_to_none=True)
                ref_losses.append(_step(ref, recipe, xs[r], seed=10 + r))
                ref_grads.append([p.grad for p in ref.parameters()])
            # FSDP2 averages the ranks' gradients in their dtype: one rounding of the sum, /2 exact
            mean = [(a + b) / 2 for a, b in zip(*ref_grads, strict=True)]
            model = qr.enable_fsdp_quantized_all_gather(_model(shapes, device, dtype), recipe)
            for layer in model:
                _fully_shard()(layer)
            _fully_shard()(model)
            if compiled:  # each layer one graph; FSDP2's hooks run eagerly around it
                for layer in model:
                    layer.compile(fullgraph=True)
            qr.reset_all_gather_bytes()
            with count_all_gathers() as counted, warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                loss = _step(model, recipe, xs[rank], seed=10 + rank)
            grads = [p.grad.to_local() for p in model.parameters()]
            results[name + (":compiled" if compiled else "")] = {
                "loss": torch.equal(loss, ref_losses[rank]),
                "grads": [torch.equal(g, m.chunk(2)[rank]) for g, m in zip(grads, mean,
                                                                         strict=True)],
                "bytes": sum(counted), "extension": qr.all_gather_bytes(),
                "warnings": [str(w.message) for w in caught
                             if "FSDP2 quantized all-gather" in str(w.message)],
            }
        out[rank] = results
    finally:
        dist.destroy_process_group()


def _run(cases):
    out = _spawn(_quantized_worker, cases)
    return out[0], out[1]


@pytest.mark.timeout(300)
def test_fsdp2_quantized_all_gather_equals_the_unsharded_step():
    shapes = [(D_OUT, D_IN), (D_OUT, D_OUT)]  # [M, K]: 128 rows per rank
    r0, r1 = _run([(name, shapes, False) for name in RECIPES])
    bf16 = 2 * sum(2 * m * k for m, k in shapes)
    for name, (_, nbytes) in RECIPES.items():
        # each layer all-gathers twice: forward, and again for backward after resharding
        expected = 2 * sum(nbytes(m, k) for m, k in shapes)
        for res in (r0[name], r1[name]):
            assert res["loss"], name
            assert all(res["grads"]), (name, res["grads"])
            assert res["bytes"] == expected, (name, res["bytes"], expected)
            assert res["extension"] == {"quantized": expected}, (name, res["extension"])
            assert not res["warnings"], (name, res["warnings"])
        if name != "mxfp8":
            assert expected < 0.6 * bf16, name


@pytest.mark.timeout(300)
def test_uneven_and_unshardable_weights():
    """Per-tensor FP8 gathers an uneven split (FSDP2 pads the last shard); FP8 128x128 blocks
    over 32 rows per rank, or an uneven split, fall back to the high-precision gather with a
    warning that says why.
    Both still equal the unsharded step."""
    r0, r1 = _run([("fp8_current", [(255, 64), (64, 255)], False),
                   ("fp8_block", [(64, 64), (255, 64)], False)])
    for res in (r0, r1):
        fp8, block = res["fp8_current"], res["fp8_block"]
        assert fp8["loss"] and all(fp8["grads"]) and not fp8["warnings"]
        # 255 rows: each rank sends 128 (one zero row of padding on rank 1)
        assert fp8["extension"] == {"quantized": 2 * (2 * 128 * 64 + 64 * 255)}
        assert block["loss"] and all(block["grads"])
        # bf16, forward and backward; 255 rows padded to 2 x 128
        assert block["extension"] == {"high_precision": 2 * 2 * (64 * 64 + 2 * 128 * 64)}
        assert len(block["warnings"]) == 2  # once per weight shape
        assert all("multiple of 128 rows" in w for w in block["warnings"])


@pytest.mark.timeout(400)
def test_compiled_layers_with_quantized_all_gather():
    """Each layer compiled (fullgraph): the gathered QuantizedTensor is a graph input, its
    columnwise copy is built inside the compiled backward; still the unsharded step's bits."""
    _needs_compile_support()
    shapes = [(D_OUT, D_IN), (D_OUT, D_OUT)]
    names = ["fp8_current", "fp8_block", "nvfp4"]
    r0, r1 = _run([(name, shapes, True) for name in names])
    for name in names:
        for res in (r0[name + ":compiled"], r1[name + ":compiled"]):
            assert res["loss"] and all(res["grads"]), (name, res)
            assert res["extension"] == {"quantized": res["bytes"]}


def _needs_compile_support():
    quant_dynamo = pytest.importorskip("quant_dynamo", reason="compiling needs quant-dynamo")
    if not quant_dynamo.compile_supported():
        pytest.skip(f"no opaque-object API on torch {torch.__version__}: quant compiles from 2.10")


def _state_worker(rank: int, port: int, out) -> None:
    device = init(rank, port)
    try:
        recipe = qr.Float8CurrentScaling()
        model = qr.enable_fsdp_quantized_all_gather(_model([(256, 64)], device, torch.float32),
                                                    recipe)
        _fully_shard()(model[0])
        _fully_shard()(model)
        try:
            qr.enable_fsdp_quantized_all_gather(model, recipe)
            refused = ""
        except TypeError as e:
            refused = str(e)
        blob = io.BytesIO()
        torch.save(model.state_dict(), blob)
        before = model[0].weight.to_local().clone()
        opt = torch.optim.AdamW(model.parameters(), lr=0.1)
        with qr.autocast(recipe=recipe):
            model(torch.randn(8, 64, device=device)).sum().backward()
        opt.step()  # updates the high-precision shard inside the wrapper
        moved = not torch.equal(model[0].weight.to_local(), before)
        blob.seek(0)
        model.load_state_dict(torch.load(blob, weights_only=False))
        out[rank] = {"refused": refused, "moved": moved,
                     "restored": torch.equal(model[0].weight.to_local(), before),
                     "local": type(model[0].weight.to_local()).__name__}
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(180)
def test_sharded_weight_trains_saves_and_loads():
    """The sharded weight stays a high-precision wrapper: the optimizer steps it, its state
    dict saves and loads; wrapping after fully_shard is refused."""
    out = _spawn(_state_worker)
    for res in (out[0], out[1]):
        assert "call it before fully_shard" in res["refused"]
        assert res["moved"] and res["restored"] and res["local"] == "QuantizedAllGatherWeight"


def _one_rank_worker(rank: int, port: int, out) -> None:
    """Every recipe's quantized all-gather on a one-rank group (the README's example) equals
    the plain step of the same model."""
    device = init(rank, port, world=1)
    dtype = torch.bfloat16
    try:
        results = {}
        shapes = [(D_OUT, D_IN), (D_OUT, D_OUT)]
        x = torch.randn(TOKENS, D_IN, generator=torch.Generator().manual_seed(0)).to(device,
                                                                                     dtype)
        for name, (make, _) in RECIPES.items():
            recipe = make()
            ref = _model(shapes, device, dtype)
            ref_loss = _step(ref, recipe, x, seed=3)
            model = qr.enable_fsdp_quantized_all_gather(_model(shapes, device, dtype), recipe)
            for layer in model:
                _fully_shard()(layer)
            _fully_shard()(model)
            loss = _step(model, recipe, x, seed=3)
            results[name] = torch.equal(loss, ref_loss) and all(
                torch.equal(p.grad.to_local(), q.grad)
                for p, q in zip(model.parameters(), ref.parameters(), strict=True))
        out[rank] = results
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(300)
def test_fsdp2_quantized_all_gather_on_one_rank():
    try:
        _fully_shard()
    except ImportError:
        pytest.skip("this torch has no FSDP2")
    results = spawn(_one_rank_worker, world=1)[0]
    assert all(results.values()), results


def _frozen_worker(rank: int, port: int, out) -> None:
    """A frozen layer between trainable ones (fine-tuning): its dgrad reads the weight's
    columnwise copy, which must be gathered although the weight takes no gradient."""
    device = init(rank, port)
    dtype = torch.bfloat16
    try:
        results = {}
        shapes = [(D_OUT, D_IN), (D_OUT, D_OUT), (D_OUT, D_OUT)]
        xs = [torch.randn(TOKENS, D_IN, generator=torch.Generator().manual_seed(r))
              .to(device, dtype) for r in range(2)]
        for name in ("mxfp8", "fp8_block", "nvfp4"):
            recipe = RECIPES[name][0]()
            ref = _model(shapes, device, dtype)
            ref[1].weight.requires_grad_(False)
            ref_grads = []
            for r in range(2):
                ref.zero_grad(set_to_none=True)
                _step(ref, recipe, xs[r], seed=10 + r)
                ref_grads.append([p.grad for p in (ref[0].weight, ref[2].weight)])
            mean = [(a + b) / 2 for a, b in zip(*ref_grads, strict=True)]
            model = _model(shapes, device, dtype)
            model[1].weight.requires_grad_(False)
            qr.enable_fsdp_quantized_all_gather(model, recipe)
            for layer in model:
                _fully_shard()(layer)
            _fully_shard()(model)
            _step(model, recipe, xs[rank], seed=10 + rank)
            grads = [model[0].weight.grad.to_local(), model[2].weight.grad.to_local()]
            results[name] = all(torch.equal(g, m.chunk(2)[rank])
                                for g, m in zip(grads, mean, strict=True))
        out[rank] = results
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(300)
def test_fsdp2_quantized_all_gather_with_a_frozen_layer():
    out = _spawn(_frozen_worker)
    assert all(out[0].values()) and all(out[1].values()), out


def _checkpoint_worker(rank: int, port: int, folder: str, with_dcp: bool, out) -> None:
    """With the quantized all-gather enabled, a plain ``state_dict`` loads with
    ``torch.load(weights_only=True)``, the full state dict too, and DCP round-trips (where
    numpy is installed: DCP gathers its plan through numpy on gloo)."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    device = init(rank, port)
    try:
        recipe = qr.MXFP8BlockScaling()

        def build(seed):
            torch.manual_seed(seed)
            model = torch.nn.Sequential(qr.Linear(D_IN, D_OUT, bias=False, device=device),
                                        qr.Linear(D_OUT, D_OUT, bias=False, device=device))
            qr.enable_fsdp_quantized_all_gather(model, recipe)
            for layer in model:
                _fully_shard()(layer)
            _fully_shard()(model)
            return model

        model = build(0)
        results = {}
        blob = io.BytesIO()
        torch.save(model.state_dict(), blob)
        blob.seek(0)
        local = torch.load(blob, weights_only=True)
        results["plain"] = all(torch.equal(local[k].to_local(), v.to_local())
                               for k, v in model.state_dict().items())
        full = get_model_state_dict(
            model, options=__import__("torch.distributed.checkpoint.state_dict",
                                      fromlist=["StateDictOptions"]).StateDictOptions(
                full_state_dict=True, cpu_offload=True))
        blob = io.BytesIO()
        torch.save(full, blob)
        blob.seek(0)
        results["full"] = sorted(torch.load(blob, weights_only=True)) == sorted(full)
        other = build(1)
        if with_dcp:
            dcp.save(model.state_dict(), checkpoint_id=folder)
            state = other.state_dict()
            dcp.load(state, checkpoint_id=folder)
            results["dcp"] = all(torch.equal(p.to_local(), q.to_local()) for p, q in
                                 zip(model.parameters(), other.parameters(), strict=True))
        x = torch.randn(TOKENS, D_IN, generator=torch.Generator().manual_seed(rank))
        results["trains"] = bool(torch.isfinite(_step(other, recipe, x.to(device), seed=1)))
        out[rank] = results
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(300)
def test_fsdp2_quantized_all_gather_checkpoints_load_the_standard_way(tmp_path):
    import importlib.util

    with_dcp = importlib.util.find_spec("numpy") is not None
    out = _spawn(_checkpoint_worker, str(tmp_path / "dcp"), with_dcp)
    assert all(out[0].values()) and all(out[1].values()), out
    assert ("dcp" in out[0]) is with_dcp
