"""The metadata of one serving step: int32 tensors only, a registered pytree, padded to a bucket
(padding tokens have request slot -1 and read and write nothing), plus the planner's host-side
record (`StepMeta.origin`, never traced)."""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import ClassVar

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from dsv4ops.config import CSA


@dataclass(frozen=True)
class PlannedRequest:
    """One request of a step as the planner saw it: id, slot, the slot's generation, first position
    and token count."""

    request_id: object
    slot: int
    generation: int
    start: int
    tokens: int


@dataclass(frozen=True)
class StepOrigin:
    """Host-side record of who planned a step: the manager's id, the step's number, its requests,
    and (for steps on the CPU) copies of the planned per-token tensors, so the eager forward checks
    a step without reading device memory (the block tables it checks against the manager's host
    tables: KVCacheManager.check_step)."""

    manager_id: int
    step_id: int
    requests: tuple[PlannedRequest, ...]
    planned: dict[str, Tensor] | None  # CPU copies of the step's per-token tensors (by name), for a step on the CPU


@dataclass
class StepMeta:
    """positions [T], req_slots [T] (-1: padding), entry_slots_csa / entry_slots_hca [T] (pool slot
    of the compressed entry a token closes, else -1), block_table_csa / block_table_hca
    [max_requests, blocks] (physical block of each block of entries; -1 unallocated), req_gens [T]
    (the generation of each token's request slot when the step was planned), window_ends [T] (the
    last position of each token's window: its own, or its draft block's last, see
    KVCacheManager.prepare_step). All CSA layers share one block table (their pools fill in step),
    and so do all HCA layers.

    The block tables are the manager's `device_tables`, the same tensors in every step (kept on the
    device, updated in place by the next prepare_step with the rows written since): a step reads
    them, never writes them, and they hold its plan until the next step is planned.

    A token runs only while its slot still has that generation (the layer compares req_gens with
    its cache's `generations` on the device): the manager gives a slot a new generation on admit,
    release, commit and abort, so only the open step of the layer's own manager writes anything."""

    positions: Tensor
    req_slots: Tensor
    entry_slots_csa: Tensor
    entry_slots_hca: Tensor
    block_table_csa: Tensor
    block_table_hca: Tensor
    req_gens: Tensor
    window_ends: Tensor
    # The planner's host-side record: a plain attribute, not a dataclass field, so it is neither a
    # pytree leaf nor seen by torch.compile.
    origin: ClassVar[StepOrigin | None] = None

    def entry_slots(self, kind: str) -> Tensor:
        return self.entry_slots_csa if kind == CSA else self.entry_slots_hca

    def block_table(self, kind: str) -> Tensor:
        return self.block_table_csa if kind == CSA else self.block_table_hca

    def to(self, device) -> StepMeta:
        moved = StepMeta(*(getattr(self, f.name).to(device, non_blocking=True) for f in fields(self)))
        moved.origin = self.origin
        return moved

    def tensors(self) -> dict[str, Tensor]:
        """The step's tensors by field name."""
        return {f.name: getattr(self, f.name) for f in fields(self)}


pytree.register_dataclass(StepMeta)


def visible_counts(positions: Tensor, req_slots: Tensor, ratio: int) -> Tensor:
    """[T] int32: complete entries of each token's request, (t + 1) // m (0 for padding)."""
    return torch.where(req_slots >= 0, (positions + 1) // ratio, 0).to(torch.int32)


def live_tokens(step, cache, *counts: tuple[int, int]) -> tuple[Tensor, ...]:
    """(positions, req_slots, then visible and lens for each (ratio, width) of `counts`) of `step` (a
    StepMeta or V41StepMeta) with every token that must not run turned into padding, on the device
    and without a sync, against `cache` (its `generations` and CacheConfig): request slot out of
    range, slot generation != the step's (a foreign, stale or closed step), position outside [0,
    max_context). visible: the complete entries at compression `ratio` of each live token's request
    (visible_counts; ratio 0: none), lens: visible cut at `width` (the comp_idx columns sparse_attn
    reads).

    Every serving forward calls it first, so it also marks the step as run on `cache` (`ran_step` =
    the step's first token's generation, never padding, unique to the step): a device write, so
    eager and compiled forwards (CUDA graphs included) mark alike, and commit refuses a step that an
    attached cache did not run.

    The values are rows of one [2 + 2 len(counts), T] int32 tensor, so Inductor computes them in one
    kernel into one buffer that every op reads. Separate, each cheap pointwise result was recomputed
    into a fresh buffer for every op taking it (an op's exact-stride input): positions in 3, 7 and 5
    buffers of a sliding, CSA and HCA layer's compiled step (tests/test_compile.py). A V4 layer runs
    the check in its own forward (a graph replayed with a stale step must compare with its own
    cache's generations); the V4.1 stack runs it once per step for all its layers (one cache)."""
    cache.ran_step.copy_(step.req_gens[:1])
    pos, req = step.positions, step.req_slots
    n = cache.generations.shape[0]
    pos_ok = (pos >= 0) & (pos < cache.cfg.max_context)
    live = (req >= 0) & (req < n) & pos_ok
    live &= cache.generations[req.clamp(0, n - 1).long()] == step.req_gens
    pos, req = torch.where(pos_ok, pos, 0), torch.where(live, req, -1)
    rows = [pos, req]
    for ratio, width in counts:
        visible = visible_counts(pos, req, ratio) if ratio else torch.zeros_like(pos)
        rows += [visible, visible.clamp(max=width)]
    return torch.stack(rows).unbind(0)
