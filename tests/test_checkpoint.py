"""Block-FP8 checkpoint weights dequantized on load, against a decode of the e4m3 and UE8M0 bits
(tests/format_model.py); DeepSeek's V4 checkpoint names against transformers' conversion rules."""

import builders
import format_model as M
import pytest
import torch

from dsv4ops import DeepseekV4Attention, DeepseekV41AttentionStack, DSV4AttentionConfig, DSV41AttentionConfig, testing
from dsv4ops.checkpoint import dequantize_block_fp8, dequantize_state_dict
from dsv4ops.layers import DEEPSEEK_NAMES

CFG = DSV4AttentionConfig.tiny()


def _table(value) -> torch.Tensor:
    return torch.tensor([value(c) for c in range(256)], dtype=torch.float64)


E4M3, UE8M0 = _table(M.e4m3_value), _table(M.ue8m0_value)


def _quantized(n: int, k: int, block: int, seed: int = 0, fp32_scales: bool = False):
    """(e4m3 weight [n, k], scales, the float64 value of every weight element). Scale bytes 117..137
    (2^-10 .. 2^10) or random fp32 scales; weight bytes cover every finite e4m3 code."""
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (n, k), generator=g, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x3C  # NaN codes -> 1.5
    tiles = (-(-n // block), -(-k // block))
    if fp32_scales:
        scales = torch.rand(tiles, generator=g) + 0.25
        per_tile = scales.double()
    else:
        sb = torch.randint(117, 138, tiles, generator=g, dtype=torch.uint8)
        scales, per_tile = sb.view(torch.float8_e8m0fnu), UE8M0[sb.long()]
    full = torch.zeros(n, k, dtype=torch.float64)
    for i in range(tiles[0]):  # tile by tile: no repeat_interleave, unlike the code under test
        for j in range(tiles[1]):
            rows, cols = slice(i * block, (i + 1) * block), slice(j * block, (j + 1) * block)
            full[rows, cols] = E4M3[codes[rows, cols].long()] * per_tile[i, j]
    return codes.view(torch.float8_e4m3fn), scales, full


@pytest.mark.parametrize("n, k, block", [(256, 384, 128), (200, 70, 128), (96, 64, 32), (33, 100, 32)])
@pytest.mark.parametrize("fp32_scales", [False, True], ids=["ue8m0", "fp32"])
def test_dequantize_matches_the_bit_decode(n, k, block, fp32_scales):
    w, s, want = _quantized(n, k, block, seed=n + k, fp32_scales=fp32_scales)
    got = dequantize_block_fp8(w, s, block, torch.float32)
    # e4m3 x a power of two is exact in fp32; an fp32 scale rounds once.
    if fp32_scales:
        torch.testing.assert_close(got.double(), want, rtol=2**-24, atol=0)
    else:
        assert torch.equal(got.double(), want)
    assert dequantize_block_fp8(w, s, block, torch.bfloat16).dtype == torch.bfloat16


def test_dequantize_rejects_bad_inputs():
    w, s, _ = _quantized(64, 64, 32)
    with pytest.raises(ValueError, match=r"weight: a \[64, 64\] weight in 128 x 128 tiles needs scales of shape "
                                         r"\(1, 1\), got \(2, 2\) \(wrong block size\?\)"):
        dequantize_block_fp8(w, s, 128, torch.float32)
    with pytest.raises(ValueError, match=r"expected a 2-D torch.float8_e4m3fn weight, got torch.float32"):
        dequantize_block_fp8(w.float(), s, 32, torch.float32)
    with pytest.raises(ValueError, match=r"expected scales of dtype float8_e8m0fnu \(UE8M0\) or a float type, got "
                                         r"torch.uint8"):
        dequantize_block_fp8(w, s.view(torch.uint8), 32, torch.float32)
    nan = s.clone()
    nan.view(torch.uint8)[0, 0] = 255
    with pytest.raises(ValueError, match=r"the scales hold NaN or inf"):
        dequantize_block_fp8(w, nan, 32, torch.float32)
    with pytest.raises(ValueError, match=r"block: expected a tile size >= 1, got 0"):
        dequantize_block_fp8(w, s, 0, torch.float32)


def test_dequantize_state_dict_pairs_weights_with_either_scale_name():
    a, sa, wa = _quantized(64, 96, 32, seed=1)
    b, sb, wb = _quantized(64, 64, 32, seed=2)
    norm = torch.randn(64)
    out = dequantize_state_dict({"x.wq_a.weight": a, "x.wq_a.scale": sa, "y.q_b_proj.weight": b,
                                 "y.q_b_proj.weight_scale_inv": sb, "x.q_norm.weight": norm}, 32, torch.float32)
    assert set(out) == {"x.wq_a.weight", "y.q_b_proj.weight", "x.q_norm.weight"}
    assert torch.equal(out["x.wq_a.weight"].double(), wa) and torch.equal(out["y.q_b_proj.weight"].double(), wb)
    assert out["x.q_norm.weight"] is norm
    with pytest.raises(ValueError, match=r"scales without an e4m3 weight: \['x.wkv.scale'\]"):
        dequantize_state_dict({"x.wkv.scale": sa}, 32, torch.float32)
    with pytest.raises(ValueError, match=r"x.wq_a.weight is an e4m3 weight without tile scales"):
        dequantize_state_dict({"x.wq_a.weight": a}, 32, torch.float32)
    with pytest.raises(ValueError, match=r"x.wq_a.weight has two scale tensors"):
        dequantize_state_dict({"x.wq_a.weight": a, "x.wq_a.scale": sa, "x.wq_a.weight_scale_inv": sa}, 32,
                              torch.float32)


def test_deepseek_names_are_transformers_conversion_rules():
    """Every DeepSeek-V4 attention key maps where transformers' own checkpoint conversion for
    deepseek_v4 puts it, and covers every parameter of a CSA layer (which has all of them)."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightConverter, WeightRenaming, rename_source_key

    rules = get_checkpoint_conversion_mapping("deepseek_v4")
    renamings = [r for r in rules if isinstance(r, WeightRenaming)]
    converters = [r for r in rules if isinstance(r, WeightConverter)]
    for ds, ours in DEEPSEEK_NAMES.items():
        hf, _ = rename_source_key(f"layers.3.{ds}", renamings, converters)
        assert hf == f"layers.3.self_attn.{ours}", (ds, hf)
    assert set(DEEPSEEK_NAMES.values()) == set(dict(DeepseekV4Attention(CFG, 1).named_parameters()))


# DeepSeek's module tree (inference/model.py): Attention holds wq_a, q_norm, wq_b, wkv, kv_norm,
# wo_a, wo_b, attn_sink, a Compressor (wkv, wgate, ape, norm) and an Indexer (wq_b, weights_proj and
# its own Compressor). Here the indexer sits inside the compressor and holds its compressor's
# weights itself; every module and leaf is renamed on its own: DEEPSEEK_NAMES written without it.
_DS_PARTS = {"wq_a": "q_a_proj", "q_norm": "q_a_norm", "wq_b": "q_b_proj", "wkv": "kv_proj", "wo_a": "o_a_proj",
             "wo_b": "o_b_proj", "wgate": "gate_proj", "norm": "kv_norm", "ape": "position_bias",
             "attn_sink": "sinks", "weights_proj": "scorer.weights_proj"}
_DS_KEYS = ["attn.attn_sink", *(f"attn.{m}.weight" for m in ("wq_a", "q_norm", "wq_b", "wkv", "kv_norm", "wo_a", "wo_b")),
            *(f"attn.{c}compressor.{m}" for c in ("", "indexer.") for m in ("wkv.weight", "wgate.weight", "norm.weight",
                                                                             "ape")),
            "attn.indexer.wq_b.weight", "attn.indexer.weights_proj.weight"]


def _our_name(deepseek_key: str) -> str:
    path = deepseek_key.removeprefix("attn.").replace("indexer.compressor.", "indexer.")
    path = "compressor." + path if path.startswith("indexer.") else path
    return ".".join(_DS_PARTS.get(part, part) for part in path.split("."))


def test_a_deepseek_checkpoint_lands_where_its_module_tree_says():
    """Each tensor of a DeepSeek-named checkpoint (all distinct) lands in the parameter that
    DeepSeek's module tree, renamed part by part, names; independent of the transformers rules."""
    params = dict(DeepseekV4Attention(CFG, 1).named_parameters())
    assert sorted(map(_our_name, _DS_KEYS)) == sorted(params)
    g = torch.Generator().manual_seed(0)
    sd = {f"layers.1.{k}": torch.randn(params[_our_name(k)].shape, generator=g) for k in _DS_KEYS}
    dst = DeepseekV4Attention(CFG, 1)
    dst.load_deepseek_state_dict(sd)
    for key in _DS_KEYS:
        assert torch.equal(dst.get_parameter(_our_name(key)), sd[f"layers.1.{key}"]), key


def _deepseek_fp8(layer, block: int, seed: int = 0) -> tuple[dict, dict]:
    """(a DeepSeek checkpoint dict of `layer` with its 2-D projections in block FP8 and the other
    tensors as they are, {our name: the float64 value each loaded parameter must get})."""
    inverse = {v: k for k, v in DEEPSEEK_NAMES.items()}
    sd, want = {"embed.weight": torch.ones(3), f"layers.{layer.layer_idx}.attn_norm.weight": torch.ones(3)}, {}
    for i, (name, p) in enumerate(layer.named_parameters()):
        key = f"layers.{layer.layer_idx}.{inverse[name]}"
        if p.dim() == 2 and name.endswith("proj.weight"):
            w, s, full = _quantized(*p.shape, block, seed=seed + i)
            sd[key], sd[key[:-len("weight")] + "scale"], want[name] = w, s, full
        else:
            sd[key], want[name] = p.detach().clone(), p.detach().double()
    return sd, want


@pytest.mark.parametrize("layer_idx", [1, 2])
def test_v4_layer_loads_deepseek_fp8_checkpoint(layer_idx):
    src = testing.randomize_(DeepseekV4Attention(CFG, layer_idx), seed=layer_idx)
    sd, want = _deepseek_fp8(src, 128)
    sd[f"layers.{layer_idx + 1}.attn.wq_a.weight"] = torch.ones(3)  # another layer's: skipped
    dst = DeepseekV4Attention(CFG, layer_idx)
    dst.load_deepseek_state_dict(sd)
    for name, p in dst.named_parameters():
        assert torch.equal(p.double(), want[name]), name
    with pytest.raises(ValueError, match=rf"layers.{layer_idx}.attn.wq_a.bias is not a V4 attention parameter"):
        dst.load_deepseek_state_dict({**sd, f"layers.{layer_idx}.attn.wq_a.bias": torch.ones(3)})
    bf16 = DeepseekV4Attention(CFG, layer_idx).to(torch.bfloat16)
    bf16.load_deepseek_state_dict(sd)  # dequantized in fp32, rounded once into the bf16 parameters
    assert torch.equal(bf16.q_a_proj.weight, want["q_a_proj.weight"].to(torch.bfloat16))
    assert bf16.sinks.dtype == torch.float32


def test_v41_stack_loads_deepseek_fp8_checkpoint_in_32x32_tiles():
    from dsv4ops.layers_v41 import DEEPSEEK_NAMES as V41_NAMES

    cfg = DSV41AttentionConfig.tiny()
    src = testing.randomize_(DeepseekV41AttentionStack(cfg), seed=4)
    inverse = {v: k for k, v in V41_NAMES.items()}
    sd, want = {}, {}
    for i, (key, p) in enumerate(src.named_parameters()):
        _, layer, name = key.split(".", 2)
        ds = f"layers.{layer}.{inverse[name]}"
        if p.dim() == 2 and i % 2 == 0:
            w, s, full = _quantized(*p.shape, 32, seed=i)
            sd[ds], sd[ds[:-len("weight")] + "scale"], want[key] = w, s, full
        else:
            sd[ds], want[key] = p.detach().clone(), p.detach().double()
    assert any(k.endswith(".scale") for k in sd)
    dst = DeepseekV41AttentionStack(cfg)
    dst.load_deepseek_state_dict(sd)
    for key, p in dst.named_parameters():
        assert torch.equal(p.double(), want[key]), key


# ---- a failed load changes nothing ---------------------------------------------------------------
def _tensors(module) -> dict:
    """Every parameter and buffer (persistent or not) by name, cloned, and each module's type."""
    out = {n: t.detach().clone() for n, t in [*module.named_parameters(), *module.named_buffers()]}
    out.update({f"{n} (module)": type(m) for n, m in module.named_modules()})
    return out


def _unchanged(module, before: dict):
    after = _tensors(module)
    assert after.keys() == before.keys()
    for name, t in before.items():
        same = t is after[name] if isinstance(t, type) else builders.bytes_equal(after[name], t)
        assert same, f"the failed load changed {name}"


def _bad(sd: dict, key: str, value) -> dict:
    sd = dict(sd)
    if value is None:
        del sd[key]
    else:
        sd[key] = value
    return sd


@pytest.mark.parametrize("keep_fp8", [False, True], ids=["dequantized", "keep_fp8"])
def test_a_failed_load_of_a_v4_layer_changes_nothing(keep_fp8):
    """Issue 32: a strict load that fails (a missing, unexpected or misshapen key, a value that is
    not a tensor) used to copy every tensor it reached first (9-18 of the 18): now the layer keeps
    every parameter and buffer bit for bit, and its projections' modules (keep_fp8 swaps them to
    BlockFP8Linear before loading). The bad key is the last one torch would copy, so every other
    copy would have happened."""
    layer = testing.randomize_(DeepseekV4Attention(CFG, 1), seed=1)
    other = testing.randomize_(DeepseekV4Attention(CFG, 1), seed=2)
    fp8_sd, _ = _deepseek_fp8(other, 128, seed=3)
    if keep_fp8:  # the layer holds block-FP8 projections already: their bytes must survive too
        layer.load_deepseek_state_dict(_deepseek_fp8(layer, 128, seed=4)[0], keep_fp8=True)
    sd = other.state_dict()
    last = list(sd)[-1]
    bad_sds = {
        "shape": _bad(sd, last, torch.zeros(3)),
        "missing": _bad(sd, last, None),
        "unexpected": {**sd, "q_a_proj.bias": torch.zeros(3)},
        "not a tensor": _bad(sd, last, [0.0] * sd[last].numel()),
    }
    before = _tensors(layer)
    for what, bad in bad_sds.items():
        if not keep_fp8:
            with pytest.raises(RuntimeError, match=r"Error\(s\) in loading state_dict"):
                layer.load_state_dict(bad)
            _unchanged(layer, before)
    sink = "layers.1.attn.attn_sink"
    with pytest.raises(RuntimeError, match=r"size mismatch for sinks"):
        layer.load_deepseek_state_dict(_bad(fp8_sd, sink, torch.zeros(3)), keep_fp8=keep_fp8)
    _unchanged(layer, before)
    with pytest.raises(RuntimeError, match=r"Missing key\(s\) in state_dict: \"sinks\""):
        layer.load_deepseek_state_dict(_bad(fp8_sd, sink, None), keep_fp8=keep_fp8)
    _unchanged(layer, before)


def test_a_failed_load_of_the_v41_stack_changes_nothing():
    from dsv4ops.layers_v41 import DEEPSEEK_NAMES as V41_NAMES

    cfg = DSV41AttentionConfig.tiny()
    stack = testing.randomize_(DeepseekV41AttentionStack(cfg), seed=1)
    other = testing.randomize_(DeepseekV41AttentionStack(cfg), seed=2)
    sd = other.state_dict()
    last = list(sd)[-1]
    before = _tensors(stack)
    for bad in (_bad(sd, last, torch.zeros(3)), _bad(sd, last, None)):
        with pytest.raises(RuntimeError, match=r"Error\(s\) in loading state_dict"):
            stack.load_state_dict(bad)
        _unchanged(stack, before)
    inverse = {v: k for k, v in V41_NAMES.items()}
    ds = {f"layers.{k.split('.')[1]}.{inverse[k.split('.', 2)[2]]}": v for k, v in sd.items()}
    ds[f"layers.{cfg.num_layers - 1}.attn.attn_sink"] = torch.zeros(3)
    with pytest.raises(RuntimeError, match=r"size mismatch for layers.9.sinks"):
        stack.load_deepseek_state_dict(ds)
    _unchanged(stack, before)
