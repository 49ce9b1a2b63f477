"""Speculative rewind and prefix forks of KVCacheManager: how far a request's end may move back
(the rings' slack), dropping a request's last tokens, and admitting a request that continues from
another's prefix. The manager's methods of the same names delegate here; their docstrings are the
contract. Each checks everything before it changes anything."""

from __future__ import annotations

from dsv4ops.cache.blocks import CacheFullError, checked_count


def max_rewind(m) -> int:
    w = m.model.window
    slack = [m.cfg.ring_size(w) - w + 1]
    slack += [m.cfg.state_rows(span) - span + 1 for span in m._state_spans(m.model)]
    return min(slack)


def rewindable(m, request_id) -> int:
    m._slot(request_id)
    length = m.length[request_id]
    return max(0, min(length, m.max_rewind - (m.high[request_id] - length)))


def rewind(m, request_id, n: int) -> None:
    m._no_open_step("rewind")
    slot = m._slot(request_id)
    n = checked_count("n", n, 0)
    length = m.length[request_id]
    if n > length:
        raise ValueError(f"n: expected at most the {length} tokens of request {request_id!r}, got {n}")
    new = length - n
    behind = m.high[request_id] - new
    if behind > m.max_rewind:
        raise ValueError(
            f"n: rewinding request {request_id!r} by {n} tokens to length {new} puts its end {behind} positions "
            f"behind the furthest position its steps wrote ({m.high[request_id] - 1}); the window ring and "
            f"compressor states keep the rows a rewind needs for at most {m.max_rewind} "
            f"(CacheConfig.max_draft_tokens = {m.cfg.max_draft_tokens}); rewindable now: "
            f"{rewindable(m, request_id)}")
    if n == 0:
        return
    for kind, r in m.ratios.items():
        if m.widths[kind] == 0:
            continue
        keep = -(-(new // r) // m.cfg.block_size)
        tail = m.tables[kind][slot, keep:]
        dropped = tail[tail >= 0].tolist()
        if dropped:
            m.allocators[kind].drop(dropped)
            m._set_blocks(kind, slot, slice(keep, None), -1)
    m.length[request_id] = new
    m._bump([slot])


def fork(m, parent, child, length: int | None) -> int:
    m._no_open_step("fork")
    pslot = m._slot(parent, "parent")
    m._check_new_id(child, "child")
    have = m.length[parent]
    length = have if length is None else checked_count("length", length, 1)
    if length > have:
        raise ValueError(f"length: expected at most the {have} tokens of parent {parent!r}, got {length}")
    behind = m.high[parent] - length
    if behind > m.max_rewind:
        raise ValueError(
            f"length: {length} is {behind} positions behind the furthest position parent {parent!r} wrote "
            f"({m.high[parent] - 1}); its window ring and compressor states hold the rows before a fork point "
            f"for at most {m.max_rewind} (CacheConfig.max_draft_tokens = {m.cfg.max_draft_tokens}): fork "
            f"when the parent reaches the prefix")
    if not m.free_slots:
        raise CacheFullError(f"fork: all {m.cfg.max_requests} request slots are in use")
    bs, size = m.cfg.block_size, m.dcp.size
    partial = {k: bool((length // r) % bs) and m.widths[k] > 0 for k, r in m.ratios.items()}
    for kind, copy in partial.items():
        owner = (length // m.ratios[kind]) // bs % size
        if copy and not m.allocators[kind].free_count(owner):
            where = f" (rank {owner}'s)" if size > 1 else ""
            raise CacheFullError(f"fork: the {kind} pool{where} needs 1 more block (the partial last block), 0 are "
                                 f"free")
    # Every check passed.
    slot = m.free_slots.pop()
    m.slot_of[child], m.length[child], m.high[child] = slot, length, m.high[parent]
    for kind, r in m.ratios.items():
        if m.widths[kind] == 0:
            continue
        full = (length // r) // bs
        src = m.tables[kind][pslot]
        if full:
            m.allocators[kind].share(src[:full].tolist())
            m._set_blocks(kind, slot, slice(0, full), src[:full])
        if partial[kind]:
            block = m.allocators[kind].take(1, full % size)[0]
            for cache in list(m._caches):
                cache.copy_blocks(kind, [int(src[full])], [block])
            m._set_blocks(kind, slot, full, block)
    for cache in list(m._caches):
        cache.copy_slot(pslot, slot)
    m._bump([slot])
    return slot
