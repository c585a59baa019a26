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
        with qr.autocast(recipe=42):
            pass
    assert current_frame() is None


def test_a_recipe_name_is_resolved_as_recipe_resolves_it():
    with qr.autocast(recipe="mxfp8"):
        assert current_frame().recipe == qr.MXFP8BlockScaling()
    with qr.autocast(recipe="Float8BlockScaling"):
        assert current_frame().recipe == qr.Float8BlockScaling()
    with pytest.raises(ValueError, match="unknown name 'fp8'; known: 'fp8_current'"):
        qr.autocast(recipe="fp8")
    assert current_frame() is None


def test_state_is_thread_local():
    """Each thread sees only its own autocast frames, as with torch.autocast.

    Two threads hold different recipes at the same time, a thread without autocast sees none,
    and one thread leaving its region does not remove the other's frame."""
    import threading

    entered = threading.Barrier(3)
    left = threading.Barrier(3)
    seen: dict[str, object] = {}

    def inside(name, recipe):
        with qr.autocast(recipe=recipe):
            entered.wait(timeout=10)
            seen[name] = current_frame().recipe
            left.wait(timeout=10)
            seen[name + "_after_other_left"] = current_frame().recipe

    def outside():
        entered.wait(timeout=10)
        seen["none"] = current_frame()
        left.wait(timeout=10)

    threads = [threading.Thread(target=inside, args=("mx", qr.MXFP8BlockScaling())),
               threading.Thread(target=inside, args=("fp8", qr.Float8CurrentScaling())),
               threading.Thread(target=outside)]
    with qr.autocast(recipe=qr.NVFP4BlockScaling()):  # the main thread's frame is its own too
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=30)
        assert current_frame().recipe == qr.NVFP4BlockScaling()
    assert seen["mx"] == seen["mx_after_other_left"] == qr.MXFP8BlockScaling()
    assert seen["fp8"] == seen["fp8_after_other_left"] == qr.Float8CurrentScaling()
    assert seen["none"] is None
