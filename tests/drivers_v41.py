"""Drive the V4.1 stack's serving forward through a schedule of requests, collecting each index
source's selections and the candidate pools as entry indices."""

from __future__ import annotations

import torch

from dsv4ops.config_v41 import DSV41AttentionConfig
from dsv4ops.testing_v41 import slots_to_entries


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
