"""The grouped routes' backward in parts (quant_recipes.moe.backward_parts): compiled, FP8
blocks, NVFP4 and the decoded ``torch._grouped_mm`` route (MXFP8) run backward as three ops, so
that the graph releases the bf16 output gradient once it is quantized, before either GEMM makes
its output; the results equal eager code's bitwise, and every op passes ``opcheck``.

On the CPU the routes run on the reference backend (FP8 blocks, NVFP4) and on
``torch._grouped_mm`` where this CPU runs it (MXFP8)."""

from __future__ import annotations

import dataclasses
import weakref

import formats
import pytest
import quant_recipes as qr
import torch
from _alive import logging_alive
from quant_core import decoded_slices
from quant_recipes.moe import fp8_block_gemm, nvfp4_gemm
from quant_recipes.moe import gemm as grouped_gemm

K, N = 256, 384
COUNTS = [0, 37, 1, 200]  # an empty group, a group of one row, one of more than a block

RECIPES = {
    "fp8_block": qr.Float8BlockScaling,
    "nvfp4": qr.NVFP4BlockScaling,
    "grouped_mm": qr.MXFP8BlockScaling,
}


@pytest.fixture(params=list(RECIPES))
def route(request, monkeypatch):
    """A route's name, its path taken on the CPU."""
    name = request.param
    monkeypatch.setattr(fp8_block_gemm, "DEVICES", {"cpu"})
    monkeypatch.setattr(nvfp4_gemm, "DEVICES", {"cpu"})
    monkeypatch.setattr(grouped_gemm, "GROUPED_MM_DEVICES", {"cpu", "cuda"})
    if name == "grouped_mm" and not grouped_gemm.grouped_mm_available("cpu"):
        pytest.skip("torch._grouped_mm does not run on this CPU")
    return name


def _compiler():
    quant_dynamo = pytest.importorskip("quant_dynamo")
    if not (quant_dynamo.compile_supported() and quant_dynamo.DERIVES_IN_GRAPH):
        pytest.skip("this torch cannot read a baked quantizer's value key (grouped ops need it)")
    torch._dynamo.reset()
    return "aot_eager"


def _layer(bias: bool):
    torch.manual_seed(0)
    m = qr.GroupedLinear(len(COUNTS), K, N, bias=bias, dtype=torch.bfloat16)
    x = (torch.randn(sum(COUNTS), K) * torch.logspace(-2, 2, sum(COUNTS))[:, None]).to(
        torch.bfloat16)
    return m, x


def _spied(monkeypatch, name: str):
    """``(gradients, at_dgrad, at_wgrad)``: weak references to each output gradient the route
    quantizes, and at each call of its input and weight gradients which of them were alive."""
    real, grads, at_dgrad, at_wgrad = grouped_gemm.ROUTES[name], [], [], []

    def gradient(gy, *args):
        grads.append(weakref.ref(gy))
        return real.gradient(gy, *args)

    monkeypatch.setitem(grouped_gemm.ROUTES, name, dataclasses.replace(
        real, gradient=gradient,
        input_gradient=logging_alive(real.input_gradient, grads, at_dgrad),
        weight_gradient=logging_alive(real.weight_gradient, grads, at_wgrad)))
    return grads, at_dgrad, at_wgrad


def _assert_compiled_equals_eager(recipe, backend, bias=False, dynamic=False, path=None):
    """A layer's step under ``recipe``, its output gradient made in the graph, compiled
    (``fullgraph``) and eagerly: the input, weight and bias gradients equal bitwise; each run's
    three GEMMs take ``path`` where given."""
    m, x = _layer(bias)

    def step(x, counts):
        with qr.autocast(recipe=recipe):
            return m(x, counts=counts).float().square().sum()

    results = []
    for fn in (torch.compile(step, fullgraph=True, backend=backend, dynamic=dynamic), step):
        xi = x.clone().requires_grad_()
        m.zero_grad(set_to_none=True)
        qr.reset_grouped_gemm_paths()
        torch.manual_seed(1)  # NVFP4's stochastic rounding of the gradient
        fn(xi, torch.tensor(COUNTS)).backward()
        results.append((xi.grad, m.weight.grad, m.bias.grad if bias else None))
        if path is not None:
            assert qr.grouped_gemm_paths() == {path: 3}
    for a, b in zip(*results, strict=True):
        assert (a is None and b is None) or torch.equal(a, b)


@pytest.mark.parametrize(("bias", "dynamic"), [(False, False), (True, False), (False, True)])
def test_compiled_backward_releases_the_output_gradient_once_it_is_quantized(route,
                                                                          monkeypatch, bias,
                                                                          dynamic):
    """Compiled (with static or dynamic shapes), the output gradient (made in the graph) is
    dead when each backward GEMM runs: the first op quantized it, the GEMM ops read only its
    quantized form. The results (output, input, weight and bias gradients) equal eager
    code's bitwise."""
    backend = _compiler()
    grads, at_dgrad, at_wgrad = _spied(monkeypatch, route)
    path = {"nvfp4": "nvfp4_grouped_gemm", "fp8_block": "fp8_block_grouped_gemm"}.get(route)
    _assert_compiled_equals_eager(RECIPES[route](), backend, bias, dynamic, path)
    assert len(grads) == 1  # compiled only: eager code calls the route's functions directly
    assert at_dgrad == [[False]] and at_wgrad == [[False]]


def _eager_backward_args(monkeypatch, route, bias: bool):
    """The arguments an eager step gives the route's backward: ``(route, gy, x, lay, w, qg,
    qx, qw)`` (the quantizers the layer made under the recipe: the route's, or ``route``
    itself where it is a recipe)."""
    real, calls = grouped_gemm.backward_parts.backward, []

    def recorded(*args):
        calls.append(args[:8])
        return real(*args)

    monkeypatch.setattr(grouped_gemm.backward_parts, "backward", recorded)
    m, x = _layer(bias)
    xi = x.clone().requires_grad_()
    recipe = (route if not isinstance(route, str)
              else RECIPES[route](disable_stochastic_rounding=True) if route == "nvfp4"
              else RECIPES[route]())
    with qr.autocast(recipe=recipe):
        y = m(xi, counts=torch.tensor(COUNTS))
    y.backward(torch.randn_like(y))
    monkeypatch.setattr(grouped_gemm.backward_parts, "backward", real)
    (args,) = calls
    return tuple(a.detach() if isinstance(a, torch.Tensor) else a for a in args)


@pytest.mark.parametrize("bias", [False, True])
def test_opcheck_backward_part_ops(route, monkeypatch, bias):
    """``torch.library.opcheck`` of ``grouped_grad_operands`` / ``grouped_dgrad`` /
    ``grouped_wgrad`` for each route and each subset of the gradients, and their plumbing: the
    list the first op returns splits into the right operands for each GEMM, and the results
    equal the eager parts'. (The parts' numerics are held to the per-group path by the routes'
    own tests, test_grouped_fp8_block.py, test_grouped_nvfp4.py, test_grouped_linear.py.)"""
    _compiler()
    from quant_recipes.moe.ops import quantizer_spec

    real, gy, x, lay, w, qg, qx, qw = _eager_backward_args(monkeypatch, route, bias)
    specs = [quantizer_spec(q) for q in (qg, qx, qw)]
    tensors, ops = lay.tensors(), torch.ops.quant_recipes
    for dgrad, wgrad in ((True, True), (True, False), (False, True)):
        args = (gy, tensors, specs, route, dgrad, wgrad, bias)
        torch.library.opcheck(ops.grouped_grad_operands.default, args)
        parts = ops.grouped_grad_operands(*args)
        nd = real.dgrad_operands if dgrad else 0
        want = grouped_gemm.backward_parts.backward(real, gy, x, lay, w, qg, qx, qw, dgrad,
                                                    wgrad)
        if dgrad:
            dargs = (parts[:nd], tensors, w, specs, route)
            torch.library.opcheck(ops.grouped_dgrad.default, dargs)
            assert torch.equal(ops.grouped_dgrad(*dargs), want[0])
        if wgrad:
            wargs = (parts[nd:len(parts) - bias], x, tensors, specs, route, N)
            torch.library.opcheck(ops.grouped_wgrad.default, wargs)
            assert torch.equal(ops.grouped_wgrad(*wargs), want[1])
        if bias:
            assert torch.equal(parts[-1], grouped_gemm.bias_sums(gy, lay.offs, w.dtype))


def test_a_high_precision_gradient_on_the_decoded_route(monkeypatch):
    """A ``CustomRecipe`` whose output gradient stays in high precision, with MXFP8 inputs and
    weights, takes the decoded route: the gradient's two forms are one tensor, which the first
    op gives as two distinct outputs (an op's outputs may not alias); compiled equals eager
    bitwise, and the op passes ``opcheck``."""
    from quant_recipes.identity import IdentityQuantizer

    monkeypatch.setattr(grouped_gemm, "GROUPED_MM_DEVICES", {"cpu", "cuda"})
    if not grouped_gemm.grouped_mm_available("cpu"):
        pytest.skip("torch._grouped_mm does not run on this CPU")
    backend = _compiler()
    from quant_recipes.moe.ops import quantizer_spec

    def factory(role):
        if role is not None and role.tensor_type == "grad_output":
            return IdentityQuantizer()
        return formats.quantizer("mxfp8")

    recipe = qr.CustomRecipe(qfactory=factory, quantization_alignment=32)
    _, gy, x, lay, w, qg, qx, qw = _eager_backward_args(monkeypatch, recipe, False)
    assert grouped_gemm.backward_route(qg, qx, qw, x.device, (gy.dtype,) * 3, (N, K), 32,
                                       True) is grouped_gemm.DECODED_ROUTE
    args = (gy, lay.tensors(), [quantizer_spec(q) for q in (qg, qx, qw)], "grouped_mm", True,
            True, False)
    torch.library.opcheck(torch.ops.quant_recipes.grouped_grad_operands.default, args)
    _assert_compiled_equals_eager(recipe, backend)


@pytest.mark.parametrize("override", [None, "dequantized"])
def test_the_decoded_input_gradient_in_column_slices(monkeypatch, override):
    """Experts past twice ``DECODED_SLICE_BYTES`` decoded are decoded and multiplied a slice
    of the input gradient's columns at a time (with the columnwise copies, and under the
    backward override): the same gradients as decoding them whole."""
    monkeypatch.setattr(grouped_gemm, "GROUPED_MM_DEVICES", {"cpu", "cuda"})
    if not grouped_gemm.grouped_mm_available("cpu"):
        pytest.skip("torch._grouped_mm does not run on this CPU")
    experts = len(COUNTS)
    recipe = qr.MXFP8BlockScaling(**({} if override is None else
                                     {"backward_override": override}))
    decoded, real = [], grouped_gemm._experts
    monkeypatch.setattr(grouped_gemm, "_experts",
                        lambda w, *a: decoded.append(tuple(w.shape)) or real(w, *a))

    def grads():
        m, x = _layer(False)
        xi = x.clone().requires_grad_()
        with qr.autocast(recipe=recipe):
            y = m(xi, counts=torch.tensor(COUNTS))
        y.backward(torch.ones_like(y))
        return xi.grad, m.weight.grad

    whole = grads()
    assert decoded[-1] == (experts, N, K)  # the input gradient's operand, decoded whole
    decoded.clear()
    # under half the whole decode, and under 128 columns' copy and values: 128-column slices
    monkeypatch.setattr(decoded_slices, "DECODED_SLICE_BYTES", experts * N * 128)
    sliced = grads()
    assert decoded[1:] == [(experts, N, 128)] * 2  # after the forward's
    for a, b in zip(sliced, whole, strict=True):
        assert torch.equal(a, b)
