"""DSV41AttentionConfig: the released Flash numbers and its role table (spec 1.1-1.3), the test preset
against spec 1.5's rules, the RoPE tables (ratio 1 uses the compress table), `from_hf` (JSON file,
dict, whole config, object; HF's defaults for omitted fields), and one clear error per validation
rule. Issue 16."""

import json
from types import SimpleNamespace

import pytest
import torch

from dsv4ops.config_v41 import DSV41AttentionConfig

FIXTURE = "tests/fixtures/v41_flash_config.json"
FLASH = DSV41AttentionConfig.v41_flash()
TINY = DSV41AttentionConfig.tiny()


# ---- spec 1.3: the Flash layer table, row by row -----------------------------------------------
def _row(layer):
    r = FLASH.role(layer)
    return r.ratio, r.kind, r.kv_source, r.index_source


@pytest.mark.parametrize("layers,ratio,kind,kv,index", [
    ([0, 1], 0, "sliding", None, None),
    ([2], 2, "source", 2, 2), ([8], 2, "source", 8, 8), ([14], 2, "source", 14, 14),
    ([3, 4, 5, 6, 7], 2, "reuse", 2, 2), ([9, 13], 2, "reuse", 8, 8), ([15, 19], 2, "reuse", 14, 14),
    ([20], 1, "source+candidate", 20, 20),
    ([21, 22, 23], 1, "reuse", 20, 20),
    ([24], 1, "reindex+pool", 20, 24), ([28], 1, "reindex+pool", 20, 28), ([32], 1, "reindex+pool", 20, 32),
    ([36], 1, "reindex+pool", 20, 36),
    ([25, 27], 1, "reuse", 20, 24), ([29, 31], 1, "reuse", 20, 28), ([33, 35], 1, "reuse", 20, 32),
    ([37, 38, 39], 1, "reuse", 20, 36),
    ([40, 41, 42], 0, "sliding", None, None),
])
def test_flash_role_table(layers, ratio, kind, kv, index):
    for layer in layers:
        assert _row(layer) == (ratio, kind, kv, index), layer


def test_flash_counts():
    # Spec 1.3 [derived]: 4 compressors (3 with wgate), 8 indexers, 4 wk, 4 compressed and 4 key
    # caches, 43 window caches; the pool published by layer 20 and used by 24/28/32/36.
    roles = FLASH.roles
    assert len(roles) == 43 and FLASH.num_layers == 40
    assert [r.layer for r in roles if r.owns_compressor] == [2, 8, 14, 20]
    assert sum(r.owns_compressor and r.ratio > 1 for r in roles) == 3
    assert [r.layer for r in roles if r.indexer] == [2, 8, 14, 20, 24, 28, 32, 36]
    assert [r.layer for r in roles if r.owns_index_keys] == [2, 8, 14, 20]
    assert [r.layer for r in roles if r.candidate_source] == [20]
    assert [r.layer for r in roles if r.uses_candidates] == [24, 28, 32, 36]
    assert FLASH.candidate_pool == 16384


def test_tiny_preset_satisfies_spec_1_5():
    # Every role present; the kernels' fixed widths kept; lengths T = 64..128 exceed the window, the
    # ratio-2 top-k and the candidate pool.
    kinds = {r.kind for r in TINY.roles}
    assert kinds == {"sliding", "source", "reuse", "source+candidate", "reindex+pool"}
    assert any(r.reuse and r.ratio == 2 for r in TINY.roles) and any(r.reuse and r.ratio == 1 for r in TINY.roles)
    assert any(r.reuse and r.index_source == 7 for r in TINY.roles)  # reuse of a reindex layer's top-k
    assert (TINY.head_dim, TINY.rope_head_dim, TINY.index_head_dim) == (512, 64, 128)
    assert TINY.num_heads // TINY.o_groups == 8
    t = 64
    assert t > TINY.window and t // 2 > TINY.index_topk and t > TINY.candidate_pool


def test_rope_tables():
    # Spec 3: main for ratio 0; compress (160000 + YaRN 16) for ratio 2 AND ratio 1 (pitfall 3).
    main, r2, r1 = FLASH.inv_freq(0), FLASH.inv_freq(2), FLASH.inv_freq(20)
    assert torch.equal(r1, r2) and not torch.equal(main, r1)
    spot = {0: 1.0, 1: 0.687656, 15: 3.63554e-3, 16: 2.26562e-3, 20: 2.96978e-4, 24: 1.95313e-5, 25: 5.37231e-6,
            31: 5.68053e-7}
    for i, v in spot.items():
        assert abs(r1[i].item() - v) <= 1e-5 * v, i
    assert abs(main[1].item() - 0.749894) < 1e-6 and abs(main[31].item() - 1.33352e-4) < 1e-9


# ---- from_hf -----------------------------------------------------------------------------------
def _text() -> dict:
    with open(FIXTURE) as f:
        return json.load(f)["text_config"]


def test_from_hf_reads_the_json_file_the_whole_config_the_text_config_and_objects():
    assert DSV41AttentionConfig.from_hf(FIXTURE) == FLASH
    with open(FIXTURE) as f:
        whole = json.load(f)
    assert DSV41AttentionConfig.from_hf(whole) == FLASH
    assert DSV41AttentionConfig.from_hf(_text()) == FLASH
    assert DSV41AttentionConfig.from_hf(SimpleNamespace(**_text())) == FLASH


def test_from_hf_nested_rope_parameters():
    text = _text()
    scaling = text.pop("rope_scaling")
    text["rope_parameters"] = {"main": {"rope_type": "default", "rope_theta": 10000.0},
                               "compress": {"rope_type": "yarn", "rope_theta": 160000.0, "attention_factor": 1.0,
                                            **{k: v for k, v in scaling.items() if k != "type"}}}
    assert DSV41AttentionConfig.from_hf(text) == FLASH


def test_from_hf_defaults_of_omitted_fields():
    # HF: 2 sliding layers, (n - 1) // 2 of ratio 2, the rest ratio 1; KV sources = the first layer of
    # each run; index sources = KV sources; candidate source = the last KV source.
    text = _text()
    for k in ("compress_ratios", "kv_source_layer_ids", "index_source_layer_ids", "candidate_source_layer_id"):
        del text[k]
    text["num_hidden_layers"] = 9
    text["num_nextn_predict_layers"] = 0
    cfg = DSV41AttentionConfig.from_hf(text)
    assert cfg.compress_ratios == (0, 0, 2, 2, 2, 2, 1, 1, 1)
    assert cfg.kv_source_layers == (2, 6) and cfg.index_source_layers == (2, 6) and cfg.candidate_source_layer == 6


def test_from_hf_pads_and_zeroes_the_draft_entries():
    text = _text()
    text["compress_ratios"] = text["compress_ratios"][:40]  # n entries: padded with the drafts' 0
    assert DSV41AttentionConfig.from_hf(text) == FLASH
    text["compress_ratios"] = text["compress_ratios"] + [2, 2, 2]  # draft entries forced to 0
    assert DSV41AttentionConfig.from_hf(text).compress_ratios[40:] == (0, 0, 0)


# ---- validation: one clear error per rule ------------------------------------------------------
BAD = [
    ("ratios-length", dict(compress_ratios=(0, 2, 2)), r"compress_ratios: expected 10 to 10 entries"),
    ("ratios-negative", dict(compress_ratios=(0, 2, 2, 2, 2, 1, 1, 1, 1, -1)), r"expected ratios >= 0"),
    ("kv-order", dict(kv_source_layers=(3, 1, 5)), r"kv_source_layers: expected distinct increasing backbone"),
    ("kv-range", dict(kv_source_layers=(1, 3, 5, 10)), r"kv_source_layers: expected distinct .* in \[0, 10\)"),
    ("kv-ratio-0", dict(kv_source_layers=(0, 1, 3, 5)),
     r"kv_source_layers: expected layers with compress ratio > 0, got layer 0"),
    ("index-ratio-0", dict(index_source_layers=(0, 1, 3, 5, 7)), r"index_source_layers: expected layers with"),
    ("index-without-kv", dict(compress_ratios=(0, 2, 2, 2, 2, 1, 1, 1, 1, 1), kv_source_layers=(3, 5),
                              index_source_layers=(1, 3, 5, 7)),
     r"index_source_layers: layer 1 has no KV source at or before it"),
    ("candidate-not-index", dict(candidate_source_layer=6), r"candidate_source_layer: expected one of the index"),
    ("layer-without-kv", dict(kv_source_layers=(3, 5), index_source_layers=(3, 5, 7)),
     r"kv_source_layers: layer 1 \(ratio 2\) has no KV source at or before it"),
    ("group-ratio", dict(compress_ratios=(0, 2, 2, 2, 1, 1, 1, 1, 1, 1)),
     r"compress_ratios: layer 4 has ratio 1 but reads the compressed KV of layer 3 \(ratio 2\)"),
    ("source-not-index", dict(index_source_layers=(1, 5, 7)),
     r"index_source_layers: KV source 3 must also be an index source"),
    ("pool-other-group", dict(compress_ratios=(0, 2, 2, 2, 2, 1, 1, 1, 1, 1), kv_source_layers=(1, 3, 5, 8),
                              index_source_layers=(1, 3, 5, 7, 8, 9)),
     r"candidate_source_layer: index source 8 would score inside the candidate pool of layer 5"),
    ("head-dim-32", dict(head_dim=528), r"head_dim: expected a multiple of 32"),
    ("index-dim-32", dict(index_head_dim=100), r"index_head_dim: expected a multiple of 32"),
    ("rope-odd", dict(rope_head_dim=63), r"rope_head_dim: expected an even number"),
    ("rope-wide", dict(rope_head_dim=256), r"rope_head_dim: expected an even number <= head_dim \(512\) and <= "
                                           r"index_head_dim \(128\), got 256"),
    ("groups", dict(o_groups=3), r"o_groups: expected a divisor of num_heads \(16\), got 3"),
    ("pool-blocks", dict(candidate_topk_blocks=0), r"candidate_topk_blocks: expected >= 1, got 0"),
    ("window", dict(window=0), r"window: expected >= 1, got 0"),
]


@pytest.mark.parametrize("changes,match", [pytest.param(c, m, id=i) for i, c, m in BAD])
def test_invalid_configs_are_rejected(changes, match):
    with pytest.raises(ValueError, match=match):
        DSV41AttentionConfig.tiny(**changes)


@pytest.mark.parametrize("key,value,match", [
    ("num_key_value_heads", 2, r"num_key_value_heads: V4.1 has one shared K = V latent, got 2"),
    ("rope_scaling", {"type": "yarn", "factor": 16, "original_max_position_embeddings": 65536,
                      "attention_factor": 1.277}, r"V4.1 uses no YaRN magnitude scale"),
    ("rope_scaling", {"type": "linear", "factor": 2}, r"expected rope_type 'yarn' or 'default', got 'linear'"),
])
def test_from_hf_rejects_what_v41_does_not_have(key, value, match):
    text = _text()
    text[key] = value
    with pytest.raises(ValueError, match=match):
        DSV41AttentionConfig.from_hf(text)


def test_from_hf_names_missing_fields():
    text = _text()
    del text["index_topk"], text["q_lora_rank"]
    with pytest.raises(ValueError, match=r"config: expected a V4.1 text_config with \['q_lora_rank', 'index_topk'\]"):
        DSV41AttentionConfig.from_hf(text)
