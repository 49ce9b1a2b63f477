"""Router benchmarks: gate_topk (CUDA C++) against the same math in eager PyTorch at 4096 tokens, and
the fused decode gate against F.linear + gate_topk at 1-64 tokens, for V4-Flash (hidden 4096, 256
experts) and V4-Pro (7168, 384), top-6. `python -m dsv4ops.bench.router` prints a markdown table.

Timing: each case is captured `ITERS` times in one CUDA graph, each iteration on its own copy of the
inputs (16 copies of the gate weight = 64 / 88 MB, more than the 50 MB L2: every weight read comes
from HBM, as in a model where other layers run in between); the median over `REPS` replays, divided
by `ITERS`, is the time per call. The eager baseline is also timed as launched from Python.
"""

import argparse
import statistics

import torch
import torch.nn.functional as F

from dsv4ops.router import api
from dsv4ops.router import cuda as router_cuda

MODELS = {"flash": (4096, 256), "pro": (7168, 384)}
TOP_K, SCALE = 6, 2.5
ITERS, REPS = 16, 20


def graph_us(fn, args_list) -> float:
    """Device time per call: one CUDA graph holding one call per argument set, median of replays."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for args in args_list:  # warm-up: JIT builds, kernel compiles, allocator pools
            fn(*args)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for args in args_list:
            fn(*args)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(REPS):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(args_list))
    return statistics.median(times)


def eager_us(fn, args_list) -> float:
    """Wall time per call launched from Python (host overhead included), median of REPS rounds."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(REPS):
        torch.cuda.synchronize()
        start.record()
        for args in args_list:
            fn(*args)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / len(args_list))
    return statistics.median(times)


def eager_gate_topk(logits, bias):
    """transformers' DeepseekV4TopKRouter math after the GEMM, in eager PyTorch."""
    scores = F.softplus(logits).sqrt()
    indices = torch.topk(scores + bias, TOP_K, dim=-1, sorted=False).indices
    weights = scores.gather(1, indices)
    return weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * SCALE, indices


def fused_gate(x, weight, bias):
    return api.router_gate(x, weight, bias, TOP_K, SCALE)


def linear_then_gate_topk(x, weight, bias):
    return api.gate_topk(F.linear(x, weight), bias, TOP_K, SCALE)


def bench_gate_topk(model: str, gpu: str, tokens: int = 4096) -> dict:
    experts = MODELS[model][1]
    args = [
        (torch.randn(tokens, experts, device="cuda"), torch.randn(experts, device="cuda") * 0.1) for _ in range(ITERS)
    ]
    ours = graph_us(lambda logits, bias: api.gate_topk(logits, bias, TOP_K, SCALE), args)
    base_graph, base_eager = graph_us(eager_gate_topk, args), eager_us(eager_gate_topk, args)
    return dict(
        kernel="gate_topk (CUDA C++)",
        shape=f"{model}: {tokens} x {experts} fp32, top-{TOP_K}",
        time_us=ours,
        baseline="eager PyTorch math (graph / eager launch)",
        baseline_us=base_graph,
        baseline_eager_us=base_eager,
        ratio=base_graph / ours,
        ratio_eager=base_eager / ours,
        gpu=gpu,
    )


def bench_decode_gate(model: str, tokens: int, gpu: str) -> dict:
    hidden, experts = MODELS[model]
    args = [
        (
            torch.randn(tokens, hidden, device="cuda", dtype=torch.bfloat16),
            (torch.randn(experts, hidden, device="cuda") * hidden**-0.5).bfloat16(),
            torch.randn(experts, device="cuda") * 0.1,
        )
        for _ in range(ITERS)
    ]
    ours, base = graph_us(fused_gate, args), graph_us(linear_then_gate_topk, args)
    return dict(
        kernel=f"router_gate ({router_cuda._decode_gate_backend(tokens, torch.cuda.get_device_capability())})",
        shape=f"{model}: {tokens} x {hidden} x {experts} bf16, top-{TOP_K}",
        time_us=ours,
        baseline="F.linear + gate_topk",
        baseline_us=base,
        ratio=base / ours,
        gpu=gpu,
    )


def run(args=None) -> list[dict]:
    if not router_cuda.load_cuda_backends():
        raise RuntimeError("router benchmarks need the CUDA kernels (see the logged reason)")
    gpu = torch.cuda.get_device_name()
    rows = [bench_gate_topk(model, gpu) for model in MODELS]
    rows += [bench_decode_gate(model, tokens, gpu) for model in MODELS for tokens in (1, 8, 32, 64)]
    return rows


def markdown(rows: list[dict]) -> str:
    lines = [
        "| kernel | shape | time (us) | baseline | baseline (us) | speed-up | GPU |",
        "|---|---|---:|---|---:|---:|---|",
    ]
    for r in rows:
        base = f"{r['baseline_us']:.2f}"
        ratio = f"{r['ratio']:.2f}x"
        if "baseline_eager_us" in r:
            base += f" / {r['baseline_eager_us']:.2f}"
            ratio += f" / {r['ratio_eager']:.2f}x"
        lines.append(
            f"| {r['kernel']} | {r['shape']} | {r['time_us']:.2f} | {r['baseline']} | {base} | {ratio} | {r['gpu']} |"
        )
    return "\n".join(lines)


def main():
    argparse.ArgumentParser(description=__doc__.splitlines()[0]).parse_args()
    import cutlass

    print(
        f"torch {torch.__version__}, CUDA {torch.version.cuda}, CuTe DSL {cutlass.__version__}, "
        f"{ITERS} calls per graph, median of {REPS} replays"
    )
    print(markdown(run()))


if __name__ == "__main__":
    main()
