"""The probe: which opaque-object API this torch has, behind one small interface.

Features are probed, not version strings (`docs/torch-versions.md` §3). The probe never raises:
a missing module or attribute means mode ``"none"``. On 2.14+ only ``torch._custom_class_base``
and ``torch._library.opaque_object`` are touched, never the warning alias ``torch._opaque_base``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from quant_core.torch_compat import opaque_api_generation

#: Every mode :func:`probe` can report, newest API first.
MODES = ("custom_class", "opaque_value", "opaque_value_base", "repr", "none")


@dataclass(frozen=True)
class OpaqueAPI:
    """The running torch's opaque-object API, reduced to what quant-dynamo needs.

    ``register(cls, members)`` registers ``cls`` as a value (constant) type; ``members`` is a list
    of attribute names and methods run on the real object at trace time (not on 2.10).
    ``type_name(cls)`` is torch's schema type name for ``cls``; ``is_registered(cls)`` asks
    torch's registry.
    """

    mode: str
    register: Callable[[type, list[str]], None] | None = None
    type_name: Callable[[type], str] | None = None
    is_registered: Callable[[type], bool] | None = None

    @property
    def available(self) -> bool:
        return self.mode != "none"


def _use_real(oo: Any, members: list[str]) -> dict[str, Any]:
    """``members`` as USE_REAL: Dynamo runs them on the real object at trace time and bakes the
    result. Needed on 2.11 for every attribute read; on every release for the methods that build
    a new quantizer (``replace``, ``with_usage``, ``copy``), which Dynamo cannot trace through a
    baked value's attributes."""
    return {m: oo.MemberType.USE_REAL for m in members}


def _custom_class_api(oo: Any) -> OpaqueAPI:
    import torch._custom_class_base  # noqa: F401  (probe first: the new home of the base class)

    def register(cls: type, members: list[str]) -> None:
        oo.register_custom_class(cls, typ="constant", members=_use_real(oo, members))

    type_name = getattr(oo, "get_custom_class_name", None) or oo.get_opaque_type_name
    is_registered = getattr(oo, "is_opaque_constant_type", None) or oo.is_opaque_value_type
    return OpaqueAPI("custom_class", register, type_name, is_registered)


def _opaque_value_api(oo: Any, mode: str) -> OpaqueAPI:
    def register(cls: type, members: list[str]) -> None:
        if mode == "repr":  # 2.10: no members parameter
            oo.register_opaque_type(cls, typ="value")
        else:
            oo.register_opaque_type(cls, typ="value", members=_use_real(oo, members))

    return OpaqueAPI(mode, register, oo.get_opaque_type_name, oo.is_opaque_value_type)


@functools.cache
def probe() -> OpaqueAPI:
    """The API of the running torch (cached); ``OpaqueAPI("none")`` when there is none."""
    try:
        mode = opaque_api_generation()
        if mode == "none":
            return OpaqueAPI("none")
        from torch._library import opaque_object as oo

        if mode == "custom_class":
            return _custom_class_api(oo)
        return _opaque_value_api(oo, mode)
    except (ImportError, AttributeError):
        return OpaqueAPI("none")
