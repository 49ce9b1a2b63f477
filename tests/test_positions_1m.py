"""Positions near 2^20 (V4's 1M context) through the CPU reference kernels, for CSA and HCA: the
compressor closing entries 262143 (CSA) and 8191 (HCA) from a state ring written before the step,
the indexer's top-k over all 262,144 visible CSA entries (the newest one visible only from its
closing token on), and HCA attention over all 8,192 entries. Expected values are written here; RoPE
angles are fp32(p) x inv_freq in fp32 (tests/test_fuzz_ops.rope64)."""

import builders
import pytest
import torch
from test_fuzz_ops import rope64
from test_sparse_attn import _dense_sink_attention

from dsv4ops import testing as T
from dsv4ops.compressor.api import compressor_update
from dsv4ops.indexer.api import indexer_topk
from dsv4ops.quant.api import unpack_kv
from dsv4ops.sparse_attn.api import sparse_attn

I32, M = torch.int32, 1 << 20
EPS = 1e-6


@pytest.mark.parametrize("ratio, overlap", [(4, True), (128, False)], ids=["csa", "hca"])
def test_compressor_closes_entries_near_1m(ratio, overlap):
    """One request continues at p0 = 2^20 - 2m - 3 with 2m + 3 tokens (two entries close: the
    last two of a 1M context); the rows before p0 that those entries pool come from the state ring,
    filled with random (a, z + ape) rows as an earlier step would have."""
    d, coff = 16, 2 if overlap else 1
    width, rows = coff * d, coff * ratio
    g = torch.Generator().manual_seed(ratio)
    p0 = M - 2 * ratio - 3
    n = M - p0
    pos = torch.arange(p0, M, dtype=I32)
    req = torch.zeros(n, dtype=I32)
    a, z = torch.randn(n, width, generator=g), torch.randn(n, width, generator=g)
    ape = torch.randn(ratio, width, generator=g)
    state = torch.randn(1, rows, 2 * width, generator=g)
    before = state.clone()
    norm = 1 + 0.1 * torch.randn(d, generator=g)
    inv_freq = builders.rope_table(8)
    closes = (pos + 1) % ratio == 0
    # One 4-entry block holds the request's last entries: entry w at its offset w % 4 (as a block table pages it).
    entry_slots = torch.where(closes, pos // ratio % 4, -1).to(I32)
    cache = builders.page_pool(1, 4, d, torch.float32)
    compressor_update(a, z, ape, pos, req, entry_slots, norm, inv_freq, state, cache, EPS, "exact")

    def row(q: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(a_q, z_q + ape[q % m]) of position q: the step's token, or the state ring before the step."""
        if q >= p0:
            return a[q - p0], z[q - p0] + ape[q % ratio]
        return before[0, q % rows, :width], before[0, q % rows, width:]

    def entries(dtype) -> torch.Tensor:
        """Each closing token's entry, in `dtype` (fp64: the reference; fp32: its budget run)."""
        out = []
        for p in pos[closes].tolist():
            slots = [row(q) for q in range(p - rows + 1, p + 1)]
            if overlap:  # window w - 1's a-stream, then window w's b-stream
                sa = torch.stack([s[0][:d] for s in slots[:ratio]] + [s[0][d:] for s in slots[ratio:]])
                sz = torch.stack([s[1][:d] for s in slots[:ratio]] + [s[1][d:] for s in slots[ratio:]])
            else:
                sa, sz = torch.stack([s[0] for s in slots]), torch.stack([s[1] for s in slots])
            sa, sz = sa.to(dtype), sz.to(dtype)
            c = (torch.softmax(sz, 0) * sa).sum(0)
            c = c * torch.rsqrt(c.square().mean() + EPS) * norm.to(dtype)
            at = torch.tensor([p // ratio * ratio])
            out.append((rope64 if dtype == torch.float64 else builders.complex_rope)(c[None], at, inv_freq)[0])
        return torch.stack(out)

    got = unpack_kv(cache, entry_slots[closes], d, torch.float32, "exact")
    assert pos[closes][-1] // ratio == M // ratio - 1  # the last entry of a 1M context
    T.assert_close_to_ref(got, entries(torch.float64), entries(torch.float32), what="entries near 1M")
    # The state ring now holds the step's last `rows` tokens.
    for q in range(M - rows, M):
        assert torch.equal(state[0, q % rows], torch.cat([a[q - p0], z[q - p0] + ape[q % ratio]]))


def test_indexer_topk_over_all_262144_entries_at_1m():
    """Tokens at 2^20 - 2 (262,143 visible entries) and 2^20 - 1 (262,144: the newest, which both
    tokens score highest, becomes visible); blocks of the table in reverse physical order."""
    ratio, bs, d, heads, k = 4, 64, 16, 2, 8
    n = M // ratio
    blocks = n // bs
    g = torch.Generator().manual_seed(1)
    keys = torch.randn(n, d, generator=g)
    q = torch.randn(2, heads, d, generator=g)
    keys[-1] = (q[0] + q[1]).sum(0) * 4  # the newest entry: the best score of both tokens
    table = torch.arange(blocks - 1, -1, -1, dtype=I32)[None]
    pool = torch.empty(blocks, bs, d)
    pool[table[0].long()] = keys.view(blocks, bs, d)
    w = torch.rand(2, heads, generator=g) + 0.5
    pos, req = torch.tensor([M - 2, M - 1], dtype=I32), torch.zeros(2, dtype=I32)
    idx = indexer_topk(q, w, pos, req, pool, table, k, ratio, "exact")
    block_of = {int(b): i for i, b in enumerate(table[0])}
    entries = torch.tensor([[block_of[s // bs] * bs + s % bs for s in row] for row in idx.tolist()])
    def scores(dtype):
        return (torch.einsum("thd,nd->thn", q.to(dtype), keys.to(dtype)).relu() * w.to(dtype)[..., None]).sum(1)

    s64 = scores(torch.float64)
    assert (s64.argmax(1) == n - 1).all()
    noise = (scores(torch.float32).double() - s64).abs().max().item()  # the scores' fp32 error
    s64[0, -1] = float("-inf")  # entry 262143 closes at position 2^20 - 1: invisible to token 0
    T.assert_topk_within(entries, s64, k, 2 * noise)
    assert n - 1 in entries[1].tolist() and n - 1 not in entries[0].tolist()


def test_hca_attention_over_8192_entries_at_1m():
    """The last token of a 1M context attends to its 128-token window (ring slots of positions
    2^20 - 128 .. 2^20 - 1) and all 8,192 HCA entries."""
    ring, window, d, heads, n = 256, 128, 16, 2, M // 128
    g = torch.Generator().manual_seed(2)
    window_cache = builders.fill_pool(builders.page_pool(ring // 64, 64, d, torch.float32), d, torch.float32)
    comp_cache = builders.fill_pool(builders.page_pool(n // 64, 64, d, torch.float32), d, torch.float32)
    q, sinks = torch.randn(1, heads, d, generator=g), torch.randn(heads, generator=g)
    pos, req = torch.tensor([M - 1], dtype=I32), torch.zeros(1, dtype=I32)
    comp_idx = torch.randperm(n, generator=g).to(I32)[None]
    out = sparse_attn(q, window_cache, comp_cache, pos, req, comp_idx, sinks, d**-0.5, window, ring, "exact", "exact")
    win = unpack_kv(window_cache, torch.tensor([p % ring for p in range(M - window, M)], dtype=I32), d,
                    torch.float32, "exact")
    comp = unpack_kv(comp_cache, comp_idx[0], d, torch.float32, "exact")
    keys = torch.cat([win, comp])
    ref64 = _dense_sink_attention(q[0].double(), keys.double(), sinks, d**-0.5)
    T.assert_close_to_ref(out[0], ref64, _dense_sink_attention(q[0], keys, sinks, d**-0.5), what="HCA at 1M")
