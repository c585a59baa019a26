"""quant-recipes' view of ``torch.compile``, in one place (as ``quant_dynamo._api`` is for torch's
opaque-object API).

quant-dynamo is imported here, once, when the package is imported: it must register the value
quantizer classes with torch before Dynamo first sees one (imported lazily, mid-trace, the first
compile of a module traced its quantizers as plain objects and failed). Without quant-dynamo,
eager use is unaffected, and compiling a quantized module stops with :data:`NEEDS_DYNAMO`.
"""

from __future__ import annotations

from typing import Any

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


def compiling() -> bool:
    """Whether Dynamo is tracing the caller (``torch.compiler.is_compiling()``)."""
    return torch.compiler.is_compiling()


def available() -> bool:
    """Whether quant-dynamo is installed (compile support)."""
    return _quant_dynamo is not None


def dynamo() -> Any:
    """The ``quant_dynamo`` module; ``RuntimeError`` naming the install command without it."""
    if _quant_dynamo is None:
        raise RuntimeError(NEEDS_DYNAMO)
    return _quant_dynamo


def is_compiled_value(q: Any) -> bool:
    """While tracing: whether ``q`` is a registered value quantizer (the registry's test, which
    Dynamo folds; also true for torch 2.11's traced wrapper of one)."""
    return dynamo().is_value_opaque_quantizer(q)
