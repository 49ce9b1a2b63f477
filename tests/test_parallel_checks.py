"""Bad use of tensor and decode context parallelism on 2 gloo processes (CPU), issue 55: ranks whose
model configs differ raise a clear error on every rank before any collective whose shape depends
on them; a rank that plans a context-parallel step, or calls a tensor-parallel forward, that the
other rank does not fails within dsv4ops.parallel.agreement.timeout_s, naming the call, with
nothing changed in any rank's cache."""

import time

import pytest
import torch
import torch.distributed as dist

import multiproc
from dsv4ops import CacheFormats, DeepseekV4Attention, DSV4AttentionConfig, testing
from dsv4ops.cache import CacheConfig, KVCacheManager
from dsv4ops.parallel import agreement

CFG = DSV4AttentionConfig.tiny(hca_ratio=16, compress_ratios=(0, 4, 16, 4), index_topk=8)
# What one rank's config differs in: the top-k width (the DCP merge's all-gather shape; TP's
# selection), and the query heads (the all-gathered attention rows; TP's split).
OTHER = {"index_topk": 4, "num_heads": 8}
TIMEOUT_S = 2.0  # the divergent-call tests' bound; each waits for it once


def _cache():
    return CacheConfig(formats=CacheFormats.exact(), exact_dtype=torch.float32, max_requests=2, max_context=160,
                       max_step_tokens=96, block_size=4)


def _mine(rank, field):
    return CFG if rank == 0 else CFG.replace(**{field: OTHER[field]})


def _raises_config(field, fn):
    want = f"{field}: rank 0 {getattr(CFG, field)}, rank 1 {OTHER[field]}"
    with pytest.raises(RuntimeError, match=r"the ranks of the .* group disagree \(.*" + want):
        fn()


def _snapshot(manager, cache):
    """The manager's requests, blocks and open step; the cache's pools and compressor states (a slot's
    generation moves on at an abort, by design)."""
    return (dict(manager.length), dict(manager.slot_of), {k: list(a.free) for k, a in manager.allocators.items()},
            {k: t.clone() for k, t in manager.tables.items()}, manager.open_step,
            {k: getattr(cache, k).clone() for k in [*cache.fmt, *(name for name, *_ in cache.state_rings)]})


def _same(a, b) -> bool:
    tensors = all(torch.equal(a[3][k], b[3][k]) for k in a[3]) and \
        all(torch.equal(x, b[5][k]) or (x.isnan() == b[5][k].isnan()).all() and
            torch.equal(x.nan_to_num(), b[5][k].nan_to_num()) for k, x in a[5].items())
    return a[:3] == b[:3] and a[4] is b[4] and tensors


# ---- configs that differ ---------------------------------------------------------------------------
def _config_body(rank, group):
    for field in sorted(OTHER):
        cfg = _mine(rank, field)
        # Context parallel. A manager built for another config on one rank: its constructor raises on
        # every rank. The managers agree, one rank's layer does not: attach_cache raises on every rank.
        _raises_config(field, lambda: KVCacheManager(cfg, _cache(), dcp_group=group))
        manager = KVCacheManager(CFG, _cache(), dcp_group=group)
        layer = DeepseekV4Attention(cfg, 1)
        _raises_config(field, lambda: layer.attach_cache(manager))
        assert not hasattr(layer, "cache")
        # Tensor parallel. Stateless: the forward raises before its all-reduce. Serving: attach_cache
        # raises (and leaves the layer without a cache).
        layer = DeepseekV4Attention(cfg, 1, process_group=group)
        _raises_config(field, lambda: layer(torch.zeros(1, 5, cfg.hidden_size)))
        _raises_config(field, lambda: layer.attach_cache(KVCacheManager(cfg, _cache())))
        assert not hasattr(layer, "cache")
    return True


def test_ranks_with_other_configs_fail_clearly():
    assert multiproc.run(_config_body) == [True, True]


# ---- a call that only one rank makes -------------------------------------------------------------------
def _first_step(layer, manager):
    manager.admit("a")
    with torch.no_grad(), manager.step({"a": 40}) as step:
        layer(torch.randn(step.positions.shape[0], CFG.hidden_size), step)


def _dcp_extra_step(rank, group):
    manager = KVCacheManager(CFG, _cache(), dcp_group=group)
    layer = testing.randomize_(DeepseekV4Attention(CFG, 1), seed=1)
    layer.attach_cache(manager)
    _first_step(layer, manager)
    before = _snapshot(manager, layer.cache)
    if rank == 1:  # rank 1 plans a step rank 0 does not
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"prepare_step: rank 1 of the context-parallel group waited 2 s "
                                               r"\(dsv4ops.parallel.agreement.timeout_s\) for the other ranks' "
                                               r"prepare_step"):
            manager.prepare_step({"a": 1})
        assert time.monotonic() - start < 10 * TIMEOUT_S
    dist.barrier(group)
    if rank == 0:  # its next step: the check's group was closed by rank 1's timeout
        with pytest.raises(RuntimeError, match=r"prepare_step: rank 0 could not check that the context-parallel "
                                               r"group's ranks agree"):
            manager.prepare_step({"a": 1})
    assert _same(_snapshot(manager, layer.cache), before)


def _tp_extra_forward(rank, group):
    full = testing.randomize_(DeepseekV4Attention(CFG, 1), seed=1)
    layer = DeepseekV4Attention(CFG, 1, process_group=group)
    layer.load_state_dict(full.state_dict())
    manager = KVCacheManager(CFG, _cache())
    layer.attach_cache(manager)
    _first_step(layer, manager)
    before = _snapshot(manager, layer.cache)
    if rank == 1:  # rank 1 runs a forward rank 0 does not
        start = time.monotonic()
        with pytest.raises(RuntimeError, match=r"DeepseekV4Attention\(layer 1\)\.forward: rank 1 of the "
                                               r"tensor-parallel group waited 2 s"):
            with torch.no_grad(), manager.step({"a": 1}) as step:
                layer(torch.randn(1, CFG.hidden_size), step)
        assert time.monotonic() - start < 10 * TIMEOUT_S
    dist.barrier()
    assert _same(_snapshot(manager, layer.cache), before)


def _extra_call_body(rank, group):
    agreement.timeout_s = TIMEOUT_S
    _dcp_extra_step(rank, group)
    # A group of its own: a timeout closes the side group of the group it happened on.
    _tp_extra_forward(rank, dist.new_group([0, 1]))
    return True


def test_a_call_only_one_rank_makes_fails_in_bounded_time():
    assert multiproc.run(_extra_call_body) == [True, True]


def test_the_timeout_must_be_a_positive_number(monkeypatch):
    monkeypatch.setattr(agreement, "timeout_s", 0)
    with pytest.raises(ValueError, match=r"dsv4ops.parallel.agreement.timeout_s: expected a positive number of "
                                         r"seconds, got 0"):
        agreement.timeout()
