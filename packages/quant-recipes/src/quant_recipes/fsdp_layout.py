"""How a weight's quantized buffers travel through FSDP2's dim-0 all-gather.

FSDP2 shards a weight ``[M, K]`` into row chunks and all-gathers what each rank's
``fsdp_pre_all_gather`` returns, concatenated along dim 0. Each format's storage says whether and
how its buffers do (``QuantizedStorage.shard_plan``: which buffers are gathered, which travel as
metadata, whether the amax is all-reduced first) and how its columnwise copy is rebuilt from the
rowwise one (``columnwise_from_rowwise``); ``docs/behaviour.md`` tabulates the formats.

:func:`plan` says which buffers a rank sends, or why the weight does not shard quantized (the
caller then all-gathers the high-precision weight). :func:`columnwise_buffer_list` adds the
columnwise copy to the buffers of a storage that holds only the rowwise one, exactly as the
quantizer would have produced it.
"""

from __future__ import annotations

import torch
from quant_core import Quantizer
from quant_core.distributed import reduce_amax
from quant_core.sharding import ShardPlan
from quant_core.storage import QuantizedStorage, absent_buffer, storage_class


def base(q: Quantizer) -> Quantizer:
    """``q`` with both usages, no amax reduction flag and ``internal=True``: what two weight
    quantizers must agree on for one's bytes to serve the other (usages, the reduction and what
    ``quantize`` returns are per call)."""
    fields = {"rowwise_usage": True, "columnwise_usage": True, "internal": True}
    if hasattr(q, "with_amax_reduction"):
        fields["with_amax_reduction"] = False
    return q.replace(**fields)


def plan(q: Quantizer, shape, world: int, *, columnwise: bool = True) -> ShardPlan | str:
    """The :class:`~quant_core.sharding.ShardPlan` for weight ``shape`` split over ``world``
    ranks, or the reason (a sentence) the quantized all-gather does not apply. ``columnwise``:
    dgrad will need the columnwise copy (the weight requires a gradient)."""
    fmt = getattr(q, "storage_format", None)
    if fmt is None or fmt == "high_precision" or q.value_fields() is None:
        return (f"{type(q).__name__} is not a value quantizer of a quantized format "
                "(delayed scaling keeps live scale state, which the shards cannot share)")
    return storage_class(fmt).shard_plan(q, shape, world, columnwise)


def quantize_shard(p: ShardPlan, shard: torch.Tensor, group) -> QuantizedStorage:
    """The rank's shard quantized as the full weight would be: with the amax all-reduced (MAX)
    over ``group`` first where the format has a tensor-wide amax."""
    q = p.quantizer
    if not p.reduce_amax:
        return q.quantize(shard)
    if shard.numel():
        amax = q.local_amax(shard)
    else:  # an empty shard (FSDP2's uneven split) contributes 0
        amax = torch.zeros(1, dtype=torch.float32, device=shard.device)
    amax = reduce_amax(amax, group)
    return q.quantize_with_amax(shard, amax)


def assemble(p: ShardPlan, gathered: dict[str, torch.Tensor], shared: dict[str, torch.Tensor],
             shape, dtype: torch.dtype) -> QuantizedStorage:
    """The full weight's storage from the all-gathered buffers (rows past ``shape[0]``, FSDP2's
    padding of an uneven split, dropped) and the shared ones."""
    m = shape[0]
    bufs = {n: (t[:m] if n in p.trimmed else t) for n, t in gathered.items()}
    return p.quantizer._make_storage(shape, dtype, {**bufs, **shared})


# ---------------------------------------------------------------------- columnwise from rowwise
def columnwise_buffer_list(s: QuantizedStorage, like: torch.Tensor, q: Quantizer | None = None
                           ) -> list[torch.Tensor]:
    """The buffers of ``s`` with its columnwise copy (:func:`columnwise_buffers`) as a storage's
    ``buffer_list`` (absent ones empty on ``like``'s device), without building a storage object
    (which compiled code cannot). Raises ``ValueError`` for a format whose columnwise bytes
    differ from the rowwise ones."""
    q = s.quantizer if q is None else q
    names = storage_class(q.storage_format).buffer_names
    bufs = columnwise_buffers(s, q)
    if bufs is None:
        bufs = {n: getattr(s, n) for n in names}
    return [absent_buffer(like) if bufs.get(n) is None else bufs[n] for n in names]


def columnwise_buffers(s: QuantizedStorage, q: Quantizer | None = None
                       ) -> dict[str, torch.Tensor] | None:
    """The present buffers of ``s`` plus its columnwise copy, built from the rowwise buffers
    where that is exact (the format's ``columnwise_from_rowwise``); ``None`` when ``s`` already
    holds a columnwise copy. ``q``: a quantizer equal to ``s.quantizer`` up to usages (default:
    that one); compiled code passes its baked constant (torch 2.10 cannot read a traced tensor's
    quantizer attribute). The format is read from ``q``, and ``s`` by attribute reads only:
    Dynamo takes a traced quantized tensor's method calls for tensor methods."""
    q = s.quantizer if q is None else q
    cls = storage_class(q.storage_format)
    if getattr(s, cls.columnwise_data_name) is not None:
        return None
    return cls.columnwise_from_rowwise(s, q)
