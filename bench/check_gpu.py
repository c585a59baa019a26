"""GPU conformance: every Triton kernel against the reference on large random tensors (bitwise),
and each elementwise encoder over all 2^32 fp32 bit patterns (chunks of 2^29): the software FP8
and bf16 encoders AND the native-cast ones the kernels use on GPU (``_common.NATIVE_CASTS``).

Run on a CUDA machine: ``PYTHONPATH=packages/quant-core/src:packages/quant-kernels/src
python bench/check_gpu.py [format ...]`` (formats: fp8_tensor mxfp8 fp8_block nvfp4; naming
some skips the encoder sweeps). Prints one mismatch count per check (goal: 0 everywhere).
"""

from __future__ import annotations

import sys
import time

import torch
import triton
from quant_core import reference as ref
from quant_core.dtypes import DType
from quant_core.reference._rounding import (
    compute_scale_from_amax,
    e2m1_encode,
    e8m0_roundup,
    fp8_encode,
)
from quant_kernels._common import native_bf16, native_fp8
from quant_kernels.backend import BACKEND as B
from quant_kernels.encoders import encode

DEV = "cuda"
FLT_MAX = 3.4028234663852886e38
RESULTS: list[tuple[str, int]] = []


def report(name: str, mismatches: int) -> None:
    RESULTS.append((name, mismatches))
    print(f"{name:60s} mismatches={mismatches}", flush=True)


def count(got, want, fp8: DType | None = None) -> int:
    """Mismatching elements; FP8 bytes and floats compare NaN by NaN-ness."""
    if want is None:
        return 0 if got is None else 1
    if got.shape != want.shape:
        return max(got.numel(), want.numel(), 1)
    if fp8 is not None and want.dtype == torch.uint8:
        gn = torch.isnan(got.view(fp8.torch_dtype).float())
        wn = torch.isnan(want.view(fp8.torch_dtype).float())
        return int(((got != want) & ~wn).sum() + (gn != wn).sum())
    if want.dtype.is_floating_point:
        iv = torch.int32 if want.dtype == torch.float32 else torch.int16
        gn, wn = torch.isnan(got), torch.isnan(want)
        return int(((got.view(iv) != want.view(iv)) & ~wn).sum() + (gn != wn).sum())
    return int((got != want).sum())


def sweep_encoders(chunk_log2: int = 29) -> None:
    """All 2^32 fp32 patterns through each shared encoder (software and native paths) vs the
    reference encoders; FP8 NaN bytes and bf16 NaNs compare by NaN-ness."""
    chunk = 1 << chunk_log2
    rules = ("e4m3", "e5m2", "e4m3_native", "e5m2_native", "e8m0", "e2m1", "bf16", "bf16_native",
             "pow2_scale_e4m3", "pow2_scale_e5m2")
    totals = dict.fromkeys(rules, 0)
    nan_bytes = dict.fromkeys(rules, 0)  # NaN inputs whose byte is a NaN other than 0x7F
    t0 = time.time()
    for start in range(0, 1 << 32, chunk):
        bits = torch.arange(start, start + chunk, dtype=torch.int64, device=DEV)
        v = torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32).view(torch.float32)
        del bits
        nan = torch.isnan(v)
        for fp8 in (DType.E4M3, DType.E5M2):
            want = fp8_encode(v, fp8).to(torch.int32)
            for rule in (fp8.name.lower(), fp8.name.lower() + "_native"):
                got = encode(v, rule)
                gnan = torch.isnan(got.to(torch.uint8).view(fp8.torch_dtype).float())
                totals[rule] += int(((got != want) & ~nan).sum() + (gnan != nan).sum())
                nan_bytes[rule] += int(((got != want) & nan).sum())
                del got, gnan
            del want
        want = v.to(torch.bfloat16).float().view(torch.int32)
        for rule in ("bf16", "bf16_native"):
            got = encode(v, rule)
            gnan = torch.isnan(got.view(torch.float32))
            totals[rule] += int(((got != want) & ~nan).sum() + (gnan != nan).sum())
            del got, gnan
        del want
        a = v.abs()
        totals["e8m0"] += int((encode(a, "e8m0") != e8m0_roundup(a).to(torch.int32)).sum())
        del a
        totals["e2m1"] += int((encode(v, "e2m1") != e2m1_encode(v).to(torch.int32)).sum())
        a = v.abs()
        for fp8 in (DType.E4M3, DType.E5M2):
            want = compute_scale_from_amax(a, fp8.max, force_pow_2_scales=True,
                                           amax_epsilon=0.0, value_for_inf=FLT_MAX)
            rule = f"pow2_scale_{fp8.name.lower()}"
            totals[rule] += int((encode(a, rule) != want.view(torch.int32)).sum())
        del a
        del v, nan
        torch.cuda.empty_cache()
    for rule, n in totals.items():
        report(f"exhaustive 2^32 {rule}", n)
    odd_nan = ", ".join(f"{r} {nan_bytes[r]}" for r in rules[:4])
    print(f"(sweep took {time.time() - t0:.1f} s; NaN inputs given a NaN byte other than the "
          f"reference's 0x7F: {odd_nan})")
    bad_native = [r for r in rules if r.endswith("_native") and totals[r]]
    if bad_native:
        print(f"NATIVE CAST MISMATCH in {bad_native}: set quant_kernels._common."
              "NATIVE_FP8_CASTS (e4m3/e5m2) or NATIVE_BF16_CASTS (bf16) to False")


def check_decoders() -> None:
    """All 256 FP8 bytes through the dequantize kernel (scale 1, fp32 out) vs the reference:
    the kernels widen FP8 with the native cast on GPU (``_rounding.fp8_decode``)."""
    b = torch.arange(256, dtype=torch.uint8, device=DEV).reshape(1, 256)
    one = torch.ones(1, device=DEV)
    for fp8 in (DType.E4M3, DType.E5M2):
        kw = dict(fp8_dtype=fp8, dtype=torch.float32)
        report(f"fp8 decode, all 256 bytes, {fp8.name}",
               count(B.fp8_dequantize(b, one, **kw), ref.fp8_dequantize(b, one, **kw)))


def make(m: int, k: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator(device=DEV).manual_seed(seed)
    x = torch.randn(m, k, generator=g, device=DEV)
    x *= torch.exp2(torch.randint(-10, 11, (m, 1), generator=g, device=DEV).float())
    x[0, :8] = torch.tensor([float("nan"), float("inf"), -float("inf"), -0.0, 1e-40, 500.0,
                             3e38, 2.0**-133], device=DEV)
    x[1] = 0.0
    return x.to(dtype)


def check_fp8_tensor(x: torch.Tensor, tag: str) -> None:
    report(f"amax {tag}", count(B.amax(x), ref.amax(x)))
    for fp8 in (DType.E4M3, DType.E5M2):
        a = ref.amax(x)
        s = ref.current_scale(a, fp8_dtype=fp8, force_pow_2_scales=False, amax_epsilon=0.0)
        n = 0
        for av in (a, torch.zeros_like(a), torch.full_like(a, float("inf")), a * 2.0**-140):
            for p2 in (False, True):
                kw = dict(fp8_dtype=fp8, force_pow_2_scales=p2, amax_epsilon=0.0)
                n += count(B.current_scale(av, **kw), ref.current_scale(av, **kw))
        report(f"current_scale {fp8.name} {tag}", n)
        ga, wa = torch.zeros(1, device=DEV), torch.zeros(1, device=DEV)
        got = B.fp8_quantize(x, s, fp8_dtype=fp8, rowwise=True, columnwise=True, amax_out=ga)
        want = ref.fp8_quantize(x, s, fp8_dtype=fp8, rowwise=True, columnwise=True, amax_out=wa)
        n = sum(count(g, w, fp8) for g, w in zip(got, want, strict=True)) + count(ga, wa)
        report(f"fp8 per-tensor {fp8.name} {tag}", n)
        n = count(B.fp8_dequantize(got[0], got[2], fp8_dtype=fp8, dtype=x.dtype),
                  ref.fp8_dequantize(want[0], want[2], fp8_dtype=fp8, dtype=x.dtype))
        report(f"fp8 per-tensor dequant {fp8.name} {tag}", n)


def _one_direction(x: torch.Tensor, tag: str, fn, kw: dict) -> None:
    for fp8 in (DType.E4M3, DType.E5M2):
        for rw, cw in ((True, False), (False, True)):
            k2 = dict(kw, fp8_dtype=fp8, rowwise=rw, columnwise=cw)
            rfn = getattr(ref, fn.__name__)
            n = sum(count(g, w, fp8) for g, w in zip(fn(x, **k2), rfn(x, **k2), strict=True))
            report(f"{fn.__name__} {fp8.name} row={rw} col={cw} {tag}", n)


def _both_directions(x: torch.Tensor, fp8: DType, fmt: str, qkw: dict, dqkw: dict) -> int:
    """Mismatches of ``<fmt>_quantize(x)`` (rowwise and columnwise) against the reference, plus
    those of dequantizing each direction back."""
    kw = dict(qkw, fp8_dtype=fp8, rowwise=True, columnwise=True)
    got = getattr(B, f"{fmt}_quantize")(x, **kw)
    want = getattr(ref, f"{fmt}_quantize")(x, **kw)
    n = sum(count(g, w, fp8) for g, w in zip(got, want, strict=True))
    for cw, gd, wd in ((False, got[:2], want[:2]), (True, got[2:], want[2:])):
        kd = dict(dqkw, fp8_dtype=fp8, columnwise=cw, dtype=x.dtype)
        n += count(getattr(B, f"{fmt}_dequantize")(*gd, **kd),
                   getattr(ref, f"{fmt}_dequantize")(*wd, **kd))
    return n


def check_mxfp8(x: torch.Tensor, tag: str) -> None:
    _one_direction(x, tag, B.mxfp8_quantize, dict(with_2d_quantization=False, swizzle=True))
    for fp8 in (DType.E4M3, DType.E5M2):
        for two_d in (False, True):
            for sw in (False, True):
                n = _both_directions(x, fp8, "mxfp8",
                                     dict(with_2d_quantization=two_d, swizzle=sw),
                                     dict(swizzled=sw))
                report(f"mxfp8 {fp8.name} 2d={two_d} swizzle={sw} (+dequant) {tag}", n)


def check_fp8_block(x: torch.Tensor, tag: str) -> None:
    _one_direction(x, tag, B.fp8_block_quantize,
                   dict(block_scaling_dim=1, amax_epsilon=0.0, force_pow_2_scales=False))
    for fp8 in (DType.E4M3, DType.E5M2):
        for dim in (1, 2):
            n = _both_directions(x, fp8, "fp8_block",
                                 dict(block_scaling_dim=dim, force_pow_2_scales=True,
                                      amax_epsilon=0.0), dict(block_scaling_dim=dim))
            report(f"fp8 block dim={dim} {fp8.name} (+dequant) {tag}", n)


def check_nvfp4(x: torch.Tensor, tag: str) -> None:
    seed = torch.tensor([987654321], dtype=torch.int64, device=DEV)
    for rht, two_d, sr in ((False, False, False), (False, True, False), (False, False, True),
                           (True, False, False), (True, False, True)):
        if rht and x.dtype != torch.bfloat16:
            continue
        ka = dict(rowwise=True, columnwise=True, with_rht=rht, rht_sign_mask=0xD7E8)
        ga, wa = B.nvfp4_amax(x, **ka), ref.nvfp4_amax(x, **ka)
        n = count(ga[0], wa[0]) + count(ga[1], wa[1])
        kw = dict(ka, with_2d_quantization=two_d, stochastic_rounding=sr, rng_seed=seed,
                  swizzle=sr)
        got = B.nvfp4_quantize(x, wa[0], wa[1], **kw)
        want = ref.nvfp4_quantize(x, wa[0], wa[1], **kw)
        n += sum(count(g, w) for g, w in zip(got, want, strict=True))
        n += count(B.nvfp4_dequantize(got[0], got[1], wa[0], swizzled=sr, dtype=x.dtype),
                   ref.nvfp4_dequantize(want[0], want[1], wa[0], swizzled=sr, dtype=x.dtype))
        report(f"nvfp4 rht={rht} 2d={two_d} sr={sr} (+amax, dequant) {tag}", n)


FORMATS = {"fp8_tensor": check_fp8_tensor, "mxfp8": check_mxfp8, "fp8_block": check_fp8_block,
           "nvfp4": check_nvfp4}


def check_formats(m: int, k: int, formats: list[str]) -> None:
    for dtype in (torch.bfloat16, torch.float32):
        x = make(m, k, dtype, seed=m + k)
        tag = f"{m}x{k} {str(dtype)[6:]}"
        for name in formats:
            FORMATS[name](x, tag)
        torch.cuda.empty_cache()


def main() -> int:
    print(torch.cuda.get_device_name(), "torch", torch.__version__, "triton", triton.__version__,
          "native casts in kernels: fp8", native_fp8(), "bf16", native_bf16(), flush=True)
    t0 = time.time()
    formats = sys.argv[1:] or list(FORMATS)
    if not sys.argv[1:]:
        sweep_encoders()
        check_decoders()
    check_formats(4096, 4096, formats)
    check_formats(1040, 2080, formats)  # ragged M for 32 / 128 blocks
    print(f"(checks took {time.time() - t0:.1f} s)")
    bad = [(n, c) for n, c in RESULTS if c]
    print(f"CHECKS {len(RESULTS)}, with mismatches: {len(bad)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
