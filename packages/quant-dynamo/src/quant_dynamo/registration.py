"""Registering value quantizer classes with torch (`docs/behaviour.md` §2.9).

Order per class: validate (quant-core's ``@value_quantizer``), attach ``__fx_repr__`` (and the
2.10 repr), register with the probed API inside ``except (RuntimeError, TypeError)``, and only
after success add the class to :data:`REGISTERED_CLASSES` and its qualname to
:data:`REGISTERED_QUALNAMES` (the strings are what :func:`is_value_opaque_quantizer` tests while
Dynamo traces, constant-folded without a graph break).
"""

from __future__ import annotations

import functools
import json
import re
import warnings
from collections.abc import Callable
from typing import Any

import torch
from quant_core.quantizer import (
    Quantizer,
    add_value_class_hook,
    is_value_quantizer,
    value_classes,
    value_quantizer,
)

from . import fx_repr
from ._api import probe

#: Qualnames of the classes registered with torch (for :func:`status`, and the membership test
#: of torch 2.11's traced wrapper, which only registered objects become).
REGISTERED_QUALNAMES: set[str] = set()
#: The registered classes themselves (exact classes, not subclasses); torch's registry keeps
#: them alive anyway.
REGISTERED_CLASSES: set[type] = set()
#: Called with each class after its successful registration (ops define their overloads here).
_on_registered: list[Callable[[type], None]] = []

#: Read-only helpers that traced code may call on a quantizer (registered USE_REAL on 2.11),
#: beside its fields and its class's ``traced_members``.
_READ_ONLY_MEMBERS = (
    "value_fields", "value_key", "get_usages", "is_requantization_safe",
    "supports_only_rowwise_all_gather", "with_usage", "replace", "copy", "__fx_repr__",
    "_opaque_qualname", "_quant_op_overload", "storage_format", "_storage_tags",
    "reduces_amax", "amax_numel", "lowerings", "row_alignment", "shape_rule",
    "decodes_exactly_to_bf16",
)
#: Overload names of the ``quant`` ops already taken. They are allocated here, not in ``ops``
#: (which defines the overloads): ``_quant_op_overload`` is one of the members torch records at
#: registration, so the class must carry its name before ``api.register`` runs.
_overload_names: set[str] = {"flat", "default"}


def _opaque_qualname(self: Any) -> str:
    """``type(self).__qualname__`` read on the real object (torch 2.11 traces a wrapper)."""
    return type(self).__qualname__


def _attach_op_helpers(cls: type) -> None:
    """Give ``cls`` the attributes traced code reads: ``_opaque_qualname`` and its own
    ``_quant_op_overload`` (the overload name of the ``quant`` ops for exactly this class)."""
    if not isinstance(cls.__dict__.get("_opaque_qualname"), property):
        type.__setattr__(cls, "_opaque_qualname", property(_opaque_qualname))
    if "_quant_op_overload" not in cls.__dict__:
        base = re.sub(r"\W", "_", cls.__qualname__)
        name, i = base, 1
        while name in _overload_names:
            i += 1
            name = f"{base}_{i}"
        _overload_names.add(name)
        type.__setattr__(cls, "_quant_op_overload", name)


def _members(cls: type) -> list[str]:
    names = list(cls._value_field_names)
    helpers = _READ_ONLY_MEMBERS + tuple(getattr(cls, "traced_members", ()))
    return names + [m for m in dict.fromkeys(helpers) if hasattr(cls, m) and m not in names]


def register_value_opaque_quantizer(cls: type) -> type:
    """Register value quantizer class ``cls`` with torch's opaque-object API; return ``cls``.

    A class that did not opt in yet is first decorated with ``@value_quantizer`` (whose field
    validation errors propagate). A missing or partial torch API only leaves ``cls`` without
    compile specialisation; it never raises.
    """
    if not is_value_quantizer(cls):
        return value_quantizer(cls)  # its hook calls back here
    api = probe()
    fx_repr.attach(cls, eval_repr=api.mode == "repr")
    if is_registered_class(cls) or not api.available:
        return cls
    _attach_op_helpers(cls)
    try:
        api.register(cls, _members(cls))
        if not api.is_registered(cls):
            raise RuntimeError(f"torch did not register {cls.__qualname__}")
        REGISTERED_CLASSES.add(cls)
        for callback in list(_on_registered):
            callback(cls)
    except (RuntimeError, TypeError):
        # e.g. a class local to a function: its type name ("f.<locals>.C") cannot appear in a
        # schema. The class keeps eager value semantics and the ops' flat overloads.
        REGISTERED_CLASSES.discard(cls)
        return cls
    except ValueError as exc:
        # torch refused the class outright (already a pytree node, a builtins module, ...): an
        # import must never die of it (behaviour.md §2.9); say so and go on with the rest
        REGISTERED_CLASSES.discard(cls)
        warnings.warn(
            f"quant_dynamo: torch refused {cls.__qualname__} as an opaque value type ({exc}); "
            "it keeps eager value semantics and compiles through the flat ops",
            RuntimeWarning, stacklevel=2,
        )
        return cls
    REGISTERED_QUALNAMES.add(cls.__qualname__)
    return cls


def on_registered(callback: Callable[[type], None]) -> None:
    """Call ``callback(cls)`` for every class registered so far and from now on. A class the
    callback refuses (``RuntimeError``/``TypeError``: e.g. a class local to a function, whose
    type name cannot appear in an op schema) leaves the registry, as it does when it is
    registered later: importing quant-dynamo after defining such a class must not fail."""
    _on_registered.append(callback)
    for cls in sorted(REGISTERED_CLASSES, key=_class_name):
        try:
            callback(cls)
        except (RuntimeError, TypeError):
            REGISTERED_CLASSES.discard(cls)
            if not any(c.__qualname__ == cls.__qualname__ for c in REGISTERED_CLASSES):
                REGISTERED_QUALNAMES.discard(cls.__qualname__)


def is_value_opaque_quantizer(obj: Any) -> bool:
    """Whether ``type(obj)`` is exactly a registered value quantizer class (by class, never by
    name: an unregistered class that shares a registered qualname is not one).

    Eager calls test the class. While tracing the registered qualname decides (a string test
    Dynamo folds without a graph break; it does not fold a class-identity test on every release):
    a class traced under a registered name but not registered then fails at the op's schema, it
    never runs as another class. Under torch 2.11's Dynamo a registered opaque value is seen
    through a ``FakeScriptObject`` (only registered objects become one), so the qualname is then
    read from the real object (a USE_REAL member).
    """
    cls = type(obj)
    if cls.__qualname__ == "FakeScriptObject":
        return obj._opaque_qualname in REGISTERED_QUALNAMES
    if torch.compiler.is_compiling():
        return cls.__qualname__ in REGISTERED_QUALNAMES
    return is_registered_class(cls)


def _class_of(cls_or_obj: Any) -> type:
    return cls_or_obj if isinstance(cls_or_obj, type) else type(cls_or_obj)


def is_registered_class(cls: type) -> bool:
    """Whether exactly ``cls`` (not a parent, nor a class of the same name) was registered."""
    return cls in REGISTERED_CLASSES


def compile_supported(cls_or_obj: Any = None) -> bool:
    """Whether this torch bakes quantizers (of this class) into graphs as constants."""
    if not probe().available:
        return False
    return cls_or_obj is None or is_registered_class(_class_of(cls_or_obj))


def opaque_schema_type(cls_or_obj: Any) -> str:
    """The schema type string of a quantizer argument of this class on this torch (torch's own
    type-name helper); ``TypeError`` when the class is not registered here."""
    cls = _class_of(cls_or_obj)
    if not is_registered_class(cls):
        raise TypeError(
            f"{cls.__qualname__} is not registered as an opaque value type on torch "
            f"{torch.__version__} (mode {probe().mode!r}); check "
            "quant_dynamo.compile_supported(cls) and use flatten_quantizer() otherwise"
        )
    return probe().type_name(cls)


def identity_quantizer_message(cls: type) -> str:
    """Why a quantizer of ``cls`` (no value semantics) cannot reach a custom op or a graph."""
    if any(is_value_quantizer(base) for base in cls.__mro__[1:]):
        return (
            f"{cls.__qualname__} is not a value quantizer: a subclass inherits no value identity "
            "(its extra state would be ignored). Decorate it with @quant_core.value_quantizer "
            "to pass it to a quant custom op or compile with it."
        )
    return (
        f"{cls.__qualname__} has identity semantics (it holds live state, e.g. delayed scaling's "
        "scale and amax tensors), so it runs in eager mode only and cannot be passed to a quant "
        "custom op or compiled; use a value quantizer (quant_core.value_classes() lists them) or "
        "run this region eagerly."
    )


def check_quantizer_arg(q: Any) -> Any:
    """Return ``q`` if it is an instance of a value quantizer class that opted in itself and
    holds no process group (``TypeError`` otherwise)."""
    if isinstance(q, Quantizer) and is_value_quantizer(q):
        q._check_value_has_no_process_group()
        return q
    cls = type(q)
    if isinstance(q, Quantizer):
        raise TypeError(identity_quantizer_message(cls))
    raise TypeError(f"expected a value quantizer (quant_core.Quantizer), got {cls.__qualname__}")


def status() -> dict[str, Any]:
    """``{"torch": version, "mode": api mode, "registered": sorted class qualnames}``."""
    return {
        "torch": torch.__version__,
        "mode": probe().mode,
        "registered": sorted(REGISTERED_QUALNAMES),
    }


# ---------------------------------------------------------------- scalar fallback (no API)
def _class_name(cls: type) -> str:
    return f"{cls.__module__}:{cls.__qualname__}"


def flatten_quantizer(q: Any) -> tuple[str, str]:
    """``(module:qualname, canonical JSON of the value key items)``; ``TypeError`` as
    :func:`check_quantizer_arg` and for a stored process group."""
    check_quantizer_arg(q)
    items = q.value_key()[1]
    return _class_name(type(q)), json.dumps([list(item) for item in items])


@functools.lru_cache(maxsize=1024)
def unflatten_quantizer(cls_name: str, key: str) -> Quantizer:
    """The quantizer :func:`flatten_quantizer` described (cached: one object per value)."""
    for cls in value_classes():
        if _class_name(cls) == cls_name:
            items = tuple((name, value) for name, value in json.loads(key))
            return fx_repr.rebuild_quantizer(cls, items)
    raise TypeError(
        f"no value quantizer class named {cls_name!r} is defined (a quantizer class must be "
        "decorated with @quant_core.value_quantizer to be passed to a quant custom op)"
    )


add_value_class_hook(register_value_opaque_quantizer)
