"""The fast GEMM paths (architecture.md contract 6): for two row operands of one format
(``quant_core.GemmOperand``), the fastest implementation this torch, GPU and backend offer whose
result is the reference's products accumulated in fp32, in another order.

- ``"scaled_mm"``: FP8 per-tensor on CUDA sm >= 8.9, ``torch._scaled_mm`` (cuBLAS);
- ``"scaled_mm_blockwise"``: FP8 1x128 / 128x128 blocks on CUDA sm 9.x where torch has block
  scaling in ``F.scaled_mm`` (cuBLAS);
- ``"triton_mxfp8"``, ``"triton_nvfp4"``: the Triton backend's GEMMs (quant-kernels: on CUDA, or
  through the interpreter when asked for by name);
- ``"emulated"``: MXFP8 and NVFP4 through the reference backend's GEMM (any device).

:func:`fast_gemm` returns ``None`` where no path applies; the caller then dequantizes both
operands to fp32 and multiplies (``emulated``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from quant_core import DType, GemmOperand, backends

#: Output dtypes routed to cuBLAS's block-scaled FP8 GEMM: bf16, checked against the reference on
#: the H200 (torch 2.11, bench/gemm.py). torch accepted fp32 and fp16 outputs there too (the
#: probe), but those were not checked against the reference: they stay emulated for now.
BLOCKWISE_OUT_DTYPES = (torch.bfloat16,)


def _cuda_capability(device: torch.device) -> tuple[int, int] | None:
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else None


def _aligned(*dims: int) -> bool:
    """cuBLAS FP8 GEMMs need 16-byte aligned leading dimensions."""
    return all(d % 16 == 0 for d in dims)


def _row_major(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def _tensorwise(ra: GemmOperand, rb: GemmOperand, bias, out_dtype):
    cap = _cuda_capability(ra.data.device)
    if cap is None or cap < (8, 9) or not hasattr(torch, "_scaled_mm"):
        return None
    if ra.fp_dtype == rb.fp_dtype == DType.E5M2 or not _aligned(ra.rows, rb.rows, ra.k):
        return None
    # cuBLAS adds a bias of the output dtype in its fp32 epilogue, before the one rounding
    fused = bias is not None and out_dtype != torch.float32 and bias.dtype == out_dtype
    direct = bias is None or fused
    # the (1,) scale-inverses as they are: a 0-dim reshape costs a reinterpret_tensor per
    # operand on every compiled step, and torch reads any one-element scale as tensorwise
    out = torch._scaled_mm(
        _row_major(ra.fp8_view()), _row_major(rb.fp8_view()).t(),
        scale_a=ra.scale, scale_b=rb.scale,
        bias=bias if fused else None, out_dtype=out_dtype if direct else torch.float32,
    )
    if not direct:
        out = (out + bias.to(torch.float32)).to(out_dtype)
    return out


def blockwise_available(device: torch.device) -> bool:
    """torch exposes cuBLAS's 1x128 / 128x128 FP8 GEMM (``F.scaled_mm``) and the GPU is sm 9.x."""
    cap = _cuda_capability(device)
    scaling = getattr(F, "ScalingType", None)
    return (cap is not None and cap[0] == 9 and hasattr(F, "scaled_mm")
            and scaling is not None and hasattr(scaling, "BlockWise1x128"))


def _blockwise_scale(op: GemmOperand):
    """The scale-inverses in the layout ``F.scaled_mm`` reads (a view of the GEMM-ready buffer;
    a copy only when a 1D buffer's padding breaks the outer-dim stride)."""
    if op.block_scaling_dim == 2:
        return op.scale.t(), F.ScalingType.BlockWise128x128
    s = op.scale[:, :op.rows]
    if s.stride(0) != op.rows and s.shape[0] > 1:
        s = s.contiguous()
    return s.t(), F.ScalingType.BlockWise1x128


def _blockwise(ra: GemmOperand, rb: GemmOperand, bias, out_dtype):
    if not blockwise_available(ra.data.device) or out_dtype not in BLOCKWISE_OUT_DTYPES:
        return None
    if ra.block_scaling_dim == rb.block_scaling_dim == 2 or not _aligned(ra.rows, rb.rows, ra.k):
        return None
    # torch 2.11's shape rule for these scales (its meta function, which torch.compile runs)
    # divides K by 128 in floating point and refuses a K that is not a multiple of 128, which
    # eager cuBLAS accepts (FSDP2 test on two H200s): one rule for both keeps them equal
    if ra.k % 128:
        return None
    if bias is not None and bias.dtype != out_dtype:
        return None
    sa, kind_a = _blockwise_scale(ra)
    sb, kind_b = _blockwise_scale(rb)
    return F.scaled_mm(_row_major(ra.fp8_view()), _row_major(rb.fp8_view()).t(), sa, kind_a, sb,
                       kind_b, bias=bias, output_dtype=out_dtype)


def _block_backend(op: GemmOperand):
    """The backend's GEMM for MXFP8/NVFP4 and the path name it runs as."""
    be = backends.get(None, op.data.device)
    return be, "emulated" if be.name == "reference" else f"{be.name}_{op.format}"


def _mxfp8(ra: GemmOperand, rb: GemmOperand, bias, out_dtype):
    be, _ = _block_backend(ra)
    return be.mxfp8_gemm(ra.data, ra.scale, rb.data, rb.scale, a_dtype=ra.fp_dtype,
                         b_dtype=rb.fp_dtype, a_swizzled=ra.swizzled, b_swizzled=rb.swizzled,
                         bias=bias, out_dtype=out_dtype)


def _nvfp4(ra: GemmOperand, rb: GemmOperand, bias, out_dtype):
    be, _ = _block_backend(ra)
    data = [op.data if op.data.stride(1) == 1 else op.data.contiguous() for op in (ra, rb)]
    return be.nvfp4_gemm(data[0], ra.scale, ra.amax, data[1], rb.scale, rb.amax,
                         a_swizzled=ra.swizzled, b_swizzled=rb.swizzled, bias=bias,
                         out_dtype=out_dtype)


def path_name(ra: GemmOperand) -> str:
    """The name :func:`fast_gemm` records for operands of ``ra``'s format."""
    if ra.format == "fp8":
        return "scaled_mm"
    if ra.format == "fp8_block":
        return "scaled_mm_blockwise"
    return _block_backend(ra)[1]


_PATHS = {"fp8": _tensorwise, "fp8_block": _blockwise, "mxfp8": _mxfp8, "nvfp4": _nvfp4}


def fast_gemm(ra: GemmOperand, rb: GemmOperand, bias: torch.Tensor | None,
              out_dtype: torch.dtype) -> tuple[torch.Tensor, str] | None:
    """``R_a @ R_bᵀ (+ bias)`` as ``out_dtype`` with its path name, or ``None`` when no fast
    path takes these operands (mixed formats, missing features, unaligned shapes)."""
    if ra.format != rb.format or ra.k != rb.k:
        return None
    out = _PATHS[ra.format](ra, rb, bias, out_dtype)
    return None if out is None else (out, path_name(ra))


__all__ = ["fast_gemm", "blockwise_available", "path_name", "BLOCKWISE_OUT_DTYPES"]
