"""Reference kernels of the Lightning Indexer ops.

`indexer_q_prep`: RoPE of the indexer query at the token position (the layer's table), head
weights x d^-1/2 x H^-1/2, and for an e4m3 q_out the per-(token, head) power-of-two scale folded
into the weights. `indexer_topk`: score_t[w] = sum_h w_h relu(q_h . K[w]) over the entries
w < (t + 1) // ratio of the token's request (read through its block table), top-k with ties to the
lower entry, written as global pool slots; -1 fills the rest and every row of a padding token.
"""

import torch
from torch import Tensor

from dsv4ops.quant.reference import indexer_block_size, unpack_kv
from dsv4ops.reference.functional import apply_rope, rope_angles, stable_topk
from dsv4ops.reference.numerics import quantize_indexer_query


def indexer_q_prep(q: Tensor, weights: Tensor, positions: Tensor, inv_freq: Tensor, q_out: Tensor,
                   w_out: Tensor) -> None:
    cos, sin = rope_angles(positions, inv_freq, q.dtype)
    qr = apply_rope(q, cos[:, None], sin[:, None])
    w = weights.float() * (q.shape[-1] ** -0.5 * q.shape[-2] ** -0.5)
    qq, ww = quantize_indexer_query(qr, w, "fp8" if q_out.dtype == torch.float8_e4m3fn else "exact")
    q_out.copy_(qq.to(q_out.dtype))
    w_out.copy_(ww)


def block_size_of(cache: Tensor) -> int:
    return indexer_block_size(cache.shape[1]) if cache.dtype == torch.uint8 else cache.shape[1]


def entry_slots(block_table: Tensor, req: Tensor, entries: Tensor, block_size: int, pool_blocks: int) -> Tensor:
    """Global pool slot of entry `entries` of request `req` through the block table; -1 where the
    block is not allocated (or names a block past the pool: no entry)."""
    blocks = block_table[req.clamp(0, block_table.shape[0] - 1).long()[:, None], (entries // block_size).long()].long()
    return torch.where((blocks >= 0) & (blocks < pool_blocks), blocks * block_size + entries % block_size, -1)


def indexer_topk(q: Tensor, weights: Tensor, positions: Tensor, req_slots: Tensor, cache: Tensor,
                 block_table: Tensor, idx_out: Tensor, ratio: int) -> None:
    t, k = idx_out.shape
    bs = block_size_of(cache)
    n_max = block_table.shape[1] * bs
    entries = torch.arange(n_max, device=q.device)
    live = (req_slots >= 0) & (req_slots < block_table.shape[0])  # other slots: padding
    visible = (entries[None] < ((positions.long() + 1) // ratio)[:, None]) & live[:, None]
    slots = entry_slots(block_table, req_slots, entries[None].expand(t, -1), bs, cache.shape[0])
    visible &= slots >= 0
    slots = slots.where(visible, -1)
    keys = torch.empty(t * n_max, cache.shape[-1] if cache.dtype != torch.uint8 else q.shape[-1],
                       dtype=torch.float32, device=q.device)
    unpack_kv(cache, slots.reshape(-1), keys)
    scores = torch.einsum("thd,tnd->thn", q.float(), keys.view(t, n_max, -1)).relu()
    scores = (scores * weights.float()[..., None]).sum(1).masked_fill(~visible, float("-inf"))
    kk = min(k, n_max)
    best = stable_topk(scores, kk)
    chosen = slots.gather(1, best).where(visible.gather(1, best), -1)
    idx_out.fill_(-1)
    idx_out[:, :kk] = chosen.to(idx_out.dtype)
