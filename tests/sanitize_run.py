"""GPU tier 3: a small run of every CUDA kernel, each launch path included, for

    compute-sanitizer --tool memcheck --error-exitcode 1 python tests/sanitize_run.py
    NV_COMPUTE_SANITIZER_MAX_RACECHECK_HAZARDS=100000000 compute-sanitizer --tool racecheck \
        --print-limit 100000 python tests/sanitize_run.py > race.log 2>&1
    python tests/racecheck_report.py race.log

(racecheck reports hazards inside cuBLAS's sm_90 GEMMs, `nvjet_sm90_*`, which the layers' torch
projections launch: 62 on the H100 with CUDA 13.0, and on sparse_attn's named-barrier hand-offs
between warpgroups, which tests/racecheck_named_barriers.cu reproduces on a correctly synchronized
kernel; tests/racecheck_report.py sorts the report and fails on any other hazard.
`--kernel-name-exclude kns=nvjet` ends in an internal sanitizer error at the first cuBLAS launch.)

(prints one line per kernel and path it ran). Paths: the layers' serving steps (qkv_prep,
compressor_update, indexer_q_prep, indexer_topk, visible_entries, sparse_attn, inv_rope) in FP8 and
bf16 pools, prefill chunks and padded decode steps; indexer_topk with one chunk, the grid select (one CTA a
tile, and two CTAs of several tiles), and the chunk tree's three merge levels (small chunks), and V4.1's
MX4 scoring at 32 heads (all entries, candidate blocks); sparse_attn with one split (many tokens) and
split-KV with the combine (decode over a long list) in each format pair of the C++ kernel (V4, V4 with
fp4 entries, V4.1), through the selected kernel (on sm_90 the CUDA C++ one) and on sm_90 also
through the Triton kernel; pack_kv / unpack_kv in every V4 and V4.1 format with skipped slots;
fp8_linear with and without split-K (decode and prefill), both scale types, and W8A8 (the Triton
FP8 kernel with x quantized in it or by act_quant, split-K; act_quant + cuBLASLt on sm_90); sparse_attn as a context-parallel shard (with lse) in each format pair, and
attn_merge of two shards; the
V4.1 stack's serving steps (every V4.1 op and role); the router's gate_topk, hash_route, and
router_gate both ways (the fused CuTe kernel at <= 64 tokens on sm_90, cuBLAS + gate_topk above)."""

import builders
import torch
from drivers_v41 import serve_schedule

from dsv4ops import CacheFormats, DeepseekV4Attention, DSV4AttentionConfig, testing
from dsv4ops.cache import CacheConfig, KVCacheManager
from dsv4ops.cache.v41 import V41CacheManager
from dsv4ops.config_v41 import DSV41AttentionConfig
from dsv4ops.layers_v41 import DeepseekV41AttentionStack
from dsv4ops.indexer.api import indexer_q_prep, indexer_topk
from dsv4ops.attn_merge.api import attn_merge
from dsv4ops.fp8_linear.api import fp8_linear
from dsv4ops.quant.api import pack_kv, unpack_kv
from dsv4ops.sparse_attn import triton as sparse_attn_triton
from dsv4ops.sparse_attn.api import sparse_attn

CFG = DSV4AttentionConfig.tiny(index_topk=8)
DEV = "cuda"
I32 = torch.int32


def say(text: str):
    torch.cuda.synchronize()
    print(f"sanitize: {text}: ok", flush=True)


def layers():
    for fmts in (CacheFormats.v4(), CacheFormats.exact()):
        for li in range(3):
            layer = testing.randomize_(DeepseekV4Attention(CFG, li, formats=fmts), seed=li)
            layer = layer.to(DEV, torch.bfloat16)
            manager = KVCacheManager(CFG, CacheConfig(max_requests=2, max_context=300, max_step_tokens=160,
                                                      formats=fmts), device=DEV)
            layer.attach_cache(manager)
            manager.admit(0)
            manager.admit(1)
            with torch.no_grad():
                # A prefill chunk that crosses t = 127 (HCA entry 0), then padded decode steps.
                with manager.step({0: 150, 1: 3}) as step:
                    layer(torch.randn(160, CFG.hidden_size, device=DEV, dtype=torch.bfloat16), step)
                for _ in range(3):
                    with manager.step({0: 1, 1: 1}) as step:
                        layer(torch.randn(step.positions.shape[0], CFG.hidden_size, device=DEV,
                                          dtype=torch.bfloat16), step)
            say(f"layer {li} ({layer.layer_type}), cache {fmts}")


def layers_v41():
    """The tiny V4.1 stack (every role: KV / index / candidate sources, reindex and reuse layers)
    over two prefill chunks and decode steps: qkv_prep into fp8_528 rings, compressor_update with
    latent_out into fp4_288 pools, indexer_k_prep into mxfp4_68 keys, MX4 indexer_q_prep,
    indexer_topk (source, candidate pool, reindex in the pool), sparse_attn over fp8_528 + fp4_288."""
    cfg = DSV41AttentionConfig.tiny()
    stack = testing.randomize_(DeepseekV41AttentionStack(cfg), seed=0).to(DEV, torch.bfloat16)
    manager = V41CacheManager(cfg, CacheConfig(max_requests=2, max_context=128, max_step_tokens=128, block_size=7,
                                               buckets=(2, 128)), device=DEV)
    stack.attach_cache(manager)
    inputs = {r: torch.randn(cfg.num_layers, n, cfg.hidden_size, device=DEV, dtype=torch.bfloat16)
              for r, n in (("a", 84), ("b", 33))}
    serve_schedule(stack, manager, inputs, [{"a": 40, "b": 17}, {"a": 40, "b": 16}, {"a": 1}, {"a": 1}, {"a": 1},
                                            {"a": 1}])
    say("V4.1 stack, 2 prefill chunks and 4 decode steps")


def _fp8_pool(blocks: int, dim: int, fmt: str) -> torch.Tensor:
    return builders.fill_pool(builders.page_pool(blocks, 64, dim, fmt, device=DEV), dim, fmt)


def topk():
    """Visible entries 40 (one chunk), 40000 with k = 512 (the grid select: 10 tiles, one CTA a tile,
    then two CTAs of 5 tiles), and 40000 again through the chunk tree with 1024-key chunks and merge
    groups of 4 (40 lists -> 10 -> 3 -> 1: three merge levels); two tokens of 64 heads (on sm_90 the
    wgmma scoring kernel), one of them padding; the 40000-entry rows also restricted to candidate
    blocks (V4.1's reindex columns)."""
    from dsv4ops.indexer import cuda as indexer_cuda
    from dsv4ops.indexer import workspace

    default = workspace.CHUNK, workspace.MERGE_BLOCK
    select, grid_ctas = indexer_cuda.select, indexer_cuda.grid_ctas
    for visible, k, sizes, ctas in ((40, 8, default, None), (40000, 512, default, None), (40000, 512, default, 2),
                                    (40000, 512, (1024, 2048), None)):
        workspace.CHUNK, workspace.MERGE_BLOCK = sizes
        # The tree has no state words: the `zeroed` hint of the launcher's wrapper means nothing to it.
        indexer_cuda.select = select if sizes == default else \
            lambda *args, zeroed=False: indexer_cuda.select_tree(*args)
        indexer_cuda.grid_ctas = grid_ctas if ctas is None else lambda tokens, n_row, device, c=ctas: c
        blocks = -(-visible // 64)
        cache = _fp8_pool(blocks, 128, "fp8_132")
        table = torch.randperm(blocks, device=DEV).to(I32)[None]
        q, w = torch.randn(2, 64, 128, device=DEV), torch.randn(2, 64, device=DEV)
        pos = torch.tensor([4 * visible - 1, 0], dtype=I32, device=DEV)
        req = torch.tensor([0, -1], dtype=I32, device=DEV)
        q8, w8 = indexer_q_prep(q, w, pos, builders.rope_table(64).to(DEV), fmt="fp8_132")
        indexer_topk(q8, w8, pos, req, cache, table, k, 4, "fp8_132")
        path = f"grid, {ctas or 'a CTA a tile'}" if sizes == default and visible > workspace.GRID_TILE else \
            f"{len(workspace.merge_levels(visible, k))} merge levels"
        say(f"indexer_topk, {visible} visible entries, k {k}, {path}")
        if visible > k:
            cand = torch.arange(0, visible // 16, 2, dtype=I32, device=DEV).expand(2, -1).contiguous()
            indexer_topk(q8, w8, pos, req, cache, table, k, 4, "fp8_132", cand=cand, cand_block=16)
            say(f"indexer_topk, {cand.shape[1]} candidate blocks of 16 entries, k {k}")
    workspace.CHUNK, workspace.MERGE_BLOCK = default
    indexer_cuda.select, indexer_cuda.grid_ctas = select, grid_ctas


def topk_mx4():
    """V4.1's MX4 scoring (sm_90: the C++ kernel at 32 heads): 40000 visible mxfp4_68 entries, k 512,
    two tokens (one padding), all entries and candidate blocks."""
    visible, k = 40000, 512
    blocks = -(-visible // 128)
    cache = builders.fill_pool(builders.page_pool(blocks, 128, 128, "mxfp4_68", device=DEV), 128, "mxfp4_68")
    table = torch.randperm(blocks, device=DEV).to(I32)[None]
    q, w = torch.randn(2, 32, 128, device=DEV), torch.randn(2, 32, device=DEV)
    pos = torch.tensor([2 * visible - 1, 0], dtype=I32, device=DEV)
    req = torch.tensor([0, -1], dtype=I32, device=DEV)
    qx, wx = indexer_q_prep(q, w, pos, builders.rope_table(64).to(DEV), fmt="mxfp4_68")
    indexer_topk(qx, wx, pos, req, cache, table, k, 2, "mxfp4_68")
    say(f"indexer_topk mxfp4_68, {visible} visible entries, 32 heads")
    cand = torch.arange(0, visible // 16, 2, dtype=I32, device=DEV).expand(2, -1).contiguous()
    indexer_topk(qx, wx, pos, req, cache, table, k, 2, "mxfp4_68", cand=cand, cand_block=16)
    say(f"indexer_topk mxfp4_68, {cand.shape[1]} candidate blocks of 16 entries")


def attention():
    """128 tokens over their window (one split), 1 token over its window and 2048 listed entries
    (split-KV and the combine), then 8 tokens over 512 (split-KV: the combine at 4 heads, at more the
    splits merged in their clusters), in each (window, entry) format pair the C++ kernels read, at 4
    heads (small_heads.cu's 8-head CTA) and 64 (sparse_attn.cu), and at 16 (small_heads.cu's 16-head
    CTA), 32 (a 64-head CTA with padding rows) and 128 (two 64-head CTAs a token) heads for V4's pair;
    at 4 heads each also as a context-parallel shard (with lse: the Triton kernel) and two such shards
    merged (attn_merge)."""
    for window_fmt, comp_fmt in (("fp8_584", "fp8_584"), ("fp8_584", "fp4_288"), ("fp8_528", "fp4_288")):
        for heads in (4, 64) + ((16, 32, 128) if comp_fmt == "fp8_584" else ()):
            _attention(window_fmt, comp_fmt, heads)


def _attention(window_fmt: str, comp_fmt: str, heads: int):
    ring, window = 256, 128
    win = _fp8_pool(ring // 64, 512, window_fmt)
    comp = _fp8_pool(64, 512, comp_fmt)
    sinks = torch.randn(heads, device=DEV)
    for t, entries in ((128, 0), (1, 2048), (8, 512)):
        pos = torch.arange(1000, 1000 + t, dtype=I32, device=DEV) if t > 1 else torch.tensor([5000], dtype=I32,
                                                                                            device=DEV)
        comp_idx = torch.randint(0, 64 * 64, (t, entries), dtype=I32, device=DEV)
        if entries:
            comp_idx[:, -7:] = -1
        q = torch.randn(t, heads, 512, device=DEV, dtype=torch.bfloat16)
        req = torch.zeros(t, dtype=I32, device=DEV)
        sparse_attn(q, win, comp, pos, req, comp_idx, sinks, 512**-0.5, window, ring, window_fmt, comp_fmt)
        say(f"sparse_attn {window_fmt} / {comp_fmt}, {t} tokens x {heads} heads x ({window} window + {entries} "
            "entries)")
        if heads != 4:  # the paths below do not depend on the C++ kernel's CTA
            continue
        out, lse = sparse_attn(q, win, comp, pos, req, comp_idx, sinks, 512**-0.5, window, ring, window_fmt, comp_fmt,
                               return_lse=True)
        say(f"sparse_attn with lse (a context-parallel shard) {window_fmt} / {comp_fmt}, {t} tokens")
        attn_merge(torch.stack([out, out]), torch.stack([lse, lse]), sinks)
        say(f"attn_merge of 2 shards, {t} tokens")
        if torch.cuda.get_device_capability()[0] == 9 and comp_fmt == "fp8_584":  # the op ran the C++ kernel
            lens = torch.full((t,), entries, dtype=I32, device=DEV)
            sparse_attn_triton.sparse_attn(q, win, comp, pos, req, comp_idx, lens, None, sinks, torch.empty_like(q),
                                           512**-0.5, window, ring, "fp8_584", "fp8_584")
            say(f"Triton sparse_attn, {t} tokens x ({window} window + {entries} entries)")


def pack_unpack():
    for fmt, dim in (("fp8_584", 512), ("fp8_132", 128), ("fp8_528", 512), ("fp4_288", 512), ("mxfp4_68", 128)):
        # mxfp4_68 pages hold 128 rows (17 x 512 B); the others 64.
        pool = builders.page_pool(2, 128 if fmt == "mxfp4_68" else 64, dim, fmt, device=DEV)
        slots = torch.tensor([3, -1, 70, 127, -1, 0], dtype=I32, device=DEV)
        pack_kv(torch.randn(6, dim, device=DEV, dtype=torch.bfloat16), slots, pool, fmt)
        unpack_kv(pool, slots, dim, torch.bfloat16, fmt)
        say(f"pack_kv / unpack_kv {fmt}")
    pool = builders.page_pool(2, 64, 512, torch.bfloat16, device=DEV)
    slots = torch.tensor([3, -1, 70], dtype=I32, device=DEV)
    pack_kv(torch.randn(3, 512, device=DEV, dtype=torch.bfloat16), slots, pool, "exact")
    unpack_kv(pool, slots, 512, torch.bfloat16, "exact")
    say("pack_kv / unpack_kv exact")


def projections():
    """fp8_linear: split-K decode rows (partials + the reduce launch), prefill rows without a split
    and with 6 (the last split ragged), V4.1's 32 x 32 tiles; ragged N and K, UE8M0 and fp32 scales."""
    for m, n, k, block, scale_dtype in ((1, 1000, 4100, 128, torch.float8_e8m0fnu), (300, 520, 700, 128, torch.float32),
                                        (300, 512, 4096, 128, torch.float8_e8m0fnu),
                                        (17, 200, 300, 32, torch.float8_e8m0fnu)):
        weight, scale = builders.block_fp8_weight(n, k, block, scale_dtype)
        fp8_linear(torch.randn(m, k, device=DEV, dtype=torch.bfloat16), weight.to(DEV), scale.to(DEV), block)
        say(f"fp8_linear {m} x {k} -> {n}, {block} x {block} tiles")
    # W8A8 (fp32 scales) on each route of its launcher: the Triton FP8 kernel with x quantized in its
    # prologue (1 row), after act_quant with split-K (300 rows: 5 row blocks, 8 splits), and on sm_90
    # from 1024 rows act_quant + cuBLASLt's blockwise-scaled GEMM.
    weight, scale = builders.block_fp8_weight(512, 4096, 128, torch.float32)
    for m in (1, 300, 1100):
        fp8_linear(torch.randn(m, 4096, device=DEV, dtype=torch.bfloat16), weight.to(DEV), scale.to(DEV), 128,
                   activations="fp8")
        say(f"fp8_linear_w8a8 {m} x 4096 -> 512")


def routers():
    from dsv4ops.router import api, modules

    router = testing.randomize_(modules.DeepseekV4Router(CFG)).to(DEV)
    for tokens in (3, 100):
        router(torch.randn(tokens, CFG.hidden_size, device=DEV))
        say(f"router_gate, {tokens} tokens")
    hash_router = testing.randomize_(modules.DeepseekV4HashRouter(CFG)).to(DEV)
    hash_router(torch.randn(5, CFG.hidden_size, device=DEV), torch.arange(5, device=DEV))
    say("hash_route")
    api.gate_topk(torch.randn(33, CFG.n_routed_experts, device=DEV), torch.zeros(CFG.n_routed_experts, device=DEV),
                  CFG.num_experts_per_tok, 1.5)
    say("gate_topk")


def main():
    with torch.no_grad():
        layers()
        layers_v41()
        topk()
        topk_mx4()
        attention()
        pack_unpack()
        projections()
        routers()


if __name__ == "__main__":
    main()
