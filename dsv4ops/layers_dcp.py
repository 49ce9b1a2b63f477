"""The layers' context-parallel steps that run dsv4:: ops on a rank's share (dsv4ops.parallel.dcp
explains the scheme): the indexer scores of a rank's candidates, recomputed for the merge of the
ranks' top-k, and the attention over a rank's share merged over the ranks. Both layer files take
the whole context-parallel vocabulary from here: these, and dsv4ops.parallel.dcp's index math.
The dsv4:: calls bypass the public functions' eager value checks, as the layers' own do."""

from __future__ import annotations

import torch
from torch import Tensor

from dsv4ops import ops  # noqa: F401  (defines the dsv4:: ops called below, as the layers call them)
from dsv4ops.parallel import all_gather
from dsv4ops.parallel.dcp import (Ownership, compact_slots, front, global_blocks, local_blocks, local_slots,
                                  merge_best, owned_count, slot_entries)

__all__ = ["attend", "block_scores", "entry_scores", "front", "global_blocks", "local_blocks", "local_slots",
           "merge_best", "owned_count", "slot_entries"]


# ---- the selection --------------------------------------------------------------------------------------
def entry_scores(q_values: Tensor, weights: Tensor, keys: Tensor, slots: Tensor, fmt: str) -> Tensor:
    """[T, k] fp32 sum_h w_h relu(q_h . key) of the keys at pool slots [T, k] (-1: -inf); q_values
    [T, H, d] fp32 (the prepared query's values), weights [T, H] (w_out of indexer_q_prep)."""
    t, k = slots.shape
    d = q_values.shape[-1]
    rows = torch.empty(t * k, d, dtype=torch.float32, device=slots.device)
    torch.ops.dsv4.unpack_kv(keys, slots.reshape(-1).contiguous(), rows, fmt)
    s = torch.einsum("thd,tkd->thk", q_values, rows.view(t, k, d)).relu()
    s = (s * weights.float()[..., None]).sum(1)
    return s.masked_fill(slots < 0, float("-inf"))


def block_scores(cand: Tensor, n_local: Tensor, q_values: Tensor, weights: Tensor, keys: Tensor, req: Tensor,
                 table: Tensor, cand_block: int, block_size: int, fmt: str) -> Tensor:
    """[T, blocks] fp32: the max score of the visible entries of each of this rank's candidate
    blocks `cand` (compact blocks, -1: none -> -inf)."""
    t, width = cand.shape
    c = cand.long()[..., None] * cand_block + torch.arange(cand_block, device=cand.device)
    valid = (cand >= 0)[..., None] & (c < n_local.long()[:, None, None])
    slots = compact_slots(c.clamp(min=0), valid, req, table, block_size).view(t, -1)
    return entry_scores(q_values, weights, keys, slots, fmt).view(t, width, cand_block).amax(-1)


# ---- attention ------------------------------------------------------------------------------------------
def attend(q: Tensor, window_cache: Tensor, comp_cache: Tensor, pos: Tensor, req: Tensor, comp_idx: Tensor,
           comp_lens: Tensor, window_ends: Tensor, sinks: Tensor, scale: float, window: int, ring_size: int,
           window_fmt: str, comp_fmt: str, own: Ownership) -> Tensor:
    """Sparse attention of a step whose entries are shared over the group: this rank's share (its
    listed entries comp_idx, and the windows of the tokens t with t % ranks == rank) without the
    sink, with its log-sum-exp; every rank's share all-gathered (one collective) and merged with the
    sink."""
    t = q.shape[0]
    mine = torch.arange(t, device=q.device) % own.size == own.rank
    ends = torch.where(mine, window_ends, -1)
    o = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    torch.ops.dsv4.sparse_attn(q, window_cache, comp_cache, pos, req, comp_idx, comp_lens, ends, sinks, o, scale,
                               window, ring_size, window_fmt, comp_fmt, lse)
    # One all-gather of both: lse's fp32 bits ride as 4 / itemsize more elements of o's last dim
    # (2 for bf16: [T, H, D + 2]); the copy into the packed rows costs less than a second collective
    # (~11 us of NCCL in a graph, issue 55).
    d = o.shape[-1]
    packed = torch.cat([o, lse.unsqueeze(-1).view(o.dtype)], -1)
    every = all_gather(packed, own.group)
    every_o = every[..., :d].contiguous()
    every_lse = every[..., d:].contiguous().view(torch.float32).squeeze(-1)
    out = torch.empty_like(q)
    torch.ops.dsv4.attn_merge(every_o, every_lse, sinks, out)
    return out
