"""A checkpoint written by quant-core 0.1, when the quantizers lived in ``quant_core.quantizers``
and the quantized tensors in ``quant_core.tensor``, still loads with ``torch.load``'s defaults.

``data/quantized_0_1.pt`` holds a bf16 input, its quantization by the four value quantizers and
the quantizers themselves, saved by that layout; the loaded bytes must equal quantizing the same
input now.
"""

from __future__ import annotations

import pathlib
import zipfile

import pytest
import torch
from quant_core import storage_class

FIXTURE = pathlib.Path(__file__).parent / "data" / "quantized_0_1.pt"


def test_the_fixture_names_the_former_module_paths():
    with zipfile.ZipFile(FIXTURE) as z:
        pickle = z.read(next(n for n in z.namelist() if n.endswith("data.pkl")))
    assert b"quant_core.tensor\nFloat8Tensor" in pickle
    assert b"quant_core.quantizers.nvfp4\nNVFP4Quantizer" in pickle


@pytest.mark.parametrize("fmt", ["fp8", "mxfp8", "fp8_block", "nvfp4"])
def test_a_0_1_tensor_loads_with_the_bytes_of_quantizing_now(fmt):
    saved = torch.load(FIXTURE)  # weights_only=True, torch's default
    t, q = saved["tensors"][fmt], saved["quantizers"][fmt]
    assert type(t) is storage_class(fmt).tensor_class
    assert t.quantizer == q
    now = q.quantize(saved["input"])
    for name, buf in now.buffers().items():
        got = getattr(t, name)
        assert (got is None) == (buf is None), name
        if buf is not None:
            assert torch.equal(got.view(torch.uint8), buf.view(torch.uint8)), name
