"""Triton kernels of `dsv4::compressor_update` (compressor/reference.py is the specification).

Two launches on the current stream, in this order (three for an HCA decode step and for every
batch-invariant HCA step, see pool_plan):
1. `_compress_kernel`, one program per token (programs of tokens that do not close a block exit at
   once): pools positions [p - coff*m + 1, p] per channel with an online softmax over slot chunks
   (the step's own rows where the reference takes them, the state ring otherwise, -inf before 0;
   CSA: slots < m read the a-stream [:d], the others the b-stream [d:]; V4.1 ratio 2 / 1: 2 / 1
   slots, no overlap), casts to the entry dtype, RMSNorm, RoPE at w*m, with HADAMARD the rotation
   of V4's MXFP4 index keys (triton_helpers.rotate), and stores the entry (in the pool's format) at
   entry_slots; with `latent_out`, every token writes its row of it (the entry
   before RoPE for closing tokens, zeros for the others: the reference's zero fill).
   HCA decode: `_pool_split_kernel` pools (token, channel block) programs into a float row per
   token and `_finish_kernel` norms, ropes and stores it (the norm needs the whole row).
2. `_save_kernel`: every token's (a, z + ape[p % m]) into its state row p % (the state's rows), unless a
   later token of the step maps to the same row. It runs second because a closing token may read
   an older state row that a later token of the same step overwrites.

At decode (H100) an update takes 5.2-6.1 us: the two launches are two dependent global
round trips (at batch 1 the pooling is one program of 8 slots x 512 channels, 47% of its stalls on
long scoreboard, the save another, 61%), not work. HCA's at batch 128, when every request closes a
128-token entry in the same step (40.9 us), reads 64 MiB of fp32 state at 51% of DRAM peak, half its
stalls on long scoreboard: 2048 programs of 4 warps keep too few loads in flight per SM (more rows
per loop step or a cp.async ring would raise that; not built).
"""

import torch
import triton
import triton.language as tl

from dsv4ops.compressor import checks as _checks
from dsv4ops.quant.reference import INDEXER_DIM, MAIN_DIM, MAIN_ROPE, capacity
from dsv4ops.quant.triton import block_size, fmt_code, store_rows
from dsv4ops.triton_helpers import (
    INTERPRET,
    TL_DTYPES,
    apply_rope,
    launch,
    require_layout,
    rope_coeffs,
    rotate,
    round_via,
    to_f32,
    wait_prior_grid,
)


@triton.jit
def _closes(pos_ptr, req_ptr, latent_ptr, i, n_requests, s_lat, ratio, D: tl.constexpr, LATENT: tl.constexpr):
    """(pos, req, closes) of token i: a request slot past the state or a negative position is
    padding (kernels never index out of range). With LATENT, a token that closes nothing writes its
    zero row of latent_out here."""
    pos = tl.load(pos_ptr + i)
    req = tl.load(req_ptr + i)
    closes = (req >= 0) & (req < n_requests) & (pos >= 0) & ((pos + 1) % ratio == 0)
    if LATENT:
        if closes == 0:
            tl.store(latent_ptr + i * s_lat + tl.arange(0, D), tl.zeros([D], latent_ptr.dtype.element_ty))
    return pos, req, closes


@triton.jit
def _pool(kv_ptr, score_ptr, ape_ptr, pos_ptr, req_ptr, state_ptr, i, pos, req, n_tokens, s_kv, s_sc, ratio, ring,
          c, D: tl.constexpr, OVERLAP: tl.constexpr, RB: tl.constexpr, EDT: tl.constexpr, SOFT: tl.constexpr):
    """Token i's pooled channels `c` (a block of [0, D)), rounded to EDT: the online softmax over its
    slots, RB at a time."""
    if OVERLAP:
        width = 2 * D
        rows = 2 * ratio
    else:
        width = D
        rows = ratio
    srow0 = state_ptr + req.to(tl.int64) * ring * (2 * width)  # ring: the state's rows (>= rows)
    m_run = tl.full(c.shape, float("-inf"), tl.float32)
    l_run = tl.zeros(c.shape, tl.float32)
    acc = tl.zeros(c.shape, tl.float32)
    for j0 in range(0, rows, RB):
        j = j0 + tl.arange(0, RB)
        jm = j < rows
        qpos = pos - (rows - 1) + j  # positions pooled by this chunk of slots
        src = i - (rows - 1) + j  # where they would sit in this step
        src_ok = jm & (src >= 0) & (src < n_tokens)
        srcc = tl.maximum(src, 0)
        rs = tl.load(req_ptr + srcc, mask=src_ok, other=-2)
        ps = tl.load(pos_ptr + srcc, mask=src_ok, other=-1)
        in_step = src_ok & (rs == req) & (ps == qpos)
        live = jm & (qpos >= 0)
        held = live & ~in_step
        if OVERLAP:
            col = c[None, :] + tl.where(j >= ratio, D, 0)[:, None]
        else:
            col = c[None, :] + 0 * j[:, None]
        ms = in_step[:, None]
        a_s = to_f32(tl.load(kv_ptr + srcc[:, None] * s_kv + col, mask=ms, other=0.0), SOFT)
        z_s = to_f32(tl.load(score_ptr + srcc[:, None] * s_sc + col, mask=ms, other=0.0), SOFT)
        z_s = z_s + tl.load(ape_ptr + (tl.maximum(qpos, 0) % ratio)[:, None] * width + col, mask=ms, other=0.0)
        srow = srow0 + (tl.maximum(qpos, 0) % ring).to(tl.int64)[:, None] * (2 * width) + col
        mh = held[:, None]
        a_h = tl.load(srow, mask=mh, other=0.0)
        z_h = tl.load(srow + width, mask=mh, other=0.0)
        a = tl.where(ms, a_s, tl.where(mh, a_h, 0.0))
        z = tl.where(ms, z_s, tl.where(mh, z_h, float("-inf"))) * 1.4426950408889634
        m_new = tl.maximum(m_run, tl.max(z, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_run - m_safe)
        p = tl.exp2(z - m_safe[None, :])
        l_run = l_run * alpha + tl.sum(p, axis=0)
        acc = acc * alpha + tl.sum(p * a, axis=0)
        m_run = m_new
    return round_via(tl.math.div_rn(acc, l_run), EDT, SOFT)


@triton.jit
def _finish(x, i, pos, eslot_ptr, w_ptr, freq_ptr, cache_ptr, latent_ptr, n_slots, s_lat, ratio, block_size, eps,
            D: tl.constexpr, ROPE: tl.constexpr, EDT: tl.constexpr, FMT: tl.constexpr, LATENT: tl.constexpr,
            HADAMARD: tl.constexpr, SOFT: tl.constexpr):
    """RMSNorm of the pooled row x [D], latent_out, RoPE at w*m (then the Hadamard rotation with
    HADAMARD), the entry stored at entry_slots[i]."""
    c = tl.arange(0, D)
    r = tl.math.rsqrt(tl.sum(x * x, axis=0) * (1.0 / D) + eps)
    w = to_f32(tl.load(w_ptr + c), SOFT)
    y = round_via(w * (x * r), EDT, SOFT)
    if LATENT:
        tl.store(latent_ptr + i * s_lat + c, y.to(latent_ptr.dtype.element_ty))
    cos, sin, rot = rope_coeffs(freq_ptr, (pos // ratio) * ratio, D, ROPE)
    y = round_via(apply_rope(y[None, :], cos, sin, rot, 1, D, False), EDT, SOFT)
    if HADAMARD:
        y = rotate(y, 1, D, SOFT)
    slot = tl.full([1], 0, tl.int64) + tl.load(eslot_ptr + i)
    ok = (slot >= 0) & (slot < n_slots)  # -1 or out of range: no entry
    store_rows(cache_ptr, tl.where(ok, slot, 0), ok, y, block_size, 1, D, FMT, SOFT)


# Pool sizes are not specialized on: warmup runs on one-request pools (n_requests == 1 would compile
# another variant than a serving cache).
@triton.jit(do_not_specialize=["n_tokens", "n_requests"])
def _compress_kernel(kv_ptr, score_ptr, ape_ptr, pos_ptr, req_ptr, eslot_ptr, w_ptr, freq_ptr, state_ptr, cache_ptr,
                     latent_ptr, n_tokens, n_requests, n_slots, s_kv, s_sc, s_lat, ratio, ring, block_size, eps,
                     D: tl.constexpr, ROPE: tl.constexpr, OVERLAP: tl.constexpr, RB: tl.constexpr, EDT: tl.constexpr,
                     FMT: tl.constexpr, LATENT: tl.constexpr, HADAMARD: tl.constexpr, SOFT: tl.constexpr):
    wait_prior_grid()
    i = tl.program_id(0).to(tl.int64)
    pos, req, closes = _closes(pos_ptr, req_ptr, latent_ptr, i, n_requests, s_lat, ratio, D, LATENT)
    if closes:
        x = _pool(kv_ptr, score_ptr, ape_ptr, pos_ptr, req_ptr, state_ptr, i, pos, req, n_tokens, s_kv, s_sc, ratio,
                  ring, tl.arange(0, D), D, OVERLAP, RB, EDT, SOFT)
        _finish(x, i, pos, eslot_ptr, w_ptr, freq_ptr, cache_ptr, latent_ptr, n_slots, s_lat, ratio, block_size, eps,
                D, ROPE, EDT, FMT, LATENT, HADAMARD, SOFT)


@triton.jit(do_not_specialize=["n_tokens", "n_requests"])
def _pool_split_kernel(kv_ptr, score_ptr, ape_ptr, pos_ptr, req_ptr, state_ptr, x_ptr, n_tokens, n_requests, s_kv, s_sc,
                       ratio, ring, D: tl.constexpr, DB: tl.constexpr, OVERLAP: tl.constexpr, RB: tl.constexpr,
                       EDT: tl.constexpr, SOFT: tl.constexpr):
    """Program (token, b): channels [b * DB, (b + 1) * DB) of the token's pooled row, into x [T, D]."""
    wait_prior_grid()
    i = tl.program_id(0).to(tl.int64)
    pos, req, closes = _closes(pos_ptr, req_ptr, pos_ptr, i, n_requests, 0, ratio, D, False)
    if closes:
        c = tl.program_id(1) * DB + tl.arange(0, DB)
        x = _pool(kv_ptr, score_ptr, ape_ptr, pos_ptr, req_ptr, state_ptr, i, pos, req, n_tokens, s_kv, s_sc, ratio,
                  ring, c, D, OVERLAP, RB, EDT, SOFT)
        tl.store(x_ptr + i * D + c, x)


@triton.jit(do_not_specialize=["n_tokens", "n_requests"])
def _finish_kernel(x_ptr, pos_ptr, req_ptr, eslot_ptr, w_ptr, freq_ptr, cache_ptr, latent_ptr, n_requests, n_slots,
                   s_lat, ratio, block_size, eps, D: tl.constexpr, ROPE: tl.constexpr, EDT: tl.constexpr,
                   FMT: tl.constexpr, LATENT: tl.constexpr, HADAMARD: tl.constexpr, SOFT: tl.constexpr):
    """The entries of the rows _pool_split_kernel pooled."""
    wait_prior_grid()
    i = tl.program_id(0).to(tl.int64)
    pos, req, closes = _closes(pos_ptr, req_ptr, latent_ptr, i, n_requests, s_lat, ratio, D, LATENT)
    if closes:
        x = tl.load(x_ptr + i * D + tl.arange(0, D))
        _finish(x, i, pos, eslot_ptr, w_ptr, freq_ptr, cache_ptr, latent_ptr, n_slots, s_lat, ratio, block_size, eps,
                D, ROPE, EDT, FMT, LATENT, HADAMARD, SOFT)


@triton.jit(do_not_specialize=["n_tokens", "n_requests"])
def _save_kernel(kv_ptr, score_ptr, ape_ptr, pos_ptr, req_ptr, state_ptr, n_tokens, n_requests, s_kv, s_sc, ratio,
                 rows, W: tl.constexpr, SOFT: tl.constexpr):
    wait_prior_grid()
    i = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + i)
    req = tl.load(req_ptr + i)
    nxt = i + rows
    has_next = nxt < n_tokens
    later = has_next & (tl.load(req_ptr + nxt, mask=has_next, other=-2) == req)
    later = later & (tl.load(pos_ptr + nxt, mask=has_next, other=-1) == pos + rows)
    if (req >= 0) & (req < n_requests) & (pos >= 0) & (later == 0):
        c = tl.arange(0, W)
        a = to_f32(tl.load(kv_ptr + i * s_kv + c), SOFT)
        z = to_f32(tl.load(score_ptr + i * s_sc + c), SOFT) + tl.load(ape_ptr + (pos % ratio) * W + c)
        row = state_ptr + (req.to(tl.int64) * rows + pos % rows) * (2 * W)
        tl.store(row + c, a)
        tl.store(row + W + c, z)


def pool_plan(span: int, tokens: int, d: int, batch_invariant: bool = False) -> tuple[int, int, int]:
    """(channels per pooling program, slots it pools per loop step, warps) for `tokens` tokens
    whose entries pool `span` slots of d channels. Channels per program < d: the pooling runs on
    (token, channel block) programs and a second launch norms and stores. HCA (128 slots), H100,
    graph-timed, against one program a token: decode 1 x 4K 7.4 us (31.6) with 16 channels x 128
    slots on 8 warps, 32 x 4K 11.6 (32.9) and 128 x 4K 42.3 (54.6) with 32 x 64 on 4; a 4096-token
    prefill (32 closing tokens) stays on one program a token: 41 us, 53 split.

    The slots a loop step pools set the order of a channel's softmax sums, so the plan decides an
    entry's bits. batch_invariant: the decode plan (16 x 128 on 8 warps) at every token count, so
    a request's entries do not depend on how many tokens share its step. It keeps batch 1 as it is
    (7.4 us; one program a token, the simpler fixed plan, takes 31.6); from 17 tokens on it stands
    in for the plans timed above (32 x 64: 11.6 and 42.3 us; one program a token at prefill: 41)
    and has not been timed there itself. Its pooled rows take a [tokens, d] fp32 buffer."""
    if span >= 64 and (tokens <= 16 or batch_invariant):
        return 16, 128, 8
    if span >= 64 and tokens <= 256:
        return 32, 64, 4
    return d, min(8, triton.next_power_of_2(span)), 4


def compressor_update(kv, score, ape, positions, req_slots, entry_slots, norm_weight, inv_freq, state, cache,
                      latent_out, eps: float, fmt: str, hadamard: bool = False, batch_invariant: bool = False) -> None:
    """Launcher of `dsv4::compressor_update` (same arguments). batch_invariant: pool_plan's fixed plan."""
    _checks.compressor_update(kv, score, ape, positions, req_slots, entry_slots, norm_weight, inv_freq, state, cache,
                              latent_out, eps, fmt, hadamard)
    code = fmt_code("compressor_update", "fmt", fmt)
    t, width = kv.shape
    d, ratio = norm_weight.shape[0], ape.shape[0]
    require_layout("compressor_update", d, inv_freq.shape[0], dims=(MAIN_DIM, INDEXER_DIM))
    if t == 0:
        return
    overlap = width == 2 * d
    rows = state.shape[1]
    edt = cache.dtype if code == 0 else torch.bfloat16
    db, rb, warps = pool_plan((width // d) * ratio, t, d, batch_invariant)
    latent = cache if latent_out is None else latent_out
    s_lat = 0 if latent_out is None else latent_out.stride(0)
    finish = (capacity(cache, fmt), s_lat, ratio, block_size(cache, fmt), eps)
    meta = dict(D=d, ROPE=MAIN_ROPE, EDT=TL_DTYPES[edt], FMT=code, LATENT=latent_out is not None, HADAMARD=hadamard,
                SOFT=INTERPRET)
    if db == d:
        launch(_compress_kernel, (t,),
               (kv, score, ape, positions, req_slots, entry_slots, norm_weight, inv_freq, state, cache, latent, t,
                state.shape[0], finish[0], kv.stride(0), score.stride(0), s_lat, ratio, rows, *finish[3:]),
               dict(meta, OVERLAP=overlap, RB=rb), num_warps=warps, pdl=True)
    else:
        x = torch.empty(t, d, dtype=torch.float32, device=kv.device)
        launch(_pool_split_kernel, (t, d // db),
               (kv, score, ape, positions, req_slots, state, x, t, state.shape[0], kv.stride(0), score.stride(0),
                ratio, rows),
               dict(D=d, DB=db, OVERLAP=overlap, RB=rb, EDT=meta["EDT"], SOFT=INTERPRET), num_warps=warps, pdl=True)
        launch(_finish_kernel, (t,),
               (x, positions, req_slots, entry_slots, norm_weight, inv_freq, cache, latent, state.shape[0], *finish),
               meta, num_warps=4, pdl=True)
    launch(_save_kernel, (t,), (kv, score, ape, positions, req_slots, state, t, state.shape[0], kv.stride(0),
                                score.stride(0), ratio, rows), dict(W=width, SOFT=INTERPRET), pdl=True)
