"""Value-object contract: FX repr round trip, process-group guard, immutability, opt-in."""

from __future__ import annotations

import pytest
import quant_dynamo
import torch
from _dynamo_helpers import MODE, QUANTIZER_IDS, assert_bitwise, make_input, quantizers
from quant_core import (
    DType,
    Float8CurrentScalingQuantizer,
    MXFP8Quantizer,
    NVFP4Quantizer,
    value_quantizer,
)
from quant_dynamo import fx_repr


@pytest.mark.parametrize("name", QUANTIZER_IDS)
def test_quantizer_value_object(name):
    q = quantizers()[name]
    expr, glb = q.__fx_repr__()
    assert expr.startswith(f"_rebuild_quantizer({type(q).__name__}, ")
    assert set(glb) == {"_rebuild_quantizer", type(q).__name__}
    r = eval(expr, dict(glb))
    assert r == q and r is not q and hash(r) == hash(q)
    assert getattr(r, "amax_reduction_group", None) is None
    x = make_input()
    a, b = q.quantize(x), r.quantize(x)
    for (na, ta), (nb, tb) in zip(a.buffers().items(), b.buffers().items(), strict=True):
        assert na == nb and (ta is None) == (tb is None)
        if ta is not None:
            assert_bitwise(ta, tb)
    assert_bitwise(a.dequantize(torch.bfloat16), b.dequantize(torch.bfloat16))


def test_fx_repr_enum_by_value_and_inf():
    """Enums by value, floats exactly (FLT_MAX); an infinite float field prints as an eval-able
    ``float('inf')`` (no built-in quantizer accepts one since amax_epsilon must be finite)."""
    from quant_dynamo.fx_repr import literal

    q = Float8CurrentScalingQuantizer(DType.E5M2, amax_epsilon=3.4028234663852886e38)
    expr, glb = q.__fx_repr__()
    assert "('dtype', 1)" in expr
    r = eval(expr, dict(glb))
    assert r == q and r.dtype is DType.E5M2 and r.amax_epsilon == q.amax_epsilon
    assert literal(float("inf")) == "float('inf')" and literal(float("-inf")) == "float('-inf')"


@pytest.mark.skipif(
    MODE != "repr", reason=f"the eval-able __repr__ is torch 2.10's only (mode {MODE!r})"
)
def test_repr_mode_eval_repr_uses_only_class_name():
    for q in quantizers().values():
        cls = type(q)
        text = repr(q)
        assert text.startswith(f"{cls.__name__}._rebuild_from_items(")
        assert eval(text, {cls.__name__: cls}) == q


def test_status_and_registration():
    st = quant_dynamo.status()
    assert st["torch"] == torch.__version__
    assert st["mode"] in ("custom_class", "opaque_value", "opaque_value_base", "repr", "none")
    expected = {type(q).__qualname__ for q in quantizers().values()}
    if st["mode"] == "none":
        assert st["registered"] == []
        assert not any(quant_dynamo.is_value_opaque_quantizer(q) for q in quantizers().values())
    else:
        assert expected <= set(st["registered"])
        assert all(quant_dynamo.is_value_opaque_quantizer(q) for q in quantizers().values())
        for q in quantizers().values():
            assert isinstance(quant_dynamo.opaque_schema_type(q), str)


def test_immutability():
    q = MXFP8Quantizer()
    with pytest.raises(AttributeError):
        q.with_2d_quantization = True
    with pytest.raises(AttributeError):
        q.rowwise_usage = False
    assert q.with_usage(rowwise=False) != q and q.rowwise_usage


@pytest.fixture
def world_group():
    """The default group of a one-rank gloo world, destroyed afterwards if this made it (a group
    left behind makes a later ``init_process_group`` in this process fail)."""
    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("torch.distributed is not available in this build")
    created = not dist.is_initialized()
    if created:
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield dist.group.WORLD
    if created:
        dist.destroy_process_group()


@pytest.mark.parametrize("cls", [Float8CurrentScalingQuantizer, NVFP4Quantizer])
@pytest.mark.parametrize("group_kind", ["sentinel", "gloo"])
def test_value_quantizer_rejects_process_group(cls, group_kind, request):
    group = object() if group_kind == "sentinel" else request.getfixturevalue("world_group")
    with pytest.warns(DeprecationWarning):
        q = cls(amax_reduction_group=group)
    other = cls()
    with pytest.raises(TypeError, match="amax_reduction_group"):
        hash(q)
    with pytest.raises(TypeError, match="amax_reduction_group"):
        q.__fx_repr__()
    with pytest.raises(TypeError, match="amax_reduction_group"):
        q == other  # noqa: B015
    with pytest.raises(TypeError, match="amax_reduction_group"):
        quant_dynamo.qdq(make_input(), q)
    with pytest.raises(TypeError, match="amax_reduction_group"):
        quant_dynamo.flatten_quantizer(q)


def test_user_subclass_must_opt_in():
    class Sub(MXFP8Quantizer):
        pass

    s = Sub()
    x = make_input()
    assert not quant_dynamo.is_value_opaque_quantizer(s)
    for call in (quant_dynamo.qdq, quant_dynamo.quantize):
        with pytest.raises(TypeError, match="value_quantizer"):
            call(x, s)
    if quant_dynamo.compile_supported():
        with pytest.raises(TypeError, match="value_quantizer"):
            torch.ops.quant.qdq(x, s)
    with pytest.raises(TypeError, match="value_quantizer"):
        torch.ops.quant.qdq.flat(x, "x:Sub", "[]")  # unknown class name
    with pytest.raises(TypeError):
        quant_dynamo.opaque_schema_type(Sub)


@value_quantizer
class TaggedMXFP8(MXFP8Quantizer):
    """A user subclass that opted in, defined at module level (its type name fits a schema)."""

    tag: str = "a"


def test_opted_in_subclass_is_registered():
    q = TaggedMXFP8(tag="b")
    assert eval(*q.__fx_repr__()) == q and q != TaggedMXFP8()
    assert quant_dynamo.is_value_opaque_quantizer(q) == quant_dynamo.compile_supported()
    assert quant_dynamo.compile_supported(q) == quant_dynamo.compile_supported()
    x = make_input()
    assert_bitwise(quant_dynamo.qdq(x, q), MXFP8Quantizer().quantize(x).dequantize(x.dtype))


def test_local_class_falls_back_to_flat_ops():
    @value_quantizer
    class LocalMXFP8(MXFP8Quantizer):
        pass

    q = LocalMXFP8()
    assert not quant_dynamo.compile_supported(q)
    assert not quant_dynamo.is_value_opaque_quantizer(q)
    x = make_input()
    assert_bitwise(quant_dynamo.qdq(x, q), MXFP8Quantizer().quantize(x).dequantize(x.dtype))
    assert_bitwise(quant_dynamo.quantize(x, q)[0], MXFP8Quantizer().quantize(x)._rowwise_data)


class Late(MXFP8Quantizer):
    """Not decorated: opted in by the test through register_value_opaque_quantizer."""


def test_register_value_opaque_quantizer_opts_in():
    assert quant_dynamo.register_value_opaque_quantizer(Late) is Late
    assert Late() == Late() and hash(Late()) == hash(Late())
    assert ("Late" in quant_dynamo.status()["registered"]) == quant_dynamo.compile_supported()


def test_flatten_round_trip():
    for q in quantizers().values():
        cls_name, key = quant_dynamo.flatten_quantizer(q)
        r = quant_dynamo.unflatten_quantizer(cls_name, key)
        assert r == q and r is not q


def test_literal_rejects_non_primitives():
    with pytest.raises(TypeError):
        fx_repr.literal(object())


def test_torch_refusing_a_class_warns_and_the_rest_registers(monkeypatch):
    """Torch refusing a value class with ValueError (already a pytree node,
    a ``builtins`` module) killed ``import quant_dynamo``; now that class is skipped with a
    warning, keeps eager value semantics, runs through the flat ops, and others still register."""
    import dataclasses

    from quant_dynamo import registration

    api = registration.probe()

    def refuse(cls, members):
        raise ValueError(f"{cls.__qualname__} is already registered as a pytree node")

    monkeypatch.setattr(registration, "probe",
                        lambda: dataclasses.replace(api, register=refuse))

    class Refused(MXFP8Quantizer):
        pass

    if api.available:
        with pytest.warns(RuntimeWarning, match="torch refused .*Refused"):
            value_quantizer(Refused)
    else:
        value_quantizer(Refused)
    assert Refused() == Refused() and not quant_dynamo.compile_supported(Refused())
    x = make_input()
    assert_bitwise(quant_dynamo.qdq(x, Refused()), MXFP8Quantizer().quantize(x).dequantize(x.dtype))
    monkeypatch.undo()
    assert quant_dynamo.register_value_opaque_quantizer(Late) is Late


def test_membership_is_by_class_not_by_name():
    """An unregistered class sharing a registered class's qualname (here
    ``TaggedMXFP8``, a local subclass that did not opt in) is not a registered value quantizer."""

    class TaggedMXFP8(MXFP8Quantizer):
        pass

    TaggedMXFP8.__qualname__ = "TaggedMXFP8"  # the module and qualname of the registered class
    impostor = TaggedMXFP8()
    assert type(impostor).__qualname__ == globals()["TaggedMXFP8"].__qualname__
    assert type(impostor).__module__ == globals()["TaggedMXFP8"].__module__
    assert not quant_dynamo.is_value_opaque_quantizer(impostor)
    registered = globals()["TaggedMXFP8"]()
    assert quant_dynamo.is_value_opaque_quantizer(registered) == quant_dynamo.compile_supported()


def test_delayed_quantizer_is_refused_as_stateful_not_as_a_subclass():
    """A Float8Quantizer holds live tensors; it is not a subclass that forgot to
    opt in, and the error says which."""
    from quant_core import DType, Float8Quantizer

    q = Float8Quantizer(torch.ones(1), torch.zeros(1), DType.E4M3)
    with pytest.raises(TypeError, match="identity semantics") as info:
        quant_dynamo.qdq(make_input(), q)
    assert "subclass" not in str(info.value)


def test_graph_rebuild_is_validated_once_per_value_and_reused():
    """Compiled code may rebuild its constant quantizers on every call; the rebuild is
    cached per (class, items), and invalid items still raise the constructor's error."""
    q = MXFP8Quantizer(with_2d_quantization=True)
    expr, glb = q.__fx_repr__()
    first, second = eval(expr, dict(glb)), eval(expr, dict(glb))
    assert first == q and first is second and first is not q
    with pytest.raises(ValueError, match="amax_epsilon"):
        fx_repr.rebuild_for_graph(type(Float8CurrentScalingQuantizer()),
                                  (("amax_epsilon", float("nan")),))


def test_import_after_a_local_value_class_does_not_fail():
    """A value class local to a function, defined before quant-dynamo is imported, made the
    import raise (its type name cannot appear in an op schema); it is now left unregistered."""
    from _dynamo_helpers import run_in_fresh_process

    run_in_fresh_process(
        "from quant_core import Quantizer, value_quantizer\n"
        "def make():\n"
        "    @value_quantizer\n"
        "    class Local(Quantizer):\n"
        "        storage_format = 'fp8'\n"
        "    return Local\n"
        "Local = make()\n"
        "import quant_dynamo\n"
        "assert 'Local' not in ' '.join(quant_dynamo.status()['registered'])\n"
    )


class TEStyleTaggedMXFP8(MXFP8Quantizer):
    """Opts in as a TransformerEngine quantizer does, by overriding ``_value_fields()``."""

    tag: str = "a"

    def _value_fields(self):
        return (*MXFP8Quantizer._value_fields(), "tag")


def test_te_style_subclass_is_registered_and_baked_into_a_fullgraph_graph():
    q = TEStyleTaggedMXFP8(tag="b")
    assert eval(*q.__fx_repr__()) == q and q != TEStyleTaggedMXFP8()
    assert quant_dynamo.is_value_opaque_quantizer(q) == quant_dynamo.compile_supported()
    x = make_input()
    want = MXFP8Quantizer().quantize(x).dequantize(x.dtype)
    assert_bitwise(quant_dynamo.qdq(x, q), want)
    if quant_dynamo.compile_supported():
        torch._dynamo.reset()
        got = torch.compile(lambda x: quant_dynamo.qdq(x, q), backend="aot_eager",
                            fullgraph=True)(x)
        assert_bitwise(got, want)
