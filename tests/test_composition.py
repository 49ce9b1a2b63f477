"""The ops composed into a layer (DeepseekV4Attention.forward with step=None: qkv_prep,
compressor_update, indexer_q_prep, indexer_topk, sparse_attn, inv_rope over a private paged cache)
equal the stateless oracle dsv4ops.reference.attention, in exact fp32 and in FP8 numerics, within
the error of the oracle's own fp32 run against its fp64 run. Issue 3."""

import pytest
import torch

from dsv4ops import CacheFormats, DeepseekV4Attention, DSV4AttentionConfig, testing

# 260 tokens: past the 128-token window, two HCA entries (t = 127, 255), 65 CSA entries (t = 3 mod 4).
# Batch 2: two requests share the pools. "csa-all" selects every visible entry (index_topk 128 >= 65,
# no ties possible); "csa-top16" makes the indexer choose 16 of up to 65 entries.
SHAPE = (2, 260)
LAYERS = {"sliding": (0, 16), "hca": (2, 16), "csa-all": (1, 128), "csa-top16": (1, 16)}
NUMERICS = {"exact": CacheFormats.exact(), "fp8": CacheFormats.v4()}


@pytest.mark.parametrize("numerics", NUMERICS)
@pytest.mark.parametrize("layer", LAYERS)
def test_layer_equals_the_oracle(layer, numerics):
    layer_idx, topk = LAYERS[layer]
    cfg = DSV4AttentionConfig.tiny(index_topk=topk)
    mode = NUMERICS[numerics]
    module = testing.randomize_(DeepseekV4Attention(cfg, layer_idx, mode), seed=layer_idx)
    x = torch.randn(*SHAPE, cfg.hidden_size)
    with torch.no_grad(), testing.recorded_selections() as log:
        y = module(x)
    # With a real selection ("csa-top16") the layer's top-k and the oracle's may differ where two
    # entries' scores lie within rounding error: the selection is checked against the oracle's
    # scores, and the output against the oracle fed the layer's own selection.
    selection = log[0].view(*SHAPE, -1) if log else [None] * SHAPE[0]
    for b in range(SHAPE[0]):
        testing.assert_matches_oracle(module, x[b], y[b], selection[b], what=f"{layer} {numerics} row {b}")
