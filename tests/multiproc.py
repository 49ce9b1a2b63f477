"""Run a test body on several processes joined by a process group (torch.multiprocessing spawn), for
the tests of tensor and context parallelism: `run(fn, *args)` calls fn(rank, group, *args) on each
rank and returns what each rank returned (torch.save'd, by rank); an exception on a rank fails the
call with its traceback. backend "gloo": CPU processes (the CPU suite); "nccl": one GPU a process
(the 2-GPU tier; NVLink multicast stays off: NCCL_NVLS_ENABLE=0 and TORCH_SYMM_MEM_DISABLE_MULTICAST=1
are kept as the machine sets them, set where it does not, and reach the spawned processes). A rank
still running after HANG_S[backend] seconds prints every thread's stack and exits, which fails the
call with the place it hung (the 2-GPU tier's first run hung silently in NCCL's teardown)."""

from __future__ import annotations

import faulthandler
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dsv4ops.parallel import destroy_process_group

NO_MULTICAST = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
# Far above a body's run: an nccl body compiles two CUDA-graph buckets of a 3-layer V4-Flash stack
# (the parallel bench compiled its 15 layer steps in about 3 minutes on 2 x H200); a gloo test took
# at most 16 s on 2 cores (test_tp / test_dcp, 2026-11-27).
HANG_S = {"nccl": 300, "gloo": 900}


def _main(rank: int, world: int, backend: str, store: str, fn, args: tuple, out: str) -> None:
    faulthandler.dump_traceback_later(HANG_S[backend], exit=True)
    device = None
    if backend == "nccl":
        for k, v in NO_MULTICAST.items():
            assert os.environ.get(k) == v, f"{k}={os.environ.get(k)!r}: NVLink multicast must stay off"
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
    else:  # two processes share the CI machine's 2 cores
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
    dist.init_process_group(backend, init_method=f"file://{store}", rank=rank, world_size=world, device_id=device)
    try:
        torch.manual_seed(0)
        torch.save(fn(rank, dist.group.WORLD, *args), f"{out}.{rank}")
    finally:
        destroy_process_group()  # frees the steps' CUDA graphs first: NCCL's destroy waits for them
        faulthandler.cancel_dump_traceback_later()


def run(fn, *args, world: int = 2, backend: str = "gloo") -> list:
    """fn(rank, group, *args) on `world` processes; returns [rank 0's result, rank 1's, ...]."""
    if backend == "nccl":
        for k, v in NO_MULTICAST.items():
            os.environ.setdefault(k, v)  # the spawned processes inherit the environment
    with tempfile.TemporaryDirectory() as tmp:
        store, out = os.path.join(tmp, "store"), os.path.join(tmp, "out")
        mp.spawn(_main, args=(world, backend, store, fn, args, out), nprocs=world)
        return [torch.load(f"{out}.{r}", weights_only=False, map_location="cpu") for r in range(world)]
