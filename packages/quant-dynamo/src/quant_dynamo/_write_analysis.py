"""One write analysis per signature of quant's kernels, not one per recorded launch.

A Triton launch recorded into a traced graph (the kernels lowering, :mod:`.capture`) is analysed
by torch for the tensors it writes: torch generates the kernel's TTIR and walks it, at
functionalization and again where Inductor lowers the launch, for every launch of every trace.
Compiling per decoder layer (``layer.compile()``) traces the same launches in every layer, so
the same analysis runs layers x launches times (about 0.1 s each). Its result depends only on
the kernel, the dtypes of its tensor arguments and the values of its other arguments
(constexprs included), so for quant's own kernels (modules of ``quant_kernels``) :func:`install`
keeps it per such signature for the life of the process. A tensor argument counts by its dtype
alone, whether a tensor, a fake tensor or Inductor's ``TensorBox`` (torch generates the TTIR
from an empty tensor of that dtype for each), and a symbolic value counts as one class (torch
generates it with the value 2 for every one); so the functionalized launch and Inductor's
lowering of it share one analysis, and a whole-model graph analyses each signature once. Other
kernels, and launches with an argument of any other kind, are analysed as torch does.

The analysis is ``identify_accessed_tensors`` on torch 2.13+ and ``identify_mutated_tensors``
before (``torch._higher_order_ops.triton_kernel_wrap``); where neither exists nothing is
installed and :func:`install` returns False.
"""

from __future__ import annotations

import copy
import functools
import sys
from collections.abc import Callable
from typing import Any

import torch

_ANALYSES = ("identify_accessed_tensors", "identify_mutated_tensors")
_SCALARS = (bool, int, float, str, type(None), torch.dtype)
#: The module prefix of the kernels whose analyses are kept.
KERNEL_MODULES = "quant_kernels"


def signature(kernel: Any, kwargs: dict[str, Any], tma_metadata: Any) -> tuple | None:
    """What the write analysis of a launch of ``kernel`` with ``kwargs`` depends on: the kernel,
    the launch configs it is wrapped in, each tensor argument's dtype and every other argument's
    value; None for a kernel outside :data:`KERNEL_MODULES` or an argument of another kind.

    torch wraps a launch given ``num_warps`` or ``num_stages`` in a new one-config ``Autotuner``
    per launch, so the key is the wrapped JIT function and the configs' values, not the
    wrapper."""
    kernel, configs = _unwrapped(kernel)
    fn = getattr(kernel, "fn", None)
    if configs is None or not getattr(fn, "__module__", "").startswith(KERNEL_MODULES):
        return None
    args = _values(kwargs)
    if args is None:
        return None
    return kernel, configs, args, repr(tma_metadata)


def _values(mapping: dict[str, Any]) -> tuple | None:
    """``mapping`` as a sorted tuple, tensors (and Inductor's tensor boxes) as their dtype,
    symbolic values as one class (as ``generate_ttir`` replaces each); None if a value is of
    another kind."""
    parts = []
    for name, value in sorted(mapping.items()):
        if isinstance(value, torch.Tensor) or _is_tensor_box(value):
            parts.append((name, "tensor", value.dtype))
        elif _is_symbolic(value):
            parts.append((name, "symbolic"))
        elif isinstance(value, _SCALARS):
            parts.append((name, type(value).__name__, value))
        else:
            return None
    return tuple(parts)


def _is_tensor_box(value: Any) -> bool:
    """Whether ``value`` is Inductor's ``TensorBox`` (what its lowering of a launch passes)."""
    ir = sys.modules.get("torch._inductor.ir")
    return ir is not None and isinstance(value, ir.TensorBox)


def _is_symbolic(value: Any) -> bool:
    """Whether ``value`` is a symbolic value ``generate_ttir`` replaces (a ``Sym*`` or a sympy
    expression)."""
    if isinstance(value, (torch.SymInt, torch.SymFloat, torch.SymBool)):
        return True
    sympy = sys.modules.get("sympy")
    return sympy is not None and isinstance(value, sympy.Expr)


def _unwrapped(kernel: Any) -> tuple[Any, tuple | None]:
    """``(the JIT function inside kernel's autotuners, their configs' values)``; the configs
    are None where a wrapper or config is of a kind the key cannot hold (heuristics, hooks)."""
    from triton.runtime.autotuner import Autotuner

    configs = []
    while isinstance(kernel, Autotuner):
        for config in kernel.configs:
            fields = {k: v for k, v in vars(config).items() if k != "kwargs"}
            values, options = _values(config.kwargs), _values(fields)
            if values is None or options is None:
                return kernel, None
            configs.append((values, options))
        kernel = kernel.fn
    return kernel, tuple(configs)


def _kept(analysis: Callable) -> Callable:
    results: dict[tuple, Any] = {}

    @functools.wraps(analysis)
    def kept(kernel, kwargs, tma_descriptor_metadata, *args, **kw):
        key = signature(kernel, kwargs, tma_descriptor_metadata)
        if key is None or args or kw:
            return analysis(kernel, kwargs, tma_descriptor_metadata, *args, **kw)
        if key not in results:
            results[key] = analysis(kernel, kwargs, tma_descriptor_metadata)
        return copy.deepcopy(results[key])  # callers own what they are given

    kept.quant_kept_analyses = results
    return kept


def install() -> bool:
    """Keep the write analyses of quant's kernels per signature (see the module docstring);
    False where this torch has no such analysis. Installing twice changes nothing."""
    try:
        from torch._higher_order_ops import triton_kernel_wrap as wrap
    except ImportError:
        return False
    for name in _ANALYSES:
        analysis = getattr(wrap, name, None)
        if callable(analysis):
            if not hasattr(analysis, "quant_kept_analyses"):
                setattr(wrap, name, _kept(analysis))
            return True
    return False
