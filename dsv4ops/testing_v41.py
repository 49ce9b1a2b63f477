"""Test helpers of the V4.1 stack: map its selections back to entry indices, and compare selections
with the oracle's scores tie-aware (FP4 queries and keys with ReLU put exact ties at the top-k
cut-off often: spec pitfall 18)."""

from __future__ import annotations

import torch
from torch import Tensor

from dsv4ops.config_v41 import DSV41AttentionConfig


def slots_to_entries(slots: Tensor, table_row: Tensor, block_size: int) -> Tensor:
    """Entry indices of global pool slots of one request (its block-table row); -1 stays -1."""
    where = {int(b): i for i, b in enumerate(table_row.tolist()) if b >= 0}
    flat = [(-1 if s < 0 else where[s // block_size] * block_size + s % block_size) for s in slots.flatten().tolist()]
    return torch.tensor(flat, dtype=torch.long).view(slots.shape)


def check_selection(picked: Tensor, scores64: Tensor, scores_lowp: Tensor, what: str):
    """Tie-aware check of one index source's top-k rows (entries, -1 none) against the oracle's
    fp64 score rows [S, N] (-inf where it may not pick): as many picks as the oracle makes, no
    repeats, and every pick scores within a band of the oracle's k-th best, the band twice the
    largest score error of the oracle's low-precision run (the data decides what "a tie" is)."""
    band = 2 * (scores_lowp.double() - scores64).nan_to_num(posinf=0, neginf=0).abs().max().item()
    band += 1e-12 * scores64.nan_to_num(posinf=0, neginf=0).abs().max().item()
    for t in range(picked.shape[0]):
        row, sel = scores64[t], [e for e in picked[t].tolist() if e >= 0]
        finite = int((row > float("-inf")).sum())
        want = min(picked.shape[1], finite)
        assert len(sel) == want == len(set(sel)), f"{what} token {t}: {len(sel)} picks (unique {len(set(sel))}), " \
                                                  f"expected {want}"
        if not sel:
            continue
        kth = row.sort(descending=True).values[want - 1].item()
        worst = min(row[e].item() for e in sel)
        assert worst >= kth - band, f"{what} token {t}: a pick scores {worst:.6g} < the k-th best {kth:.6g} - {band:.3g}"


def check_pool(pool: Tensor, scores64: Tensor, scores_lowp: Tensor, cfg: DSV41AttentionConfig, what: str):
    """Tie-aware check of candidate pools [S, blocks] against the source's fp64 score rows: blocks
    in ascending order, the newest visible block among them, as many blocks as have a visible
    entry (up to the pool width), no repeats, every other block's max score within a band of the
    oracle's block at the cut-off."""
    cb, keep = cfg.candidate_block_size, pool.shape[1]
    band = 2 * (scores_lowp.double() - scores64).nan_to_num(posinf=0, neginf=0).abs().max().item()
    band += 1e-12 * scores64.nan_to_num(posinf=0, neginf=0).abs().max().item()
    n = scores64.shape[1]
    for t in range(pool.shape[0]):
        row = scores64[t]
        n_vis = int((row > float("-inf")).sum())
        blocks = [row[b * cb:(b + 1) * cb].max().item() for b in range(-(-n // cb))]
        picked = [b for b in pool[t].tolist() if b >= 0]
        if n_vis == 0:
            assert not picked, f"{what} token {t}: a pool without visible entries"
            continue
        newest = (n_vis - 1) // cb
        assert newest in picked, f"{what} token {t}: the newest block {newest} is not in the pool"
        assert picked == sorted(picked), f"{what} token {t}: blocks not in ascending order: {picked}"
        assert pool[t, len(picked):].eq(-1).all(), f"{what} token {t}: -1 fill not after the blocks"
        want = min(keep, sum(v > float("-inf") for v in blocks))
        assert len(picked) == want == len(set(picked)), f"{what} token {t}: {len(picked)} blocks, expected {want}"
        rest = sorted((v for b, v in enumerate(blocks) if b != newest), reverse=True)
        if want > 1:
            cut = rest[want - 2]
            assert min(blocks[b] for b in picked if b != newest) >= cut - band, \
                f"{what} token {t}: a block below the cut-off"
