"""How a weight's quantized buffers travel through FSDP2's dim-0 all-gather.

FSDP2 shards a weight ``[M, K]`` into row chunks and all-gathers what each rank's
``fsdp_pre_all_gather`` returns, concatenated along dim 0. A format qualifies when the
concatenation of every rank's buffers *is* the buffer of the full weight quantized on one device:

* FP8 per-tensor current scaling: the data bytes (1 byte an element), any row split; the one
  ``scale_inv`` comes from the amax all-reduced (MAX) over the group, equal on every rank, so it
  travels as metadata. The transpose for dgrad is built from the data (exact: one scale).
* FP8 blocks with 2D 128x128 weight blocks, when every rank holds a multiple of 128 rows: data
  and the block scale rows. The columnwise copy is the byte transpose with the transposed scales.
* MXFP8, when every rank holds a multiple of 128 rows (the rowwise scales pad rows to 128, the
  columnwise ones pad 32-row blocks to 4): the rowwise data and scales; with 2D 32x32 blocks the
  columnwise copy is rebuilt from them, with 1x32 blocks it is gathered too (it is needed for
  dgrad and differs from the rowwise bytes).
* NVFP4 with 2D 16x16 weight blocks (the recipe's default), without stochastic rounding, when every
  rank holds a multiple of 128 rows: packed data and scale rows; the tensor amax is all-reduced
  and travels as metadata. The columnwise copy is the transposed codes with the transposed scales.

:func:`plan` says which buffers a rank sends, or why the format does not shard (the caller then
all-gathers the high-precision weight). :func:`columnwise_buffer_list` adds the columnwise
copy to the buffers of a storage that holds only the rowwise one, exactly as the quantizer would
have produced it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from quant_core import Quantizer
from quant_core.distributed import reduce_amax
from quant_core.reference._pad import zero_pad
from quant_core.reference.nvfp4 import pack_e2m1, unpack_e2m1
from quant_core.shapes import (
    FP8_BLOCK,
    MXFP8_BLOCK,
    NVFP4_BLOCK,
    ceil_div,
    fp8_block_columnwise_scale_shape,
    m_k,
    mxfp8_columnwise_scale_shape,
    nvfp4_columnwise_scale_shape,
)
from quant_core.storage import (
    Float8BlockwiseQTensorStorage,
    Float8TensorStorage,
    MXFP8TensorStorage,
    NVFP4TensorStorage,
    QuantizedStorage,
    absent_buffer,
)

#: Rows a rank must hold a multiple of, per block format (scale rows are padded to 128).
_ROWS = 128


@dataclass(frozen=True)
class Plan:
    """What one rank sends for a weight: ``gathered`` buffers (row blocks, concatenated along
    dim 0 by the all-gather) and ``shared`` ones (equal on every rank: sent as metadata),
    quantized by ``quantizer`` (the weight quantizer with the usages gathered)."""

    quantizer: Quantizer
    gathered: tuple[str, ...]
    shared: tuple[str, ...]
    reduce_amax: bool


def base(q: Quantizer) -> Quantizer:
    """``q`` with both usages, no amax reduction flag and ``internal=True``: what two weight
    quantizers must agree on for one's bytes to serve the other (usages, the reduction and what
    ``quantize`` returns are per call)."""
    fields = {"rowwise_usage": True, "columnwise_usage": True, "internal": True}
    if hasattr(q, "with_amax_reduction"):
        fields["with_amax_reduction"] = False
    return q.replace(**fields)


def plan(q: Quantizer, shape, world: int, *, columnwise: bool = True) -> Plan | str:
    """The :class:`Plan` for weight ``shape`` split over ``world`` ranks, or the reason (a
    sentence) the quantized all-gather does not apply. ``columnwise``: dgrad will need the
    columnwise copy (the weight requires a gradient)."""
    fmt = getattr(q, "storage_format", None)
    if fmt is None or fmt == "high_precision" or q._value_fields() is None:
        return (f"{type(q).__name__} is not a value quantizer of a quantized format "
                "(delayed scaling keeps live scale state, which the shards cannot share)")
    m, k = m_k(shape)
    even = m % world == 0 and (m // world) % _ROWS == 0
    rows = (f"every rank must hold a multiple of {_ROWS} rows (dim 0 = {m} over {world} ranks "
            f"gives {ceil_div(m, world)})")
    if getattr(q, "optimize_for_gemm", False) and fmt in ("mxfp8", "nvfp4"):
        return "GEMM-swizzled scales do not concatenate along dim 0"
    row = q.replace(rowwise_usage=True, columnwise_usage=False)
    if fmt == "fp8":
        return Plan(row.replace(with_amax_reduction=False), ("_data",), ("_scale_inv",), True)
    if fmt == "fp8_block":
        if q.block_scaling_dim != 2:
            return ("FP8 1x128 weight blocks: the columnwise copy (128x1 blocks along dim 0) is "
                    "stored transposed and does not gather along dim 0; use 2D weight blocks "
                    "(Float8BlockScaling(w_block_scaling_dim=2), the default)")
        if not even:
            return f"FP8 128x128 blocks: {rows}"
        return Plan(row, ("_rowwise_data", "_rowwise_scale_inv"), (), False)
    if fmt == "mxfp8":
        if not even:
            return f"MXFP8: {rows}"
        names = ("_rowwise_data", "_rowwise_scale_inv")
        if columnwise and not q.with_2d_quantization:
            return Plan(q.with_usage(True, True), names + (
                "_columnwise_data", "_columnwise_scale_inv"), (), False)
        return Plan(row, names, (), False)
    if fmt == "nvfp4":
        if not q.with_2d_quantization or q.with_rht:
            return ("NVFP4 1x16 weight blocks: the columnwise copy is stored transposed and does "
                    "not gather along dim 0; use 2D 16x16 weight blocks (the recipe's default)")
        if q.stochastic_rounding:
            return "NVFP4 stochastic rounding: each rank's bytes depend on its random stream"
        if not even:
            return f"NVFP4: {rows}"
        return Plan(row.replace(with_amax_reduction=False),
                    ("_rowwise_data", "_rowwise_scale_inv"), ("_amax_rowwise",), True)
    return f"format {fmt!r} has no quantized all-gather"


def quantize_shard(p: Plan, shard: torch.Tensor, group) -> QuantizedStorage:
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


def assemble(p: Plan, gathered: dict[str, torch.Tensor], shared: dict[str, torch.Tensor],
             shape, dtype: torch.dtype) -> QuantizedStorage:
    """The full weight's storage from the all-gathered buffers (rows past ``shape[0]``, FSDP2's
    padding of an uneven split, dropped) and the shared ones."""
    m = shape[0]
    bufs = {n: (t[:m] if n in ("_data",) else t) for n, t in gathered.items()}
    return p.quantizer._make_storage(shape, dtype, {**bufs, **shared})


# ---------------------------------------------------------------------- columnwise from rowwise
def columnwise_buffer_list(s: QuantizedStorage, like: torch.Tensor, q: Quantizer | None = None
                           ) -> list[torch.Tensor]:
    """The buffers of ``s`` with its columnwise copy (:func:`columnwise_buffers`) as a storage's
    ``buffer_list`` (absent ones empty on ``like``'s device), without building a storage object
    (which compiled code cannot). Raises ``ValueError`` for a format whose columnwise bytes
    differ from the rowwise ones."""
    bufs = columnwise_buffers(s, q)
    if bufs is None:
        bufs = {n: getattr(s, n) for n in s._buffer_names}
    return [absent_buffer(like) if bufs.get(n) is None else bufs[n] for n in s._buffer_names]


def columnwise_buffers(s: QuantizedStorage, q: Quantizer | None = None
                       ) -> dict[str, torch.Tensor] | None:
    """The present buffers of ``s`` plus its columnwise copy, built from the rowwise buffers
    where that is exact (one scale per tensor, or 2D blocks whose scale serves rows and columns
    alike), exactly as the quantizer would have produced it; ``None`` when ``s`` already holds a
    columnwise copy. ``q``: a
    quantizer equal to ``s.quantizer`` up to usages (default: that one); compiled code passes
    its baked constant (torch 2.10 cannot read a traced tensor's quantizer attribute)."""
    q = s.quantizer if q is None else q
    # isinstance and attribute reads only, no ``s.buffers()``: Dynamo traces a quantized
    # tensor's method calls as tensor methods
    fp8 = isinstance(s, Float8TensorStorage)
    if getattr(s, "_transpose" if fp8 else "_columnwise_data") is not None:
        return None
    m, k = m_k(s.shape)
    bufs = {n: getattr(s, n) for n in s._buffer_names if getattr(s, n) is not None}
    if fp8:
        bufs["_transpose"] = s._data.reshape(m, k).t().contiguous()
    elif isinstance(s, Float8BlockwiseQTensorStorage) and s._is_2D_scaled:
        bufs["_columnwise_data"] = s._rowwise_data.reshape(m, k).t().contiguous()
        rs = s._rowwise_scale_inv[:, :ceil_div(k, FP8_BLOCK)]
        bufs["_columnwise_scale_inv"] = zero_pad(rs.t(), *fp8_block_columnwise_scale_shape(m, k, 2))
    elif isinstance(s, MXFP8TensorStorage) and q.with_2d_quantization and (
            not s._with_gemm_swizzled_scales):
        bufs["_columnwise_data"] = s._rowwise_data
        per_block = s._rowwise_scale_inv[:m:MXFP8_BLOCK, :k // MXFP8_BLOCK]
        cs = per_block.repeat_interleave(MXFP8_BLOCK, dim=1)
        bufs["_columnwise_scale_inv"] = zero_pad(cs, *mxfp8_columnwise_scale_shape(m, k))
    elif isinstance(s, NVFP4TensorStorage) and q.with_2d_quantization and not q.with_rht and (
            not s._with_gemm_swizzled_scales):
        codes = unpack_e2m1(s._rowwise_data.reshape(m, k // 2))  # [m, k]
        codes = zero_pad(codes, m + m % 2, k).t()  # [k, m even], the last nibble 0
        bufs["_columnwise_data"] = pack_e2m1(codes.contiguous())
        per_block = s._rowwise_scale_inv[:m:NVFP4_BLOCK, :k // NVFP4_BLOCK]  # [ceil(m/16), k/16]
        cs = per_block.t().repeat_interleave(NVFP4_BLOCK, dim=0)  # [k, ceil(m/16)]
        bufs["_columnwise_scale_inv"] = zero_pad(cs, *nvfp4_columnwise_scale_shape(m, k))
        bufs["_amax_columnwise"] = s._amax_rowwise.clone()
    else:
        raise ValueError(
            f"{type(s).__name__} holds no columnwise copy and it cannot be built from the "
            "rowwise one (it is quantized along the other dimension); quantize the weight with "
            "columnwise_usage=True"
        )
    return bufs


__all__ = ["Plan", "base", "plan", "quantize_shard", "assemble", "columnwise_buffers",
           "columnwise_buffer_list"]
