"""Attention over several processes with torch.distributed (NCCL on GPUs, gloo on CPU).

- Tensor parallel (`dsv4ops.parallel.tp`): a layer built with a `process_group` holds its rank's query
  heads and output groups; the rest (q_a, kv, compressors, indexer) is replicated; the output is
  summed over the ranks by one all-reduce.
- Decode context parallel (`dsv4ops.parallel.dcp`): a cache manager built with a `dcp_group` keeps
  each request's compressed entries (and V4.1 index keys) on the rank that owns their block; each
  rank attends over its own entries and the ranks' partial outputs are merged exactly.
- The ranks' checks (`dsv4ops.parallel.agreement`): on the host, before the collectives, that every
  rank makes the same call with the same config, failing within `agreement.timeout_s` where one
  rank's call has no partner.

Collectives go through the functional ops of `torch.ops._c10d_functional` (all_reduce,
all_gather_into_tensor, wait_tensor; torch 2.11 and 2.13 alike): Dynamo traces them, so a step and
its collectives compile into one `torch.compile(fullgraph=True)` graph. The group enters the graph
by its name only (a constant), never as an object.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

_C10D = torch.ops._c10d_functional


@dataclass(frozen=True)
class Group:
    """A process group as the layers use it: its name (what the functional collectives take), this
    process's rank in it and its size."""

    name: str
    rank: int
    size: int

    @classmethod
    def of(cls, process_group, what: str = "process_group") -> Group | None:
        """The Group of a torch.distributed ProcessGroup (None for None); binds the group's checks
        (agreement.bind: a collective of its ranks, once per group)."""
        if process_group is None:
            return None
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(f"{what}: torch.distributed is not initialized (init_process_group first)")
        if not isinstance(process_group, dist.ProcessGroup):
            raise TypeError(f"{what}: expected a torch.distributed ProcessGroup, got {type(process_group).__name__}")
        from dsv4ops.parallel import agreement

        agreement.bind(process_group)  # the side group of the ranks' checks (dsv4ops.parallel.agreement)
        return cls(process_group.group_name, dist.get_rank(process_group), dist.get_world_size(process_group))


def all_reduce(x: Tensor, group: Group) -> Tensor:
    """The sum of x over the group's ranks (a new tensor)."""
    return _C10D.wait_tensor(_C10D.all_reduce(x, "sum", group.name))


def all_gather(x: Tensor, group: Group) -> Tensor:
    """[group.size, *x.shape]: every rank's x, by rank."""
    out = _C10D.wait_tensor(_C10D.all_gather_into_tensor(x.contiguous(), group.size, group.name))
    return out.view(group.size, *x.shape)


def destroy_process_group(group=None) -> None:
    """torch.distributed.destroy_process_group(group), after freeing the CUDA graphs that
    torch.compile(mode="reduce-overhead") recorded. NCCL's communicator destroy waits until every CUDA
    graph that captured one of its collectives is freed (pytorch/pytorch#115388): a process that ran a
    parallel step in CUDA graphs otherwise hangs in this call, or at exit. Resets Dynamo: functions
    compiled before recompile on their next call."""
    import gc

    import torch.distributed as dist

    torch._dynamo.reset()
    if torch.cuda.is_available():
        from torch._inductor.cudagraph_trees import reset_cudagraph_trees

        torch.cuda.synchronize()
        reset_cudagraph_trees()  # torch 2.13's Dynamo reset does it too; 2.11's may not
    gc.collect()  # graphs held by reference cycles (compiled modules' closures)
    dist.destroy_process_group(group)
