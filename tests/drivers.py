"""Drive a V4 layer's (or any serving forward's) steps through a schedule of requests: plain
continuous batching and speculative decoding with rewinds."""

from __future__ import annotations

import torch

from dsv4ops.testing import recorded_selections


def serve_schedule(layer, manager, inputs: dict, schedule: list[dict], garbage: torch.Generator | None = None,
                   selections: dict | None = None) -> dict:
    """Run `schedule` (steps of {request_id: new tokens}) through the layer's serving forward, with
    x rows taken from `inputs[request_id]` [L, hidden] in order, each step planned and committed with
    `with manager.step(...)`. Returns {request_id: [L, hidden]} outputs. Requests are admitted on
    first appearance. With `garbage`, padding tokens get random rows and random positions (they
    must still read and write nothing). With a dict `selections`, a CSA layer's indexer selection
    of each request is stored there ({request_id: [L, index_topk] entry indices})."""
    done = {rid: 0 for rid in inputs}
    outs = {rid: [] for rid in inputs}
    sels = {rid: [] for rid in inputs}
    for new in schedule:
        for rid in new:
            if rid not in manager.slot_of:
                manager.admit(rid)
        with manager.step(new) as step:
            rows = [inputs[rid][done[rid]:done[rid] + n] for rid, n in new.items()]
            x = torch.cat(rows)
            pad = step.positions.shape[0] - x.shape[0]
            if garbage is None:
                x = torch.cat([x, x.new_zeros(pad, x.shape[1])])
            else:
                x = torch.cat([x, torch.randn(pad, x.shape[1], generator=garbage).to(x)])
                step.positions[x.shape[0] - pad:] = torch.randint(0, 1000, (pad,), generator=garbage).to(step.positions)
            with recorded_selections() as log:
                y = layer(x, step)
        i = 0
        for rid, n in new.items():
            outs[rid].append(y[i:i + n])
            if log:
                sels[rid].append(log[-1][i:i + n])
            done[rid] += n
            i += n
    if selections is not None:
        selections.update({rid: torch.cat(v) for rid, v in sels.items() if v})
    return {rid: torch.cat(v) for rid, v in outs.items()}


def decode_after(lengths: dict, prefill: int) -> list[dict]:
    """A schedule (steps of {request: tokens}) that prefills min(prefill, length) tokens of every
    request in one step, then decodes the rest one token a step."""
    steps = [{rid: min(prefill, n) for rid, n in lengths.items()}]
    left = {rid: n - min(prefill, n) for rid, n in lengths.items()}
    while any(left.values()):
        steps.append({rid: 1 for rid in lengths if left[rid]})
        left = {rid: max(0, v - 1) for rid, v in left.items()}
    return steps


def speculative_schedule(lengths: dict, max_draft: int, seed: int, prefill: dict | None = None) -> list[dict]:
    """A random speculative-decoding schedule: steps of {request: (tokens, kept)}. A request first
    brings its `prefill` chunk (if any), then each step either a verify of 1 + k tokens (k in
    0..max_draft, a draft of k; kept = 1 + the accepted drafts, at random) or a chunk of 2..9 tokens
    (all kept); requests sit out steps at random. The kept tokens of a request add up to its length."""
    import random

    rng = random.Random(seed)
    left = dict(lengths)
    steps = []
    first = dict(prefill or {})
    while any(left.values()):
        active = [r for r, n in left.items() if n and rng.random() < 0.75] or [r for r, n in left.items() if n]
        step = {}
        for r in active:
            if r in first:
                n = kept = min(first.pop(r), left[r])
            elif rng.random() < 0.8:
                n = 1 + rng.randint(0, max_draft)
                kept = min(1 + rng.randint(0, n - 1), left[r])
            else:
                n = kept = min(rng.randint(2, 9), left[r])
            step[r] = (n, kept)
            left[r] -= kept
        steps.append(step)
    return steps


def serve_speculative(fn, manager, inputs: dict, schedule: list[dict], garbage: torch.Generator) -> dict:
    """Run a speculative schedule (steps of {request: (tokens, kept)}, see speculative_schedule)
    through fn(x, step) (a layer's or a stack's serving forward; inputs[request] and the outputs
    carry tokens on dim -2): a step's kept tokens are the request's next rows of `inputs`, its
    rejected drafts random rows; after the step commits, each request is rewound by its rejected
    tokens. Returns {request: outputs of the kept tokens} (what a run of the kept tokens alone,
    stateless, must give). Requests are admitted on first appearance."""
    done = {r: 0 for r in inputs}
    outs = {r: [] for r in inputs}
    for spec in schedule:
        serve_step(fn, manager, inputs, spec, done, outs, garbage)
    return {r: torch.cat(v, -2) for r, v in outs.items() if v}


def serve_step(fn, manager, inputs: dict, spec: dict, done: dict, outs: dict, garbage: torch.Generator,
               on_step=None) -> None:
    """One step of serve_speculative: admit the step's new requests, run fn on the kept rows (from
    done[request] on) and random drafts padded to the bucket, on_step(step, spec) after the forward
    if given, then append each request's kept outputs to outs, advance done and rewind the drafts."""
    for r in spec:
        if r not in manager.slot_of:
            manager.admit(r)
    new = {r: n for r, (n, _) in spec.items()}
    with manager.step(new) as step:
        rows = []
        for r, (n, kept) in spec.items():
            x = inputs[r]
            rows.append(x[..., done[r]:done[r] + kept, :])
            rows.append(torch.randn(*x.shape[:-2], n - kept, x.shape[-1], generator=garbage).to(x))
        x = torch.cat(rows, -2)
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


def split_args(call: str) -> list[str]:
    """Top-level arguments of a generated call (commas inside reinterpret_tensor(...) stay)."""
    args, depth, cur = [], 0, ""
    for ch in call:
        depth += ch in "(["
        depth -= ch in ")]"
        if ch == "," and depth == 0:
            args.append(cur.strip())
            cur = ""
        else:
            cur += ch
    return args + [cur.strip()]
