"""Triton kernels of `dsv4::sparse_attn` (sparse_attn/reference.py is the specification), decode and
prefill alike.

Split-KV MQA. A token's keys are one list: its window (positions t - window + 1 .. t of its
request's ring), then its compressed entries comp_idx[t, :comp_lens[t]] (-1 = none). K = V is one
shared 512-d head, so a program holds q [HB heads, 512] and streams key tiles [BK, 512] of one
split of that list: every key is read once for all HB heads. Grid (tokens, head blocks, splits).

- Byte entries are dequantized in bf16 arithmetic, which is exact: e4m3 and e2m1 -> bf16 are
  exact, the UE8M0 scales are powers of two (the bf16 with exponent field = the scale byte) and an
  e4m3 scale times an e2m1 value has <= 5 significant bits, so a tile never exists in fp32
  registers (an fp32 [64, 512] tile alone is 128 registers per thread at 8 warps). Float pools are
  converted to q's dtype, as the reference's key copy.
- V4 (fp8_584) tiles are [512 dims with the rope dims zeroed | 64 bf16 rope dims]; V4.1 (fp8_528
  window, fp4_288 compressed) tiles, and V4's fp8_584 window beside fp4_288 entries (its FP4 cache
  option), are [even dims | odd dims], the split an fp4 byte gives for free (its two nibbles); q,
  the accumulators and the output follow the tiles' split.
- S = q k^T and O += P k on the tensor cores in q's dtype, fp32 accumulation, P cast to q's dtype
  (DeepSeek's kernel); online softmax in fp32 (exp2).
- One split: the sink opens the online softmax (running max s_h, sum e^0 = 1, no value), which is
  exactly its term in the denominator; the output is written directly. Several splits (few tokens:
  a decode batch that would leave SMs idle): each writes its normalized partial output and log2-sum
  to a workspace, and `_combine_kernel` merges them with the sink. The workspace is allocated per
  call from static sizes only (tokens, heads, splits), so the op stays CUDA-graph safe.
- Tiles with no valid key are skipped; tiles past comp_lens are never visited, so the cost follows
  each token's real key count, not the width of comp_idx. Padding tokens (request -1) write zeros.
- With `lse` (a context-parallel shard, SINK False): no sink anywhere; the output is normalized by
  the keys' own sum and lse gets its natural log (-inf, zero row: no key), after the combine when
  the list is split.
"""

import math

import torch
import triton
import triton.language as tl

from dsv4ops.quant.formats import EXACT
from dsv4ops.quant.reference import MAIN_DIM, MAIN_ROPE
from dsv4ops.quant.triton import block_size, fmt_code, load_rows, main_offsets, not_yet, page_offsets
from dsv4ops.sparse_attn import checks as _checks
from dsv4ops.triton_helpers import INTERPRET, dot, launch, require, round_to, to_f32

# SM count of an H100 SXM: splits are chosen to give about two programs per SM.
_SMS = 132
_V41 = ("fp8_528", "fp4_288")  # formats read as even / odd column halves


@triton.jit
def _fp8_584_nope(pool_ptr, data_at, scale_at, valid):
    """The 448 e4m3 dims of fp8_584 rows (byte offsets data_at, scale_at) in bf16 as [BK, 8, 64]:
    seven 64-dim scale blocks, the eighth (the rope dims' place) zero. Rows with valid False are 0."""
    blk = tl.arange(0, 8)[None, :, None]
    c64 = tl.arange(0, 64)[None, None, :]
    codes = tl.load(pool_ptr + data_at[:, None, None] + blk * 64 + c64, mask=valid[:, None, None] & (blk < 7),
                    other=0)
    b8 = tl.arange(0, 8)[None, :]
    sc = tl.load(pool_ptr + scale_at[:, None] + b8, mask=valid[:, None] & (b8 < 7), other=127)
    # UE8M0 byte e -> the bf16 2^(e - 127): e in the exponent field, zero mantissa. (Integer and
    # fp32 bit tricks instead of the e4m3 -> bf16 conversion measured 20% slower on the H100.)
    scale = (sc.to(tl.int16) << 7).to(tl.bfloat16, bitcast=True)
    return codes.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16) * scale[:, :, None]


@triton.jit
def _load_keys(pool_ptr, slots, valid, bs, BK: tl.constexpr, D: tl.constexpr, R: tl.constexpr, FMT: tl.constexpr,
               KDT: tl.constexpr, SOFT: tl.constexpr):
    """Key tile of `slots` in KDT as two tensors: k [BK, D] with its trailing R (rope) dims zeroed,
    and rope [BK, R]. Rows with valid False are 0 and read nothing. Building one [BK, D] tile from
    the e4m3 and the bf16 parts would hold both at full width in registers, next to an
    accumulator that already takes 128 registers a thread."""
    cols = tl.arange(0, R)[None, :]
    if FMT == 1:
        data_at, scale_at = main_offsets(slots, bs)
        data_at = tl.multiple_of(data_at, 16)
        rope_ptr = (pool_ptr + data_at + 448).to(tl.pointer_type(tl.bfloat16))
        rope = round_to(to_f32(tl.load(rope_ptr[:, None] + cols, mask=valid[:, None], other=0.0), SOFT), KDT, SOFT)
    else:
        rope_at = slots[:, None] * D + (D - R) + cols
        rope = round_to(to_f32(tl.load(pool_ptr + rope_at, mask=valid[:, None], other=0.0), SOFT), KDT, SOFT)
    if FMT == 1 and KDT == tl.bfloat16 and not SOFT:
        k = tl.reshape(_fp8_584_nope(pool_ptr, data_at, scale_at, valid), [BK, D])
    else:
        rows = load_rows(pool_ptr, slots, valid, bs, BK, D, FMT, SOFT)
        k = round_to(tl.where(tl.arange(0, D)[None, :] < D - R, rows, 0.0), KDT, SOFT)
    return k, rope


@triton.jit
def _load_keys_eo(pool_ptr, slots, valid, bs, BK: tl.constexpr, D: tl.constexpr, FMT: tl.constexpr,
                  KDT: tl.constexpr, SOFT: tl.constexpr):
    """Key tile of `slots` (V4.1 formats, V4's 584-B window rows beside fp4_288 entries, or exact
    rows beside one) in KDT as its even and odd columns, each [BK, D // 2]: fp4_288 bytes hold elements 2i and 2i + 1 in their low and high
    nibbles, so the halves come out of a byte without moving data across threads; q, the
    accumulator and the output use the same split. Rows with valid False are 0."""
    H: tl.constexpr = D // 2
    if FMT == 4 and KDT == tl.bfloat16 and not SOFT:
        data_at, scale_at = page_offsets(slots, bs, 256, 32, 256)
        cols = tl.arange(0, H)[None, :]
        b = tl.load(pool_ptr + tl.multiple_of(data_at, 16)[:, None] + cols, mask=valid[:, None], other=0).to(tl.int32)
        g = tl.arange(0, 32)[None, :]
        sc = tl.load(pool_ptr + scale_at[:, None] + g, mask=valid[:, None], other=0)
        # e2m1 s.ee.m as the e4m3 code s.00ee.m00 is the value x 2^-6 (subnormals included): an
        # exact cvt to bf16, the 2^6 folded into the e4m3 scale (bf16 products of <= 5 significant
        # bits: exact). A NaN scale (code 0x7F) reads back NaN, as the reference.
        scale = (sc.to(tl.float8e4nv, bitcast=True).to(tl.float32) * 64.0).to(tl.bfloat16)
        lo = (((b & 8) << 4) | ((b & 7) << 2)).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.bfloat16)
        hi = (((b & 0x80)) | ((b & 0x70) >> 2)).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.bfloat16)
        k_even = tl.reshape(tl.reshape(lo, [BK, 32, 8]) * scale[:, :, None], [BK, H])
        k_odd = tl.reshape(tl.reshape(hi, [BK, 32, 8]) * scale[:, :, None], [BK, H])
    elif FMT == 3 and KDT == tl.bfloat16 and not SOFT:
        data_at, scale_at = page_offsets(slots, bs, 512, 16, 512)
        cols = tl.arange(0, D)[None, :]
        codes = tl.load(pool_ptr + tl.multiple_of(data_at, 16)[:, None] + cols, mask=valid[:, None], other=0)
        g = tl.arange(0, 16)[None, :]
        sc = tl.load(pool_ptr + scale_at[:, None] + g, mask=valid[:, None], other=127)
        scale = (sc.to(tl.int16) << 7).to(tl.bfloat16, bitcast=True)  # UE8M0 byte -> bf16 2^(e - 127)
        c_even, c_odd = tl.split(tl.reshape(codes, [BK, H, 2]))
        # Elements 2i and 2i + 1 share the scale of group 2i // 32 = i // 16.
        k_even = tl.reshape(tl.reshape(c_even.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16), [BK, 16, 16])
                            * scale[:, :, None], [BK, H])
        k_odd = tl.reshape(tl.reshape(c_odd.to(tl.float8e4nv, bitcast=True).to(tl.bfloat16), [BK, 16, 16])
                           * scale[:, :, None], [BK, H])
    elif FMT == 1 and KDT == tl.bfloat16 and not SOFT:  # V4's 584-B window rows beside fp4_288 entries
        data_at, scale_at = main_offsets(slots, bs)
        data_at = tl.multiple_of(data_at, 16)
        nope = _fp8_584_nope(pool_ptr, data_at, scale_at, valid)
        blk = tl.arange(0, 8)[None, :, None]
        c64 = tl.arange(0, 64)[None, None, :]
        rope_ptr = (pool_ptr + data_at + 448).to(tl.pointer_type(tl.bfloat16))
        rope = tl.load(rope_ptr[:, None, None] + c64 + blk * 0, mask=valid[:, None, None] & (blk == 7), other=0.0)
        k_even, k_odd = tl.split(tl.reshape(tl.where(blk < 7, nope, rope), [BK, H, 2]))
    else:
        rows = round_to(load_rows(pool_ptr, slots, valid, bs, BK, D, FMT, SOFT), KDT, SOFT)
        k_even, k_odd = tl.split(tl.reshape(rows, [BK, H, 2]))
    return k_even, k_odd


@triton.jit
def _attend_tile(q_a, q_b, k_a, k_b, valid, m_i, l_i, acc_a, acc_b, qk_scale, SOFT: tl.constexpr):
    """One online-softmax step over a key tile given as two column parts (k_a [BK, DA], k_b
    [BK, DB]; see the kernel) for q's parts q_a [HB, DA], q_b [HB, DB]: S = q_a k_a^T + q_b k_b^T,
    acc_a += P k_a, acc_b += P k_b."""
    s = dot(q_a, tl.trans(k_a), tl.zeros([q_a.shape[0], k_a.shape[0]], tl.float32), SOFT)
    s = dot(q_b, tl.trans(k_b), s, SOFT)
    s = tl.where(valid[None, :], s * qk_scale, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    # m_new is -inf only while no key and no sink has been seen (a split's first empty tiles).
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    p = p.to(k_a.dtype)  # P in the keys' dtype for P V, as DeepSeek's kernel
    acc_a = dot(p, k_a, acc_a * alpha[:, None], SOFT)
    acc_b = dot(p, k_b, acc_b * alpha[:, None], SOFT)
    return m_new, l_i, acc_a, acc_b


@triton.jit(do_not_specialize=["n_heads", "n_idx"])
def _sparse_attn_kernel(q_ptr, wc_ptr, cc_ptr, pos_ptr, req_ptr, idx_ptr, len_ptr, sink_ptr, out_ptr, part_ptr,
                        lse_ptr, lse_out_ptr, sq_t, sq_h, si_t, so_t, so_h, n_heads, n_idx, qk_scale, window,
                        ring_size, w_bs, c_bs, D: tl.constexpr, R: tl.constexpr, HB: tl.constexpr, BK: tl.constexpr,
                        SPLIT_KEYS: tl.constexpr, SPLITS: tl.constexpr, WIN: tl.constexpr, STAGES: tl.constexpr,
                        W_FMT: tl.constexpr, C_FMT: tl.constexpr, EVEN_ODD: tl.constexpr, SINK: tl.constexpr,
                        SOFT: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * HB + tl.arange(0, HB)
    split = tl.program_id(2)
    hm = heads < n_heads
    h64 = heads.to(tl.int64)
    cols = tl.arange(0, D)
    # The head dim in two parts A and B, the same for q, the key tiles and the accumulators. V4:
    # A = the 512 dims (k's rope dims zeroed), B = the 64 rope dims (bf16 in the 584-B entry).
    # V4.1 (EVEN_ODD): A = the even dims, B = the odd dims (the two nibbles of an fp4_288 byte).
    if EVEN_ODD:
        DA: tl.constexpr = D // 2
        DB: tl.constexpr = D // 2
    else:
        DA: tl.constexpr = D
        DB: tl.constexpr = R
    req = tl.load(req_ptr + t)
    kdt: tl.constexpr = q_ptr.dtype.element_ty
    # This split's share of the key list [window (WIN slots) | entries (n_len)].
    k_lo = split * SPLIT_KEYS
    k_hi = k_lo + SPLIT_KEYS
    if SPLITS == 1 and SINK:
        # The sink opens the online softmax: running max s_h, running sum e^0 = 1, no value. A
        # padding token keeps acc = 0, so its row is written as zeros.
        m_i = tl.load(sink_ptr + heads, mask=hm, other=0.0) * 1.4426950408889634
        l_i = tl.full([HB], 1.0, tl.float32)
    else:
        m_i = tl.full([HB], float("-inf"), tl.float32)
        l_i = tl.zeros([HB], tl.float32)
    acc_a = tl.zeros([HB, DA], tl.float32)
    acc_b = tl.zeros([HB, DB], tl.float32)
    if req >= 0:
        pos = tl.load(pos_ptr + t)
        n_len = tl.minimum(tl.load(len_ptr + t), n_idx)
        q_at = q_ptr + t * sq_t + h64[:, None] * sq_h
        if EVEN_ODD:
            q_a, q_b = tl.split(tl.reshape(tl.load(q_at + cols[None, :], mask=hm[:, None], other=0.0), [HB, DA, 2]))
        else:
            q_a = tl.load(q_at + cols[None, :], mask=hm[:, None], other=0.0)
            q_b = tl.load(q_at + (D - R) + tl.arange(0, R)[None, :], mask=hm[:, None], other=0.0)
        ring0 = req.to(tl.int64) * ring_size
        # The key list: slots [0, WIN) are the window (positions pos - window + 1 + j, j < window),
        # slots [WIN, WIN + n_len) the listed entries. WIN is a multiple of BK, so a tile is one or the
        # other; one loop (not two) keeps one copy of the tile code, and of its registers.
        for j0 in tl.range(k_lo, tl.minimum(k_hi, WIN + n_len), BK, num_stages=STAGES):
            j = j0 + tl.arange(0, BK)
            in_win = j0 < WIN
            wpos = pos - window + 1 + j
            idx = tl.load(idx_ptr + t * si_t + (j - WIN), mask=(j >= WIN) & (j < WIN + n_len), other=-1)
            valid = tl.where(j < WIN, (j < window) & (wpos >= 0), idx >= 0)
            if STAGES > 1 or tl.max(valid.to(tl.int32), axis=0) > 0:
                slots = tl.where(j < WIN, ring0 + tl.maximum(wpos, 0) % ring_size, tl.maximum(idx, 0).to(tl.int64))
                if EVEN_ODD:
                    if W_FMT == C_FMT:
                        k_a, k_b = _load_keys_eo(tl.where(in_win, wc_ptr, cc_ptr), slots, valid,
                                                 tl.where(in_win, w_bs, c_bs), BK, D, W_FMT, kdt, SOFT)
                    elif in_win:
                        k_a, k_b = _load_keys_eo(wc_ptr, slots, valid, w_bs, BK, D, W_FMT, kdt, SOFT)
                    else:
                        k_a, k_b = _load_keys_eo(cc_ptr, slots, valid, c_bs, BK, D, C_FMT, kdt, SOFT)
                else:
                    if W_FMT == C_FMT:
                        k_a, k_b = _load_keys(tl.where(in_win, wc_ptr, cc_ptr), slots, valid,
                                              tl.where(in_win, w_bs, c_bs), BK, D, R, W_FMT, kdt, SOFT)
                    elif in_win:
                        k_a, k_b = _load_keys(wc_ptr, slots, valid, w_bs, BK, D, R, W_FMT, kdt, SOFT)
                    else:
                        k_a, k_b = _load_keys(cc_ptr, slots, valid, c_bs, BK, D, R, C_FMT, kdt, SOFT)
                m_i, l_i, acc_a, acc_b = _attend_tile(q_a, q_b, k_a, k_b, valid, m_i, l_i, acc_a, acc_b, qk_scale,
                                                      SOFT)
    if SPLITS == 1:
        dst = out_ptr + t * so_t + h64[:, None] * so_h
        odt: tl.constexpr = out_ptr.dtype.element_ty
        if not SINK:  # the keys' own sum (1 where there was no key: the row stays 0) and its ln
            tl.store(lse_out_ptr + t * n_heads + h64,
                     tl.where(l_i > 0.0, (m_i + tl.log2(tl.where(l_i > 0.0, l_i, 1.0))) * 0.6931471805599453,
                              float("-inf")), mask=hm)
            l_i = tl.where(l_i > 0.0, l_i, 1.0)
        if EVEN_ODD:
            o = tl.reshape(tl.join(acc_a, acc_b), [HB, D]) / l_i[:, None]
            tl.store(dst + cols[None, :], round_to(o, odt, SOFT), mask=hm[:, None])
        else:
            tl.store(dst + cols[None, :], round_to(acc_a / l_i[:, None], odt, SOFT), mask=hm[:, None] & (cols < D - R))
            tl.store(dst + (D - R) + tl.arange(0, R)[None, :], round_to(acc_b / l_i[:, None], odt, SOFT),
                     mask=hm[:, None])
    else:
        # Partial output normalized by its own sum, and the log2 of that sum (-inf: no key).
        row = (t * SPLITS + split) * n_heads + h64
        l_safe = tl.where(l_i > 0.0, l_i, 1.0)
        dst = part_ptr + row[:, None] * D
        if EVEN_ODD:
            tl.store(dst + cols[None, :], tl.reshape(tl.join(acc_a, acc_b), [HB, D]) / l_safe[:, None],
                     mask=hm[:, None])
        else:
            tl.store(dst + cols[None, :], acc_a / l_safe[:, None], mask=hm[:, None] & (cols < D - R))
            tl.store(dst + (D - R) + tl.arange(0, R)[None, :], acc_b / l_safe[:, None], mask=hm[:, None])
        tl.store(lse_ptr + row, tl.where(l_i > 0.0, m_i + tl.log2(l_safe), float("-inf")), mask=hm)


@triton.jit(do_not_specialize=["n_heads"])
def _combine_kernel(part_ptr, lse_ptr, req_ptr, sink_ptr, out_ptr, lse_out_ptr, so_t, so_h, n_heads, D: tl.constexpr,
                    HB: tl.constexpr, DB: tl.constexpr, SPLITS: tl.constexpr, SINK: tl.constexpr,
                    SOFT: tl.constexpr):
    """out = sum_s 2^lse_s o_s / (sum_s 2^lse_s + e^sink): the splits' partials and the sink, for HB
    heads x DB columns of a token. Without SINK: out = sum_s 2^lse_s o_s / sum_s 2^lse_s and
    lse_out = ln sum_s 2^lse_s (-inf and a zero row where no split had a key)."""
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * HB + tl.arange(0, HB)
    hm = heads < n_heads
    h64 = heads.to(tl.int64)
    cols = tl.program_id(2) * DB + tl.arange(0, DB)
    out = out_ptr + t * so_t + h64[:, None] * so_h + cols[None, :]
    lse_at = lse_out_ptr + t * n_heads + h64
    if tl.load(req_ptr + t) < 0:
        tl.store(out, tl.zeros([HB, DB], out_ptr.dtype.element_ty), mask=hm[:, None])
        if not SINK:
            tl.store(lse_at, tl.full([HB], float("-inf"), tl.float32), mask=hm & (tl.program_id(2) == 0))
    else:
        if SINK:
            sink = tl.load(sink_ptr + heads, mask=hm, other=0.0) * 1.4426950408889634
        else:
            sink = tl.full([HB], float("-inf"), tl.float32)
        m = sink
        for s in tl.static_range(SPLITS):
            m = tl.maximum(m, tl.load(lse_ptr + (t * SPLITS + s) * n_heads + h64, mask=hm, other=float("-inf")))
        m = tl.where(m == float("-inf"), 0.0, m)  # no sink and no key in any split
        den = tl.exp2(sink - m)
        acc = tl.zeros([HB, DB], tl.float32)
        for s in tl.static_range(SPLITS):
            row = (t * SPLITS + s) * n_heads + h64
            w = tl.exp2(tl.load(lse_ptr + row, mask=hm, other=float("-inf")) - m)
            den += w
            acc += w[:, None] * tl.load(part_ptr + row[:, None] * D + cols[None, :], mask=hm[:, None], other=0.0)
        if not SINK:
            tl.store(lse_at, tl.where(den > 0.0, (m + tl.log2(tl.where(den > 0.0, den, 1.0))) * 0.6931471805599453,
                                      float("-inf")), mask=hm & (tl.program_id(2) == 0))
            den = tl.where(den > 0.0, den, 1.0)
        tl.store(out, round_to(acc / den[:, None], out_ptr.dtype.element_ty, SOFT), mask=hm[:, None])


def config(num_heads: int, dtype: torch.dtype, pool_dtypes=(), fp4_entries: bool = False) -> tuple[int, int, int, int]:
    """(heads per program, keys per tile, warps, pipeline stages), from static dims only.

    bf16 tiles of 64 heads x 64 keys on 8 warps, two pipeline stages: the accumulator [64, 512]
    fp32 is 128 registers a thread, the key tile stays bf16 (exact dequantization in bf16, see the
    module docstring). Measured on the H100 (CSA 128 x 4K, 128 + 512 keys): 64 x 64 with 2 stages
    82 us; one stage 115 us (the tile-skip branch of one stage spills: 816 B a thread, 112 B with
    2 stages, ptxas); 64 x 32 with 2 stages 104 us; 16 heads x 64 keys 253 us (four programs read
    and dequantize every key). tl.dot needs >= 16 rows: fewer heads are padded. fp32 activations or
    pools (exact mode) take [32, 512] fp32 tiles for 16 heads (shared memory).
    V4.1's fp4_288 entries beside fp8_528 window rows (two decoders in one loop) spill 440 B a
    thread at 64 x 64, 40 B at 32 heads x 64 keys: H100, 128 + 512 keys, 32 x 64 vs 64 x 64 is
    27.9 vs 49.9 us at 1 x 4K, 48.6 vs 75.7 at 32 x 4K, 175.7 vs 205.0 at 128 x 64K."""
    if dtype == torch.float32 or torch.float32 in pool_dtypes:
        return 16, 32, 4, 1
    if fp4_entries and num_heads > 16:
        return 32, 64, 8, 2
    if num_heads > 32:
        return 64, 64, 8, 2
    if num_heads > 16:
        return 32, 64, 8, 1
    return 16, 32, 4, 1


# The combine's tile (heads, columns): small, so that a small batch spreads its merge over many SMs.
# H100, graph-timed, with one-tile splits: 4 x 128 gives CSA 1 x 4K 19.1 us (16 x 512, 4 programs for
# 64 heads: 29.2), CSA 32 x 4K 41.0 (44.2), HCA 32 x 1M 362 (381); 1 x 512 and 2 x 256 within 1 us.
COMBINE_TILE = (4, 128)


def splits(programs: int, keys: int, bk: int) -> int:
    """Splits of each token's key list for this kernel (see `split_rule`); the interpreter runs both
    paths on tiny shapes."""
    if INTERPRET:
        return 1 if keys <= 2 * bk else 2
    return split_rule(programs, keys, bk)


def split_rule(programs: int, keys: int, bk: int, sms: int = _SMS) -> int:
    """Splits of each token's key list, each at least one tile: one (no workspace, no combine) once
    the tokens fill half the SMs (H100, CSA 128 x 4K: 3 splits cost 2x one, the partial outputs
    being 8x the keys' bytes); below, one wave of programs (CSA 32 x 4K: 4 splits 46 us, 9 splits
    54 us), or one split per 1024 keys for long lists (HCA 32 x 1M, 8320 keys: 10 splits 370 us, 5
    splits 432 us). One-tile splits rather than two: CSA 1 x 4K 19.1 us instead of 24.0, 8 x 4K 22.4
    instead of 25.6, sliding 1 x 4K 17.1 instead of 20.7. The CUDA C++ kernel (sparse_attn/cuda.py)
    splits by the same rule, its CTAs as the programs."""
    if programs >= sms // 2:
        return 1
    return max(1, min(max(sms // max(programs, 1), -(-keys // 1024)), keys // bk))


def invariant_splits(programs: int, keys: int, bk: int) -> int:
    """Splits of a batch-invariant step (CacheConfig(batch_invariant=True)): from the key list's static
    width only, never the token count, so a query's splits and the combine's order are the same
    whatever shares its step: one split per 1024 keys (split_rule's share for long lists), at least
    one tile each; the interpreter's rule (`splits`) already reads the width alone. Not tuned: the
    cost against the default at batch 1 / 128 is for the GPU bench."""
    if INTERPRET:
        return splits(programs, keys, bk)
    return max(1, min(-(-keys // 1024), keys // bk))


def sparse_attn(q, window_cache, comp_cache, positions, req_slots, comp_idx, comp_lens, window_ends, sinks, out,
                scale: float, window: int, ring_size: int, window_fmt: str, comp_fmt: str, lse=None,
                batch_invariant: bool = False) -> None:
    """Launcher of `dsv4::sparse_attn` (same arguments)."""
    _checks.sparse_attn(q, window_cache, comp_cache, positions, req_slots, comp_idx, comp_lens, window_ends, sinks, out,
                        scale, window, ring_size, window_fmt, comp_fmt, lse)
    # The kernel reads a token's position only where its window ends: window_ends, when given.
    positions = positions if window_ends is None else window_ends
    w_fmt = fmt_code("sparse_attn", "window_fmt", window_fmt, allowed=(EXACT, "fp8_584", "fp8_528"))
    # A sliding layer passes its window as comp_cache (and no entries): the window's format there too.
    c_fmt = fmt_code("sparse_attn", "comp_fmt", comp_fmt, allowed=(EXACT, "fp8_584", "fp8_528", "fp4_288"))
    # V4.1's formats, and V4's 584-B window rows beside fp4_288 entries (CacheFormats comp="fp4_288"), run as even /
    # odd column halves.
    even_odd = window_fmt in _V41 or comp_fmt in _V41
    if even_odd and comp_fmt == "fp8_584":
        not_yet("sparse_attn", f"window_fmt={window_fmt!r} with comp_fmt={comp_fmt!r} (V4's 584-B entries beside a "
                               f"V4.1 window)")
    t, h, d = q.shape
    require(d == MAIN_DIM, "sparse_attn", "q", f"head_dim {MAIN_DIM} (V4 layout)", d)
    if t == 0 or h == 0:
        return
    sink = lse is None
    lse_out = out if sink else lse  # unused with the sink
    hb, bk, warps, stages = config(h, q.dtype, (window_cache.dtype, comp_cache.dtype), comp_fmt == "fp4_288")
    n_idx = comp_idx.shape[1]
    win = triton.cdiv(window, bk) * bk
    n_split = (invariant_splits if batch_invariant else splits)(t * triton.cdiv(h, hb), win + n_idx, bk)
    split_keys = triton.cdiv(triton.cdiv(win + n_idx, n_split), bk) * bk
    n_split = triton.cdiv(win + n_idx, split_keys)
    if n_split > 1:
        part = torch.empty(t * n_split * h, d, dtype=torch.float32, device=q.device)
        split_lse = torch.empty(t * n_split * h, dtype=torch.float32, device=q.device)
    else:
        part = split_lse = out  # unused
    grid = (t, triton.cdiv(h, hb), n_split)
    launch(_sparse_attn_kernel, grid,
           (q, window_cache, comp_cache, positions, req_slots, comp_idx, comp_lens, sinks, out, part, split_lse,
            lse_out, q.stride(0), q.stride(1), comp_idx.stride(0), out.stride(0), out.stride(1), h, n_idx,
            scale * math.log2(math.e), window, ring_size, block_size(window_cache, window_fmt),
            block_size(comp_cache, comp_fmt)),
           dict(D=d, R=MAIN_ROPE, HB=hb, BK=bk, SPLIT_KEYS=split_keys, SPLITS=n_split, WIN=win, STAGES=stages,
                W_FMT=w_fmt, C_FMT=c_fmt, EVEN_ODD=even_odd, SINK=sink, SOFT=INTERPRET), num_warps=warps)
    if n_split > 1:
        chb, cdb = COMBINE_TILE
        launch(_combine_kernel, (t, triton.cdiv(h, chb), d // cdb),
               (part, split_lse, req_slots, sinks, out, lse_out, out.stride(0), out.stride(1), h),
               dict(D=d, HB=chb, DB=cdb, SPLITS=n_split, SINK=sink, SOFT=INTERPRET), num_warps=4)

