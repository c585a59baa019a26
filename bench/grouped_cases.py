"""Which FP8 GEMM forms the running torch and Triton take on this GPU, for GroupedLinear's grouped
GEMMs, with each form's error against an fp32 product and its speed (``speed.py probe``).

Forms (DeepSeek-V3 expert widths by default: 32 experts x 2048 rows, hidden 7168, expert MLP
2048, so the gate/up GEMM is ``[2048, 7168] x [7168, 4096]`` per expert):

- ``torch._scaled_grouped_mm`` with E4M3 and with E5M2 first operands, rows grouped (fprop,
  dgrad) and contraction grouped (wgrad);
- ``torch._scaled_mm`` per group on slices of one batched buffer, E4M3 x E4M3 and E5M2 x E4M3:
  the dgrad form (row slices) and the wgrad form (column slices of the transposed buffers), with
  the per-group scale a slice of the scales or a copy of it;
- ``torch._grouped_mm`` in bf16 (the baseline) and with an fp32 output;
- a plain Triton tile kernel of one E5M2 x E4M3 product, with Hopper's fast FP8 accumulation
  and with the fp32 promotion after every MMA (``max_num_imprecise_acc``);
- quant-kernels' grouped FP8 GEMMs (rows grouped and contraction grouped) over tile configs and
  promotion intervals.

Prints one JSON line per form (``ok``, ``err`` = max |got - fp32| / max |fp32|, ``ms``,
``tflops``) and a markdown table last.
"""

from __future__ import annotations

import contextlib
import json

import steps
import torch

E4M3, E5M2 = torch.float8_e4m3fn, torch.float8_e5m2


def _fp8(shape, dtype, scale: float = 1.0):
    return (torch.randn(shape, device="cuda") * scale).to(dtype)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.float() - want).abs().max() / want.abs().max().clamp_min(1e-30))


def _time(fn) -> float:
    import triton

    return triton.testing.do_bench(fn, warmup=5, rep=40, return_mode="median")


#: ``--match``: the forms whose name contains one of these run (every form where empty)
MATCH: list[str] = []


def _row(name: str, fn, want_fn, flops: float) -> dict:
    res = {"form": name}
    if MATCH and not any(m in name for m in MATCH):
        res["skipped"] = True
        return res
    try:
        got = fn()
        torch.cuda.synchronize()
        res["ok"] = True
        res["err"] = _rel(got, want_fn())
        res["ms"] = _time(fn)
        res["tflops"] = flops / res["ms"] / 1e9
    except Exception as e:  # noqa: BLE001 - the point is which forms raise
        res["ok"] = False
        res["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
    print(json.dumps(res), flush=True)
    return res


def _forms_of(adt, e: int, m: int, k: int, n: int, offs, w, sw) -> list[dict]:
    """The forms whose first operand is ``adt``."""
    rows = []
    fl = 2.0 * e * m * n * k
    tag = "e4m3" if adt == E4M3 else "e5m2"
    a = _fp8((e * m, k), adt)
    sa = torch.rand(e, device="cuda") + 0.5
    w32 = w.float()
    want = []

    def ref():
        if not want:
            want.append(torch.cat([(a[g * m:(g + 1) * m].float() @ w32[g].t()) * sa[g] * sw[g]
                                   for g in range(e)]))
        return want[0]

    sa_rows = sa.repeat_interleave(m)
    sw_cols = sw[:, None].expand(e, n).contiguous()
    rows.append(_row(f"scaled_grouped_mm rows {tag}xe4m3", lambda: torch._scaled_grouped_mm(
        a, w.transpose(-2, -1), sa_rows, sw_cols, offs=offs, out_dtype=torch.bfloat16,
        use_fast_accum=False), ref, fl))

    def per_group(copy: bool):
        out = a.new_empty((e * m, n), dtype=torch.bfloat16)
        for g in range(e):
            s1 = sa[g:g + 1].clone() if copy else sa[g:g + 1]
            s2 = sw[g:g + 1].clone() if copy else sw[g:g + 1]
            out[g * m:(g + 1) * m] = torch._scaled_mm(
                a[g * m:(g + 1) * m], w[g].t(), scale_a=s1, scale_b=s2, out_dtype=torch.bfloat16)
        return out

    for copy in (False, True):
        rows.append(_row(f"scaled_mm per group rows {tag}xe4m3 "
                         f"scale {'copy' if copy else 'slice'}",
                         lambda copy=copy: per_group(copy), ref, fl))
    # the wgrad form: [n, e*m] (a transposed buffer) x [e*m, k], the contraction grouped
    at = _fp8((n, e * m), adt)
    xt = _fp8((k, e * m), E4M3)
    s_a = torch.rand(e, device="cuda") + 0.5
    s_x = torch.rand(e, device="cuda") + 0.5
    wwant = []

    def wref():
        if not wwant:
            wwant.append(torch.stack([(at[:, g * m:(g + 1) * m].float()
                                       @ xt[:, g * m:(g + 1) * m].float().t()) * s_a[g] * s_x[g]
                                      for g in range(e)]))
        return wwant[0]

    rows.append(_row(f"scaled_grouped_mm contraction {tag}xe4m3",
                     lambda: torch._scaled_grouped_mm(
                         at, xt.t(), s_a.repeat_interleave(n), s_x.repeat_interleave(k),
                         offs=offs, out_dtype=torch.bfloat16, use_fast_accum=False), wref, fl))

    def wper_group():
        out = at.new_empty((e, n, k), dtype=torch.bfloat16)
        for g in range(e):
            out[g] = torch._scaled_mm(at[:, g * m:(g + 1) * m], xt[:, g * m:(g + 1) * m].t(),
                                      scale_a=s_a[g:g + 1].clone(), scale_b=s_x[g:g + 1].clone(),
                                      out_dtype=torch.bfloat16)
        return out

    rows.append(_row(f"scaled_mm per group contraction {tag}xe4m3 (strided slices)",
                     wper_group, wref, fl))
    return rows


def grouped_forms(e: int, m: int, k: int, n: int) -> list[dict]:
    """Rows grouped (``[e*m, k] x [e, k, n]``) and contraction grouped (``[n, e*m] x [e*m,
    k]``), every form."""
    offs = torch.arange(1, e + 1, device="cuda", dtype=torch.int32) * m
    w = _fp8((e, n, k), E4M3)  # each expert's [n, k]: its transpose is column-major
    sw = torch.rand(e, device="cuda") + 0.5
    rows = [r for adt in (E4M3, E5M2) for r in _forms_of(adt, e, m, k, n, offs, w, sw)]
    # bf16 baselines and an fp32 output
    ab = torch.randn(e * m, k, device="cuda", dtype=torch.bfloat16)
    wb = torch.randn(e, n, k, device="cuda", dtype=torch.bfloat16)
    bwant = []

    def bref():
        if not bwant:
            bwant.append(torch.cat([ab[g * m:(g + 1) * m].float() @ wb[g].float().t()
                                    for g in range(e)]))
        return bwant[0]

    fl = 2.0 * e * m * n * k
    rows.append(_row("grouped_mm bf16", lambda: torch._grouped_mm(
        ab, wb.transpose(-2, -1), offs=offs), bref, fl))
    rows.append(_row("grouped_mm bf16 -> fp32 out", lambda: torch._grouped_mm(
        ab, wb.transpose(-2, -1), offs=offs, out_dtype=torch.float32), bref, fl))
    return rows


def triton_forms(m: int, k: int, n: int) -> list[dict]:
    """One E5M2 x E4M3 product through a plain Triton tile kernel, with the second operand
    stored ``[n, k]`` (contiguous along the contraction, K-major: what Hopper's FP8 tensor-core
    instructions read) or ``[k, n]`` (contiguous along the output columns, MN-major: a weight's
    rowwise copy read for the input gradient, which Triton must reorder on the way to the
    tensor cores), promoted every 128 products or with fast accumulation."""
    import triton
    import triton.language as tl

    @triton.jit
    def mm(a_ptr, b_ptr, c_ptr, M, N, K, FAST: tl.constexpr, BM: tl.constexpr,
           BN: tl.constexpr, BK: tl.constexpr, GROUP: tl.constexpr, B_KN: tl.constexpr):
        pid = tl.program_id(0)
        npm, npn = tl.cdiv(M, BM), tl.cdiv(N, BN)
        width = GROUP * npn
        gid = pid // width
        first = gid * GROUP
        size = min(npm - first, GROUP)
        pm = first + (pid % width) % size
        pn = (pid % width) // size
        rm = pm * BM + tl.arange(0, BM)
        rn = pn * BN + tl.arange(0, BN)
        rk = tl.arange(0, BK)
        acc = tl.zeros((BM, BN), tl.float32)
        for k0 in range(0, K, BK):
            a = tl.load(a_ptr + rm[:, None] * K + (k0 + rk)[None, :])
            if B_KN:
                b = tl.load(b_ptr + (k0 + rk)[:, None] * N + rn[None, :])
            else:
                b = tl.load(b_ptr + rn[None, :] * K + (k0 + rk)[:, None])
            if FAST:  # Triton's default: Hopper's fast accumulation over the whole K
                acc = tl.dot(a, b, acc)
            else:  # Triton takes no interval past the tile's K: promoted every 128
                acc = tl.dot(a, b, acc, max_num_imprecise_acc=128)
        tl.store(c_ptr + rm[:, None] * N + rn[None, :], acc.to(tl.bfloat16))

    a = _fp8((m, k), E5M2)
    b = _fp8((n, k), E4M3)
    b_kn = b.t().contiguous()
    want = a.float() @ b.float().t()
    rows = []
    for kn in (False, True):
        for fast in (False, True):
            for bm, bn, bk, warps, stages in ((128, 256, 128, 8, 3), (128, 256, 128, 8, 4),
                                              (128, 128, 128, 4, 4)):
                c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
                grid = (triton.cdiv(m, bm) * triton.cdiv(n, bn),)

                def run(c=c, grid=grid, bm=bm, bn=bn, bk=bk, warps=warps, stages=stages,
                        fast=fast, kn=kn):
                    mm[grid](a, b_kn if kn else b, c, m, n, k, FAST=fast, BM=bm,
                             BN=bn, BK=bk, GROUP=8, B_KN=kn, num_warps=warps,
                             num_stages=stages)
                    return c
                acc = "fast" if fast else "promoted"
                rows.append(_row(f"triton e5m2xe4m3 b [{'k, n' if kn else 'n, k'}] {acc} "
                                 f"{bm}x{bn}x{bk} w{warps} s{stages}", run, lambda: want,
                                 2.0 * m * n * k))
    return rows


#: The own kernels' sweep: tile configs (PROMOTE -1: fast accumulation; COLS_FASTEST, the rows
#: kernel's program order, is left out of the contraction kernel's).
OWN_CONFIGS = tuple({"BM": 128, "BN": 256, "BK": 128, "PROMOTE": 128, "num_warps": 8,
                     "num_stages": 4, "tma": 1, "COLS_FASTEST": 1, **c} for c in (
    {"tma": 0, "BN": 128, "COLS_FASTEST": 0}, {"COLS_FASTEST": 0}, {}, {"num_stages": 3},
    {"BN": 128}, {"BN": 128, "COLS_FASTEST": 0}, {"BM": 64, "BN": 128, "num_warps": 4},
    {"BM": 64, "BN": 256, "num_warps": 4, "num_stages": 3}, {"PROMOTE": -1},
    # tiles whose pipeline fits twice in shared memory: two programs per SM, one's epilogue
    # under the other's main loop
    {"BN": 128, "num_stages": 3}, {"BN": 128, "num_stages": 3, "COLS_FASTEST": 0},
    {"BN": 128, "BK": 64, "num_stages": 5}, {"BM": 64, "BN": 128, "num_warps": 4,
                                               "num_stages": 4},
    # two promoted chunks a main-loop step: the second's MMAs under the first one's fp32 adds
    {"BN": 128, "CHUNKS": 2, "num_stages": 3},
    {"BN": 128, "CHUNKS": 2, "num_stages": 3, "COLS_FASTEST": 0},
    {"CHUNKS": 2, "num_stages": 2}, {"CHUNKS": 2, "num_stages": 2, "COLS_FASTEST": 0},
    # the tile multiplied as two halves of its columns: a promoted partial sum of half the
    # tile (the whole tile's and its accumulator's registers exceed a thread's and spill)
    {"SPLIT": 2}, {"SPLIT": 2, "num_stages": 3}, {"SPLIT": 2, "COLS_FASTEST": 0},
    {"BN": 128, "num_warps": 4, "num_stages": 3}, {"BN": 128, "num_warps": 4, "num_stages": 3,
                                                   "SPLIT": 2}))


def group_rows(e: int, m: int, ragged: bool, multiple: int = 16, skew: float = 0.3) -> list[int]:
    """``e`` groups of ``m`` rows, or (``ragged``) as a router skews them: multinomial draws
    around ``m`` on average, the experts' weights ``exp(skew * N(0, 1))``; rounded up to
    multiples of ``multiple`` (the padded layout's groups)."""
    if not ragged:
        return [-(-m // multiple) * multiple] * e
    gen = torch.Generator().manual_seed(0)
    weights = torch.exp(torch.randn(e, generator=gen) * skew)
    counts = torch.multinomial(weights, e * m, replacement=True, generator=gen).bincount(
        minlength=e)
    return [-(-int(c) // multiple) * multiple for c in counts]


def own_forms(counts: list[int], k: int, n: int, multiple: int = 16) -> list[dict]:
    """quant-kernels' grouped FP8 GEMMs (E5M2 x E4M3, HYBRID's gradient GEMMs) at the rows
    form and the contraction form, over tile configs and promotion intervals, with groups of
    ``counts`` rows; the contraction form told the groups' row multiple is 16 (descriptors made
    per program) and, where ``multiple`` is more, that multiple (host descriptors where it is
    a multiple of the tile's chunk)."""
    from quant_core.dtypes import DType
    from quant_kernels import configs
    from quant_kernels import fp8_grouped_gemm as kern

    e, total = len(counts), sum(counts)
    offs = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
    spans = list(zip([0, *offs.tolist()[:-1]], offs.tolist(), strict=True))
    a = _fp8((total, k), E5M2)
    w = _fp8((e, n, k), E4M3)
    at, bt = _fp8((n, total), E5M2), _fp8((k, total), E4M3)
    sa, sb = torch.rand(e, device="cuda") + 0.5, torch.rand(e, device="cuda") + 0.5
    u8 = (lambda t: t.view(torch.uint8))
    kw = {"a_dtype": DType.E5M2, "b_dtype": DType.E4M3}
    rows_want, tok_want = [], []
    flops = 2.0 * total * n * k

    def rows_ref():
        if not rows_want:
            rows_want.append(torch.cat([(a[s:t].float() @ w[g].float().t()) * sa[g] * sb[g]
                                        for g, (s, t) in enumerate(spans)]))
        return rows_want[0]

    def tok_ref():
        if not tok_want:
            tok_want.append(torch.stack([(at[:, s:t].float() @ bt[:, s:t].float().t())
                                         * sa[g] * sb[g] for g, (s, t) in enumerate(spans)]))
        return tok_want[0]

    out = []
    for cfg in OWN_CONFIGS:
        cfg = {**cfg, "PROMOTE": min(cfg["PROMOTE"], cfg["BK"])}
        tokens_cfg = {k: v for k, v in cfg.items() if k not in ("COLS_FASTEST", "CHUNKS")}
        tag = (f"{cfg['BM']}x{cfg['BN']}x{cfg['BK']} w{cfg['num_warps']} s{cfg['num_stages']} "
               f"promote {cfg['PROMOTE']}{' chunks 2' if cfg.get('CHUNKS') == 2 else ''}"
               f"{' halves' if cfg.get('SPLIT') == 2 else ''}")
        loads = {0: "pointers", 1: "tma"}
        # the config's order whatever the expert's bytes, so that the sweep measures both
        with configs.overridden("fp8_grouped_rows_gemm", cfg), steps.columns_first():
            out.append(_row(f"own rows {tag} {loads[cfg['tma']]} "
                            f"cols {'first' if cfg['COLS_FASTEST'] else 'last'}",
                            lambda: kern.fp8_grouped_rows_gemm(
                                u8(a), sa, u8(w), sb, offs, offs, total=total, **kw),
                            rows_ref, flops))
        if not cfg["COLS_FASTEST"] or "CHUNKS" in cfg:  # the rows kernel's own choices
            continue
        for gm in sorted({16, multiple}):
            host = cfg["tma"] and gm % cfg["BK"] == 0
            form = "host tma" if host else loads[cfg["tma"]]
            with tokens_overridden(tokens_cfg), steps.wgrad_columns_first():
                out.append(_row(f"own tokens {tag} {form} (groups of {gm})",
                                lambda gm=gm: kern.fp8_grouped_tokens_gemm(
                    u8(at), sa, u8(bt), sb, offs, **kw, group_multiple=gm), tok_ref, flops))
    return out


#: The weight-gradient kernel's tile configs (``--wgrad``).
WGRAD_CONFIGS = tuple({"BM": 128, "BN": 256, "BK": 128, "PROMOTE": 128, "num_warps": 8,
                       "num_stages": 4, "tma": 1, **c} for c in (
    {}, {"num_stages": 3}, {"BN": 128}, {"BN": 128, "num_stages": 6},
    # two programs per SM (shared memory and registers for two): one's store under the other's
    # main loop
    {"BN": 128, "num_warps": 4, "num_stages": 3}, {"BN": 128, "num_warps": 4, "num_stages": 2},
    {"BM": 64, "BN": 256, "num_warps": 4, "num_stages": 3},
    # the programs that run together share a column tile and sweep a's rows
    {"ROWS_FASTEST": 1}, {"BN": 128, "ROWS_FASTEST": 1},
    {"BN": 128, "num_warps": 4, "num_stages": 3, "ROWS_FASTEST": 1},
    # two halves of the tile's columns (:data:`OWN_CONFIGS`)
    {"SPLIT": 2}, {"SPLIT": 2, "num_stages": 3}, {"SPLIT": 2, "ROWS_FASTEST": 1},
    {"BN": 128, "num_warps": 4, "num_stages": 3, "SPLIT": 2}))


@contextlib.contextmanager
def tokens_overridden(cfg: dict):
    """The weight-gradient kernel runs ``cfg`` whatever its group rows (both of its configs)."""
    from quant_kernels import configs

    with configs.overridden("fp8_grouped_tokens_gemm", cfg), \
            configs.overridden("fp8_grouped_tokens_gemm_short", cfg):
        yield


def wgrad_forms(counts: list[int], m: int, n: int) -> list[dict]:
    """The weight-gradient GEMM of groups of ``counts`` rows (E5M2 x E4M3, HYBRID's): bf16
    ``torch._grouped_mm`` (the baseline) and quant-kernels' grouped FP8 tokens GEMM over
    :data:`WGRAD_CONFIGS`; output ``[E, m, n]``."""
    from quant_core.dtypes import DType
    from quant_kernels import fp8_grouped_gemm as kern

    e, total = len(counts), sum(counts)
    offs = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
    spans = list(zip([0, *offs.tolist()[:-1]], offs.tolist(), strict=True))
    at, bt = _fp8((m, total), E5M2), _fp8((n, total), E4M3)
    sa, sb = torch.rand(e, device="cuda") + 0.5, torch.rand(e, device="cuda") + 0.5
    flops, want = 2.0 * total * m * n, []

    def products():
        if not want:
            want.append(torch.stack([at[:, s:t].float() @ bt[:, s:t].float().t()
                                     for s, t in spans]))
        return want[0]

    def ref():
        return products() * (sa * sb)[:, None, None]

    # as autograd's weight gradient of torch._grouped_mm reads them: token-major rows
    ab, bb = (t.to(torch.bfloat16).t().contiguous() for t in (at, bt))
    out = [_row("bf16 torch._grouped_mm wgrad",
                lambda: torch._grouped_mm(ab.t(), bb, offs=offs), products, flops)]
    u8 = (lambda t: t.view(torch.uint8))
    for cfg in WGRAD_CONFIGS:
        tag = (f"{cfg['BM']}x{cfg['BN']}x{cfg['BK']} w{cfg['num_warps']} s{cfg['num_stages']}"
               f"{' halves' if cfg.get('SPLIT') == 2 else ''}"
               f"{' rows first' if cfg.get('ROWS_FASTEST') else ''}")
        with tokens_overridden(cfg), steps.wgrad_columns_first():
            out.append(_row(f"own wgrad {tag}", lambda: kern.fp8_grouped_tokens_gemm(
                u8(at), sa, u8(bt), sb, offs, a_dtype=DType.E5M2, b_dtype=DType.E4M3),
                ref, flops))
    return out


#: The grouped current-scaling quantize's sweep: (amax tile, cast tile) configs.
CAST_CONFIGS = tuple(({"BM": 32, "BK": 256, "num_warps": 4, **a}, {"BM": 64, "BK": 128,
                                                                  "num_warps": 4, **c})
                     for a, c in (({}, {}), ({"BM": 64, "num_warps": 8}, {}),
                                  ({}, {"BM": 128, "BK": 64}), ({}, {"BM": 64, "BK": 64}),
                                  ({}, {"BM": 128, "BK": 128, "num_warps": 8}),
                                  ({}, {"BM": 32, "BK": 256})))


def cast_forms(counts: list[int], k: int) -> list[dict]:
    """The grouped FP8 quantize of ``sum(counts)`` bf16 rows of width ``k`` (the backend's
    ``fp8_group_quantize_rows``: rowwise in place and transposed padded, as the forward's input
    takes it), over :data:`CAST_CONFIGS`; ``tflops`` is the share of a bf16 copy of the input
    (reads and writes the same bytes, so the floor of the quantize's traffic is 1.5 copies)."""
    from quant_core.dtypes import DType
    from quant_kernels import configs
    from quant_kernels import fp8_grouped as kern
    from quant_recipes.moe import fp8

    total = sum(counts)
    offs = torch.tensor(counts, device="cuda").cumsum(0).to(torch.int32)
    lay = fp8.layout(offs, total, 16)
    x = torch.randn(total, k, device="cuda", dtype=torch.bfloat16)
    copy_ms = _time(lambda: x.clone())
    out, first = [], None
    for amax_cfg, cast_cfg in CAST_CONFIGS:
        def run():
            return kern.fp8_group_quantize_rows(
                x, lay.gid, lay.src, lay.grp, groups=len(counts), fp8_dtype=DType.E4M3,
                force_pow_2_scales=False, amax_epsilon=0.0, rowwise=True, columnwise=True,
                row_padded=False, scale_pitch=4)[1]
        with configs.overridden("fp8_group_amax", amax_cfg), \
                configs.overridden("fp8_group_cast", cast_cfg):
            got = run().float()
            first = first if out else got  # every config's bytes against the first's
            res = _row(f"group quantize amax {amax_cfg} cast {cast_cfg} (copy {copy_ms:.3f} ms)",
                       run, lambda f=first: f, 0.0)
            if res.get("ok"):
                res["tflops"] = copy_ms / res["ms"]
            out.append(res)
    return out


#: The one-pass expert cast's sweep: (name, config overrides); ``None``: the two passes.
EXPERT_CAST_CONFIGS = (("two passes (amax, then cast)", None),
                       ("one pass", {}),
                       ("one pass, BM 32 BK 256", {"BM": 32, "BK": 256}),
                       ("one pass, BM 128 BK 64", {"BM": 128, "BK": 64}),
                       ("one pass, BM 128 BK 128, 8 warps", {"BM": 128, "BK": 128,
                                                             "num_warps": 8}))


def cast_experts(w: torch.Tensor, experts: int):
    """FP8 current scaling's per-expert quantize of ``w [experts * n, k]`` as a forward without
    kept amaxes takes it (the backend's ``fp8_group_quantize_experts``, E4M3, rowwise and
    transposed): ``(data, transposed data, scale-inverses)``."""
    from quant_core.dtypes import DType
    from quant_kernels import fp8_grouped_experts

    return fp8_grouped_experts.fp8_group_quantize_experts(
        w, groups=experts, fp8_dtype=DType.E4M3, force_pow_2_scales=False, amax_epsilon=0.0,
        rowwise=True, columnwise=True, scale_pitch=4)


def expert_cast_forms(experts: int, n: int, k: int) -> list[dict]:
    """The per-expert FP8 quantize of bf16 expert weights ``[experts, n, k]`` as a forward
    without kept amaxes takes it (the backend's ``fp8_group_quantize_experts``, rowwise and
    transposed) in two passes and in one; ``tflops`` is the share of a bf16 copy's speed (the
    one pass moves a copy's bytes, the two passes 1.5 copies')."""
    from quant_kernels import configs

    w = torch.randn(experts * n, k, device="cuda", dtype=torch.bfloat16)
    copy_ms = _time(lambda: w.clone())
    base = configs.TABLE["fp8_expert_cast"]["gpu"]
    out, first = [], None
    for name, cfg in EXPERT_CAST_CONFIGS:
        def run():
            return cast_experts(w, experts)[1]
        passes = steps.two_pass_experts() if cfg is None else contextlib.nullcontext()
        with passes, configs.overridden("fp8_expert_cast", {**base, **(cfg or {})}):
            got = run().float()
            first = first if out else got  # every form's bytes against the first's
            res = _row(f"experts {name} (copy {copy_ms:.3f} ms)", run, lambda f=first: f, 0.0)
        if res.get("ok"):
            res["tflops"] = copy_ms / res["ms"]
        out.append(res)
    return out


def main(args) -> None:
    """The forms ``speed.py probe``'s options select: a JSON line each, then the table."""
    print(json.dumps({"torch": torch.__version__, "gpu": torch.cuda.get_device_name()}))
    MATCH[:] = [m for m in (args.match or "").split(",") if m]
    if args.triton_only:
        rows = triton_forms(args.rows, args.hidden, args.out)
        _table(rows)
        return
    rows = [] if args.own else grouped_forms(args.experts, args.rows, args.hidden, args.out)
    rows += [] if args.own or args.no_triton else triton_forms(args.rows, args.hidden, args.out)
    counts = group_rows(args.experts, args.rows, args.ragged, args.multiple, args.skew)
    print(json.dumps({"group_rows": {"min": min(counts), "max": max(counts),
                                     "total": sum(counts)}}))
    if args.experts_cast:
        rows += expert_cast_forms(args.experts, args.out, args.hidden)
    elif args.wgrad:
        rows += wgrad_forms(counts, args.out, args.hidden)
    else:
        rows += (cast_forms(counts, args.hidden) if args.cast
                 else own_forms(counts, args.hidden, args.out, args.multiple))
    _table(rows)


def _table(rows: list[dict]) -> None:
    """The forms' table: whether each ran, its error, ms and TFLOP/s."""
    print("| form | runs | max rel err | ms | TFLOP/s |\n| --- | --- | --- | --- | --- |")
    for r in rows:
        if r.get("skipped"):
            continue
        if r["ok"]:
            rate = f"{r['tflops']:.{0 if r['tflops'] >= 10 else 2}f}"
            print(f"| {r['form']} | yes | {r['err']:.2e} | {r['ms']:.3f} | {rate} |")
        else:
            print(f"| {r['form']} | no: {r['error'][:90]} | - | - | - |")
