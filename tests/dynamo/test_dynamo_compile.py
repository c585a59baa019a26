"""Quantizers under torch.compile: baked constants, guards, graph breaks, nesting, lists."""

from __future__ import annotations

import pytest
import quant_dynamo
import torch
from _dynamo_helpers import (
    HAS_API,
    QUANTIZER_IDS,
    assert_bitwise,
    make_input,
    quantizers,
    requires_api,
    requires_nesting,
)
from quant_core import DType, MXFP8Quantizer, NVFP4Quantizer
from quant_core.torch_compat import opaque_base
from quant_dynamo._api import probe
from torch._dynamo.testing import CompileCounter


@pytest.fixture(autouse=True)
def _reset_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _qdq_fn(x, q):
    return quant_dynamo.qdq(x, q) * 2


@requires_api
@pytest.mark.parametrize("name", QUANTIZER_IDS)
def test_quantizer_value_object_fullgraph(name):
    q = quantizers()[name]
    x = make_input()

    def fn(x):
        return torch.ops.quant.qdq(x, q), quant_dynamo.quantize(x, q)

    eager = fn(x)
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True)(x)
    assert_bitwise(compiled[0], eager[0])
    assert len(compiled[1]) == len(eager[1]) == len(quant_dynamo.buffer_names(q))
    for a, b in zip(compiled[1], eager[1], strict=True):
        assert_bitwise(a, b)


@pytest.mark.parametrize("name", QUANTIZER_IDS)
def test_compile_is_correct_on_every_release(name):
    """Without fullgraph (graph breaks allowed where torch has no API) results stay exact."""
    q = quantizers()[name]
    x = make_input(1)
    assert_bitwise(torch.compile(_qdq_fn, backend="aot_eager")(x, q), _qdq_fn(x, q))


@requires_api
def test_recompiles_equal_vs_distinct():
    cnt = CompileCounter()
    f = torch.compile(_qdq_fn, backend=cnt, fullgraph=True)
    x = make_input()
    f(x, MXFP8Quantizer())
    f(x, MXFP8Quantizer())  # equal but new: the equality guard passes
    assert cnt.frame_count == 1
    f(x, MXFP8Quantizer(DType.E5M2))  # a distinct value recompiles
    assert cnt.frame_count == 2
    for _ in range(5):
        f(x, MXFP8Quantizer())
    assert cnt.frame_count == 2


@requires_api
def test_no_graph_breaks():
    x, q = make_input(), NVFP4Quantizer(with_rht=True, with_post_rht_amax=True)
    explained = torch._dynamo.explain(_qdq_fn)(x, q)
    assert explained.graph_break_count == 0 and explained.graph_count == 1


@requires_api
def test_straight_through_gradient():
    q = MXFP8Quantizer()
    x = make_input().float().requires_grad_()
    y = torch.compile(_qdq_fn, backend="aot_eager", fullgraph=True)(x, q)
    y.sum().backward()
    assert_bitwise(x.grad, torch.full_like(x, 2.0))
    assert_bitwise(y.detach(), _qdq_fn(x.detach(), q))


def test_eager_gradient_every_release():
    x = make_input().float().requires_grad_()
    quant_dynamo.qdq(x, MXFP8Quantizer()).sum().backward()
    assert_bitwise(x.grad, torch.ones_like(x))


@requires_api
def test_quantizer_created_inside_region_and_attribute_reads():
    def fn(x):
        q = MXFP8Quantizer(rowwise_usage=True, columnwise_usage=False)
        scale = 2.0 if q.rowwise_usage and not q.with_2d_quantization else 3.0
        return quant_dynamo.qdq(x, q) * scale, q.dtype is DType.E4M3

    x = make_input()
    out, is_e4m3 = torch.compile(fn, backend="aot_eager", fullgraph=True)(x)
    assert is_e4m3
    assert_bitwise(out, fn(x)[0])


@requires_api
def test_attribute_reads_on_argument():
    def fn(x, q):
        return x * (q.block_scaling_dim + q.amax_epsilon) + q.force_pow_2_scales

    q = quantizers()["float8_blockwise"]
    x = make_input()
    assert_bitwise(torch.compile(fn, backend="aot_eager", fullgraph=True)(x, q), fn(x, q))


@requires_api
@pytest.mark.parametrize("dynamic", [None, True])
def test_scalar_fields_from_changing_arguments_stay_constants(dynamic):
    """A quantizer built in the region from Python scalar arguments. Once an
    argument changes (automatic dynamic) or under ``dynamic=True`` Dynamo makes them symbolic;
    the constructor must see constants: one specialised graph per value, each equal to eager."""
    from quant_core import Float8CurrentScalingQuantizer

    def fn(x, eps, mask):
        q = Float8CurrentScalingQuantizer(amax_epsilon=eps)
        n = NVFP4Quantizer(rht_matrix_random_sign_mask_t=mask, columnwise_usage=False)
        return quant_dynamo.qdq(x, q) + quant_dynamo.qdq(x, n)

    x = make_input() * 1e-3
    compiled = torch.compile(fn, backend="aot_eager", fullgraph=True, dynamic=dynamic)
    cases = [(0.0, 0), (0.5, 0), (0.25, 3), (0.5, 0)]
    for eps, mask in cases:
        assert_bitwise(compiled(x, eps, mask), fn(x, eps, mask))
    assert len(torch._dynamo.eval_frame._debug_get_cache_entry_list(fn.__code__)) == 3


# ------------------------------------------------------------------ ops defined by the test
_lib = torch.library.Library("quant_dynamo_test", "FRAGMENT")
_DEFINED: set[str] = set()


def _define_once(name: str, schema: str, impl) -> None:
    if name in _DEFINED:
        return
    _lib.define(schema)
    _lib.impl(name, impl, "CompositeExplicitAutograd")
    torch.library.register_fake(
        f"quant_dynamo_test::{name}", lambda x, *a: torch.empty_like(x), lib=_lib
    )
    _DEFINED.add(name)


def _sum_qdq(x, qs):
    return sum(q.quantize(x).dequantize(x.dtype) for q in qs)


@requires_api
def test_list_of_quantizers_as_op_argument():
    typ = quant_dynamo.opaque_schema_type(MXFP8Quantizer)
    _define_once("multi", f"multi(Tensor x, {typ}[] qs) -> Tensor", _sum_qdq)
    qs = [MXFP8Quantizer(), MXFP8Quantizer(DType.E5M2)]

    def fn(x):
        return torch.ops.quant_dynamo_test.multi(x, qs)

    x = make_input()
    assert_bitwise(torch.compile(fn, backend="aot_eager", fullgraph=True)(x), _sum_qdq(x, qs))


class _Pair:
    """A value type holding a value quantizer (nested ``__fx_repr__``)."""

    def __init__(self, q, k: int) -> None:
        self.q, self.k = q, k

    def __eq__(self, other):
        return type(other) is type(self) and (self.q, self.k) == (other.q, other.k)

    def __hash__(self):
        return hash((self.q, self.k))

    def __fx_repr__(self):
        q_expr, q_globals = self.q.__fx_repr__()
        return f"_Pair({q_expr}, {self.k!r})", {**q_globals, "_Pair": type(self)}


def _pair_class() -> type:
    base = opaque_base()
    if base is None:
        return _Pair
    return type("_Pair", (_Pair, base), {})


@requires_nesting
def test_value_type_inside_value_type():
    cls = _pair_class()
    probe().register(cls, ["q", "k"])
    typ = probe().type_name(cls)

    def impl(x, p):
        return p.q.quantize(x).dequantize(x.dtype) * p.k

    _define_once("pair_qdq", f"pair_qdq(Tensor x, {typ} p) -> Tensor", impl)
    p = cls(MXFP8Quantizer(), 3)
    assert eval(*p.__fx_repr__()) == p
    x = make_input()
    cnt = CompileCounter()
    f = torch.compile(lambda x, p: torch.ops.quant_dynamo_test.pair_qdq(x, p), backend=cnt,
                      fullgraph=True)
    assert_bitwise(f(x, p), impl(x, p))
    f(x, cls(MXFP8Quantizer(), 3))
    assert cnt.frame_count == 1


def test_has_api_matches_status():
    assert HAS_API == (quant_dynamo.status()["mode"] != "none")
