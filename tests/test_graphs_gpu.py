"""GPU tier 2: a stack of V4-Flash-shaped layers (sliding, CSA, HCA) compiled with
mode="reduce-overhead" runs bucketed prefill then 64 decode steps for 8 requests: no cudagraph
skip, one recorded graph per bucket, replays after that, no recompiles across block boundaries,
outputs equal to eager, and the Inductor code calls the ops on the cache buffers in place."""

import re

import drivers
import pytest
import torch
from torch import nn
from torch._dynamo.utils import counters
from torch._inductor import cudagraph_trees
from torch.testing import FileCheck

from dsv4ops import CacheFormats, DeepseekV4Attention, DSV4AttentionConfig, reference, testing
from dsv4ops.cache import CacheConfig, KVCacheManager

pytestmark = pytest.mark.gpu

# Positions of the pool arguments in each op's schema (window / comp / state / index pools, workspace).
CACHE_ARGS = {"qkv_prep": (6,), "compressor_update": (8, 9), "indexer_topk": (4, 9), "sparse_attn": (1, 2)}

# V4-Flash dims (64 heads x 512, hidden 4096, q_lora 1024, 64 x 128 indexer, top-512), 3 layers.
CFG = DSV4AttentionConfig.flash().replace(num_layers=3, compress_ratios=(0, 4, 128))
FP8 = CacheFormats.v4()
LENGTHS = [5, 31, 60, 127, 129, 200, 255, 300]  # prompt lengths; decode crosses 127/255 and 3 mod 4
# Prefill in two chunks per request (1107 tokens: 553 + 554, both in the 1024 bucket), so the prefill
# bucket is called twice (warm-up, then recording) like the decode bucket (8 tokens).
DECODE_STEPS = 64


class Stack(nn.Module):
    def __init__(self, seed):
        super().__init__()
        self.layers = nn.ModuleList(
            testing.randomize_(DeepseekV4Attention(CFG, i, formats=FP8), seed=seed + i) for i in range(3)
        )

    def forward(self, x, step):
        for layer in self.layers:
            x = x + layer(x, step)
        return x


def _model(manager):
    model = Stack(seed=11).to("cuda", torch.bfloat16)
    for layer in model.layers:
        layer.attach_cache(manager)
    return model


def _steps():
    yield {r: n // 2 for r, n in enumerate(LENGTHS) if n // 2}
    yield {r: n - n // 2 for r, n in enumerate(LENGTHS)}
    for _ in range(DECODE_STEPS):
        yield {r: 1 for r in range(len(LENGTHS))}


def _run(model, manager, inputs, compiled_fn=None):
    fn = model if compiled_fn is None else compiled_fn
    done = [0] * len(LENGTHS)
    outs = [[] for _ in LENGTHS]
    for r in range(len(LENGTHS)):
        manager.admit(r)
    for new in _steps():
        with manager.step(new) as step:
            rows = [inputs[r][done[r]:done[r] + n] for r, n in new.items()]
            x = torch.cat(rows)
            x = torch.cat([x, x.new_zeros(step.positions.shape[0] - x.shape[0], x.shape[1])])
            if compiled_fn is not None:
                torch.compiler.cudagraph_mark_step_begin()
            y = fn(x, step).clone()
        i = 0
        for r, n in new.items():
            outs[r].append(y[i:i + n])
            done[r] += n
            i += n
    return [torch.cat(o) for o in outs]


def test_reduce_overhead_stack_prefill_then_decode(monkeypatch):
    torch._dynamo.reset()
    counters.clear()
    recorded, replayed = [], []
    record, execute = cudagraph_trees.CUDAGraphTreeManager.record_function, cudagraph_trees.CUDAGraphTreeManager.execute_node

    def count(fn, log):
        def wrapper(self, *a, **k):
            log.append(1)
            return fn(self, *a, **k)
        return wrapper

    monkeypatch.setattr(cudagraph_trees.CUDAGraphTreeManager, "record_function", count(record, recorded))
    monkeypatch.setattr(cudagraph_trees.CUDAGraphTreeManager, "execute_node", count(execute, replayed))
    g = torch.Generator(device="cuda").manual_seed(0)
    inputs = [torch.randn(n + DECODE_STEPS, CFG.hidden_size, device="cuda", dtype=torch.bfloat16, generator=g)
              for n in LENGTHS]
    cache_cfg = CacheConfig(max_requests=8, max_context=512, max_step_tokens=1024, buckets=(8, 1024))
    with torch.no_grad():
        eager_manager = KVCacheManager(CFG, cache_cfg, device="cuda")
        eager = _run(_model(eager_manager), eager_manager, inputs)
        manager = KVCacheManager(CFG, cache_cfg, device="cuda")
        model = _model(manager)
        compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
        outs = _run(model, manager, inputs, compiled_fn=compiled)
    assert counters["inductor"]["cudagraph_skips"] == 0
    assert counters["stats"]["unique_graphs"] == 2, counters["stats"]  # one Dynamo frame per bucket
    # Cudagraph trees warm each function up once eagerly, record it on its second call, then replay:
    # one recorded graph per bucket, every later decode step a replay.
    assert (len(recorded), len(replayed)) == (2, DECODE_STEPS - 2), (len(recorded), len(replayed))
    # Same kernels, Inductor-fused projections: compiled vs eager within the eager run's own error
    # against the fp64 oracle (chained through the 3 layers, per request).
    params = [{k: v.double() for k, v in layer.named_parameters()} for layer in model.layers]
    for r, n in enumerate(LENGTHS):
        h = inputs[r][: n + DECODE_STEPS][None].double()
        for i in range(3):
            h = h + reference.attention(params[i], CFG, i, h, reference.Numerics("fp8", "fp8"))
        testing.assert_close_to_ref(outs[r], h[0], eager[r], what=f"request {r}")


def test_inductor_code_writes_caches_in_place():
    torch._dynamo.reset()
    manager = KVCacheManager(CFG, CacheConfig(max_requests=2, max_context=256, max_step_tokens=16), device="cuda")
    model = _model(manager)
    manager.admit(0)
    step = manager.prepare_step({0: 16})
    x = torch.randn(16, CFG.hidden_size, device="cuda", dtype=torch.bfloat16)
    from torch._inductor.utils import run_and_get_code

    with torch.no_grad():
        _, codes = run_and_get_code(torch.compile(model, fullgraph=True), x, step)
    code = "\n".join(codes)
    # Inductor may interleave independent ops of different layers; each op appears as a direct
    # (reinplaced) call, as often as the three layers call it.
    counts = {"qkv_prep": 3, "compressor_update": 3, "indexer_q_prep": 1, "indexer_topk": 1, "visible_entries": 1,
              "sparse_attn": 3, "inv_rope": 3}
    for op, n in counts.items():
        FileCheck().check_count(f"torch.ops.dsv4.{op}.default(", n, exactly=True).run(code)
    FileCheck().check_not("aten.copy_").check_not(".copy_(").run(code)
    # Every cache argument is the module buffer itself (a graph input, argN_1): no clone or temporary
    # stands in for a pool. (Activations may be cloned, e.g. the grouped output's flatten.)
    for op, positions in CACHE_ARGS.items():
        for call in re.findall(rf"torch\.ops\.dsv4\.{op}\.default\((.*)\)", code):
            args = drivers.split_args(call)
            for i in positions:
                assert re.fullmatch(r"arg\d+_1", args[i]), (op, i, call)
