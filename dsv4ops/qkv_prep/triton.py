"""Triton kernel of `dsv4::qkv_prep` (qkv_prep/reference.py is the specification): one pass per
token over q (V4: weightless per-head RMSNorm; V4.1: none; interleaved RoPE on the trailing 64 dims)
and over the new kv row (RoPE, then the entry of the pool's format into the request's window ring).

Grid (tokens, head blocks + 1): programs 0..n_hb-1 of a token take HB heads of q each, the last one
takes its kv row. Padding tokens (request -1) write q_out but no cache entry.
"""

import triton
import triton.language as tl

from dsv4ops.qkv_prep import checks as _checks
from dsv4ops.quant.reference import MAIN_DIM, MAIN_ROPE, capacity
from dsv4ops.quant.formats import EXACT
from dsv4ops.quant.triton import block_size, fmt_code, store_rows
from dsv4ops.triton_helpers import (
    INTERPRET,
    apply_rope,
    launch,
    require_layout,
    rope_coeffs,
    round_to,
    round_via,
    to_f32,
    wait_prior_grid,
)


# Pool sizes are not specialized on: warmup runs on one-request pools (n_requests == 1 would compile
# another variant than a serving cache).
@triton.jit(do_not_specialize=["n_heads", "n_requests"])
def _qkv_prep_kernel(q_ptr, kv_ptr, pos_ptr, req_ptr, freq_ptr, qo_ptr, cache_ptr, sq_t, sq_h, skv_t, so_t, so_h,
                     n_heads, n_requests, ring_size, block_size, eps, D: tl.constexpr, ROPE: tl.constexpr,
                     HB: tl.constexpr, FMT: tl.constexpr, Q_NORM: tl.constexpr, SOFT: tl.constexpr):
    wait_prior_grid()
    t = tl.program_id(0).to(tl.int64)
    hb = tl.program_id(1)
    pos = tl.load(pos_ptr + t)
    cos, sin, rot = rope_coeffs(freq_ptr, pos, D, ROPE)
    cols = tl.arange(0, D)
    if hb < tl.cdiv(n_heads, HB):
        heads = hb * HB + tl.arange(0, HB)
        hm = heads < n_heads
        h64 = heads.to(tl.int64)
        x = to_f32(tl.load(q_ptr + t * sq_t + h64[:, None] * sq_h + cols[None, :], mask=hm[:, None], other=0.0), SOFT)
        y = x
        if Q_NORM:
            # transformers' order: the fp32 rsqrt is cast to q's dtype, the product is rounded to it.
            r = tl.math.rsqrt(tl.sum(x * x, axis=1) * (1.0 / D) + eps)
            y = round_via(x * round_via(r, q_ptr.dtype.element_ty, SOFT)[:, None], q_ptr.dtype.element_ty, SOFT)
        y = apply_rope(y, cos, sin, rot, HB, D, False)
        tl.store(qo_ptr + t * so_t + h64[:, None] * so_h + cols[None, :], round_to(y, qo_ptr.dtype.element_ty, SOFT),
                 mask=hm[:, None])
    else:
        req = tl.load(req_ptr + t)
        # A request slot past the pool or a negative position: padding (kernels never index out of range).
        if (req >= 0) & (req < n_requests) & (pos >= 0):
            x = to_f32(tl.load(kv_ptr + t * skv_t + cols), SOFT)
            y = round_via(apply_rope(x[None, :], cos, sin, rot, 1, D, False), kv_ptr.dtype.element_ty, SOFT)
            slot = req.to(tl.int64) * ring_size + pos % ring_size
            store_rows(cache_ptr, tl.full([1], slot, tl.int64), tl.full([1], True, tl.int1), y, block_size, 1, D,
                       FMT, SOFT)


def heads_per_program(d: int) -> int:
    return 8 if d >= 512 else 16


def qkv_prep(q, kv, positions, req_slots, inv_freq, q_out, window_cache, ring_size: int, eps: float, q_norm: bool,
             window_fmt: str) -> None:
    """Launcher of `dsv4::qkv_prep` (same arguments)."""
    _checks.qkv_prep(q, kv, positions, req_slots, inv_freq, q_out, window_cache, ring_size, eps, window_fmt)
    fmt = fmt_code("qkv_prep", "window_fmt", window_fmt, allowed=(EXACT, "fp8_584", "fp8_528"))
    t, h, d = q.shape
    require_layout("qkv_prep", d, inv_freq.shape[0], dims=(MAIN_DIM,))
    if t == 0:
        return
    hb = heads_per_program(d)
    grid = (t, triton.cdiv(h, hb) + 1)
    launch(_qkv_prep_kernel, grid,
           (q, kv, positions, req_slots, inv_freq, q_out, window_cache, q.stride(0), q.stride(1), kv.stride(0),
            q_out.stride(0), q_out.stride(1), h, capacity(window_cache, window_fmt) // ring_size, ring_size,
            block_size(window_cache, window_fmt), eps),
           dict(D=d, ROPE=MAIN_ROPE, HB=hb, FMT=fmt, Q_NORM=bool(q_norm), SOFT=INTERPRET), pdl=True)

