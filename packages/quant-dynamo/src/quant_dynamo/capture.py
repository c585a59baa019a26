"""Backend kernels inside the compiled graph: a ``quant`` op lowered to the kernels it launches.

In a compiled graph ``quant::quantize`` is an opaque Python custom op: every call pays the backend
lookup, the checks, the allocations and Triton's Python launcher (hundreds of microseconds per
call on the H200, bench/RESULTS.md). Where the tensor's backend can record its launches
(``capturable = True``: Triton, through ``torch.library.wrap_triton``), functionalization
(AOTAutograd, under Inductor and aot_eager alike) runs the op's Python body instead, inside
:func:`quant_core.kernel_capture.capture`: allocations become graph ops and every kernel launch a
``triton_kernel_wrapper`` node, which Inductor compiles into its generated code and launches
itself (no Python between kernels; memory planning and CUDA-graph trees see the buffers). The
same kernel source runs with the same constants, so the bytes equal the eager op's.

Where lowering does not apply the op stays opaque, as before: a device outside
:data:`KERNEL_DEVICES`, a backend that is not capturable (the reference: Inductor could reorder
its fp32 arithmetic), a body that raises ``NotCapturable``, a torch without
``register_torch_dispatch`` / ``wrap_triton``, or ``QUANT_LOWERING=0`` in the environment
(read when a graph is traced). Eager calls never come here.
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

#: One registration library per op namespace (a library registers rules in its own namespace).
_LIBS: dict[str, torch.library.Library] = {}


def supported() -> bool:
    """Whether this torch can record Triton launches into a functionalized graph."""
    return hasattr(torch.library, "register_torch_dispatch") and hasattr(
        torch.library, "wrap_triton"
    )


def enabled() -> bool:
    """False when ``QUANT_LOWERING=0``: every op stays opaque (a switch for A/B benchmarks and
    for a torch whose Inductor mishandles a recorded kernel)."""
    return os.environ.get("QUANT_LOWERING", "1") != "0"


def capturable(device: torch.device) -> bool:
    """Whether ops on ``device`` are lowered: lowering :func:`enabled`, a kernel device, and a
    backend that records its launches."""
    return enabled() and device.type in KERNEL_DEVICES and bool(
        getattr(backends.get(None, device), "capturable", False)
    )


def _plain(types: Any) -> bool:
    from torch._subclasses import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor

    return all(t in (torch.Tensor, FunctionalTensor) or issubclass(t, FakeTensor) for t in types)


def lower(op: torch._ops.OpOverload, body: Callable[..., Any],
          device_of: Callable[..., torch.device]) -> bool:
    """Lower custom op ``op`` to ``body`` (same arguments, same results) under
    functionalization, for calls whose ``device_of(*args)`` is :func:`capturable`. Returns
    whether the lowering was registered (False on a torch without the API)."""
    if not supported():
        return False
    from torch._subclasses.functional_tensor import FunctionalTensorMode

    def functional(mode, func, types, args, kwargs):
        if not _plain(types):
            return NotImplemented
        if capturable(device_of(*args, **kwargs)):
            try:
                with mode, capture():
                    return body(*args, **kwargs)
            except NotCapturable:
                pass  # nothing was recorded: the check comes before the first launch
        return mode.__torch_dispatch__(func, types, args, kwargs)

    namespace = op.name().split("::")[0]
    lib = _LIBS.setdefault(namespace, torch.library.Library(namespace, "FRAGMENT"))
    torch.library.register_torch_dispatch(op, FunctionalTensorMode, functional, lib=lib)
    return True


__all__ = ["NotCapturable", "KERNEL_DEVICES", "supported", "enabled", "capturable", "lower"]
