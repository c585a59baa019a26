"""Every registered format is a complete unit: its storage declares what the layers above ask,
it has a tensor class and a value quantizer, and its buffers cross the custom-op wire and back."""

from __future__ import annotations

import pytest
import quant_core as qc
import torch
from quant_core import storage_class, storage_formats
from quant_core.storage import QuantizedStorage

FORMATS = storage_formats()


def _value_quantizers(fmt):
    return [c for c in qc.value_classes() if c.storage_format == fmt]


def test_the_four_formats_are_registered():
    assert set(FORMATS) == {"fp8", "mxfp8", "fp8_block", "nvfp4"}


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_format_declares_its_layout(fmt):
    cls = storage_class(fmt)
    assert cls.format == fmt
    names = cls.buffer_names
    assert cls.rowwise_data_name in names and cls.columnwise_data_name in names
    assert set(cls.rowwise_only_names) <= set(names)
    assert cls.columnwise_data_name not in cls.rowwise_only_names
    assert cls.tag_names == tuple(cls.tag_types)
    assert cls.tensor_class is not None and cls.tensor_class._storage_type is cls
    assert _value_quantizers(fmt), f"no value quantizer produces {fmt!r}"


@pytest.mark.parametrize("fmt", FORMATS)
def test_buffers_cross_the_wire_and_back(fmt):
    q = _value_quantizers(fmt)[0](internal=True)
    x = torch.randn(32, 64, dtype=torch.bfloat16)
    s = q.quantize(x)
    wire = storage_class(fmt).wire_tags(q._storage_tags())
    assert all(type(v) is int for v in wire)
    back = storage_class(fmt).from_wire(s.buffer_list(x), wire, s.shape)
    assert back.tags() == s.tags()
    for name, buf in s.buffers().items():
        assert getattr(back, name) is buf
    assert torch.equal(back.dequantize(torch.float32), s.dequantize(torch.float32))


def test_a_second_storage_under_a_registered_name_is_refused():
    with pytest.raises(TypeError, match="storage format 'fp8' is already Float8TensorStorage"):
        type("Other", (QuantizedStorage,), {"format": "fp8"})


def test_an_unknown_format_names_the_registered_ones():
    with pytest.raises(TypeError, match="'fp16' is not registered; registered: fp8, "):
        storage_class("fp16")


def test_row_alignment_is_the_row_block_of_each_format():
    """The row multiple a caller pads to (grouped GEMMs): MXFP8's 32-row columnwise blocks,
    FP8 blocks' 128, and 16 (cuBLAS's row multiple, NVFP4's 16-row transform) otherwise."""
    from quant_core import (
        Float8BlockQuantizer,
        Float8CurrentScalingQuantizer,
        MXFP8Quantizer,
        NVFP4Quantizer,
    )

    assert MXFP8Quantizer().row_alignment() == 32
    assert Float8BlockQuantizer(block_scaling_dim=1).row_alignment() == 128
    assert Float8BlockQuantizer(block_scaling_dim=2).row_alignment() == 128
    assert NVFP4Quantizer().row_alignment() == 16
    assert Float8CurrentScalingQuantizer().row_alignment() == 16
