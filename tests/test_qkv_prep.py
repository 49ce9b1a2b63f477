"""dsv4::qkv_prep and qkv_prep.api.qkv_prep: q's norm (V4; none in V4.1) + RoPE, the window-ring
insert in the pool's format (exactly the live tokens' slots), padding tokens, bad inputs. Issues 3, 16."""

import os
from functools import partial

import builders
import pytest
import torch
from builders import FP8

import format_model as M
from dsv4ops import testing as T
from dsv4ops.quant.api import pool_slots, unpack_kv

BF16, FP32, I32 = torch.bfloat16, torch.float32, torch.int32
# Request 0 continues at positions 5..7; request 1 at 9, 10 wraps its 8-slot ring (slots 8 + 1, 8 + 2).
RUNS = ((0, 5, 3), (1, 9, 2))


def _independent(args: dict, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(q_out, the live tokens' stored kv rows) written out here: weightless per-head RMS norm with
    transformers' rounding (the fp32 rsqrt cast to q's dtype, the product rounded to it; V4.1: no
    norm), RoPE; the rows as the pool stores them (byte formats: the plain-Python format model). In
    `dtype` (fp64: the budget's reference, unquantized)."""
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    q, kv, pos = args["q"].to(dtype), args["kv"].to(dtype), args["positions"]
    if args["q_norm"]:
        q = q * torch.rsqrt(q.to(acc).square().mean(-1, keepdim=True) + args["eps"]).to(dtype)
    q_out = builders.complex_rope(q, pos, args["inv_freq"])
    rows = builders.complex_rope(kv, pos, args["inv_freq"])[args["req_slots"] >= 0]
    fmt = args["window_fmt"]
    if dtype != torch.float64:
        if fmt == "exact":
            rows = rows.to(args["window_cache"].dtype).to(dtype)
        else:
            rows = torch.tensor([M.roundtrip(fmt, r.tolist()) for r in rows.float()], dtype=dtype)
    return q_out, rows


def _stored(args: dict, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows of the live tokens' window slots, which pool slots hold anything)."""
    pool, fmt = args["window_cache"], args["window_fmt"]
    every = unpack_kv(pool, torch.arange(pool_slots(pool, fmt), dtype=I32), dim, torch.float32, fmt)
    live = args["req_slots"] >= 0
    slots = (args["req_slots"].long() * args["ring_size"] + args["positions"].long() % args["ring_size"])[live]
    return every[slots], ~every.isnan().any(1)


@pytest.mark.parametrize("dtype,fmt,q_norm", [(FP32, FP32, True), (BF16, BF16, True), (BF16, FP8, True),
                                               (FP32, FP8, True), (BF16, "fp8_528", False), (FP32, FP32, False)],
                         ids=["fp32", "bf16", "bf16-fp8", "fp32-fp8", "v41-bf16-fp8_528", "v41-fp32"])
def test_writes_q_out_and_the_live_tokens_window_slots(dtype, fmt, q_norm):
    args = builders.qkv_prep_args(dtype, fmt, runs=RUNS, pad=2, noncontig=dtype == FP32, q_norm=q_norm)
    args["window_cache"].fill_(255 if args["window_cache"].dtype == torch.uint8 else float("nan"))  # poison
    args["q_out"].fill_(float("nan"))
    builders.call_op("qkv_prep", args)
    dim = args["q"].shape[-1]
    q64, rows64 = _independent(args, torch.float64)
    q_lowp, rows_lowp = _independent(args, dtype)
    T.assert_close_to_ref(args["q_out"], q64, q_lowp, what="q_out")  # every row, padding rows included
    rows, written = _stored(args, dim)
    T.assert_close_to_ref(rows, rows64, rows_lowp, what="window rows")
    # Live slots only (5 and 6, 7 of request 0; 8 + 1, 8 + 2 of request 1); everything else still poison.
    assert written.nonzero().flatten().tolist() == [5, 6, 7, 9, 10]


def test_q_norm_flag_is_the_only_difference_between_v4_and_v41_queries():
    # Same inputs: V4's q is RoPE(q / rms(q)); V4.1's is RoPE(q). The norm scales each head by one
    # number, so the V4 row is the V4.1 row times that head's rsqrt(mean(q^2) + eps).
    args = builders.qkv_prep_args(FP32, runs=RUNS, pad=0)
    v41 = dict(args, q_norm=False, q_out=torch.empty_like(args["q_out"]))
    builders.call_op("qkv_prep", args)
    builders.call_op("qkv_prep", v41)
    rms = torch.rsqrt(args["q"].double().square().mean(-1, keepdim=True) + args["eps"])
    torch.testing.assert_close(args["q_out"].double(), v41["q_out"].double() * rms, rtol=1e-6, atol=1e-6)
    assert not torch.allclose(args["q_out"], v41["q_out"])


def test_public_function_returns_q_out():
    args = builders.qkv_prep_args(BF16, FP8, runs=RUNS, pad=1, noncontig=True)
    same = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    out = builders.call_public("qkv_prep", args)
    builders.call_op("qkv_prep", same)  # the same kernel on the same inputs: bit for bit
    assert out.is_contiguous() and builders.bytes_equal(out, same["q_out"])
    assert builders.bytes_equal(args["window_cache"], same["window_cache"])


def test_padding_tokens_write_nothing():
    args = builders.qkv_prep_args(FP32, runs=(), pad=3)
    before = args["window_cache"].clone()
    q_out = builders.call_public("qkv_prep", args)
    assert builders.bytes_equal(args["window_cache"], before)
    T.assert_close_to_ref(q_out, _independent(args, torch.float64)[0], _independent(args, FP32)[0])


def test_window_slots_give_no_slot_to_a_negative_position_of_a_live_request():
    """Issue 32: Python's modulo gives -3 % 16 = 13, a real ring slot, so without its guard
    window_slots would hand a live request's negative position the slot of position 13. The op
    writes nothing there (tests/test_no_entry.py), and the helper says so itself: -1."""
    from dsv4ops.qkv_prep.reference import window_slots

    pos = torch.tensor([-3, -16, -1, 0, 13, 35, -2**31], dtype=torch.int32)
    req = torch.tensor([1, 0, 2, 1, 0, 2, 1], dtype=torch.int32)
    assert window_slots(pos, req, 16).tolist() == [-1, -1, -1, 16, 13, 35, -1]
    assert window_slots(pos, torch.full_like(req, -1), 16).tolist() == [-1] * 7


@pytest.mark.parametrize("kernel", ["reference", "triton"])
@pytest.mark.parametrize("fmt", [FP8, "fp8_528"], ids=["fp8_584", "fp8_528"])
def test_a_nan_in_a_row_is_stored_as_nan_codes_where_no_check_runs(fmt, kernel):
    """Issue 52: a compiled step cannot sync to refuse a NaN row; the window ring must then hold NaN,
    never finite bytes (the Triton kernel stored 448-scaled or 2^-127-scaled finite codes, the
    reference zeros beside the NaN). A quantized tile holding a NaN has no scale: all its codes are
    NaN; the row's other tiles hold what they hold without the NaN."""
    if kernel == "triton":
        pytest.importorskip("triton")
        from dsv4ops.qkv_prep.triton import qkv_prep as run
    else:
        from dsv4ops.qkv_prep.reference import qkv_prep as run
    group = 64 if fmt == FP8 else 32  # the quantized tile of fp8_584 / fp8_528
    dev = "cuda" if kernel == "triton" and torch.cuda.is_available() else "cpu"  # else: Triton's interpreter
    dirty = builders.qkv_prep_args(BF16, fmt, runs=((0, 5, 2),), pad=0, q_norm=fmt == FP8)
    dirty = {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in dirty.items()}
    clean = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in dirty.items()}
    dirty["kv"][0, 3] = float("nan")
    dirty["kv"][1] = float("nan")
    clean["kv"][0, 3] = 0.0
    clean["kv"][1] = 0.0
    for args in (dirty, clean):
        run(*args.values())
    got, want = (_stored({k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in args.items()}, 512)[0]
                 for args in (dirty, clean))
    assert got[0, :group].isnan().all(), f"row 0's NaN tile: {got[0, :group].tolist()}"
    assert torch.equal(got[0, group:], want[0, group:]) and not want[0].isnan().any()
    assert got[1].isnan().all(), f"the NaN row: {got[1].isnan().sum().item()} of 512 values NaN"


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_a_live_request_writes_only_its_non_negative_positions(backend):
    """The raw op with request 0 at positions -3..1 (the public function rejects those): its ring
    holds positions 0 and 1 only. Unguarded, -3, -2, -1 land in ring slots 5, 6, 7 (Python's
    modulo) or 3, 2, 1 rows before the pool (Triton's truncating one): the pool sits between two
    poisoned guard pages of one buffer, which must stay as they were. The written slots are read
    back from the pool, for the reference and the Triton kernel (V4's FP8 window layout)."""
    args = builders.qkv_prep_args(FP32, FP8, runs=((0, -3, 5), (1, 9, 2)), pad=1)
    dev = "cuda" if backend == "triton" and torch.cuda.is_available() else "cpu"  # else: Triton's interpreter
    args = {k: v.to(dev) if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    pool = args["window_cache"]
    buffer = torch.full((pool.shape[0] + 4, *pool.shape[1:]), 255, dtype=pool.dtype, device=dev)  # 255: NaN rows
    args["window_cache"] = buffer[2:-2]
    if backend == "triton":
        if dev == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
            pytest.skip("needs the Triton interpreter (conftest sets it without a GPU)")
        from dsv4ops.qkv_prep.triton import qkv_prep

        qkv_prep(*args.values())
    else:
        builders.call_op("qkv_prep", args)
    assert (buffer[:2] == 255).all() and (buffer[-2:] == 255).all(), "a write outside the pool"
    _, written = _stored({k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in args.items()},
                         args["kv"].shape[1])
    assert written.nonzero().flatten().tolist() == [0, 1, 8 + 1, 8 + 2]


# ---- bad inputs: one per rule ------------------------------------------------------------------
ARGS = partial(builders.qkv_prep_args, FP32)
FP8_ARGS = partial(builders.qkv_prep_args, BF16, FP8)
w = builders.with_arg
BAD = [
    ("q-ndim", ARGS, w("q", lambda a: a["q"][0]), r"q: expected 3-D \[tokens, heads, head_dim\]"),
    ("q-dtype", ARGS, w("q", lambda a: a["q"].double()), r"q: expected dtype in"),
    ("q-last-dim", ARGS, w("q", lambda a: a["q"].transpose(1, 2).contiguous().transpose(1, 2)),
     r"q: expected a contiguous last dim"),
    ("kv-ndim", ARGS, w("kv", lambda a: a["kv"][None]), r"kv: expected 2-D \[tokens, head_dim\]"),
    ("kv-dtype", ARGS, w("kv", lambda a: a["kv"].int()), r"kv: expected dtype in"),
    ("kv-shape", ARGS, w("kv", lambda a: a["kv"][:, :8]),
     r"kv: expected shape \(6, 16\) \(as q\[:, 0\]\), got \(6, 8\)"),
    ("kv-last-dim", ARGS, w("kv", lambda a: a["kv"].t().contiguous().t()), r"kv: expected a contiguous last dim"),
    ("positions-dtype", ARGS, w("positions", lambda a: a["positions"].long()), r"positions: expected dtype in"),
    ("req_slots-size", ARGS, w("req_slots", lambda a: a["req_slots"][:5]),
     r"req_slots: expected size 6 \(tokens of q\) at dim 0, got 5"),
    ("inv_freq-ndim", ARGS, w("inv_freq", lambda a: a["inv_freq"][None]), r"inv_freq: expected 1-D \[rope_dim / 2\]"),
    ("inv_freq-dtype", ARGS, w("inv_freq", lambda a: a["inv_freq"].double()), r"inv_freq: expected dtype in"),
    ("inv_freq-width", ARGS, w("inv_freq", lambda a: torch.ones(9)),
     r"inv_freq: expected at most 8 frequencies \(head dim 16\), got 9"),
    ("inv_freq-device", ARGS, w("inv_freq", lambda a: a["inv_freq"].to("meta")),
     r"inv_freq: expected device cpu \(as q\), got meta"),
    ("q_out-shape", ARGS, w("q_out", lambda a: a["q_out"][:, :1]), r"q_out: expected shape \(6, 2, 16\)", ("op",)),
    ("q_out-dtype", ARGS, w("q_out", lambda a: a["q_out"].bfloat16()), r"q_out: expected dtype in \[torch.float32\]",
     ("op",)),
    ("q_out-last-dim", ARGS, w("q_out", lambda a: a["q_out"].transpose(1, 2).contiguous().transpose(1, 2)),
     r"q_out: expected a contiguous last dim", ("op",)),
    ("window_cache-width", ARGS, w("window_cache", lambda a: a["window_cache"][..., :8].contiguous()),
     r"window_cache: expected size 16 \(row width\) at dim 2, got 8"),
    ("window_cache-fp8-width", FP8_ARGS, w("window_cache", lambda a: torch.zeros(4, 4 * 132, dtype=torch.uint8)),
     r"window_cache: expected a page of whole 584-B fp8_584 rows"),
    ("window_fmt-unknown", ARGS, w("window_fmt", lambda a: "fp8"), r"window_fmt: expected one of \['fp8_584', "),
    ("window_fmt-mismatch", FP8_ARGS, w("window_fmt", lambda a: "fp8_528"),
     r"window_cache: expected a page of whole 528-B fp8_528 rows \(3072 B for 5 rows\), got 2880 B"),
    ("window_fmt-exact-on-bytes", FP8_ARGS, w("window_fmt", lambda a: "exact"),
     r"window_cache: expected dtype in \[torch.float32, torch.bfloat16, torch.float16\], got torch.uint8"),
    ("window_fmt-bytes-on-floats", ARGS, w("window_fmt", lambda a: "fp8_528"),
     r"window_cache: expected dtype in \[torch.uint8\], got torch.float32"),
    ("ring_size-positive", ARGS, w("ring_size", lambda a: 0), r"ring_size: expected > 0, got 0"),
    ("eps-inf", ARGS, w("eps", lambda a: float("inf")), r"eps: expected a finite value >= 0 \(the RMSNorm's epsilon\), "
     r"got inf"),
    ("ring_size-pool", ARGS, w("ring_size", lambda a: 17), r"ring_size: expected <= the pool's 16 slots, got 17"),
    # Values (public function only; eager).
    ("positions-negative", ARGS, w("positions", lambda a: torch.tensor([5, 6, -1, 0, 1, 0], dtype=I32)),
     r"positions: expected >= 0 \(token positions\), got -1 at index 2", ("public",)),
    ("req_slots-high", ARGS, w("req_slots", lambda a: torch.tensor([0, 0, 0, 2, 2, -1], dtype=I32)),
     r"req_slots: expected values in \[-1, 2\) \(-1 or one of the 2 requests of the window pool \(8-slot rings\)\), "
     r"got 2 at index 3", ("public",)),
    ("req_slots-low", ARGS, w("req_slots", lambda a: torch.tensor([0, 0, 0, 1, 1, -2], dtype=I32)),
     r"req_slots: expected values in \[-1, 2\) .*got -2 at index 5", ("public",)),
    ("window-slot-twice", ARGS, w("positions", lambda a: torch.tensor([5, 6, 13, 0, 1, 0], dtype=I32)),
     r"positions: expected distinct window slots \(one token per request and position % ring_size = 8\), "
     r"got 5 \(2 times\)", ("public",)),
    # Issue 52: a NaN row became finite FP8 bytes in the window ring (pack_kv refuses it).
    ("kv-nan-fp8", FP8_ARGS, w("kv", lambda a: a["kv"].index_fill(0, torch.tensor([1]), float("nan"))),
     r"kv: expected finite values \(the live tokens' rows stored in format fp8_584: its scales come from each "
     r"tile's amax\), got nan at index \(1, 0\)", ("public",)),
    ("kv-inf-fp8_528", partial(builders.qkv_prep_args, BF16, "fp8_528", q_norm=False),
     w("kv", lambda a: a["kv"].index_put((torch.tensor([2]), torch.tensor([7])), torch.tensor(float("inf"),
                                                                                             dtype=BF16))),
     r"kv: expected finite values \(the live tokens' rows stored in format fp8_528: .*\), got inf at index \(2, 7\)",
     ("public",)),
]


def test_a_padding_tokens_nan_row_is_not_refused():
    # A padding token stores nothing: its kv row may hold anything (a bucket's unwritten padding).
    args = FP8_ARGS()
    args["kv"][-1] = float("nan")
    before = args["window_cache"].clone()
    q_out = builders.call_public("qkv_prep", args)
    live = args["req_slots"] >= 0
    assert not q_out[live].isnan().any() and not torch.equal(args["window_cache"], before)


@pytest.mark.parametrize("case", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_rejected_and_writes_nothing(case):
    _, factory, mutate, match, *via = case
    builders.assert_bad_case("qkv_prep", factory(), mutate, match, via)


# ---- the Triton kernel under the interpreter, against the reference (helpers: tests/interp.py) -------------
from interp import BS, INV_FREQ, i32, new_pool, pool_rows  # noqa: E402

from dsv4ops.qkv_prep import reference as qkv_prep_ref  # noqa: E402
from dsv4ops.qkv_prep import triton as qkv_prep_tt  # noqa: E402


@pytest.mark.parametrize("pool,q_norm", [("fp8", True), (torch.bfloat16, True), ("fp8_528", False)],
                         ids=["fp8", "bf16", "v41-fp8_528"])
def test_qkv_prep(pool, q_norm):
    t, h, ring = 5, 3, 8
    q, kv = torch.randn(t, h, 512), torch.randn(t, 512)
    pos, req = i32(0, 7, 130, 5000, 3), i32(0, 1, 0, -1, 1)

    def run(fn, dtype, pool_kind):
        cache = new_pool(pool_kind, 512, 2 * ring // BS)
        q_out = torch.full((t, h, 512), float("nan"), dtype=dtype)
        fn(q.to(dtype), kv.to(dtype), pos, req, INV_FREQ, q_out, cache, ring, 1e-6, q_norm,
           builders.format_name(pool_kind, 512))
        return q_out, cache

    fmt = builders.format_name(pool, 512)
    q_k, c_k = run(qkv_prep_tt.qkv_prep, torch.bfloat16, pool)
    q_r, c_r = run(qkv_prep_ref.qkv_prep, torch.bfloat16, pool)
    q_64, c_64 = run(qkv_prep_ref.qkv_prep, torch.float64, torch.float64)
    T.assert_close_to_ref(q_k, q_64, q_r, what="q_out")
    rows_k, rows_r, rows_64 = pool_rows(c_k, 512, fmt=fmt), pool_rows(c_r, 512, fmt=fmt), pool_rows(c_64, 512)
    written = ~rows_64.isnan().any(1)
    assert written.sum() == 4 and torch.equal(written, ~rows_k.isnan().any(1)), "slots written"
    T.assert_close_to_ref(rows_k[written], rows_64[written], rows_r[written], what="window rows")
    # The nope dims involve no trig (and fill whole scale groups): their quantized entries are bit-exact.
    assert torch.equal(rows_k[written, :448], rows_r[written, :448])


def test_qkv_prep_kernel_rejects_other_layouts_by_name():
    q, kv = torch.randn(2, 2, 256), torch.randn(2, 256)
    pool = torch.zeros(4, BS, 256)
    with pytest.raises(ValueError, match="head_dim.*512"):
        qkv_prep_tt.qkv_prep(q, kv, i32(0, 1), i32(0, 0), INV_FREQ, torch.empty_like(q), pool, 8, 1e-6, True, "exact")
