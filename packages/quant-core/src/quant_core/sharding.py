"""How a quantized weight travels through a dim-0 all-gather (FSDP2): the plan each format's
storage gives (``QuantizedStorage.shard_plan``).

A format qualifies when the concatenation of every rank's buffers along dim 0 *is* the buffer of
the full weight quantized on one device. Buffers equal on every rank (a scale that comes from an
amax all-reduced over the group) travel once, as metadata.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .shapes import ceil_div, m_k

#: Rows a rank must hold a multiple of for a block format (scale rows are padded to 128).
ROW_BLOCK = 128


@dataclass(frozen=True)
class ShardPlan:
    """What one rank sends for a weight: ``gathered`` buffers (row blocks, concatenated along
    dim 0 by the all-gather) and ``shared`` ones (equal on every rank: sent as metadata),
    quantized by ``quantizer`` (the weight quantizer with the usages gathered), with the amax
    all-reduced over the group first when ``reduce_amax``. ``trimmed``: gathered buffers whose
    rows past the weight's (the padding of an uneven split) are dropped on assembly.
    ``rows_independent`` (every format states it): each row of a gathered buffer is one row of
    the input and nothing else, so rows may be split anywhere and gathered in any order (False
    where blocks or scales span rows)."""

    quantizer: Any
    gathered: tuple[str, ...]
    shared: tuple[str, ...]
    reduce_amax: bool
    trimmed: tuple[str, ...] = ()
    rows_independent: bool = field(kw_only=True)


def row_blocks_refusal(what: str, shape, world: int) -> str | None:
    """Why ``world`` ranks cannot each hold a multiple of :data:`ROW_BLOCK` rows of a weight of
    ``shape`` (a sentence starting with ``what``), or None when they can."""
    m, _ = m_k(shape)
    if m % world == 0 and (m // world) % ROW_BLOCK == 0:
        return None
    return (f"{what}: every rank must hold a multiple of {ROW_BLOCK} rows (dim 0 = {m} over "
            f"{world} ranks gives {ceil_div(m, world)})")
