"""The pure-torch reference gives the same bytes on CUDA as on the CPU, for every quantizer on
fp32 / bf16 / fp16 1040x2048 inputs with zeros, NaN, ±Inf, fp32 subnormals and -0.0 planted
(the RHT cases on bf16 only)."""

from __future__ import annotations

import formats
import pytest
import torch

#: Every format's default quantizer and variants (tests/formats.py).
CASES = formats.quantizers("current_pow2", "mxfp8_2d_swizzled", "block1d", "nvfp4_rht",
                           "nvfp4_2d_swizzled", defaults=True)


def _inputs(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(1040, 2048, generator=g) * torch.logspace(-30, 30, 2048).sqrt()
    x[3, :40] = 0.0
    x[5, 7] = float("nan")
    x[9, 100] = float("inf")
    x[17, 200] = -float("inf")
    x[33, 64:96] = 1e-40  # fp32 subnormals
    x[40, :] = -0.0
    return x.to(dtype)


def _bytes(t):
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16],
                         ids=lambda d: str(d)[6:])
@pytest.mark.parametrize("name", list(CASES))
def test_reference_bytes_on_cuda_equal_the_cpu(name, dtype):
    if "rht" in name and dtype != torch.bfloat16:
        pytest.skip("the RHT takes bf16 inputs")
    q = CASES[name]()
    x = _inputs(dtype)
    cpu = q.quantize(x, backend="reference")
    gpu = q.quantize(x.cuda(), backend="reference")
    on_gpu = gpu.buffers()
    bad = [n for n, t in cpu.buffers().items()
           if t is not None and not torch.equal(_bytes(t), _bytes(on_gpu[n].cpu()))]
    assert not bad, f"buffers that differ: {bad}"
