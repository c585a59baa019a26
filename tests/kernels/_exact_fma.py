"""A fused multiply-add for Triton's interpreter, so that the GPU-only FMA paths run on the CPU.

The interpreter computes ``tl.fma(a, b, c)`` as ``a * b + c`` in fp32, rounding twice; a GPU
rounds once. :func:`fused` rounds once: the fp32 product is exact in fp64, the fp64 sum's error is
exact (TwoSum), and a sum that lands on the midpoint of two fp32 values rounds toward the side
the error is on (the exact value is never the midpoint then). :func:`gpu_fma_paths` installs it
and turns on ``_rounding.FMA_DIVISION`` for a test (a ``monkeypatch``)."""

from __future__ import annotations

import numpy as np


def fused(a, b, c) -> np.ndarray:
    """fp32 ``a * b + c`` rounded once to nearest-even, elementwise (numpy fp32 arrays)."""
    a64, b64, c64 = (np.asarray(v, dtype=np.float64) for v in (a, b, c))
    with np.errstate(all="ignore"):
        s = a64 * b64
        t = s + c64
        v = t - s
        err = (s - (t - v)) + (c64 - v)
        r = t.astype(np.float32)
        toward = np.where(t > r.astype(np.float64), np.float32(np.inf), np.float32(-np.inf))
        other = np.nextafter(r, toward)
        midpoint = (r.astype(np.float64) + other.astype(np.float64)) / 2 == t
        up = np.maximum(r, other)
        down = np.minimum(r, other)
        fix = midpoint & (err != 0) & np.isfinite(t)
        return np.where(fix, np.where(err > 0, up, down), r).astype(np.float32)


def gpu_fma_paths(monkeypatch) -> None:
    """Make the interpreter fuse ``tl.fma`` and take the kernels' FMA division."""
    import triton.language as tl
    from quant_kernels import _rounding
    from triton.runtime import interpreter

    def create_fma(self, x, y, z):
        return interpreter.TensorHandle(fused(x.data, y.data, z.data), z.dtype.scalar)

    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_fma", create_fma)
    monkeypatch.setattr(_rounding, "FMA_DIVISION", tl.constexpr(True))
