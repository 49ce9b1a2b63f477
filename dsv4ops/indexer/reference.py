"""Reference kernels of the indexer ops.

`indexer_q_prep`: RoPE of the indexer query at the token position (the layer's table), head
weights x d^-1/2 x H^-1/2, and the query (with `hadamard`: rotated, quant.reference.rotate)
quantized per (token, head) row like keys of its format:
`fp8_132` folds the row's power-of-two scale into the weights (e4m3 q_out), `mxfp4_68` writes the
packed 68-B row (64 B of e2m1 nibbles, 4 UE8M0 bytes).
`indexer_k_prep` (V4.1 spec 2.4): the index key of each entry closed in the step,
RoPE_{w*m}(RMSNorm_{k_norm}(latent @ wk^T)), stored in the key pool.
`indexer_topk`: score_t[w] = sum_h w_h relu(q_h . K[w]) over the entries w < (t + 1) // ratio of
the token's request (read through its block table), or only over the entries of the token's
candidate blocks when `cand` is given (cost follows the candidates, V4.1 spec 2.7); top-k with
ties to the lower entry, written as global pool slots in ascending entry order; -1 fills the rest
and every row of a padding token. `cand_out` (V4.1 spec 2.6): from the same score row, block
b = entries [b * cand_block, (b + 1) * cand_block) scores the max of its entries, the block of the
newest visible entry scores +inf, the best blocks (ties to the lower block) are kept, blocks
scoring -inf are dropped (-1).
"""

import torch
import torch.nn.functional as F
from torch import Tensor

from dsv4ops.quant import codecs, formats
from dsv4ops.quant.reference import pack_kv, rotate, unpack_kv
from dsv4ops.reference.functional import apply_rope, candidate_blocks, rms_norm, rope_angles, stable_topk

MX4_ROW = formats.FORMATS["mxfp4_68"]


def indexer_q_prep(q: Tensor, weights: Tensor, positions: Tensor, inv_freq: Tensor, q_out: Tensor,
                   w_out: Tensor, fmt: str, hadamard: bool = False) -> None:
    t, h, d = q.shape
    cos, sin = rope_angles(positions, inv_freq, q.dtype)
    qr = apply_rope(q, cos[:, None], sin[:, None])
    if hadamard:
        qr = rotate(qr)
    w = weights.float() * (d**-0.5 * h**-0.5)
    if fmt == formats.EXACT:
        q_out.copy_(qr)
    else:
        data, scales = codecs.encode(fmt, qr.reshape(t * h, d))
        if fmt == "fp8_132":
            q_out.copy_(data.view(torch.float8_e4m3fn).view(t, h, d))
            w = w * scales.view(torch.float32).view(t, h)
        else:
            q_out.copy_(torch.cat([data, scales], 1).view(t, h, -1))
    w_out.copy_(w)


def query_values(q: Tensor) -> Tensor:
    """fp32 values of a prepared indexer query: float or e4m3 as is, a packed MX4 row decoded."""
    if q.dtype != torch.uint8:
        return q.float()
    t, h, _ = q.shape
    rows = q.reshape(t * h, -1)
    data, scales = rows[:, : MX4_ROW.data_bytes], rows[:, MX4_ROW.data_bytes:]
    return codecs.decode("mxfp4_68", data, scales).view(t, h, MX4_ROW.dim)


def closing_tokens(positions: Tensor, req_slots: Tensor, ratio: int) -> Tensor:
    """Indices of the live tokens (request >= 0, position >= 0) that close an entry
    ((p + 1) % ratio == 0)."""
    pos = positions.long()
    return ((req_slots >= 0) & (pos >= 0) & ((pos + 1) % ratio == 0)).nonzero().flatten()


def indexer_k_prep(latent: Tensor, positions: Tensor, req_slots: Tensor, entry_slots: Tensor, wk: Tensor,
                   k_norm_weight: Tensor, inv_freq: Tensor, cache: Tensor, ratio: int, eps: float, fmt: str) -> None:
    close = closing_tokens(positions, req_slots, ratio)
    if not close.numel():
        return
    lat = latent[close]
    k = rms_norm(F.linear(lat, wk.to(lat.dtype)), k_norm_weight, eps)
    cos, sin = rope_angles((positions[close].long() // ratio) * ratio, inv_freq, k.dtype)
    pack_kv(apply_rope(k, cos, sin), entry_slots[close], cache, fmt)


def entry_slots(block_table: Tensor, req: Tensor, entries: Tensor, block_size: int, pool_blocks: int) -> Tensor:
    """Global pool slot of entry `entries` of request `req` through the block table; -1 where the
    block is not allocated (or names a block past the pool: no entry)."""
    blocks = block_table[req.clamp(0, block_table.shape[0] - 1).long()[:, None], (entries // block_size).long()].long()
    return torch.where((blocks >= 0) & (blocks < pool_blocks), blocks * block_size + entries % block_size, -1)


def _candidate_entries(cand: Tensor, cand_block: int) -> Tensor:
    """[T, blocks * cand_block] entry indices of the candidate blocks (-1 for block -1)."""
    blocks = cand.long()[:, :, None]
    entries = blocks * cand_block + torch.arange(cand_block, device=cand.device)
    return entries.where(blocks >= 0, -1).flatten(1)


def indexer_topk(q: Tensor, weights: Tensor, positions: Tensor, req_slots: Tensor, cache: Tensor,
                 block_table: Tensor, cand: Tensor | None, idx_out: Tensor, cand_out: Tensor | None, ratio: int,
                 cand_block: int, fmt: str) -> None:
    t, k = idx_out.shape
    bs = formats.block_size(cache.shape, fmt)
    n_max = block_table.shape[1] * bs
    live = (req_slots >= 0) & (req_slots < block_table.shape[0])  # other slots: padding
    # Entries past the table's width do not exist (the kernels clamp alike).
    n_visible = torch.where(live, (positions.long() + 1) // ratio, 0).clamp(max=n_max)
    if cand is None:
        entries = torch.arange(n_max, device=q.device)[None].expand(t, -1)
    else:
        entries = _candidate_entries(cand, cand_block)
        # Columns in entry order (absent ones last): the stable sort below then breaks exact score
        # ties toward the lower entry whatever the order of the candidate blocks.
        entries = torch.sort(entries.where(entries >= 0, n_max + entries.shape[1]), dim=1, stable=True).values
    visible = (entries < n_visible[:, None]) & (entries < n_max)
    slots = entry_slots(block_table, req_slots, entries.clamp(0, max(n_max - 1, 0)), bs, cache.shape[0])
    visible &= slots >= 0
    slots = slots.where(visible, -1)
    e = entries.shape[1]
    keys = torch.empty(t * e, cache.shape[-1] if fmt == formats.EXACT else formats.get(fmt).dim,
                       dtype=torch.float32, device=q.device)
    unpack_kv(cache, slots.reshape(-1), keys, fmt)
    scores = torch.einsum("thd,ted->the", query_values(q), keys.view(t, e, keys.shape[-1])).relu()
    scores = (scores * weights.float()[..., None]).sum(1).masked_fill(~visible, float("-inf"))
    kk = min(k, e)
    best = stable_topk(scores, kk)
    picked = visible.gather(1, best)
    # The picked columns (in entry order) ascending, then the -1 fill.
    col = torch.where(picked, best, e).sort(dim=1).values
    chosen = slots.gather(1, col.clamp(max=max(e - 1, 0))).where(col < e, -1)
    idx_out.fill_(-1)
    idx_out[:, :kk] = chosen.to(idx_out.dtype)
    if cand_out is not None:
        cand_out.copy_(candidate_blocks(scores, n_visible, cand_block, cand_out.shape[1]).to(cand_out.dtype))
