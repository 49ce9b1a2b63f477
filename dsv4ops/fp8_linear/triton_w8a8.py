"""Triton kernel of `dsv4::fp8_linear_w8a8` (fp8_linear/reference.py is the specification): an
FP8 x FP8 GEMM for the token counts where act_quant + cuBLASLt (fp8_linear/w8a8.py) pays its own
floor, x quantized in the kernel's prologue (QUANT) or by the act_quant kernel before it.

Each program owns a [BM rows, BN cols] output tile and one split of K. Per K step of one 1 x 128
activation block it has x's e4m3 codes and each row's power-of-two scale 2^e: with QUANT it loads
x's [BM, 128] tile in x's dtype and takes each row's amax and UE8M0 exponent (the reference's
act_quant, exactly: triton_helpers.ue8m0_exponent) and rounds x / 2^e to e4m3, so the codes never
reach memory but every column tile's program re-quantizes its rows (BM x 128 per step against
BM x BN x 128 multiply-adds: worth it up to 16 rows); else it loads act_quant's codes and scales.
The codes and the weight's e4m3 bytes [BN, 128] go to one FP8 tensor-core dot (fresh fp32
accumulator), and the block's sum times 2^e (per row) and the weight tile's scale (per column; one
for the program where BN divides 128) is added to the fp32 tile accumulator. So the FP8 dot never
sums over more than one 128-wide block, the promotion DeepSeek's FP8 GEMMs make to bound the tensor
cores' reduced-precision FP8 accumulation.

Split-K partials (fp32, [splits, M, N]) are summed in split order by fp8_linear/triton.py's
_reduce_kernel (deterministic, no atomics); workspaces come from static sizes only (graph safe).

Where it stands (H100, graph-timed; README Benchmarks): from 1 to 256 tokens it beats act_quant +
cuBLASLt on V4's q_a and kv and below 64-256 tokens on the wide projections (o_b at one token 17.8
us against 23.6, at 128 25.6 against 29.3), and loses above (q_b at 128: 24.9 against 21.5). At
128 tokens it is latency-bound, not bandwidth- or compute-bound: ncu (base clocks, caches flushed)
on V4-Flash q_a (act_quant first, 64 x 128 tiles, 8 splits) shows 128 CTAs of 8 warps, one an SM
(142 registers a thread), DRAM 15% and SM 16% busy, 8.0 cycles a warp between issues: each CTA runs
a 4-step K loop whose loads, FP8 dot and per-block promotion follow one another; the indexer's q_b
(one split, 8 steps) DRAM 22%. More splits add fp32 partials (swept: slower).

What the extra launches cost (H100, graph-timed at 128 tokens, each launch skipped in turn; us: as
built / without the reduce / without act_quant / the GEMM alone): V4-Flash q_a 9.9 / 8.0 / 8.4 / 6.6,
kv 7.6 / 5.8 / 6.0 / 4.3, o_b 24.9 / 22.5 / 23.1 / 20.6. The split-K sum stays a separate kernel:
summed by each tile's last program instead (a per-tile arrival counter), it moves from the reduce
kernel's 128 programs onto one program a tile and was slower (q_a 17.2 against 9.9 us, kv 10.3
against 7.6). What the GEMM alone moves at q_a (estimate): x's codes re-read by each of 8 column tiles
(4 MB), the weight by each of 2 row blocks (8 MB), 4 MB of partials: ~16 MB between L2 and the SMs for
4 MB of weights; sharing x and weight tiles between a cluster's CTAs (TMA multicast) would cut it,
which this Triton kernel does not express.
"""

import torch
import triton
import triton.language as tl

from dsv4ops.fp8_linear.launch_table import LAUNCH
from dsv4ops.fp8_linear.reference import ACT_BLOCK
from dsv4ops.fp8_linear.triton import act_quant, output_tile, reduce_splits
from dsv4ops.triton_helpers import (
    INTERPRET,
    e4m3_bits_to_f32,
    f32_to_e4m3_bits,
    launch,
    pow2,
    round_to,
    to_f32,
    ue8m0_exponent,
    wait_prior_grid,
)


@triton.jit
def _block_dot(a, wbits, QUANT: tl.constexpr, SOFT: tl.constexpr):
    """One 1 x 128 block's FP8 product [BM, BN] in fp32 of a [BM, 128] activation tile and the
    [BN, 128] e4m3 weight bytes. a: fp32 values already scaled into e4m3's range (QUANT: rounded
    to e4m3 here), or e4m3 codes as bytes. The interpreter multiplies the codes' values in IEEE fp32."""
    if SOFT:
        if QUANT:
            a = f32_to_e4m3_bits(a, SOFT)
        return tl.dot(e4m3_bits_to_f32(a, SOFT), tl.trans(e4m3_bits_to_f32(wbits, SOFT)), input_precision="ieee")
    else:
        if QUANT:
            a8 = a.to(tl.float8e4nv)
        else:
            a8 = a.to(tl.float8e4nv, bitcast=True)
        return tl.dot(a8, tl.trans(wbits.to(tl.float8e4nv, bitcast=True)))


@triton.jit(do_not_specialize=["m", "mp"])
def _w8a8_kernel(x_ptr, xs_ptr, w_ptr, s_ptr, out_ptr, part_ptr, m, mp, n, k, sx, so, s_cols, k_split,
                 BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, QUANT: tl.constexpr, SPLIT: tl.constexpr,
                 STAGES: tl.constexpr, SOFT: tl.constexpr):
    """QUANT: x [m, k] in its dtype, quantized here per 1 x 128 block; else x holds act_quant's e4m3
    codes (bytes) and xs_ptr its scales [k / 128, mp] (M-major)."""
    wait_prior_grid()
    rows, cols, r64, c64, rm, cm, split = output_tile(m, n, BM, BN)
    s_row = s_ptr + (cols // BK).to(tl.int64) * s_cols  # a weight tile row's scales
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    k_lo = split * k_split
    for k0 in tl.range(k_lo, tl.minimum(k_lo + k_split, k), BK, num_stages=STAGES):
        ks = k0 + tl.arange(0, BK)
        if QUANT:
            v = to_f32(tl.load(x_ptr + r64[:, None] * sx + ks[None, :], mask=rm[:, None], other=0.0), SOFT)
            e = ue8m0_exponent(tl.max(tl.abs(v), axis=1))
            a = v * pow2(-e)[:, None]
            xs = pow2(e)
        else:
            a = tl.load(x_ptr + r64[:, None] * sx + ks[None, :], mask=rm[:, None], other=0)
            xs = tl.load(xs_ptr + (k0 // BK) * mp + rows, mask=rm, other=0.0)
        wbits = tl.load(w_ptr + c64[:, None] * k + ks[None, :], mask=cm[:, None], other=0)
        blk = _block_dot(a, wbits, QUANT, SOFT)
        if BN > BK:  # columns of two weight tiles: a scale per column
            acc += blk * xs[:, None] * tl.load(s_row + k0 // BK, mask=cm, other=0.0)[None, :]
        else:  # BN divides the tile: one scale for the program
            acc += blk * (xs * tl.load(s_ptr + (tl.program_id(0) * BN // BK) * s_cols + k0 // BK))[:, None]
    if SPLIT:
        tl.store(part_ptr + (split * m + r64[:, None]) * n + cols[None, :], acc, mask=rm[:, None] & cm[None, :])
    else:
        tl.store(out_ptr + r64[:, None] * so + cols[None, :], round_to(acc, out_ptr.dtype.element_ty, SOFT),
                 mask=rm[:, None] & cm[None, :])


# (N, K) -> {M bucket: (QUANT, BM, BN, splits, warps, stages)}: launch_table.LAUNCH's tiles.
TUNED: dict[tuple[int, int], dict[int, tuple]] = {shape: r.tiles for shape, r in LAUNCH.items()}


def config(m: int, n: int, k: int, interpret: bool = INTERPRET) -> dict:
    """Launch config from static shapes: x quantized in the prologue (QUANT) or by act_quant first,
    tile (BM, BN), K splits, warps, pipeline stages. TUNED where it lists (N, K); elsewhere the rule
    its winners follow: up to 16 rows a 16-row block quantized in the prologue (a small x tile, one
    kernel fewer), above act_quant first and 64-row blocks (128 from 65 rows where N >= 4096); split-K
    until the grid holds about 256 programs (16 rows), else 128, or up to 256 while a split keeps 16
    K steps (2048 columns), partials within 2x the weight bytes (4 x splits x M x N <= 2 x N x K).
    On the sweep's points the rule's config came within 10% of the fastest at 43 of the 46 it ran
    (V4-Flash q_b at 64 rows 1.21x with BN 64 for 128, q_a at 256 1.14x, V4-Pro q_a at 256 1.34x)."""
    tiles = k // ACT_BLOCK
    buckets = TUNED.get((n, k))
    if buckets:
        quant, bm, bn, split, warps, stages = buckets[next((b for b in sorted(buckets) if b >= m), max(buckets))]
    else:
        quant, warps, stages = m <= 16, 4, 3 if m <= 16 else 4
        bm = 16 if m <= 16 else 64 if m <= 64 or n < 4096 else 128
        bn = 128 if m <= 16 and n >= 4096 else 64
        programs = triton.cdiv(n, bn) * triton.cdiv(m, bm)
        split = 256 // programs if m <= 16 else max(128 // programs, min(256 // programs, tiles // 16))
        split = max(1, min(16, split, k // (2 * max(m, bm))))
    split = min(split, tiles)
    if interpret:
        split = min(tiles, 2)  # the interpreter runs both paths on tiny shapes
    k_split = triton.cdiv(tiles, split) * ACT_BLOCK
    return dict(QUANT=quant, BM=bm, BN=bn, SPLITS=triton.cdiv(k, k_split), K_SPLIT=k_split, WARPS=warps, STAGES=stages)


def fp8_linear_w8a8(x, weight, scale, out, cfg: dict | None = None) -> None:
    """x [M, K] (K a multiple of 128), weight [N, K] e4m3, scale [ceil(N / 128), K / 128] fp32,
    out [M, N] in x's dtype (the op has checked them). `cfg` overrides config(), for sweeps."""
    m, k = x.shape
    n = weight.shape[0]
    cfg = cfg or config(m, n, k)
    splits = cfg["SPLITS"]
    part = torch.empty(splits, m, n, dtype=torch.float32, device=x.device) if splits > 1 else out
    if cfg["QUANT"]:
        a, xs, sx = x, x, x.stride(0)
    else:
        codes = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
        xs = torch.empty(k // ACT_BLOCK, m, dtype=torch.float32, device=x.device)
        act_quant(x, codes, xs)
        a, sx = codes.view(torch.uint8), k
    grid = (triton.cdiv(n, cfg["BN"]), triton.cdiv(m, cfg["BM"]), splits)
    launch(_w8a8_kernel, grid,
           (a, xs, weight.view(torch.uint8), scale, out, part, m, m, n, k, sx, out.stride(0), scale.shape[1],
            cfg["K_SPLIT"]),
           dict(BM=cfg["BM"], BN=cfg["BN"], BK=ACT_BLOCK, QUANT=cfg["QUANT"], SPLIT=splits > 1,
                STAGES=cfg["STAGES"], SOFT=INTERPRET),
           num_warps=cfg["WARPS"], pdl=True)
    if splits > 1:
        reduce_splits(part, out)
