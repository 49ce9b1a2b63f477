"""Attention benchmarks at V4-Flash shapes: every op of a layer step (decode batch 1/32/128 at 4K
and 64K context, prefill 4096 tokens), the attention core (all ops) vs the projection GEMMs, the
reference backend on the GPU, and transformers' layer (eager and compiled) as baselines; any of
them with the FP8 cache (default) or the FP4 cache option (`formats`); and the decode step of the
whole V4-Flash stack (its layers' attention cores) with each cache at the same shapes (`stack_rows`).

Caches are filled synthetically: requests are marked as holding `context - 1` tokens, their blocks
allocated, and every pool slot written with random entries through `dsv4::pack_kv`."""

from __future__ import annotations

import contextlib

import torch

from dsv4ops import CacheFormats, DeepseekV4Attention, DSV4AttentionConfig, ops, testing
from dsv4ops.bench import flashmla
from dsv4ops.bench.timing import ceilings, eager_time_us, graph_time_us
from dsv4ops.cache import CacheConfig, KVCacheManager
from dsv4ops.cache.step import visible_counts
from dsv4ops.cache.config import v4_numerics
from dsv4ops.config import CSA, HCA, SLIDING
from dsv4ops.layers import indexer_query, indexer_rotates
from dsv4ops.projections import project_x
from dsv4ops.quant import formats
from dsv4ops.reference.functional import rms_norm

FLASH = DSV4AttentionConfig.flash()
FP8 = CacheFormats.v4()
FP4 = CacheFormats("fp8_584", "fp4_288", "mxfp4_68")  # 288-B FP4 entries, 68-B MXFP4 keys
CACHES = {"fp8": FP8, "fp4": FP4}
ATTN_OPS = ("qkv_prep", "compressor_update", "indexer_q_prep", "indexer_topk", "visible_entries", "sparse_attn",
            "inv_rope")


def _prefilled(manager: KVCacheManager, rid, length: int):
    """Book `length` tokens for a request without running them (blocks allocated, length set)."""
    slot = manager.admit(rid)
    for kind, ratio in manager.ratios.items():
        width = manager.widths[kind]
        if not width:
            continue
        n = -(-(length // ratio) // manager.cfg.block_size)
        manager._set_blocks(kind, slot, slice(0, n), torch.tensor(manager.allocators[kind].take(n), dtype=torch.int32))
    manager.length[rid] = length


def _fill(pool: torch.Tensor, dim: int, fmt: str, gen: torch.Generator):
    """Random entries in every slot of a pool (values of an RMS-normed row: ~N(0, 1))."""
    slots = pool.shape[0] * formats.block_size(pool.shape, fmt)
    for s in range(0, slots, 1 << 18):
        n = min(1 << 18, slots - s)
        rows = torch.randn(n, dim, device=pool.device, dtype=torch.bfloat16, generator=gen)
        ops.pack_kv(rows, torch.arange(s, s + n, device=pool.device, dtype=torch.int32), pool, fmt)


def new_layer(kind: str, model: DSV4AttentionConfig = FLASH, device="cuda",
              formats: CacheFormats = FP8) -> DeepseekV4Attention:
    """The model's first layer of this kind, random weights (testing.randomize_), bf16, in `formats`."""
    layer_idx = next(i for i in range(model.num_layers) if model.layer_type(i) == kind)
    return testing.randomize_(DeepseekV4Attention(model, layer_idx, formats=formats)).to(device, torch.bfloat16)


class Case:
    """One layer of V4-Flash with a synthetic cache and the inputs of every op of one step."""

    def __init__(self, kind: str, batch: int, context: int, new_tokens: int, device="cuda",
                 model: DSV4AttentionConfig = FLASH, max_context: int | None = None, formats: CacheFormats = FP8,
                 layer: DeepseekV4Attention | None = None, batch_invariant: bool = False):
        """`layer`: a layer of this kind, model and formats (bf16, on `device`) to attach the new cache to
        instead of building one (a sweep reuses one per kind; `release` detaches it). batch_invariant:
        the cache's CacheConfig.batch_invariant."""
        self.kind, self.batch, self.context, self.new_tokens, self.model = kind, batch, context, new_tokens, model
        self.max_context = max_context or context + new_tokens
        self.numerics = v4_numerics(formats)
        cfg = model
        self.layer = layer if layer is not None else new_layer(kind, model, device, formats)
        # The pools hold the real context (max_total_tokens); max_context sizes the block tables, the
        # key lists and the indexer's workspace rows.
        cache_cfg = CacheConfig(formats=formats, exact_dtype=torch.bfloat16, max_requests=batch,
                                max_context=self.max_context, max_total_tokens=batch * (context + new_tokens),
                                max_step_tokens=batch * new_tokens, buckets=(batch * new_tokens,),
                                batch_invariant=batch_invariant)
        self.manager = KVCacheManager(cfg, cache_cfg, device=device)
        self.layer.attach_cache(self.manager)
        gen = torch.Generator(device=device).manual_seed(0)
        past = context - new_tokens
        for r in range(batch):
            _prefilled(self.manager, r, past)
        cache = self.layer.cache
        for name, dim in (("window", 512), ("comp", 512), ("index", 128)):
            if hasattr(cache, name):
                _fill(getattr(cache, name), dim, cache.fmt[name], gen)
        for name in ("state", "index_state"):
            if hasattr(cache, name):
                getattr(cache, name).normal_(generator=gen)
        self.step = self.manager.prepare_step({r: new_tokens for r in range(batch)})
        self.x = torch.randn(batch * new_tokens, cfg.hidden_size, device=device, dtype=torch.bfloat16, generator=gen)
        self._prepare_inputs()

    @torch.no_grad()
    def _prepare_inputs(self):
        """The activations each op reads (the projections of `_attend`, run once)."""
        layer, cfg, x, st = self.layer, self.model, self.x, self.step
        eps = cfg.rms_norm_eps
        t = x.shape[0]
        px = project_x(layer, x)  # the layer's own projections: the packed GEMM, block-FP8 ones
        self.qr = rms_norm(px["q_a_proj"], layer.q_a_norm.weight, eps)
        self.q = layer.q_b_proj(self.qr).view(t, cfg.num_heads, cfg.head_dim)
        self.kv = rms_norm(px["kv_proj"], layer.kv_norm.weight, eps)
        self.q_rot = torch.empty_like(self.q)
        self.o = torch.empty_like(self.q)
        self.o_rot = torch.empty_like(self.q)
        self.idx = torch.empty(t, 0, dtype=torch.int32, device=x.device)
        self.lens = torch.zeros_like(st.positions)
        c = layer.compressor
        if c is None:
            return
        ratio = cfg.compress_ratio(layer.layer_idx)
        self.a, self.z = px["compressor.kv_proj"], px["compressor.gate_proj"]
        if self.kind == CSA:
            ix = c.indexer
            self.ia, self.iz = px["compressor.indexer.kv_proj"], px["compressor.indexer.gate_proj"]
            self.qi = ix.q_b_proj(self.qr).view(t, cfg.index_n_heads, cfg.index_head_dim)
            self.wi = px["compressor.indexer.scorer.weights_proj"]
            self.qi_out = indexer_query(self.qi, layer.cache.fmt["index"])
            self.wi_out = torch.empty(self.wi.shape, dtype=torch.float32, device=x.device)
            self.idx = torch.empty(t, cfg.index_topk, dtype=torch.int32, device=x.device)
        else:  # the key list sparse_attn reads (op_calls' visible_entries rewrites the same)
            bs = self.manager.cfg.block_size
            self.idx = torch.empty(t, st.block_table(HCA).shape[1] * bs, dtype=torch.int32, device=x.device)
            torch.ops.dsv4.visible_entries(st.block_table(HCA), st.positions, st.req_slots, self.idx, ratio, bs)
        self.lens = visible_counts(st.positions, st.req_slots, ratio).clamp(max=self.idx.shape[1])

    def release(self) -> None:
        """Detach the cache from the layer (its pools are freed once this case goes)."""
        del self.layer.cache, self.layer.cache_manager

    # ---- the ops of one step, each a closure over this case's buffers ----------------------------
    def op_calls(self) -> dict:
        layer, cache, st, cfg = self.layer, self.layer.cache, self.step, self.model
        eps, d, fmt = cfg.rms_norm_eps, torch.ops.dsv4, cache.fmt
        calls = {"qkv_prep": lambda: d.qkv_prep(self.q, self.kv, st.positions, st.req_slots, layer.inv_freq,
                                                self.q_rot, cache.window, cache.ring_size, eps, True, fmt["window"])}
        comp_cache, comp_fmt = cache.window, fmt["window"]
        if layer.compressor is not None:
            c = layer.compressor
            comp_cache, comp_fmt = cache.comp, fmt["comp"]
            calls["compressor_update"] = lambda: d.compressor_update(
                self.a, self.z, c.position_bias, st.positions, st.req_slots, st.entry_slots(self.kind),
                c.kv_norm.weight, layer.inv_freq, cache.state, cache.comp, None, eps, fmt["comp"])
            if self.kind == CSA:
                ix = c.indexer
                rotate = indexer_rotates(self.numerics)
                calls["compressor_update (indexer)"] = lambda: d.compressor_update(
                    self.ia, self.iz, ix.position_bias, st.positions, st.req_slots, st.entry_slots(CSA),
                    ix.kv_norm.weight, layer.inv_freq, cache.index_state, cache.index, None, eps, fmt["index"], rotate)
                calls["indexer_q_prep"] = lambda: d.indexer_q_prep(self.qi, self.wi, st.positions, layer.inv_freq,
                                                                   self.qi_out, self.wi_out, fmt["index"], rotate)
                calls["indexer_topk"] = lambda: d.indexer_topk(self.qi_out, self.wi_out, st.positions, st.req_slots,
                                                               cache.index, st.block_table(CSA), None, self.idx, None,
                                                               cache.topk_workspace, cfg.csa_ratio, 0, fmt["index"])
        if self.kind == HCA:  # the layer's key list of the step, into self.idx (sparse_attn reads it)
            calls["visible_entries"] = lambda: d.visible_entries(st.block_table(HCA), st.positions, st.req_slots,
                                                                 self.idx, cfg.hca_ratio, self.manager.cfg.block_size)
        calls["sparse_attn"] = lambda: d.sparse_attn(self.q_rot, cache.window, comp_cache, st.positions, st.req_slots,
                                                     self.idx, self.lens, st.window_ends, layer.sinks, self.o,
                                                     cfg.head_dim**-0.5, cfg.window, cache.ring_size, fmt["window"],
                                                     comp_fmt)
        calls["inv_rope"] = lambda: d.inv_rope(self.o, st.positions, layer.inv_freq, self.o_rot)
        return calls

    # ---- work per op (bytes moved, flops), for the roofline columns ------------------------------
    def row_bytes(self, pool: str) -> int:
        """Bytes of a row of the layer's pool `pool` (window, comp, index) in its format."""
        return formats.get(self.layer.cache.fmt[pool]).row_bytes

    def work(self, op: str) -> tuple[float, float, str]:
        cfg, t = self.model, self.x.shape[0]
        h, dd = cfg.num_heads, cfg.head_dim
        pos = self.step.positions.long()
        if op == "qkv_prep":
            return t * h * dd * 2 * 2 + t * dd * 2 + t * self.row_bytes("window"), 0.0, "copy"
        if op.startswith("compressor_update"):
            indexer = "indexer" in op
            width = self.ia.shape[1] if indexer else self.a.shape[1]
            d = cfg.index_head_dim if indexer else dd
            m = cfg.csa_ratio if self.kind == CSA else cfg.hca_ratio
            rows = (width // d) * m
            closing = int(((pos + 1) % m == 0).sum())
            entry = self.row_bytes("index" if indexer else "comp")
            # a, z read once; a closing token reads the rows older than the step from the state (its
            # own step's rows are the a, z just read) and writes an entry; each request writes at
            # most `rows` state rows.
            older = max(rows - self.new_tokens, 0)
            state_rows = min(rows, self.new_tokens) * self.batch
            return (t * width * 4 * 2 + closing * (older * width * 2 * 4 + entry) + state_rows * width * 2 * 4,
                    0.0, "copy")
        if op == "indexer_q_prep":
            return t * cfg.index_n_heads * (cfg.index_head_dim * 3 + 6), 0.0, "copy"
        if op == "indexer_topk":
            n = ((pos + 1) // cfg.csa_ratio).sum().item()
            return (n * self.row_bytes("index") + t * cfg.index_n_heads * cfg.index_head_dim,
                    2.0 * n * cfg.index_n_heads * cfg.index_head_dim, "copy")
        if op == "sparse_attn":
            window = torch.clamp(pos + 1, max=cfg.window).sum().item()
            live = torch.arange(self.idx.shape[1], device=self.idx.device)[None] < self.lens[:, None]
            entries = ((self.idx >= 0) & live).sum().item()
            comp = self.row_bytes("comp" if self.layer.compressor is not None else "window")
            keys = window + entries
            return (window * self.row_bytes("window") + entries * comp + t * h * dd * 2 * 2, 4.0 * keys * h * dd,
                    "gather" if self.new_tokens == 1 else "bf16")
        if op == "visible_entries":
            return self.idx.numel() * 4, 0.0, "copy"
        if op == "inv_rope":
            return t * h * dd * 2 * 2, 0.0, "copy"
        raise KeyError(op)

    def core(self):
        calls = list(self.op_calls().values())

        def run():
            for call in calls:
                call()
        return run

    def layer_fn(self):
        return lambda: self.layer(self.x, self.step)

    def torch_topk_call(self):
        """The baseline of indexer_topk's selection: torch.topk of k over a float32 score row per token,
        as wide as the longest real row of the step (random scores; same k as the layer)."""
        n = int(((self.step.positions.long() + 1) // self.model.csa_ratio).max().item())
        scores = torch.randn(self.x.shape[0], max(n, self.model.index_topk), device=self.x.device)
        return lambda: torch.topk(scores, self.model.index_topk, dim=1)

    def flashmla_call(self):
        """FlashMLA's kernel on this case's pools and indices (decode, or sparse prefill on the keys
        gathered to bf16), or None where it cannot run: not installed, heads other than 64 / 128, or
        compressed entries in another format than its 584-B rows (the FP4 cache option)."""
        if not flashmla.available() or self.model.num_heads not in (64, 128) or self.numerics.kv != "fp8":
            return None
        st, cache = self.step, self.layer.cache
        comp = cache.comp if self.layer.compressor is not None else cache.window
        fn = flashmla.decode if self.new_tokens == 1 else flashmla.prefill
        return fn(self.q_rot, cache.window, comp, st.positions, st.req_slots, self.idx, self.lens, self.layer.sinks,
                  self.model.head_dim**-0.5, self.model.window, cache.ring_size)


def _row(case: Case, op: str, us: float, mode: str, baseline_us: float | None, flashmla_us: float | None = None,
         topk_us: float | None = None) -> dict:
    nbytes, flops, ceiling = case.work(op)
    c = ceilings()[ceiling]
    rate = flops / (us * 1e-6) if ceiling == "bf16" else nbytes / (us * 1e-6)
    return {
        "layer": case.kind, "batch": case.batch, "context": case.context, "max_context": case.max_context,
        "tokens": case.new_tokens, "op": op,
        "us": us, "timing": mode, "GB/s": nbytes / (us * 1e-6) / 1e9, "TFLOP/s": flops / (us * 1e-6) / 1e12,
        "ceiling": ceiling, "pct_ceiling": 100.0 * rate / c, "reference_us": baseline_us,
        "flashmla_us": flashmla_us, "vs_flashmla": None if flashmla_us is None else us / flashmla_us,
        "torch_topk_us": topk_us,
    }


@contextlib.contextmanager
def _reference_backend():
    """The reference kernels on the GPU: every attention op's CUDA kernel disabled for the block."""
    with contextlib.ExitStack() as stack:
        for name in ATTN_OPS:
            stack.enter_context(getattr(ops, name).set_kernel_enabled("cuda", False))
        yield


def _flashmla_us(case: Case) -> float | None:
    fn = case.flashmla_call()
    return None if fn is None else graph_time_us(fn)


@torch.no_grad()  # inference kernels: no autograd graph (the ops have no backward)
def bench_case(case: Case, with_reference: bool) -> list[dict]:
    rows = []
    for op, call in case.op_calls().items():
        us = graph_time_us(call)
        ref = None
        if with_reference:
            with _reference_backend():
                ref = eager_time_us(call, iters=3)
        topk = graph_time_us(case.torch_topk_call()) if op == "indexer_topk" else None
        rows.append(_row(case, op, us, "graph", ref, _flashmla_us(case) if op == "sparse_attn" else None, topk))
    core = graph_time_us(case.core())
    total = graph_time_us(case.layer_fn())
    base = {"layer": case.kind, "batch": case.batch, "context": case.context, "max_context": case.max_context,
            "tokens": case.new_tokens}
    rows.append({**base, "op": "attention core (all ops)", "us": core, "timing": "graph"})
    rows.append({**base, "op": "projection GEMMs + norms (layer - core)", "us": total - core, "timing": "graph"})
    rows.append({**base, "op": "whole layer", "us": total, "timing": "graph"})
    return rows


# The sparse_attn rows of the FlashMLA comparison: (label, model, layer kind, batch, context, new tokens).
SIDE_BY_SIDE = [
    ("sliding 1 x 4K", FLASH, SLIDING, 1, 4096, 1),
    ("sliding 128 x 4K", FLASH, SLIDING, 128, 4096, 1),
    ("CSA 1 x 4K", FLASH, CSA, 1, 4096, 1),
    ("CSA 32 x 4K", FLASH, CSA, 32, 4096, 1),
    ("CSA 128 x 4K", FLASH, CSA, 128, 4096, 1),
    ("HCA 128 x 64K", FLASH, HCA, 128, 65536, 1),
    ("HCA 32 x 1M", FLASH, HCA, 32, 1 << 20, 1),
    ("V4-Pro CSA 128 x 4K", DSV4AttentionConfig.pro(), CSA, 128, 4096, 1),
    ("prefill CSA 4096 from 0", FLASH, CSA, 1, 4096, 4096),
]


def side_by_side(progress=print) -> list[dict]:
    """dsv4ops' sparse_attn and FlashMLA's kernel on the same pools and indices, same timer, and the
    largest difference of their outputs relative to FlashMLA's largest |output|."""
    rows = []
    for label, model, kind, batch, context, new in SIDE_BY_SIDE:
        case = Case(kind, batch, context, new, model=model)
        calls = case.op_calls()
        for op in ("qkv_prep", "indexer_q_prep", "indexer_topk"):  # the inputs sparse_attn reads
            if op in calls:
                calls[op]()
        ours = graph_time_us(calls["sparse_attn"])
        row = _row(case, "sparse_attn", ours, "graph", None, _flashmla_us(case))
        row["case"] = label
        fn = case.flashmla_call()
        if fn is not None:
            calls["sparse_attn"]()
            theirs = fn().float()
            live = case.step.req_slots >= 0
            row["rel_diff"] = ((case.o.float()[live] - theirs[live]).abs().max() / theirs[live].abs().max()).item()
        progress(row)
        rows.append(row)
        del case
        torch.cuda.empty_cache()
    return rows


def hf_baselines(kind: str, batch: int, context: int, device="cuda", model: DSV4AttentionConfig = FLASH) -> list[dict]:
    """transformers' DeepseekV4Attention (bf16): prefill of `context` tokens eager and compiled, and
    one decode step with its own cache after that prefill (eager)."""
    from transformers import DynamicCache
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Attention as HF

    hc = testing.hf_config(model)
    layer_idx = next(i for i in range(model.num_layers) if model.layer_type(i) == kind)
    layer = testing.randomize_(HF(hc, layer_idx)).to(device, torch.bfloat16)
    x = torch.randn(batch, context, model.hidden_size, device=device, dtype=torch.bfloat16)
    base = {"layer": kind, "batch": batch, "context": context, "timing": "eager"}
    rows = []
    with torch.no_grad():
        rows.append({**base, "tokens": context, "op": "transformers prefill (eager)",
                     "us": eager_time_us(lambda: testing.hf_attention(layer, hc, x), iters=3)})
        compiled = torch.compile(lambda inp: testing.hf_attention(layer, hc, inp))
        rows.append({**base, "tokens": context, "op": "transformers prefill (torch.compile)",
                     "us": eager_time_us(lambda: compiled(x), iters=3)})
        try:
            cache = DynamicCache(config=hc)
            testing.hf_attention(layer, hc, x[:, :-1], cache=cache)
            # Each timed call appends one more token to the cache (context grows by <= 10).
            rows.append({**base, "tokens": 1, "op": "transformers decode step (eager, own cache)",
                         "us": eager_time_us(lambda: testing.hf_attention(layer, hc, x[:, -1:], cache=cache,
                                                                           start=context - 1), iters=5)})
        except Exception as e:  # noqa: BLE001 - reported in the table: transformers' cached path fails here
            rows.append({**base, "tokens": 1, "op": f"transformers decode step: raises {type(e).__name__}: {e}"[:160],
                         "us": float("nan")})
    return rows


def run(quick: bool = False, progress=print, cases: list[tuple[str, int, int, int, int | None]] | None = None,
        model: DSV4AttentionConfig = FLASH, formats: CacheFormats = FP8) -> list[dict]:
    """Every case (or only `cases`: (layer kind, batch, context, new tokens per request, max_context or
    None), without the baselines), with the cache of `formats`; each finished row also goes to
    `progress` (a long run leaves a partial log)."""
    rows = []
    decode = [(1, 4096), (32, 4096), (128, 4096), (1, 65536), (32, 65536), (128, 65536)]
    if quick:
        decode = [(1, 4096), (128, 4096)]

    def add(new):
        for r in new:
            progress(r)
        rows.extend(new)

    if cases:
        for kind, batch, context, new, max_context in cases:
            add(bench_case(Case(kind, batch, context, new, model=model, max_context=max_context, formats=formats),
                           with_reference=False))
            torch.cuda.empty_cache()
        return rows
    for kind in (SLIDING, CSA, HCA):
        for batch, context in decode:
            add(bench_case(Case(kind, batch, context, 1, model=model, formats=formats),
                           with_reference=(batch, context) == (128, 4096)))
            torch.cuda.empty_cache()
        add(bench_case(Case(kind, 1, 4096, 4096, model=model, formats=formats), with_reference=False))
        add(hf_baselines(kind, 1, 4096, model=model))
        torch.cuda.empty_cache()
    return rows


# The decode shapes of the FP8 / FP4 cache comparison (issue 29: 64K and 1M context).
STACK_SHAPES = [(1, 65536), (32, 65536), (128, 65536), (1, 1 << 20), (32, 1 << 20)]


def stack_time(batch: int, context: int, formats: CacheFormats = FP8, model: DSV4AttentionConfig = FLASH,
               device="cuda") -> tuple[float, float]:
    """(us, cache bytes the step reads per request) of one decode step of the model's whole stack of
    attention cores (every op of every layer, projections excluded), from one timed layer per kind
    times the layers of that kind."""
    total, nbytes = 0.0, 0.0
    for kind in (SLIDING, CSA, HCA):
        count = sum(model.layer_type(i) == kind for i in range(model.num_layers))
        if not count:
            continue
        case = Case(kind, batch, context, 1, model=model, formats=formats, device=device)
        calls = case.op_calls()
        for call in calls.values():
            call()  # the inputs each op reads
        total += count * sum(graph_time_us(c) for c in calls.values())
        for op in ("indexer_topk", "sparse_attn"):
            if op in calls:
                nbytes += count * case.work(op)[0] / batch
        del case
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    return total, nbytes


@torch.no_grad()
def stack_rows(shapes=None, progress=print, model: DSV4AttentionConfig = FLASH, device="cuda") -> list[dict]:
    """The decode step of the model's stack with the FP8 cache and with the FP4 cache option at each
    (batch, context) of `shapes` (default STACK_SHAPES), same run: us per step and per request, the
    cache bytes read per request, and FP4 against FP8."""
    rows = []
    for batch, context in shapes or STACK_SHAPES:
        got = {}
        for name, fmts in CACHES.items():
            us, nbytes = stack_time(batch, context, fmts, model, device)
            got[name] = us
            row = {"batch": batch, "context": context, "cache": name, "op": f"V4 stack ({model.num_layers} layers' "
                   f"cores), decode", "us": us, "per_token_us": us / batch, "bytes_per_token": nbytes,
                   "vs_fp8": us / got["fp8"]}
            progress(row)
            rows.append(row)
    return rows
