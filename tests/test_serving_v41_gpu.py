"""GPU tiers 1-2 for V4.1: the stack serves mixed prefill / decode steps on the GPU through its Triton
kernels (and, switched off, through the ops' reference kernels), equal to the fp64 oracle within the
bf16 oracle's error (tie-aware: the oracle takes the GPU run's selections and pools); compiled with
mode="reduce-overhead": no cudagraph skip, one graph per bucket, outputs as eager. Issues 13, 16."""

import contextlib
import sys

import pytest
import torch
from drivers_v41 import serve_schedule
from torch._dynamo.utils import counters
from torch._inductor import cudagraph_trees

import dsv4ops
from dsv4ops import CacheFormats, testing
from dsv4ops.cache.config import CacheConfig
from dsv4ops.cache.v41 import V41CacheManager
from dsv4ops.config_v41 import DSV41AttentionConfig
from dsv4ops.layers_v41 import DeepseekV41AttentionStack
from dsv4ops.reference.v41 import stack_attention
from dsv4ops.testing_v41 import check_pool, check_selection

pytestmark = pytest.mark.gpu
CFG = DSV41AttentionConfig.tiny()


@contextlib.contextmanager
def _reference_kernels():
    with contextlib.ExitStack() as stack:
        for op in dsv4ops.backends.TRITON_LAUNCHERS:
            stack.enter_context(getattr(dsv4ops.ops, op).set_kernel_enabled("cuda", False))
        yield


def _served():
    stack = testing.randomize_(DeepseekV41AttentionStack(CFG), seed=0).to("cuda", torch.bfloat16)
    manager = V41CacheManager(CFG, CacheConfig(max_requests=2, max_context=128, max_step_tokens=128, block_size=7,
                                               buckets=(2, 128)), device="cuda")
    stack.attach_cache(manager)
    g = torch.Generator().manual_seed(1)
    inputs = {r: torch.randn(CFG.num_layers, n, CFG.hidden_size, generator=g).to("cuda", torch.bfloat16)
              for r, n in (("a", 96), ("b", 33))}
    return stack, manager, inputs


SCHEDULE = [{"a": 40, "b": 17}, {"a": 40, "b": 16}] + [{"a": 1}] * 16


def _check_against_oracle(stack, inputs, outs, topk, pools):
    params = {k: v.cpu() for k, v in stack.named_parameters()}
    for rid, x in inputs.items():
        sel = {k: v[None] for k, v in topk[rid].items()}
        pool = {k: v[None] for k, v in pools[rid].items()}
        ref64 = stack_attention({k: v.double() for k, v in params.items()}, CFG, x.cpu()[:, None].double(),
                                CacheFormats.v41(), sel, pool)
        low = stack_attention(params, CFG, x.cpu()[:, None], CacheFormats.v41(), sel, pool)
        testing.assert_close_to_ref(outs[rid].cpu(), ref64.y[:, 0], low.y[:, 0], what=f"request {rid}")
        for layer, picked in topk[rid].items():
            check_selection(picked, ref64.scores[layer][0], low.scores[layer][0], f"request {rid} layer {layer}")
        for layer, pk in pools[rid].items():
            check_pool(pk, ref64.scores[layer][0], low.scores[layer][0], CFG, f"request {rid} pool")


@pytest.mark.parametrize("kernels", ["triton", "reference"])
def test_the_stack_serves_on_the_gpu(kernels):
    stack, manager, inputs = _served()
    with torch.no_grad(), (_reference_kernels() if kernels == "reference" else contextlib.nullcontext()):
        outs, topk, pools = serve_schedule(stack, manager, inputs, SCHEDULE)
    if kernels == "triton":
        assert "triton" in sys.modules and dsv4ops.backends.resolve.cache_info().currsize > 0
    _check_against_oracle(stack, inputs, outs, topk, pools)


def test_reduce_overhead_stack_prefill_then_decode(monkeypatch):
    """The stack compiled with mode="reduce-overhead", fullgraph=True over the schedule's two
    prefill steps (bucket 128) and 16 decode steps (bucket 2): no cudagraph skip, one Dynamo graph
    and one recorded CUDA graph per bucket, every later decode step a replay; the outputs within
    the eager run's error of the oracle."""
    torch._dynamo.reset()
    counters.clear()
    recorded = []
    record = cudagraph_trees.CUDAGraphTreeManager.record_function

    def count(self, *a, **k):
        recorded.append(1)
        return record(self, *a, **k)

    monkeypatch.setattr(cudagraph_trees.CUDAGraphTreeManager, "record_function", count)
    stack, manager, inputs = _served()
    compiled = torch.compile(stack, mode="reduce-overhead", fullgraph=True)
    done = {rid: 0 for rid in inputs}
    outs = {rid: [] for rid in inputs}
    with torch.no_grad():
        for new in SCHEDULE:
            for rid in new:
                if rid not in manager.slot_of:
                    manager.admit(rid)
            with manager.step(new) as step:
                xs = torch.cat([inputs[rid][:, done[rid]:done[rid] + n] for rid, n in new.items()], 1)
                xs = torch.cat([xs, xs.new_zeros(xs.shape[0], step.positions.shape[0] - xs.shape[1], xs.shape[2])], 1)
                torch.compiler.cudagraph_mark_step_begin()
                ys = compiled(xs, step).clone()
            i = 0
            for rid, n in new.items():
                outs[rid].append(ys[:, i:i + n])
                done[rid] += n
                i += n
    assert counters["inductor"]["cudagraph_skips"] == 0
    assert counters["stats"]["unique_graphs"] == 2, counters["stats"]
    assert len(recorded) == 2, len(recorded)
    eager_stack, eager_manager, _ = _served()
    with torch.no_grad():
        eager, topk, pools = serve_schedule(eager_stack, eager_manager, inputs, SCHEDULE)
    params = {k: v.cpu().double() for k, v in stack.named_parameters()}
    for rid, x in inputs.items():
        # The oracle with the eager run's selections; compiled and eager ran the same kernels on the
        # same inputs up to Inductor's fused projections, so their selections may differ only at ties.
        ref64 = stack_attention(params, CFG, x.cpu()[:, None].double(), CacheFormats.v41(),
                                {k: v[None] for k, v in topk[rid].items()}, {k: v[None] for k, v in pools[rid].items()})
        got = torch.cat(outs[rid], 1).cpu()
        testing.assert_close_to_ref(got, ref64.y[:, 0], eager[rid].cpu(), what=f"compiled request {rid}")
