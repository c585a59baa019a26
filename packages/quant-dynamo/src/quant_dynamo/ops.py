"""The ``quant`` custom ops: ``quantize(x, q) -> Tensor[]`` and ``qdq(x, q) -> Tensor``.

Overloads:
    ``quant::quantize.<Class>(Tensor x, <opaque type of Class> q) -> Tensor[]`` and
    ``quant::qdq.<Class>(...) -> Tensor``, one per registered class (the type string comes from
    torch's helper, :func:`~quant_dynamo.registration.opaque_schema_type`); torch erases opaque
    types to ``PyObject`` in the dispatcher, so calling the packet ``torch.ops.quant.qdq(x, q)``
    works for any registered quantizer, and the Python entries below pick the class's overload.
    ``quant::quantize.flat(Tensor x, str cls, str key)`` / ``quant::qdq.flat(...)``: the same ops
    with the quantizer flattened into strings (:func:`flatten_quantizer`), for a torch without
    the API or a class whose registration failed.

``quantize`` returns the storage's buffers in its declaration order (:func:`buffer_names`); an
absent buffer (a direction not produced) is an empty uint8 tensor, so positions are stable.
``qdq`` is ``q.quantize(x).dequantize(x.dtype)`` with a straight-through gradient. ``amax`` and
``quantize_with_amax`` split a quantizer whose ``reduces_amax`` is True around its amax, so that
compiled code can reduce it across ranks in between (a functional all-reduce traces). Both run
through quant-core's backend registry; their fake implementations compute exact shapes and dtypes
from :mod:`quant_core.shapes`. In compiled graphs each op is lowered (:mod:`.capture`) in the
forms its quantizer allows: ``quantize`` and ``qdq`` to the backend's kernels or to the
reference's torch ops, ``amax`` and ``quantize_with_amax`` to the torch ops.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from quant_core.storage import absent_buffer

from . import capture, fake
from ._api import probe
from .registration import (
    REGISTERED_QUALNAMES,
    check_quantizer_arg,
    flatten_quantizer,
    is_value_opaque_quantizer,
    on_registered,
    opaque_schema_type,
    unflatten_quantizer,
)

_lib = torch.library.Library("quant", "FRAGMENT")
#: class qualname -> overload name of ``quantize`` and ``qdq`` defined for it.
OVERLOADS: dict[str, str] = {}

def buffer_names(cls_or_obj: Any) -> tuple[str, ...]:
    """The buffer order of ``quantize`` for this quantizer class (``()`` if unknown)."""
    cls = cls_or_obj if isinstance(cls_or_obj, type) else type(cls_or_obj)
    storage_cls = getattr(cls, "_storage_class", None)
    return storage_cls.buffer_names if storage_cls is not None else ()


# ----------------------------------------------------------------------------- kernels
def _with_amax(q: Any) -> Any:
    """``q`` if its class splits quantization around an amax reduction (``reduces_amax``:
    ``local_amax`` and ``quantize_with_amax``); ``TypeError`` otherwise."""
    q = check_quantizer_arg(q)
    if not q.reduces_amax:
        raise TypeError(f"{type(q).__name__} has no amax to reduce (amax_reduction_group is for "
                        "quantizers whose reduces_amax is True)")
    return q


def _quantize_impl(x: torch.Tensor, q: Any, amax: torch.Tensor | None = None
                   ) -> list[torch.Tensor]:
    storage = (check_quantizer_arg(q).quantize(x) if amax is None
               else _with_amax(q).quantize_with_amax(x, amax))
    seen = {x.untyped_storage().data_ptr()} if x.numel() else set()
    out = []
    for name in storage.buffer_names:
        t = getattr(storage, name)
        if t is None:
            t = absent_buffer(x)
        elif not t.numel():  # empty buffers may share a storage; outputs must not alias
            t = torch.empty(t.shape, dtype=t.dtype, device=t.device)
        else:
            ptr = t.untyped_storage().data_ptr()
            if ptr in seen:  # outputs of a custom op may not alias inputs or each other
                t = t.clone()
            seen.add(t.untyped_storage().data_ptr())
        out.append(t)
    return out


def _qdq_impl(x: torch.Tensor, q: Any) -> torch.Tensor:
    out = check_quantizer_arg(q).quantize(x).dequantize(dtype=x.dtype)
    if out.numel() and out.untyped_storage().data_ptr() == x.untyped_storage().data_ptr():
        out = out.clone()  # a custom op's output may not alias its input (IdentityQuantizer)
    return out


def _lowered(q: Any, form: str) -> Any:
    """``q`` if its class allows ``form`` in compiled graphs (:meth:`Quantizer.lowerings`);
    ``NotCapturable`` otherwise (the op then tries the next form, or stays opaque)."""
    q = check_quantizer_arg(q)
    if form not in q.lowerings():
        raise capture.NotCapturable(f"{type(q).__name__} is not lowered to {form}")
    return q


def _usage(q: Any) -> tuple[bool, bool]:
    """``(rowwise, columnwise)``: what quantizing with ``q`` writes."""
    usages = check_quantizer_arg(q).get_usages()
    return usages["rowwise"], usages["columnwise"]


def _quantize_in(form: str):
    """The body of ``quantize`` lowered to ``form``."""
    return lambda x, q: _lowered(q, form).quantize(x).buffer_list(x)


def _qdq_in(form: str):
    """The body of ``qdq`` lowered to ``form``."""
    return lambda x, q: _lowered(q, form).quantize(x).dequantize(dtype=x.dtype)


def _amax_ops(x: torch.Tensor, q: Any) -> torch.Tensor:
    return _with_amax(_lowered(q, "ops")).local_amax(x)


def _quantize_with_amax_in(x: torch.Tensor, amax: torch.Tensor, q: Any, form: str
                           ) -> list[torch.Tensor]:
    return _with_amax(_lowered(q, form)).quantize_with_amax(x, amax).buffer_list(x)


def _quantize_with_amax_ops(x: torch.Tensor, amax: torch.Tensor, q: Any) -> list[torch.Tensor]:
    return _quantize_with_amax_in(x, amax, q, "ops")


def _quantize_fake(x: torch.Tensor, q: Any) -> list[torch.Tensor]:
    return fake.fake_buffers(x, check_quantizer_arg(q))


def _amax_impl(x: torch.Tensor, q: Any) -> torch.Tensor:
    return _with_amax(q).local_amax(x)


def _amax_fake(x: torch.Tensor, q: Any) -> torch.Tensor:
    # math.prod keeps a dynamic row count symbolic (torch.Size.numel() specializes it)
    rows = math.prod(x.shape[:-1])
    return x.new_empty((_with_amax(q).amax_numel(rows),), dtype=torch.float32)


def _qdq_fake(x: torch.Tensor, q: Any) -> torch.Tensor:
    check_quantizer_arg(q)
    return torch.empty_like(x)


def _qdq_backward(ctx: Any, grad: torch.Tensor) -> tuple:
    return (grad,) + (None,) * ctx.n_args


def _quantize_setup(ctx: Any, inputs: tuple, output: Any) -> None:
    outputs = output if isinstance(output, (list, tuple)) else (output,)
    ctx.mark_non_differentiable(*outputs)  # quantization is not differentiable: no grad_fn


def _quantize_backward(ctx: Any, *grads: Any) -> tuple:
    raise RuntimeError("quant::quantize, quant::amax and quant::quantize_with_amax are not "
                       "differentiable (their outputs take no gradient)")


def _qdq_setup(n_args: int):
    def setup_context(ctx: Any, inputs: tuple, output: Any) -> None:
        ctx.n_args = n_args

    return setup_context


def _define(overload: str, q_type: str, unpack) -> None:
    """Define ``quantize``, ``qdq``, ``amax`` and ``quantize_with_amax`` as ``.<overload>``;
    ``unpack(*args) -> q``."""
    n_args = q_type.count(",") + 1

    def q_impl(x, *args):
        return _quantize_impl(x, unpack(*args))

    def q_fake(x, *args):
        return _quantize_fake(x, unpack(*args))

    def d_impl(x, *args):
        return _qdq_impl(x, unpack(*args))

    def d_fake(x, *args):
        return _qdq_fake(x, unpack(*args))

    def a_impl(x, *args):
        return _amax_impl(x, unpack(*args))

    def a_fake(x, *args):
        return _amax_fake(x, unpack(*args))

    def w_impl(x, amax, *args):
        return _quantize_impl(x, unpack(*args), amax)

    def w_fake(x, amax, *args):
        return _quantize_fake(x, unpack(*args))

    for name, params, ret, impl, fake_fn in (
        ("quantize", "Tensor x", "Tensor[]", q_impl, q_fake),
        ("qdq", "Tensor x", "Tensor", d_impl, d_fake),
        ("amax", "Tensor x", "Tensor", a_impl, a_fake),
        ("quantize_with_amax", "Tensor x, Tensor amax", "Tensor[]", w_impl, w_fake),
    ):
        _lib.define(f"{name}.{overload}({params}, {q_type}) -> {ret}")
        _lib.impl(f"{name}.{overload}", impl, "CompositeExplicitAutograd")
        torch.library.register_fake(f"quant::{name}.{overload}", fake_fn, lib=_lib)
    for name, kernels, ops in (
        ("quantize", _quantize_in("kernels"), _quantize_in("ops")),
        ("qdq", _qdq_in("kernels"), _qdq_in("ops")),
        ("amax", None, _amax_ops),
    ):
        capture.lower(getattr(getattr(torch.ops.quant, name), overload),
                      kernels and (lambda x, *args, body=kernels: body(x, unpack(*args))),
                      lambda x, *args: x.device,
                      lambda x, *args, body=ops: body(x, unpack(*args)),
                      (lambda x, *args: _usage(unpack(*args))) if name != "qdq" else None)
    capture.lower(getattr(torch.ops.quant.quantize_with_amax, overload),
                  lambda x, amax, *args: _quantize_with_amax_in(x, amax, unpack(*args), "kernels"),
                  lambda x, *args: x.device,
                  lambda x, amax, *args: _quantize_with_amax_ops(x, amax, unpack(*args)),
                  lambda x, amax, *args: _usage(unpack(*args)))
    torch.library.register_autograd(
        f"quant::qdq.{overload}", _qdq_backward, setup_context=_qdq_setup(n_args), lib=_lib
    )
    for name in ("quantize", "amax", "quantize_with_amax"):
        torch.library.register_autograd(
            f"quant::{name}.{overload}", _quantize_backward, setup_context=_quantize_setup,
            lib=_lib,
        )


def _define_for_class(cls: type) -> None:
    overload = cls._quant_op_overload
    if OVERLOADS.get(cls.__qualname__) == overload:
        return
    _define(overload, f"{opaque_schema_type(cls)} q", lambda q: q)
    OVERLOADS[cls.__qualname__] = overload


_define("flat", "str cls, str key", unflatten_quantizer)
on_registered(_define_for_class)


# ----------------------------------------------------------------------- Python entries
#: Whether Dynamo calls a function marked ``assume_constant_result`` with the registered value
#: quantizer itself at trace time (torch's opaque-value API, 2.11 to 2.13), so that
#: :func:`_traced_overload` runs there instead of being traced.
_FOLDS = probe().mode in ("opaque_value", "opaque_value_base")


def _overload_while_tracing(q: Any) -> str | None:
    """The overload name the entries below pick for ``q`` while Dynamo traces: its class's, when
    :func:`is_value_opaque_quantizer` says so there (the registered qualname), else None (the
    ``flat`` overload). A pure function of the quantizer's class (read through torch 2.11's
    traced wrapper, should one arrive here)."""
    name = type(q).__qualname__
    if name == "FakeScriptObject":
        name = q._opaque_qualname
    return q._quant_op_overload if name in REGISTERED_QUALNAMES else None


#: :func:`_overload_while_tracing`, run at trace time and baked as a constant where
#: :data:`_FOLDS` (a few traced instructions per call instead of the registry test's tens).
_traced_overload = (torch.compiler.assume_constant_result(_overload_while_tracing) if _FOLDS
                    else _overload_while_tracing)


def quantize(x: torch.Tensor, q: Any) -> list[torch.Tensor]:
    """``torch.ops.quant.quantize`` for this torch: the class's overload, else ``flat``."""
    if _FOLDS and torch.compiler.is_compiling():
        name = _traced_overload(q)
        if name is not None:
            return getattr(torch.ops.quant.quantize, name)(x, q)
    elif is_value_opaque_quantizer(q):
        return getattr(torch.ops.quant.quantize, q._quant_op_overload)(x, q)
    return torch.ops.quant.quantize.flat(x, *flatten_quantizer(q))


def amax(x: torch.Tensor, q: Any) -> torch.Tensor:
    """``torch.ops.quant.amax``: ``q.local_amax(x)``, this rank's amaxes (a quantizer whose
    ``reduces_amax`` is True), for a reduction across ranks before :func:`quantize_with_amax`."""
    if _FOLDS and torch.compiler.is_compiling():
        name = _traced_overload(q)
        if name is not None:
            return getattr(torch.ops.quant.amax, name)(x, q)
    elif is_value_opaque_quantizer(q):
        return getattr(torch.ops.quant.amax, q._quant_op_overload)(x, q)
    return torch.ops.quant.amax.flat(x, *flatten_quantizer(q))


def quantize_with_amax(x: torch.Tensor, amax: torch.Tensor, q: Any) -> list[torch.Tensor]:
    """``torch.ops.quant.quantize_with_amax``: the buffers of ``q.quantize_with_amax(x, amax)``
    in :func:`quantize`'s order."""
    if _FOLDS and torch.compiler.is_compiling():
        name = _traced_overload(q)
        if name is not None:
            return getattr(torch.ops.quant.quantize_with_amax, name)(x, amax, q)
    elif is_value_opaque_quantizer(q):
        return getattr(torch.ops.quant.quantize_with_amax, q._quant_op_overload)(x, amax, q)
    return torch.ops.quant.quantize_with_amax.flat(x, amax, *flatten_quantizer(q))


def qdq(x: torch.Tensor, q: Any) -> torch.Tensor:
    """``torch.ops.quant.qdq`` for this torch: the class's overload, else ``flat``."""
    if is_value_opaque_quantizer(q):
        return getattr(torch.ops.quant.qdq, q._quant_op_overload)(x, q)
    return torch.ops.quant.qdq.flat(x, *flatten_quantizer(q))
