"""Direct launches of already compiled kernels: the eager host path.

``kernel[grid](*args)`` spends host time in Triton's Python on every call (its binder, a cache
key built with ``str(options)``, ``driver.active`` lookups, the used-globals check, launch
metadata). After the first launch of a kernel for an *argument key*, :func:`launch` calls that
compiled kernel's launcher itself, as ``JITFunction.run`` ends, and skips the rest: the same
launch, with less host time per call (bench/RESULTS.md, section "The eager launch path and the
GPT demo").

The argument key is at least as fine as Triton's specialisation, so one key never meets two
compiled kernels:

- a tensor by ``(dtype, data_ptr % 16 == 0)`` (pointers are specialised on 16-byte alignment);
- an ``int`` by its value (Triton specialises on ``== 1``, ``% 16 == 0`` and the i32/i64 range);
- a ``bool`` or ``float`` by type and value (``True == 1 == 1.0`` in Python, three types to
  Triton; the value also covers a constexpr passed by position);
- a host tensor descriptor (``triton.tools.tensor_descriptor.TensorDescriptor``) by its base's
  dtype, block shape and padding (Triton specialises on the dtype and block shape; the shape,
  strides and base go to the launcher, which encodes the descriptor on every launch);
- anything else (``None``, constexpr values) by value;
- keyword arguments (constexprs, launch options such as ``num_warps``) by name and value;
- the current CUDA device (a compiled function handle belongs to one device).

Unhashable arguments and launch hooks that would run (``triton.knobs.runtime.launch_enter_hook``,
added by profilers such as proton) take Triton's own path every time. The direct path skips
Triton's check that the globals a kernel read have not changed since it was compiled: this
package's kernels read module constants only.
"""

from __future__ import annotations

import inspect
import operator

import torch
from triton.tools.tensor_descriptor import TensorDescriptor

#: The most argument keys kept per kernel; past it the kernel's table starts again (dynamic shapes
#: make one key per distinct M).
MAX_KEYS_PER_KERNEL = 1024

_tables: dict[object, dict] = {}
_NO_TABLE: dict = {}
_signatures: dict[object, tuple[tuple[str, object], ...]] = {}
_runtime_knobs = None


def _arg_key(a):
    if isinstance(a, torch.Tensor):
        ptr = a.data_ptr()
        if not ptr and a.numel():
            raise ValueError(
                f"a {type(a).__name__} of shape {tuple(a.shape)} has no storage (data_ptr 0) and "
                "cannot be passed to a Triton kernel; a wrapper subclass must be unwrapped first "
                "(an AsyncCollectiveTensor by .wait())"
            )
        return a.dtype, not ptr & 15
    t = type(a)
    if t is float or t is bool:  # 0.0 == 0 == False and hash alike; Triton types them apart
        return t, a
    if t is TensorDescriptor:  # a dataclass compared by value: unhashable
        return t, a.base.dtype, tuple(a.block_shape), a.padding
    return a


def _hooks_set() -> bool:
    global _runtime_knobs
    if _runtime_knobs is None:
        import triton

        _runtime_knobs = triton.knobs.runtime
    return _active(_runtime_knobs.launch_enter_hook) or _active(_runtime_knobs.launch_exit_hook)


def _active(hook) -> bool:
    """A hook that would run: Triton 3.6+ keeps a ``HookChain`` (a list of ``calls``, often
    empty) where earlier releases keep ``None`` or one callable."""
    return hook is not None and getattr(hook, "calls", True) != []


def _current_device() -> int:
    return torch._C._cuda_getDevice()  # what torch.cuda.current_device() returns, once CUDA is up


def _current_stream(device: int) -> int:
    return torch._C._cuda_getCurrentRawStream(device)


def _signature(kernel) -> tuple[tuple[str, object], ...]:
    """``((name, default), ...)`` of ``kernel``'s parameters (``inspect.Parameter.empty`` where
    there is no default)."""
    sig = _signatures.get(kernel)
    if sig is None:
        params = inspect.signature(kernel.fn).parameters.values()
        sig = _signatures[kernel] = tuple((p.name, p.default) for p in params)
    return sig


def _entry(kernel, compiled, args: tuple, kwargs: dict):
    """``(launcher, function, packed metadata, arrange)``, where ``arrange(args + kwarg values)``
    gives every parameter of ``kernel`` in signature order, defaults filled, as the launcher takes
    them; ``None`` when ``compiled`` lacks what a direct launch needs."""
    run = getattr(compiled, "run", None)
    function = getattr(compiled, "function", None)
    packed = getattr(compiled, "packed_metadata", None)
    if run is None or function is None or packed is None:
        return None
    sig = _signature(kernel)
    positions = {name: i for i, (name, _) in enumerate(sig[: len(args)])}
    positions.update({name: len(args) + i for i, name in enumerate(kwargs)})
    order, defaults = [], []
    for name, default in sig:
        if name in positions:
            order.append(positions[name])
        elif default is not inspect.Parameter.empty:
            order.append(len(args) + len(kwargs) + len(defaults))
            defaults.append(default)
        else:
            return None
    pick, tail = operator.itemgetter(*order), tuple(defaults)
    if len(order) == 1:
        return run, function, packed, lambda values: (pick(values + tail),)
    return run, function, packed, lambda values: pick(values + tail)


def launch(kernel, grid, args: tuple, kwargs: dict) -> None:
    """Launch ``kernel[grid](*args, **kwargs)`` on the current CUDA device and stream, directly
    through its compiled launcher when this argument key was launched before."""
    key = (_current_device(), tuple(map(_arg_key, args)), tuple(kwargs.items()))
    table = _tables.get(kernel, _NO_TABLE)
    try:
        entry = table.get(key)
    except TypeError:  # an unhashable argument: Triton's path, every time
        kernel[grid](*args, **kwargs)
        return
    if entry is None or _hooks_set():
        compiled = kernel[grid](*args, **kwargs)
        if table is _NO_TABLE or len(table) >= MAX_KEYS_PER_KERNEL:
            table = _tables[kernel] = {}
        table[key] = _entry(kernel, compiled, args, kwargs) or False
        return
    if entry is False:
        kernel[grid](*args, **kwargs)
        return
    run, function, packed, arrange = entry
    n = len(grid)
    run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, _current_stream(key[0]),
        function, packed, None, None, None, *arrange(args + tuple(kwargs.values())))


def clear() -> None:
    """Forget every compiled-kernel entry (the next launch of each key goes through Triton)."""
    _tables.clear()
