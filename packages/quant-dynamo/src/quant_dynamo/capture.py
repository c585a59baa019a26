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

The two forms trade speed for memory where a quantization writes a columnwise (transposed)
copy: the traced ops let the partitioner keep less between forward and backward, but Inductor
fuses a recomputed cast, with its transposed stores, into the norm's backward reduction, where
those stores are uncoalesced; the recorded kernels write them in tiles. A rowwise-only cast has
no such store, and as ops its amax and cast fuse into the kernel that makes the tensor. Nor has
a pointwise product of GEMM outputs (a SwiGLU's): recomputed in backward it is made in a
pointwise kernel, whose tiled accesses take the transposed store, instead of writing an exact
bf16 copy for a recorded kernel to read (:func:`pointwise_of_products`). So by default each
quantization takes the form that suits what it writes and where (``mixed``; the Llama
measurements that chose it are in bench/RESULTS.md, section "One default, fast and lean").

``QUANT_LOWERING`` (read when a graph is traced, so one process can compare the forms) picks:
unset or ``mixed`` by what the quantization writes: rowwise bytes only, or backward's
columnwise copy of a pointwise product, the ops where they apply, else the kernels; any other
columnwise copy, the kernels, else the op stays opaque. ``1`` the
kernels where they apply, else the ops; ``ops`` the ops where they apply, else the kernels;
``kernels`` the kernels only; ``0`` opaque ops. Where no form applies the op stays opaque: a
device outside the form's devices, a backend that is not capturable (for kernels), a body
that raises ``NotCapturable``, or a torch without ``register_torch_dispatch`` /
``wrap_triton``. Eager calls never come here.

A quantization that writes the columnwise copy alone is one backward makes (a layer that keeps
no quantized copy: ``save_input_copy=False``, ``save_weight_copy=False``). In every form it is
marked to be recomputed in backward, and a recorded kernel or an opaque op reads a fusible copy
of its input: so the partitioner keeps neither its bytes nor its bf16 input from forward when
the input's producer can be recomputed (:func:`recomputed_in_backward`).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
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


#: ``QUANT_LOWERING`` values -> the forms each allows, preferred first; ``mixed`` (the default)
#: is the ops first for a rowwise-only quantization and the kernels alone for one that writes a
#: columnwise copy (:data:`_COLUMNWISE_FORMS`).
_FORMS = {"mixed": ("ops", "kernels"), "1": ("kernels", "ops"), "kernels": ("kernels",),
          "ops": ("ops", "kernels"), "0": ()}
#: The forms of a quantization that writes a columnwise copy, where they differ from _FORMS.
_COLUMNWISE_FORMS = {"mixed": ("kernels",)}


def forms(columnwise: bool = False) -> tuple[str, ...]:
    """The lowered forms ``QUANT_LOWERING`` allows, preferred first, for a quantization that
    writes a columnwise copy (``columnwise``) or not (``ValueError`` for an unknown value)."""
    value = os.environ.get("QUANT_LOWERING", "mixed")
    if value not in _FORMS:
        raise ValueError(f"QUANT_LOWERING={value!r}; allowed: {', '.join(_FORMS)} (unset: mixed)")
    return _COLUMNWISE_FORMS.get(value, _FORMS[value]) if columnwise else _FORMS[value]


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


@contextlib.contextmanager
def recomputed_in_backward(enabled: bool = True) -> Iterator[None]:
    """Mark the graph nodes traced inside as ones the partitioner recomputes in backward
    (``recompute=MUST_RECOMPUTE``, the tag selective activation checkpointing sets) where
    the tracer preserves node metadata (AOTAutograd's joint graph). A node that no
    tangent reads is otherwise computed in forward, and a recorded kernel or an opaque op,
    which the partitioner never recomputes, has its outputs saved from forward to backward."""
    from torch.fx import traceback as fx_traceback

    if not enabled or not fx_traceback.has_preserved_node_meta():
        yield
        return
    from torch.utils.checkpoint import CheckpointPolicy

    meta = fx_traceback.get_current_meta()
    had, before = "recompute" in meta, meta.get("recompute")
    meta["recompute"] = CheckpointPolicy.MUST_RECOMPUTE
    try:
        yield
    finally:
        if had:
            meta["recompute"] = before
        else:
            meta.pop("recompute", None)


def _recomputable_input(args: tuple) -> tuple:
    """``args`` with the input tensor (the first) copied where it is computed in the graph,
    for a call that :func:`recomputed_in_backward` marks. A recorded kernel or an opaque op
    that reads a tensor forces the partitioner to keep that tensor for backward (it must be
    materialized there, so recomputing its producer is banned); a copy, which is fusible and
    marked like the call, lets it recompute the producer in backward (a norm, a SwiGLU product)
    and write the tensor there instead. A graph input (a weight) is available in backward
    anyway: it is not copied."""
    x = args[0]
    if _graph_input(x) or x.element_size() not in _SAME_SIZE_INTS:
        return args
    # an exact copy that Inductor's graph passes keep (they drop a clone, "* 1" and "+ 0"
    # before partitioning): the bits xor 0
    bits = x.view(_SAME_SIZE_INTS[x.element_size()])
    return (torch.bitwise_xor(bits, 0).view(x.dtype), *args[1:])


_SAME_SIZE_INTS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _traced_node(t: torch.Tensor) -> torch.fx.Node | None:
    """The graph node that makes ``t``, being traced under functionalization (None where that
    cannot be read)."""
    from torch._subclasses.functional_tensor import FunctionalTensor
    from torch.fx.experimental import proxy_tensor

    mode = proxy_tensor.get_innermost_proxy_mode()
    if mode is None or not isinstance(t, FunctionalTensor):
        return None
    slot = proxy_tensor.get_proxy_slot(torch._from_functional_tensor(t.elem), mode.tracer, None)
    return getattr(getattr(slot, "proxy", None), "node", None)


def _graph_input(t: torch.Tensor) -> bool:
    """Whether ``t``, being traced, is a graph input or a view of one (False where that cannot
    be read: it is then copied, which only costs a copy)."""
    node = _traced_node(t)
    while (node is not None and node.op == "call_function"
           and getattr(node.target, "is_view", False)):  # an OpOverload's own view flag
        node = node.args[0] if node.args and isinstance(node.args[0], torch.fx.Node) else None
    return node is not None and node.op == "placeholder"


def _products() -> set:
    """The ops whose outputs a pointwise chain may start from and still fuse into one pointwise
    kernel: the GEMMs (Inductor launches them as extern kernels, outside any fusion)."""
    aten = torch.ops.aten
    return {getattr(aten, name).default for name in
            ("mm", "addmm", "bmm", "baddbmm", "_scaled_mm", "_grouped_mm", "_scaled_grouped_mm")
            if hasattr(aten, name)}


def pointwise_of_products(t: torch.Tensor) -> bool:
    """Whether ``t``, being traced, is made by pointwise ops (at least one) from GEMM outputs and
    graph inputs alone, through views and dtype copies: a SwiGLU product, never a norm's output
    (a reduction) nor a GEMM's output as it is. Inductor computes such a tensor in a pointwise
    kernel, into which a cast with its transposed store fuses with tiled (coalesced) accesses,
    as it does where the tensor is recomputed in backward (the SwiGLU's backward kernel)."""
    node = _traced_node(t)
    if node is None:
        return False
    products, pointwise, stack, seen = _products(), torch.Tag.pointwise, [node], set()
    computed = False  # a pointwise op among the producers
    while stack:
        node = stack.pop()
        if node in seen or node.op == "placeholder":
            continue
        seen.add(node)
        if node.op != "call_function":
            return False
        if node.target in products:
            continue
        if pointwise in getattr(node.target, "tags", ()):
            computed = True
        elif not (getattr(node.target, "is_view", False)
                  or node.target is torch.ops.aten._to_copy.default):
            return False
        stack.extend(node.all_input_nodes)
    return computed


def _plain(types: Any) -> bool:
    from torch._subclasses import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor

    return all(t in (torch.Tensor, FunctionalTensor) or issubclass(t, FakeTensor) for t in types)


def lower(op: torch._ops.OpOverload, body: Callable[..., Any] | None,
          device_of: Callable[..., torch.device],
          ops_body: Callable[..., Any] | None = None,
          usage_of: Callable[..., tuple[bool, bool]] | None = None) -> bool:
    """Lower custom op ``op`` under functionalization to ``body`` (recorded kernel launches)
    for calls whose ``device_of(*args)`` is :func:`capturable`, or to ``ops_body`` (traced
    torch ops) where it is :func:`traceable`, trying the forms in :func:`forms`' order; either
    body has the op's arguments and results and raises ``NotCapturable`` before its first op or
    launch where it does not apply (the next form is then tried, else the op stays opaque).

    ``usage_of(*args)`` is ``(rowwise, columnwise)``: what a quantizing call writes (none: the
    rowwise form alone). A call that writes a columnwise copy takes :func:`forms`' columnwise
    order; one that writes the columnwise copy alone is what backward's GEMMs read, and nothing
    else: its nodes are marked to be recomputed in backward (:func:`recomputed_in_backward`),
    so that the partitioner never saves its bytes from forward.
    Returns whether the lowering was registered (False on a torch without the API)."""
    if not supported():
        return False
    from torch._subclasses.functional_tensor import FunctionalTensorMode

    def functional(mode, func, types, args, kwargs):
        if not _plain(types):
            return NotImplemented
        device = device_of(*args, **kwargs)
        rowwise, columnwise = (True, False) if usage_of is None else usage_of(*args, **kwargs)
        backward_only = columnwise and not rowwise
        # the columnwise order, but for backward's copy of a pointwise product: as ops its
        # cast fuses into the kernel that recomputes the product in backward
        columnwise_order = columnwise and body is not None and not (
            backward_only and ops_body is not None and pointwise_of_products(args[0]))

        def unfusible_args():
            """What a recorded kernel or the opaque op reads (traced ops read ``args``)."""
            if not backward_only:
                return args
            with mode:
                return _recomputable_input(args)

        with recomputed_in_backward(backward_only):
            for form in forms(columnwise_order):
                try:
                    if form == "ops" and ops_body is not None and traceable(device):
                        with mode, backends.using("reference"):
                            return ops_body(*args, **kwargs)
                    if form == "kernels" and body is not None and capturable(device):
                        read = unfusible_args()
                        with mode, capture():
                            return body(*read, **kwargs)
                except NotCapturable:
                    pass  # refused before its first op or launch: nothing was traced
            return mode.__torch_dispatch__(func, types, unfusible_args(), kwargs)

    namespace = op.name().split("::")[0]
    lib = _LIBS.setdefault(namespace, torch.library.Library(namespace, "FRAGMENT"))
    torch.library.register_torch_dispatch(op, FunctionalTensorMode, functional, lib=lib)
    return True
