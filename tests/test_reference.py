"""The oracle against transformers' DeepseekV4Attention, the config against the published configs,
and the numerics modes. Issue: foundation."""

import json
import pathlib

import pytest
import torch
from transformers import DeepseekV4Config
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4Attention as HFAttention
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

from dsv4ops import DSV4AttentionConfig, reference, testing
from dsv4ops.config import CSA, HCA, SLIDING
from dsv4ops.quant import codecs
from dsv4ops.quant.reference import FP4_BLOCK, e2m1_round, fp8_roundtrip, hadamard, mxfp4_roundtrip
from dsv4ops.reference.functional import apply_rope, rope_angles, sink_attention
from dsv4ops.reference.numerics import Numerics, quantize_indexer_query, round_entry, round_indexer_key, round_kv

FIXTURES = pathlib.Path(__file__).parent / "fixtures"
# index_topk >= the number of entries (301 // 4 = 75) makes the CSA selection tie-free: every
# visible entry is chosen, so exact comparisons do not depend on how ties fall.
CFG = DSV4AttentionConfig.tiny(index_topk=128)
LAYER = {SLIDING: 0, CSA: 1, HCA: 2}
# 301 crosses t = 3 mod 4, 127 and 255 mod 128 and the first CSA window; batch 2.
SHAPE = (2, 301)


def _hf_layer(layer_idx, cfg=CFG, dtype=torch.float32):
    hc = testing.hf_config(cfg)
    layer = testing.randomize_(HFAttention(hc, layer_idx), seed=layer_idx).to(dtype)
    if dtype != torch.float32:  # transformers' _keep_in_fp32_modules_strict
        for name, p in layer.named_parameters():
            if name.endswith(("norm.weight", "sinks", "position_bias")):
                p.data = p.data.float()
    return hc, layer


def _params(layer, dtype=None):
    return {k: (v.detach() if dtype is None else v.detach().to(dtype)) for k, v in layer.named_parameters()}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("kind", [SLIDING, CSA, HCA])
def test_hf_parity(kind, dtype):
    li = LAYER[kind]
    hc, hf = _hf_layer(li, dtype=dtype)
    x = torch.randn(*SHAPE, CFG.hidden_size).to(dtype)
    with torch.no_grad():
        y_hf = testing.hf_attention(hf, hc, x)
        y_lowp = reference.attention(_params(hf), CFG, li, x)
        y64 = reference.attention(_params(hf, torch.float64), CFG, li, x.double())
    # Both directions: transformers is as close to the fp64 oracle as our low-precision run, and
    # vice versa (a semantic difference, e.g. a mask off by one, costs O(1), not O(eps)).
    err, budget = testing.assert_close_to_ref(y_hf, y64, y_lowp, what=f"transformers {kind} {dtype}")
    testing.assert_close_to_ref(y_lowp, y64, y_hf, what=f"reference {kind} {dtype}")
    print(f"parity {kind} {dtype}: max|hf-ref64| {err:.3e}, max|ref_lowp-ref64| {budget:.3e}, "
          f"rel {err / y64.abs().max().item():.2e}")


def test_indexer_selection_overlap_and_fed_indices():
    cfg = DSV4AttentionConfig.tiny(index_topk=16)
    hc, hf = _hf_layer(1, cfg)
    x = torch.randn(1, 301, cfg.hidden_size)
    p = _params(hf)
    with torch.no_grad():
        ours = reference.indexer_topk(p, cfg, 1, x)
        positions = torch.arange(301)[None]
        theirs = hf.compressor.indexer(x, hf.q_a_norm(hf.q_a_proj(x)), positions, None, 1)
        agree = sum(
            len(set(a[a >= 0].tolist()) & set(b[b >= 0].tolist())) for a, b in zip(ours[0], theirs[0])
        ) / max(1, int((ours >= 0).sum()))
        assert ((ours >= 0).sum(-1) == (theirs >= 0).sum(-1)).all()
        assert agree >= 0.99, f"top-k overlap {agree:.4f}"
        # The layer fed one selection: transformers' indexer replaced by ours.
        hf.compressor.indexer.forward = lambda *args, **kwargs: ours
        y_hf = testing.hf_attention(hf, hc, x)
        y = reference.attention(p, cfg, 1, x, topk=ours)
        y64 = reference.attention(_params(hf, torch.float64), cfg, 1, x.double(), topk=ours)
    testing.assert_close_to_ref(y_hf, y64, y, what="layer fed the reference's indices")


def test_topk_ties_pick_lower_index():
    cfg = DSV4AttentionConfig.tiny(index_topk=3)
    _, hf = _hf_layer(1, cfg)
    p = _params(hf)
    p["compressor.indexer.scorer.weights_proj.weight"] = torch.zeros_like(p["compressor.indexer.scorer.weights_proj.weight"])
    idx = reference.indexer_topk(p, cfg, 1, torch.randn(1, 40, cfg.hidden_size))
    # All scores are 0: every query picks its first visible entries, lowest first, -1 beyond.
    t = 23  # (23 + 1) // 4 = 6 visible entries
    assert idx[0, t].tolist() == [0, 1, 2]
    assert idx[0, 7].tolist() == [0, 1, -1]
    assert idx[0, 2].tolist() == [-1, -1, -1]


@pytest.mark.parametrize("name", ["flash", "pro"])
def test_from_hf_published_config(name):
    fields = json.loads((FIXTURES / f"v4_{name}_config.json").read_text())
    hc = DeepseekV4Config(**fields)
    preset = getattr(DSV4AttentionConfig, name)()
    assert DSV4AttentionConfig.from_hf(hc) == preset
    # The schedule as published, MTP entry excluded (it is a sliding layer).
    assert list(preset.compress_ratios) == fields["compress_ratios"][:-1]
    assert fields["compress_ratios"][-1] == 0


def test_presets_schedules():
    f, p = DSV4AttentionConfig.flash(), DSV4AttentionConfig.pro()
    assert [f.layer_type(i) for i in range(4)] == [SLIDING, SLIDING, CSA, HCA]
    assert [p.layer_type(i) for i in range(4)] == [HCA, HCA, CSA, HCA]
    assert sum(f.layer_type(i) == CSA for i in range(43)) == 21 and sum(f.layer_type(i) == HCA for i in range(43)) == 20
    assert sum(p.layer_type(i) == CSA for i in range(61)) == 30 and sum(p.layer_type(i) == HCA for i in range(61)) == 31
    assert (f.hidden_size, f.num_heads, f.q_lora_rank, f.o_groups, f.index_topk) == (4096, 64, 1024, 8, 512)
    assert (p.hidden_size, p.num_heads, p.q_lora_rank, p.o_groups, p.index_topk) == (7168, 128, 1536, 16, 1024)
    t = DSV4AttentionConfig.tiny()
    assert (t.head_dim, t.rope_head_dim, t.index_head_dim, t.window, t.csa_ratio, t.hca_ratio) == (512, 64, 128, 128, 4, 128)


def test_bad_config_is_rejected():
    with pytest.raises(ValueError, match="compress_ratios: expected 4 entries"):
        DSV4AttentionConfig.tiny(compress_ratios=(0, 4))
    with pytest.raises(ValueError, match=r"compress_ratios: entries must be in \[0, 4, 128\], got \[8\]"):
        DSV4AttentionConfig.tiny(compress_ratios=(0, 4, 8, 4))


@pytest.mark.parametrize("field, value", [("index_topk", 0), ("window", 0), ("num_heads", -4), ("head_dim", 0),
                                          ("hca_ratio", 0), ("window", 128.0), ("index_topk", True)])
def test_dims_below_one_are_rejected_at_construction(field, value):
    """Issue 32: index_topk=0 (V4.1's config refuses it) and window=0 (refused only at the first
    forward) were accepted; every dimension, window, top-k and ratio is an int >= 1."""
    with pytest.raises(ValueError, match=rf"{field}: expected an int >= 1, got {value!r}"):
        DSV4AttentionConfig.tiny(**{field: value})


def test_a_config_that_is_not_one_is_named():
    """Issue 32: a dict config ended in AttributeError: 'dict' object has no attribute 'compress_rates'."""
    from dsv4ops import DeepseekV4Attention, DSV41AttentionConfig

    for config in ({"hidden_size": 256}, DSV41AttentionConfig.tiny(), 4):
        with pytest.raises(TypeError, match=rf"config: expected a DSV4AttentionConfig or a transformers "
                                            rf"DeepseekV4Config, got {type(config).__name__} \(from a config.json "
                                            rf"dict: transformers.DeepseekV4Config\(\*\*d\); a V4.1 config: "
                                            rf"DeepseekV41AttentionStack\)"):
            DeepseekV4Attention(config, 1)
    with pytest.raises(TypeError, match=r"hf_config: expected a transformers DeepseekV4Config, got a dict without "
                                        r"compress_rates, layer_types, rope_parameters, \.\.\. \(a config.json dict: "
                                        r"DSV4AttentionConfig.from_hf\(transformers.DeepseekV4Config\(\*\*d\)\)\)"):
        DSV4AttentionConfig.from_hf({"hidden_size": 256})


# ---- RoPE (pitfalls 1, 2, 3, 8) ----------------------------------------------------------------
def test_rope_tables_match_transformers_and_skip_yarn_on_sliding_layers():
    cfg = DSV4AttentionConfig.flash()
    hc = testing.hf_config(cfg)
    rot = DeepseekV4RotaryEmbedding(hc)
    sliding, compressed = cfg.inv_freq(0), cfg.inv_freq(2)
    assert torch.equal(sliding, rot.main_inv_freq) and torch.equal(compressed, rot.compress_inv_freq)
    assert rot.compress_attention_scaling == 1.0  # no YaRN mscale on cos/sin (pitfall 2)
    assert torch.allclose(sliding, 10000.0 ** (-torch.arange(0, 64, 2) / 64))
    base = 160000.0 ** (-torch.arange(0, 64, 2) / 64)
    # Pairs 0-15 keep their frequency, 25-31 are divided by 16 (spec 2: low 15, high 25).
    assert torch.allclose(compressed[:16], base[:16]) and torch.allclose(compressed[25:], base[25:] / 16)
    assert ((compressed[16:25] < base[16:25]) & (compressed[16:25] > base[16:25] / 16)).all()


def test_rope_is_interleaved_on_the_trailing_channels():
    x = torch.zeros(512)
    x[448], x[449] = 1.0, 0.0  # pair 0
    cos, sin = rope_angles(torch.tensor(3), torch.tensor([0.5] + [0.0] * 31), torch.float32)
    y = apply_rope(x, cos, sin)
    assert torch.equal(y[:448], x[:448])
    assert torch.allclose(y[448:450], torch.tensor([torch.cos(torch.tensor(1.5)), torch.sin(torch.tensor(1.5))]))
    assert torch.allclose(apply_rope(y, cos, sin, inverse=True), x, atol=1e-7)


def test_compressed_rope_position_is_block_start():
    cfg = CFG
    _, hf = _hf_layer(2)
    p = _params(hf)
    x = torch.randn(256, cfg.hidden_size)
    args = (p["compressor.kv_proj.weight"], p["compressor.gate_proj.weight"], p["compressor.position_bias"],
            p["compressor.kv_norm.weight"], 128)
    rotated = reference.compress(x, *args, cfg.inv_freq(2), "exact", cfg.rms_norm_eps)
    plain = reference.compress(x, *args, torch.zeros(32), "exact", cfg.rms_norm_eps)
    cos, sin = rope_angles(torch.tensor([0, 128]), cfg.inv_freq(2), torch.float32)
    assert torch.allclose(rotated, apply_rope(plain, cos, sin), atol=1e-6)


# ---- masks (pitfalls 6, 7, 15) -----------------------------------------------------------------
def test_window_holds_128_tokens_including_the_query():
    _, hf = _hf_layer(0)
    p = _params(hf)
    x = torch.randn(1, 200, CFG.hidden_size)
    y = reference.attention(p, CFG, 0, x)
    x2 = x.clone()
    x2[0, 50] += 1.0
    moved = (reference.attention(p, CFG, 0, x2) - y).abs().amax(-1)[0] > 0
    # Token 50 is seen by queries 50..177 (= 50 + 127) and no other.
    assert moved.nonzero().flatten().tolist() == list(range(50, 178))


@pytest.mark.parametrize("kind", [CSA, HCA])
def test_entry_visible_from_the_token_that_completes_it(kind):
    li = LAYER[kind]
    m = CFG.compress_ratio(li)
    _, hf = _hf_layer(li)
    p = _params(hf)
    x = torch.randn(1, 2 * m + 1, CFG.hidden_size)
    y = reference.attention(p, CFG, li, x)
    p2 = dict(p)
    p2["compressor.kv_norm.weight"] = p["compressor.kv_norm.weight"] * 2
    moved = (reference.attention(p2, CFG, li, x) - y).abs().amax(-1)[0] > 0
    # Entry 0 covers tokens 0..m-1 and is first visible to t = m - 1 (w < (t+1)//m).
    assert moved.nonzero().flatten().tolist() == list(range(m - 1, 2 * m + 1))


# ---- sink (pitfall 10) ------------------------------------------------------------------------
def test_sink_only_adds_to_the_denominator():
    q, k = torch.randn(3, 2, 8), torch.randn(5, 8)
    valid = torch.ones(3, 5, dtype=torch.bool)
    plain = sink_attention(q, k, valid, torch.full((2,), float("-inf")), 0.3)
    probs = torch.softmax(torch.einsum("thd,jd->thj", q, k) * 0.3, -1)
    assert torch.allclose(plain, torch.einsum("thj,jd->thd", probs, k), atol=1e-6)
    sinks = torch.tensor([0.5, -1.0])
    logits = torch.einsum("thd,jd->thj", q, k) * 0.3
    denom = logits.exp().sum(-1) + sinks.exp()[None]
    expect = torch.einsum("thj,jd->thd", logits.exp() / denom[..., None], k)
    assert torch.allclose(sink_attention(q, k, valid, sinks, 0.3), expect, atol=1e-6)


# ---- numerics modes (pitfalls 4, 5) ------------------------------------------------------------
def test_fp8_kv_rounds_nope_to_e4m3_and_rope_to_bf16():
    x = torch.randn(64, 512) * torch.logspace(-3, 2, 64)[:, None]
    y = round_kv(x, "fp8", 64)
    assert torch.equal(y[:, 448:], x[:, 448:].bfloat16().float())
    nope, v = y[:, :448], x[:, :448].bfloat16().float()
    blocks = v.reshape(64, 7, 64)
    scale = torch.exp2(torch.ceil(torch.log2(blocks.abs().amax(-1, keepdim=True) / 448)))
    err = (nope.reshape(64, 7, 64) - blocks).abs()
    # e4m3: 3 mantissa bits -> half-ulp 2^-4 relative; subnormals: half of 2^-9 x scale.
    assert (err <= torch.maximum(blocks.abs() * 2**-4, scale * 2**-10)).all()
    assert (nope.reshape(64, 7, 64) / scale).abs().max() <= 448
    assert torch.equal(nope.bfloat16().float(), nope)  # e4m3 x 2^k is exact in bf16
    assert torch.equal(round_kv(x, "exact", 64), x)


def test_fp8_scale_is_a_power_of_two_from_the_block_amax():
    x = torch.zeros(1, 64)
    x[0, 5] = 448.0 * 4  # amax / 448 = 4 exactly -> scale 4, no rounding of log2
    assert torch.equal(fp8_roundtrip(x, 64), x)
    x[0, 5] = 448.0 * 4 * 1.01  # -> scale 8: 1809.92 / 8 = 226.24 rounds to e4m3 224 (step 16 in [128, 256))
    y = fp8_roundtrip(x, 64)
    assert y[0, 5] == 224.0 * 8 and torch.count_nonzero(y) == 1


def test_mxfp4_values_on_the_e2m1_grid():
    x = torch.randn(8, 128) * 3
    y = mxfp4_roundtrip(x)
    blocks, yb = x.reshape(8, 4, FP4_BLOCK), y.reshape(8, 4, FP4_BLOCK)
    scale = torch.exp2(torch.ceil(torch.log2(blocks.abs().amax(-1, keepdim=True) / 6)))
    grid = torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6])
    assert torch.isin((yb / scale).abs(), grid).all()
    assert torch.equal(e2m1_round(torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -5.0, 7.0])),
                       torch.tensor([0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, -4.0, 6.0]))


def test_hadamard_is_orthogonal_and_scores_invariant_on_both_sides():
    x = torch.randn(5, 128, dtype=torch.float64)
    eye = hadamard(torch.eye(128, dtype=torch.float64))
    assert torch.allclose(eye @ eye.T, torch.eye(128, dtype=torch.float64))
    assert torch.allclose(hadamard(hadamard(x)), x)
    k = torch.randn(7, 128, dtype=torch.float64)
    assert torch.allclose(hadamard(x) @ hadamard(k).T, x @ k.T)  # both sides: exact
    assert not torch.allclose(hadamard(x) @ k.T, x @ k.T)  # one side only: wrong


def test_fp4_entries_are_e2m1_times_an_e4m3_scale_per_16_as_the_288_byte_row():
    # kv="fp4": the compressed entry (all 512 dims, rope too) as an fp4_288 row reads back. The oracle's
    # fake quantizer (grid argmin, torch's e4m3 cast) and the row codec (nibble thresholds, scale bits)
    # are separate formulations of the same exact rounding: equal on bf16 inputs, ties and edges too.
    x = torch.randn(64, 512) * torch.logspace(-4, 2, 64)[:, None]
    x[0, :16] = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -2.5, -5.0, 5.5, 0.0, -0.0, 0, 0])
    x[1, :16] = 0.0  # scale floor 2^-9
    x[2, :16] = 3000.0  # amax / 6 = 500 > 464: e4m3's NaN scale (no clamp, as the QAT reference)
    y = round_entry(x.bfloat16().float(), "fp4", 64)
    assert torch.equal(y.nan_to_num(7.0), codecs.roundtrip("fp4_288", x).nan_to_num(7.0))
    assert y[0, :8].tolist() == [6.0, 0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]  # ties to the even code
    assert y[2, :16].isnan().all() and not y[2, 16:].isnan().any()
    blocks, yb = x.bfloat16().float()[3:].reshape(61, 32, 16), y[3:].reshape(61, 32, 16)
    scale = (blocks.abs().amax(-1, keepdim=True).clamp(min=6 * 2**-9) / 6).to(torch.float8_e4m3fn).float()
    assert torch.isin((yb / scale).abs(), torch.tensor([0, 0.5, 1, 1.5, 2, 3, 4, 6])).all()
    assert torch.equal(round_entry(x, "fp8", 64), round_kv(x, "fp8", 64))
    assert torch.equal(round_entry(x, "exact", 64), x)


def test_mxfp4_indexer_rotates_bf16_rows_then_rounds_as_the_68_byte_row():
    # V4's indexer (DeepSeek's rotate_activation: bf16 in, bf16 out) before E2M1 with UE8M0 per 32:
    # key and query alike, the query's weights untouched.
    k = torch.randn(10, 128, dtype=torch.float64) * 3
    rotated = (hadamard(k.bfloat16().double()).bfloat16().float())
    assert torch.equal(round_indexer_key(k, "mxfp4"), codecs.roundtrip("mxfp4_68", rotated).double())
    w = torch.randn(10)
    q, w2 = quantize_indexer_query(k.view(10, 1, 128), w.view(10, 1), "mxfp4")
    assert torch.equal(q.view(10, 128), codecs.roundtrip("mxfp4_68", rotated)) and torch.equal(w2.view(10), w)


def test_indexer_fp8_key_has_one_pow2_scale_per_entry():
    k = torch.randn(10, 128)
    y = round_indexer_key(k, "fp8")
    scale = torch.exp2(torch.ceil(torch.log2(k.bfloat16().float().abs().amax(-1, keepdim=True) / 448)))
    assert torch.equal((y / scale).to(torch.float8_e4m3fn).float() * scale, y)


@pytest.mark.parametrize("mode", [Numerics("fp8", "exact"), Numerics("exact", "fp8"), Numerics("exact", "mxfp4"),
                                  Numerics("fp4", "exact"), Numerics("fp4", "mxfp4")])
def test_modes_move_the_output_by_their_quantization_error(mode):
    cfg = DSV4AttentionConfig.tiny(index_topk=8)
    _, hf = _hf_layer(1, cfg)
    p = _params(hf)
    x = torch.randn(1, 140, cfg.hidden_size)
    exact = reference.attention(p, cfg, 1, x)
    moved = (reference.attention(p, cfg, 1, x, mode) - exact).abs().max() / exact.abs().max()
    # Quantization moves the output (it is not a no-op) but stays a perturbation, not a different layer.
    assert 0 < moved < 0.5, moved


# ---- spec section 8 pitfalls: every one mapped to a test here or to the issue that owns it -----
PITFALLS = {
    1: "test_rope_tables_match_transformers_and_skip_yarn_on_sliding_layers",
    2: "test_rope_tables_match_transformers_and_skip_yarn_on_sliding_layers",
    3: "test_rope_is_interleaved_on_the_trailing_channels",
    4: "test_hadamard_is_orthogonal_and_scores_invariant_on_both_sides",
    5: "test_fp8_kv_rounds_nope_to_e4m3_and_rope_to_bf16",
    6: "test_window_holds_128_tokens_including_the_query",
    7: "test_entry_visible_from_the_token_that_completes_it",
    8: "test_compressed_rope_position_is_block_start",
    9: "test_hf_parity",  # the CSA a/b-stream split: any other split breaks CSA parity
    10: "test_sink_only_adds_to_the_denominator",
    11: "test_hf_parity",  # inverse RoPE of the output
    12: "test_hf_parity",  # weightless per-head q norm
    13: "test_hf_parity",  # block-diagonal o_a
    14: "test_hf_parity",  # indexer reads the normalised q latent (no q_a of its own in the state dict)
    15: "test_entry_visible_from_the_token_that_completes_it",
    16: "issue: paged KV cache and the serving step (chunked prefill == decode == one-shot)",
    17: "issue: GPU kernels (heads 64/128, d_v 512, FP8 decode KV, global paged indices)",
    18: "test_from_hf_published_config",
}


def test_every_pitfall_is_owned():
    assert sorted(PITFALLS) == list(range(1, 19))
    for owner in PITFALLS.values():
        assert owner.startswith("issue:") or owner in globals(), owner
