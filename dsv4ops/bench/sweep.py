"""`python -m dsv4ops bench --sweep`: dsv4::sparse_attn against FlashMLA's sparse decode over a grid
(issue 30): each layer kind x model x query heads a rank x batch x context, on the same pools and
key lists, one CUDA-graph timing each (timing.graph_time_us), then the worst and median ratio per
(kind, model, heads), printed last. `--sweep-quick` runs a subset.

- Heads: V4-Flash 64 and its tensor-parallel shards 32 / 16 / 8 (TP2 / 4 / 8); V4-Pro 128 and 16 / 8
  (TP8 / 16). FlashMLA on Hopper takes 64 or 128 heads: engines (vLLM, SGLang, TensorRT-LLM) pad q
  with zero heads to the smallest of the two >= H and slice the output. FlashMLA's time does not
  depend on the padded heads' values, so one FlashMLA timing at 64 heads (128 for Pro's 128 row)
  serves every row of a point; Pro's shard rows also show the ratio to its 128-head time. The pad
  copy (q into the padded buffer, ~1-3 us) is not timed: FlashMLA's row is a lower bound.
- V4-Pro has no sliding main layer: its "sliding" rows are its MTP layer's (a sliding layer of the
  Pro dims: 128 heads).
- A point's pools hold its real context (batch x context tokens; Case), built, timed and freed
  before the next one; a point whose estimate (point_bytes) exceeds the free GPU memory is skipped
  and listed. The largest, CSA 256 x 1M, holds 48.5 GB of pools (FP8 entries + indexer keys).
- Cost: a timing replays a graph of GRAPH_REPS calls GRAPH_ITERS + 3 times (~140 calls); with the
  pools' fill (~1 ms per 256K entries) a point takes ~0.1 s at 4K and up to ~2 s at 256 x 1M, the
  grid (180 points, 630 rows) ran in 39 s on an H200 (2026-11-27), the whole --sweep with the layer
  steps in 74 s; each point's wall time is printed (`point_s`).
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import torch

from dsv4ops.bench import flashmla
from dsv4ops.cache.config import CacheConfig, layer_pools, topk_workspace_words
from dsv4ops.config import CSA, HCA, SLIDING, DSV4AttentionConfig

BATCHES = (1, 8, 32, 64, 128, 256)
CONTEXTS = (4096, 16384, 65536, 262144, 1 << 20)
KINDS = (SLIDING, CSA, HCA)
HEADS = {"flash": (64, 32, 16, 8), "pro": (128, 16, 8)}
QUICK = {"batches": (1, 32, 128), "contexts": (4096, 65536), "heads": {"flash": (64, 8), "pro": (128, 16)}}
FLASHMLA_HEADS = (64, 128)  # the head counts FlashMLA's Hopper kernels take
GRAPH_ITERS, GRAPH_REPS = 10, 10
TARGET = 0.9  # issue 30: sparse_attn <= 0.9 x FlashMLA's time at every point
# Issue 30: a tensor-parallel rank's 8 / 16 / 32 heads <= 0.6 x FlashMLA's padded time at batch >= 32.
SHARD_TARGET, SHARD_BATCH = 0.6, 32
MARGIN_BYTES = 2 << 30  # allocator slack, FlashMLA's and the split kernel's scratch
KIND_NAMES = {SLIDING: "sliding", CSA: "CSA", HCA: "HCA"}


@dataclass(frozen=True)
class Point:
    model: str  # "flash" | "pro"
    kind: str
    batch: int
    context: int

    @property
    def label(self) -> str:
        ctx = f"{self.context >> 20}M" if self.context >= 1 << 20 else f"{self.context >> 10}K"
        return f"{self.model} {KIND_NAMES[self.kind]} {self.batch} x {ctx}"


def model_config(model: str, kind: str) -> DSV4AttentionConfig:
    """The dims of a point: V4-Flash, or V4-Pro (whose sliding layer is its MTP layer: Pro's dims
    with layer 0 sliding)."""
    if model == "flash":
        return DSV4AttentionConfig.flash()
    pro = DSV4AttentionConfig.pro()
    return pro.replace(compress_ratios=(0,) + pro.compress_ratios[1:]) if kind == SLIDING else pro


def flashmla_heads(heads: int) -> int:
    """The head count engines pad q to for FlashMLA's Hopper kernels."""
    return next(h for h in FLASHMLA_HEADS if h >= heads)


def grid(quick: bool = False) -> list[Point]:
    """Every point in run order: model, kind (one layer built per pair), batch, context."""
    batches, contexts = (QUICK["batches"], QUICK["contexts"]) if quick else (BATCHES, CONTEXTS)
    return [Point(m, k, b, c) for m in HEADS for k in KINDS for b in batches for c in contexts]


def heads_of(model: str, quick: bool = False) -> tuple[int, ...]:
    return (QUICK["heads"] if quick else HEADS)[model]


def cache_config(point: Point) -> CacheConfig:
    """The cache a Case builds for this point (bench/attention.py): pools of batch x (context + 1) tokens."""
    tokens = point.context + 1
    return CacheConfig(max_requests=point.batch, max_context=tokens, max_total_tokens=point.batch * tokens,
                       max_step_tokens=point.batch, buckets=(point.batch,))


def cache_bytes(point: Point, model: DSV4AttentionConfig | None = None) -> int:
    """Bytes of the layer's pools and the indexer's top-k workspace (allocated for any layer of a
    model with CSA layers) of this point's cache (model: the point's dims unless given)."""
    model = model or model_config(point.model, point.kind)
    cfg = cache_config(point)
    layer_idx = next(i for i in range(model.num_layers) if model.layer_type(i) == point.kind)
    pools = sum(_numel(s.shape) * _itemsize(s.dtype) for s in layer_pools(model, layer_idx, cfg))
    return pools + 4 * topk_workspace_words(model, cfg)


def point_bytes(point: Point, heads: tuple[int, ...]) -> int:
    """cache_bytes plus the step's buffers: x, q / q_rot / o / o_rot at the model's heads, one q and
    out a head count, the key list, the fill's 256K-row chunk, and MARGIN_BYTES."""
    model = model_config(point.model, point.kind)
    t, d = point.batch, model.head_dim
    qo = 2 * t * d * (4 * model.num_heads + 2 * sum(heads) + 2 * max(FLASHMLA_HEADS))
    keys = model.index_topk if point.kind == CSA else -(-point.context // model.hca_ratio) if point.kind == HCA else 0
    fill = (1 << 18) * (2 * 512 + 584)
    return cache_bytes(point) + 2 * t * model.hidden_size + qo + 4 * t * (keys + 64) + fill + MARGIN_BYTES


def plan(points: list[Point], budget: int, quick: bool = False) -> tuple[list[Point], list[tuple[Point, int]]]:
    """(points that fit `budget` bytes, [(skipped point, its estimate)])."""
    run, skipped = [], []
    for p in points:
        need = point_bytes(p, heads_of(p.model, quick))
        (run.append(p) if need <= budget else skipped.append((p, need)))
    return run, skipped


def _numel(shape) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


# ---- timing a point -------------------------------------------------------------------------------
def _ours(case, heads: int):
    """sparse_attn on the case's step at `heads` query heads (the first heads of q_rot, contiguous,
    as a rank holds its shard)."""
    layer, cache, st, cfg = case.layer, case.layer.cache, case.step, case.model
    q = case.q_rot if heads == cfg.num_heads else case.q_rot[:, :heads].contiguous()
    sinks = layer.sinks[:heads].contiguous()
    out = torch.empty_like(q)
    comp, comp_fmt = (cache.comp, cache.fmt["comp"]) if layer.compressor is not None else (cache.window,
                                                                                          cache.fmt["window"])

    def run():
        torch.ops.dsv4.sparse_attn(q, cache.window, comp, st.positions, st.req_slots, case.idx, case.lens,
                                   st.window_ends, sinks, out, cfg.head_dim**-0.5, cfg.window, cache.ring_size,
                                   cache.fmt["window"], comp_fmt)
        return out
    return run


def _flashmla(case, heads: int):
    """FlashMLA's decode at `heads` (64 or 128) heads: the first heads of q_rot (the zero pad's
    place; FlashMLA's time does not depend on its values)."""
    layer, cache, st, cfg = case.layer, case.layer.cache, case.step, case.model
    q = case.q_rot if heads == cfg.num_heads else case.q_rot[:, :heads].contiguous()
    comp = cache.comp if layer.compressor is not None else cache.window
    run = flashmla.Decode(cache.window, comp, st.positions, st.req_slots, layer.sinks[:heads].contiguous(),
                          cfg.head_dim**-0.5, cfg.window, cache.ring_size)
    return lambda: run(q, case.idx, case.lens)


def _rel_diff(ours, theirs, heads: int) -> float:
    a, b = ours().float(), theirs()[:, :heads].float()
    return ((a - b).abs().max() / b.abs().max()).item()


def _time(fn, timer) -> tuple[float | None, str | None]:
    try:
        return timer(fn, iters=GRAPH_ITERS, reps=GRAPH_REPS), None
    except RuntimeError as e:  # reported in the row: the point's other rows still run
        return None, f"{type(e).__name__}: {str(e).splitlines()[0][:150]}"


def run_point(point: Point, layer, heads: tuple[int, ...], timer, device="cuda",
              model: DSV4AttentionConfig | None = None) -> list[dict]:
    """One row per head count: ours, FlashMLA at its padded heads, their ratio and output difference
    (model: the point's dims unless given; `layer` must have them)."""
    from dsv4ops.bench.attention import Case

    start = time.perf_counter()
    case = Case(point.kind, point.batch, point.context, 1, device=device,
                model=model or model_config(point.model, point.kind), layer=layer)
    calls = case.op_calls()
    for op in ("qkv_prep", "indexer_q_prep", "indexer_topk"):  # the inputs sparse_attn reads
        if op in calls:
            calls[op]()
    theirs = {}
    if flashmla.available():
        for fh in sorted({flashmla_heads(h) for h in heads} | ({128} if point.model == "pro" else set())):
            fn = _flashmla(case, fh)
            theirs[fh] = (fn, *_time(fn, timer))
    rows = []
    for h in heads:
        ours = _ours(case, h)
        us, err = _time(ours, timer)
        fh = flashmla_heads(h)
        fn, fus, ferr = theirs.get(fh, (None, None, None))
        row = dict(model=point.model, layer=KIND_NAMES[point.kind], batch=point.batch, context=point.context,
                   heads=h, us=us, flashmla_heads=fh, flashmla_us=fus,
                   vs_flashmla=None if us is None or fus is None else us / fus, error=err or ferr)
        if point.model == "pro" and h < 128 and 128 in theirs and theirs[128][1] is not None and us is not None:
            row["vs_flashmla_128"] = us / theirs[128][1]
        if us is not None and fus is not None:
            row["rel_diff"] = _rel_diff(ours, fn, h)
        rows.append(row)
    case.release()
    del case, calls, theirs
    if device == "cuda":
        torch.cuda.empty_cache()
    for row in rows:
        row["point_s"] = time.perf_counter() - start
    return rows


def run(quick: bool = False, progress=print, device="cuda", budget: int | None = None, timer=None) -> dict:
    """{"rows": every row, "skipped": [(label, GB needed)], "summary": summarize(rows), "seconds"}."""
    from dsv4ops.bench.attention import new_layer
    from dsv4ops.bench.timing import graph_time_us

    timer = timer or graph_time_us
    start = time.perf_counter()
    points = grid(quick)
    if budget is None:
        free, _ = torch.cuda.mem_get_info()
        budget = free - _largest_layer_bytes()
    todo, skipped = plan(points, budget, quick)
    rows, layer, layer_key = [], None, None
    for p in todo:
        if (p.model, p.kind) != layer_key:
            layer = None
            if device == "cuda":
                torch.cuda.empty_cache()
            layer, layer_key = new_layer(p.kind, model_config(p.model, p.kind), device), (p.model, p.kind)
        with torch.no_grad():
            new = run_point(p, layer, heads_of(p.model, quick), timer, device)
        for r in new:
            progress(r)
        rows.extend(new)
    return {"rows": rows, "skipped": [(p.label, need / 1e9) for p, need in skipped], "summary": summarize(rows),
            "seconds": time.perf_counter() - start}


def _largest_layer_bytes() -> int:
    """A V4-Pro CSA layer's weights (bf16, fp32 compressors): the sweep holds one layer at a time."""
    from dsv4ops import DeepseekV4Attention
    from dsv4ops.bench.attention import FP8

    pro = DSV4AttentionConfig.pro()
    with torch.device("meta"):
        layer = DeepseekV4Attention(pro, next(i for i in range(pro.num_layers) if pro.layer_type(i) == CSA),
                                    formats=FP8).to(torch.bfloat16)
    return sum(p.numel() * p.element_size() for p in layer.parameters())


def summarize(rows: list[dict]) -> list[dict]:
    """Per (layer kind, model, heads): points timed, worst and median ours / FlashMLA (and the worst's
    point), how many exceed TARGET; over the points of batch >= SHARD_BATCH the worst and median, and
    for a rank's shard (FlashMLA padded to more heads) how many of those exceed SHARD_TARGET."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if r.get("vs_flashmla") is not None:
            groups.setdefault((r["layer"], r["model"], r["heads"]), []).append(r)
    out = []
    for (kind, model, heads), rs in groups.items():
        worst = max(rs, key=lambda r: r["vs_flashmla"])
        ratios = [r["vs_flashmla"] for r in rs]
        large = [r["vs_flashmla"] for r in rs if r["batch"] >= SHARD_BATCH]
        shard = all(r.get("flashmla_heads", heads) > heads for r in rs)
        out.append(dict(layer=kind, model=model, heads=heads, points=len(rs), worst=worst["vs_flashmla"],
                        worst_at=f"{worst['batch']} x {_ctx(worst['context'])}", median=statistics.median(ratios),
                        over_target=sum(v > TARGET for v in ratios),
                        large_batch_worst=max(large) if large else None,
                        large_batch_median=statistics.median(large) if large else None,
                        shard_over_target=sum(v > SHARD_TARGET for v in large) if shard and large else None))
    return out


def _ctx(context: int) -> str:
    return f"{context >> 20}M" if context >= 1 << 20 else f"{context >> 10}K"


COLUMNS = ["model", "layer", "batch", "context", "heads", "us", "flashmla_heads", "flashmla_us", "vs_flashmla",
           "vs_flashmla_128", "rel_diff", "point_s", "error"]
SUMMARY_COLUMNS = ["layer", "model", "heads", "points", "worst", "worst_at", "median", "over_target",
                   "large_batch_worst", "large_batch_median", "shard_over_target"]
