"""Value identity of quantizers (behaviour.md §2-§3): opt-in, annotations, immutability, keys."""

from __future__ import annotations

import enum
import pickle
import warnings

import formats
import pytest
import torch
from quant_core import (
    DType,
    Float8BlockQuantizer,
    Float8CurrentScalingQuantizer,
    Float8Quantizer,
    MXFP8Quantizer,
    NVFP4Quantizer,
    Quantizer,
    add_value_class_hook,
    is_value_quantizer,
    value_quantizer,
)
from quant_core.quantizer import _rebuild_quantizer

#: One value quantizer per format (tests/formats.py), NVFP4 with its RHT fields set.
_BY_ID = {**formats.default_quantizers(), "nvfp4": formats.quantizers("nvfp4_rht")["nvfp4_rht"]}
VALUE_QUANTIZERS = list(_BY_ID.values())
IDS = list(_BY_ID)

class FloatEnum(enum.Enum):
    A = 0.5


class Mode(enum.Enum):
    FAST = "fast"
    EXACT = "exact"


BASE_FIELDS = ("rowwise_usage", "columnwise_usage", "internal", "optimize_for_gemm")


@pytest.mark.parametrize("make", VALUE_QUANTIZERS, ids=IDS)
def test_equal_configs_are_equal_distinct_objects(make):
    a, b = make(), make()
    assert a is not b
    assert a == b and hash(a) == hash(b)
    assert len({a, b}) == 1


@pytest.mark.parametrize("make", VALUE_QUANTIZERS, ids=IDS)
def test_a_changed_field_is_a_different_value(make):
    a = make()
    for name in a.value_fields():
        value = getattr(a, name)
        if isinstance(value, bool):
            try:
                other = a.replace(**{name: not value})
            except (ValueError, NotImplementedError):
                continue  # a combination the quantizer refuses
            assert other != a, name
            assert getattr(a, name) == value, "replace must not touch the original"


def test_value_fields_follow_annotations_base_first():
    expected = {
        Float8CurrentScalingQuantizer: (
            "dtype", "with_amax_reduction", "force_pow_2_scales", "amax_epsilon"),
        MXFP8Quantizer: ("dtype", "with_2d_quantization"),
        Float8BlockQuantizer: (
            "dtype", "block_len", "amax_epsilon", "force_pow_2_scales", "block_scaling_dim"),
        NVFP4Quantizer: (
            "dtype", "with_rht", "with_post_rht_amax", "with_amax_reduction",
            "with_2d_quantization", "stochastic_rounding", "row_scaled_nvfp4",
            "nvfp4_use_4over6", "nvfp4_e4m3_max", "nvfp4_4over6_err_mode",
            "rht_matrix_random_sign_mask_t"),
    }
    for cls, own in expected.items():
        assert cls.value_fields() == BASE_FIELDS + own, cls


def test_value_key_shape_and_enum_by_value():
    q = MXFP8Quantizer(DType.E5M2, with_2d_quantization=True)
    name, items = q.value_key()
    assert name == "MXFP8Quantizer"
    assert dict(items)["dtype"] == DType.E5M2.value
    assert all(type(v) in (bool, int, float, str) for _, v in items)


def test_delayed_scaling_quantizer_keeps_identity():
    scale, amax = torch.ones(1), torch.zeros(1)
    a = Float8Quantizer(scale, amax)
    b = Float8Quantizer(scale, amax)
    assert Float8Quantizer.value_fields() is None and not is_value_quantizer(a)
    assert a != b and a == a
    assert hash(a) == object.__hash__(a)
    a.dtype = DType.E5M2  # stateful quantizers stay mutable, as in TransformerEngine
    with pytest.raises(TypeError, match="not a value quantizer"):
        a.value_key()


def test_unregistered_subclass_has_identity_semantics():
    class Tagged(MXFP8Quantizer):
        tag: str = "a"

    a, b = Tagged(tag="x"), Tagged(tag="x")
    assert Tagged.value_fields() is None and not is_value_quantizer(Tagged)
    assert a != b and hash(a) != hash(b)
    assert a != MXFP8Quantizer() and MXFP8Quantizer() != a


def test_subclass_that_opts_in_compares_its_own_fields():
    @value_quantizer
    class Tagged(MXFP8Quantizer):
        tag: str = "a"

    assert Tagged.value_fields()[-1] == "tag"
    assert Tagged(tag="x") == Tagged(tag="x")
    assert Tagged(tag="x") != Tagged(tag="y")
    # same fields as MXFP8Quantizer otherwise, but another class: never equal
    assert Tagged() != MXFP8Quantizer()


def test_opt_in_rejects_non_value_annotations():
    with pytest.raises(TypeError, match=r"Bad\.matrix.*_rebuild_derived_state"):
        @value_quantizer
        class Bad(MXFP8Quantizer):
            matrix: torch.Tensor = None

    with pytest.raises(TypeError, match="mode"):
        @value_quantizer
        class BadEnum(MXFP8Quantizer):
            mode: FloatEnum = FloatEnum.A


def test_second_enum_field_is_rebuilt_by_its_type_not_its_name():
    @value_quantizer
    class Moded(MXFP8Quantizer):
        mode: Mode = Mode.FAST

    q = Moded(DType.E5M2, mode=Mode.EXACT)
    rebuilt = _rebuild_quantizer(Moded, q.value_key()[1])
    assert rebuilt == q and rebuilt is not q
    assert rebuilt.mode is Mode.EXACT and rebuilt.dtype is DType.E5M2


@pytest.mark.parametrize("make", VALUE_QUANTIZERS, ids=IDS)
def test_immutable(make):
    q = make()
    with pytest.raises(AttributeError, match=r"replace\(dtype=\.\.\.\)"):
        q.dtype = DType.E5M2
    with pytest.raises(AttributeError, match="with_usage"):
        q.rowwise_usage = False
    with pytest.raises(AttributeError):
        del q.dtype
    assert q == make()


def test_replace_and_with_usage_return_new_objects():
    q = MXFP8Quantizer()
    r = q.with_usage(columnwise=False)
    assert r is not q and r.columnwise_usage is False and q.columnwise_usage is True
    assert r.rowwise_usage is True
    assert q.with_usage() is q
    assert q.replace(dtype=DType.E5M2).dtype is DType.E5M2
    with pytest.raises(TypeError, match="allowed"):
        q.replace(nonsense=1)


@pytest.mark.parametrize("make", VALUE_QUANTIZERS, ids=IDS)
def test_copy_and_pickle_give_equal_distinct_objects(make):
    q = make()
    for other in (q.copy(), pickle.loads(pickle.dumps(q))):
        assert other == q and other is not q and hash(other) == hash(q)


def test_constructor_errors_name_the_argument():
    with pytest.raises(TypeError, match=r"unexpected keyword.*fp8_dtype.*allowed"):
        MXFP8Quantizer(fp8_dtype=DType.E4M3)
    with pytest.raises(ValueError, match="dtype must be DType.E4M3 or DType.E5M2"):
        MXFP8Quantizer(DType.E2M1)
    with pytest.raises(TypeError, match="with_2d_quantization must be a bool"):
        MXFP8Quantizer(with_2d_quantization=1)
    with pytest.raises(ValueError, match="NaN"):
        Float8CurrentScalingQuantizer(amax_epsilon=float("nan"))
    with pytest.raises(ValueError, match="block_scaling_dim must be 1 or 2"):
        Float8BlockQuantizer(block_scaling_dim=3)
    with pytest.raises(ValueError, match="with_post_rht_amax"):
        NVFP4Quantizer(with_rht=True)
    with pytest.raises(ValueError, match="row_scaled_nvfp4=True is rowwise only.*columnwise_usage"):
        NVFP4Quantizer(row_scaled_nvfp4=True)
    with pytest.raises(ValueError, match="takes no with_rht=True, with_2d_quantization=True"):
        NVFP4Quantizer(row_scaled_nvfp4=True, columnwise_usage=False, with_rht=True,
                       with_post_rht_amax=True, with_2d_quantization=True)
    with pytest.raises(TypeError, match="fp32 tensor"):
        Float8Quantizer(torch.ones(1, dtype=torch.float16), torch.zeros(1))


def test_int_is_accepted_for_float_fields():
    q = Float8CurrentScalingQuantizer(amax_epsilon=0)
    assert q.amax_epsilon == 0.0 and type(q.amax_epsilon) is float
    assert q == Float8CurrentScalingQuantizer(amax_epsilon=0.0)


def test_nvfp4_sign_mask_field_and_flag():
    assert NVFP4Quantizer().rht_matrix_random_sign_mask_t == 55272
    assert NVFP4Quantizer(with_random_sign_mask=False).rht_matrix_random_sign_mask_t == 0
    assert NVFP4Quantizer(with_random_sign_mask=False).with_random_sign_mask is False
    assert NVFP4Quantizer(with_random_sign_mask=True) == NVFP4Quantizer()


@pytest.mark.parametrize("cls", [Float8CurrentScalingQuantizer, NVFP4Quantizer])
def test_stored_group_is_refused_for_value_operations(cls):
    with pytest.warns(DeprecationWarning, match="per call"):
        q = cls(amax_reduction_group=object())
    with pytest.raises(TypeError, match="per call"):
        hash(q)
    with pytest.raises(TypeError, match="per call"):
        q.value_key()
    with pytest.raises(TypeError, match="per call"):
        _ = q == cls()
    assert q == q  # identity short-circuits before the value key
    copy = q.copy()
    assert getattr(copy, "amax_reduction_group", None) is None and copy == cls()


def test_stored_real_process_group_is_refused(tmp_path):
    import torch.distributed as dist

    if not dist.is_available():
        pytest.skip("torch.distributed is not available in this build")
    created = not dist.is_initialized()
    if created:
        store = dist.FileStore(str(tmp_path / "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            q = Float8CurrentScalingQuantizer(amax_reduction_group=dist.group.WORLD)
        with pytest.raises(TypeError, match="amax_reduction_group"):
            hash(q)
    finally:
        if created:
            dist.destroy_process_group()


def test_hooks_see_past_and_future_value_classes():
    seen: list[type] = []
    add_value_class_hook(seen.append)
    assert {MXFP8Quantizer, NVFP4Quantizer, Float8BlockQuantizer,
            Float8CurrentScalingQuantizer} <= set(seen)

    @value_quantizer
    class Later(MXFP8Quantizer):
        pass

    assert seen[-1] is Later


def test_value_quantizer_decorator_refuses_non_quantizers():
    with pytest.raises(TypeError, match="Quantizer subclasses"):
        value_quantizer(int)
    assert not is_value_quantizer(Quantizer)


@pytest.mark.parametrize("cls, items, error, message", [
    (Float8CurrentScalingQuantizer, (("amax_epsilon", float("inf")),), ValueError,
     "amax_epsilon must"),
    (Float8CurrentScalingQuantizer, (("amax_epsilon", 1e400),), ValueError, "amax_epsilon must"),
    (MXFP8Quantizer, (("with_2d_quantization", "yes"),), TypeError, "with_2d_quantization"),
    (Float8BlockQuantizer, (("block_len", 64),), ValueError, "block_len must be 128"),
    (MXFP8Quantizer, (("no_such_field", 1),), TypeError, "has no field 'no_such_field'"),
])
def test_rebuilt_quantizers_are_validated_like_constructed_ones(cls, items, error, message):
    """Pickle / FX reconstruction / the flat ops rebuilt quantizers past the
    constructor's checks (inf or 1e400 epsilons, a string bool, block_len=64), and an unknown
    field raised a raw KeyError."""
    with pytest.raises(error, match=message):
        _rebuild_quantizer(cls, items)


def test_pickle_round_trip_still_works():
    import pickle

    for q in (Float8CurrentScalingQuantizer(amax_epsilon=1e-6), MXFP8Quantizer(DType.E5M2),
              Float8BlockQuantizer(block_scaling_dim=1)):
        r = pickle.loads(pickle.dumps(q))
        assert r == q and type(r) is type(q)


def test_abstract_quantizer_cannot_be_instantiated():
    """``Quantizer()`` built an object that quantizes nothing."""
    with pytest.raises(TypeError, match="Quantizer is the abstract base"):
        Quantizer()


def test_nvfp4_generator_must_be_a_generator():
    """``generator=5`` failed deep inside torch.randint."""
    import torch

    q = NVFP4Quantizer(stochastic_rounding=True)
    with pytest.raises(TypeError, match="generator must be a torch.Generator or None, got 5"):
        q.quantize(torch.randn(16, 32), generator=5)


@pytest.mark.parametrize("old_module, q", [
    ("quant_core.quantizers.float8", Float8CurrentScalingQuantizer(force_pow_2_scales=True)),
    ("quant_core.quantizers.float8_block", Float8BlockQuantizer(block_scaling_dim=2)),
])
def test_quantizers_pickled_under_the_old_module_names_still_load(old_module, q):
    """quantizers/float8.py and float8_block.py were renamed to the kernels' file stems; a
    checkpoint pickled before records the old module path."""
    import pickle

    new_module = type(q).__module__.encode()
    old = pickle.dumps(q, protocol=0).replace(new_module + b"\n", old_module.encode() + b"\n")
    assert old_module.encode() in old
    assert pickle.loads(old) == q


class TEStyleMXFP8(MXFP8Quantizer):
    """Opts in as a TransformerEngine quantizer does: by overriding ``_value_fields()``."""

    tag: str = "a"

    def _value_fields(self):
        return (*BASE_FIELDS, "dtype", "with_2d_quantization", "tag")


def test_te_hook_names_are_callable_on_every_quantizer():
    """``_value_fields()`` / ``_value_key()`` (TransformerEngine's names) are the same hooks as
    ``value_fields()`` / ``value_key()``."""
    q = MXFP8Quantizer(DType.E5M2)
    assert q._value_fields() == q.value_fields() == MXFP8Quantizer._value_fields()
    assert q._value_key() == q.value_key()
    d = Float8Quantizer(torch.ones(1), torch.zeros(1))
    assert d._value_fields() is None
    with pytest.raises(TypeError, match="not a value quantizer"):
        d._value_key()


def test_te_style_value_fields_override_opts_in():
    a, b = TEStyleMXFP8(tag="x"), TEStyleMXFP8(tag="x")
    assert a is not b and a == b and hash(a) == hash(b) and len({a, b}) == 1
    assert a != TEStyleMXFP8(tag="y") and a != MXFP8Quantizer()
    assert is_value_quantizer(TEStyleMXFP8)
    assert a.value_fields() == a._value_fields() == (
        *BASE_FIELDS, "dtype", "with_2d_quantization", "tag")
    assert a.value_key() == a._value_key() and dict(a._value_key()[1])["tag"] == "x"
    for other in (a.copy(), pickle.loads(pickle.dumps(a)), a.replace(tag="x")):
        assert other == a and other is not a
    with pytest.raises(AttributeError, match="immutable"):
        a.tag = "z"


def test_te_style_override_returning_none_keeps_identity():
    """``None`` from the override keeps identity semantics, also below a value class."""

    class Stateful(MXFP8Quantizer):
        def _value_fields(self):
            return None

    a, b = Stateful(), Stateful()
    assert a != b and hash(a) == object.__hash__(a) and not is_value_quantizer(Stateful)
    assert a.value_fields() is None and a._value_fields() is None


def test_subclass_of_an_overriding_class_does_not_inherit_value_identity():
    class Sub(TEStyleMXFP8):
        pass

    assert Sub.value_fields() is None and Sub()._value_fields() is None
    assert Sub() != Sub() and not is_value_quantizer(Sub)


def test_overriding_either_name_overrides_both():
    class QuantStyle(MXFP8Quantizer):
        tag: str = "a"

        @classmethod
        def value_fields(cls):
            return (*MXFP8Quantizer.value_fields(), "tag")

    assert QuantStyle._value_fields() == QuantStyle.value_fields()
    assert QuantStyle(tag="x") != QuantStyle(tag="y")

    @value_quantizer
    class Keyed(MXFP8Quantizer):
        def _value_key(self):  # TransformerEngine's name: every Keyed is one value
            return ("Keyed", ())

    assert Keyed(DType.E4M3) == Keyed(DType.E5M2)
    assert Keyed().value_key() == ("Keyed", ())


def test_override_naming_a_non_field_is_refused_at_class_creation():
    with pytest.raises(TypeError, match=r"Bad\._value_fields\(\) names 'nope'"):
        class Bad(MXFP8Quantizer):
            def _value_fields(self):
                return (*BASE_FIELDS, "nope")
