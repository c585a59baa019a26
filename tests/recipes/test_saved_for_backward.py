"""What a quantized Linear saves for backward: only what the backward GEMMs read.

The backward GEMMs use both forward operands transposed: dgrad reads the weight's columnwise
copy, wgrad the input's. So per recipe the saved tensors must be exactly the columnwise buffers
of the input and of the weight (named below per storage, independently of the code), nothing of
an operand whose gradient partner is not needed, and all of them for the "dequantized" override.
"""

from __future__ import annotations

import dataclasses

import formats
import pytest
import quant_recipes as qr
import torch

#: The buffers of each storage that a columnwise (transposed) use reads.
COLUMNWISE = {
    "Float8TensorStorage": ("_transpose", "_scale_inv"),
    "MXFP8TensorStorage": ("_columnwise_data", "_columnwise_scale_inv"),
    "Float8BlockwiseQTensorStorage": ("_columnwise_data", "_columnwise_scale_inv"),
    "NVFP4TensorStorage": ("_columnwise_data", "_columnwise_scale_inv", "_amax_columnwise"),
}
#: Every format's built-in recipe (tests/formats.py), as factories.
RECIPES = formats.default_recipes()


def _signature(tensors) -> list[tuple[tuple[int, ...], torch.dtype]]:
    return sorted(((tuple(t.shape), t.dtype) for t in tensors if t.numel()), key=str)


def _saved_in_forward(m, x, recipe):
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with qr.autocast(recipe=recipe):
            y = m(x)
    return y, saved


def _expected(m, x, names_of, which):
    """The columnwise buffers of the input and/or weight storages the module's quantizers make."""
    fwd = m._qset.fwd
    out = []
    for i, t in ((0, x), (1, m.weight)):
        if i not in which:
            continue
        storage = fwd[i].quantize(t.detach())
        out += [getattr(storage, n) for n in names_of[type(storage).__name__]]
    return _signature(out)


def _layer_and_input(grads: str):
    """A bf16 Linear and its input, the gradients of ``grads`` ("both", "input_only",
    "weight_only") asked for."""
    torch.manual_seed(0)
    m = qr.Linear(64, 32, bias=False, dtype=torch.bfloat16)
    x = torch.randn(32, 64, dtype=torch.bfloat16)
    x.requires_grad_(grads in ("both", "input_only"))
    m.weight.requires_grad_(grads in ("both", "weight_only"))
    return m, x


@pytest.mark.parametrize("name", list(RECIPES))
@pytest.mark.parametrize("grads", ["both", "input_only", "weight_only"])
def test_only_the_columnwise_copies_are_saved(name, grads):
    m, x = _layer_and_input(grads)
    y, saved = _saved_in_forward(m, x, RECIPES[name]())
    # wgrad (weight needs grad) reads the input's copy; dgrad (input needs grad) the weight's
    which = {0} if grads == "weight_only" else {1} if grads == "input_only" else {0, 1}
    assert _signature(saved) == _expected(m, x, COLUMNWISE, which)
    y.float().sum().backward()  # and backward runs on what was kept


@pytest.mark.parametrize("name", list(RECIPES))
@pytest.mark.parametrize("grads", ["both", "input_only", "weight_only"])
def test_no_placeholder_for_an_absent_buffer_is_saved(name, grads):
    """The buffers backward does not read are neither made nor saved in forward (backward puts
    the empty stand-ins back): every saved tensor holds data, and the gradients are unchanged."""
    m, x = _layer_and_input(grads)
    y, saved = _saved_in_forward(m, x, RECIPES[name]())
    assert all(t.numel() for t in saved), [tuple(t.shape) for t in saved]
    y.float().sum().backward()
    assert (x.grad is not None) == x.requires_grad
    assert (m.weight.grad is not None) == m.weight.requires_grad


def test_a_compiled_linear_saves_no_placeholder():
    """Compiled, the forward graph's outputs for backward hold no empty tensor either (each
    output costs host time on every call)."""
    quant_dynamo = pytest.importorskip("quant_dynamo")
    if not quant_dynamo.compile_supported():
        pytest.skip("no torch.compile support for quant on this torch")
    from torch._dynamo.backends.common import aot_autograd

    outputs = []

    def forward_compiler(gm, example_inputs):
        out = next(n for n in gm.graph.nodes if n.op == "output")
        outputs.extend(o.meta["val"] for o in out.args[0] if hasattr(o, "meta"))
        return gm.forward

    torch._dynamo.reset()
    torch.manual_seed(0)
    m = qr.Linear(64, 32, bias=False, dtype=torch.bfloat16)
    recipe = qr.Float8CurrentScaling()

    def step(x):
        with qr.autocast(recipe=recipe):
            return m(x)

    fn = torch.compile(step, fullgraph=True,
                       backend=aot_autograd(fw_compiler=forward_compiler,
                                            bw_compiler=lambda gm, _: gm.forward))
    x = torch.randn(32, 64, dtype=torch.bfloat16, requires_grad=True)
    fn(x).float().sum().backward()
    tensors = [t for t in outputs if isinstance(t, torch.Tensor)]
    assert len(tensors) > 1 and all(t.numel() for t in tensors), [t.shape for t in tensors]


#: The buffers of each storage that a rowwise use reads.
ROWWISE = {
    "Float8TensorStorage": ("_data", "_scale_inv"),
    "MXFP8TensorStorage": ("_rowwise_data", "_rowwise_scale_inv"),
    "Float8BlockwiseQTensorStorage": ("_rowwise_data", "_rowwise_scale_inv"),
    "NVFP4TensorStorage": ("_rowwise_data", "_rowwise_scale_inv", "_amax_rowwise"),
}


@pytest.mark.parametrize("name", list(RECIPES))
def test_dequantized_override_keeps_only_the_rowwise_forms(name):
    """``backward_override="dequantized"`` runs the backward GEMMs on the rowwise forms, so
    those are all that is saved: forward makes no columnwise copy no GEMM would read."""
    torch.manual_seed(0)
    recipe = dataclasses.replace(RECIPES[name](), backward_override="dequantized")
    m = qr.Linear(64, 32, bias=False, dtype=torch.bfloat16)
    x = torch.randn(32, 64, dtype=torch.bfloat16, requires_grad=True)
    y, saved = _saved_in_forward(m, x, recipe)
    assert _signature(saved) == _expected(m, x, ROWWISE, {0, 1})
    y.float().sum().backward()
    assert x.grad is not None and m.weight.grad is not None


def test_high_precision_override_saves_the_originals_only():
    torch.manual_seed(0)
    m = qr.Linear(64, 32, bias=False, dtype=torch.bfloat16)
    x = torch.randn(32, 64, dtype=torch.bfloat16, requires_grad=True)
    _, saved = _saved_in_forward(m, x, qr.Float8CurrentScaling(backward_override="high_precision"))
    assert len(saved) == 2 and saved[0] is x and saved[1] is m.weight


def _grads(m, x, recipe, seed=0):
    torch.manual_seed(seed)  # NVFP4's stochastic rounding of the gradient
    x = x.detach().clone().requires_grad_()
    m.zero_grad(set_to_none=True)
    with qr.autocast(recipe=recipe):
        y = m(x)
    y.float().pow(2).sum().backward()
    return y.detach(), x.grad, m.weight.grad


#: ``Linear`` switch -> (the operand it keeps as is, the other operand's index in ``_expected``).
REQUANTIZED = {"save_weight_copy": (lambda m, x: m.weight, 0),
               "save_input_copy": (lambda m, x: x, 1)}


@pytest.mark.parametrize("switch", sorted(REQUANTIZED))
@pytest.mark.parametrize("name", list(RECIPES))
def test_an_operand_requantized_in_backward_is_saved_as_is_and_gives_the_same_bits(name, switch):
    """``save_weight_copy=False`` / ``save_input_copy=False``: the weight (a parameter, no new
    memory) or the input itself is saved instead of its quantized copy (as torchao does for the
    input), and backward's copy has the forward copy's bytes."""
    torch.manual_seed(0)
    saving = qr.Linear(128, 64, bias=False, dtype=torch.bfloat16)
    requant = qr.Linear(128, 64, bias=False, dtype=torch.bfloat16, **{switch: False})
    requant.load_state_dict(saving.state_dict())
    x = torch.randn(32, 128, dtype=torch.bfloat16, requires_grad=True)
    kept_of, other = REQUANTIZED[switch]
    kept = kept_of(requant, x)
    _, saved = _saved_in_forward(requant, x, RECIPES[name]())
    assert any(t is kept for t in saved)
    assert _signature([t for t in saved if t is not kept]) == _expected(
        requant, x, COLUMNWISE, which=(other,))
    for a, b in zip(_grads(saving, x, RECIPES[name]()), _grads(requant, x, RECIPES[name]()),
                    strict=True):
        assert torch.equal(a, b)


def test_input_and_weight_both_requantized_save_no_copy_at_all():
    torch.manual_seed(0)
    m = qr.Linear(64, 32, bias=False, save_input_copy=False, save_weight_copy=False)
    x = torch.randn(16, 64, requires_grad=True)
    _, saved = _saved_in_forward(m, x, qr.Float8CurrentScaling())
    assert all(t is x or t is m.weight for t in saved) and len(saved) == 2
    assert "save_weight_copy=False, save_input_copy=False" in repr(m)


@pytest.mark.parametrize("switch", sorted(REQUANTIZED))
def test_delayed_scaling_keeps_the_copy(switch):
    """A delayed-scaling scale changes when the region exits, before backward: requantizing
    would not give the forward's bytes, so the copy is saved."""
    m = qr.Linear(64, 32, bias=False, **{switch: False})
    x = torch.randn(16, 64, requires_grad=True)
    _, saved = _saved_in_forward(m, x, qr.DelayedScaling())
    assert not any(t is REQUANTIZED[switch][0](m, x) for t in saved)
    assert f"{switch}=False" in repr(m)


@pytest.mark.parametrize("switch", sorted(REQUANTIZED))
@pytest.mark.parametrize("name", ["current", "mxfp8", "block"])
def test_an_operand_requantized_in_backward_compiles_to_the_same_bits(name, switch):
    """Compiled and eager, the requantizing layer gives the saving layer's eager bits."""
    dynamo = pytest.importorskip("quant_dynamo")
    if not dynamo.compile_supported():
        pytest.skip("no opaque-object API on this torch")
    torch.manual_seed(0)
    m = qr.Linear(128, 64, bias=False, dtype=torch.bfloat16, **{switch: False})
    saving = qr.Linear(128, 64, bias=False, dtype=torch.bfloat16)
    saving.load_state_dict(m.state_dict())
    x = torch.randn(32, 128, dtype=torch.bfloat16)
    recipe = RECIPES[name]()

    def fn(t):
        with qr.autocast(recipe=recipe):
            return m(t)

    torch._dynamo.reset()
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)
    want = _grads(saving, x, recipe)
    for f in (fn, compiled):
        t = x.clone().requires_grad_()
        m.zero_grad(set_to_none=True)
        y = f(t)
        y.float().pow(2).sum().backward()
        for a, b in zip((y.detach(), t.grad, m.weight.grad), want, strict=True):
            assert torch.equal(a, b)


# ------------------------------------------------------------------ one table, every layer kind
# The dense, tensor-parallel and grouped layers share one operand policy
# (quant_recipes.operands). What each keeps for backward, per recipe, flag and override, as the
# policy states it: "x"/"w" the input/weight tensor itself, "x.col"/"w.col" (".row") the
# columnwise (rowwise) buffers of its quantization by the layer's quantizer, "lay" the groups'
# padded layout (quant_recipes.moe.fp8.Layout, its tensors).
#: (save flags, which gradients, override) -> what a dense or tensor-parallel layer saves.
DENSE = {
    ("copies", "both", None): {"x.col", "w.col"},
    ("copies", "input_only", None): {"w.col"},
    ("copies", "weight_only", None): {"x.col"},
    ("no weight copy", "both", None): {"x.col", "w"},
    ("no weight copy", "weight_only", None): {"x.col"},
    ("no input copy", "both", None): {"x", "w.col"},
    ("no input copy", "input_only", None): {"w.col"},
    ("no copies", "both", None): {"x", "w"},
    ("copies", "both", "dequantized"): {"x.row", "w.row"},
    ("no copies", "both", "dequantized"): {"x.row", "w.row"},
    ("copies", "both", "high_precision"): {"x", "w"},
}
#: The same for a GroupedLinear: its per-group paths quantize both operands again in backward
#: whatever the flags (the quantize-once FP8 path, tests/recipes/test_grouped_fp8.py, keeps
#: transposed copies as the flags say).
GROUPED = {
    ("copies", "both", None): {"x", "lay", "w"},
    ("copies", "input_only", None): {"lay", "w"},
    ("copies", "weight_only", None): {"x", "lay"},
    ("no copies", "both", None): {"x", "lay", "w"},
    ("copies", "both", "dequantized"): {"x", "lay", "w"},
    ("copies", "both", "high_precision"): {"x", "lay", "w"},
}
FLAGS = {"copies": {}, "no weight copy": {"save_weight_copy": False},
         "no input copy": {"save_input_copy": False},
         "no copies": {"save_weight_copy": False, "save_input_copy": False}}
K, N, ROWS, EXPERTS = 128, 128, 64, 2


def _buffers(q, t, names_of):
    storage = q.quantize(t.detach())
    return [getattr(storage, n) for n in names_of[type(storage).__name__]]


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (a.shape == b.shape and a.dtype == b.dtype
            and (a.data_ptr() == b.data_ptr() or torch.equal(a, b)))


def _matches(saved, expected) -> bool:
    """Whether the non-empty saved tensors are exactly the expected ones (a multiset match)."""
    left = [t for t in expected if t.numel()]
    for t in (t for t in saved if t.numel()):
        hit = next((i for i, e in enumerate(left) if _same(t, e)), None)
        if hit is None:
            return False
        left.pop(hit)
    return not left


def _layer(kind, recipe, flags, mesh):
    torch.manual_seed(0)
    if kind == "grouped":
        return qr.GroupedLinear(EXPERTS, K, N, dtype=torch.bfloat16, **flags)
    m = qr.Linear(K, N, bias=False, dtype=torch.bfloat16, name="proj", **flags)
    if kind == "dense":
        return m
    from torch.distributed.tensor.parallel import parallelize_module

    model = torch.nn.Sequential(m)
    style = qr.QuantColwiseParallel() if kind == "colwise" else qr.QuantRowwiseParallel()
    parallelize_module(model, mesh, {"0": style})
    return m


def _layout(m, recipe, counts) -> list[torch.Tensor]:
    """The tensors of a grouped layer's padded layout of ``counts`` under ``recipe``."""
    from quant_recipes.moe.fp8 import layout
    from quant_recipes.moe.gemm import token_alignment

    align = token_alignment(recipe, (*m._qset.fwd[:2], m._qset.bwd[0]))
    return layout(counts.cumsum(0), int(counts.sum()), align).tensors()


def _local(t):
    return t.to_local() if hasattr(t, "to_local") else t


@pytest.fixture(scope="module")
def mesh(tmp_path_factory):
    """A one-rank device mesh: the tensor-parallel layers' policy runs as on many ranks."""
    dist = pytest.importorskip("torch.distributed")
    if not dist.is_available():
        pytest.skip("torch.distributed is not available")
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{tmp_path_factory.mktemp('pg') / 'f'}",
                            rank=0, world_size=1)
    yield init_device_mesh("cpu", (1,))
    dist.destroy_process_group()


CASES = [(kind, key) for kind in ("dense", "colwise", "rowwise") for key in DENSE] + [
    ("grouped", key) for key in GROUPED]


@pytest.mark.parametrize("name", list(RECIPES))
@pytest.mark.parametrize(("kind", "key"), CASES, ids=lambda v: str(v))
def test_what_every_layer_kind_saves_for_backward(kind, key, name, mesh):
    flags, grads, override = key
    recipe = RECIPES[name]()
    if override is not None:
        recipe = dataclasses.replace(recipe, backward_override=override)
    m = _layer(kind, recipe, FLAGS[flags], mesh)
    x = torch.randn(ROWS, K, dtype=torch.bfloat16)
    x.requires_grad_(grads in ("both", "input_only"))
    m.weight.requires_grad_(grads in ("both", "weight_only"))
    counts = torch.tensor([ROWS // 4, ROWS - ROWS // 4])
    saved = []

    def pack(t):
        saved.append(t)
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), qr.autocast(recipe=recipe):
        y = m(x, counts=counts) if kind == "grouped" else m(x)
    w = _local(m.weight)
    fwd = m._qset.fwd
    parts = {"x": lambda: [x], "w": lambda: [w], "lay": lambda: _layout(m, recipe, counts),
             "x.col": lambda: _buffers(fwd[0], x, COLUMNWISE),
             "w.col": lambda: _buffers(fwd[1], w, COLUMNWISE),
             "x.row": lambda: _buffers(fwd[0], x, ROWWISE),
             "w.row": lambda: _buffers(fwd[1], w, ROWWISE)}
    table = GROUPED if kind == "grouped" else DENSE
    want = [t for part in sorted(table[key]) for t in parts[part]()]
    assert _matches([_local(t) for t in saved], want), (
        sorted(table[key]), [(tuple(t.shape), t.dtype) for t in saved])
    y.float().sum().backward()  # backward runs on what was kept


@pytest.mark.parametrize("kind", ["dense", "colwise", "rowwise"])
def test_compiled_default_flags_quantize_again_only_where_no_amax_is_reduced(kind, mesh,
                                                                             monkeypatch):
    """The copy flags' default (None) with FP8 current scaling: compiled, a dense layer plans to
    quantize its weight and input again in backward (from forward's amax, nothing kept); a
    tensor-parallel layer keeps both copies, since quantizing again would all-reduce the amax
    once more. Eagerly every layer keeps them. The flags set to True or False are obeyed."""
    quant_dynamo = pytest.importorskip("quant_dynamo")
    if not (quant_dynamo.compile_supported() and quant_dynamo.DERIVES_IN_GRAPH):
        pytest.skip("this torch cannot derive quantizers in a graph (no lean form there)")
    import quant_recipes.linear as linear_module
    import quant_recipes.tensor_parallel.forward as tp_forward

    kept = []

    def recording(plan_operands):
        def plan(*args, **kwargs):
            p = plan_operands(*args, **kwargs)
            kept.append((p.weight_bwd is None, p.input_bwd is None))
            return p
        return plan

    for module in (linear_module, tp_forward):
        monkeypatch.setattr(module, "plan_operands", recording(module.plan_operands))
    recipe = qr.Float8CurrentScaling()
    got = {}
    for flags in ({}, {"save_weight_copy": True, "save_input_copy": True},
                  {"save_weight_copy": False, "save_input_copy": False}):
        m = _layer(kind, recipe, flags, mesh)

        def step(x, m=m):
            with qr.autocast(recipe=recipe):
                return m(x)

        for compiled in (False, True):
            torch._dynamo.reset()
            kept.clear()
            fn = torch.compile(step, fullgraph=True, backend="aot_eager") if compiled else step
            x = torch.randn(ROWS, K, dtype=torch.bfloat16, requires_grad=True)
            fn(x).float().sum().backward()
            got[(tuple(flags.values()), compiled)] = kept[0]
    lean = kind == "dense"
    assert got[((), False)] == (True, True)
    assert got[((), True)] == (not lean, not lean)
    for compiled in (False, True):
        assert got[((True, True), compiled)] == (True, True)
        assert got[((False, False), compiled)] == (False, False)
