"""GPU tier 1 for V4's FP4 cache option (CacheFormats("fp8_584", "fp4_288", "mxfp4_68")): the kernels of its
paths against the reference kernels on the same CUDA inputs at V4 dims (64 / 128 heads x 512, window
128, 64 index heads x 128, top-512, pages of 128 rows), poisoned pools and padding tokens; the serving
layer (bf16 model) against the fp64 oracle; CUDA-graph capture after `dsv4ops.warmup`.

sparse_attn on the (fp8_584 window, fp4_288 entries) pair runs the CUDA C++ kernel on sm_90 through
the op and the Triton kernel (called directly here; the op's choice on sm_100). The indexer's 64
heads exceed the C++ MX4 scoring (<= 32 heads): its Triton scoring feeds the C++ select. Tolerances
as test_kernels_gpu: bit-exact where the math is (exact scores), else within 2x the error of the
reference's own low-precision run against its float64 run."""

import pytest
import torch
import builders
import drivers
from test_fp4_cache import LAYER, SCHEDULES, SELECTING, _setup, check_against_oracle

import dsv4ops
from dsv4ops import testing
from dsv4ops.cache import CacheConfig, KVCacheManager
from dsv4ops.compressor import reference as compressor_ref
from dsv4ops.config import CSA, HCA
from dsv4ops.indexer import reference as indexer_ref
from dsv4ops.quant import formats
from dsv4ops.quant import reference as quant_ref
from dsv4ops.sparse_attn import reference as sparse_attn_ref

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CFG = dsv4ops.DSV4AttentionConfig.tiny()
FP4 = dsv4ops.CacheFormats("fp8_584", "fp4_288", "mxfp4_68")
BS, RING, WINDOW, TOPK = 128, 256, 128, 512


def _i32(values) -> torch.Tensor:
    return torch.as_tensor(values, dtype=torch.int32, device="cuda")


def _rows(pool: torch.Tensor, dim: int, fmt: str) -> torch.Tensor:
    """Every row of a pool, dequantized by the reference, float64 (poisoned 0xFF rows: NaN / -inf)."""
    n = pool.shape[0] * formats.block_size(pool.shape, fmt)
    out = torch.empty(n, dim, device=pool.device)
    quant_ref.unpack_kv(pool, torch.arange(n, dtype=torch.int32, device=pool.device), out, fmt)
    return out.double()


# ---- sparse_attn on (fp8_584, fp4_288) ------------------------------------------------------------
def _attn_case(heads: int, prefill: bool):
    """Decode tokens of separate requests (windows cut short below 127, a 70000 position) or one
    request's prefill chunk across the first window's end, 3 padding tokens; 512 listed entries a
    token, 10% -1, every other token's list cut short by comp_lens."""
    g = torch.Generator(device="cuda").manual_seed(heads + prefill)
    if prefill:
        pos, req = _i32(list(range(60, 316)) + [9, 9, 9]), _i32([0] * 256 + [-1] * 3)
    else:
        starts = [0, 5, 126, 127, 128, 1000, 4095, 70000]
        pos, req = _i32(starts + [9, 9, 9]), _i32(list(range(len(starts))) + [-1] * 3)
    t, n_req = pos.shape[0], int(req.max()) + 1
    wc = builders.fill_pool(builders.page_pool(n_req * RING // BS, BS, 512, "fp8_584", device="cuda"), 512, "fp8_584")
    blocks = 2 * TOPK // BS + 1
    cc = builders.fill_pool(builders.page_pool(blocks, BS, 512, "fp4_288", device="cuda"), 512, "fp4_288")
    idx = torch.stack([torch.randperm(blocks * BS, device="cuda", generator=g)[:TOPK] for _ in range(t)]).int()
    idx[torch.rand(idx.shape, device="cuda", generator=g) < 0.1] = -1
    lens = torch.randint(0, TOPK + 1, (t,), device="cuda", generator=g).int()
    lens[::2] = TOPK
    q = torch.randn(t, heads, 512, device="cuda", generator=g)
    return q, wc, cc, pos, req, idx, lens, torch.randn(heads, device="cuda", generator=g)


def _attn(fn, dtype, q, wc, cc, pos, req, idx, lens, sinks):
    out = torch.full(q.shape, float("nan"), dtype=dtype, device="cuda")
    fn(q.to(dtype), wc, cc, pos, req, idx, lens, None, sinks, out, 512**-0.5, WINDOW, RING, "fp8_584", "fp4_288")
    return out


@pytest.mark.parametrize("heads", [64, 128])
@pytest.mark.parametrize("prefill", [False, True], ids=["decode", "prefill"])
@pytest.mark.parametrize("backend", ["op", "triton"])
def test_sparse_attn_fp8_window_fp4_entries(backend, prefill, heads):
    from dsv4ops.sparse_attn import triton as sparse_attn_tt

    case = _attn_case(heads, prefill)
    fn = torch.ops.dsv4.sparse_attn if backend == "op" else sparse_attn_tt.sparse_attn
    got = _attn(fn, torch.bfloat16, *case)
    req = case[4]
    assert got.isfinite().all() and (got[req < 0] == 0).all(), "every row written, padding rows zero"
    testing.assert_close_to_ref(got, _attn(sparse_attn_ref.sparse_attn, torch.float64, *case),
                                _attn(sparse_attn_ref.sparse_attn, torch.bfloat16, *case), what="attention")


# ---- compressor_update: FP4 entries, rotated MXFP4 keys -------------------------------------------
# (rows d, ratio, coff, pool format, hadamard, steps of (request, tokens)): a prefill then a decode
# step (the HCA decode of few tokens takes the channel-split pooling).
COMPRESS = {
    "csa-fp4": (512, 4, 2, "fp4_288", False, [[(0, 301), (1, 37)], [(0, 1), (1, 1)]]),
    "hca-fp4": (512, 128, 1, "fp4_288", False, [[(0, 300), (1, 127)], [(0, 1), (1, 1)]]),
    "indexer-mxfp4": (128, 4, 2, "mxfp4_68", True, [[(0, 301), (1, 37)], [(0, 1), (1, 1)]]),
}


@pytest.mark.parametrize("case", sorted(COMPRESS))
def test_compressor_update(case):
    d, ratio, coff, fmt, rotate, steps = COMPRESS[case]
    width, blocks = coff * d, 8
    g = torch.Generator(device="cuda").manual_seed(1)
    ape = torch.randn(ratio, width, device="cuda", generator=g)
    w = 1 + 0.1 * torch.randn(d, device="cuda", generator=g)
    inv_freq = CFG.inv_freq(1).cuda()
    runs = {name: (torch.full((2, coff * ratio, 2 * width), float("nan"), device="cuda"),
                   builders.page_pool(blocks, BS, d, pool, device="cuda"))
            for name, pool in (("kernel", fmt), ("ref", fmt), ("ref64", torch.float32))}
    lens = [0, 0]
    for step in steps:
        pos = [p for r, n in step for p in range(lens[r], lens[r] + n)] + [9]
        req = [r for r, n in step for _ in range(n)] + [-1]
        for r, n in step:
            lens[r] += n
        pos, req = _i32(pos), _i32(req)
        entry = torch.where((req >= 0) & ((pos + 1) % ratio == 0), req * (blocks * BS // 2) + pos // ratio, -1).int()
        kv = torch.randn(pos.shape[0], width, device="cuda", generator=g)
        score = torch.randn(pos.shape[0], width, device="cuda", generator=g)
        for name, (state, cache) in runs.items():
            fn = torch.ops.dsv4.compressor_update if name == "kernel" else compressor_ref.compressor_update
            pool_fmt, flag = ("exact", False) if name == "ref64" else (fmt, rotate)
            fn(kv, score, ape, pos, req, entry, w, inv_freq, state, cache, None, 1e-6, pool_fmt, flag)
        assert torch.equal(runs["kernel"][0].nan_to_num(7), runs["ref"][0].nan_to_num(7)), "state rows"
    got, lowp = _rows(runs["kernel"][1], d, fmt), _rows(runs["ref"][1], d, fmt)
    ref = _rows(runs["ref64"][1], d, "exact")
    if rotate:
        ref = quant_ref.hadamard(ref)
    written = ref.isfinite().all(1)
    assert torch.equal(written, got.isfinite().all(1)), "entries written"
    testing.assert_close_to_ref(got[written], ref[written], lowp[written], what=f"{case} entries")


# ---- indexer: rotated MX4 queries of 64 heads, their scores over mxfp4_68 keys ----------------------
def test_indexer_q_prep_rotates_64_heads():
    t, h = 300, 64
    g = torch.Generator(device="cuda").manual_seed(2)
    q, w = 3 * torch.randn(t, h, 128, device="cuda", generator=g), torch.randn(t, h, device="cuda", generator=g)
    pos = torch.randint(0, 1 << 20, (t,), device="cuda", generator=g).int()
    inv_freq = CFG.inv_freq(1).cuda()

    def run(fn, dtype, fmt, rotate):
        q_out = (torch.empty(t, h, 68, dtype=torch.uint8, device="cuda") if fmt == "mxfp4_68"
                 else torch.empty(t, h, 128, dtype=dtype, device="cuda"))
        w_out = torch.empty(t, h, device="cuda")
        fn(q.to(dtype), w.to(dtype), pos, inv_freq, q_out, w_out, fmt, rotate)
        return indexer_ref.query_values(q_out).double() * w_out.double()[..., None]

    got = run(torch.ops.dsv4.indexer_q_prep, torch.bfloat16, "mxfp4_68", True)
    lowp = run(indexer_ref.indexer_q_prep, torch.bfloat16, "mxfp4_68", True)
    ref = quant_ref.hadamard(run(indexer_ref.indexer_q_prep, torch.float32, "exact", False))
    testing.assert_close_to_ref(got, ref, lowp, what="rotated q x w")


@pytest.mark.parametrize("context", [4096, 65536, 1 << 20])
def test_indexer_topk_64_heads_on_mxfp4_keys_is_exact(context):
    """32 decode tokens of 8 requests at up to `context` (ratio 4: up to 262144 keys a request, pages
    of 128 in a shuffled table) and 2 padding tokens. Keys and queries on the e2m1 grid, weights signed
    powers of two: every score is exact in fp32, so the selection equals the reference's, ties included."""
    from dsv4ops.indexer import cuda as indexer_cuda

    g = torch.Generator(device="cuda").manual_seed(3)
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], device="cuda")

    def values(*shape):
        v = grid[torch.randint(0, 8, shape, device="cuda", generator=g)]
        return torch.where(torch.rand(shape, device="cuda", generator=g) < 0.5, -v, v)

    n_req, t, h = 8, 34, 64
    per_req = context // 4 // BS
    cache = builders.page_pool(n_req * per_req, BS, 128, "mxfp4_68", device="cuda")
    slots = torch.arange(n_req * per_req * BS, dtype=torch.int32, device="cuda")
    for s in range(0, slots.shape[0], 1 << 18):
        quant_ref.pack_kv(values(min(1 << 18, slots.shape[0] - s), 128), slots[s:s + (1 << 18)], cache, "mxfp4_68")
    table = torch.randperm(n_req * per_req, device="cuda", generator=g).int().view(n_req, per_req)
    q = builders.mx4_query(values(t, h, 128).cpu()).cuda()
    w = 2.0 ** torch.randint(-3, 3, (t, h), device="cuda", generator=g).float()
    w = torch.where(torch.rand(t, h, device="cuda", generator=g) < 0.3, -w, w)
    pos = torch.randint(0, context, (t,), device="cuda", generator=g).int()
    req = torch.cat([torch.arange(t - 2, device="cuda") % n_req, _i32([-1, -1])]).int()
    assert not indexer_cuda.score_serves(q, w, cache, "mxfp4_68", BS), "64 heads: the Triton scoring"
    got = torch.full((t, TOPK), 99, dtype=torch.int32, device="cuda")
    want = torch.empty(t, TOPK, dtype=torch.int32, device="cuda")
    ws = builders.topk_workspace(t, per_req * BS, TOPK, device="cuda")
    torch.ops.dsv4.indexer_topk(q, w, pos, req, cache, table, None, got, None, ws, 4, 0, "mxfp4_68")
    indexer_ref.indexer_topk(q, w, pos, req, cache, table, None, want, None, 4, 0, "mxfp4_68")
    assert torch.equal(got, want)


# ---- the serving layer and CUDA graphs --------------------------------------------------------------
@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("kind", [CSA, HCA])
def test_serving_equals_the_oracle_on_cuda(kind, schedule):
    layer, manager, inputs = _setup(kind, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        outs = drivers.serve_schedule(layer, manager, inputs, SCHEDULES[schedule]())
    check_against_oracle(layer, inputs, outs)


@pytest.mark.parametrize("schedule", ["chunked", "decode"])
def test_serving_with_real_selection_on_cuda(schedule):
    layer, manager, inputs = _setup(CSA, cfg=SELECTING, device="cuda", dtype=torch.bfloat16)
    sel = {}
    with torch.no_grad():
        outs = drivers.serve_schedule(layer, manager, {r: inputs[r] for r in ("a", "b")},
                                      [{r: n for r, n in step.items() if r != "c"} for step in SCHEDULES[schedule]()
                                       if set(step) - {"c"}], selections=sel)
    for rid in ("a", "b"):
        testing.assert_matches_oracle(layer, inputs[rid], outs[rid], sel[rid], what=f"request {rid}")


def test_layers_capture_in_cuda_graphs_after_warmup():
    from test_kernels_gpu import _compiled_kernels

    cache_cfg = CacheConfig(formats=FP4, exact_dtype=torch.bfloat16, max_requests=4, max_context=512, max_step_tokens=64)
    assert dsv4ops.warmup(CFG, cache_cfg, "cuda", torch.bfloat16) > 0
    compiled = _compiled_kernels()
    manager = KVCacheManager(CFG, cache_cfg, device="cuda")
    layers = [testing.randomize_(dsv4ops.DeepseekV4Attention(CFG, li, formats=FP4), seed=li).to("cuda", torch.bfloat16)
              for li in (0, LAYER[CSA], LAYER[HCA])]
    for layer in layers:
        layer.attach_cache(manager)
    for r in range(3):
        manager.admit(r)
    with torch.no_grad():
        for new in ({0: 40, 1: 9, 2: 3}, {0: 1, 1: 1, 2: 1}):  # a prefill step, then a decode step
            if manager.open_step is not None:
                manager.commit(manager.open_step)
            step = manager.prepare_step(new)
            x = torch.randn(step.positions.shape[0], CFG.hidden_size, device="cuda").bfloat16()
            eager = [layer(x, step) for layer in layers]
        new = {name: keys - compiled[name] for name, keys in _compiled_kernels().items() if keys - compiled[name]}
        assert not new, f"compiled after warmup (kernel: specializations): {new}"
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream), torch.cuda.graph(graph, stream=stream):
            captured = [layer(x, step) for layer in layers]
        torch.cuda.current_stream().wait_stream(stream)
        graph.replay()
        torch.cuda.synchronize()
    for a, b in zip(captured, eager):
        assert torch.equal(a, b), "replay == eager (same inputs, same cache state)"
