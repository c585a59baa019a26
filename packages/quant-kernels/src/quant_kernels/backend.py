"""The ``triton`` backend of quant-core (entry point ``quant_core.backends``).

``BACKEND`` exposes the functions of ``quant_core.reference`` with identical signatures and
return conventions, computed by the Triton kernels of this package. Two helpers
delegate to the reference on purpose (no bandwidth at stake): ``swizzle_scales`` /
``unswizzle_scales`` (scale matrices are 1/32 to 1/16 of the data; the
quantize and dequantize kernels write and read the swizzled layout directly instead).
"""

from __future__ import annotations

import os

import torch
from quant_core import reference
from quant_core.reference.nvfp4_dispatch import nvfp4_dispatcher

from . import (
    _amax,
    _gemm,
    fp8_block,
    fp8_block_grouped_gemm,
    fp8_grouped,
    fp8_grouped_experts,
    fp8_grouped_gemm,
    fp8_tensor,
    grouped_gemm,
    mxfp8,
    mxfp8_gemm,
    nvfp4,
    nvfp4_4over6,
    nvfp4_gemm,
    nvfp4_grouped,
    nvfp4_grouped_gemm,
)
from ._common import interpreting


class TritonBackend:
    """Triton kernels for every format and direction, byte-exact against the reference."""

    name = "triton"
    priority = 10
    @property
    def capturable(self) -> bool:
        """Launches go through ``_common.launch``: inside ``quant_core.kernel_capture.capture()``
        they are recorded into the graph being compiled (quant-dynamo lowers its ops with this).
        Not under the interpreter, whose kernels torch's ``wrap_triton`` cannot record."""
        return not interpreting()

    @staticmethod
    def supports(device: torch.device) -> bool:
        """CUDA devices; the CPU only through Triton's interpreter (``TRITON_INTERPRET=1``)."""
        device = torch.device(device)
        if device.type == "cuda":
            return True
        return device.type == "cpu" and os.environ.get("TRITON_INTERPRET") == "1"

    @staticmethod
    def preferred(device: torch.device) -> bool:
        """Automatic choice takes Triton on CUDA only: the interpreter is for tests, by name."""
        return torch.device(device).type == "cuda"

    @staticmethod
    def gemm_route(device: torch.device) -> str:
        """What :attr:`mxfp8_gemm` and :attr:`nvfp4_gemm` run on ``device``, in words (the
        routes ``quant_recipes.gemm_fast.routes`` describes)."""
        return _gemm.IMPLEMENTATIONS[_gemm.default_implementation()]

    amax = staticmethod(_amax.amax)
    current_scale = staticmethod(fp8_tensor.current_scale)
    fp8_quantize = staticmethod(fp8_tensor.fp8_quantize)
    fp8_current_quantize = staticmethod(fp8_tensor.fp8_current_quantize)
    fp8_dequantize = staticmethod(fp8_tensor.fp8_dequantize)
    mxfp8_quantize = staticmethod(mxfp8.mxfp8_quantize)
    mxfp8_dequantize = staticmethod(mxfp8.mxfp8_dequantize)
    mxfp8_quantize_decoded = staticmethod(mxfp8.mxfp8_quantize_decoded)
    fp8_block_quantize = staticmethod(fp8_block.fp8_block_quantize)
    fp8_block_dequantize = staticmethod(fp8_block.fp8_block_dequantize)
    nvfp4_amax = staticmethod(nvfp4.nvfp4_amax)
    #: the variant flags checked once, then the TE-default kernels or 4over6's
    nvfp4_quantize = staticmethod(nvfp4_dispatcher(nvfp4.nvfp4_base_quantize,
                                                   nvfp4_4over6.nvfp4_4over6_quantize))
    nvfp4_dequantize = staticmethod(nvfp4.nvfp4_dequantize)
    swizzle_scales = staticmethod(reference.swizzle_scales)
    unswizzle_scales = staticmethod(reference.unswizzle_scales)
    mxfp8_gemm = staticmethod(mxfp8_gemm.mxfp8_gemm)
    nvfp4_gemm = staticmethod(nvfp4_gemm.nvfp4_gemm)
    fp8_group_quantize_rows = staticmethod(fp8_grouped.fp8_group_quantize_rows)
    fp8_group_quantize_experts = staticmethod(fp8_grouped_experts.fp8_group_quantize_experts)
    grouped_rows_gemm = staticmethod(grouped_gemm.grouped_rows_gemm)
    fp8_grouped_rows_gemm = staticmethod(fp8_grouped_gemm.fp8_grouped_rows_gemm)
    fp8_grouped_tokens_gemm = staticmethod(fp8_grouped_gemm.fp8_grouped_tokens_gemm)
    fp8_block_grouped_rows_gemm = staticmethod(
        fp8_block_grouped_gemm.fp8_block_grouped_rows_gemm)
    fp8_block_grouped_tokens_gemm = staticmethod(
        fp8_block_grouped_gemm.fp8_block_grouped_tokens_gemm)
    nvfp4_group_quantize = staticmethod(nvfp4_grouped.nvfp4_group_quantize)
    nvfp4_grouped_rows_gemm = staticmethod(nvfp4_grouped_gemm.nvfp4_grouped_rows_gemm)
    nvfp4_grouped_tokens_gemm = staticmethod(nvfp4_grouped_gemm.nvfp4_grouped_tokens_gemm)


BACKEND = TritonBackend()
