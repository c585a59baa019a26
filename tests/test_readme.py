"""The README's usage example runs as written (so it cannot rot)."""

from __future__ import annotations

import pathlib
import re

README = pathlib.Path(__file__).resolve().parents[1] / "README.md"


def test_readme_usage_example_runs():
    text = README.read_text()
    usage = text[text.index("## Usage"):]
    blocks = re.findall(r"```python\n(.*?)```", usage, flags=re.S)
    assert blocks, "the README's Usage section has no python example"
    namespace: dict = {}
    exec(compile(blocks[0], str(README), "exec"), namespace)  # noqa: S102
    assert namespace["q_rowwise"].columnwise_usage is False
    assert namespace["model"][0].weight.grad is not None
