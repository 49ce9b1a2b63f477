"""Host-side bookkeeping between steps: request slots and their generations, block allocation with
reference counts, the step lifecycle (plan -> forward -> commit, or abort), speculative rewind and
prefix forks, with every value checked before anything changes."""

from __future__ import annotations

import contextlib
import itertools
import operator
import weakref
from collections.abc import Mapping

import torch

from dsv4ops.cache.config import CacheConfig, blocks_per_request, layer_pools, pool_blocks, topk_workspace_words
from dsv4ops.cache.step import PlannedRequest, StepMeta, StepOrigin
from dsv4ops.config import CSA, HCA, SLIDING, DSV4AttentionConfig
from dsv4ops.parallel import Group
from dsv4ops.parallel import dcp as _dcp

# Process-wide counters: manager ids, and generations, so that no two (slot, generation) pairs of
# any two managers are equal and a step of one manager never passes another's device check.
_MANAGER_IDS = itertools.count(1)
_GENERATIONS = itertools.count(1)
_INT32_MAX = 2**31 - 1


def _next_generation() -> int:
    return next(_GENERATIONS) % _INT32_MAX


class CacheFullError(RuntimeError):
    """No free request slot or block for the step; nothing was changed."""


class BlockAllocator:
    """A free list of block ids (lowest first, so runs are reproducible) and each block's reference
    count: every block-table entry that lists a block holds one reference (a fork shares its
    parent's complete blocks); a block goes back to the free list when its last holder drops it.

    `shards` (context parallelism): `num_blocks` blocks on each of `shards` ranks; block id
    = local block x shards + rank, and a block is taken from the pool of the rank that owns it."""

    def __init__(self, num_blocks: int, shards: int = 1):
        self.shards = shards
        self._free = [list(range((num_blocks - 1) * shards + s, -1, -shards)) for s in range(shards)]
        self.refs = [0] * (num_blocks * shards)

    @property
    def free(self) -> list[int]:
        """The free block ids, highest first."""
        return self._free[0] if self.shards == 1 else sorted((b for f in self._free for b in f), reverse=True)

    def free_count(self, shard: int = 0) -> int:
        return len(self._free[shard])

    def take(self, n: int, shard: int = 0) -> list[int]:
        taken = [self._free[shard].pop() for _ in range(n)]
        for b in taken:
            self.refs[b] = 1
        return taken

    def share(self, blocks: list[int]):
        for b in blocks:
            self.refs[b] += 1

    def drop(self, blocks: list[int]):
        freed = set()
        for b in blocks:
            self.refs[b] -= 1
            if self.refs[b] == 0:
                self._free[b % self.shards].append(b)
                freed.add(b % self.shards)
        for shard in freed:
            self._free[shard].sort(reverse=True)


class _OpenStep:
    """What abort needs to undo a planned step: the blocks it took (kind -> [(slot, block index in
    the slot's table row, block id)]), the shared blocks it copied on write ([(kind, slot, block
    index, shared block, private copy)]) and copies of the compressor-state rows it may overwrite."""

    def __init__(self, step: StepMeta, taken: dict, cows: list, backups: list):
        self.step, self.taken, self.cows, self.backups = step, taken, cows, backups


def _count(name: str, n, low: int) -> int:
    """n as an int >= low, else a TypeError / ValueError naming `name`."""
    if isinstance(n, bool):
        raise TypeError(f"{name}: expected an int, got bool {n}")
    try:
        n = operator.index(n)
    except TypeError:
        raise TypeError(f"{name}: expected an int, got {type(n).__name__} {n!r}") from None
    if n < low:
        raise ValueError(f"{name}: expected >= {low}, got {n}")
    return n


class KVCacheManager:
    """Request admission and release with slot reuse, the compressed pools' block tables, and the
    step lifecycle, for every layer of `model` given this manager's cache (`layer.attach_cache`).

    Lifecycle: `with manager.step({request: tokens, ...}) as step: y = model(x, step)` plans the
    step, commits it when the block ends normally and aborts it when the block raises. Or by hand:
    `step = manager.prepare_step(...)`, then `manager.commit(step)` or `manager.abort(step)`. One
    step is open at a time: planning another before committing or aborting raises, so a failed
    forward can never be built upon. Lengths move only at commit; abort restores block tables, free
    lists and the compressor-state rows a long chunk may have overwritten (the window ring and the
    compressed pools need nothing: a step only writes ring slots of positions that left every
    window, and entries past the committed length).

    Speculative decoding: a verify step brings 1 + k tokens of a request (k may differ per request
    and step); after it, `rewind(request, n)` drops the n rejected drafts, as if they had never run
    (CacheConfig.max_draft_tokens sizes the rings for it). Prefix sharing: `fork(parent, child,
    length)` admits a request that continues from the first `length` tokens of another: complete
    compressed blocks are shared by reference count and copied on write, the partial block, the
    window ring and the compressor states are copied. `usage()` reports blocks, shared blocks and
    bytes.

    Decode context parallelism (`process_group`; dsv4ops.parallel.dcp): the ranks of the group share
    each request's compressed entries (and indexer keys) by block: block b of a request lives on
    rank b % ranks, and each rank's pools hold only its own blocks (about 1 / ranks of the context);
    the window rings and compressor states are replicated. Every rank builds the same manager and
    plans the same steps with the same arguments (prepare_step checks that the ranks agree and
    raises on every rank, before anything changes, when they do not); the allocation is the same
    on every rank (each takes a block from its owner's free list), each rank's device tables list
    its own blocks only (`device_tables` [requests, blocks per request / ranks]: column j = block
    j x ranks + rank), and a step's entry slots name the entries this rank stores (-1 elsewhere).
    `topk` ("exact" or "union") is how the layers merge the indexer's selection over the ranks
    (dsv4ops.parallel.dcp)."""

    model_type = DSV4AttentionConfig  # the model config this manager plans for

    def __init__(self, model: DSV4AttentionConfig, cfg: CacheConfig, device=None, process_group=None,
                 topk: str = "exact"):
        self._check_args(model, cfg)
        cfg = cfg.for_model(model)  # the formats (None: the model's default) and block size, resolved and checked
        if topk not in _dcp.TOPK_MODES:
            raise ValueError(f"topk: expected one of {_dcp.TOPK_MODES}, got {topk!r}")
        self.model, self.cfg, self.device = model, cfg, torch.device(device or "cpu")
        if self.device.type == "cuda" and self.device.index is None:  # "cuda" is the current device: name it
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.id = next(_MANAGER_IDS)
        self.dcp = Group.of(process_group)
        self.dcp_topk = topk
        self.shards = 1 if self.dcp is None else self.dcp.size
        self._agreement = None if self.dcp is None else _dcp.Agreement(process_group)
        self.ratios, kinds = self._compressed_pools(model)
        if self.dcp is not None:
            _dcp.check_layout(model, cfg)
        self.widths = {k: (blocks_per_request(cfg, r) if k in kinds else 0) for k, r in self.ratios.items()}
        self.allocators = {k: BlockAllocator(pool_blocks(cfg, r, self.shards) if k in kinds else 0, self.shards)
                           for k, r in self.ratios.items()}
        # The block tables: the planner's on the host (`tables`, written only through _set_blocks) and
        # the copies the steps read (`device_tables`, on `device`; a CPU manager's are separate CPU
        # tensors). The device tables are allocated once and every step carries them (CUDA graphs
        # keep their addresses); prepare_step copies in only the rows written since the last step
        # (`_dirty`): a decode step moves a few rows, not [max_requests, max_context / ratio /
        # block_size] (128 requests at 1M, CSA: 2 MiB a step).
        self.tables = {k: torch.full((cfg.max_requests, w), -1, dtype=torch.int32) for k, w in self.widths.items()}
        self.device_tables = {k: torch.full((cfg.max_requests, -(-w // self.shards)), -1, dtype=torch.int32,
                                            device=self.device) for k, w in self.widths.items()}
        self._dirty: dict[object, set[int]] = {k: set() for k in self.tables}
        # Context parallel: each of this rank's blocks' index in its request's block table (the
        # block holds entries index x block_size ..), on the host and the device, so the layers map
        # a pool slot back to its entry (dsv4ops.parallel.dcp); the caches get the device tensors.
        self.block_index = {}
        if self.dcp is not None:
            self.block_index = {k: torch.full((len(a.refs) // self.shards,), -1, dtype=torch.int32)
                                for k, a in self.allocators.items()}
            self.device_block_index = {k: torch.full_like(t, -1, device=self.device)
                                       for k, t in self.block_index.items()}
            self._dirty_index: dict[object, set[int]] = {k: set() for k in self.block_index}
        self.free_slots = list(range(cfg.max_requests - 1, -1, -1))
        self.slot_of: dict[object, int] = {}
        self.length: dict[object, int] = {}
        # One past the furthest position a planned step of the request may have written to its
        # window ring and compressor states (>= its length; more after a rewind or an abort): a
        # rewind or fork may go back at most max_rewind positions behind it.
        self.high: dict[object, int] = {}
        self.generation = [_next_generation() for _ in range(cfg.max_requests)]
        self._caches: weakref.WeakSet = weakref.WeakSet()
        self._open: _OpenStep | None = None
        self._steps = itertools.count(1)
        self._topk_workspace: dict[torch.device, torch.Tensor] = {}

    def _check_args(self, model, cfg) -> None:
        if not isinstance(model, self.model_type):
            raise TypeError(f"model: expected a {self.model_type.__name__}, got {type(model).__name__} (V4: "
                            f"KVCacheManager(DSV4AttentionConfig, ...); V4.1: V41CacheManager(DSV41AttentionConfig, "
                            f"...))")
        if not isinstance(cfg, CacheConfig):
            raise TypeError(f"cfg: expected a CacheConfig, got {type(cfg).__name__}")

    def _compressed_pools(self, model) -> tuple[dict, set]:
        """({pool group: ratio}, the groups the model has): the compressed pools whose blocks this
        manager allocates, one block table per group (V4: one group per layer kind)."""
        kinds = {model.layer_type(i) for i in range(model.num_layers)}
        return {CSA: model.csa_ratio, HCA: model.hca_ratio}, kinds

    def _state_spans(self, model) -> list[int]:
        """Positions one entry pools, for every compressor-state ring of the model (V4: CSA 2m for the
        main and indexer states, HCA m)."""
        kinds = {model.layer_type(i) for i in range(model.num_layers)}
        return [{CSA: 2 * model.csa_ratio, HCA: model.hca_ratio}[k] for k in kinds if k != SLIDING]

    def _pool_bytes(self) -> tuple[dict, int]:
        """({pool group: bytes of one block over every layer's pools of the group}, bytes of one
        request slot: every layer's window ring and compressor states), from the pool specs."""
        block, slot = {k: 0 for k in self.ratios}, 0
        for li in range(self.model.num_layers):
            for spec in layer_pools(self.model, li, self.cfg):
                if spec.name in ("comp", "index"):
                    block[self.model.layer_type(li)] += spec.nbytes // spec.shape[0]
                else:  # the window ring (max_requests rings of pages) and the states [requests, rows, width]
                    slot += spec.nbytes // self.cfg.max_requests
        return block, slot

    def _step_meta(self, pos: torch.Tensor, req: torch.Tensor, entries: dict, tables: dict, gens: torch.Tensor,
                   ends: torch.Tensor) -> StepMeta:
        """The step's metadata from its positions, request slots, entry slots per group (host
        tensors), block tables per group (the device tables), request generations and window ends
        (host tensors)."""
        return StepMeta(pos, req, entries[CSA], entries[HCA], tables[CSA], tables[HCA], gens, ends)

    # ---- block tables ---------------------------------------------------------------------------
    def _set_blocks(self, kind, slot: int, at, blocks) -> None:
        """Write entries `at` (an index or slice) of a slot's host block-table row; the row reaches
        the device table at the next prepare_step. Every table write goes through here."""
        self.tables[kind][slot, at] = blocks
        self._dirty[kind].add(slot)
        if self.dcp is not None:  # this rank's blocks among them: their index in the table row
            cols = torch.arange(self.widths[kind])[at].reshape(-1)
            ids = self.tables[kind][slot, cols].long()
            mine = (ids >= 0) & (ids % self.shards == self.dcp.rank)
            local = ids[mine] // self.shards
            self.block_index[kind][local] = cols[mine].int()
            self._dirty_index[kind].update(local.tolist())

    def _device_rows(self, kind, slots: torch.Tensor) -> torch.Tensor:
        """Rows `slots` of the host table as the device table holds them: as they are, or under
        context parallelism this rank's blocks (column j = block j x ranks + rank) as local ids."""
        rows = self.tables[kind][slots.long()]
        if self.dcp is None:
            return rows
        mine = rows[:, self.dcp.rank::self.shards]
        mine = torch.where(mine >= 0, mine // self.shards, -1)
        pad = self.device_tables[kind].shape[1] - mine.shape[1]
        return torch.cat([mine, mine.new_full((mine.shape[0], pad), -1)], 1)

    def _sync_tables(self) -> None:
        """Copy the host rows written since the last sync into the device tables: per group one
        host-to-device copy of [rows, 1 + width] (slot, then the row) and one index_copy_, in stream
        order after the kernels of earlier steps that read the table; no host sync."""
        for kind, dirty in self._dirty.items():
            if not dirty:
                continue
            slots = torch.tensor(sorted(dirty), dtype=torch.int32)
            packed = torch.cat([slots[:, None], self._device_rows(kind, slots)], 1).to(self.device, non_blocking=True)
            self.device_tables[kind].index_copy_(0, packed[:, 0].long(), packed[:, 1:])
            dirty.clear()
        for kind, dirty in (self._dirty_index.items() if self.dcp is not None else ()):
            if dirty:
                at = torch.tensor(sorted(dirty), dtype=torch.long)
                packed = torch.stack([at.int(), self.block_index[kind][at]], 1).to(self.device, non_blocking=True)
                self.device_block_index[kind].index_copy_(0, packed[:, 0].long(), packed[:, 1])
                dirty.clear()

    def topk_workspace(self, device) -> torch.Tensor:
        """The indexer top-k scratch every CSA layer attached to this manager shares on `device`
        (layers run one after another; allocated once, so CUDA graphs keep its address)."""
        device = torch.device(device)
        if device not in self._topk_workspace:
            self._topk_workspace[device] = torch.empty(topk_workspace_words(self.model, self.cfg, self.shards),
                                                       dtype=torch.int32, device=device)
        return self._topk_workspace[device]

    # ---- layers ---------------------------------------------------------------------------------
    def attach(self, cache) -> None:
        """Register a layer's LayerCache (done by `layer.attach_cache`): abort restores its
        compressor states, and its `generations` buffer follows the slots' generations. Refused
        while a step is open or an admitted request holds tokens: the new pools would hold nothing
        of them, and the layer would attend to never-written (NaN-poisoned) rows."""
        self._no_open_step("attach_cache")
        written = [r for r, n in self.length.items() if n > 0]
        if written:
            r = written[0]
            raise RuntimeError(f"attach_cache: {len(written)} admitted request(s) already hold tokens (e.g. {r!r}: "
                               f"{self.length[r]}), which the new layer's pools would not have; attach every layer "
                               f"before the first step, or release those requests first")
        self._caches.add(cache)
        cache.generations.copy_(torch.tensor(self.generation, dtype=torch.int32))
        for kind, t in (self.device_block_index.items() if self.dcp is not None else ()):
            cache.register_buffer(f"block_index_{kind}", t, persistent=False)

    def _publish_generations(self):
        host = torch.tensor(self.generation, dtype=torch.int32)
        for cache in list(self._caches):
            cache.generations.copy_(host, non_blocking=True)

    def _bump(self, slots):
        for slot in slots:
            self.generation[slot] = _next_generation()
        self._publish_generations()

    # ---- requests ------------------------------------------------------------------------------
    def admit(self, request_id) -> int:
        try:
            hash(request_id)
        except TypeError:
            raise TypeError(f"request_id: expected a hashable id, got {type(request_id).__name__}") from None
        if request_id in self.slot_of:
            raise ValueError(f"request_id: {request_id!r} is already admitted")
        if not self.free_slots:
            raise CacheFullError(f"admit: all {self.cfg.max_requests} request slots are in use")
        slot = self.free_slots.pop()
        self.slot_of[request_id], self.length[request_id], self.high[request_id] = slot, 0, 0
        self._bump([slot])
        return slot

    def release(self, request_id):
        """Free the request's slot and drop its blocks (a block shared with a fork stays with the
        other holders). Allowed while a step is open: that step then no longer runs the request
        (its tokens are stale) and abort or commit skip it."""
        slot = self._slot(request_id)
        for kind, table in self.tables.items():
            held = table[slot][table[slot] >= 0].tolist()
            if held:
                self.allocators[kind].drop(held)
                self._set_blocks(kind, slot, slice(None), -1)
        del self.slot_of[request_id], self.length[request_id], self.high[request_id]
        self.free_slots.append(slot)
        self.free_slots.sort(reverse=True)
        self._bump([slot])

    def _slot(self, request_id, name: str = "request_id") -> int:
        try:
            known = request_id in self.slot_of
        except TypeError:
            known = False
        if not known:
            raise KeyError(f"{name}: {request_id!r} is not admitted (unknown or released)")
        return self.slot_of[request_id]

    def _no_open_step(self, what: str):
        if self._open is not None:
            o = self._open.step.origin
            requests = [r.request_id for r in o.requests]
            raise RuntimeError(f"{what}: step {o.step_id} is still open (requests {requests}); commit(step) or "
                               f"abort(step) it first")

    # ---- speculative decoding and prefix sharing -----------------------------------------------
    @property
    def max_rewind(self) -> int:
        """How far behind the furthest written position a request's end may move back (rewind, fork):
        the window ring keeps W - 1 + this many positions and every compressor-state ring span - 1
        + this many (CacheConfig.ring_size, state_rows), so the rows the next tokens read survive
        the tokens written after them."""
        w = self.model.window
        slack = [self.cfg.ring_size(w) - w + 1]
        slack += [self.cfg.state_rows(span) - span + 1 for span in self._state_spans(self.model)]
        return min(slack)

    def rewindable(self, request_id) -> int:
        """How many of the request's last tokens `rewind` may drop now."""
        self._slot(request_id)
        length = self.length[request_id]
        return max(0, min(length, self.max_rewind - (self.high[request_id] - length)))

    def rewind(self, request_id, n: int) -> None:
        """Drop the request's last n tokens (rejected drafts of a verify step): its length goes back
        by n and the blocks past the new end are dropped; continuing is exactly as if the tokens
        had never run (the window ring and compressor states still hold every row the next tokens
        read, and entries the dropped tokens closed are past the new end: invisible, rewritten when
        closed again). n = 0 does nothing. Raises before changing anything while a step is open,
        for an unknown request, or when n passes the request's length or `rewindable(request)`
        (CacheConfig.max_draft_tokens sizes that slack)."""
        self._no_open_step("rewind")
        slot = self._slot(request_id)
        n = _count("n", n, 0)
        length = self.length[request_id]
        if n > length:
            raise ValueError(f"n: expected at most the {length} tokens of request {request_id!r}, got {n}")
        new = length - n
        behind = self.high[request_id] - new
        if behind > self.max_rewind:
            raise ValueError(
                f"n: rewinding request {request_id!r} by {n} tokens to length {new} puts its end {behind} positions "
                f"behind the furthest position its steps wrote ({self.high[request_id] - 1}); the window ring and "
                f"compressor states keep the rows a rewind needs for at most {self.max_rewind} "
                f"(CacheConfig.max_draft_tokens = {self.cfg.max_draft_tokens}); rewindable now: "
                f"{self.rewindable(request_id)}")
        if n == 0:
            return
        for kind, r in self.ratios.items():
            if self.widths[kind] == 0:
                continue
            keep = -(-(new // r) // self.cfg.block_size)
            tail = self.tables[kind][slot, keep:]
            dropped = tail[tail >= 0].tolist()
            if dropped:
                self.allocators[kind].drop(dropped)
                self._set_blocks(kind, slot, slice(keep, None), -1)
        self.length[request_id] = new
        self._bump([slot])

    def fork(self, parent, child, length: int | None = None) -> int:
        """Admit `child` as a request whose first `length` tokens (default: all of the parent's) are
        the parent's: it continues exactly like a fresh request fed those tokens and its own. Any
        length, not page- or block-aligned: the complete blocks of compressed entries (and indexer
        keys) are shared by reference count, the partial last block is copied, and so are the
        window ring and the compressor states (the child's own rows). Writes never touch a shared
        block: a step that would write one gives its request a private copy first (prepare_step).
        Releasing either side frees only what nobody else holds.

        The parent's rings must still hold the rows of the positions before `length`: length may be
        at most max_rewind positions behind the furthest position the parent wrote (a long prompt:
        fork right after its prefill). Raises before changing anything while a step is open, for
        an unknown parent, a child already admitted, a length outside [1, parent's length] or too
        far back, or no free slot or block. Returns the child's slot."""
        self._no_open_step("fork")
        pslot = self._slot(parent, "parent")
        try:
            hash(child)
        except TypeError:
            raise TypeError(f"child: expected a hashable id, got {type(child).__name__}") from None
        if child in self.slot_of:
            raise ValueError(f"child: {child!r} is already admitted")
        have = self.length[parent]
        length = have if length is None else _count("length", length, 1)
        if length > have:
            raise ValueError(f"length: expected at most the {have} tokens of parent {parent!r}, got {length}")
        behind = self.high[parent] - length
        if behind > self.max_rewind:
            raise ValueError(
                f"length: {length} is {behind} positions behind the furthest position parent {parent!r} wrote "
                f"({self.high[parent] - 1}); its window ring and compressor states hold the rows before a fork point "
                f"for at most {self.max_rewind} (CacheConfig.max_draft_tokens = {self.cfg.max_draft_tokens}): fork "
                f"when the parent reaches the prefix")
        if not self.free_slots:
            raise CacheFullError(f"fork: all {self.cfg.max_requests} request slots are in use")
        bs = self.cfg.block_size
        partial = {k: bool((length // r) % bs) and self.widths[k] > 0 for k, r in self.ratios.items()}
        for kind, copy in partial.items():
            owner = (length // self.ratios[kind]) // bs % self.shards
            if copy and not self.allocators[kind].free_count(owner):
                where = f" (rank {owner}'s)" if self.shards > 1 else ""
                raise CacheFullError(f"fork: the {kind} pool{where} needs 1 more block (the partial last block), 0 are "
                                     f"free")
        # Every check passed.
        slot = self.free_slots.pop()
        self.slot_of[child], self.length[child], self.high[child] = slot, length, self.high[parent]
        for kind, r in self.ratios.items():
            if self.widths[kind] == 0:
                continue
            full = (length // r) // bs
            src = self.tables[kind][pslot]
            if full:
                self.allocators[kind].share(src[:full].tolist())
                self._set_blocks(kind, slot, slice(0, full), src[:full])
            if partial[kind]:
                block = self.allocators[kind].take(1, full % self.shards)[0]
                for cache in list(self._caches):
                    cache.copy_blocks(kind, [int(src[full])], [block])
                self._set_blocks(kind, slot, full, block)
        for cache in list(self._caches):
            cache.copy_slot(pslot, slot)
        self._bump([slot])
        return slot

    def usage(self) -> dict:
        """The admitted requests' cache memory as this manager holds it: per pool group the blocks
        in use (`blocks`, each counted once), the block-table entries listing them (`block_refs`)
        and the blocks listed by more than one request (`shared_blocks`); `bytes`: the blocks in use
        over every layer's pools plus each admitted request's slot (window rings, compressor states);
        `bytes_without_sharing`: the same requests with a block of their own for every reference.
        Context parallel: every rank's blocks (each rank's pools hold its own)."""
        block_bytes, slot_bytes = self._pool_bytes()
        out = {"blocks": {}, "block_refs": {}, "shared_blocks": {}}
        used = unshared = len(self.slot_of) * slot_bytes
        for kind, alloc in self.allocators.items():
            held = [c for c in alloc.refs if c > 0]
            out["blocks"][kind], out["block_refs"][kind] = len(held), sum(held)
            out["shared_blocks"][kind] = sum(c > 1 for c in held)
            used += len(held) * block_bytes[kind]
            unshared += sum(held) * block_bytes[kind]
        out["bytes"], out["bytes_without_sharing"] = used, unshared
        return out

    # ---- the step ------------------------------------------------------------------------------
    @property
    def open_step(self) -> StepMeta | None:
        """The planned step not yet committed or aborted, if any."""
        return None if self._open is None else self._open.step

    @contextlib.contextmanager
    def step(self, new_tokens: Mapping[object, int], blocks: Mapping[object, int] | None = None):
        """`with manager.step({request: tokens}) as step:` plan a step (prepare_step), commit it when
        the block ends, abort it if the block raises (the exception propagates)."""
        step = self.prepare_step(new_tokens, blocks)
        try:
            yield step
        except BaseException:
            self.abort(step)
            raise
        self.commit(step)

    def prepare_step(self, new_tokens: Mapping[object, int], blocks: Mapping[object, int] | None = None) -> StepMeta:
        """Plan and open a step. `new_tokens` maps each request of the step to how many tokens it
        adds (a prefill chunk, a continuation, 1 for decode, or 1 + k for a verify step of k
        drafts), in the order their tokens appear in the step's flat batch. `blocks` maps requests
        of the step to a draft-block size b: the request's last b tokens of the step see each other
        both ways in their window (their window ends at the block's last position, DSpark's draft
        layers); the others are causal. Raises before changing anything if a step is open, a
        request is unknown, a count is not a positive int, a block is not 1..its request's tokens,
        a position would pass max_context, the step passes its capacity, or blocks run out. A step
        that writes entries into a block its request shares with a fork first gives the request a
        private copy of it (copy on write). The step stays open until `commit(step)` or
        `abort(step)`.

        Context parallel: first of all the ranks compare a digest of their call and state (the
        arguments, the open step, every request's slot, length and furthest position, the free
        blocks of every rank's pools: dsv4ops.parallel.dcp.Agreement, one all-gather of 8 bytes on a
        CPU group); ranks that disagree all raise, with nothing changed."""
        cfg = self.cfg
        if self._agreement is not None:
            self._agreement.check("prepare_step", (
                _dcp.describe(new_tokens), _dcp.describe(blocks), self._open is not None, list(self.slot_of.items()),
                list(self.length.items()), list(self.high.items()),
                {k: [a.free_count(s) for s in range(self.shards)] for k, a in self.allocators.items()}))
        if self._open is not None:
            o = self._open.step.origin
            raise RuntimeError(f"prepare_step: step {o.step_id} is still open (requests "
                               f"{[r.request_id for r in o.requests]}); commit(step) or abort(step) it first, or "
                               f"plan steps with `with manager.step(...)`")
        if not isinstance(new_tokens, Mapping):
            raise TypeError(f"new_tokens: expected a mapping {{request_id: token count}}, got "
                            f"{type(new_tokens).__name__}")
        if not new_tokens:
            raise ValueError("new_tokens: expected at least one request, got an empty mapping")
        plan = []
        for rid, n in new_tokens.items():
            slot = self._slot(rid)
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
            start = self.length[rid]
            if start + n > cfg.max_context:
                raise ValueError(f"new_tokens[{rid!r}]: positions {start}..{start + n - 1} pass max_context "
                                 f"{cfg.max_context}")
            plan.append(PlannedRequest(rid, slot, self.generation[slot], start, n))
        total = sum(p.tokens for p in plan)
        if total > cfg.max_step_tokens:
            raise ValueError(f"new_tokens: {total} tokens pass max_step_tokens {cfg.max_step_tokens}")
        drafts = self._draft_blocks(blocks, new_tokens)
        need = {k: [] for k in self.tables}
        cow = {k: [] for k in self.tables}
        bs = cfg.block_size
        for p in plan:
            for kind, r in self.ratios.items():
                if self.widths[kind] == 0:
                    continue
                row = self.tables[kind][p.slot]
                have = int((row >= 0).sum())
                want = -(-((p.start + p.tokens) // r) // bs)
                need[kind] += [(p.slot, b) for b in range(have, want)]
                # Entries start // r .. (start + tokens) // r - 1 close in this step: a held block
                # that another request also lists is copied first.
                first, last = p.start // r, (p.start + p.tokens) // r - 1
                for b in range(first // bs, min(last // bs, have - 1) + 1):
                    if self.allocators[kind].refs[int(row[b])] > 1:
                        cow[kind].append((p.slot, b))
        for kind in need:
            for shard in range(self.shards):  # every block comes from its owner's pool
                n_cow = sum(b % self.shards == shard for _, b in cow[kind])
                want = sum(b % self.shards == shard for _, b in need[kind]) + n_cow
                free = self.allocators[kind].free_count(shard)
                if want > free:
                    shared = f" ({n_cow} of them copies of shared blocks)" if n_cow else ""
                    where = f" (rank {shard}'s)" if self.shards > 1 else ""
                    raise CacheFullError(f"prepare_step: the {kind} pool{where} needs {want} more blocks{shared}, "
                                         f"{free} are free")
        # Every check passed: back up the state rows the step may overwrite, copy shared blocks it
        # writes, allocate, open the step.
        backups = self._back_up_states(plan)
        cows = []
        for kind, at in cow.items():
            if not at:
                continue
            shared = [int(self.tables[kind][slot, b]) for slot, b in at]
            private = [self.allocators[kind].take(1, b % self.shards)[0] for _, b in at]
            for cache in list(self._caches):
                cache.copy_blocks(kind, shared, private)
            for (slot, b), old, new in zip(at, shared, private):
                self._set_blocks(kind, slot, b, new)
                cows.append((kind, slot, b, old, new))
            self.allocators[kind].drop(shared)
        taken = {k: [] for k in self.tables}
        for kind, blocks_ in need.items():
            for (slot, b), block in zip(blocks_, [self.allocators[kind].take(1, b % self.shards)[0]
                                                  for _, b in blocks_]):
                self._set_blocks(kind, slot, b, block)
                taken[kind].append((slot, b, block))
        bucket = min(b for b in cfg.buckets if b >= total)
        pos = torch.zeros(bucket, dtype=torch.int32)
        req = torch.full((bucket,), -1, dtype=torch.int32)
        gens = torch.zeros(bucket, dtype=torch.int32)
        i = 0
        for p in plan:
            pos[i:i + p.tokens] = torch.arange(p.start, p.start + p.tokens, dtype=torch.int32)
            req[i:i + p.tokens] = p.slot
            gens[i:i + p.tokens] = p.generation
            i += p.tokens
            self.high[p.request_id] = max(self.high[p.request_id], p.start + p.tokens)
        ends = pos.clone()
        i = 0
        for p in plan:
            b = drafts.get(p.request_id, 0)
            ends[i + p.tokens - b:i + p.tokens] = p.start + p.tokens - 1
            i += p.tokens
        entries = {k: self._entry_slots(k, pos, req) for k in self.tables}
        self._sync_tables()
        planned = self._step_meta(pos, req, entries, self.device_tables, gens, ends)
        step = planned.to(self.device)  # the per-token tensors; the tables are there already
        tables = {id(t) for t in self.device_tables.values()}
        on_cpu = self.device.type == "cpu"
        step.origin = StepOrigin(self.id, next(self._steps), tuple(plan),
                                 {k: t.clone() for k, t in planned.tensors().items() if id(t) not in tables}
                                 if on_cpu else None)
        self._open = _OpenStep(step, taken, cows, backups)
        return step

    @staticmethod
    def _draft_blocks(blocks, new_tokens: Mapping) -> dict:
        """`blocks` checked: {request of the step: block size in 1..its tokens}."""
        if blocks is None:
            return {}
        if not isinstance(blocks, Mapping):
            raise TypeError(f"blocks: expected a mapping {{request_id: draft-block size}}, got {type(blocks).__name__}")
        out = {}
        for rid, b in blocks.items():
            if rid not in new_tokens:
                raise ValueError(f"blocks: request {rid!r} has no tokens in this step (new_tokens: {list(new_tokens)})")
            b = _count(f"blocks[{rid!r}]", b, 1)
            if b > new_tokens[rid]:
                raise ValueError(f"blocks[{rid!r}]: expected at most the request's {new_tokens[rid]} tokens of the "
                                 f"step, got {b}")
            out[rid] = b
        return out

    def _entry_slots(self, kind: str, pos: torch.Tensor, req: torch.Tensor) -> torch.Tensor:
        """The pool slot of the entry each token closes (-1: none); context parallel: this rank's
        pool slot of the entries it owns, -1 for the others'."""
        r, bs = self.ratios[kind], self.cfg.block_size
        closes = (req >= 0) & ((pos + 1) % r == 0)
        if self.widths[kind] == 0 or not bool(closes.any()):
            return torch.full_like(pos, -1)
        w = (pos // r).long()
        blocks = self.tables[kind][req.clamp(min=0).long(), (w // bs).clamp(max=self.widths[kind] - 1)].long()
        if self.dcp is not None:
            closes &= (w // bs) % self.shards == self.dcp.rank
            blocks = blocks // self.shards
        return torch.where(closes, blocks * bs + w % bs, -1).to(torch.int32)

    def _back_up_states(self, plan) -> list:
        """Copies of the compressor-state rows of every request whose chunk wraps its state ring far
        enough to overwrite a row that the step's first block-closing token still pools from before
        the step (positions c - span + 1 .. start - 1, c = the first closing position >= start,
        span = coff x ratio): a chunk of n tokens from `start` rewrites row q % rows for q in
        start .. start + n - 1, so row (lo % rows) is hit iff lo + rows <= start + n - 1. A decode
        token never is (rows >= span). `rows` is the ring's row count, read from the buffer."""
        backups = []
        for cache in list(self._caches):
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

    def _check_open(self, step: StepMeta, what: str) -> _OpenStep:
        o = getattr(step, "origin", None)
        if self._open is None or o is None or o.manager_id != self.id or self._open.step.origin is not o:
            open_id = None if self._open is None else self._open.step.origin.step_id
            got = "a step of no manager" if o is None else f"step {o.step_id} of manager {o.manager_id}"
            raise ValueError(f"{what}: expected the open step ({'none is open' if open_id is None else open_id}) "
                             f"of manager {self.id}, got {got}")
        return self._open

    def _unchanged(self, p: PlannedRequest) -> bool:
        """The request of a planned step is still admitted in its slot, with the same generation."""
        return self.slot_of.get(p.request_id) == p.slot and self.generation[p.slot] == p.generation

    def commit(self, step: StepMeta) -> None:
        """Close the open step after its forward: its requests' lengths advance (a request released
        since planning is skipped), their slots get a new generation (the step no longer runs)."""
        self._check_open(step, "commit")
        live = [p for p in step.origin.requests if self._unchanged(p)]
        for p in live:
            self.length[p.request_id] = p.start + p.tokens
        self._open = None
        self._bump([p.slot for p in live])

    def abort(self, step: StepMeta) -> None:
        """Undo the open step (its forward failed or will not run): lengths stay, the blocks it took
        go back to the free lists, the compressor-state rows it may have overwritten are restored,
        and its slots get a new generation. Requests released since planning are left alone."""
        opened = self._check_open(step, "abort")
        live = {p.slot for p in step.origin.requests if self._unchanged(p)}
        for kind, taken in opened.taken.items():
            back = [block for slot, b, block in taken if slot in live]
            for slot, b, block in taken:
                if slot in live:
                    self._set_blocks(kind, slot, b, -1)
            self.allocators[kind].drop(back)
        for kind, slot, b, shared, private in opened.cows:
            # The shared block again, unless its other holders released it meanwhile (then the
            # private copy, equal up to the step's own writes past the committed length, stays).
            if slot in live and self.allocators[kind].refs[shared] > 0:
                self.allocators[kind].share([shared])
                self._set_blocks(kind, slot, b, shared)
                self.allocators[kind].drop([private])
        for cache, name, index, rows in opened.backups:
            keep = torch.tensor([int(s) in live for s in index.tolist()], dtype=torch.bool)
            if keep.any():
                getattr(cache, name).index_copy_(0, index[keep.to(index.device)], rows[keep.to(rows.device)])
        self._open = None
        self._bump(sorted(live))

    # ---- the forward's check -------------------------------------------------------------------
    def check_step(self, step: StepMeta, tokens: int) -> None:
        """Raises unless `step` is this manager's open step, all its requests are still admitted with
        the generation they had when it was planned, and (when the step lives on the CPU, where it
        costs no sync) its tensors are the planned ones for every live token: the per-token tensors
        against copies taken at planning, the block tables by identity (the manager's
        `device_tables`) and content (each row equal to the host table's, except rows written since
        planning: those of requests released while the step is open, which no token of the step
        reads). Reads host metadata only. The eager serving forward calls it before writing
        anything."""
        if not hasattr(step, "tensors") or not hasattr(step, "req_gens"):
            raise TypeError(f"step: expected the metadata of a step planned by {type(self).__name__}.prepare_step / "
                            f".step, got {type(step).__name__}")
        o = step.origin
        if o is None:
            raise ValueError("step: expected a StepMeta planned by a KVCacheManager (prepare_step / step), got one "
                             "without the planner's record (built or rebuilt by hand?)")
        if o.manager_id != self.id:
            raise ValueError(f"step: planned by KVCacheManager {o.manager_id}, but this layer's cache belongs to "
                             f"KVCacheManager {self.id}; a step runs only on the layers of the manager that planned it")
        if self._open is None or self._open.step.origin is not o:
            raise ValueError(f"step: step {o.step_id} is closed (committed or aborted); plan the next step")
        for p in o.requests:
            if not self._unchanged(p):
                raise ValueError(f"step: request {p.request_id!r} (slot {p.slot}) was released or re-admitted after "
                                 f"step {o.step_id} was planned; abort(step) and plan again")
        if step.positions.shape[0] != tokens:
            raise ValueError(f"hidden_states: expected {step.positions.shape[0]} rows (the step's tokens, padded to "
                             f"its bucket), got {tokens}")
        planned = o.planned
        if planned is None or step.positions.device.type != "cpu":
            return
        live = planned["req_slots"] >= 0
        got_all = step.tensors()
        for name, want in planned.items():
            got = got_all[name]
            # Padding rows may carry any position, generation or entry slot (they read and write
            # nothing) but must stay padding: req_slots is compared whole.
            per_token = name != "req_slots"
            same = got.shape == want.shape and (torch.equal(got[live], want[live]) if per_token
                                                 else torch.equal(got, want))
            if not same:
                raise ValueError(f"step: {name} is not what step {o.step_id} was planned with (edited by hand?); "
                                 f"plan steps with the manager")
        for kind, table in self.device_tables.items():
            if step.block_table(kind) is not table:
                raise ValueError(f"step: its {kind} block table is not the manager's (replaced by hand?); plan steps "
                                 f"with the manager")
            edited = (table != self._device_rows(kind, torch.arange(table.shape[0]))).any(1)
            edited[sorted(self._dirty[kind])] = False
            if edited.any():
                self._dirty[kind].update(edited.nonzero().flatten().tolist())  # the next step restores them
                raise ValueError(f"step: the {kind} block table is not what step {o.step_id} was planned with "
                                 f"(edited by hand?); plan steps with the manager")
