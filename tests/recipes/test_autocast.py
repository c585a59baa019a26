"""autocast: nesting, exceptions, re-entry, enabled=False (behaviour.md §7)."""

from __future__ import annotations

import pytest
import quant_recipes as qr
from quant_recipes import current_frame


def test_nesting_innermost_wins_and_outer_restored():
    r0, r1 = qr.Float8CurrentScaling(), qr.MXFP8BlockScaling()
    assert current_frame() is None
    with qr.autocast(recipe=r0):
        outer = current_frame()
        assert outer.recipe is r0 and outer.enabled
        with qr.autocast(recipe=r1):
            assert current_frame().recipe is r1
            with qr.autocast(enabled=False):
                assert not current_frame().enabled
            assert current_frame().recipe is r1
        assert current_frame() is outer
    assert current_frame() is None


def test_exception_restores_state():
    r0 = qr.Float8CurrentScaling()
    with qr.autocast(recipe=r0):
        outer = current_frame()
        with pytest.raises(KeyError):
            with qr.autocast(recipe=qr.MXFP8BlockScaling()):
                raise KeyError("boom")
        assert current_frame() is outer
    assert current_frame() is None


def test_reentering_same_instance_raises():
    ac = qr.autocast(recipe=qr.Float8CurrentScaling())
    with ac:
        with pytest.raises(RuntimeError, match="already active"):
            with ac:
                pass
        assert current_frame().recipe == qr.Float8CurrentScaling()
    with ac:  # reusable after exit
        pass
    assert current_frame() is None


def test_default_recipe_is_stateless():
    with qr.autocast():
        recipe = current_frame().recipe
    assert isinstance(recipe, qr.Float8CurrentScaling)
    assert not recipe.delayed()


def test_bad_recipe_type():
    with pytest.raises(TypeError, match="Recipe"):
        with qr.autocast(recipe="fp8"):
            pass
    assert current_frame() is None
