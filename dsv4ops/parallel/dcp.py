"""Decode context parallelism: each rank of a group keeps the blocks of compressed entries (and V4.1
index keys) it owns, attends over them, and the ranks' partial outputs are merged exactly.

Ownership. Block b of a request's entries (entries b x block_size .. (b + 1) x block_size - 1) lives
on rank b % ranks (interleaved, so every rank holds about 1 / ranks of every request's context, and
a decode step's new entry lands on one rank). A rank's device block table lists its own blocks:
column j is block j x ranks + rank (KVCacheManager). Its entries in that order are the rank's
"compact" entries c = j x block_size + o <-> global entry (j x ranks + rank) x block_size + o, in
increasing global order, so the ops run on a rank's share as on a context of its own: the entries
w < n visible to a token are, on a rank, its compact entries c < owned_count(n), and the ops take
positions n_local - 1 with ratio 1 (visible_entries, indexer_topk).

Window rings and compressor states are replicated (every rank runs the compressors on every token;
only the owner of an entry's block stores the entry). A token's window is attended on one rank,
rank t % ranks (the others pass window end -1: no window).

Top-k (CSA, V4.1 index sources). Each rank selects the top-k of its own entries (indexer_topk), then:
- "exact" (default): the ranks' candidates (score, global entry) are all-gathered (one collective:
  merge_best) and the top-k of all of them taken, ties to the lower entry: the top-k of the whole
  context, because each entry of the global top-k is in its owner's top-k. The scores are recomputed for
  the k candidates of a rank from their keys (sum_h w_h relu(q_h . k)), the indexer op's formula; their
  rounding may differ from the op's own, so entries whose scores tie within rounding may go either way
  (as between any two implementations of the indexer). V4.1's candidate pool is merged the same way:
  each rank proposes its best blocks (block max of its entries; one more than the pool's width, since a
  rank's own newest block is forced), the global newest block is forced, the best of all are kept.
- "union": each rank attends over its own top-k (up to ranks x k entries in all, and V4.1's
  reindex layers score inside their rank's own pool): no collective for the selection, but not
  the model's math (more entries than index_topk).

Attention. Each rank runs sparse_attn over its window share and its entries with `lse` (its output
normalized without the sink, and ln of its sum); the ranks' (out, lse) are all-gathered and
dsv4::attn_merge applies the sink once (one collective of both). A V4 CSA layer step makes two
collectives, an HCA step one. An empty share gives zeros and -inf, and is not read.

This module is index math and collectives only (plain torch): what runs dsv4:: ops on a rank's
share (the candidates' scores, the merged attention) is the layers', in dsv4ops.layers_dcp.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import Tensor

from dsv4ops.parallel import Group, agreement, all_gather

TOPK_MODES = ("exact", "union")
_NONE = torch.iinfo(torch.int32).max  # sorts after every entry


# ---- the plan every rank must share -----------------------------------------------------------------
def describe(x) -> object:
    """A representation of a planner argument that is the same on every rank for the same value."""
    if isinstance(x, Mapping):
        return [(repr(k), repr(v)) for k, v in x.items()]
    return (type(x).__name__, repr(x))


_HINT = ("; every rank must build the same managers and layers, and plan the same steps with the same arguments in "
         "the same order, on managers with the same history (admit, release, commit, abort, rewind, fork)")


# ---- ownership and the compact entries of a rank ----------------------------------------------------------
class Ownership:
    """Which rank holds which block of a request's compressed entries: block b on rank b % size,
    where it is local block b // size (block ids: local block x size + rank). A cache manager, and
    every cache attached to it, holds one. `Ownership()` (no group) is one rank: rank 0 of 1 holds
    every block, each formula of this module is the identity and `agree` / `check_layout` check
    nothing, so the planner and the pools have one path. `group` (a Group, None on one rank) is what
    the collectives take."""

    def __init__(self, dcp_group=None, what: str = "dcp_group"):
        self.group = Group.of(dcp_group, what)
        self.rank, self.size = (0, 1) if self.group is None else (self.group.rank, self.group.size)

    def __repr__(self) -> str:
        return f"Ownership(rank={self.rank}, size={self.size})"

    def agree(self, what: str, state: dict, config=None, hint: str = _HINT) -> None:
        """Raise on every rank unless every rank's `state` (and model `config`) is the same, and on a
        rank the others do not join within agreement.timeout_s (dsv4ops.parallel.agreement: one
        8-byte all-gather on the host, no device sync); one rank: nothing."""
        if self.group is not None:
            agreement.check(self.group, "context-parallel", what, state, config, hint)

    def check_layout(self, model, cfg) -> None:
        """A V4.1 candidate block (candidate_block_size entries) must lie in one rank's block."""
        cb = getattr(model, "candidate_block_size", None)
        if self.size > 1 and cb and cfg.block_size % cb:
            raise ValueError(f"block_size: context parallelism keeps each candidate block of {cb} entries on one "
                             f"rank; expected a multiple of {cb}, got {cfg.block_size}")


def owned_count(n: Tensor, block_size: int, own: Ownership) -> Tensor:
    """[T] int32: how many of the entries w < n[t] lie in this rank's blocks."""
    n = n.long()
    full, rem = n // block_size, n % block_size
    mine = (full - own.rank + own.size - 1).clamp(min=0) // own.size
    part = torch.where(full % own.size == own.rank, rem, 0)
    return (mine * block_size + part).to(torch.int32)


def compact_to_global(c: Tensor, block_size: int, own: Ownership) -> Tensor:
    """Global entry of this rank's compact entry c (c >= 0)."""
    return ((c // block_size) * own.size + own.rank) * block_size + c % block_size


def compact_slots(c: Tensor, valid: Tensor, req: Tensor, table: Tensor, block_size: int) -> Tensor:
    """This rank's pool slots of its compact entries c [T, ...] of each token's request (table: the
    rank's device block table); -1 where not `valid` or unallocated."""
    n_req, width = table.shape
    rows = req.clamp(0, n_req - 1).long().view(-1, *([1] * (c.dim() - 1)))
    blk = table[rows, (c // block_size).clamp(0, width - 1)].long()
    ok = valid & (blk >= 0) & (req >= 0).view(-1, *([1] * (c.dim() - 1)))
    return torch.where(ok, blk * block_size + c % block_size, -1).to(torch.int32)


def local_slots(entries: Tensor, req: Tensor, table: Tensor, block_size: int, own: Ownership) -> Tensor:
    """This rank's pool slots of global entries [T, k] (-1: none) of each token's request; -1 for
    the entries of other ranks' blocks."""
    e = entries.long()
    b = e.clamp(min=0) // block_size
    mine = (e >= 0) & (b % own.size == own.rank)
    c = (b // own.size) * block_size + e.clamp(min=0) % block_size
    return compact_slots(c, mine, req, table, block_size)


def slot_entries(slots: Tensor, block_index: Tensor, block_size: int) -> Tensor:
    """Global entries (of their requests) of this rank's pool slots (-1: none), through the
    manager's block_index (each local block's index in its request's block table)."""
    s = slots.long()
    b = block_index[(s.clamp(min=0) // block_size).clamp(max=block_index.shape[0] - 1)].long()
    return torch.where((s >= 0) & (b >= 0), b * block_size + s.clamp(min=0) % block_size, -1).to(torch.int32)


def front(slots: Tensor) -> tuple[Tensor, Tensor]:
    """(slots with the valid ones (>= 0) first, in their order; the count of valid ones [T] int32):
    a key list whose cost follows the count."""
    order = torch.sort((slots < 0).to(torch.int8), dim=1, stable=True).indices
    return slots.gather(1, order), (slots >= 0).sum(1).to(torch.int32)


# ---- the selection --------------------------------------------------------------------------------------
def merge_best(ids: Tensor, scores: Tensor, k: int, own: Ownership) -> Tensor:
    """The best k of every rank's candidates: ids [T, c] (-1: none) with scores [T, c] (-inf: not
    eligible) on each rank -> [T, k] int32, the chosen ids ascending, -1 after them; ties go to the
    lower id (the single-process ops' rule). One all-gather of [T, 2c] fp32 (scores, then the ids'
    bits): a layer step's context-parallel collectives are this and attend's (out, lse)."""
    t, c = ids.shape
    # One all-gather of both: the ids' int32 bits ride in the fp32 buffer (a collective copies bytes).
    packed = torch.cat([scores.float(), ids.to(torch.int32).view(torch.float32)], 1)
    every = all_gather(packed, own.group).permute(1, 0, 2)
    every_score = every[..., :c].reshape(t, -1)
    every_id = every[..., c:].contiguous().view(torch.int32).reshape(t, -1)
    ok = (every_id >= 0) & (every_score > float("-inf"))
    key = torch.where(ok, every_id, _NONE)
    by_id = torch.sort(key, dim=1, stable=True)
    score = torch.where(by_id.values < _NONE, every_score.gather(1, by_id.indices), float("-inf"))
    best = torch.sort(score, dim=1, descending=True, stable=True).indices[:, :k]
    chosen = by_id.values.gather(1, best)
    chosen = torch.sort(chosen, dim=1).values
    out = torch.where(chosen < _NONE, chosen, -1)
    if out.shape[1] < k:
        out = torch.cat([out, out.new_full((t, k - out.shape[1]), -1)], 1)
    return out.to(torch.int32)


def global_blocks(cand: Tensor, cand_block: int, block_size: int, own: Ownership) -> Tensor:
    """Global candidate blocks of this rank's compact candidate blocks (-1 stays -1)."""
    g = compact_to_global(cand.long().clamp(min=0) * cand_block, block_size, own) // cand_block
    return torch.where(cand >= 0, g, -1).to(torch.int32)


def local_blocks(blocks: Tensor, cand_block: int, block_size: int, own: Ownership) -> Tensor:
    """This rank's compact candidate blocks of global candidate blocks [T, n] (ascending, -1 fill):
    the ones in its blocks, ascending, then -1."""
    e = blocks.long().clamp(min=0) * cand_block
    b = e // block_size
    mine = (blocks >= 0) & (b % own.size == own.rank)
    c = ((b // own.size) * block_size + e % block_size) // cand_block
    return front(torch.where(mine, c, -1).to(torch.int32))[0]
