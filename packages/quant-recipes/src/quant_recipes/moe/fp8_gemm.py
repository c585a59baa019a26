"""FP8 current-scaling grouped GEMMs of :class:`~quant_recipes.GroupedLinear` on the batched
quantization (:mod:`.fp8`), and the layer's quantize-once forward and backward.

Each GEMM multiplies every group on FP8 tensor cores, by one of three routes (the first two
are one launch with the group bounds read on the device: nothing read on the host, so the step
can be captured in a CUDA graph):

- ``"scaled_grouped_mm"``: ``torch._scaled_grouped_mm`` (fp32 accumulation, or the tensor
  cores' fast accumulation where the recipe's ``MMParams`` ask for it) with each row's
  (column's) group ``scale_inv`` as its row scale, where the kernel takes the operands (probed
  once per device type and first-operand dtype, by value: torch 2.11's takes E4M3 x E4M3 only)
  and :data:`ROUTE` prefers it;
- ``"fp8_grouped_gemm"``: the backend's grouped FP8 GEMMs (``fp8_grouped_rows_gemm``,
  ``fp8_grouped_tokens_gemm`` of the backend contract; quant-kernels' Triton kernels on GPUs):
  any FP8 pair (the E5M2 gradients of the HYBRID backward), each group's ``scale_inv`` applied
  to its fp32 product. The reference backend's definition reads the group bounds on the host.
- ``"scaled_mm_per_group"``: one ``torch._scaled_mm`` (cuBLAS, likewise) per group on
  slices of the same batched bytes, after one host read of the group bounds per backward; only
  where :data:`CUBLAS_PER_GROUP` asks for it.

Layers of at least :data:`OWN_KERNEL_MIN_EXPERTS` experts run every GEMM on
``"fp8_grouped_gemm"``; smaller ones run E4M3 x E4M3 on ``"scaled_grouped_mm"`` and the pairs
torch's grouped kernel does not take (HYBRID's E5M2 gradients) on ``"fp8_grouped_gemm"`` too
(``"scaled_mm_per_group"`` with :data:`CUBLAS_PER_GROUP`). With many small experts the grouped
kernels beat torch's grouped kernel; with a few large ones torch's is the faster, and cuBLAS
per group beats the grouped kernels, at the price of a host read (the measurements:
bench/RESULTS.md).

:func:`forward` quantizes the input and each expert's weight once, in every layout the step
needs (the rowwise bytes for the forward GEMM, the transposed bytes that backward's GEMMs read),
and returns the transposed bytes for the backward to keep instead of the high-precision tensors;
:func:`backward` quantizes the output gradient once, in both layouts. The bytes are those every
per-group quantize call would make (they do not depend on the layout).
"""

from __future__ import annotations

import math

import torch
from quant_core import backends

from ..compiling import device_probe
from ..gemm_fast import tensorwise_problem
from . import bias, fp8
from .fp8 import quantize_experts, quantize_rows
from .paths import count_path

#: Device types whose grouped FP8 GEMMs may run (tests add "cpu", with stand-ins for the ops).
SCALED_GROUPED_MM_DEVICES = {"cuda"}


def scaled_grouped_mm(a, b, scale_a, scale_b, offs, fast_accum=False):
    """``torch._scaled_grouped_mm`` with a bf16 output, fp32 accumulation unless
    ``fast_accum`` (tests replace it by an emulation on the CPU)."""
    return torch._scaled_grouped_mm(a, b, scale_a, scale_b, offs=offs, out_dtype=torch.bfloat16,
                                    use_fast_accum=fast_accum)


@device_probe
def _runs(device_type: str, a_dtype: torch.dtype) -> bool:
    """``torch._scaled_grouped_mm`` runs an ``a_dtype`` x E4M3 problem on this device type and
    gives the right values (a torch that reads E5M2 bytes as E4M3 fails the check)."""
    if not hasattr(torch, "_scaled_grouped_mm"):
        return False
    try:
        a = torch.full((32, 16), 1.5, device=device_type).to(a_dtype)
        b = torch.full((2, 16, 16), 0.5, device=device_type).to(torch.float8_e4m3fn)
        sa = torch.full((32,), 2.0, device=device_type)
        sb = torch.full((2, 16), 4.0, device=device_type)
        offs = torch.tensor([16, 32], dtype=torch.int32, device=device_type)
        out = scaled_grouped_mm(a, b.transpose(-2, -1), sa, sb, offs)
        return bool((out == 16 * 0.75 * 8.0).all())
    except (RuntimeError, TypeError, ValueError, NotImplementedError):
        return False


@device_probe
def unpadded_rows_run(device_type: str) -> bool:
    """``torch._scaled_grouped_mm`` multiplies row groups of any size (group ends that are not
    multiples of 16) right, probed by value: then the row-grouped GEMMs read and write the rows
    where they are, with no padded copy of the output to gather back."""
    if not _runs(device_type, torch.float8_e4m3fn):
        return False
    try:
        rows = torch.arange(1, 41, device=device_type, dtype=torch.float32)[:, None]
        a = (torch.ones(40, 16, device=device_type) * (rows % 8)).to(torch.float8_e4m3fn)
        b = torch.ones(3, 16, 16, device=device_type).to(torch.float8_e4m3fn)
        sb = torch.tensor([1.0, 2.0, 4.0], device=device_type)[:, None].expand(3, 16)
        offs = torch.tensor([7, 7, 40], dtype=torch.int32, device=device_type)
        out = scaled_grouped_mm(a, b.transpose(-2, -1), torch.ones(40, device=device_type),
                                sb.contiguous(), offs)
        want = 16 * (rows % 8) * torch.where(rows <= 7, 1.0, 4.0)
        return bool((out.float() == want).all())
    except (RuntimeError, TypeError, ValueError, NotImplementedError):
        return False


#: Which route takes an E4M3 x E4M3 GEMM that both can run: ``"auto"`` (torch's kernel in
#: layers of fewer than :data:`OWN_KERNEL_MIN_EXPERTS` experts, the backend's from there on),
#: ``"scaled_grouped_mm"`` or ``"fp8_grouped_gemm"`` (the benchmarks compare them).
ROUTE = "auto"


#: Layers of at least this many experts run their GEMMs on the backend's grouped kernels (one
#: launch each, no host read): the pairs ``torch._scaled_grouped_mm`` does not take, and with
#: :data:`ROUTE` ``"auto"`` the E4M3 x E4M3 ones too; smaller layers run cuBLAS per group for
#: the former and torch's grouped kernel for the latter. 0: always the grouped kernels.
OWN_KERNEL_MIN_EXPERTS = 64

#: The row multiple of the quantize-once path's padded layout where the weight gradient runs on
#: the backend's grouped kernel (at least the recipe's token alignment; 16 by default, the
#: kernels' 16-byte loads). At a multiple of the kernel's contraction chunk (128) every group of
#: the transposed copies starts and ends on a whole chunk, so the kernel loads its tiles from
#: descriptors made once on the host rather than once per program, for more zero padding in
#: the transposed copies (up to 127 rows a group). The bytes of every GEMM are the same. 16
#: stays the default: at Qwen3-MoE widths 128 made the weight gradient 12% faster and the
#: casts, which write the padded rows, slower by as much (bench/RESULTS.md).
TOKENS_GROUP_MULTIPLE = 16

#: Layers of fewer than :data:`OWN_KERNEL_MIN_EXPERTS` experts run the pairs torch's grouped
#: kernel does not take on cuBLAS per group (``"scaled_mm_per_group"``). That is faster with a
#: few large experts, but backward then reads the group bounds on the host: the step waits for
#: the GPU once per backward and cannot be captured in a CUDA graph. Off by default: no grouped
#: GEMM reads anything on the host.
CUBLAS_PER_GROUP = False


def scaled_mm(a, b, scale_a, scale_b, out, fast_accum=False):
    """``torch._scaled_mm`` of one group into ``out`` (bf16), fp32 accumulation unless
    ``fast_accum`` (tests replace it by an emulation on the CPU)."""
    torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16,
                     use_fast_accum=fast_accum, out=out)


def grouped_takes(qa, qb, device: torch.device, experts: int) -> bool:
    """``"scaled_grouped_mm"`` takes a GEMM of ``qa`` x ``qb`` operands: :data:`ROUTE` prefers
    it (at this expert count), ``qb`` E4M3, ``qa`` a type this torch's kernel runs, fewer than
    1024 groups."""
    prefers = ROUTE == "scaled_grouped_mm" or (ROUTE == "auto"
                                               and experts < OWN_KERNEL_MIN_EXPERTS)
    return (prefers and qb.dtype.torch_dtype == torch.float8_e4m3fn and experts < 1024
            and _runs(device.type, qa.dtype.torch_dtype))


def takes(quantizers, device: torch.device, out_dtype: torch.dtype, align: int,
          *widths: int) -> bool:
    """The quantize-once FP8 path takes a layer of these quantizers: all FP8 current scaling, a
    device of :data:`SCALED_GROUPED_MM_DEVICES` with FP8 tensor cores (``torch._scaled_mm``
    runs there), bf16 output, widths and the token alignment multiples of 16 (the GEMMs over
    tokens contract over whole padded groups)."""
    return (device.type in SCALED_GROUPED_MM_DEVICES and out_dtype == torch.bfloat16
            and all(fp8.takes(q) for q in quantizers)
            and all(w % 16 == 0 for w in (align, *widths)) and _per_group_runs(device))


def layout_alignment(align: int, qg, qx, device: torch.device, experts: int) -> int:
    """The row multiple of the padded layout for a layer of token alignment ``align`` on this
    path: ``align``, or where the weight gradient (``qg`` x ``qx`` operands) runs on the
    backend's grouped kernel, the least multiple of it and :data:`TOKENS_GROUP_MULTIPLE`."""
    if _route(qg, qx, device, experts) != "fp8_grouped_gemm":
        return align
    return math.lcm(align, TOKENS_GROUP_MULTIPLE)


def describe(device: torch.device | str) -> str:
    """What multiplies FP8 current scaling's grouped GEMMs on ``device`` (``quant doctor``)."""
    device = torch.device(device)
    if device.type not in SCALED_GROUPED_MM_DEVICES or not _per_group_runs(device):
        return "one GEMM per group (no FP8 tensor cores here)"
    own = f"the {backends.get(None, device).name} backend's grouped FP8 GEMM"
    n = OWN_KERNEL_MIN_EXPERTS
    per_group = CUBLAS_PER_GROUP and n
    rest = f"cuBLAS per group under {n} experts, else {own}" if per_group else own
    torch_e4m3 = _runs(device.type, torch.float8_e4m3fn)
    if torch_e4m3 and ROUTE == "scaled_grouped_mm":
        return f"quantized once; torch._scaled_grouped_mm for E4M3 x E4M3, else {rest}"
    if torch_e4m3 and ROUTE == "auto" and n:
        others = "cuBLAS per group" if per_group else own
        return (f"quantized once; under {n} experts torch._scaled_grouped_mm for E4M3 x E4M3 "
                f"and {others} for the rest, else {own}")
    return f"quantized once; {rest}"


def _per_group_runs(device: torch.device) -> bool:
    return device.type != "cuda" or tensorwise_problem(device) is None


def _fp8(t: torch.Tensor, q) -> torch.Tensor:
    return t.view(q.dtype.torch_dtype)


def _host_groups(lay) -> list[tuple[int, int, int, int]]:
    """``(start, end, padded start, padded end)`` of each group's rows (one host read)."""
    ends, pends = torch.stack([lay.offs, lay.ends]).tolist()
    return list(zip([0, *ends[:-1]], ends, [0, *pends[:-1]], pends, strict=True))


def _route(qa, qb, device: torch.device, experts: int, fp32: bool = False) -> str:
    """The path of a GEMM of ``qa`` x ``qb`` operands (the module docstring's names); an fp32
    product (``fp32``, for a bias to add before the one rounding) only the backend's kernels
    give."""
    if not fp32 and grouped_takes(qa, qb, device, experts):
        return "scaled_grouped_mm"
    if not fp32 and CUBLAS_PER_GROUP and experts < OWN_KERNEL_MIN_EXPERTS:
        return "scaled_mm_per_group"
    return "fp8_grouped_gemm"


def rows_gemm(a, sa, b, sb, lay, qa, qb, padded: bool, groups=None, fp32: bool = False,
              fast_accum: bool = False) -> torch.Tensor:
    """``[T, cols]``: group ``g``'s rows of ``a`` times ``b[g]ᵀ``, ``b [E, cols, contraction]``
    (each expert's operand, contraction contiguous); ``a`` ``[rows, contraction]`` in the padded
    layout when ``padded``, else ``[T, contraction]``. ``groups``: :func:`_host_groups`, when the
    caller has read them. bf16, or the fp32 products when ``fp32``. ``fast_accum``: the tensor
    cores may accumulate at their own width (the recipe's ``MMParams``)."""
    experts, cols = b.shape[:2]
    route = _route(qa, qb, a.device, experts, fp32)
    count_path(route)
    if route == "scaled_grouped_mm":
        out = scaled_grouped_mm(
            _fp8(a, qa), _fp8(b, qb).transpose(-2, -1),
            sa[:, 0][lay.grp if padded else lay.gid],
            sb[:, 0, None].expand(experts, cols).contiguous(), lay.ends if padded else lay.offs,
            fast_accum)
        return out[lay.dest] if padded else out
    if route == "fp8_grouped_gemm":
        return backends.get(None, a.device).fp8_grouped_rows_gemm(
            a, sa[:, 0], b, sb[:, 0], lay.offs, lay.ends if padded else lay.offs,
            total=lay.total, a_dtype=qa.dtype, b_dtype=qb.dtype,
            out_dtype=torch.float32 if fp32 else torch.bfloat16, fast_accum=fast_accum)
    out = a.new_empty((lay.total, cols), dtype=torch.bfloat16)
    av, bv = _fp8(a, qa), _fp8(b, qb)
    for g, (s, e, ps, _) in enumerate(groups or _host_groups(lay)):
        if e > s:
            at = ps if padded else s
            scaled_mm(av[at:at + e - s], bv[g].t(), sa[g, :1], sb[g, :1], out[s:e], fast_accum)
    return out


def tokens_gemm(at, sa, bt, sb, lay, qa, qb, groups=None, fast_accum: bool = False,
                group_multiple: int = 16) -> torch.Tensor:
    """``[E, m, n]``: per group ``a_gᵀ b_g`` of the transposed padded copies ``at [m, rows]`` and
    ``bt [n, rows]``, the contraction over the group's padded tokens (an empty group's are
    zeros, so is its product); ``fast_accum`` as :func:`rows_gemm`'s; ``group_multiple``: the
    row multiple of the layout ``lay`` (:func:`layout_alignment`)."""
    m, n = at.shape[0], bt.shape[0]
    route = _route(qa, qb, at.device, lay.groups)
    count_path(route)
    if route == "scaled_grouped_mm":
        return scaled_grouped_mm(_fp8(at, qa), _fp8(bt, qb).t(), sa[:, 0].repeat_interleave(m),
                                 sb[:, 0].repeat_interleave(n), lay.ends, fast_accum)
    if route == "fp8_grouped_gemm":
        return backends.get(None, at.device).fp8_grouped_tokens_gemm(
            at, sa[:, 0], bt, sb[:, 0], lay.ends, a_dtype=qa.dtype, b_dtype=qb.dtype,
            fast_accum=fast_accum, group_multiple=group_multiple)
    out = at.new_empty((lay.groups, m, n), dtype=torch.bfloat16)
    av, bv = _fp8(at, qa), _fp8(bt, qb)
    for g, (_, _, ps, pe) in enumerate(groups or _host_groups(lay)):
        scaled_mm(av[:, ps:pe], bv[:, ps:pe].t(), sa[g, :1], sb[g, :1], out[g], fast_accum)
    return out


def reads_padded_rows(qa, qb, device: torch.device, experts: int) -> bool:
    """A row-grouped GEMM of these operands reads its rows in the padded layout: it takes
    ``"scaled_grouped_mm"`` and this torch's kernel needs 16-row group starts."""
    return grouped_takes(qa, qb, device, experts) and not unpadded_rows_run(device.type)


def forward(x, lay, w, qx, qw, keep_x_t: bool, keep_w_t: bool, b=None, fast_accum: bool = False,
            x_row_amax=None, x_rows=None, w_bytes=None):
    """``(y [T, N], x_t [K, rows] | None, sx, w_t [E, K, N] | None, sw)``: the forward GEMM
    (group ``g`` of ``x [T, K]`` times ``w[g]ᵀ``, ``w [E, N, K]``, plus ``b[g]``, :mod:`.bias`;
    the groups' padded layout ``lay``; ``fast_accum`` as :func:`rows_gemm`'s), and the
    transposed bytes backward's GEMMs read (``keep_x_t`` for the weight gradient, ``keep_w_t``
    for the input gradient) with their ``scale_inv`` ``[E, SCALE_PITCH]``. ``x_row_amax``:
    the amax of each of the ``T`` rows, where the caller has it; ``x_rows [T]``: the rows are
    ``x[x_rows]``, read where they lie (:func:`.fp8.quantize_rows`). ``w_bytes``: ``(rowwise
    bytes, scale_inv)`` of ``w`` quantized by ``qw`` already, multiplied instead of quantizing
    ``w`` (then no transposed weight bytes are made)."""
    fp32 = b is not None
    padded = not fp32 and reads_padded_rows(qx, qw, x.device, w.shape[0])
    xd, xt, sx = quantize_rows(x, lay, qx, True, keep_x_t, row_padded=padded,
                               row_amax=x_row_amax, x_rows=x_rows)
    if w_bytes is None:
        wd, wt, sw = quantize_experts(w, qw, True, keep_w_t)
    else:
        (wd, sw), wt = w_bytes, None
    y = rows_gemm(xd, sx, wd, sw, lay, qx, qw, padded, fp32=fp32, fast_accum=fast_accum)
    return (y if b is None else bias.added(y, b, lay.gid, x.dtype)), xt, sx, wt, sw


def input_transposed(x, lay, qx, sx=None, x_rows=None):
    """``(x_t [K, rows], sx)``: :func:`forward`'s transposed input bytes, quantized again
    (``sx``: forward's scale-inverses, whose amaxes spare the amax pass; ``x_rows`` as
    :func:`forward`'s)."""
    _, xt, sx = quantize_rows(x, lay, qx, False, True, scale_inv=sx, x_rows=x_rows)
    return xt, sx


def weight_transposed(w, qw, sw=None):
    """``(w_t [E, K, N], sw)``: :func:`forward`'s transposed weight bytes, quantized again
    (``sw`` as :func:`input_transposed`'s ``sx``)."""
    _, wt, sw = quantize_experts(w, qw, False, True, scale_inv=sw)
    return wt, sw


def gradient_bytes(gy, lay, qg, dgrad: bool, wgrad: bool, padded: bool):
    """``(gd | None, gt [N, rows] | None, sg)``: the output gradient ``gy [T, N]`` quantized
    once by ``qg`` into the layouts the two GEMMs read: the rowwise bytes of
    :func:`input_gradient` (``dgrad``; in the padded layout when ``padded``, where its GEMM
    reads that: :func:`reads_padded_rows`), the transposed bytes of :func:`weight_gradient`
    (``wgrad``), and their scale-inverses."""
    return quantize_rows(gy, lay, qg, dgrad, wgrad, row_padded=dgrad and padded)


def input_gradient(gd, sg, lay, wt, sw, qg, qw, padded: bool, fast_dgrad: bool = False,
                   requant_w: bool = False, groups=None) -> torch.Tensor:
    """``dx [T, K]`` from :func:`gradient_bytes`' rowwise bytes ``gd`` (``padded`` as there)
    and the weight's transposed bytes ``wt``; ``requant_w``: ``wt`` is the weight itself
    (``[E, N, K]``, with forward's ``sw``), whose transposed bytes are quantized here
    (:func:`weight_transposed`) and released on return. ``groups``: as :func:`rows_gemm`'s."""
    if requant_w:
        wt, sw = weight_transposed(wt, qw, sw)
    return rows_gemm(gd, sg, wt, sw, lay, qg, qw, padded, groups, fast_accum=fast_dgrad)


def weight_gradient(gt, sg, lay, xt, sx, qg, qx, fast_wgrad: bool = False,
                    group_multiple: int = 16, requant_x: bool = False, x_rows=None,
                    groups=None) -> torch.Tensor:
    """``dw [E, N, K]`` from :func:`gradient_bytes`' transposed bytes ``gt`` and
    forward's transposed input bytes ``xt``; ``requant_x``: ``xt`` is the input itself (``[T,
    K]``, :func:`input_transposed` with ``x_rows``), quantized here. ``fast_wgrad`` and
    ``group_multiple`` as :func:`tokens_gemm`'s, ``groups`` as :func:`input_gradient`'s."""
    if requant_x:
        xt, sx = input_transposed(xt, lay, qx, sx, x_rows)
    return tokens_gemm(gt, sg, xt, sx, lay, qg, qx, groups, fast_wgrad, group_multiple)


def backward(gy, lay, xt, sx, wt, sw, qg, qx, qw, dgrad: bool, wgrad: bool,
             fast_dgrad: bool = False, fast_wgrad: bool = False, group_multiple: int = 16,
             requant_x: bool = False, requant_w: bool = False, x_rows=None):
    """``(dx [T, K] | None, dw [E, N, K] | None)`` for the output gradient ``gy [T, N]``, from
    :func:`forward`'s transposed bytes (or, with ``requant_x`` / ``requant_w``, the input and
    the weight themselves): :func:`gradient_bytes`, :func:`input_gradient`, then
    :func:`weight_gradient`. The input gradient's operands (the weight's transposed bytes, the
    gradient's rowwise bytes) are released before the weight gradient's output is made, so that
    the two never take memory at once. Compiled code runs the three as ops, so that the graph
    also releases ``gy`` (which an op that reads it cannot) once it is quantized."""
    per_group = ((dgrad and _route(qg, qw, gy.device, lay.groups) == "scaled_mm_per_group")
                 or (wgrad and _route(qg, qx, gy.device, lay.groups) == "scaled_mm_per_group"))
    groups = _host_groups(lay) if per_group else None  # one host read for both GEMMs
    padded = dgrad and reads_padded_rows(qg, qw, gy.device, lay.groups)
    gd, gt, sg = gradient_bytes(gy, lay, qg, dgrad, wgrad, padded)
    dx = (input_gradient(gd, sg, lay, wt, sw, qg, qw, padded, fast_dgrad, requant_w, groups)
          if dgrad else None)
    del wt, gd
    dw = (weight_gradient(gt, sg, lay, xt, sx, qg, qx, fast_wgrad, group_multiple, requant_x,
                          x_rows, groups) if wgrad else None)
    return dx, dw
