"""The serving scenario the tensor- and context-parallel tests run on every rank and in one process:
mixed prefill and decode steps, a verify step whose rejected drafts are rewound, and a fork that
continues from a prefix of another request (copy on write included)."""

from __future__ import annotations

import torch

import drivers
from dsv4ops import testing
from dsv4ops.reference.v41 import stack_attention
from dsv4ops.testing_v41 import check_pool, check_selection, slots_to_entries

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
        drivers.serve_step(fn, manager, rows, op[1], done, outs, garbage, on_step)
    return {r: torch.cat(v, -2) for r, v in outs.items()}


def kept_rows(t: torch.Tensor, spec: dict) -> dict:
    """{request: rows of its kept tokens} of a per-token tensor [T, ...] of a step (spec as above)."""
    out, i = {}, 0
    for r, (n, kept) in spec.items():
        out[r] = t[i:i + kept]
        i += n
    return out


def serve_v41(stack, manager, block: int):
    """Attach `manager` to the V4.1 stack and run the scenario: (rows, outputs, {request: {layer:
    selected entry ids of its kept tokens}}, {request: candidate pool rows}). A context-parallel
    manager publishes entry ids; one that holds every entry publishes pool slots (mapped here)."""
    cfg = stack.config
    stack.attach_cache(manager)
    rows = inputs(cfg.hidden_size, seed=3, layers=cfg.num_layers)
    topk, pools, published = {r: {} for r in rows}, {r: [] for r in rows}, {}

    def fn(x, step):
        return stack(x, step, published)

    def record(step, spec):
        for key, idx in published.items():
            if isinstance(key, tuple):
                table = step.block_table(cfg.role(key[1]).ratio)
                for r, s in kept_rows(idx, spec).items():
                    if manager.dcp.size == 1:
                        s = slots_to_entries(s, table[manager.slot_of[r]].cpu(), block)
                    topk[r].setdefault(key[1], []).append(s.long())
        for r, s in kept_rows(published["pool"], spec).items():
            pools[r].append(s.long())

    with torch.no_grad():
        outs = serve(fn, manager, rows, on_step=record)
    return rows, outs, {r: {k: torch.cat(v) for k, v in d.items()} for r, d in topk.items()}, \
        {r: torch.cat(v) for r, v in pools.items()}


def check_v41_oracle(stack, numerics, lowp: torch.dtype, rows: dict, outs: dict, topk: dict, pools: dict,
                     who: str) -> dict:
    """Hold each request's outputs of the scenario (serve_v41's) to the float64 oracle of `stack`'s
    weights on the selections and candidate pools the run made (a fork's prefix: its parent's),
    within the budget of a `lowp` run of the oracle; check every selection and pool against the
    oracle's scores. Returns {request: its budget}."""
    cfg = stack.config
    p32 = dict(stack.named_parameters())
    p64 = {k: v.double() for k, v in p32.items()}
    plow = {k: v if k.endswith(("sinks", "norm.weight")) else v.to(lowp) for k, v in p32.items()}
    fork = next(op for op in PLAN if op[0] == "fork")
    budgets = {}
    for r, x in rows.items():
        start = fork[3] if r == fork[2] else 0
        sel = {k: v[None] for k, v in topk[r].items()}
        pool = {cfg.candidate_source_layer: pools[r][None]}
        if start:
            p = fork[1]
            sel = {k: torch.cat([topk[p][k][None, :start], v], 1) for k, v in sel.items()}
            pool = {k: torch.cat([pools[p][None, :start], v], 1) for k, v in pool.items()}
        ref64 = stack_attention(p64, cfg, x[:, None].double(), numerics, sel, pool)
        low = stack_attention(plow, cfg, x[:, None].to(lowp), numerics, sel, pool)
        _, budgets[r] = testing.assert_close_to_ref(outs[r], ref64.y[:, 0, start:], low.y[:, 0, start:],
                                                    what=f"{who} request {r}")
        for layer, picked in sel.items():
            check_selection(picked[0], ref64.scores[layer][0], low.scores[layer][0], f"request {r} layer {layer}")
        for layer, pk in pool.items():
            check_pool(pk[0], ref64.scores[layer][0], low.scores[layer][0], cfg, f"request {r} pool")
    return budgets


def torchrun_demo(mode: str) -> str:
    """stdout of `torchrun --nproc-per-node 2 -m dsv4ops --parallel <mode>` on 2 CPU processes (gloo),
    small dims; fails with both streams' tails where it exits non-zero."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    env["CUDA_VISIBLE_DEVICES"] = ""
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                          "-m", "dsv4ops", "--parallel", mode, "--requests", "2", "--context", "140", "--step-tokens",
                          "64", "--layers", "3"], capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    return run.stdout
