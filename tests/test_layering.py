"""The layering rules of `docs/architecture.md` (§2 and §3 contract 8), checked statically with
``ast`` over the packages' sources (nothing is imported):

1. the dependency direction: which package may import which (§2, with its one exception);
2. no package imports a private name (a leading-underscore module or name) of another;
3. above quant-core (quant-dynamo, quant-recipes), no switch on a format's name: no comparison,
   ``match`` case or dict key of a name from quant-core's format registry; the layers ask the
   format's classes instead (contract 8);
4. no module-level import cycle inside a package (a function may import late); in quant-core
   and quant-kernels none even counting the imports inside functions.

Each violation is reported as ``file:line: rule: what``. The checkers run on synthetic sources
too (the ``test_rule_catches_*`` tests), so a rule that stopped matching cannot pass silently.
"""

from __future__ import annotations

import ast
import dataclasses
import pathlib
import textwrap

import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("quant_core", "quant_kernels", "quant_dynamo", "quant_recipes")

#: importing package -> the packages it may import (§2). quant-kernels joins quant-core through
#: the entry point only, so nothing imports it by name.
MAY_IMPORT = {
    "quant_core": frozenset(),
    "quant_kernels": frozenset({"quant_core"}),
    "quant_dynamo": frozenset({"quant_core"}),
    "quant_recipes": frozenset({"quant_core"}),
}

#: (module, imported package) -> why this module may import it (§2's documented exceptions).
IMPORT_EXCEPTIONS = {
    ("quant_recipes.compiling", "quant_dynamo"):
        "compile support: quant-dynamo is imported once, when installed, before Dynamo sees a "
        "quantizer",
    ("quant_recipes.cli.doctor", "quant_dynamo"):
        "`quant doctor` reports the compile API and lowering quant-dynamo provides, if installed",
}

#: module -> why it may name formats (contract 8: the hardware routes and the recipes).
FORMAT_NAME_EXCEPTIONS = {
    "quant_recipes.gemm_fast": "the hardware routes: one cuBLAS/backend GEMM per format pair",
    "quant_recipes.recipe_names": "recipe names (`recipe('mxfp8')`), some equal to format names",
    "quant_recipes.cli.demo": "the demo's table of recipe names and their expected errors",
}
FORMAT_NAME_EXCEPTION_PACKAGES = {
    "quant_recipes.recipes": "one module per recipe: a recipe chooses its format's quantizers",
}

#: the packages above quant-core, where rule 3 applies.
ABOVE_CORE = ("quant_dynamo", "quant_recipes")

#: the packages where rule 4 counts an import inside a function body as an edge too: a late
#: import there would only hide a cycle between modules that should sit one below the other.
NO_LATE_CYCLE = ("quant_core", "quant_kernels")


@dataclasses.dataclass(frozen=True)
class Module:
    path: str  # shown in messages
    name: str  # dotted module name
    is_package: bool  # an __init__.py
    source: str

    @property
    def package(self) -> str:
        return self.name.split(".")[0]

    @property
    def tree(self) -> ast.Module:
        return ast.parse(self.source, filename=self.path)


@dataclasses.dataclass(frozen=True)
class Import:
    line: int
    module: str  # absolute dotted module
    names: tuple[str, ...]  # ``from module import names``; () for ``import module``
    module_level: bool  # runs when the module is imported (not inside a function)


def _modules() -> list[Module]:
    out = []
    for src in sorted(REPO.glob("packages/*/src")):
        for path in sorted(src.rglob("*.py")):
            parts = path.relative_to(src).with_suffix("").parts
            is_package = parts[-1] == "__init__"
            out.append(Module(str(path.relative_to(REPO)),
                              ".".join(parts[:-1] if is_package else parts), is_package,
                              path.read_text()))
    return out


MODULES = _modules()


def _type_checking(node: ast.AST) -> bool:
    test = getattr(node, "test", None)
    return isinstance(node, ast.If) and (
        (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING")
        or (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"))


def imports(m: Module) -> list[Import]:
    """Every import statement of ``m``, relative ones made absolute, and every
    ``importlib.import_module("...")`` / ``__import__("...")`` with a literal name."""
    package = m.name if m.is_package else m.name.rpartition(".")[0]
    out: list[Import] = []

    def visit(node: ast.AST, module_level: bool) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            module_level = False
        if _type_checking(node):
            return
        if isinstance(node, ast.Import):
            out.extend(Import(node.lineno, a.name, (), module_level) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            out.append(Import(node.lineno, target, tuple(a.name for a in node.names),
                              module_level))
        elif (isinstance(node, ast.Call) and node.args
              and isinstance(node.args[0], ast.Constant) and isinstance(node.args[0].value, str)
              and ((isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
                   or (isinstance(node.func, ast.Name)
                       and node.func.id in ("import_module", "__import__")))):
            out.append(Import(node.lineno, node.args[0].value, (), False))
        for child in ast.iter_child_nodes(node):
            visit(child, module_level)

    visit(m.tree, True)
    return out


# ---------------------------------------------------------------------- rule 1: direction
def direction_violations(modules: list[Module]) -> list[str]:
    out = []
    for m in modules:
        for imp in imports(m):
            top = imp.module.split(".")[0]
            if top not in PACKAGES or top == m.package or top in MAY_IMPORT[m.package]:
                continue
            if (m.name, top) in IMPORT_EXCEPTIONS:
                continue
            out.append(f"{m.path}:{imp.line}: direction: {m.package} may not import {top} "
                       f"(imports {imp.module}; docs/architecture.md §2)")
    return out


# ---------------------------------------------------------------------- rule 2: private names
def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def private_violations(modules: list[Module]) -> list[str]:
    out = []
    for m in modules:
        for imp in imports(m):
            top = imp.module.split(".")[0]
            if top not in PACKAGES or top == m.package:
                continue  # within a package, private modules and names are shared freely
            hidden = [p for p in imp.module.split(".")[1:] if _private(p)]
            hidden += [n for n in imp.names if _private(n)]
            if hidden:
                out.append(f"{m.path}:{imp.line}: private import: {m.package} imports "
                           f"{', '.join(hidden)} from {imp.module}, private to {top}")
    return out


def sibling_private_violations(modules: list[Module]) -> list[str]:
    """Above quant-core a module imports no underscore name from another module of its own
    package either: what a module shares is public (a private module may hold public names and
    be imported itself)."""
    known = {m.name for m in (*modules, *MODULES)}
    out = []
    for m in modules:
        if m.package not in ABOVE_CORE:
            continue
        for imp in imports(m):
            if imp.module.split(".")[0] != m.package:
                continue
            hidden = [n for n in imp.names if _private(n) and f"{imp.module}.{n}" not in known]
            if hidden:
                out.append(f"{m.path}:{imp.line}: private import: {m.name} imports "
                           f"{', '.join(hidden)} from {imp.module}")
    return out


# ---------------------------------------------------------------------- rule 3: format names
def format_names(modules: list[Module]) -> frozenset[str]:
    """The names quant-core's formats register (``format = "..."`` on a storage class in
    ``quant_core.formats``), read from the source."""
    names = set()
    for m in modules:
        if not m.name.startswith("quant_core.formats"):
            continue
        for cls in ast.walk(m.tree):
            if not isinstance(cls, ast.ClassDef):
                continue
            for node in cls.body:
                if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant)
                        and isinstance(node.value.value, str)
                        and any(isinstance(t, ast.Name) and t.id in ("format", "storage_format")
                                for t in node.targets)):
                    names.add(node.value.value)
    return frozenset(names)


def _strings(node: ast.AST | None) -> list[str]:
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
        return [s for e in node.elts for s in _strings(e)]
    return []


def _may_name_formats(m: Module) -> bool:
    return m.name in FORMAT_NAME_EXCEPTIONS or any(
        m.name.startswith(p + ".") for p in FORMAT_NAME_EXCEPTION_PACKAGES)


def format_switch_violations(modules: list[Module], names: frozenset[str]) -> list[str]:
    out = []
    for m in modules:
        if m.package not in ABOVE_CORE or _may_name_formats(m):
            continue
        for node in ast.walk(m.tree):
            if isinstance(node, ast.Compare):
                found = [s for e in (node.left, *node.comparators) for s in _strings(e)]
                what = "comparison " + ast.unparse(node)
            elif isinstance(node, ast.MatchValue):
                found, what = _strings(node.value), "match case " + ast.unparse(node.value)
            elif isinstance(node, ast.Dict):
                found = [s for k in node.keys for s in _strings(k)]
                what = "dict keyed by format names"
            else:
                continue
            named = sorted(set(found) & names)
            if named:
                out.append(f"{m.path}:{node.lineno}: format switch: {what} names format(s) "
                           f"{', '.join(named)}; ask the quantizer or storage class instead "
                           "(docs/architecture.md §3 contract 8)")
    return out


# ---------------------------------------------------------------------- rule 4: cycles
def cycle_violations(modules: list[Module], *, function_level: bool = False) -> list[str]:
    """Module-level import cycles inside each package; with ``function_level``, import cycles
    counting the imports inside functions too. An edge to one's own ancestor package is left
    out: importing a submodule runs its package's ``__init__`` first anyway."""
    by_name = {m.name: m for m in modules}
    graph: dict[str, dict[str, int]] = {}
    for m in modules:
        edges: dict[str, int] = {}
        for imp in imports(m):
            if ((not imp.module_level and not function_level)
                    or imp.module.split(".")[0] != m.package):
                continue
            for target in (imp.module, *(f"{imp.module}.{n}" for n in imp.names)):
                if (target in by_name and target != m.name
                        and not m.name.startswith(target + ".")):
                    edges.setdefault(target, imp.line)
        graph[m.name] = edges
    out, state = [], {}

    def visit(name: str, stack: list[str]) -> None:
        state[name] = 1
        for nxt in sorted(graph[name]):
            if state.get(nxt) == 1:
                cycle = stack[stack.index(nxt):] + [name, nxt] if nxt in stack else [name, nxt]
                m = by_name[name]
                out.append(f"{m.path}:{graph[name][nxt]}: import cycle: "
                           + " -> ".join(cycle))
            elif nxt not in state:
                visit(nxt, stack + [name])
        state[name] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name, [])
    return out


# ---------------------------------------------------------------------- the repository
def _report(violations: list[str]) -> str:
    return "\n".join(violations)


def test_packages_import_in_the_documented_direction():
    v = direction_violations(MODULES)
    assert not v, _report(v)


def test_quant_recipes_imports_no_kernels():
    v = [s for s in direction_violations(MODULES) if "quant_recipes may not import quant_kernels"
         in s]
    assert not v, _report(v)


def test_no_package_imports_another_packages_private_names():
    v = private_violations(MODULES)
    assert not v, _report(v)


def test_no_module_above_core_imports_a_siblings_private_names():
    v = sibling_private_violations(MODULES)
    assert not v, _report(v)


def test_format_names_are_read_from_the_registry():
    assert {"fp8", "fp8_block", "mxfp8", "nvfp4"} <= format_names(MODULES)


def test_no_format_switch_above_quant_core():
    v = format_switch_violations(MODULES, format_names(MODULES))
    assert not v, _report(v)


def test_no_module_level_import_cycle():
    v = cycle_violations(MODULES)
    assert not v, _report(v)


def test_no_import_cycle_counting_function_level_imports():
    v = cycle_violations([m for m in MODULES if m.package in NO_LATE_CYCLE], function_level=True)
    assert not v, _report(v)


def test_every_exception_is_still_needed():
    """An allow-list entry that matches nothing is stale: remove it (or it admits a new use)."""
    names = {m.name for m in MODULES}
    for module, package in IMPORT_EXCEPTIONS:
        m = next(m for m in MODULES if m.name == module)
        assert any(i.module.split(".")[0] == package for i in imports(m)), (module, package)
    for module in FORMAT_NAME_EXCEPTIONS:
        assert module in names, module
        m = next(m for m in MODULES if m.name == module)
        assert format_switch_violations([dataclasses.replace(m, name="quant_recipes._x")],
                                        format_names(MODULES)), module
    for package in FORMAT_NAME_EXCEPTION_PACKAGES:
        assert any(n.startswith(package + ".") for n in names), package


# ---------------------------------------------------------------------- the rules themselves
def _mod(name: str, source: str, *, is_package: bool = False) -> Module:
    path = "packages/x/src/" + name.replace(".", "/") + ("/__init__.py" if is_package else ".py")
    return Module(path, name, is_package, textwrap.dedent(source))


@pytest.mark.parametrize("name, source, line", [
    ("quant_core.x", "import torch\nimport quant_recipes\n", 2),
    ("quant_core.x", "from quant_kernels import backend\n", 1),
    ("quant_core.x", "def f():\n    from quant_dynamo import ops\n", 2),
    ("quant_kernels.x", "from quant_dynamo.ops import quantize\n", 1),
    ("quant_kernels.x", "import quant_recipes.gemm\n", 1),
    ("quant_dynamo.x", "from quant_recipes import Linear\n", 1),
    ("quant_recipes.x", "from quant_kernels import fp8_grouped_gemm\n", 1),
    ("quant_recipes.x", "import importlib\nimportlib.import_module('quant_kernels.nvfp4')\n", 2),
    ("quant_recipes.gemm", "import quant_dynamo\n", 1),  # only the documented modules may
])
def test_rule_catches_a_wrong_direction(name, source, line):
    v = direction_violations([_mod(name, source)])
    assert len(v) == 1 and f".py:{line}: direction:" in v[0], v


@pytest.mark.parametrize("name, source", [
    ("quant_kernels.x", "from quant_core.shapes import ceil_div\n"),
    ("quant_recipes.compiling", "import quant_dynamo\n"),
    ("quant_recipes.x", "from quant_core import backends\nfrom .gemm import qgemm\n"),
    ("quant_recipes.x", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                        "    pass\n"),
])
def test_rule_admits_the_documented_directions(name, source):
    assert direction_violations([_mod(name, source)]) == []


@pytest.mark.parametrize("name, source, hidden", [
    ("quant_recipes.fsdp", "from quant_core.reference._pad import zero_pad\n", "_pad"),
    ("quant_recipes.fsdp", "from quant_core.reference import _pad\n", "_pad"),
    ("quant_recipes.fsdp", "import quant_core._torch_compat\n", "_torch_compat"),
    ("quant_dynamo.x", "def f():\n    from quant_core.quantizer import Quantizer, _rebuild\n",
     "_rebuild"),
])
def test_rule_catches_a_private_import(name, source, hidden):
    v = private_violations([_mod(name, source)])
    assert len(v) == 1 and "private import" in v[0] and hidden in v[0], v


@pytest.mark.parametrize("name, source", [
    ("quant_core.formats.nvfp4", "from ..reference._pad import zero_pad\n"),
    ("quant_recipes.moe.fp8_gemm", "from quant_recipes.gemm_fast import _helper\n"),
    ("quant_recipes.x", "from quant_core.quantizer import __doc__\n"),
])
def test_rule_admits_private_imports_inside_a_package(name, source):
    assert private_violations([_mod(name, source)]) == []


@pytest.mark.parametrize("name, source, hidden", [
    ("quant_recipes.recipes.mxfp8", "from ..states import RecipeState, _dtype\n", "_dtype"),
    ("quant_recipes.moe.fp8_gemm", "from quant_recipes.gemm_fast import _helper\n", "_helper"),
    ("quant_dynamo.x", "def f():\n    from .ops import _impl\n", "_impl"),
])
def test_rule_catches_a_siblings_private_name(name, source, hidden):
    v = sibling_private_violations([_mod(name, source)])
    assert len(v) == 1 and hidden in v[0], v


@pytest.mark.parametrize("name, source", [
    ("quant_recipes.x", "from ._impl import helper\nfrom . import _impl\n"),
    ("quant_dynamo.x", "from ._api import probe as _probe\n"),
    ("quant_kernels.nvfp4", "from .nvfp4_common import _tile_amax\n"),
])
def test_rule_admits_private_modules_and_kernel_helpers(name, source):
    private_module = _mod("quant_recipes._impl", "helper = 1\n")
    assert sibling_private_violations([_mod(name, source), private_module]) == []


def test_format_names_come_from_storage_classes():
    src = _mod("quant_core.formats.new", """
        class NewStorage(QuantizedStorage):
            format = "new4"
        """)
    assert format_names([src]) == {"new4"}


@pytest.mark.parametrize("source, line", [
    ("if q.storage_format != 'fp8':\n    pass\n", 1),
    ("x = 1\nok = q.storage_format == \"nvfp4\" and q.with_rht\n", 2),
    ("ok = fmt in ('mxfp8', 'nvfp4')\n", 1),
    ("ok = fmt not in {'fp8_block'}\n", 1),
    ("match fmt:\n    case 'fp8':\n        pass\n", 2),
    ("TABLE = {'nvfp4': 1}\n", 1),
    ("def f(q):\n    return 'fp8' == q.storage_format\n", 2),
])
def test_rule_catches_a_format_switch(source, line):
    names = frozenset({"fp8", "fp8_block", "mxfp8", "nvfp4"})
    for name in ("quant_recipes.tensor_parallel.sequence", "quant_dynamo.ops"):
        v = format_switch_violations([_mod(name, source)], names)
        assert len(v) == 1 and f".py:{line}: format switch:" in v[0], v


@pytest.mark.parametrize("name, source", [
    ("quant_recipes.x", "ok = recipe_name == 'fp8_current'\n"),
    ("quant_recipes.x", "ok = q.decodes_exactly_to_bf16()\n"),
    ("quant_recipes.gemm_fast", "ok = fmt == 'nvfp4'\n"),
    ("quant_recipes.recipes.nvfp4", "ok = fmt == 'nvfp4'\n"),
    ("quant_kernels.x", "ok = fmt == 'nvfp4'\n"),  # below the rule: not above quant-core
    ("quant_core.tensor_ops", "ok = fmt == 'nvfp4'\n"),
])
def test_rule_admits_what_names_no_format_or_may(name, source):
    names = frozenset({"fp8", "fp8_block", "mxfp8", "nvfp4"})
    assert format_switch_violations([_mod(name, source)], names) == []


def test_rule_catches_an_import_cycle():
    a = _mod("quant_recipes.a", "import torch\nfrom .b import f\n")
    b = _mod("quant_recipes.b", "from . import c\n")
    c = _mod("quant_recipes.c", "from quant_recipes.a import g\n")
    v = cycle_violations([a, b, c])
    assert len(v) == 1 and "import cycle: quant_recipes.a -> quant_recipes.b -> " \
        "quant_recipes.c -> quant_recipes.a" in v[0] and "c.py:1:" in v[0], v


def test_rule_admits_late_and_package_imports():
    init = _mod("quant_recipes", "from .a import f\n", is_package=True)
    a = _mod("quant_recipes.a", "from . import b\nfrom quant_recipes import c\n")
    b = _mod("quant_recipes.b", "def f():\n    from .a import f\n")
    c = _mod("quant_recipes.c", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                "    from .a import f\n")
    assert cycle_violations([init, a, b, c]) == []


def test_rule_catches_a_cycle_through_a_function_level_import():
    a = _mod("quant_kernels.a", "from .b import g\n")
    b = _mod("quant_kernels.b", "def g():\n    from .a import f\n")
    assert cycle_violations([a, b]) == []
    v = cycle_violations([a, b], function_level=True)
    assert len(v) == 1 and "import cycle: quant_kernels.a -> quant_kernels.b -> " \
        "quant_kernels.a" in v[0] and "b.py:2:" in v[0], v
