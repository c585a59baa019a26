"""Per-expert FP8 current scaling in one pass (``quant_kernels.fp8_grouped_experts``): the bytes,
scale-inverses and amaxes equal the reference's bitwise, for ragged tiles, a tile per expert,
experts smaller than a tile, and experts of NaN, Inf, zeros, subnormal amaxes and values past
the FP8 maxima; a program that finds an arrival missing computes the amax itself, to the same
bytes; larger experts and given amaxes take the two passes."""

from __future__ import annotations

import pytest
import torch
from _kernels_util import DEVICE, assert_all_same, make_input
from quant_core import DType
from quant_core import reference as ref
from quant_kernels import _common, configs, fp8_grouped, fp8_grouped_experts

HAVE_CUDA = DEVICE == "cuda"
NAMES = ("data", "transpose", "scale_inv")
KW = dict(force_pow_2_scales=False, amax_epsilon=0.0)


def _experts(e: int, n: int, k: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """``w [e * n, k]``: expert 0 holds make_input's specials (NaN, ±Inf, subnormals, values
    past the maxima), expert 1 is all zeros, expert 2 a NaN among tiny values (a subnormal amax
    in fp32), the rest plain values of different magnitudes."""
    w = torch.cat([make_input(n, k, torch.float32, seed=seed + i, specials=i == 0)
                   * 2.0 ** (3 * i - 6) for i in range(e)])
    if e > 1:
        w[n:2 * n] = 0.0
    if e > 2:
        w[2 * n:3 * n] *= 1e-39 if dtype == torch.float32 else 1e-6
        w[2 * n + 1, k - 1] = float("nan")
    return w.to(dtype)


def _check(w, e, fp8=DType.E4M3, rowwise=True, columnwise=True, pitch=4, **kw):
    args = dict(groups=e, fp8_dtype=fp8, rowwise=rowwise, columnwise=columnwise,
                scale_pitch=pitch, **{**KW, **kw})
    got = fp8_grouped_experts.fp8_group_quantize_experts(w.to(DEVICE), **args)
    want = ref.fp8_group_quantize_experts(w, **args)
    assert_all_same(got, want, fp8, NAMES)


def _launched(monkeypatch) -> list[str]:
    """The names of the kernels launched from here on."""
    names: list[str] = []
    real = _common.launch

    def spy(kernel, grid, *args, **kwargs):
        names.append(kernel.fn.__name__)
        return real(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(fp8_grouped_experts, "launch", spy)
    monkeypatch.setattr(fp8_grouped, "launch", spy)
    return names


@pytest.mark.parametrize("fp8", [DType.E4M3, DType.E5M2], ids=str)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("n, k", [(40, 80), (16, 32), (5, 3)])  # ragged tiles; one; < a tile
def test_one_pass_equals_the_reference(dtype, fp8, n, k):
    _check(_experts(5, n, k, dtype), 5, fp8)


@pytest.mark.parametrize("rowwise, columnwise", [(True, False), (False, True)])
@pytest.mark.parametrize("pitch", [1, 2])
def test_one_direction_and_pitches(rowwise, columnwise, pitch):
    _check(_experts(4, 24, 48, torch.bfloat16, seed=3), 4, rowwise=rowwise,
           columnwise=columnwise, pitch=pitch)


@pytest.mark.parametrize("kw", [dict(force_pow_2_scales=True), dict(amax_epsilon=1e-3)],
                         ids=["pow2", "eps"])
def test_scale_options(kw):
    _check(_experts(4, 24, 48, torch.float32, seed=5), 4, **kw)


def _config(**changes):
    """``fp8_expert_cast``'s config of this device's mode, with ``changes``, in the block."""
    mode = "gpu" if HAVE_CUDA else "interp"
    return configs.overridden("fp8_expert_cast",
                              {**configs.TABLE["fp8_expert_cast"][mode], **changes}, mode=mode)


@pytest.mark.parametrize("tile", [(16, 16), (64, 128)])
def test_tile_shapes(tile):
    """Tiles that split an expert's rows and columns unevenly, and a tile larger than an
    expert."""
    with _config(BM=tile[0], BK=tile[1]):
        _check(_experts(7, 40, 80, torch.bfloat16, seed=7), 7)


def test_one_expert():
    """One expert: the programs past its reads cast it."""
    _check(_experts(1, 24, 48, torch.bfloat16, seed=13), 1)


@pytest.mark.parametrize("short", [[3], [0, 1, 2, 3]], ids=["expert 3", "every expert"])
def test_a_missing_arrival_is_computed_by_the_waiting_programs(monkeypatch, short):
    """Arrival counts one short, as if a program had not run yet, and amax accumulators
    holding a value no tile has: the programs casting those experts stop polling and compute
    their amaxes from all their tiles themselves (expert 3's maximum planted in its first
    tile; expert 0 holds NaN, Inf and values past the maxima), to the same bytes."""
    real = fp8_grouped_experts.launch

    def one_short(kernel, grid, *args, **kwargs):
        args[1][short] = torch.tensor(1e30).view(torch.int32)  # the amax bits
        args[2][short] -= 1  # the arrivals
        return real(kernel, grid, *args, **kwargs)

    monkeypatch.setattr(fp8_grouped_experts, "launch", one_short)
    monkeypatch.setattr(fp8_grouped_experts, "SPIN_POLLS", 0)
    w = _experts(4, 40, 80, torch.bfloat16, seed=9)
    w[3 * 40, 0] = 1e4
    _check(w, 4)


def test_one_launch_for_small_experts_two_passes_for_large(monkeypatch):
    names = _launched(monkeypatch)
    w = _experts(3, 16, 32, torch.bfloat16)
    _check(w, 3)
    assert names == ["_expert_cast_kernel"]
    names.clear()
    monkeypatch.setattr(fp8_grouped_experts, "ONE_PASS_EXPERT_BYTES", 16 * 32 * 2 - 1)
    _check(w, 3)
    assert names == ["_group_amax_kernel", "_group_cast_kernel"]


@pytest.mark.parametrize("given", [False, True])
def test_two_passes_for_experts_off_the_cast_tile(monkeypatch, given):
    """The two passes' cast of experts whose rows are not a multiple of its tile (a tile then
    spans two experts' transposed copies), with the amaxes computed or given."""
    monkeypatch.setattr(fp8_grouped_experts, "ONE_PASS_EXPERT_BYTES", 0)
    w = _experts(3, 40, 80, torch.bfloat16, seed=4)
    amax = torch.tensor([1.0, 3.0, 0.5]) if given else None
    args = dict(groups=3, fp8_dtype=DType.E4M3, rowwise=True, columnwise=True, scale_pitch=4,
                amax=amax, **KW)
    got = fp8_grouped_experts.fp8_group_quantize_experts(
        w.to(DEVICE), **{**args, "amax": None if amax is None else amax.to(DEVICE)})
    assert_all_same(got, ref.fp8_group_quantize_experts(w, **args), DType.E4M3, NAMES)


def test_given_amaxes_take_the_cast_alone(monkeypatch):
    names = _launched(monkeypatch)
    w = _experts(3, 16, 32, torch.bfloat16)
    amax = torch.tensor([1.0, 2.0, 0.5])
    args = dict(groups=3, fp8_dtype=DType.E4M3, rowwise=True, columnwise=True, scale_pitch=4,
                amax=amax, **KW)
    got = fp8_grouped_experts.fp8_group_quantize_experts(w.to(DEVICE),
                                                         **{**args, "amax": amax.to(DEVICE)})
    assert_all_same(got, ref.fp8_group_quantize_experts(w, **args), DType.E4M3, NAMES)
    assert names == ["_group_cast_kernel"]


@pytest.mark.skipif(not HAVE_CUDA, reason="real widths: thousands of programs, on a GPU only")
@pytest.mark.parametrize("n, k", [(1536, 2048), (2048, 768)])
def test_qwen3_moe_widths(n, k):
    """Qwen3-MoE's gate/up and down experts (32 of its 128): hundreds of programs an expert,
    most of them running while the ones they wait for still are."""
    _check(_experts(32, n, k, torch.bfloat16, seed=11), 32)
