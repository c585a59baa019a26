"""What an Inductor-compiled function keeps from forward for backward: the inputs of its
backward graph that are not gradients, as its partitioner (which merges equal expressions
first) chose them."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch


@contextlib.contextmanager
def compiled_recording_saved(fn: Callable) -> Iterator[tuple[Callable, list]]:
    """``(compiled, saved)``: ``fn`` compiled with Inductor (``fullgraph``), and the list that
    each backward graph compiled inside the context extends with ``(name, shape, dtype)`` of
    its saved inputs. The AOTAutograd and FX graph caches are off inside, so every compile
    partitions afresh."""
    import torch._inductor.compile_fx as compile_fx

    saved: list[tuple[str, torch.Size, torch.dtype]] = []

    def recording(gm, example_inputs, **kwargs):
        if kwargs.get("is_backward"):
            for node in gm.graph.find_nodes(op="placeholder"):
                val = node.meta.get("val")
                if isinstance(val, torch.Tensor) and not node.name.startswith("tangents"):
                    saved.append((node.name, val.shape, val.dtype))
        return compile_fx.compile_fx_inner(gm, example_inputs, **kwargs)

    torch._dynamo.reset()
    with torch._functorch.config.patch(enable_autograd_cache=False), \
            torch._inductor.config.patch(fx_graph_cache=False):
        yield torch.compile(fn, fullgraph=True, backend=lambda gm, ex: compile_fx.compile_fx(
            gm, ex, inner_compile=recording)), saved
