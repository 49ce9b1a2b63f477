"""The Triton kernels of the attention ops on CPU: numerics under TRITON_INTERPRET=1 (conftest sets it
when there is no GPU) against the reference kernels, launched directly (the op would dispatch CPU
tensors to the reference); an ahead-of-time compile of every launch variant for sm_90 and sm_100 (in
a subprocess without the interpreter); and the arch table. Issue 5.

Shapes are tiny because the interpreter runs programs one at a time in numpy: a few tokens, 2-3
heads (the kernels pad heads to a tl.dot tile), window 8 instead of 128 where the op allows it; the
512-d head, 64 rope dims and 128-d indexer rows are the V4 layout the kernels require.
Tolerances: bit-exact where the math is exact (FP8 packing, state rows, integer-valued indexer
scores); elsewhere the error of the kernel against a high-precision run of the reference must stay
within 2x the error of the reference's own low-precision run (dsv4ops.testing.assert_close_to_ref).
"""

import inspect
import os
import subprocess
import sys

import builders
import pytest
import torch

import dsv4ops
from dsv4ops import _arch, testing
from dsv4ops.attn_merge import reference as attn_merge_ref
from dsv4ops.compressor import reference as compressor_ref
from dsv4ops.fp8_linear import reference as fp8_linear_ref
from dsv4ops.indexer import reference as indexer_ref
from dsv4ops.qkv_prep import reference as qkv_prep_ref
from dsv4ops.inv_rope import reference as inv_rope_ref
from dsv4ops.quant import formats
from dsv4ops.quant import reference as quant_ref
from dsv4ops.sparse_attn import reference as sparse_attn_ref

AOT_PROCESS = os.environ.get("DSV4OPS_TRITON_AOT") == "1"  # the compile-only subprocess below
if not AOT_PROCESS and not torch.cuda.is_available():
    assert os.environ.get("TRITON_INTERPRET") == "1", "conftest.py sets TRITON_INTERPRET=1 before collection"

triton = pytest.importorskip("triton")
tl = triton.language

from dsv4ops import triton_helpers as th  # noqa: E402
from dsv4ops.attn_merge import triton as attn_merge_tt  # noqa: E402
from dsv4ops.compressor import triton as compressor_tt  # noqa: E402
from dsv4ops.fp8_linear import triton as fp8_linear_tt  # noqa: E402
from dsv4ops.fp8_linear import triton_w8a8 as w8a8_tt  # noqa: E402
from dsv4ops.indexer import triton as indexer_tt  # noqa: E402
from dsv4ops.inv_rope import triton as inv_rope_tt  # noqa: E402
from dsv4ops.qkv_prep import triton as qkv_prep_tt  # noqa: E402
from dsv4ops.quant import triton as quant_tt  # noqa: E402
from dsv4ops.sparse_attn import triton as sparse_attn_tt  # noqa: E402
from dsv4ops.visible_entries import triton as visible_entries_tt  # noqa: E402

CFG = dsv4ops.DSV4AttentionConfig.tiny()
INV_FREQ = CFG.inv_freq(1)  # the YaRN / 160000 table of a compressed layer
BS = 4  # entries per page: small, so slots cross pages


def _pool(fmt, dim: int, blocks: int, bs: int = BS) -> torch.Tensor:
    """A page pool poisoned like LayerCache: FP8 bytes 0xFF (NaN), float rows NaN."""
    return builders.page_pool(blocks, bs, dim, fmt)


def _fmt(pool: torch.Tensor, dim: int) -> str:
    """The V4 format of a pool: fp8_584 / fp8_132 by width for uint8 pools, exact otherwise."""
    return builders.format_name("fp8" if pool.dtype == torch.uint8 else pool.dtype, dim)


def _rows(pool: torch.Tensor, dim: int, dtype=torch.float64, fmt: str | None = None) -> torch.Tensor:
    """Every entry of a pool of format `fmt` (default: the V4 format of its dtype and width),
    dequantized (unwritten byte entries read as NaN)."""
    fmt = fmt or _fmt(pool, dim)
    n = pool.shape[0] * formats.block_size(pool.shape, fmt)
    out = torch.empty(n, dim, dtype=torch.float32)
    quant_ref.unpack_kv(pool, torch.arange(n, dtype=torch.int32), out, fmt)
    return out.to(dtype)


def _i32(*values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)


# ---- pack_kv / unpack_kv: bit-exact ------------------------------------------------------------
@pytest.mark.parametrize("dim", [512, 128])
@pytest.mark.parametrize("pool", ["fp8", torch.bfloat16, torch.float32], ids=["fp8", "bf16", "fp32"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_pack_unpack_bit_exact(dim, pool, dtype):
    # Rows spanning 6 decades, a zero block (amax floor), an exact power-of-two amax (the frexp
    # edge), signed zeros and a padding slot (-1).
    x = (torch.randn(7, dim) * torch.logspace(-3, 3, 7)[:, None]).to(dtype)
    x[0, :64] = 0
    x[1, 5] = 448 * 2.0**-3
    x[2] = -0.0
    slots = _i32(0, 11, -1, 5, 3, 2, 7)
    got, want = _pool(pool, dim, 4), _pool(pool, dim, 4)
    out, expect = _pack_unpack_both(x, slots, got, want, _fmt(got, dim))
    assert builders.bytes_equal(out, expect)


def _pack_unpack_both(x, slots, got, want, fmt):
    """Pack x at slots with the kernel into `got` and with the reference into `want` (the bytes must
    be equal), then unpack `want` both ways: (kernel rows, poisoned first; reference rows)."""
    quant_tt.pack_kv(x, slots, got, fmt)
    quant_ref.pack_kv(x, slots, want, fmt)
    assert builders.bytes_equal(got, want)
    out, expect = torch.full(x.shape, 7.0, dtype=x.dtype), torch.empty_like(x)
    quant_tt.unpack_kv(want, slots, out, fmt)
    quant_ref.unpack_kv(want, slots, expect, fmt)
    return out, expect


V41_BS = {"fp8_528": 4, "fp4_288": 4, "mxfp4_68": 7}  # mxfp4_68 pages (512-B aligned) need 7 or 128 rows


@pytest.mark.parametrize("fmt", sorted(V41_BS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_pack_unpack_v41_formats_bit_exact(fmt, dtype):
    # Rows over 8 decades; a zero row (the amax floors); a row past fp4_288's scale range (amax / 6
    # > 464: the NaN scale code); e2m1 tie points (0.25, 0.75, ..., 5 times a power of two: ties to
    # the even code); signed zeros; subnormal e4m3 scales; a padding slot (-1).
    dim = formats.FORMATS[fmt].dim
    x = (torch.randn(9, dim) * torch.logspace(-4, 4, 9)[:, None]).to(dtype)
    x[0] = 0
    x[1, :40] = 3000.0
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
    x[2] = (ties.repeat(dim // 8) * torch.tensor([1.0, -1.0]).repeat_interleave(4).repeat(dim // 8)).to(dtype)
    x[3] = -0.0
    x[4] = x[4] * 1e-3
    bs = V41_BS[fmt]
    slots = _i32(0, 11, -1, 5, 3, 2, 7, 9, 1)
    got, want = builders.page_pool(3, bs, dim, fmt), builders.page_pool(3, bs, dim, fmt)
    out, expect = _pack_unpack_both(x, slots, got, want, fmt)
    # The NaN-scale groups read back NaN on both sides (payloads may differ); the rest bit for bit.
    nan = expect.isnan()
    assert torch.equal(out.isnan(), nan) and builders.bytes_equal(out[~nan], expect[~nan])


def test_fp8_casts_match_torch_on_every_code():
    # Every e4m3 code decodes as torch does, and values between and around codes encode as torch
    # rounds them (nearest even), through the same helpers the kernels use.
    codes = torch.arange(256, dtype=torch.int32)
    finite = codes[(codes & 0x7F) != 0x7F]
    vals = finite.to(torch.uint8).view(torch.float8_e4m3fn).float()
    mids = torch.cat([vals, (vals[:-1] + vals[1:]) / 2, vals * (1 + 2**-10), vals * (1 - 2**-10)])
    mids = mids[mids.abs() <= 448].reshape(1, -1)
    mids = torch.nn.functional.pad(mids, (0, 128 - mids.shape[1] % 128)).reshape(-1, 128)
    # Pack with scale 1: make each row's amax 448 so the UE8M0 exponent is 0.
    mids[:, 0] = 448.0
    slots = torch.arange(mids.shape[0], dtype=torch.int32)
    got, want = _pool("fp8", 128, mids.shape[0]), _pool("fp8", 128, mids.shape[0])
    quant_tt.pack_kv(mids.to(torch.float32), slots, got, "fp8_132")
    quant_ref.pack_kv(mids.to(torch.float32), slots, want, "fp8_132")
    assert torch.equal(got, want)


# ---- qkv_prep ----------------------------------------------------------------------------------
@pytest.mark.parametrize("pool,q_norm", [("fp8", True), (torch.bfloat16, True), ("fp8_528", False)],
                         ids=["fp8", "bf16", "v41-fp8_528"])
def test_qkv_prep(pool, q_norm):
    t, h, ring = 5, 3, 8
    q, kv = torch.randn(t, h, 512), torch.randn(t, 512)
    pos, req = _i32(0, 7, 130, 5000, 3), _i32(0, 1, 0, -1, 1)

    def run(fn, dtype, pool_kind):
        cache = _pool(pool_kind, 512, 2 * ring // BS)
        q_out = torch.full((t, h, 512), float("nan"), dtype=dtype)
        fn(q.to(dtype), kv.to(dtype), pos, req, INV_FREQ, q_out, cache, ring, 1e-6, q_norm,
           builders.format_name(pool_kind, 512))
        return q_out, cache

    fmt = builders.format_name(pool, 512)
    q_k, c_k = run(qkv_prep_tt.qkv_prep, torch.bfloat16, pool)
    q_r, c_r = run(qkv_prep_ref.qkv_prep, torch.bfloat16, pool)
    q_64, c_64 = run(qkv_prep_ref.qkv_prep, torch.float64, torch.float64)
    testing.assert_close_to_ref(q_k, q_64, q_r, what="q_out")
    rows_k, rows_r, rows_64 = _rows(c_k, 512, fmt=fmt), _rows(c_r, 512, fmt=fmt), _rows(c_64, 512)
    written = ~rows_64.isnan().any(1)
    assert written.sum() == 4 and torch.equal(written, ~rows_k.isnan().any(1)), "slots written"
    testing.assert_close_to_ref(rows_k[written], rows_64[written], rows_r[written], what="window rows")
    # The nope dims involve no trig (and fill whole scale groups): their quantized entries are bit-exact.
    assert torch.equal(rows_k[written, :448], rows_r[written, :448])


# ---- compressor_update -------------------------------------------------------------------------
# Steps of (request, tokens): prefill chunks, decode tokens, a chunk longer than the ring (its
# closing tokens read state rows that later tokens of the same step overwrite), a padding token.
# A ring with slack rows (CacheConfig.state_rows for drafts): rows past the span, addressed p % rows.
STEPS = {
    "csa": (512, 4, True, [[(0, 6), (1, 3)], [(0, 1), (1, 1)], [(0, 9)]], 0),
    "hca": (512, 16, False, [[(0, 20), (1, 3)], [(1, 14)], [(0, 30)]], 0),  # ratio 16 stands in for 128
    "indexer": (128, 4, True, [[(0, 6), (1, 3)], [(0, 9), (1, 1)]], 0),
    "csa-ring-slack": (512, 4, True, [[(0, 6), (1, 3)], [(0, 1), (1, 1)], [(0, 15)], [(0, 2)]], 5),
}


def _compressor_step(step, lens: list, ratio: int, nblk: int):
    """(positions, req_slots, closing, entry slots) of a step of (request, tokens) runs continuing
    at `lens` (advanced here), plus one padding token; entries of request r at r * 32 + w."""
    pos, req = [], []
    for r, n in step:
        pos += range(lens[r], lens[r] + n)
        req += [r] * n
        lens[r] += n
    pos, req = torch.tensor(pos + [0], dtype=torch.int32), torch.tensor(req + [-1], dtype=torch.int32)
    closes = (req >= 0) & ((pos + 1) % ratio == 0)
    entry = torch.where(closes, (req * 32 + pos // ratio) % (nblk * BS), -1).to(torch.int32)
    return pos, req, closes, entry


def _pool_plan(monkeypatch, split: bool):
    """split: every pool on (token, channel block) programs of d / 4 channels, 4 slots a loop step,
    and the norm / store launch (the HCA decode path; the tiny shapes here take it only when forced)."""
    if split:
        monkeypatch.setattr(compressor_tt, "pool_plan", lambda span, tokens, d: (d // 4, 4, 4))


@pytest.mark.parametrize("split", [False, True], ids=["one-program", "channel-split"])
@pytest.mark.parametrize("pool", ["fp8", torch.bfloat16], ids=["fp8", "bf16"])
@pytest.mark.parametrize("case", sorted(STEPS))
def test_compressor_update(case, pool, split, monkeypatch):
    _pool_plan(monkeypatch, split)
    d, ratio, overlap, steps, slack = STEPS[case]
    width, rows = (2 * d, 2 * ratio + slack) if overlap else (d, ratio + slack)
    adt = torch.float32 if pool == "fp8" else torch.bfloat16  # numerics.compressor_dtype
    ape, w = torch.randn(ratio, width), 1 + 0.1 * torch.randn(d)
    nblk = 16
    runs = {name: (torch.full((2, rows, 2 * width), float("nan")), _pool(p, d, nblk))
            for name, p in (("kernel", pool), ("ref", pool), ("ref64", torch.float32))}
    lens = [0, 0]
    for step in steps:
        pos, req, closes, entry = _compressor_step(step, lens, ratio, nblk)
        kv, score = torch.randn(len(pos), width).to(adt), torch.randn(len(pos), width).to(adt)
        for name, (state, cache) in runs.items():
            fn = compressor_tt.compressor_update if name == "kernel" else compressor_ref.compressor_update
            fn(kv, score, ape, pos, req, entry, w, INV_FREQ, state, cache, None, 1e-6, _fmt(cache, d))
        assert torch.equal(runs["kernel"][0].nan_to_num(7), runs["ref"][0].nan_to_num(7)), "state rows"
    got, lowp, ref = (_rows(runs[n][1], d) for n in ("kernel", "ref", "ref64"))
    written = ~ref.isnan().any(1)
    assert torch.equal(written, ~got.isnan().any(1)), "entries written"
    testing.assert_close_to_ref(got[written], ref[written], lowp[written], what="compressed entries")


@pytest.fixture
def programs_in_reverse(monkeypatch):
    """The interpreter runs a launch's programs from the last to the first (it runs them one after
    another in grid order): a write that is right only because a later program overwrites an
    earlier one is then wrong, as it can be on a GPU, where programs run concurrently."""
    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    forward = builder.set_grid_idx
    seen = []

    def reverse(x, y, z):
        nx, ny, nz = builder.grid_dim
        seen.append(nx - 1 - x)
        forward(nx - 1 - x, ny - 1 - y, nz - 1 - z)

    monkeypatch.setattr(builder, "set_grid_idx", reverse)
    return seen


@pytest.mark.parametrize("d, ratio, overlap", [(512, 4, True), (512, 16, False)], ids=["csa", "hca"])
def test_compressor_state_save_keeps_the_last_writer_in_any_program_order(d, ratio, overlap, programs_in_reverse):
    """Issue 32: tokens p and p + rows of one request in one step map to the same state row; only the
    later may write it (_save_kernel's `later == 0`). With the programs in reverse order the earlier
    token's program runs last: without the guard its values would stay in the row."""
    width, rows = (2 * d, 2 * ratio) if overlap else (d, ratio)
    t = 2 * rows + 3
    pos, req = torch.arange(t, dtype=torch.int32), torch.zeros(t, dtype=torch.int32)
    entry = torch.where((pos + 1) % ratio == 0, pos // ratio, -1).to(torch.int32)
    kv, score, ape = torch.randn(t, width), torch.randn(t, width), torch.randn(ratio, width)
    states = {}
    for name, fn in (("kernel", compressor_tt.compressor_update), ("ref", compressor_ref.compressor_update)):
        states[name] = torch.full((1, rows, 2 * width), float("nan"))
        fn(kv, score, ape, pos, req, entry, torch.ones(d), INV_FREQ, states[name], _pool(torch.float32, d, 4), None,
           1e-6, "exact")
    assert programs_in_reverse[:2] == [t - 1, t - 2], "the interpreter ran the programs in reverse"
    assert torch.equal(states["kernel"], states["ref"]), "a state row holds an earlier writer's values"


@pytest.mark.parametrize("split", [False, True], ids=["one-program", "channel-split"])
@pytest.mark.parametrize("pool", ["fp4_288", torch.bfloat16], ids=["fp4_288", "bf16"])
@pytest.mark.parametrize("ratio", [2, 1])
def test_compressor_update_v41_with_latent(ratio, pool, split, monkeypatch):
    _pool_plan(monkeypatch, split)
    # V4.1's sources: ratio 2 (2 state rows, fp32 a and score) and ratio 1 (no pooling: score 0 as
    # a stride-0 row); `latent_out` gets the entry before RoPE on closing tokens, zeros elsewhere.
    d, nblk = 512, 16
    steps = [[(0, 5), (1, 3)], [(0, 1), (1, 1)], [(0, 7)]]
    adt = torch.float32 if ratio == 2 else torch.bfloat16  # reference.v41.compressor_dtype
    ape, w = torch.randn(ratio, d), 1 + 0.1 * torch.randn(d)
    runs = {name: (torch.full((2, ratio, 2 * d), float("nan")), _pool(p, d, nblk))
            for name, p in (("kernel", pool), ("ref", pool), ("ref64", torch.float32))}
    lens = [0, 0]
    for step in steps:
        pos, req, closes, entry = _compressor_step(step, lens, ratio, nblk)
        kv = torch.randn(len(pos), d).to(adt)
        score = torch.randn(len(pos), d).to(adt) if ratio > 1 else kv.new_zeros(1, d).expand_as(kv)
        latents = {}
        for name, (state, cache) in runs.items():
            fn = compressor_tt.compressor_update if name == "kernel" else compressor_ref.compressor_update
            fmt = builders.format_name(pool if name != "ref64" else torch.float32, d)
            lat = torch.full((len(pos), d), float("nan"), dtype=torch.float32 if name == "ref64" else torch.bfloat16)
            fn(kv, score, ape, pos, req, entry, w, INV_FREQ, state, cache, lat, 1e-6, fmt)
            latents[name] = lat
        assert torch.equal(runs["kernel"][0].nan_to_num(7), runs["ref"][0].nan_to_num(7)), "state rows"
        assert (latents["kernel"][~closes] == 0).all(), "latent rows of tokens that close nothing"
        testing.assert_close_to_ref(latents["kernel"], latents["ref64"], latents["ref"], what="latent")
    fmt = builders.format_name(pool, d)
    got, lowp = _rows(runs["kernel"][1], d, fmt=fmt), _rows(runs["ref"][1], d, fmt=fmt)
    ref = _rows(runs["ref64"][1], d)
    written = ~ref.isnan().any(1)
    assert torch.equal(written, ~got.isnan().any(1)), "entries written"
    testing.assert_close_to_ref(got[written], ref[written], lowp[written], what="compressed entries")


@pytest.mark.parametrize("split", [False, True], ids=["one-program", "channel-split"])
def test_compressor_update_rotates_v4_mx4_index_keys(split, monkeypatch):
    # V4's MXFP4 index keys (indexer_cache="mxfp4"): the CSA indexer stream's entries rotated by the
    # Hadamard before E2M1, over pages of 7 mxfp4_68 slots. Expected: the entries of an exact fp32 pool
    # (no rotation there: a float pool has no quantizer), rotated in fp64.
    _pool_plan(monkeypatch, split)
    d, ratio, _, steps, _ = STEPS["indexer"]
    width, rows, bs, nblk = 2 * d, 2 * ratio, 7, 10
    ape, w = torch.randn(ratio, width), 1 + 0.1 * torch.randn(d)
    runs = {name: (torch.full((2, rows, 2 * width), float("nan")), builders.page_pool(nblk, bs, d, pool))
            for name, pool in (("kernel", "mxfp4_68"), ("ref", "mxfp4_68"), ("ref64", torch.float32))}
    lens = [0, 0]
    for step in steps:
        pos, req, closes, entry = _compressor_step(step, lens, ratio, nblk)
        kv, score = torch.randn(len(pos), width), torch.randn(len(pos), width)
        for name, (state, cache) in runs.items():
            fn = compressor_tt.compressor_update if name == "kernel" else compressor_ref.compressor_update
            fmt, rotate = ("exact", False) if name == "ref64" else ("mxfp4_68", True)
            fn(kv, score, ape, pos, req, entry, w, INV_FREQ, state, cache, None, 1e-6, fmt, rotate)
        assert torch.equal(runs["kernel"][0].nan_to_num(7), runs["ref"][0].nan_to_num(7)), "state rows"
    got, lowp = (_rows(runs[n][1], d, fmt="mxfp4_68") for n in ("kernel", "ref"))
    ref = quant_ref.hadamard(_rows(runs["ref64"][1], d))
    # Poisoned slots read back NaN (float pool) or -inf (0xFF bytes of mxfp4_68: -6 x 2^128).
    written = ref.isfinite().all(1)
    assert written.sum() == 4 and torch.equal(written, got.isfinite().all(1)), "entries written"
    testing.assert_close_to_ref(got[written], ref[written], lowp[written], what="rotated index keys")


# ---- indexer -----------------------------------------------------------------------------------
@pytest.mark.parametrize("out_dtype", [torch.float8_e4m3fn, torch.bfloat16], ids=["fp8", "bf16"])
def test_indexer_q_prep(out_dtype):
    t, h = 4, 3
    q, w = 3 * torch.randn(t, h, 128), torch.randn(t, h)
    pos = _i32(0, 77, 5000, 3)

    def run(fn, dtype, odt):
        q_out, w_out = torch.empty(t, h, 128, dtype=odt), torch.empty(t, h)
        fn(q.to(dtype), w.to(dtype), pos, INV_FREQ, q_out, w_out, "fp8_132" if odt == torch.float8_e4m3fn else "exact")
        return q_out.double() * w_out.double()[..., None]  # what the scores see

    got = run(indexer_tt.indexer_q_prep, torch.bfloat16, out_dtype)
    lowp = run(indexer_ref.indexer_q_prep, torch.bfloat16, out_dtype)
    ref = run(indexer_ref.indexer_q_prep, torch.float32, torch.float32)
    testing.assert_close_to_ref(got, ref, lowp, what="q x w")


def _indexer_case(q_dtype, pool, integer: bool):
    """Two requests over 3 pages of 4 entries; tokens see 0, 12 (all), 5, 8 (12 minus an
    unallocated page) entries and one is padding.
    Integer-valued q and keys with power-of-two weights make every score exact in fp32 (ties
    included), so the selection must equal the reference's, order and tie-breaks included."""
    t, h = 5, 3
    keys = torch.randint(-8, 9, (7 * BS, 128)).float() if integer else torch.randn(7 * BS, 128)
    cache = _pool(pool, 128, 7)
    table = _i32(3, 0, 5, 1, 6, -1).view(2, 3)
    used = torch.tensor([3, 0, 5, 1, 6])
    slots = (used[:, None] * BS + torch.arange(BS)).flatten().to(torch.int32)
    quant_ref.pack_kv(keys[slots.long()], slots, cache, _fmt(cache, 128))
    q = torch.randint(-8, 9, (t, h, 128)).float() if integer else torch.randn(t, h, 128)
    w = torch.tensor([1.0, -0.5, 2.0]).repeat(t, 1)
    # Token 4: request 1 at position 47 sees 12 entries, of which the third block is unallocated.
    return q.to(q_dtype), w, _i32(3, 47, 20, 9, 47), _i32(0, 0, 1, -1, 1), cache, table


@pytest.mark.parametrize("k", [4, 16])
@pytest.mark.parametrize("q_dtype,pool", [(torch.float8_e4m3fn, "fp8"), (torch.bfloat16, torch.bfloat16),
                                          (torch.float32, "fp8")], ids=["fp8", "bf16", "fp32-q"])
def test_indexer_topk_exact(q_dtype, pool, k):
    q, w, pos, req, cache, table = _indexer_case(q_dtype, pool, integer=True)
    got, want = torch.full((5, k), 99, dtype=torch.int32), torch.empty(5, k, dtype=torch.int32)
    fmt = _fmt(cache, 128)
    indexer_tt.indexer_topk(q, w, pos, req, cache, table, None, got, None, builders.topk_workspace(5, 12, k), 4, 0,
                            fmt)
    indexer_ref.indexer_topk(q, w, pos, req, cache, table, None, want, None, 4, 0, fmt)
    assert torch.equal(got, want)


def test_indexer_topk_score_hook_replaces_the_triton_scoring_or_falls_back():
    # The hook the sm_90 launcher passes (dsv4ops/indexer/cuda.py `score`): once per launch of tokens,
    # with the launch's first token and count; declining runs the Triton scoring, serving replaces it
    # (here a scoring that finds no entry: every row is the -1 fill).
    q, w, pos, req, cache, table = _indexer_case(torch.float8_e4m3fn, "fp8", integer=True)
    fmt = _fmt(cache, 128)
    want = torch.empty(5, 4, dtype=torch.int32)
    indexer_ref.indexer_topk(q, w, pos, req, cache, table, None, want, None, 4, 0, fmt)
    launches = []

    def declines(*args):
        launches.append(args[9:11])  # (t0, tokens)
        return False

    got = torch.full((5, 4), 99, dtype=torch.int32)
    indexer_tt.indexer_topk(q, w, pos, req, cache, table, None, got, None, builders.topk_workspace(2, 12, 4), 4, 0,
                            fmt, score=declines)
    assert torch.equal(got, want)
    assert launches == [(0, 2), (2, 2), (4, 1)]

    def serves_empty(*args):
        args[7].zero_()  # the workspace: key 0 (no entry) in every column
        return True

    indexer_tt.indexer_topk(q, w, pos, req, cache, table, None, got, None, builders.topk_workspace(5, 12, 4), 4, 0,
                            fmt, score=serves_empty)
    assert (got == -1).all()


def test_indexer_csrc_scoring_serves_sm90_byte_pages_only(monkeypatch):
    """The wgmma scoring kernel takes sm_90, pages of a multiple of 4 entries, and fp8_132 keys with
    e4m3 queries of 16-B aligned rows or mxfp4_68 keys with MX4 query rows of at most 32 heads;
    everything else, sm_100 included, keeps Triton's."""
    from dsv4ops.indexer import cuda as indexer_cuda

    q, w = torch.zeros(3, 64, 128, dtype=torch.float8_e4m3fn), torch.zeros(3, 64)
    cache = torch.zeros(2, 64 * 132, dtype=torch.uint8)
    shifted = torch.zeros(q.numel() + 16, dtype=torch.uint8)[1:1 + q.numel()].view(torch.float8_e4m3fn).view(q.shape)
    monkeypatch.setenv("DSV4OPS_ARCH", "sm_90a")
    assert indexer_cuda.score_serves(q, w, cache, "fp8_132", 64)
    assert not indexer_cuda.score_serves(q, w, cache, "fp8_132", 6)
    assert not indexer_cuda.score_serves(shifted, w, cache, "fp8_132", 64)
    assert not indexer_cuda.score_serves(q.float(), w, cache, "fp8_132", 64)
    assert not indexer_cuda.score_serves(q, w, cache, "exact", 64)
    assert not indexer_cuda.score_serves(q, w.t().contiguous().t(), cache, "fp8_132", 64)
    mx, mx_cache = torch.zeros(3, 32, 68, dtype=torch.uint8), torch.zeros(2, 128 * 68, dtype=torch.uint8)
    assert indexer_cuda.score_serves(mx, w[:, :32], mx_cache, "mxfp4_68", 128)
    assert indexer_cuda.score_serves(mx, w[:, :32], mx_cache, "mxfp4_68", 7)  # 64-B rows: any page size
    assert not indexer_cuda.score_serves(torch.zeros(3, 64, 68, dtype=torch.uint8), w, mx_cache, "mxfp4_68", 128)
    assert not indexer_cuda.score_serves(mx, w[:, :32], mx_cache, "fp8_132", 128)
    assert not indexer_cuda.score_serves(q, w, mx_cache, "mxfp4_68", 128)
    monkeypatch.setenv("DSV4OPS_ARCH", "sm_100a")
    assert not indexer_cuda.score_serves(q, w, cache, "fp8_132", 64)
    assert not indexer_cuda.score_serves(mx, w[:, :32], mx_cache, "mxfp4_68", 128)


@pytest.mark.parametrize("chunk", [2048, 8], ids=["one-chunk", "2-chunks-merged"])
def test_indexer_topk_chunks_tokens_and_entries(chunk, monkeypatch):
    # A workspace of one token's row: the launcher loops over 5 launches of one token. With 8-key
    # chunks a token's 12 entries are selected (top 4) in 2 chunks, whose lists are then merged.
    q, w, pos, req, cache, table = _indexer_case(torch.float8_e4m3fn, "fp8", integer=True)
    monkeypatch.setattr(indexer_tt._ws, "CHUNK", chunk)
    got, want = torch.empty(5, 4, dtype=torch.int32), torch.empty(5, 4, dtype=torch.int32)
    fmt = _fmt(cache, 128)
    indexer_tt.indexer_topk(q, w, pos, req, cache, table, None, got, None, builders.topk_workspace(1, 12, 4), 4, 0,
                            fmt)
    indexer_ref.indexer_topk(q, w, pos, req, cache, table, None, want, None, 4, 0, fmt)
    assert torch.equal(got, want)


def test_indexer_topk_merge_levels_keep_ties_to_the_lower_entry(monkeypatch):
    # Zero weights: every score is exactly 0, so each 8-key chunk keeps its first 4 entries and the
    # merge levels (2 lists a level with k = 4 and 8-key blocks; 3 chunks need 2 levels for the
    # 20-entry rows) must keep the lowest entries overall.
    monkeypatch.setattr(indexer_tt._ws, "CHUNK", 8)
    monkeypatch.setattr(indexer_tt._ws, "MERGE_BLOCK", 8)
    n, t = 20, 3
    cache = _pool("fp8", 128, n // BS)
    quant_ref.pack_kv(torch.randn(n, 128), torch.arange(n, dtype=torch.int32), cache, "fp8_132")
    table = torch.randperm(n // BS).int().view(1, -1)
    q = torch.randn(t, 2, 128).to(torch.float8_e4m3fn)
    w = torch.zeros(t, 2)
    pos, req = _i32(4 * n - 1, 4 * 17 - 1, 4 * 9 - 1), _i32(0, 0, 0)
    got, want = torch.empty(t, 4, dtype=torch.int32), torch.empty(t, 4, dtype=torch.int32)
    indexer_tt.indexer_topk(q, w, pos, req, cache, table, None, got, None, builders.topk_workspace(t, n, 4), 4, 0,
                            "fp8_132")
    indexer_ref.indexer_topk(q, w, pos, req, cache, table, None, want, None, 4, 0, "fp8_132")
    assert torch.equal(got, want)


@pytest.mark.parametrize("chunks", [1, 4])
def test_indexer_topk_long_rows_with_many_ties(chunks, monkeypatch):
    # Up to 2600 visible entries (three 1024-key scan blocks, the last partial), k = 512. Keys from
    # {-2, 0, 2} and queries with 3 nonzero dims make most scores exact ties: token 0 (weights of
    # both signs) cuts at a positive score shared by ~275 entries, token 1 cuts inside its ~270
    # exact zeros (ReLU), token 2 (negative weights, scores <= 0, its zeros -0.0) cuts among
    # negative ties. Every score is exact (small integers), so the reference's selection, tie-break
    # included, is the answer; 1024-key chunks add the merge of chunk candidates.
    monkeypatch.setattr(indexer_tt._ws, "CHUNK", 4096 // chunks)  # 1024-key chunks: their lists merge in one level
    n, bs = 2600, 64
    blocks = -(-n // bs)
    keys = torch.randint(-1, 2, (blocks * bs, 128)) * 2.0
    cache = _pool("fp8", 128, blocks, bs)
    quant_ref.pack_kv(keys, torch.arange(blocks * bs, dtype=torch.int32), cache, "fp8_132")
    table = torch.randperm(blocks).int().view(1, -1)
    q = torch.zeros(3, 2, 128)
    q[:, 0, :3], q[:, 1, :3] = torch.tensor([1.0, -1.0, 1.0]), torch.tensor([-1.0, 1.0, 1.0])
    w = torch.tensor([[1.0, -1.0], [2.0, 1.0], [-1.0, -0.5]])
    pos, req = _i32(4 * n - 1, 4 * 702, 4 * 1500 + 3), _i32(0, 0, 0)
    got, want = torch.empty(3, 512, dtype=torch.int32), torch.empty(3, 512, dtype=torch.int32)
    q8 = q.to(torch.float8_e4m3fn)
    indexer_tt.indexer_topk(q8, w, pos, req, cache, table, None, got, None, builders.topk_workspace(3, blocks * bs, 512),
                            4, 0, "fp8_132")
    indexer_ref.indexer_topk(q8, w, pos, req, cache, table, None, want, None, 4, 0, "fp8_132")
    assert torch.equal(got, want)


def test_indexer_q_prep_mx4():
    # V4.1's packed 68-B query rows: what the scores see (the decoded row times the weight) against
    # the fp64 rotation, within the reference MX4 run's own error.
    t, h = 4, 3
    q, w = 3 * torch.randn(t, h, 128), torch.randn(t, h)
    pos = _i32(0, 77, 5000, 3)

    def run(fn, dtype, fmt):
        odt, width = (torch.uint8, 68) if fmt == "mxfp4_68" else (torch.float32, 128)
        q_out, w_out = torch.empty(t, h, width, dtype=odt), torch.empty(t, h)
        fn(q.to(dtype), w.to(dtype), pos, INV_FREQ, q_out, w_out, fmt)
        return indexer_ref.query_values(q_out).double() * w_out.double()[..., None]

    got = run(indexer_tt.indexer_q_prep, torch.bfloat16, "mxfp4_68")
    lowp = run(indexer_ref.indexer_q_prep, torch.bfloat16, "mxfp4_68")
    ref = run(indexer_ref.indexer_q_prep, torch.float32, "exact")
    testing.assert_close_to_ref(got, ref, lowp, what="q x w")


@pytest.mark.parametrize("fmt", ["mxfp4_68", "fp8_132"])
def test_indexer_q_prep_rotates_v4_queries(fmt):
    # V4's 64 index heads, rotated by the Hadamard before the quantizer (the MXFP4 indexer; fp8_132 takes
    # the flag too): what the scores see against the fp64 rotation of the fp32 RoPE'd query.
    t, h = 3, 64
    q, w = 3 * torch.randn(t, h, 128), torch.randn(t, h)
    pos = _i32(0, 77, 5000)

    def run(fn, dtype, fmt, rotate):
        odt, width = {"mxfp4_68": (torch.uint8, 68), "fp8_132": (torch.float8_e4m3fn, 128)}.get(fmt, (dtype, 128))
        q_out, w_out = torch.empty(t, h, width, dtype=odt), torch.empty(t, h)
        fn(q.to(dtype), w.to(dtype), pos, INV_FREQ, q_out, w_out, fmt, rotate)
        return indexer_ref.query_values(q_out).double() * w_out.double()[..., None]

    got = run(indexer_tt.indexer_q_prep, torch.bfloat16, fmt, True)
    lowp = run(indexer_ref.indexer_q_prep, torch.bfloat16, fmt, True)
    ref = quant_ref.hadamard(run(indexer_ref.indexer_q_prep, torch.float32, "exact", False))
    testing.assert_close_to_ref(got, ref, lowp, what="rotated q x w")


def test_indexer_topk_mx4_keys_with_v4_heads():
    # V4's CSA indexer on MXFP4 keys: 64 heads (the C++ MX4 scoring serves <= 32; V4 takes this one),
    # ratio 4, pages of 128 keys. Grid values and power-of-two weights make every score exact: the
    # selection equals the reference's, ties included.
    g = torch.Generator().manual_seed(4)
    grid = lambda *shape: E2M1_GRID[torch.randint(0, 8, shape, generator=g)] * (torch.randint(0, 2, shape, generator=g) * 2 - 1)  # noqa: E731
    h, bs, pages, t, k = 64, 128, 3, 5, 16
    cache = builders.page_pool(pages, bs, 128, "mxfp4_68")
    quant_ref.pack_kv(grid(pages * bs, 128), torch.arange(pages * bs, dtype=torch.int32), cache, "mxfp4_68")
    table = _i32(2, 0, 1).view(1, 3)
    q = builders.mx4_query(grid(t, h, 128))
    w = (2.0 ** torch.randint(-2, 3, (t, h), generator=g)) * (torch.randint(0, 2, (t, h), generator=g) * 2 - 1)
    pos, req = _i32(3, 130, 700, 1535, 9), _i32(0, 0, 0, 0, -1)
    got, want = torch.full((t, k), 99, dtype=torch.int32), torch.empty(t, k, dtype=torch.int32)
    indexer_tt.indexer_topk(q, w, pos, req, cache, table, None, got, None, builders.topk_workspace(t, pages * bs, k),
                            4, 0, "mxfp4_68")
    indexer_ref.indexer_topk(q, w, pos, req, cache, table, None, want, None, 4, 0, "mxfp4_68")
    assert torch.equal(got, want)
    assert (want[0, 1:] == -1).all() and (want[1:4] >= 0).all() and (want[4] == -1).all()


@pytest.mark.parametrize("pool", ["mxfp4_68", torch.bfloat16], ids=["mxfp4_68", "bf16"])
def test_indexer_k_prep(pool):
    # V4.1's index keys from the compressor's latent: only closing live tokens write their entry.
    t, ratio, d = 7, 2, 512
    latent = torch.randn(t, d)
    pos, req = _i32(1, 2, 3, 9, 5, 0, 7), _i32(0, 0, 0, 1, -1, 1, 1)  # token 4 is padding
    slots = torch.where((req >= 0) & ((pos + 1) % ratio == 0), req * 8 + pos // ratio, -1).to(torch.int32)
    wk, kw = torch.randn(128, d) / d**0.5, 1 + 0.1 * torch.randn(128)
    bs = 7 if pool == "mxfp4_68" else BS

    def run(fn, dtype, kind):
        cache = builders.page_pool(16 // bs + 2, bs, 128, kind)
        fn(latent.to(dtype), pos, req, slots, wk, kw, INV_FREQ, cache, ratio, 1e-6, builders.format_name(kind, 128))
        return _rows(cache, 128, fmt=builders.format_name(kind, 128))

    got = run(indexer_tt.indexer_k_prep, torch.bfloat16, pool)
    lowp = run(indexer_ref.indexer_k_prep, torch.bfloat16, pool)
    ref = run(indexer_ref.indexer_k_prep, torch.float64, torch.float64)
    # Poisoned slots read back NaN (float pools) or -inf (0xFF bytes of mxfp4_68: -6 x 2^128).
    written = ref.isfinite().all(1)
    assert written.sum() == 4 and torch.equal(written, got.isfinite().all(1)), "entries written"
    testing.assert_close_to_ref(got[written], ref[written], lowp[written], what="index keys")


E2M1_GRID = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _mx4_topk_case(n: int, t: int, bs: int = 7):
    """A request of n entries (ratio 1) over shuffled pages of bs mxfp4_68 keys, and t tokens at
    positions spread over it (the last one padding). Keys and queries take e2m1 grid values (exact
    in MX4) and the weights are signed powers of two, so every score is exact in fp32 and ties are
    frequent: the selection must equal the reference's, tie-breaks included."""
    g = torch.Generator().manual_seed(n)
    pages = -(-n // bs)

    def grid(*shape):
        v = E2M1_GRID[torch.randint(0, 8, shape, generator=g)]
        return torch.where(torch.rand(shape, generator=g) < 0.5, -v, v)

    cache = builders.page_pool(pages, bs, 128, "mxfp4_68")
    quant_ref.pack_kv(grid(pages * bs, 128), torch.arange(pages * bs, dtype=torch.int32), cache, "mxfp4_68")
    table = torch.randperm(pages, generator=g).int().view(1, -1)
    q = builders.mx4_query(grid(t, 3, 128))
    w = torch.tensor([1.0, -0.5, 2.0]).repeat(t, 1)
    pos = torch.linspace(0, n - 1, t - 1).round().int()
    pos = torch.cat([pos, _i32(0)])
    req = torch.cat([torch.zeros(t - 1, dtype=torch.int32), _i32(-1)])
    return q, w, pos, req, cache, table


@pytest.mark.parametrize("chunked", [False, True], ids=["one-chunk", "chunks-merged"])
def test_indexer_topk_mx4_candidate_source_and_reindex(chunked, monkeypatch):
    # The candidate source (cand_out: block max, newest block forced, ascending) and a reindex
    # layer scoring only the pool's columns (cand = the source's cand_out), both bit-exact against
    # the reference. Chunked: 8-key chunks and 2-list merges for the entries and for the blocks.
    if chunked:
        monkeypatch.setattr(indexer_tt._ws, "CHUNK", 8)
        monkeypatch.setattr(indexer_tt._ws, "MERGE_BLOCK", 8)
    n, t, k, cb, keep = 60, 7, 4, 4, 5
    q, w, pos, req, cache, table = _mx4_topk_case(n, t)
    n_entries = table.shape[1] * 7
    out = {}
    for name, fn in (("kernel", indexer_tt.indexer_topk), ("ref", indexer_ref.indexer_topk)):
        idx, cand_out = torch.full((t, k), 99, dtype=torch.int32), torch.full((t, keep), 99, dtype=torch.int32)
        args = (q, w, pos, req, cache, table, None, idx, cand_out)
        if name == "kernel":
            args += (builders.topk_workspace(t, n_entries, k, keep=keep, cand_block=cb),)
        fn(*args, 1, cb, "mxfp4_68")
        out[name] = idx, cand_out
    assert torch.equal(out["kernel"][1], out["ref"][1]), "cand_out"
    assert torch.equal(out["kernel"][0], out["ref"][0]), "source top-k"
    cand = out["ref"][1]
    q2 = builders.mx4_query(torch.randn(t, 3, 128, generator=torch.Generator().manual_seed(5)).round())
    got, want = torch.full((t, k), 99, dtype=torch.int32), torch.empty(t, k, dtype=torch.int32)
    indexer_tt.indexer_topk(q2, w, pos, req, cache, table, cand, got, None,
                            builders.topk_workspace(t, n_entries, k, cand_cols=keep * cb), 1, cb, "mxfp4_68")
    indexer_ref.indexer_topk(q2, w, pos, req, cache, table, cand, want, None, 1, cb, "mxfp4_68")
    assert torch.equal(got, want), "reindex top-k"


def test_indexer_score_keys_order_like_scores():
    # The uint32 keys of the radix select: ordered like the scores, -0.0 equal to +0.0 (a ReLU'd
    # score can be either), and never 0 (which marks "no entry").
    @triton.jit
    def keys(x_ptr, out_ptr, N: tl.constexpr):
        i = tl.arange(0, N)
        tl.store(out_ptr + i, indexer_tt._key_of(tl.load(x_ptr + i)).to(tl.int32, bitcast=True))

    x = torch.tensor([float("-inf"), -3e38, -1.0, -1e-40, -0.0, 0.0, 1e-40, 1.0, 3e38, float("inf")])
    x = torch.cat([x, x.new_zeros(6)])
    out = torch.empty(16, dtype=torch.int32)
    keys[(1,)](x, out, N=16)
    k = out[:10].long() & 0xFFFFFFFF  # as unsigned
    assert (k[1:] - k[:-1] > 0).tolist() == [True] * 4 + [False] + [True] * 4  # -0.0 == 0.0
    assert (k > 0).all()


# ---- sparse_attn -------------------------------------------------------------------------------
@pytest.mark.parametrize("stages,n_split,blocks", [(1, 1, False), (2, 1, False), (1, 2, False), (1, 2, True)],
                         ids=["skip-empty-tiles", "pipelined", "2-splits", "2-splits-draft-block"])
@pytest.mark.parametrize("w_pool,c_pool", [("fp8", "fp8"), (torch.bfloat16, torch.bfloat16), ("fp8", torch.float32),
                                            ("fp8_528", "fp4_288"), ("fp8_528", torch.float32), ("fp8", "fp4_288")],
                         ids=["fp8", "bf16", "fp8-window-fp32-comp", "v41", "v41-window-fp32-comp", "v4-fp4-entries"])
def test_sparse_attn(w_pool, c_pool, stages, n_split, blocks, monkeypatch):
    # 16-key tiles: the 8-key window is one tile, the 40 listed columns three more; two splits cut
    # the entries between programs, merged with the sink by the combine kernel. Draft block: tokens
    # 0 and 1 of request 0 (positions 3, 4) end their windows at 4.
    hb = sparse_attn_tt.config(2, torch.bfloat16)[0]
    monkeypatch.setattr(sparse_attn_tt, "config", lambda *args: (hb, 16, 4, stages))
    monkeypatch.setattr(sparse_attn_tt, "splits", lambda *args: n_split)
    t, h, window, ring = 5, 2, 8, 12
    pos, req = _i32(3, 4, 20, 9, 0), _i32(0, 0, 1, -1, 1)
    ends = _i32(4, 4, 20, 9, 0) if blocks else None
    wc, cc = _pool(w_pool, 512, 2 * ring // BS), _pool(c_pool, 512, 4)
    w_fmt, c_fmt = builders.format_name(w_pool, 512), builders.format_name(c_pool, 512)
    for p, r in zip((pos if ends is None else ends).tolist(), req.tolist()):  # only the windows' ring slots hold keys
        if r >= 0:
            held = torch.arange(max(0, p - window + 1), p + 1)
            quant_ref.pack_kv(torch.randn(len(held), 512), (r * ring + held % ring).to(torch.int32), wc, w_fmt)
    quant_ref.pack_kv(torch.randn(16, 512), torch.arange(16, dtype=torch.int32), cc, c_fmt)
    idx = torch.randint(0, 16, (t, 40), dtype=torch.int32)
    idx[0, 2:] = -1
    idx[2, 0] = -1
    lens = _i32(40, 40, 37, 40, 5)  # token 2 drops its last 3 columns, token 4 lists 5 (all in split 0)
    q, sinks = torch.randn(t, h, 512), torch.randn(h)

    def run(fn, dtype):
        as_dtype = (lambda c: c if c.dtype == torch.uint8 else c.to(dtype)) if dtype == torch.float64 else (lambda c: c)
        out = torch.full((t, h, 512), float("nan"), dtype=dtype)
        w_, c_ = as_dtype(wc), as_dtype(cc)
        fn(q.to(dtype), w_, c_, pos, req, idx, lens, ends, sinks, out, 512**-0.5, window, ring, w_fmt, c_fmt)
        return out

    got = run(sparse_attn_tt.sparse_attn, torch.bfloat16)
    assert (got[3] == 0).all(), "padding token"
    testing.assert_close_to_ref(got, run(sparse_attn_ref.sparse_attn, torch.float64),
                                run(sparse_attn_ref.sparse_attn, torch.bfloat16), what="attention output")


@pytest.mark.parametrize("n_split", [1, 2], ids=["1-split", "2-splits"])
@pytest.mark.parametrize("w_pool,c_pool", [("fp8", "fp8"), ("fp8_528", "fp4_288")], ids=["fp8", "v41"])
def test_sparse_attn_lse(w_pool, c_pool, n_split, monkeypatch):
    """A context-parallel shard's partial: out without the sink and lse (natural log) against the
    reference; token 1 (window end -1: no window, and no listed entry) and token 3 (padding) get
    exact zero rows and lse -inf; with two splits the combine merges them without the sink."""
    hb = sparse_attn_tt.config(2, torch.bfloat16)[0]
    monkeypatch.setattr(sparse_attn_tt, "config", lambda *args: (hb, 16, 4, 1))
    monkeypatch.setattr(sparse_attn_tt, "splits", lambda *args: n_split)
    t, h, window, ring = 5, 2, 8, 12
    pos, req = _i32(3, 4, 20, 9, 0), _i32(0, 0, 1, -1, 1)
    ends = _i32(3, -1, 20, 9, -1)  # tokens 1 and 4: no window
    wc, cc = _pool(w_pool, 512, 2 * ring // BS), _pool(c_pool, 512, 4)
    w_fmt, c_fmt = builders.format_name(w_pool, 512), builders.format_name(c_pool, 512)
    for p, r in ((3, 0), (20, 1)):
        held = torch.arange(max(0, p - window + 1), p + 1)
        quant_ref.pack_kv(torch.randn(len(held), 512), (r * ring + held % ring).to(torch.int32), wc, w_fmt)
    quant_ref.pack_kv(torch.randn(16, 512), torch.arange(16, dtype=torch.int32), cc, c_fmt)
    idx = torch.randint(0, 16, (t, 40), dtype=torch.int32)
    lens = _i32(40, 0, 37, 40, 5)
    q, sinks = torch.randn(t, h, 512), torch.randn(h)

    def run(fn, dtype):
        as_dtype = (lambda c: c if c.dtype == torch.uint8 else c.to(dtype)) if dtype == torch.float64 else (lambda c: c)
        out = torch.full((t, h, 512), float("nan"), dtype=dtype)
        lse = torch.full((t, h), float("nan"))
        fn(q.to(dtype), as_dtype(wc), as_dtype(cc), pos, req, idx, lens, ends, sinks, out, 512**-0.5, window, ring,
           w_fmt, c_fmt, lse)
        return out, lse

    got, lse = run(sparse_attn_tt.sparse_attn, torch.bfloat16)
    ref, ref_lse = run(sparse_attn_ref.sparse_attn, torch.float64)
    low, low_lse = run(sparse_attn_ref.sparse_attn, torch.bfloat16)
    assert (got[[1, 3]] == 0).all() and (lse[[1, 3]] == float("-inf")).all()
    live = [0, 2, 4]
    testing.assert_close_to_ref(got, ref, low, what="partial output")
    testing.assert_close_to_ref(lse[live], ref_lse[live], low_lse[live], what="lse")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_attn_merge(dtype):
    """3 shards over 5 heads x 512 (two head blocks, four column blocks), an empty shard (poisoned:
    not read) and a token without keys; strided partials."""
    args = builders.attn_merge_args(dtype, shards=3, tokens=4, heads=5, dim=512, noncontig=True)
    args["partials"][args["lse"] == float("-inf")] = float("nan")
    got = torch.full_like(args["out"], float("nan"))
    attn_merge_tt.attn_merge(args["partials"], args["lse"], args["sinks"], got)
    want = torch.empty(got.shape, dtype=torch.float64)
    attn_merge_ref.attn_merge(args["partials"].double(), args["lse"], args["sinks"], want)
    low = torch.empty_like(got)
    attn_merge_ref.attn_merge(args["partials"], args["lse"], args["sinks"], low)
    assert not got.isnan().any() and (got[-1] == 0).all()
    testing.assert_close_to_ref(got, want, low, what=f"attn_merge {dtype}")


def test_sparse_attn_fp32():
    # fp32 activations and pools: the fp32 (IEEE) dot path, close to fp64.
    t, h, window, ring = 2, 3, 8, 8
    wc, cc = _pool(torch.float32, 512, 4), _pool(torch.float32, 512, 2)
    wc.normal_()
    cc.normal_()
    q, sinks = torch.randn(t, h, 512), torch.randn(h)
    pos, req, idx, lens = _i32(5, 30), _i32(1, 0), _i32(0, 3, -1, 7).view(2, 2), _i32(2, 2)
    got, want = torch.empty(t, h, 512), torch.empty(t, h, 512, dtype=torch.float64)
    sparse_attn_tt.sparse_attn(q, wc, cc, pos, req, idx, lens, None, sinks, got, 512**-0.5, window, ring, "exact",
                               "exact")
    sparse_attn_ref.sparse_attn(q.double(), wc.double(), cc.double(), pos, req, idx, lens, None, sinks, want,
                                512**-0.5, window, ring, "exact", "exact")
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


# ---- visible_entries ---------------------------------------------------------------------------
# (ratio, block size, blocks): V4's HCA key list 2560 entries wide (three column programs; the
# tokens' counts end in each of them, or before them), CSA's ratio over 16-entry blocks, ratio 1
# over 3-entry blocks.
@pytest.mark.parametrize("ratio,block_size,blocks", [(128, 64, 40), (4, 16, 5), (1, 3, 5)])
def test_visible_entries(ratio, block_size, blocks):
    from test_visible_entries import expected_entries, random_case

    args = random_case(ratio, block_size, blocks)
    # Out-of-range tokens are padding in the kernel too: a request past the table, below -1, and a
    # negative position of a live request.
    args["req_slots"][1], args["req_slots"][2], args["positions"][3] = 4, -2, -5
    wide = torch.full((args["out"].shape[0], args["out"].shape[1] + 3), 2**31 - 1, dtype=torch.int32)
    args["out"] = wide[:, :-3]  # rows with a stride gap, poisoned
    visible_entries_tt.visible_entries(*args.values())
    want = expected_entries(args["block_table"], args["positions"], args["req_slots"], ratio, block_size)
    assert torch.equal(args["out"], want) and (wide[:, -3:] == 2**31 - 1).all()
    assert (want[:4] == -1).all() and (want >= 0).any()


# ---- inv_rope ----------------------------------------------------------------------------------
def test_inv_rope():
    o, pos = torch.randn(3, 9, 512), _i32(0, 129, 70000)

    def run(fn, dtype):
        out = torch.full((3, 9, 512), float("nan"), dtype=dtype)
        fn(o.to(dtype), pos, INV_FREQ, out)
        return out

    got = run(inv_rope_tt.inv_rope, torch.bfloat16)
    testing.assert_close_to_ref(got, run(inv_rope_ref.inv_rope, torch.float64), run(inv_rope_ref.inv_rope, torch.bfloat16))
    assert torch.equal(got[..., :448], o[..., :448].bfloat16()), "nope dims are copied"


# ---- fp8_linear --------------------------------------------------------------------------------
# (N, K, block): K over two tiles (split-K: partials + _reduce_kernel in the interpreter), within one
# tile (direct store), V4.1's 32 x 32 tiles; none a multiple of its tile.
FP8_SHAPES = [(200, 300, 128), (200, 100, 128), (70, 100, 32)]


@pytest.mark.parametrize("scale_dtype", [torch.float8_e8m0fnu, torch.float32], ids=["ue8m0", "fp32"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("n,k,block", FP8_SHAPES)
def test_fp8_linear(n, k, block, dtype, scale_dtype):
    weight, scale = builders.block_fp8_weight(n, k, block, scale_dtype, seed=n + k)
    if scale_dtype == torch.float8_e8m0fnu:
        scale = scale.view(torch.uint8)
    # The scales end right before a NaN (UE8M0 0xFF): a K step past the last tile column that read
    # its scale would turn 0 x scale into NaN.
    after = torch.full((scale.numel() + 1,), 255 if scale.dtype == torch.uint8 else float("nan"), dtype=scale.dtype)
    after[:-1] = scale.flatten()
    scale = after[:-1].view(scale.shape)
    for m in (1, 3, 17, 130):  # decode rows padded to 16, 32; a prefill of two 128-row blocks
        x = torch.randn(m, k)

        def run(fn, dt):
            wide = torch.full((m, n + 3), float("nan"), dtype=dt)  # rows with a stride gap, poisoned
            fn(x.to(dt), weight, scale, wide[:, :n], block)
            assert wide[:, n:].isnan().all(), "wrote outside out"
            return wide[:, :n]

        def in_order(out_dtype):
            # The reference's math with its K sum taken term by term in fp32 (the accumulation the
            # tensor cores keep), then rounded to x's dtype: a second low-precision run, so the
            # budget covers a summation order other than F.linear's (AMD EPYC, fp32, M = 3: the CPU
            # GEMM came within 1 ulp of float64 there, the kernel's tile order 3 ulps).
            w = fp8_linear_ref.dequantize(weight, scale, block, out_dtype).float()
            xs = x.to(out_dtype).float()
            acc = torch.zeros(m, n)
            for j in range(k):
                acc += xs[:, j, None] * w[:, j]
            return acc.to(out_dtype)

        got = run(fp8_linear_tt.fp8_linear, dtype)
        assert not got.isnan().any(), "every element written"
        testing.assert_close_to_ref(got, run(fp8_linear_ref.fp8_linear, torch.float64),
                                    [run(fp8_linear_ref.fp8_linear, dtype), in_order(dtype)], what=f"M={m}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_act_quant(dtype):
    # W8A8's activation quantization: exact math (power-of-two scales, round to nearest even), so bit
    # for bit against the reference; rows past M (the GEMM's padding) zero codes; scales M-major.
    from test_fp8_linear import act_quant_inputs

    x = act_quant_inputs(dtype)
    wide = torch.full((x.shape[0], x.shape[1] + 8), float("nan"), dtype=dtype)
    wide[:, :x.shape[1]] = x  # rows with a stride gap
    for m in (1, 6):
        mp = 16 if m == 1 else 6  # padded, and not
        codes = torch.full((mp, x.shape[1]), 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn)  # NaN
        scales = torch.full((x.shape[1] // 128, mp), float("nan"))
        fp8_linear_tt.act_quant(wide[:m, :x.shape[1]], codes, scales)
        want_codes, want_scales = fp8_linear_ref.act_quant(x[:m])
        assert builders.bytes_equal(codes[:m], want_codes), m
        assert builders.bytes_equal(scales.t()[:m].contiguous(), want_scales), m
        assert (codes[m:].view(torch.uint8) == 0).all() and not scales.isnan().any()


@pytest.mark.parametrize("scale_dtype", [torch.float8_e8m0fnu, torch.float32], ids=["ue8m0", "fp32"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_fused_w8a8(dtype, scale_dtype):
    # The FP8 x FP8 kernel with act_quant in its prologue: N ragged (200: a 128-tile and a partial
    # one), three 1 x 128 blocks over two K splits (partials + _reduce_kernel) or one; rows padded
    # to a 64-row block and in two row blocks; fp32 weight scales that are no powers of two.
    n, k = 200, 384
    weight, scale = builders.block_fp8_weight(n, k, 128, scale_dtype, seed=11)
    scale = scale.float() * (k**-0.5 if scale_dtype == torch.float32 else 1.0)
    x0 = torch.randn(130, k)
    x0[1, :128] *= 1e-6  # a block under the amax floor
    x0[2, 128:256] *= 300.0
    # x quantized in the kernel's prologue, or by act_quant first (QUANT False); column tiles of 64
    # (one weight tile's scale) and of 256 (a scale per column)
    for m, split, quant, bn in ((1, 2, True, 64), (3, 1, True, 256), (3, 2, False, 64), (130, 2, False, 256),
                                (130, 1, True, 64)):
        x = x0[:m]
        cfg = dict(w8a8_tt.config(m, n, k), SPLITS=split, K_SPLIT=256 if split == 2 else 384, QUANT=quant, BN=bn)

        def run(fn, dt, **kw):
            wide = torch.full((m, n + 3), float("nan"), dtype=dt)  # rows with a stride gap, poisoned
            fn(x.to(dt), weight, scale, wide[:, :n], **kw)
            assert wide[:, n:].isnan().all(), "wrote outside out"
            return wide[:, :n]

        def in_order(out_dtype):
            # the W8A8 product from the reference's act_quant, its K sum term by term in fp32
            codes, xs = fp8_linear_ref.act_quant(x.to(out_dtype))
            xq = (codes.float().view(m, -1, 128) * xs[..., None]).view(m, k)
            w = fp8_linear_ref.dequantize(weight, scale, 128, torch.float32)
            acc = torch.zeros(m, n)
            for j in range(k):
                acc += xq[:, j, None] * w[:, j]
            return acc.to(out_dtype)

        got = run(w8a8_tt.fp8_linear_w8a8, dtype, cfg=cfg)
        assert not got.isnan().any(), "every element written"
        ref = [run(fp8_linear_ref.fp8_linear_w8a8, d, block=128) for d in (torch.float64, dtype)]
        # x's values in dtype, in float64: the reference quantizes the values the kernel reads
        ref[0] = run(lambda xx, *a, **kw: fp8_linear_ref.fp8_linear_w8a8(xx.to(dtype).double(), *a, **kw),
                     torch.float64, block=128)
        testing.assert_close_to_ref(got, ref[0], [ref[1], in_order(dtype)], what=f"M={m}, quant={quant}")


def _scaled_mm_model(a, b, scale_a, scale_b, out_dtype=None, out=None):
    """torch._scaled_mm's blockwise contract (ScaledBlas.cpp, DeepSeek-style 1 x 128 / 128 x 128):
    a [M, K] row-major, b [K, N] column-major, scale_a [M, K / 128] M-major (strides (1, M)),
    scale_b [K / 128, N / 128] K-major (strides (1, K / 128)); the product in float64."""
    (m, k), n = a.shape, b.shape[1]
    kb, nb = k // 128, -(-n // 128)
    assert a.is_contiguous() and b.t().is_contiguous() and a.dtype == b.dtype == torch.float8_e4m3fn
    assert scale_a.shape == (m, kb) and scale_a.stride() == (1, m), (scale_a.shape, scale_a.stride())
    assert scale_b.shape == (kb, nb) and scale_b.stride() == (1, kb), (scale_b.shape, scale_b.stride())
    assert out.shape == (m, n) and out.is_contiguous() and out.dtype == out_dtype
    xa = a.double().view(m, kb, 128) * scale_a.double()[:, :, None]
    wb = b.t().double() * scale_b.t().double().repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)
    out.copy_(xa.view(m, k) @ wb.t())
    return out


def test_w8a8_launcher_hands_cublaslt_the_blockwise_layouts(monkeypatch):
    # The CUDA launcher's cuBLASLt route on CPU (routed from one token here): act_quant in the
    # interpreter, torch._scaled_mm replaced by a model that asserts the layouts torch's blockwise
    # check wants; rows padded to 16 and copied back, an out with a stride gap through a temporary;
    # nothing written past out.
    from dsv4ops.fp8_linear import rule
    from dsv4ops.fp8_linear import w8a8

    monkeypatch.setattr(rule, "device_capability", lambda device: (9, 0))
    monkeypatch.setattr(w8a8, "DEFAULT_CUBLASLT_FROM", 1)
    monkeypatch.setattr(torch, "_scaled_mm", _scaled_mm_model)
    n, k = 272, 512  # N: two 128-tiles and a partial one
    weight, scale = builders.block_fp8_weight(n, k, 128, seed=4)
    scale = scale.float()
    for m, gap in ((3, 0), (32, 0), (32, 5)):
        x = torch.randn(m, k).bfloat16()
        wide = torch.full((m, n + gap), float("nan"), dtype=torch.bfloat16)
        w8a8.fp8_linear_w8a8(x, weight, scale, wide[:, :n], 128)
        assert wide[:, n:].isnan().all() and not wide[:, :n].isnan().any()
        want = torch.empty(m, n, dtype=torch.float64)
        fp8_linear_ref.fp8_linear_w8a8(x.double(), weight, scale, want, 128)
        testing.assert_close_to_ref(wide[:, :n], want, want.bfloat16(), what=f"M={m}, gap={gap}")
    before = wide.clone()

    def refuse(*args, **kwargs):
        raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED")

    monkeypatch.setattr(torch, "_scaled_mm", refuse)
    with pytest.raises(RuntimeError, match=r"blockwise GEMM refused \[32, 512\] x \[512, 272\] .*NOT_SUPPORTED"):
        w8a8.fp8_linear_w8a8(x, weight, scale, wide[:, :n], 128)
    assert builders.bytes_equal(wide, before)
    # sm_100 (no cuBLASLt blockwise scaling): the Triton kernel serves every token count
    monkeypatch.setattr(rule, "device_capability", lambda device: (10, 0))
    wide.fill_(float("nan"))
    w8a8.fp8_linear_w8a8(x, weight, scale, wide[:, :n], 128)
    testing.assert_close_to_ref(wide[:, :n], want, want.bfloat16(), what="sm_100")
    assert wide[:, n:].isnan().all()


def test_w8a8_probe_uses_the_launchers_layouts_and_turns_auto_off_where_torch_refuses(monkeypatch):
    # The probe's call passes torch's blockwise contract (the model above asserts the layouts); a
    # torch whose _scaled_mm refuses it turns "auto" to W8A16 (capability None), with a warning.
    from dsv4ops.fp8_linear import rule

    probe, cpu = rule.probe.__wrapped__, torch.device("cpu")  # uncached
    monkeypatch.setattr(torch, "_scaled_mm", _scaled_mm_model)
    assert probe(cpu) is None

    def refuse(*args, **kwargs):
        raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED\nmore")

    monkeypatch.setattr(torch, "_scaled_mm", refuse)
    with pytest.warns(UserWarning, match=r"W8A8 path is off on cpu .*refused 1 x 128 / 128 x 128 scaling: "
                                         r"CUBLAS_STATUS_NOT_SUPPORTED\); activations='auto' runs W8A16"):
        why = probe(cpu)
    assert why.endswith("CUBLAS_STATUS_NOT_SUPPORTED")
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(rule, "device_capability", lambda device: (9, 0))
    monkeypatch.setattr(rule, "probe", lambda dev: why)
    assert rule.serving_capability(cuda) is None
    monkeypatch.setattr(rule, "probe", lambda dev: None)
    assert rule.serving_capability(cuda) == (9, 0)
    monkeypatch.setattr(rule, "device_capability", lambda device: (10, 0))
    monkeypatch.setattr(rule, "probe", lambda dev: pytest.fail("probed off sm_90"))
    assert rule.serving_capability(cuda) == (10, 0)  # pick's own reason applies there


def test_fp8_linear_runs_the_gpus_prefill_config():
    # What config() gives a GPU at 300 tokens of kv (4096 -> 512), run here: 3 row blocks (the last of
    # 44 rows) x 6 splits of K (the last 256 wide): the partials of several row blocks and the reduce.
    n, k, m = 512, 4096, 300
    cfg = fp8_linear_tt.config(m, n, k, 128, interpret=False)
    assert (cfg["BM"], cfg["SPLITS"], cfg["K_SPLIT"]) == (128, 6, 768)
    weight, scale = builders.block_fp8_weight(n, k, 128, torch.float32, seed=1)
    scale = scale * k**-0.5
    x = torch.randn(m, k)

    def run(fn, dt, **kw):
        out = torch.full((m, n), float("nan"), dtype=dt)
        fn(x.to(dt), weight, scale, out, 128, **kw)
        return out

    got = run(fp8_linear_tt.fp8_linear, torch.bfloat16, cfg=cfg)
    assert not got.isnan().any(), "every element written"
    testing.assert_close_to_ref(got, run(fp8_linear_ref.fp8_linear, torch.float64),
                                run(fp8_linear_ref.fp8_linear, torch.bfloat16))


def test_fp8_linear_launch_config_fills_the_h100():
    # The V4-Flash projections (q_a, q_b, kv, o_b) at decode batch 1 and 128: at least a wave of
    # programs on the 132 SMs, every weight byte read by one row block, split-K partials within 2x
    # the weight bytes; a prefill runs 128 x 128 tiles, split where they leave SMs idle (q_a at 256
    # rows: 16 tiles, 60 us unsplit on an H200) as far as partials within 2x the weight bytes allow.
    f = dsv4ops.DSV4AttentionConfig.flash()
    shapes = [(f.q_lora_rank, f.hidden_size), (f.num_heads * f.head_dim, f.q_lora_rank), (f.head_dim, f.hidden_size),
              (f.hidden_size, f.o_groups * f.o_lora_rank)]
    assert shapes == [(1024, 4096), (32768, 1024), (512, 4096), (4096, 8192)]
    for n, k in shapes:
        for m in (1, 128):
            c = fp8_linear_tt.config(m, n, k, 128, interpret=False)
            programs = triton.cdiv(n, c["BN"]) * c["SPLITS"]
            assert c["BM"] >= m and programs >= 128 and 4 * c["SPLITS"] * c["BM"] * n <= 2 * n * k, (n, k, m, c)
            assert (c["SPLITS"] - 1) * c["K_SPLIT"] < k <= c["SPLITS"] * c["K_SPLIT"]
        c = fp8_linear_tt.config(4096, n, k, 128, interpret=False)
        assert (c["BM"], c["BN"], c["SPLITS"]) == (128, 128, 1)
        for m in (256, 512, 1024):
            c = fp8_linear_tt.config(m, n, k, 128, interpret=False)
            tiles = triton.cdiv(n, 128) * triton.cdiv(m, 128)
            assert (c["BM"], c["BN"]) == (128, 128), (n, k, m, c)
            assert c["SPLITS"] == 1 or 4 * c["SPLITS"] * m * n <= 2 * n * k, (n, k, m, c)
            assert tiles * c["SPLITS"] >= 128 or c["SPLITS"] == min(8, k // (2 * m)), (n, k, m, c)


# ---- layout rejection --------------------------------------------------------------------------
def test_kernels_reject_other_layouts_by_name():
    q, kv = torch.randn(2, 2, 256), torch.randn(2, 256)
    pool = torch.zeros(4, BS, 256)
    with pytest.raises(ValueError, match="head_dim.*512"):
        qkv_prep_tt.qkv_prep(q, kv, _i32(0, 1), _i32(0, 0), INV_FREQ, torch.empty_like(q), pool, 8, 1e-6, True, "exact")
    with pytest.raises(ValueError, match="inv_freq"):
        inv_rope_tt.inv_rope(torch.randn(2, 2, 512), _i32(0, 1), INV_FREQ[:16], torch.empty(2, 2, 512))
    with pytest.raises(ValueError, match="q: .*index_head_dim 128"):
        indexer_tt.indexer_topk(torch.randn(2, 2, 64), torch.randn(2, 2), _i32(0, 1), _i32(0, 0), torch.zeros(2, 4, 64),
                                _i32(0, 1).view(1, 2), None, torch.empty(2, 4, dtype=torch.int32), None,
                                builders.topk_workspace(2, 8, 4), 4, 0, "exact")


def test_launchers_reject_the_combinations_they_do_not_implement():
    # Each launcher names what it lacks instead of guessing, before writing anything: a float query
    # over MX4 keys (the reference decodes both), V4's 584-B rows beside a V4.1 format.
    args = {name: make() for name, make in (
        ("indexer_topk", lambda: builders.indexer_topk_args(torch.float32, "mxfp4_68", ratio=1, block_size=7)),
        ("sparse_attn", lambda: builders.sparse_attn_args(torch.bfloat16, "fp8_528", comp_fmt="fp8_584")),
    )}
    launchers = {"indexer_topk": indexer_tt.indexer_topk, "sparse_attn": sparse_attn_tt.sparse_attn}
    expect = {"indexer_topk": "q of dtype torch.float32 with fmt='mxfp4_68'",
              "sparse_attn": "window_fmt='fp8_528' with comp_fmt='fp8_584'"}
    for name, a in args.items():
        before = {k: v.clone() for k, v in a.items() if isinstance(v, torch.Tensor)}
        with pytest.raises(NotImplementedError, match=f"the Triton kernel does not implement {expect[name]}"):
            launchers[name](*a.values())
        assert all(builders.bytes_equal(a[k], v) for k, v in before.items()), name


# ---- warmup ------------------------------------------------------------------------------------
@pytest.mark.parametrize("parallel", [(1, 1), (2, 2)], ids=["one-gpu", "tp2-dcp2"])
@pytest.mark.parametrize("mode", ["fp8", "bf16", "fp4"])
def test_warmup_calls_every_op_of_every_layer_kind(mode, parallel, monkeypatch):
    # On CPU the ops run their reference kernels: this checks that every warmup call is a valid op
    # call (the CUDA run compiles through the same calls), and that it covers every op and bucket.
    from dsv4ops.cache import CacheConfig

    seen = []

    def spy(name, op):
        def call(*args):
            seen.append((name, args[1 if name == "unpack_kv" else 0].shape[0]))  # (op, tokens)
            return op(*args)

        return call

    for name in dsv4ops.backends.TRITON_LAUNCHERS:
        monkeypatch.setattr(torch.ops.dsv4, name, spy(name, getattr(torch.ops.dsv4, name)))
    formats = {"bf16": dsv4ops.CacheFormats.exact(), "fp8": dsv4ops.CacheFormats.v4(),
               "fp4": dsv4ops.CacheFormats("fp8_584", "fp4_288", "mxfp4_68")}[mode]
    cache_cfg = CacheConfig(max_requests=2, max_context=256, max_step_tokens=4, formats=formats)
    fp8_block = 128 if mode == "fp8" else None  # layers loaded with keep_fp8=True: fp8_linear too
    tp, dcp = parallel  # a rank's heads under tensor parallelism; the partial and merge of context parallelism
    calls = dsv4ops.warmup(CFG, cache_cfg, "cpu", fp8_block=fp8_block, tp=tp, dcp=dcp)
    assert calls == len(seen)
    # Every op a V4 layer calls: all but V4.1's key writer (warmup takes V4 configurations), attn_merge
    # only for a context-parallel cache, and fp8_linear_w8a8 only where rule.pick chooses it: never
    # without a GPU (test_warmup_runs_w8a8_...).
    skipped = ({"indexer_k_prep", "fp8_linear_w8a8"} | (set() if fp8_block else {"fp8_linear"})
               | ({"attn_merge"} if dcp == 1 else set()))
    assert {n for n, _ in seen} == set(dsv4ops.backends.TRITON_LAUNCHERS) - skipped
    assert {t for _, t in seen} == set(cache_cfg.buckets)


def test_warmup_runs_w8a8_where_the_rule_picks_it(monkeypatch):
    # An sm_90 capability and a rule that switches between the two buckets: W8A8 at the larger one
    # only, for every projection.
    from dsv4ops.cache import CacheConfig
    from dsv4ops.fp8_linear import rule

    cfg = dsv4ops.DSV4AttentionConfig.tiny(hidden_size=512, q_lora_rank=512, o_lora_rank=256)
    cache_cfg = CacheConfig(max_requests=2, max_context=256, max_step_tokens=4, buckets=(1, 4))
    monkeypatch.setattr(rule, "serving_capability", lambda device: (9, 0))
    monkeypatch.setattr(rule, "W8A8_FROM", {})
    monkeypatch.setattr(rule, "DEFAULT_W8A8_FROM", 4)
    seen = []
    real = torch.ops.dsv4.fp8_linear_w8a8

    def spy(*args):
        seen.append((args[0].shape[0], tuple(args[1].shape)))
        return real(*args)

    monkeypatch.setattr(torch.ops.dsv4, "fp8_linear_w8a8", spy)
    dsv4ops.warmup(cfg, cache_cfg, "cpu", fp8_block=128)
    # q_b (heads x 512, 512); q_a, kv, o_b and the indexer's q_b are all (512, 512) here
    assert {t for t, _ in seen} == {4} and {s for _, s in seen} == {(2048, 512), (512, 512)}


# ---- the arch table ----------------------------------------------------------------------------
@pytest.mark.parametrize("op", sorted(_arch.ARCH_TABLE))
def test_arch_table_never_picks_an_sm90a_only_backend_on_sm100(op):
    chosen = _arch.backends(op, (10, 0))
    assert chosen and all(_arch.ARCH_ONLY.get(b, 10) == 10 for b in chosen), chosen
    assert "cute_sm90" not in chosen


def test_attention_ops_run_triton_on_sm90_and_sm100():
    """Triton everywhere but the CUDA C++ launchers (Triton for what they do not serve): sparse_attn
    on sm_90 (its wgmma kernel), indexer_topk on sm_90 and sm_100 (its plain-CUDA select)."""
    from dsv4ops import backends
    from dsv4ops.indexer import cuda as indexer_cuda
    from dsv4ops.sparse_attn import cuda as sparse_attn_cuda

    csrc_on = {"sparse_attn": (9,), "indexer_topk": (9, 10)}
    assert set(csrc_on) == set(backends.CSRC_LAUNCHERS)
    for op in backends.TRITON_LAUNCHERS:
        for major in (9, 10):
            want = ("csrc", "triton") if major in csrc_on.get(op, ()) else ("triton",)
            assert _arch.backends(op, (major, 0)) == want
        if 10 not in csrc_on.get(op, ()):
            assert backends.resolve(op, (10, 0)) is backends.triton_launcher(op)
        assert backends.resolve(op, (8, 0)) is getattr(dsv4ops.ops, op)._init_fn  # no row: the reference
    assert backends.resolve("sparse_attn", (9, 0)) is sparse_attn_cuda.sparse_attn
    for major in (9, 10):
        assert backends.resolve("indexer_topk", (major, 0)) is indexer_cuda.indexer_topk


def test_a_pdl_launch_requires_the_wait_first():
    # A kernel launched with programmatic dependent launch may start before the previous kernel of the
    # stream has finished: touching memory before wait_prior_grid() would race with it.
    @triton.jit
    def _no_wait(x_ptr):
        tl.store(x_ptr, 1)

    x = torch.zeros(1, dtype=torch.int32)
    with pytest.raises(RuntimeError, match="must start with wait_prior_grid"):
        th.launch(_no_wait, (1,), (x,), {}, pdl=True)
    assert x.item() == 0
    th.launch(_no_wait, (1,), (x,), {})
    assert x.item() == 1


def test_import_binds_cuda_kernels_without_triton():
    code = ("import sys, dsv4ops, torch; assert 'triton' not in sys.modules; "
            "assert all(torch._C._dispatch_has_kernel_for_dispatch_key(f'dsv4::{op}', 'CUDA') "
            "for op in dsv4ops.backends.TRITON_LAUNCHERS); print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


# ---- ahead-of-time compile for sm_90 / sm_100 --------------------------------------------------
_TRITON_TYPES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.uint8: "u8",
                 torch.int32: "i32", torch.int64: "i64", torch.float8_e4m3fn: "fp8e4nv"}


def signature(kernel, args, constexprs):
    """ASTSource signature, constexprs and attributes of one recorded launch: like Triton's runtime
    specialization, 16-byte aligned pointers and ints divisible by 16 (not `do_not_specialize`)
    carry tt.divisibility = 16, so the compiled code is the code the GPU runs."""
    sig, attrs = {}, {}
    values = iter(args)
    for i, p in enumerate(kernel.params):
        if p.is_constexpr:
            sig[p.name] = "constexpr"
            continue
        v = next(values)
        if isinstance(v, torch.Tensor):
            sig[p.name] = "*" + _TRITON_TYPES[v.dtype]
            aligned = v.data_ptr() % 16 == 0
        elif isinstance(v, bool):
            sig[p.name], aligned = "i1", False
        elif isinstance(v, int):
            sig[p.name] = "i32" if -(2**31) <= v < 2**31 else "i64"
            aligned = v % 16 == 0 and not p.do_not_specialize
        else:
            sig[p.name], aligned = "fp32", False
        if aligned:
            attrs[(i,)] = [["tt.divisibility", 16]]
    return sig, dict(constexprs), attrs


def record_launches():
    """Every launch variant the V4 configurations use (bf16 model with FP8 or bf16 pools, fp32 exact
    model with fp32 pools) and V4.1's QAT formats, recorded from the launchers on tiny CPU tensors."""
    launches, seen, recorded = [], set(), []
    t = 3
    pos, req = torch.zeros(t, dtype=torch.int32), torch.zeros(t, dtype=torch.int32)
    for dtype, mode in ((torch.bfloat16, "fp8"), (torch.bfloat16, "bf16"), (torch.float32, "fp32")):
        pool = {"fp8": "fp8", "bf16": torch.bfloat16, "fp32": torch.float32}[mode]
        adt = torch.float32 if mode == "fp8" else dtype
        with th.recording() as rec:
            q, kv = torch.zeros(t, 64, 512, dtype=dtype), torch.zeros(t, 512, dtype=dtype)
            window = _pool(pool, 512, 4)
            f512, f128 = _fmt(window, 512), builders.format_name(pool, 128)
            qkv_prep_tt.qkv_prep(q, kv, pos, req, INV_FREQ, q, window, 8, 1e-6, True, f512)
            for d, ratio, coff in ((512, 4, 2), (512, 128, 1), (128, 4, 2)):
                a = torch.zeros(t, coff * d, dtype=adt)
                compressor_tt.compressor_update(a, a, torch.zeros(ratio, coff * d), pos, req, pos, torch.ones(d),
                                                INV_FREQ, torch.zeros(1, coff * ratio, 2 * coff * d), _pool(pool, d, 1),
                                                None, 1e-6, f512 if d == 512 else f128)
            qi = torch.zeros(t, 64, 128, dtype=dtype)
            qi_out = torch.zeros(t, 64, 128, dtype=torch.float8_e4m3fn if mode == "fp8" else dtype)
            indexer_tt.indexer_q_prep(qi, qi[..., 0], pos, INV_FREQ, qi_out, torch.zeros(t, 64),
                                      "fp8_132" if mode == "fp8" else "exact")
            for tokens, blocks in ((t, 2), (t, 2100)):  # one chunk per row; rows of several chunks, merged
                indexer_tt.indexer_topk(torch.zeros(tokens, 64, 128, dtype=qi_out.dtype), torch.zeros(tokens, 64),
                                        torch.zeros(tokens, dtype=torch.int32), torch.zeros(tokens, dtype=torch.int32),
                                        _pool(pool, 128, 2), torch.zeros(1, blocks, dtype=torch.int32), None,
                                        torch.zeros(tokens, 512, dtype=torch.int32), None,
                                        builders.topk_workspace(tokens, blocks * BS, 512), 4, 0, f128)
            idx = torch.zeros(t, 512, dtype=torch.int32)
            lens = torch.full((t,), idx.shape[1], dtype=torch.int32)
            sparse_attn_tt.sparse_attn(q, window, _pool(pool, 512, 2), pos, req, idx, lens, None, torch.zeros(64), q,
                                       0.04, 8, 8, f512, f512)
            # A context-parallel shard's partial (lse; split like the call above), and the merge.
            sparse_attn_tt.sparse_attn(q, window, _pool(pool, 512, 2), pos, req, idx, lens, None, torch.zeros(64), q,
                                       0.04, 8, 8, f512, f512, torch.zeros(t, 64))
            attn_merge_tt.attn_merge(torch.zeros(2, t, 64, 512, dtype=dtype), torch.zeros(2, t, 64), torch.zeros(64), q)
            inv_rope_tt.inv_rope(q, pos, INV_FREQ, q)
            for blocks in (8, 128):  # V4-Flash's HCA key lists at 64K and 1M context: 512 and 8192 entries
                visible_entries_tt.visible_entries(torch.zeros(1, blocks, dtype=torch.int32), pos, req,
                                                   torch.zeros(t, blocks * 64, dtype=torch.int32), 128, 64)
            _record_fp8_linear(dtype, 128, t)
            for d in (512, 128):
                rows = torch.zeros(t, d, dtype=dtype)
                quant_tt.pack_kv(rows, pos, _pool(pool, d, 1), f512 if d == 512 else f128)
                quant_tt.unpack_kv(_pool(pool, d, 1), pos, rows, f512 if d == 512 else f128)
        recorded.append(rec)
    recorded.append(_record_v41_launches(t, pos, req))
    recorded.append(_record_v4_fp4_launches(t, pos, req))
    for rec in recorded:
        for kernel, args, constexprs, warps in rec:
            sig, consts, attrs = signature(kernel, args, constexprs)
            key = (kernel.__name__, str(sig), str(consts), str(attrs), warps)
            if key not in seen:
                seen.add(key)
                launches.append((kernel, sig, consts, attrs, warps))
    return launches


def _record_fp8_linear(dtype, block: int, t: int) -> None:
    """fp8_linear's variants: decode rows at V4-Flash's kv_proj shape (512 x 4096: split-K and the
    reduce) and at q_b_proj's (32768 x 1024: no split), a 4096-row prefill; UE8M0 and fp32 scales."""
    for m, n, k in ((t, 512, 4096), (t, 32768, 1024), (4096, 256, 512)):
        weight = torch.empty(n, k, dtype=torch.float8_e4m3fn)
        tiles = (-(-n // block), -(-k // block))
        for scale in (torch.empty(tiles, dtype=torch.uint8), torch.empty(tiles)):
            fp8_linear_tt.fp8_linear(torch.empty(m, k, dtype=dtype), weight, scale, torch.empty(m, n, dtype=dtype),
                                     block)
        if block == 128 and k % 128 == 0:  # W8A8's activation quantization, rows padded to 16
            mp = -(-m // 16) * 16
            fp8_linear_tt.act_quant(torch.empty(m, k, dtype=dtype), torch.empty(mp, k, dtype=torch.float8_e4m3fn),
                                    torch.empty(k // 128, mp))
            w8a8_tt.fp8_linear_w8a8(torch.empty(m, k, dtype=dtype), weight, torch.empty(tiles),
                                    torch.empty(m, n, dtype=dtype))


def _record_v41_launches(t, pos, req) -> list:
    """The launch variants of a bf16 V4.1 model with its QAT formats (fp8_528 window, fp4_288
    compressed, mxfp4_68 index keys)."""
    with th.recording() as rec:
        q, kv = torch.zeros(t, 64, 512, dtype=torch.bfloat16), torch.zeros(t, 512, dtype=torch.bfloat16)
        window, comp = builders.page_pool(4, BS, 512, "fp8_528"), builders.page_pool(2, BS, 512, "fp4_288")
        qkv_prep_tt.qkv_prep(q, kv, pos, req, INV_FREQ, q, window, 8, 1e-6, False, "fp8_528")
        for ratio, adt in ((2, torch.float32), (1, torch.bfloat16)):
            a = torch.zeros(t, 512, dtype=adt)
            compressor_tt.compressor_update(a, a, torch.zeros(ratio, 512), pos, req, pos, torch.ones(512), INV_FREQ,
                                            torch.zeros(1, ratio, 1024), comp, torch.zeros(t, 512, dtype=torch.bfloat16),
                                            1e-6, "fp4_288")
        idx = torch.zeros(t, 512, dtype=torch.int32)
        lens = torch.full((t,), idx.shape[1], dtype=torch.int32)
        sparse_attn_tt.sparse_attn(q, window, comp, pos, req, idx, lens, None, torch.zeros(64), q, 0.04, 8, 8,
                                   "fp8_528", "fp4_288")
        qi = torch.zeros(t, 64, 128, dtype=torch.bfloat16)
        q4 = torch.zeros(t, 64, 68, dtype=torch.uint8)
        indexer_tt.indexer_q_prep(qi, qi[..., 0], pos, INV_FREQ, q4, torch.zeros(t, 64), "mxfp4_68")
        keys = builders.page_pool(2, 128, 128, "mxfp4_68")
        indexer_tt.indexer_k_prep(torch.zeros(t, 512, dtype=torch.bfloat16), pos, req, pos, torch.zeros(128, 512),
                                  torch.ones(128), INV_FREQ, keys, 2, 1e-6, "mxfp4_68")
        cb, keep, k = 8, 2048, 512
        for blocks in (2, 8192):  # one chunk; rows of several chunks (entries and blocks), merged
            table = torch.zeros(1, blocks, dtype=torch.int32)
            n = blocks * 128
            idx, cand = torch.zeros(t, k, dtype=torch.int32), torch.zeros(t, keep, dtype=torch.int32)
            indexer_tt.indexer_topk(q4, torch.zeros(t, 64), pos, req, keys, table, None, idx, cand,
                                    builders.topk_workspace(t, n, k, keep=keep, cand_block=cb), 1, cb, "mxfp4_68")
            indexer_tt.indexer_topk(q4, torch.zeros(t, 64), pos, req, keys, table, cand, idx, None,
                                    builders.topk_workspace(t, n, k, cand_cols=keep * cb), 1, cb, "mxfp4_68")
        _record_fp8_linear(torch.bfloat16, 32, t)
        for fmt, bs in (("fp8_528", BS), ("fp4_288", BS), ("mxfp4_68", 7)):
            d = formats.FORMATS[fmt].dim
            rows, pool = torch.zeros(t, d, dtype=torch.bfloat16), builders.page_pool(1, bs, d, fmt)
            quant_tt.pack_kv(rows, pos, pool, fmt)
            quant_tt.unpack_kv(pool, pos, rows, fmt)
    return rec


def _record_v4_fp4_launches(t, pos, req) -> list:
    """A bf16 V4 model with kv_cache="fp4" / indexer_cache="mxfp4": fp4_288 entries (CSA and HCA)
    beside fp8_584 window rows, and the MXFP4 indexer's rotated keys and queries of 64 heads over
    pages of 128 keys."""
    with th.recording() as rec:
        q = torch.zeros(t, 64, 512, dtype=torch.bfloat16)
        window, comp = _pool("fp8", 512, 4), builders.page_pool(2, BS, 512, "fp4_288")
        for ratio, coff in ((4, 2), (128, 1)):
            a = torch.zeros(t, coff * 512)
            compressor_tt.compressor_update(a, a, torch.zeros(ratio, coff * 512), pos, req, pos, torch.ones(512),
                                            INV_FREQ, torch.zeros(1, coff * ratio, 2 * coff * 512), comp, None, 1e-6,
                                            "fp4_288")
        keys = builders.page_pool(2, 128, 128, "mxfp4_68")
        a = torch.zeros(t, 256)
        compressor_tt.compressor_update(a, a, torch.zeros(4, 256), pos, req, pos, torch.ones(128), INV_FREQ,
                                        torch.zeros(1, 8, 512), keys, None, 1e-6, "mxfp4_68", True)
        qi, q4 = torch.zeros(t, 64, 128, dtype=torch.bfloat16), torch.zeros(t, 64, 68, dtype=torch.uint8)
        indexer_tt.indexer_q_prep(qi, qi[..., 0], pos, INV_FREQ, q4, torch.zeros(t, 64), "mxfp4_68", True)
        idx = torch.zeros(t, 512, dtype=torch.int32)
        # The scoring of 64 heads at ratio 4 is this mode's own variant (the selects are V4's and V4.1's).
        indexer_tt.indexer_topk(q4, torch.zeros(t, 64), pos, req, keys, torch.zeros(1, 2, dtype=torch.int32), None,
                                idx, None, builders.topk_workspace(t, 2 * 128, 512), 4, 0, "mxfp4_68")
        lens = torch.full((t,), idx.shape[1], dtype=torch.int32)
        sparse_attn_tt.sparse_attn(q, window, comp, pos, req, idx, lens, None, torch.zeros(64), q, 0.04, 8, 8,
                                   "fp8_584", "fp4_288")
    return rec


def _aot_compile(arch: int):
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    names = set()
    for kernel, sig, consts, attrs, warps in record_launches():
        compiled = triton.compile(ASTSource(fn=kernel, signature=sig, constexprs=consts, attrs=attrs),
                                  target=GPUTarget("cuda", arch, 32), options={"num_warps": warps})
        assert compiled.asm["cubin"], kernel.__name__
        if "wait_prior_grid()" in inspect.getsource(kernel.fn):  # a PDL kernel: the wait before any global access
            ptx = compiled.asm["ptx"]
            first_access = min(ptx.find(op) if op in ptx else len(ptx) for op in ("ld.global", "st.global"))
            assert -1 < ptx.find("griddepcontrol.wait") < first_access, kernel.__name__
        names.add(kernel.__name__)
    print(f"sm_{arch}: compiled", " ".join(sorted(names)))


def test_aot_compile_every_kernel_for_sm90_and_sm100():
    # Needs un-interpreted JITFunctions: subprocesses without TRITON_INTERPRET, one per arch, run
    # side by side. ptxas ships with triton (triton/backends/nvidia/bin): no GPU or CUDA toolkit.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["DSV4OPS_TRITON_AOT"] = "1"
    procs = {arch: subprocess.Popen([sys.executable, __file__, str(arch)], stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True, env=env) for arch in (90, 100)}
    expected = {"_qkv_prep_kernel", "_compress_kernel", "_pool_split_kernel", "_finish_kernel", "_save_kernel",
                "_q_prep_kernel", "_k_prep_kernel", "_score_kernel",
                "_block_keys_kernel", "_select_kernel", "_merge_kernel", "_sparse_attn_kernel", "_combine_kernel",
                "_attn_merge_kernel", "_visible_entries_kernel", "_inv_rope_kernel", "_pack_kernel", "_unpack_kernel",
                "_fp8_linear_kernel", "_reduce_kernel", "_act_quant_kernel", "_w8a8_kernel"}
    for arch, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=600)
        assert proc.returncode == 0, f"sm_{arch}: " + stdout[-3000:] + stderr[-6000:]
        assert set(stdout.split("compiled", 1)[1].split()) == expected, stdout


if __name__ == "__main__":
    _aot_compile(int(sys.argv[1]))
