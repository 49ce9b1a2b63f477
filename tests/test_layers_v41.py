"""The drop-in V4.1 modules: parameter names by role (transformers' newest names; DeepSeek's for the
compressor and indexer), loading DeepSeek's checkpoint names through the documented mapping, dtype
handling, the stateless forward's shape and bf16 run. Issue 16."""

import pytest
import torch

from dsv4ops import CacheFormats, testing
from dsv4ops.config_v41 import DSV41AttentionConfig
from dsv4ops.layers_v41 import DEEPSEEK_NAMES, STATELESS_BLOCK, DeepseekV41Attention, DeepseekV41AttentionStack
from dsv4ops.reference.v41 import stack_attention
from dsv4ops.testing_v41 import slots_to_entries

CFG = DSV41AttentionConfig.tiny()
OWN = {"q_a_proj.weight", "q_a_norm.weight", "q_b_proj.weight", "kv_proj.weight", "kv_norm.weight", "o_a_proj.weight",
       "o_b_proj.weight", "sinks"}


def _names(stack, layer):
    return {k[len(f"layers.{layer}."):] for k, _ in stack.named_parameters() if k.startswith(f"layers.{layer}.")}


def test_parameter_names_by_role():
    stack = DeepseekV41AttentionStack(CFG)
    comp = {"compressor.wkv.weight", "compressor.norm.weight"}
    idx = {"indexer.wq_b.weight", "indexer.weights_proj.weight"}
    keys = {"indexer.wk.weight", "indexer.k_norm.weight"}
    assert _names(stack, 0) == OWN  # sliding
    assert _names(stack, 1) == OWN | comp | {"compressor.wgate.weight"} | idx | keys  # ratio-2 source
    assert _names(stack, 2) == OWN  # reuse
    assert _names(stack, 5) == OWN | comp | idx | keys  # ratio-1 source: no gate
    assert _names(stack, 7) == OWN | idx  # reindex
    shapes = {k: tuple(v.shape) for k, v in stack.named_parameters()}
    h, d, q = CFG.num_heads, CFG.head_dim, CFG.q_lora_rank
    assert shapes["layers.1.indexer.wk.weight"] == (CFG.index_head_dim, d)
    assert shapes["layers.7.indexer.wq_b.weight"] == (CFG.index_n_heads * CFG.index_head_dim, q)
    assert shapes["layers.0.o_a_proj.weight"] == (CFG.o_groups * CFG.o_lora_rank, h * d // CFG.o_groups)
    assert not any(k.startswith("layers.") and "ape" in k for k in stack.state_dict())  # no position bias


def _deepseek_state_dict(stack) -> dict:
    """The stack's weights under DeepSeek's names, with the keys of other modules beside them."""
    inverse = {v: k for k, v in DEEPSEEK_NAMES.items()}
    sd = {}
    for key, value in stack.state_dict().items():
        _, layer, name = key.split(".", 2)
        sd[f"layers.{layer}.{inverse[name]}"] = value.clone()
    sd["layers.0.attn_norm.weight"] = torch.ones(CFG.hidden_size)  # not the attention's: skipped
    sd["layers.3.ffn.gate.weight"] = torch.ones(3)
    sd["embed.weight"] = torch.ones(3)
    return sd


def test_load_deepseek_names():
    src = testing.randomize_(DeepseekV41AttentionStack(CFG), seed=2)
    dst = DeepseekV41AttentionStack(CFG)
    dst.load_deepseek_state_dict(_deepseek_state_dict(src))
    assert all(torch.equal(a, b) for a, b in zip(src.state_dict().values(), dst.state_dict().values(), strict=True))
    assert "layers.1.attn.compressor.wgate.weight" in _deepseek_state_dict(src)


def test_load_deepseek_names_rejects_fp8_scales_unknown_and_missing_keys():
    src = DeepseekV41AttentionStack(CFG)
    sd = _deepseek_state_dict(src)
    # A scale beside a weight that is not e4m3 (FP8 checkpoints: tests/test_checkpoint.py).
    with pytest.raises(ValueError, match=r"layers.0.attn.wq_a.weight: expected a 2-D torch.float8_e4m3fn weight, got "
                                         r"torch.float32"):
        DeepseekV41AttentionStack(CFG).load_deepseek_state_dict({**sd, "layers.0.attn.wq_a.scale": torch.ones(1)})
    with pytest.raises(ValueError, match=r"state_dict: layers.2.attn.indexer.wk.bias is not a V4.1 attention"):
        DeepseekV41AttentionStack(CFG).load_deepseek_state_dict({**sd, "layers.2.attn.indexer.wk.bias": torch.ones(1)})
    del sd["layers.5.attn.indexer.wk.weight"]
    with pytest.raises(RuntimeError, match=r"Missing key\(s\) in state_dict: \"layers.5.indexer.wk.weight\""):
        DeepseekV41AttentionStack(CFG).load_deepseek_state_dict(sd)
    unexpected = _deepseek_state_dict(src)
    unexpected["layers.2.attn.indexer.wk.weight"] = torch.ones(128, 512)  # layer 2 reuses: no indexer
    with pytest.raises(RuntimeError, match=r"Unexpected key\(s\) in state_dict: \"layers.2.indexer.wk.weight\""):
        DeepseekV41AttentionStack(CFG).load_deepseek_state_dict(unexpected)


def test_to_bf16_keeps_sinks_norms_and_rope_tables_in_fp32_and_the_compressors_in_bf16():
    # The compressors' weights follow the model dtype (bf16 in the checkpoint; the ratio-2 a and gate
    # still compute in fp32: the packed GEMM's fp32 output, tests/test_packing_v41.py).
    stack = DeepseekV41AttentionStack(CFG).to(torch.bfloat16)
    for name, t in [*stack.named_parameters(), *stack.named_buffers()]:
        keep = name.endswith(("sinks", "norm.weight", "inv_freq", "ape"))
        assert t.dtype == (torch.float32 if keep else torch.bfloat16), name
    for i, layer in enumerate(stack.layers):  # the values too, not rounded through bf16
        assert torch.equal(layer.inv_freq, CFG.inv_freq(i)), i
    alone = DeepseekV41Attention(CFG, 1).to(torch.bfloat16)  # a layer alone keeps the same tensors fp32
    assert torch.equal(alone.inv_freq, CFG.inv_freq(1)) and alone.sinks.dtype == alone.compressor.ape.dtype == torch.float32
    assert stack.layers[1].compressor.wgate.weight.dtype == torch.bfloat16


def test_bf16_stack_against_the_oracle():
    # The released model runs bf16: the stateless forward (through the ops) against the fp64 oracle,
    # within the bf16 oracle's own error, with the stack's selections fed to both oracles.
    stack = testing.randomize_(DeepseekV41AttentionStack(CFG), seed=4).to(torch.bfloat16)
    xs = torch.randn(CFG.num_layers, 1, 40, CFG.hidden_size).bfloat16()
    published = {}
    with torch.no_grad():
        ys = stack(xs, published=published)
    step = published["step"]
    topk = {L: slots_to_entries(published["topk", L], step.block_table(CFG.role(L).ratio)[0], STATELESS_BLOCK)[None]
            for L in (1, 3, 5, 7)}
    pools = {5: published["pool"].long()[None]}
    params = dict(stack.named_parameters())
    ref64 = stack_attention({k: v.double() for k, v in params.items()}, CFG, xs.double(), CacheFormats.v41(), topk, pools)
    low = stack_attention(params, CFG, xs, CacheFormats.v41(), topk, pools)
    testing.assert_close_to_ref(ys, ref64.y, low.y, what="bf16 stack")


def test_a_v4_config_is_refused_with_a_type_error():
    # Issue 52: AttributeError "'DSV4AttentionConfig' object has no attribute 'role'" (the reverse mix-up,
    # a V4.1 config to DeepseekV4Attention, gets a TypeError).
    from dsv4ops import DSV4AttentionConfig

    for make in (lambda cfg: DeepseekV41AttentionStack(cfg), lambda cfg: DeepseekV41Attention(cfg, 0)):
        with pytest.raises(TypeError, match=r"config: expected a DSV41AttentionConfig, got DSV4AttentionConfig \(a V4 "
                                            r"config: dsv4ops.DeepseekV4Attention\)"):
            make(DSV4AttentionConfig.tiny())
