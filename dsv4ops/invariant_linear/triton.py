"""Triton kernel of `dsv4::invariant_linear` (invariant_linear/reference.py is the specification):
out [M, N] = x [M, K] @ weight [N, K]^T, fp32 accumulation, one rounding to out's dtype.

Batch invariance: one compiled kernel serves every M. The tile (BM x BN x BK), warps and stages are
constants, M is a runtime argument that Triton does not specialize (an M of 1 or a multiple of 16
would otherwise compile another kernel), there is no split-K, and each program walks K in the same
order. An output element is then computed by the same instructions on the same operands whatever
M is and wherever its row falls in a tile (the rows of an MMA do not mix), which cuBLAS does not
promise (its heuristics pick algorithms, tiles and split-K by M). The interpreter's tl.dot is
numpy's GEMM, whose rows do mix (a row 5 places down a tile gets other bits): there the K step
sums its products in order, a row-wise fp32 sum.

Split-K is fixed by the weight's shape alone (`splits`: about 256 programs at one row block, at
most 8 splits, each a whole number of BK steps), its fp32 partials summed in split order by
fp8_linear's reduce kernel: the same sum for every M. A decode step then still streams the weight
from about two programs an SM (a [4160, 4096] weight: 65 column tiles x 4 splits), where one
program a column tile would leave half the SMs idle; it pays a 64-row tile for its few rows
(decode is bound by the weight's bytes, not the tile's FLOPs)."""

import torch
import triton
import triton.language as tl

from dsv4ops.fp8_linear.triton import reduce_splits
from dsv4ops.invariant_linear import checks as _checks
from dsv4ops.triton_helpers import INTERPRET, TL_DTYPES, dot, launch, round_to, to_f32

# The one config (BM, BN, BK, warps, stages): 64-row tiles run wgmma on sm_90.
CONFIG = (64, 64, 64, 4, 3)


@triton.jit(do_not_specialize=["m"])
def _invariant_linear_kernel(x_ptr, w_ptr, out_ptr, part_ptr, m, n, k, sx, sw, so, k_split, BM: tl.constexpr,
                             BN: tl.constexpr, BK: tl.constexpr, SPLITS: tl.constexpr, STAGES: tl.constexpr,
                             SOFT: tl.constexpr):
    rows = tl.program_id(1) * BM + tl.arange(0, BM)
    cols = tl.program_id(0) * BN + tl.arange(0, BN)
    r64, c64 = rows.to(tl.int64), cols.to(tl.int64)
    rm, cm = rows < m, cols < n
    acc = tl.zeros([BM, BN], dtype=tl.float32)
    k_lo = tl.program_id(2) * k_split
    for k0 in tl.range(k_lo, tl.minimum(k_lo + k_split, k), BK, num_stages=STAGES):
        ks = k0 + tl.arange(0, BK)
        km = ks < k
        a = tl.load(x_ptr + r64[:, None] * sx + ks[None, :], mask=rm[:, None] & km[None, :], other=0.0)
        w = tl.load(w_ptr + c64[:, None] * sw + ks[None, :], mask=cm[:, None] & km[None, :], other=0.0)
        if SOFT:  # the interpreter's tl.dot is numpy's GEMM, whose rows' bits depend on their place in the tile
            acc += tl.sum(to_f32(a, SOFT)[:, :, None] * tl.trans(to_f32(w, SOFT))[None, :, :], axis=1)
        else:
            acc = dot(a, tl.trans(w), acc, SOFT)
    if SPLITS == 1:
        tl.store(out_ptr + r64[:, None] * so + cols[None, :], round_to(acc, out_ptr.dtype.element_ty, SOFT),
                 mask=rm[:, None] & cm[None, :])
    else:
        at = (tl.program_id(2) * m + r64[:, None]) * n + cols[None, :]
        tl.store(part_ptr + at, acc, mask=rm[:, None] & cm[None, :])


def splits(n: int, k: int) -> tuple[int, int]:
    """(K splits, K per split) of a [n, k] weight: a function of the weight's shape only."""
    _, bn, bk, _, _ = CONFIG
    steps = triton.cdiv(k, bk)
    want = max(1, min(8, steps, 256 // triton.cdiv(n, bn)))
    k_split = triton.cdiv(steps, want) * bk
    return triton.cdiv(k, k_split) if k else 1, k_split


def invariant_linear(x, weight, out) -> None:
    """Launcher of `dsv4::invariant_linear` (same arguments)."""
    _checks.invariant_linear(x, weight, out)
    m, k = x.shape
    n = weight.shape[0]
    if m == 0 or n == 0:
        return
    assert x.dtype in TL_DTYPES
    bm, bn, bk, warps, stages = CONFIG
    n_split, k_split = splits(n, k)
    part = torch.empty(n_split, m, n, dtype=torch.float32, device=x.device) if n_split > 1 else out
    launch(_invariant_linear_kernel, (triton.cdiv(n, bn), triton.cdiv(m, bm), n_split),
           (x, weight, out, part, m, n, k, x.stride(0), weight.stride(0), out.stride(0), k_split),
           dict(BM=bm, BN=bn, BK=bk, SPLITS=n_split, STAGES=stages, SOFT=INTERPRET), num_warps=warps)
    if n_split > 1:
        reduce_splits(part, out)
