"""2-GPU tier (2 x H100, NCCL, NVLink multicast off): tensor and decode context parallelism compiled
with mode="reduce-overhead" (the step and its collectives in CUDA graphs): no cudagraph skip, the
outputs within the error budget of the one-GPU eager run against the fp64 oracle. V4-Flash-shaped
layers (sliding, CSA, HCA; FP8 pools) and the V4.1 stack (QAT formats). Issue 31.

Run: python -m pytest -m gpu tests/test_parallel_gpu.py (needs 2 GPUs; one process per GPU is
spawned by the tests)."""

import copy

import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters

import multiproc
from dsv4ops import CacheFormats, DeepseekV4Attention, DSV4AttentionConfig, layers, reference, testing
from dsv4ops.cache import CacheConfig, KVCacheManager, V41CacheManager
from dsv4ops.config_v41 import DSV41AttentionConfig
from dsv4ops.layers_v41 import DeepseekV41AttentionStack
from dsv4ops.reference.v41 import stack_attention
from dsv4ops.testing_v41 import check_pool, check_selection, slots_to_entries

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="the 2-GPU tier needs 2 GPUs")]

# V4-Flash dims (64 heads x 512, hidden 4096, 64 x 128 indexer, top-512), 3 layers: sliding, CSA, HCA.
CFG = DSV4AttentionConfig.flash().replace(num_layers=3, compress_ratios=(0, 4, 128))
FP8 = CacheFormats.v4()
LENGTHS = [5, 127, 129, 300, 600, 700]  # prompt lengths; decode crosses 127 and 3 mod 4
DECODE_STEPS = 24


class Stack(nn.Module):
    def __init__(self, process_group=None):
        super().__init__()
        self.layers = nn.ModuleList(DeepseekV4Attention(CFG, i, formats=FP8, process_group=process_group)
                                    for i in range(3))

    def forward(self, x, step):
        for layer in self.layers:
            x = x + layer(x, step)
        return x


def _steps():
    yield {r: n // 2 for r, n in enumerate(LENGTHS) if n // 2}
    yield {r: n - n // 2 for r, n in enumerate(LENGTHS)}
    for _ in range(DECODE_STEPS):
        yield {r: 1 for r in range(len(LENGTHS))}


def _run(fn, manager, inputs, compiled: bool):
    done, outs = [0] * len(LENGTHS), [[] for _ in LENGTHS]
    for r in range(len(LENGTHS)):
        manager.admit(r)
    for new in _steps():
        with manager.step(new) as step:
            x = torch.cat([inputs[r][done[r]:done[r] + n] for r, n in new.items()])
            x = torch.cat([x, x.new_zeros(step.positions.shape[0] - x.shape[0], x.shape[1])])
            if compiled:
                torch.compiler.cudagraph_mark_step_begin()
            y = fn(x, step).clone()
        i = 0
        for r, n in new.items():
            outs[r].append(y[i:i + n])
            done[r] += n
            i += n
    return [torch.cat(o) for o in outs]


def _flash_body(rank, group, mode):
    """mode "tp": the stack's heads split over the 2 GPUs; "dcp": its cache's entries."""
    torch._dynamo.reset()
    counters.clear()
    cache_cfg = CacheConfig(max_requests=8, max_context=1024, max_step_tokens=1024, buckets=(8, 1024))
    full = Stack().to("cuda", torch.bfloat16)
    for i, layer in enumerate(full.layers):
        testing.randomize_(layer, seed=11 + i)
    g = torch.Generator(device="cuda").manual_seed(0)
    inputs = [torch.randn(n + DECODE_STEPS, CFG.hidden_size, device="cuda", dtype=torch.bfloat16, generator=g)
              for n in LENGTHS]
    with torch.no_grad():
        manager = KVCacheManager(CFG, cache_cfg, device="cuda")
        for layer in full.layers:
            layer.attach_cache(manager)
        eager = _run(full, manager, inputs, False)
        if mode == "tp":
            model = Stack(process_group=group).to("cuda", torch.bfloat16)
            model.load_state_dict(full.state_dict())
            manager = KVCacheManager(CFG, cache_cfg, device="cuda")
        else:
            model = copy.deepcopy(full)
            manager = KVCacheManager(CFG, cache_cfg, device="cuda", dcp_group=group)
        for layer in model.layers:
            layer.attach_cache(manager)
        compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
        outs = _run(compiled, manager, inputs, True)
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    assert counters["stats"]["unique_graphs"] == 2, counters["stats"]  # one graph per bucket
    params = [{k: v.double() for k, v in layer.named_parameters()} for layer in full.layers]
    for r, n in enumerate(LENGTHS):
        def run64(r=r, n=n):
            h = inputs[r][: n + DECODE_STEPS][None].double()
            for i in range(3):
                h = h + reference.attention(params[i], CFG, i, h, reference.Numerics("fp8", "fp8"))
            return h[0]

        # Budget: the one-GPU eager run and the oracle's FP8 rounding twins (a layer's output that
        # moved by the all-reduce's or the merge's rounding may flip an e4m3 rounding in the next
        # layer's KV, as between any two summation orders).
        testing.assert_close_to_ref(outs[r], run64(), [eager[r], *testing.rounding_twins(run64)],
                                    what=f"rank {rank} {mode} request {r}")
    return True


@pytest.mark.parametrize("mode", ["tp", "dcp"])
def test_flash_stack_in_cuda_graphs_equals_one_gpu(mode):
    assert multiproc.run(_flash_body, mode, backend="nccl") == [True, True]


def _selection_body(rank, group):
    """A CSA layer with a real selection (top-64 of up to 250 entries; 16-entry blocks on both
    GPUs): the merged top-k is a top-k of the fp64 oracle's scores up to their rounding, and the
    output equals the oracle fed that selection."""
    cfg = CFG.replace(index_topk=64)
    layer = testing.randomize_(DeepseekV4Attention(cfg, 1, formats=FP8), seed=3).to("cuda", torch.bfloat16)
    manager = KVCacheManager(cfg, CacheConfig(max_requests=2, max_context=1024, max_step_tokens=512, block_size=16),
                             device="cuda", dcp_group=group)
    layer.attach_cache(manager)
    original, log = layers._select_dcp, []

    def record(*args):
        out = original(*args)
        log.append(out[2])
        return out

    layers._select_dcp = record
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(1000, cfg.hidden_size, device="cuda", dtype=torch.bfloat16, generator=g)
    outs, sels = [], []
    manager.admit("r")
    try:
        with torch.no_grad():
            for lo, hi in ((0, 512), (512, 990)) + tuple((p, p + 1) for p in range(990, 1000)):
                with manager.step({"r": hi - lo}) as step:
                    rows = torch.cat([x[lo:hi], x.new_zeros(step.positions.shape[0] - (hi - lo), x.shape[1])])
                    outs.append(layer(rows, step)[:hi - lo])
                    sels.append(log[-1][:hi - lo])
    finally:
        layers._select_dcp = original
    full = DeepseekV4Attention(cfg, 1, formats=FP8).to("cuda", torch.bfloat16)
    full.load_state_dict(layer.state_dict())
    testing.assert_matches_oracle(full, x, torch.cat(outs), torch.cat(sels), what=f"rank {rank} merged top-k")
    return True


def test_dcp_real_selection_is_a_topk_of_the_whole_context():
    assert multiproc.run(_selection_body, backend="nccl") == [True, True]


# ---- V4.1 ---------------------------------------------------------------------------------------
CFG41 = DSV41AttentionConfig.tiny()
SCHEDULE41 = [{"a": 40, "b": 17}, {"a": 40, "b": 16}] + [{"a": 1, "b": 1}] * 12


def _v41_run(stack, manager, inputs, compiled_fn=None):
    """(outputs, top-k entries, pools) of SCHEDULE41; the selections from an eager run only (the
    compiled step returns the outputs alone)."""
    published, done = {}, {r: 0 for r in inputs}
    outs, topk, pools = {r: [] for r in inputs}, {r: {} for r in inputs}, {r: [] for r in inputs}
    bs = manager.cfg.block_size
    for new in SCHEDULE41:
        for r in new:
            if r not in manager.slot_of:
                manager.admit(r)
        with manager.step(new) as step:
            xs = torch.cat([inputs[r][:, done[r]:done[r] + n] for r, n in new.items()], 1)
            xs = torch.cat([xs, xs.new_zeros(xs.shape[0], step.positions.shape[0] - xs.shape[1], xs.shape[2])], 1)
            if compiled_fn is None:
                ys = stack(xs, step, published)
            else:
                torch.compiler.cudagraph_mark_step_begin()
                ys = compiled_fn(xs, step)
            ys = ys.clone()
            i = 0
            for r, n in new.items():
                outs[r].append(ys[:, i:i + n])
                for key, idx in published.items():
                    if isinstance(key, tuple):
                        s = idx[i:i + n].cpu()
                        if manager.dcp is None:
                            s = slots_to_entries(s, step.block_table(CFG41.role(key[1]).ratio)[manager.slot_of[r]]
                                                 .cpu(), bs)
                        topk[r].setdefault(key[1], []).append(s.long())
                if "pool" in published:
                    pools[r].append(published["pool"][i:i + n].long().cpu())
                done[r] += n
                i += n
    return ({r: torch.cat(v, 1) for r, v in outs.items()},
            {r: {k: torch.cat(v) for k, v in d.items()} for r, d in topk.items()},
            {r: torch.cat(v) if v else None for r, v in pools.items()})


def _v41_body(rank, group, mode):
    """The parallel stack eager (its selections: the oracle's) and compiled with CUDA graphs: the
    compiled outputs within the eager parallel run's error of the fp64 oracle fed those selections;
    the selections a top-k of the oracle's scores up to their rounding."""
    torch._dynamo.reset()
    counters.clear()
    block = 52  # whole candidate blocks of 4 in a block; mxfp4_68 pages 52 x 68 B in 3584 B
    full = testing.randomize_(DeepseekV41AttentionStack(CFG41), seed=0).to("cuda", torch.bfloat16)
    cache_cfg = CacheConfig(max_requests=2, max_context=128, max_step_tokens=128, block_size=block, buckets=(2, 128))
    g = torch.Generator().manual_seed(1)
    inputs = {r: torch.randn(CFG41.num_layers, n, CFG41.hidden_size, generator=g).to("cuda", torch.bfloat16)
              for r, n in (("a", 92), ("b", 45))}

    def parallel():
        if mode == "tp":
            stack = DeepseekV41AttentionStack(CFG41, process_group=group).to("cuda", torch.bfloat16)
            stack.load_state_dict(full.state_dict())
            manager = V41CacheManager(CFG41, cache_cfg, device="cuda")
        else:
            stack = copy.deepcopy(full)
            manager = V41CacheManager(CFG41, cache_cfg, device="cuda", dcp_group=group)
        stack.attach_cache(manager)
        return stack, manager

    with torch.no_grad():
        stack, manager = parallel()
        eager, topk, pools = _v41_run(stack, manager, inputs)
        stack, manager = parallel()
        compiled = torch.compile(stack, mode="reduce-overhead", fullgraph=True)
        outs, _, _ = _v41_run(stack, manager, inputs, compiled)
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])
    assert counters["stats"]["unique_graphs"] == 2, counters["stats"]  # one graph per bucket
    params = {k: v.cpu() for k, v in full.named_parameters()}
    for r, x in inputs.items():
        sel = {k: v[None] for k, v in topk[r].items()}
        pool = {CFG41.candidate_source_layer: pools[r][None]}
        ref64 = stack_attention({k: v.double() for k, v in params.items()}, CFG41, x.cpu()[:, None].double(),
                                CacheFormats.v41(), sel, pool)
        testing.assert_close_to_ref(outs[r].cpu(), ref64.y[:, 0], eager[r].cpu(), what=f"rank {rank} {mode} {r}")
        low = stack_attention(params, CFG41, x.cpu()[:, None], CacheFormats.v41(), sel, pool)
        for layer, picked in topk[r].items():
            check_selection(picked, ref64.scores[layer][0], low.scores[layer][0], f"request {r} layer {layer}")
        for layer, pk in pool.items():
            check_pool(pk[0], ref64.scores[layer][0], low.scores[layer][0], CFG41, f"request {r} pool")
    return True


@pytest.mark.parametrize("mode", ["tp", "dcp"])
def test_v41_stack_in_cuda_graphs_equals_one_gpu(mode):
    assert multiproc.run(_v41_body, mode, backend="nccl") == [True, True]
