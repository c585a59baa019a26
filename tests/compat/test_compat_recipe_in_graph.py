"""The default ``autocast()`` and a recipe constructed inside a
``fullgraph=True`` region compile in a fresh process (they failed with "SourcelessBuilder.create
does not know how to wrap MMParams" unless an eager ``autocast()`` had run first)."""

from __future__ import annotations

import subprocess
import sys

import pytest
import quant_dynamo

CHILD = """
import torch, quant_dynamo, quant_recipes as qr
layer = qr.Linear(32, 32)
def default_autocast(x):
    with qr.autocast():
        return layer(x)
def recipe_built_inside(x):
    with qr.autocast(recipe=qr.Float8BlockScaling()):
        return layer(x)
x = torch.randn(8, 32)
for fn in (default_autocast, recipe_built_inside):
    torch._dynamo.reset()
    got = torch.compile(fn, fullgraph=True, backend="aot_eager")(x)
    assert torch.equal(got, fn(x)), fn.__name__
    print("compiled", fn.__name__)
"""


@pytest.mark.skipif(quant_dynamo.status()["mode"] == "none",
                    reason="no opaque-object API on this torch: fullgraph is not promised")
def test_recipes_constructed_inside_a_fullgraph_region():
    run = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout.split() == ["compiled", "default_autocast", "compiled",
                                  "recipe_built_inside"]
