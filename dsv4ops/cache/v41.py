"""The V4.1 serving cache: the pools of a whole attention stack, its step metadata and its manager.

V4.1 shares caches across layers (spec 6.1): every layer has its own window ring; each KV source
owns a compressed pool (and, with ratio 2, an fp32 compressor state) and, when it is an index
source, an index-key pool; the layers of its group read them. Pools of the sources of one ratio
fill in step, so they share one block table per ratio (the manager's pool groups are the ratios),
and a source's key pool shares its compressed pool's slots. Admission, release, slot reuse, block
allocation, the step planner, rewind, fork (copy on write) and usage are KVCacheManager's,
unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from dsv4ops.cache.config import CacheConfig, PoolSpec, blocks_per_request, paged_pool, pool_blocks, row_bytes
from dsv4ops.cache.manager import KVCacheManager
from dsv4ops.cache.pools import PoolCache
from dsv4ops.cache.step import StepOrigin
from dsv4ops.config_v41 import DSV41AttentionConfig
from dsv4ops.parallel.dcp import Ownership
from dsv4ops.indexer.workspace import workspace_words
from dsv4ops.quant.formats import CacheFormats


@dataclass
class V41StepMeta:
    """positions [T], req_slots [T] (-1: padding), entries {ratio: [T] pool slot of the entry a token
    closes in that ratio's pools, else -1}, tables {ratio: [max_requests, blocks] physical block of
    each block of a request's entries (-1 unallocated): the manager's device tables, shared by every
    step, see StepMeta}, req_gens [T] (the generation of each token's slot at planning: see
    StepMeta), window_ends [T] (the last position of each token's window: see StepMeta). int32
    tensors, a registered pytree; `origin` is the planner's host-side record, never traced."""

    positions: Tensor
    req_slots: Tensor
    entries: dict[int, Tensor]
    tables: dict[int, Tensor]
    req_gens: Tensor
    window_ends: Tensor
    origin: ClassVar[StepOrigin | None] = None

    def entry_slots(self, ratio: int) -> Tensor:
        return self.entries[ratio]

    def block_table(self, ratio: int) -> Tensor:
        return self.tables[ratio]

    def to(self, device) -> V41StepMeta:
        moved = V41StepMeta(self.positions.to(device, non_blocking=True), self.req_slots.to(device, non_blocking=True),
                            {k: v.to(device, non_blocking=True) for k, v in self.entries.items()},
                            {k: v.to(device, non_blocking=True) for k, v in self.tables.items()},
                            self.req_gens.to(device, non_blocking=True), self.window_ends.to(device, non_blocking=True))
        moved.origin = self.origin
        return moved

    def tensors(self) -> dict[str, Tensor]:
        """The step's tensors by name."""
        return {"positions": self.positions, "req_slots": self.req_slots, "req_gens": self.req_gens,
                "window_ends": self.window_ends,
                **{f"entries_{m}": t for m, t in self.entries.items()},
                **{f"tables_{m}": t for m, t in self.tables.items()}}


pytree.register_dataclass(V41StepMeta)


def stack_pools(model: DSV41AttentionConfig, cfg: CacheConfig, shards: int = 1) -> list[PoolSpec]:
    """Every buffer of a stack's cache: `window_{L}` per backbone layer; per KV source S `comp_{S}`,
    `state_{S}` (fp32 compressor ring [requests, rows, 2 d]: ratio 2, the pending rows of an open
    group, cfg.state_rows(2) rows so a rewind keeps them; a ratio-1 source's single row is rewritten
    by every token and never read back) and, for an index source, `keys_{S}`. `shards`: the shared
    pools of one context-parallel rank (pool_blocks). Formats: cfg.formats (None: CacheFormats.v41())."""
    cfg = cfg.for_model(model)
    fmts = cfg.formats
    d, di = model.head_dim, model.index_head_dim
    ring_blocks = cfg.max_requests * cfg.ring_size(model.window) // cfg.block_size
    pools = [paged_pool(f"window_{i}", cfg, fmts.window, d, ring_blocks) for i in range(model.num_layers)]
    for role in model.roles:
        if role.owns_compressor:
            m = role.ratio
            pools.append(paged_pool(f"comp_{role.layer}", cfg, fmts.comp, d, pool_blocks(cfg, m, shards)))
            pools.append(PoolSpec(f"state_{role.layer}", (cfg.max_requests, state_rows(cfg, m), 2 * d), torch.float32))
            if role.owns_index_keys:
                pools.append(paged_pool(f"keys_{role.layer}", cfg, fmts.index, di, pool_blocks(cfg, m, shards)))
    return pools


def state_rows(cfg: CacheConfig, ratio: int) -> int:
    """Rows of a KV source's compressor state: ratio 2 pools 2 positions (rewind slack included,
    CacheConfig.state_rows); ratio 1 pools its own token only, one row never read back."""
    return cfg.state_rows(ratio) if ratio > 1 else 1


class V41StackCache(PoolCache):
    """The stack's pools as non-persistent buffers (allocated once, never reassigned: CUDA graphs keep
    their addresses), poisoned at birth (byte pools 0xFF, float pools NaN) so a read of an entry that
    was never written shows up in the output. `fmt[name]` is each pool's format. Context parallel
    (`dcp`, the manager's group; `dcp_topk`, its top-k merge): the shared pools hold this rank's
    blocks, and the manager adds `block_index_{ratio}`."""

    def __init__(self, model: DSV41AttentionConfig, cfg: CacheConfig, device=None, dcp: Ownership = Ownership(),
                 dcp_topk: str = "exact"):
        super().__init__()
        cfg = cfg.for_model(model)
        self.model, self.cfg, self.dcp, self.dcp_topk = model, cfg, dcp, dcp_topk
        shards = dcp.size
        self.ring_size = cfg.ring_size(model.window)
        self.fmt: dict[str, str] = {}
        for spec in stack_pools(model, cfg, shards):
            self.fmt[spec.name] = spec.fmt
            fill = 255 if spec.dtype == torch.uint8 else float("nan")
            self.register_buffer(spec.name, torch.full(spec.shape, fill, dtype=spec.dtype, device=device),
                                 persistent=False)
        self.register_step_state(cfg, device)
        # (state buffer, ratio, positions one entry pools): the ratio-2 sources' pending rows, what
        # abort may have to restore (ratio 1 pools its own token only).
        self.state_rings = [(f"state_{r.layer}", r.ratio, r.ratio) for r in model.roles
                            if r.owns_compressor and r.ratio > 1]
        # Per request slot: every layer's window ring and every source's state (ratio 1's too: a
        # fork copies it, though no token reads it back); per block of a ratio: its sources' pools.
        self.slot_pools = {f"window_{i}": self.ring_size // cfg.block_size for i in range(model.num_layers)}
        self.block_pools = {}
        for r in model.roles:
            if r.owns_compressor:
                self.slot_pools[f"state_{r.layer}"] = 1
                self.block_pools[f"comp_{r.layer}"] = r.ratio
                if r.owns_index_keys:
                    self.block_pools[f"keys_{r.layer}"] = r.ratio
        # The indexer's top-k scratch, shared by every index source (they run one after another).
        self.register_buffer("topk_workspace", torch.empty(topk_workspace_words(model, cfg, shards), dtype=torch.int32,
                                                           device=device), persistent=False)


def topk_workspace_words(model: DSV41AttentionConfig, cfg: CacheConfig, shards: int = 1) -> int:
    """int32 words of the top-k workspace the stack's index sources share: the largest row among
    them (a source over its ratio's entries; the candidate source adds its block selection; a
    reindex layer scores the pool's columns). A context-parallel rank scores its share of a
    request's blocks, and its candidate source proposes one block more (dsv4ops.parallel.dcp)."""
    rows = [0]
    for r in model.roles:
        if not r.indexer:
            continue
        n_entries = -(-blocks_per_request(cfg, r.ratio) // shards) * cfg.block_size
        cols = model.candidate_topk_blocks * model.candidate_block_size if r.uses_candidates else 0
        keep = model.candidate_topk_blocks + (shards > 1) if r.candidate_source else 0
        rows.append(workspace_words(cfg.topk_launch_tokens, n_entries, model.index_topk, cols, keep,
                                    model.candidate_block_size))
    return max(rows)


class V41CacheManager(KVCacheManager):
    """KVCacheManager for a V4.1 stack: one pool group per compress ratio of the KV sources; steps
    carry V41StepMeta. The CacheConfig gives capacity, block size, buckets, the pools' formats
    (`formats`: any CacheFormats; None: CacheFormats.v41()) and the dtype of exact pools: every field
    is honoured. `dcp_group`, `topk`: context parallelism, as
    KVCacheManager's (the compressed entries and index keys of a ratio's sources by block; a block
    holds whole candidate blocks)."""

    model_type = DSV41AttentionConfig

    def __init__(self, model: DSV41AttentionConfig, cfg: CacheConfig, device=None, dcp_group=None,
                 topk: str = "exact", **renamed):
        if "numerics" in renamed or isinstance(device, CacheFormats):
            raise TypeError("V41CacheManager: numerics was replaced by CacheConfig(formats=CacheFormats(...)): the "
                            "cache config carries the pools' formats")
        self._check_args(model, cfg)
        super().__init__(model, cfg, device, dcp_group, topk, **renamed)

    def _compressed_pools(self, model: DSV41AttentionConfig) -> tuple[dict, set]:
        ratios = sorted({r.ratio for r in model.roles if r.owns_compressor}, reverse=True)
        return {m: m for m in ratios}, set(ratios)

    def _state_spans(self, model: DSV41AttentionConfig) -> list[int]:
        return [r.ratio for r in model.roles if r.owns_compressor and r.ratio > 1]

    def _pool_bytes(self) -> tuple[dict, int]:
        block, slot = {m: 0 for m in self.ratios}, 0
        for spec in stack_pools(self.model, self.cfg, self.dcp.size):
            kind, layer = spec.name.rsplit("_", 1)
            if kind in ("comp", "keys"):
                block[self.model.role(int(layer)).ratio] += spec.nbytes // spec.shape[0]
            else:  # window rings (max_requests rings of pages), states [requests, rows, width]
                slot += spec.nbytes // self.cfg.max_requests
        return block, slot

    def _step_meta(self, pos: Tensor, req: Tensor, entries: dict, tables: dict, gens: Tensor,
                   ends: Tensor) -> V41StepMeta:
        return V41StepMeta(pos, req, dict(entries), dict(tables), gens, ends)


def memory(model: DSV41AttentionConfig, cfg: CacheConfig, layers: int | None = None) -> dict[str, float]:
    """Bytes per context token (the shared compressed entries and index keys, page padding included)
    and fixed bytes per request (window rings of `layers` layers, default the backbone; compressor
    states), as the pools are allocated in cfg.formats (None: CacheFormats.v41())."""
    cfg = cfg.for_model(model)
    fmts = cfg.formats
    d, di = model.head_dim, model.index_head_dim
    per_token = fixed = 0.0
    for role in model.roles:
        if role.owns_compressor:
            per_token += row_bytes(cfg, fmts.comp, d) / role.ratio
            fixed += state_rows(cfg, role.ratio) * 2 * d * 4
            if role.owns_index_keys:
                per_token += row_bytes(cfg, fmts.index, di) / role.ratio
    ring = cfg.ring_size(model.window)
    fixed += (layers or model.num_layers) * ring * row_bytes(cfg, fmts.window, d)
    return {"bytes_per_token": per_token, "fixed_bytes_per_request": fixed, "ring_size": ring}

