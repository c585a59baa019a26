"""The model benchmark's peak analysis (``bench/measure.py``): the blocks alive at the peak of
a CUDA allocator trace, and the allocation site each is reported under."""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "bench"))

import measure  # noqa: E402


def _alloc(addr, size, site="model.py"):
    return {"action": "alloc", "addr": addr, "size": size,
            "frames": [{"filename": f"/x/{site}", "line": addr, "name": "f"}]}


def _free(addr, action="free_completed"):
    return {"action": action, "addr": addr}


def test_the_peak_counts_what_the_trace_allocated_and_keeps_the_blocks_alive_then():
    events = [
        _free(99),  # a block from before the trace: not counted, not an error
        _alloc(1, 100), _alloc(2, 300),
        _free(1, "free_requested"),  # still held until the free completes
        _alloc(3, 50),  # 450 bytes in blocks 1, 2 and 3
        _free(1), _free(3), _alloc(4, 200),  # the peak: 500 bytes in blocks 2 and 4
        _free(2), _alloc(5, 10),
    ]
    peak, blocks = measure.live_at_peak(events)
    assert peak == 500
    assert [b["addr"] for b in blocks] == [2, 4]  # in allocation order: 4 reached the peak


def test_an_empty_trace_has_no_peak():
    assert measure.live_at_peak([]) == (0, [])


def test_the_site_is_the_innermost_frame_outside_torch():
    frames = [
        {"filename": "/site/torch/_tensor.py", "line": 1, "name": "new_empty"},
        {"filename": "/site/quant_recipes/moe/fp8_gemm.py", "line": 330, "name": "backward"},
        {"filename": "/bench/speed.py", "line": 9, "name": "step"},
    ]
    assert measure.allocation_site(frames) == "moe/fp8_gemm.py:330 backward"
    inductor = [{"filename": "/site/torch/x.py", "line": 2, "name": "a"},
                {"filename": "/tmp/torchinductor_root/ab/cab.py", "line": 7, "name": "call"}]
    assert measure.allocation_site(inductor) == "ab/cab.py:7 call"
    only_torch = [{"filename": "/site/torch/nn/functional.py", "line": 5, "name": "linear"}]
    assert measure.allocation_site(only_torch) == "nn/functional.py:5 linear"
    assert measure.allocation_site([]) == "?"


def test_cpp_frames_are_not_sites():
    frames = [
        {"filename": "??", "line": 0, "name": "torch::unwind::unwind()"},
        {"filename": "/pytorch/c10/cuda/CUDACachingAllocator.cpp", "line": 9, "name": "malloc"},
        {"filename": "/site/torch/_ops.py", "line": 3, "name": "__call__"},
        {"filename": "/site/quant_kernels/grouped_cast.py", "line": 40, "name": "cast"},
    ]
    assert measure.allocation_site(frames) == "quant_kernels/grouped_cast.py:40 cast"
    cpp_only = [{"filename": "??", "line": 0, "name": "torch::unwind::unwind()"}]
    assert measure.allocation_site(cpp_only) == "??:0 torch::unwind::unwind()"


def test_the_source_line_is_the_chosen_frames(tmp_path):
    code = tmp_path / "graph.py"
    code.write_text("a = 1\nbuf7 = empty_strided_cuda((16, 4), (4, 1), torch.float8_e4m3fn)\n")
    frames = [{"filename": "??", "line": 0, "name": "unwind"},
              {"filename": str(code), "line": 2, "name": "call"}]
    assert measure.source_line(frames) == (
        "buf7 = empty_strided_cuda((16, 4), (4, 1), torch.float8_e4m3fn)")
    assert measure.source_line([{"filename": "/gone.py", "line": 3, "name": "f"}]) == ""
    assert measure.source_line([]) == ""
