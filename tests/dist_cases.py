"""The serving scenario the tensor- and context-parallel tests run on every rank and in one process:
mixed prefill and decode steps, a verify step whose rejected drafts are rewound, and a fork that
continues from a prefix of another request (copy on write included)."""

from __future__ import annotations

import torch

# Steps {request: (tokens, kept)} (the tokens past `kept` are rejected drafts, rewound after the
# step) and forks (parent, child, length). Request a is forked at 100 while it stands at 104
# (behind by 4: max_draft_tokens >= 4); c then writes entries into the block it shares with a.
PLAN = [
    ("step", {"a": (64, 64)}),
    ("step", {"a": (40, 40), "b": (30, 30)}),
    ("fork", "a", "c", 100),
    ("step", {"a": (4, 2), "b": (1, 1), "c": (20, 20)}),
    ("step", {"a": (1, 1), "b": (3, 1), "c": (1, 1)}),
    ("step", {"a": (30, 30), "c": (1, 1)}),
    ("step", {"a": (1, 1), "b": (1, 1), "c": (5, 3)}),
]
MAX_DRAFT = 5


def lengths(plan=PLAN) -> dict:
    """Tokens each request ends with (a fork's prefix included)."""
    n = {}
    for op in plan:
        if op[0] == "fork":
            n[op[2]] = op[3]
        else:
            for r, (_, kept) in op[1].items():
                n[r] = n.get(r, 0) + kept
    return n


def inputs(hidden: int, seed: int, layers: int | None = None, plan=PLAN) -> dict:
    """Each request's accepted rows [(layers,) length, hidden]; a fork's first rows are its parent's."""
    g = torch.Generator().manual_seed(seed)
    lead = () if layers is None else (layers,)
    out = {r: torch.randn(*lead, n, hidden, generator=g) for r, n in lengths(plan).items()}
    for op in plan:
        if op[0] == "fork":
            _, parent, child, at = op
            out[child][..., :at, :] = out[parent][..., :at, :]
    return out


def serve(fn, manager, rows: dict, plan=PLAN, seed: int = 1, on_step=None) -> dict:
    """Run `plan` through fn(x, step) (x [(layers,) bucket, hidden], the step's flat batch padded to
    its bucket): each step's kept tokens are the requests' next rows, its drafts random rows, and
    after the step commits each request is rewound by its rejected drafts. Requests are admitted on
    first appearance. on_step(step, spec), if given, runs after each forward (spec: the step's
    {request: (tokens, kept)} in batch order). Returns {request:
    outputs of its kept tokens [(layers,) kept, hidden]} (a fork's from the fork point)."""
    garbage = torch.Generator().manual_seed(seed)
    done = {r: 0 for r in rows}
    outs = {r: [] for r in rows}
    for op in plan:
        if op[0] == "fork":
            _, parent, child, at = op
            manager.fork(parent, child, at)
            done[child] = at
            continue
        spec = op[1]
        for r in spec:
            if r not in manager.slot_of:
                manager.admit(r)
        new = {r: n for r, (n, _) in spec.items()}
        with manager.step(new) as step:
            parts = []
            for r, (n, kept) in spec.items():
                x = rows[r]
                parts.append(x[..., done[r]:done[r] + kept, :])
                parts.append(torch.randn(*x.shape[:-2], n - kept, x.shape[-1], generator=garbage).to(x))
            x = torch.cat(parts, -2)
            pad = step.positions.shape[0] - x.shape[-2]
            x = torch.cat([x, x.new_zeros(*x.shape[:-2], pad, x.shape[-1])], -2)
            y = fn(x, step)
            if on_step is not None:
                on_step(step, spec)
        i = 0
        for r, (n, kept) in spec.items():
            outs[r].append(y[..., i:i + kept, :])
            done[r] += kept
            i += n
        for r, (n, kept) in spec.items():
            manager.rewind(r, n - kept)
    return {r: torch.cat(v, -2) for r, v in outs.items()}


def kept_rows(t: torch.Tensor, spec: dict) -> dict:
    """{request: rows of its kept tokens} of a per-token tensor [T, ...] of a step (spec as above)."""
    out, i = {}, 0
    for r, (n, kept) in spec.items():
        out[r] = t[i:i + kept]
        i += n
    return out
