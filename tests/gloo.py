"""Run a test body on several CPU processes joined by a gloo process group (torch.multiprocessing
spawn), for the tests of tensor and context parallelism: `run(fn, *args)` calls fn(rank, group,
*args) on each rank and returns what each rank returned (torch.save'd), by rank; an exception on a
rank fails the call with its traceback."""

from __future__ import annotations

import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _main(rank: int, world: int, store: str, fn, args: tuple, out: str) -> None:
    # Two processes share the CI machine's 2 cores.
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        torch.save(fn(rank, dist.group.WORLD, *args), f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def run(fn, *args, world: int = 2) -> list:
    """fn(rank, group, *args) on `world` gloo processes; returns [rank 0's result, rank 1's, ...]."""
    with tempfile.TemporaryDirectory() as tmp:
        store, out = os.path.join(tmp, "store"), os.path.join(tmp, "out")
        mp.spawn(_main, args=(world, store, fn, args, out), nprocs=world)
        return [torch.load(f"{out}.{r}", weights_only=False) for r in range(world)]
