"""Triton kernels of the Lightning Indexer ops (indexer/reference.py is the specification).

`indexer_q_prep`: RoPE of the 128-d indexer query, head weights x d^-1/2 x H^-1/2, and for an e4m3
q_out the per-(token, head) UE8M0 scale folded into the weights. Grid (tokens, head blocks).

`indexer_topk`: exact top-k without a sort and without per-entry int64 keys, three launches.
1. `_score_kernel`, grid (tokens, G): a token's visible entries w < (t + 1) // ratio (only these: the
   cost follows the real context, not the block table's width) are scored 64 at a time through the
   block table (132-B FP8 entries: e4m3 x e4m3 tl.dot on the tensor cores with the query held in
   shared memory, the entry's power-of-two scale after it; an unallocated block holds no entry)
   into the workspace as uint32 keys ordered like the scores (-0.0 == +0.0; 0 = no entry).
2. `_select_kernel`, grid (tokens, GC): each chunk of 1024 keys is loaded into registers; a binary
   search over the 32 key bits (each step a count of the keys at or above the candidate) finds the
   k-th largest key T; the keys above T and the lowest-index ones equal to T are written in
   ascending entry order, so exact ties go to the lower entry and the result is bitwise
   deterministic. A one-chunk token gets its row (global slots, -1 fill) here.
3. `_merge_kernel` (rows longer than a chunk): the global cut is at or above every chunk's cut, so
   the chunks' candidates at or above the highest cut are gathered (few: about k) and selected once.
The workspace (an op argument, sized by the cache config; indexer/workspace.py) holds one row per
token of a launch; a step with more tokens runs in several launches.
"""

import torch
import triton
import triton.language as tl

from dsv4ops.indexer import checks as _checks
from dsv4ops.indexer import workspace as _ws
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
def _key_of(score):
    """uint32 key ordered like the fp32 score (-0.0 == +0.0); 0 is never a score's key, so it marks
    "no entry" in the workspace."""
    bits = (score + 0.0).to(tl.int32, bitcast=True)  # -0.0 + 0.0 = +0.0
    return (bits ^ ((bits >> 31) | -2147483648)).to(tl.uint32, bitcast=True)


@triton.jit
def _scores(q, w, cache_ptr, bt_ptr, req, e0, hi, s_bt, block_size, D: tl.constexpr, BN: tl.constexpr,
            FMT: tl.constexpr, Q_FP8: tl.constexpr, DOT: tl.constexpr, SOFT: tl.constexpr):
    """Keys [BN] of entries e0 .. e0 + BN - 1 (< hi) of the token's request, for its query q [HP, D]
    and head weights w [HP]: score = sum_h w_h relu(q_h . k_e); key 0 where the entry is past hi or
    its block is unallocated (-1). Entries are the dot's rows and heads its columns, so the sum over
    heads stays inside each warp (heads as rows would reduce across warps through shared memory)."""
    e = e0 + tl.arange(0, BN)
    vis = e < hi
    blk = tl.load(bt_ptr + req.to(tl.int64) * s_bt + e // block_size, mask=vis, other=-1)
    vis = vis & (blk >= 0)
    slots = blk.to(tl.int64) * block_size + e % block_size
    cols = tl.arange(0, D)
    if DOT == 0:  # e4m3 query x e4m3 keys; the entry's power-of-two scale after the dot (exact)
        blk_at = (slots // block_size) * (block_size * 132)
        off = slots % block_size
        codes = tl.load(cache_ptr + (blk_at + off * 128)[:, None] + cols[None, :], mask=vis[:, None], other=0)
        kscale = tl.load((cache_ptr + blk_at + block_size * 128 + off * 4).to(tl.pointer_type(tl.float32)),
                         mask=vis, other=0.0)
        if SOFT:
            s = tl.dot(e4m3_bits_to_f32(codes, SOFT), tl.trans(e4m3_bits_to_f32(q, SOFT)), input_precision="ieee")
        else:
            s = tl.dot(codes.to(tl.float8e4nv, bitcast=True), tl.trans(q.to(tl.float8e4nv, bitcast=True)))
        s = s * kscale[:, None]
    elif DOT == 1:  # same 16-bit float dtype on both sides
        k = tl.load(cache_ptr + slots[:, None] * D + cols[None, :], mask=vis[:, None], other=0.0)
        s = tl.dot(k, tl.trans(q))
    else:  # fp32 (exact products, as the reference's fp32 einsum)
        k = load_rows(cache_ptr, slots, vis, block_size, BN, D, FMT, SOFT)
        if Q_FP8:
            qf = e4m3_bits_to_f32(q, SOFT)
        else:
            qf = to_f32(q, SOFT)
        s = tl.dot(k, tl.trans(qf), input_precision="ieee")
    s = tl.sum(tl.maximum(s, 0.0) * w[None, :], axis=1)
    return tl.where(vis, _key_of(s), 0), e


@triton.jit
def _visible(pos_ptr, req_ptr, t, ratio, n_entries):
    """(request, visible entries) of token t: (t + 1) // ratio, 0 for padding."""
    req = tl.load(req_ptr + t)
    return req, tl.where(req >= 0, tl.minimum((tl.load(pos_ptr + t) + 1) // ratio, n_entries), 0)


@triton.jit(do_not_specialize=["t0", "n_entries"])
def _score_kernel(q_ptr, w_ptr, pos_ptr, req_ptr, cache_ptr, bt_ptr, ws_ptr, t0, sq_t, sq_h, sw_t, s_bt, n_heads,
                  n_entries, ratio, block_size, row_words, D: tl.constexpr, HP: tl.constexpr, BN: tl.constexpr,
                  G: tl.constexpr, FMT: tl.constexpr, Q_FP8: tl.constexpr, DOT: tl.constexpr, SOFT: tl.constexpr):
    """Program (token, g) scores the token's visible entries in tiles g, g + G, ... (the grid follows
    the batch, the loop the token's real context) into its workspace row as uint32 keys."""
    tc = tl.program_id(0).to(tl.int64)
    t = t0 + tc
    req, n_vis = _visible(pos_ptr, req_ptr, t, ratio, n_entries)
    e_first = tl.program_id(1) * BN
    if e_first < n_vis:
        heads = tl.arange(0, HP)
        hm = heads < n_heads
        q = tl.load(q_ptr + t * sq_t + heads.to(tl.int64)[:, None] * sq_h + tl.arange(0, D)[None, :],
                    mask=hm[:, None], other=0)
        w = tl.load(w_ptr + t * sw_t + heads, mask=hm, other=0.0)
        row = ws_ptr + tc * row_words
        for e0 in range(e_first, n_vis, G * BN):
            key, e = _scores(q, w, cache_ptr, bt_ptr, req, e0, n_vis, s_bt, block_size, D, BN, FMT, Q_FP8, DOT, SOFT)
            tl.store(row + e, key.to(tl.int32, bitcast=True), mask=e < n_vis)


@triton.jit
def _kth_key(key, want):
    """The want-th largest of the uint32 keys [N] (want >= 1, at most the nonzero keys): a binary
    search over the 32 bits of the answer, each step counting the keys at or above the candidate.
    (Two bits a step, three counts in one reduction of a [4, N] broadcast, measured 1.8x slower on
    the H100: the broadcast costs a layout conversion each step.)"""
    T = tl.zeros([], tl.uint32)
    for b in tl.static_range(31, -1, -1):
        cand = T | (tl.full([], 1, tl.uint32) << b)
        T = tl.where(tl.sum((key >= cand).to(tl.int32), axis=0) >= want, cand, T)
    return T


@triton.jit
def _select_block(key, entry, k, out_ptr, out_key_ptr, bt_ptr, req, s_bt, block_size, N: tl.constexpr,
                  SLOTS: tl.constexpr):
    """Write the top min(k, nonzero keys) of key [N] (entries `entry`, ascending), ties to the lower
    entry, in ascending entry order: SLOTS as global pool slots through the block table, else entries
    to out_ptr and keys to out_key_ptr. Returns how many."""
    valid = tl.sum((key != 0).to(tl.int32), axis=0)
    want = tl.minimum(valid, k)
    T = tl.zeros([], tl.uint32)  # want == valid: every nonzero key is selected
    if want < valid:
        T = _kth_key(key, want)
    eq = ((key == T) & (key != 0)).to(tl.int32)
    take = want - tl.sum((key > T).to(tl.int32), axis=0)
    sel = ((key > T) | ((eq != 0) & (tl.cumsum(eq, axis=0) - eq < take))).to(tl.int32)
    at = tl.cumsum(sel, axis=0) - sel
    if SLOTS:
        blk = tl.load(bt_ptr + req.to(tl.int64) * s_bt + entry // block_size, mask=sel != 0, other=-1)
        tl.store(out_ptr + at, blk * block_size + entry % block_size, mask=sel != 0)
    else:
        tl.store(out_ptr + at, entry, mask=sel != 0)
        tl.store(out_key_ptr + at, key.to(tl.int32, bitcast=True), mask=sel != 0)
    return want


@triton.jit
def _fill(ptr, lo, hi, value, BLOCK: tl.constexpr):
    for i0 in range(lo, hi, BLOCK):
        i = i0 + tl.arange(0, BLOCK)
        tl.store(ptr + i, tl.full([BLOCK], value, tl.int32), mask=i < hi)


@triton.jit(do_not_specialize=["t0", "n_entries"])
def _select_kernel(pos_ptr, req_ptr, bt_ptr, idx_ptr, ws_ptr, t0, s_bt, s_idx, n_entries, ratio, block_size, k,
                   row_words, cand_at, CH: tl.constexpr, GC: tl.constexpr):
    """Program (token, g) selects the top k of chunks g, g + GC, ... of CH keys each, held in
    registers. A token with one chunk gets its final row; otherwise each chunk leaves its candidate
    list [count, k entries (ascending), k keys] for _merge_kernel."""
    tc = tl.program_id(0).to(tl.int64)
    t = t0 + tc
    req, n_vis = _visible(pos_ptr, req_ptr, t, ratio, n_entries)
    chunks = tl.maximum(tl.cdiv(n_vis, CH), 1)
    row = ws_ptr + tc * row_words
    for c in range(tl.program_id(1), chunks, GC):
        e = c * CH + tl.arange(0, CH)
        key = tl.load(row + e, mask=e < n_vis, other=0).to(tl.uint32, bitcast=True)
        if chunks == 1:
            out = idx_ptr + t * s_idx
            n = _select_block(key, e, k, out, out, bt_ptr, req, s_bt, block_size, CH, True)
            _fill(out, n, k, -1, 1024)
        else:
            lst = row + cand_at + c * (2 * k + 1)
            tl.store(lst, _select_block(key, e, k, lst + 1, lst + 1 + k, bt_ptr, req, s_bt, block_size, CH, False))


@triton.jit(do_not_specialize=["t0", "n_entries"])
def _merge_kernel(pos_ptr, req_ptr, bt_ptr, idx_ptr, ws_ptr, t0, s_bt, s_idx, n_entries, ratio, block_size, k,
                  row_words, in_at, out_at, level, CH: tl.constexpr, GS: tl.constexpr, MCH: tl.constexpr):
    """One level of a tree of merges: program (token, g) loads the candidate lists g * GS ..
    (g + 1) * GS - 1 of the level's input into one register block (list j at positions j * k ..,
    unused positions key 0) and selects their top k: the token's final row when this level leaves it
    one list, else list g of the next level. Lists stay in chunk order, so entries stay ascending."""
    tc = tl.program_id(0).to(tl.int64)
    t = t0 + tc
    g = tl.program_id(1)
    req, n_vis = _visible(pos_ptr, req_ptr, t, ratio, n_entries)
    lists = tl.cdiv(n_vis, CH)
    for _ in range(level):
        lists = tl.cdiv(lists, GS)
    if (lists > 1) & (g * GS < lists):
        row = ws_ptr + tc * row_words
        p = tl.arange(0, MCH)
        j = g * GS + p // k
        lst = row + in_at + j * (2 * k + 1)
        count = tl.load(lst, mask=(p < GS * k) & (j < lists), other=0)
        ok = (p % k < count) & (p < GS * k)
        key = tl.load(lst + 1 + k + p % k, mask=ok, other=0).to(tl.uint32, bitcast=True)
        entry = tl.load(lst + 1 + p % k, mask=ok, other=0)
        if lists <= GS:
            out = idx_ptr + t * s_idx
            n = _select_block(key, entry, k, out, out, bt_ptr, req, s_bt, block_size, MCH, True)
            _fill(out, n, k, -1, 1024)
        else:
            nxt = row + out_at + g * (2 * k + 1)
            tl.store(nxt, _select_block(key, entry, k, nxt + 1, nxt + 1 + k, bt_ptr, req, s_bt, block_size, MCH,
                                        False))


def _dot_kind(q: torch.Tensor, cache: torch.Tensor, fmt: int) -> int:
    if INTERPRET and fmt != FMT_INDEXER:
        return 2
    if fmt == FMT_INDEXER and q.dtype == torch.float8_e4m3fn:
        return 0
    if fmt == 0 and q.dtype == cache.dtype and q.dtype in (torch.bfloat16, torch.float16):
        return 1
    return 2


# Entries per scoring tile (the dot's rows; 64 heads its columns). Software pipelining of the loop
# (num_stages 3) measured 1.1-2x slower on the H100.
SCORE_BN = 64


def score_programs(tokens: int, tiles: int) -> int:
    """Scoring programs per token: about 16 per SM over the launch (each scores 64 entries at a time
    with its query kept in shared memory), at most one per tile."""
    return max(1, min(tiles, 16 * _ws.SMS // tokens))


def select_programs(tokens: int, chunks: int) -> int:
    """Select programs per token: about two per SM over the launch, at most one per chunk."""
    return max(1, min(chunks, 2 * _ws.SMS // tokens))


def _warps(block: int) -> int:
    """One warp per 1024 keys of a register block, at most 4 (32 keys a thread)."""
    return max(1, min(4, block // 1024))


def indexer_topk(q, weights, positions, req_slots, cache, block_table, cand, idx_out, cand_out, workspace,
                 ratio: int, cand_block: int, fmt: str) -> None:
    """Launcher of `dsv4::indexer_topk` (same arguments). No host sync: every size is static."""
    _checks.indexer_topk(q, weights, positions, req_slots, cache, block_table, cand, idx_out, cand_out, workspace,
                         ratio, cand_block, fmt)
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
    row_words = _ws.row_words(n_entries, k)
    rows = workspace.numel() // row_words  # >= 1: checked with the metadata
    ch = _ws.chunk(n_entries, k)
    hp = max(16, triton.next_power_of_2(h))
    bn = SCORE_BN if hp <= 64 else SCORE_BN // 2
    dot = _dot_kind(q, cache, code)
    q_fp8 = q.dtype == torch.float8_e4m3fn
    qa = q.view(torch.uint8) if q_fp8 else q  # e4m3 codes load as bytes (masked lanes read 0)
    chunks = triton.cdiv(n_entries, ch)
    region_a, region_b, _ = _ws.merge_regions(n_entries, k)
    gs = _ws.merge_group(k)
    mch = triton.next_power_of_2(gs * k)
    for t0 in range(0, t, rows):
        n = min(rows, t - t0)
        g = score_programs(n, triton.cdiv(n_entries, bn))
        launch(_score_kernel, (n, g),
               (qa, weights, positions, req_slots, cache, block_table, workspace, t0, q.stride(0), q.stride(1),
                weights.stride(0), block_table.stride(0), h, n_entries, ratio, bs, row_words),
               dict(D=d, HP=hp, BN=bn, G=g, FMT=code, Q_FP8=q_fp8, DOT=dot, SOFT=INTERPRET), num_warps=4)
        common = (positions, req_slots, block_table, idx_out, workspace, t0, block_table.stride(0), idx_out.stride(0),
                  n_entries, ratio, bs, k, row_words)
        gc = select_programs(n, chunks)
        launch(_select_kernel, (n, gc), common + (region_a,), dict(CH=ch, GC=gc), num_warps=_warps(ch))
        lists, level = chunks, 0
        while lists > 1:  # a tree of merges: each level divides a token's lists by gs
            regions = (region_a, region_b) if level % 2 == 0 else (region_b, region_a)
            launch(_merge_kernel, (n, triton.cdiv(lists, gs)), common + regions + (level,),
                   dict(CH=ch, GS=gs, MCH=mch), num_warps=_warps(mch))
            lists, level = triton.cdiv(lists, gs), level + 1
