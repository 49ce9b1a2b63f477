"""Triton kernels of the Lightning Indexer's query and key writers (indexer/reference.py is the
specification; the top-k: indexer/triton.py).

`indexer_q_prep`: RoPE of the 128-d indexer query (with HADAMARD, V4's rotation of its MXFP4 indexer
after it: triton_helpers.rotate), head weights x d^-1/2 x H^-1/2, and for an e4m3 q_out the
per-(token, head) UE8M0 scale folded into the weights. Grid (tokens, head blocks).

`indexer_k_prep`: V4.1's key writer (its compressor's latent through wk, RMSNorm, RoPE) into the
indexer pool's rows.
"""

import torch
import triton
import triton.language as tl

from dsv4ops.indexer import checks as _checks
from dsv4ops.invariant_linear.triton import invariant_linear
from dsv4ops.quant.reference import INDEXER_DIM, MAIN_ROPE, capacity
from dsv4ops.quant.triton import (
    block_size,
    fmt_code,
    mx4_encode,
    not_yet,
    store_rows,
)
from dsv4ops.triton_helpers import (
    INTERPRET,
    apply_rope,
    f32_to_e4m3_bits,
    launch,
    pow2,
    require_layout,
    rope_coeffs,
    rotate,
    round_to,
    round_via,
    to_f32,
    ue8m0_exponent,
    wait_prior_grid,
)


@triton.jit(do_not_specialize=["n_heads"])
def _q_prep_kernel(q_ptr, w_ptr, pos_ptr, freq_ptr, qo_ptr, wo_ptr, sq_t, sq_h, sw_t, so_t, so_h, swo_t, n_heads,
                   w_scale, D: tl.constexpr, ROPE: tl.constexpr, HB: tl.constexpr, OUT: tl.constexpr,
                   HADAMARD: tl.constexpr, SOFT: tl.constexpr):
    """OUT: 0 = float q_out, 1 = e4m3 (scale folded into the weights), 2 = packed MX4 rows."""
    wait_prior_grid()
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * HB + tl.arange(0, HB)
    hm = heads < n_heads
    h64 = heads.to(tl.int64)
    cols = tl.arange(0, D)
    cos, sin, rot = rope_coeffs(freq_ptr, tl.load(pos_ptr + t), D, ROPE)
    x = to_f32(tl.load(q_ptr + t * sq_t + h64[:, None] * sq_h + cols[None, :], mask=hm[:, None], other=0.0), SOFT)
    y = round_via(apply_rope(x, cos, sin, rot, HB, D, False), q_ptr.dtype.element_ty, SOFT)
    if HADAMARD:
        y = rotate(y, HB, D, SOFT)
    w = to_f32(tl.load(w_ptr + t * sw_t + heads, mask=hm, other=0.0), SOFT) * w_scale
    row = qo_ptr + t * so_t + h64[:, None] * so_h
    if OUT == 1:
        v = round_via(y, tl.bfloat16, SOFT)
        e = ue8m0_exponent(tl.max(tl.abs(v), axis=1))
        codes = f32_to_e4m3_bits(v * pow2(-e)[:, None], SOFT)
        tl.store(row + cols[None, :], codes.to(tl.float8e4nv, bitcast=True), mask=hm[:, None])
        w = w * pow2(e)
    elif OUT == 2:
        data, scales = mx4_encode(y, HB, D, SOFT)
        tl.store(row + tl.arange(0, D // 2)[None, :], data, mask=hm[:, None])
        tl.store(row + D // 2 + tl.arange(0, D // 32)[None, :], scales, mask=hm[:, None])
    else:
        tl.store(row + cols[None, :], round_to(y, qo_ptr.dtype.element_ty, SOFT), mask=hm[:, None])
    tl.store(wo_ptr + t * swo_t + heads, w, mask=hm)


def indexer_q_prep(q, weights, positions, inv_freq, q_out, w_out, fmt: str, hadamard: bool = False) -> None:
    """Launcher of `dsv4::indexer_q_prep` (same arguments)."""
    _checks.indexer_q_prep(q, weights, positions, inv_freq, q_out, w_out, fmt, hadamard)
    out = {"exact": 0, "fp8_132": 1, "mxfp4_68": 2}
    if fmt not in out:
        not_yet("indexer_q_prep", f"fmt={fmt!r} (it writes queries of {sorted(out)})")
    t, h, d = q.shape
    require_layout("indexer_q_prep", d, inv_freq.shape[0], dims=(INDEXER_DIM,))
    if t == 0 or h == 0:
        return
    hb = 16
    launch(_q_prep_kernel, (t, triton.cdiv(h, hb)),
           (q, weights, positions, inv_freq, q_out, w_out, q.stride(0), q.stride(1), weights.stride(0),
            q_out.stride(0), q_out.stride(1), w_out.stride(0), h, d**-0.5 * h**-0.5),
           dict(D=d, ROPE=MAIN_ROPE, HB=hb, OUT=out[fmt], HADAMARD=hadamard, SOFT=INTERPRET), pdl=True)


@triton.jit
def _k_prep_kernel(k_ptr, pos_ptr, req_ptr, eslot_ptr, w_ptr, freq_ptr, cache_ptr, s_k, n_slots, ratio, block_size,
                   eps, D: tl.constexpr, ROPE: tl.constexpr, FMT: tl.constexpr, SOFT: tl.constexpr):
    """Token t closing an entry: RoPE_{w*m}(RMSNorm(k[t])) (fp32 norm, the weight in fp32, one cast
    to k's dtype; RoPE in fp32, rounded to k's dtype) stored at its entry slot."""
    wait_prior_grid()
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(pos_ptr + t)
    slot = tl.full([1], 0, tl.int64) + tl.load(eslot_ptr + t)
    ok = (slot >= 0) & (slot < n_slots)  # -1 or out of range: no entry
    if (tl.load(req_ptr + t) >= 0) & (pos >= 0) & ((pos + 1) % ratio == 0):
        cols = tl.arange(0, D)
        kdt: tl.constexpr = k_ptr.dtype.element_ty
        x = to_f32(tl.load(k_ptr + t * s_k + cols), SOFT)
        r = tl.math.rsqrt(tl.sum(x * x, axis=0) * (1.0 / D) + eps)
        y = round_via(to_f32(tl.load(w_ptr + cols), SOFT) * (x * r), kdt, SOFT)
        cos, sin, rot = rope_coeffs(freq_ptr, (pos // ratio) * ratio, D, ROPE)
        y = round_via(apply_rope(y[None, :], cos, sin, rot, 1, D, False), kdt, SOFT)
        store_rows(cache_ptr, tl.where(ok, slot, 0), ok, y, block_size, 1, D, FMT, SOFT)


def indexer_k_prep(latent, positions, req_slots, entry_slots, wk, k_norm_weight, inv_freq, cache, ratio: int,
                   eps: float, fmt: str, batch_invariant: bool = False) -> None:
    """Launcher of `dsv4::indexer_k_prep` (same arguments): the key projection of every token as
    one GEMM in latent's dtype (fp32 accumulation, as the reference's F.linear; tokens that close no
    entry are a few wasted rows; batch_invariant: dsv4::invariant_linear's kernel, whose schedule
    does not follow the token count as cuBLAS's does), then one program per token for the norm,
    RoPE and the store."""
    _checks.indexer_k_prep(latent, positions, req_slots, entry_slots, wk, k_norm_weight, inv_freq, cache, ratio, eps,
                           fmt)
    code = fmt_code("indexer_k_prep", "fmt", fmt)
    t = latent.shape[0]
    require_layout("indexer_k_prep", wk.shape[0], inv_freq.shape[0], dims=(INDEXER_DIM,))
    if t == 0:
        return
    if batch_invariant:
        k = torch.empty(t, wk.shape[0], dtype=latent.dtype, device=latent.device)
        invariant_linear(latent, wk.to(latent.dtype), k)
    else:
        k = torch.nn.functional.linear(latent, wk.to(latent.dtype))
    launch(_k_prep_kernel, (t,),
           (k, positions, req_slots, entry_slots, k_norm_weight, inv_freq, cache, k.stride(0), capacity(cache, fmt),
            ratio, block_size(cache, fmt), eps),
           dict(D=wk.shape[0], ROPE=MAIN_ROPE, FMT=code, SOFT=INTERPRET), pdl=True)
