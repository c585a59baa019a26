"""quant-core's modules import one another without a cycle (module-level imports; a function may
import late, but no module needs to): the bases sit below the formats, and the op table's
handlers below nothing they register onto."""

from __future__ import annotations

import ast
import pathlib

import quant_core

ROOT = pathlib.Path(quant_core.__file__).parent


def _name(path: pathlib.Path) -> str:
    parts = ("quant_core",) + path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path) -> set[str]:
    """The quant_core modules ``path`` imports at module level (``from . import x`` included)."""
    package = _name(path) if path.name == "__init__.py" else _name(path).rsplit(".", 1)[0]
    out = set()
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
            target = f"{base}.{node.module}" if node.module else base
            out.add(target)
            out |= {f"{target}.{a.name}" for a in node.names}
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("quant_core"):
            out.add(node.module)
    return out


def test_quant_core_has_no_import_cycle():
    modules = {_name(p): p for p in ROOT.rglob("*.py")}
    graph = {m: {i for i in _imports(p) if i in modules and i != m} for m, p in modules.items()}
    # a package's __init__ importing its own modules is not a cycle through them
    def own_package(m: str, i: str) -> bool:
        return m.startswith(i + ".") and modules[i].name == "__init__.py"

    graph = {m: {i for i in deps if not own_package(m, i)} for m, deps in graph.items()}
    state: dict[str, int] = {}

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for n in sorted(graph[m]):
            assert state.get(n) != 1, " -> ".join(stack + [m, n])
            if n not in state:
                visit(n, stack + [m])
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
