"""Host-side bookkeeping between steps: request slots and their generations, block allocation with
reference counts, the step lifecycle (plan -> forward -> commit, or abort), speculative rewind and
prefix forks, with every value checked before anything changes."""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Mapping

import torch

from dsv4ops.cache import planner, rewind as _rewind
from dsv4ops.cache.blocks import BlockAllocator, CacheFullError
from dsv4ops.cache.config import CacheConfig, blocks_per_request, layer_pools, pool_blocks, topk_workspace_words
from dsv4ops.cache.step import PlannedRequest, StepMeta
from dsv4ops.config import CSA, HCA, SLIDING, DSV4AttentionConfig
from dsv4ops.parallel import dcp as _dcp

__all__ = ["BlockAllocator", "CacheFullError", "KVCacheManager"]

# Process-wide counters: manager ids, and generations, so that no two (slot, generation) pairs of
# any two managers are equal and a step of one manager never passes another's device check.
_MANAGER_IDS = itertools.count(1)
_GENERATIONS = itertools.count(1)
_INT32_MAX = 2**31 - 1


def _next_generation() -> int:
    return next(_GENERATIONS) % _INT32_MAX


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

    Decode context parallelism (`dcp_group`: the group, held as `dcp`, a dsv4ops.parallel.dcp.Ownership,
    a no-op one-rank Ownership without a group; a layer's `process_group` is its tensor-parallel
    group, another role): the ranks of the group share
    each request's compressed entries (and indexer keys) by block: block b of a request lives on
    rank b % ranks, and each rank's pools hold only its own blocks (about 1 / ranks of the context);
    the window rings and compressor states are replicated. Every rank builds the same manager and
    plans the same steps with the same arguments (prepare_step checks that the ranks agree and
    raises on every rank, before anything changes, when they do not); the allocation is the same
    on every rank (each takes a block from its owner's free list), each rank's device tables list
    its own blocks only (`device_tables` [requests, blocks per request / ranks]: column j = block
    j x ranks + rank), and a step's entry slots name the entries this rank stores (-1 elsewhere).
    `topk` ("exact" or "union") is how the layers merge the indexer's selection over the ranks
    (dsv4ops.parallel.dcp). The ranks check, on the host, that they build the manager for the same
    model config, CacheConfig and `topk`, and attach layers of the same configs (all raise, naming
    the field, before any step), and that they plan the same steps (prepare_step); a rank the
    others do not join at a check raises after dsv4ops.parallel.agreement.timeout_s."""

    model_type = DSV4AttentionConfig  # the model config this manager plans for

    def __init__(self, model: DSV4AttentionConfig, cfg: CacheConfig, device=None, dcp_group=None,
                 topk: str = "exact", **renamed):
        if "process_group" in renamed:
            raise TypeError(f"{type(self).__name__}: process_group was renamed dcp_group=: the decode-context-parallel "
                            f"group (a layer's process_group is its tensor-parallel group)")
        if renamed:
            raise TypeError(f"{type(self).__name__}: unexpected keyword argument {sorted(renamed)[0]!r}")
        self._check_args(model, cfg)
        cfg = cfg.for_model(model)  # the formats (None: the model's default) and block size, resolved and checked
        if topk not in _dcp.TOPK_MODES:
            raise ValueError(f"topk: expected one of {_dcp.TOPK_MODES}, got {topk!r}")
        self.model, self.cfg, self.device = model, cfg, torch.device(device or "cpu")
        if self.device.type == "cuda" and self.device.index is None:  # "cuda" is the current device: name it
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.id = next(_MANAGER_IDS)
        self.dcp = _dcp.Ownership(dcp_group)
        self.dcp_topk = topk
        # Before any step: the shapes of the step's collectives follow the model config.
        self.dcp.agree(type(self).__name__, {"cache": cfg, "topk": topk}, config=model)
        self.ratios, kinds = self._compressed_pools(model)
        self.dcp.check_layout(model, cfg)
        size = self.dcp.size
        self.widths = {k: (blocks_per_request(cfg, r) if k in kinds else 0) for k, r in self.ratios.items()}
        self.allocators = {k: BlockAllocator(pool_blocks(cfg, r, size) if k in kinds else 0, size)
                           for k, r in self.ratios.items()}
        # The block tables: the planner's on the host (`tables`, written only through _set_blocks) and
        # the copies the steps read (`device_tables`, on `device`; a CPU manager's are separate CPU
        # tensors). The device tables are allocated once and every step carries them (CUDA graphs
        # keep their addresses); prepare_step copies in only the rows written since the last step
        # (`_dirty`): a decode step moves a few rows, not [max_requests, max_context / ratio /
        # block_size] (128 requests at 1M, CSA: 2 MiB a step).
        self.tables = {k: torch.full((cfg.max_requests, w), -1, dtype=torch.int32) for k, w in self.widths.items()}
        self.device_tables = {k: torch.full((cfg.max_requests, -(-w // size)), -1, dtype=torch.int32,
                                            device=self.device) for k, w in self.widths.items()}
        self._dirty: dict[object, set[int]] = {k: set() for k in self.tables}
        # Each of this rank's blocks' index in its request's block table (the block holds entries
        # index x block_size ..), on the host and the device, so the context-parallel layers map a
        # pool slot back to its entry (dsv4ops.parallel.dcp); the caches get the device tensors.
        # Kept on one rank too (one path; a few int32 per table write).
        self.block_index = {k: torch.full((len(a.refs) // size,), -1, dtype=torch.int32)
                            for k, a in self.allocators.items()}
        self.device_block_index = {k: torch.full_like(t, -1, device=self.device) for k, t in self.block_index.items()}
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
        self._open: planner.OpenStep | None = None
        self._steps = itertools.count(1)
        self._topk_workspace: dict[torch.device, torch.Tensor] = {}

    @property
    def shards(self) -> int:
        """The ranks that share each request's blocks (dcp.size; 1 without a group)."""
        return self.dcp.size

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
        own = self.dcp  # this rank's blocks among them: their index in the table row
        cols = torch.arange(self.widths[kind])[at].reshape(-1)
        ids = self.tables[kind][slot, cols].long()
        mine = (ids >= 0) & (ids % own.size == own.rank)
        local = ids[mine] // own.size
        self.block_index[kind][local] = cols[mine].int()
        self._dirty_index[kind].update(local.tolist())

    def _device_rows(self, kind, slots: torch.Tensor) -> torch.Tensor:
        """Rows `slots` of the host table as the device table holds them: this rank's blocks (column
        j = block j x ranks + rank) as local ids (one rank: the rows as they are)."""
        own = self.dcp
        mine = self.tables[kind][slots.long()][:, own.rank::own.size]
        mine = torch.where(mine >= 0, mine // own.size, -1)
        pad = self.device_tables[kind].shape[1] - mine.shape[1]
        return torch.cat([mine, mine.new_full((mine.shape[0], pad), -1)], 1)

    def _sync_tables(self) -> None:
        """Copy the host rows written since the last sync into the device tables: per group one
        host-to-device copy of [rows, 1 + width] (slot, then the row) and one index_copy_, in stream
        order after the kernels of earlier steps that read the table; no host sync. The same for
        the block index."""
        for kind, dirty in self._dirty.items():
            if not dirty:
                continue
            slots = torch.tensor(sorted(dirty), dtype=torch.int32)
            packed = torch.cat([slots[:, None], self._device_rows(kind, slots)], 1).to(self.device, non_blocking=True)
            self.device_tables[kind].index_copy_(0, packed[:, 0].long(), packed[:, 1:])
            dirty.clear()
        for kind, dirty in self._dirty_index.items():
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
            self._topk_workspace[device] = torch.empty(topk_workspace_words(self.model, self.cfg, self.dcp.size),
                                                       dtype=torch.int32, device=device)
        return self._topk_workspace[device]

    # ---- layers ---------------------------------------------------------------------------------
    def attach(self, cache) -> None:
        """Register a layer's LayerCache (done by `layer.attach_cache`): abort restores its
        compressor states, and its `generations` buffer follows the slots' generations. Refused
        while a step is open or an admitted request holds tokens: the new pools would hold nothing
        of them, and the layer would attend to never-written (NaN-poisoned) rows."""
        self._no_open_step("attach_cache")
        # The layer's config (index_topk, heads: its collectives' shapes) may differ from the manager's
        # in fields the pools do not depend on: the ranks compare it, before the layer's first step.
        self.dcp.agree("attach_cache", {"layer": getattr(cache, "layer_idx", None)}, config=cache.model)
        written = [r for r, n in self.length.items() if n > 0]
        if written:
            r = written[0]
            raise RuntimeError(f"attach_cache: {len(written)} admitted request(s) already hold tokens (e.g. {r!r}: "
                               f"{self.length[r]}), which the new layer's pools would not have; attach every layer "
                               f"before the first step, or release those requests first")
        self._caches.add(cache)
        cache.generations.copy_(torch.tensor(self.generation, dtype=torch.int32))
        for kind, t in self.device_block_index.items():
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
    def _check_new_id(self, rid, arg: str) -> None:
        """A request id `arg` that admit or fork may take: hashable, not admitted yet."""
        try:
            hash(rid)
        except TypeError:
            raise TypeError(f"{arg}: expected a hashable id, got {type(rid).__name__}") from None
        if rid in self.slot_of:
            raise ValueError(f"{arg}: {rid!r} is already admitted")

    def admit(self, request_id) -> int:
        self._check_new_id(request_id, "request_id")
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
        return _rewind.max_rewind(self)

    def rewindable(self, request_id) -> int:
        """How many of the request's last tokens `rewind` may drop now."""
        return _rewind.rewindable(self, request_id)

    def rewind(self, request_id, n: int) -> None:
        """Drop the request's last n tokens (rejected drafts of a verify step): its length goes back
        by n and the blocks past the new end are dropped; continuing is exactly as if the tokens
        had never run (the window ring and compressor states still hold every row the next tokens
        read, and entries the dropped tokens closed are past the new end: invisible, rewritten when
        closed again). n = 0 does nothing. Raises before changing anything while a step is open,
        for an unknown request, or when n passes the request's length or `rewindable(request)`
        (CacheConfig.max_draft_tokens sizes that slack)."""
        _rewind.rewind(self, request_id, n)

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
        return _rewind.fork(self, parent, child, length)

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
        blocks of every rank's pools: dsv4ops.parallel.agreement, one all-gather of 8 bytes on a
        gloo side group); ranks that disagree all raise, naming what differs, and a rank the others
        do not join within agreement.timeout_s raises, with nothing changed."""
        return planner.prepare(self, new_tokens, blocks)

    def _unchanged(self, p: PlannedRequest) -> bool:
        """The request of a planned step is still admitted in its slot, with the same generation."""
        return self.slot_of.get(p.request_id) == p.slot and self.generation[p.slot] == p.generation

    def commit(self, step: StepMeta) -> None:
        """Close the open step after its forward: its requests' lengths advance (a request released
        since planning is skipped), their slots get a new generation (the step no longer runs).

        Every attached layer cache must have run the step (each forward marks its cache on the
        device: live_tokens): a step some cache did not run is rolled back (abort) and refused,
        since its requests would move on over positions that cache never wrote (their next output
        NaN). Reading the marks is one device-to-host copy: on a GPU, commit waits for the step's
        forward (a serving loop reads its output next anyway)."""
        planner.commit(self, step)

    def abort(self, step: StepMeta) -> None:
        """Undo the open step (its forward failed or will not run): lengths stay, the blocks it took
        go back to the free lists, the compressor-state rows it may have overwritten are restored,
        and its slots get a new generation. Requests released since planning are left alone."""
        planner.abort(self, step)

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
