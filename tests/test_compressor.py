"""dsv4::compressor_update and compressor.api.compressor_update against the stateless oracle
dsv4ops.reference.compress: CSA overlap (entry w pools window w-1's a-stream and window w's
b-stream; w = 0 has no previous window), HCA 128 without overlap, the state-ring write rule,
entries closing within a step, splits across steps, what a call writes, bad inputs. Issue 3."""

from functools import partial

import builders
import pytest
import torch
import torch.nn.functional as F
from builders import FP8

from dsv4ops import reference
from dsv4ops import testing as T
from dsv4ops.quant.api import unpack_kv
from dsv4ops.reference.functional import apply_rope, rope_angles
from dsv4ops.reference.numerics import round_indexer_key, round_kv

HIDDEN, EPS, I32 = 16, 1e-6, torch.int32
CSA, HCA = (4, True), (128, False)  # (ratio, overlap)
BLOCK = 4


def _weights(ratio: int, overlap: bool, d: int) -> dict:
    width = (2 if overlap else 1) * d
    return dict(kv=torch.randn(width, HIDDEN) / 4, gate=torch.randn(width, HIDDEN) / 4, ape=torch.randn(ratio, width),
                norm=1 + 0.1 * torch.randn(d), inv_freq=builders.rope_table(min(64, d // 2)), ratio=ratio, d=d)


def _oracle(x: torch.Tensor, w: dict, mode: str = "exact") -> torch.Tensor:
    return reference.compress(x, w["kv"], w["gate"], w["ape"], w["norm"], w["ratio"], w["inv_freq"], mode, EPS)


class Stream:
    """Requests' token streams fed to the op step by step, like the serving loop: positions continue
    per request, each step ends with a padding token that closes a block (position ratio - 1) and
    carries a valid entry slot and random rows: it must write nothing."""

    def __init__(self, w: dict, xs: dict, fmt=torch.float32, blocks_per_request: int = 2, eps: float = EPS,
                 slack: int = 0):
        self.w, self.xs, self.eps = w, xs, eps
        requests = len(xs)
        width = w["kv"].shape[0]
        self.a = {r: F.linear(x, w["kv"]) for r, x in xs.items()}
        self.z = {r: F.linear(x, w["gate"]) for r, x in xs.items()}
        self.done = {r: 0 for r in xs}
        self.per_request = blocks_per_request * BLOCK
        # slack: ring rows past the span (CacheConfig.state_rows sizes them for rewinds).
        self.state = torch.full((requests, width // w["d"] * w["ratio"] + slack, 2 * width), float("nan"))
        self.cache = builders.page_pool(requests * blocks_per_request, BLOCK, w["d"], fmt)
        self.fmt = builders.format_name(fmt, w["d"])
        self.spare = requests * self.per_request - 1  # never a real entry in these tests

    def step(self, new: dict, entry_slots=None):
        rows_a, rows_z, runs = [], [], []
        for r, n in new.items():
            s = self.done[r]
            runs.append((r, s, n))
            rows_a.append(self.a[r][s:s + n])
            rows_z.append(self.z[r][s:s + n])
            self.done[r] = s + n
        positions, req_slots = builders.step_tokens(*runs, pad=1)
        positions[-1] = self.w["ratio"] - 1
        width = self.w["kv"].shape[0]
        kv = torch.cat(rows_a + [torch.randn(1, width)])
        score = torch.cat(rows_z + [torch.randn(1, width)])
        if entry_slots is None:
            entry_slots = builders.entry_slots_of(positions, req_slots, self.w["ratio"], self.per_request)
        entry_slots[-1] = self.spare
        self.positions, self.req_slots, self.kv, self.score = positions, req_slots, kv, score
        builders.call_public("compressor_update", dict(
            kv=kv, score=score, ape=self.w["ape"], positions=positions, req_slots=req_slots, entry_slots=entry_slots,
            norm_weight=self.w["norm"], inv_freq=self.w["inv_freq"], state=self.state, cache=self.cache,
            latent_out=None, eps=self.eps, fmt=self.fmt))

    def entries(self, r: int, n: int) -> torch.Tensor:
        slots = torch.arange(r * self.per_request, r * self.per_request + n, dtype=I32)
        return unpack_kv(self.cache, slots, self.w["d"], torch.float32, self.fmt)


def _xs(lengths: dict) -> dict:
    return {r: torch.randn(n, HIDDEN) for r, n in lengths.items()}


# ---- against the oracle ------------------------------------------------------------------------
# CSA: 13 tokens = 3 entries + 1 left over; HCA: 259 tokens = 2 entries + 3 (crosses 127 and 255).
LENGTHS = {CSA: {0: 13, 1: 9}, HCA: {0: 259, 1: 130}}
ONE_STEP = {CSA: [{0: 13, 1: 9}], HCA: [{0: 259, 1: 130}]}
CHUNKED = {  # prefill chunks that end mid-block, decode tokens, requests interleaved across steps
    CSA: [{0: 3}, {1: 2, 0: 1}, {0: 4, 1: 5}, {0: 1}, {1: 1, 0: 1}, {0: 3, 1: 1}],
    HCA: [{0: 100, 1: 127}, {0: 27}, {1: 1, 0: 1}, {0: 131, 1: 2}],
}


@pytest.mark.parametrize("kind", [CSA, HCA], ids=["csa", "hca"])
@pytest.mark.parametrize("steps,slack", [(ONE_STEP, 0), (CHUNKED, 0), (CHUNKED, 5)],
                         ids=["one-step", "chunked", "chunked-ring-slack"])
def test_entries_equal_the_stateless_oracle(kind, steps, slack):
    w = _weights(*kind, d=8)
    xs = _xs(LENGTHS[kind])
    stream = Stream(w, xs, slack=slack)
    for new in steps[kind]:
        stream.step(new)
    w64 = {k: v.double() if isinstance(v, torch.Tensor) else v for k, v in w.items()}
    for r, x in xs.items():
        expect = _oracle(x.double(), w64)
        # One step: entries closing in it pool rows of the step (the state is NaN-poisoned and never
        # read); chunked: rows of earlier steps come from the state ring. Within the fp32 oracle's own
        # error, not bit for bit: the op pools [entries, 2m or m, width] with a different number of
        # entries than the oracle, and torch's CPU reductions may then vectorize differently (AMD
        # EPYC, HCA's 128-row pools: 1 fp32 ulp apart).
        T.assert_close_to_ref(stream.entries(r, expect.shape[0]), expect, _oracle(x, w), what=f"request {r}")
    written = torch.zeros(stream.cache.shape[:2], dtype=torch.bool).view(-1)
    for r, x in xs.items():
        written[r * stream.per_request: r * stream.per_request + x.shape[0] // w["ratio"]] = True
    assert stream.cache.view(-1, w["d"])[~written].isnan().all()  # no other slot (padding's included)


def _slots(x: torch.Tensor, w: dict, dtype: torch.dtype):
    """Per entry e: (e, slot a-rows, slot z-rows) in `dtype`: the 2m slots (CSA: window e-1's
    a-stream [:d], absent for e = 0 (a = 0, z = -inf), then window e's b-stream [d:]) or m slots
    (HCA), z including ape."""
    m, d = w["ratio"], w["d"]
    overlap = w["kv"].shape[0] == 2 * d
    x = x.to(dtype)
    a = x @ w["kv"].to(dtype).T
    z = x @ w["gate"].to(dtype).T + w["ape"].to(dtype)[torch.arange(x.shape[0]) % m]
    for e in range(x.shape[0] // m):
        cur = slice(e * m, (e + 1) * m)
        if not overlap:
            yield e, a[cur], z[cur]
            continue
        prev = slice((e - 1) * m, e * m)
        pa = a[prev, :d] if e else a.new_zeros(m, d)
        pz = z[prev, :d] if e else z.new_full((m, d), float("-inf"))
        yield e, torch.cat([pa, a[cur, d:]]), torch.cat([pz, z[cur, d:]])


def _finish(c: torch.Tensor, e: int, w: dict) -> torch.Tensor:
    """A pooled entry's RMS norm times the weight, then RoPE at position e*m."""
    c = c / torch.sqrt(c.square().mean() + EPS) * w["norm"].to(c.dtype)
    return builders.complex_rope(c[None], torch.tensor([e * w["ratio"]]), w["inv_freq"])[0]


def _independent(x: torch.Tensor, w: dict, dtype: torch.dtype) -> torch.Tensor:
    """The entries written out here, independent of reference.functional: per entry, a per-channel
    softmax of z over the slots, the weighted sum of a, then `_finish`. In `dtype` (fp64: the
    budget's reference)."""
    entries = []
    for e, slots_a, slots_z in _slots(x, w, dtype):
        p = torch.exp(slots_z - slots_z.max(0).values)
        entries.append(_finish((p / p.sum(0) * slots_a).sum(0), e, w))
    return torch.stack(entries)


def _gamma(n: int) -> float:
    """Higham's gamma_n = n u / (1 - n u), fp32 u = 2^-24: a sum of n + 1 terms in fp32 is within
    gamma_n times the sum of their magnitudes, in ANY order (sequential, pairwise, blocked by
    vector lanes: whatever the CPU's kernels pick)."""
    return n * 2.0**-24 / (1 - n * 2.0**-24)


def _summation_order_bound(x: torch.Tensor, w: dict) -> torch.Tensor:
    """[entries, d], in fp64: a first-order bound on how far the fp32 reductions move an entry, for
    any summation order. The projections sum K = HIDDEN products (+ ape): |da| <= gamma_K |x|.|W|,
    |dz| <= gamma_K+1 (|x|.|W| + |ape|) plus the max subtraction's ulp. A shift dz moves weight w_i
    by w_i (dz_i - sum w dz), so the pool c by sum_i w_i dz_i (a_i - c). The softmax's denominator
    and the weighted sum, n slots each (HCA: 128), add gamma_n sum_i w_i |a_i| each; exp, the divide
    and the products a few ulps. Carried through the norm and RoPE by their absolute Jacobian."""
    u, k = 2.0**-24, w["kv"].shape[1]
    magnitudes = {**w, "kv": w["kv"].abs(), "gate": w["gate"].abs(), "ape": w["ape"].abs()}
    out = []
    for (e, a, z), (_, abs_a, abs_z) in zip(_slots(x, w, torch.float64),
                                            _slots(x.abs(), magnitudes, torch.float64)):
        n = a.shape[0]
        weight = torch.softmax(z, 0)
        c = (weight * a).sum(0)
        dz = torch.where(z.isfinite(), _gamma(k + 1) * abs_z + u * (z - z.max(0).values).abs(), 0.0)
        dc = ((weight * _gamma(k) * abs_a).sum(0) + (weight * dz * (a - c).abs()).sum(0)
              + (2 * _gamma(n) + 6 * u) * (weight * a.abs()).sum(0))
        jacobian = torch.autograd.functional.jacobian(lambda v: _finish(v, e, w), c)
        out.append(jacobian.abs() @ dc)
    return torch.stack(out)


@pytest.mark.parametrize("kind", [CSA, HCA], ids=["csa", "hca"])
@pytest.mark.parametrize("steps", [ONE_STEP, CHUNKED], ids=["one-step", "chunked"])
def test_entries_equal_an_independent_formulation(kind, steps):
    """Within the bound on any summation order of the reductions (`_summation_order_bound`,
    elementwise), plus 2x the fp32 twin's error and an ulp for the rest. The twin alone samples one
    order: torch pools the op's [entries, n, width] in an order that depends on the CPU's vector
    path and the shapes, and on an Intel Xeon (AVX-512, ATEN_CPU_CAPABILITY=default) HCA's entries
    came out 8.6e-7 (3.6 ulps) from fp64 where the twin was 2.8e-7 off."""
    w = _weights(*kind, d=8)
    xs = _xs(LENGTHS[kind])
    stream = Stream(w, xs)
    for new in steps[kind]:
        stream.step(new)
    for r, x in xs.items():
        expect = _independent(x, w, torch.float64)
        out = stream.entries(r, expect.shape[0]).double()
        order = _summation_order_bound(x, w)
        beyond = ((out - expect).abs() - order).clamp(min=0).max().item()
        twin = (_independent(x, w, torch.float32).double() - expect).abs().max().item()
        ulp = torch.finfo(torch.float32).eps * expect.abs().max().item()
        assert beyond <= 2 * twin + ulp, (f"request {r}: {beyond:.3e} beyond the order bound (max "
                                         f"{order.max():.3e}) > 2 x {twin:.3e} + {ulp:.3e}")


@pytest.mark.parametrize("fmt,d,mode", [(FP8, 512, "main"), (FP8, 128, "indexer")])
def test_fp8_entries_equal_the_oracle_in_fp8_mode(fmt, d, mode):
    # FP8 pools: the pooled entry is cast to bf16 before the norm (DeepSeek), then packed.
    w = _weights(*CSA, d=d)
    xs = _xs({0: 9})
    stream = Stream(w, xs, fmt)
    stream.step({0: 5})
    stream.step({0: 4})
    e = _oracle(xs[0], w, "fp8")
    expect = round_kv(e, "fp8", 64) if mode == "main" else round_indexer_key(e, "fp8")
    assert torch.equal(stream.entries(0, 2), expect.float())


# ---- semantics ---------------------------------------------------------------------------------
def _entries_after(w: dict, x: torch.Tensor) -> torch.Tensor:
    stream = Stream(w, {0: x})
    stream.step({0: x.shape[0]})
    return stream.entries(0, x.shape[0] // w["ratio"])


def test_csa_entry_pools_previous_a_stream_and_current_b_stream():
    d, m = 8, 4
    w = _weights(*CSA, d=d)
    x = torch.randn(3 * m, HIDDEN)
    base = _entries_after(w, x)
    for cols, moved in ((slice(0, d), [2]), (slice(d, 2 * d), [1])):
        # Window 1 (positions 4..7): its a-stream ([:d]) feeds entry 2 only, its b-stream ([d:]) entry 1.
        # Entries whose rows did not move are the same computation on the same values as in `base`
        # (same kernel, same shapes), so `!=` sees exactly the moved ones.
        stream = Stream(w, {0: x})
        stream.a[0][m:2 * m, cols] += 1.0
        stream.z[0][m:2 * m, cols] += 1.0
        stream.step({0: 3 * m})
        changed = (stream.entries(0, 3) != base).any(-1).nonzero().flatten().tolist()
        assert changed == moved, (cols, changed)
    # Entry 0 has no previous window: its a-stream slots weigh 0 (score -inf), so it is the pool
    # of window 0's b-stream alone (the oracle without overlap on the b-stream weights). An 8-slot
    # softmax with 4 -inf slots and a 4-slot softmax are different fp32 computations (the last ulp
    # depends on the CPU's vector path), so both are held to the fp64 4-slot pool within the fp32
    # 4-slot run's own error.
    def alone(dtype):
        return reference.compress(x[:m].to(dtype), w["kv"][d:].to(dtype), w["gate"][d:].to(dtype), w["ape"][:, d:],
                                  w["norm"], m, w["inv_freq"], "exact", EPS)[0]

    T.assert_close_to_ref(base[0], alone(torch.float64), alone(torch.float32), what="entry 0")


@pytest.mark.parametrize("kind,token,moved", [(HCA, 127, [0]), (HCA, 128, [1]), (CSA, 5, [1, 2])],
                         ids=["hca-127", "hca-128", "csa-5"])
def test_a_token_feeds_exactly_its_entries(kind, token, moved):
    w = _weights(*kind, d=8)
    x = torch.randn(3 * kind[0], HIDDEN)
    base = _entries_after(w, x)
    x2 = x.clone()
    x2[token] += 1.0
    changed = (_entries_after(w, x2) != base).any(-1).nonzero().flatten().tolist()
    assert changed == moved


def test_state_ring_keeps_the_last_token_of_each_row():
    m = 4
    w = _weights(*CSA, d=8)
    xs = _xs({0: 13, 1: 3})
    stream = Stream(w, xs)
    stream.step({0: 13})  # rows 0..7 of request 0 map to positions p % 8: tokens 5..12 are the last
    rows = torch.cat([stream.a[0], stream.z[0] + w["ape"][torch.arange(13) % m]], -1)
    expect = torch.stack([rows[p] for p in sorted(range(5, 13), key=lambda p: p % 8)])
    assert torch.equal(stream.state[0], expect)
    assert stream.state[1].isnan().all()  # request 1 had no token: untouched
    stream.step({1: 3})  # 3 tokens: rows 0..2 of request 1 written, rows 3..7 untouched
    assert not stream.state[1, :3].isnan().any() and stream.state[1, 3:].isnan().all()
    assert torch.equal(stream.state[0], expect)


def test_state_ring_with_slack_rows_holds_position_p_at_row_p_mod_rows():
    """A ring of 8 + 5 rows (CacheConfig.state_rows for 5 drafts): the last 13 positions of a
    request each keep their row p % 13, so the 7 positions before any of the last 6 survive them."""
    m = 4
    w = _weights(*CSA, d=8)
    xs = _xs({0: 20})
    stream = Stream(w, xs, slack=5)
    stream.step({0: 20})
    rows = torch.cat([stream.a[0], stream.z[0] + w["ape"][torch.arange(20) % m]], -1)
    expect = torch.stack([rows[p] for p in sorted(range(7, 20), key=lambda p: p % 13)])
    assert torch.equal(stream.state[0], expect)


def test_closing_token_with_entry_slot_minus_one_stores_nothing():
    w = _weights(*CSA, d=8)
    stream = Stream(w, _xs({0: 8}))
    positions = torch.arange(8, dtype=I32)
    slots = builders.entry_slots_of(positions, torch.zeros(8, dtype=I32), 4, stream.per_request)
    slots = torch.cat([slots, slots[:1]])
    slots[3] = -1  # entry 0 is not stored; entry 1 is
    stream.step({0: 8}, entry_slots=slots)
    assert stream.cache.view(-1, 8)[0].isnan().all() and not stream.cache.view(-1, 8)[1].isnan().any()
    assert not stream.state[0].isnan().any()  # the state rows are still written


# ---- bad inputs: one per rule ------------------------------------------------------------------
ARGS = partial(builders.compressor_update_args, torch.float32)
wa = builders.with_arg


def _entry_twice(a):
    a["req_slots"] = torch.tensor([0] * 5 + [1] * 4, dtype=I32)  # request 1 at 0..3 closes entry 0 at 3
    a["positions"] = torch.tensor([2, 3, 4, 5, 6, 0, 1, 2, 3], dtype=I32)
    a["entry_slots"] = torch.tensor([-1, 0, -1, -1, -1, -1, -1, -1, 0], dtype=I32)


BAD = [
    ("kv-ndim", wa("kv", lambda a: a["kv"][None]), r"kv: expected 2-D \[tokens, coff \* d\]"),
    ("kv-dtype", wa("kv", lambda a: a["kv"].double()), r"kv: expected dtype in"),
    ("kv-last-dim", wa("kv", lambda a: a["kv"].t().contiguous().t()), r"kv: expected a contiguous last dim"),
    ("score-shape", wa("score", lambda a: a["score"][:-1]),
     r"score: expected shape \(9, 16\) \(as kv\), got \(8, 16\)"),
    ("score-dtype", wa("score", lambda a: a["score"].int()), r"score: expected dtype in"),
    ("score-last-dim", wa("score", lambda a: a["score"].t().contiguous().t()), r"score: expected a contiguous last"),
    ("norm_weight-ndim", wa("norm_weight", lambda a: a["norm_weight"][None]), r"norm_weight: expected 1-D \[d\]"),
    ("norm_weight-dtype", wa("norm_weight", lambda a: a["norm_weight"].double()), r"norm_weight: expected dtype"),
    ("kv-width", wa("norm_weight", lambda a: torch.ones(6)),
     r"kv: expected width d = 6 \(no overlap\) or 2d = 12 \(CSA overlap\), got 16"),
    ("ape-ndim", wa("ape", lambda a: a["ape"][0]), r"ape: expected 2-D \[ratio, coff \* d\]"),
    ("ape-dtype", wa("ape", lambda a: a["ape"].bfloat16()), r"ape: expected dtype in \[torch.float32\]"),
    ("ape-width", wa("ape", lambda a: a["ape"][:, :8].contiguous()), r"ape: expected size 16 \(kv width\) at dim 1"),
    ("ape-device", wa("ape", lambda a: a["ape"].to("meta")), r"ape: expected device cpu \(as kv\), got meta"),
    ("norm_weight-device", wa("norm_weight", lambda a: a["norm_weight"].to("meta")),
     r"norm_weight: expected device cpu \(as kv\), got meta"),
    ("positions-ndim", wa("positions", lambda a: a["positions"][None]), r"positions: expected 1-D \[tokens\]"),
    ("req_slots-dtype", wa("req_slots", lambda a: a["req_slots"].long()), r"req_slots: expected dtype in"),
    ("entry_slots-size", wa("entry_slots", lambda a: a["entry_slots"][1:]),
     r"entry_slots: expected size 9 \(tokens of kv\) at dim 0, got 8"),
    ("inv_freq-width", wa("inv_freq", lambda a: torch.ones(5)),
     r"inv_freq: expected at most 4 frequencies \(head dim 8\), got 5"),
    ("state-ndim", wa("state", lambda a: a["state"][0]),
     r"state: expected 3-D \[requests, ring rows >= coff \* ratio, 2 \* coff"),
    ("state-dtype", wa("state", lambda a: a["state"].double()), r"state: expected dtype in \[torch.float32\]"),
    ("state-contiguous", wa("state", lambda a: a["state"].transpose(0, 1)), r"state: expected a contiguous tensor"),
    ("state-device", wa("state", lambda a: a["state"].to("meta")), r"state: expected device cpu \(as kv\), got meta"),
    ("state-rows", wa("state", lambda a: a["state"][:, :4].contiguous()),
     r"state: expected at least 8 ring rows \(coff \* ratio, the positions one entry pools\) at dim 1, got 4"),
    ("state-width", wa("state", lambda a: a["state"][..., :16].contiguous()),
     r"state: expected size 32 \(kv and score rows\) at dim 2, got 16"),
    ("cache-width", wa("cache", lambda a: a["cache"][..., :4].contiguous()),
     r"cache: expected size 8 \(row width\) at dim 2, got 4"),
    ("fmt-unknown", wa("fmt", lambda a: "bf16"), r"fmt: expected one of \['fp8_584', "),
    ("fmt-width", wa("fmt", lambda a: "fp4_288"), r"cache: expected dtype in \[torch.uint8\], got torch.float32"),
    # The Hadamard rotates bf16 rows before a byte format's quantizer (V4's MXFP4 keys).
    ("hadamard-exact-pool", wa("hadamard", lambda a: True),
     r"hadamard: expected a byte format \(it rotates bf16 rows before their quantizer\), got fmt 'exact'"),
    # Issue 52: float scalars are checked (eps = nan made every entry NaN).
    ("eps-nan", wa("eps", lambda a: float("nan")),
     r"eps: expected a finite value >= 0 \(the entry RMSNorm's epsilon\), got nan"),
    ("latent_out-dtype", wa("latent_out", lambda a: torch.empty(9, 8, dtype=torch.bfloat16)),
     r"latent_out: expected dtype in \[torch.float32\], got torch.bfloat16", ("op",)),
    ("latent_out-width", wa("latent_out", lambda a: torch.empty(9, 16)),
     r"latent_out: expected size 8 \(d of norm_weight\) at dim 1, got 16", ("op",)),
    ("latent_out-tokens", wa("latent_out", lambda a: torch.empty(8, 8)),
     r"latent_out: expected size 9 \(tokens of kv\) at dim 0, got 8", ("op",)),
    # Values (public function only; eager). Tokens: request 0 at 2..6, request 1 at 0..2, padding.
    ("positions-negative", wa("positions", lambda a: torch.tensor([2, 3, 4, 5, 6, -1, 0, 1, 0], dtype=I32)),
     r"positions: expected >= 0 \(token positions\), got -1 at index 5", ("public",)),
    ("req_slots-high", wa("req_slots", lambda a: torch.tensor([0] * 5 + [2] * 3 + [-1], dtype=I32)),
     r"req_slots: expected values in \[-1, 2\) \(-1 or one of the 2 requests of the state\), got 2 at index 5",
     ("public",)),
    ("positions-gap", wa("positions", lambda a: torch.tensor([2, 3, 5, 6, 7, 0, 1, 2, 0], dtype=I32)),
     r"positions: expected consecutive positions within a request, got 3 then 5 for request 0 at tokens 1, 2",
     ("public",)),
    ("request-split", wa("req_slots", lambda a: torch.tensor([0, 0, 1, 1, 1, 0, 0, 0, -1], dtype=I32)),
     r"req_slots: expected the tokens of a request to be contiguous in the step, got request 0 in 2 separate runs",
     ("public",)),
    ("request-split-by-padding", wa("req_slots", lambda a: torch.tensor([0, 0, -1, 0, 0, 1, 1, 1, -1], dtype=I32)),
     r"req_slots: expected the tokens of a request to be contiguous in the step, got request 0 in 2 separate runs",
     ("public",)),
    ("entry_slots-high", wa("entry_slots", lambda a: torch.tensor([-1, 16, -1, -1, -1, -1, -1, -1, -1], dtype=I32)),
     r"entry_slots: expected values in \[-1, 16\) \(-1 or a slot of the pool's 16\), got 16 at index 1", ("public",)),
    ("entry_slots-twice", _entry_twice,
     r"entry_slots: expected distinct slots among the tokens that close an entry, got 0 \(2 times\)", ("public",)),
    ("entry_slots-on-a-token-closing-nothing",
     wa("entry_slots", lambda a: torch.tensor([-1, 0, 5, -1, -1, -1, -1, -1, -1], dtype=I32)),
     r"entry_slots: expected -1 for the tokens that close no entry at ratio 4 \(\(position \+ 1\) % 4 != 0\), got 5 "
     r"at index 2 \(position 4\)", ("public",)),
]


@pytest.mark.parametrize("case", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_rejected_and_writes_nothing(case):
    _, mutate, match, *via = case
    builders.assert_bad_case("compressor_update", ARGS(), mutate, match, via)


# ---- V4.1 (spec V4.1 2.3): ratio 2 = a 2-slot pool without overlap or position bias, ratio 1 = a
# 1-slot pool; the entries against an independent float64 formula of the spec ---------------------
V41_EPS = 1e-20  # V4.1's rms_norm_eps


def _v41_weights(ratio: int, d: int = 8) -> dict:
    w = _weights(ratio, False, d)
    w["ape"] = torch.zeros(ratio, d)
    if ratio == 1:
        w["gate"] = torch.zeros(d, HIDDEN)  # score 0: the one slot weighs exactly 1
    return w


def _v41_formula(x: torch.Tensor, w: dict, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(latents, entries) of spec V4.1 2.3 in `dtype`: C_w = sum_p a_p e^{g_p} / sum_p e^{g_p} over the
    2 tokens of group w (ratio 2) or C_p = a_p (ratio 1); latent = w_norm C / sqrt(mean C^2 + eps);
    entry = the latent with its last R dims rotated at position w * m (pairs 2i, 2i + 1)."""
    m, d = w["ratio"], w["d"]
    xd = x.to(dtype)
    a = xd @ w["kv"].to(dtype).T
    n = x.shape[0] // m
    if m == 2:
        g = (xd @ w["gate"].to(dtype).T)[: 2 * n].view(n, 2, d)
        e = torch.exp(g - g.amax(1, keepdim=True))
        c = (a[: 2 * n].view(n, 2, d) * e).sum(1) / e.sum(1)
    else:
        c = a
    lat = w["norm"].to(dtype) * c / torch.sqrt(c.square().mean(-1, keepdim=True) + V41_EPS)
    r = 2 * w["inv_freq"].shape[0]
    ang = (torch.arange(n) * m).to(dtype)[:, None] * w["inv_freq"].to(dtype)
    x0, x1 = lat[:, d - r::2], lat[:, d - r + 1::2]
    rot = torch.stack([x0 * ang.cos() - x1 * ang.sin(), x0 * ang.sin() + x1 * ang.cos()], -1).flatten(1)
    return lat, torch.cat([lat[:, : d - r], rot], 1)


def _v41_stream(ratio: int, lengths: dict, fmt=torch.float32, d: int = 8):
    w = _v41_weights(ratio, d)
    xs = _xs(lengths)
    stream = Stream(w, xs, fmt, blocks_per_request=max(2, -(-max(lengths.values()) // ratio // BLOCK)), eps=V41_EPS)
    return w, xs, stream


V41_STEPS = {  # chunks ending on even and odd positions, decode tokens, requests interleaved
    2: [{0: 3}, {1: 2, 0: 1}, {0: 1}, {0: 4, 1: 5}, {1: 1, 0: 1}, {0: 3, 1: 1}],
    1: [{0: 3}, {1: 2, 0: 1}, {0: 4, 1: 5}, {1: 1, 0: 1}, {0: 4, 1: 1}],
}


@pytest.mark.parametrize("ratio", [2, 1])
def test_v41_entries_equal_the_spec_formula(ratio):
    lengths = {0: 13, 1: 9}
    w, xs, stream = _v41_stream(ratio, lengths)
    for new in V41_STEPS[ratio]:
        stream.step(new)
    for r, x in xs.items():
        n = lengths[r] // ratio
        _, want64 = _v41_formula(x, w, torch.float64)
        _, want32 = _v41_formula(x, w, torch.float32)
        T.assert_close_to_ref(stream.entries(r, n), want64, want32, what=f"ratio {ratio} request {r}")


def test_v41_ratio2_keeps_a_pending_row_and_a_decode_step_at_an_even_position_emits_nothing():
    w, xs, stream = _v41_stream(2, {0: 6})
    stream.step({0: 3})  # positions 0..2: entry 0 closes at 1; position 2 waits in the state ring
    assert torch.equal(stream.state[0, 0, :8], stream.a[0][2]) and stream.state[0, 0, 8:].equal(stream.z[0][2])
    stream.step({0: 1})  # position 3 closes entry 1 with the pending row of 2
    before = stream.cache.clone()
    stream.step({0: 1})  # position 4 (even): no entry
    assert builders.bytes_equal(stream.cache, before)
    stream.step({0: 1})
    _, want64 = _v41_formula(xs[0], w, torch.float64)
    _, want32 = _v41_formula(xs[0], w, torch.float32)
    T.assert_close_to_ref(stream.entries(0, 3), want64, want32)


def test_v41_ratio2_group_zero_is_tokens_0_and_1_alone():
    # No -inf slot at w = 0 (V4's CSA had one): entry 0 changes with tokens 0 and 1 only.
    w = _v41_weights(2)
    x = torch.randn(6, HIDDEN)
    base = _entries_after(w, x)
    for token, moved in ((0, [0]), (1, [0]), (2, [1]), (5, [2])):
        x2 = x.clone()
        x2[token] += 1.0
        assert (_entries_after(w, x2) != base).any(-1).nonzero().flatten().tolist() == moved, token


@pytest.mark.parametrize("ratio", [2, 1])
def test_v41_quantized_pool_holds_the_codec_of_the_bf16_entry(ratio):
    # Before a quantized format the pooled entry is cast to bf16 (norm and RoPE in bf16): the fp4_288
    # pool must hold exactly fp4_288(the entries of an exact bf16 pool), byte for byte.
    from dsv4ops.quant import codecs

    lengths = {0: 11, 1: 6}
    runs = {}
    for fmt in (torch.bfloat16, "fp4_288"):
        torch.manual_seed(3)
        w, xs, stream = _v41_stream(ratio, lengths, fmt, d=512)
        for new in V41_STEPS[ratio][:4]:
            stream.step({r: n for r, n in new.items() if stream.done[r] + n <= lengths[r]})
        runs[fmt] = stream
    exact, fp4 = runs[torch.bfloat16], runs["fp4_288"]
    for r in lengths:
        n = exact.done[r] // ratio
        assert torch.equal(fp4.entries(r, n), codecs.roundtrip("fp4_288", exact.entries(r, n)))


@pytest.mark.parametrize("ratio", [2, 1])
def test_latent_out_is_the_entry_before_rope_in_every_closing_row_and_zero_elsewhere(ratio):
    args = builders.compressor_update_args(torch.float32, ratio=ratio, overlap=False, latent=True)
    args["ape"].zero_()
    args["latent_out"].fill_(float("nan"))  # poison: every row must be written
    builders.call_op("compressor_update", args)
    pos, req = args["positions"].long(), args["req_slots"].long()
    closes = (req >= 0) & ((pos + 1) % ratio == 0)
    lat = args["latent_out"]
    assert (lat[~closes] == 0).all() and not lat[closes].isnan().any()
    stored = unpack_kv(args["cache"], args["entry_slots"][closes], 8, torch.float32, "exact")
    cos, sin = rope_angles((pos[closes] // ratio) * ratio, args["inv_freq"], torch.float32)
    assert torch.equal(apply_rope(lat[closes], cos, sin), stored)


def test_latent_out_public_function_returns_it_in_the_entry_dtype():
    args = builders.compressor_update_args(torch.float32, "fp4_288", ratio=2, overlap=False, runs=((0, 0, 4),), pad=0)
    lat = builders.call_public("compressor_update", dict(args, latent_out=torch.empty(0)))
    assert lat.dtype == torch.bfloat16 and lat.shape == (4, 512)
    assert builders.call_public("compressor_update", builders.compressor_update_args(torch.float32)) is None


# ---- the Triton kernel under the interpreter, against the reference (helpers: tests/interp.py) -------------
from interp import BS, INV_FREQ, new_pool, pool_fmt, pool_rows  # noqa: E402

from dsv4ops.compressor import reference as compressor_ref  # noqa: E402
from dsv4ops.compressor import triton as compressor_tt  # noqa: E402
from dsv4ops.quant import reference as quant_ref  # noqa: E402


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
        monkeypatch.setattr(compressor_tt, "pool_plan", lambda span, tokens, d, batch_invariant: (d // 4, 4, 4))


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
    runs = {name: (torch.full((2, rows, 2 * width), float("nan")), new_pool(p, d, nblk))
            for name, p in (("kernel", pool), ("ref", pool), ("ref64", torch.float32))}
    lens = [0, 0]
    for step in steps:
        pos, req, closes, entry = _compressor_step(step, lens, ratio, nblk)
        kv, score = torch.randn(len(pos), width).to(adt), torch.randn(len(pos), width).to(adt)
        for name, (state, cache) in runs.items():
            fn = compressor_tt.compressor_update if name == "kernel" else compressor_ref.compressor_update
            fn(kv, score, ape, pos, req, entry, w, INV_FREQ, state, cache, None, 1e-6, pool_fmt(cache, d))
        assert torch.equal(runs["kernel"][0].nan_to_num(7), runs["ref"][0].nan_to_num(7)), "state rows"
    got, lowp, ref = (pool_rows(runs[n][1], d) for n in ("kernel", "ref", "ref64"))
    written = ~ref.isnan().any(1)
    assert torch.equal(written, ~got.isnan().any(1)), "entries written"
    T.assert_close_to_ref(got[written], ref[written], lowp[written], what="compressed entries")


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
        fn(kv, score, ape, pos, req, entry, torch.ones(d), INV_FREQ, states[name], new_pool(torch.float32, d, 4), None,
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
    runs = {name: (torch.full((2, ratio, 2 * d), float("nan")), new_pool(p, d, nblk))
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
        T.assert_close_to_ref(latents["kernel"], latents["ref64"], latents["ref"], what="latent")
    fmt = builders.format_name(pool, d)
    got, lowp = pool_rows(runs["kernel"][1], d, fmt=fmt), pool_rows(runs["ref"][1], d, fmt=fmt)
    ref = pool_rows(runs["ref64"][1], d)
    written = ~ref.isnan().any(1)
    assert torch.equal(written, ~got.isnan().any(1)), "entries written"
    T.assert_close_to_ref(got[written], ref[written], lowp[written], what="compressed entries")


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
    got, lowp = (pool_rows(runs[n][1], d, fmt="mxfp4_68") for n in ("kernel", "ref"))
    ref = quant_ref.hadamard(pool_rows(runs["ref64"][1], d))
    # Poisoned slots read back NaN (float pool) or -inf (0xFF bytes of mxfp4_68: -6 x 2^128).
    written = ref.isfinite().all(1)
    assert written.sum() == 4 and torch.equal(written, got.isfinite().all(1)), "entries written"
    T.assert_close_to_ref(got[written], ref[written], lowp[written], what="rotated index keys")
