"""Triton kernels of the Lightning Indexer ops (indexer/reference.py is the specification).

`indexer_q_prep`: RoPE of the 128-d indexer query, head weights x d^-1/2 x H^-1/2, and for an e4m3
q_out the per-(token, head) UE8M0 scale folded into the weights. Grid (tokens, head blocks).

`indexer_topk`: exact top-k without a sort and without per-entry int64 keys.
1. `_topk_kernel`, grid (tokens, chunks): a token's visible entries w < (t + 1) // ratio (only
   these: the cost follows the real context, not the block table's width) are cut into at most P
   chunks of at least CHUNK_MIN entries. Each program scores its chunk, 64 entries at a time through
   the block table (132-B FP8 entries: e4m3 x e4m3 tl.dot on the tensor cores, the entry's power-of-
   two scale after it; an unallocated block holds no entry), into the workspace as uint32 keys
   ordered like the scores (-0.0 == +0.0; 0 = no entry). A radix select (4 passes of 8 bits,
   histograms) finds the k-th largest key T and how many keys equal to T make the cut; one more
   pass writes the entries with key > T and the lowest-index ones equal to T, in ascending entry
   order, so exact ties go to the lower entry and the result is bitwise deterministic.
   A token with one chunk writes its row (global slots, -1 fill) right there.
2. `_merge_kernel` (launched only when P > 1, i.e. small batches): a token with several chunks
   selects its top k from the chunks' candidates the same way; chunk order keeps entries ascending.
The workspace (an op argument, sized by the cache config; `workspace_words`) holds the chunk
candidates and one key row per token of a launch; a step with more tokens runs in several launches.
"""

import torch
import triton
import triton.language as tl

from dsv4ops.indexer import checks as _checks
from dsv4ops.indexer import workspace as _ws
from dsv4ops.quant.reference import INDEXER_DIM, MAIN_ROPE
from dsv4ops.quant.triton import FMT_INDEXER, block_size, load_rows, pool_format
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


def indexer_q_prep(q, weights, positions, inv_freq, q_out, w_out) -> None:
    """Launcher of `dsv4::indexer_q_prep` (same arguments)."""
    _checks.indexer_q_prep(q, weights, positions, inv_freq, q_out, w_out)
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
def _key_of(score):
    """uint32 key ordered like the fp32 score (-0.0 == +0.0); 0 is never a score's key, so it marks
    "no entry" in the workspace."""
    bits = (score + 0.0).to(tl.int32, bitcast=True)  # -0.0 + 0.0 = +0.0
    return (bits ^ ((bits >> 31) | -2147483648)).to(tl.uint32, bitcast=True)


@triton.jit
def _scores(q_ptr, w_ptr, cache_ptr, bt_ptr, t, req, e0, hi, sq_t, sq_h, sw_t, s_bt, n_heads, block_size,
            D: tl.constexpr, HP: tl.constexpr, BN: tl.constexpr, FMT: tl.constexpr, Q_FP8: tl.constexpr,
            DOT: tl.constexpr, SOFT: tl.constexpr):
    """Keys [BN] of entries e0 .. e0 + BN - 1 (< hi) of the token's request: score = sum_h w_h
    relu(q_h . k_e); 0 where the entry is past hi or its block is unallocated (-1). Also the
    entries and how many hold a key (counted from the block table, not from the keys: a reduction
    of the dot's layout breaks Triton 3.6's sm_100 TMEM layout pass)."""
    e = e0 + tl.arange(0, BN)
    vis = e < hi
    blk = tl.load(bt_ptr + req.to(tl.int64) * s_bt + e // block_size, mask=vis, other=-1)
    vis = vis & (blk >= 0)
    slots = blk.to(tl.int64) * block_size + e % block_size
    heads = tl.arange(0, HP)
    hm = heads < n_heads
    cols = tl.arange(0, D)
    q = tl.load(q_ptr + t * sq_t + heads.to(tl.int64)[:, None] * sq_h + cols[None, :], mask=hm[:, None], other=0)
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
    return tl.where(vis, _key_of(s), 0), e, tl.sum(vis.to(tl.int32), axis=0)


@triton.jit
def _threshold(key_ptr, lo, hi, want, BLOCK: tl.constexpr):
    """(T, take): the want-th largest nonzero uint32 key of key_ptr[lo:hi] and how many keys equal
    to it belong to the top `want` (radix select, 4 passes of 8 bits). want >= 1 and at most the
    number of nonzero keys."""
    prefix = tl.zeros([], tl.uint32)
    fixed = tl.zeros([], tl.uint32)
    bins = tl.arange(0, 256)
    for d in tl.static_range(4):
        shift = 24 - 8 * d
        hist = tl.zeros([256], tl.int32)
        for i0 in range(lo, hi, BLOCK):
            i = i0 + tl.arange(0, BLOCK)
            key = tl.load(key_ptr + i, mask=i < hi, other=0).to(tl.uint32, bitcast=True)
            m = (key != 0) & ((key & fixed) == prefix)
            hist += tl.histogram(((key >> shift) & 255).to(tl.int32), 256, mask=m)
        ge = tl.sum(hist, axis=0) - tl.cumsum(hist, axis=0) + hist  # keys with this digit or more
        b = tl.sum((ge >= want).to(tl.int32), axis=0) - 1
        want -= tl.sum(tl.where(bins > b, hist, 0), axis=0)
        prefix |= b.to(tl.uint32) << shift
        fixed |= tl.full([], 255, tl.uint32) << shift
    return prefix, want


@triton.jit
def _emit(key_ptr, val_ptr, lo, hi, T, take, out_ptr, out_key_ptr, bt_ptr, req, s_bt, block_size,
          BLOCK: tl.constexpr, HAS_VAL: tl.constexpr, SLOTS: tl.constexpr):
    """Write the selected entries of key_ptr[lo:hi] (key > T, and the first `take` keys == T) in
    index order; the entry of position i is val_ptr[i] with HAS_VAL, else i. SLOTS: as global pool
    slots through the block table; else the entries to out_ptr and their keys to out_key_ptr.
    Returns how many were written."""
    count = tl.zeros([], tl.int32)
    seen = tl.zeros([], tl.int32)
    for i0 in range(lo, hi, BLOCK):
        i = i0 + tl.arange(0, BLOCK)
        key = tl.load(key_ptr + i, mask=i < hi, other=0).to(tl.uint32, bitcast=True)
        eq = ((key == T) & (key != 0)).to(tl.int32)
        sel = ((key > T) | ((eq != 0) & (seen + tl.cumsum(eq, axis=0) - eq < take))).to(tl.int32)
        at = count + tl.cumsum(sel, axis=0) - sel
        if HAS_VAL:
            entry = tl.load(val_ptr + i, mask=sel != 0, other=0)
        else:
            entry = i
        if SLOTS:
            blk = tl.load(bt_ptr + req.to(tl.int64) * s_bt + entry // block_size, mask=sel != 0, other=-1)
            tl.store(out_ptr + at, blk * block_size + entry % block_size, mask=sel != 0)
        else:
            tl.store(out_ptr + at, entry, mask=sel != 0)
            tl.store(out_key_ptr + at, key.to(tl.int32, bitcast=True), mask=sel != 0)
        count += tl.sum(sel, axis=0)
        seen += tl.sum(eq, axis=0)
    return count


@triton.jit
def _fill(ptr, lo, hi, value, BLOCK: tl.constexpr):
    for i0 in range(lo, hi, BLOCK):
        i = i0 + tl.arange(0, BLOCK)
        tl.store(ptr + i, tl.full([BLOCK], value, tl.int32), mask=i < hi)


@triton.jit
def _count_keys(key_ptr, lo, hi, BLOCK: tl.constexpr):
    n = tl.zeros([], tl.int32)
    for i0 in range(lo, hi, BLOCK):
        i = i0 + tl.arange(0, BLOCK)
        n += tl.sum((tl.load(key_ptr + i, mask=i < hi, other=0) != 0).to(tl.int32), axis=0)
    return n


@triton.jit
def _select(key_ptr, val_ptr, lo, hi, valid, k, out_ptr, out_key_ptr, bt_ptr, req, s_bt, block_size,
            BLOCK: tl.constexpr, HAS_VAL: tl.constexpr, SLOTS: tl.constexpr):
    """The top min(k, valid) keys of key_ptr[lo:hi] (valid: its nonzero keys) written by _emit."""
    want = tl.minimum(valid, k)
    T = tl.zeros([], tl.uint32)  # want == valid: every nonzero key is selected
    take = tl.zeros([], tl.int32)
    if want < valid:
        T, take = _threshold(key_ptr, lo, hi, want, BLOCK)
    return _emit(key_ptr, val_ptr, lo, hi, T, take, out_ptr, out_key_ptr, bt_ptr, req, s_bt, block_size, BLOCK,
                 HAS_VAL, SLOTS)


@triton.jit
def _chunk(pos_ptr, req_ptr, t, ratio, n_entries, P: tl.constexpr, CMIN: tl.constexpr):
    """(request, visible entries, entries per chunk, chunks) of token t: its visible entries cut
    into at most P chunks of a multiple of CMIN entries."""
    req = tl.load(req_ptr + t)
    n_vis = tl.where(req >= 0, tl.minimum((tl.load(pos_ptr + t) + 1) // ratio, n_entries), 0)
    c = tl.maximum(tl.cdiv(tl.cdiv(n_vis, P), CMIN), 1) * CMIN
    return req, n_vis, c, tl.maximum(tl.cdiv(n_vis, c), 1)


@triton.jit(do_not_specialize=["t0", "n_entries"])
def _topk_kernel(q_ptr, w_ptr, pos_ptr, req_ptr, cache_ptr, bt_ptr, idx_ptr, ws_ptr, t0, sq_t, sq_h, sw_t, s_bt, s_idx,
                 n_heads, n_entries, ratio, block_size, k, ckey_at, centry_at, score_at, D: tl.constexpr,
                 HP: tl.constexpr, BN: tl.constexpr, P: tl.constexpr, CMIN: tl.constexpr, BLOCK: tl.constexpr,
                 FMT: tl.constexpr, Q_FP8: tl.constexpr, DOT: tl.constexpr, SOFT: tl.constexpr):
    """Program (token, chunk): score the chunk's entries into the workspace, then select the chunk's
    top k. A token whose entries fit one chunk gets its final row here; otherwise every chunk
    writes its (at most k) candidates, for _merge_kernel."""
    tc = tl.program_id(0).to(tl.int64)
    p = tl.program_id(1)
    t = t0 + tc
    req, n_vis, c, chunks = _chunk(pos_ptr, req_ptr, t, ratio, n_entries, P, CMIN)
    if p < chunks:
        lo = p * c
        hi = tl.minimum(lo + c, n_vis)
        row = ws_ptr + score_at + tc * n_entries
        valid = tl.zeros([], tl.int32)
        for e0 in range(lo, hi, BN):
            key, e, n = _scores(q_ptr, w_ptr, cache_ptr, bt_ptr, t, req, e0, hi, sq_t, sq_h, sw_t, s_bt, n_heads,
                                block_size, D, HP, BN, FMT, Q_FP8, DOT, SOFT)
            tl.store(row + e, key.to(tl.int32, bitcast=True), mask=e < hi)
            valid += n
        tl.debug_barrier()  # the keys stored above are read back by other threads of the program
        if chunks == 1:
            out = idx_ptr + t * s_idx
            n = _select(row, row, lo, hi, valid, k, out, out, bt_ptr, req, s_bt, block_size, BLOCK, False, True)
            _fill(out, n, k, -1, BLOCK)
        else:
            at = (tc * P + p) * k
            n = _select(row, row, lo, hi, valid, k, ws_ptr + centry_at + at, ws_ptr + ckey_at + at, bt_ptr, req,
                        s_bt, block_size, BLOCK, False, False)
            _fill(ws_ptr + ckey_at + at, n, k, 0, BLOCK)


@triton.jit(do_not_specialize=["t0", "n_entries"])
def _merge_kernel(pos_ptr, req_ptr, bt_ptr, idx_ptr, ws_ptr, t0, s_bt, s_idx, n_entries, ratio, block_size, k,
                  ckey_at, centry_at, P: tl.constexpr, CMIN: tl.constexpr, BLOCK: tl.constexpr):
    """The top k of a token's chunk candidates (in chunk order, so entries stay ascending)."""
    tc = tl.program_id(0).to(tl.int64)
    t = t0 + tc
    req, n_vis, c, chunks = _chunk(pos_ptr, req_ptr, t, ratio, n_entries, P, CMIN)
    if chunks > 1:
        at = tc * P * k
        keys = ws_ptr + ckey_at + at
        n = chunks * k
        valid = _count_keys(keys, 0, n, BLOCK)
        out = idx_ptr + t * s_idx
        got = _select(keys, ws_ptr + centry_at + at, 0, n, valid, k, out, out, bt_ptr, req, s_bt, block_size, BLOCK,
                      True, True)
        _fill(out, got, k, -1, BLOCK)


def _dot_kind(q: torch.Tensor, cache: torch.Tensor, fmt: int) -> int:
    if INTERPRET and fmt != FMT_INDEXER:
        return 2
    if fmt == FMT_INDEXER and q.dtype == torch.float8_e4m3fn:
        return 0
    if fmt == 0 and q.dtype == cache.dtype and q.dtype in (torch.bfloat16, torch.float16):
        return 1
    return 2


# A chunk is a multiple of this many entries (of the 64-entry tile too): below it the merge costs
# more than the parallel scoring saves.
CHUNK_MIN = 2048
# Chunks per token at most (batch 1 at 1M context: 64 chunks of 4096 entries).
MAX_CHUNKS = 64
SCAN_BLOCK = 1024


def chunks_per_token(tokens: int) -> int:
    """Chunk programs per token: about two programs per SM over the launch, one for large batches.
    tokens x chunks <= CAND_PROGRAMS, the candidate slots of the workspace."""
    return max(1, min(MAX_CHUNKS, _ws.CAND_PROGRAMS // tokens))


def indexer_topk(q, weights, positions, req_slots, cache, block_table, idx_out, workspace, ratio: int) -> None:
    """Launcher of `dsv4::indexer_topk` (same arguments). No host sync: every size is static."""
    _checks.indexer_topk(q, weights, positions, req_slots, cache, block_table, idx_out, workspace, ratio)
    t, h, d = q.shape
    require(d == INDEXER_DIM, "indexer_topk", "q", f"index_head_dim {INDEXER_DIM} (V4 layout)", d)
    require(h <= 128, "indexer_topk", "q", "at most 128 indexer heads", h)
    k = idx_out.shape[1]
    if t == 0 or k == 0:
        return
    fmt = pool_format(cache, d)
    bs = block_size(cache, fmt)
    n_entries = block_table.shape[1] * bs
    rows = _ws.rows(workspace.numel(), n_entries, k)  # >= 1: checked with the metadata
    hp = max(16, triton.next_power_of_2(h))
    bn = 64 if hp <= 64 else 32
    dot = _dot_kind(q, cache, fmt)
    q_fp8 = q.dtype == torch.float8_e4m3fn
    qa = q.view(torch.uint8) if q_fp8 else q  # e4m3 codes load as bytes (masked lanes read 0)
    ckey_at, centry_at, score_at = 0, _ws.CAND_PROGRAMS * k, 2 * _ws.CAND_PROGRAMS * k
    for t0 in range(0, t, rows):
        n = min(rows, t - t0)
        p = chunks_per_token(n)
        consts = dict(P=p, CMIN=CHUNK_MIN, BLOCK=SCAN_BLOCK)
        launch(_topk_kernel, (n, p),
               (qa, weights, positions, req_slots, cache, block_table, idx_out, workspace, t0, q.stride(0),
                q.stride(1), weights.stride(0), block_table.stride(0), idx_out.stride(0), h, n_entries, ratio, bs, k,
                ckey_at, centry_at, score_at),
               dict(D=d, HP=hp, BN=bn, FMT=fmt, Q_FP8=q_fp8, DOT=dot, SOFT=INTERPRET, **consts), num_warps=4)
        if p > 1:
            launch(_merge_kernel, (n,),
                   (positions, req_slots, block_table, idx_out, workspace, t0, block_table.stride(0),
                    idx_out.stride(0), n_entries, ratio, bs, k, ckey_at, centry_at), consts, num_warps=4)
