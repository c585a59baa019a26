"""The pure-torch reference gives the same bytes on CUDA as on the CPU, for every quantizer on
fp32 / bf16 / fp16 1040x2048 inputs with zeros, NaN, ±Inf, fp32 subnormals and -0.0 planted
(the RHT cases on bf16 only)."""

from __future__ import annotations

import pytest
import torch
from quant_core import (
    Float8BlockQuantizer,
    Float8CurrentScalingQuantizer,
    MXFP8Quantizer,
    NVFP4Quantizer,
)

CASES = {
    "current": lambda: Float8CurrentScalingQuantizer(),
    "current_pow2": lambda: Float8CurrentScalingQuantizer(force_pow_2_scales=True),
    "mxfp8": lambda: MXFP8Quantizer(),
    "mxfp8_2d_swizzled": lambda: MXFP8Quantizer(with_2d_quantization=True,
                                                optimize_for_gemm=True),
    "block1d": lambda: Float8BlockQuantizer(block_scaling_dim=1),
    "block2d": lambda: Float8BlockQuantizer(block_scaling_dim=2),
    "nvfp4": lambda: NVFP4Quantizer(),
    "nvfp4_rht": lambda: NVFP4Quantizer(with_rht=True, with_post_rht_amax=True),
    "nvfp4_2d_swizzled": lambda: NVFP4Quantizer(with_2d_quantization=True,
                                                optimize_for_gemm=True),
}


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
