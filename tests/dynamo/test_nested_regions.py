"""Quantizers inside ``torch.compiler.nested_compile_region`` (hierarchical compilation: a
repeated block compiled once and called as an Inductor subgraph): the subgraph's code rebuilds
the baked quantizers by name, which must resolve in the module Inductor generates."""

from __future__ import annotations

import pytest
import torch
from _dynamo_helpers import assert_bitwise, make_input, quantizers, requires_api


@pytest.fixture(autouse=True)
def _fresh_compiles():
    # a cached graph would hide what its first compile generates
    import torch._inductor.config

    torch._dynamo.reset()
    with torch._inductor.config.patch(fx_graph_cache=False):
        yield
    torch._dynamo.reset()


@requires_api
def test_a_quantizer_inside_a_nested_compile_region_under_inductor():
    if not hasattr(torch.compiler, "nested_compile_region"):
        pytest.skip("this torch has no nested_compile_region")
    q = quantizers()["float8_current_scaling"]

    @torch.compiler.nested_compile_region
    def block(x):
        return torch.ops.quant.qdq(x, q) * 2 + 1

    def fn(x):
        return block(block(x)) - x  # the region called twice: one subgraph, reused

    x = make_input()
    assert_bitwise(torch.compile(fn, fullgraph=True)(x), fn(x))
