"""Timing and memory measurements shared by the benchmarks: CUDA-event and CUDA-graph timing,
host time without synchronisation, peak memory of a step, the bytes saved for backward, and the
kernels of one profiled step."""

from __future__ import annotations

import statistics
import time

import torch

WARMUP, ITERS = 3, 20


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def warm_up(seconds: float = 3.0, device: str = "cuda") -> None:
    """Keep the GPU busy for a few seconds first: the idle card reads a low SM clock (345 MHz)."""
    x = torch.empty(1 << 28, device=device, dtype=torch.uint8)
    y = torch.empty_like(x)
    t = time.time()
    while time.time() - t < seconds:
        for _ in range(50):
            y.copy_(x)
        torch.cuda.synchronize(device)


def graph_ms(fn, rep: int = 40) -> float:
    """Median ms of ``fn`` per call, timed over CUDA-graph replays so that the host's launch
    overhead stays out of the kernel time; plain ``do_bench`` if ``fn`` cannot be captured."""
    import triton

    try:
        return triton.testing.do_bench_cudagraph(fn, rep=rep, return_mode="median")
    except Exception as e:  # noqa: BLE001 - e.g. a peer that syncs with the host
        print(f"  (not capturable: {type(e).__name__}; timed with do_bench)", flush=True)
        return triton.testing.do_bench(fn, warmup=10, rep=rep, return_mode="median")


def time_steps(step, device: torch.device, warmup: int = WARMUP, iters: int = ITERS) -> float:
    """Median ms of ``step`` over ``iters`` calls after ``warmup`` (CUDA events on a GPU)."""
    for _ in range(warmup):
        step()
    sync(device)
    times = []
    for _ in range(iters):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            step()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end))
        else:
            t0 = time.perf_counter()
            step()
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def host_ms(step, device: torch.device, iters: int = ITERS) -> float:
    """Wall ms per step of ``iters`` steps issued back to back, without synchronising (close to
    the step's time: the step is bound by Python and launches, not by the GPU)."""
    sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        step()
    elapsed = (time.perf_counter() - t0) * 1e3 / iters
    sync(device)
    return elapsed


def per_call_us(fn, iters: int, device: torch.device) -> tuple[float, float | None]:
    """``(host us, gpu us)`` per call of ``fn`` over ``iters`` calls after 5 warm-up calls, with
    no synchronisation inside the loop (``gpu us`` from CUDA events; None on the CPU)."""
    for _ in range(5):
        fn()
    sync(device)
    start = end = None
    if device.type == "cuda":
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    host = (time.perf_counter() - t0) / iters * 1e6
    if end is None:
        return host, None
    end.record()
    end.synchronize()
    return host, start.elapsed_time(end) * 1e3 / iters


def peak_gib(step, device: torch.device) -> float | None:
    """Run one step; its peak memory above the memory allocated before it, in GiB (CUDA)."""
    if device.type != "cuda":
        step()
        return None
    sync(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    step()
    sync(device)
    return (torch.cuda.max_memory_allocated(device) - before) / 2**30


def saved_mib(eager, x: torch.Tensor, params) -> float:
    """MiB saved for backward by one eager forward (distinct storages; the parameters' own
    storages excluded, since saving a parameter costs no memory)."""
    own = {p.untyped_storage().data_ptr() for p in params}
    seen: dict[int, int] = {}

    def pack(t):
        st = t.untyped_storage()
        if st.data_ptr() not in own:
            seen[st.data_ptr()] = st.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        y = eager(x)
    del y
    return sum(seen.values()) / 2**20


def host_syncs(step, device: torch.device) -> int:
    """How many times one call of ``step`` made the host wait for the GPU (CUDA's synchronizing
    calls, as ``torch.cuda.set_sync_debug_mode`` reports them)."""
    import warnings

    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message) for w in seen)


def kernel_stats(step, device: torch.device) -> dict:
    """GPU kernels of one step (torch.profiler): their count, total GPU ms and the largest 30 by
    GPU time; the host synchronizations of another step (:func:`host_syncs`)."""
    if device.type != "cuda":
        return {}
    from torch.profiler import ProfilerActivity, profile

    syncs = host_syncs(step, device)
    sync(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        sync(device)
    kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    by_name: dict[str, list[float]] = {}
    for e in kernels:
        entry = by_name.setdefault(e.name, [0, 0.0])
        entry[0] += 1
        entry[1] += e.device_time
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:30]
    return {"kernels": len(kernels), "syncs": syncs,
            "gpu_ms": sum(v[1] for v in by_name.values()) / 1e3,
            "top": [{"name": n[:160], "count": c, "us": round(t, 1)} for n, (c, t) in top]}


def env_line(device: torch.device) -> dict:
    """The versions and the device a table was measured with."""
    import triton

    try:
        import torchao

        ao = torchao.__version__
    except Exception as e:  # noqa: BLE001 - a broken torchao only loses the peers
        ao = f"unavailable ({type(e).__name__}: {e})"
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "none (CPU)"
    return {"torch": torch.__version__, "triton": triton.__version__, "torchao": ao, "gpu": gpu}


def live_at_peak(events: list[dict]) -> tuple[int, list[dict]]:
    """``(peak bytes, the blocks alive then)`` of a CUDA caching allocator trace (the
    ``device_traces`` entries of ``torch.cuda.memory._snapshot()``): its ``alloc`` and
    ``free_completed`` events replayed in order, counting only blocks allocated within the
    trace (what was alive before recording began is the baseline). Each block: its ``addr``,
    ``size`` and ``frames``."""
    live: dict[int, dict] = {}
    now = peak = 0
    at_peak: list[dict] = []
    for ev in events:
        action = ev.get("action")
        if action == "alloc":
            live[ev["addr"]] = ev
            now += ev["size"]
            if now > peak:
                peak, at_peak = now, list(live.values())
        elif action == "free_completed" and ev["addr"] in live:
            now -= live.pop(ev["addr"])["size"]
    return peak, at_peak


def allocation_frame(frames: list[dict]) -> dict | None:
    """The innermost Python frame outside torch's own modules (a quant module, the model's code,
    or a compiled graph's generated code), else the innermost Python frame, else the innermost
    frame. C++ frames (the unwinder's, the allocator's) are not sites: their ``filename`` is no
    ``.py`` file."""
    python = [f for f in frames if f.get("filename", "").endswith(".py")]
    return next((f for f in python if "/torch/" not in f["filename"]),
                python[0] if python else frames[0] if frames else None)


def allocation_site(frames: list[dict]) -> str:
    """``file:line function`` of :func:`allocation_frame`, the file by its last two parts."""
    chosen = allocation_frame(frames)
    if chosen is None:
        return "?"
    path = chosen.get("filename", "?")
    short = "/".join(path.split("/")[-2:])
    return f"{short}:{chosen.get('line', '?')} {chosen.get('name', '?')}"


def source_line(frames: list[dict]) -> str:
    """The source text of :func:`allocation_frame`'s line (for a compiled graph: the buffer's
    allocation in its generated code), or '' where the file is not readable here."""
    import linecache

    chosen = allocation_frame(frames)
    if chosen is None:
        return ""
    return linecache.getline(chosen.get("filename", ""), chosen.get("line", 0)).strip()[:160]


def peak_blocks(step, device: torch.device, top: int = 24) -> dict | None:
    """Run one step with the CUDA allocator's history recorded: the peak above the memory
    allocated before it (GiB), the allocation that reached it (``reached_by``: its site and
    source line; :func:`live_at_peak` keeps the blocks in allocation order), and the blocks alive
    at that peak grouped by allocation site, largest first (``top`` sites: GiB, count, site, the
    site's source line). None off CUDA."""
    if device.type != "cuda":
        return None
    sync(device)
    torch.cuda.memory._record_memory_history(max_entries=2_000_000, stacks="python")
    try:
        step()
        sync(device)
        snapshot = torch.cuda.memory._snapshot(device)
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    peak, blocks = live_at_peak(snapshot["device_traces"][device.index or 0])
    sites: dict[str, list] = {}
    for b in blocks:
        frames = b.get("frames", [])
        entry = sites.setdefault(allocation_site(frames), [0, 0, source_line(frames)])
        entry[0] += b["size"]
        entry[1] += 1
    ranked = sorted(sites.items(), key=lambda kv: -kv[1][0])[:top]
    last = blocks[-1].get("frames", []) if blocks else []
    return {"peak_gib": round(peak / 2**30, 3),
            "reached_by": f"{allocation_site(last)}: {source_line(last)}",
            "sites": [{"gib": round(size / 2**30, 3), "count": n, "site": site, "code": code}
                      for site, (size, n, code) in ranked]}
