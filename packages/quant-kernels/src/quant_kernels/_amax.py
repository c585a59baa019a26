"""NaN-dropping amax passes shared by the formats (`numerics.md` §3 step 1, §7.3): a persistent
grid whose programs keep an elementwise running max, then one atomic max each (:func:`amax`,
:func:`amax_into`) or one partial each for a consumer to reduce (:func:`amax_partials`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from quant_core.inputs import check_input_dtype
from quant_core.shapes import ceil_div

from ._common import interpreting, launch
from ._rounding import abs_for_max, f32_bits
from .configs import launch_config


@triton.jit
def _program_max(x_ptr, n, n_tiles, BLOCK: tl.constexpr):
    """NaN-dropping ``max|x|`` over this program's tiles of a persistent grid (>= 0)."""
    acc = tl.zeros([BLOCK], tl.float32)
    t = tl.program_id(0).to(tl.int64)
    while t < n_tiles:  # a while loop: the interpreter cannot iterate range() of a runtime int
        offs = t * BLOCK + tl.arange(0, BLOCK)
        acc = tl.maximum(acc, abs_for_max(tl.load(x_ptr + offs, mask=offs < n, other=0.0)))
        t += tl.num_programs(0)
    return tl.max(acc, axis=0)


@triton.jit
def _amax_kernel(x_ptr, out_bits_ptr, n, n_tiles, BLOCK: tl.constexpr):
    """One atomic max of this program's ``max|x|`` into the amax (:func:`amax_into`).

    x_ptr: input x, ``n`` contiguous elements (fp32, bf16 or fp16).
    out_bits_ptr: the fp32 amax ``(1,)`` viewed as int32 (non-negative floats order as ints).
    n: element count of x.
    n_tiles: ``ceil(n / BLOCK)``, the tiles the persistent grid's programs share.
    BLOCK: elements per tile.
    """
    tl.atomic_max(out_bits_ptr, f32_bits(_program_max(x_ptr, n, n_tiles, BLOCK)))


@triton.jit
def _amax_partials_kernel(x_ptr, parts_ptr, n, n_tiles, BLOCK: tl.constexpr):
    """This program's ``max|x|`` into its partial (:func:`amax_partials`).

    x_ptr: input x, ``n`` contiguous elements (fp32, bf16 or fp16).
    parts_ptr: fp32 partials ``[grid]``, one per program.
    n: element count of x.
    n_tiles: ``ceil(n / BLOCK)``, the tiles the persistent grid's programs share.
    BLOCK: elements per tile.
    """
    tl.store(parts_ptr + tl.program_id(0), _program_max(x_ptr, n, n_tiles, BLOCK))


_SMS: dict[int, int] = {}


def _sm_count(dev: torch.device) -> int:
    if interpreting() or dev.type != "cuda":
        return 2
    i = dev.index if dev.index is not None else torch.cuda.current_device()
    if i not in _SMS:
        _SMS[i] = torch.cuda.get_device_properties(i).multi_processor_count
    return _SMS[i]


def amax_into(x: torch.Tensor, out: torch.Tensor) -> None:
    """Max-accumulate NaN-dropping ``max|x|`` into fp32 ``out (1,)`` (non-negative) in place:
    a persistent grid, an elementwise running max per program, one atomic max (fp32 bits) each."""
    n = x.numel()
    if n == 0:
        return
    cfg, kw = launch_config("amax")
    n_tiles = ceil_div(n, cfg["BLOCK"])
    grid = min(n_tiles, cfg["per_sm"] * _sm_count(x.device))
    launch(_amax_kernel, (grid,), x, out.view(torch.int32), n, n_tiles, **kw)


def amax_partials(x: torch.Tensor) -> torch.Tensor:
    """Each program's NaN-dropping ``max|x|`` of non-empty ``x`` (fp32, no initialisation and no
    atomics: the consumer takes the max of all of them). A contiguous ``x`` of any rank is read in
    place: flattening it costs a ``reinterpret_tensor`` call per quantize in compiled code."""
    x = x if x.is_contiguous() else x.reshape(-1)  # the max does not depend on the order
    n = x.numel()
    cfg, kw = launch_config("amax_partials")
    n_tiles = ceil_div(n, cfg["BLOCK"])
    grid = min(n_tiles, cfg["per_sm"] * _sm_count(x.device))
    parts = torch.empty(grid, dtype=torch.float32, device=x.device)
    launch(_amax_partials_kernel, (grid,), x, parts, n, n_tiles, **kw)
    return parts


def amax(x: torch.Tensor) -> torch.Tensor:
    """``max|x|`` as fp32 ``(1,)``, NaN dropped, 0 for an empty tensor (one atomic-max pass)."""
    check_input_dtype(x, "amax")
    out = torch.zeros(1, dtype=torch.float32, device=x.device)
    amax_into(x.reshape(-1), out)
    return out
