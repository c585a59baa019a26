"""quant_core.decoded_slices: the output-column slices of a GEMM over decoded expert weights,
at the widths people train (bf16 decoded values, 2 bytes an element)."""

from __future__ import annotations

from quant_core.decoded_slices import column_slices

GIB = 2**30


def test_weights_up_to_twice_the_bound_are_decoded_whole():
    # Qwen3-MoE's gate/up input gradient: 128 experts x 1536 x 2048, 0.75 GiB decoded
    assert column_slices(2048, 128 * 1536 * 2, 128 * 1536 * 2048 * 2) == [(0, 2048)]
    assert column_slices(1000, 1, GIB) == [(0, 1000)]  # exactly twice: whole


def test_wider_weights_are_sliced_within_the_bound():
    # Mixtral's gate/up input gradient: 8 experts x 28672 contraction x 4096 columns, 1.75 GiB;
    # 512 MiB / (8 * 28672 * 2 bytes a column) = 1170 columns, 1152 in multiples of 128
    assert column_slices(4096, 8 * 28672 * 2, 8 * 28672 * 4096 * 2) == [
        (0, 1152), (1152, 2304), (2304, 3456), (3456, 4096)]
    # a column wider than the bound still takes a slice of 128
    assert column_slices(300, GIB, GIB * 300) == [(0, 128), (128, 256), (256, 300)]
