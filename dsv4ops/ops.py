"""Every `dsv4::` operator, defined once with its pure-PyTorch reference kernel.

Rules (docs: architecture.md): one op per meaning; out-variant (outputs and caches are preallocated
and listed in `mutates_args`, the op returns None); the reference kernel is registered for every
device (CompositeExplicitAutograd), so it serves CPU and is the "reference backend" on GPU; CUDA
backends attach with `register_kernel("cuda")` (Python) or `TORCH_LIBRARY_IMPL(dsv4, CUDA, m)`
(csrc). Metadata is validated with `torch._check` by the same functions the fakes in `meta/` run.

Where values are checked: shapes, dtypes and devices everywhere (the op and its fake). Values (indices,
positions, token ids in range) on the host, with a ValueError, by the public functions in eager mode
and by the step planner (KVCacheManager); never inside a compiled graph, where a check would sync the
host. The raw ops trust no value but raise on none: in a kernel an index of -1 or out of range means
"no entry" (written nowhere, read as nothing); a request slot of -1 or out of range, or a negative
position, makes a padding token (reads and writes nothing); a hash_route token id or table entry out
of range selects nothing (index -1, weight 0). So a bad value never leaves a half-written entry.
"""

import torch
from torch import Tensor
from torch.library import custom_op

from dsv4ops.attn_merge import checks as _attn_merge_checks
from dsv4ops.attn_merge import reference as _attn_merge
from dsv4ops.compressor import checks as _compressor_checks
from dsv4ops.compressor import reference as _compressor
from dsv4ops.fp8_linear import checks as _fp8_linear_checks
from dsv4ops.fp8_linear import reference as _fp8_linear
from dsv4ops.indexer import checks as _indexer_checks
from dsv4ops.indexer import reference as _indexer
from dsv4ops.qkv_prep import checks as _qkv_prep_checks
from dsv4ops.qkv_prep import reference as _qkv_prep
from dsv4ops.inv_rope import checks as _inv_rope_checks
from dsv4ops.inv_rope import reference as _inv_rope
from dsv4ops.invariant_linear import checks as _invariant_linear_checks
from dsv4ops.invariant_linear import reference as _invariant_linear
from dsv4ops.quant import checks as _quant_checks
from dsv4ops.quant import reference as _quant
from dsv4ops.router import checks as _router_checks
from dsv4ops.router import reference as _router
from dsv4ops.router.cuda import bind_cuda_kernel as _bind_router_kernel
from dsv4ops.sparse_attn import checks as _sparse_attn_checks
from dsv4ops.sparse_attn import reference as _sparse_attn
from dsv4ops.visible_entries import checks as _visible_entries_checks
from dsv4ops.visible_entries import reference as _visible_entries


# ---- router ------------------------------------------------------------------------------------
def _on_cuda_kernel(name: str, t: Tensor, args: tuple) -> bool:
    """A router op whose reference body meets CUDA tensors binds its CUDA kernels (first run: eager,
    or a compiled graph's first call, never a trace) and runs the op again on them; False where the
    arch table names the reference for this GPU. A failed build raises: no silent fallback."""
    if t.device.type != "cuda" or "cuda" in globals()[name]._disabled_kernel:  # set_kernel_enabled("cuda", False)
        return False
    if not _bind_router_kernel(name, torch.cuda.get_device_capability(t.device)):
        return False
    getattr(torch.ops.dsv4, name).default(*args)
    return True


@custom_op("dsv4::gate_topk", mutates_args=("weights_out", "indices_out"))
def gate_topk(
    logits: Tensor, bias: Tensor, weights_out: Tensor, indices_out: Tensor, routed_scaling_factor: float
) -> None:
    """scores = sqrt(softplus(logits)); indices = top-k(scores + bias) (ties: lower index);
    weights = scores[indices] / sum * routed_scaling_factor. k = indices_out.shape[1]."""
    _router_checks.gate_topk(logits, bias, weights_out, indices_out, routed_scaling_factor)
    if not _on_cuda_kernel("gate_topk", logits, (logits, bias, weights_out, indices_out, routed_scaling_factor)):
        _router.gate_topk(logits, bias, weights_out, indices_out, routed_scaling_factor)


@custom_op("dsv4::hash_route", mutates_args=("weights_out", "indices_out"))
def hash_route(
    logits: Tensor, token_ids: Tensor, tid2eid: Tensor, weights_out: Tensor, indices_out: Tensor,
    routed_scaling_factor: float,
) -> None:
    """indices = tid2eid[token_ids]; weights = renormalised sqrt(softplus(logits))[indices] * scale.
    A token id outside [0, vocab) or a table entry outside [0, experts) selects nothing (index -1,
    weight 0)."""
    _router_checks.hash_route(logits, token_ids, tid2eid, weights_out, indices_out, routed_scaling_factor)
    args = (logits, token_ids, tid2eid, weights_out, indices_out, routed_scaling_factor)
    if not _on_cuda_kernel("hash_route", logits, args):
        _router.hash_route(*args)


@custom_op("dsv4::router_gate", mutates_args=("logits_out", "weights_out", "indices_out"))
def router_gate(
    x: Tensor, weight: Tensor, bias: Tensor, logits_out: Tensor, weights_out: Tensor, indices_out: Tensor,
    routed_scaling_factor: float,
) -> None:
    """logits = x @ weight.T (fp32), then gate_topk; one kernel for decode-sized batches on GPU."""
    _router_checks.router_gate(x, weight, bias, logits_out, weights_out, indices_out, routed_scaling_factor)
    args = (x, weight, bias, logits_out, weights_out, indices_out, routed_scaling_factor)
    if not _on_cuda_kernel("router_gate", x, args):
        _router.router_gate(*args)


# ---- quant: cache entries ----------------------------------------------------------------------
@custom_op("dsv4::pack_kv", mutates_args=("cache",))
def pack_kv(x: Tensor, slots: Tensor, cache: Tensor, fmt: str) -> None:
    """Store rows x [N, d] at global slots of a page pool of format `fmt` (-1 or out of range:
    skipped): a byte format of dsv4ops/quant/formats.py (uint8 pages) or `exact` (float rows as
    they are)."""
    _quant_checks.pack_kv(x, slots, cache, fmt)
    _quant.pack_kv(x, slots, cache, fmt)


@custom_op("dsv4::unpack_kv", mutates_args=("out",))
def unpack_kv(cache: Tensor, slots: Tensor, out: Tensor, fmt: str) -> None:
    """Read the rows at slots of a pool of format `fmt` into out [N, d] (dequantized); rows with
    slot -1 (or out of range) become 0."""
    _quant_checks.unpack_kv(cache, slots, out, fmt)
    _quant.unpack_kv(cache, slots, out, fmt)


# ---- qkv_prep ----------------------------------------------------------------------------------
@custom_op("dsv4::qkv_prep", mutates_args=("q_out", "window_cache"))
def qkv_prep(q: Tensor, kv: Tensor, positions: Tensor, req_slots: Tensor, inv_freq: Tensor, q_out: Tensor,
             window_cache: Tensor, ring_size: int, eps: float, q_norm: bool, window_fmt: str) -> None:
    """q_out = RoPE(q), after a weightless per-head RMSNorm when q_norm (V4; not V4.1); the kv
    row, RoPE'd, goes to slot req * ring_size + position % ring_size of the window pool (format
    window_fmt; nothing for request -1)."""
    _qkv_prep_checks.qkv_prep(q, kv, positions, req_slots, inv_freq, q_out, window_cache, ring_size, eps, window_fmt)
    _qkv_prep.qkv_prep(q, kv, positions, req_slots, inv_freq, q_out, window_cache, ring_size, eps, q_norm,
                       window_fmt)


# ---- compressor --------------------------------------------------------------------------------
@custom_op("dsv4::compressor_update", mutates_args=("state", "cache", "latent_out"))
def compressor_update(kv: Tensor, score: Tensor, ape: Tensor, positions: Tensor, req_slots: Tensor,
                      entry_slots: Tensor, norm_weight: Tensor, inv_freq: Tensor, state: Tensor, cache: Tensor,
                      latent_out: Tensor | None, eps: float, fmt: str, hadamard: bool = False,
                      batch_invariant: bool = False) -> None:
    """Save every token's (a, z + ape) in its request's state ring; tokens that close a block pool
    it (CSA: 8-slot overlap; otherwise the m slots of the block), RMSNorm, RoPE at w*m and store
    the entry at entry_slots (pool format fmt; with `hadamard`, a byte format, the entry rotated by
    the orthonormal Hadamard first: V4's MXFP4 index keys). latent_out [T, d], if given, gets each
    closing token's entry before RoPE (0 in the other rows). batch_invariant: an entry's bits depend
    on its own slots only (a pooling order fixed for every token count; on the CPU one entry at a time)."""
    _compressor_checks.compressor_update(kv, score, ape, positions, req_slots, entry_slots, norm_weight, inv_freq,
                                         state, cache, latent_out, eps, fmt, hadamard)
    _compressor.compressor_update(kv, score, ape, positions, req_slots, entry_slots, norm_weight, inv_freq, state,
                                  cache, latent_out, eps, fmt, hadamard, batch_invariant)


# ---- indexer -----------------------------------------------------------------------------------
@custom_op("dsv4::indexer_q_prep", mutates_args=("q_out", "w_out"))
def indexer_q_prep(q: Tensor, weights: Tensor, positions: Tensor, inv_freq: Tensor, q_out: Tensor,
                   w_out: Tensor, fmt: str, hadamard: bool = False) -> None:
    """q_out = RoPE(q), quantized per (token, head) row like keys of format fmt: `exact` (q's
    dtype), `fp8_132` (e4m3, the pow2 scale folded into w_out) or `mxfp4_68` (the packed 68-B row);
    with `hadamard` (a byte format), bf16(RoPE(q)) rotated by the orthonormal Hadamard before the
    quantizer (V4's MXFP4 indexer); w_out = weights x d^-1/2 x H^-1/2 (x that scale)."""
    _indexer_checks.indexer_q_prep(q, weights, positions, inv_freq, q_out, w_out, fmt, hadamard)
    _indexer.indexer_q_prep(q, weights, positions, inv_freq, q_out, w_out, fmt, hadamard)


@custom_op("dsv4::indexer_k_prep", mutates_args=("cache",))
def indexer_k_prep(latent: Tensor, positions: Tensor, req_slots: Tensor, entry_slots: Tensor, wk: Tensor,
                   k_norm_weight: Tensor, inv_freq: Tensor, cache: Tensor, ratio: int, eps: float, fmt: str,
                   batch_invariant: bool = False) -> None:
    """Index keys of the entries closed by this step: k = RoPE_{w*m}(RMSNorm(latent @ wk^T)) of each
    token with (p + 1) % ratio == 0, stored at entry_slots (-1: none) of the key pool (format fmt).
    batch_invariant: a key's bits depend on its own latent row only (the GEMM by
    dsv4::invariant_linear's schedule, not one picked by the step's token count)."""
    _indexer_checks.indexer_k_prep(latent, positions, req_slots, entry_slots, wk, k_norm_weight, inv_freq, cache,
                                   ratio, eps, fmt)
    _indexer.indexer_k_prep(latent, positions, req_slots, entry_slots, wk, k_norm_weight, inv_freq, cache, ratio,
                            eps, fmt, batch_invariant)


@custom_op("dsv4::indexer_topk", mutates_args=("idx_out", "cand_out", "workspace"))
def indexer_topk(q: Tensor, weights: Tensor, positions: Tensor, req_slots: Tensor, cache: Tensor,
                 block_table: Tensor, cand: Tensor | None, idx_out: Tensor, cand_out: Tensor | None,
                 workspace: Tensor, ratio: int, cand_block: int, fmt: str) -> None:
    """The top-k entries (ties to the lower entry) of sum_h w_h relu(q_h . k) over the visible
    entries w < (t + 1) // ratio of each token's request, or only over the entries of its candidate
    blocks `cand` (blocks of cand_block entries), as global slots in ascending entry order, -1 after
    them. cand_out, if given, gets the candidate-block pool of the same scores (block max, newest
    block forced, best first). workspace: int32 scratch of the CUDA kernel (the reference ignores it)."""
    _indexer_checks.indexer_topk(q, weights, positions, req_slots, cache, block_table, cand, idx_out, cand_out,
                                 workspace, ratio, cand_block, fmt)
    _indexer.indexer_topk(q, weights, positions, req_slots, cache, block_table, cand, idx_out, cand_out, ratio,
                          cand_block, fmt)


# ---- visible_entries ---------------------------------------------------------------------------
@custom_op("dsv4::visible_entries", mutates_args=("out",))
def visible_entries(block_table: Tensor, positions: Tensor, req_slots: Tensor, out: Tensor, ratio: int,
                    block_size: int) -> None:
    """The HCA key list: out[t, w] = the global pool slot of entry w of the token's request through
    block_table (blocks of block_size entries) for w < (t + 1) // ratio; -1 past them, where the
    block is -1 (unallocated), and in every row of a padding token (request slot -1 or out of range,
    or a negative position). Every element of out is written."""
    _visible_entries_checks.visible_entries(block_table, positions, req_slots, out, ratio, block_size)
    _visible_entries.visible_entries(block_table, positions, req_slots, out, ratio, block_size)


# ---- sparse_attn -------------------------------------------------------------------------------
@custom_op("dsv4::sparse_attn", mutates_args=("out", "lse"))
def sparse_attn(q: Tensor, window_cache: Tensor, comp_cache: Tensor, positions: Tensor, req_slots: Tensor,
                comp_idx: Tensor, comp_lens: Tensor, window_ends: Tensor | None, sinks: Tensor, out: Tensor,
                scale: float, window: int, ring_size: int, window_fmt: str, comp_fmt: str,
                lse: Tensor | None = None, batch_invariant: bool = False) -> None:
    """MQA with sink over each query's window (the `window` positions of its request's ring ending at
    window_ends[t]; None: at its own position; a negative end: no window) and the compressed entries
    comp_idx[t, :comp_lens[t]] (-1 = none); K = V; padding tokens get zeros. The pools' formats are
    window_fmt and comp_fmt. With lse [T, H] fp32: a context-parallel shard's partial, out normalized
    over these keys without the sink and lse = ln sum_j e^(scaled logit j) (-inf and a zero row for
    no key); dsv4::attn_merge applies the sink. batch_invariant: a query's bits depend on its own
    keys only (its key list's splits fixed by static sizes, not by the step's token count)."""
    _sparse_attn_checks.sparse_attn(q, window_cache, comp_cache, positions, req_slots, comp_idx, comp_lens,
                                    window_ends, sinks, out, scale, window, ring_size, window_fmt, comp_fmt, lse)
    _sparse_attn.sparse_attn(q, window_cache, comp_cache, positions, req_slots, comp_idx, comp_lens, window_ends,
                             sinks, out, scale, window, ring_size, window_fmt, comp_fmt, lse, batch_invariant)


@custom_op("dsv4::attn_merge", mutates_args=("out",))
def attn_merge(partials: Tensor, lse: Tensor, sinks: Tensor, out: Tensor) -> None:
    """The sink attention of a query from R shards of its keys: out = sum_r e^(lse_r - M) partials_r
    / (sum_r e^(lse_r - M) + e^(sink - M)), M = max(lse_r, sink); partials [R, T, H, D] each shard's
    output without the sink (sparse_attn with lse), lse [R, T, H] fp32 (-inf: a shard without keys,
    its row not read), sinks [H] fp32, out [T, H, D]."""
    _attn_merge_checks.attn_merge(partials, lse, sinks, out)
    _attn_merge.attn_merge(partials, lse, sinks, out)


# ---- output ------------------------------------------------------------------------------------
@custom_op("dsv4::inv_rope", mutates_args=("out",))
def inv_rope(o: Tensor, positions: Tensor, inv_freq: Tensor, out: Tensor) -> None:
    """out = o with its trailing rope dims rotated by -position x theta."""
    _inv_rope_checks.inv_rope(o, positions, inv_freq, out)
    _inv_rope.inv_rope(o, positions, inv_freq, out)



# ---- fp8_linear --------------------------------------------------------------------------------
@custom_op("dsv4::fp8_linear", mutates_args=("out",))
def fp8_linear(x: Tensor, weight: Tensor, scale: Tensor, out: Tensor, block: int, groups: int = 1,
               batch_invariant: bool = False) -> None:
    """out [M, N] = x [M, K] @ (weight [N, K] e4m3 x its block x block tile scale)^T in x's dtype,
    fp32 accumulation; the dequantized weight is the one dsv4ops.checkpoint computes on load.
    scale: fp32, or UE8M0 as uint8 bytes (2^(byte - 127); fp8_linear/checks.py says why).
    groups > 1: block-diagonal (V4's grouped o_a): x [M, groups x K], and output group g (columns
    g N / groups .. (g + 1) N / groups, a multiple of 32) reads x's g-th K columns.
    batch_invariant: a row's bits do not depend on the other rows or their count (one launch config
    for every M; on the CPU one product a row)."""
    _fp8_linear_checks.fp8_linear(x, weight, scale, out, block, groups)
    _fp8_linear.fp8_linear(x, weight, scale, out, block, groups, batch_invariant)


@custom_op("dsv4::fp8_linear_w8a8", mutates_args=("out",))
def fp8_linear_w8a8(x: Tensor, weight: Tensor, scale: Tensor, out: Tensor, block: int) -> None:
    """fp8_linear with x quantized first (W8A8, DeepSeek's act_quant): out [M, N] = (x's e4m3 codes x
    one power-of-two scale per 1 x 128 block) @ (weight x its 128 x 128 tile scale)^T, fp32 sums,
    rounded to x's dtype. block: 128 only; scale: fp32; in_features a multiple of 128."""
    _fp8_linear_checks.fp8_linear_w8a8(x, weight, scale, out, block)
    _fp8_linear.fp8_linear_w8a8(x, weight, scale, out, block)


# ---- invariant_linear --------------------------------------------------------------------------
@custom_op("dsv4::invariant_linear", mutates_args=("out",))
def invariant_linear(x: Tensor, weight: Tensor, out: Tensor) -> None:
    """out [M, N] = x [M, K] @ weight [N, K]^T, fp32 sums rounded to out's dtype (x's or fp32), by a
    schedule fixed independently of M: each row's bits depend on that row of x and the weight only
    (CacheConfig(batch_invariant=True))."""
    _invariant_linear_checks.invariant_linear(x, weight, out)
    _invariant_linear.invariant_linear(x, weight, out)
