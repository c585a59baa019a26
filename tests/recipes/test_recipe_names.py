"""``quant_recipes.recipe(name, **options)``: recipes from the names configs and command lines
use."""

from __future__ import annotations

import pytest
import quant_recipes as qr


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
