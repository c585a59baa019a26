"""``QuantColwiseParallel`` and ``QuantRowwiseParallel``: torch's ``ColwiseParallel`` and
``RowwiseParallel`` for quant's ``Linear``, with the GEMMs quantized on the local shards.

The parameters are sharded as torch's styles shard them (column-wise: weight and bias
``Shard(0)``; row-wise: weight ``Shard(1)``, bias replicated), so ``state_dict`` keys, DTensor
checkpoints and the optimizer see what they see with torch's styles. The layer's class becomes
:class:`TensorParallelLinear` (a subclass: still a ``Linear`` and an ``nn.Linear``), whose
forward runs on local tensors (:func:`.forward.forward`): the input hook hands it the local input
(redistributed to the layout the layer needs), the output hook wraps its local output back into
the requested layout. A row-parallel output is a partial sum: the output hook reduces it
(all-reduce for a replicated output, reduce-scatter for a sharded one, as torch's
``RowwiseParallel``) and adds the bias after the reduction.
"""

from __future__ import annotations

from functools import partial

import torch
from quant_core.storage import QuantizedStorage
from quant_core.tensor import QuantizedTensor
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from ..autocast import Frame
from ..compiling import compiling
from ..fsdp import QuantizedAllGatherWeight
from ..linear import Linear
from . import forward as tp_forward
from .forward import COLWISE, ROWWISE, AddBias, check_alignment, check_stateless, layer_name
from .sequence import count_gather


class TensorParallelLinear(Linear):
    """A quant ``Linear`` parallelized by :class:`QuantColwiseParallel` or
    :class:`QuantRowwiseParallel`: its parameters are DTensors, its forward runs the quantized
    GEMMs on their local shards."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return tp_forward.forward(self, x)


_CLASSES: dict[type, type] = {Linear: TensorParallelLinear}


def _tp_class(cls: type) -> type:
    sub = _CLASSES.get(cls)
    if sub is None:
        sub = _CLASSES[cls] = type(f"TensorParallel{cls.__name__}", (TensorParallelLinear, cls),
                                   {"__module__": cls.__module__})
    return sub


def _prepare(style: str, module, mesh, kind: str, recipe) -> None:
    """Refuse what the styles cannot shard, check ``recipe``'s quantizers (stateless, block
    alignment) when one is given, and make ``module`` a :class:`TensorParallelLinear`."""
    if not isinstance(module, Linear):
        raise TypeError(f"{style} parallelizes quant_recipes.Linear layers, got "
                        f"{type(module).__name__}; use torch's ColwiseParallel/RowwiseParallel "
                        "for other modules, or convert the model first (quant_recipes.convert)")
    if mesh.ndim != 1:
        raise ValueError(f"{style}: give parallelize_module the 1-D tensor-parallel mesh "
                         f"(mesh['tp']), got a {mesh.ndim}-D mesh")
    w = module.weight
    if isinstance(w, QuantizedAllGatherWeight) or isinstance(
            getattr(w, "_local_tensor", None), QuantizedAllGatherWeight):
        raise ValueError(
            f"{style}: layer {layer_name(module)} is set up for the FSDP2 quantized all-gather "
            "(enable_fsdp_quantized_all_gather), which does not compose with tensor "
            "parallelism: its amax would be reduced over the FSDP group only, not over the "
            "tensor-parallel shards. Parallelize without it (plain fully_shard composes)")
    if isinstance(w, (DTensor, QuantizedStorage)) or isinstance(module, TensorParallelLinear):
        raise ValueError(f"{style}: layer {layer_name(module)} has a "
                         f"{type(w).__name__} weight; parallelize a layer with plain "
                         "high-precision parameters, once")
    world = mesh.size()
    module._quant_tp = (kind, mesh.get_group(), world)
    if recipe is not None:
        qset = module.quantizers(Frame(True, recipe, False, None), device=w.device)
        check_stateless(module, qset, recipe)
        check_alignment(module, kind, world, (qset.fwd[0], qset.fwd[1], qset.bwd[0]))
    module.__class__ = _tp_class(type(module))


def _local_input(x, mesh, input_layouts, desired, grad_placements):
    if not isinstance(x, DTensor):
        x = DTensor.from_local(x, mesh, input_layouts, run_check=False)
    if input_layouts != desired:
        if not compiling():
            count_gather(x, desired)
        x = x.redistribute(placements=desired)
    return x.to_local(grad_placements=grad_placements)


def _colwise_input(input_layouts, mod, inputs, mesh):
    x = inputs[0]
    if isinstance(x, QuantizedTensor):  # gathered quantized by PrepareQuantModuleInput
        return inputs
    # the gradient of a replicated input is this rank's partial sum over its output features
    return (_local_input(x, mesh, input_layouts, (Replicate(),), (Partial(),)), *inputs[1:])


def _contiguous_stride(shape) -> tuple[int, ...]:
    """The strides of a contiguous tensor of ``shape``."""
    stride, step = [], 1
    for size in reversed(shape):
        stride.append(step)
        step *= max(size, 1)
    return tuple(reversed(stride))


def _colwise_output(output_layouts, use_local_output, mod, y, mesh):
    # the global shape given: a shard of out_features may be uneven (DTensor's 50/49 of 99)
    shape = (*y.shape[:-1], mod.out_features)
    y = DTensor.from_local(y, mesh, (Shard(-1),), run_check=False, shape=shape,
                           stride=_contiguous_stride(shape))
    if output_layouts != (Shard(-1),):
        y = y.redistribute(placements=output_layouts)
    return y.to_local() if use_local_output else y


def _rowwise_input(input_layouts, mod, inputs, mesh):
    return (_local_input(inputs[0], mesh, input_layouts, (Shard(-1),), None), *inputs[1:])


def _rowwise_output(output_layouts, use_local_output, mod, y, mesh):
    y = DTensor.from_local(y, mesh, (Partial(),), run_check=False)
    y = y.redistribute(placements=output_layouts)
    if mod.bias is None:
        return y.to_local() if use_local_output else y
    sharded = not all(p.is_replicate() for p in output_layouts)
    local = AddBias.apply(y.to_local(), mod.bias.to_local(),
                          mod._quant_tp[1] if sharded else None)
    if use_local_output:
        return local
    return DTensor.from_local(local, mesh, output_layouts, run_check=False)


class _QuantStyle:
    """What the two styles share: torch's constructor plus ``recipe``, and ``_apply`` with the
    class's hooks around torch's own parameter partitioning."""

    _kind: str
    _hooks: tuple

    def __init__(self, *, input_layouts=None, output_layouts=None, use_local_output=True,
                 recipe=None) -> None:
        super().__init__(input_layouts=input_layouts, output_layouts=output_layouts,
                         use_local_output=use_local_output)
        self.recipe = recipe

    def _apply(self, module, device_mesh):
        _prepare(type(self).__name__, module, device_mesh, self._kind, self.recipe)
        input_fn, output_fn = self._hooks
        return distribute_module(
            module, device_mesh, self._partition_linear_fn, partial(input_fn, self.input_layouts),
            partial(output_fn, self.output_layouts, self.use_local_output))


def parallel_style(module: torch.nn.Module) -> str | None:
    """The name of the style that parallelized ``module`` (``"QuantColwiseParallel"`` or
    ``"QuantRowwiseParallel"``), or None for a module that is not a
    :class:`TensorParallelLinear`."""
    if not isinstance(module, TensorParallelLinear):
        return None
    return {COLWISE: "QuantColwiseParallel", ROWWISE: "QuantRowwiseParallel"}[module._quant_tp[0]]


class QuantColwiseParallel(_QuantStyle, ColwiseParallel):
    """torch's ``ColwiseParallel`` for a quant ``Linear`` (same arguments): weight and bias
    ``Shard(0)``, the input replicated (gathered from ``input_layouts`` when it is sharded), the
    output ``Shard(-1)`` unless ``output_layouts`` says otherwise. The forward and backward GEMMs
    are quant's quantized GEMMs on the local weight shard. ``recipe``: check at
    ``parallelize_module`` time that each shard holds whole blocks of the recipe's format
    (otherwise the first forward under a recipe checks)."""

    _kind = COLWISE
    _hooks = (_colwise_input, _colwise_output)


class QuantRowwiseParallel(_QuantStyle, RowwiseParallel):
    """torch's ``RowwiseParallel`` for a quant ``Linear`` (same arguments): weight ``Shard(1)``,
    bias replicated, the input ``Shard(-1)``; the partial output is all-reduced (replicated
    output, the default) or reduce-scattered (``output_layouts=Shard(1)``, sequence
    parallelism), then the bias is added. ``recipe`` as for :class:`QuantColwiseParallel`."""

    _kind = ROWWISE
    _hooks = (_rowwise_input, _rowwise_output)
