"""Tensor and sequence parallelism for quant's ``Linear`` on torch's DTensor
(``torch.distributed.tensor.parallel.parallelize_module``).

:class:`QuantColwiseParallel` and :class:`QuantRowwiseParallel` shard a layer as torch's
``ColwiseParallel`` and ``RowwiseParallel`` do and run its quantized GEMMs on the local shards
(:mod:`.styles`, :mod:`.forward`); :class:`PrepareQuantModuleInput` quantizes a
sequence-sharded input before its all-gather (:mod:`.sequence`). Tensor-wide amaxes are
all-reduced over the tensor-parallel group exactly for the operands a rank holds a piece of, so
every rank quantizes with the scales of the unsharded run (``docs/behaviour.md``, "Tensor
parallelism").
"""

from .sequence import (
    PrepareQuantModuleInput,
    reset_tensor_parallel_gather_bytes,
    tensor_parallel_gather_bytes,
)
from .styles import QuantColwiseParallel, QuantRowwiseParallel, TensorParallelLinear

__all__ = [
    "QuantColwiseParallel", "QuantRowwiseParallel", "PrepareQuantModuleInput",
    "TensorParallelLinear", "tensor_parallel_gather_bytes", "reset_tensor_parallel_gather_bytes",
]
