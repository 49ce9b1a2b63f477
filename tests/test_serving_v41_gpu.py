"""GPU tier 1 for V4.1 (no V4.1 GPU kernels yet): on CUDA tensors the Triton launchers refuse the V4.1
formats and options with a clear error and write nothing; with the CUDA kernels switched off the
ops' reference kernels serve the whole stack on the GPU, equal to the fp64 oracle within the bf16
oracle's error (tie-aware: the oracle takes the GPU run's selections). Issue 16."""

import contextlib

import pytest
import torch

import dsv4ops
from dsv4ops import testing
from dsv4ops.cache.config import CacheConfig
from dsv4ops.cache.v41 import V41CacheManager
from dsv4ops.config_v41 import DSV41AttentionConfig
from dsv4ops.layers_v41 import DeepseekV41AttentionStack
from dsv4ops.reference.v41 import V41Numerics, stack_attention
from dsv4ops.testing_v41 import check_selection, serve_schedule

pytestmark = pytest.mark.gpu
CFG = DSV41AttentionConfig.tiny()


def test_triton_launchers_refuse_v41_formats_on_cuda():
    args = testing.pack_kv_args(torch.bfloat16, "fp8_528")
    args = {k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    before = args["cache"].clone()
    with pytest.raises(NotImplementedError, match=r"dsv4::pack_kv: the Triton kernel does not implement "
                                                  r"fmt='fp8_528'"):
        testing.call_op("pack_kv", args)
    assert torch.equal(args["cache"], before)


@contextlib.contextmanager
def _reference_kernels():
    with contextlib.ExitStack() as stack:
        for op in dsv4ops.backends.TRITON_LAUNCHERS:
            stack.enter_context(getattr(dsv4ops.ops, op).set_kernel_enabled("cuda", False))
        yield


def test_the_stack_serves_on_the_gpu_through_the_reference_kernels():
    stack = testing.randomize_(DeepseekV41AttentionStack(CFG), seed=0).to("cuda", torch.bfloat16)
    manager = V41CacheManager(CFG, CacheConfig(max_requests=2, max_context=128, max_step_tokens=128, block_size=7),
                              V41Numerics(), device="cuda")
    stack.attach_cache(manager)
    g = torch.Generator().manual_seed(1)
    inputs = {r: torch.randn(CFG.num_layers, n, CFG.hidden_size, generator=g).to("cuda", torch.bfloat16)
              for r, n in (("a", 96), ("b", 33))}
    schedule = [{"a": 40, "b": 17}, {"a": 40, "b": 16}] + [{"a": 1}] * 16
    with torch.no_grad(), _reference_kernels():
        outs, topk, pools = serve_schedule(stack, manager, inputs, schedule)
    params = {k: v.cpu() for k, v in stack.named_parameters()}
    for rid, x in inputs.items():
        sel = {k: v[None] for k, v in topk[rid].items()}
        pool = {k: v[None] for k, v in pools[rid].items()}
        ref64 = stack_attention({k: v.double() for k, v in params.items()}, CFG, x.cpu()[:, None].double(),
                                V41Numerics(), sel, pool)
        low = stack_attention(params, CFG, x.cpu()[:, None], V41Numerics(), sel, pool)
        testing.assert_close_to_ref(outs[rid].cpu(), ref64.y[:, 0], low.y[:, 0], what=f"request {rid}")
        for layer, picked in topk[rid].items():
            check_selection(picked, ref64.scores[layer][0], low.scores[layer][0], f"request {rid} layer {layer}")
