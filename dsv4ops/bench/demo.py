"""`python -m dsv4ops`: the library doing its job. A stack of V4 attention layers (random weights,
residual between layers) serves several requests through the paged FP8 cache (or, with `--kv-cache
fp4`, FP4 compressed entries and MXFP4 index keys): continuous batching, each step the decode tokens
of the requests that finished their prompt plus prefill chunks of the others up to the step's token
budget, compiled (CUDA graphs on a GPU). Then the summary: the backend that ran, tokens/s, cache
memory, and each request's deviation from the float64 oracle run on its whole sequence in the
cache's numerics, against the error budget of the oracle's own low-precision run, and from the float64
oracle without cache rounding and in DeepSeek's reference numerics (what the cache's formats cost).

Under torchrun (`torchrun --nproc-per-node 2 -m dsv4ops --parallel tp`) every process serves the
same requests over a process group (NCCL on GPUs, one per process; gloo on CPU): `--parallel tp`
splits each layer's heads over the ranks (dsv4ops.parallel.tp), `--parallel dcp` the cache's
compressed entries (dsv4ops.parallel.dcp, exact top-k merge); rank 0 prints."""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
from torch import nn

from dsv4ops import CacheFormats, DeepseekV4Attention, DSV4AttentionConfig, reference, testing
from dsv4ops._arch import backends
from dsv4ops.cache import CacheConfig, KVCacheManager
from dsv4ops.cache.config import memory, v4_numerics
from dsv4ops.config import CSA, HCA, SLIDING
from dsv4ops.reference import Numerics

PRESETS = {"tiny": DSV4AttentionConfig.tiny, "flash": DSV4AttentionConfig.flash, "pro": DSV4AttentionConfig.pro}
COMPILE = ("none", "aot_eager", "inductor", "cudagraphs")
# The cache choices: --kv-cache picks the compressed entries' format (the window rows stay fp8_584),
# --indexer-cache the keys' (default: fp8 keys with fp8 entries, mxfp4 with fp4).
COMP_FORMAT = {"fp8": "fp8_584", "fp4": "fp4_288"}
INDEX_FORMAT = {"fp8": "fp8_132", "mxfp4": "mxfp4_68"}
DEFAULT_INDEXER = {"fp8": "fp8", "fp4": "mxfp4"}
# What the served outputs are also measured against, each an fp64 oracle: no cache rounding at all
# (transformers' layer), and the numerics of DeepSeek's reference code, V4's QAT (FP8 KV, MXFP4
# indexer after the Hadamard), which neither cache mode matches exactly.
BASELINES = {"unquantized": Numerics(), "V4 reference": Numerics(kv="fp8", indexer="mxfp4")}
SHORT = {SLIDING: "sliding", CSA: "CSA", HCA: "HCA"}
ATTN_OPS = ("qkv_prep", "compressor_update", "indexer_q_prep", "indexer_topk", "visible_entries", "sparse_attn",
            "inv_rope")


class Stack(nn.Module):
    """The first `n` attention layers of a preset with a residual between them: h += layer(h).
    With a process group the layers are tensor parallel (load a full stack's state dict)."""

    def __init__(self, cfg: DSV4AttentionConfig, n: int, seed: int, formats: CacheFormats, process_group=None):
        super().__init__()
        self.numerics = v4_numerics(formats)  # the oracle's modes
        self.layers = nn.ModuleList(testing.randomize_(DeepseekV4Attention(cfg, i, formats=formats,
                                                                           process_group=process_group), seed=seed + i)
                                    for i in range(n))

    def forward(self, x: torch.Tensor, step) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x, step)
        return x


def schedule(lengths: list[int], prompts: list[int], budget: int) -> list[dict]:
    """Continuous batching: each step, one token for every request past its prompt (until it has
    all its tokens), then prefill chunks of the others in order, up to `budget` tokens."""
    done, steps = [0] * len(lengths), []
    while any(d < n for d, n in zip(done, lengths)):
        step = {r: 1 for r, (d, p, n) in enumerate(zip(done, prompts, lengths)) if p <= d < n}
        room = budget - len(step)
        for r, (d, p) in enumerate(zip(done, prompts)):
            if d < p and room > 0:
                step[r] = min(p - d, room)
                room -= step[r]
        for r, n in step.items():
            done[r] += n
        steps.append(step)
    return steps


class Progress:
    """One status line: rewritten in place on a terminal, printed every tenth of the run otherwise."""

    def __init__(self, total: int, out=None):
        out = out or sys.stdout
        self.total, self.out, self.tty, self.shown = total, out, out.isatty(), -1

    def update(self, i: int, text: str):
        frac = (i + 1) / self.total
        bar = "#" * int(24 * frac) + "." * (24 - int(24 * frac))
        line = f"  [{bar}] step {i + 1}/{self.total} {text}"
        if self.tty:
            self.out.write("\r" + line + ("\n" if i + 1 == self.total else ""))
            self.out.flush()
        elif int(10 * frac) > self.shown:
            self.shown = int(10 * frac)
            print(line, file=self.out, flush=True)


def backend_name(device: torch.device) -> str:
    if device.type != "cuda":
        return "reference kernels (pure PyTorch, dsv4ops/<family>/reference.py): no GPU"
    chosen = sorted({backends(op)[0] for op in ATTN_OPS})
    return f"{'/'.join(chosen)} kernels on {torch.cuda.get_device_name(device)}"


def oracle_check(stack: Stack, x: torch.Tensor, out: torch.Tensor) -> dict:
    """The fp64 oracle stack in the cache's numerics on one request's whole sequence x [L, hidden] vs
    the served `out`; the budget is 2x the distance of the oracle's model-dtype run and its rounding
    twins (values within 2^-17 of a rounding boundary moved once) to the fp64 run
    (testing.assert_close_to_ref). Tokens past the budget are counted and their largest error
    reported. `vs`: for each of BASELINES, the served output's largest and RMS distance to that fp64
    oracle, and the RMS relative to the RMS of the layers' part of that oracle's output (minus the
    residual input x): what the cache's formats cost (random weights, not a model's)."""
    cfg = stack.layers[0].config
    params = [{k: v.detach() for k, v in layer.named_parameters()} for layer in stack.layers]

    def run(dtype, numerics=stack.numerics):
        h = x.detach().to(dtype)[None]
        for i, p in enumerate(params):
            h = h + reference.attention({k: v.to(dtype) for k, v in p.items()}, cfg, i, h, numerics)
        return h[0]

    with torch.no_grad():
        ref = run(torch.float64)
        lowp = (run(x.dtype).double() - ref).abs().max().item()
        twins = max((t - ref).abs().max().item() for t in testing.rounding_twins(lambda: run(torch.float64)))
        vs = {}
        for name, numerics in BASELINES.items():
            base = run(torch.float64, numerics)
            off = out.double() - base
            layers = base - x.double()
            vs[name] = {"max": off.abs().max().item(), "rms": off.square().mean().sqrt().item(),
                        "rel_rms": (off.square().mean() / layers.square().mean()).sqrt().item()}
    bound = 2 * max(lowp, twins) + torch.finfo(out.dtype).eps * ref.abs().max().item()
    per_token = (out.double() - ref).abs().amax(-1)
    return {"err": per_token.max().item(), "lowp": lowp, "twins": twins, "bound": bound,
            "scale": ref.abs().max().item(), "beyond": int((per_token > bound).sum()), "tokens": x.shape[0],
            "vs": vs}


def device_arg(text: str) -> torch.device:
    """--device: cpu, or cuda / cuda:N of a GPU this machine has (argparse reports the error)."""
    try:
        device = torch.device(text)
    except RuntimeError:
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}") from None
    if device.type == "cpu" and device.index not in (None, 0):
        # torch accepts "cpu:1" but its tensors land on "cpu": the layers and the cache would disagree.
        raise argparse.ArgumentTypeError(f"expected cpu (the CPU has no device index), got {text!r}")
    if device.type == "cuda":
        count = torch.cuda.device_count()
        if not count or (device.index is not None and device.index >= count):
            raise argparse.ArgumentTypeError(f"expected one of this machine's {count} CUDA devices, got {text!r}")
    elif device.type != "cpu":
        raise argparse.ArgumentTypeError(f"expected cpu, cuda or cuda:N, got {text!r}")
    return device


def main(argv=None):
    gpu = torch.cuda.is_available()
    ap = argparse.ArgumentParser(prog="python -m dsv4ops", description=__doc__)
    ap.add_argument("--preset", choices=sorted(PRESETS), default="flash" if gpu else "tiny",
                    help="model dims (tiny: V4 layout dims, 4 heads, hidden 256)")
    ap.add_argument("--layers", type=int, default=4 if gpu else 3,
                    help="the first N layers of the preset (tiny: sliding, CSA, HCA, CSA; flash: 2 sliding, then "
                         "CSA / HCA alternating)")
    ap.add_argument("--requests", type=int, default=4)
    # GPU default 2048: the fp64 oracle's dense [tokens, heads, keys] scores of a Flash layer take
    # ~3 GB there, four times that at 4096.
    ap.add_argument("--context", type=int, default=2048 if gpu else 300, help="tokens of the longest request")
    ap.add_argument("--step-tokens", type=int, default=1024 if gpu else 128, help="token budget of one step")
    ap.add_argument("--compile", choices=COMPILE, default="cudagraphs" if gpu else "aot_eager",
                    help="torch.compile of the step: cudagraphs = Inductor + CUDA graphs (mode='reduce-overhead'); "
                         "aot_eager = one Dynamo graph per bucket running the ops eagerly (CPU default: Inductor's "
                         "CPU compile alone takes minutes)")
    ap.add_argument("--kv-cache", choices=sorted(DEFAULT_INDEXER), default="fp8",
                    help="compressed entries: fp8 (584-B rows, as the window ring) or fp4 (288-B FP4 rows; V4 was not "
                         "trained for them)")
    ap.add_argument("--indexer-cache", choices=("fp8", "mxfp4"),
                    help="index keys: fp8 (132-B) or mxfp4 (68-B, after V4's Hadamard); default fp8 with --kv-cache "
                         "fp8, mxfp4 with fp4")
    ap.add_argument("--device", type=device_arg, default="cuda" if gpu else "cpu")
    # One thread by default on a CPU: the tiny preset's ops are too small to share, and where other
    # processes load the cores, threads that spin-wait for each other at every op made a 4-token
    # decode step take ~2 s instead of ~75 ms (2-core machine at load 8; at load 0 one thread is as fast).
    ap.add_argument("--threads", type=int, default=None,
                    help="CPU threads of torch's ops while the demo runs (default: 1 on a CPU, torch's own with a GPU)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--parallel", choices=("none", "tp", "dcp"), default="none",
                    help="under torchrun: tp = the layers' heads split over the processes (one GPU each); dcp = the "
                         "cache's compressed entries split over them (decode context parallelism)")
    args = ap.parse_args(argv)
    if args.parallel != "none" and "WORLD_SIZE" not in os.environ:
        ap.error(f"--parallel {args.parallel}: run under torchrun (torchrun --nproc-per-node N -m dsv4ops ...)")
    if args.requests < 1 or args.layers < 1 or args.context < 2 or args.step_tokens < args.requests:
        ap.error("expected --requests >= 1, --layers >= 1, --context >= 2 and --step-tokens >= --requests")
    if args.threads is not None and args.threads < 1:
        ap.error(f"--threads: expected >= 1, got {args.threads}")
    threads = torch.get_num_threads()
    torch.set_num_threads(args.threads or (threads if args.device.type == "cuda" else 1))
    try:
        return run(args)
    finally:
        torch.set_num_threads(threads)
        # The group _process_group joined (torchrun's), its CUDA graphs freed first; not where the run
        # failed before joining (the error is the run's).
        if args.parallel != "none" and torch.distributed.is_initialized():
            from dsv4ops.parallel import destroy_process_group

            destroy_process_group()


def _process_group(args) -> tuple:
    """(group or None, device, whether this process prints): under torchrun, the default group of
    every process (NCCL with one GPU a process, gloo on CPU)."""
    device = torch.device(args.device)
    if getattr(args, "parallel", "none") == "none":
        return None, device, True
    import torch.distributed as dist

    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    return dist.group.WORLD, device, dist.get_rank() == 0


def run(args) -> dict:
    group, device, shown = _process_group(args)
    out = sys.stdout if shown else open(os.devnull, "w")
    cfg = PRESETS[args.preset]()
    if args.layers > cfg.num_layers:
        raise SystemExit(f"--layers: the {args.preset} preset has {cfg.num_layers} layers, got {args.layers}")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    kv_cache = args.kv_cache
    indexer_cache = args.indexer_cache or DEFAULT_INDEXER[kv_cache]
    fmts = CacheFormats.v4().replace(comp=COMP_FORMAT[kv_cache], index=INDEX_FORMAT[indexer_cache])
    numerics = v4_numerics(fmts)
    torch.manual_seed(args.seed)
    full = Stack(cfg, args.layers, args.seed, fmts).to(device, dtype)  # the oracle's weights
    stack = full
    if args.parallel == "tp":
        stack = Stack(cfg, args.layers, args.seed, fmts, process_group=group).to(device, dtype)
        stack.load_state_dict(full.state_dict())  # each rank keeps its heads' share
    n = args.requests
    lengths = [max(2, args.context - r * args.context // (2 * n)) for r in range(n)]
    prompts = [max(1, L - max(1, min(16, L // 4))) for L in lengths]
    steps = schedule(lengths, prompts, args.step_tokens)
    buckets = tuple(sorted({min(n, args.step_tokens), args.step_tokens}))
    cache_cfg = CacheConfig(formats=fmts, exact_dtype=dtype, max_requests=n, max_context=max(lengths),
                            max_step_tokens=args.step_tokens, buckets=buckets)
    formats = "/".join(dict.fromkeys((fmts.window, fmts.comp, fmts.index)))
    manager = KVCacheManager(cfg, cache_cfg, device=device, dcp_group=group if args.parallel == "dcp" else None)
    for layer in stack.layers:
        layer.attach_cache(manager)
    kinds = ", ".join(SHORT[layer.layer_type] for layer in stack.layers)
    ranks = "" if group is None else f"; {args.parallel} over {torch.distributed.get_world_size(group)} processes"
    print(f"dsv4ops demo: {args.preset} preset, {args.layers} layers ({kinds}), {dtype}, {device}; "
          f"{n} requests of {min(lengths)}..{max(lengths)} tokens ({sum(lengths) - sum(prompts)} decode tokens), "
          f"{len(steps)} steps of <= {args.step_tokens} tokens (buckets {buckets}); paged cache {kv_cache} / "
          f"{indexer_cache} ({formats} rows); "
          f"compile: {args.compile}{ranks}", file=out)
    step_fn = _compiled(stack, args.compile)
    g = torch.Generator().manual_seed(args.seed + 1)
    inputs = [torch.randn(L, cfg.hidden_size, generator=g).to(device, dtype) for L in lengths]
    outs, done = [[] for _ in range(n)], [0] * n
    for r in range(n):
        manager.admit(r)
    progress = Progress(len(steps), out)
    calls: dict[int, int] = {}  # bucket -> steps run in it
    warm_time, warm_tokens, t_start = 0.0, 0, time.perf_counter()
    with torch.no_grad():
        for i, new in enumerate(steps):
            t0 = time.perf_counter()
            with manager.step(new) as step:
                rows = [inputs[r][done[r]:done[r] + k] for r, k in new.items()]
                x = torch.cat(rows)
                x = torch.cat([x, x.new_zeros(step.positions.shape[0] - x.shape[0], x.shape[1])])
                if args.compile == "cudagraphs":
                    torch.compiler.cudagraph_mark_step_begin()
                y = step_fn(x, step)
                j = 0
                for r, k in new.items():
                    outs[r].append(y[j:j + k].clone())
                    done[r] += k
                    j += k
            if device.type == "cuda":
                torch.cuda.synchronize()
            dt = time.perf_counter() - t0
            bucket = step.positions.shape[0]
            # A bucket's first two steps compile (and, with CUDA graphs, warm up and record): not
            # steady state.
            calls[bucket] = calls.get(bucket, 0) + 1
            if calls[bucket] > 2:
                warm_time, warm_tokens = warm_time + dt, warm_tokens + sum(new.values())
            prefill = sum(k for r, k in new.items() if done[r] <= prompts[r])
            progress.update(i, f"| {sum(new.values())} tokens ({prefill} prefill) | bucket {bucket} | "
                               f"{dt * 1e3:.0f} ms")
    total = time.perf_counter() - t_start
    mem = memory(cfg.replace(num_layers=args.layers, compress_ratios=cfg.compress_ratios[:args.layers]), cache_cfg)
    pools = sum(b.numel() * b.element_size() for layer in stack.layers for b in layer.cache.buffers())
    tokens = sum(lengths)
    print(f"backend: {backend_name(device)}", file=out)
    steady = (f"{warm_tokens / warm_time:.0f} tokens/s over the steps after each bucket's first two"
              if warm_time else "no step ran after its bucket's first two (compile, record)")
    print(f"throughput: {tokens} tokens in {total:.1f} s = {tokens / total:.0f} tokens/s including compilation; "
          f"{steady}", file=out)
    print(f"cache: {pools / 2**20:.1f} MiB of pools for {n} requests x {max(lengths)} positions "
          f"({mem['bytes_per_token']:.0f} B per context token over {args.layers} layers, "
          f"{mem['fixed_bytes_per_request'] / 2**20:.2f} MiB fixed per request: window rings and compressor states)",
          file=out)
    print(f"deviation from the float64 oracle in the cache's numerics ({numerics}) on each request's whole "
          f"sequence; budget = 2 x the larger of the oracle's own {str(dtype)[6:]} run and its rounding twins (every "
          f"value within 2^-17 of a bf16 / FP8 / FP4 rounding boundary moved across it); then from the float64 "
          f"oracle without cache rounding and in DeepSeek's reference numerics ({BASELINES['V4 reference']}): "
          f"what the cache's formats cost (rms, and in % of the rms of the layers' part of the output):", file=out)
    results = []
    for r in range(n):
        res = oracle_check(full, inputs[r], torch.cat(outs[r]))
        results.append(res)
        verdict = "within budget" if res["beyond"] == 0 else f"{res['beyond']} of {res['tokens']} tokens past it"
        print(f"  request {r}: {res['tokens']:5d} tokens | max |out - oracle| {res['err']:.1e} "
              f"(|oracle| <= {res['scale']:.1f}) | {str(dtype)[6:]} run {res['lowp']:.1e}, twins {res['twins']:.1e} "
              f"-> budget {res['bound']:.1e}: {verdict}", file=out)
        print("      " + " | ".join(f"vs {name}: rms {v['rms']:.1e} ({100 * v['rel_rms']:.2f}%), max {v['max']:.1e}"
                                    for name, v in res["vs"].items()), file=out)
    return {"results": results, "tokens": tokens, "seconds": total, "numerics": numerics}


def _compiled(stack: Stack, mode: str):
    if mode == "none":
        return stack
    if mode == "aot_eager":
        return torch.compile(stack, backend="aot_eager", fullgraph=True)
    if mode == "inductor":
        return torch.compile(stack, fullgraph=True)
    return torch.compile(stack, mode="reduce-overhead", fullgraph=True)


if __name__ == "__main__":
    main()
