"""The grouped rows GEMM of high-precision operands (mixture-of-experts layers), the contract
of ``quant_core.reference.grouped_rows_gemm``: one launch of :mod:`.fp8_grouped_gemm`'s rows
kernel over values it multiplies as they are, fp32 accumulation, unit group scales, one cast.
bf16 operands run on the bf16 tensor cores (their products are exact in fp32); fp16 and fp32
ones, and every operand under the interpreter (whose bf16 arithmetic is not exact), are widened
to fp32 and multiplied in IEEE fp32. The group bounds stay on the device.
"""

from __future__ import annotations

import torch
from quant_core.inputs import check_input_dtype

from ._common import interpreting, out_code
from .configs import launch_config
from .fp8_grouped_gemm import check_ends, check_rows_shapes, rows_gemm

#: The operands' FP8 dtypes for the kernel: none, the values are multiplied as they are.
_VALUES = (None, None)


def _operand(t: torch.Tensor) -> torch.Tensor:
    """``t`` as the kernel multiplies it: bf16 on a GPU, else fp32; contiguous."""
    keep = t.dtype == torch.bfloat16 and not interpreting()
    return (t if keep else t.to(torch.float32)).contiguous()


def grouped_rows_gemm(a: torch.Tensor, b: torch.Tensor, offs: torch.Tensor, a_ends: torch.Tensor,
                      *, total: int, out_dtype: torch.dtype = torch.bfloat16) -> torch.Tensor:
    """``out [total, N]``: rows ``offs[g-1]:offs[g]`` are ``a_g @ b[g]ᵀ``, ``a_g`` group ``g``'s
    rows of ``a [R, K]`` from row ``a_ends[g-1]`` on, ``b [E, N, K]`` (bf16, fp16 or fp32;
    ``offs``, ``a_ends`` int32/int64 ``[E]`` cumulative ends, ``offs[-1] == total``)."""
    name = "grouped_rows_gemm"
    check_input_dtype(a, name)
    check_input_dtype(b, name)
    out_code(out_dtype)
    check_ends(name, a, (("offs", offs), ("a_ends", a_ends)))
    check_rows_shapes(name, a, b, offs, a_ends)
    if b.device != a.device:
        raise ValueError(f"{name}: b is on {b.device} but a on {a.device}")
    av, bv = _operand(a), _operand(b)
    if av.dtype != bv.dtype:
        av, bv = av.to(torch.float32), bv.to(torch.float32)
    unit = torch.ones(b.shape[0], dtype=torch.float32, device=a.device)
    return rows_gemm(av, unit, bv, unit, offs, a_ends, total, _VALUES, out_dtype, launch_config(
        "grouped_rows_gemm" if av.dtype == torch.bfloat16 else "grouped_rows_gemm_fp32"))
