"""The V4.1 stack oracle (dsv4ops.reference.v41) against the spec's semantics, without another
implementation to compare with (the installed transformers has no V4.1 port; its port is wrong
without a cache anyway, spec pitfall 23): causality, which layers each layer's input reaches (the
role table: shared entries, keys, top-k and pool of the same forward), visibility w < (t + 1) // m,
ratio-2 groups of 2 tokens, the pool restricting the later index sources, ties to the lower entry,
the fake-quant points. Issue 16."""

import pytest
import torch

from dsv4ops import CacheFormats, testing
from dsv4ops.config_v41 import DSV41AttentionConfig
from dsv4ops.layers_v41 import DeepseekV41AttentionStack
from dsv4ops.quant import codecs
from dsv4ops.reference.v41 import quantize_query, stack_attention

CFG = DSV41AttentionConfig.tiny()
S = 48


@pytest.fixture(scope="module")
def params():
    stack = testing.randomize_(DeepseekV41AttentionStack(CFG), seed=5)
    return {k: v.detach().double() for k, v in stack.named_parameters()}


def _xs(seed=0):
    return torch.randn(CFG.num_layers, 1, S, CFG.hidden_size, generator=torch.Generator().manual_seed(seed),
                       dtype=torch.float64)


@pytest.mark.parametrize("numerics", [CacheFormats.exact(), CacheFormats.v41()], ids=["exact", "qat"])
def test_causal(params, numerics):
    xs = _xs()
    base = stack_attention(params, CFG, xs, numerics).y
    xs2 = xs.clone()
    xs2[:, :, 30:] += 1.0
    moved = stack_attention(params, CFG, xs2, numerics).y
    assert torch.equal(moved[:, :, :30], base[:, :, :30])
    assert (moved[:, :, 30:] != base[:, :, 30:]).any(-1).all()


# layer whose input changes -> the layers whose outputs move (tiny: sources 1, 3, 5; index sources
# 1, 3, 5, 7; candidate source 5). A reuse layer reaches only itself; a source its whole group; the
# candidate source also the reindex layer and its reuse layers; the reindex layer its reuse layers.
REACH = {0: {0}, 1: {1, 2}, 2: {2}, 3: {3, 4}, 4: {4}, 5: {5, 6, 7, 8, 9}, 6: {6}, 7: {7, 8, 9}, 8: {8}, 9: {9}}


@pytest.mark.parametrize("layer", sorted(REACH))
def test_a_layer_input_reaches_exactly_its_readers(params, layer):
    xs = _xs()
    base = stack_attention(params, CFG, xs, CacheFormats.exact()).y
    xs2 = xs.clone()
    xs2[layer] += 0.5
    moved = stack_attention(params, CFG, xs2, CacheFormats.exact()).y
    assert set((moved != base).flatten(1).any(1).nonzero().flatten().tolist()) == REACH[layer]


def test_visibility_and_ratio_2_groups(params):
    trace = stack_attention(params, CFG, _xs(), CacheFormats.exact())
    for layer, m in ((1, 2), (3, 2), (5, 1)):
        picks = trace.topk[layer][0]
        for t in range(S):
            n = (t + 1) // m  # entry w is visible iff (w + 1) m <= t + 1: ratio 2, t = 2w + 1 closes w
            got = sorted(e for e in picks[t].tolist() if e >= 0)
            assert all(e < n for e in got) and len(got) == min(n, CFG.index_topk), (layer, t)
            if n <= CFG.index_topk:
                assert got == list(range(n)), (layer, t)


def test_the_pool_restricts_the_reindex_layer_and_not_the_source(params):
    trace = stack_attention(params, CFG, _xs(), CacheFormats.exact())
    pool, cb = trace.pools[5][0], CFG.candidate_block_size
    differs = 0
    for t in range(S):
        inside = {e for b in pool[t].tolist() if b >= 0 for e in range(b * cb, (b + 1) * cb)}
        assert (t // cb) in pool[t].tolist()  # the newest block is forced in
        assert set(trace.topk[7][0, t].tolist()) - {-1} <= inside
        scores7 = trace.scores[7][0, t]
        assert (scores7[[e for e in range(scores7.shape[0]) if e not in inside]] == float("-inf")).all()
        differs += bool(set(trace.topk[5][0, t].tolist()) - inside)
    # With 16-entry pools over up to 48 entries the pool prunes, and the source's own top-8 is taken
    # over every visible entry (pitfall 13): with 4 pool blocks it reaches outside its pool.
    assert sum(len({b for b in pool[t].tolist() if b >= 0}) * cb < t + 1 for t in range(S)) > 20
    assert differs > 0


def test_ties_pick_the_lower_entry(params):
    p = dict(params)
    p["layers.1.indexer.weights_proj.weight"] = torch.zeros_like(p["layers.1.indexer.weights_proj.weight"])
    p["layers.5.indexer.weights_proj.weight"] = torch.zeros_like(p["layers.5.indexer.weights_proj.weight"])
    trace = stack_attention(p, CFG, _xs(), CacheFormats.exact())  # every score of layers 1 and 5 is 0
    for t in range(S):
        n1, n5 = (t + 1) // 2, t + 1
        assert trace.topk[1][0, t].tolist()[: min(n1, 8)] == list(range(min(n1, 8)))
        assert trace.topk[5][0, t].tolist()[: min(n5, 8)] == list(range(min(n5, 8)))
        # Blocks tie too: the forced newest block and the lowest others, in ascending order.
        want = sorted([t // 4] + [b for b in range(t // 4 + 1) if b != t // 4][:3])
        assert trace.pools[5][0, t].tolist()[: len(want)] == want


def test_fake_quant_points_move_the_output(params):
    # Each cache format changes the output on its own (window: every layer; compressed: the compressed
    # layers; index: the selections).
    xs = _xs()
    exact = stack_attention(params, CFG, xs, CacheFormats.exact())
    for fmt in ({"window": "fp8_528"}, {"comp": "fp4_288"}, {"index": "mxfp4_68"}):
        one = stack_attention(params, CFG, xs, CacheFormats.exact().replace(**fmt))
        moved = (one.y != exact.y).flatten(1).any(1)
        if "window" in fmt:
            assert moved.all()
        elif "comp" in fmt:
            assert moved.tolist() == [CFG.role(i).ratio > 0 for i in range(CFG.num_layers)]
        else:
            assert any(not torch.equal(one.topk[k], exact.topk[k]) for k in one.topk)


def test_mx4_query_is_the_format_codec_per_head():
    q, w = torch.randn(3, 4, 128, dtype=torch.float64), torch.rand(3, 4, dtype=torch.float64)
    qq, ww = quantize_query(q, w, "mxfp4_68")
    assert torch.equal(ww, w) and torch.equal(qq, codecs.roundtrip("mxfp4_68", q))
    q8, w8 = quantize_query(q, w, "fp8_132")
    assert torch.allclose((q8 * w8[..., None]), codecs.roundtrip("fp8_132", q) * w[..., None], rtol=0, atol=0)


def test_numerics_and_inputs_are_checked():
    with pytest.raises(ValueError, match=r"window: expected one of \['exact', 'fp8_584', 'fp8_528', 'fp4_288'\], got 'mxfp4_68'"):
        CacheFormats.v41().replace(window="mxfp4_68")
    with pytest.raises(ValueError, match=r"index: expected one of \['exact', 'fp8_132', 'mxfp4_68'\]"):
        CacheFormats.v41().replace(index="fp4_288")
    with pytest.raises(ValueError, match=r"xs: expected one input per backbone layer \(10\) at dim 0, got 9"):
        stack_attention({}, CFG, torch.zeros(9, 1, 4, CFG.hidden_size))
