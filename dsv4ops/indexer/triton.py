"""Triton kernels of the Lightning Indexer ops (indexer/reference.py is the specification).

`indexer_q_prep`: RoPE of the 128-d indexer query, head weights x d^-1/2 x H^-1/2, and for an e4m3
q_out the per-(token, head) UE8M0 scale folded into the weights. Grid (tokens, head blocks).

`indexer_topk`, per chunk of tokens (three launches; the chunk bounds the key workspace):
1. `_scores_kernel`, grid (tokens, entry blocks of BN): score[w] = sum_h w_h relu(q_h . k_w) over the
   visible entries w < (t + 1) // ratio of allocated blocks (block table entry >= 0), keys read
   through the block table (FP8 132-B entries feed an
   e4m3 x e4m3 tl.dot, the per-entry scale applied after it). Each score is written as an int64
   key (order-preserving fp32 bits << 32 | ~entry), -inf for invisible entries, so one descending
   sort orders by score and breaks exact ties toward the lower entry, as the reference's stable sort.
2. `torch.topk` of the keys (unique, so its order is deterministic).
3. `_finalize_kernel`: entry -> global pool slot through the block table, -1 for invisible entries
   and for the columns beyond the candidates.
"""

import torch
import triton
import triton.language as tl

from dsv4ops.indexer import checks as _checks
from dsv4ops.quant.reference import INDEXER_DIM, MAIN_ROPE
from dsv4ops.quant.triton import FMT_INDEXER, block_size, fmt_code, load_rows, not_yet
from dsv4ops.triton_helpers import (
    INTERPRET,
    apply_rope,
    e4m3_bits_to_f32,
    f32_to_e4m3_bits,
    launch,
    pow2,
    require,
    require_layout,
    rope_coeffs,
    round_to,
    round_via,
    to_f32,
    ue8m0_exponent,
)

# Bytes of int64 keys one topk chunk may hold (tokens x candidate entries x 8).
WORKSPACE_BYTES = 256 << 20


@triton.jit(do_not_specialize=["n_heads"])
def _q_prep_kernel(q_ptr, w_ptr, pos_ptr, freq_ptr, qo_ptr, wo_ptr, sq_t, sq_h, sw_t, so_t, so_h, swo_t, n_heads,
                   w_scale, D: tl.constexpr, ROPE: tl.constexpr, HB: tl.constexpr, FP8_OUT: tl.constexpr,
                   SOFT: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * HB + tl.arange(0, HB)
    hm = heads < n_heads
    h64 = heads.to(tl.int64)
    cols = tl.arange(0, D)
    cos, sin, rot = rope_coeffs(freq_ptr, tl.load(pos_ptr + t), D, ROPE)
    x = to_f32(tl.load(q_ptr + t * sq_t + h64[:, None] * sq_h + cols[None, :], mask=hm[:, None], other=0.0), SOFT)
    y = round_via(apply_rope(x, cos, sin, rot, HB, D, False), q_ptr.dtype.element_ty, SOFT)
    w = to_f32(tl.load(w_ptr + t * sw_t + heads, mask=hm, other=0.0), SOFT) * w_scale
    out = qo_ptr + t * so_t + h64[:, None] * so_h + cols[None, :]
    if FP8_OUT:
        v = round_via(y, tl.bfloat16, SOFT)
        e = ue8m0_exponent(tl.max(tl.abs(v), axis=1))
        codes = f32_to_e4m3_bits(v * pow2(-e)[:, None], SOFT)
        tl.store(out, codes.to(tl.float8e4nv, bitcast=True), mask=hm[:, None])
        w = w * pow2(e)
    else:
        tl.store(out, round_to(y, qo_ptr.dtype.element_ty, SOFT), mask=hm[:, None])
    tl.store(wo_ptr + t * swo_t + heads, w, mask=hm)


def indexer_q_prep(q, weights, positions, inv_freq, q_out, w_out, fmt: str) -> None:
    """Launcher of `dsv4::indexer_q_prep` (same arguments)."""
    _checks.indexer_q_prep(q, weights, positions, inv_freq, q_out, w_out, fmt)
    if fmt not in ("exact", "fp8_132"):
        not_yet("indexer_q_prep", f"fmt={fmt!r} (V4.1's MX4 query)")
    t, h, d = q.shape
    require_layout("indexer_q_prep", d, inv_freq.shape[0], dims=(INDEXER_DIM,))
    if t == 0 or h == 0:
        return
    hb = 16
    launch(_q_prep_kernel, (t, triton.cdiv(h, hb)),
           (q, weights, positions, inv_freq, q_out, w_out, q.stride(0), q.stride(1), weights.stride(0),
            q_out.stride(0), q_out.stride(1), w_out.stride(0), h, d**-0.5 * h**-0.5),
           dict(D=d, ROPE=MAIN_ROPE, HB=hb, FP8_OUT=q_out.dtype == torch.float8_e4m3fn, SOFT=INTERPRET))


@triton.jit
def _score_key(score, entry):
    """int64 key: descending key order = descending score, then ascending entry (-0.0 == +0.0)."""
    bits = tl.where(score == 0.0, 0.0, score).to(tl.int32, bitcast=True)
    mono = bits ^ ((bits >> 31) & 0x7FFFFFFF)
    return (mono.to(tl.int64) << 32) + (4294967295 - entry.to(tl.int64))


@triton.jit(do_not_specialize=["t0", "n_entries"])
def _scores_kernel(q_ptr, w_ptr, pos_ptr, req_ptr, cache_ptr, bt_ptr, key_ptr, t0, sq_t, sq_h, sw_t, s_bt, sk_t,
                   n_heads, n_entries, ratio, block_size, D: tl.constexpr, HP: tl.constexpr, BN: tl.constexpr,
                   FMT: tl.constexpr, Q_FP8: tl.constexpr, DOT: tl.constexpr, SOFT: tl.constexpr):
    tc = tl.program_id(0).to(tl.int64)  # token within the chunk
    t = t0 + tc
    e = tl.program_id(1) * BN + tl.arange(0, BN)
    req = tl.load(req_ptr + t)
    n_vis = tl.where(req >= 0, (tl.load(pos_ptr + t) + 1) // ratio, 0)
    vis = (e < n_vis) & (e < n_entries)
    score = tl.full([BN], float("-inf"), tl.float32)
    if tl.max(vis.to(tl.int32), axis=0) > 0:
        blk = tl.load(bt_ptr + req.to(tl.int64) * s_bt + e // block_size, mask=vis, other=-1)
        vis = vis & (blk >= 0)  # an unallocated block (-1) holds no entry
        slots = blk.to(tl.int64) * block_size + e % block_size
        heads = tl.arange(0, HP)
        hm = heads < n_heads
        cols = tl.arange(0, D)
        q = tl.load(q_ptr + t * sq_t + heads.to(tl.int64)[:, None] * sq_h + cols[None, :], mask=hm[:, None],
                    other=0)
        w = tl.load(w_ptr + t * sw_t + heads, mask=hm, other=0.0)
        if DOT == 0:  # e4m3 query x e4m3 keys; the entry's power-of-two scale after the dot (exact)
            blk_at = (slots // block_size) * (block_size * 132)
            off = slots % block_size
            codes = tl.load(cache_ptr + (blk_at + off * 128)[:, None] + cols[None, :], mask=vis[:, None], other=0)
            kscale = tl.load((cache_ptr + blk_at + block_size * 128 + off * 4).to(tl.pointer_type(tl.float32)),
                             mask=vis, other=0.0)
            if SOFT:
                s = tl.dot(e4m3_bits_to_f32(q, SOFT), tl.trans(e4m3_bits_to_f32(codes, SOFT)), input_precision="ieee")
            else:
                s = tl.dot(q.to(tl.float8e4nv, bitcast=True), tl.trans(codes.to(tl.float8e4nv, bitcast=True)))
            s = s * kscale[None, :]
        elif DOT == 1:  # same 16-bit float dtype on both sides
            k = tl.load(cache_ptr + slots[:, None] * D + cols[None, :], mask=vis[:, None], other=0.0)
            s = tl.dot(q, tl.trans(k))
        else:  # fp32 (exact products, as the reference's fp32 einsum)
            k = load_rows(cache_ptr, slots, vis, block_size, BN, D, FMT, SOFT)
            if Q_FP8:
                qf = e4m3_bits_to_f32(q, SOFT)
            else:
                qf = to_f32(q, SOFT)
            s = tl.dot(qf, tl.trans(k), input_precision="ieee")
        s = tl.sum(tl.maximum(s, 0.0) * w[:, None], axis=0)
        score = tl.where(vis, s, score)
    tl.store(key_ptr + tc * sk_t + e, _score_key(score, e), mask=e < n_entries)


@triton.jit(do_not_specialize=["t0"])
def _finalize_kernel(top_ptr, pos_ptr, req_ptr, bt_ptr, idx_ptr, t0, s_top, s_bt, s_idx, n_top, n_out, ratio,
                     block_size, KP: tl.constexpr):
    tc = tl.program_id(0).to(tl.int64)
    t = t0 + tc
    c = tl.arange(0, KP)
    req = tl.load(req_ptr + t)
    n_vis = tl.where(req >= 0, (tl.load(pos_ptr + t) + 1) // ratio, 0)
    key = tl.load(top_ptr + tc * s_top + c, mask=c < n_top, other=0)
    e = (4294967295 - (key & 4294967295)).to(tl.int32)
    ok = (c < n_top) & (e < n_vis)
    blk = tl.load(bt_ptr + tl.maximum(req, 0).to(tl.int64) * s_bt + e // block_size, mask=ok, other=-1)
    slot = blk * block_size + e % block_size
    tl.store(idx_ptr + t * s_idx + c, tl.where(ok & (blk >= 0), slot, -1), mask=c < n_out)


def _dot_kind(q: torch.Tensor, cache: torch.Tensor, fmt: int) -> int:
    if INTERPRET and fmt != FMT_INDEXER:
        return 2
    if fmt == FMT_INDEXER and q.dtype == torch.float8_e4m3fn:
        return 0
    if fmt == 0 and q.dtype == cache.dtype and q.dtype in (torch.bfloat16, torch.float16):
        return 1
    return 2


def indexer_topk(q, weights, positions, req_slots, cache, block_table, cand, idx_out, cand_out, ratio: int,
                 cand_block: int, fmt: str) -> None:
    """Launcher of `dsv4::indexer_topk` (same arguments). No host sync: every size is static."""
    _checks.indexer_topk(q, weights, positions, req_slots, cache, block_table, cand, idx_out, cand_out, ratio,
                         cand_block, fmt)
    code = fmt_code("indexer_topk", "fmt", fmt)
    if cand is not None or cand_out is not None or q.dtype == torch.uint8:
        not_yet("indexer_topk", "candidate blocks (cand, cand_out) or MX4 queries (V4.1)")
    t, h, d = q.shape
    require(d == INDEXER_DIM, "indexer_topk", "q", f"index_head_dim {INDEXER_DIM} (V4 layout)", d)
    require(h <= 128, "indexer_topk", "q", "at most 128 indexer heads", h)
    k = idx_out.shape[1]
    if t == 0 or k == 0:
        return
    bs = block_size(cache, fmt)
    n_entries = block_table.shape[1] * bs
    kk = min(k, n_entries)
    if kk == 0:
        idx_out.fill_(-1)
        return
    hp = max(16, triton.next_power_of_2(h))
    bn = 64 if hp <= 64 else 32
    kp = triton.next_power_of_2(k)
    chunk = max(1, min(t, WORKSPACE_BYTES // (8 * n_entries)))
    keys = torch.empty(chunk, n_entries, dtype=torch.int64, device=q.device)
    dot = _dot_kind(q, cache, code)
    q_fp8 = q.dtype == torch.float8_e4m3fn
    qa = q.view(torch.uint8) if q_fp8 else q  # e4m3 codes load as bytes (masked lanes read 0)
    for t0 in range(0, t, chunk):
        n = min(chunk, t - t0)
        launch(_scores_kernel, (n, triton.cdiv(n_entries, bn)),
               (qa, weights, positions, req_slots, cache, block_table, keys, t0, q.stride(0), q.stride(1),
                weights.stride(0), block_table.stride(0), keys.stride(0), h, n_entries, ratio, bs),
               dict(D=d, HP=hp, BN=bn, FMT=code, Q_FP8=q_fp8, DOT=dot, SOFT=INTERPRET), num_warps=4)
        top = torch.topk(keys[:n], kk, dim=1, sorted=True).values
        launch(_finalize_kernel, (n,),
               (top, positions, req_slots, block_table, idx_out, t0, top.stride(0), block_table.stride(0),
                idx_out.stride(0), kk, k, ratio, bs),
               dict(KP=kp))
