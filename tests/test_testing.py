"""dsv4ops.testing's checkpoint helper: a layer's or stack's weights under DeepSeek's names load back
bit for bit, and its block FP8 is DeepSeek's (e4m3 within range, power-of-two UE8M0 tile scales,
each weight within e4m3's rounding of the original)."""

import pytest
import torch

from dsv4ops import DeepseekV4Attention, DeepseekV41AttentionStack, DSV4AttentionConfig, DSV41AttentionConfig, testing
from dsv4ops.checkpoint import dequantize_block_fp8

V4 = DSV4AttentionConfig.tiny()
V41 = DSV41AttentionConfig.tiny()


@pytest.mark.parametrize("make", [lambda: DeepseekV4Attention(V4, 1), lambda: DeepseekV41AttentionStack(V41)],
                         ids=["v4-layer", "v41-stack"])
def test_deepseek_names_load_back_bit_for_bit(make):
    src, dst = testing.randomize_(make(), seed=3), make()
    sd = testing.deepseek_state_dict(src)
    assert all(k.startswith("layers.") and ".attn." in k for k in sd)
    dst.load_deepseek_state_dict(sd)
    for (name, a), b in zip(src.state_dict().items(), dst.state_dict().values(), strict=True):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("block", [128, 32])
def test_block_fp8_is_deepseeks_format(block):
    src = testing.randomize_(DeepseekV4Attention(V4, 2), seed=5)  # an HCA layer: its ape is 2-D but no weight
    with torch.no_grad():
        src.q_b_proj.weight[0, 0] = 0.0  # a zero and a tile of zeros stay exact
        src.kv_proj.weight[:block, :block] = 0.0
    sd = testing.deepseek_state_dict(src, fp8_block=block)
    plain = testing.deepseek_state_dict(src)
    weights = [k for k, v in plain.items() if v.dim() == 2 and k.endswith(".weight")]
    assert set(k for k in sd if k.endswith(".scale")) == {k[:-len("weight")] + "scale" for k in weights}
    assert sd["layers.2.attn.compressor.ape"].dtype == torch.float32  # not a weight: as it is
    for key in weights:
        w, s = sd[key], sd[key[:-len("weight")] + "scale"]
        n, k = w.shape
        assert w.dtype == torch.float8_e4m3fn and s.dtype == torch.float8_e8m0fnu
        assert s.shape == (-(-n // block), -(-k // block))
        assert torch.isfinite(w.float()).all(), key
        x = plain[key].double()
        got = dequantize_block_fp8(w, s, block, torch.float64)
        # Each tile's scale is the smallest power of two with amax / scale <= 448: the largest element
        # lands in (224, 448] (e4m3's top binade), so no tile wastes range; e4m3 rounds to 3 mantissa
        # bits: |error| <= 2^-4 |x| for normal values, and half a subnormal step (2^-10 scale) below.
        tiles = x.new_zeros(s.shape[0] * block, s.shape[1] * block)
        tiles[:n, :k] = x
        amax = tiles.view(s.shape[0], block, s.shape[1], block).abs().amax((1, 3))
        ratio = amax / s.double()
        assert ((ratio > 224) & (ratio <= 448) | (amax == 0)).all(), key
        step = s.double().repeat_interleave(block, 0).repeat_interleave(block, 1)[:n, :k]
        assert ((got - x).abs() <= torch.maximum(x.abs() * 2.0**-4, step * 2.0**-10)).all(), key
    assert sd["layers.2.attn.wq_b.weight"].float()[0, 0] == 0
