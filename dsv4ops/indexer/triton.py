"""Triton kernel of the Lightning Indexer's `indexer_topk` (indexer/reference.py is the specification;
the query and key writers: indexer/triton_prep.py).

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
from dsv4ops.quant import formats
from dsv4ops.quant.reference import INDEXER_DIM
from dsv4ops.quant.triton import (
    FMT_INDEXER,
    block_size,
    e2m1_to_f32,
    fmt_code,
    load_rows,
    not_yet,
    page_offsets,
)
from dsv4ops.triton_helpers import (
    INTERPRET,
    e4m3_bits_to_f32,
    launch,
    pow2,
    require,
    to_f32,
)




@triton.jit
def _key_of(score):
    """uint32 key ordered like the fp32 score (-0.0 == +0.0); 0 is never a score's key, so it marks
    "no entry" in the workspace."""
    bits = (score + 0.0).to(tl.int32, bitcast=True)  # -0.0 + 0.0 = +0.0
    return (bits ^ ((bits >> 31) | -2147483648)).to(tl.uint32, bitcast=True)


@triton.jit
def _mx4_halves(data, sc, R: tl.constexpr, D: tl.constexpr, SOFT: tl.constexpr):
    """Packed MX4 rows (data [R, D // 2] bytes, UE8M0 bytes [R, D // 32]) as their even and odd
    elements, each [R, D // 2] fp32 (exact: an e2m1 value times a power of two)."""
    b = data.to(tl.int32)
    scale = pow2(sc.to(tl.int32) - 127)[:, :, None]  # element 2i and 2i + 1 are in group i // 16
    even = tl.reshape(tl.reshape(e2m1_to_f32(b & 0xF), [R, D // 32, 16]) * scale, [R, D // 2])
    odd = tl.reshape(tl.reshape(e2m1_to_f32(b >> 4), [R, D // 32, 16]) * scale, [R, D // 2])
    return even, odd


@triton.jit
def _mx4_keys_64th(data, sc, R: tl.constexpr, D: tl.constexpr):
    """bf16 even and odd elements of packed MX4 key rows, each 2^-6 of its value: a nibble s.ee.m
    is the e4m3 code s.00ee.m00 of value / 64 (subnormals included), an exact cvt, then one
    multiply by the power-of-two scale; the 64 goes into the scores (see _scores)."""
    b = data.to(tl.int32)
    lo = (((b & 8) << 4) | ((b & 7) << 2)).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.bfloat16)
    hi = ((b & 0x80) | ((b & 0x70) >> 2)).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.bfloat16)
    scale = (sc.to(tl.int16) << 7).to(tl.bfloat16, bitcast=True)[:, :, None]  # UE8M0 byte -> bf16 2^(e - 127)
    even = tl.reshape(tl.reshape(lo, [R, D // 32, 16]) * scale, [R, D // 2])
    odd = tl.reshape(tl.reshape(hi, [R, D // 32, 16]) * scale, [R, D // 2])
    return even, odd


@triton.jit
def _scores(q, q_odd, w, cache_ptr, bt_ptr, cand_row, req, c0, hi, n_vis, s_bt, block_size, cb, D: tl.constexpr,
            BN: tl.constexpr, FMT: tl.constexpr, Q_FP8: tl.constexpr, DOT: tl.constexpr, CAND: tl.constexpr,
            SOFT: tl.constexpr):
    """Keys [BN] of columns c0 .. c0 + BN - 1 (< hi) of the token's row, for its query q [HP, D]
    (MX4: its even elements, q_odd the odd ones) and head weights w [HP]: score = sum_h w_h
    relu(q_h . k_e) of the column's entry e (CAND: entry cand[c // cb] * cb + c % cb, visible if
    < n_vis); key 0 where the column has no visible entry or its block is unallocated (-1).
    Entries are the dot's rows and heads its columns, so the sum over heads stays inside each warp
    (heads as rows would reduce across warps through shared memory)."""
    c = c0 + tl.arange(0, BN)
    vis = c < hi
    if CAND:
        cblk = tl.load(cand_row + c // cb, mask=vis, other=-1)
        e = cblk * cb + c % cb
        vis = vis & (cblk >= 0) & (e < n_vis)
    else:
        e = c
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
    elif DOT == 3:  # MX4 query x mxfp4_68 keys, as even / odd halves (the two nibbles of a byte)
        data_at, scale_at = page_offsets(slots, block_size, 64, 4, 512)
        data = tl.load(cache_ptr + data_at[:, None] + tl.arange(0, D // 2)[None, :], mask=vis[:, None], other=0)
        sc = tl.load(cache_ptr + scale_at[:, None] + tl.arange(0, D // 32)[None, :], mask=vis[:, None], other=127)
        if SOFT:
            k_even, k_odd = _mx4_halves(data, sc, BN, D, SOFT)
            s = tl.dot(k_even, tl.trans(q), input_precision="ieee")
            s = tl.dot(k_odd, tl.trans(q_odd), s, input_precision="ieee")
        else:
            k_even, k_odd = _mx4_keys_64th(data, sc, BN, D)
            s = tl.dot(k_even, tl.trans(q))
            s = tl.dot(k_odd, tl.trans(q_odd), s) * 64.0  # exact: products of <= 2-bit mantissas, pow2 factor
    else:  # fp32 (exact products, as the reference's fp32 einsum)
        k = load_rows(cache_ptr, slots, vis, block_size, BN, D, FMT, SOFT)
        if Q_FP8:
            qf = e4m3_bits_to_f32(q, SOFT)
        else:
            qf = to_f32(q, SOFT)
        s = tl.dot(k, tl.trans(qf), input_precision="ieee")
    s = tl.sum(tl.maximum(s, 0.0) * w[None, :], axis=1)
    return tl.where(vis, _key_of(s), 0)


@triton.jit
def _row_len(pos_ptr, req_ptr, cand_ptr, t, s_cand, n_cand, ratio, n_entries, cb, MODE: tl.constexpr,
             NC: tl.constexpr):
    """(request, visible entries, columns of the token's row): MODE 0 the entries w < (t + 1) //
    ratio, 1 the candidate columns (listed blocks x cb; blocks ascending, -1 after them), 2 the
    candidate blocks over the visible entries; 0 for padding."""
    req = tl.load(req_ptr + t)
    n_vis = tl.where(req >= 0, tl.minimum((tl.load(pos_ptr + t) + 1) // ratio, n_entries), 0)
    if MODE == 1:
        j = tl.arange(0, NC)
        listed = tl.load(cand_ptr + t * s_cand + j, mask=j < n_cand, other=-1) >= 0
        n = tl.where(req >= 0, tl.sum(listed.to(tl.int32), axis=0) * cb, 0)
    elif MODE == 2:
        n = tl.cdiv(n_vis, cb)
    else:
        n = n_vis
    return req, n_vis, n


@triton.jit(do_not_specialize=["t0", "n_entries"])
def _score_kernel(q_ptr, w_ptr, pos_ptr, req_ptr, cache_ptr, bt_ptr, cand_ptr, ws_ptr, t0, sq_t, sq_h, sw_t, s_bt,
                  s_cand, n_cand, cb, n_heads, n_entries, ratio, block_size, row_words, D: tl.constexpr,
                  HP: tl.constexpr, BN: tl.constexpr, G: tl.constexpr, FMT: tl.constexpr, Q_FP8: tl.constexpr,
                  DOT: tl.constexpr, CAND: tl.constexpr, NC: tl.constexpr, STAGES: tl.constexpr,
                  SOFT: tl.constexpr):
    """Program (token, g) scores the token's columns in tiles g, g + G, ... (the grid follows the
    batch, the loop the token's real context, or its candidates) into its workspace row as uint32
    keys."""
    tc = tl.program_id(0).to(tl.int64)
    t = t0 + tc
    req, n_vis, n = _row_len(pos_ptr, req_ptr, cand_ptr, t, s_cand, n_cand, ratio, n_entries, cb, CAND, NC)
    c_first = tl.program_id(1) * BN
    if c_first < n:
        heads = tl.arange(0, HP)
        hm = heads < n_heads
        q_row = q_ptr + t * sq_t + heads.to(tl.int64)[:, None] * sq_h
        if DOT == 3:  # the packed MX4 query, decoded once: its even and odd elements
            data = tl.load(q_row + tl.arange(0, D // 2)[None, :], mask=hm[:, None], other=0)
            sc = tl.load(q_row + D // 2 + tl.arange(0, D // 32)[None, :], mask=hm[:, None], other=127)
            q, q_odd = _mx4_halves(data, sc, HP, D, SOFT)
            if not SOFT:
                q = q.to(tl.bfloat16)
                q_odd = q_odd.to(tl.bfloat16)
        else:
            q = tl.load(q_row + tl.arange(0, D)[None, :], mask=hm[:, None], other=0)
            q_odd = q
        w = tl.load(w_ptr + t * sw_t + heads, mask=hm, other=0.0)
        row = ws_ptr + tc * row_words
        cand_row = cand_ptr + t * s_cand
        for c0 in tl.range(c_first, n, G * BN, num_stages=STAGES):
            key = _scores(q, q_odd, w, cache_ptr, bt_ptr, cand_row, req, c0, n, n_vis, s_bt, block_size, cb, D, BN,
                          FMT, Q_FP8, DOT, CAND, SOFT)
            c = c0 + tl.arange(0, BN)
            tl.store(row + c, key.to(tl.int32, bitcast=True), mask=c < n)


@triton.jit(do_not_specialize=["t0", "n_entries"])
def _block_keys_kernel(pos_ptr, req_ptr, ws_ptr, t0, n_entries, ratio, cb, row_words, block_at, CB: tl.constexpr,
                       BB: tl.constexpr, G: tl.constexpr):
    """V4.1 candidate source, program (token, g): the key of candidate block b is the max of its
    entries' keys (the keys order like the scores; 0 = no visible entry), the newest visible
    entry's block gets the largest key (forced in); written after the entry row at block_at."""
    tc = tl.program_id(0).to(tl.int64)
    t = t0 + tc
    req = tl.load(req_ptr + t)
    n_vis = tl.where(req >= 0, tl.minimum((tl.load(pos_ptr + t) + 1) // ratio, n_entries), 0)
    n_blk = tl.cdiv(n_vis, cb)
    row = ws_ptr + tc * row_words
    for b0 in range(tl.program_id(1) * BB, n_blk, G * BB):
        b = b0 + tl.arange(0, BB)
        j = tl.arange(0, CB)
        e = b[:, None] * cb + j[None, :]
        keys = tl.load(row + e, mask=(j[None, :] < cb) & (e < n_vis), other=0).to(tl.uint32, bitcast=True)
        bkey = tl.max(keys, axis=1)
        bkey = tl.where(b == (n_vis - 1) // cb, tl.full([BB], 0xFFFFFFFF, tl.uint32), bkey)
        tl.store(row + block_at + b, bkey.to(tl.int32, bitcast=True), mask=b < n_blk)


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
def _select_block(key, col, k, out_ptr, out_key_ptr, bt_ptr, cand_row, req, s_bt, block_size, cb, N: tl.constexpr,
                  OUT: tl.constexpr):
    """Write the top min(k, nonzero keys) of key [N] (columns `col`, ascending), ties to the lower
    column, in ascending column order. OUT: -1 a candidate list (columns to out_ptr, keys to
    out_key_ptr); 0 global pool slots of entries = columns; 1 of entries cand[c // cb] * cb +
    c % cb; 2 the columns themselves (candidate blocks). Returns how many."""
    valid = tl.sum((key != 0).to(tl.int32), axis=0)
    want = tl.minimum(valid, k)
    T = tl.zeros([], tl.uint32)  # want == valid: every nonzero key is selected
    if want < valid:
        T = _kth_key(key, want)
    eq = ((key == T) & (key != 0)).to(tl.int32)
    take = want - tl.sum((key > T).to(tl.int32), axis=0)
    sel = ((key > T) | ((eq != 0) & (tl.cumsum(eq, axis=0) - eq < take))).to(tl.int32)
    at = tl.cumsum(sel, axis=0) - sel
    if OUT == -1:
        tl.store(out_ptr + at, col, mask=sel != 0)
        tl.store(out_key_ptr + at, key.to(tl.int32, bitcast=True), mask=sel != 0)
    elif OUT == 2:
        tl.store(out_ptr + at, col, mask=sel != 0)
    else:
        entry = col
        if OUT == 1:
            entry = tl.load(cand_row + col // cb, mask=sel != 0, other=0) * cb + col % cb
        blk = tl.load(bt_ptr + req.to(tl.int64) * s_bt + entry // block_size, mask=sel != 0, other=-1)
        tl.store(out_ptr + at, blk * block_size + entry % block_size, mask=sel != 0)
    return want


@triton.jit
def _emit(key, col, k, final, out, lst, bt_ptr, cand_row, req, s_bt, block_size, cb, N: tl.constexpr,
          MODE: tl.constexpr):
    """The top k of key [N]: with `final`, the token's row at out (as _select_block's OUT = MODE, -1
    filled to k); else a candidate list [count, k columns, k keys] at lst for the next merge."""
    if final:
        got = _select_block(key, col, k, out, out, bt_ptr, cand_row, req, s_bt, block_size, cb, N, MODE)
        _fill(out, got, k, -1, 1024)
    else:
        tl.store(lst, _select_block(key, col, k, lst + 1, lst + 1 + k, bt_ptr, cand_row, req, s_bt, block_size, cb,
                                    N, -1))


@triton.jit
def _fill(ptr, lo, hi, value, BLOCK: tl.constexpr):
    for i0 in range(lo, hi, BLOCK):
        i = i0 + tl.arange(0, BLOCK)
        tl.store(ptr + i, tl.full([BLOCK], value, tl.int32), mask=i < hi)


@triton.jit(do_not_specialize=["t0", "n_entries"])
def _select_kernel(pos_ptr, req_ptr, bt_ptr, cand_ptr, out_ptr, ws_ptr, t0, s_bt, s_cand, n_cand, cb, s_out, n_entries,
                   ratio, block_size, k, row_words, keys_at, cand_at, CH: tl.constexpr, GC: tl.constexpr,
                   MODE: tl.constexpr, NC: tl.constexpr):
    """Program (token, g) selects the top k of chunks g, g + GC, ... of CH keys each (the row's
    keys start at keys_at), held in registers. A token with one chunk gets its final row (MODE:
    see _row_len; the output as _select_block's OUT = MODE); otherwise each chunk leaves its
    candidate list [count, k columns (ascending), k keys] at cand_at for _merge_kernel."""
    tc = tl.program_id(0).to(tl.int64)
    t = t0 + tc
    req, n_vis, n = _row_len(pos_ptr, req_ptr, cand_ptr, t, s_cand, n_cand, ratio, n_entries, cb, MODE, NC)
    chunks = tl.maximum(tl.cdiv(n, CH), 1)
    row = ws_ptr + tc * row_words
    for c in range(tl.program_id(1), chunks, GC):
        col = c * CH + tl.arange(0, CH)
        key = tl.load(row + keys_at + col, mask=col < n, other=0).to(tl.uint32, bitcast=True)
        _emit(key, col, k, chunks == 1, out_ptr + t * s_out, row + cand_at + c * (2 * k + 1), bt_ptr,
              cand_ptr + t * s_cand, req, s_bt, block_size, cb, CH, MODE)


@triton.jit(do_not_specialize=["t0", "n_entries"])
def _merge_kernel(pos_ptr, req_ptr, bt_ptr, cand_ptr, out_ptr, ws_ptr, t0, s_bt, s_cand, n_cand, cb, s_out, n_entries,
                  ratio, block_size, k, row_words, in_at, out_at, level, CH: tl.constexpr, GS: tl.constexpr,
                  MCH: tl.constexpr, MODE: tl.constexpr, NC: tl.constexpr):
    """One level of a tree of merges: program (token, g) loads the candidate lists g * GS ..
    (g + 1) * GS - 1 of the level's input into one register block (list j at positions j * k ..,
    unused positions key 0) and selects their top k: the token's final row when this level leaves it
    one list, else list g of the next level. Lists stay in chunk order, so columns stay ascending."""
    tc = tl.program_id(0).to(tl.int64)
    t = t0 + tc
    g = tl.program_id(1)
    req, n_vis, n = _row_len(pos_ptr, req_ptr, cand_ptr, t, s_cand, n_cand, ratio, n_entries, cb, MODE, NC)
    lists = tl.cdiv(n, CH)
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
        col = tl.load(lst + 1 + p % k, mask=ok, other=0)
        _emit(key, col, k, lists <= GS, out_ptr + t * s_out, row + out_at + g * (2 * k + 1), bt_ptr,
              cand_ptr + t * s_cand, req, s_bt, block_size, cb, MCH, MODE)


def _dot_kind(q: torch.Tensor, cache: torch.Tensor, fmt: int) -> int:
    if q.dtype == torch.uint8:
        return 3
    if INTERPRET and fmt != FMT_INDEXER:
        return 2
    if fmt == FMT_INDEXER and q.dtype == torch.float8_e4m3fn:
        return 0
    if fmt == 0 and q.dtype == cache.dtype and q.dtype in (torch.bfloat16, torch.float16):
        return 1
    return 2


# Score tiles of 64 entries (the dot's rows; 64 heads its columns) on 4 warps, the tile loop not
# software-pipelined. H100, graph-timed indexer_topk (V4-Flash, 8 programs per SM): 128-entry tiles
# or 8 warps took 4-17% longer at 128 x 64K, 32 x 64K and 1 x 1M; 2-4 pipeline stages (a plain
# `range` got the launch default, 3) 30.1-32.3 us at 128 x 4K against 22.2 with one, 14.3-14.8
# against 12.3 at 1 x 4K, and no faster at 64K or 1M: the gathered 132-B rows are too small for
# cp.async stages to pay.
SCORE_BN = 64
SCORE_WARPS = 4
SCORE_STAGES = 1


def score_programs(tokens: int, tiles: int) -> int:
    """Scoring programs per token: about 8 per SM over the launch (each scores 64 entries at a time
    with its query kept in shared memory), at most one per tile. H100, whole indexer_topk, 8 vs 16
    per SM: 28.4 vs 34.3 us at 128 x 4K, 119.2 vs 122.9 at 32 x 64K, 113.4 vs 120.6 at 1 x 1M, equal
    at 1 x 4K and 128 x 64K (32 per SM: no better anywhere); index sets identical."""
    return max(1, min(tiles, 8 * _ws.SMS // tokens))


def select_programs(tokens: int, chunks: int) -> int:
    """Select programs per token: about two per SM over the launch, at most one per chunk."""
    return max(1, min(chunks, 2 * _ws.SMS // tokens))


def _warps(block: int) -> int:
    """One warp per 256 keys of a register block, at most 8 (8 keys a thread): the select's bit-by-bit
    search is a chain of reductions, so keys a thread set its latency. H100, V4-Flash CSA, graph-timed
    indexer_topk, against one warp per 1024 keys (at most 4): 1 x 4K 13.8 us (20.2), 128 x 4K 33.9
    (41.2), 128 x 64K 296 (380), 1 x 1M 119 (180); 4 warps per 1024 keys at most 16: 350 at 128 x 64K."""
    return max(1, min(8, block // 256))


def indexer_topk(q, weights, positions, req_slots, cache, block_table, cand, idx_out, cand_out, workspace,
                 ratio: int, cand_block: int, fmt: str, select=None, score=None) -> None:
    """Launcher of `dsv4::indexer_topk` (same arguments). No host sync: every size is static.
    `select`: the launches of the selection (`select_tree`'s arguments; default `select_tree`);
    `score`: another scoring kernel, called as score(q, weights, positions, req_slots, cache,
    block_table, cand, workspace, fmt, t0, tokens, n_row, row_words, n_entries, ratio, block_size,
    cand_block, mode) before each launch's scoring; it returns False where it does not serve the
    arguments (then `_score_kernel` runs)."""
    select = select or select_tree
    _checks.indexer_topk(q, weights, positions, req_slots, cache, block_table, cand, idx_out, cand_out, workspace,
                         ratio, cand_block, fmt)
    code = fmt_code("indexer_topk", "fmt", fmt)
    mx4 = q.dtype == torch.uint8
    if mx4 != (fmt == "mxfp4_68"):
        not_yet("indexer_topk", f"q of dtype {q.dtype} with fmt={fmt!r} (MX4 queries go with mxfp4_68 keys)")
    t, h = q.shape[:2]
    d = formats.FORMATS[fmt].dim if mx4 else q.shape[2]
    require(d == INDEXER_DIM, "indexer_topk", "q", f"index_head_dim {INDEXER_DIM} (V4 layout)", d)
    require(h <= 128, "indexer_topk", "q", "at most 128 indexer heads", h)
    k = idx_out.shape[1]
    if t == 0 or k == 0:
        return
    bs = block_size(cache, fmt)
    n_entries = block_table.shape[1] * bs
    cb = max(cand_block, 1)
    n_cand = cand.shape[1] if cand is not None else 0
    keep = cand_out.shape[1] if cand_out is not None else 0
    n_row, block_at, n_blocks, row_words = _ws.layout(n_entries, k, n_cand * cb, keep, cb)
    rows = workspace.numel() // row_words  # >= 1: checked with the metadata
    hp = max(16, triton.next_power_of_2(h))
    bn = SCORE_BN if hp <= 64 else SCORE_BN // 2
    dot = _dot_kind(q, cache, code)
    q_fp8 = q.dtype == torch.float8_e4m3fn
    qa = q.view(torch.uint8) if q_fp8 else q  # e4m3 codes load as bytes (masked lanes read 0)
    cand_t = cand if cand is not None else block_table  # an unused pointer when there is no cand
    s_cand = cand.stride(0) if cand is not None else 0
    nc = triton.next_power_of_2(max(n_cand, 1))
    mode = 1 if cand is not None else 0
    for t0 in range(0, t, rows):
        n = min(rows, t - t0)
        g = score_programs(n, triton.cdiv(n_row, bn))
        served = score is not None and score(q, weights, positions, req_slots, cache, block_table, cand_t, workspace,
                                             fmt, t0, n, n_row, row_words, n_entries, ratio, bs, cb, mode)
        if not served:
            launch(_score_kernel, (n, g),
                   (qa, weights, positions, req_slots, cache, block_table, cand_t, workspace, t0, q.stride(0),
                    q.stride(1), weights.stride(0), block_table.stride(0), s_cand, n_cand, cb, h, n_entries, ratio,
                    bs, row_words),
                   dict(D=d, HP=hp, BN=bn, G=g, FMT=code, Q_FP8=q_fp8, DOT=dot, CAND=mode, NC=nc,
                        STAGES=SCORE_STAGES, SOFT=INTERPRET), num_warps=SCORE_WARPS)
        common = (positions, req_slots, block_table, cand_t, idx_out, workspace, t0, block_table.stride(0), s_cand,
                  n_cand, cb, idx_out.stride(0), n_entries, ratio, bs, row_words)
        select(n, n_row, k, 0, common, mode, nc)
        if cand_out is not None:
            bb = 128
            gb = max(1, min(triton.cdiv(n_blocks, bb), 4 * _ws.SMS // n))
            launch(_block_keys_kernel, (n, gb), (positions, req_slots, workspace, t0, n_entries, ratio, cb,
                                                 row_words, block_at),
                   dict(CB=triton.next_power_of_2(cb), BB=bb, G=gb), num_warps=4)
            common = (positions, req_slots, block_table, cand_t, cand_out, workspace, t0, block_table.stride(0),
                      s_cand, n_cand, cb, cand_out.stride(0), n_entries, ratio, bs, row_words)
            select(n, n_blocks, keep, block_at, common, 2, nc)


def select_tree(n: int, n_row: int, k: int, keys_at: int, common: tuple, mode: int, nc: int):
    """Launches selecting the top k of each token's row of n_row columns (its keys at keys_at of
    the workspace row; MODE and the output as _select_kernel): the chunks, then a tree of merges
    while a token has more than one list (workspace.merge_levels)."""
    ch = _ws.chunk(n_row, k)
    region_a = _ws.merge_regions(n_row, k)[0] + keys_at
    gs = _ws.merge_group(k)
    mch = triton.next_power_of_2(gs * k)
    head = common[:-1] + (k, common[-1])  # ..., n_entries, ratio, block_size, k, row_words
    gc = select_programs(n, triton.cdiv(n_row, ch))
    launch(_select_kernel, (n, gc), head + (keys_at, region_a), dict(CH=ch, GC=gc, MODE=mode, NC=nc),
           num_warps=_warps(ch))
    for level, (a, b, programs) in enumerate(_ws.merge_levels(n_row, k)):
        launch(_merge_kernel, (n, programs), head + (a + keys_at, b + keys_at, level),
               dict(CH=ch, GS=gs, MCH=mch, MODE=mode, NC=nc), num_warps=_warps(mch))
