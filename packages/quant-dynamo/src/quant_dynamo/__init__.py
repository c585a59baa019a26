"""quant-dynamo: quantizers as compile-time constants under ``torch.compile``.

``import quant_dynamo`` registers every value quantizer class of quant-core (the four tensorless
ones and every class decorated with ``@value_quantizer`` later) with the opaque-object API of the
running torch (`docs/torch-versions.md`), and defines the custom ops ``torch.ops.quant.quantize``
and ``torch.ops.quant.qdq``. The import never fails; on a torch without the API (2.9) value
semantics still hold in eager mode and the ops take the quantizer flattened into strings.

Public API
----------
``status() -> dict``
    ``{"torch": <version>, "mode": <api mode>, "registered": [<class qualnames>]}``; the mode is
    ``"custom_class"`` (2.14+), ``"opaque_value"`` (2.12, 2.13), ``"opaque_value_base"`` (2.11),
    ``"repr"`` (2.10) or ``"none"`` (2.9 and older).
``compile_supported(cls_or_obj=None) -> bool``
    Whether quantizers (or this quantizer / class) can be custom-op arguments baked into a graph,
    i.e. ``torch.compile(fullgraph=True)`` is promised. False on a torch without the API.
``register_value_opaque_quantizer(cls) -> cls``
    Register a value quantizer class with torch (done automatically for ``@value_quantizer``
    classes); returns ``cls``. Never raises for a missing or partial torch API.
``is_value_opaque_quantizer(obj) -> bool``
    ``type(obj).__qualname__`` is registered; a string-set test, traceable without a graph break.
``opaque_schema_type(cls_or_obj) -> str``
    The type string to write in a ``torch.library`` schema for a quantizer argument of this class
    on this torch, from torch's own helper (never hand-written). Raises ``TypeError`` when the
    class is not registered (check :func:`compile_supported` first; fall back to
    :func:`flatten_quantizer` then).
``check_quantizer_arg(q) -> q``
    ``TypeError`` unless ``q`` is an instance of a class that opted in itself (a subclass of a
    value quantizer must be decorated with ``@value_quantizer``). Call it in custom-op wrappers.
``flatten_quantizer(q) -> (str, str)`` / ``unflatten_quantizer(cls_name, key) -> Quantizer``
    The scalar fallback for torches without the API: the class's ``module:qualname`` and a
    canonical string of its value key, and back (an equal, distinct object).
``quantize(x, q) -> list[Tensor]``, ``qdq(x, q) -> Tensor``
    Call the right ``quant`` custom op for this torch. ``quantize`` returns the storage's buffers
    in the storage's declaration order (:func:`buffer_names`), an absent buffer as an empty
    (``numel() == 0``) uint8 tensor; ``qdq`` returns ``q.quantize(x).dequantize(x.dtype)`` with a
    straight-through gradient.
``amax(x, q) -> Tensor``, ``quantize_with_amax(x, amax, q) -> list[Tensor]``
    A quantizer whose ``reduces_amax`` is True splits around its amax (``q.local_amax`` and
    ``q.quantize_with_amax``), so compiled code can all-reduce the amax in between.
``buffer_names(cls_or_obj) -> tuple[str, ...]``
    The buffer order of ``quantize`` for this quantizer class.
``lower_to_kernels(op, body, device_of, ops_body=None, usage_of=None) -> bool``
    Under functionalization (AOTAutograd: Inductor, aot_eager), run custom op ``op`` as
    ``body`` with the backend's kernel launches recorded into the graph, for calls on a device
    whose backend can record them (CUDA with Triton), or as ``ops_body`` traced into torch ops
    (``QUANT_LOWERING`` and what the call writes, ``usage_of``, pick;
    :mod:`quant_dynamo.capture`). The ``quant`` ops are lowered so, in
    the forms each quantizer allows (``Quantizer.lowerings()``); quant-recipes lowers its GEMM
    op.
``DERIVES_IN_GRAPH: bool``
    Whether compiled code may derive a new quantizer from one it holds (``q.replace``,
    ``q.with_usage``): those methods then run on the real object at trace time and the result is
    baked. False on 2.10 (no ``members`` in the API) and without the API.
"""

from __future__ import annotations

from quant_core import backends as _backends

from ._api import probe as _probe
from ._specialize import install as _install_specialisation
from ._write_analysis import install as _install_kept_write_analyses
from .capture import lower as lower_to_kernels
from .fx_repr import rebuild_quantizer
from .ops import amax, buffer_names, qdq, quantize, quantize_with_amax
from .registration import (
    check_quantizer_arg,
    compile_supported,
    flatten_quantizer,
    is_value_opaque_quantizer,
    opaque_schema_type,
    register_value_opaque_quantizer,
    status,
    unflatten_quantizer,
)
from .registration import (
    is_registered_class as _is_registered_class,
)

__version__ = "0.1.0"

DERIVES_IN_GRAPH: bool = _probe().mode not in ("repr", "none")

# Symbolic (dynamic=True) scalars passed to a registered class become guarded constants.
_install_specialisation(_is_registered_class)

# Per-layer compiles record the same kernel launches in every layer: analyse each signature once.
_install_kept_write_analyses()

# A traced quantize looks its backend up; loading the registry and choosing do not trace.
_backends.preload()

__all__ = [
    "status", "compile_supported", "register_value_opaque_quantizer", "is_value_opaque_quantizer",
    "opaque_schema_type", "check_quantizer_arg", "flatten_quantizer", "unflatten_quantizer",
    "quantize", "qdq", "amax", "quantize_with_amax", "buffer_names", "rebuild_quantizer",
    "DERIVES_IN_GRAPH", "lower_to_kernels",
]
