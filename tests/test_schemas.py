"""Every dsv4:: op's schema, pinned: a signature or mutation-annotation change is a visible diff.
Regenerate with `EXPECTTEST_ACCEPT=1 python -m pytest tests/test_schemas.py`. Issue 3."""

import torch
from builders import dsv4_ops
from expecttest import assert_expected_inline


PINNED = {"gate_topk", "hash_route", "router_gate", "pack_kv", "unpack_kv", "qkv_prep", "compressor_update",
          "indexer_q_prep", "indexer_k_prep", "indexer_topk", "visible_entries", "sparse_attn", "attn_merge",
          "inv_rope", "fp8_linear", "fp8_linear_w8a8", "invariant_linear"}


def _schema(name: str) -> str:
    return str(getattr(torch.ops.dsv4, name).default._schema)


def test_every_op_is_pinned():
    assert dsv4_ops() == PINNED


def test_gate_topk():
    assert_expected_inline(_schema("gate_topk"), """dsv4::gate_topk(Tensor logits, Tensor bias, Tensor(a2!) weights_out, Tensor(a3!) indices_out, float routed_scaling_factor) -> ()""")


def test_hash_route():
    assert_expected_inline(_schema("hash_route"), """dsv4::hash_route(Tensor logits, Tensor token_ids, Tensor tid2eid, Tensor(a3!) weights_out, Tensor(a4!) indices_out, float routed_scaling_factor) -> ()""")


def test_router_gate():
    assert_expected_inline(_schema("router_gate"), """dsv4::router_gate(Tensor x, Tensor weight, Tensor bias, Tensor(a3!) logits_out, Tensor(a4!) weights_out, Tensor(a5!) indices_out, float routed_scaling_factor) -> ()""")


def test_pack_kv():
    assert_expected_inline(_schema("pack_kv"), """dsv4::pack_kv(Tensor x, Tensor slots, Tensor(a2!) cache, str fmt) -> ()""")


def test_unpack_kv():
    assert_expected_inline(_schema("unpack_kv"), """dsv4::unpack_kv(Tensor cache, Tensor slots, Tensor(a2!) out, str fmt) -> ()""")


def test_qkv_prep():
    assert_expected_inline(_schema("qkv_prep"), """dsv4::qkv_prep(Tensor q, Tensor kv, Tensor positions, Tensor req_slots, Tensor inv_freq, Tensor(a5!) q_out, Tensor(a6!) window_cache, SymInt ring_size, float eps, bool q_norm, str window_fmt) -> ()""")


def test_compressor_update():
    assert_expected_inline(_schema("compressor_update"), """dsv4::compressor_update(Tensor kv, Tensor score, Tensor ape, Tensor positions, Tensor req_slots, Tensor entry_slots, Tensor norm_weight, Tensor inv_freq, Tensor(a8!) state, Tensor(a9!) cache, Tensor(a10!)? latent_out, float eps, str fmt, bool hadamard=False, bool batch_invariant=False) -> ()""")


def test_indexer_q_prep():
    assert_expected_inline(_schema("indexer_q_prep"), """dsv4::indexer_q_prep(Tensor q, Tensor weights, Tensor positions, Tensor inv_freq, Tensor(a4!) q_out, Tensor(a5!) w_out, str fmt, bool hadamard=False) -> ()""")


def test_indexer_k_prep():
    assert_expected_inline(_schema("indexer_k_prep"), """dsv4::indexer_k_prep(Tensor latent, Tensor positions, Tensor req_slots, Tensor entry_slots, Tensor wk, Tensor k_norm_weight, Tensor inv_freq, Tensor(a7!) cache, SymInt ratio, float eps, str fmt, bool batch_invariant=False) -> ()""")


def test_indexer_topk():
    assert_expected_inline(_schema("indexer_topk"), """dsv4::indexer_topk(Tensor q, Tensor weights, Tensor positions, Tensor req_slots, Tensor cache, Tensor block_table, Tensor? cand, Tensor(a7!) idx_out, Tensor(a8!)? cand_out, Tensor(a9!) workspace, SymInt ratio, SymInt cand_block, str fmt) -> ()""")


def test_visible_entries():
    assert_expected_inline(_schema("visible_entries"), """dsv4::visible_entries(Tensor block_table, Tensor positions, Tensor req_slots, Tensor(a3!) out, SymInt ratio, SymInt block_size) -> ()""")


def test_sparse_attn():
    assert_expected_inline(_schema("sparse_attn"), """dsv4::sparse_attn(Tensor q, Tensor window_cache, Tensor comp_cache, Tensor positions, Tensor req_slots, Tensor comp_idx, Tensor comp_lens, Tensor? window_ends, Tensor sinks, Tensor(a9!) out, float scale, SymInt window, SymInt ring_size, str window_fmt, str comp_fmt, Tensor(a15!)? lse=None, bool batch_invariant=False) -> ()""")


def test_attn_merge():
    assert_expected_inline(_schema("attn_merge"), """dsv4::attn_merge(Tensor partials, Tensor lse, Tensor sinks, Tensor(a3!) out) -> ()""")


def test_fp8_linear():
    assert_expected_inline(_schema("fp8_linear"), """dsv4::fp8_linear(Tensor x, Tensor weight, Tensor scale, Tensor(a3!) out, SymInt block, SymInt groups=1, bool batch_invariant=False) -> ()""")


def test_fp8_linear_w8a8():
    assert_expected_inline(_schema("fp8_linear_w8a8"), """dsv4::fp8_linear_w8a8(Tensor x, Tensor weight, Tensor scale, Tensor(a3!) out, SymInt block) -> ()""")


def test_inv_rope():
    assert_expected_inline(_schema("inv_rope"), """dsv4::inv_rope(Tensor o, Tensor positions, Tensor inv_freq, Tensor(a3!) out) -> ()""")


def test_invariant_linear():
    assert_expected_inline(_schema("invariant_linear"), """dsv4::invariant_linear(Tensor x, Tensor weight, Tensor(a2!) out) -> ()""")
