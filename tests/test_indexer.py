"""dsv4::indexer_q_prep / dsv4::indexer_topk and their public functions: RoPE and weight folding
(exact and FP8 queries), top-k over the visible entries through the block table (ties to the lower
entry, -1 fill, padding rows), what a call writes, bad inputs. Issue 3."""

from functools import partial

import pytest
import torch

from dsv4ops import testing as T
from dsv4ops.quant.reference import pack_kv
from dsv4ops.reference.numerics import quantize_indexer_query, round_indexer_key
from dsv4ops.testing import FP8

BF16, FP32, E4M3, I32 = torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.int32


# ---- indexer_q_prep ----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,fp8", [(FP32, False), (BF16, False), (BF16, True), (FP32, True)],
                         ids=["fp32", "bf16", "bf16-fp8", "fp32-fp8"])
def test_q_prep_ropes_the_query_and_folds_the_weights(dtype, fp8):
    args = T.indexer_q_prep_args(dtype, fp8=fp8, heads=3, tokens=4, noncontig=True)
    args["q_out"].view(torch.uint8).fill_(0xFF)  # poison: NaN in every float dtype
    args["w_out"].fill_(float("nan"))
    T.call_op("indexer_q_prep", args)
    q, pos, inv_freq = args["q"], args["positions"], args["inv_freq"]
    # The same expression as the op (one fp32 product per element): bit for bit.
    w = args["weights"].float() * (16**-0.5 * 3**-0.5)  # d^-1/2 x H^-1/2
    rot64 = T.complex_rope(q.double(), pos, inv_freq)  # expected values: RoPE written independently
    rot_lowp = T.complex_rope(q, pos, inv_freq)
    if not fp8:
        T.assert_close_to_ref(args["q_out"], rot64, rot_lowp, what="q_out")
        assert torch.equal(args["w_out"], w)
        return
    # What the scores see, q' x w' per (token, head), against the fp64 rotation times the weights;
    # budget: the run in the activations' dtype with the numerics' FP8 query rounding.
    scale = args["w_out"] / w  # [T, H]: one power of two per (token, head), folded into the weights
    assert torch.equal(torch.frexp(scale).mantissa, torch.full_like(scale, 0.5))
    got = args["q_out"].double() * args["w_out"].double()[..., None]
    q8, w8 = quantize_indexer_query(rot_lowp, w, "fp8")
    T.assert_close_to_ref(got, rot64 * w.double()[..., None], q8.double() * w8.double()[..., None], what="q x w")


def test_q_prep_public_function_allocates_contiguous_outputs():
    args = T.indexer_q_prep_args(BF16, fp8=True, noncontig=True)
    q_out, w_out = T.call_public("indexer_q_prep", args)
    T.call_op("indexer_q_prep", args)
    assert q_out.is_contiguous() and q_out.dtype == E4M3 and w_out.dtype == FP32
    assert T.bytes_equal(q_out, args["q_out"]) and torch.equal(w_out, args["w_out"])


# ---- indexer_topk ------------------------------------------------------------------------------
RATIO, BS, D, H = 2, 4, 16, 3
# Request 0 at positions 5..9 sees 3..5 entries; request 1 at 0..2 sees 0..1; one padding token.
RUNS = ((0, 5, 5), (1, 0, 3))
TABLE = torch.tensor([[5, 2], [0, -1]], dtype=I32)  # request 1's second block is unallocated
ENTRIES = {0: 5, 1: 1}  # entries each request has stored


def _topk_case(fmt, k: int, zero_weights: bool = False):
    """Arguments with keys stored at the requests' entry slots only (every other slot poison) and
    the fp64 scores of every (token, entry) from those keys."""
    positions, req_slots = T.step_tokens(*RUNS, pad=1)
    t = positions.shape[0]
    dim = 128 if fmt == FP8 else D
    pool = T.page_pool(6, BS, dim, fmt)
    keys = {r: torch.randn(n, dim) for r, n in ENTRIES.items()}
    for r, kr in keys.items():
        w = torch.arange(kr.shape[0])
        pack_kv(kr, (TABLE[r, w // BS].long() * BS + w % BS).to(I32), pool)
    q = torch.randn(t, H, dim)
    if fmt == FP8:
        q = q.to(E4M3)
        keys = {r: round_indexer_key(kr, "fp8") for r, kr in keys.items()}
    weights = torch.zeros(t, H) if zero_weights else torch.rand(t, H) + 0.5
    args = dict(q=q, weights=weights, positions=positions, req_slots=req_slots, cache=pool,
                block_table=TABLE.clone(), idx_out=torch.full((t, k), 7777, dtype=I32), ratio=RATIO)
    return args, keys


def _scores(args: dict, keys: dict, dtype) -> torch.Tensor:
    """[T, 12] score of every entry of each token's request in `dtype` (sum_h w_h relu(q_h . k));
    -inf past the visible ones (w >= (t + 1) // ratio) and for padding."""
    out = torch.full((args["q"].shape[0], 12), float("-inf"), dtype=torch.float64)
    for i, (p, r) in enumerate(zip(args["positions"].tolist(), args["req_slots"].tolist(), strict=True)):
        if r < 0:
            continue
        n = (p + 1) // RATIO
        kd = keys[r][:n].to(dtype)
        score = (args["q"][i].to(dtype) @ kd.T).relu().mul(args["weights"][i].to(dtype)[:, None]).sum(0)
        out[i, :n] = score.double()
    return out


def _entries(idx: torch.Tensor, req_slots: torch.Tensor) -> torch.Tensor:
    """Global slots -> entry indices of the token's request through TABLE (-1 stays -1)."""
    out = torch.full_like(idx, -1, dtype=torch.long)
    for i, r in enumerate(req_slots.tolist()):
        for j, s in enumerate(idx[i].tolist()):
            if s >= 0:
                b = TABLE[r].tolist().index(s // BS)
                out[i, j] = b * BS + s % BS
    return out


@pytest.mark.parametrize("fmt", [FP32, BF16, FP8], ids=["fp32-pool", "bf16-pool", "fp8-pool"])
@pytest.mark.parametrize("k", [2, 6])
def test_topk_selects_the_best_visible_entries(fmt, k):
    args, keys = _topk_case(fmt, k)
    if fmt == BF16:
        keys = {r: kr.bfloat16().float() for r, kr in keys.items()}
        args["q"] = args["q"].bfloat16()
    T.call_op("indexer_topk", args)
    # Every row written (7777 gone); padding rows and entries past the visible ones are -1; keys in
    # unallocated or foreign slots are NaN poison, so reading one would scramble the order. The
    # kernel scores in fp32: against fp64 scores, entries within twice the fp32 run's error of the
    # k-th best may swap.
    s64, s32 = _scores(args, keys, torch.float64), _scores(args, keys, torch.float32)
    finite = torch.isfinite(s64)
    tol = 2 * (s32 - s64)[finite].abs().max().item()
    assert (args["idx_out"][args["req_slots"] < 0] == -1).all()
    T.assert_topk_within(_entries(args["idx_out"], args["req_slots"]), s64, k, tol, what="op")
    idx = T.call_public("indexer_topk", args)
    assert torch.equal(idx, args["idx_out"]) and idx.dtype == I32  # the same kernel on the same inputs


def test_topk_ties_pick_the_lower_entry():
    args, keys = _topk_case(FP32, 3, zero_weights=True)  # every score 0
    T.call_op("indexer_topk", args)
    # Token 4 of request 0 (position 9) sees entries 0..4 in blocks 5, 2: the first three are slots
    # 20, 21, 22; request 1 at position 2 sees entry 0 (slot 0).
    assert args["idx_out"][4].tolist() == [20, 21, 22]
    assert args["idx_out"][7].tolist() == [0, -1, -1]
    assert args["idx_out"][5].tolist() == [-1, -1, -1]  # request 1 at position 0 sees nothing


# ---- bad inputs: one per rule ------------------------------------------------------------------
Q_PREP = partial(T.indexer_q_prep_args, FP32)
TOPK = partial(T.indexer_topk_args, FP32)
TOPK_FP8 = partial(T.indexer_topk_args, E4M3, FP8)
wa = T.with_arg
BAD = [
    # (id, op, factory, mutation, message[, paths])
    ("q-ndim", "indexer_q_prep", Q_PREP, wa("q", lambda a: a["q"][0]), r"q: expected 3-D \[tokens, index_heads"),
    ("q-dtype", "indexer_q_prep", Q_PREP, wa("q", lambda a: a["q"].double()), r"q: expected dtype in"),
    ("q-last-dim", "indexer_q_prep", Q_PREP, wa("q", lambda a: a["q"].transpose(1, 2).contiguous().transpose(1, 2)),
     r"q: expected a contiguous last dim"),
    ("weights-ndim", "indexer_q_prep", Q_PREP, wa("weights", lambda a: a["weights"][0]),
     r"weights: expected 2-D \[tokens, index_heads\]"),
    ("weights-dtype", "indexer_q_prep", Q_PREP, wa("weights", lambda a: a["weights"].int()),
     r"weights: expected dtype in"),
    ("weights-shape", "indexer_q_prep", Q_PREP, wa("weights", lambda a: a["weights"][:, :1]),
     r"weights: expected shape \(3, 2\) \(as q\[\.\.\., 0\]\), got \(3, 1\)"),
    ("positions-size", "indexer_q_prep", Q_PREP, wa("positions", lambda a: a["positions"][:2]),
     r"positions: expected size 3 \(tokens of q\)"),
    ("inv_freq-width", "indexer_q_prep", Q_PREP, wa("inv_freq", lambda a: torch.ones(9)),
     r"inv_freq: expected at most 8 frequencies"),
    ("q_out-shape", "indexer_q_prep", Q_PREP, wa("q_out", lambda a: a["q_out"][:2]), r"q_out: expected shape", ("op",)),
    ("q_out-dtype", "indexer_q_prep", Q_PREP, wa("q_out", lambda a: a["q_out"].int()), r"q_out: expected dtype in",
     ("op",)),
    ("q_out-last-dim", "indexer_q_prep", Q_PREP,
     wa("q_out", lambda a: a["q_out"].transpose(1, 2).contiguous().transpose(1, 2)),
     r"q_out: expected a contiguous last dim", ("op",)),
    ("w_out-shape", "indexer_q_prep", Q_PREP, wa("w_out", lambda a: a["w_out"][:2]), r"w_out: expected shape", ("op",)),
    ("w_out-dtype", "indexer_q_prep", Q_PREP, wa("w_out", lambda a: a["w_out"].bfloat16()),
     r"w_out: expected dtype in \[torch.float32\]", ("op",)),
    ("q_prep-positions-negative", "indexer_q_prep", Q_PREP,
     wa("positions", lambda a: torch.tensor([0, -3, 1], dtype=I32)),
     r"positions: expected >= 0 \(token positions\), got -3 at index 1", ("public",)),
    ("topk-q-ndim", "indexer_topk", TOPK, wa("q", lambda a: a["q"][0]), r"q: expected 3-D"),
    ("topk-q-dtype", "indexer_topk", TOPK, wa("q", lambda a: a["q"].double()), r"q: expected dtype in"),
    ("topk-q-last-dim", "indexer_topk", TOPK, wa("q", lambda a: a["q"].transpose(1, 2).contiguous().transpose(1, 2)),
     r"q: expected a contiguous last dim"),
    ("topk-weights-ndim", "indexer_topk", TOPK, wa("weights", lambda a: a["weights"][0]), r"weights: expected 2-D"),
    ("topk-weights-dtype", "indexer_topk", TOPK, wa("weights", lambda a: a["weights"].bfloat16()),
     r"weights: expected dtype in \[torch.float32\], got torch.bfloat16"),
    ("topk-weights-shape", "indexer_topk", TOPK, wa("weights", lambda a: a["weights"][:-1]),
     r"weights: expected shape \(6, 2\)"),
    ("topk-positions-dtype", "indexer_topk", TOPK, wa("positions", lambda a: a["positions"].long()),
     r"positions: expected dtype in"),
    ("topk-req_slots-ndim", "indexer_topk", TOPK, wa("req_slots", lambda a: a["req_slots"][None]),
     r"req_slots: expected 1-D"),
    ("topk-cache-fp8-width", "indexer_topk", TOPK_FP8, wa("q", lambda a: a["q"][..., :64].contiguous()),
     r"cache: FP8 entries exist for 512-d \(584 B\) and 128-d \(132 B\) rows, got 64-d rows"),
    ("block_table-ndim", "indexer_topk", TOPK, wa("block_table", lambda a: a["block_table"][0]),
     r"block_table: expected 2-D \[requests, blocks per request\]"),
    ("block_table-dtype", "indexer_topk", TOPK, wa("block_table", lambda a: a["block_table"].long()),
     r"block_table: expected dtype in \[torch.int32\]"),
    ("block_table-device", "indexer_topk", TOPK, wa("block_table", lambda a: a["block_table"].to("meta")),
     r"block_table: expected device cpu \(as q\), got meta"),
    ("idx_out-ndim", "indexer_topk", TOPK, wa("idx_out", lambda a: a["idx_out"][0]), r"idx_out: expected 2-D", ("op",)),
    ("idx_out-dtype", "indexer_topk", TOPK, wa("idx_out", lambda a: a["idx_out"].long()),
     r"idx_out: expected dtype in \[torch.int32\]", ("op",)),
    ("idx_out-size", "indexer_topk", TOPK, wa("idx_out", lambda a: a["idx_out"][:-1]),
     r"idx_out: expected size 6 \(tokens of q\)", ("op",)),
    ("idx_out-device", "indexer_topk", TOPK, wa("idx_out", lambda a: a["idx_out"].to("meta")),
     r"idx_out: expected device cpu \(as q\), got meta", ("op",)),
    ("ratio-positive", "indexer_topk", TOPK, wa("ratio", lambda a: 0), r"ratio: expected > 0, got 0"),
    # Values (public function only; eager). Tokens: request 0 at 5..7, request 1 at 0..1, padding.
    ("k", "indexer_topk", TOPK, wa("idx_out", lambda a: a["idx_out"][:, :0]),
     r"k: expected >= 1 entries per token, got 0", ("public",)),
    ("topk-positions-negative", "indexer_topk", TOPK,
     wa("positions", lambda a: torch.tensor([5, 6, 7, 0, -1, 0], dtype=I32)),
     r"positions: expected >= 0 \(token positions\), got -1 at index 4", ("public",)),
    ("topk-req_slots-high", "indexer_topk", TOPK,
     wa("req_slots", lambda a: torch.tensor([0, 0, 0, 2, 2, -1], dtype=I32)),
     r"req_slots: expected values in \[-1, 2\) \(-1 or one of the 2 requests of block_table\), got 2", ("public",)),
    ("block_table-high", "indexer_topk", TOPK, wa("block_table", lambda a: torch.tensor([[0, 4], [2, 3]], dtype=I32)),
     r"block_table: expected values in \[-1, 4\) \(-1 or one of the pool's 4 blocks\), got 4 at flat index 1",
     ("public",)),
    ("block_table-unallocated", "indexer_topk", TOPK,
     wa("block_table", lambda a: torch.tensor([[-1, 1], [2, 3]], dtype=I32)),
     r"block_table: expected an allocated block \(>= 0\) for every visible entry, got -1 at block 0 of request 0 "
     r"\(position 5 sees 3 entries\)", ("public",)),
    ("block_table-narrow", "indexer_topk", partial(T.indexer_topk_args, FP32, ratio=1),
     wa("block_table", lambda a: a["block_table"][:, :1].contiguous()),
     r"block_table: expected 2 blocks for the 6 visible entries of request 0 at position 5, got a table 1 blocks "
     r"wide", ("public",)),
]


@pytest.mark.parametrize("case", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_rejected_and_writes_nothing(case):
    _, name, factory, mutate, match, *via = case
    T.assert_bad_case(name, factory(), mutate, match, via)
