"""The drop-in layer: transformers' names and state dict, both config kinds, stateless forward."""

import contextlib
import copy

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Attention as HFAttention

from dsv4ops import CacheFormats, DeepseekV4Attention, DSV4AttentionConfig, testing
from dsv4ops.cache import CacheConfig, KVCacheManager


CFG = DSV4AttentionConfig.tiny(index_topk=128)


@pytest.mark.parametrize("layer_idx", [0, 1, 2])
def test_state_dict_round_trips_with_transformers(layer_idx):
    hc = testing.hf_config(CFG)
    hf = testing.randomize_(HFAttention(hc, layer_idx), seed=layer_idx)
    ours = DeepseekV4Attention(hc, layer_idx)  # built from the transformers config
    ours.load_state_dict(hf.state_dict(), strict=True)
    assert set(ours.state_dict()) == set(hf.state_dict())
    for k, v in ours.state_dict().items():
        assert v.shape == hf.state_dict()[k].shape, k
    back = HFAttention(hc, layer_idx)
    back.load_state_dict(ours.state_dict(), strict=True)
    x = torch.randn(2, 133, CFG.hidden_size)
    # transformers is the reference here: its fp64 run is the expected value and its fp32 run the
    # budget, so a slip shared by our kernels and our oracle (both use reference.functional) shows.
    # (transformers keeps RoPE, norms and indexer scores in fp32 inside its fp64 run; that error is
    # in both of its runs, and ours measured at 1.0-1.1x its fp32 run's on this data.)
    with torch.no_grad():
        y, y_hf32 = ours(x), testing.hf_attention(hf, hc, x)
        y_hf64 = testing.hf_attention(copy.deepcopy(hf).double(), hc, x.double())
    testing.assert_close_to_ref(y, y_hf64, y_hf32, what="layer vs transformers")


def test_layer_from_our_config_has_the_layer_type_and_rope_table():
    layer = DeepseekV4Attention(CFG, 3)
    assert layer.layer_type == "compressed_sparse_attention" and layer.compressor.indexer is not None
    assert torch.equal(layer.inv_freq, CFG.inv_freq(3))
    assert DeepseekV4Attention(CFG, 0).compressor is None
    assert not hasattr(DeepseekV4Attention(CFG, 2).compressor, "indexer")


@pytest.fixture
def uninitialised_memory_is_nan():
    """torch.empty fills floats with NaN (deterministic mode), so a parameter nobody initialised shows."""
    import torch.utils.deterministic

    mode, fill = torch.are_deterministic_algorithms_enabled(), torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    yield
    torch.use_deterministic_algorithms(mode)
    torch.utils.deterministic.fill_uninitialized_memory = fill


def test_every_parameter_of_a_fresh_module_is_initialised(uninitialised_memory_is_nan):
    from dsv4ops import DeepseekV4HashRouter, DeepseekV4Router

    modules = {f"layer {i}": DeepseekV4Attention(CFG, i) for i in range(CFG.num_layers)}
    modules |= {"router": DeepseekV4Router(CFG), "hash router": DeepseekV4HashRouter(CFG)}
    for what, module in modules.items():
        for name, p in module.named_parameters():
            assert torch.isfinite(p).all(), f"{what}: {name} is not initialised"
    with torch.no_grad():
        y = modules["layer 1"](torch.randn(1, 9, CFG.hidden_size))
    assert torch.isfinite(y).all() and y.abs().max() > 0  # a fresh layer computes something


@pytest.mark.parametrize("layer_idx", [-1, 4, 1.0])
def test_layer_index_out_of_range_is_rejected(layer_idx):
    with pytest.raises(ValueError, match=rf"layer_idx: expected an int in \[0, 4\) \(num_layers\), got {layer_idx}"):
        DeepseekV4Attention(CFG, layer_idx)


@pytest.mark.parametrize(
    "x, match",
    [
        (torch.randn(9, 256), r"hidden_states: expected 3-D \[batch, seq, hidden\], got shape \(9, 256\)"),
        (torch.ones(1, 9, 256, dtype=torch.int64), r"hidden_states: expected dtype torch.float32 \(the layer's "
                                                    r"weights\), got torch.int64"),
        (torch.randn(1, 9, 128), r"hidden_states: expected hidden size 256 \(last dim\), got 128"),
        (torch.randn(1, 0, 256), r"hidden_states: expected at least one sequence of at least one token"),
    ],
    ids=["2-D", "integer", "hidden-size", "empty"],
)
def test_stateless_forward_rejects_bad_inputs(x, match):
    with pytest.raises(ValueError, match=match), torch.no_grad():
        DeepseekV4Attention(CFG, 1)(x)


MODES = {"exact": CacheFormats.exact(), "kv-fp8": CacheFormats("fp8_584", "fp8_584", "exact"),
         "indexer-fp8": CacheFormats("exact", "exact", "fp8_132"), "fp8": CacheFormats.v4()}


@pytest.mark.parametrize("mode", MODES)
def test_to_bf16_keeps_sinks_norms_rope_tables_in_fp32_and_the_compressor_weights_in_bf16(mode):
    """The compressor projections' weights follow the model dtype in every mode (bf16 in the checkpoint,
    spec 1.3; their fp32 a, z come from the packed GEMM's fp32 output)."""
    fmts = MODES[mode]
    for li in (1, 2):  # CSA, HCA
        layer = DeepseekV4Attention(CFG, li, formats=fmts).to(torch.bfloat16)
        for name, t in [*layer.named_parameters(), *layer.named_buffers()]:
            keep = name.endswith(("sinks", "position_bias", "norm.weight", "inv_freq"))
            assert t.dtype == (torch.float32 if keep else torch.bfloat16), (mode, li, name)
        # The values too: a frequency rounded through bf16 turns the angle by up to 1.2 rad at 740.
        assert torch.equal(layer.inv_freq, CFG.inv_freq(li)), (mode, li)
        with torch.device("meta"), _default_dtype(torch.bfloat16):  # built in bf16: the same dtypes
            built = DeepseekV4Attention(CFG, li, formats=fmts)
        assert {n: t.dtype for n, t in built.named_parameters()} == {n: t.dtype for n, t in layer.named_parameters()}


@contextlib.contextmanager
def _default_dtype(dtype):
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def test_bf16_state_dicts_load_into_the_layer_and_back():
    """transformers' bf16 layer -> a bf16 FP8-numerics layer -> transformers' again: every tensor
    round-trips bit for bit (the packed projections' views included)."""
    hc = testing.hf_config(CFG)
    hf = testing.randomize_(HFAttention(hc, 1), seed=1).to(torch.bfloat16)
    ours = DeepseekV4Attention(hc, 1, formats=MODES["fp8"]).to(torch.bfloat16)
    ours.load_state_dict(hf.state_dict(), strict=True)
    assert ours.compressor.indexer.gate_proj.weight.dtype == torch.bfloat16
    back = HFAttention(hc, 1).to(torch.bfloat16)
    back.load_state_dict(ours.state_dict(), strict=True)
    for k, v in hf.state_dict().items():
        assert torch.equal(ours.state_dict()[k], v) and torch.equal(back.state_dict()[k], v), k


class _WeightConversions(TorchDispatchMode):
    """Records the parameters and buffers of `module` that a dtype conversion (aten._to_copy) reads."""

    def __init__(self, module):
        super().__init__()
        self.names = {id(t): n for n, t in [*module.named_parameters(), *module.named_buffers()]}
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._to_copy.default and isinstance(args[0], torch.Tensor):
            name = self.names.get(id(args[0]))
            if name is not None:
                self.seen.append(name)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("mode", ["exact", "fp8", "none"])  # none: built without formats, takes the exact cache's
@pytest.mark.parametrize("layer_idx", [1, 2], ids=["CSA", "HCA"])
def test_a_serving_step_of_a_bf16_layer_converts_no_weight(mode, layer_idx):
    """No projection weight is converted per step; on the CPU, which has no bf16 GEMM with an fp32
    output, the packed weight is upcast once for the compressors' fp32 products (a CUDA GPU runs
    mm's out_dtype instead: tests/test_layer_gpu.py)."""
    fmts = MODES.get(mode, CacheFormats.exact())
    layer = DeepseekV4Attention(CFG, layer_idx, formats=None if mode == "none" else fmts)
    layer = testing.randomize_(layer, seed=3).to(torch.bfloat16)
    manager = KVCacheManager(CFG, CacheConfig(max_requests=2, max_context=64, max_step_tokens=16, formats=fmts,
                                              exact_dtype=torch.bfloat16))
    layer.attach_cache(manager)
    manager.admit("a")
    x = torch.randn(16, CFG.hidden_size).bfloat16()
    with torch.no_grad(), manager.step({"a": 16}) as step, _WeightConversions(layer) as conversions:
        y = layer(x, step)
    assert conversions.seen == ["x_packed"] and torch.isfinite(y).all()
