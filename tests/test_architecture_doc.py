"""`docs/architecture.md` §6 ("How to add a format") is a map of every module that names a
format, checked against the packages' sources (read with ``ast``, nothing imported):

- every module that names a format is named in §6, by its path (a ``<format>`` placeholder
  covers none: the table of today's units names each existing one);
- every path §6 names exists, and a placeholder path matches at least one file;
- the counts §6 states ("N new files plus additions to M existing files") are the lengths of
  its two lists.

A module *names a format* (the registry's names, ``tests/test_layering.py``'s
:func:`format_names`) when it

1. is a per-format module: its name is a format's (``mxfp8.py``) or starts with it and ``_``
   (``fp8_tensor.py``, ``nvfp4_gemm.py``, ``fp8_current.py``);
2. may switch on format names by ``tests/test_layering.py``'s allow-list;
3. holds a format's name as a string outside docstrings (a table keyed by ``"mxfp8"``);
4. refers to a public name that a per-format module defines and that spells a format (holds
   its name or, for the FP8 formats' TransformerEngine class names, ``float8``): its classes
   (``MXFP8Quantizer``), its backend functions (``mxfp8_quantize``), its recipe's kind
   predicate (``mxfp8()``); or
5. defines such a name for a per-format module to import (``shapes.py``'s
   ``mxfp8_rowwise_scale_shape``).
"""

from __future__ import annotations

import ast
import fnmatch
import pathlib
import re

import pytest
import test_layering as layering

REPO = pathlib.Path(__file__).resolve().parents[1]
DOC = REPO / "docs" / "architecture.md"
#: import name -> the folder its sources live in
SOURCES = {p: REPO / "packages" / p.replace("_", "-") / "src" / p for p in layering.PACKAGES}
PATH = re.compile(r"^(?:quant_core|quant_kernels|quant_dynamo|quant_recipes|tests|docs|packages)/"
                  r"[\w<>./-]*\.(?:py|md)$")
NEW, ADDED, WHEN = "**New files", "**Additions to existing files", "**Only when"


# ---------------------------------------------------------------------- the tree
def _doc_path(m: layering.Module) -> str:
    """``packages/quant-core/src/quant_core/shapes.py`` -> ``quant_core/shapes.py``."""
    return m.path.split("/src/", 1)[1]


def _per_format(m: layering.Module, formats: frozenset[str]) -> bool:
    stem = m.name.rsplit(".", 1)[-1]
    return not m.is_package and any(stem == f or stem.startswith(f + "_") for f in formats)


def _spells(name: str, formats: frozenset[str]) -> bool:
    low = name.lower()
    return not name.startswith("_") and (any(f in low for f in formats) or "float8" in low)


def _defined(m: layering.Module, formats: frozenset[str], *, methods: bool) -> set[str]:
    """Public names ``m`` defines at module level (and, with ``methods``, in its classes) that
    spell a format."""
    out: set[str] = set()
    for node in m.tree.body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            out.add(node.name)
            if methods and isinstance(node, ast.ClassDef):
                out |= {b.name for b in node.body
                        if isinstance(b, (ast.FunctionDef, ast.AsyncFunctionDef))}
        elif isinstance(node, ast.Assign):
            out |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out.add(node.target.id)
    return {n for n in out if _spells(n, formats)}


def _referred(m: layering.Module, formats: frozenset[str]) -> tuple[set[str], set[str]]:
    """The identifiers ``m`` uses or defines, and the format names it holds as strings outside
    docstrings."""
    tree = m.tree
    docstrings = {id(n.body[0].value) for n in ast.walk(tree)
                  if isinstance(n, (ast.Module, ast.ClassDef, ast.FunctionDef,
                                    ast.AsyncFunctionDef))
                  and n.body and isinstance(n.body[0], ast.Expr)
                  and isinstance(n.body[0].value, ast.Constant)}
    names, strings = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            names.add(node.id)
        elif isinstance(node, ast.Attribute):
            names.add(node.attr)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.alias):
            names.add(node.name.rsplit(".", 1)[-1])
        elif (isinstance(node, ast.Constant) and isinstance(node.value, str)
              and id(node) not in docstrings and node.value in formats):
            strings.add(node.value)
    return names, strings


def modules_naming_a_format(modules: list[layering.Module]) -> dict[str, str]:
    """Doc path of each module that names a format -> the first reason (the module docstring's
    rules 1-5)."""
    formats = layering.format_names(modules)
    by_name = {m.name: m for m in modules}
    units = [m for m in modules if _per_format(m, formats)]
    vocabulary = set().union(*(_defined(m, formats, methods=True) for m in units))
    definers = set()
    for unit in units:
        for imp in layering.imports(unit):
            source = by_name.get(imp.module)
            if source is not None and set(imp.names) & _defined(source, formats, methods=False):
                definers.add(source.name)
    out = {}
    for m in modules:
        names, strings = _referred(m, formats)
        why = ("a per-format module" if _per_format(m, formats)
               else "allowed to switch on format names" if layering._may_name_formats(m)
               else f"holds {sorted(strings)}" if strings
               else f"refers to {sorted(names & vocabulary)[:3]}" if names & vocabulary
               else "defines names a per-format module imports" if m.name in definers
               else None)
        if why:
            out[_doc_path(m)] = why
    return out


# ---------------------------------------------------------------------- the document
def section_6(text: str) -> str:
    start = text.index("\n## 6. ")
    return text[start:text.index("\n## 7. ", start)]


def _paths(text: str) -> list[str]:
    return [p for p in re.findall(r"`([^`\n]+)`", text) if PATH.match(p)]


def _table_paths(text: str) -> list[str]:
    """Paths in the section's tables: a header cell naming a folder (`` `quant_kernels/` ``)
    makes each file named in its column a path in that folder."""
    out, folders = [], None
    for line in text.splitlines():
        if not line.startswith("|"):
            folders = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if folders is None:
            folders = [c.strip("`") if re.fullmatch(r"`[\w/-]+/`", c) else None for c in cells]
            continue
        for folder, cell in zip(folders, cells, strict=True):
            if folder:
                out += [folder + name for name in re.findall(r"`([\w.-]+\.py)`", cell)]
    return out


def _between(text: str, start: str, end: str) -> str:
    i = text.index(start)
    return text[i:text.index(end, i)]


def named_paths(section: str) -> set[str]:
    return set(_paths(section)) | set(_table_paths(section))


def resolve(path: str) -> list[pathlib.Path]:
    """The files ``path`` names (a ``<placeholder>`` matches any name not starting with ``_``)."""
    first, _, rest = path.partition("/")
    root = SOURCES[first] if first in SOURCES else REPO / first
    if "<" not in rest:
        return [root / rest] if (root / rest).is_file() else []
    pattern = re.sub(r"<\w+>", "[!_]*", rest)
    return [p for p in root.rglob("*") if p.is_file()
            and fnmatch.fnmatchcase(p.relative_to(root).as_posix(), pattern)]


def missing_from(section: str, naming: dict[str, str]) -> list[str]:
    exact = {p for p in named_paths(section) if "<" not in p}
    return [f"{path} ({why})" for path, why in sorted(naming.items()) if path not in exact]


def not_existing(section: str) -> list[str]:
    return sorted(p for p in named_paths(section) if not resolve(p))


# ---------------------------------------------------------------------- the checks
SECTION = section_6(DOC.read_text())
NAMING = modules_naming_a_format(layering.MODULES)


def test_the_rule_finds_the_modules_that_name_formats():
    """A sample of each rule, so that a rule that stopped matching cannot pass silently."""
    assert NAMING["quant_core/formats/mxfp8.py"] == "a per-format module"
    assert NAMING["quant_kernels/nvfp4_gemm.py"] == "a per-format module"
    assert NAMING["quant_recipes/gemm_fast.py"] == "allowed to switch on format names"
    assert NAMING["quant_kernels/configs.py"].startswith("holds")
    assert NAMING["quant_kernels/backend.py"].startswith("refers to")
    assert NAMING["quant_recipes/recipe.py"].startswith("refers to")  # the kind predicates
    assert NAMING["quant_core/shapes.py"] == "defines names a per-format module imports"
    assert not any(p.startswith("quant_dynamo/") for p in NAMING)  # §6: no change there
    assert "quant_core/tensor_ops.py" not in NAMING  # it reads formats through hooks only


def test_section_6_names_every_module_that_names_a_format():
    missing = missing_from(SECTION, NAMING)
    assert not missing, ("docs/architecture.md §6 does not name these modules, which name a "
                         "format: " + "; ".join(missing))


def test_every_path_section_6_names_exists():
    gone = not_existing(SECTION)
    assert not gone, f"docs/architecture.md §6 names files that do not exist: {gone}"


def new_files(section: str) -> set[str]:
    """The list of new files: the bold paths heading its items."""
    return {p for p in re.findall(r"\*\*`([^`]+)`\*\*", _between(section, NEW, ADDED))
            if PATH.match(p)}


def added_files(section: str) -> set[str]:
    """The list of additions: the paths before the colon of each item."""
    items = re.split(r"\n- ", _between(section, ADDED, WHEN))[1:]
    return {p for item in items for p in _paths(item.split(": ", 1)[0])}


def test_section_6_states_the_lengths_of_its_lists():
    new, added = new_files(SECTION), added_files(SECTION)
    assert new and all("<" in p for p in new), new
    assert added and not any("<" in p for p in added), added
    stated = re.search(r"(\d+) new files plus additions to (\d+) existing files", SECTION)
    assert stated, "§6 no longer states how many files a new format touches"
    assert (int(stated[1]), int(stated[2])) == (len(new), len(added)), sorted(added)


# ---------------------------------------------------------------------- the checks themselves
def _mod(name: str, source: str) -> layering.Module:
    path = "packages/x/src/" + name.replace(".", "/") + ".py"
    return layering.Module(path, name, False, source)


_UNIT = _mod("quant_core.formats.foo4", 'class Foo4Storage:\n    format = "foo4"\n'
             "class FOO4Quantizer:\n    def foo4(self):\n        return True\n"
             "from ..shapes import FOO4_BLOCK\n")
_SHAPES = _mod("quant_core.shapes", "FOO4_BLOCK = 16\nOTHER = 1\n")


@pytest.mark.parametrize("name, source", [
    ("quant_recipes.x", "from quant_core import FOO4Quantizer\n"),
    ("quant_recipes.x", "TABLE = {'foo4': 1}\n"),
    ("quant_recipes.x", "def is_it(r):\n    return r.foo4()\n"),
    ("quant_kernels.foo4_gemm", "import torch\n"),
])
def test_rule_catches_a_module_naming_a_new_format(name, source):
    naming = modules_naming_a_format([_UNIT, _SHAPES, _mod(name, source)])
    assert name.replace(".", "/") + ".py" in naming, naming
    assert "quant_core/shapes.py" in naming  # FOO4_BLOCK, imported by the unit


@pytest.mark.parametrize("source", ['"""Quantize like "foo4" does."""\n', "amax = 1\n",
                                    "def f(x):\n    return x.other()\n"])
def test_rule_admits_a_module_that_names_no_format(source):
    assert "quant_recipes/x.py" not in modules_naming_a_format(
        [_UNIT, _SHAPES, _mod("quant_recipes.x", source)])


def test_check_catches_a_module_missing_from_the_doc():
    naming = {"quant_core/formats/fp8.py": "a per-format module",
              "quant_recipes/new.py": "refers to ['FOO4Quantizer']"}
    section = "## 6. x\n\n| f | `quant_core/formats/` |\n| --- | --- |\n| fp8 | `fp8.py` |\n"
    assert missing_from(section, naming) == ["quant_recipes/new.py (refers to ['FOO4Quantizer'])"]
    assert missing_from(section + "- `quant_recipes/<format>.py`\n", naming)  # no placeholder


def test_check_catches_a_path_that_does_not_exist():
    section = ("- `quant_core/shapes.py`, `quant_core/gone.py`, `quant_kernels/<format>.py`, "
               "`quant_kernels/<format>_nothing.py`\n")
    assert not_existing(section) == ["quant_core/gone.py", "quant_kernels/<format>_nothing.py"]
