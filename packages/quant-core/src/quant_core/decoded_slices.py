"""Output-column slices of a GEMM whose weight operand is decoded to bf16 first (Hopper's grouped
NVFP4 and MXFP8 GEMMs, which have no tensor cores for those scales).

Every expert's weight decoded at once can set a training step's peak (1.75 GiB at a Mixtral
layer's gate/up input gradient). Where the whole decode would take more than twice
:data:`DECODED_SLICE_BYTES`, the weights are decoded and multiplied a slice of output columns at
a time, each slice within that bound; smaller weights are decoded whole, in one launch (Qwen3-MoE's
experts, 0.75 GiB decoded). Each output column's products and sums are the same either way.
"""

from __future__ import annotations

#: The most bytes one slice of decoded weights holds.
DECODED_SLICE_BYTES = 512 * 2**20


def column_slices(columns: int, column_bytes: int, whole_bytes: int) -> list[tuple[int, int]]:
    """``[(c0, c1), ...]``: all ``columns`` at once where decoding them whole takes at most twice
    :data:`DECODED_SLICE_BYTES` (``whole_bytes``), else slices of a multiple of 128 columns (but
    the last) whose ``column_bytes`` each (what a slice holds per column) stay within it."""
    if whole_bytes <= 2 * DECODED_SLICE_BYTES:
        return [(0, columns)]
    width = max(128, DECODED_SLICE_BYTES // max(column_bytes, 1) // 128 * 128)
    return [(c0, min(columns, c0 + width)) for c0 in range(0, columns, width)]
