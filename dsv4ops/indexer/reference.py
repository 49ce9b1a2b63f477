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

from dsv4ops.invariant_linear.reference import invariant_linear
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
                   k_norm_weight: Tensor, inv_freq: Tensor, cache: Tensor, ratio: int, eps: float, fmt: str,
                   batch_invariant: bool = False) -> None:
    close = closing_tokens(positions, req_slots, ratio)
    if not close.numel():
        return
    lat = latent[close]
    if batch_invariant:  # the CPU's GEMM picks its kernel by M, here the step's closing tokens
        k = torch.empty(lat.shape[0], wk.shape[0], dtype=lat.dtype, device=lat.device)
        invariant_linear(lat, wk.to(lat.dtype), k)
    else:
        k = F.linear(lat, wk.to(lat.dtype))
    k = rms_norm(k, k_norm_weight, eps)
    cos, sin = rope_angles((positions[close].long() // ratio) * ratio, inv_freq, k.dtype)
    pack_kv(apply_rope(k, cos, sin), entry_slots[close], cache, fmt)


def entry_slots(block_table: Tensor, req: Tensor, entries: Tensor, block_size: int, pool_blocks: int) -> Tensor:
    """Global pool slot of entry `entries` of request `req` through the block table; -1 where the
    block is not allocated (or names a block past the pool: no entry)."""
    blocks = block_table[req.clamp(0, block_table.shape[0] - 1).long()[:, None], (entries // block_size).long()].long()
    return torch.where((blocks >= 0) & (blocks < pool_blocks), blocks * block_size + entries % block_size, -1)


# Elements of one chunk's score rows [tokens, heads, columns] (or gathered keys [tokens, columns,
# d]): 2^22 fp32 = 16 MiB. A request's tokens are scored a chunk at a time over the entries they see
# (its keys read once), so the reference's memory and time follow the real context, never the block
# table's width (max_context / ratio entries: at 1M positions and ratio 4, 262144 columns a token).
_CHUNK_ELEMENTS = 1 << 22


def _candidate_entries(cand: Tensor, cand_block: int) -> Tensor:
    """[T, blocks * cand_block] entry indices of the candidate blocks (-1 for block -1)."""
    blocks = cand.long()[:, :, None]
    entries = blocks * cand_block + torch.arange(cand_block, device=cand.device)
    return entries.where(blocks >= 0, -1).flatten(1)


def _top_slots(scores: Tensor, visible: Tensor, slots: Tensor, k: int) -> Tensor:
    """[n, min(k, columns)] the slots of the k best visible columns (exact ties to the lower column),
    in column order, -1 after them."""
    e = scores.shape[1]
    best = stable_topk(scores, min(k, e))
    picked = visible.gather(1, best)
    col = torch.where(picked, best, e).sort(dim=1).values
    return slots.gather(1, col.clamp(max=max(e - 1, 0))).where(col < e, -1)


def indexer_topk(q: Tensor, weights: Tensor, positions: Tensor, req_slots: Tensor, cache: Tensor,
                 block_table: Tensor, cand: Tensor | None, idx_out: Tensor, cand_out: Tensor | None, ratio: int,
                 cand_block: int, fmt: str) -> None:
    k = idx_out.shape[1]
    bs = formats.block_size(cache.shape, fmt)
    n_max = block_table.shape[1] * bs
    live = (req_slots >= 0) & (req_slots < block_table.shape[0])  # other slots: padding
    # Entries past the table's width do not exist (the kernels clamp alike).
    n_visible = torch.where(live, (positions.long() + 1) // ratio, 0).clamp(0, n_max)
    idx_out.fill_(-1)
    if cand_out is not None:
        cand_out.fill_(-1)
    qv, w = query_values(q), weights.float()
    heads = qv.shape[1]
    key_width = cache.shape[-1] if fmt == formats.EXACT else formats.get(fmt).dim
    for r in req_slots[n_visible > 0].unique().tolist():
        tokens = ((req_slots == r) & (n_visible > 0)).nonzero().flatten()
        req = req_slots[tokens[:1]]
        if cand is None:  # every visible entry: the request's keys, read once for all its tokens
            n = int(n_visible[tokens].max())
            entries = torch.arange(n, device=q.device)
            slots = entry_slots(block_table, req, entries[None], bs, cache.shape[0])
            keys = torch.empty(n, key_width, dtype=torch.float32, device=q.device)
            unpack_kv(cache, slots[0], keys, fmt)
            step = max(1, _CHUNK_ELEMENTS // (n * heads))
        else:  # the candidates of each token (cand.shape[1] * cand_block columns at most)
            step = max(1, _CHUNK_ELEMENTS // (cand.shape[1] * cand_block * max(heads, key_width)))
        for chunk in tokens.split(step):
            seen = n_visible[chunk, None]
            if cand is None:
                scores = torch.einsum("thd,ed->the", qv[chunk], keys)
                visible = (entries[None] < seen) & (slots >= 0)
                chunk_slots = slots.expand(len(chunk), -1)
            else:
                # Columns in entry order (absent ones last): the stable sort of the top-k then breaks
                # exact score ties toward the lower entry whatever the order of the candidate blocks.
                # The visible entries come first, so only as many columns as a token sees are read.
                ce = _candidate_entries(cand[chunk], cand_block)
                ce = torch.sort(ce.where(ce >= 0, n_max + ce.shape[1]), dim=1, stable=True).values
                ce = ce[:, : max(int((ce < seen).sum(1).max()), 1)]
                chunk_slots = entry_slots(block_table, req.expand(len(chunk)), ce.clamp(0, max(n_max - 1, 0)), bs,
                                          cache.shape[0])
                visible = (ce < seen) & (chunk_slots >= 0)
                chunk_slots = chunk_slots.where(visible, -1)
                keys_t = torch.empty(chunk_slots.numel(), key_width, dtype=torch.float32, device=q.device)
                unpack_kv(cache, chunk_slots.reshape(-1), keys_t, fmt)
                scores = torch.einsum("thd,ted->the", qv[chunk], keys_t.view(*ce.shape, key_width))
            scores = (scores.relu() * w[chunk, :, None]).sum(1).masked_fill(~visible, float("-inf"))
            top = _top_slots(scores, visible, chunk_slots.where(visible, -1), k)
            idx_out[chunk, : top.shape[1]] = top.to(idx_out.dtype)
            if cand_out is not None:
                blocks = candidate_blocks(scores, n_visible[chunk], cand_block, cand_out.shape[1])
                cand_out[chunk] = blocks.to(cand_out.dtype)
