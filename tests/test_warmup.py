"""dsv4ops.warmup: the op calls it makes for each layer kind, cache mode and parallel layout."""

import pytest
import torch
from interp import CFG

import dsv4ops


@pytest.mark.parametrize("parallel", [(1, 1), (2, 2)], ids=["one-gpu", "tp2-dcp2"])
@pytest.mark.parametrize("mode", ["fp8", "bf16", "fp4"])
def test_warmup_calls_every_op_of_every_layer_kind(mode, parallel, monkeypatch):
    # On CPU the ops run their reference kernels: this checks that every warmup call is a valid op
    # call (the CUDA run compiles through the same calls), and that it covers every op and bucket.
    from dsv4ops.cache import CacheConfig

    seen = []

    def spy(name, op):
        def call(*args):
            seen.append((name, args[1 if name == "unpack_kv" else 0].shape[0]))  # (op, tokens)
            return op(*args)

        return call

    for name in dsv4ops.backends.TRITON_LAUNCHERS:
        monkeypatch.setattr(torch.ops.dsv4, name, spy(name, getattr(torch.ops.dsv4, name)))
    formats = {"bf16": dsv4ops.CacheFormats.exact(), "fp8": dsv4ops.CacheFormats.v4(),
               "fp4": dsv4ops.CacheFormats("fp8_584", "fp4_288", "mxfp4_68")}[mode]
    cache_cfg = CacheConfig(max_requests=2, max_context=256, max_step_tokens=4, formats=formats)
    fp8_block = 128 if mode == "fp8" else None  # layers loaded with keep_fp8=True: fp8_linear too
    tp, dcp = parallel  # a rank's heads under tensor parallelism; the partial and merge of context parallelism
    calls = dsv4ops.warmup(CFG, cache_cfg, "cpu", fp8_block=fp8_block, tp=tp, dcp=dcp)
    assert calls == len(seen)
    # Every op a V4 layer calls: all but V4.1's key writer (warmup takes V4 configurations), attn_merge
    # only for a context-parallel cache, and fp8_linear_w8a8 only where rule.pick chooses it: never
    # without a GPU (test_warmup_runs_w8a8_...).
    skipped = ({"indexer_k_prep", "fp8_linear_w8a8", "invariant_linear"} | (set() if fp8_block else {"fp8_linear"})
               | ({"attn_merge"} if dcp == 1 else set()))
    assert {n for n, _ in seen} == set(dsv4ops.backends.TRITON_LAUNCHERS) - skipped
    assert {t for _, t in seen} == set(cache_cfg.buckets)


def test_warmup_runs_w8a8_where_the_rule_picks_it(monkeypatch):
    # An sm_90 capability and a rule that switches between the two buckets: W8A8 at the larger one
    # only, for every projection.
    from dsv4ops.cache import CacheConfig
    from dsv4ops.fp8_linear import rule

    cfg = dsv4ops.DSV4AttentionConfig.tiny(hidden_size=512, q_lora_rank=512, o_lora_rank=256)
    cache_cfg = CacheConfig(max_requests=2, max_context=256, max_step_tokens=4, buckets=(1, 4))
    monkeypatch.setattr(rule, "serving_capability", lambda device: (9, 0))
    monkeypatch.setattr(rule, "W8A8_FROM", {})
    monkeypatch.setattr(rule, "DEFAULT_W8A8_FROM", 4)
    seen = []
    real = torch.ops.dsv4.fp8_linear_w8a8

    def spy(*args):
        seen.append((args[0].shape[0], tuple(args[1].shape)))
        return real(*args)

    monkeypatch.setattr(torch.ops.dsv4, "fp8_linear_w8a8", spy)
    dsv4ops.warmup(cfg, cache_cfg, "cpu", fp8_block=128)
    # q_b (heads x 512, 512); q_a, kv, o_b and the indexer's q_b are all (512, 512) here
    assert {t for t, _ in seen} == {4} and {s for _, s in seen} == {(2048, 512), (512, 512)}


def test_warmup_of_a_batch_invariant_cache_runs_every_invariant_gemm_shape(monkeypatch):
    # The shapes come from the layers themselves: each kind's packed x projection, q_b, o_a a group,
    # o_b and the indexer's q_b; fp8_linear in its invariant launch, never W8A8.
    from dsv4ops.cache import CacheConfig

    seen, fp8 = set(), []
    real, real8 = torch.ops.dsv4.invariant_linear, torch.ops.dsv4.fp8_linear
    monkeypatch.setattr(torch.ops.dsv4, "invariant_linear", lambda x, w, out: (
        seen.add((*w.shape, out.dtype == torch.float32)), real(x, w, out)))
    monkeypatch.setattr(torch.ops.dsv4, "fp8_linear", lambda *a: (fp8.append(a[5:]), real8(*a)))
    cache_cfg = CacheConfig(max_requests=2, max_context=256, max_step_tokens=4, batch_invariant=True)
    dsv4ops.warmup(CFG, cache_cfg, "cpu", fp8_block=128)
    want = set()
    for i in range(CFG.num_layers):
        layer = dsv4ops.DeepseekV4Attention(CFG, i)
        want.add((*layer.x_packed.shape, layer.compressor is not None))
        want |= {(*layer.q_b_proj.weight.shape, False), (*layer.o_b_proj.weight.shape, False),
                 (CFG.o_lora_rank, layer.o_a_proj.weight.shape[1], False)}
        if layer.compressor is not None and hasattr(layer.compressor, "indexer"):
            want.add((*layer.compressor.indexer.q_b_proj.weight.shape, False))
    assert seen == want
    assert fp8 and all(a == (1, True) or a == (CFG.o_groups, True) for a in fp8)


@pytest.mark.parametrize("invariant", [False, True])
def test_warmup_runs_the_compressor_and_sparse_attn_in_the_cache_mode(invariant, monkeypatch):
    # A batch-invariant cache's layers pool V4's HCA entries in one plan for every step size
    # (compressor/triton.py pool_plan), and split a query's keys by its list's static width (Triton's
    # split count is a constexpr): warmup compiles those launches, not the per-size ones.
    from dsv4ops.cache import CacheConfig

    seen, attn = [], []
    real, real_attn = torch.ops.dsv4.compressor_update, torch.ops.dsv4.sparse_attn
    monkeypatch.setattr(torch.ops.dsv4, "compressor_update", lambda *a: (seen.append(a[14:]), real(*a)))
    monkeypatch.setattr(torch.ops.dsv4, "sparse_attn", lambda *a: (attn.append(a[16:] or (False,)), real_attn(*a)))
    cache_cfg = CacheConfig(max_requests=2, max_context=256, max_step_tokens=4, batch_invariant=invariant)
    dsv4ops.warmup(CFG, cache_cfg, "cpu")
    assert seen and set(seen) == {(invariant,)}
    assert attn and set(attn) == {(invariant,)}
