"""The backend is discoverable and mirrors the reference's contract."""

from __future__ import annotations

import inspect
import re

import pytest
import torch
from installed import NOT_INSTALLED, triton_entry_point
from quant_core import backends, reference
from quant_core.dtypes import DType

NAMES = backends.FUNCTIONS


def _backend():
    ep = triton_entry_point()
    if ep is None:
        pytest.fail(NOT_INSTALLED)
    return ep.load()


def test_entry_point_loads_backend():
    from quant_kernels.backend import BACKEND

    b = _backend()
    assert b is BACKEND
    assert b.name == "triton" and b.priority == 10


def test_signatures_mirror_reference():
    b = _backend()
    for name in NAMES:
        assert inspect.signature(getattr(b, name)) == inspect.signature(
            getattr(reference, name)
        ), name


def test_supports(monkeypatch):
    b = _backend()
    assert b.supports(torch.device("cuda"))
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert b.supports(torch.device("cpu"))
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    assert not b.supports(torch.device("cpu"))
    assert not b.supports(torch.device("meta"))


_NV = dict(rowwise=True, columnwise=True, rht_sign_mask=0xD7E8, with_2d_quantization=False,
           stochastic_rounding=False, rng_seed=None, swizzle=False)
_BAD_CALLS = [
    ("mxfp8_quantize", (torch.zeros(4, 48),),
     dict(fp8_dtype=DType.E4M3, rowwise=True, columnwise=True, with_2d_quantization=False,
          swizzle=False), "MXFP8 needs K to be a multiple of 32, got K = 48"),
    ("fp8_block_quantize", (torch.zeros(4, 128),),
     dict(fp8_dtype=DType.E4M3, block_scaling_dim=3, force_pow_2_scales=True, amax_epsilon=0.0,
          rowwise=True, columnwise=True), "block_scaling_dim must be 1 or 2, got 3"),
    ("nvfp4_quantize", (torch.zeros(4, 24), torch.ones(1), torch.ones(1)),
     dict(_NV, with_rht=False), "NVFP4 needs K to be a multiple of 16, got K = 24"),
    ("nvfp4_quantize", (torch.zeros(16, 32, dtype=torch.bfloat16), torch.ones(1), torch.ones(1)),
     dict(_NV, with_rht=True, with_2d_quantization=True), "exclusive"),
    ("nvfp4_quantize", (torch.zeros(16, 32), torch.ones(1), torch.ones(1)),
     dict(_NV, with_rht=False, stochastic_rounding=True), "needs rng_seed"),
    ("nvfp4_quantize", (torch.zeros(16, 32), torch.ones(1), torch.ones(1)),
     dict(_NV, with_rht=True), "RHT needs a bfloat16 input"),
    ("nvfp4_quantize", (torch.zeros(8, 32, dtype=torch.bfloat16), torch.ones(1), torch.ones(1)),
     dict(_NV, with_rht=True), "M must be a multiple of 16, got M = 8"),
]


_X64 = torch.zeros(16, 32, dtype=torch.float64)
_FP8 = dict(fp8_dtype=DType.E4M3, rowwise=True, columnwise=True)
_BAD_CALLS += [  # a float64 x: the same TypeError from every backend (a KeyError from Triton's)
    (name, (_X64, *more), kwargs, f"{name}: input dtype must be one of")
    for name, more, kwargs in [
        ("amax", (), {}),
        ("fp8_quantize", (torch.ones(1),), _FP8),
        ("fp8_current_quantize", (), dict(_FP8, force_pow_2_scales=False, amax_epsilon=0.0)),
        ("mxfp8_quantize", (), dict(_FP8, with_2d_quantization=False, swizzle=False)),
        ("fp8_block_quantize", (), dict(_FP8, block_scaling_dim=1, force_pow_2_scales=True,
                                        amax_epsilon=0.0)),
        ("nvfp4_amax", (), dict(rowwise=True, columnwise=True, with_rht=False,
                                rht_sign_mask=0xD7E8)),
        ("nvfp4_quantize", (torch.ones(1), torch.ones(1)), dict(_NV, with_rht=False)),
    ]
]

_U8 = torch.zeros(32, 32, dtype=torch.uint8)
_BAD_CALLS += [  # decoded values asked in an integer dtype: the same ValueError everywhere
    (name, args, dict(kwargs, dtype=torch.int32), f"{name}: dtype must be one of")
    for name, args, kwargs in [
        ("fp8_dequantize", (_U8, torch.ones(1)), dict(fp8_dtype=DType.E4M3)),
        ("mxfp8_dequantize", (_U8, torch.zeros(128, 4, dtype=torch.uint8)),
         dict(fp8_dtype=DType.E4M3, columnwise=False, swizzled=False)),
        ("mxfp8_quantize_decoded", (torch.zeros(32, 32),),
         dict(fp8_dtype=DType.E4M3, rowwise=True, columnwise=False,
              with_2d_quantization=False)),
        ("fp8_block_dequantize", (_U8, torch.ones(32, 1)),
         dict(fp8_dtype=DType.E4M3, block_scaling_dim=1, columnwise=False)),
        ("nvfp4_dequantize", (_U8[:, :16], torch.zeros(128, 4, dtype=torch.uint8),
                              torch.ones(1)), dict(swizzled=False)),
    ]
]


@pytest.mark.parametrize("name, args, kwargs, message", _BAD_CALLS)
def test_bad_arguments_refused_like_the_reference(monkeypatch, name, args, kwargs, message):
    """The reference and the Triton backend refuse the same bad arguments with the same message
    (one rule each in ``quant_core.inputs``), before any kernel runs."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    error = TypeError if "input dtype" in message else ValueError
    for impl in (reference, _backend()):
        with pytest.raises(error, match=re.escape(message)):
            getattr(impl, name)(*args, **kwargs)
