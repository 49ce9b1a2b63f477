"""Triton kernel of `dsv4::sparse_attn` (sparse_attn/reference.py is the specification), decode and
prefill alike.

One program per (token, block of HB heads). K = V is one shared 512-d head (MQA), so the program
holds q [HB, 512] and streams key tiles [BK, 512]: first the token's window (positions
t - window + 1 .. t of its request's ring), then its compressed entries (comp_idx, -1 = none).
Tiles are read straight from the pools (FP8 584-B entries dequantized in registers: e4m3 x 2^(s-127)
for the 448 nope dims, bf16 rope dims; float pools converted to q's dtype, as the reference's key
copy), S = q k^T and O += P k run on the tensor cores in q's dtype with fp32 accumulation (P cast to
q's dtype, as DeepSeek's kernel), online softmax in fp32 (exp2). The sink starts the running max and
sum (logit s_h, no value), which is exactly its term in the denominator. Tiles with no valid key are
skipped. Padding tokens (request -1) write zeros.
"""

import math

import torch
import triton
import triton.language as tl

from dsv4ops.quant.reference import MAIN_DIM
from dsv4ops.quant.triton import block_size, fmt_code, load_rows
from dsv4ops.triton_helpers import INTERPRET, launch, require, round_to
from dsv4ops.sparse_attn import checks as _checks


@triton.jit
def _attend_tile(q, k, valid, m_i, l_i, acc, qk_scale, SOFT: tl.constexpr):
    """One online-softmax step over key tile k [BK, D] (q's dtype) for q [HB, D]."""
    if SOFT or q.dtype == tl.float32:
        s = tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if SOFT or q.dtype == tl.float32:
        pv = tl.dot(p, k.to(tl.float32), input_precision="ieee")
    else:
        pv = tl.dot(p.to(k.dtype), k)
    return m_new, l_i, acc * alpha[:, None] + pv


@triton.jit(do_not_specialize=["n_heads", "n_idx"])
def _sparse_attn_kernel(q_ptr, wc_ptr, cc_ptr, pos_ptr, req_ptr, idx_ptr, sink_ptr, out_ptr, sq_t, sq_h, si_t, so_t,
                        so_h, n_heads, n_idx, qk_scale, window, ring_size, w_bs, c_bs, D: tl.constexpr,
                        HB: tl.constexpr, BK: tl.constexpr, STAGES: tl.constexpr, W_FMT: tl.constexpr,
                        C_FMT: tl.constexpr, SOFT: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * HB + tl.arange(0, HB)
    hm = heads < n_heads
    h64 = heads.to(tl.int64)
    cols = tl.arange(0, D)
    out = out_ptr + t * so_t + h64[:, None] * so_h + cols[None, :]
    req = tl.load(req_ptr + t)
    if req < 0:
        tl.store(out, tl.zeros([HB, D], out_ptr.dtype.element_ty), mask=hm[:, None])
    else:
        pos = tl.load(pos_ptr + t)
        q = tl.load(q_ptr + t * sq_t + h64[:, None] * sq_h + cols[None, :], mask=hm[:, None], other=0.0)
        kdt: tl.constexpr = q_ptr.dtype.element_ty
        # The sink opens the online softmax: running max s_h, running sum e^0 = 1, no value.
        m_i = tl.load(sink_ptr + heads, mask=hm, other=0.0) * 1.4426950408889634
        l_i = tl.full([HB], 1.0, tl.float32)
        acc = tl.zeros([HB, D], tl.float32)
        ring0 = req.to(tl.int64) * ring_size
        for j0 in tl.range(0, window, BK, num_stages=STAGES):
            j = j0 + tl.arange(0, BK)
            wpos = pos - window + 1 + j
            valid = (j < window) & (wpos >= 0)
            if STAGES > 1 or tl.max(valid.to(tl.int32), axis=0) > 0:
                slots = ring0 + tl.maximum(wpos, 0) % ring_size
                k = round_to(load_rows(wc_ptr, slots, valid, w_bs, BK, D, W_FMT, SOFT), kdt, SOFT)
                m_i, l_i, acc = _attend_tile(q, k, valid, m_i, l_i, acc, qk_scale, SOFT)
        for j0 in tl.range(0, n_idx, BK, num_stages=STAGES):
            j = j0 + tl.arange(0, BK)
            idx = tl.load(idx_ptr + t * si_t + j, mask=j < n_idx, other=-1)
            valid = idx >= 0
            if STAGES > 1 or tl.max(valid.to(tl.int32), axis=0) > 0:
                k = round_to(load_rows(cc_ptr, tl.maximum(idx, 0).to(tl.int64), valid, c_bs, BK, D, C_FMT, SOFT),
                             kdt, SOFT)
                m_i, l_i, acc = _attend_tile(q, k, valid, m_i, l_i, acc, qk_scale, SOFT)
        o = acc / l_i[:, None]
        tl.store(out, round_to(o, out_ptr.dtype.element_ty, SOFT), mask=hm[:, None])


def config(num_heads: int, dtype: torch.dtype, pool_dtypes=()) -> tuple[int, int, int, int]:
    """(heads per program, keys per tile, warps, pipeline stages), from static dims only.

    Measured on an H200 (V4-Flash decode, 128 x 1 token, 128 + 512 FP8 keys, h=64; the bench in
    tests/test_kernels_gpu.py): the kernel is bound by the latency of each tile iteration (gather,
    dequant, two dots), not by registers, so the widest tiles win although they spill: 64 heads x
    64 keys 105 us; 64 x 32: 131 us; 32 x 64: 204 us; 16 x 32: 186 us; spill-free 32 x 16: 315 us;
    Triton's cp.async pipeline (stages 2): 100 us at 64 x 64, 139 us at 64 x 32, within noise, so
    the default stays on the tile-skipping loop. tl.dot needs >= 16 rows: fewer heads are padded.
    fp32 activations or pools (exact mode) take [32, 512] fp32 tiles for 16 heads (shared memory)."""
    if dtype == torch.float32 or torch.float32 in pool_dtypes:
        return 16, 32, 4, 1
    if num_heads > 32:
        return 64, 64, 8, 1
    if num_heads > 16:
        return 32, 64, 8, 1
    return 16, 32, 4, 1


def sparse_attn(q, window_cache, comp_cache, positions, req_slots, comp_idx, sinks, out, scale: float, window: int,
                ring_size: int, window_fmt: str, comp_fmt: str) -> None:
    """Launcher of `dsv4::sparse_attn` (same arguments)."""
    _checks.sparse_attn(q, window_cache, comp_cache, positions, req_slots, comp_idx, sinks, out, window, ring_size,
                        window_fmt, comp_fmt)
    w_fmt, c_fmt = fmt_code("sparse_attn", "window_fmt", window_fmt), fmt_code("sparse_attn", "comp_fmt", comp_fmt)
    t, h, d = q.shape
    require(d == MAIN_DIM, "sparse_attn", "q", f"head_dim {MAIN_DIM} (V4 layout)", d)
    if t == 0 or h == 0:
        return
    hb, bk, warps, stages = config(h, q.dtype, (window_cache.dtype, comp_cache.dtype))
    launch(_sparse_attn_kernel, (t, triton.cdiv(h, hb)),
           (q, window_cache, comp_cache, positions, req_slots, comp_idx, sinks, out, q.stride(0), q.stride(1),
            comp_idx.stride(0), out.stride(0), out.stride(1), h, comp_idx.shape[1], scale * math.log2(math.e), window,
            ring_size, block_size(window_cache, window_fmt), block_size(comp_cache, comp_fmt)),
           dict(D=d, HB=hb, BK=bk, STAGES=stages, W_FMT=w_fmt, C_FMT=c_fmt, SOFT=INTERPRET), num_warps=warps)

