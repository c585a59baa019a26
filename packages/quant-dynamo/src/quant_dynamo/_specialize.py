"""Scalar fields of a value quantizer stay compile-time constants under ``dynamic=True``.

With ``torch.compile(dynamic=True)``, or once a Python float argument has changed between calls
(automatic dynamic), Dynamo turns the floats and ints it reads into symbolic values. A value
quantizer is baked into the graph as a constant, so its constructor needs concrete arguments:
torch would stop with "SymNodeVariable() is not a constant". For the classes quant-dynamo
registered, :func:`install` has Dynamo specialise such arguments before construction: each gets
a guard on its value, exactly as a constant argument would, so a new value recompiles and never
reaches a graph built for another (`behaviour.md` §2: quantizers are values).

The hook wraps the ``call_function`` of Dynamo's variable for an opaque class (named
``CustomClassVariable`` on 2.14+, ``OpaqueObjectClassVariable`` on 2.10-2.13), found by probing.
Where neither exists the hook is not installed and :func:`install` returns False.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

_CLASS_VARIABLE_NAMES = ("CustomClassVariable", "OpaqueObjectClassVariable")


def _class_variable() -> type | None:
    try:
        from torch._dynamo.variables import script_object
    except ImportError:
        return None
    for name in _CLASS_VARIABLE_NAMES:
        found = getattr(script_object, name, None)
        if isinstance(found, type) and callable(getattr(found, "call_function", None)):
            return found
    return None


def _specialised(tx: Any, arg: Any) -> Any:
    """``arg`` as a constant variable when it is a symbolic int/float/bool, else unchanged."""
    from torch._dynamo.variables.constant import ConstantVariable
    from torch._dynamo.variables.lazy import LazyVariableTracker
    from torch._dynamo.variables.tensor import SymNodeVariable

    if isinstance(arg, LazyVariableTracker):
        arg = arg.realize()
    if isinstance(arg, SymNodeVariable):
        return ConstantVariable.create(arg.evaluate_expr(tx.output))
    return arg


def install(is_ours: Callable[[type], bool]) -> bool:
    """Specialise symbolic constructor arguments of every class for which ``is_ours(cls)``.

    Idempotent; returns whether the hook is in place on this torch.
    """
    variable = _class_variable()
    if variable is None:
        return False
    original = variable.call_function
    if getattr(original, "_quant_specialises", False):
        return True

    def call_function(self: Any, tx: Any, args: list, kwargs: dict) -> Any:
        cls = getattr(self, "value", None)
        if isinstance(cls, type) and is_ours(cls):
            args = [_specialised(tx, a) for a in args]
            kwargs = {k: _specialised(tx, v) for k, v in kwargs.items()}
        return original(self, tx, args, kwargs)

    call_function._quant_specialises = True  # type: ignore[attr-defined]
    call_function.__wrapped__ = original  # type: ignore[attr-defined]
    variable.call_function = call_function
    return True
