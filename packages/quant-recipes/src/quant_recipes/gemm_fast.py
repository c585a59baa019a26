"""The fast GEMM paths (architecture.md contract 6): for two row operands of one format
(``quant_core.GemmOperand``), the fastest implementation this torch, GPU and backend offer whose
result is the reference's products accumulated in fp32, in another order (an FP8 per-tensor
GEMM asked for fast accumulation, ``fast_accum``, sums at the FP8 tensor cores' own width).

- ``"scaled_mm"``: FP8 per-tensor on CUDA sm >= 8.9, ``torch._scaled_mm`` (cuBLAS);
- ``"scaled_mm_blockwise"``: FP8 1x128 / 128x128 blocks on CUDA sm 9.x where torch has block
  scaling in ``F.scaled_mm`` (cuBLAS);
- ``"scaled_mm_mxfp8"``, ``"scaled_mm_nvfp4"``: MXFP8 (1x32 E8M0 scales) and NVFP4 (1x16 E4M3
  scales; the two per-tensor factors applied to the fp32 product afterwards, as the reference
  does) through cuBLAS's block-scaled GEMM in ``F.scaled_mm`` on CUDA sm >= 10.0 (Blackwell),
  scales in the 128x4 swizzle cuBLAS reads. Routed, not yet verified on such a GPU;
- ``"triton_mxfp8"``, ``"triton_nvfp4"``: the Triton backend's GEMMs (quant-kernels: on CUDA, or
  through the interpreter when asked for by name), elsewhere and for the operands the
  block-scaled path does not take;
- ``"emulated"``: MXFP8 and NVFP4 through the reference backend's GEMM (any device).

:func:`fast_gemm` returns ``None`` where no path applies; the caller then dequantizes both
operands to fp32 and multiplies (``emulated``). :func:`routes` describes, per format, the path
:func:`fast_gemm` takes on a device, from the same table (``_PATHS``) and probes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from quant_core import DType, GemmOperand, backends
from quant_core.constants import RCP_NVFP4_GLOBAL_MAX
from quant_core.shapes import ceil_div, roundup

from .compiling import device_probe

#: Output dtypes routed to cuBLAS's block-scaled FP8 GEMM: bf16, checked against the reference on
#: the H200 (torch 2.11, bench/speed.py gemm). torch accepted fp32 and fp16 outputs there too (the
#: probe), but those were not checked against the reference: they stay emulated for now.
BLOCKWISE_OUT_DTYPES = (torch.bfloat16,)


def _cuda_capability(device: torch.device) -> tuple[int, int] | None:
    return torch.cuda.get_device_capability(device) if device.type == "cuda" else None


def _aligned(*dims: int) -> bool:
    """cuBLAS FP8 GEMMs need 16-byte aligned leading dimensions."""
    return all(d % 16 == 0 for d in dims)


def _row_major(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


#: What :func:`fast_gemm` runs where no fast path takes the operands.
EMULATED = "dequantize to fp32, fp32 matmul"


def tensorwise_problem(device: torch.device) -> str | None:
    """Why ``torch._scaled_mm`` (FP8 per-tensor scales) cannot run on ``device``; ``None`` when
    it can. The grouped FP8 GEMMs (:mod:`.moe.fp8_gemm`) ask it too."""
    cap = _cuda_capability(device)
    if cap is None:
        return f"no FP8 tensor cores on {device.type}"
    if cap < (8, 9):
        return f"sm_{cap[0]}{cap[1]}: FP8 tensor cores need sm_89+"
    if not hasattr(torch, "_scaled_mm"):
        return f"torch {torch.__version__} has no torch._scaled_mm"
    return None


def _tensorwise(ra: GemmOperand, rb: GemmOperand, bias, out_dtype, fast_accum=False):
    if tensorwise_problem(ra.data.device) is not None:
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
        use_fast_accum=fast_accum,
    )
    if not direct:
        out = (out + bias.to(torch.float32)).to(out_dtype)
    return out


def _blockwise_problem(device: torch.device) -> str | None:
    """Why cuBLAS's 1x128 / 128x128 FP8 GEMM cannot run on ``device``; ``None`` when it can."""
    cap = _cuda_capability(device)
    if cap is None:
        return f"no FP8 tensor cores on {device.type}"
    if cap[0] != 9:
        return f"sm_{cap[0]}{cap[1]}: cuBLAS's 1x128/128x128 FP8 GEMM runs on sm 9.x only"
    scaling = getattr(F, "ScalingType", None)
    if not (hasattr(F, "scaled_mm") and scaling is not None
            and hasattr(scaling, "BlockWise1x128")):
        return f"torch {torch.__version__} has no block scaling in F.scaled_mm (torch >= 2.10)"
    return None


def blockwise_available(device: torch.device) -> bool:
    """torch exposes cuBLAS's 1x128 / 128x128 FP8 GEMM (``F.scaled_mm``) and the GPU is sm 9.x."""
    return _blockwise_problem(device) is None


def _blockwise_scale(op: GemmOperand):
    """The scale-inverses in the layout ``F.scaled_mm`` reads (a view of the GEMM-ready buffer;
    a copy only when a 1D buffer's padding breaks the outer-dim stride)."""
    if op.block_scaling_dim == 2:
        return op.scale.t(), F.ScalingType.BlockWise128x128
    s = op.scale[:, :op.rows]
    if s.stride(0) != op.rows and s.shape[0] > 1:
        s = s.contiguous()
    return s.t(), F.ScalingType.BlockWise1x128


def _blockwise(ra: GemmOperand, rb: GemmOperand, bias, out_dtype, fast_accum=False):
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


#: Said of a route that has not run on its hardware yet (the Blackwell block-scaled GEMMs).
NOT_VERIFIED = "routed, not verified on this hardware"


def _native_block_problem(device: torch.device) -> str | None:
    """Why cuBLAS's MXFP8/NVFP4 block-scaled GEMM cannot run on ``device``; ``None`` when it
    can (sm_100+, and a torch whose ``F.scaled_mm`` takes 1x32 / 1x16 block scales)."""
    cap = _cuda_capability(device)
    if cap is None:
        return f"no MXFP8/NVFP4 tensor cores on {device.type}"
    if cap[0] < 10:
        return f"sm_{cap[0]}{cap[1]}: MXFP8/NVFP4 tensor cores need sm_100+"
    return _native_block_api_problem()


@device_probe
def _native_block_api_problem() -> str | None:
    """Why this torch's ``F.scaled_mm`` does not take the block-scaled calls below (probed
    once, on meta tensors: torch's own shape rules check the arguments), else ``None``."""
    scaling, swizzle = getattr(F, "ScalingType", None), getattr(F, "SwizzleType", None)
    if not (hasattr(F, "scaled_mm") and hasattr(scaling, "BlockWise1x32")
            and hasattr(scaling, "BlockWise1x16") and hasattr(swizzle, "SWIZZLE_32_4_4")
            and hasattr(torch, "float8_e8m0fnu") and hasattr(torch, "float4_e2m1fn_x2")):
        return f"torch {torch.__version__} has no MX/NVFP4 block scaling in F.scaled_mm"
    try:
        # a 128 x 128 x 128 problem: 128 rows x roundup(128 / block, 4) scale bytes
        fp8 = torch.empty((128, 128), dtype=torch.float8_e4m3fn, device="meta")
        scale = torch.empty(128 * 4, dtype=torch.uint8, device="meta")
        _call_mxfp8(fp8, scale, fp8, scale, torch.float32)
        fp4 = torch.empty((128, 64), dtype=torch.uint8, device="meta")
        scale = torch.empty(128 * 8, dtype=torch.uint8, device="meta")
        _call_nvfp4(fp4, scale, fp4, scale, torch.float32)
    except (RuntimeError, TypeError, ValueError, IndexError) as exc:
        return f"torch {torch.__version__}'s F.scaled_mm refuses the block-scaled call ({exc})"
    return None


def swizzled_scale(op: GemmOperand, block: int) -> torch.Tensor:
    """``op``'s block scales as the flat bytes cuBLAS's block-scaled GEMM reads: the padded
    ``[roundup(rows, 128), roundup(ceil(K / block), 4)]`` matrix in the 128x4 GEMM swizzle (the
    storage's own bytes when it holds them swizzled; otherwise padded with zeros and swizzled)."""
    if op.swizzled:
        return op.scale.reshape(-1)
    blocks = ceil_div(op.k, block)
    s = op.scale[:op.rows, :blocks]
    s = F.pad(s, (0, roundup(blocks, 4) - blocks, 0, roundup(op.rows, 128) - op.rows))
    return backends.get(None, s.device).swizzle_scales(s.contiguous()).reshape(-1)


def _native_takes(ra: GemmOperand, rb: GemmOperand, out_dtype) -> bool:
    return (_native_block_problem(ra.data.device) is None and _aligned(ra.rows, rb.rows)
            and ra.k % 32 == 0 and out_dtype in (torch.bfloat16, torch.float16, torch.float32))


def _finish(out: torch.Tensor, bias, out_dtype) -> torch.Tensor:
    if bias is not None:
        out = out + bias.to(torch.float32)
    return out.to(out_dtype)


def _call_mxfp8(a, a_scale, b, b_scale, out_dtype):
    """cuBLAS's MXFP8 GEMM of FP8 row operands ``a [M, K]``, ``b [N, K]`` (row-major) with their
    flat swizzled E8M0 scale bytes."""
    e8m0, swz = torch.float8_e8m0fnu, F.SwizzleType.SWIZZLE_32_4_4
    return F.scaled_mm(
        a, b.t(), a_scale.view(e8m0), F.ScalingType.BlockWise1x32, b_scale.view(e8m0),
        F.ScalingType.BlockWise1x32, swizzle_a=swz, swizzle_b=swz, output_dtype=out_dtype,
    )


def _call_nvfp4(a, a_scale, b, b_scale, out_dtype):
    """cuBLAS's NVFP4 GEMM of packed E2M1 row operands ``a [M, K/2]``, ``b [N, K/2]`` with their
    flat swizzled E4M3 scale bytes and per-tensor factors of 1 (the two-level form every
    release with block scaling takes), so the result is the elements' fp32 product."""
    fp4, e4m3 = torch.float4_e2m1fn_x2, torch.float8_e4m3fn
    one = torch.ones(1, dtype=torch.float32, device=a.device)
    recipe = [F.ScalingType.BlockWise1x16, F.ScalingType.TensorWise]
    swz = [F.SwizzleType.SWIZZLE_32_4_4, F.SwizzleType.NO_SWIZZLE]
    return F.scaled_mm(
        a.view(fp4), b.view(fp4).t(), [a_scale.view(e4m3), one], recipe,
        [b_scale.view(e4m3), one], recipe, swizzle_a=swz, swizzle_b=swz, output_dtype=out_dtype,
    )


def _native_mxfp8(ra: GemmOperand, rb: GemmOperand, bias, out_dtype, fast_accum=False):
    if not _native_takes(ra, rb, out_dtype):
        return None
    out = _call_mxfp8(_row_major(ra.fp8_view()), swizzled_scale(ra, 32),
                      _row_major(rb.fp8_view()), swizzled_scale(rb, 32),
                      out_dtype if bias is None else torch.float32)
    return out if bias is None else _finish(out, bias, out_dtype)


def _native_nvfp4(ra: GemmOperand, rb: GemmOperand, bias, out_dtype, fast_accum=False):
    """The fp32 product of the E2M1 x E4M3 elements, then ``(P * alpha_a) * alpha_b``: the
    reference's two per-tensor factors, not cuBLAS's one (which rounds differently)."""
    if not _native_takes(ra, rb, out_dtype):
        return None
    p = _call_nvfp4(_row_major(ra.data), swizzled_scale(ra, 16), _row_major(rb.data),
                    swizzled_scale(rb, 16), torch.float32)
    # one factor per output row / column for a row-scaled operand, else one for the tensor
    alpha_a = ra.amax.to(torch.float32).reshape(-1, 1) * RCP_NVFP4_GLOBAL_MAX
    alpha_b = rb.amax.to(torch.float32).reshape(1, -1) * RCP_NVFP4_GLOBAL_MAX
    return _finish((p * alpha_a) * alpha_b, bias, out_dtype)


def _block_backend(device: torch.device):
    """The backend whose GEMM serves MXFP8/NVFP4 on ``device``, and its path-name prefix."""
    be = backends.get(None, device)
    return be, None if be.name == "reference" else be.name


def _block_problem(device: torch.device) -> str | None:
    """Why MXFP8/NVFP4 GEMMs on ``device`` are emulated (the reference backend's fp32 GEMM);
    ``None`` when a kernel backend serves them."""
    problem = backends.environment_problem(device)
    if problem is not None:
        return problem
    if _block_backend(device)[1] is None:
        return f"the reference backend serves {device.type} (quant-kernels serves CUDA)"
    return None


def _mxfp8(ra: GemmOperand, rb: GemmOperand, bias, out_dtype, fast_accum=False):
    be, _ = _block_backend(ra.data.device)
    return be.mxfp8_gemm(ra.data, ra.scale, rb.data, rb.scale, a_dtype=ra.fp_dtype,
                         b_dtype=rb.fp_dtype, a_swizzled=ra.swizzled, b_swizzled=rb.swizzled,
                         bias=bias, out_dtype=out_dtype)


def _nvfp4(ra: GemmOperand, rb: GemmOperand, bias, out_dtype, fast_accum=False):
    be, _ = _block_backend(ra.data.device)
    data = [op.data if op.data.stride(1) == 1 else op.data.contiguous() for op in (ra, rb)]
    return be.nvfp4_gemm(data[0], ra.scale, ra.amax, data[1], rb.scale, rb.amax,
                         a_swizzled=ra.swizzled, b_swizzled=rb.swizzled, bias=bias,
                         out_dtype=out_dtype)


@dataclass(frozen=True)
class _Path:
    """One format's fast path: ``gemm`` (``None`` where it does not take the operands),
    ``problem`` (why it cannot run on a device, ``None`` where it can), the name it records
    (``None``: the backend's, ``<backend>_<format>``), what runs in words (``""``: the backend's
    optional ``gemm_route(device)``) and the operands it takes beyond the format."""

    gemm: Callable
    problem: Callable[[torch.device], str | None]
    path: str | None = None
    runs: str = ""
    takes: str = ""
    #: The path has run on its hardware and matched the reference.
    verified: bool = True


_NATIVE_TAKES = "rows multiples of 16, K of 32"
#: Per format, its fast paths in the order :func:`fast_gemm` tries them.
_PATHS: dict[str, tuple[_Path, ...]] = {
    "fp8": (_Path(_tensorwise, tensorwise_problem, "scaled_mm", "cuBLAS scaled_mm (tensorwise)",
                  "not both E5M2; rows and K multiples of 16"),),
    "fp8_block": (_Path(_blockwise, _blockwise_problem, "scaled_mm_blockwise",
                        "cuBLAS blockwise scaled_mm",
                        "bf16 output; not both 128x128; rows multiples of 16, K of 128"),),
    "mxfp8": (_Path(_native_mxfp8, _native_block_problem, "scaled_mm_mxfp8",
                    "cuBLAS block-scaled scaled_mm (MXFP8, 1x32 E8M0 scales)", _NATIVE_TAKES,
                    verified=False),
              _Path(_mxfp8, _block_problem)),
    "nvfp4": (_Path(_native_nvfp4, _native_block_problem, "scaled_mm_nvfp4",
                    "cuBLAS block-scaled scaled_mm (NVFP4, 1x16 E4M3 scales), per-tensor "
                    "factors after", _NATIVE_TAKES + "; the global bound 448", verified=False),
              _Path(_nvfp4, _block_problem, takes="the standard global bound 448 (4over6 "
                    "operands under 256 are emulated); row-scaled operands' factors per row")),
}


def _path_name(p: _Path, ra: GemmOperand) -> str:
    if p.path is not None:
        return p.path
    prefix = _block_backend(ra.data.device)[1]
    return "emulated" if prefix is None else f"{prefix}_{ra.format}"


@dataclass(frozen=True)
class Route:
    """The GEMM of two operands of ``format`` on a device (:func:`routes`).

    ``path``: the name :func:`fast_gemm` records (``gemm_paths()``), ``"emulated"`` where no
    fast path runs; ``runs``: what computes it, in words; ``available``: a fast path runs here;
    ``note``: the operands it takes beyond the format (others are emulated), or why it is
    emulated here."""

    format: str
    path: str
    runs: str
    available: bool
    note: str


def routes(device: torch.device | str) -> list[Route]:
    """Per operand format, in the order :func:`fast_gemm` dispatches on, the GEMM route on
    ``device`` with this torch, GPU and backend choice."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None and torch.cuda.is_available():
        device = torch.device("cuda", torch.cuda.current_device())
    out = []
    for fmt, paths in _PATHS.items():
        p = next((p for p in paths if p.problem(device) is None), None)
        if p is None:  # the reason of the last fallback
            out.append(Route(fmt, "emulated", EMULATED, False, paths[-1].problem(device)))
            continue
        be, prefix = (None, None) if p.path is not None else _block_backend(device)
        describe = getattr(be, "gemm_route", None)
        runs = p.runs or (describe(device) if describe is not None
                          else f"the {prefix} backend's {fmt} GEMM")
        note = p.takes if p.verified else f"{NOT_VERIFIED}; {p.takes}"
        out.append(Route(fmt, p.path or f"{prefix}_{fmt}", runs, True, note))
    return out


def fast_gemm(ra: GemmOperand, rb: GemmOperand, bias: torch.Tensor | None,
              out_dtype: torch.dtype, fast_accum: bool = False
              ) -> tuple[torch.Tensor, str] | None:
    """``R_a @ R_bᵀ (+ bias)`` as ``out_dtype`` with its path name, or ``None`` when no fast
    path takes these operands (mixed formats, missing features, unaligned shapes).
    ``fast_accum``: the FP8 per-tensor path (``"scaled_mm"``) accumulates at the FP8 tensor
    cores' own width (cuBLAS's fast accumulation), as the recipe's ``MMParams`` ask; the block
    scaled and bf16 paths accumulate in fp32 regardless."""
    if ra.format != rb.format or ra.k != rb.k:
        return None
    for p in _PATHS[ra.format]:
        out = p.gemm(ra, rb, bias, out_dtype, fast_accum)
        if out is not None:
            return out, _path_name(p, ra)
    return None
