"""Quantizers lowered to their reference's torch ops in compiled graphs (``"ops"`` lowering,
quant_dynamo.capture): no ``quant`` op and no kernel remains, the bytes are the eager op's, equal
quantizations of one tensor merge, and the switch picks the form.

The CPU is outside ``OPS_DEVICES`` (Inductor's C++ code is not trusted with the rules); the
tests add it, and compile with aot_eager (the traced ops run eagerly) and with Inductor. The
GPU check is tests/gpu/test_compiled_ops.py.
"""

from __future__ import annotations

import pytest
import quant_dynamo
import torch
from _dynamo_helpers import capturable_reference, requires_api, requires_lowering
from functorch.compile import make_boxed_func, min_cut_rematerialization_partition
from quant_core import (
    DType,
    Float8CurrentScalingQuantizer,
    MXFP8Quantizer,
    NVFP4Quantizer,
    backends,
)
from quant_core.reference._rounding import to_fp32
from quant_dynamo import capture as lowering
from torch._dynamo.backends.common import aot_autograd

pytestmark = [requires_api, requires_lowering]

CURRENT = Float8CurrentScalingQuantizer(columnwise_usage=True)


@pytest.fixture
def ops_on_cpu(cpu_ops_device, monkeypatch):
    """The CPU among the devices whose quantizers are lowered to reference ops, and the ops
    form first for every quantization (the default sends a columnwise copy to the kernels,
    which the CPU lacks; a test may set another form)."""
    monkeypatch.setenv("QUANT_LOWERING", "ops")


def _compiled(fn, partitioned: bool = False):
    """``fn`` compiled with aot_eager-like boxed graphs; the list of forward graph codes. With
    ``partitioned`` the joint graph goes through Inductor's partitioner (which merges equal
    expressions first)."""
    graphs: list[torch.fx.GraphModule] = []

    def forward(gm, example_inputs):
        graphs.append(gm)
        return make_boxed_func(gm)

    kw = {"partition_fn": min_cut_rematerialization_partition} if partitioned else {}
    torch._dynamo.reset()
    backend = aot_autograd(fw_compiler=forward,
                           bw_compiler=lambda gm, example_inputs: make_boxed_func(gm), **kw)
    return torch.compile(fn, backend=backend, fullgraph=True), graphs


def _x(dtype=torch.bfloat16):
    torch.manual_seed(0)
    x = torch.randn(64, 96, dtype=dtype) * 30
    x[0, :4] = torch.tensor([float("nan"), -0.0, float("inf"), 1e-30])
    return x


def _targets(gm) -> list[str]:
    return [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("q", [CURRENT, CURRENT.with_usage(columnwise=False),
                               CURRENT.with_usage(rowwise=False),
                               Float8CurrentScalingQuantizer(DType.E5M2, force_pow_2_scales=True,
                                                             amax_epsilon=1e-3)],
                         ids=["both", "rowwise", "columnwise", "e5m2_pow2_eps"])
def test_quantize_becomes_the_reference_ops_with_the_eager_bytes(ops_on_cpu, q, dtype):
    compiled, graphs = _compiled(lambda t: quant_dynamo.quantize(t * 2, q))
    x = _x(dtype)
    got, want = compiled(x), quant_dynamo.quantize(x * 2, q)
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    targets = _targets(graphs[0])
    assert not any("quant." in t or "triton_kernel_wrapper" in t for t in targets), targets
    assert "aten.amax.default" in targets


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_inductor_keeps_the_bytes(ops_on_cpu, dtype):
    torch._dynamo.reset()
    compiled = torch.compile(lambda a, b: quant_dynamo.quantize(torch.nn.functional.silu(a) * b,
                                                                CURRENT), fullgraph=True)
    a, b = _x(dtype), _x(dtype).flip(0)
    produced = torch.compile(lambda a, b: torch.nn.functional.silu(a) * b)(a, b)
    want = CURRENT.quantize(produced, backend="reference").buffer_list(produced)
    assert all(torch.equal(g, w) for g, w in zip(compiled(a, b), want, strict=True))


def test_amax_ops_are_lowered_too(ops_on_cpu):
    """The split around an amax reduction (FSDP2, tensor parallelism) traces as ops as well."""
    q = CURRENT.replace(with_amax_reduction=True)

    def fn(t):
        return quant_dynamo.quantize_with_amax(t, quant_dynamo.amax(t, q), q)

    compiled, graphs = _compiled(fn)
    x = _x()
    assert all(torch.equal(a, b) for a, b in zip(compiled(x), fn(x), strict=True))
    assert not any("quant." in t for t in _targets(graphs[0]))


def test_equal_quantizations_of_one_tensor_merge(ops_on_cpu):
    """Two quantizers of equal value (distinct objects) on one tensor trace equal ops, which the
    partitioner's common-subexpression elimination merges: one amax, one cast remain."""
    q2 = Float8CurrentScalingQuantizer(columnwise_usage=True)
    assert q2 == CURRENT and q2 is not CURRENT
    w = torch.randn(48, 96, dtype=torch.bfloat16, requires_grad=True)

    def fn(t):
        a, b = quant_dynamo.quantize(t, CURRENT), quant_dynamo.quantize(t, q2)
        return (t @ w.t()).sum() + a[2].sum() + b[2].sum()

    compiled, graphs = _compiled(fn, partitioned=True)
    x = _x().requires_grad_()
    compiled(x).backward()
    amaxes = [t for t in _targets(graphs[0]) if t == "aten.amax.default"]
    assert len(amaxes) == 1


def test_stochastic_rounding_and_other_formats_keep_their_forms(ops_on_cpu):
    """NVFP4 with stochastic rounding stays opaque; MXFP8 takes no ops form (its kernels, where
    the backend records them; opaque on the CPU's reference)."""
    assert NVFP4Quantizer(stochastic_rounding=True).lowerings() == ()
    assert MXFP8Quantizer().lowerings() == ("kernels",)
    compiled, graphs = _compiled(lambda t: quant_dynamo.quantize(t, MXFP8Quantizer()))
    x = _x()
    assert all(torch.equal(a, b) for a, b in
               zip(compiled(x), quant_dynamo.quantize(x, MXFP8Quantizer()), strict=True))
    assert any("quant.quantize" in t for t in _targets(graphs[0]))


@pytest.fixture
def recording_backend(cpu_kernel_device):
    """A capturable CPU backend made of the reference's functions whose current-scaling
    quantize records whether it ran while launches were being recorded."""
    from quant_core import reference
    from quant_core.kernel_capture import capturing

    calls: list[bool] = []

    def fp8_current_quantize(*args, **kwargs):
        calls.append(capturing())
        return reference.fp8_current_quantize(*args, **kwargs)

    with capturable_reference(fp8_current_quantize=fp8_current_quantize):
        yield calls


@pytest.mark.parametrize("value, form", [("1", "kernels"), ("kernels", "kernels"),
                                         ("ops", "ops"), ("0", "opaque")])
def test_quant_lowering_picks_the_form(ops_on_cpu, recording_backend, monkeypatch, value, form):
    monkeypatch.setenv("QUANT_LOWERING", value)
    compiled, graphs = _compiled(lambda t: quant_dynamo.quantize(t, CURRENT))
    x = _x()
    assert all(torch.equal(a, b) for a, b in
               zip(compiled(x), quant_dynamo.quantize(x, CURRENT), strict=True))
    targets = _targets(graphs[0])
    assert ("aten.amax.default" in targets) is (form != "opaque")  # the backend's ops too
    assert any("quant.quantize" in t for t in targets) is (form == "opaque")
    assert (True in recording_backend) is (form == "kernels")  # recorded while capturing


@pytest.mark.parametrize("value", [None, "1"])
def test_without_capturable_kernels_a_rowwise_cast_traces_the_ops(ops_on_cpu, monkeypatch, value):
    if value is None:
        monkeypatch.delenv("QUANT_LOWERING")
    else:
        monkeypatch.setenv("QUANT_LOWERING", value)
    rowwise = CURRENT.with_usage(columnwise=False)
    compiled, graphs = _compiled(lambda t: quant_dynamo.quantize(t, rowwise))
    compiled(_x())
    assert "aten.amax.default" in _targets(graphs[0])


COLUMNWISE = pytest.mark.parametrize("q", [CURRENT, CURRENT.with_usage(rowwise=False)],
                                     ids=["both", "columnwise"])


@COLUMNWISE
def test_by_default_a_columnwise_copy_takes_the_kernels(ops_on_cpu, recording_backend,
                                                        monkeypatch, q):
    """Unset (``mixed``), a quantization that writes a columnwise copy is recorded as kernels,
    whose transposed stores are tiled."""
    monkeypatch.delenv("QUANT_LOWERING")
    compiled, graphs = _compiled(lambda t: quant_dynamo.quantize(t, q))
    x = _x()
    assert all(torch.equal(a, b) for a, b in
               zip(compiled(x), quant_dynamo.quantize(x, q), strict=True))
    assert True in recording_backend


def _norm(t):
    return t * torch.rsqrt(t.float().pow(2).mean(-1, keepdim=True) + 1e-6).to(t.dtype)


@pytest.mark.parametrize("make, form", [
    (lambda a, b, c: torch.nn.functional.silu(a @ b) * (a @ c), "ops"),  # a SwiGLU product
    (lambda a, b, c: (a @ b).to(torch.float32).mul(2).to(torch.bfloat16), "ops"),
    (lambda a, b, c: a @ b, "kernels"),  # a GEMM's output as it is: no kernel to fuse into
    (lambda a, b, c: _norm(a @ b), "kernels"),  # a reduction among the producers
    (lambda a, b, c: _norm(a) * 2, "kernels"),
    (lambda a, b, c: torch.softmax(a @ b, -1) * 2, "kernels"),  # no reduction tag: not a GEMM
], ids=["swiglu", "scaled_product", "gemm", "norm_of_product", "scaled_norm", "softmax"])
def test_by_default_backwards_copy_of_a_pointwise_product_takes_the_ops(
        ops_on_cpu, recording_backend, monkeypatch, make, form):
    """Unset (``mixed``), the columnwise copy alone (the one backward makes) of a tensor that
    pointwise ops make from GEMM outputs is traced as ops: Inductor fuses its cast into the
    kernel that computes the product; any other tensor's is recorded as kernels. The bytes are
    the eager op's either way."""
    monkeypatch.delenv("QUANT_LOWERING")
    q = CURRENT.with_usage(rowwise=False)
    torch.manual_seed(0)
    a, b, c = (torch.randn(64, 96, dtype=torch.bfloat16), torch.randn(96, 64,
               dtype=torch.bfloat16), torch.randn(96, 64, dtype=torch.bfloat16))
    compiled, graphs = _compiled(lambda a, b, c: quant_dynamo.quantize(make(a, b, c), q))
    assert all(torch.equal(x, y) for x, y in
               zip(compiled(a, b, c), quant_dynamo.quantize(make(a, b, c), q), strict=True))
    # a recorded kernel reads an exact copy of its input (the bits xor 0); the ops read it
    assert ("aten.bitwise_xor.Scalar" in _targets(graphs[0])) is (form == "kernels")


@COLUMNWISE
def test_by_default_a_columnwise_copy_never_traces_the_ops(ops_on_cpu, monkeypatch, q):
    """Without capturable kernels it stays opaque rather than tracing the ops, whose transposed
    stores Inductor fuses into reductions."""
    monkeypatch.delenv("QUANT_LOWERING")
    compiled, graphs = _compiled(lambda t: quant_dynamo.quantize(t, q))
    compiled(_x())
    assert any("quant.quantize" in t for t in _targets(graphs[0]))


def test_an_unknown_quant_lowering_is_refused(monkeypatch):
    monkeypatch.setenv("QUANT_LOWERING", "fast")
    with pytest.raises(ValueError,
                       match="QUANT_LOWERING='fast'; allowed: mixed, 1, kernels, ops, 0"):
        lowering.forms()


def test_the_cpu_keeps_the_opaque_op():
    """Without the test's OPS_DEVICES, the CPU's reference runs inside the opaque op."""
    assert "cpu" not in lowering.OPS_DEVICES
    assert not getattr(backends.get(None, "cpu"), "capturable", False)
    compiled, graphs = _compiled(lambda t: quant_dynamo.quantize(t, CURRENT))
    compiled(_x())
    assert any("quant.quantize" in t for t in _targets(graphs[0]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_widening_is_exact_compiled_for_every_bit_pattern(dtype):
    """``to_fp32`` reads the stored bits (so a fused producer's rounding cannot be skipped);
    compiled it gives ``float(x)`` for all 65536 patterns, -0.0 and subnormals included."""
    bits = torch.arange(-32768, 32768, dtype=torch.int32).to(torch.int16).view(dtype)
    torch._dynamo.reset()
    got = torch.compile(to_fp32, fullgraph=True)(bits)
    want = bits.float()
    same = (got.view(torch.int32) == want.view(torch.int32)) | (got.isnan() & want.isnan())
    assert bool(same.all())
