"""Timers and ceilings shared by the benchmarks."""

import statistics

import torch

# Ceilings measured on the project's GPUs (perf-targets.md): device copy (read + write), random
# gather of 576-B rows, bf16 dense tensor-core rate.
CEILINGS = {
    "H100": {"copy": 3.0e12, "gather": 2.0e12, "bf16": 790e12},
    "H200": {"copy": 4.3e12, "gather": 2.9e12, "bf16": 790e12},
}


def ceilings() -> dict:
    name = torch.cuda.get_device_name() if torch.cuda.is_available() else ""
    for key, c in CEILINGS.items():
        if key in name:
            return c
    return CEILINGS["H100"]


def graph_time_us(fn, iters: int = 20, reps: int = 20) -> float:
    """Time of one call from a CUDA graph holding `reps` calls back to back (median over replays,
    divided by reps): one replay's own launch (~8 us measured on the H100) would otherwise hide
    kernels that take a few us, as they run inside a serving step's graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    # thread_local, as Inductor's cudagraph trees capture: another thread's CUDA call (NCCL's
    # watchdog, in the parallel bench) must not invalidate the capture.
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        for _ in range(reps):
            fn()
    return _events(graph.replay, iters) / reps


def eager_time_us(fn, iters: int = 10) -> float:
    """Median time of one eager call (functions with host syncs, e.g. the reference backend)."""
    fn()
    torch.cuda.synchronize()
    return _events(fn, iters)


def _events(fn, iters: int) -> float:
    times = []
    for _ in range(3):
        fn()
    for _ in range(iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)
