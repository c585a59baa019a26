"""What FSDP2 all-gathers, counted at its collective: the probe of the tests that pin the bytes
a quantized all-gather sends."""

from __future__ import annotations

import contextlib

import torch.distributed as dist


@contextlib.contextmanager
def count_all_gathers():
    """Measure what FSDP2 all-gathers, whatever the parameters: inside, every call of
    ``torch.distributed.all_gather_single`` / ``all_gather_into_tensor`` (FSDP2's collective,
    by torch release) appends its output's bytes to the yielded list (an inner call made by the
    other is not counted twice). Patches ``torch.distributed`` for the duration."""
    counted: list[int] = []
    names = [n for n in ("all_gather_single", "all_gather_into_tensor") if hasattr(dist, n)]
    originals = {n: getattr(dist, n) for n in names}
    depth = [0]

    def counting(orig):
        def call(output_tensor, input_tensor, *args, **kwargs):
            if not depth[0]:
                counted.append(output_tensor.numel() * output_tensor.element_size())
            depth[0] += 1
            try:
                return orig(output_tensor, input_tensor, *args, **kwargs)
            finally:
                depth[0] -= 1
        return call

    for n, orig in originals.items():
        setattr(dist, n, counting(orig))
    try:
        yield counted
    finally:
        for n, orig in originals.items():
            setattr(dist, n, orig)
