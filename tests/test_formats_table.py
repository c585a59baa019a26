"""tests/formats.py, the format table the test modules' QUANTIZERS / RECIPES tables derive from:
one row per registered storage format, each row's factories building that format, and its
stated capabilities agreeing with the quantizers."""

from __future__ import annotations

import importlib.util

import formats
import pytest
import quant_core
import torch

HAVE_RECIPES = importlib.util.find_spec("quant_recipes") is not None
ROWS = list(formats.FORMATS)


def test_every_registered_format_has_a_row():
    assert set(formats.FORMATS) == set(quant_core.storage_formats())


@pytest.mark.parametrize("fmt", ROWS)
def test_quantizer_factories_build_the_rows_format(fmt):
    row = formats.FORMATS[fmt]
    assert row.quantizers and row.label in (row.default_quantizer, *row.recipes)
    for name, make in row.quantizers.items():
        q = make()
        assert q.storage_format == fmt, name
        assert make() is not q and make() == q, f"{name}: a fresh, equal quantizer per call"
        assert make(columnwise_usage=False).columnwise_usage is False, name
    assert type(row.quantizer()) is type(next(iter(row.quantizers.values()))())
    assert row.quantizer() == type(row.quantizer())(), "the first variant is the class default"


@pytest.mark.parametrize("fmt", ROWS)
def test_every_row_has_a_recipe_factory(fmt):
    row = formats.FORMATS[fmt]
    assert row.recipes
    if not HAVE_RECIPES:
        pytest.skip("quant_recipes is not installed: the factories are not called")
    qr = pytest.importorskip("quant_recipes")
    for name, make in row.recipes.items():
        recipe = make()
        assert isinstance(recipe, qr.Recipe), name
        state = qr.RecipeState.create(recipe, mode="forward", num_quantizers=3)
        assert {q.storage_format for q in state.make_quantizers()} == {fmt}, name


@pytest.mark.parametrize("fmt", ROWS)
def test_stated_capabilities_agree_with_the_default_quantizer(fmt):
    row, q = formats.FORMATS[fmt], formats.FORMATS[fmt].quantizer()
    assert q.reduces_amax == row.reduces_amax
    assert ("ops" in q.lowerings()) == row.lowers_to_ops
    x = torch.randn(row.row_block * 2, row.k_multiple * 2)
    assert q.quantize(x).dequantize().shape == x.shape
    if row.k_multiple > 1:
        with pytest.raises(ValueError, match=f"multiple of {row.k_multiple}"):
            q.quantize(torch.randn(32, row.k_multiple + row.k_multiple // 2))
    col = q.with_usage(rowwise=False, columnwise=True).quantize(torch.randn(128, 128))
    if row.columnwise_dequantizes:
        assert col.dequantize().shape == (128, 128)
    else:
        with pytest.raises(NotImplementedError):
            col.dequantize()


def test_ids_name_one_row_each_and_select_by_capability():
    for row in formats.FORMATS.values():
        for name in (row.name, row.label, row.qualified, *row.quantizers, *row.recipes):
            assert formats.format_of(name) is row
    assert formats.select(["current", "mxfp8", "nvfp4_rht"], reduces_amax=True) == [
        "current", "nvfp4_rht"]
    assert list(formats.default_recipes(qualified=True)) == [
        formats.FORMATS[f].qualified for f in formats.FORMATS]
    assert formats.recipes("fp8_current").keys() == {"current"}
    with pytest.raises(KeyError, match="no id"):
        formats.format_of("fp9")
