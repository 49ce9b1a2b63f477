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
- "exact" (default): the ranks' candidates (score, global entry) are all-gathered and the top-k
  of all of them taken, ties to the lower entry: the top-k of the whole context, because each
  entry of the global top-k is in its owner's top-k. The scores are recomputed for the k candidates
  of a rank from their keys (sum_h w_h relu(q_h . k)), the indexer op's formula; their rounding may
  differ from the op's own, so entries whose scores tie within rounding may go either way (as
  between any two implementations of the indexer). V4.1's candidate pool is merged the same way:
  each rank proposes its best blocks (block max of its entries; one more than the pool's width,
  since a rank's own newest block is forced), the global newest block is forced, the best of all
  are kept.
- "union": each rank attends over its own top-k (up to ranks x k entries in all, and V4.1's
  reindex layers score inside their rank's own pool): no collective for the selection, but not
  the model's math (more entries than index_topk).

Attention. Each rank runs sparse_attn over its window share and its entries with `lse` (its output
normalized without the sink, and ln of its sum); the ranks' (out, lse) are all-gathered and
dsv4::attn_merge applies the sink once. An empty share gives zeros and -inf, and is not read.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch
from torch import Tensor

from dsv4ops.parallel import Group, all_gather

TOPK_MODES = ("exact", "union")
_NONE = torch.iinfo(torch.int32).max  # sorts after every entry


# ---- the plan every rank must share -----------------------------------------------------------------
def describe(x) -> object:
    """A representation of a planner argument that is the same on every rank for the same value."""
    if isinstance(x, Mapping):
        return [(repr(k), repr(v)) for k, v in x.items()]
    return (type(x).__name__, repr(x))


# A gloo group with the ranks of each NCCL group the managers use (by group name): made once, by
# the first manager of that group (a collective: every rank builds its managers in the same order).
_CPU_GROUPS: dict = {}


class Agreement:
    """Checks that the ranks of a group hold the same state: one all-gather of an 8-byte digest on
    a CPU group (gloo: the group itself, or one with its ranks), on the host, between steps: no
    device sync."""

    def __init__(self, process_group):
        import torch.distributed as dist

        self.size = dist.get_world_size(process_group)
        if dist.get_backend(process_group) == "gloo":
            self.group = process_group
        else:
            name = process_group.group_name
            if name not in _CPU_GROUPS:
                _CPU_GROUPS[name] = dist.new_group(dist.get_process_group_ranks(process_group), backend="gloo")
            self.group = _CPU_GROUPS[name]

    def check(self, what: str, state) -> None:
        """Raise on every rank unless every rank's `state` has the same repr."""
        import torch.distributed as dist

        digest = int.from_bytes(hashlib.sha256(repr(state).encode()).digest()[:8], "little", signed=True)
        mine = torch.tensor([digest], dtype=torch.int64)
        got = [torch.zeros_like(mine) for _ in range(self.size)]
        dist.all_gather(got, mine, group=self.group)
        digests = [int(t) for t in got]
        if len(set(digests)) > 1:
            rank = dist.get_rank(self.group)
            agree = [r for r, d in enumerate(digests) if d == digests[rank]]
            raise RuntimeError(f"{what}: the ranks of the context-parallel group disagree on the step (ranks {agree} "
                               f"agree with rank {rank}, of {self.size}); every rank must plan the same steps with "
                               f"the same arguments in the same order, on managers with the same history (admit, "
                               f"release, commit, abort, rewind, fork); nothing was changed")


def check_layout(model, cfg) -> None:
    """A V4.1 candidate block (candidate_block_size entries) must lie in one rank's block."""
    cb = getattr(model, "candidate_block_size", None)
    if cb and cfg.block_size % cb:
        raise ValueError(f"block_size: context parallelism keeps each candidate block of {cb} entries on one rank; "
                         f"expected a multiple of {cb}, got {cfg.block_size}")


# ---- ownership and the compact entries of a rank ----------------------------------------------------------
def owned_count(n: Tensor, block_size: int, group: Group) -> Tensor:
    """[T] int32: how many of the entries w < n[t] lie in this rank's blocks."""
    n = n.long()
    full, rem = n // block_size, n % block_size
    mine = (full - group.rank + group.size - 1).clamp(min=0) // group.size
    part = torch.where(full % group.size == group.rank, rem, 0)
    return (mine * block_size + part).to(torch.int32)


def compact_to_global(c: Tensor, block_size: int, group: Group) -> Tensor:
    """Global entry of this rank's compact entry c (c >= 0)."""
    return ((c // block_size) * group.size + group.rank) * block_size + c % block_size


def compact_slots(c: Tensor, valid: Tensor, req: Tensor, table: Tensor, block_size: int) -> Tensor:
    """This rank's pool slots of its compact entries c [T, ...] of each token's request (table: the
    rank's device block table); -1 where not `valid` or unallocated."""
    n_req, width = table.shape
    rows = req.clamp(0, n_req - 1).long().view(-1, *([1] * (c.dim() - 1)))
    blk = table[rows, (c // block_size).clamp(0, width - 1)].long()
    ok = valid & (blk >= 0) & (req >= 0).view(-1, *([1] * (c.dim() - 1)))
    return torch.where(ok, blk * block_size + c % block_size, -1).to(torch.int32)


def local_slots(entries: Tensor, req: Tensor, table: Tensor, block_size: int, group: Group) -> Tensor:
    """This rank's pool slots of global entries [T, k] (-1: none) of each token's request; -1 for
    the entries of other ranks' blocks."""
    e = entries.long()
    b = e.clamp(min=0) // block_size
    mine = (e >= 0) & (b % group.size == group.rank)
    c = (b // group.size) * block_size + e.clamp(min=0) % block_size
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


def merge_best(ids: Tensor, scores: Tensor, k: int, group: Group) -> Tensor:
    """The best k of every rank's candidates: ids [T, c] (-1: none) with scores [T, c] (-inf: not
    eligible) on each rank -> [T, k] int32, the chosen ids ascending, -1 after them; ties go to the
    lower id (the single-process ops' rule)."""
    t = ids.shape[0]
    every_id = all_gather(ids.to(torch.int32), group).permute(1, 0, 2).reshape(t, -1)
    every_score = all_gather(scores.float(), group).permute(1, 0, 2).reshape(t, -1)
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


def block_scores(cand: Tensor, n_local: Tensor, q_values: Tensor, weights: Tensor, keys: Tensor, req: Tensor,
                 table: Tensor, cand_block: int, block_size: int, fmt: str) -> Tensor:
    """[T, blocks] fp32: the max score of the visible entries of each of this rank's candidate
    blocks `cand` (compact blocks, -1: none -> -inf)."""
    t, width = cand.shape
    c = cand.long()[..., None] * cand_block + torch.arange(cand_block, device=cand.device)
    valid = (cand >= 0)[..., None] & (c < n_local.long()[:, None, None])
    slots = compact_slots(c.clamp(min=0), valid, req, table, block_size).view(t, -1)
    return entry_scores(q_values, weights, keys, slots, fmt).view(t, width, cand_block).amax(-1)


def global_blocks(cand: Tensor, cand_block: int, block_size: int, group: Group) -> Tensor:
    """Global candidate blocks of this rank's compact candidate blocks (-1 stays -1)."""
    g = compact_to_global(cand.long().clamp(min=0) * cand_block, block_size, group) // cand_block
    return torch.where(cand >= 0, g, -1).to(torch.int32)


def local_blocks(blocks: Tensor, cand_block: int, block_size: int, group: Group) -> Tensor:
    """This rank's compact candidate blocks of global candidate blocks [T, n] (ascending, -1 fill):
    the ones in its blocks, ascending, then -1."""
    e = blocks.long().clamp(min=0) * cand_block
    b = e // block_size
    mine = (blocks >= 0) & (b % group.size == group.rank)
    c = ((b // group.size) * block_size + e % block_size) // cand_block
    return front(torch.where(mine, c, -1).to(torch.int32))[0]


# ---- attention ------------------------------------------------------------------------------------------
def attend(q: Tensor, window_cache: Tensor, comp_cache: Tensor, pos: Tensor, req: Tensor, comp_idx: Tensor,
           comp_lens: Tensor, window_ends: Tensor, sinks: Tensor, scale: float, window: int, ring_size: int,
           window_fmt: str, comp_fmt: str, group: Group) -> Tensor:
    """Sparse attention of a step whose entries are shared over the group: this rank's share (its
    listed entries comp_idx, and the windows of the tokens t with t % ranks == rank) without the
    sink, with its log-sum-exp; every rank's share all-gathered and merged with the sink."""
    t = q.shape[0]
    mine = torch.arange(t, device=q.device) % group.size == group.rank
    ends = torch.where(mine, window_ends, -1)
    o = torch.empty_like(q)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device)
    torch.ops.dsv4.sparse_attn(q, window_cache, comp_cache, pos, req, comp_idx, comp_lens, ends, sinks, o, scale,
                               window, ring_size, window_fmt, comp_fmt, lse)
    out = torch.empty_like(q)
    torch.ops.dsv4.attn_merge(all_gather(o, group), all_gather(lse, group), sinks, out)
    return out
