"""Quantization inside the compiled graph: a ``quant`` op lowered to torch ops or to kernels.

In a compiled graph ``quant::quantize`` is an opaque Python custom op: every call pays the backend
lookup, the checks, the allocations and Triton's Python launcher, host time that small layers
cannot hide (bench/RESULTS.md, section "Host overhead, CUDA graphs and the exact RHT", run H2).
Where the tensor's backend can record its launches
(``capturable = True``: Triton, through ``torch.library.wrap_triton``), functionalization
(AOTAutograd, under Inductor and aot_eager alike) runs the op's Python body instead, inside
:func:`quant_core.kernel_capture.capture`: allocations become graph ops and every kernel launch a
``triton_kernel_wrapper`` node, which Inductor compiles into its generated code and launches
itself (no Python between kernels; memory planning and CUDA-graph trees see the buffers). The
same kernel source runs with the same constants, so the bytes equal the eager op's.

A quantizer whose lowerings (:meth:`quant_core.Quantizer.lowerings`) include ``"ops"`` can
instead be lowered to its pure-torch reference, traced as torch ops (``ops_body``, run under
``quant_core.backends.using("reference")``). Inductor then schedules the quantization like its own
ops: it fuses the amax into the kernel that produces the tensor and the cast into the kernel
that reads it, merges equal quantizations of one tensor (the graph's common-subexpression
elimination: equal quantizer values trace equal ops), and its partitioner chooses what backward
keeps, recomputing a quantization there when that saves memory. The reference's rules are
written to compile to its bytes (``reference/_rounding.py``), on the devices of
:data:`OPS_DEVICES`.

The two forms trade speed for memory: the traced ops let the partitioner keep less between
forward and backward, and the recorded kernels train faster, since Inductor fuses the
recomputed casts, with their transposed (columnwise) stores, into the norms' backward
reductions, where those stores are uncoalesced. So the kernels come first by default; the
Llama measurement that chose this order is bench/RESULTS.md, section "Quantization the compiler
can see: a Llama trained end to end" (figures in docs/performance.md).

``QUANT_LOWERING`` (read when a graph is traced, so one process can compare the forms) picks:
unset or ``1`` the kernels where they apply, else the ops; ``ops`` the ops where they apply,
else the kernels; ``kernels`` the kernels only; ``0`` opaque ops. Where no form applies the op
stays opaque: a device outside the form's devices, a backend that is not capturable (for
kernels), a body that raises ``NotCapturable``, or a torch without ``register_torch_dispatch``
/ ``wrap_triton``. Eager calls never come here.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any

import torch
from quant_core import backends
from quant_core.kernel_capture import NotCapturable, capture

#: Device types whose quant ops are lowered to kernels in compiled graphs. CUDA only: Inductor
#: cannot launch Triton kernels on CPU tensors. Tests add "cpu" to check lowering under
#: aot_eager with the Triton interpreter.
KERNEL_DEVICES: set[str] = {"cuda"}

#: Device types whose quantizers may be lowered to reference ops: CUDA, where Inductor's Triton
#: code was checked byte for byte against the reference (tests/gpu/test_compiled_ops.py). Inductor's
#: C++ code for the CPU is built with fast-math flags that differ between torch releases (on
#: 2.13: ``-fno-signed-zeros``, ``-fexcess-precision=fast``), so the CPU keeps the opaque op,
#: which runs the reference itself. Tests add "cpu" to check the traced ops.
OPS_DEVICES: set[str] = {"cuda"}

#: One registration library per op namespace (a library registers rules in its own namespace).
_LIBS: dict[str, torch.library.Library] = {}


def supported() -> bool:
    """Whether this torch can record Triton launches into a functionalized graph."""
    return hasattr(torch.library, "register_torch_dispatch") and hasattr(
        torch.library, "wrap_triton"
    )


#: ``QUANT_LOWERING`` values -> the forms each allows, preferred first. The kernels lead by
#: default: they trained a Llama faster than the traced ops, which use less memory
#: (bench/RESULTS.md, section "Quantization the compiler can see: a Llama trained end to end").
_FORMS = {"1": ("kernels", "ops"), "kernels": ("kernels",), "ops": ("ops", "kernels"), "0": ()}


def forms() -> tuple[str, ...]:
    """The lowered forms ``QUANT_LOWERING`` allows, preferred first (``ValueError`` for an
    unknown value)."""
    value = os.environ.get("QUANT_LOWERING", "1")
    if value not in _FORMS:
        raise ValueError(f"QUANT_LOWERING={value!r}; allowed: {', '.join(_FORMS)} (unset: 1)")
    return _FORMS[value]


def enabled() -> bool:
    """False when ``QUANT_LOWERING=0``: every op stays opaque (a switch for A/B benchmarks and
    for a torch whose Inductor mishandles a lowered op)."""
    return bool(forms())


def capturable(device: torch.device) -> bool:
    """Whether ops on ``device`` may be lowered to kernels: the form allowed, a kernel device,
    and a backend that records its launches."""
    return "kernels" in forms() and device.type in KERNEL_DEVICES and bool(
        getattr(backends.get(None, device), "capturable", False)
    )


def traceable(device: torch.device) -> bool:
    """Whether ops on ``device`` may be lowered to reference ops: the form allowed and a device
    of :data:`OPS_DEVICES`."""
    return "ops" in forms() and device.type in OPS_DEVICES


def _plain(types: Any) -> bool:
    from torch._subclasses import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor

    return all(t in (torch.Tensor, FunctionalTensor) or issubclass(t, FakeTensor) for t in types)


def lower(op: torch._ops.OpOverload, body: Callable[..., Any] | None,
          device_of: Callable[..., torch.device],
          ops_body: Callable[..., Any] | None = None) -> bool:
    """Lower custom op ``op`` under functionalization to ``body`` (recorded kernel launches)
    for calls whose ``device_of(*args)`` is :func:`capturable`, or to ``ops_body`` (traced
    torch ops) where it is :func:`traceable`, trying the forms in :func:`forms`' order; either
    body has the op's arguments and results and raises ``NotCapturable`` before its first op or
    launch where it does not apply (the next form is then tried, else the op stays opaque).
    Returns whether the lowering was registered (False on a torch without the API)."""
    if not supported():
        return False
    from torch._subclasses.functional_tensor import FunctionalTensorMode

    def functional(mode, func, types, args, kwargs):
        if not _plain(types):
            return NotImplemented
        device = device_of(*args, **kwargs)
        for form in forms():
            try:
                if form == "ops" and ops_body is not None and traceable(device):
                    with mode, backends.using("reference"):
                        return ops_body(*args, **kwargs)
                if form == "kernels" and body is not None and capturable(device):
                    with mode, capture():
                        return body(*args, **kwargs)
            except NotCapturable:
                pass  # refused before its first op or launch: nothing was traced
        return mode.__torch_dispatch__(func, types, args, kwargs)

    namespace = op.name().split("::")[0]
    lib = _LIBS.setdefault(namespace, torch.library.Library(namespace, "FRAGMENT"))
    torch.library.register_torch_dispatch(op, FunctionalTensorMode, functional, lib=lib)
    return True
