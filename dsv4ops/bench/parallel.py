"""`torchrun --nproc-per-node 2 -m dsv4ops bench --only parallel`: tensor and decode context
parallelism on 2 GPUs (NCCL), V4-Flash layers, each step compiled with its collectives (Inductor) and
timed in a CUDA graph of 10 steps (CUDA events, median of the replays; both ranks run the same steps,
rank 0 reports):

- TP2 against one GPU, decode at batch 1 / 32 / 128 x 4K (CSA and HCA layers): the whole layer's
  step, and the share of it one all-reduce of the layer output [batch, hidden] bf16 takes (timed
  alone, compiled the same way).
- DCP2 against one GPU, decode at batch 1 x 256K and 1M (CSA and HCA layers): the step; KV bytes
  per rank for the whole model (43 layers: compressed pools of a rank's blocks, window rings and
  compressor states) against one GPU's; the longest context one request can hold per GPU in the
  memory free at the start (90% of it), one GPU against DCP2.
- The indexer: replicated (every rank scores all 64 heads: indexer_q_prep + indexer_topk) against
  heads split over the ranks with the scores summed by an all-reduce, at 1 / 32 / 128 x 4K and 64K.
  dsv4ops has no score-only op, so the split side is a lower bound: indexer_q_prep + indexer_topk on
  32 heads (scores and a select) plus one all-reduce of the [tokens, entries] fp32 scores; the
  faster side is named per shape.

Caches are filled synthetically (bench/attention.py's way): requests hold `context - 1` tokens,
their blocks allocated (context parallel: each from its owner's pool), every slot written with
random entries. On a CPU (gloo, reference kernels) the same code runs for a smoke test at tiny dims
(`run(model=DSV4AttentionConfig.tiny(), ...)`), timed with the host clock."""

from __future__ import annotations

import statistics
import time

import torch
import torch.distributed as dist

from dsv4ops import CacheFormats, DeepseekV4Attention, DSV4AttentionConfig, testing
from dsv4ops.bench import timing
from dsv4ops.bench.attention import _fill
from dsv4ops.cache import CacheConfig, KVCacheManager
from dsv4ops.cache.config import layer_pools
from dsv4ops.config import CSA, HCA
from dsv4ops.parallel import Group, all_reduce

FP8 = CacheFormats.v4()
TP_CASES = ((1, 4096), (32, 4096), (128, 4096))
DCP_CASES = ((1, 256 * 1024), (1, 1024 * 1024))
INDEXER_CASES = ((1, 4096), (32, 4096), (128, 4096), (1, 65536), (32, 65536), (128, 65536))
GRAPH_REPS = 10  # calls in a timed graph: its replay's own launch (~8 us) spread over them
COLUMNS = ["part", "layer", "batch", "context", "one_gpu_us", "parallel_us", "ratio", "collective_us",
           "collective_share", "kv_bytes_one_gpu", "kv_bytes_per_rank", "kv_ratio", "max_context_one_gpu",
           "max_context_per_rank", "replicated_us", "split_us", "faster", "note"]


def _time_us(fn, iters: int = 20) -> float:
    """Median time of one fn() (a compiled step). CUDA: fn captured GRAPH_REPS times in one CUDA graph
    with its collectives (timing.graph_time_us), the GPU's time as a serving engine's step graph runs
    it. Timing a Python call of a mode="reduce-overhead" function instead measured the host: 300-500 us
    a layer step and 100-230 us an all-reduce on 2 x H200 (2026-11-27), where NCCL's all-reduce of
    [128, 4096] bf16 takes ~17 us in a graph (issue 31)."""
    if torch.cuda.is_available():
        return timing.graph_time_us(fn, iters, GRAPH_REPS)
    for _ in range(3):
        fn()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(times)


def _compiled(fn):
    """fn compiled whole with its collectives (Inductor on CUDA, its CUDA graph made by _time_us);
    every case compiles anew (Dynamo's caches reset: the cases' layers share one forward, whose
    recompile limit would otherwise be reached)."""
    torch._dynamo.reset()
    cuda = torch.cuda.is_available()
    return torch.compile(fn, fullgraph=True, backend="inductor" if cuda else "aot_eager")


def _book(manager: KVCacheManager, rid, length: int) -> None:
    """`length` tokens of a request booked without running them: blocks allocated (each from its
    owner's pool), length set."""
    slot = manager.admit(rid)
    for kind, ratio in manager.ratios.items():
        if not manager.widths[kind]:
            continue
        n = -(-(length // ratio) // manager.cfg.block_size)
        blocks = [manager.allocators[kind].take(1, b % manager.shards)[0] for b in range(n)]
        manager._set_blocks(kind, slot, slice(0, n), torch.tensor(blocks, dtype=torch.int32))
    manager.length[rid] = length


def _layer_step(model, kind: str, batch: int, context: int, device, state: dict | None, tp=None, dcp=None):
    """(time of one compiled decode step of a `kind` layer at batch x context, the layer): its
    weights from `state` (one GPU's full layer) when given."""
    li = next(i for i in range(model.num_layers) if model.layer_type(i) == kind)
    layer = DeepseekV4Attention(model, li, formats=FP8, process_group=tp)
    if state is None:
        testing.randomize_(layer)
    else:
        layer.load_state_dict(state)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    layer = layer.to(device, dtype)
    cfg = CacheConfig(max_requests=batch, max_context=context, max_total_tokens=batch * context, max_step_tokens=batch,
                      buckets=(batch,))
    manager = KVCacheManager(model, cfg, device=device, dcp_group=dcp)
    layer.attach_cache(manager)
    for r in range(batch):
        _book(manager, r, context - 1)
    gen = torch.Generator(device=device).manual_seed(0)
    cache = layer.cache
    for name, dim in (("window", model.head_dim), ("comp", model.head_dim), ("index", model.index_head_dim)):
        if hasattr(cache, name):
            _fill(getattr(cache, name), dim, cache.fmt[name], gen)
    step = manager.prepare_step({r: 1 for r in range(batch)})
    x = torch.randn(batch, model.hidden_size, device=device, dtype=dtype, generator=gen)
    fn = _compiled(layer)
    with torch.no_grad():
        us = _time_us(lambda: fn(x, step))
    return us, layer


def _model_kv_bytes(model: DSV4AttentionConfig, context: int, shards: int) -> tuple[int, int]:
    """(bytes of one request's cache at `context` over every layer of the model on one rank,
    the bytes that grow with the context per token) for FP8 pools."""
    def total(ctx):
        cfg = CacheConfig(max_requests=1, max_context=ctx, max_step_tokens=1)
        return sum(spec.nbytes for li in range(model.num_layers) for spec in layer_pools(model, li, cfg, shards))

    return total(context), (total(2 * context) - total(context)) / context


def run(model: DSV4AttentionConfig | None = None, tp_cases=TP_CASES, dcp_cases=DCP_CASES,
        indexer_cases=INDEXER_CASES, progress=None) -> list[dict]:
    """The rows (every rank returns them; rank 0 prints). Needs an initialized process group of 2."""
    model = model or DSV4AttentionConfig.flash()
    group = dist.group.WORLD
    g = Group.of(group)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
    rows = []

    def add(row):
        rows.append(row)
        if progress is not None:
            progress(row)

    for kind in (CSA, HCA):
        for batch, context in tp_cases:
            one, full = _layer_step(model, kind, batch, context, device, None)
            state = {k: v.float().cpu() if v.is_floating_point() else v.cpu() for k, v in full.state_dict().items()}
            del full
            par, _ = _layer_step(model, kind, batch, context, device, state, tp=group)
            y = torch.randn(batch, model.hidden_size, device=device,
                            dtype=torch.bfloat16 if device.type == "cuda" else torch.float32)
            reduce = _compiled(lambda t: all_reduce(t, g))
            coll = _time_us(lambda: reduce(y))
            add({"part": "TP2", "layer": kind, "batch": batch, "context": context, "one_gpu_us": one,
                 "parallel_us": par, "ratio": par / one, "collective_us": coll, "collective_share": coll / par})
    for kind in (CSA, HCA):
        for batch, context in dcp_cases:
            one, _ = _layer_step(model, kind, batch, context, device, None)
            par, _ = _layer_step(model, kind, batch, context, device, None, dcp=group)
            kv1, per1 = _model_kv_bytes(model, context, 1)
            kv2, per2 = _model_kv_bytes(model, context, g.size)
            row = {"part": "DCP2", "layer": kind, "batch": batch, "context": context, "one_gpu_us": one,
                   "parallel_us": par, "ratio": par / one, "kv_bytes_one_gpu": kv1, "kv_bytes_per_rank": kv2,
                   "kv_ratio": kv2 / kv1}
            if free is not None:  # the fixed bytes (rings, states) plus the per-token slope, in 90% of free
                fixed1, fixed2 = kv1 - per1 * context, kv2 - per2 * context
                row["max_context_one_gpu"] = int((0.9 * free - fixed1) / per1)
                row["max_context_per_rank"] = int((0.9 * free - fixed2) / per2)
            add(row)
    _indexer_rows(model, indexer_cases, device, g, add)
    return rows


def _indexer_rows(model: DSV4AttentionConfig, cases, device, g: Group, add) -> None:
    li = next(i for i in range(model.num_layers) if model.layer_type(i) == CSA)
    for batch, context in cases:
        row = {"part": "indexer", "layer": CSA, "batch": batch, "context": context}
        times = {}
        for heads in (model.index_n_heads, model.index_n_heads // g.size):
            m = model.replace(index_n_heads=heads)
            try:
                times[heads] = _indexer_time(m, li, batch, context, device)
            except (ValueError, NotImplementedError, RuntimeError) as e:  # a kernel that takes 64 heads only
                row["note"] = f"{heads} heads: {type(e).__name__}: {str(e)[:120]}"
        n = context // model.csa_ratio
        scores = torch.zeros(batch, n, device=device)
        reduce = _compiled(lambda t: all_reduce(t, g))
        coll = _time_us(lambda: reduce(scores))
        row["collective_us"] = coll
        row["replicated_us"] = times.get(model.index_n_heads)
        half = times.get(model.index_n_heads // g.size)
        if half is not None:
            row["split_us"] = half + coll
            row["faster"] = "replicated" if row["replicated_us"] <= row["split_us"] else "split (lower bound)"
        add(row)


def _indexer_time(model: DSV4AttentionConfig, li: int, batch: int, context: int, device) -> float:
    """indexer_q_prep + indexer_topk of one decode step (the step's q and weights precomputed)."""
    layer = DeepseekV4Attention(model, li, formats=FP8)
    testing.randomize_(layer)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    layer = layer.to(device, dtype)
    cfg = CacheConfig(max_requests=batch, max_context=context, max_total_tokens=batch * context, max_step_tokens=batch,
                      buckets=(batch,))
    manager = KVCacheManager(model, cfg, device=device)
    layer.attach_cache(manager)
    for r in range(batch):
        _book(manager, r, context - 1)
    gen = torch.Generator(device=device).manual_seed(0)
    _fill(layer.cache.index, model.index_head_dim, layer.cache.fmt["index"], gen)
    step = manager.prepare_step({r: 1 for r in range(batch)})
    cache = layer.cache
    q = torch.randn(batch, model.index_n_heads, model.index_head_dim, device=device, dtype=dtype, generator=gen)
    w = torch.randn(batch, model.index_n_heads, device=device, dtype=dtype, generator=gen)
    fmt = cache.fmt["index"]
    q_out = torch.empty(q.shape, dtype=torch.float8_e4m3fn if fmt == "fp8_132" else dtype, device=device)
    w_out = torch.empty(w.shape, dtype=torch.float32, device=device)
    idx = torch.empty(batch, model.index_topk, dtype=torch.int32, device=device)

    def select(q, w):
        torch.ops.dsv4.indexer_q_prep(q, w, step.positions, layer.inv_freq, q_out, w_out, fmt)
        torch.ops.dsv4.indexer_topk(q_out, w_out, step.positions, step.req_slots, cache.index, step.block_table(CSA),
                                    None, idx, None, cache.topk_workspace, model.csa_ratio, 0, fmt)
        return idx

    fn = _compiled(select)
    return _time_us(lambda: fn(q, w))
