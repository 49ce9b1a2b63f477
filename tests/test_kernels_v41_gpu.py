"""GPU tier 1 for V4.1: each V4.1 path of the Triton kernels against the reference kernel on the
same CUDA inputs, at V4.1-Flash dims (64 heads x 512, window 128, 32 index heads x 128 with MX4
queries and keys, top-512, a candidate pool of 2048 blocks x 8): the 528 / 288 / 68-B codecs bit
for bit, the query and key writers, the compressors with their latent, the candidate source and
the pool-restricted reindex selection (bit for bit on exact scores), sparse attention over fp8_528
window rows and fp4_288 compressed rows. Issue 13.

Tolerances as tests/test_kernels_gpu.py: bit-exact where the math is exact, elsewhere
max|kernel - ref64| <= 2 x max|ref_lowp - ref64| (dsv4ops.testing.assert_close_to_ref).
"""

import builders
import pytest
import torch

from dsv4ops import testing
from dsv4ops.compressor import reference as compressor_ref
from dsv4ops.indexer import reference as indexer_ref
from dsv4ops.qkv_prep import reference as qkv_prep_ref
from dsv4ops.quant import formats
from dsv4ops.quant import reference as quant_ref
from dsv4ops.sparse_attn import reference as sparse_attn_ref

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
DEV = "cuda"
HEADS, INDEX_HEADS, WINDOW, RING, TOPK = 64, 32, 128, 256, 512
CB, KEEP = 8, 2048  # candidate block size, pool blocks
E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _op(name):
    return getattr(torch.ops.dsv4, name)


def _i32(values) -> torch.Tensor:
    return torch.as_tensor(values, dtype=torch.int32, device=DEV)


def _inv_freq() -> torch.Tensor:
    return builders.rope_table(64).to(DEV)


def _rows(pool, dim, fmt) -> torch.Tensor:
    n = pool.shape[0] * formats.block_size(pool.shape, fmt)
    out = torch.empty(n, dim, dtype=torch.float32, device=DEV)
    quant_ref.unpack_kv(pool, torch.arange(n, dtype=torch.int32, device=DEV), out, fmt)
    return out.double()


def _steps(*runs, pad=0):
    pos = [p for _, s, n in runs for p in range(s, s + n)] + torch.randint(0, 5000, (pad,)).tolist()
    req = [r for r, _, n in runs for _ in range(n)] + [-1] * pad
    return _i32(pos), _i32(req)


# ---- codecs ------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt,bs", [("fp8_528", 64), ("fp4_288", 64), ("mxfp4_68", 128)])
def test_pack_unpack_bit_exact(fmt, bs):
    dim = formats.FORMATS[fmt].dim
    n = 3000
    x = (torch.randn(n, dim, device=DEV) * torch.logspace(-4, 4, n, device=DEV)[:, None]).bfloat16()
    x[0], x[1, :40] = 0, 3000.0  # the amax floors; fp4_288's NaN scale code
    slots = torch.randperm(n + 100, device=DEV)[:n].to(torch.int32)
    slots[5] = -1
    blocks = -(-(n + 100) // bs)
    got, want = builders.page_pool(blocks, bs, dim, fmt, DEV), builders.page_pool(blocks, bs, dim, fmt, DEV)
    _op("pack_kv")(x, slots, got, fmt)
    quant_ref.pack_kv(x, slots, want, fmt)
    assert torch.equal(got, want)
    out, expect = torch.full((n, dim), 7.0, device=DEV), torch.empty(n, dim, device=DEV)
    _op("unpack_kv")(want, slots, out, fmt)
    quant_ref.unpack_kv(want, slots, expect, fmt)
    nan = expect.isnan()
    assert torch.equal(out.isnan(), nan) and torch.equal(out[~nan], expect[~nan])


# ---- writers -----------------------------------------------------------------------------------
def test_qkv_prep_fp8_528_without_q_norm():
    pos, req = _steps((0, 120, 40), (1, 5, 1), (2, 70000, 1), pad=3)
    t = pos.shape[0]
    q, kv = torch.randn(t, HEADS, 512, device=DEV), torch.randn(t, 512, device=DEV)

    def run(fn, dtype, kind):
        fmt = builders.format_name(kind, 512)
        cache = builders.page_pool(3 * RING // 64, 64, 512, kind, DEV)
        q_out = torch.full((t, HEADS, 512), float("nan"), dtype=dtype, device=DEV)
        fn(q.to(dtype), kv.to(dtype), pos, req, _inv_freq(), q_out, cache, RING, 1e-6, False, fmt)
        return q_out, _rows(cache, 512, fmt)

    q_k, rows_k = run(_op("qkv_prep"), torch.bfloat16, "fp8_528")
    q_r, rows_r = run(qkv_prep_ref.qkv_prep, torch.bfloat16, "fp8_528")
    q_64, rows_64 = run(qkv_prep_ref.qkv_prep, torch.float64, torch.float64)
    testing.assert_close_to_ref(q_k, q_64, q_r, what="q_out")
    written = ~rows_64.isnan().any(1)
    assert torch.equal(written, ~rows_k.isnan().any(1)), "slots written"
    testing.assert_close_to_ref(rows_k[written], rows_64[written], rows_r[written], what="window rows")


@pytest.mark.parametrize("ratio", [2, 1])
def test_compressor_v41_with_latent(ratio):
    # Three steps: prefill chunks of three requests, decode, a chunk; padding tokens.
    steps = [[(0, 0, 37), (1, 0, 8), (2, 0, 1)], [(0, 37, 1), (1, 8, 1), (2, 1, 1)], [(1, 9, 50)]]
    adt = torch.float32 if ratio == 2 else torch.bfloat16
    ape, w = torch.randn(ratio, 512, device=DEV), 1 + 0.1 * torch.randn(512, device=DEV)
    runs = {name: (torch.full((3, ratio, 1024), float("nan"), device=DEV), builders.page_pool(64, 64, 512, kind, DEV))
            for name, kind in (("kernel", "fp4_288"), ("ref", "fp4_288"), ("ref64", torch.float32))}
    for step in steps:
        pos, req = _steps(*step, pad=2)
        t = pos.shape[0]
        entry = torch.where((req >= 0) & ((pos + 1) % ratio == 0), req * 1024 + pos // ratio, -1).to(torch.int32)
        kv = torch.randn(t, 512, device=DEV).to(adt)
        score = torch.randn(t, 512, device=DEV).to(adt) if ratio > 1 else kv.new_zeros(1, 512).expand_as(kv)
        lat = {}
        for name, (state, cache) in runs.items():
            fn = _op("compressor_update") if name == "kernel" else compressor_ref.compressor_update
            fmt = "exact" if name == "ref64" else "fp4_288"
            lat[name] = torch.full((t, 512), float("nan"), device=DEV,
                                   dtype=torch.float32 if name == "ref64" else torch.bfloat16)
            fn(kv, score, ape, pos, req, entry, w, _inv_freq(), state, cache, lat[name], 1e-6, fmt)
        assert torch.equal(runs["kernel"][0].nan_to_num(7), runs["ref"][0].nan_to_num(7)), "state rows"
        testing.assert_close_to_ref(lat["kernel"], lat["ref64"], lat["ref"], what="latent")
    got, lowp = _rows(runs["kernel"][1], 512, "fp4_288"), _rows(runs["ref"][1], 512, "fp4_288")
    ref = _rows(runs["ref64"][1], 512, "exact")
    written = ~ref.isnan().any(1)
    assert torch.equal(written, ~got.isnan().any(1)), "entries written"
    testing.assert_close_to_ref(got[written], ref[written], lowp[written], what="compressed entries")


def test_indexer_k_prep_and_q_prep_mx4():
    pos, req = _steps((0, 0, 300), (1, 1000, 1), pad=2)
    t = pos.shape[0]
    latent = torch.randn(t, 512, device=DEV)
    entry = torch.where((req >= 0) & ((pos + 1) % 2 == 0), req * 2048 + pos // 2, -1).to(torch.int32)
    wk, kw = torch.randn(128, 512, device=DEV) / 512**0.5, 1 + 0.1 * torch.randn(128, device=DEV)

    def keys(fn, dtype, kind):
        fmt = builders.format_name(kind, 128)
        cache = builders.page_pool(40, 128, 128, kind, DEV)
        fn(latent.to(dtype), pos, req, entry, wk, kw, _inv_freq(), cache, 2, 1e-6, fmt)
        return _rows(cache, 128, fmt)

    got = keys(_op("indexer_k_prep"), torch.bfloat16, "mxfp4_68")
    lowp = keys(indexer_ref.indexer_k_prep, torch.bfloat16, "mxfp4_68")
    ref = keys(indexer_ref.indexer_k_prep, torch.float64, torch.float64)
    written = ref.isfinite().all(1)  # unwritten: NaN (float) or -inf (0xFF MX4 bytes)
    assert torch.equal(written, got.isfinite().all(1)), "entries written"
    testing.assert_close_to_ref(got[written], ref[written], lowp[written], what="index keys")

    q, w = 3 * torch.randn(t, INDEX_HEADS, 128, device=DEV), torch.randn(t, INDEX_HEADS, device=DEV)

    def query(fn, dtype, fmt):
        odt, width = (torch.uint8, 68) if fmt == "mxfp4_68" else (torch.float32, 128)
        q_out, w_out = torch.empty(t, INDEX_HEADS, width, dtype=odt, device=DEV), torch.empty(t, INDEX_HEADS, device=DEV)
        fn(q.to(dtype), w.to(dtype), pos, _inv_freq(), q_out, w_out, fmt)
        return indexer_ref.query_values(q_out).double() * w_out.double()[..., None]

    testing.assert_close_to_ref(query(_op("indexer_q_prep"), torch.bfloat16, "mxfp4_68"),
                                query(indexer_ref.indexer_q_prep, torch.float32, "exact"),
                                query(indexer_ref.indexer_q_prep, torch.bfloat16, "mxfp4_68"), what="q x w")


# ---- candidate source and reindex selection ----------------------------------------------------
def _grid(*shape, g):
    v = E2M1_GRID[torch.randint(0, 8, shape, generator=g)]
    return torch.where(torch.rand(shape, generator=g) < 0.5, -v, v)


@pytest.mark.parametrize("n", [3000, 40000], ids=["one-chunk-blocks", "chunked-blocks-merged"])
def test_candidate_source_and_reindex_are_exact(n):
    # Keys and queries on the e2m1 grid, power-of-two weights: exact fp32 scores with many ties, so
    # the kernel's top-k, candidate pool (ascending, newest block forced) and the reindex layer's
    # top-k inside the pool equal the reference's, tie-breaks included. 40000 entries: 5000 blocks,
    # above the 2048-block pool (the block selection runs in chunks and merges).
    g = torch.Generator().manual_seed(n)
    bs = 128
    pages = -(-n // bs)
    cache = builders.page_pool(pages, bs, 128, "mxfp4_68", DEV)
    quant_ref.pack_kv(_grid(pages * bs, 128, g=g).to(DEV), torch.arange(pages * bs, dtype=torch.int32, device=DEV),
                      cache, "mxfp4_68")
    table = torch.randperm(pages, generator=g).int().view(1, -1).to(DEV)
    t = 6
    pos = _i32([n - 1, n // 2, 17, 2 * n // 3, 0, 5])
    req = _i32([0, 0, 0, 0, 0, -1])
    w = torch.tensor([1.0, -0.5, 2.0, 0.25] * (INDEX_HEADS // 4), device=DEV).repeat(t, 1)
    q = builders.mx4_query(_grid(t, INDEX_HEADS, 128, g=g)).to(DEV)
    out = {}
    for name, fn in (("kernel", _op("indexer_topk")), ("ref", indexer_ref.indexer_topk)):
        idx = torch.full((t, TOPK), 99, dtype=torch.int32, device=DEV)
        cand = torch.full((t, KEEP), 99, dtype=torch.int32, device=DEV)
        args = (q, w, pos, req, cache, table, None, idx, cand)
        if name == "kernel":
            args += (builders.topk_workspace(t, pages * bs, TOPK, DEV, keep=KEEP, cand_block=CB),)
        fn(*args, 1, CB, "mxfp4_68")
        out[name] = idx, cand
    assert torch.equal(out["kernel"][1], out["ref"][1]), "candidate pool"
    assert torch.equal(out["kernel"][0], out["ref"][0]), "source top-k"
    cand = out["ref"][1]
    q2 = builders.mx4_query(_grid(t, INDEX_HEADS, 128, g=g)).to(DEV)
    got = torch.full((t, TOPK), 99, dtype=torch.int32, device=DEV)
    want = torch.empty_like(got)
    _op("indexer_topk")(q2, w, pos, req, cache, table, cand, got, None,
                        builders.topk_workspace(t, pages * bs, TOPK, DEV, cand_cols=KEEP * CB), 1, CB, "mxfp4_68")
    indexer_ref.indexer_topk(q2, w, pos, req, cache, table, cand, want, None, 1, CB, "mxfp4_68")
    assert torch.equal(got, want), "reindex top-k"


# ---- sparse_attn -------------------------------------------------------------------------------
@pytest.mark.parametrize("prefill", [False, True], ids=["decode", "prefill"])
def test_sparse_attn_fp8_528_window_fp4_288_entries(prefill):
    if prefill:
        pos, req = _steps((1, 3, 200), pad=3)
    else:
        pos, req = _steps(*[(i, s, 1) for i, s in enumerate([0, 5, 126, 127, 128, 1000, 4095, 70000] * 2)], pad=3)
    t, n_req = pos.shape[0], int(req.max()) + 1
    wc = builders.fill_pool(builders.page_pool(n_req * RING // 64, 64, 512, "fp8_528", DEV), 512, "fp8_528")
    cc = builders.fill_pool(builders.page_pool(32, 64, 512, "fp4_288", DEV), 512, "fp4_288")
    idx = torch.stack([torch.randperm(32 * 64, device=DEV)[:TOPK] for _ in range(t)]).to(torch.int32)
    keep = torch.randint(0, TOPK + 1, (t, 1), device=DEV)
    idx = torch.where(torch.arange(TOPK, device=DEV)[None] < keep, idx, -1).to(torch.int32)
    lens = torch.where(torch.arange(t, device=DEV) % 2 == 0, keep[:, 0], TOPK).to(torch.int32)
    q, sinks = torch.randn(t, HEADS, 512, device=DEV), torch.randn(HEADS, device=DEV)

    def run(fn, dtype):
        out = torch.full(q.shape, float("nan"), dtype=dtype, device=DEV)
        fn(q.to(dtype), wc, cc, pos, req, idx, lens, None, sinks, out, 512**-0.5, WINDOW, RING, "fp8_528", "fp4_288")
        return out

    got = run(_op("sparse_attn"), torch.bfloat16)
    assert got.isfinite().all() and (got[req < 0] == 0).all(), "every row written, padding rows zero"
    testing.assert_close_to_ref(got, run(sparse_attn_ref.sparse_attn, torch.float64),
                                run(sparse_attn_ref.sparse_attn, torch.bfloat16), what="attention")
