"""The metadata of one serving step: int32 tensors only, a registered pytree, padded to a bucket
(padding tokens have request slot -1 and read and write nothing)."""

from dataclasses import dataclass

import torch
import torch.utils._pytree as pytree
from torch import Tensor

from dsv4ops.config import CSA, HCA


@dataclass
class StepMeta:
    """positions [T], req_slots [T] (-1: padding), entry_slots_csa / entry_slots_hca [T] (pool slot
    of the compressed entry a token closes, else -1), block_table_csa / block_table_hca
    [max_requests, blocks] (physical block of each block of entries; -1 unallocated). All CSA
    layers share one block table (their pools fill in step), and so do all HCA layers."""

    positions: Tensor
    req_slots: Tensor
    entry_slots_csa: Tensor
    entry_slots_hca: Tensor
    block_table_csa: Tensor
    block_table_hca: Tensor

    def entry_slots(self, kind: str) -> Tensor:
        return self.entry_slots_csa if kind == CSA else self.entry_slots_hca

    def block_table(self, kind: str) -> Tensor:
        return self.block_table_csa if kind == CSA else self.block_table_hca

    def to(self, device) -> "StepMeta":
        return StepMeta(*(getattr(self, f).to(device, non_blocking=True) for f in self.__dataclass_fields__))


pytree.register_dataclass(StepMeta)


def visible_counts(step: StepMeta, ratio: int) -> Tensor:
    """[T] int32: complete entries of each token's request, (t + 1) // m (0 for padding)."""
    return torch.where(step.req_slots >= 0, (step.positions + 1) // ratio, 0).to(torch.int32)


def visible_entries(step: StepMeta, ratio: int, block_size: int) -> Tensor:
    """[T, max entries] pool slots of every complete entry of each token's request (w < (t+1)//m),
    -1 elsewhere: the HCA key list, computed on the device inside the graph."""
    table = step.block_table(HCA)
    n = table.shape[1] * block_size
    w = torch.arange(n, device=table.device, dtype=torch.int32)
    req = step.req_slots.clamp(min=0)
    slots = table[req][:, w // block_size] * block_size + w % block_size
    ok = (w[None] < (step.positions[:, None] + 1) // ratio) & (step.req_slots >= 0)[:, None]
    return slots.where(ok, -1).to(torch.int32)
