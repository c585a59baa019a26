"""The tile configs of every kernel launch, in one table.

``TABLE[name]`` holds two configs of the kernel launch ``name``: ``"gpu"`` for real GPUs and
``"interp"`` for Triton's CPU interpreter (``TRITON_INTERPRET=1``), whose tiles are large to keep
the grid small. The keys of a config:

- upper-case keys (``BM``, ``BK``, ``BLOCK``, ``SLAB``, ...) are ``tl.constexpr`` tile sizes of
  the kernel, passed by name (:func:`tile_args`);
- ``num_warps``, ``num_stages`` and ``maxnreg`` are Triton launch options, dropped under the
  interpreter (:func:`launch_kwargs`);
- other lower-case keys (``per_sm``) are host-side parameters the wrapper reads itself.

Kernels read their entry through :func:`launch_config` (or :func:`config`, a copy). Benchmarks
sweep the ``"gpu"`` entries with :func:`overridden`.
"""

from __future__ import annotations

import contextlib
import types
from collections.abc import Iterator, Mapping

from ._common import interpreting

TABLE: dict[str, dict[str, dict[str, int]]] = {
    # _amax.py
    # amax: persistent grid of ``PER_SM`` programs per SM, each looping over ``BLOCK`` tiles.
    "amax": {"gpu": {"BLOCK": 2048, "num_warps": 4, "per_sm": 16},
             "interp": {"BLOCK": 4096, "per_sm": 1}},
    # current scaling's amax: fewer programs, whose partial maxima every cast program reads.
    # amax_partials and fp8_cast: the winners of a tile sweep (bench/speed.py kernels, 4096^2 and
    # 8192^2; bench/RESULTS.md, section "Host cost of the compiled step, interleaved timing
    # rounds", its current-scaling kernels)
    "amax_partials": {"gpu": {"BLOCK": 4096, "num_warps": 8, "per_sm": 4},
                      "interp": {"BLOCK": 4096, "per_sm": 1}},
    # fp8_tensor.py
    "fp8_cast": {"gpu": {"BM": 32, "BK": 128, "num_warps": 4}, "interp": {"BM": 64, "BK": 64}},
    "fp8_dequant": {"gpu": {"BLOCK": 4096, "num_warps": 8}, "interp": {"BLOCK": 4096}},
    # fp8_grouped.py: per-group amax tiles (one atomic per tile and group) and the cast, whose
    # 64 output rows make 64-byte runs of the transposed copy
    "fp8_group_amax": {"gpu": {"BM": 32, "BK": 256, "num_warps": 4},
                       "interp": {"BM": 64, "BK": 64}},
    "fp8_group_cast": {"gpu": {"BM": 64, "BK": 128, "num_warps": 4},
                       "interp": {"BM": 16, "BK": 64}},
    # fp8_grouped_experts.py: a program per tile and expert, the cast's tiles
    "fp8_expert_cast": {"gpu": {"BM": 64, "BK": 128, "num_warps": 4},
                        "interp": {"BM": 16, "BK": 32}},
    # fp8_block.py
    "fp8_block": {
        "gpu": {"BM_ROW": 32, "num_warps": 4},  # BM_ROW: tile height of the rowwise-only 1D path
        "interp": {"BM_ROW": 128},
    },
    # 128x128 tiles (columnwise or 2D), processed in SLAB-row slabs
    # (winners of the GPU sweep in bench/RESULTS.md: 1D row+col SLAB 32 / 4 warps, 2D SLAB 128 /
    # 8 warps)
    "fp8_block_col": {"gpu": {"SLAB": 32, "num_warps": 4}, "interp": {"SLAB": 64}},
    "fp8_block_2d": {"gpu": {"SLAB": 128, "num_warps": 8}, "interp": {"SLAB": 64}},
    "fp8_block_dequant": {
        "gpu": {"BM": 64, "BK": 128, "num_warps": 8},
        "interp": {"BM": 128, "BK": 128},
    },
    # mxfp8.py
    # Tile configs (winners of the GPU sweeps at 16384^2): rowwise-only, and columnwise
    # (alone or 2D). One warp per 32x128 slab keeps every 32-row column block inside a thread pair:
    # no shared-memory reduction (ncu: 60M bank conflicts with four warps).
    "mxfp8": {"gpu": {"BM": 32, "BK": 256, "num_warps": 8}, "interp": {"BM": 64, "BK": 64}},
    "mxfp8_col": {"gpu": {"BM": 32, "BK": 128, "num_warps": 1}, "interp": {"BM": 64, "BK": 64}},
    # rowwise + columnwise 1D from one read: two warps (fewer registers per thread than one, worth
    # the cross-warp column reduction: bench/RESULTS.md, section "Runs 4-6 (ncu-guided
    # instruction cuts)")
    "mxfp8_fused": {"gpu": {"BM": 32, "BK": 128, "num_warps": 2}, "interp": {"BM": 64, "BK": 64}},
    # dequantization: 16x256 tiles, 4 warps (the winner of the sweep through the dequant GEMM at
    # 16384x8192x8192: bench/RESULTS.md, section "GEMMs and the training step")
    "mxfp8_dequant": {"gpu": {"BM": 16, "BK": 256, "num_warps": 4}, "interp": {"BM": 32, "BK": 64}},
    # nvfp4.py
    "nvfp4_row": {"gpu": {"BM": 32, "BK": 256, "num_warps": 4}, "interp": {"BM": 64, "BK": 64}},
    "nvfp4_col": {"gpu": {"G": 4, "BK": 64, "num_warps": 4}, "interp": {"G": 4, "BK": 64}},
    "nvfp4_dequant": {"gpu": {"BM": 32, "BK": 64, "num_warps": 4}, "interp": {"BM": 64, "BK": 32}},
    # nvfp4_4over6.py: one block per thread (each holds its 16 elements and both candidates'
    # errors and codes): 96-160 registers (both division paths) and no stack frame for sm_90,
    # where the plain NVFP4 tiles spill up to 1368 bytes per thread
    # (tests/kernels/test_kernel_registers.py); the interpreter runs the same tiles
    "nvfp4_4over6_row": {"gpu": {"BM": 16, "BK": 128, "num_warps": 4},
                         "interp": {"BM": 16, "BK": 128}},
    "nvfp4_4over6_col": {"gpu": {"G": 2, "BK": 64, "num_warps": 4}, "interp": {"G": 2, "BK": 64}},
    # mxfp8_gemm.py
    # Tile configs of the fused mainloops (winners of the GPU sweep, bench/RESULTS.md).
    "mxfp8_gemm": {
        "gpu": {"BM": 128, "BN": 256, "BK": 128, "GROUP_M": 8, "num_warps": 8, "num_stages": 2},
        "interp": {"BM": 32, "BN": 32, "BK": 64, "GROUP_M": 1},
    },
    # nvfp4_gemm.py
    "nvfp4_gemm": {
        "gpu": {"BM": 128, "BN": 256, "BK": 128, "GROUP_M": 8, "num_warps": 8, "num_stages": 3},
        "interp": {"BM": 32, "BN": 32, "BK": 64, "GROUP_M": 1},
    },
    # fp8_grouped_gemm.py: grouped FP8 GEMMs; PROMOTE: the contraction elements the tensor core
    # sums before an fp32 add (0: after every MMA); COLS_FASTEST: the rows kernel's programs
    # that run together share a row tile; tma: tiles loaded by the tensor memory accelerator;
    # SPLIT (1 unless given): 2 multiplies a TMA tile as two halves of its columns, the promoted
    # partial sum of one half at a time (the same sums; a 128 x 256 tile's accumulator and
    # partial sum exceed a thread's registers and spill, its halves nearly don't: on an H100
    # 7% faster at 2048-row groups over a long contraction, about even at 512-row groups).
    # The winners of the sweep of bench/speed.py probe (bench/grouped_cases.py)
    "fp8_grouped_rows_gemm": {
        "gpu": {"BM": 128, "BN": 256, "BK": 128, "PROMOTE": 128, "COLS_FASTEST": 1,
                "num_warps": 8, "num_stages": 4, "tma": 1, "SPLIT": 2},
        "interp": {"BM": 32, "BN": 64, "BK": 64, "PROMOTE": 0, "COLS_FASTEST": 1, "tma": 1,
                   "SPLIT": 2},
    },
    # the same where the contraction is long and the expert passes L2 (fp8_grouped_gemm's
    # long_contraction); CHUNKS: the promoted chunks a main-loop step multiplies, the second's MMAs
    # under the first one's fp32 adds
    "fp8_grouped_rows_gemm_long": {
        "gpu": {"BM": 128, "BN": 128, "BK": 128, "PROMOTE": 128, "COLS_FASTEST": 1, "CHUNKS": 2,
                "num_warps": 8, "num_stages": 3, "tma": 1},
        "interp": {"BM": 32, "BN": 64, "BK": 64, "PROMOTE": 0, "COLS_FASTEST": 1, "CHUNKS": 2,
                   "tma": 1},
    },
    # the weight-gradient kernel's tma: every chunk by TMA from descriptors bounded by the group
    "fp8_grouped_tokens_gemm": {
        "gpu": {"BM": 128, "BN": 256, "BK": 128, "PROMOTE": 128, "num_warps": 8,
                "num_stages": 4, "tma": 1, "SPLIT": 2},
        "interp": {"BM": 32, "BN": 64, "BK": 64, "PROMOTE": 0, "tma": 1, "SPLIT": 2},
    },
    # the same where the groups contract over few rows (fp8_grouped_gemm.SHORT_GROUP_ROWS):
    # 128x128 tiles of 4 warps fit two programs per SM, one's store under the other's main loop
    # (whole tiles: their halves were 10% slower)
    "fp8_grouped_tokens_gemm_short": {
        "gpu": {"BM": 128, "BN": 128, "BK": 128, "PROMOTE": 128, "num_warps": 4,
                "num_stages": 3, "tma": 1},
        "interp": {"BM": 32, "BN": 64, "BK": 64, "PROMOTE": 0, "tma": 1},
    },
    # grouped_gemm.py: the rows kernel of fp8_grouped_gemm.py over bf16 values (fp32 under the
    # interpreter), as nvfp4_grouped_rows_gemm's
    "grouped_rows_gemm": {
        "gpu": {"BM": 128, "BN": 256, "BK": 64, "COLS_FASTEST": 1, "num_warps": 8,
                "num_stages": 4, "tma": 1},
        "interp": {"BM": 32, "BN": 64, "BK": 64, "COLS_FASTEST": 1, "tma": 1},
    },
    # fp16 and fp32 operands, multiplied in fp32: BK 32 keeps the fp32 tiles the bytes of bf16's
    # (BK 64 asks more shared memory than an H200 has)
    "grouped_rows_gemm_fp32": {
        "gpu": {"BM": 128, "BN": 256, "BK": 32, "COLS_FASTEST": 1, "num_warps": 8,
                "num_stages": 4, "tma": 1},
        "interp": {"BM": 32, "BN": 64, "BK": 64, "COLS_FASTEST": 1, "tma": 1},
    },
    # nvfp4_grouped_gemm.py: the kernels of fp8_grouped_gemm.py over decoded bf16 operands
    # (fp32 under the interpreter); BK 64 keeps the bf16 tiles the bytes of the FP8 ones
    "nvfp4_grouped_rows_gemm": {
        "gpu": {"BM": 128, "BN": 256, "BK": 64, "COLS_FASTEST": 1, "num_warps": 8,
                "num_stages": 4, "tma": 1},
        "interp": {"BM": 32, "BN": 64, "BK": 64, "COLS_FASTEST": 1, "tma": 1},
    },
    "nvfp4_grouped_tokens_gemm": {
        "gpu": {"BM": 128, "BN": 256, "BK": 64, "num_warps": 8, "num_stages": 4, "tma": 1},
        "interp": {"BM": 32, "BN": 64, "BK": 64, "tma": 1},
    },
    # fp8_block_grouped_gemm.py: FP8 block-scaled grouped GEMMs; each BK slice (BK divides 128)
    # is scaled into the fp32 accumulator, so a tile holds two fp32 [BM, BN] tiles
    "fp8_block_grouped_rows_gemm": {
        "gpu": {"BM": 128, "BN": 128, "BK": 128, "PROMOTE": 128, "COLS_FASTEST": 1,
                "num_warps": 8, "num_stages": 4},
        "interp": {"BM": 32, "BN": 64, "BK": 64, "PROMOTE": 0, "COLS_FASTEST": 1},
    },
    "fp8_block_grouped_tokens_gemm": {
        "gpu": {"BM": 128, "BN": 128, "BK": 128, "PROMOTE": 128, "num_warps": 8,
                "num_stages": 4},
        "interp": {"BM": 32, "BN": 64, "BK": 64, "PROMOTE": 0},
    },
    # dequant_gemm.py
    "gemm_epilogue": {"gpu": {"BLOCK": 4096, "num_warps": 8}, "interp": {"BLOCK": 4096}},
}


def _entry(name: str) -> dict[str, dict[str, int]]:
    if name not in TABLE:
        raise KeyError(f"no tile config {name!r}; known: {', '.join(sorted(TABLE))}")
    return TABLE[name]


def config(name: str) -> dict[str, int]:
    """The tile config of kernel ``name`` for the current mode (a copy)."""
    return dict(_entry(name)["interp" if interpreting() else "gpu"])


#: ``launch_config``'s results per (name, interpreting); :func:`overridden` clears it.
_LAUNCH_CONFIGS: dict[tuple[str, bool], tuple[Mapping[str, int], dict[str, int]]] = {}


def launch_config(name: str) -> tuple[Mapping[str, int], dict[str, int]]:
    """``(config, keywords)`` of kernel ``name`` in the current mode: the config read-only, and
    the keywords a launch passes (:func:`tile_args` plus :func:`launch_kwargs`). Built once per
    name and mode, since every quantize call goes through here (rebuilding the dicts would be
    a quarter of a kernel wrapper's host time). Spread the keywords (``**``); don't modify
    them."""
    key = (name, interpreting())
    found = _LAUNCH_CONFIGS.get(key)
    if found is None:
        cfg = config(name)
        found = _LAUNCH_CONFIGS[key] = (types.MappingProxyType(cfg),
                                        {**tile_args(cfg), **launch_kwargs(cfg)})
    return found


@contextlib.contextmanager
def overridden(name: str, gpu_config: dict[str, int], *, mode: str = "gpu") -> Iterator[None]:
    """Within the block, ``name``'s config of ``mode`` (``"gpu"``, or ``"interp"``: what
    :func:`config` returns under the interpreter) is (a copy of) ``gpu_config``; the previous
    one is restored on exit, also on an exception. For benchmarks and for tests that run a
    kernel's other forms."""
    if mode not in ("gpu", "interp"):
        raise ValueError(f"overridden: mode must be 'gpu' or 'interp', got {mode!r}")
    entry = _entry(name)
    saved = entry[mode]
    entry[mode] = dict(gpu_config)
    _LAUNCH_CONFIGS.clear()
    try:
        yield
    finally:
        entry[mode] = saved
        _LAUNCH_CONFIGS.clear()


def launch_kwargs(cfg: Mapping[str, int]) -> dict[str, int]:
    """``num_warps`` / ``num_stages`` / ``maxnreg`` of a config, dropped in interpreter mode."""
    if interpreting():
        return {}
    return {k: v for k, v in cfg.items() if k in ("num_warps", "num_stages", "maxnreg")}


def tile_args(cfg: Mapping[str, int]) -> dict[str, int]:
    """The constexpr tile sizes of a config (upper-case keys)."""
    return {k: v for k, v in cfg.items() if k.isupper()}
