"""quant-recipes' view of ``torch.compile``, in one place (as ``quant_dynamo._api`` is for torch's
opaque-object API).

quant-dynamo is imported here, once, when the package is imported: it must register the value
quantizer classes with torch before Dynamo first sees one (imported lazily, mid-trace, the first
compile of a module traced its quantizers as plain objects and failed). Without quant-dynamo,
eager use is unaffected, and compiling a quantized module stops with :data:`NEEDS_DYNAMO`.

quant's errors in traced code go through :func:`raise_error`, so that a ``fullgraph=True`` caller
reads quant's message first rather than Dynamo's "Observed exception" report around it.
"""

from __future__ import annotations

import functools
from typing import Any, NoReturn

import torch

try:
    import quant_dynamo as _quant_dynamo
except ImportError:  # compile support is optional
    _quant_dynamo = None

#: The error of compiling a quantized module without quant-dynamo.
NEEDS_DYNAMO = (
    "compiling a quant_recipes module needs quant-dynamo (from a clone: "
    "pip install ./packages/quant-dynamo)"
)


#: ``compiling()``: whether Dynamo is tracing the caller. torch's own function, not a wrapper:
#: Dynamo folds a call to it to a constant, where it would inline a wrapper's frame on each of
#: the dozen calls a quantized layer makes while it is traced.
compiling = torch.compiler.is_compiling


def available() -> bool:
    """Whether quant-dynamo is installed (compile support)."""
    return _quant_dynamo is not None


def dynamo() -> Any:
    """The ``quant_dynamo`` module; ``RuntimeError`` naming the install command without it."""
    if _quant_dynamo is None:
        raise_error(RuntimeError, NEEDS_DYNAMO)
    return _quant_dynamo


#: The quant-dynamo modes in which Dynamo hands a function marked by :func:`trace_time_constant`
#: the registered value quantizers themselves, so that it can run at trace time:
#: ``opaque_value`` (torch 2.12, 2.13) and ``opaque_value_base`` (torch 2.11, where traced code
#: holds a quantizer as a ``FakeScriptObject`` and Dynamo passes such a function the real
#: quantizer it wraps).
FOLDING_MODES = frozenset({"opaque_value", "opaque_value_base"})

#: ``quant_dynamo`` itself, or None without it: traced code on a path that compiling has
#: already required it for reads it in one instruction (``QUANT_DYNAMO or dynamo()``), where
#: :func:`dynamo` inlines a call.
QUANT_DYNAMO: Any = _quant_dynamo

#: Whether functions marked by :func:`trace_time_constant` run at trace time (a mode of
#: :data:`FOLDING_MODES`). 2.10 bakes quantizers through their repr; it, and releases not
#: verified, trace such functions as before.
FOLDS_CONSTANTS = (_quant_dynamo is not None
                   and _quant_dynamo.status()["mode"] in FOLDING_MODES)


#: ``quant_dynamo.DERIVES_IN_GRAPH`` (False without quant-dynamo), read as a module constant:
#: traced code reads it in one instruction, where ``dynamo().DERIVES_IN_GRAPH`` inlines a call.
DERIVES_IN_GRAPH: bool = _quant_dynamo is not None and _quant_dynamo.DERIVES_IN_GRAPH


def trace_time_constant(fn):
    """``fn``, marked so that Dynamo calls it at trace time and bakes its result as a constant
    (``torch.compiler.assume_constant_result``) instead of tracing its body: a call costs a few
    traced instructions where the body costs tens to hundreds, at every call site of every
    layer. For a pure function of values that traced code holds as constants (value quantizers
    made in traced code, strings, numbers, None, tuples of these) returning plain data (ints,
    bools, tuples or lists of them), which callers do not mutate. A result is computed afresh
    per call, so nothing is shared. Eagerly, and where :data:`FOLDS_CONSTANTS` is False, ``fn``
    runs (and is traced) as it is."""
    return torch.compiler.assume_constant_result(fn) if FOLDS_CONSTANTS else fn


def device_probe(fn):
    """``fn``, a probe of what this torch runs on a device (it calls torch's kernels on real
    tensors), run once per argument tuple and cached; while Dynamo traces, called at trace time
    with its result baked (:func:`trace_time_constant`). Dynamo traces through a plain cache
    decorator: the probe's body would then run on fake tensors, which say what torch's shape
    rules allow rather than what the device runs, or fail the compile where a rule refuses the
    probe's call. ``fn`` takes constants (strings, dtypes) and returns plain data."""
    cached = functools.cache(fn)

    @functools.wraps(fn)
    def probe(*args):
        return cached(*args)

    return trace_time_constant(probe)


def is_compiled_value(q: Any) -> bool:
    """While tracing: whether ``q`` is a registered value quantizer (the registry's test, which
    Dynamo folds; also true for torch 2.11's traced wrapper of one)."""
    return dynamo().is_value_opaque_quantizer(q)


class CompileError(Exception):
    """Base of quant's errors raised while Dynamo traces (see :func:`raise_error`); each is also
    an instance of the error class the same mistake raises eagerly (``RuntimeError``,
    ``TypeError``, ``ValueError``)."""


def raise_error(error: type[Exception], message: str) -> NoReturn:
    """Raise ``error(message)``.

    Eagerly this is a plain ``raise``. While Dynamo traces, a ``raise`` in traced code reaches a
    ``fullgraph=True`` caller as Dynamo's "Observed exception" report, with quant's message deep
    in its debug context. So the error is raised at trace time instead (``comptime``), as
    :func:`compile_error_class` of ``error``, which Dynamo hands to the caller as it is: ``str()``
    of it starts with ``message``. ``message`` must be a constant while tracing (built from
    constants, as quant's messages are); where it is not, the plain ``raise`` runs.
    """
    if compiling():
        from torch._dynamo.comptime import comptime

        comptime(_raise_at_trace_time)
    raise error(message)


def _raise_at_trace_time(ctx: Any) -> None:
    """``comptime`` callback: raise :func:`raise_error`'s error, read from its locals."""
    try:
        error = ctx.get_local("error").as_python_constant()
        message = ctx.get_local("message").as_python_constant()
    except Exception:  # noqa: BLE001  (not constants: leave it to the traced raise)
        return
    raise compile_error_class(error)(message)


@functools.cache
def compile_error_class(error: type[Exception]) -> type[Exception]:
    """The class :func:`raise_error` raises under torch.compile for ``error``: a subclass of
    ``error``, of :class:`CompileError` and of Dynamo's ``UserError`` ("valid in eager, not
    under Dynamo"), the one user exception Dynamo passes through unchanged. ``error`` itself
    where this torch has no ``UserError``."""
    try:
        from torch._dynamo.exc import UserError, UserErrorType
    except ImportError:  # pragma: no cover  (every supported torch has it)
        return error

    def __init__(self, message: str) -> None:
        UserError.__init__(self, UserErrorType.INVALID_INPUT, message)

    bases = (UserError, CompileError) + (() if issubclass(UserError, error) else (error,))
    name = f"Compile{error.__name__}"
    return type(name, bases, {"__init__": __init__, "__module__": __name__,
                              "__qualname__": name})
