"""Triton kernels of `dsv4::fp8_linear` (fp8_linear/reference.py is the specification): W8A16 GEMM
out [M, N] = x [M, K] @ (e4m3 weight [N, K] x tile scale)^T; and `act_quant`, the activation
quantization of `dsv4::fp8_linear_w8a8` where it runs ahead of the GEMM (fp8_linear/w8a8.py).

- Each program owns a [BM rows, BN cols] tile of the output and one split of K. Per K step it
  loads the e4m3 bytes [BN, BK] and one scale per weight row (BK divides the tile size, so a K step
  stays in one tile column), dequantizes in registers as the reference does (e4m3 -> fp32, times
  the scale in fp32, rounded to x's dtype) and feeds tl.dot in x's dtype with fp32 accumulation:
  the weight bytes are read once per row block and the dequantized weight is never stored.
- Decode (M <= 128): one row block (M padded to 16, 32, 64 or 128 rows, the tl.dot minimum is 16),
  so every weight byte is read once; narrow column tiles (BN = 64) and split-K give about two
  programs per SM even for the 512- and 1024-wide projections. Each split writes its fp32 partial to
  a workspace and `_reduce_kernel` sums the splits in a fixed order (deterministic, no atomics) and
  rounds to x's dtype. The workspace is allocated per call from static sizes only (tokens, N,
  splits), so the op stays CUDA-graph safe.
- Prefill (M > 128): 128 x 128 output tiles, split-K where the tiles alone leave SMs idle.
- The three kernels are launched with programmatic dependent launch (triton_helpers.launch): the
  next one's launch hides behind the previous kernel's tail. H100, graph-timed, without / with:
  V4-Flash q_a at 1 token 6.5 / 5.2 us, at 128 tokens 10.3 / 9.3; kv at 128 tokens 8.0 / 7.2.
  Also releasing the next kernel at once (griddepcontrol.launch_dependents after the wait, as the
  C++ kernels do) changed no time here by more than run-to-run noise (V4-Flash and V4-Pro
  projections, 1-512 tokens, two runs each), so the kernels do not.

Against cuBLAS F.linear on the dequantized bf16 weight (H100, V4-Flash projections,
with PDL): 1.30-1.68x at one token (half the bytes would allow 2x: the small projections are
launch- and latency-bound at 5-7 us), 0.71-1.18x at 128 tokens, where every K step converts a
[BN, 128] e4m3 tile to bf16 in registers on the path cuBLAS spends on loads alone; the FP8 x FP8
kernel (fp8_linear/triton_w8a8.py) takes those shapes where it is faster. The launch rule came from a sweep of tiles
and splits; one swept shape where it is not the fastest: o_b at one token (BN 32 x 2 splits,
22.0 us; BN 64 x 8 splits 18.6).
"""

import torch
import triton
import triton.language as tl

from dsv4ops.fp8_linear import checks as _checks
from dsv4ops.fp8_linear.checks import GROUP_ROWS
from dsv4ops.fp8_linear.reference import ACT_BLOCK
from dsv4ops.triton_helpers import (
    INTERPRET,
    dot,
    e4m3_bits_to_f32,
    f32_to_e4m3_bits,
    launch,
    pow2,
    round_to,
    to_f32,
    ue8m0_exponent,
    wait_prior_grid,
)

# SM count of an H100 SXM: splits are chosen to give about two programs per SM.
_SMS = 132


@triton.jit
def output_tile(m, n, BM: tl.constexpr, BN: tl.constexpr):
    """This program's [BM, BN] output tile (grid: column tiles, row blocks, K splits): its rows and
    columns (int32 and int64), their in-bounds masks and its K split."""
    rows = tl.program_id(1) * BM + tl.arange(0, BM)
    cols = tl.program_id(0) * BN + tl.arange(0, BN)
    return rows, cols, rows.to(tl.int64), cols.to(tl.int64), rows < m, cols < n, tl.program_id(2)


@triton.jit(do_not_specialize=["m"])
def _fp8_linear_kernel(x_ptr, w_ptr, s_ptr, out_ptr, part_ptr, m, n, k, group_n, sx, so, s_cols, k_split,
                       BLOCK: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
                       UE8M0: tl.constexpr, SPLITS: tl.constexpr, STAGES: tl.constexpr, SOFT: tl.constexpr):
    wait_prior_grid()
    rows, cols, r64, c64, rm, cm, split = output_tile(m, n, BM, BN)
    dt = x_ptr.dtype.element_ty
    # Grouped (block-diagonal): the tile's output group reads its own K columns of x (BN divides group_n).
    x_ptr += (tl.program_id(0) * BN // group_n).to(tl.int64) * k
    s_row = s_ptr + (cols // BLOCK).to(tl.int64) * s_cols
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    k_lo = split * k_split
    # The last split stops at K: a K step wholly past K would read a scale past the last tile column.
    for k0 in tl.range(k_lo, tl.minimum(k_lo + k_split, k), BK, num_stages=STAGES):
        ks = k0 + tl.arange(0, BK)
        km = ks < k
        a = tl.load(x_ptr + r64[:, None] * sx + ks[None, :], mask=rm[:, None] & km[None, :], other=0.0)
        codes = tl.load(w_ptr + c64[:, None] * k + ks[None, :], mask=cm[:, None] & km[None, :], other=0)
        if UE8M0:  # 2^(e - 127) from its bits: e = 0 is the fp32 subnormal 2^-127, e = 255 NaN
            e = tl.load(s_row + k0 // BLOCK, mask=cm, other=127).to(tl.int32)
            bits = tl.where(e == 0, 0x400000, tl.where(e == 255, 0x7FC00000, e << 23))
            s = bits.to(tl.float32, bitcast=True)
        else:
            s = tl.load(s_row + k0 // BLOCK, mask=cm, other=1.0)
        w = round_to(e4m3_bits_to_f32(codes, SOFT) * s[:, None], dt, SOFT)
        acc = dot(a, tl.trans(w), acc, SOFT)
    if SPLITS == 1:
        tl.store(out_ptr + r64[:, None] * so + cols[None, :], round_to(acc, dt, SOFT), mask=rm[:, None] & cm[None, :])
    else:
        at = (split * m + r64[:, None]) * n + cols[None, :]
        tl.store(part_ptr + at, acc, mask=rm[:, None] & cm[None, :])


@triton.jit(do_not_specialize=["m"])
def _reduce_kernel(part_ptr, out_ptr, m, n, so, SPLITS: tl.constexpr, BR: tl.constexpr, SOFT: tl.constexpr):
    """out = sum of the SPLITS fp32 partials [SPLITS, m, n], in split order, rounded to out's dtype."""
    wait_prior_grid()
    idx = tl.program_id(0).to(tl.int64) * BR + tl.arange(0, BR)
    ok = idx < m * n
    acc = tl.zeros([BR], dtype=tl.float32)
    for s in tl.static_range(SPLITS):
        acc += tl.load(part_ptr + s * m * n + idx, mask=ok, other=0.0)
    tl.store(out_ptr + (idx // n) * so + idx % n, round_to(acc, out_ptr.dtype.element_ty, SOFT), mask=ok)


# Rows of the one launch config of a batch-invariant call: a decode step pays 64-row tiles, which
# still read each weight byte once (decode is bound by the weight's bytes).
INVARIANT_ROWS = 64
REDUCE_ROWS = 1024  # elements per program of the split-K sum


def config(m: int, n: int, k: int, block: int, interpret: bool = INTERPRET) -> dict:
    """Launch config from static shapes: tile (BM, BN, BK), K splits, warps, pipeline stages.

    Decode (m <= 128): one row block of the next power of two >= 16 rows, so every weight byte is
    read once, and split-K (at most 8 splits, fp32 partials within 2x the weight bytes:
    4 x splits x BM x N <= 2 x N x K) until the grid holds about 256 programs at one row block of
    16 (BN = 32) and 128 above (BN = 64, or 32 when 64 cannot reach 128 with 8 splits). Three
    pipeline stages. Swept on the H100 at the V4-Flash projections (graph-timed, weights from HBM;
    the best config per shape, which this rule picks): at m = 1 q_a 4096 -> 1024 BN 32 x 8 splits
    6.4 us, kv 4096 -> 512 BN 32 x 8 5.5 us, indexer q_b 1024 -> 8192 BN 32 x 1 6.9 us, q_b
    1024 -> 32768 BN 32 x 1 16.8 us (BN 64: 16.7); at m = 128 q_a BN 64 x 8 10.2 us, kv BN 32 x 8 8.0 us, o_b
    8192 -> 4096 BN 64 x 2 36.8 us, indexer q_b BN 64 x 1 11.2 us. Not the best at one swept shape: o_b at m = 1 gets BN 32 x 2 splits, 22.0 us, where
    BN 64 x 8 measured 18.6.
    Prefill (m > 128): 128 x 128 tiles, 8 warps, split-K while the grid holds fewer than two programs
    per SM, the partials within 2x the weight bytes (4 x splits x m x N <= 2 x N x K). Unsplit, m = 256
    ran 16 programs on q_a and kv and took 60 us where m = 128 took 9.9 and 8.0; split, q_a at m = 256
    takes 15.1 us and kv 13.2 (H200). BK = 128 (V4 tiles), or the tile size when it is smaller
    (V4.1's 32: one scale per weight row and K step)."""
    bk = min(block, 128)
    tiles = triton.cdiv(k, bk)
    if m > 128:
        bm, bn, warps, stages = 128, 128, 8, 3
        split = max(1, min(8, tiles, 2 * _SMS // (triton.cdiv(n, bn) * triton.cdiv(m, bm)), k // (2 * m)))
    else:
        bm = max(16, triton.next_power_of_2(m))
        target = 256 if bm == 16 else 128
        bn = 32 if bm == 16 or triton.cdiv(n, 64) * 8 < target else 64
        warps, stages = 4 if bm <= 64 else 8, 3
        split = max(1, min(8, tiles, target // triton.cdiv(n, bn), k // (2 * bm)))
    if interpret:
        split = min(tiles, 2)  # the interpreter runs both paths on tiny shapes
    k_split = triton.cdiv(tiles, max(split, 1)) * bk
    return dict(BM=bm, BN=bn, BK=bk, SPLITS=triton.cdiv(k, k_split), K_SPLIT=k_split, WARPS=warps, STAGES=stages)


def fp8_linear(x, weight, scale, out, block: int, groups: int = 1, batch_invariant: bool = False,
               cfg: dict | None = None) -> None:
    """Launcher of `dsv4::fp8_linear` (same arguments; `cfg` overrides config(), for sweeps). Grouped,
    the tiles are chosen for the whole [N, K] weight (each weight byte is still read once) and a
    column tile stays inside one output group (BN 32 where 64 would straddle two). batch_invariant:
    the config of INVARIANT_ROWS rows for every M (row blocks of 64, tiles and K splits from the
    weight's shape alone: a row's products and sums are the same whatever M is)."""
    _checks.fp8_linear(x, weight, scale, out, block, groups)
    m = x.shape[0]
    n, k = weight.shape
    if m == 0 or n == 0:
        return
    if k == 0:
        out.zero_()
        return
    cfg = cfg or config(INVARIANT_ROWS if batch_invariant else m, n, k, block)
    group_n = n // groups
    if group_n % cfg["BN"]:
        cfg = dict(cfg, BN=GROUP_ROWS)  # the checks make group_n a multiple of it
    splits = cfg["SPLITS"]
    part = torch.empty(splits, m, n, dtype=torch.float32, device=x.device) if splits > 1 else out
    ue8m0 = scale.dtype == torch.uint8
    grid = (triton.cdiv(n, cfg["BN"]), triton.cdiv(m, cfg["BM"]), splits)
    launch(_fp8_linear_kernel, grid,
           (x, weight.view(torch.uint8), scale, out, part, m, n, k, group_n, x.stride(0),
            out.stride(0), scale.shape[1], cfg["K_SPLIT"]),
           dict(BLOCK=block, BM=cfg["BM"], BN=cfg["BN"], BK=cfg["BK"], UE8M0=ue8m0, SPLITS=splits,
                STAGES=cfg["STAGES"], SOFT=INTERPRET), num_warps=cfg["WARPS"], pdl=True)
    if splits > 1:
        reduce_splits(part, out)


def reduce_splits(part, out) -> None:
    """out = the split-order sum of the fp32 partials [splits, M, N] (the GEMM kernels' split-K)."""
    splits, m, n = part.shape
    launch(_reduce_kernel, (triton.cdiv(m * n, REDUCE_ROWS),), (part, out, m, n, out.stride(0)),
           dict(SPLITS=splits, BR=REDUCE_ROWS, SOFT=INTERPRET), pdl=True)



# ---- act_quant (W8A8) ----------------------------------------------------------------------------
@triton.jit(do_not_specialize=["m", "mp"])
def _act_quant_kernel(x_ptr, q_ptr, s_ptr, m, mp, k, sx, BR: tl.constexpr, BLOCK: tl.constexpr, SOFT: tl.constexpr):
    """BR rows x one 1 x BLOCK block of x -> e4m3 codes and one power-of-two scale a row, as the
    reference's act_quant: the exponent from the amax's bits (ue8m0_exponent), exact scaling by
    2^-e, round to nearest even. Rows m .. mp (the GEMM's row padding) get zero codes."""
    wait_prior_grid()
    rows = tl.program_id(0) * BR + tl.arange(0, BR)
    kb = tl.program_id(1)
    cols = kb * BLOCK + tl.arange(0, BLOCK)
    r64 = rows.to(tl.int64)
    v = to_f32(tl.load(x_ptr + r64[:, None] * sx + cols[None, :], mask=(rows < m)[:, None], other=0.0), SOFT)
    e = ue8m0_exponent(tl.max(tl.abs(v), axis=1))
    codes = f32_to_e4m3_bits(v * pow2(-e)[:, None], SOFT)
    keep = rows < mp
    tl.store(q_ptr + r64[:, None] * k + cols[None, :], codes.to(tl.float8e4nv, bitcast=True), mask=keep[:, None])
    # scales M-major: [K / BLOCK, mp] rows, the layout cuBLASLt's 1 x 128 scaling reads
    tl.store(s_ptr + kb.to(tl.int64) * mp + rows, pow2(e), mask=keep)


ACT_ROWS = 16  # rows a program: a 16 x 128 tile, so a 128-token step at K = 1024 still runs 64 programs


def act_quant(x, codes, scales) -> None:
    """x [M, K] (K a multiple of 128, last dim contiguous) -> codes [Mp, K] e4m3 and scales
    [K / 128, Mp] fp32 (contiguous; `scales.t()` is the M-major [Mp, K / 128] view cuBLASLt
    takes), Mp >= M rows: rows past M hold zero codes."""
    m, k = x.shape
    mp = codes.shape[0]
    if not (k % ACT_BLOCK == 0 and mp >= m and codes.shape == (mp, k) and codes.is_contiguous()
            and scales.shape == (k // ACT_BLOCK, mp) and scales.is_contiguous() and x.stride(1) == 1):
        raise ValueError(f"act_quant: expected x [M, K] (K % {ACT_BLOCK} == 0), codes [Mp >= M, K] and scales "
                         f"[K / {ACT_BLOCK}, Mp], contiguous; got x {tuple(x.shape)}, codes {tuple(codes.shape)}, "
                         f"scales {tuple(scales.shape)}")
    if mp == 0 or k == 0:
        return
    launch(_act_quant_kernel, (triton.cdiv(mp, ACT_ROWS), k // ACT_BLOCK),
           (x, codes, scales, m, mp, k, x.stride(0)), dict(BR=ACT_ROWS, BLOCK=ACT_BLOCK, SOFT=INTERPRET), pdl=True)
