"""dsv4::indexer_q_prep / dsv4::indexer_k_prep / dsv4::indexer_topk and their public functions: RoPE
and weight folding (exact, FP8 and MX4 queries), V4.1's index keys, top-k over the visible entries
through the block table (ties to the lower entry, -1 fill, padding rows), V4.1's candidate-block
pool (published from the source's scores; reindex scoring restricted to it), what a call writes,
bad inputs. Issues 3, 16."""

from functools import partial

import builders
import pytest
import torch
from builders import FP8

import format_model as M
import triton
from interp import INV_FREQ, i32, new_pool, pool_fmt, pool_rows
from dsv4ops import testing as T
from dsv4ops.indexer import reference as indexer_ref
from dsv4ops.indexer import triton as indexer_tt
from dsv4ops.indexer import triton_prep as indexer_prep_tt
from dsv4ops.quant import reference as quant_ref
from dsv4ops.quant.reference import pack_kv
from dsv4ops.reference.functional import apply_rope, rope_angles
from dsv4ops.reference.numerics import quantize_indexer_query, round_indexer_key

tl = triton.language

BF16, FP32, E4M3, I32 = torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.int32


# ---- indexer_q_prep ----------------------------------------------------------------------------
@pytest.mark.parametrize("dtype,fp8", [(FP32, False), (BF16, False), (BF16, True), (FP32, True)],
                         ids=["fp32", "bf16", "bf16-fp8", "fp32-fp8"])
def test_q_prep_ropes_the_query_and_folds_the_weights(dtype, fp8):
    args = builders.indexer_q_prep_args(dtype, "fp8_132" if fp8 else "exact", heads=3, tokens=4, noncontig=True)
    args["q_out"].view(torch.uint8).fill_(0xFF)  # poison: NaN in every float dtype
    args["w_out"].fill_(float("nan"))
    builders.call_op("indexer_q_prep", args)
    q, pos, inv_freq = args["q"], args["positions"], args["inv_freq"]
    # The same expression as the op (one fp32 product per element): bit for bit.
    w = args["weights"].float() * (q.shape[2]**-0.5 * 3**-0.5)  # d^-1/2 x H^-1/2
    rot64 = builders.complex_rope(q.double(), pos, inv_freq)  # expected values: RoPE written independently
    rot_lowp = builders.complex_rope(q, pos, inv_freq)
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


@pytest.mark.parametrize("dtype", [FP32, BF16])
def test_q_prep_mx4_writes_the_packed_68_byte_row_of_each_head(dtype):
    # V4.1's FP4 query (spec 2.5.1): MX4 of the RoPE'd head row, 64 B of nibbles then 4 UE8M0 bytes;
    # the weights are not touched by the quantizer (one scale per 32 elements cannot fold).
    args = builders.indexer_q_prep_args(dtype, "mxfp4_68", heads=3, tokens=4, noncontig=True)
    args["q_out"].fill_(0xAA)
    args["w_out"].fill_(float("nan"))
    builders.call_op("indexer_q_prep", args)
    cos, sin = rope_angles(args["positions"], args["inv_freq"], dtype)
    rotated = apply_rope(args["q"], cos[:, None], sin[:, None])
    for t in range(4):
        for h in range(3):
            data, scales = M.encode("mxfp4_68", rotated[t, h].float().tolist())
            assert bytes(args["q_out"][t, h].tolist()) == data + scales, (t, h)
    assert torch.equal(args["w_out"], args["weights"].float() * (128**-0.5 * 3**-0.5))


def test_q_prep_public_function_allocates_contiguous_outputs():
    args = builders.indexer_q_prep_args(BF16, "fp8_132", noncontig=True)
    q_out, w_out = builders.call_public("indexer_q_prep", args)
    builders.call_op("indexer_q_prep", args)
    assert q_out.is_contiguous() and q_out.dtype == E4M3 and w_out.dtype == FP32
    assert builders.bytes_equal(q_out, args["q_out"]) and torch.equal(w_out, args["w_out"])


# ---- indexer_topk ------------------------------------------------------------------------------
RATIO, BS, D, H = 2, 4, 16, 3
# Request 0 at positions 5..9 sees 3..5 entries; request 1 at 0..2 sees 0..1; one padding token.
RUNS = ((0, 5, 5), (1, 0, 3))
TABLE = torch.tensor([[5, 2], [0, -1]], dtype=I32)  # request 1's second block is unallocated
ENTRIES = {0: 5, 1: 1}  # entries each request has stored


def _topk_case(fmt, k: int, zero_weights: bool = False):
    """Arguments with keys stored at the requests' entry slots only (every other slot poison) and
    the fp64 scores of every (token, entry) from those keys."""
    positions, req_slots = builders.step_tokens(*RUNS, pad=1)
    t = positions.shape[0]
    dim = 128 if fmt == FP8 else D
    pool = builders.page_pool(6, BS, dim, fmt)
    keys = {r: torch.randn(n, dim) for r, n in ENTRIES.items()}
    for r, kr in keys.items():
        w = torch.arange(kr.shape[0])
        pack_kv(kr, (TABLE[r, w // BS].long() * BS + w % BS).to(I32), pool, builders.format_name(fmt, dim))
    q = torch.randn(t, H, dim)
    if fmt == FP8:
        q = q.to(E4M3)
        keys = {r: round_indexer_key(kr, "fp8") for r, kr in keys.items()}
    weights = torch.zeros(t, H) if zero_weights else torch.rand(t, H) + 0.5
    args = dict(q=q, weights=weights, positions=positions, req_slots=req_slots, cache=pool,
                block_table=TABLE.clone(), cand=None, idx_out=torch.full((t, k), 7777, dtype=I32), cand_out=None,
                workspace=builders.topk_workspace(t, TABLE.shape[1] * BS, k), ratio=RATIO, cand_block=0,
                fmt=builders.format_name(fmt, dim))
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
    builders.call_op("indexer_topk", args)
    # Every row written (7777 gone); padding rows and entries past the visible ones are -1; keys in
    # unallocated or foreign slots are NaN poison, so reading one would scramble the order. The
    # kernel scores in fp32: against fp64 scores, entries within twice the fp32 run's error of the
    # k-th best may swap.
    s64, s32 = _scores(args, keys, torch.float64), _scores(args, keys, torch.float32)
    finite = torch.isfinite(s64)
    tol = 2 * (s32 - s64)[finite].abs().max().item()
    assert (args["idx_out"][args["req_slots"] < 0] == -1).all()
    entries = _entries(args["idx_out"], args["req_slots"])
    T.assert_topk_within(entries, s64, k, tol, what="op")
    chosen = entries.masked_fill(entries < 0, 1 << 40)  # the -1 fill sorts last
    assert torch.equal(chosen, chosen.sort(-1).values), "selection not in ascending entry order"
    idx = builders.call_public("indexer_topk", args)
    assert torch.equal(idx, args["idx_out"]) and idx.dtype == I32  # the same kernel on the same inputs


def test_topk_ties_pick_the_lower_entry():
    args, keys = _topk_case(FP32, 3, zero_weights=True)  # every score 0
    builders.call_op("indexer_topk", args)
    # Token 4 of request 0 (position 9) sees entries 0..4 in blocks 5, 2: the first three are slots
    # 20, 21, 22; request 1 at position 2 sees entry 0 (slot 0).
    assert args["idx_out"][4].tolist() == [20, 21, 22]
    assert args["idx_out"][7].tolist() == [0, -1, -1]
    assert args["idx_out"][5].tolist() == [-1, -1, -1]  # request 1 at position 0 sees nothing


# ---- bad inputs: one per rule ------------------------------------------------------------------
Q_PREP = partial(builders.indexer_q_prep_args, FP32)
TOPK = partial(builders.indexer_topk_args, FP32)
TOPK_FP8 = partial(builders.indexer_topk_args, E4M3, FP8)
K_PREP = partial(builders.indexer_k_prep_args, FP32)
wa = builders.with_arg
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
    ("q_prep-hadamard-exact", "indexer_q_prep", Q_PREP, wa("hadamard", lambda a: True),
     r"hadamard: expected a byte format \(it rotates bf16 rows before their quantizer\), got fmt 'exact'"),
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
     r"cache: format fp8_132 stores 128-d rows, got 64-d rows"),
    ("workspace-dtype", "indexer_topk", TOPK, wa("workspace", lambda a: a["workspace"].float()),
     r"workspace: expected dtype in \[torch.int32\]", ("op",)),
    ("workspace-small", "indexer_topk", TOPK, wa("workspace", lambda a: a["workspace"][:5]),
     r"workspace: expected >= 8 int32 words .*got 5", ("op",)),
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
    ("q_prep-fmt-unknown", "indexer_q_prep", Q_PREP, wa("fmt", lambda a: "fp4_288"),
     r"fmt: expected one of \['exact', 'fp8_132', 'mxfp4_68'\], got 'fp4_288'"),
    ("q_prep-mx4-width", "indexer_q_prep", partial(builders.indexer_q_prep_args, FP32, "mxfp4_68"),
     wa("q", lambda a: a["q"][..., :64].contiguous()), r"q: format mxfp4_68 quantizes 128-d rows, got 64-d rows"),
    ("q_prep-mx4-row", "indexer_q_prep", partial(builders.indexer_q_prep_args, FP32, "mxfp4_68"),
     wa("q_out", lambda a: a["q_out"][..., :64].contiguous()),
     r"q_out: expected size 68 \(mxfp4_68 query row\) at dim 2, got 64", ("op",)),
    ("q_prep-mx4-dtype", "indexer_q_prep", partial(builders.indexer_q_prep_args, FP32, "mxfp4_68"),
     wa("q_out", lambda a: a["q_out"].float()), r"q_out: expected dtype in \[torch.uint8\]", ("op",)),
    ("topk-q-mx4-row", "indexer_topk", partial(builders.indexer_topk_args, torch.uint8, "mxfp4_68", block_size=7),
     wa("q", lambda a: a["q"][..., :64].contiguous()),
     r"q: expected size 68 \(bytes of a packed mxfp4_68 query row\) at dim 2, got 64"),
    ("topk-fmt-unknown", "indexer_topk", TOPK, wa("fmt", lambda a: "fp8"), r"fmt: expected .*'fp8_584'"),
    ("topk-cand-and-cand_out", "indexer_topk", partial(TOPK, cand_blocks=2),
     wa("cand_out", lambda a: torch.empty(6, 2, dtype=I32)),
     r"cand, cand_out: expected at most one \(a pool is published from unrestricted scores\)", ("op",)),
    ("topk-cand-dtype", "indexer_topk", partial(TOPK, cand_blocks=2), wa("cand", lambda a: a["cand"].long()),
     r"cand: expected dtype in \[torch.int32\], got torch.int64"),
    ("topk-cand-size", "indexer_topk", partial(TOPK, cand_blocks=2), wa("cand", lambda a: a["cand"][1:]),
     r"cand: expected size 6 \(tokens of q\) at dim 0, got 5"),
    ("topk-cand_block", "indexer_topk", partial(TOPK, cand_blocks=2), wa("cand_block", lambda a: 0),
     r"cand_block: expected > 0 entries per candidate block with cand, got 0"),
    ("topk-cand_out-ndim", "indexer_topk", partial(TOPK, pool_blocks=2), wa("cand_out", lambda a: a["cand_out"][0]),
     r"cand_out: expected 2-D \[tokens, candidate blocks\]", ("op",)),
    ("topk-cand-high", "indexer_topk", partial(TOPK, cand_blocks=2),
     wa("cand", lambda a: torch.tensor([[0, 4]] * 6, dtype=I32)),
     r"cand: expected values in \[-1, 4\) \(-1 or one of the 4 candidate blocks of the table\), got 4", ("public",)),
    ("topk-cand-twice", "indexer_topk", partial(TOPK, cand_blocks=2),
     wa("cand", lambda a: torch.tensor([[0, 1]] * 5 + [[1, 1]], dtype=I32)),
     r"cand: expected distinct candidate blocks in ascending order, -1 after them \(as cand_out is written\), got "
     r"1 then 1 for token 5", ("public",)),
    ("topk-cand-descending", "indexer_topk", partial(TOPK, cand_blocks=2),
     wa("cand", lambda a: torch.tensor([[0, 1]] * 5 + [[1, 0]], dtype=I32)),
     r"cand: expected distinct candidate blocks in ascending order.*got 1 then 0 for token 5", ("public",)),
    ("topk-cand-fill-first", "indexer_topk", partial(TOPK, cand_blocks=2),
     wa("cand", lambda a: torch.tensor([[0, 1]] * 5 + [[-1, 1]], dtype=I32)),
     r"cand: expected distinct candidate blocks in ascending order.*got -1 then 1 for token 5", ("public",)),
    ("topk-cand_out-dtype", "indexer_topk", partial(TOPK, pool_blocks=2), wa("cand_out", lambda a: torch.empty(6, 2)),
     r"cand_out: expected dtype in \[torch.int32\], got torch.float32", ("op",)),
    ("k_prep-latent-ndim", "indexer_k_prep", K_PREP, wa("latent", lambda a: a["latent"][None]),
     r"latent: expected 2-D \[tokens, d\]"),
    ("k_prep-latent-last-dim", "indexer_k_prep", K_PREP, wa("latent", lambda a: a["latent"].t().contiguous().t()),
     r"latent: expected a contiguous last dim"),
    ("k_prep-entry_slots-size", "indexer_k_prep", K_PREP, wa("entry_slots", lambda a: a["entry_slots"][1:]),
     r"entry_slots: expected size 9 \(tokens of latent\) at dim 0, got 8"),
    ("k_prep-wk-width", "indexer_k_prep", K_PREP, wa("wk", lambda a: a["wk"][:, :8].contiguous()),
     r"wk: expected size 16 \(d of latent\) at dim 1, got 8"),
    ("k_prep-k_norm-size", "indexer_k_prep", K_PREP, wa("k_norm_weight", lambda a: a["k_norm_weight"][:8]),
     r"k_norm_weight: expected size 16 \(rows of wk\) at dim 0, got 8"),
    ("k_prep-inv_freq-width", "indexer_k_prep", K_PREP, wa("inv_freq", lambda a: torch.ones(9)),
     r"inv_freq: expected at most 8 frequencies \(head dim 16\), got 9"),
    ("k_prep-cache-width", "indexer_k_prep", K_PREP, wa("cache", lambda a: a["cache"][..., :8].contiguous()),
     r"cache: expected size 16 \(row width\) at dim 2, got 8"),
    ("k_prep-fmt", "indexer_k_prep", K_PREP, wa("fmt", lambda a: "mxfp4_68"),
     r"cache: expected dtype in \[torch.uint8\], got torch.float32"),
    ("k_prep-ratio", "indexer_k_prep", K_PREP, wa("ratio", lambda a: 0), r"ratio: expected > 0, got 0"),
    ("k_prep-eps-negative", "indexer_k_prep", K_PREP, wa("eps", lambda a: -1e-6),
     r"eps: expected a finite value >= 0 \(the key RMSNorm's epsilon\), got -1e-06"),
    ("k_prep-positions-negative", "indexer_k_prep", K_PREP,
     wa("positions", lambda a: torch.tensor([2, 3, 4, 5, 6, -1, 0, 1, 0], dtype=I32)),
     r"positions: expected >= 0 \(token positions\), got -1 at index 5", ("public",)),
    ("k_prep-entry_slots-high", "indexer_k_prep", K_PREP,
     wa("entry_slots", lambda a: torch.tensor([-1, 16, -1, -1, -1, -1, -1, -1, -1], dtype=I32)),
     r"entry_slots: expected values in \[-1, 16\) \(-1 or a slot of the pool's 16\), got 16 at index 1", ("public",)),
    ("k_prep-entry_slots-twice", "indexer_k_prep", K_PREP,
     wa("entry_slots", lambda a: torch.tensor([-1, 3, -1, 3, -1, -1, -1, -1, -1], dtype=I32)),
     r"entry_slots: expected distinct slots among the tokens that close an entry, got 3 \(2 times\)", ("public",)),
    # Issue 32: slots planned for ratio 2 given with ratio 4 stored keys at the wrong entries, silently.
    ("k_prep-ratio-of-other-slots", "indexer_k_prep", K_PREP, wa("ratio", lambda a: 4),
     r"entry_slots: expected -1 for the tokens that close no entry at ratio 4 \(\(position \+ 1\) % 4 != 0\), got 2 "
     r"at index 3 \(position 5\); were the slots planned for another ratio\?", ("public",)),
    # Issue 52: slots planned for ratio 4 given with ratio 2 or 1 stored keys at the wrong rotation, silently
    # (every ratio-4 closing token closes an entry at 2 and 1 too): the slot's offset in its block is not the
    # offset of the entry the token closes at the given ratio.
    ("k_prep-ratio-4-slots-at-2", "indexer_k_prep", partial(K_PREP, ratio=4), wa("ratio", lambda a: 2),
     r"entry_slots: expected a slot at offset 1 of its 4-entry block \(entry 1, closed by position 3 at ratio 2\), "
     r"got 0 \(offset 0\) at index 1; were the slots planned for another ratio\?", ("public",)),
    ("k_prep-ratio-4-slots-at-1", "indexer_k_prep", partial(K_PREP, ratio=4), wa("ratio", lambda a: 1),
     r"entry_slots: expected a slot at offset 3 of its 4-entry block \(entry 3, closed by position 3 at ratio 1\), "
     r"got 0 \(offset 0\) at index 1; were the slots planned for another ratio\?", ("public",)),
    ("block_table-narrow", "indexer_topk", partial(builders.indexer_topk_args, FP32, ratio=1),
     wa("block_table", lambda a: a["block_table"][:, :1].contiguous()),
     r"block_table: expected 2 blocks for the 6 visible entries of request 0 at position 5, got a table 1 blocks "
     r"wide", ("public",)),
]


@pytest.mark.parametrize("case", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_rejected_and_writes_nothing(case):
    _, name, factory, mutate, match, *via = case
    builders.assert_bad_case(name, factory(), mutate, match, via)


# ---- V4.1: index keys (spec 2.4) ---------------------------------------------------------------
def _k_formula(args: dict, dtype: torch.dtype) -> dict:
    """{slot: key} of spec V4.1 2.4 in `dtype`: k = w_norm u / sqrt(mean u^2 + eps), u = latent wk^T,
    its last R dims rotated (pairs 2i, 2i + 1) at position w * m, w = p // m, for the live tokens
    that close an entry (slot != -1)."""
    m, eps = args["ratio"], args["eps"]
    r = 2 * args["inv_freq"].shape[0]
    out = {}
    for i, (p, req, slot) in enumerate(zip(args["positions"].tolist(), args["req_slots"].tolist(),
                                           args["entry_slots"].tolist(), strict=True)):
        if req < 0 or (p + 1) % m or slot < 0:
            continue
        u = args["latent"][i].to(dtype) @ args["wk"].to(dtype).T
        k = args["k_norm_weight"].to(dtype) * u / torch.sqrt(u.square().mean() + eps)
        ang = float((p // m) * m) * args["inv_freq"].to(dtype)
        x0, x1 = k[-r::2], k[-r + 1::2]
        rot = torch.stack([x0 * ang.cos() - x1 * ang.sin(), x0 * ang.sin() + x1 * ang.cos()], -1).flatten()
        out[slot] = torch.cat([k[:-r], rot])
    return out


@pytest.mark.parametrize("ratio", [2, 1])
def test_k_prep_stores_the_key_of_every_closing_token_only(ratio):
    args = builders.indexer_k_prep_args(FP32, ratio=ratio, noncontig=True, block_size=8)
    args["cache"].fill_(float("nan"))  # poison: only the closing tokens' slots may change
    builders.call_op("indexer_k_prep", args)
    want64, want32 = _k_formula(args, torch.float64), _k_formula(args, torch.float32)
    rows = args["cache"].view(-1, args["cache"].shape[-1])
    assert want64 and sorted(want64) == [s for s in range(rows.shape[0]) if not rows[s].isnan().any()]
    for slot in want64:
        T.assert_close_to_ref(rows[slot], want64[slot], want32[slot], what=f"slot {slot}")


@pytest.mark.parametrize("fmt", ["mxfp4_68", FP8])
def test_k_prep_quantized_pool_holds_the_codec_of_the_key(fmt):
    # The same keys through an exact bf16 pool and a quantized one: the quantized pool holds exactly
    # the format's codes of the bf16 key (the model's bytes), every other byte untouched.
    bs = 7 if fmt == "mxfp4_68" else 4
    exact = builders.indexer_k_prep_args(BF16, BF16, di=128, block_size=bs, blocks=6)
    quant = dict(exact, cache=builders.page_pool(6, bs, 128, fmt), fmt=builders.format_name(fmt, 128))
    exact["cache"].fill_(float("nan"))
    builders.call_op("indexer_k_prep", exact)
    builders.call_op("indexer_k_prep", quant)
    rows = exact["cache"].view(-1, 128)
    live = {s: rows[s].float().tolist() for s in range(rows.shape[0]) if not rows[s].isnan().any()}
    assert bytes(quant["cache"].view(-1).tolist()) == M.pool_bytes(quant["fmt"], 6, bs, live)


def test_k_prep_public_function_checks_slots_and_writes_nothing_for_padding():
    args = builders.indexer_k_prep_args(FP32, runs=(), pad=3)
    before = args["cache"].clone()
    builders.call_public("indexer_k_prep", args)
    assert builders.bytes_equal(args["cache"], before)


# ---- V4.1: MX4 queries x MX4 keys, the candidate pool (spec 2.5-2.8) ---------------------------
def _mx4_values(q: torch.Tensor) -> torch.Tensor:
    """fp64 values of packed MX4 query rows [T, H, 68] through the format model."""
    t, h, _ = q.shape
    return torch.tensor([[M.decode("mxfp4_68", bytes(q[i, j, :64].tolist()), bytes(q[i, j, 64:].tolist()))
                          for j in range(h)] for i in range(t)], dtype=torch.float64)


def _mx4_case(n_entries: int, t: int = 6, heads: int = 2, bs: int = 7, seed: int = 0):
    """One request with `n_entries` MX4 keys (entries 2 and 5 equal: exact score ties), t tokens at
    the last positions (ratio 1), powers-of-two head weights (every score is exact in fp32).
    Returns (args, fp64 key values [n, 128], block table, block size)."""
    g = torch.Generator().manual_seed(seed)
    keys = torch.randn(n_entries, 128, generator=g)
    keys[5] = keys[2]
    blocks = -(-n_entries // bs)
    table = torch.arange(blocks, dtype=I32)[None].flip(1)  # pages in reverse order
    pool = builders.page_pool(blocks, bs, 128, "mxfp4_68")
    w = torch.arange(n_entries)
    pack_kv(keys, (table[0, w // bs].long() * bs + w % bs).to(I32), pool, "mxfp4_68")
    positions = torch.arange(n_entries - t, n_entries, dtype=I32)
    q = builders.mx4_query(torch.randn(t, heads, 128, generator=g))
    weights = torch.exp2(torch.randint(-3, 3, (t, heads), generator=g).float()) * (
        torch.randint(0, 2, (t, heads), generator=g) * 2 - 1)
    kv = torch.tensor([M.roundtrip("mxfp4_68", k.tolist()) for k in keys], dtype=torch.float64)
    args = dict(q=q, weights=weights, positions=positions, req_slots=torch.zeros(t, dtype=I32), cache=pool,
                block_table=table, cand=None, idx_out=torch.full((t, 8), 7777, dtype=I32), cand_out=None,
                workspace=builders.topk_workspace(t, blocks * bs, 8), ratio=1, cand_block=4, fmt="mxfp4_68")
    return args, kv, table, bs


def _mx4_scores(args: dict, kv: torch.Tensor) -> torch.Tensor:
    """fp64 [t, n] scores sum_h w_h relu(q_h . k), entries a token does not see -inf."""
    s = ((_mx4_values(args["q"]) @ kv.T).relu() * args["weights"].double()[..., None]).sum(1)
    unseen = torch.arange(kv.shape[0])[None] >= (args["positions"].long() + 1)[:, None]
    return s.masked_fill(unseen, float("-inf"))


def _slot(table, bs, w: int) -> int:
    return int(table[0, w // bs]) * bs + w % bs


def _best(scores_row, entries, k):
    """The k best of `entries` by (score desc, entry asc), -inf dropped, in ascending entry order."""
    order = sorted((e for e in entries if scores_row[e] > float("-inf")), key=lambda e: (-scores_row[e].item(), e))
    return sorted(order[:k])


def test_topk_mx4_query_and_keys_against_the_format_model():
    args, kv, table, bs = _mx4_case(40)
    scores = _mx4_scores(args, kv)
    builders.call_op("indexer_topk", args)
    for i in range(6):
        want = [_slot(table, bs, e) for e in _best(scores[i], range(40), 8)]
        assert args["idx_out"][i].tolist() == want, i
    assert (scores[:, 2] == scores[:, 5]).all()  # the tie was there to be broken


def _expected_blocks(scores_row, n_visible: int, cand_block: int, keep: int) -> list:
    """Spec V4.1 2.6, written out: block b = entries [b cb, (b + 1) cb), its score the max of its
    visible entries, the block of the newest visible entry forced, the best `keep` (ties to the
    lower block), blocks without a visible entry dropped; in ascending block order, -1 fill."""
    n_blocks = -(-scores_row.shape[0] // cand_block)
    score = {b: max(scores_row[b * cand_block: (b + 1) * cand_block].tolist()) for b in range(n_blocks)}
    if n_visible:
        score[(n_visible - 1) // cand_block] = float("inf")
    order = sorted((b for b in score if score[b] > float("-inf")), key=lambda b: (-score[b], b))[:keep]
    return sorted(order) + [-1] * (keep - len(order))


@pytest.mark.parametrize("keep", [3, 20])
def test_candidate_blocks_of_the_source_scores(keep):
    args, kv, table, bs = _mx4_case(40)
    scores = _mx4_scores(args, kv)
    args["cand_out"] = torch.full((6, keep), 7777, dtype=I32)
    builders.call_op("indexer_topk", args)
    for i in range(6):
        want = _expected_blocks(scores[i], int(args["positions"][i]) + 1, 4, keep)
        assert args["cand_out"][i].tolist() == want, i
    # The source's own top-k is over every visible entry, not its pool (pitfall 13): unchanged.
    plain = dict(args, cand_out=None, idx_out=torch.empty_like(args["idx_out"]))
    builders.call_op("indexer_topk", plain)
    assert torch.equal(plain["idx_out"], args["idx_out"])


def test_candidate_pool_forces_the_newest_block_even_when_it_scores_lowest():
    args, kv, table, bs = _mx4_case(40)
    args["weights"] = -args["weights"].abs()  # every score <= 0: the newest block may score lowest
    args["cand_out"] = torch.empty(6, 2, dtype=I32)
    builders.call_op("indexer_topk", args)
    for row, p in zip(args["cand_out"].tolist(), args["positions"].tolist(), strict=True):
        assert p // 4 in row, (row, p)


@pytest.mark.parametrize("keep", [2, 4])
def test_reindex_scores_only_the_candidate_entries(keep, monkeypatch):
    # A reindex layer (spec 2.7): its own query and weights, the source's keys, its top-k inside the
    # source's pool (its blocks in ascending order): ties go to the lower entry. Cost follows the
    # pool: the keys read are the candidates' only.
    from dsv4ops.indexer import reference as ref

    src, kv, table, bs = _mx4_case(40)
    src["cand_out"] = torch.empty(6, keep, dtype=I32)
    builders.call_op("indexer_topk", src)
    g = torch.Generator().manual_seed(1)
    args = dict(src, q=builders.mx4_query(torch.randn(6, 2, 128, generator=g)), weights=torch.rand(6, 2, generator=g).round(),
                cand=src["cand_out"], cand_out=None, idx_out=torch.full((6, 8), 7777, dtype=I32))
    read = []
    real = ref.unpack_kv
    monkeypatch.setattr(ref, "unpack_kv", lambda c, s, o, f: (read.append(int((s >= 0).sum())), real(c, s, o, f)))
    builders.call_op("indexer_topk", args)
    scores = _mx4_scores(args, kv)
    pools = [[e for b in row if b >= 0 for e in range(4 * b, 4 * b + 4) if e <= p]
             for p, row in zip(args["positions"].tolist(), src["cand_out"].tolist(), strict=True)]
    assert read == [sum(len(pool) for pool in pools)] and max(len(pool) for pool in pools) <= 4 * keep < 40
    for i in range(6):
        want = [_slot(table, bs, e) for e in _best(scores[i], pools[i], 8)]
        assert args["idx_out"][i].tolist() == want + [-1] * (8 - len(want)), i


# ---- the top-k workspace -----------------------------------------------------------------------
def _params_h() -> dict:
    """The integer constants of csrc/indexer/params.h by name."""
    import pathlib
    import re
    text = (pathlib.Path(__file__).resolve().parents[1] / "csrc" / "indexer" / "params.h").read_text()
    return {m[1]: int(m[2]) for m in re.finditer(r"constexpr int (\w+) = (\d+);", text)}


def test_workspace_rows_hold_the_grid_select_state():
    # The Python sizing (cache config, op checks) and the C++ grid select's layout agree, and a row
    # longer than one tile has room for both selects' words after its keys; a shorter row is unchanged.
    from dsv4ops.indexer import workspace as ws
    h = _params_h()
    assert (ws.GRID_TILE, ws.GRID_MAX_K) == (h["kGridTile"], h["kMaxGridK"])
    assert ws.GRID_HEAD == h["kGridHead"]
    assert ws.GRID_STATE == h["kGridHead"] + h["kGridLevels12"] + h["kGridCand"]
    for n, k in [(300, 512), (4096, 512), (4097, 512), (16448, 512), (40000, 1024), (262144, 512), (20000, 8192),
                 (40000, 8193)]:
        chunks = -(-n // ws.chunk(n, k))
        a, b, lst = ws.merge_regions(n, k)
        tree_end = n if chunks == 1 else b + -(-chunks // ws.merge_group(k)) * lst  # the last merge list's end
        grid = n > h["kGridTile"] and k <= h["kMaxGridK"]
        assert ws.has_grid(n, k) == grid
        # the C++ host check: keys, then kGridHead + one word a tile + levels 1, 2 + candidates
        grid_end = n + h["kGridHead"] + -(-n // h["kGridTile"]) + h["kGridLevels12"] + h["kGridCand"] if grid else 0
        assert ws.row_words(n, k) == max(tree_end, grid_end), (n, k)


# ---- the Triton kernel under the interpreter, against the reference (helpers: tests/interp.py) -------------
@pytest.mark.parametrize("out_dtype", [torch.float8_e4m3fn, torch.bfloat16], ids=["fp8", "bf16"])
def test_indexer_q_prep(out_dtype):
    t, h = 4, 3
    q, w = 3 * torch.randn(t, h, 128), torch.randn(t, h)
    pos = i32(0, 77, 5000, 3)

    def run(fn, dtype, odt):
        q_out, w_out = torch.empty(t, h, 128, dtype=odt), torch.empty(t, h)
        fn(q.to(dtype), w.to(dtype), pos, INV_FREQ, q_out, w_out, "fp8_132" if odt == torch.float8_e4m3fn else "exact")
        return q_out.double() * w_out.double()[..., None]  # what the scores see

    got = run(indexer_prep_tt.indexer_q_prep, torch.bfloat16, out_dtype)
    lowp = run(indexer_ref.indexer_q_prep, torch.bfloat16, out_dtype)
    ref = run(indexer_ref.indexer_q_prep, torch.float32, torch.float32)
    T.assert_close_to_ref(got, ref, lowp, what="q x w")


def _indexer_case(q_dtype, pool, integer: bool):
    """Two requests over 3 pages of 4 entries; tokens see 0, 12 (all), 5, 8 (12 minus an
    unallocated page) entries and one is padding.
    Integer-valued q and keys with power-of-two weights make every score exact in fp32 (ties
    included), so the selection must equal the reference's, order and tie-breaks included."""
    t, h = 5, 3
    keys = torch.randint(-8, 9, (7 * BS, 128)).float() if integer else torch.randn(7 * BS, 128)
    cache = new_pool(pool, 128, 7)
    table = i32(3, 0, 5, 1, 6, -1).view(2, 3)
    used = torch.tensor([3, 0, 5, 1, 6])
    slots = (used[:, None] * BS + torch.arange(BS)).flatten().to(torch.int32)
    quant_ref.pack_kv(keys[slots.long()], slots, cache, pool_fmt(cache, 128))
    q = torch.randint(-8, 9, (t, h, 128)).float() if integer else torch.randn(t, h, 128)
    w = torch.tensor([1.0, -0.5, 2.0]).repeat(t, 1)
    # Token 4: request 1 at position 47 sees 12 entries, of which the third block is unallocated.
    return q.to(q_dtype), w, i32(3, 47, 20, 9, 47), i32(0, 0, 1, -1, 1), cache, table


@pytest.mark.parametrize("k", [4, 16])
@pytest.mark.parametrize("q_dtype,pool", [(torch.float8_e4m3fn, "fp8"), (torch.bfloat16, torch.bfloat16),
                                          (torch.float32, "fp8")], ids=["fp8", "bf16", "fp32-q"])
def test_indexer_topk_exact(q_dtype, pool, k):
    q, w, pos, req, cache, table = _indexer_case(q_dtype, pool, integer=True)
    got, want = torch.full((5, k), 99, dtype=torch.int32), torch.empty(5, k, dtype=torch.int32)
    fmt = pool_fmt(cache, 128)
    indexer_tt.indexer_topk(q, w, pos, req, cache, table, None, got, None, builders.topk_workspace(5, 12, k), 4, 0,
                            fmt)
    indexer_ref.indexer_topk(q, w, pos, req, cache, table, None, want, None, 4, 0, fmt)
    assert torch.equal(got, want)


def test_indexer_topk_score_hook_replaces_the_triton_scoring_or_falls_back():
    # The hook the sm_90 launcher passes (dsv4ops/indexer/cuda.py `score`): once per launch of tokens,
    # with the launch's first token and count; declining runs the Triton scoring, serving replaces it
    # (here a scoring that finds no entry: every row is the -1 fill).
    q, w, pos, req, cache, table = _indexer_case(torch.float8_e4m3fn, "fp8", integer=True)
    fmt = pool_fmt(cache, 128)
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
    fmt = pool_fmt(cache, 128)
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
    cache = new_pool("fp8", 128, n // BS)
    quant_ref.pack_kv(torch.randn(n, 128), torch.arange(n, dtype=torch.int32), cache, "fp8_132")
    table = torch.randperm(n // BS).int().view(1, -1)
    q = torch.randn(t, 2, 128).to(torch.float8_e4m3fn)
    w = torch.zeros(t, 2)
    pos, req = i32(4 * n - 1, 4 * 17 - 1, 4 * 9 - 1), i32(0, 0, 0)
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
    cache = new_pool("fp8", 128, blocks, bs)
    quant_ref.pack_kv(keys, torch.arange(blocks * bs, dtype=torch.int32), cache, "fp8_132")
    table = torch.randperm(blocks).int().view(1, -1)
    q = torch.zeros(3, 2, 128)
    q[:, 0, :3], q[:, 1, :3] = torch.tensor([1.0, -1.0, 1.0]), torch.tensor([-1.0, 1.0, 1.0])
    w = torch.tensor([[1.0, -1.0], [2.0, 1.0], [-1.0, -0.5]])
    pos, req = i32(4 * n - 1, 4 * 702, 4 * 1500 + 3), i32(0, 0, 0)
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
    pos = i32(0, 77, 5000, 3)

    def run(fn, dtype, fmt):
        odt, width = (torch.uint8, 68) if fmt == "mxfp4_68" else (torch.float32, 128)
        q_out, w_out = torch.empty(t, h, width, dtype=odt), torch.empty(t, h)
        fn(q.to(dtype), w.to(dtype), pos, INV_FREQ, q_out, w_out, fmt)
        return indexer_ref.query_values(q_out).double() * w_out.double()[..., None]

    got = run(indexer_prep_tt.indexer_q_prep, torch.bfloat16, "mxfp4_68")
    lowp = run(indexer_ref.indexer_q_prep, torch.bfloat16, "mxfp4_68")
    ref = run(indexer_ref.indexer_q_prep, torch.float32, "exact")
    T.assert_close_to_ref(got, ref, lowp, what="q x w")


@pytest.mark.parametrize("fmt", ["mxfp4_68", "fp8_132"])
def test_indexer_q_prep_rotates_v4_queries(fmt):
    # V4's 64 index heads, rotated by the Hadamard before the quantizer (the MXFP4 indexer; fp8_132 takes
    # the flag too): what the scores see against the fp64 rotation of the fp32 RoPE'd query.
    t, h = 3, 64
    q, w = 3 * torch.randn(t, h, 128), torch.randn(t, h)
    pos = i32(0, 77, 5000)

    def run(fn, dtype, fmt, rotate):
        odt, width = {"mxfp4_68": (torch.uint8, 68), "fp8_132": (torch.float8_e4m3fn, 128)}.get(fmt, (dtype, 128))
        q_out, w_out = torch.empty(t, h, width, dtype=odt), torch.empty(t, h)
        fn(q.to(dtype), w.to(dtype), pos, INV_FREQ, q_out, w_out, fmt, rotate)
        return indexer_ref.query_values(q_out).double() * w_out.double()[..., None]

    got = run(indexer_prep_tt.indexer_q_prep, torch.bfloat16, fmt, True)
    lowp = run(indexer_ref.indexer_q_prep, torch.bfloat16, fmt, True)
    ref = quant_ref.hadamard(run(indexer_ref.indexer_q_prep, torch.float32, "exact", False))
    T.assert_close_to_ref(got, ref, lowp, what="rotated q x w")


def test_indexer_topk_mx4_keys_with_v4_heads():
    # V4's CSA indexer on MXFP4 keys: 64 heads (the C++ MX4 scoring serves <= 32; V4 takes this one),
    # ratio 4, pages of 128 keys. Grid values and power-of-two weights make every score exact: the
    # selection equals the reference's, ties included.
    g = torch.Generator().manual_seed(4)
    grid = lambda *shape: E2M1_GRID[torch.randint(0, 8, shape, generator=g)] * (torch.randint(0, 2, shape, generator=g) * 2 - 1)  # noqa: E731
    h, bs, pages, t, k = 64, 128, 3, 5, 16
    cache = builders.page_pool(pages, bs, 128, "mxfp4_68")
    quant_ref.pack_kv(grid(pages * bs, 128), torch.arange(pages * bs, dtype=torch.int32), cache, "mxfp4_68")
    table = i32(2, 0, 1).view(1, 3)
    q = builders.mx4_query(grid(t, h, 128))
    w = (2.0 ** torch.randint(-2, 3, (t, h), generator=g)) * (torch.randint(0, 2, (t, h), generator=g) * 2 - 1)
    pos, req = i32(3, 130, 700, 1535, 9), i32(0, 0, 0, 0, -1)
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
    pos, req = i32(1, 2, 3, 9, 5, 0, 7), i32(0, 0, 0, 1, -1, 1, 1)  # token 4 is padding
    slots = torch.where((req >= 0) & ((pos + 1) % ratio == 0), req * 8 + pos // ratio, -1).to(torch.int32)
    wk, kw = torch.randn(128, d) / d**0.5, 1 + 0.1 * torch.randn(128)
    bs = 7 if pool == "mxfp4_68" else BS

    def run(fn, dtype, kind):
        cache = builders.page_pool(16 // bs + 2, bs, 128, kind)
        fn(latent.to(dtype), pos, req, slots, wk, kw, INV_FREQ, cache, ratio, 1e-6, builders.format_name(kind, 128))
        return pool_rows(cache, 128, fmt=builders.format_name(kind, 128))

    got = run(indexer_prep_tt.indexer_k_prep, torch.bfloat16, pool)
    lowp = run(indexer_ref.indexer_k_prep, torch.bfloat16, pool)
    ref = run(indexer_ref.indexer_k_prep, torch.float64, torch.float64)
    # Poisoned slots read back NaN (float pools) or -inf (0xFF bytes of mxfp4_68: -6 x 2^128).
    written = ref.isfinite().all(1)
    assert written.sum() == 4 and torch.equal(written, got.isfinite().all(1)), "entries written"
    T.assert_close_to_ref(got[written], ref[written], lowp[written], what="index keys")


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
    pos = torch.cat([pos, i32(0)])
    req = torch.cat([torch.zeros(t - 1, dtype=torch.int32), i32(-1)])
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


def test_indexer_topk_kernel_rejects_other_layouts_by_name():
    with pytest.raises(ValueError, match="q: .*index_head_dim 128"):
        indexer_tt.indexer_topk(torch.randn(2, 2, 64), torch.randn(2, 2), i32(0, 1), i32(0, 0), torch.zeros(2, 4, 64),
                                i32(0, 1).view(1, 2), None, torch.empty(2, 4, dtype=torch.int32), None,
                                builders.topk_workspace(2, 8, 4), 4, 0, "exact")


def test_indexer_topk_launcher_rejects_the_combinations_it_does_not_implement():
    # The launcher names what it lacks instead of guessing, before writing anything: a float query
    # over MX4 keys (the reference decodes both).
    a = builders.indexer_topk_args(torch.float32, "mxfp4_68", ratio=1, block_size=7)
    before = {k: v.clone() for k, v in a.items() if isinstance(v, torch.Tensor)}
    with pytest.raises(NotImplementedError,
                       match="the Triton kernel does not implement q of dtype torch.float32 with fmt='mxfp4_68'"):
        indexer_tt.indexer_topk(*a.values())
    assert all(builders.bytes_equal(a[k], v) for k, v in before.items())
