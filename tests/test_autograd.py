"""No dsv4:: op has a backward (dsv4ops/_autograd.py): a forward in grad mode runs, a backward through
an op, a public function, a layer or a router raises a RuntimeError naming it (eager and compiled),
an op that would store a grad-requiring input in a cache raises at the call, and nothing gets a
partial gradient. Issue 10."""

from functools import partial

import builders
import pytest
import torch

from dsv4ops import CacheFormats, DeepseekV4Attention, DeepseekV4HashRouter, DeepseekV4Router, DSV4AttentionConfig, testing
from dsv4ops._autograd import op_names
from dsv4ops.cache import CacheConfig, KVCacheManager

CFG = DSV4AttentionConfig.tiny()
NO_BACKWARD = r"has no backward \(the dsv4:: ops are inference kernels\); run inference under torch.inference_mode\(\)"

# op -> (factory, the input made to require grad, the float output a loss reads); None: a cache
# writer, which raises at the call.
OPS = {
    "unpack_kv": None,  # reads a cache only: no float input that could require grad
    "pack_kv": (partial(builders.pack_kv_args, torch.float32), "x", None),
    "qkv_prep": (partial(builders.qkv_prep_args, torch.float32), "kv", None),
    "compressor_update": (partial(builders.compressor_update_args, torch.float32), "kv", None),
    "indexer_q_prep": (partial(builders.indexer_q_prep_args, torch.float32), "q", "w_out"),
    "indexer_topk": None,  # integer output
    "visible_entries": None,  # integer inputs and output
    "sparse_attn": (partial(builders.sparse_attn_args, torch.float32), "q", "out"),
    "inv_rope": (partial(builders.inv_rope_args, torch.float32), "o", "out"),
    "fp8_linear": (partial(builders.fp8_linear_args, torch.float32), "x", "out"),
    "fp8_linear_w8a8": (partial(builders.fp8_linear_w8a8_args, torch.float32), "x", "out"),
    "invariant_linear": (partial(builders.invariant_linear_args, torch.float32), "x", "out"),
}


def test_every_op_has_the_no_backward_kernel():
    assert op_names() == builders.dsv4_ops()
    for name in builders.dsv4_ops():
        for key in ("AutogradCPU", "AutogradCUDA"):
            assert torch._C._dispatch_has_kernel_for_dispatch_key(f"dsv4::{name}", key), (name, key)


@pytest.mark.parametrize("name", [n for n, case in OPS.items() if case is not None])
def test_raw_op_backward_raises(name):
    factory, key, out = OPS[name]
    args = factory()
    args[key] = args[key].requires_grad_()
    if out is None:  # stores the input in a cache: no gradient could come back
        with pytest.raises(RuntimeError, match=rf"dsv4::{name}: an input requires grad, but the op stores it in"):
            builders.call_op(name, args)
        return
    builders.call_op(name, args)  # the forward runs in grad mode
    assert torch.isfinite(args[out]).all()
    with pytest.raises(RuntimeError, match=rf"dsv4::{name} {NO_BACKWARD}"):
        args[out].sum().backward()
    with torch.no_grad():  # inference: no graph at all
        fresh = factory()
        fresh[key].requires_grad_()
        builders.call_op(name, fresh)
    assert fresh[out].grad_fn is None


def test_public_function_backward_raises():
    args = builders.sparse_attn_args(torch.float32)
    args["q"].requires_grad_()
    out = builders.call_public("sparse_attn", args)
    with pytest.raises(RuntimeError, match=rf"dsv4::sparse_attn {NO_BACKWARD}"):
        (out * 2).sum().backward()
    assert args["q"].grad is None


@pytest.mark.parametrize("layer_idx", [0, 1, 2])
def test_layer_backward_raises_and_leaves_no_gradient(layer_idx):
    layer = testing.randomize_(DeepseekV4Attention(CFG, layer_idx), seed=layer_idx)
    x = torch.randn(2, 9, CFG.hidden_size)
    y = layer(x)  # grad mode: the forward runs
    with torch.no_grad():
        assert torch.equal(y, layer(x))
    with pytest.raises(RuntimeError, match=rf"DeepseekV4Attention\(layer {layer_idx}, \w+\) {NO_BACKWARD}"):
        y.sum().backward()
    assert all(p.grad is None for p in layer.parameters())
    x.requires_grad_()
    with pytest.raises(RuntimeError, match=NO_BACKWARD):
        layer.requires_grad_(False)(x).sum().backward()  # frozen weights, a grad-requiring input


def test_compiled_serving_forward_backward_raises():
    torch._dynamo.reset()
    layer = testing.randomize_(DeepseekV4Attention(CFG, 1))
    manager = KVCacheManager(CFG, CacheConfig(max_requests=1, max_context=32, max_step_tokens=16,
                                              formats=CacheFormats.exact(), exact_dtype=torch.float32))
    layer.attach_cache(manager)
    manager.admit(0)
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    with manager.step({0: 16}) as step:
        y = compiled(torch.randn(16, CFG.hidden_size), step)  # compiles and runs in grad mode
    with pytest.raises(RuntimeError, match=rf"DeepseekV4Attention\(layer 1, compressed_sparse_attention\) "
                                           rf"{NO_BACKWARD}"):
        y.sum().backward()


def test_router_backward_raises():
    router, hash_router = testing.randomize_(DeepseekV4Router(CFG)), testing.randomize_(DeepseekV4HashRouter(CFG))
    x = torch.randn(5, CFG.hidden_size)
    logits, weights, _ = router(x)
    with pytest.raises(RuntimeError, match=rf"dsv4::router_gate {NO_BACKWARD}"):
        weights.sum().backward()
    logits, weights, _ = hash_router(x, torch.arange(5))
    with pytest.raises(RuntimeError, match=rf"dsv4::hash_route {NO_BACKWARD}"):
        (logits.sum() + weights.sum()).backward()
    assert router.weight.grad is None and hash_router.weight.grad is None
