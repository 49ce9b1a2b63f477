"""Hypothesis fuzzing of the public functions: random token counts (0 included: an empty step),
heads, dtypes, positions up to and past 2^20, padding tokens, requests of one token, index rows
that are all -1; each result against a formulation written here (or in tests/format_model.py),
and every bad value (a negative position, a request slot or index out of range) rejected with a
ValueError that leaves the caches as they were.

RoPE expected values take the angle as transformers does, fp32(position) x inv_freq in fp32 (at
2^20 that product carries ~0.03 rad of fp32 rounding, the same in every implementation), and rotate
in fp64; the budget is builders.complex_rope run in the op's dtype."""

import builders
import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from test_sparse_attn import _dense_sink_attention
from test_visible_entries import expected_entries

import format_model as M
from dsv4ops import testing as T
from dsv4ops.indexer.api import indexer_q_prep, indexer_topk
from dsv4ops.inv_rope.api import inv_rope
from dsv4ops.qkv_prep.api import qkv_prep
from dsv4ops.quant.api import pack_kv, unpack_kv
from dsv4ops.sparse_attn.api import sparse_attn
from dsv4ops.visible_entries.api import visible_entries

I32 = torch.int32
MILLION = 1 << 20
FUZZ = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
POSITION = st.one_of(st.integers(0, 300), st.integers(MILLION - 300, MILLION + 300))
DTYPE = st.sampled_from([torch.float32, torch.bfloat16])


def rope64(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """RoPE of the trailing 2n channels (interleaved pairs) in fp64, angle fp32(p) * inv_freq in fp32."""
    n = inv_freq.shape[0]
    angle = (positions.float()[:, None] * inv_freq.float()).double()
    angle = angle.view(angle.shape[0], *([1] * (x.dim() - 2)), n)
    if inverse:
        angle = -angle
    a, b = x[..., -2 * n::2].double(), x[..., -2 * n + 1::2].double()
    rot = torch.stack([a * angle.cos() - b * angle.sin(), a * angle.sin() + b * angle.cos()], -1).flatten(-2)
    return torch.cat([x[..., :-2 * n].double(), rot], -1)


def _runs(draw, requests: int, ring: int, window: int):
    """Token runs (request, first position, count) of 1..ring - window + 1 tokens, then padding."""
    runs = []
    for r in range(draw(st.integers(0, requests))):
        runs.append((r, draw(POSITION), draw(st.integers(1, ring - window + 1))))
    return runs, draw(st.integers(0, 2))


@FUZZ
@given(t=st.integers(0, 5), h=st.integers(1, 3), dtype=DTYPE, data=st.data())
def test_inv_rope(t, h, dtype, data):
    pos = torch.tensor(data.draw(st.lists(POSITION, min_size=t, max_size=t)), dtype=I32)
    o = torch.randn(t, h, 24, dtype=dtype)
    inv_freq = builders.rope_table(8)
    out = inv_rope(o, pos, inv_freq)
    assert out.shape == o.shape and out.dtype == dtype
    if t:
        T.assert_close_to_ref(out, rope64(o, pos, inv_freq, inverse=True),
                              builders.complex_rope(o, pos, inv_freq, inverse=True), what="inv_rope")
    if t and data.draw(st.booleans()):
        pos[data.draw(st.integers(0, t - 1))] = -1
        with pytest.raises(ValueError, match=r"positions: expected >= 0 \(token positions\), got -1"):
            inv_rope(o, pos, inv_freq)


@FUZZ
@given(h=st.integers(1, 3), dtype=DTYPE, data=st.data())
def test_qkv_prep(h, dtype, data):
    ring, dim, requests = 8, 16, 2
    runs, pad = _runs(data.draw, requests, ring, 1)
    pos, req = builders.step_tokens(*runs, pad=pad)
    t = pos.shape[0]
    q, kv = torch.randn(t, h, dim, dtype=dtype), torch.randn(t, dim, dtype=dtype)
    inv_freq = builders.rope_table(8)
    pool = builders.page_pool(requests * ring // 4, 4, dim, torch.float32)  # NaN: never written
    bad = t and data.draw(st.booleans())
    if bad:  # a request slot past the pool's requests: rejected, nothing written
        req[data.draw(st.integers(0, t - 1))] = requests
        with pytest.raises(ValueError, match=r"req_slots: expected values in \[-1, 2\)"):
            qkv_prep(q, kv, pos, req, inv_freq, pool, ring, 1e-6, "exact")
        assert pool.isnan().all()
        return
    q_out = qkv_prep(q, kv, pos, req, inv_freq, pool, ring, 1e-6, "exact")
    if not t:
        assert q_out.shape == (0, h, dim) and pool.isnan().all()
        return
    normed = q.double() * torch.rsqrt(q.double().square().mean(-1, keepdim=True) + 1e-6)
    lowp = q * torch.rsqrt(q.float().square().mean(-1, keepdim=True) + 1e-6).to(dtype)
    T.assert_close_to_ref(q_out, rope64(normed, pos, inv_freq), builders.complex_rope(lowp, pos, inv_freq), what="q_out")
    live = req >= 0
    slots = (req.long() * ring + pos.long() % ring)[live]
    rows = unpack_kv(pool, torch.arange(requests * ring, dtype=I32), dim, torch.float32, "exact")
    written = ~rows.isnan().any(1)
    assert sorted(written.nonzero().flatten().tolist()) == sorted(slots.tolist())  # live tokens' slots only
    if live.any():
        T.assert_close_to_ref(rows[slots], rope64(kv[live], pos[live], inv_freq),
                              builders.complex_rope(kv[live], pos[live], inv_freq), what="window rows")


@FUZZ
@given(ratio=st.sampled_from([1, 4, 128]), block_size=st.sampled_from([1, 3, 64]), t=st.integers(0, 5),
       data=st.data())
def test_visible_entries(ratio, block_size, t, data):
    requests, blocks = data.draw(st.integers(1, 3)), data.draw(st.integers(0, 3))
    table = torch.tensor(data.draw(st.lists(st.integers(-1, 40), min_size=requests * blocks,
                                            max_size=requests * blocks)), dtype=I32).view(requests, blocks)
    full = blocks * block_size * ratio  # the first position past which every column is visible
    pos = torch.tensor(data.draw(st.lists(st.one_of(POSITION, st.integers(0, full + ratio)), min_size=t, max_size=t)),
                       dtype=I32)
    req = torch.tensor(data.draw(st.lists(st.integers(-1, requests - 1), min_size=t, max_size=t)), dtype=I32)
    if t and data.draw(st.booleans()):  # a request slot past the table: rejected
        req[data.draw(st.integers(0, t - 1))] = requests
        with pytest.raises(ValueError, match=rf"req_slots: expected values in \[-1, {requests}\)"):
            visible_entries(table, pos, req, ratio, block_size, 41)
        return
    if bool(((req >= 0) & ((pos.long() + 1) // ratio > blocks * block_size)).any()):  # entries past the table
        with pytest.raises(ValueError, match=r"block_table: expected \d+ blocks for the \d+ visible entries"):
            visible_entries(table, pos, req, ratio, block_size, 41)
        return
    out = visible_entries(table, pos, req, ratio, block_size, 41)  # the table's blocks are drawn from 41
    assert torch.equal(out, expected_entries(table, pos, req, ratio, block_size))


@FUZZ
@given(t=st.integers(0, 4), h=st.integers(1, 3), dtype=DTYPE, data=st.data())
def test_indexer_q_prep(t, h, dtype, data):
    pos = torch.tensor(data.draw(st.lists(POSITION, min_size=t, max_size=t)), dtype=I32)
    q, w = torch.randn(t, h, 16, dtype=dtype), torch.randn(t, h, dtype=dtype)
    inv_freq = builders.rope_table(8)
    q_out, w_out = indexer_q_prep(q, w, pos, inv_freq)
    assert q_out.shape == (t, h, 16) and w_out.shape == (t, h)
    if t:
        T.assert_close_to_ref(q_out, rope64(q, pos, inv_freq), builders.complex_rope(q, pos, inv_freq), what="q_out")
        torch.testing.assert_close(w_out, w.float() * 16**-0.5 * h**-0.5, rtol=2**-20, atol=0)


@FUZZ
@given(fmt=st.sampled_from(["exact", "fp8_584", "fp8_132"]), n=st.integers(0, 6), data=st.data())
def test_pack_then_unpack(fmt, n, data):
    """Rows stored at distinct slots (-1: skipped) read back as the format stores them (the format
    model's round trip; exact pools: the rows themselves); an out-of-range slot stores nothing."""
    dim = {"exact": 16, "fp8_584": 512, "fp8_132": 128}[fmt]
    slots_all = data.draw(st.lists(st.sampled_from([-1, *range(8)]), min_size=n, max_size=n))
    slots = [s if s < 0 or s not in slots_all[:i] else -1 for i, s in enumerate(slots_all)]  # distinct
    slots = torch.tensor(slots, dtype=I32)
    x = torch.randn(n, dim) * data.draw(st.sampled_from([1.0, 1e-3, 300.0]))
    pool = builders.page_pool(2, 4, dim, torch.float32 if fmt == "exact" else fmt)
    before = pool.clone()
    if n and data.draw(st.booleans()):
        bad = slots.clone()
        bad[0] = 8
        with pytest.raises(ValueError, match=r"slots: expected values in \[-1, 8\)"):
            pack_kv(x, bad, pool, fmt)
        assert builders.bytes_equal(pool, before)
    pack_kv(x, slots, pool, fmt)
    back = unpack_kv(pool, slots, dim, torch.float32, fmt)
    live = slots >= 0
    assert (back[~live] == 0).all()
    want = x[live] if fmt == "exact" else torch.tensor([M.roundtrip(fmt, r.tolist()) for r in x[live]])
    assert torch.equal(back[live], want.reshape(-1, dim).float())
    untouched = torch.tensor([s for s in range(8) if s not in slots.tolist()], dtype=I32)
    if fmt == "exact" and untouched.numel():
        assert unpack_kv(pool, untouched, dim, torch.float32, fmt).isnan().all()


@FUZZ
@given(h=st.integers(1, 3), window=st.sampled_from([1, 2, 4]), data=st.data())
def test_sparse_attn(h, window, data):
    """Window rows plus the listed entries (all -1 rows and comp_lens 0 included) against dense
    attention over exactly those keys; padding rows are zero."""
    ring, dim, requests, n_comp = 8, 16, 2, 8
    runs, pad = _runs(data.draw, requests, ring, window)
    pos, req = builders.step_tokens(*runs, pad=pad)
    t = pos.shape[0]
    window_cache = builders.fill_pool(builders.page_pool(requests * ring // 4, 4, dim, torch.float32), dim, torch.float32)
    comp_cache = builders.fill_pool(builders.page_pool(n_comp // 4, 4, dim, torch.float32), dim, torch.float32)
    width = data.draw(st.integers(0, 4))
    comp_idx = torch.tensor(data.draw(st.lists(st.lists(st.integers(-1, n_comp - 1), min_size=width, max_size=width),
                                               min_size=t, max_size=t)), dtype=I32).view(t, width)
    comp_lens = torch.tensor([data.draw(st.integers(0, width)) for _ in range(t)], dtype=I32)
    q, sinks = torch.randn(t, h, dim), torch.randn(h)
    if width and t and data.draw(st.booleans()):
        bad = comp_idx.clone()
        bad[0, 0] = n_comp
        with pytest.raises(ValueError, match=r"comp_idx: expected values in \[-1, 8\)"):
            sparse_attn(q, window_cache, comp_cache, pos, req, bad, sinks, dim**-0.5, window, ring, "exact", "exact",
                        comp_lens=comp_lens)
    out = sparse_attn(q, window_cache, comp_cache, pos, req, comp_idx, sinks, dim**-0.5, window, ring, "exact",
                      "exact", comp_lens=comp_lens)
    win_rows = unpack_kv(window_cache, torch.arange(requests * ring, dtype=I32), dim, torch.float32, "exact")
    comp_rows = unpack_kv(comp_cache, torch.arange(n_comp, dtype=I32), dim, torch.float32, "exact")

    def expected(dtype, order=1):
        outs = []
        for i, (p, r) in enumerate(zip(pos.tolist(), req.tolist())):
            if r < 0:
                outs.append(torch.zeros(h, dim, dtype=dtype))
                continue
            keys = [win_rows[r * ring + s % ring] for s in range(max(0, p - window + 1), p + 1)]
            keys += [comp_rows[j] for j in comp_idx[i, :comp_lens[i]].tolist() if j >= 0]
            keys = keys[::order]
            outs.append(_dense_sink_attention(q[i].to(dtype), torch.stack(keys).to(dtype), sinks, dim**-0.5))
        return torch.stack(outs) if outs else torch.zeros(0, h, dim, dtype=dtype)

    assert out.shape == (t, h, dim)
    if t:
        # Two fp32 runs, the keys in both orders (attention does not depend on it): with a few keys
        # one order can land within an ulp of float64 by chance, which left a budget below the
        # kernel's own rounding (ATEN_CPU_CAPABILITY=default, 3 keys: 5.1e-7 against 4.8e-7).
        T.assert_close_to_ref(out, expected(torch.float64), [expected(torch.float32), expected(torch.float32, -1)],
                              what="sparse_attn")


@FUZZ
@given(k=st.integers(1, 6), data=st.data())
def test_indexer_topk(k, data):
    """A top-k of the fp64 scores over each token's visible entries (w < (t + 1) // 4) in ascending
    entry order, -1 after them: all -1 for tokens with no visible entry and for padding."""
    ratio, bs, requests, blocks, heads, dim = 4, 4, 2, 3, 2, 16
    runs, pad = [], data.draw(st.integers(0, 2))
    for r in range(data.draw(st.integers(0, requests))):
        runs.append((r, data.draw(st.integers(0, ratio * bs * blocks - 3)), data.draw(st.integers(1, 3))))
    pos, req = builders.step_tokens(*runs, pad=pad)
    t = pos.shape[0]
    table = torch.randperm(requests * blocks).to(I32).view(requests, blocks)  # any physical block order
    pool = builders.fill_pool(builders.page_pool(requests * blocks, bs, dim, torch.float32), dim, torch.float32)
    keys = unpack_kv(pool, torch.arange(requests * blocks * bs, dtype=I32), dim, torch.float32, "exact")
    q, w = torch.randn(t, heads, dim), torch.rand(t, heads) + 0.1
    idx = indexer_topk(q, w, pos, req, pool, table, k, ratio, "exact")
    scores = torch.full((t, blocks * bs), float("-inf"), dtype=torch.float64)
    entries = torch.full_like(idx, -1, dtype=torch.long)
    for i, (p, r) in enumerate(zip(pos.tolist(), req.tolist())):
        if r < 0:
            assert (idx[i] == -1).all()
            continue
        n = (p + 1) // ratio
        slots = table[r, torch.arange(n) // bs].long() * bs + torch.arange(n) % bs
        scores[i, :n] = (q[i].double() @ keys[slots].double().T).relu().mul(w[i].double()[:, None]).sum(0)
        for j, s in enumerate(idx[i].tolist()):
            if s >= 0:
                entries[i, j] = table[r].tolist().index(s // bs) * bs + s % bs
        chosen = entries[i][entries[i] >= 0]
        assert torch.equal(chosen, chosen.sort().values), "entries in ascending order"
    if t:
        tol = 1e-5 * scores[scores.isfinite()].abs().max().item() if scores.isfinite().any() else 0.0
        T.assert_topk_within(entries, scores, k, tol, what="indexer_topk")
    if t and data.draw(st.booleans()):
        bad = pos.clone()
        bad[0] = -3
        with pytest.raises(ValueError, match=r"positions: expected >= 0"):
            indexer_topk(q, w, bad, req, pool, table, k, ratio, "exact")


@FUZZ
@given(kind=st.sampled_from([(4, True), (8, False)]), data=st.data())
def test_compressor_update_random_chunks(kind, data):
    """Two requests' streams cut into random steps (1-token decode steps, chunks that end mid-block,
    steps of padding only): every entry equals test_compressor's independent formulation. The budget
    is the larger error of two fp32 runs of it, the second over the hidden dim reversed (the same sums
    in another order): one fp32 run alone can land within an ulp of fp64 by chance."""
    from test_compressor import Stream, _independent, _weights, _xs

    torch.manual_seed(data.draw(st.integers(0, 2**32 - 1)))  # the example's tensors follow its draws
    w = _weights(*kind, d=8)
    w_reversed = dict(w, kv=w["kv"].flip(-1), gate=w["gate"].flip(-1))
    xs = _xs({0: data.draw(st.integers(1, 30)), 1: data.draw(st.integers(1, 30))})
    stream = Stream(w, xs, blocks_per_request=2)
    chunks = {}
    for r, x in xs.items():  # chunk sizes of each stream; the last one ends it
        sizes, left = [], x.shape[0]
        for n in data.draw(st.lists(st.integers(1, 9), min_size=1, max_size=30)):
            sizes.append(min(n, left))
            left -= sizes[-1]
            if not left:
                break
        chunks[r] = sizes + ([left] if left else [])
    for i in range(max(len(c) for c in chunks.values())):
        if data.draw(st.booleans()):
            stream.step({})  # a step of one padding token
        order = data.draw(st.permutations([0, 1]))
        stream.step({r: chunks[r][i] for r in order if i < len(chunks[r])})
    for r, x in xs.items():
        if x.shape[0] >= w["ratio"]:
            expect = _independent(x, w, torch.float64)
            lowp = [_independent(x, w, torch.float32), _independent(x.flip(-1), w_reversed, torch.float32)]
            T.assert_close_to_ref(stream.entries(r, expect.shape[0]), expect, lowp, what=f"request {r}")


def test_every_public_function_takes_an_empty_step():
    """T = 0 tokens: each public function returns its empty outputs and writes nothing."""
    for name in ("qkv_prep", "compressor_update", "indexer_q_prep", "indexer_topk", "visible_entries", "sparse_attn",
                 "inv_rope", "pack_kv", "unpack_kv"):
        args = getattr(builders, f"{name}_args")()
        for key, value in args.items():  # every per-token tensor cut to 0 rows
            if isinstance(value, torch.Tensor) and key not in ("cache", "window_cache", "comp_cache", "state",
                                                                 "ape", "norm_weight", "inv_freq", "sinks",
                                                                 "block_table", "workspace"):
                args[key] = value[:0]
        pools = {k: v.clone() for k, v in args.items() if k in ("cache", "window_cache", "comp_cache", "state")}
        out = builders.call_public(name, args)
        for k, v in pools.items():
            assert builders.bytes_equal(args[k], v), (name, k)
        outs = out if isinstance(out, tuple) else (out,)
        assert all(o is None or o.shape[0] == 0 for o in outs), name
