"""Sequence parallelism: ``PrepareQuantModuleInput`` quantizes a sequence-sharded input before
its all-gather.

Under sequence parallelism a block's input arrives sharded along the sequence (``Shard(1)``) and
its column-parallel layers need it whole. torch's ``PrepareModuleInput`` gathers the
high-precision tensor; :class:`PrepareQuantModuleInput` (torchao's ``PrepareFloat8ModuleInput``
for every quant format) quantizes each rank's shard with the consuming layers' input quantizer
(the tensor amax all-reduced over the tensor-parallel group first, so the scale is the
unsharded tensor's), all-gathers the quantized buffers and hands the block the gathered input as
a ``QuantizedTensor``, which the :class:`~quant_recipes.QuantColwiseParallel` layers consume
without quantizing again (q, k and v share the one gather). Its gradient, the sum of those
layers' input gradients, is reduce-scattered back to the shards.

Which buffers travel is the format's dim-0 shard plan (``fsdp_layout.plan``, the one the FSDP2
quantized all-gather uses), over the rows of the input flattened to ``[tokens, K]``: per-tensor
FP8 sends the data (the scale is equal on every rank; the transpose is rebuilt from the data),
MXFP8 its rowwise and columnwise data and scales (each rank holding a multiple of 128 tokens).
The rows of every rank follow each other in the gathered tensor only when the dimensions before
the sequence dimension are 1; per-tensor FP8, whose rows carry no block structure, reorders the
gathered rows for any batch. Where no plan applies (FP8 1x128 and NVFP4 1x16 inputs, whose
columnwise copies are stored transposed; a batch over 1 for block formats; outside autocast) the
high-precision input is gathered, with a one-time warning that says why when a recipe was active.
:func:`tensor_parallel_gather_bytes` counts what the gathers moved.
"""

from __future__ import annotations

import collections
import warnings

import torch
from quant_core.storage import storage_class
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel.style import ParallelStyle

from .. import fsdp_layout
from ..compiling import compiling
from ..gemm import is_high_precision
from ..module import module_frame

_BYTES: collections.Counter = collections.Counter()
_WARNED: set = set()


def tensor_parallel_gather_bytes() -> dict[str, int]:
    """Bytes this process's sequence-parallel input all-gathers received since the last
    :func:`reset_tensor_parallel_gather_bytes` (every rank's part: the gathered size), split into
    ``"quantized"`` (:class:`PrepareQuantModuleInput`) and ``"high_precision"`` (its fallback,
    and a :class:`~quant_recipes.QuantColwiseParallel` layer given a sharded input). Eager
    calls are counted; a compiled graph's are not."""
    return dict(_BYTES)


def reset_tensor_parallel_gather_bytes() -> None:
    _BYTES.clear()


def count_gather(x: DTensor, desired) -> None:
    """Count a high-precision redistribution of ``x`` to ``desired`` that all-gathers."""
    if any(p.is_shard() for p in x.placements) and all(p.is_replicate() for p in desired):
        _BYTES["high_precision"] += x.numel() * x.element_size()


def _gather(t: torch.Tensor, group, world: int, lead: int) -> torch.Tensor:
    """The dim-0 all-gather of ``t`` (``lead`` blocks of rows per rank, rank-major after the
    collective) with the rows put back in the unsharded order: block-major, then rank."""
    from torch.distributed import _functional_collectives as funcol

    out = funcol.all_gather_tensor(t.contiguous(), 0, group)
    wait = getattr(out, "wait", None)
    out = wait() if wait is not None and not compiling() else out
    if lead > 1:
        out = out.reshape(world, lead, t.shape[0] // lead, *t.shape[1:]).transpose(0, 1)
        out = out.reshape(world * t.shape[0], *t.shape[1:])
    return out


class QuantizedGather(torch.autograd.Function):
    """The quantized all-gather of a sequence shard along ``dim``; backward reduce-scatters the
    gradient along ``dim``."""

    @staticmethod
    def forward(ctx, x, plan, amax_groups, group, world, dim):
        from .forward import quantize_over

        k = x.shape[-1]
        lead = x.shape[:dim].numel()
        rows = quantize_over(x.reshape(-1, k), plan.quantizer,
                             amax_groups if plan.reduce_amax else ())
        bufs = dict(zip(storage_class(plan.quantizer.storage_format).buffer_names, rows,
                        strict=True))
        gathered = {n: _gather(bufs[n], group, world, lead) for n in plan.gathered}
        if not compiling():
            _BYTES["quantized"] += world * sum(bufs[n].numel() * bufs[n].element_size()
                                               for n in plan.gathered)
        shape = list(x.shape)
        shape[dim] *= world
        ctx.group, ctx.dim = group, dim
        # internal=False: the quantizer builds its format's QuantizedTensor (which traces)
        return plan.quantizer.replace(internal=False)._make_storage(
            torch.Size(shape), x.dtype, {**gathered, **{n: bufs[n] for n in plan.shared}})

    @staticmethod
    def backward(ctx, g):
        from torch.distributed import _functional_collectives as funcol

        out = funcol.reduce_scatter_tensor(g.contiguous(), "sum", ctx.dim, ctx.group)
        wait = getattr(out, "wait", None)
        return (wait() if wait is not None and not compiling() else out), *(None,) * 5


def _warn(reason: str) -> None:
    if reason not in _WARNED:
        _WARNED.add(reason)
        warnings.warn(f"PrepareQuantModuleInput: the input is all-gathered in high precision "
                      f"and quantized after the gather: {reason}", stacklevel=4)


def _tuple(layouts):
    return layouts if isinstance(layouts, tuple) else (layouts,)


class PrepareQuantModuleInput(ParallelStyle):
    """A module's positional inputs from ``input_layouts`` to ``desired_input_layouts`` (one
    placement per input, ``None`` for an input to leave alone), as torch's
    ``PrepareModuleInput`` (defaults: one input, ``Shard(1)`` to ``Replicate()``), but an input
    gathered from a sequence shard (``Shard(d)`` to
    ``Replicate()``) under a quantizing autocast travels quantized with the input quantizer of
    the submodule ``fwd_config_submodule_fqn`` (default: the first quant ``Linear`` in the
    module) and reaches the module as a local ``QuantizedTensor``. Other inputs become local
    tensors with ``use_local_output`` (default), else DTensors."""

    def __init__(self, *, input_layouts=None, desired_input_layouts=None,
                 use_local_output: bool = True, fwd_config_submodule_fqn: str | None = None
                 ) -> None:
        super().__init__()
        self.input_layouts = _tuple(Shard(1) if input_layouts is None else input_layouts)
        self.desired_input_layouts = _tuple(
            Replicate() if desired_input_layouts is None else desired_input_layouts)
        if len(self.input_layouts) != len(self.desired_input_layouts):
            raise ValueError("PrepareQuantModuleInput: input_layouts and desired_input_layouts "
                             "must have one entry per input")
        self.use_local_output = use_local_output
        self.fwd_config_submodule_fqn = fwd_config_submodule_fqn

    def _apply(self, module, device_mesh):
        from ..linear import Linear

        if self.fwd_config_submodule_fqn is not None:
            layer = module.get_submodule(self.fwd_config_submodule_fqn)
        else:
            layer = next((m for m in module.modules() if isinstance(m, Linear)), None)
        if not isinstance(layer, Linear):
            raise ValueError("PrepareQuantModuleInput: the module holds no quant_recipes.Linear "
                             "whose input quantizer the gather could use; name one with "
                             "fwd_config_submodule_fqn")
        group, world = device_mesh.get_group(), device_mesh.size()
        module.register_forward_pre_hook(
            lambda _, inputs: self._prepare(inputs, layer, device_mesh, group, world))
        return module

    def _prepare(self, inputs, layer, mesh, group, world):
        out = list(inputs)
        for i, (src, dst) in enumerate(zip(self.input_layouts, self.desired_input_layouts,
                                           strict=False)):
            x = inputs[i] if i < len(inputs) else None
            if src is None or not isinstance(x, torch.Tensor):
                continue
            local = x.to_local() if isinstance(x, DTensor) else x
            plan = self._plan(local, src, dst, layer, world)
            if plan is not None:
                frame = module_frame(layer)
                out[i] = QuantizedGather.apply(local, plan, (group, frame.amax_reduction_group),
                                               group, world, src.dim % local.dim())
                continue
            if not isinstance(x, DTensor):
                x = DTensor.from_local(x, mesh, (src,), run_check=False)
            if (src,) != (dst,):
                if not compiling():
                    count_gather(x, (dst,))
                x = x.redistribute(placements=(dst,))
            out[i] = x.to_local() if self.use_local_output else x
        return tuple(out)

    def _plan(self, x, src, dst, layer, world):
        """The shard plan of a quantized gather of ``x``, or None (with a warning saying why
        where a recipe quantizes)."""
        if not (src.is_shard() and dst.is_replicate()):
            return None
        frame = module_frame(layer)
        if frame is None or not frame.enabled or frame.recipe.delayed():
            return None
        if frame.recipe.backward_override == "high_precision":
            return None  # its backward reads the high-precision input
        if compiling():
            # a graph's autograd takes the output's gradient for a quantized tensor like the
            # output itself: compiled code gathers the high-precision input
            return None
        q = layer.quantizers(frame, device=x.device).fwd[0]
        if is_high_precision(q):
            return None
        dim = src.dim % x.dim()
        tokens = x.shape[:-1].numel()
        p = fsdp_layout.plan(q, (tokens * world, x.shape[-1]), world,
                             columnwise=torch.is_grad_enabled())
        if isinstance(p, str):
            reason = p
        elif x.shape[:dim].numel() > 1 and not p.rows_independent:
            reason = (f"the {q.storage_format} blocks of the gathered rows need the dimensions "
                      f"before the sequence dimension to be 1, got input shape "
                      f"{tuple(x.shape)}")
        else:
            return p
        if not compiling():
            _warn(reason)
        return None
