"""``quant_recipes.recipe(name, **options)``: recipes from the names configs and command lines
use."""

from __future__ import annotations

import pytest
import quant_recipes as qr
import torch
from quant_recipes.model_converter import QuantConverter


@pytest.mark.parametrize(("name", "cls"), [
    ("fp8_current", qr.Float8CurrentScaling), ("fp8_block", qr.Float8BlockScaling),
    ("mxfp8", qr.MXFP8BlockScaling), ("nvfp4", qr.NVFP4BlockScaling),
    ("delayed", qr.DelayedScaling),
    ("Float8CurrentScaling", qr.Float8CurrentScaling), ("MXFP8-BlockScaling", qr.MXFP8BlockScaling),
    ("FP8-CURRENT", qr.Float8CurrentScaling), ("DelayedScaling", qr.DelayedScaling),
])
def test_names_and_te_class_names_give_the_recipe_with_its_defaults(name, cls):
    assert qr.recipe(name) == cls()


def test_options_are_the_recipe_fields():
    assert qr.recipe("nvfp4", disable_rht=True) == qr.NVFP4BlockScaling(disable_rht=True)
    assert qr.recipe("delayed", margin=2).margin == 2


def test_an_unknown_name_lists_the_names():
    with pytest.raises(ValueError, match=r"unknown name 'fp16'; known: 'fp8_current' "
                                         r"\(Float8CurrentScaling\), 'fp8_block'"):
        qr.recipe("fp16")


def test_an_unknown_option_lists_the_recipe_fields():
    with pytest.raises(ValueError, match=r"MXFP8BlockScaling has no option 'disable_rht'; "
                                         r"its options: .*backward_override"):
        qr.recipe("mxfp8", disable_rht=True)


def test_a_name_must_be_a_string():
    with pytest.raises(TypeError, match="name must be a str"):
        qr.recipe(qr.MXFP8BlockScaling())


def test_options_take_format_names_in_any_case():
    """A config gives a format as text: the name of a ``Format`` member, in any case."""
    for text in ("HYBRID", "hybrid", "Hybrid"):
        assert qr.recipe("fp8_current", fp8_format=text) == qr.Float8CurrentScaling(
            fp8_format=qr.Format.HYBRID)
    assert qr.recipe("mxfp8", fp8_format="e4m3").fp8_format is qr.Format.E4M3
    assert qr.recipe("nvfp4", fp4_format="e2m1").fp4_format is qr.Format.E2M1


def test_options_take_qparams_and_mmparams_as_dicts():
    """A config gives ``QParams``/``MMParams`` as mappings: they become the dataclasses when the
    recipe is built, so the first forward reads their fields."""
    r = qr.recipe("fp8_current", fp8_quant_fwd_inp={"amax_epsilon": 1e-6},
                  fp8_gemm_fprop={"use_split_accumulator": True})
    assert r == qr.Float8CurrentScaling(fp8_quant_fwd_inp=qr.QParams(amax_epsilon=1e-6),
                                        fp8_gemm_fprop=qr.MMParams(True))
    torch.manual_seed(0)
    layer, x = qr.Linear(32, 16), torch.randn(8, 32)
    with qr.autocast(recipe=r):
        got = layer(x)
    with qr.autocast(recipe=qr.Float8CurrentScaling(
            fp8_quant_fwd_inp=qr.QParams(amax_epsilon=1e-6))):
        want = layer(x)
    assert torch.equal(got, want)


@pytest.mark.parametrize(("options", "error", "message"), [
    ({"fp8_format": "HYBRD"}, ValueError,
     r"Float8CurrentScaling.fp8_format: unknown Format 'HYBRD'; allowed: 'E4M3', 'E5M2', "
     r"'HYBRID', 'E2M1' \(any case\)"),
    ({"fp8_format": 3}, TypeError,
     r"fp8_format must be a Format or one of its names \('E4M3', 'E5M2', 'HYBRID', 'E2M1'"),
    ({"fp8_quant_fwd_inp": {"amax_eps": 0.1}}, ValueError,
     r"fp8_quant_fwd_inp: QParams has no field 'amax_eps'; its fields: power_2_scale, "
     r"amax_epsilon, random_hadamard_transform"),
    ({"fp8_gemm_dgrad": [True]}, TypeError,
     r"fp8_gemm_dgrad must be a MMParams or a dict of its fields \(use_split_accumulator\)"),
    ({"fp8_quant_bwd_grad": {"amax_epsilon": "0"}}, TypeError, "amax_epsilon must be a float"),
])
def test_unknown_names_and_keys_are_refused_with_what_is_allowed(options, error, message):
    with pytest.raises(error, match=message):
        qr.recipe("fp8_current", **options)


@pytest.mark.parametrize("where, call", [
    ("convert", lambda: qr.convert(torch.nn.Sequential(torch.nn.Linear(32, 32)), recipe="fp9")),
    ("QuantConverter", lambda: QuantConverter("fp9")),
    ("bound_recipe", lambda: setattr(qr.Linear(32, 32), "bound_recipe", "fp9")),
])
def test_an_unknown_name_is_refused_naming_the_argument_that_took_it(where, call):
    with pytest.raises(ValueError, match=rf"^{where}: unknown name 'fp9'; known: 'fp8_current'"):
        call()
