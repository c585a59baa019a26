"""Evaluable representations of value quantizers for FX codegen (`docs/behaviour.md` §2.8).

``__fx_repr__`` (torch 2.11+) returns ``(expr, globals)`` with
``expr = "_rebuild_quantizer(ClassName, <key items>)"``; torch 2.10 instead evals ``repr(q)`` with
only the class name in scope, so there the repr is ``ClassName._rebuild_from_items(<key items>)``.
Both go through ``value_key()``, so a quantizer holding a process group raises ``TypeError``, and
both write enum fields by value, converted back by the field's annotated enum type.
"""

from __future__ import annotations

import functools
import math
import sys
from typing import Any

from quant_core.quantizer import Quantizer, rebuild_quantizer


@functools.lru_cache(maxsize=4096)
def _rebuild_interned(cls: type, items: tuple[tuple[str, Any], ...]) -> Quantizer:
    return rebuild_quantizer(cls, items)


def rebuild_for_graph(cls: type, items: tuple[tuple[str, Any], ...]) -> Quantizer:
    """What compiled code calls as ``_rebuild_quantizer``: the same rebuild, validated once per
    distinct ``(cls, items)`` and then reused. A graph may rebuild its constant quantizers on
    every call (torch 2.11 does, per custom-op call), and a value needs no fresh object."""
    try:
        return _rebuild_interned(cls, items)
    except TypeError:
        return rebuild_quantizer(cls, items)  # unhashable items, or the validation error again


def literal(value: Any) -> str:
    """Python source for a key item value (int, bool, float, str, tuples of them)."""
    if isinstance(value, tuple):
        inner = ", ".join(literal(v) for v in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    if isinstance(value, float) and math.isinf(value):
        return "float('inf')" if value > 0 else "float('-inf')"
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    raise TypeError(f"cannot write {value!r} into FX code: key items must be primitives")


def _bind_in_outermost_graph(names: dict[str, Any]) -> None:
    """Record ``names`` for the module of the outermost graph Inductor is lowering, when it is
    lowering a nested subgraph (``torch.compiler.nested_compile_region``): Inductor binds the
    names an expression needs from the graph that wrote it, but a subgraph's code is a function
    in its outermost graph's module, which would not get them (``NameError`` when it runs)."""
    virtualized = sys.modules.get("torch._inductor.virtualized")
    graph = None if virtualized is None else virtualized.V.graph
    parent = getattr(graph, "parent", None)
    if parent is None:
        return
    while getattr(parent, "parent", None) is not None:
        parent = parent.parent
    record = getattr(parent, "opaque_value_type_classes", None)
    if isinstance(record, dict):
        record.update(names)


def quantizer_fx_repr(self: Quantizer) -> tuple[str, dict[str, Any]]:
    """``(expr, globals)`` such that ``eval(expr, globals) == self`` (a distinct object, shared by
    every evaluation of an equal expression: see :func:`rebuild_for_graph`)."""
    cls = type(self)
    items = self.value_key()[1]
    expr = f"_rebuild_quantizer({cls.__name__}, {literal(items)})"
    names = {"_rebuild_quantizer": rebuild_for_graph, cls.__name__: cls}
    _bind_in_outermost_graph(names)
    return expr, names


def _rebuild_from_items(cls: type, items: tuple[tuple[str, Any], ...]) -> Quantizer:
    """Classmethod body for torch 2.10's repr: ``ClassName._rebuild_from_items(items)``."""
    return rebuild_for_graph(cls, items)


def quantizer_eval_repr(self: Quantizer) -> str:
    """torch 2.10's eval-able ``__repr__``, naming only the class."""
    _bind_in_outermost_graph({type(self).__name__: type(self)})
    return f"{type(self).__name__}._rebuild_from_items({literal(self.value_key()[1])})"


def attach(cls: type, *, eval_repr: bool) -> None:
    """Give ``cls`` ``__fx_repr__`` (and with ``eval_repr`` an eval-able ``__repr__``) unless it
    defines or inherits its own; must run before the torch registration call."""
    if getattr(cls, "__fx_repr__", None) in (None, quantizer_fx_repr):
        type.__setattr__(cls, "__fx_repr__", quantizer_fx_repr)
    if eval_repr:
        if not hasattr(cls, "_rebuild_from_items"):
            type.__setattr__(cls, "_rebuild_from_items", classmethod(_rebuild_from_items))
        if cls.__repr__ in (Quantizer.__repr__, quantizer_eval_repr):
            type.__setattr__(cls, "__repr__", quantizer_eval_repr)
