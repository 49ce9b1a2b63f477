"""The ops composed into a layer (DeepseekV4Attention.forward with step=None: qkv_prep,
compressor_update, indexer_q_prep, indexer_topk, sparse_attn, inv_rope over a private paged cache)
equal the stateless oracle dsv4ops.reference.attention, in exact fp32 and in FP8 numerics, within
the error of the oracle's own fp32 run against its fp64 run. Issue 3."""

import pytest
import torch

from dsv4ops import DeepseekV4Attention, DSV4AttentionConfig, Numerics, reference, testing

# 260 tokens: past the 128-token window, two HCA entries (t = 127, 255), 65 CSA entries (t = 3 mod 4).
# Batch 2: two requests share the pools. "csa-all" selects every visible entry (index_topk 128 >= 65,
# no ties possible); "csa-top16" makes the indexer choose 16 of up to 65 entries.
SHAPE = (2, 260)
LAYERS = {"sliding": (0, 16), "hca": (2, 16), "csa-all": (1, 128), "csa-top16": (1, 16)}
NUMERICS = {"exact": Numerics(), "fp8": Numerics(kv="fp8", indexer="fp8")}


@pytest.mark.parametrize("numerics", NUMERICS)
@pytest.mark.parametrize("layer", LAYERS)
def test_layer_equals_the_oracle(layer, numerics):
    layer_idx, topk = LAYERS[layer]
    cfg = DSV4AttentionConfig.tiny(index_topk=topk)
    mode = NUMERICS[numerics]
    module = testing.randomize_(DeepseekV4Attention(cfg, layer_idx, mode), seed=layer_idx)
    x = torch.randn(*SHAPE, cfg.hidden_size)
    params = {k: v.detach() for k, v in module.named_parameters()}
    with torch.no_grad():
        y = module(x)
        lowp = reference.attention(params, cfg, layer_idx, x, mode)
        y64 = reference.attention({k: v.double() for k, v in params.items()}, cfg, layer_idx, x.double(), mode)
    testing.assert_close_to_ref(y, y64, lowp, what=f"{layer} {numerics}")
