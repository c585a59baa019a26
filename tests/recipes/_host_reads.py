"""A context that fails on any read of a tensor's values by the host (``.item()``, ``.tolist()``,
``bool()``, ``int()``, ``float()``, ``.numpy()``, indexing a list by a tensor): on a GPU each
would stall the host until the device catches up, once per step. Reads made by Triton's CPU
interpreter, which stands in for the GPU, are allowed."""

from __future__ import annotations

import os
import sys

import torch
from torch.overrides import TorchFunctionMode

_READS = {torch.Tensor.item, torch.Tensor.tolist, torch.Tensor.__bool__, torch.Tensor.__int__,
          torch.Tensor.__float__, torch.Tensor.__index__, torch.Tensor.numpy,
          torch.Tensor.__array__}
_TRITON = os.sep + "triton" + os.sep


def _caller() -> str:
    """The file of the innermost frame outside torch (what asked for the read)."""
    frame = sys._getframe(2)
    while frame is not None and (os.sep + "torch" + os.sep) in frame.f_code.co_filename:
        frame = frame.f_back
    return frame.f_code.co_filename if frame is not None else ""


class HostReads(TorchFunctionMode):
    """Record every host read of tensor values outside the Triton interpreter."""

    def __init__(self):
        super().__init__()
        self.reads: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in _READS and _TRITON not in _caller():
            frame = sys._getframe(1)
            self.reads.append(f"{func.__name__} at {frame.f_code.co_filename}:{frame.f_lineno}"
                              f" (from {_caller()})")
        return func(*args, **(kwargs or {}))
