"""GPU: speculative decoding and prefix sharing (issue 14) on CUDA tensors, through the Triton
kernels: the CPU suite's verify schedules with rewinds (every layer type and cache mode) and forks
at every boundary (copy on write included) equal the oracle; a stack of the three layer types
compiled with mode="reduce-overhead", fullgraph=True runs a verify loop with rewinds, a fork and
copies on write without cudagraph skips, with one recorded graph per bucket and no recompile after
the buckets are warm; the V4.1 stack's verify schedule through the reference kernels.

FP8 pools run a bf16 model, unquantized pools an fp32 model (see test_serving_gpu)."""

import drivers
import pytest
import torch
from test_serving import CFG, MODES
from test_serving_v41_gpu import _reference_kernels
from test_spec import DRAFTS, LAYER, fork_run, verify_run
from torch import nn
from torch._dynamo.utils import counters
from torch._inductor import cudagraph_trees

from dsv4ops import DeepseekV4Attention, reference, testing
from dsv4ops.cache import CacheConfig, KVCacheManager
from dsv4ops.config import CSA, HCA, SLIDING

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("kind", [SLIDING, CSA, HCA])
def test_verify_steps_with_rewinds_on_cuda(kind, mode):
    verify_run(kind, mode, "cuda", torch.bfloat16 if mode == "fp8" else torch.float32)


@pytest.mark.parametrize("kind", [SLIDING, CSA, HCA])
def test_forks_on_cuda(kind):
    fork_run(kind, "cuda", torch.bfloat16)


class Stack(nn.Module):
    """The tiny config's sliding, CSA and HCA layers, residual, one manager."""

    def __init__(self):
        super().__init__()
        fp8 = MODES["fp8"]
        self.layers = nn.ModuleList(testing.randomize_(DeepseekV4Attention(CFG, i, formats=fp8), seed=i)
                                    for i in LAYER.values())

    def forward(self, x, step):
        for layer in self.layers:
            x = x + layer(x, step)
        return x


RECORDED = []  # cudagraph recordings (CUDAGraphTreeManager.record_function calls)


def _stack_run(fn, manager, inputs):
    """The warm-up steps (every bucket twice: 160, 16, 8; cudagraph trees warm a function up once,
    then record it), then a fork of b at 48 tokens (12 entries, 6 full blocks shared) taken back
    2 tokens (the entry it closes next is in a shared block: a copy on write), and a random verify
    schedule of a, b and c. Returns (outputs, the unique graphs and recordings after the warm-up)."""
    warm = [{"a": (60, 60), "b": (20, 20)}, {"a": (40, 40), "b": (20, 20)}, {"a": (6, 2), "b": (8, 8)},
            {"a": (12, 9)}, {"a": (3, 1)}, {"a": (4, 4)}]
    with torch.no_grad():
        first = drivers.serve_speculative(fn, manager, {r: inputs[r] for r in "ab"}, warm,
                                          torch.Generator().manual_seed(1))
        after_warm = (counters["stats"]["unique_graphs"], len(RECORDED))
        manager.fork("b", "c", 48)
        manager.rewind("c", 2)
        rest = drivers.speculative_schedule({"a": 34, "b": 20, "c": 20}, DRAFTS, seed=3)
        more = drivers.serve_speculative(fn, manager, {"a": inputs["a"][116:], "b": inputs["b"][48:],
                                                       "c": inputs["c"]}, rest, torch.Generator().manual_seed(2))
    return {"a": torch.cat([first["a"], more["a"]]), "b": torch.cat([first["b"], more["b"]]), "c": more["c"]}, after_warm


def _graphed(model):
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)

    def fn(x, step):
        torch.compiler.cudagraph_mark_step_begin()
        return compiled(x, step).clone()  # a replay overwrites the graph's outputs

    return fn


def test_reduce_overhead_verify_loop_records_one_graph_per_bucket(monkeypatch):
    torch._dynamo.reset()
    counters.clear()
    RECORDED.clear()
    record = cudagraph_trees.CUDAGraphTreeManager.record_function

    def counting(self, *a, **k):
        RECORDED.append(1)
        return record(self, *a, **k)

    monkeypatch.setattr(cudagraph_trees.CUDAGraphTreeManager, "record_function", counting)
    cache_cfg = CacheConfig(max_requests=4, max_context=280, max_step_tokens=160, buckets=(8, 16, 160), block_size=2,
                            max_draft_tokens=DRAFTS)
    g = torch.Generator().manual_seed(0)
    inputs = {r: torch.randn(n, CFG.hidden_size, generator=g).to("cuda", torch.bfloat16)
              for r, n in (("a", 150), ("b", 68), ("c", 20))}
    runs = []
    for compile_it in (False, True):
        manager = KVCacheManager(CFG, cache_cfg, device="cuda")
        model = Stack().to("cuda", torch.bfloat16)
        for layer in model.layers:
            layer.attach_cache(manager)
        runs.append(_stack_run(_graphed(model) if compile_it else model, manager, inputs))
    (eager, _), (outs, (graphs, records)) = runs
    assert counters["inductor"]["cudagraph_skips"] == 0
    assert graphs <= 3 and counters["stats"]["unique_graphs"] == graphs, counters["stats"]
    assert records == 3 and len(RECORDED) == records, len(RECORDED)  # one graph per bucket, replays after
    # Same kernels, Inductor-fused projections: compiled vs the fp64 oracle chain within the eager
    # run's own error, per request.
    params = [{k: v.double() for k, v in layer.named_parameters()} for layer in model.layers]
    seqs = {"a": inputs["a"], "b": inputs["b"], "c": torch.cat([inputs["b"][:46], inputs["c"]])}
    for r, x in seqs.items():
        h = x[None].double()
        for i, li in enumerate(LAYER.values()):
            h = h + reference.attention(params[i], CFG, li, h, reference.Numerics("fp8", "fp8"))
        s = 46 if r == "c" else 0
        testing.assert_close_to_ref(outs[r], h[0, s:], eager[r], what=f"request {r}")


def test_v41_verify_steps_with_rewinds_on_cuda():
    from test_spec_v41 import CFG as CFG41
    from test_spec_v41 import NUMERICS

    from dsv4ops.cache.v41 import V41CacheManager
    from dsv4ops.layers_v41 import DeepseekV41AttentionStack
    from dsv4ops.reference.v41 import stack_attention

    stack = testing.randomize_(DeepseekV41AttentionStack(CFG41, NUMERICS["qat"]), seed=0).to("cuda", torch.bfloat16)
    manager = V41CacheManager(CFG41, CacheConfig(max_requests=4, max_context=112, max_step_tokens=160, block_size=7,
                                                 max_draft_tokens=DRAFTS, formats=NUMERICS["qat"]), device="cuda")
    stack.attach_cache(manager)
    lengths = {"a": 64, "b": 29, "c": 9}
    g = torch.Generator().manual_seed(1)
    inputs = {r: torch.randn(CFG41.num_layers, n, CFG41.hidden_size, generator=g).to("cuda", torch.bfloat16)
              for r, n in lengths.items()}
    schedule = drivers.speculative_schedule(lengths, DRAFTS, seed=2, prefill={"a": 30})
    with torch.no_grad(), _reference_kernels():
        outs = drivers.serve_speculative(stack, manager, inputs, schedule, g)
    params = {k: v.cpu() for k, v in stack.named_parameters()}
    for r, x in inputs.items():
        ref64 = stack_attention({k: v.double() for k, v in params.items()}, CFG41, x.cpu()[:, None].double(),
                                NUMERICS["qat"])
        low = stack_attention(params, CFG41, x.cpu()[:, None], NUMERICS["qat"])
        testing.assert_close_to_ref(outs[r].cpu(), ref64.y[:, 0], low.y[:, 0], what=f"request {r}")
