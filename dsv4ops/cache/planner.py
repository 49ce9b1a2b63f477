"""The step planner of KVCacheManager: plan and open a step (prepare), close it after its forward
(commit) or undo it (abort). Every value is checked before anything changes; the manager's methods
of the same names delegate here, and their docstrings are the contract."""

from __future__ import annotations

import operator
from collections.abc import Mapping

import torch

from dsv4ops.cache.blocks import CacheFullError, checked_count
from dsv4ops.cache.step import PlannedRequest, StepMeta, StepOrigin
from dsv4ops.parallel import dcp as _dcp


class OpenStep:
    """What abort needs to undo a planned step: the blocks it took (kind -> [(slot, block index in
    the slot's table row, block id)]), the shared blocks it copied on write ([(kind, slot, block
    index, shared block, private copy)]) and copies of the compressor-state rows it may overwrite."""

    def __init__(self, step: StepMeta, taken: dict, cows: list, backups: list):
        self.step, self.taken, self.cows, self.backups = step, taken, cows, backups


# ---- prepare ------------------------------------------------------------------------------------
def prepare(m, new_tokens: Mapping, blocks: Mapping | None) -> StepMeta:
    """KVCacheManager.prepare_step: the checks (ranks agree, no open step, the requests and their
    counts, capacity, free blocks), then the changes (state backups, copies on write, new blocks,
    the step's tensors)."""
    if m.dcp.size > 1:  # (the state is built only where it is compared)
        m.dcp.agree("prepare_step", {
            "new_tokens": _dcp.describe(new_tokens), "blocks": _dcp.describe(blocks), "open step": m._open is not None,
            "slots": list(m.slot_of.items()), "lengths": list(m.length.items()), "written": list(m.high.items()),
            "free blocks": {k: [a.free_count(s) for s in range(m.dcp.size)] for k, a in m.allocators.items()}})
    if m._open is not None:
        o = m._open.step.origin
        raise RuntimeError(f"prepare_step: step {o.step_id} is still open (requests "
                           f"{[r.request_id for r in o.requests]}); commit(step) or abort(step) it first, or "
                           f"plan steps with `with manager.step(...)`")
    plan = _plan_requests(m, new_tokens)
    total = sum(p.tokens for p in plan)
    if total > m.cfg.max_step_tokens:
        raise ValueError(f"new_tokens: {total} tokens pass max_step_tokens {m.cfg.max_step_tokens}")
    drafts = draft_blocks(blocks, new_tokens)
    need, cow = _blocks_needed(m, plan)
    _check_free(m, need, cow)
    # Every check passed: back up the state rows the step may overwrite, copy shared blocks it
    # writes, allocate, open the step.
    backups = back_up_states(m, plan)
    cows = _copy_on_write(m, cow)
    taken = _allocate(m, need)
    step = _step_tensors(m, plan, total, drafts)
    m._open = OpenStep(step, taken, cows, backups)
    return step


def _plan_requests(m, new_tokens) -> list[PlannedRequest]:
    """Each request of the step checked (admitted, a token count in 1..request_step_tokens, inside
    max_context) and planned from its length."""
    cfg = m.cfg
    if not isinstance(new_tokens, Mapping):
        raise TypeError(f"new_tokens: expected a mapping {{request_id: token count}}, got {type(new_tokens).__name__}")
    if not new_tokens:
        raise ValueError("new_tokens: expected at least one request, got an empty mapping")
    plan = []
    for rid, n in new_tokens.items():
        slot = m._slot(rid)
        if isinstance(n, bool):
            raise TypeError(f"new_tokens[{rid!r}]: expected an int token count, got bool {n}")
        try:
            n = operator.index(n)
        except TypeError:
            raise TypeError(f"new_tokens[{rid!r}]: expected an int token count, got {type(n).__name__} "
                            f"{n!r}") from None
        if n < 1:
            raise ValueError(f"new_tokens[{rid!r}]: expected >= 1 token, got {n}")
        if n > cfg.request_step_tokens:
            raise ValueError(f"new_tokens[{rid!r}]: expected <= {cfg.request_step_tokens} tokens per request "
                             f"per step (the window ring's slack), got {n}")
        start = m.length[rid]
        if start + n > cfg.max_context:
            raise ValueError(f"new_tokens[{rid!r}]: positions {start}..{start + n - 1} pass max_context "
                             f"{cfg.max_context}")
        plan.append(PlannedRequest(rid, slot, m.generation[slot], start, n))
    return plan


def draft_blocks(blocks, new_tokens: Mapping) -> dict:
    """`blocks` checked: {request of the step: block size in 1..its tokens}."""
    if blocks is None:
        return {}
    if not isinstance(blocks, Mapping):
        raise TypeError(f"blocks: expected a mapping {{request_id: draft-block size}}, got {type(blocks).__name__}")
    out = {}
    for rid, b in blocks.items():
        if rid not in new_tokens:
            raise ValueError(f"blocks: request {rid!r} has no tokens in this step (new_tokens: {list(new_tokens)})")
        b = checked_count(f"blocks[{rid!r}]", b, 1)
        if b > new_tokens[rid]:
            raise ValueError(f"blocks[{rid!r}]: expected at most the request's {new_tokens[rid]} tokens of the "
                             f"step, got {b}")
        out[rid] = b
    return out


def _blocks_needed(m, plan) -> tuple[dict, dict]:
    """({group: [(slot, block index)] the step allocates}, {group: [(slot, block index)] of held
    blocks it writes that another request also lists: copied first})."""
    need = {k: [] for k in m.tables}
    cow = {k: [] for k in m.tables}
    bs = m.cfg.block_size
    for p in plan:
        for kind, r in m.ratios.items():
            if m.widths[kind] == 0:
                continue
            row = m.tables[kind][p.slot]
            have = int((row >= 0).sum())
            want = -(-((p.start + p.tokens) // r) // bs)
            need[kind] += [(p.slot, b) for b in range(have, want)]
            # Entries start // r .. (start + tokens) // r - 1 close in this step.
            first, last = p.start // r, (p.start + p.tokens) // r - 1
            for b in range(first // bs, min(last // bs, have - 1) + 1):
                if m.allocators[kind].refs[int(row[b])] > 1:
                    cow[kind].append((p.slot, b))
    return need, cow


def _check_free(m, need: dict, cow: dict) -> None:
    """CacheFullError unless every pool (each rank's: a block comes from its owner's) has the blocks."""
    size = m.dcp.size
    for kind in need:
        for shard in range(size):
            n_cow = sum(b % size == shard for _, b in cow[kind])
            want = sum(b % size == shard for _, b in need[kind]) + n_cow
            free = m.allocators[kind].free_count(shard)
            if want > free:
                shared = f" ({n_cow} of them copies of shared blocks)" if n_cow else ""
                where = f" (rank {shard}'s)" if size > 1 else ""
                raise CacheFullError(f"prepare_step: the {kind} pool{where} needs {want} more blocks{shared}, "
                                     f"{free} are free")


def _copy_on_write(m, cow: dict) -> list:
    """Give each written shared block's request a private copy; [(kind, slot, b, shared, private)]."""
    cows = []
    for kind, at in cow.items():
        if not at:
            continue
        shared = [int(m.tables[kind][slot, b]) for slot, b in at]
        private = [m.allocators[kind].take(1, b % m.dcp.size)[0] for _, b in at]
        for cache in list(m._caches):
            cache.copy_blocks(kind, shared, private)
        for (slot, b), old, new in zip(at, shared, private):
            m._set_blocks(kind, slot, b, new)
            cows.append((kind, slot, b, old, new))
        m.allocators[kind].drop(shared)
    return cows


def _allocate(m, need: dict) -> dict:
    """Take the new blocks (each from its owner's pool); {kind: [(slot, b, block)]}."""
    taken = {k: [] for k in m.tables}
    for kind, at in need.items():
        for slot, b in at:
            block = m.allocators[kind].take(1, b % m.dcp.size)[0]
            m._set_blocks(kind, slot, b, block)
            taken[kind].append((slot, b, block))
    return taken


def _step_tensors(m, plan, total: int, drafts: dict) -> StepMeta:
    """The step's metadata padded to its bucket, on the manager's device, with its origin record."""
    bucket = min(b for b in m.cfg.buckets if b >= total)
    pos = torch.zeros(bucket, dtype=torch.int32)
    req = torch.full((bucket,), -1, dtype=torch.int32)
    gens = torch.zeros(bucket, dtype=torch.int32)
    ends = torch.zeros(bucket, dtype=torch.int32)
    i = 0
    for p in plan:
        pos[i:i + p.tokens] = torch.arange(p.start, p.start + p.tokens, dtype=torch.int32)
        req[i:i + p.tokens] = p.slot
        gens[i:i + p.tokens] = p.generation
        # A draft block of b tokens: each sees the block's last position (both ways in the block).
        b = drafts.get(p.request_id, 0)
        ends[i:i + p.tokens - b] = pos[i:i + p.tokens - b]
        ends[i + p.tokens - b:i + p.tokens] = p.start + p.tokens - 1
        i += p.tokens
        m.high[p.request_id] = max(m.high[p.request_id], p.start + p.tokens)
    entries = {k: entry_slots(m, k, pos, req) for k in m.tables}
    m._sync_tables()
    planned = m._step_meta(pos, req, entries, m.device_tables, gens, ends)
    step = planned.to(m.device)  # the per-token tensors; the tables are there already
    tables = {id(t) for t in m.device_tables.values()}
    step.origin = StepOrigin(m.id, next(m._steps), tuple(plan),
                             {k: t.clone() for k, t in planned.tensors().items() if id(t) not in tables}
                             if m.device.type == "cpu" else None)
    return step


def entry_slots(m, kind, pos: torch.Tensor, req: torch.Tensor) -> torch.Tensor:
    """The pool slot of the entry each token closes (-1: none): on this rank's blocks, as the
    rank's local block (one rank: every block, as it is)."""
    r, bs, own = m.ratios[kind], m.cfg.block_size, m.dcp
    closes = (req >= 0) & ((pos + 1) % r == 0)
    if m.widths[kind] == 0 or not bool(closes.any()):
        return torch.full_like(pos, -1)
    w = (pos // r).long()
    blocks = m.tables[kind][req.clamp(min=0).long(), (w // bs).clamp(max=m.widths[kind] - 1)].long()
    closes &= (w // bs) % own.size == own.rank
    return torch.where(closes, blocks // own.size * bs + w % bs, -1).to(torch.int32)


def back_up_states(m, plan) -> list:
    """Copies of the compressor-state rows of every request whose chunk wraps its state ring far
    enough to overwrite a row that the step's first block-closing token still pools from before
    the step (positions c - span + 1 .. start - 1, c = the first closing position >= start,
    span = coff x ratio): a chunk of n tokens from `start` rewrites row q % rows for q in
    start .. start + n - 1, so row (lo % rows) is hit iff lo + rows <= start + n - 1. A decode
    token never is (rows >= span). `rows` is the ring's row count, read from the buffer."""
    backups = []
    for cache in list(m._caches):
        for name, ratio, span in cache.state_rings:
            state = getattr(cache, name)
            rows = state.shape[1]
            slots = []
            for p in plan:
                c = (p.start // ratio + 1) * ratio - 1
                lo = max(0, c - span + 1)
                if lo < p.start and lo + rows <= p.start + p.tokens - 1:
                    slots.append(p.slot)
            if slots:
                index = torch.tensor(slots, dtype=torch.long, device=state.device)
                backups.append((cache, name, index, state.index_select(0, index)))
    return backups


# ---- commit and abort ---------------------------------------------------------------------------
def check_open(m, step: StepMeta, what: str) -> OpenStep:
    o = getattr(step, "origin", None)
    if m._open is None or o is None or o.manager_id != m.id or m._open.step.origin is not o:
        open_id = None if m._open is None else m._open.step.origin.step_id
        got = "a step of no manager" if o is None else f"step {o.step_id} of manager {o.manager_id}"
        raise ValueError(f"{what}: expected the open step ({'none is open' if open_id is None else open_id}) "
                         f"of manager {m.id}, got {got}")
    return m._open


def commit(m, step: StepMeta) -> None:
    check_open(m, step, "commit")
    _check_ran(m, step)
    live = [p for p in step.origin.requests if m._unchanged(p)]
    for p in live:
        m.length[p.request_id] = p.start + p.tokens
    m._open = None
    m._bump([p.slot for p in live])


def _check_ran(m, step: StepMeta) -> None:
    """Abort the step and raise unless every attached cache ran it (no cache: nothing to write).
    The forwards mark their caches on the device (live_tokens); one device-to-host read."""
    caches = list(m._caches)
    if not caches:
        return
    mark = step.origin.requests[0].generation  # the first token's: what the forwards wrote
    ran = sum(g == mark for g in torch.cat([c.ran_step for c in caches]).tolist())
    if ran < len(caches):
        abort(m, step)
        raise RuntimeError(f"commit: step {step.origin.step_id} ran on {ran} of the {len(caches)} attached layer "
                           f"caches (each runs every step); it was rolled back (abort): its requests stay as "
                           f"before it. Run every attached layer's forward(x, step) before commit, or abort(step)")


def abort(m, step: StepMeta) -> None:
    opened = check_open(m, step, "abort")
    live = {p.slot for p in step.origin.requests if m._unchanged(p)}
    for kind, taken in opened.taken.items():
        back = [block for slot, b, block in taken if slot in live]
        for slot, b, block in taken:
            if slot in live:
                m._set_blocks(kind, slot, b, -1)
        m.allocators[kind].drop(back)
    for kind, slot, b, shared, private in opened.cows:
        # The shared block again, unless its other holders released it meanwhile (then the
        # private copy, equal up to the step's own writes past the committed length, stays).
        if slot in live and m.allocators[kind].refs[shared] > 0:
            m.allocators[kind].share([shared])
            m._set_blocks(kind, slot, b, shared)
            m.allocators[kind].drop([private])
    for cache, name, index, rows in opened.backups:
        keep = torch.tensor([int(s) in live for s in index.tolist()], dtype=torch.bool)
        if keep.any():
            getattr(cache, name).index_copy_(0, index[keep.to(index.device)], rows[keep.to(rows.device)])
    m._open = None
    m._bump(sorted(live))
