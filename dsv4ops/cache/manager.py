"""Host-side bookkeeping between steps: request slots, block allocation, and `prepare_step`, which
checks every value before anything is allocated and returns the step's device metadata."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from dsv4ops.cache.config import CacheConfig, blocks_per_request, pool_blocks, topk_workspace_words
from dsv4ops.cache.step import StepMeta
from dsv4ops.config import CSA, HCA, DSV4AttentionConfig


class CacheFullError(RuntimeError):
    """No free request slot or block for the step; nothing was changed."""


class BlockAllocator:
    """A free list of block ids (lowest first, so runs are reproducible)."""

    def __init__(self, num_blocks: int):
        self.free = list(range(num_blocks - 1, -1, -1))

    def take(self, n: int) -> list[int]:
        taken = [self.free.pop() for _ in range(n)]
        return taken

    def give(self, blocks: list[int]):
        self.free.extend(sorted(blocks, reverse=True))
        self.free.sort(reverse=True)


class KVCacheManager:
    """Request admission and release with slot reuse, the compressed pools' block tables, and the
    step planner, for every layer of `model` that is given this manager's cache."""

    def __init__(self, model: DSV4AttentionConfig, cfg: CacheConfig, device=None):
        self.model, self.cfg, self.device = model, cfg, torch.device(device or "cpu")
        self.ratios, kinds = self._compressed_pools(model)
        self.widths = {k: (blocks_per_request(cfg, r) if k in kinds else 0) for k, r in self.ratios.items()}
        self.allocators = {k: BlockAllocator(pool_blocks(cfg, r) if k in kinds else 0) for k, r in self.ratios.items()}
        self.tables = {k: torch.full((cfg.max_requests, w), -1, dtype=torch.int32) for k, w in self.widths.items()}
        self.free_slots = list(range(cfg.max_requests - 1, -1, -1))
        self._topk_workspace: dict[torch.device, torch.Tensor] = {}
        self.slot_of: dict[object, int] = {}
        self.length: dict[object, int] = {}

    def topk_workspace(self, device) -> torch.Tensor:
        """The indexer top-k scratch every CSA layer attached to this manager shares on `device`
        (layers run one after another; allocated once, so CUDA graphs keep its address)."""
        device = torch.device(device)
        if device not in self._topk_workspace:
            self._topk_workspace[device] = torch.empty(topk_workspace_words(self.model, self.cfg), dtype=torch.int32,
                                                       device=device)
        return self._topk_workspace[device]

    def _compressed_pools(self, model) -> tuple[dict, set]:
        """({pool group: ratio}, the groups the model has): the compressed pools whose blocks this
        manager allocates, one block table per group (V4: one group per layer kind)."""
        kinds = {model.layer_type(i) for i in range(model.num_layers)}
        return {CSA: model.csa_ratio, HCA: model.hca_ratio}, kinds

    # ---- requests ------------------------------------------------------------------------------
    def admit(self, request_id) -> int:
        if request_id in self.slot_of:
            raise ValueError(f"request_id: {request_id!r} is already admitted")
        if not self.free_slots:
            raise CacheFullError(f"admit: all {self.cfg.max_requests} request slots are in use")
        slot = self.free_slots.pop()
        self.slot_of[request_id], self.length[request_id] = slot, 0
        return slot

    def release(self, request_id):
        slot = self._slot(request_id)
        for kind, table in self.tables.items():
            row = table[slot]
            self.allocators[kind].give(row[row >= 0].tolist())
            row.fill_(-1)
        del self.slot_of[request_id], self.length[request_id]
        self.free_slots.append(slot)
        self.free_slots.sort(reverse=True)

    def _slot(self, request_id) -> int:
        if request_id not in self.slot_of:
            raise KeyError(f"request_id: {request_id!r} is not admitted (unknown or released)")
        return self.slot_of[request_id]

    # ---- the step ------------------------------------------------------------------------------
    def prepare_step(self, new_tokens: Mapping[object, int]) -> StepMeta:
        """`new_tokens` maps each request of the step to how many tokens it adds (a prefill chunk, a
        continuation, or 1 for decode), in the order their tokens appear in the step's flat batch.
        Raises before changing anything if a request is unknown, a count is not positive, a
        position would pass max_context, the step passes its capacity, or blocks run out."""
        cfg = self.cfg
        plan = []
        for rid, n in new_tokens.items():
            slot = self._slot(rid)
            if n < 1:
                raise ValueError(f"new_tokens[{rid!r}]: expected >= 1 token, got {n}")
            if n > cfg.request_step_tokens:
                raise ValueError(f"new_tokens[{rid!r}]: expected <= {cfg.request_step_tokens} tokens per request "
                                 f"per step (the window ring's slack), got {n}")
            start = self.length[rid]
            if start + n > cfg.max_context:
                raise ValueError(f"new_tokens[{rid!r}]: positions {start}..{start + n - 1} pass max_context "
                                 f"{cfg.max_context}")
            plan.append((rid, slot, start, n))
        total = sum(n for *_, n in plan)
        if total > cfg.max_step_tokens:
            raise ValueError(f"new_tokens: {total} tokens pass max_step_tokens {cfg.max_step_tokens}")
        need = {k: [] for k in self.tables}
        for rid, slot, start, n in plan:
            for kind, r in self.ratios.items():
                if self.widths[kind] == 0:
                    continue
                have = int((self.tables[kind][slot] >= 0).sum())
                want = -(-((start + n) // r) // cfg.block_size)
                need[kind] += [(slot, b) for b in range(have, want)]
        for kind, blocks in need.items():
            if len(blocks) > len(self.allocators[kind].free):
                raise CacheFullError(f"prepare_step: the {kind} pool needs {len(blocks)} more blocks, "
                                     f"{len(self.allocators[kind].free)} are free")
        # Every check passed: allocate and commit.
        for kind, blocks in need.items():
            for (slot, b), block in zip(blocks, self.allocators[kind].take(len(blocks))):
                self.tables[kind][slot, b] = block
        bucket = min(b for b in cfg.buckets if b >= total)
        pos = torch.zeros(bucket, dtype=torch.int32)
        req = torch.full((bucket,), -1, dtype=torch.int32)
        i = 0
        for rid, slot, start, n in plan:
            pos[i:i + n] = torch.arange(start, start + n, dtype=torch.int32)
            req[i:i + n] = slot
            self.length[rid] = start + n
            i += n
        entries = {k: self._entry_slots(k, pos, req) for k in self.tables}
        return self._step_meta(pos, req, entries)

    def _step_meta(self, pos: torch.Tensor, req: torch.Tensor, entries: dict) -> StepMeta:
        """The step's device metadata from its positions, request slots and entry slots per group."""
        return StepMeta(pos, req, entries[CSA], entries[HCA], self.tables[CSA].clone(),
                        self.tables[HCA].clone()).to(self.device)

    def _entry_slots(self, kind: str, pos: torch.Tensor, req: torch.Tensor) -> torch.Tensor:
        r, bs = self.ratios[kind], self.cfg.block_size
        closes = (req >= 0) & ((pos + 1) % r == 0)
        if self.widths[kind] == 0 or not bool(closes.any()):
            return torch.full_like(pos, -1)
        w = (pos // r).long()
        blocks = self.tables[kind][req.clamp(min=0).long(), (w // bs).clamp(max=self.widths[kind] - 1)]
        return torch.where(closes, blocks * bs + (w % bs).int(), -1).to(torch.int32)
