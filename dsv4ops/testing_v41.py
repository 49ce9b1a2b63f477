"""Test helpers of the V4.1 stack: drive the serving forward through a schedule, map its selections
back to entry indices, and compare selections with the oracle's scores tie-aware (FP4 queries and
keys with ReLU put exact ties at the top-k cut-off often: spec pitfall 18)."""

from __future__ import annotations

import torch
from torch import Tensor

from dsv4ops.config_v41 import DSV41AttentionConfig


def slots_to_entries(slots: Tensor, table_row: Tensor, block_size: int) -> Tensor:
    """Entry indices of global pool slots of one request (its block-table row); -1 stays -1."""
    where = {int(b): i for i, b in enumerate(table_row.tolist()) if b >= 0}
    flat = [(-1 if s < 0 else where[s // block_size] * block_size + s % block_size) for s in slots.flatten().tolist()]
    return torch.tensor(flat, dtype=torch.long).view(slots.shape)


def serve_schedule(stack, manager, inputs: dict, schedule: list[dict], garbage: torch.Generator | None = None):
    """Run `schedule` (steps of {request: new tokens}) through the stack's serving forward, layer
    inputs taken from inputs[request] [num_layers, length, hidden] in order. Returns (outputs
    {request: [num_layers, length, hidden]}, topk {request: {index source: [length, k] entries}},
    pools {request: {candidate source: [length, blocks]}}). Requests are admitted on first
    appearance; each step is planned and committed with `with manager.step(...)`. With `garbage`, padding tokens get random rows and positions (they must read and
    write nothing)."""
    cfg: DSV41AttentionConfig = stack.config
    bs = manager.cfg.block_size
    done = {rid: 0 for rid in inputs}
    outs = {rid: [] for rid in inputs}
    topk = {rid: {} for rid in inputs}
    pools = {rid: [] for rid in inputs}
    for new in schedule:
        for rid in new:
            if rid not in manager.slot_of:
                manager.admit(rid)
        with manager.step(new) as step:
            xs = torch.cat([inputs[rid][:, done[rid]:done[rid] + n] for rid, n in new.items()], 1)
            pad = step.positions.shape[0] - xs.shape[1]
            if garbage is None:
                xs = torch.cat([xs, xs.new_zeros(xs.shape[0], pad, xs.shape[2])], 1)
            else:
                xs = torch.cat([xs, torch.randn(xs.shape[0], pad, xs.shape[2], generator=garbage).to(xs)], 1)
                step.positions[xs.shape[1] - pad:] = torch.randint(0, 1000, (pad,), generator=garbage).to(step.positions)
            published = {}
            ys = stack(xs, step, published)
        i = 0
        for rid, n in new.items():
            outs[rid].append(ys[:, i:i + n])
            slot = manager.slot_of[rid]
            for key, idx in published.items():
                if isinstance(key, tuple):
                    m = cfg.role(key[1]).ratio
                    row = step.block_table(m)[slot].cpu()
                    topk[rid].setdefault(key[1], []).append(slots_to_entries(idx[i:i + n].cpu(), row, bs))
            if "pool" in published:
                pools[rid].append(published["pool"][i:i + n].long().cpu())
            done[rid] += n
            i += n
    cand = cfg.candidate_source_layer
    return ({rid: torch.cat(v, 1) for rid, v in outs.items()},
            {rid: {k: torch.cat(v) for k, v in d.items()} for rid, d in topk.items()},
            {rid: ({cand: torch.cat(v)} if v else {}) for rid, v in pools.items()})


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
