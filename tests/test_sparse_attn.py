"""dsv4::sparse_attn and sparse_attn.api.sparse_attn: each query attends to exactly its window
(itself included) and its listed compressed entries, with the sink in the denominator, reading each
pool in its format (V4: fp8_584 / exact; V4.1: fp8_528 window rows, fp4_288 compressed rows); -1
entries and padding tokens read nothing; bad inputs. Issues 3, 16."""

from functools import partial

import builders
import pytest
import torch
from builders import FP8

from dsv4ops import testing as T
from dsv4ops.quant.api import unpack_kv
from dsv4ops.quant.reference import pack_kv

BF16, FP32, I32 = torch.bfloat16, torch.float32, torch.int32
WINDOW, RING, BS = 4, 8, 4
# Request 0 at positions 9..11 reads window positions 6..11 (ring slots 6, 7, 0..3): slots 4, 5 hold
# positions 4, 5, outside every window, and stay poison. Request 1 at 0..1 (slots 8, 9). One padding.
RUNS = ((0, 9, 3), (1, 0, 2))
STORED = {0: range(6, 12), 1: range(0, 2)}
COMP_IDX = [[0, 3, -1], [-1, -1, -1], [4, 1, 2], [2, -1, -1], [0, 1, 4], [6, 7, 5]]  # last: padding -> poison
# Token 2 lists its first two columns only: its slot 2 is not read; token 4 lists none of its row.
COMP_LENS = [3, 3, 2, 1, 0, 3]


def _case(dtype, fmt, heads: int, comp_fmt=None, window_ends=None):
    """Arguments whose pools hold rows only where a query may read; and those rows as read back."""
    comp_fmt = comp_fmt or fmt
    dim = 16 if isinstance(fmt, torch.dtype) else 512
    wf, cf = builders.format_name(fmt, dim), builders.format_name(comp_fmt, dim)
    positions, req_slots = builders.step_tokens(*RUNS, pad=1)
    window_cache, comp_cache = builders.page_pool(4, BS, dim, fmt), builders.page_pool(2, BS, dim, comp_fmt)
    rows = {}
    for r, ps in STORED.items():
        for p in ps:
            rows[r, p] = torch.randn(1, dim)
            pack_kv(rows[r, p], torch.tensor([r * RING + p % RING], dtype=I32), window_cache, wf)
    pack_kv(torch.randn(5, dim), torch.arange(5, dtype=I32), comp_cache, cf)
    t = positions.shape[0]
    args = dict(q=torch.randn(t, heads, dim, dtype=dtype), window_cache=window_cache, comp_cache=comp_cache,
                positions=positions, req_slots=req_slots, comp_idx=torch.tensor(COMP_IDX, dtype=I32),
                comp_lens=torch.tensor(COMP_LENS, dtype=I32),
                window_ends=None if window_ends is None else torch.tensor(window_ends, dtype=I32),
                sinks=torch.randn(heads),
                out=torch.full((t, heads, dim), float("nan"), dtype=dtype), scale=dim**-0.5, window=WINDOW,
                ring_size=RING, window_fmt=wf, comp_fmt=cf)
    read = {k: unpack_kv(window_cache, torch.tensor([k[0] * RING + k[1] % RING], dtype=I32), dim, FP32, wf)[0]
            for k in rows}
    comp = unpack_kv(comp_cache, torch.arange(5, dtype=I32), dim, FP32, cf)
    return args, read, comp


def _dense_sink_attention(q: torch.Tensor, keys: torch.Tensor, sinks: torch.Tensor, scale: float) -> torch.Tensor:
    """Written out here, independent of reference.functional: per head, softmax over [logits, sink]
    with the sink's share dropped, times the keys (K = V). q [H, D], keys [J, D]. QK and PV in q's
    dtype with the probabilities cast to it, the softmax in fp32 (fp64 for fp64), as the spec's
    rounding points."""
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    logits = (q @ keys.T).to(acc) * scale  # [H, J]
    full = torch.cat([logits, sinks.to(acc)[:, None]], 1)
    e = torch.exp(full - full.max(1, keepdim=True).values)
    p = e / e.sum(1, keepdim=True)
    return p[:, :-1].to(q.dtype) @ keys


def _reference(args: dict, read: dict, comp: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Query by query: keys = window rows of positions max(0, e - W + 1) .. e (e: the token's window
    end, its position by default), then comp rows of its comp_idx >= 0; dense sink attention in
    `dtype` (fp64: the error budget's reference)."""
    outs = []
    ends = args["positions"] if args["window_ends"] is None else args["window_ends"]
    for i, (e, r) in enumerate(zip(ends.tolist(), args["req_slots"].tolist(), strict=True)):
        q = args["q"][i].to(dtype)
        if r < 0:
            outs.append(torch.zeros_like(q))
            continue
        keys = [read[r, s] for s in range(max(0, e - WINDOW + 1), e + 1)]
        keys += [comp[j] for j in args["comp_idx"][i, :args["comp_lens"][i]].tolist() if j >= 0]
        outs.append(_dense_sink_attention(q, torch.stack(keys).to(dtype), args["sinks"], args["scale"]))
    return torch.stack(outs)


@pytest.mark.parametrize("dtype,fmt,heads,comp_fmt",
                         [(FP32, FP32, 2, None), (BF16, BF16, 2, None), (BF16, FP8, 1, None), (FP32, FP8, 2, None),
                          (BF16, "fp8_528", 2, "fp4_288"), (FP32, "fp8_528", 1, "fp4_288")],
                         ids=["fp32", "bf16", "bf16-fp8", "fp32-fp8", "v41-bf16", "v41-fp32"])
def test_attends_to_exactly_its_window_and_entries(dtype, fmt, heads, comp_fmt):
    args, read, comp = _case(dtype, fmt, heads, comp_fmt)
    builders.call_op("sparse_attn", args)
    out = args["out"]
    # Rows outside every window and comp slots 5..7 are NaN poison: reading any of them shows here.
    assert not out.isnan().any()
    assert (out[-1] == 0).all()  # the padding token's row
    ref64 = _reference(args, read, comp, torch.float64)
    lowp = _reference(args, read, comp, dtype)
    T.assert_close_to_ref(out, ref64, lowp, what=f"sparse_attn {dtype} {fmt}")
    public = builders.call_public("sparse_attn", args)
    assert public.is_contiguous() and builders.bytes_equal(public, out)


# Draft blocks: request 0's three tokens (9..11) one block ending at 11, request 1's two (0..1) one
# ending at 1; the padding token's end is free.
BLOCK_ENDS = [11, 11, 11, 1, 1, 0]


@pytest.mark.parametrize("dtype,fmt,comp_fmt", [(FP32, FP32, None), (BF16, FP8, None), (BF16, "fp8_528", "fp4_288")],
                         ids=["fp32", "bf16-fp8", "v41-bf16"])
def test_draft_block_sees_itself_both_ways(dtype, fmt, comp_fmt):
    """window_ends = the block's last position: every token of a block reads the same window (the
    `window` positions ending there, later tokens of its block included), equal to the independent
    dense formulation with those keys."""
    args, read, comp = _case(dtype, fmt, 2, comp_fmt, window_ends=BLOCK_ENDS)
    builders.call_op("sparse_attn", args)
    out = args["out"]
    assert not out.isnan().any() and (out[-1] == 0).all()
    T.assert_close_to_ref(out, _reference(args, read, comp, torch.float64), _reference(args, read, comp, dtype),
                          what=f"block-causal sparse_attn {dtype} {fmt}")
    public = builders.call_public("sparse_attn", args)
    assert builders.bytes_equal(public, out)
    causal = builders.call_public("sparse_attn", dict(args, window_ends=None))
    # Token 2 (position 11, the block's end) and token 4 (position 1) see the same keys either way;
    # the earlier tokens of each block see later ones only with the block's window end.
    same = [bool(torch.equal(a, b)) for a, b in zip(causal, public, strict=True)]
    assert same == [False, False, True, False, True, True]


def test_window_and_entries_both_count():
    # A query's output moves when a row of its window or a listed entry changes, and only then
    # (queries whose keys did not change repeat the same computation on the same values: `!=` is exact).
    args, _, _ = _case(FP32, FP32, 2)
    base = builders.call_public("sparse_attn", args)
    args["window_cache"].view(-1, 16)[1 * RING + 1] += 1.0  # request 1, position 1: token 4 only
    moved = (builders.call_public("sparse_attn", args) != base).flatten(1).any(-1).nonzero().flatten().tolist()
    assert moved == [4]
    args["comp_cache"].view(-1, 16)[3] += 1.0  # entry slot 3: listed by token 0 only
    moved = (builders.call_public("sparse_attn", args) != base).flatten(1).any(-1).nonzero().flatten().tolist()
    assert moved == [0, 4]
    args["comp_cache"].view(-1, 16)[2] += 1.0  # slot 2: in token 2's row past its comp_lens, and token 3's
    moved = (builders.call_public("sparse_attn", args) != base).flatten(1).any(-1).nonzero().flatten().tolist()
    assert moved == [0, 3, 4]


# ---- bad inputs: one per rule ------------------------------------------------------------------
ARGS = partial(builders.sparse_attn_args, FP32)
wa = builders.with_arg
BAD = [
    ("q-ndim", wa("q", lambda a: a["q"][0]), r"q: expected 3-D \[tokens, heads, head_dim\]"),
    ("q-dtype", wa("q", lambda a: a["q"].double()), r"q: expected dtype in"),
    ("q-last-dim", wa("q", lambda a: a["q"].transpose(1, 2).contiguous().transpose(1, 2)),
     r"q: expected a contiguous last dim"),
    ("window_cache-width", wa("window_cache", lambda a: a["window_cache"][..., :8].contiguous()),
     r"window_cache: expected size 16 \(row width\) at dim 2, got 8"),
    ("comp_cache-bytes", wa("comp_cache", lambda a: torch.zeros(2, 528, dtype=torch.uint8)),
     r"comp_cache: expected dtype in \[torch.float32, torch.bfloat16, torch.float16\], got torch.uint8"),
    ("comp_fmt-width", wa("comp_fmt", lambda a: "fp4_288"),
     r"comp_cache: expected dtype in \[torch.uint8\], got torch.float32"),
    ("comp_fmt-unknown", wa("comp_fmt", lambda a: "nvfp4"), r"comp_fmt: expected one of \['fp8_584'"),
    ("positions-device", wa("positions", lambda a: a["positions"].to("meta")),
     r"positions: expected device cpu \(as q\), got meta"),
    ("req_slots-size", wa("req_slots", lambda a: a["req_slots"][:-1]), r"req_slots: expected size 6 \(tokens of q\)"),
    ("comp_idx-ndim", wa("comp_idx", lambda a: a["comp_idx"][0]), r"comp_idx: expected 2-D \[tokens, entries\]"),
    ("comp_idx-dtype", wa("comp_idx", lambda a: a["comp_idx"].long()), r"comp_idx: expected dtype in \[torch.int32\]"),
    ("comp_idx-size", wa("comp_idx", lambda a: a["comp_idx"][:-1]), r"comp_idx: expected size 6 \(tokens of q\)"),
    ("comp_idx-device", wa("comp_idx", lambda a: a["comp_idx"].to("meta")),
     r"comp_idx: expected device cpu \(as q\), got meta"),
    ("comp_lens-dtype", wa("comp_lens", lambda a: a["comp_lens"].long()),
     r"comp_lens: expected dtype in \[torch.int32\]"),
    ("comp_lens-size", wa("comp_lens", lambda a: a["comp_lens"][:-1]), r"comp_lens: expected size 6 \(tokens of q\)"),
    ("window_ends-dtype", wa("window_ends", lambda a: a["positions"].long()),
     r"window_ends: expected dtype in \[torch.int32\]"),
    ("window_ends-size", wa("window_ends", lambda a: a["positions"][:-1]),
     r"window_ends: expected size 6 \(tokens of q\)"),
    ("sinks-ndim", wa("sinks", lambda a: a["sinks"][None]), r"sinks: expected 1-D \[heads\]"),
    ("sinks-dtype", wa("sinks", lambda a: a["sinks"].bfloat16()), r"sinks: expected dtype in \[torch.float32\]"),
    ("sinks-size", wa("sinks", lambda a: a["sinks"][:1]), r"sinks: expected size 2 \(heads of q\) at dim 0, got 1"),
    ("sinks-device", wa("sinks", lambda a: a["sinks"].to("meta")), r"sinks: expected device cpu \(as q\), got meta"),
    ("out-shape", wa("out", lambda a: a["out"][:, :1]), r"out: expected shape \(6, 2, 16\) \(as q\)", ("op",)),
    ("out-dtype", wa("out", lambda a: a["out"].bfloat16()), r"out: expected dtype in \[torch.float32\]", ("op",)),
    ("out-last-dim", wa("out", lambda a: a["out"].transpose(1, 2).contiguous().transpose(1, 2)),
     r"out: expected a contiguous last dim", ("op",)),
    ("window-positive", wa("window", lambda a: 0), r"window: expected > 0, got 0"),
    ("ring_size-window", wa("ring_size", lambda a: 3), r"ring_size: expected >= window \(4\), got 3"),
    # Issue 52: scale=nan ran and returned NaN.
    ("scale-nan", wa("scale", lambda a: float("nan")),
     r"scale: expected a finite value > 0 \(the logits' multiplier\), got nan"),
    ("scale-inf", wa("scale", lambda a: float("inf")), r"scale: expected a finite value > 0 .*got inf"),
    ("scale-zero", wa("scale", lambda a: 0.0), r"scale: expected a finite value > 0 .*got 0.0"),
    # Values (public function only; eager). Tokens: request 0 at 5..7, request 1 at 0..1, padding.
    ("positions-negative", wa("positions", lambda a: torch.tensor([5, 6, 7, -4, 1, 0], dtype=I32)),
     r"positions: expected >= 0 \(token positions\), got -4 at index 3", ("public",)),
    ("req_slots-high", wa("req_slots", lambda a: torch.tensor([0, 0, 0, 2, 2, -1], dtype=I32)),
     r"req_slots: expected values in \[-1, 2\) \(-1 or one of the 2 requests of the window pool \(8-slot rings\)\)",
     ("public",)),
    ("comp_idx-high", wa("comp_idx", lambda a: a["comp_idx"].masked_fill(torch.eye(6, 3, dtype=torch.bool), 8)),
     r"comp_idx: expected values in \[-1, 8\) \(-1 or a slot of comp_cache's 8\), got 8 at flat index 0",
     ("public",)),
    ("comp_idx-low", wa("comp_idx", lambda a: a["comp_idx"] - 2),
     r"comp_idx: expected values in \[-1, 8\) .*got -\d at flat index", ("public",)),
    ("comp_lens-high", wa("comp_lens", lambda a: a["comp_lens"] + 1),
     r"comp_lens: expected values in \[0, 4\) \(entries listed of comp_idx's 3 columns\), got 4 at index 1",
     ("public",)),
    ("window_ends-before", wa("window_ends", lambda a: torch.tensor([5, 7, 6, 0, 1, 0], dtype=I32)),
     r"window_ends: expected values from the token's position to the last position of its request \(7\.\.7 for "
     r"request 0\), got 6 at index 2", ("public",)),
    ("window_ends-past", wa("window_ends", lambda a: torch.tensor([7, 7, 7, 2, 1, 0], dtype=I32)),
     r"window_ends: expected values from the token's position to the last position of its request \(0\.\.1 for "
     r"request 1\), got 2 at index 3", ("public",)),
    ("span", wa("positions", lambda a: torch.tensor([0, 1, 7, 0, 1, 0], dtype=I32)),
     r"positions: expected the tokens of a request to span at most 5 positions \(ring_size 8 - window 4 \+ 1\), "
     r"got 8 for request 0 \(positions 0\.\.7\)", ("public",)),
]


@pytest.mark.parametrize("case", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_rejected_and_writes_nothing(case):
    _, mutate, match, *via = case
    builders.assert_bad_case("sparse_attn", ARGS(), mutate, match, via)


# ---- the sm_90 CUDA C++ launcher's choices (dsv4ops/sparse_attn/cuda.py) ------------------------
def test_csrc_launcher_serves_the_models_byte_formats_with_bf16_queries():
    """V4's (584, 584) and (584, 288) pools, V4.1's (528, 288) and its sliding layers' (528, 528), bf16 q
    of 512 dims, int32 lists, contiguous pools; the Triton kernel the rest."""
    from dsv4ops.sparse_attn import cuda

    pool = torch.zeros(2, 64 * 576, dtype=torch.uint8)
    q, idx = torch.zeros(1, 64, 512, dtype=torch.bfloat16), torch.zeros(1, 4, dtype=torch.int32)
    pairs = {("fp8_584", "fp8_584"), ("fp8_584", "fp4_288"), ("fp8_528", "fp4_288"), ("fp8_528", "fp8_528")}
    assert cuda.FORMAT_PAIRS == pairs
    for window_fmt, comp_fmt in pairs:
        assert cuda.serves(q, pool, pool, idx, window_fmt, comp_fmt)
        assert not cuda.serves(q.float(), pool, pool, idx, window_fmt, comp_fmt)
        assert not cuda.serves(q, pool, pool, idx.long(), window_fmt, comp_fmt)
        assert not cuda.serves(q, pool, pool[:, ::2], idx, window_fmt, comp_fmt)
    for window_fmt, comp_fmt in (("fp8_528", "fp8_584"), ("fp4_288", "fp4_288"), ("exact", "exact")):
        assert not cuda.serves(q, pool, pool, idx, window_fmt, comp_fmt)


def test_split_rule_fills_the_sms_once():
    from dsv4ops.sparse_attn.triton import split_rule

    assert split_rule(128, 640, 32, 132) == 1  # CSA 128 x 4K: the CTAs already fill the GPU
    assert split_rule(1, 640, 32, 132) == 20  # CSA 1 x 4K: one 32-key tile per split
    assert split_rule(32, 128 + 8192, 32, 132) == 9  # HCA 32 x 1M: one split per 1024 keys
    assert split_rule(8, 128, 32, 132) == 4  # never a split without a whole tile


# H100 (132 SMs): clusters of s whole-SM CTAs the device holds at once (dsv4ops.sparse_attn.cuda.cluster_capacity).
H100_CLUSTERS = (0, 0, 66, 39, 30, 22, 17, 15, 15)


def test_csrc_split_plan_fills_one_wave():
    from dsv4ops.sparse_attn.cuda import split_plan

    assert split_plan(128, 640, 132) == (1, False)  # CSA 128 x 4K: the CTAs already fill the GPU
    assert split_plan(1, 640, 132) == (20, False)  # CSA 1 x 4K: one 32-key tile per split
    assert split_plan(32, 640, 132) == (4, False)  # CSA 32 x 4K: 128 CTAs, 5 tiles each
    assert split_plan(32, 128 + 8192, 132) == (4, False)  # HCA 32 x 1M: one wave of 65 tiles, not 3 waves of 29
    assert split_plan(8, 128, 132) == (4, False)  # never a split without a whole tile
    assert split_plan(32, 128, 132) == (1, False)  # a 4-tile window at batch 32: the partials cost more than they save
    assert split_plan(1, 128, 132) == (4, False)
    assert split_plan(8, 640, 132) == (7, False)  # CSA 8 x 4K: 7 splits of 3 tiles (H100 15.4 us) beat 10 of 2 (16.7)
    # every count survives the launcher's rounding to whole tiles (7 splits of 22 tiles would be 6 of 4)
    for ctas in (1, 3, 8, 17, 40):
        for keys in (128, 192, 704, 1152, 2240, 128 + 8192):
            for heads, tile in ((64, 32), (8, 64)):
                n, _ = split_plan(ctas, keys, 132, heads, tile, H100_CLUSTERS)
                tiles = -(-keys // tile)
                assert -(-tiles // -(-tiles // n)) == n, (ctas, keys, heads, n)


def test_csrc_split_plan_merges_in_clusters_that_fit():
    """Where 2-8 splits' clusters all fit the device at once, the plan weighs their merge in the
    cluster (its CTAs read (S - 1) / S of their heads' rows from their peers) against the combine."""
    from dsv4ops.sparse_attn.cuda import split_plan

    # CSA 8 x 4K at 64 heads: 7 splits merged (H100 13.7 us; 5 with the combine 16.1)
    assert split_plan(8, 640, 132, clusters=H100_CLUSTERS) == (7, True)
    # CSA 32 x 4K: 32 clusters of 3 fit, 32 of 4 do not (30): 3 merged (H100 19.0 us, 4 with the combine 19.2)
    assert split_plan(32, 640, 132, clusters=H100_CLUSTERS) == (3, True)
    assert split_plan(32, 640, 132) == (4, False)  # no cluster capacity known: the combine
    assert split_plan(32, 640, 132, clusters=H100_CLUSTERS[:3]) == (2, True)  # 32 clusters of 2 only
    assert split_plan(1, 640, 132, clusters=H100_CLUSTERS) == (20, False)  # more splits than a cluster holds
    assert split_plan(128, 640, 132, clusters=H100_CLUSTERS) == (1, False)
    # 8 heads, sliding 64 x 4K: two splits of one 64-key tile merge (H100 7.7 us against one split's 8.7)
    assert split_plan(64, 128, 132, 8, 64) == (1, False)
    assert split_plan(64, 128, 132, 8, 64, H100_CLUSTERS) == (2, True)


def test_csrc_heads_per_cta_and_tile_keys():
    """Tensor-parallel head shards of up to 16 heads take small_heads.cu's CTA of 8 / 16 heads (64-key
    tiles), at any token count; more heads take 64-head CTAs (32-key tiles), 17-32 heads one with
    padding rows."""
    from dsv4ops.sparse_attn.cuda import cta_heads, split_plan, tile_keys

    assert [cta_heads(h) for h in (1, 8, 9, 16, 17, 24, 32, 33, 64, 128)] == [8, 8, 16, 16, 64, 64, 64, 64, 64, 64]
    assert [tile_keys(c) for c in (8, 16, 64)] == [64, 64, 32]
    assert split_plan(1, 640, 132, 8, 64) == (10, False)  # CSA 1 x 4K at 8 heads: one 64-key tile per split
    # CSA 32 x 4K at 16 heads: 4 splits of 3 tiles fill the wave (H100: 17.8 us; 2 splits 20.7, 5: 22.7)
    assert split_plan(32, 640, 132, 16, 64) == (4, False)


# ---- the Triton kernel under the interpreter, against the reference (helpers: tests/interp.py) -------------
from interp import i32, new_pool  # noqa: E402

from dsv4ops.quant import reference as quant_ref  # noqa: E402
from dsv4ops.sparse_attn import reference as sparse_attn_ref  # noqa: E402
from dsv4ops.sparse_attn import triton as sparse_attn_tt  # noqa: E402


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
    pos, req = i32(3, 4, 20, 9, 0), i32(0, 0, 1, -1, 1)
    ends = i32(4, 4, 20, 9, 0) if blocks else None
    wc, cc = new_pool(w_pool, 512, 2 * ring // BS), new_pool(c_pool, 512, 4)
    w_fmt, c_fmt = builders.format_name(w_pool, 512), builders.format_name(c_pool, 512)
    for p, r in zip((pos if ends is None else ends).tolist(), req.tolist()):  # only the windows' ring slots hold keys
        if r >= 0:
            held = torch.arange(max(0, p - window + 1), p + 1)
            quant_ref.pack_kv(torch.randn(len(held), 512), (r * ring + held % ring).to(torch.int32), wc, w_fmt)
    quant_ref.pack_kv(torch.randn(16, 512), torch.arange(16, dtype=torch.int32), cc, c_fmt)
    idx = torch.randint(0, 16, (t, 40), dtype=torch.int32)
    idx[0, 2:] = -1
    idx[2, 0] = -1
    lens = i32(40, 40, 37, 40, 5)  # token 2 drops its last 3 columns, token 4 lists 5 (all in split 0)
    q, sinks = torch.randn(t, h, 512), torch.randn(h)

    def run(fn, dtype):
        as_dtype = (lambda c: c if c.dtype == torch.uint8 else c.to(dtype)) if dtype == torch.float64 else (lambda c: c)
        out = torch.full((t, h, 512), float("nan"), dtype=dtype)
        w_, c_ = as_dtype(wc), as_dtype(cc)
        fn(q.to(dtype), w_, c_, pos, req, idx, lens, ends, sinks, out, 512**-0.5, window, ring, w_fmt, c_fmt)
        return out

    got = run(sparse_attn_tt.sparse_attn, torch.bfloat16)
    assert (got[3] == 0).all(), "padding token"
    T.assert_close_to_ref(got, run(sparse_attn_ref.sparse_attn, torch.float64),
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
    pos, req = i32(3, 4, 20, 9, 0), i32(0, 0, 1, -1, 1)
    ends = i32(3, -1, 20, 9, -1)  # tokens 1 and 4: no window
    wc, cc = new_pool(w_pool, 512, 2 * ring // BS), new_pool(c_pool, 512, 4)
    w_fmt, c_fmt = builders.format_name(w_pool, 512), builders.format_name(c_pool, 512)
    for p, r in ((3, 0), (20, 1)):
        held = torch.arange(max(0, p - window + 1), p + 1)
        quant_ref.pack_kv(torch.randn(len(held), 512), (r * ring + held % ring).to(torch.int32), wc, w_fmt)
    quant_ref.pack_kv(torch.randn(16, 512), torch.arange(16, dtype=torch.int32), cc, c_fmt)
    idx = torch.randint(0, 16, (t, 40), dtype=torch.int32)
    lens = i32(40, 0, 37, 40, 5)
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
    T.assert_close_to_ref(got, ref, low, what="partial output")
    T.assert_close_to_ref(lse[live], ref_lse[live], low_lse[live], what="lse")


def test_sparse_attn_fp32():
    # fp32 activations and pools: the fp32 (IEEE) dot path, close to fp64.
    t, h, window, ring = 2, 3, 8, 8
    wc, cc = new_pool(torch.float32, 512, 4), new_pool(torch.float32, 512, 2)
    wc.normal_()
    cc.normal_()
    q, sinks = torch.randn(t, h, 512), torch.randn(h)
    pos, req, idx, lens = i32(5, 30), i32(1, 0), i32(0, 3, -1, 7).view(2, 2), i32(2, 2)
    got, want = torch.empty(t, h, 512), torch.empty(t, h, 512, dtype=torch.float64)
    sparse_attn_tt.sparse_attn(q, wc, cc, pos, req, idx, lens, None, sinks, got, 512**-0.5, window, ring, "exact",
                               "exact")
    sparse_attn_ref.sparse_attn(q.double(), wc.double(), cc.double(), pos, req, idx, lens, None, sinks, want,
                                512**-0.5, window, ring, "exact", "exact")
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)


def test_sparse_attn_launcher_rejects_the_combinations_it_does_not_implement():
    # The launcher names what it lacks instead of guessing, before writing anything: V4's 584-B rows
    # beside a V4.1 format.
    a = builders.sparse_attn_args(torch.bfloat16, "fp8_528", comp_fmt="fp8_584")
    before = {k: v.clone() for k, v in a.items() if isinstance(v, torch.Tensor)}
    with pytest.raises(NotImplementedError,
                       match="the Triton kernel does not implement window_fmt='fp8_528' with comp_fmt='fp8_584'"):
        sparse_attn_tt.sparse_attn(*a.values())
    assert all(builders.bytes_equal(a[k], v) for k, v in before.items())
