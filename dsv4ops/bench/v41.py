"""V4.1 benchmarks at V4.1-Flash shapes: every op of each layer role on synthetic pools of V4.1's
own formats (fp8_528 window rows, fp4_288 compressed rows, mxfp4_68 index keys), decode batch
1 / 32 / 128 at 4K / 64K / 1M context and prefill 4096 tokens (or the `cases` asked for), and a
whole-stack decode step (the 40 backbone layers' attention cores, projections excluded) beside the
V4-Flash stack's at the same context (bytes of the cache read per token and time per token).

The engines' Hopper route as a same-run baseline: no public sm_90 kernel reads 528 / 288-B rows, so
engines re-encode V4.1's rows into V4's 584-B layout (dequantize, encode with the V4 codec) and run
FlashMLA's V4 decode. Each sparse_attn row also times, on the window ring and ratio-2 pool
re-encoded that way, FlashMLA's kernel (`flashmla_us`, where the bench kit is installed) and our V4
kernel (`v4_kernel_us`) with the same indices; the stack row's `route_us` is the V4.1 stack with
every sparse_attn swapped for FlashMLA's on the re-encoded pools (every other op ours).

Pools are filled with random rows; each request holds `context - 1` tokens before the step, its
blocks allocated in order. Times come from CUDA graphs of 20 calls (bench/timing.py)."""

from __future__ import annotations

import torch

from dsv4ops import DSV4AttentionConfig, ops
from dsv4ops.bench import flashmla
from dsv4ops.bench.timing import ceilings, graph_time_us
from dsv4ops.config import rope_inv_freq
from dsv4ops.config_v41 import DSV41AttentionConfig
from dsv4ops.indexer.workspace import workspace_words
from dsv4ops.quant import formats

V41 = DSV41AttentionConfig.v41_flash()
BS = 128  # rows per page of every pool (a page size all three formats can pad)
ROW = {name: formats.FORMATS[name].row_bytes for name in ("fp8_528", "fp4_288", "mxfp4_68")}
DECODE = [(1, 4096), (32, 4096), (128, 4096), (1, 65536), (32, 65536), (128, 65536), (1, 1 << 20)]


def _reencoded(pool: torch.Tensor, fmt: str) -> torch.Tensor:
    """A V4 fp8_584 pool holding every row of `pool` (format `fmt`) dequantized and encoded again,
    slot for slot (the engines' route for V4.1 rows on Hopper)."""
    bs = formats.block_size(pool.shape, fmt)
    out = torch.full(formats.pool_shape("fp8_584", pool.shape[0], bs, 512), 255, dtype=torch.uint8, device="cuda")
    n = pool.shape[0] * bs
    for s in range(0, n, 1 << 18):
        slots = torch.arange(s, min(n, s + (1 << 18)), device="cuda", dtype=torch.int32)
        rows = torch.empty(slots.numel(), 512, device="cuda")
        ops.unpack_kv(pool, slots, rows, fmt)
        ops.pack_kv(rows.bfloat16(), slots, out, "fp8_584")
    return out


def _pool(fmt: str, rows: int, gen: torch.Generator) -> torch.Tensor:
    dim = formats.FORMATS[fmt].dim
    pool = torch.full(formats.pool_shape(fmt, -(-rows // BS), BS, dim), 255, dtype=torch.uint8, device="cuda")
    n = pool.shape[0] * BS
    for s in range(0, n, 1 << 18):
        m = min(1 << 18, n - s)
        x = torch.randn(m, dim, device="cuda", dtype=torch.bfloat16, generator=gen)
        ops.pack_kv(x, torch.arange(s, s + m, device="cuda", dtype=torch.int32), pool, fmt)
    return pool


class Shape:
    """Inputs of every V4.1 op for `batch` requests at `context` tokens, `new` tokens each."""

    def __init__(self, batch: int, context: int, new: int, cfg: DSV41AttentionConfig = V41):
        self.batch, self.context, self.new, self.cfg = batch, context, new, cfg
        gen = torch.Generator(device="cuda").manual_seed(0)
        dev, t = "cuda", batch * new
        self.t = t
        past = context - new
        self.pos = (past + torch.arange(new, device=dev)).repeat(batch).to(torch.int32)
        self.req = torch.arange(batch, device=dev).repeat_interleave(new).to(torch.int32)
        h, d, hi, di = cfg.num_heads, cfg.head_dim, cfg.index_n_heads, cfg.index_head_dim
        self.ring = cfg.window + new
        self.window = _pool("fp8_528", batch * self.ring, gen)
        self.inv_freq = rope_inv_freq(10000.0, 64, None).to(dev)
        self.q = torch.randn(t, h, d, device=dev, dtype=torch.bfloat16, generator=gen)
        self.kv = torch.randn(t, d, device=dev, dtype=torch.bfloat16, generator=gen)
        self.q_rot, self.o, self.o_rot = (torch.empty_like(self.q) for _ in range(3))
        self.sinks = torch.randn(h, device=dev)
        self.comp, self.keys, self.table, self.entries = {}, {}, {}, {}
        for m in (2, 1):
            blocks = -(-(context // m) // BS)
            self.entries[m] = blocks * BS
            self.comp[m] = _pool("fp4_288", batch * blocks * BS, gen)
            self.keys[m] = _pool("mxfp4_68", batch * blocks * BS, gen)
            self.table[m] = torch.arange(batch * blocks, device=dev, dtype=torch.int32).view(batch, blocks)
        # The compressors' inputs (ratio 2: fp32 a and score; ratio 1: the bf16 projection, score 0).
        self.a2 = torch.randn(t, d, device=dev, generator=gen)
        self.z2 = torch.randn(t, d, device=dev, generator=gen)
        self.a1 = torch.randn(t, d, device=dev, dtype=torch.bfloat16, generator=gen)
        self.z1 = self.a1.new_zeros(1, d).expand_as(self.a1)
        self.state = {m: torch.randn(batch, m, 2 * d, device=dev, generator=gen) for m in (2, 1)}
        self.ape = {m: torch.randn(m, d, device=dev, generator=gen) for m in (2, 1)}
        self.norm = torch.ones(d, device=dev)
        self.latent = torch.empty(t, d, device=dev, dtype=torch.bfloat16)
        self.wk, self.knorm = torch.randn(di, d, device=dev) / d**0.5, torch.ones(di, device=dev)
        closing = {m: ((self.pos + 1) % m == 0) for m in (2, 1)}
        self.eslots = {m: torch.where(closing[m], self.req * self.entries[m] + self.pos // m, -1).to(torch.int32)
                       for m in (2, 1)}
        self.qi = torch.randn(t, hi, di, device=dev, dtype=torch.bfloat16, generator=gen)
        self.wi = torch.randn(t, hi, device=dev, dtype=torch.bfloat16, generator=gen)
        self.qi_out = torch.empty(t, hi, ROW["mxfp4_68"], dtype=torch.uint8, device=dev)
        self.wi_out = torch.empty(t, hi, device=dev)
        k, keep, cb = cfg.index_topk, cfg.candidate_topk_blocks, cfg.candidate_block_size
        self.idx = torch.empty(t, k, dtype=torch.int32, device=dev)
        self.cand = torch.empty(t, keep, dtype=torch.int32, device=dev)
        self.ws = torch.empty(max(workspace_words(t, self.entries[1], k, 0, keep, cb),
                                  workspace_words(t, self.entries[1], k, keep * cb)), dtype=torch.int32, device=dev)
        # sparse_attn's entries: k distinct visible ratio-2 entries of each token's request, spread
        # over its context (what a top-k picks), as global slots of the ratio-2 pool.
        vis2 = (self.pos.long() + 1) // 2
        spread = (torch.arange(k, device=dev)[None] * vis2[:, None]) // k
        self.attn_idx = (self.req.long()[:, None] * self.entries[2] + spread).to(torch.int32)
        self.lens = vis2.clamp(max=k).to(torch.int32)

    def calls(self) -> dict:
        """op name -> call, per role (the names say which)."""
        d, cfg = torch.ops.dsv4, self.cfg
        eps, cb = cfg.rms_norm_eps, cfg.candidate_block_size
        win_idx = torch.empty(self.t, 0, dtype=torch.int32, device="cuda")
        zero = torch.zeros_like(self.pos)

        def topk(m, cand=None, cand_out=None):
            return lambda: d.indexer_topk(self.qi_out, self.wi_out, self.pos, self.req, self.keys[m], self.table[m],
                                          cand, self.idx, cand_out, self.ws, m, cb, "mxfp4_68")

        def attend(m):
            comp = self.window if m == 0 else self.comp[m]
            return lambda: d.sparse_attn(self.q_rot, self.window, comp, self.pos, self.req,
                                         win_idx if m == 0 else self.attn_idx, zero if m == 0 else self.lens, None,
                                         self.sinks, self.o, cfg.head_dim**-0.5, cfg.window, self.ring, "fp8_528",
                                         "fp8_528" if m == 0 else "fp4_288")

        return {
            "qkv_prep": lambda: d.qkv_prep(self.q, self.kv, self.pos, self.req, self.inv_freq, self.q_rot, self.window,
                                           self.ring, eps, False, "fp8_528"),
            "compressor_update (ratio 2)": lambda: d.compressor_update(
                self.a2, self.z2, self.ape[2], self.pos, self.req, self.eslots[2], self.norm, self.inv_freq,
                self.state[2], self.comp[2], self.latent, eps, "fp4_288"),
            "compressor_update (ratio 1)": lambda: d.compressor_update(
                self.a1, self.z1, self.ape[1], self.pos, self.req, self.eslots[1], self.norm, self.inv_freq,
                self.state[1], self.comp[1], self.latent, eps, "fp4_288"),
            "indexer_k_prep (ratio 2)": lambda: d.indexer_k_prep(self.latent, self.pos, self.req, self.eslots[2],
                                                                 self.wk, self.knorm, self.inv_freq, self.keys[2], 2,
                                                                 eps, "mxfp4_68"),
            "indexer_q_prep": lambda: d.indexer_q_prep(self.qi, self.wi, self.pos, self.inv_freq, self.qi_out,
                                                       self.wi_out, "mxfp4_68"),
            "indexer_topk (ratio-2 source)": topk(2),
            "indexer_topk (candidate source)": topk(1, cand_out=self.cand),
            "indexer_topk (reindex in pool)": topk(1, cand=self.cand),
            "sparse_attn (window)": attend(0),
            "sparse_attn (window + 512 fp4)": attend(2),
            "inv_rope": lambda: d.inv_rope(self.o, self.pos, self.inv_freq, self.o_rot),
        }

    def route_calls(self) -> dict:
        """sparse_attn op name -> {"v4_kernel": call, "flashmla": call or None}: the same attention on
        the window ring and ratio-2 pool re-encoded into fp8_584 rows, by our V4 kernel and FlashMLA's."""
        d, cfg = torch.ops.dsv4, self.cfg
        window, comp = _reencoded(self.window, "fp8_528"), _reencoded(self.comp[2], "fp4_288")
        win_idx = torch.empty(self.t, 0, dtype=torch.int32, device="cuda")
        zero = torch.zeros_like(self.pos)
        self.o_route = torch.empty_like(self.o)
        out = {}
        for op, (idx, lens) in {"sparse_attn (window)": (win_idx, zero),
                                "sparse_attn (window + 512 fp4)": (self.attn_idx, self.lens)}.items():
            ours = (lambda idx=idx, lens=lens: d.sparse_attn(
                self.q_rot, window, comp, self.pos, self.req, idx, lens, None, self.sinks, self.o_route,
                cfg.head_dim**-0.5, cfg.window, self.ring, "fp8_584", "fp8_584"))
            theirs = None
            if flashmla.available() and self.new == 1:
                theirs = flashmla.decode(self.q_rot, window, comp, self.pos, self.req, idx, lens, self.sinks,
                                         cfg.head_dim**-0.5, cfg.window, self.ring)
            out[op] = {"v4_kernel": ours, "flashmla": theirs}
        return out

    def bytes_read(self, op: str) -> float:
        t, cfg = self.t, self.cfg
        vis = {m: min(self.context // m, self.entries[m]) for m in (2, 1)}
        if op.startswith("sparse_attn"):
            keys = t * min(self.context, cfg.window) * ROW["fp8_528"]
            if "fp4" in op:
                keys += t * min(cfg.index_topk, vis[2]) * ROW["fp4_288"]
            return keys + 2 * t * cfg.num_heads * cfg.head_dim * 2
        if op == "indexer_topk (ratio-2 source)":
            return self.batch * vis[2] * ROW["mxfp4_68"]
        if op == "indexer_topk (candidate source)":
            return self.batch * vis[1] * ROW["mxfp4_68"]
        if op == "indexer_topk (reindex in pool)":
            return t * min(vis[1], cfg.candidate_pool) * ROW["mxfp4_68"]
        return float("nan")


def _v41_layer_ops() -> list[list[str]]:
    """The timed ops each V4.1-Flash backbone layer runs, by its role."""
    out = []
    for r in V41.roles[: V41.num_layers]:
        names = ["qkv_prep"]
        if r.owns_compressor:
            names.append(f"compressor_update (ratio {r.ratio})")
        if r.owns_index_keys:
            names.append("indexer_k_prep (ratio 2)")  # ratio 1's is the same kernel on as many rows
        if r.indexer:
            names.append("indexer_q_prep")
            names.append("indexer_topk (candidate source)" if r.candidate_source else
                         "indexer_topk (reindex in pool)" if r.uses_candidates else "indexer_topk (ratio-2 source)")
        names.append("sparse_attn (window)" if r.sliding else "sparse_attn (window + 512 fp4)")
        names.append("inv_rope")
        out.append(names)
    return out


def _v4_stack(batch: int, context: int) -> tuple[float, float]:
    """(us, cache bytes read per token) of the V4-Flash stack's cores, from one layer per kind."""
    from dsv4ops.bench.attention import stack_time

    return stack_time(batch, context, model=DSV4AttentionConfig.flash())


@torch.no_grad()
def run(quick: bool = False, progress=print, with_v4: bool = True,
        cases: list[tuple[int, int, int]] | None = None) -> list[dict]:
    """Rows of every op at each (batch, context, new tokens) of `cases` (default: the decode set, 3 of
    them with `quick`, and a 4096-token prefill), each decode shape's stack row last."""
    rows = []
    shapes = cases or [(b, c, 1) for b, c in (DECODE[:3] if quick else DECODE)] + [(1, 4096, 4096)]
    gather = ceilings()["gather"]
    for batch, context, new in shapes:
        shape = Shape(batch, context, new)
        calls = shape.calls()
        times, route_times = {}, {}
        for op in ("qkv_prep", "indexer_q_prep", "indexer_topk (candidate source)"):
            calls[op]()  # q_rot, the MX4 query and the candidate pool the later ops read
        route = shape.route_calls()  # re-encoded after qkv_prep wrote the tokens' own window rows
        for op, call in calls.items():
            us = graph_time_us(call)
            times[op] = us
            nbytes = shape.bytes_read(op)
            row = {"batch": batch, "context": context, "tokens": new, "op": op, "us": us,
                   "per_token_us": us / shape.t, "GB/s": nbytes / (us * 1e-6) / 1e9,
                   "pct_ceiling": 100.0 * nbytes / (us * 1e-6) / gather}
            if op in route:
                row["v4_kernel_us"] = graph_time_us(route[op]["v4_kernel"])
                if route[op]["flashmla"] is not None:
                    row["flashmla_us"] = route_times[op] = graph_time_us(route[op]["flashmla"])
                    row["vs_flashmla"] = us / row["flashmla_us"]
                    call()
                    theirs = route[op]["flashmla"]().float()
                    live = shape.req >= 0
                    row["rel_diff"] = ((shape.o.float()[live] - theirs[live]).abs().max()
                                       / theirs[live].abs().max()).item()
            progress(row)
            rows.append(row)
        if new == 1:
            layers = _v41_layer_ops()
            stack_us = sum(times[op] for ops_ in layers for op in ops_)
            per_token = sum(shape.bytes_read(op) for ops_ in layers for op in ops_
                            if op.startswith(("sparse", "indexer_topk")))
            row = {"batch": batch, "context": context, "tokens": new, "op": "V4.1-Flash stack (40 layers' cores)",
                   "us": stack_us, "per_token_us": stack_us / batch, "bytes_per_token": per_token / batch}
            if len(route_times) == len(route):
                row["route_us"] = stack_us + sum(route_times[op] - times[op] for ops_ in layers for op in ops_
                                                 if op in route_times)
            if with_v4:
                v4_us, v4_bytes = _v4_stack(batch, context)
                row.update({"v4_us": v4_us, "v4_per_token_us": v4_us / batch, "v4_bytes_per_token": v4_bytes,
                            "vs_v4": stack_us / v4_us})
            progress(row)
            rows.append(row)
        del shape, calls, route
        torch.cuda.empty_cache()
    return rows
