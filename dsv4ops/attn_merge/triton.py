"""Triton kernel of `dsv4::attn_merge` (attn_merge/reference.py is the specification). Grid (tokens,
head blocks, column blocks): a program reads its heads' R log-sum-exps and its columns of the R
partials once, in fp32, and writes its tile of the output. Small tiles spread a decode batch's merge
over many SMs, like sparse_attn's split combine (which this kernel generalizes to shards on other
ranks)."""

import triton
import triton.language as tl

from dsv4ops.attn_merge import checks as _checks
from dsv4ops.triton_helpers import INTERPRET, launch, round_to, to_f32

# (heads, columns) of a program; the column block divides the 512-d V4 head.
TILE = (4, 128)


@triton.jit(do_not_specialize=["n_tokens", "n_heads"])
def _attn_merge_kernel(part_ptr, lse_ptr, sink_ptr, out_ptr, sp_r, sp_t, sp_h, so_t, so_h, n_tokens, n_heads,
                       R: tl.constexpr, D: tl.constexpr, HB: tl.constexpr, DB: tl.constexpr, SOFT: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * HB + tl.arange(0, HB)
    hm = heads < n_heads
    h64 = heads.to(tl.int64)
    cols = tl.program_id(2) * DB + tl.arange(0, DB)
    cm = cols < D
    sink = tl.load(sink_ptr + heads, mask=hm, other=0.0)
    m = sink
    for r in tl.static_range(R):
        m = tl.maximum(m, tl.load(lse_ptr + (r * n_tokens + t) * n_heads + h64, mask=hm, other=float("-inf")))
    den = tl.exp(sink - m)
    acc = tl.zeros([HB, DB], tl.float32)
    for r in tl.static_range(R):
        lse = tl.load(lse_ptr + (r * n_tokens + t) * n_heads + h64, mask=hm, other=float("-inf"))
        w = tl.exp(lse - m)
        den += w
        has = hm & (lse > float("-inf"))  # an empty shard's row is not read
        part = tl.load(part_ptr + r * sp_r + t * sp_t + h64[:, None] * sp_h + cols[None, :],
                       mask=has[:, None] & cm[None, :], other=0.0)
        acc += w[:, None] * to_f32(part, SOFT)
    tl.store(out_ptr + t * so_t + h64[:, None] * so_h + cols[None, :],
             round_to(acc / den[:, None], out_ptr.dtype.element_ty, SOFT), mask=hm[:, None] & cm[None, :])


def attn_merge(partials, lse, sinks, out) -> None:
    """Launcher of `dsv4::attn_merge` (same arguments)."""
    _checks.attn_merge(partials, lse, sinks, out)
    r, t, h, d = partials.shape
    if r == 0 or t == 0 or h == 0 or d == 0:
        if r == 0:
            out.zero_()
        return
    hb, db = TILE
    db = min(db, triton.next_power_of_2(d))
    launch(_attn_merge_kernel, (t, triton.cdiv(h, hb), triton.cdiv(d, db)),
           (partials, lse, sinks, out, partials.stride(0), partials.stride(1), partials.stride(2), out.stride(0),
            out.stride(1), t, h),
           dict(R=r, D=d, HB=hb, DB=db, SOFT=INTERPRET), num_warps=4)
