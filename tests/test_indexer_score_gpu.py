"""GPU (sm_90): the indexer's wgmma scoring kernel (csrc/indexer/score.cu, `dsv4_csrc::topk_score`),
for fp8_132 keys with e4m3 queries and mxfp4_68 keys with MX4 queries, against an independent
float64 formulation: every key row (and MX4 query) decoded by the reference codec, score =
sum_h w_h relu(q_h . k_e), each column's entry found through the block table (or V4.1's candidate
blocks) by hand. The keys the kernel writes are decoded back to scores and compared within a budget
from the data: Hopper's e4m3 wgmma accumulates with about 14 significant bits (DeepGEMM's note), so
each of the four k32 steps may round at 2^-13 of the running sum, bounded by 2^-11 of the sum of
|terms| of a score. The workspace is poisoned first: every column of a token's row is written
(key 0 = no entry: past its visible entries, an unallocated block, a padding token, an unlisted
candidate block) and nothing else is."""

import builders
import pytest
import torch

from dsv4ops import csrc
from dsv4ops.indexer import workspace as ws
from dsv4ops.quant import codecs, formats
from dsv4ops.quant import reference as quant_ref

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                                 reason="needs an sm_90 GPU (the wgmma scoring kernel)")]

DEV = "cuda"
BS = {"fp8_132": 64, "mxfp4_68": 128}  # entries a page (mxfp4_68 pages are padded to 512 B: 128 x 68 fits)
RATIO = 4
POISON = 0x5A5A5A5A


def _scores_of(keys: torch.Tensor) -> torch.Tensor:
    """The inverse of the kernel's key order: uint32 keys (int32 storage) -> float64 scores."""
    k = keys.long() & 0xFFFFFFFF
    bits = torch.where(k >= 1 << 31, k - (1 << 31), (~k) & 0xFFFFFFFF)
    return (bits - (bits >> 31 << 32)).to(torch.int32).view(torch.float32).double()


def _case(t: int, heads: int, pages: int, g: torch.Generator, fmt: str = "fp8_132", q_span: int = 12):
    """Two requests over a shuffled pool of pages with one unallocated page each; keys of varied
    magnitude (their power-of-two scales differ; mxfp4_68: per 32-dim group too), e4m3 queries (MX4
    rows whose groups' magnitudes spread over q_span binades: <= 8 keeps every head's group scales
    foldable into its codes, 12 leaves heads that are not, the kernel's other path), weights of both
    signs and a zero."""
    bs = BS[fmt]
    n = pages * bs
    table = torch.randperm(2 * pages, device=DEV, generator=g).to(torch.int32).view(2, pages)
    table[0, 1] = -1
    table[1, pages - 1] = -1
    cache = builders.page_pool(2 * pages, bs, 128, fmt, device=DEV)
    rows = torch.randn(2 * n, 128, device=DEV, generator=g)
    rows = rows * torch.rand(2 * n, 1, device=DEV, generator=g).mul(6).exp2()
    if fmt == "mxfp4_68":
        rows = rows * torch.rand(2 * n, 4, device=DEV, generator=g).mul(12).sub(6).exp2().repeat_interleave(32, 1)
    quant_ref.pack_kv(rows, torch.arange(2 * n, dtype=torch.int32, device=DEV), cache, fmt)
    q = torch.randn(t, heads, 128, device=DEV, generator=g) * 4
    if fmt == "mxfp4_68":
        q = q * torch.rand(t, heads, 4, device=DEV, generator=g).sub(0.5).mul(q_span).exp2().repeat_interleave(32, 2)
        data, scales = codecs.encode("mxfp4_68", q.reshape(-1, 128))
        q = torch.cat([data, scales], 1).view(t, heads, 68)
    else:
        q = q.to(torch.float8_e4m3fn)
    w = torch.randn(t, heads, device=DEV, generator=g)
    w[:, 0] = 0.0
    pos = torch.randint(0, n * RATIO + 40, (t,), device=DEV, generator=g).to(torch.int32)
    pos[:3] = torch.tensor([0, RATIO - 1, 67 * RATIO + 1], dtype=torch.int32)  # 0, 1 and 67 entries
    req = torch.randint(0, 2, (t,), device=DEV, generator=g).to(torch.int32)
    req[3] = -1  # padding
    return q, w, pos, req, cache, table


def _page_bytes(fmt: str) -> int:
    return formats.get(fmt).page_bytes(BS[fmt])


def _expected(q, w, pos, req, cache, table, cand, cb: int, fmt: str = "fp8_132"):
    """[t, columns] float64 scores and the columns' visibility; columns = the request's entries, or
    the candidate columns cand[j] * cb + i (listed blocks first)."""
    bs = BS[fmt]
    t, n = q.shape[0], table.shape[1] * bs
    slots = torch.arange(cache.shape[0] * bs, dtype=torch.int32, device=DEV)
    keys = torch.empty(slots.numel(), 128, device=DEV)
    quant_ref.unpack_kv(cache, slots, keys, fmt)
    if fmt == "mxfp4_68":
        rows = q.reshape(-1, 68)
        q = codecs.decode("mxfp4_68", rows[:, :64], rows[:, 64:]).view(t, -1, 128)
    if cand is None:
        entries = torch.arange(n, device=DEV).expand(t, n)
        listed = torch.full((t, n), True, device=DEV)
    else:
        entries = (cand.long()[:, :, None] * cb + torch.arange(cb, device=DEV)).flatten(1)
        listed = (cand >= 0).repeat_interleave(cb, 1)
    n_vis = torch.where(req >= 0, ((pos.long() + 1) // RATIO).clamp(max=n), 0)
    page = table[req.clamp(min=0).long()].long().gather(1, (entries.clamp(0, n - 1) // bs))
    vis = listed & (entries < n_vis[:, None]) & (page >= 0) & (req[:, None] >= 0)
    slot = (page.clamp(min=0) * bs + entries.clamp(min=0) % bs)
    k = keys.double()[slot]  # [t, columns, 128]
    qd = q.double()
    terms = torch.einsum("thd,tcd->tch", qd, k)
    score = (terms.relu() * w.double()[:, None, :]).sum(-1)
    size = torch.einsum("thd,tcd->tch", qd.abs(), k.abs()).mul(w.double().abs()[:, None, :]).sum(-1)
    return score, size, vis, listed.sum(1) * (req >= 0)


def _check(got_rows, score, size, vis, n_cols):
    for i in range(got_rows.shape[0]):
        n = int(n_cols[i]) if n_cols is not None else score.shape[1]
        row = got_rows[i]
        assert (row[n:] == POISON).all(), f"token {i}: wrote past its {n} columns"
        keys = row[:n]
        assert ((keys == 0) == ~vis[i, :n]).all(), f"token {i}: key 0 exactly where no entry is visible"
        v = vis[i, :n]
        err = (_scores_of(keys[v]) - score[i, :n][v]).abs()
        budget = 2.0**-11 * size[i, :n][v]
        assert (err <= budget).all(), f"token {i}: score off by {(err - budget).max().item():.3g} over budget"


@pytest.mark.parametrize("programs", [1, 3, 0])
@pytest.mark.parametrize("fmt,heads,q_span", [("fp8_132", 4, 0), ("fp8_132", 32, 0), ("fp8_132", 64, 0),
                                              ("fp8_132", 128, 0), ("mxfp4_68", 4, 12), ("mxfp4_68", 16, 12),
                                              ("mxfp4_68", 32, 12), ("mxfp4_68", 32, 7), ("mxfp4_68", 16, 7)])
def test_scores_match_float64(fmt, heads, q_span, programs):
    # programs 1 and 3: many tiles a CTA (the ring wraps around its stages); 0: one CTA per tile.
    # Each launched row also gets 32 words zeroed 8 words after its keys (the grid select's state).
    g = torch.Generator(device=DEV).manual_seed(heads + programs)
    t, pages, k = 12, 9, 64
    q, w, pos, req, cache, table = _case(t, heads, pages, g, fmt, q_span)
    n = pages * BS[fmt]
    row_words = ws.layout(n, k)[3] + 40
    t0, launch = 2, t - 3  # tokens 2 .. 10: rows outside the launch stay poisoned
    work = torch.full((t * row_words,), POISON, dtype=torch.int32, device=DEV)
    csrc.load()
    tiles = -(-n // 64)
    torch.ops.dsv4_csrc.topk_score(q, w, pos, req, cache, table, table, work, t0, launch, row_words,
                                   programs or tiles, n, RATIO, BS[fmt], _page_bytes(fmt), 1, 0, n + 8, 32)
    rows = work.view(t, row_words)
    score, size, vis, _ = _expected(q, w, pos, req, cache, table, None, 1, fmt)
    n_cols = torch.where(req >= 0, ((pos.long() + 1) // RATIO).clamp(max=n), 0)
    _check(rows[:launch, :n + 8], score[t0:t0 + launch], size[t0:t0 + launch], vis[t0:t0 + launch],
           n_cols[t0:t0 + launch])
    assert (rows[:launch, n + 8:] == 0).all()
    assert (rows[launch:] == POISON).all()


@pytest.mark.parametrize("fmt,heads", [("fp8_132", 64), ("mxfp4_68", 32)])
def test_candidate_columns_match_float64(fmt, heads):  # mxfp4_68: query groups over 7 binades (folded)
    # V4.1's candidate entries: listed blocks of cb entries (any order, -1 after them), entries past
    # the token's visible ones and unallocated pages inside listed blocks.
    g = torch.Generator(device=DEV).manual_seed(7)
    t, pages, cb, k = 10, 8, 16, 32
    q, w, pos, req, cache, table = _case(t, heads, pages, g, fmt, q_span=7)
    n = pages * BS[fmt]
    n_cand = 20
    cand = torch.stack([torch.randperm(n // cb, device=DEV, generator=g)[:n_cand] for _ in range(t)]).to(torch.int32)
    cand[0, 5:] = -1
    cand[1, :] = -1
    row_words = ws.layout(n, k, n_cand * cb)[3]
    work = torch.full((t * row_words,), POISON, dtype=torch.int32, device=DEV)
    csrc.load()
    torch.ops.dsv4_csrc.topk_score(q, w, pos, req, cache, table, cand, work, 0, t, row_words, 5, n, RATIO,
                                   BS[fmt], _page_bytes(fmt), cb, 1, n_cand * cb, 0)
    score, size, vis, n_cols = _expected(q, w, pos, req, cache, table, cand, cb, fmt)
    _check(work.view(t, row_words), score, size, vis, n_cols)


def test_bad_layout_is_refused_and_the_workspace_kept():
    g = torch.Generator(device=DEV).manual_seed(3)
    q, w, pos, req, cache, table = _case(4, 64, 2, g)
    work = torch.full((4 * 128,), POISON, dtype=torch.int32, device=DEV)
    csrc.load()
    bs, pb = BS["fp8_132"], _page_bytes("fp8_132")
    args = (pos, req, cache, table, table, work, 0, 4, 128, 1, 128, RATIO, bs, pb, 1, 0, 128, 0)
    with pytest.raises(RuntimeError, match="q: expected e4m3"):
        torch.ops.dsv4_csrc.topk_score(q.float(), w, *args)
    with pytest.raises(RuntimeError, match="workspace: expected 1024"):
        torch.ops.dsv4_csrc.topk_score(q, w, pos, req, cache, table, table, work, 0, 4, 256, 1, 128, RATIO, bs, pb, 1,
                                       0, 128, 0)
    with pytest.raises(RuntimeError, match="block_size"):
        torch.ops.dsv4_csrc.topk_score(q, w, pos, req, cache, table, table, work, 0, 4, 128, 1, 128, RATIO, 6, pb, 1,
                                       0, 128, 0)
    with pytest.raises(RuntimeError, match="q: expected e4m3"):  # MX4 rows of more heads than the kernel keeps
        torch.ops.dsv4_csrc.topk_score(torch.zeros(4, 64, 68, dtype=torch.uint8, device=DEV), w, *args)
    with pytest.raises(RuntimeError, match="zero_at / zero_words"):  # past the row
        torch.ops.dsv4_csrc.topk_score(q, w, pos, req, cache, table, table, work, 0, 4, 128, 1, 120, RATIO, bs, pb, 1,
                                       0, 120, 16)
    torch.cuda.synchronize()
    assert (work == POISON).all()


def test_mx4_scores_at_1m_positions():
    """Rows of 262144 entries (ratio 4 at positions up to 2^20): the MX4 scoring's tile walk and page
    arithmetic at the longest context, against float64."""
    g = torch.Generator(device=DEV).manual_seed(11)
    t, heads, fmt = 4, 32, "mxfp4_68"
    pages = (1 << 20) // RATIO // BS[fmt]
    q, w, pos, req, cache, table = _case(t, heads, pages, g, fmt, q_span=7)
    pos[:] = torch.tensor([(1 << 20) - 1, (1 << 20) - 2, 524287, 0], dtype=torch.int32)
    n = pages * BS[fmt]
    row_words = ws.layout(n, 512)[3]
    work = torch.full((t * row_words,), POISON, dtype=torch.int32, device=DEV)
    csrc.load()
    torch.ops.dsv4_csrc.topk_score(q, w, pos, req, cache, table, table, work, 0, t, row_words, 396, n, RATIO,
                                   BS[fmt], _page_bytes(fmt), 1, 0, n, 0)
    score, size, vis, _ = _expected(q, w, pos, req, cache, table, None, 1, fmt)
    n_cols = torch.where(req >= 0, ((pos.long() + 1) // RATIO).clamp(max=n), 0)
    _check(work.view(t, row_words)[:, :n], score, size, vis, n_cols)
