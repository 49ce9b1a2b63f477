"""`dsv4ops.warmup`: compile every GPU kernel a configuration uses before any CUDA-graph capture.

The Triton kernels have no autotuning: their tiles follow from static dims (heads, head dim, pool
format), token counts are not specialized on (`do_not_specialize`), and block sizes / ring sizes /
strides are fixed by the CacheConfig. So one call per (op, dtypes, static shape) compiles a kernel
for every step size; warmup still runs each op once per batch bucket, on tiny dummy buffers whose
dtypes and static dims are the real ones (pools hold one request; every token is padding, so
nothing is read or written).
"""

from __future__ import annotations

import torch

from dsv4ops.cache.config import CacheConfig, blocks_per_request, topk_workspace_words, v4_numerics
from dsv4ops.config import CSA, SLIDING, DSV4AttentionConfig
from dsv4ops.fp8_linear import rule as fp8_rule
from dsv4ops.cache.config import paged_pool
from dsv4ops.layers import indexer_query, indexer_rotates
from dsv4ops.reference.numerics import compressor_dtype


def _pool(fmt: str, dim: int, blocks: int, cache_cfg: CacheConfig, device) -> torch.Tensor:
    spec = paged_pool("", cache_cfg, fmt, dim, blocks)
    return torch.zeros(spec.shape, dtype=spec.dtype, device=device)


def warmup(model_cfg: DSV4AttentionConfig, cache_cfg: CacheConfig, device, dtype: torch.dtype = torch.bfloat16,
           fp8_block: int | None = None, fp8_scale: torch.dtype = torch.float8_e8m0fnu, tp: int = 1,
           dcp: int = 1) -> int:
    """Run every attention op of every layer kind of `model_cfg` once per batch bucket of
    `cache_cfg` on `device` with activations of `dtype`; returns the number of op calls. On a
    CUDA device this compiles the kernels and binds the router's CUDA kernels (a failed build
    raises); on CPU (reference kernels) there is nothing to compile. `fp8_block`: the layers were
    loaded with keep_fp8=True (tiles of that size, scales of dtype `fp8_scale`): fp8_linear runs
    too, at every FP8 projection's shape, and fp8_linear_w8a8 where BlockFP8Linear's "auto" picks it
    for the bucket (dsv4ops/fp8_linear/rule.py). `tp`: the layers hold 1 / tp of the heads (tensor
    parallel: the kernels of that head count); `dcp`: the cache is shared by that many ranks
    (context parallel: sparse_attn's partial with lse and attn_merge run too)."""
    device = torch.device(device)
    ops = torch.ops.dsv4
    first = {}  # one layer of each kind (its RoPE table)
    for i in range(model_cfg.num_layers):
        first.setdefault(model_cfg.layer_type(i), i)
    kinds = set(first)
    cache_cfg = cache_cfg.for_model(model_cfg)
    numerics = v4_numerics(cache_cfg.formats)
    main_fmt, comp_fmt, index_fmt = cache_cfg.formats.window, cache_cfg.formats.comp, cache_cfg.formats.index
    rotates = indexer_rotates(numerics)
    bs, ring = cache_cfg.block_size, cache_cfg.ring_size(model_cfg.window)
    h, d = model_cfg.num_heads // tp, model_cfg.head_dim
    hi, di = model_cfg.index_n_heads, model_cfg.index_head_dim
    eps = model_cfg.rms_norm_eps
    inv_freq = {k: model_cfg.inv_freq(i).to(device) for k, i in first.items()}
    window = _pool(main_fmt, d, -(-ring // bs), cache_cfg, device)
    calls = 0
    for t in cache_cfg.buckets:
        pos = torch.zeros(t, dtype=torch.int32, device=device)
        req = torch.full((t,), -1, dtype=torch.int32, device=device)
        none = torch.full((t,), -1, dtype=torch.int32, device=device)
        q = torch.zeros(t, h, d, dtype=dtype, device=device)
        kv = torch.zeros(t, d, dtype=dtype, device=device)
        q_rot, o, o_rot = torch.empty_like(q), torch.empty_like(q), torch.empty_like(q)
        sinks = torch.zeros(h, dtype=torch.float32, device=device)
        for kind in sorted(kinds):
            freq = inv_freq[kind]
            ops.qkv_prep(q, kv, pos, req, freq, q_rot, window, ring, eps, True, main_fmt)
            comp, idx = window, torch.empty(t, 0, dtype=torch.int32, device=device)
            if kind != SLIDING:
                ratio = model_cfg.csa_ratio if kind == CSA else model_cfg.hca_ratio
                coff = 2 if kind == CSA else 1
                nblk = blocks_per_request(cache_cfg, ratio)
                table = torch.zeros(1, nblk, dtype=torch.int32, device=device)
                comp = _pool(comp_fmt, d, 1, cache_cfg, device)
                streams = [(d, comp, comp_fmt, numerics.kv, False)]
                if kind == CSA:
                    streams.append((di, _pool(index_fmt, di, 1, cache_cfg, device), index_fmt, numerics.indexer,
                                    rotates))
                for dim, pool, fmt, mode, hadamard in streams:
                    cdt = compressor_dtype(mode, dtype)
                    a = torch.zeros(t, coff * dim, dtype=cdt, device=device)
                    ape = torch.zeros(ratio, coff * dim, dtype=torch.float32, device=device)
                    norm = torch.ones(dim, dtype=torch.float32, device=device)
                    state = torch.zeros(1, coff * ratio, 2 * coff * dim, dtype=torch.float32, device=device)
                    ops.compressor_update(a, a, ape, pos, req, none, norm, freq, state, pool, None, eps, fmt, hadamard,
                                          cache_cfg.batch_invariant)
                    calls += 1
                if kind == CSA:
                    qi = torch.zeros(t, hi, di, dtype=dtype, device=device)
                    wi = torch.zeros(t, hi, dtype=dtype, device=device)
                    qi_out = indexer_query(qi, index_fmt)
                    wi_out = torch.empty(t, hi, dtype=torch.float32, device=device)
                    ops.indexer_q_prep(qi, wi, pos, freq, qi_out, wi_out, index_fmt, rotates)
                    idx = torch.empty(t, model_cfg.index_topk, dtype=torch.int32, device=device)
                    ws = torch.empty(topk_workspace_words(model_cfg, cache_cfg, dcp), dtype=torch.int32,
                                     device=device)
                    ops.indexer_topk(qi_out, wi_out, pos, req, streams[1][1], table, None, idx, None, ws, ratio, 0,
                                     index_fmt)
                    calls += 2
                else:
                    idx = torch.empty(t, nblk * bs, dtype=torch.int32, device=device)
                    ops.visible_entries(table, pos, req, idx, ratio, bs)
                    calls += 1
            lens = torch.full((t,), idx.shape[1], dtype=torch.int32, device=device)
            ops.sparse_attn(q_rot, window, comp, pos, req, idx, lens, pos, sinks, o, d**-0.5, model_cfg.window, ring,
                            main_fmt, main_fmt if kind == SLIDING else comp_fmt, None, cache_cfg.batch_invariant)
            ops.inv_rope(o, pos, freq, o_rot)
            calls += 3
            if dcp > 1 and kind != SLIDING:  # a shard's partial, and the merge of the ranks' partials
                lse = torch.empty(t, h, dtype=torch.float32, device=device)
                ops.sparse_attn(q_rot, window, comp, pos, req, idx, lens, pos, sinks, o, d**-0.5, model_cfg.window,
                                ring, main_fmt, main_fmt, lse)
                ops.attn_merge(o[None].expand(dcp, -1, -1, -1), lse[None].expand(dcp, -1, -1).contiguous(), sinks,
                               o_rot)
                calls += 2
        for n, k in _fp8_projections(model_cfg, kinds, tp) if fp8_block else ():
            weight = torch.zeros(n, k, dtype=torch.float8_e4m3fn, device=device)
            scale = torch.ones(-(-n // fp8_block), -(-k // fp8_block), dtype=fp8_scale, device=device)
            x, out = torch.zeros(t, k, dtype=dtype, device=device), torch.empty(t, n, dtype=dtype, device=device)
            ops.fp8_linear(x, weight, scale.view(torch.uint8) if fp8_scale == torch.float8_e8m0fnu else scale, out,
                           fp8_block, 1, cache_cfg.batch_invariant)
            calls += 1
            # BlockFP8Linear's "auto" runs W8A8 at this step size: its route's kernels too
            if not cache_cfg.batch_invariant and fp8_rule.pick(t, n, k, fp8_block, fp8_rule.serving_capability(device)) == "fp8":
                ops.fp8_linear_w8a8(x, weight, scale.float(), out, fp8_block)
                calls += 1
        if fp8_block:  # o_a_proj, grouped (this rank's groups)
            groups = model_cfg.o_groups // tp
            n, k = groups * model_cfg.o_lora_rank, model_cfg.num_heads * d // model_cfg.o_groups
            weight = torch.zeros(n, k, dtype=torch.float8_e4m3fn, device=device)
            scale = torch.ones(-(-n // fp8_block), -(-k // fp8_block), dtype=fp8_scale, device=device)
            ops.fp8_linear(torch.zeros(t, groups * k, dtype=dtype, device=device), weight,
                           scale.view(torch.uint8) if fp8_scale == torch.float8_e8m0fnu else scale,
                           torch.empty(t, n, dtype=dtype, device=device), fp8_block, groups,
                           cache_cfg.batch_invariant)
            calls += 1
        if cache_cfg.batch_invariant:  # every GEMM's one launch config (dsv4ops.invariant)
            for n, k, fp32 in _invariant_shapes(model_cfg, kinds, tp):
                ops.invariant_linear(torch.zeros(t, k, dtype=dtype, device=device),
                                     torch.zeros(n, k, dtype=dtype, device=device),
                                     torch.empty(t, n, dtype=torch.float32 if fp32 else dtype, device=device))
                calls += 1
        rows = torch.empty(t, d, dtype=dtype, device=device)
        ops.pack_kv(rows, none, window, main_fmt)
        ops.unpack_kv(window, none, rows, main_fmt)
        calls += 2
    if device.type == "cuda":
        from dsv4ops.router.cuda import bind_cuda_kernel

        # The router's CUDA kernels build and bind here rather than at a first call inside a capture.
        bind_cuda_kernel("gate_topk", torch.cuda.get_device_capability(device))
        torch.cuda.synchronize(device)
    return calls



def _fp8_projections(cfg: DSV4AttentionConfig, kinds: set, tp: int = 1) -> set:
    """(out, in) of the ungrouped projections a keep_fp8 layer computes with fp8_linear (layers.FP8_PROJECTIONS
    but o_a_proj; q_b_proj's rows and o_b_proj's columns a rank's share under tensor parallelism)."""
    shapes = {(cfg.q_lora_rank, cfg.hidden_size), (cfg.num_heads // tp * cfg.head_dim, cfg.q_lora_rank),
              (cfg.head_dim, cfg.hidden_size), (cfg.hidden_size, cfg.o_groups // tp * cfg.o_lora_rank)}
    if CSA in kinds:
        shapes.add((cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank))
    return shapes


def _invariant_shapes(cfg: DSV4AttentionConfig, kinds: set, tp: int = 1) -> set:
    """(out, in, fp32 out) of the bf16 GEMMs a batch-invariant step runs through invariant_linear: each
    kind's packed projection of x (fp32 out where a compressor reads it), q_b, o_a a group, o_b and
    the indexer's q_b (dsv4ops.projections, dsv4ops.invariant)."""
    h, g, d, di = cfg.num_heads // tp, cfg.o_groups // tp, cfg.head_dim, cfg.index_head_dim
    base = cfg.q_lora_rank + d
    shapes = {(h * d, cfg.q_lora_rank, False), (cfg.o_lora_rank, cfg.num_heads * d // cfg.o_groups, False),
              (cfg.hidden_size, g * cfg.o_lora_rank, False)}
    if SLIDING in kinds:
        shapes.add((base, cfg.hidden_size, False))
    if CSA in kinds:  # weights_proj, the compressor's kv and gate (2d wide), the indexer's (2 di wide)
        shapes.add((base + cfg.index_n_heads + 4 * d + 4 * di, cfg.hidden_size, True))
        shapes.add((cfg.index_n_heads * di, cfg.q_lora_rank, False))
    if kinds - {SLIDING, CSA}:  # HCA: the compressor's kv and gate (d wide)
        shapes.add((base + 2 * d, cfg.hidden_size, True))
    return shapes
