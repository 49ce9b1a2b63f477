"""GPU tier 1: each attention op's CUDA (Triton) kernel against the reference kernel on the same CUDA
inputs, V4 dims (64 / 128 heads x 512, window 128, 128-d indexer, top-512), poisoned outputs and
pools, padding tokens, opcheck with CUDA tensors, whole layers against the fp64 oracle, a pool over
2 GiB, and CUDA-graph capture after `dsv4ops.warmup`. Issue 5.

Tolerances: bit-exact where the math is exact (FP8 packing, state rows, integer-valued indexer
scores); elsewhere max|kernel - ref64| <= 2 x max|ref_lowp - ref64| (dsv4ops.testing.assert_close_to_ref),
ref64 being the reference kernel run in float64 (or into an exact float pool) and ref_lowp the
reference kernel on the kernel's own low-precision inputs.

Debugging without a GPU: DSV4OPS_GPU_TESTS_ON_CPU=1 pytest -m gpu tests/test_kernels_gpu.py runs
the same tests on CPU with the launchers under the Triton interpreter, at smaller head counts.
"""

import os
import sys

import builders
import pytest
import torch

import dsv4ops
from dsv4ops import reference, testing
from dsv4ops.cache import CacheConfig, KVCacheManager
from dsv4ops.compressor import reference as compressor_ref
from dsv4ops.config import CSA, HCA, SLIDING
from dsv4ops.indexer import reference as indexer_ref
from dsv4ops.qkv_prep import reference as qkv_prep_ref
from dsv4ops.inv_rope import reference as inv_rope_ref
from dsv4ops.quant import formats
from dsv4ops.quant import reference as quant_ref
from dsv4ops.sparse_attn import reference as sparse_attn_ref

ON_CPU = os.environ.get("DSV4OPS_GPU_TESTS_ON_CPU") == "1"
DEV = "cpu" if ON_CPU else "cuda"
pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not ON_CPU and not torch.cuda.is_available(), reason="needs a CUDA GPU")]

HEADS = (3,) if ON_CPU else (64, 128)  # Flash, Pro
INDEX_HEADS = 3 if ON_CPU else 64
BS = 4 if ON_CPU else 64  # entries per page
WINDOW = 8 if ON_CPU else 128
RING = 12 if ON_CPU else 256
TOPK = 16 if ON_CPU else 512
CFG = dsv4ops.DSV4AttentionConfig.tiny()
FP8 = "fp8"


def _op(name: str):
    """The CUDA kernel through the op's dispatch; on the CPU debug path the launcher itself."""
    if ON_CPU:
        return dsv4ops.backends.triton_launcher(name)
    return getattr(torch.ops.dsv4, name)


def _i32(values) -> torch.Tensor:
    return torch.as_tensor(values, dtype=torch.int32, device=DEV)


def _inv_freq(layer_idx: int = 1) -> torch.Tensor:
    return CFG.inv_freq(layer_idx).to(DEV)


def _pool(fmt, dim: int, blocks: int, bs: int = BS) -> torch.Tensor:
    return builders.page_pool(blocks, bs, dim, fmt, device=DEV)


def _fmt(pool: torch.Tensor, dim: int) -> str:
    """The V4 format of a pool: fp8_584 / fp8_132 by width for uint8 pools, exact otherwise."""
    return builders.format_name(FP8 if pool.dtype == torch.uint8 else pool.dtype, dim)


def _n_slots(pool: torch.Tensor, dim: int) -> int:
    return pool.shape[0] * formats.block_size(pool.shape, _fmt(pool, dim))


def _rows(pool: torch.Tensor, dim: int) -> torch.Tensor:
    """Every entry of a pool, dequantized by the reference, float64 (unwritten FP8 entries: NaN)."""
    out = torch.empty(_n_slots(pool, dim), dim, dtype=torch.float32, device=pool.device)
    quant_ref.unpack_kv(pool, torch.arange(out.shape[0], dtype=torch.int32, device=pool.device), out,
                        _fmt(pool, dim))
    return out.double()


def _written(rows: torch.Tensor) -> torch.Tensor:
    return ~rows.isnan().any(1)


def _steps(*runs, pad=0, garbage_positions=True):
    """positions, req_slots of a flat step: runs of (request, first position, count), then padding
    tokens with random positions (they must read and write nothing)."""
    pos = [p for _, s, n in runs for p in range(s, s + n)]
    req = [r for r, _, n in runs for _ in range(n)]
    pad_pos = torch.randint(0, 5000, (pad,)).tolist() if garbage_positions else [0] * pad
    return _i32(pos + pad_pos), _i32(req + [-1] * pad)


# ---- pack_kv / unpack_kv -----------------------------------------------------------------------
@pytest.mark.parametrize("dim", [512, 128])
@pytest.mark.parametrize("pool", [FP8, torch.bfloat16, torch.float32], ids=["fp8", "bf16", "fp32"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_pack_unpack_bit_exact(dim, pool, dtype):
    n, blocks = (9, 4) if ON_CPU else (600, 16)
    x = (torch.randn(n, dim, device=DEV) * torch.logspace(-4, 4, n, device=DEV)[:, None]).to(dtype)
    x[0, :64] = 0
    x[1, 7] = 448 * 2.0**-5  # an exact power-of-two amax
    slots = torch.randperm(blocks * BS, device=DEV)[:n].to(torch.int32)
    slots[::7] = -1
    got, want = _pool(pool, dim, blocks), _pool(pool, dim, blocks)
    fmt = _fmt(got, dim)
    _op("pack_kv")(x, slots, got, fmt)
    quant_ref.pack_kv(x, slots, want, fmt)
    assert builders.bytes_equal(got, want), "pack_kv"
    out = torch.full((n, dim), float("nan"), dtype=dtype, device=DEV)
    expect = torch.empty(n, dim, dtype=dtype, device=DEV)
    _op("unpack_kv")(want, slots, out, fmt)
    quant_ref.unpack_kv(want, slots, expect, fmt)
    assert builders.bytes_equal(out, expect), "unpack_kv"


# ---- qkv_prep ----------------------------------------------------------------------------------
@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("pool", [FP8, torch.bfloat16], ids=["fp8", "bf16"])
def test_qkv_prep(pool, heads):
    # Prefill from 0, a decode token at 1000, a chunk crossing 127, padding with random positions.
    pos, req = _steps((0, 0, 5 if ON_CPU else 20), (1, 1000, 1), (2, 125, 4 if ON_CPU else 10), pad=3)
    t = pos.shape[0]
    q, kv = torch.randn(t, heads, 512, device=DEV), torch.randn(t, 512, device=DEV)

    def run(fn, dtype, pool_kind):
        cache = _pool(pool_kind, 512, 3 * RING // BS)
        q_out = torch.full((t, heads, 512), float("nan"), dtype=dtype, device=DEV)
        fn(q.to(dtype), kv.to(dtype), pos, req, _inv_freq(), q_out, cache, RING, 1e-6, True, _fmt(cache, 512))
        return q_out, _rows(cache, 512)

    q_k, rows_k = run(_op("qkv_prep"), torch.bfloat16, pool)
    q_r, rows_r = run(qkv_prep_ref.qkv_prep, torch.bfloat16, pool)
    q_64, rows_64 = run(qkv_prep_ref.qkv_prep, torch.float64, torch.float64)
    assert q_k.isfinite().all(), "q_out fully written"
    testing.assert_close_to_ref(q_k, q_64, q_r, what="q_out")
    written = _written(rows_64)
    assert written.sum() == (req >= 0).sum(), "one entry per live token"
    assert torch.equal(_written(rows_k), written), "padding tokens write nothing"
    testing.assert_close_to_ref(rows_k[written], rows_64[written], rows_r[written], what="window entries")
    assert torch.equal(rows_k[written, :448], rows_r[written, :448]), "nope dims (no trig): bit-exact"


# ---- compressor_update -------------------------------------------------------------------------
# (d, ratio, overlap, steps of (request, tokens)): prefill chunks longer than the state ring (their
# closing tokens read rows later tokens of the step overwrite), decode tokens, two requests.
if ON_CPU:
    COMPRESS = {"csa": (512, 4, True, [[(0, 6), (1, 3)], [(0, 1), (1, 1)], [(0, 9)]]),
                "hca": (512, 16, False, [[(0, 20), (1, 3)], [(1, 14)], [(0, 30)]]),
                "indexer": (128, 4, True, [[(0, 6), (1, 3)], [(0, 9), (1, 1)]])}
else:
    COMPRESS = {"csa": (512, 4, True, [[(0, 37), (1, 3)], [(0, 1), (1, 1)], [(0, 20), (1, 13)]]),
                "hca": (512, 128, False, [[(0, 300), (1, 5)], [(0, 1), (1, 200)], [(0, 140), (1, 1)]]),
                "indexer": (128, 4, True, [[(0, 37), (1, 3)], [(0, 21), (1, 1)]])}


@pytest.mark.parametrize("pool", [FP8, torch.bfloat16], ids=["fp8", "bf16"])
@pytest.mark.parametrize("case", sorted(COMPRESS))
def test_compressor_update(case, pool):
    d, ratio, overlap, steps = COMPRESS[case]
    width, rows = (2 * d, 2 * ratio) if overlap else (d, ratio)
    adt = torch.float32 if pool == FP8 else torch.bfloat16  # numerics.compressor_dtype
    ape, w = torch.randn(ratio, width, device=DEV), 1 + 0.1 * torch.randn(d, device=DEV)
    blocks = 8 if ON_CPU else 12
    runs = {name: (torch.full((2, rows, 2 * width), float("nan"), device=DEV), _pool(p, d, blocks))
            for name, p in (("kernel", pool), ("ref", pool), ("ref64", torch.float32))}
    lens = [0, 0]
    for step in steps:
        pos, req = _steps(*[(r, lens[r], n) for r, n in step], pad=2)
        for r, n in step:
            lens[r] += n
        closes = (req >= 0) & ((pos + 1) % ratio == 0)
        entry = torch.where(closes, (req * (blocks * BS // 2) + pos // ratio) % (blocks * BS), -1).to(torch.int32)
        kv, score = (torch.randn(pos.shape[0], width, device=DEV).to(adt) for _ in range(2))
        for name, (state, cache) in runs.items():
            fn = _op("compressor_update") if name == "kernel" else compressor_ref.compressor_update
            fn(kv, score, ape, pos, req, entry, w, _inv_freq(), state, cache, None, 1e-6, _fmt(cache, d))
        assert builders.bytes_equal(runs["kernel"][0], runs["ref"][0]), "state rows (exact)"
    got, lowp, ref = (_rows(runs[n][1], d) for n in ("kernel", "ref", "ref64"))
    written = _written(ref)
    assert written.any() and torch.equal(written, _written(got)), "entries written where the reference writes"
    testing.assert_close_to_ref(got[written], ref[written], lowp[written], what=f"{case} entries")


@pytest.mark.parametrize("case", ["csa", "hca"])
def test_compressor_state_row_holds_its_last_writer(case):
    """Issue 32: in a step longer than the state ring, tokens p and p + rows of a request map to the
    same state row (rows = 8 for CSA, 128 for HCA) and only the later may write it (_save_kernel's
    `later == 0`). The interpreter runs programs one after another in order, so a missing guard shows
    only where programs run concurrently: one request's 8192-token chunk (CSA: 1024 writers per row,
    HCA: 64), three times with fresh data, the state rows bit-exact against the reference's (the last
    writer's a and z + ape). tests/test_compressor.py runs the same check on the CPU with the
    interpreter's programs in reverse order."""
    d, ratio, overlap = (512, 4, True) if case == "csa" else (512, 128, False)
    width, rows = (2 * d, 2 * ratio) if overlap else (d, ratio)
    t = 3 * rows + 1 if ON_CPU else 8192
    ape, w = torch.randn(ratio, width, device=DEV), 1 + 0.1 * torch.randn(d, device=DEV)
    pos, req = torch.arange(t, dtype=torch.int32, device=DEV), torch.zeros(t, dtype=torch.int32, device=DEV)
    closes = (pos + 1) % ratio == 0
    blocks = t // ratio // BS + 1
    entry = torch.where(closes, pos // ratio, -1).to(torch.int32)
    for _ in range(3):
        kv, score = (torch.randn(t, width, device=DEV) for _ in range(2))
        states = {}
        for name, fn in (("kernel", _op("compressor_update")), ("ref", compressor_ref.compressor_update)):
            states[name] = torch.full((1, rows, 2 * width), float("nan"), device=DEV)
            fn(kv, score, ape, pos, req, entry, w, _inv_freq(), states[name], _pool(torch.float32, d, blocks), None,
               1e-6, "exact")
        assert builders.bytes_equal(states["kernel"], states["ref"]), "a state row holds another writer's values"
        last = torch.arange(t - rows, t, device=DEV)  # the last writer of each row, in row order p % rows
        want = torch.cat([kv[last], score[last] + ape[last % ratio]], 1)[torch.argsort(last % rows)]
        assert torch.equal(states["ref"][0], want), "the reference's rows are the last writers'"


# ---- indexer -----------------------------------------------------------------------------------
@pytest.mark.parametrize("out_dtype", [torch.float8_e4m3fn, torch.bfloat16], ids=["fp8", "bf16"])
def test_indexer_q_prep(out_dtype):
    t, h = 5, INDEX_HEADS
    q, w = 3 * torch.randn(t, h, 128, device=DEV), torch.randn(t, h, device=DEV)
    pos = _i32([0, 77, 5000, 3, 1 << 20])

    def run(fn, dtype, odt):
        q_out = torch.full((t, h, 128), float("nan"), device=DEV).to(odt)
        w_out = torch.full((t, h), float("nan"), device=DEV)
        fn(q.to(dtype), w.to(dtype), pos, _inv_freq(), q_out, w_out, "fp8_132" if odt == torch.float8_e4m3fn else "exact")
        return q_out.double() * w_out.double()[..., None]  # what the scores see

    got = run(_op("indexer_q_prep"), torch.bfloat16, out_dtype)
    assert got.isfinite().all()
    testing.assert_close_to_ref(got, run(indexer_ref.indexer_q_prep, torch.float32, torch.float32),
                                run(indexer_ref.indexer_q_prep, torch.bfloat16, out_dtype), what="q x w")


def _indexer_case(q_dtype, pool, integer: bool, t: int = 12):
    """3 requests x 4 pages; token positions give 0 .. all visible entries; 2 padding tokens.
    Integer q and keys with power-of-two weights: every score is exact in fp32 (ties included)."""
    h, per = INDEX_HEADS, 4
    blocks = 3 * per + 1
    table = torch.randperm(blocks, device=DEV)[:3 * per].to(torch.int32).view(3, per)
    table[2, 1] = -1  # an unallocated block inside request 2's visible range holds no entry
    cache = _pool(pool, 128, blocks)
    n = blocks * BS
    keys = torch.randint(-8, 9, (n, 128), device=DEV).float() if integer else torch.randn(n, 128, device=DEV)
    quant_ref.pack_kv(keys, torch.arange(n, dtype=torch.int32, device=DEV), cache, _fmt(cache, 128))
    q = torch.randint(-8, 9, (t, h, 128), device=DEV).float() if integer else torch.randn(t, h, 128, device=DEV)
    w = torch.tensor([1.0, -0.5, 2.0, 0.25], device=DEV).repeat(t, -(-h // 4))[:, :h].contiguous()
    span = per * BS * 4  # positions covering every entry of a request (ratio 4)
    pos = torch.randint(0, span + 8, (t,), device=DEV).to(torch.int32)
    pos[:3] = _i32([0, 3, span - 1])
    req = torch.randint(0, 3, (t,), device=DEV).to(torch.int32)
    req[-2:] = -1
    return q.to(q_dtype), w, pos, req, cache, table


@pytest.mark.parametrize("k", [BS // 2, TOPK])
@pytest.mark.parametrize("q_dtype,pool", [(torch.float8_e4m3fn, FP8), (torch.bfloat16, torch.bfloat16),
                                          (torch.float32, FP8)], ids=["fp8", "bf16", "fp32-q"])
def test_indexer_topk_exact(q_dtype, pool, k):
    q, w, pos, req, cache, table = _indexer_case(q_dtype, pool, integer=True)
    got = torch.full((q.shape[0], k), 12345, dtype=torch.int32, device=DEV)
    want = torch.empty_like(got)
    _op("indexer_topk")(q, w, pos, req, cache, table, None, got, None, _workspace(q, table, k), 4, 0,
                        _fmt(cache, 128))
    indexer_ref.indexer_topk(q, w, pos, req, cache, table, None, want, None, 4, 0, _fmt(cache, 128))
    assert torch.equal(got, want)


def _workspace(q, table, k):
    return builders.topk_workspace(q.shape[0], table.shape[1] * BS, k, device=DEV)


def test_indexer_topk_selection_random():
    # Random scores: the selection may differ from the reference only among near-ties (fp32
    # summation order); every chosen entry must score within a rounding band of the k-th best,
    # and the entries come in ascending order.
    q, w, pos, req, cache, table = _indexer_case(torch.float8_e4m3fn, FP8, integer=False, t=16)
    k = 8 if ON_CPU else 64
    got = torch.empty(q.shape[0], k, dtype=torch.int32, device=DEV)
    want = torch.empty_like(got)
    _op("indexer_topk")(q, w, pos, req, cache, table, None, got, None, _workspace(q, table, k), 4, 0,
                        _fmt(cache, 128))
    indexer_ref.indexer_topk(q, w, pos, req, cache, table, None, want, None, 4, 0, _fmt(cache, 128))
    n = table.shape[1] * BS
    slots = (table.long()[:, :, None] * BS + torch.arange(BS, device=DEV)).view(3, n)
    keys = torch.empty(slots.numel(), 128, device=DEV)
    quant_ref.unpack_kv(cache, slots.flatten().to(torch.int32), keys, _fmt(cache, 128))
    scores = torch.einsum("thd,rnd->trhn", q.double(), keys.double().view(3, n, 128)).relu()
    scores = (scores * w.double()[:, None, :, None]).sum(2)  # [t, request, entry]
    band = 1e-5 * (q.double().abs().sum(-1).amax() * keys.abs().amax() * w.abs().sum(-1).amax()).item()
    for i in range(q.shape[0]):
        assert torch.equal((got[i] >= 0).sum(), (want[i] >= 0).sum()), f"token {i}: number selected"
        if req[i] < 0:
            continue
        s = scores[i, req[i]]
        by_slot = dict(zip(slots[req[i]].tolist(), s.tolist()))
        entry_of = {x: e for e, x in enumerate(slots[req[i]].tolist())}
        chosen = [by_slot[x] for x in got[i].tolist() if x >= 0]
        ref = [by_slot[x] for x in want[i].tolist() if x >= 0]
        assert len(set(got[i].tolist()) - {-1}) == len(chosen), "no duplicates"
        entries = [entry_of[x] for x in got[i].tolist() if x >= 0]
        assert entries == sorted(entries), "ascending entry order"
        if chosen:
            assert min(chosen) >= min(ref) - band


def _long_case(t: int, n: int, heads: int, k: int, seed: int = 0):
    """t tokens of one request whose pool holds n keys from {-2, 0, 2} (exact integer scores, most of
    them tied) through a shuffled block table; positions give each token n .. about n / 3 entries."""
    g = torch.Generator(device=DEV).manual_seed(seed)
    blocks = -(-n // BS)
    cache = _pool(FP8, 128, blocks)
    for s in range(0, blocks * BS, 1 << 16):
        m = min(1 << 16, blocks * BS - s)
        keys = (torch.randint(-1, 2, (m, 128), device=DEV, generator=g) * 2).float()
        quant_ref.pack_kv(keys, torch.arange(s, s + m, dtype=torch.int32, device=DEV), cache, "fp8_132")
    table = torch.randperm(blocks, device=DEV, generator=g).to(torch.int32)[None]
    q = torch.zeros(t, heads, 128, device=DEV)
    q[:, :, :3] = torch.randint(-1, 2, (t, heads, 3), device=DEV, generator=g).float()
    w = torch.randn(t, heads, device=DEV, generator=g).sign()
    w[0] = 0.0  # every score of token 0 is exactly 0: its first k entries win
    pos = (4 * torch.linspace(n, n // 3, t, device=DEV) - 1).to(torch.int32)
    req = torch.zeros(t, dtype=torch.int32, device=DEV)
    return q.to(torch.float8_e4m3fn), w, pos, req, cache, table


@pytest.mark.parametrize("t,n,k", [(1, 1 << 18, 512), (2, 1 << 18, 1024), (3, 40000, 512), (300, 3000, 512)],
                         ids=["1M-positions", "1M-positions-top1024", "chunked-merge", "one-chunk-per-token"])
def test_indexer_topk_at_serving_scale_is_exact_and_deterministic(t, n, k):
    # 262144 entries (1M positions), the chunked path with its merge, and rows shorter than k; exact
    # index sets against the reference (integer scores, so ties are exact) and bitwise identical on
    # a second run.
    if ON_CPU:
        pytest.skip("serving-scale rows")
    q, w, pos, req, cache, table = _long_case(t, n, INDEX_HEADS, k)
    got = torch.full((t, k), 12345, dtype=torch.int32, device=DEV)
    ws = _workspace(q, table, k)
    _op("indexer_topk")(q, w, pos, req, cache, table, None, got, None, ws, 4, 0, "fp8_132")
    again = torch.full_like(got, -7)
    _op("indexer_topk")(q, w, pos, req, cache, table, None, again, None, ws.fill_(0x5A5A5A5A), 4, 0, "fp8_132")
    want = torch.empty_like(got)
    indexer_ref.indexer_topk(q, w, pos, req, cache, table, None, want, None, 4, 0, "fp8_132")
    assert torch.equal(got, want)
    assert torch.equal(got, again), "run to run"
    first = torch.arange(k, device=DEV)
    assert torch.equal(got[0], table[0, first // BS] * BS + first % BS), "all-zero row: the first k entries"


# ---- sparse_attn -------------------------------------------------------------------------------
def _attn_case(heads, w_pool, c_pool, prefill: bool, entries: int):
    """Decode: tokens of separate requests at positions around the window and block boundaries;
    prefill: one request's chunk. Window ring and compressed pool filled with keys; comp_idx rows
    of distinct slots with a -1 tail; padding tokens."""
    if prefill:
        n = 20 if ON_CPU else 200
        pos, req = _steps((1, 3, n), pad=3)
    else:
        starts = [0, 5, 7, 8, 100, 5000] if ON_CPU else [0, 5, 126, 127, 128, 1000, 4095, 70000] * 2
        pos, req = _steps(*[(i, s, 1) for i, s in enumerate(starts)], pad=3)
    t, n_req = pos.shape[0], int(req.max()) + 1
    wc = builders.fill_pool(_pool(w_pool, 512, n_req * RING // BS), 512, w_pool)
    c_blocks = max(2, -(-2 * entries // BS))
    cc = builders.fill_pool(_pool(c_pool, 512, c_blocks), 512, c_pool)
    idx = torch.stack([torch.randperm(c_blocks * BS, device=DEV)[:entries] for _ in range(t)]).to(torch.int32)
    keep = torch.randint(0, entries + 1, (t, 1), device=DEV)
    idx = torch.where(torch.arange(entries, device=DEV)[None] < keep, idx, -1).to(torch.int32)
    # comp_lens: every other token lists exactly its kept prefix, the others their whole row.
    lens = torch.where(torch.arange(t, device=DEV) % 2 == 0, keep[:, 0], entries).to(torch.int32)
    q, sinks = torch.randn(t, heads, 512, device=DEV), torch.randn(heads, device=DEV)
    return q, wc, cc, pos, req, idx, lens, sinks


def _attn(fn, dtype, q, wc, cc, pos, req, idx, lens, sinks, ends=None):
    as64 = (lambda c: c if c.dtype == torch.uint8 else c.double()) if dtype == torch.float64 else (lambda c: c)
    out = torch.full(q.shape, float("nan"), dtype=dtype, device=DEV)
    w_, c_ = as64(wc), as64(cc)
    fn(q.to(dtype), w_, c_, pos, req, idx, lens, ends, sinks, out, 512**-0.5, WINDOW, RING, _fmt(w_, 512),
       _fmt(c_, 512))
    return out


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("prefill", [False, True], ids=["decode", "prefill"])
@pytest.mark.parametrize("pools", [(FP8, FP8), (torch.bfloat16, torch.bfloat16), (FP8, torch.float32)],
                         ids=["fp8", "bf16", "fp8-window-fp32-comp"])
def test_sparse_attn(pools, prefill, heads):
    case = _attn_case(heads, *pools, prefill=prefill, entries=TOPK)
    got = _attn(_op("sparse_attn"), torch.bfloat16, *case)
    req = case[4]
    assert got.isfinite().all() and (got[req < 0] == 0).all(), "every row written, padding rows zero"
    testing.assert_close_to_ref(got, _attn(sparse_attn_ref.sparse_attn, torch.float64, *case),
                                _attn(sparse_attn_ref.sparse_attn, torch.bfloat16, *case), what="attention")


@pytest.mark.parametrize("pools", [(FP8, FP8), (torch.bfloat16, torch.bfloat16)], ids=["fp8", "bf16"])
def test_sparse_attn_draft_blocks(pools):
    """A prefill chunk cut in draft blocks of 5 tokens (DSpark), each token's window ending at its
    block's last position (the chunk's last for the final, shorter block)."""
    case = _attn_case(HEADS[0], *pools, prefill=True, entries=TOPK)
    pos, req = case[3], case[4]
    live = req >= 0
    start, last = pos[live].min(), pos[live].max()
    ends = torch.where(live, torch.minimum(start + ((pos - start) // 5 + 1) * 5 - 1, last), 0).to(torch.int32)
    got = _attn(_op("sparse_attn"), torch.bfloat16, *case, ends=ends)
    assert got.isfinite().all() and (got[req < 0] == 0).all(), "every row written, padding rows zero"
    testing.assert_close_to_ref(got, _attn(sparse_attn_ref.sparse_attn, torch.float64, *case, ends=ends),
                                _attn(sparse_attn_ref.sparse_attn, torch.bfloat16, *case, ends=ends),
                                what="block-causal attention")


def test_sparse_attn_hca_long_index_and_fp32():
    # HCA-like key lists (many entries, mostly -1) and fp32 activations over fp32 pools.
    case = _attn_case(HEADS[0], torch.float32, torch.float32, prefill=False, entries=4 * TOPK)
    got = _attn(_op("sparse_attn"), torch.float32, *case)
    want = _attn(sparse_attn_ref.sparse_attn, torch.float64, *case)
    torch.testing.assert_close(got.double(), want, rtol=2e-5, atol=2e-5)


# ---- visible_entries ---------------------------------------------------------------------------
@pytest.mark.parametrize("context", [4096, 65536, 1 << 20])
def test_visible_entries(context):
    # V4-Flash HCA key lists (ratio 128, 64-entry blocks; CPU debug: 4-entry blocks) of 128 tokens as
    # wide as `context` allows (GPU: one block of 64 entries, 512 and 8192 entries, so 1, 1 and 8
    # column programs a token), a quarter of the blocks unallocated, every fifth token padding, and
    # three tokens out of range (a request past the table, one below -1, a negative position); out
    # poisoned.
    from test_visible_entries import expected_entries, random_case

    blocks = max(1, context // 128 // BS)
    args = random_case(128, BS, blocks, requests=64, tokens=128, device=DEV)
    args["req_slots"][1], args["req_slots"][2], args["positions"][3] = 64, -2, -5
    _op("visible_entries")(*args.values())
    cpu = {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    want = expected_entries(cpu["block_table"], cpu["positions"], cpu["req_slots"], 128, BS)
    assert torch.equal(cpu["out"], want)


# ---- inv_rope ----------------------------------------------------------------------------------
@pytest.mark.parametrize("heads", HEADS)
def test_inv_rope(heads):
    o, pos = torch.randn(7, heads, 512, device=DEV), _i32([0, 1, 127, 128, 5000, 70000, 1 << 20])

    def run(fn, dtype):
        out = torch.full((7, heads, 512), float("nan"), dtype=dtype, device=DEV)
        fn(o.to(dtype), pos, _inv_freq(), out)
        return out

    got = run(_op("inv_rope"), torch.bfloat16)
    testing.assert_close_to_ref(got, run(inv_rope_ref.inv_rope, torch.float64), run(inv_rope_ref.inv_rope, torch.bfloat16))
    assert torch.equal(got[..., :448], o[..., :448].bfloat16())


# ---- opcheck with CUDA tensors -----------------------------------------------------------------
def _op_args(name: str, fp8: bool = True) -> tuple:
    h, pos, req = HEADS[0], *_steps((0, 3, 3), (1, 0, 2), pad=1)
    t = pos.shape[0]
    win = builders.fill_pool(_pool(FP8, 512, 2 * RING // BS), 512, FP8)
    if name == "pack_kv":
        return (torch.randn(t, 512, device=DEV), torch.arange(t, dtype=torch.int32, device=DEV), _pool(FP8, 512, 1),
                "fp8_584")
    if name == "unpack_kv":
        return win, torch.arange(t, dtype=torch.int32, device=DEV), torch.empty(t, 512, device=DEV), "fp8_584"
    if name == "qkv_prep":
        return (torch.randn(t, h, 512, device=DEV), torch.randn(t, 512, device=DEV), pos, req, _inv_freq(),
                torch.empty(t, h, 512, device=DEV), win, RING, 1e-6, True, "fp8_584")
    if name == "compressor_update":
        entry = torch.where((req >= 0) & ((pos + 1) % 4 == 0), req * 4 + pos // 4, -1).to(torch.int32)
        return (torch.randn(t, 1024, device=DEV), torch.randn(t, 1024, device=DEV), torch.randn(4, 1024, device=DEV),
                pos, req, entry, torch.ones(512, device=DEV), _inv_freq(), torch.randn(2, 8, 2048, device=DEV),
                _pool(FP8, 512, 2), None, 1e-6, "fp8_584")
    if name == "indexer_q_prep":
        return (torch.randn(t, INDEX_HEADS, 128, device=DEV), torch.randn(t, INDEX_HEADS, device=DEV), pos,
                _inv_freq(), torch.empty(t, INDEX_HEADS, 128, device=DEV,
                                         dtype=torch.float8_e4m3fn if fp8 else torch.float32),
                torch.empty(t, INDEX_HEADS, device=DEV), "fp8_132" if fp8 else "exact")
    if name == "indexer_topk":
        q, w, pos, req, cache, table = _indexer_case(*((torch.float8_e4m3fn, FP8) if fp8 else
                                                       (torch.bfloat16, torch.bfloat16)), integer=False)
        return (q, w, pos, req, cache, table, None, torch.empty(q.shape[0], 8, dtype=torch.int32, device=DEV), None,
                _workspace(q, table, 8), 4, 0, _fmt(cache, 128))
    if name == "sparse_attn":
        q, wc, cc, pos, req, idx, lens, sinks = _attn_case(h, FP8, FP8, prefill=False, entries=16)
        return (q, wc, cc, pos, req, idx, lens, None, sinks, torch.empty_like(q), 512**-0.5, WINDOW, RING, "fp8_584",
                "fp8_584")
    if name == "inv_rope":
        return torch.randn(t, h, 512, device=DEV), pos, _inv_freq(), torch.empty(t, h, 512, device=DEV)
    if name == "visible_entries":
        table = torch.arange(2 * 3, dtype=torch.int32, device=DEV).view(2, 3)
        return table, pos, req, torch.empty(t, 3 * BS, dtype=torch.int32, device=DEV), 2, BS
    if name == "indexer_k_prep":
        entry = torch.where((req >= 0) & ((pos + 1) % 2 == 0), req * 4 + pos // 2, -1).to(torch.int32)
        return (torch.randn(t, 512, device=DEV), pos, req, entry, torch.randn(128, 512, device=DEV) / 512**0.5,
                torch.ones(128, device=DEV), _inv_freq(), _pool("mxfp4_68", 128, 2, 7), 2, 1e-6, "mxfp4_68")
    if name == "fp8_linear":
        weight, scale = builders.block_fp8_weight(512, 4096, 128)
        return (torch.randn(t, 4096, device=DEV, dtype=torch.bfloat16), weight.to(DEV), scale.view(torch.uint8).to(DEV),
                torch.empty(t, 512, device=DEV, dtype=torch.bfloat16), 128)
    if name == "fp8_linear_w8a8":
        weight, scale = builders.block_fp8_weight(512, 4096, 128)
        return (torch.randn(t, 4096, device=DEV, dtype=torch.bfloat16), weight.to(DEV), scale.float().to(DEV),
                torch.empty(t, 512, device=DEV, dtype=torch.bfloat16), 128)
    if name == "attn_merge":
        args = builders.attn_merge_args(shards=2, tokens=t, heads=h, dim=512)
        return tuple(args[k].to(DEV) for k in ("partials", "lse", "sinks", "out"))
    raise KeyError(name)


@pytest.mark.skipif(ON_CPU, reason="opcheck dispatches CPU tensors to the reference kernel")
@pytest.mark.parametrize("name", sorted(dsv4ops.backends.TRITON_LAUNCHERS))
def test_opcheck_cuda(name):
    op = getattr(torch.ops.dsv4, name).default
    if name in ("indexer_q_prep", "indexer_topk"):
        # torch's schema check compares tensors with allclose, which has no float8 kernel: the full
        # opcheck runs on the 16/32-bit variant, the FP8 variant skips only test_schema.
        torch.library.opcheck(op, _op_args(name, fp8=False))
        utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
        torch.library.opcheck(op, _op_args(name), test_utils=utils)
    elif name in ("fp8_linear", "fp8_linear_w8a8"):  # an e4m3 weight: only test_schema's allclose cannot run
        utils = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
        torch.library.opcheck(op, _op_args(name), test_utils=utils)
    else:
        torch.library.opcheck(op, _op_args(name))


@pytest.mark.skipif(ON_CPU, reason="dispatch to CUDA kernels needs CUDA tensors")
def test_cuda_dispatch_reaches_triton_and_the_reference_stays_reachable():
    args = _op_args("sparse_attn")
    torch.ops.dsv4.sparse_attn(*args)
    got = args[9].clone()
    assert "triton" in sys.modules and dsv4ops.backends.resolve.cache_info().currsize > 0
    with dsv4ops.ops.sparse_attn.set_kernel_enabled("cuda", False):
        torch.ops.dsv4.sparse_attn(*args)
    ref = args[9].clone()
    sparse_attn_ref.sparse_attn(*args)
    assert torch.equal(ref, args[9]), "with the CUDA kernel disabled the op runs the reference"
    assert got.isfinite().all()


# ---- whole layers ------------------------------------------------------------------------------
LAYER_CFG = dsv4ops.DSV4AttentionConfig.tiny(index_topk=128)  # >= entries: a tie-free CSA selection
LAYERS = {SLIDING: 0, CSA: 1, HCA: 2}


@pytest.mark.skipif(ON_CPU, reason="the layer dispatches CPU tensors to the reference kernels")
@pytest.mark.parametrize("mode", ["fp8", "exact"])
@pytest.mark.parametrize("kind", [SLIDING, CSA, HCA])
def test_layer_against_fp64_oracle(kind, mode):
    li = LAYERS[kind]
    fmts = dsv4ops.CacheFormats.v4() if mode == "fp8" else dsv4ops.CacheFormats.exact()
    layer = testing.randomize_(dsv4ops.DeepseekV4Attention(LAYER_CFG, li, formats=fmts), seed=li)
    numerics = layer.numerics
    layer = layer.to("cuda", torch.bfloat16)
    x = torch.randn(2, 301, LAYER_CFG.hidden_size, device="cuda").to(torch.bfloat16)  # crosses 127, 255, 3 mod 4
    with torch.no_grad():
        y = layer(x)
        params = dict(layer.named_parameters())
        y64 = reference.attention({k: v.double() for k, v in params.items()}, LAYER_CFG, li, x.double(), numerics)
        lowp = reference.attention(params, LAYER_CFG, li, x, numerics)
    err, budget = testing.assert_close_to_ref(y, y64, lowp, what=f"{kind} {mode} layer")
    print(f"layer {kind} {mode}: max|cuda - ref64| {err:.3e}, max|ref_bf16 - ref64| {budget:.3e}")


# ---- int64 addressing --------------------------------------------------------------------------
@pytest.mark.skipif(ON_CPU, reason="a 2 GiB pool")
def test_pool_over_2gib_written_and_read_at_its_far_end():
    bs = 64
    blocks = (2**31) // quant_ref.main_block_bytes(bs) + 8
    pool = torch.full((blocks, quant_ref.main_block_bytes(bs)), 255, dtype=torch.uint8, device="cuda")
    f = "fp8_584"
    assert pool.numel() > 2**31
    last = blocks * bs - 1
    slots = _i32([last, last - 70, 3, -1])
    x = torch.randn(4, 512, device="cuda")
    torch.ops.dsv4.pack_kv(x, slots, pool, f)
    got = torch.full((4, 512), float("nan"), device="cuda")
    torch.ops.dsv4.unpack_kv(pool, slots, got, f)
    want = _fp8_rows(x[:3])  # the same rows through a small pool, reference packer and unpacker
    assert torch.equal(got[:3].double(), want) and (got[3] == 0).all()
    ref_read = torch.empty(3, 512, device="cuda")
    quant_ref.unpack_kv(pool, slots[:3], ref_read, f)
    assert torch.equal(ref_read.double(), want)
    # qkv_prep into a window ring at the end of the pool, then attention reading it back.
    ring = 256
    req_slot = blocks * bs // ring - 1
    pos, req = _i32([0, 1, 2]), _i32([req_slot] * 3)
    q, kv = torch.randn(3, 64, 512, device="cuda").bfloat16(), torch.randn(3, 512, device="cuda").bfloat16()
    q_out = torch.empty_like(q)
    torch.ops.dsv4.qkv_prep(q, kv, pos, req, _inv_freq(), q_out, pool, ring, 1e-6, True, f)
    kv_rows = torch.empty(3, 512, device="cuda")
    quant_ref.unpack_kv(pool, (req * ring + pos).to(torch.int32), kv_rows, f)
    assert kv_rows.isfinite().all() and torch.equal(kv_rows[:, :448].double(), _fp8_rows(kv.float())[:, :448])
    o, o_ref = torch.empty_like(q), torch.empty_like(q)
    idx = torch.full((3, 1), -1, dtype=torch.int32, device="cuda")
    sinks, lens = torch.zeros(64, device="cuda"), _i32([1, 1, 1])
    torch.ops.dsv4.sparse_attn(q_out, pool, pool, pos, req, idx, lens, None, sinks, o, 512**-0.5, 128, ring, f, f)
    sparse_attn_ref.sparse_attn(q_out, pool, pool, pos, req, idx, lens, None, sinks, o_ref, 512**-0.5, 128, ring, f,
                                f)
    o64 = torch.empty(q.shape, dtype=torch.float64, device="cuda")
    sparse_attn_ref.sparse_attn(q_out.double(), pool, pool, pos, req, idx, lens, None, sinks, o64, 512**-0.5, 128,
                                ring, f, f)
    testing.assert_close_to_ref(o, o64, o_ref, what="attention over the far end")


def _fp8_rows(x: torch.Tensor) -> torch.Tensor:
    """x through the 584-B entry format (the reference packer and unpacker), float64."""
    pool = builders.page_pool(1, x.shape[0], 512, FP8, device=x.device)
    slots = torch.arange(x.shape[0], dtype=torch.int32, device=x.device)
    quant_ref.pack_kv(x, slots, pool, "fp8_584")
    out = torch.empty_like(x, dtype=torch.float32)
    quant_ref.unpack_kv(pool, slots, out, "fp8_584")
    return out.double()


# ---- CUDA graphs after warmup ------------------------------------------------------------------
def _compiled_kernels() -> dict[str, set[str]]:
    from dsv4ops.compressor import triton as c
    from dsv4ops.indexer import triton as i
    from dsv4ops.indexer import triton_prep as ip
    from dsv4ops.qkv_prep import triton as k
    from dsv4ops.inv_rope import triton as o
    from dsv4ops.quant import triton as q
    from dsv4ops.sparse_attn import triton as s
    from dsv4ops.visible_entries import triton as v

    kernels = [k._qkv_prep_kernel, c._compress_kernel, c._save_kernel, ip._q_prep_kernel, i._score_kernel,
               i._select_kernel, i._merge_kernel, v._visible_entries_kernel, s._sparse_attn_kernel,
               s._combine_kernel, o._inv_rope_kernel, q._pack_kernel, q._unpack_kernel]
    return {fn.__name__: {str(key) for cache in fn.device_caches.values() for key in cache[0]} for fn in kernels}


@pytest.mark.skipif(ON_CPU, reason="CUDA graphs")
@pytest.mark.parametrize("mode", ["fp8", "exact"])
def test_layers_capture_in_cuda_graphs_after_warmup(mode):
    cfg = dsv4ops.DSV4AttentionConfig.tiny()
    fmts = dsv4ops.CacheFormats.v4() if mode == "fp8" else dsv4ops.CacheFormats.exact()
    cache_cfg = CacheConfig(formats=fmts, exact_dtype=torch.bfloat16, max_requests=4, max_context=512,
                            max_step_tokens=64)
    calls = dsv4ops.warmup(cfg, cache_cfg, "cuda", torch.bfloat16)
    assert calls > 0
    compiled = _compiled_kernels()
    manager = KVCacheManager(cfg, cache_cfg, device="cuda")
    layers = [testing.randomize_(dsv4ops.DeepseekV4Attention(cfg, li, formats=fmts), seed=li)
              for li in (0, 1, 2)]
    layers = [layer.to("cuda", torch.bfloat16) for layer in layers]
    for layer in layers:
        layer.attach_cache(manager)
    for r in range(3):
        manager.admit(r)
    with torch.no_grad():
        for new in ({0: 40, 1: 9, 2: 3}, {0: 1, 1: 1, 2: 1}):  # a prefill step, then a decode step
            if manager.open_step is not None:
                manager.commit(manager.open_step)
            step = manager.prepare_step(new)
            x = torch.randn(step.positions.shape[0], cfg.hidden_size, device="cuda").bfloat16()
            eager = [layer(x, step) for layer in layers]
        after = _compiled_kernels()
        new = {name: keys - compiled[name] for name, keys in after.items() if keys - compiled[name]}
        assert not new, f"compiled after warmup (kernel: specializations): {new}"
        # The decode step once more, captured: no host sync, no compile inside the capture.
        graph = torch.cuda.CUDAGraph()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            with torch.cuda.graph(graph, stream=stream):
                captured = [layer(x, step) for layer in layers]
        torch.cuda.current_stream().wait_stream(stream)
        graph.replay()
        torch.cuda.synchronize()
    for a, b in zip(captured, eager):
        assert torch.equal(a, b), "replay == eager (same inputs, same cache state)"
