"""One rule for ``__all__``: a package's ``__init__.py`` declares its public API in ``__all__``
and every name there exists; modules inside a package declare none (what other modules import
from them carries no leading underscore)."""

from __future__ import annotations

import ast
import importlib
import pathlib

import pytest

SRC = sorted(pathlib.Path(__file__).resolve().parents[1].glob("packages/*/src"))
MODULES = sorted(p for src in SRC for p in src.rglob("*.py"))
INITS = [p for p in MODULES if p.name == "__init__.py"]


def _all_of(path: pathlib.Path) -> list[str] | None:
    for node in ast.parse(path.read_text()).body:
        targets = node.targets if isinstance(node, ast.Assign) else (
            [node.target] if isinstance(node, ast.AnnAssign) else [])
        if any(isinstance(t, ast.Name) and t.id == "__all__" for t in targets):
            return list(ast.literal_eval(node.value))
    return None


def _module_name(path: pathlib.Path) -> str:
    src = next(s for s in SRC if s in path.parents)
    parts = path.relative_to(src).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@pytest.mark.parametrize("path", [p for p in MODULES if p.name != "__init__.py"],
                         ids=_module_name)
def test_a_module_declares_no_all(path):
    assert _all_of(path) is None


@pytest.mark.parametrize("path", INITS, ids=_module_name)
def test_a_package_declares_its_public_names(path):
    names = _all_of(path)
    assert names is not None, f"{_module_name(path)} has no __all__"
    assert len(names) == len(set(names)), "a name is listed twice"
    try:
        module = importlib.import_module(_module_name(path))
    except ImportError as exc:  # a package whose dependencies this session lacks
        pytest.skip(str(exc))
    missing = [n for n in names if not hasattr(module, n)]
    assert not missing, missing
