"""GPU (sm_90): the CUDA C++ sparse_attn kernels (csrc/sparse_attn/, launcher
dsv4ops/sparse_attn/cuda.py) against the float64 reference within the bf16 budget (a bf16 run of the
reference), through their launcher (the arch table selects it on sm_90, so the op-level tiers run it
too). Decode tokens of separate requests (split-KV: the splits merged in their cluster or by the
combine kernel) and a prefill chunk (one split), windows cut short below position 127, -1 entries
and shortened comp_lens, padding tokens, draft-block window ends, both kernels (64 heads a CTA, and
8 / 16 for tensor-parallel shards; 17-32 heads on the 64-head one) and head counts that leave a CTA
partly empty; outputs
poisoned with NaN before the call."""

import builders
import pytest
import torch

from dsv4ops import testing
from dsv4ops.sparse_attn import cuda as sparse_attn_cuda
from dsv4ops.quant import formats
from dsv4ops.quant import reference as quant_ref
from dsv4ops.sparse_attn import reference as sparse_attn_ref

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                                 reason="needs an sm_90 GPU (the kernel is wgmma, sm_90a)")]

BS, RING, WINDOW, FMT = 64, 256, 128, "fp8_584"


def _case(heads: int, prefill: bool, entries: int = 512, pool=builders.FP8):
    return builders.sparse_attn_gpu_case(heads, prefill, entries, pool, padding=True, block_size=BS, ring=RING)


def _run(fn, dtype, q, wc, cc, pos, req, idx, lens, sinks, ends=None, fmt=FMT):
    out = torch.full(q.shape, float("nan"), dtype=dtype, device="cuda")
    fn(q.to(dtype), wc, cc, pos, req, idx, lens, ends, sinks, out, 512**-0.5, WINDOW, RING, fmt, fmt)
    return out


def _check(case, ends=None, fmt=FMT):
    got = _run(sparse_attn_cuda.sparse_attn, torch.bfloat16, *case, ends=ends, fmt=fmt)
    req = case[4]
    assert got.isfinite().all() and (got[req < 0] == 0).all(), "every row written, padding rows zero"
    testing.assert_close_to_ref(got, _run(sparse_attn_ref.sparse_attn, torch.float64, *case, ends=ends, fmt=fmt),
                                _run(sparse_attn_ref.sparse_attn, torch.bfloat16, *case, ends=ends, fmt=fmt),
                                what="csrc sparse_attn")
    return got


def _force_cta(monkeypatch, cta: int):
    """Runs every head count on the kernel with `cta` heads a CTA (128 heads: two 64-head CTAs a
    token), whatever the launch rule picks."""
    monkeypatch.setattr(sparse_attn_cuda, "cta_heads", lambda heads: cta)


# (heads, heads a CTA): 64 and 128 on sparse_attn.cu's 64-head CTAs, 32 and 24 on one with padding
# rows (the rule's pick for 17-32 heads); 8, 16 and 12 (a CTA of 16 partly empty) on small_heads.cu;
# 72: a 64-head CTA and a mostly empty one.
@pytest.mark.parametrize("heads,cta", [(64, 64), (128, 64), (8, 8), (16, 16), (12, 16), (32, 64), (24, 64), (72, 64)])
@pytest.mark.parametrize("prefill", [False, True], ids=["decode", "prefill"])
def test_matches_the_reference(heads, cta, prefill, monkeypatch):
    _force_cta(monkeypatch, cta)
    case = _case(heads, prefill)
    t = case[0].shape[0]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    # decode runs the split-KV path (merged in clusters or by the combine, as the rule picks), prefill the
    # single-split one
    splits, _ = sparse_attn_cuda.split_plan(t * -(-heads // cta), 128 + 512, sms, min(heads, cta),
                                            sparse_attn_cuda.tile_keys(cta))
    assert (splits > 1) == (not prefill)
    _check(case)


@pytest.mark.parametrize("heads", [64, 8])
def test_draft_block_window_ends(heads):
    """Draft blocks of 5 tokens: each token's window ends at its block's last position."""
    case = _case(heads, prefill=True)
    pos, req = case[3], case[4]
    live = req >= 0
    start, last = pos[live].min(), pos[live].max()
    ends = torch.where(live, torch.minimum(start + ((pos - start) // 5 + 1) * 5 - 1, last), 0).to(torch.int32)
    _check(case, ends=ends)


@pytest.mark.parametrize("heads", [64, 16, 128])
def test_long_entry_lists_split_many_ways(heads):
    """HCA-like: 4096 entries per token, few tokens: many splits merged by the combine kernel."""
    _check(_case(heads, prefill=False, entries=4096))


@pytest.mark.parametrize("heads", [64, 16])
def test_lists_much_wider_than_their_lengths(heads):
    """HCA at a large max_context: 8192-entry lists holding 0 to 300 real entries. Most splits hold
    no key of their token: they leave at once and the combine reads only the live ones."""
    case = list(_case(heads, prefill=False, entries=8192))
    lens = case[6]
    case[6] = (torch.arange(lens.numel(), device=lens.device, dtype=lens.dtype) * 37) % 301
    t = case[0].shape[0]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert sparse_attn_cuda.split_plan(t, 128 + 8192, sms)[0] > 8
    _check(tuple(case))


@pytest.mark.parametrize("heads", [64, 16, 8, 128])
def test_two_tokens_of_8192_entries_merge_over_a_hundred_splits(heads, monkeypatch):
    """HCA 1M-like: two tokens, full 8192-entry lists in 130 splits a token (forced: the rule picks
    52-65 here), so the combine's warps each merge several rounds of splits (a count no multiple of its
    warps)."""
    monkeypatch.setattr(sparse_attn_cuda, "split_plan", lambda *args, **kwargs: (130, False))
    case = _case(heads, prefill=False, entries=8192)
    keep = torch.tensor([5, 7], device="cuda")  # positions 1000 and 70000
    case = [x[keep] if i not in (1, 2, 7) else x for i, x in enumerate(case)]
    case[6] = torch.full_like(case[6], 8192)
    _check(tuple(case))


# (heads, heads a CTA, splits): the 64-head kernel's 32-key tiles in 2, 5 or 8 splits; small_heads.cu's
# 64-key tiles in 2, 3 or 8 (5 would round to 4 splits of 4 tiles).
@pytest.mark.parametrize("heads,cta,splits", [(h, 64, s) for h in (64, 32, 72, 128) for s in (2, 5, 8)]
                         + [(h, c, s) for h, c in ((8, 8), (16, 16), (12, 16)) for s in (2, 3, 8)])
@pytest.mark.parametrize("scores", ["rising", "spread"])
def test_splits_merge_in_their_cluster(heads, cta, splits, scores, monkeypatch):
    """8 tokens (one padding) of 896 entries (1024 keys) in 2 to 8 splits of 2 tiles or more, each
    token's splits merged in its cluster over distributed shared memory (no combine kernel; 32 heads: a
    64-head CTA of 32, 72 heads: a CTA of 8 live heads, 12: a 16-head CTA of 12; at 72 and 128 heads the
    16 clusters of 8 need not fit the device at once, and wait for each other's SMs). Cut comp_lens
    leave splits with no key (-inf log2-sums, nothing staged). "rising": q scaled by 16 and the entries
    ordered by head 0's score, lowest first, so the later splits hold the max and the first queries'
    sink weighs; "spread": q as drawn, so every split carries a share of each head's softmax and a
    split's weight taken wrong in the merge moves the output at every head count (the rising scores
    leave the first split next to nothing to weigh)."""
    _force_cta(monkeypatch, cta)
    monkeypatch.setattr(sparse_attn_cuda, "split_plan", lambda *args, **kwargs: (splits, True))
    keys, tile = 128 + 896, sparse_attn_cuda.tile_keys(cta)
    split_keys = -(-keys // splits // tile) * tile
    assert -(-keys // split_keys) == splits and split_keys >= 2 * tile
    _check(_rising_case(heads, False, 896) if scores == "rising" else _case(heads, False, 896))


@pytest.mark.parametrize("heads,cta", [(64, 64), (16, 16)])
@pytest.mark.parametrize("merge", [False, True], ids=["combine", "cluster"])
def test_forty_tokens_few_splits(heads, cta, merge, monkeypatch):
    """40 tokens of one request from position 0: the rule's 2 to 4 splits a token over 40 CTAs, merged
    by the combine's one-CTA-a-(token, head) kernel or in their clusters (forced either way); the first
    queries see a few window keys, so their sink weighs."""
    _force_cta(monkeypatch, cta)
    plan = sparse_attn_cuda.split_plan
    monkeypatch.setattr(sparse_attn_cuda, "split_plan", lambda *args, **kwargs: (plan(*args, **kwargs)[0], merge))
    q, wc, cc, pos, req, idx, lens, sinks = (x[:40] if i not in (1, 2, 7) else x
                                             for i, x in enumerate(_case(heads, prefill=True)))
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert 1 < plan(40, 128 + 512, sms, heads, sparse_attn_cuda.tile_keys(cta))[0] <= 4
    _check((q, wc, cc, pos - pos[0], req, idx, lens, sinks))


def test_cluster_capacity_and_its_checks():
    """The device's capacity for clusters of 2-8 whole-SM CTAs of each kernel falls as the clusters
    grow and never exceeds the SMs they need; a CTA size no kernel is built for, and a cluster merge of
    more splits than a portable cluster holds, are refused before any launch."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for cta in (8, 16, 64):
        cap = sparse_attn_cuda.cluster_capacity(torch.cuda.current_device(), cta)
        assert len(cap) == sparse_attn_cuda.MAX_CLUSTER_SPLITS + 1 and cap[:2] == (0, 0)
        assert all(0 < cap[s] * s <= sms and cap[s] >= cap[s + 1] for s in range(2, len(cap) - 1)), cap
    with pytest.raises(RuntimeError, match="splits: expected 1 to 8"):
        torch.ops.dsv4_csrc.cluster_capacity(64, 9)
    with pytest.raises(RuntimeError, match="cta_heads: expected 8, 16 or 64"):
        torch.ops.dsv4_csrc.cluster_capacity(32, 2)
    q, wc, cc, pos, req, idx, lens, sinks = _case(64, prefill=False)
    q = q.bfloat16()
    out = torch.full_like(q, float("nan"))
    page = formats.get(FMT).page_bytes(BS)
    with pytest.raises(RuntimeError, match="cluster_merge: expected 2 to 8 splits"):
        torch.ops.dsv4_csrc.sparse_attn(q, wc, cc, pos, req, idx, lens, sinks, out, out, out, 512**-0.5, WINDOW,
                                        RING, 0, 0, BS, BS, page, page, 128, 64, 10, 64, True)
    assert out.isnan().all(), "nothing launched"


@pytest.mark.parametrize("heads", [64, 8, 16, 32, 128])
@pytest.mark.parametrize("prefill", [False, True], ids=["decode", "prefill"])
def test_sink_and_rising_scores(heads, prefill):
    """Queries at positions below 16 see at most 16 window keys and no entry (the prefill chunk starts
    at position 0), so the sink holds much of their softmax: in the main kernel at one split
    (prefill), in the combine with several (decode). q is scaled by 16 and the other queries' entries
    are ordered by head 0's score, lowest first, so the running max passes its slack (8 in log2
    units) tile after tile and the accumulators must be rescaled. A dropped sink or a skipped
    rescale fails here at every head count."""
    _check(_rising_case(heads, prefill))


def _rising_case(heads: int, prefill: bool, entries: int = 512):
    q, wc, cc, pos, req, idx, lens, sinks = _case(heads, prefill, entries)
    if prefill:
        pos = pos - pos[0]
    lens = torch.where(pos < 16, 0, idx.shape[1]).to(torch.int32)
    q = (q.float() * 16).bfloat16()
    keys = torch.empty(idx.numel(), 512, dtype=torch.float32, device="cuda")
    quant_ref.unpack_kv(cc, idx.reshape(-1), keys, FMT)
    score = torch.einsum("td,ted->te", q[:, 0].float(), keys.view(*idx.shape, 512)).where(idx >= 0, -torch.inf)
    return q, wc, cc, pos, req, idx.gather(1, score.argsort(1)), lens, sinks


def test_combine_rounds_rescale(monkeypatch):
    """The combine's one-CTA-a-(token, head) kernel (8 tokens x 128 heads: 1024 pairs, too many for
    the spreading one on 132 SMs) over 34 splits a token, more than one round of its loads: with the
    entries ordered by score, lowest first, each round raises head 0's running max and must rescale
    what it summed."""
    monkeypatch.setattr(sparse_attn_cuda, "split_plan", lambda *args, **kwargs: (40, False))
    case = _rising_case(128, prefill=False, entries=2048)
    keys = 128 + 2048
    per_split = -(-keys // 40)
    split_keys = -(-per_split // 32) * 32  # the launcher's: whole 32-key tiles
    assert -(-keys // split_keys) == 34
    _check(case)


@pytest.mark.parametrize("heads", [64, 16, 128])
def test_run_to_run_bitwise_identical(heads):
    case = _case(heads, prefill=False)
    first = _run(sparse_attn_cuda.sparse_attn, torch.bfloat16, *case)
    again = _run(sparse_attn_cuda.sparse_attn, torch.bfloat16, *case)
    assert torch.equal(first, again)


def test_other_formats_run_the_triton_kernel():
    case = _case(64, prefill=False, pool=torch.bfloat16)
    wc, cc = case[1], case[2]
    assert not sparse_attn_cuda.serves(case[0], wc, cc, case[5], "exact", "exact")
    _check(case, fmt="exact")


@pytest.mark.parametrize("heads", [64, 16])
@pytest.mark.parametrize("tokens", [16, 132], ids=["split", "one-split"])
def test_one_key_returns_its_dequantized_row_bit_for_bit(tokens, heads):
    """Each token sees one key (position 0, no entries), q = 0 and no sink (-inf): its softmax weight
    is exactly 1, so its output is that key's row, and the kernel's e4m3 x UE8M0 -> bf16 conversion
    must equal the reference unpack bit for bit: every e4m3 code but the NaNs, subnormals included,
    in every dim, at scales 2^-27 .. 2^13 (bytes 100 .. 140)."""
    from dsv4ops.quant import formats
    from dsv4ops.quant.reference import unpack_kv

    f = formats.get(FMT)
    slots = torch.arange(tokens, dtype=torch.int32, device="cuda") * RING  # request r's position 0
    wc = builders.fill_pool(builders.page_pool(tokens * RING // BS, BS, 512, builders.FP8, device="cuda"), 512,
                           builders.FP8)
    rows = torch.arange(tokens, device="cuda")[:, None]
    codes = (torch.arange(448, device="cuda") + 37 * rows) % 256
    codes = torch.where(codes % 128 == 127, codes - 1, codes).to(torch.uint8)  # 0x7f / 0xff are NaN
    scales = (100 + (rows * 7 + torch.arange(8, device="cuda")) * 3 % 41).to(torch.uint8)
    page = wc.view(wc.shape[0], -1)
    blk, off = (slots // BS).long(), (slots % BS).long()
    page[blk[:, None], off[:, None] * f.data_bytes + torch.arange(448, device="cuda")] = codes
    page[blk[:, None], BS * f.data_bytes + off[:, None] * f.scale_bytes + torch.arange(8, device="cuda")] = scales
    expected = torch.empty(tokens, 512, dtype=torch.float32, device="cuda")
    unpack_kv(wc, slots, expected, FMT)
    expected = expected.bfloat16()
    assert expected.isfinite().all() and (expected[:, :448] == 0).float().mean() < 0.05

    q = torch.zeros(tokens, heads, 512, dtype=torch.bfloat16, device="cuda")
    pos = torch.zeros(tokens, dtype=torch.int32, device="cuda")
    idx = torch.empty(tokens, 0, dtype=torch.int32, device="cuda")
    sinks = torch.full((heads,), float("-inf"), device="cuda")
    out = _run(sparse_attn_cuda.sparse_attn, torch.bfloat16, q, wc, wc, pos, slots // RING, idx, pos, sinks)
    assert torch.equal(out, expected[:, None].expand_as(out))


# V4 with fp4 entries, V4.1, V4.1's sliding layers (csrc/sparse_attn/rows.cuh).
PAIRS = [("fp8_584", "fp4_288"), ("fp8_528", "fp4_288"), ("fp8_528", "fp8_528")]


def _pools(case, window_fmt: str, comp_fmt: str):
    """The case with its pools rebuilt in these formats (same blocks and slots, random rows); the
    sliding pair lists no entry (V4.1's sliding layers pass the window pool as comp_cache)."""
    q, wc, cc, pos, req, idx, lens, sinks = case
    wc = builders.fill_pool(builders.page_pool(wc.shape[0], BS, 512, window_fmt, "cuda"), 512, window_fmt)
    if comp_fmt == window_fmt:
        return q, wc, wc, pos, req, idx[:, :0].contiguous(), torch.zeros_like(lens), sinks
    cc = builders.fill_pool(builders.page_pool(cc.shape[0], BS, 512, comp_fmt, "cuda"), 512, comp_fmt)
    return q, wc, cc, pos, req, idx, lens, sinks


def _check_formats(case, window_fmt, comp_fmt, ends=None):
    got = torch.full(case[0].shape, float("nan"), dtype=torch.bfloat16, device="cuda")
    assert sparse_attn_cuda.serves(case[0], case[1], case[2], case[5], window_fmt, comp_fmt)

    def run(fn, dtype, out=None):
        out = torch.full(case[0].shape, float("nan"), dtype=dtype, device="cuda") if out is None else out
        q, wc, cc, pos, req, idx, lens, sinks = case
        fn(q.to(dtype), wc, cc, pos, req, idx, lens, ends, sinks, out, 512**-0.5, WINDOW, RING, window_fmt, comp_fmt)
        return out

    run(sparse_attn_cuda.sparse_attn, torch.bfloat16, got)
    req = case[4]
    assert got.isfinite().all() and (got[req < 0] == 0).all(), "every row written, padding rows zero"
    testing.assert_close_to_ref(got, run(sparse_attn_ref.sparse_attn, torch.float64),
                                run(sparse_attn_ref.sparse_attn, torch.bfloat16), what=f"{window_fmt}/{comp_fmt}")


@pytest.mark.parametrize("window_fmt,comp_fmt", PAIRS)
@pytest.mark.parametrize("heads", [64, 8, 16, 32, 128])
@pytest.mark.parametrize("prefill", [False, True], ids=["decode", "prefill"])
def test_low_bit_formats_match_the_reference(window_fmt, comp_fmt, heads, prefill):
    _check_formats(_pools(_case(heads, prefill), window_fmt, comp_fmt), window_fmt, comp_fmt)


@pytest.mark.parametrize("window_fmt,comp_fmt", PAIRS[1:])
@pytest.mark.parametrize("heads", [64, 16])
def test_low_bit_formats_draft_windows_and_long_lists(window_fmt, comp_fmt, heads):
    """Draft blocks of 5 (window ends at the block's last position), and 4096-entry lists with
    lengths 0..300 (many splits, most empty)."""
    case = _pools(_case(heads, prefill=True), window_fmt, comp_fmt)
    pos, req = case[3], case[4]
    live = req >= 0
    start, last = pos[live].min(), pos[live].max()
    ends = torch.where(live, torch.minimum(start + ((pos - start) // 5 + 1) * 5 - 1, last), 0).to(torch.int32)
    _check_formats(case, window_fmt, comp_fmt, ends=ends)
    case = list(_pools(_case(heads, prefill=False, entries=4096), window_fmt, comp_fmt))
    case[6] = ((torch.arange(case[6].numel(), device="cuda") * 37) % 301).to(torch.int32)
    _check_formats(tuple(case), window_fmt, comp_fmt)


@pytest.mark.parametrize("window_fmt,comp_fmt", PAIRS[:2])
def test_low_bit_formats_at_1m_positions(window_fmt, comp_fmt):
    """Decode tokens at positions up to 2^20 - 1 (full windows wrapping the ring) beside cut-short
    windows at 0 and 5."""
    case = list(_pools(_case(64, prefill=False), window_fmt, comp_fmt))
    case[3] = torch.tensor([0, 5, (1 << 20) - 1, (1 << 20) - 128, 524287, 1 << 19, 999999, 70000], dtype=torch.int32,
                           device="cuda")
    _check_formats(tuple(case), window_fmt, comp_fmt)


def test_one_fp4_entry_returns_half_its_row_bit_for_bit():
    """Each token sees its window row (position 0, stored as zeros) and one fp4_288 entry, q = 0, no
    sink: both weigh 1/2, so the output is half the entry's row, and the kernel's e2m1 x e4m3 -> bf16
    conversion must equal the reference unpack bit for bit: every nibble (both signs, both nibble
    positions) under every e4m3 scale code but NaN, subnormal scales and negative ones included."""
    from dsv4ops.quant import formats
    from dsv4ops.quant.reference import pack_kv, unpack_kv

    tokens, heads, f = 16, 64, formats.get("fp4_288")
    wc = builders.page_pool(tokens * RING // BS, BS, 512, "fp8_528", "cuda")
    win_slots = torch.arange(tokens, dtype=torch.int32, device="cuda") * RING  # request r's position 0
    pack_kv(torch.zeros(tokens, 512, device="cuda"), win_slots, wc, "fp8_528")
    cc = builders.page_pool(-(-tokens // BS), BS, 512, "fp4_288", "cuda")
    rows = torch.arange(tokens, device="cuda")[:, None]
    data = ((torch.arange(256, device="cuda") + 29 * rows) % 256).to(torch.uint8)
    scales = (torch.arange(32, device="cuda") + 32 * rows) % 256
    scales = torch.where(scales % 128 == 127, scales - 1, scales).to(torch.uint8)  # 0x7f / 0xff are NaN
    page = cc.view(cc.shape[0], -1)
    blk, off = rows // BS, rows % BS
    page[blk, off * f.data_bytes + torch.arange(256, device="cuda")] = data
    page[blk, BS * f.data_bytes + off * f.scale_bytes + torch.arange(32, device="cuda")] = scales
    slots = torch.arange(tokens, dtype=torch.int32, device="cuda")
    expected = torch.empty(tokens, 512, dtype=torch.float32, device="cuda")
    unpack_kv(cc, slots, expected, "fp4_288")
    assert expected.isfinite().all() and (expected != 0).float().mean() > 0.8
    expected = (expected / 2).bfloat16()

    q = torch.zeros(tokens, heads, 512, dtype=torch.bfloat16, device="cuda")
    pos = torch.zeros(tokens, dtype=torch.int32, device="cuda")
    sinks = torch.full((heads,), float("-inf"), device="cuda")
    out = torch.full(q.shape, float("nan"), dtype=torch.bfloat16, device="cuda")
    sparse_attn_cuda.sparse_attn(q, wc, cc, pos, win_slots // RING, slots[:, None].contiguous(),
                                 torch.ones_like(pos), None, sinks, out, 512**-0.5, WINDOW, RING, "fp8_528", "fp4_288")
    assert torch.equal(out, expected[:, None].expand_as(out))


def test_one_fp8_528_key_returns_its_dequantized_row_bit_for_bit():
    """As the fp8_584 test: one window row (position 0), q = 0, no sink; every e4m3 code but NaN in
    every dim, under UE8M0 scales 2^-27 .. 2^13, one per 32 dims."""
    from dsv4ops.quant import formats
    from dsv4ops.quant.reference import unpack_kv

    tokens, heads, f = 16, 64, formats.get("fp8_528")
    slots = torch.arange(tokens, dtype=torch.int32, device="cuda") * RING
    wc = builders.page_pool(tokens * RING // BS, BS, 512, "fp8_528", "cuda")
    rows = torch.arange(tokens, device="cuda")[:, None]
    codes = (torch.arange(512, device="cuda") + 37 * rows) % 256
    codes = torch.where(codes % 128 == 127, codes - 1, codes).to(torch.uint8)
    scales = (100 + (rows * 7 + torch.arange(16, device="cuda")) * 3 % 41).to(torch.uint8)
    page = wc.view(wc.shape[0], -1)
    blk, off = (slots // BS).long()[:, None], (slots % BS).long()[:, None]
    page[blk, off * f.data_bytes + torch.arange(512, device="cuda")] = codes
    page[blk, BS * f.data_bytes + off * f.scale_bytes + torch.arange(16, device="cuda")] = scales
    expected = torch.empty(tokens, 512, dtype=torch.float32, device="cuda")
    unpack_kv(wc, slots, expected, "fp8_528")
    expected = expected.bfloat16()
    q = torch.zeros(tokens, heads, 512, dtype=torch.bfloat16, device="cuda")
    pos = torch.zeros(tokens, dtype=torch.int32, device="cuda")
    idx = torch.empty(tokens, 0, dtype=torch.int32, device="cuda")
    sinks = torch.full((heads,), float("-inf"), device="cuda")
    out = torch.full(q.shape, float("nan"), dtype=torch.bfloat16, device="cuda")
    sparse_attn_cuda.sparse_attn(q, wc, wc, pos, slots // RING, idx, pos, None, sinks, out, 512**-0.5, WINDOW, RING,
                                 "fp8_528", "fp8_528")
    assert torch.equal(out, expected[:, None].expand_as(out))
