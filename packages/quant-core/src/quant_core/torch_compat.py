"""The one torch-release probe quant-core needs: the ``Quantizer`` metaclass.

torch 2.11 requires every opaque class, value types included, to use ``OpaqueBaseMeta``; that must
be decided when the class is created, so quant-core decides it at import. Every other release gets
plain ``ABCMeta`` (2.12+ dropped the requirement; 2.14+ warns when ``torch._opaque_base`` is
imported, so it is never imported there). Features are probed, not version strings
(`docs/torch-versions.md` §3).
"""

from __future__ import annotations

import abc
import importlib.util
import inspect


def opaque_api_generation() -> str:
    """Which opaque-object API this torch has: "custom_class", "opaque_value",
    "opaque_value_base", "repr" or "none" (the modes of `docs/torch-versions.md` §1)."""
    try:
        from torch._library import opaque_object
    except ImportError:
        return "none"
    if hasattr(opaque_object, "register_custom_class"):
        return "custom_class"
    register = getattr(opaque_object, "register_opaque_type", None)
    if register is None:
        return "none"
    params = inspect.signature(register).parameters
    if "reconstruct_fn" in params:
        return "opaque_value"
    if "hoist" in params:
        return "opaque_value_base"
    return "repr"


def _quantizer_metaclass() -> type:
    if opaque_api_generation() != "opaque_value_base":
        return abc.ABCMeta
    if importlib.util.find_spec("torch._opaque_base") is None:  # pragma: no cover
        return abc.ABCMeta
    from torch._opaque_base import OpaqueBaseMeta

    class QuantizerMeta(OpaqueBaseMeta, abc.ABCMeta):
        """``OpaqueBaseMeta`` combined with ``ABCMeta`` (torch 2.11 only)."""

    return QuantizerMeta


QuantizerMeta = _quantizer_metaclass()


def opaque_base() -> type | None:
    """torch 2.11's ``OpaqueBase`` class, which value quantizers must subclass there; else None."""
    if opaque_api_generation() != "opaque_value_base":
        return None
    from torch._opaque_base import OpaqueBase

    return OpaqueBase
