"""The serving path: paged cache + step planner + the layer's forward(x, step). Issue: paged KV cache
and the serving step."""

import dataclasses
import random

import drivers
import pytest
import torch

from dsv4ops import CacheFormats, DeepseekV4Attention, DSV4AttentionConfig, reference, testing
from dsv4ops.cache.config import CacheConfig, layer_pools, memory
from dsv4ops.cache.manager import CacheFullError, KVCacheManager
from dsv4ops.config import CSA, HCA, SLIDING

# index_topk >= the entries of the longest request (260 // 4 = 65): the CSA selection keeps every
# visible entry, so equality does not hinge on near-ties (selection is tested in test_indexer).
CFG = DSV4AttentionConfig.tiny(index_topk=128)
LAYER = {SLIDING: 0, CSA: 1, HCA: 2}
# Lengths: 260 crosses 127 and 255 (mod 128) and 3 mod 4 many times; 131 crosses 127 once; 9 is
# inside the first CSA windows only.
LENGTHS = {"a": 260, "b": 131, "c": 9}
MODES = {"bf16": CacheFormats.exact(), "fp8": CacheFormats.v4()}


def _setup(kind, mode, max_step_tokens=400, seed=0, device="cpu", dtype=torch.float32, cfg=CFG, **capacity):
    li = LAYER[kind]
    fmts = MODES[mode]
    layer = testing.randomize_(DeepseekV4Attention(cfg, li, formats=fmts), seed=li).to(device, dtype)
    cache_cfg = CacheConfig(
        max_requests=4, max_context=272, max_step_tokens=max_step_tokens, formats=fmts, exact_dtype=torch.float32,
        **capacity,
    )
    manager = KVCacheManager(cfg, cache_cfg, device=device)
    layer.attach_cache(manager)
    g = torch.Generator().manual_seed(seed)
    inputs = {rid: torch.randn(n, cfg.hidden_size, generator=g).to(device, dtype) for rid, n in LENGTHS.items()}
    return layer, manager, inputs


def _check_against_stateless(layer, inputs, outs, mode):
    """Each request's outputs against the fp64 oracle; budget: the oracle's fp32 run and, in FP8
    modes, its rounding twins (a chunked or decode schedule computes the values it quantizes in
    another summation order, so a value at a bf16 / e4m3 boundary may round the other way)."""
    params = {k: v.detach() for k, v in layer.named_parameters()}
    p64 = {k: v.double() for k, v in params.items()}
    for rid, x in inputs.items():
        with torch.no_grad():
            ref32 = reference.attention(params, CFG, layer.layer_idx, x[None], layer.numerics)[0]
            run64 = lambda: reference.attention(p64, CFG, layer.layer_idx, x[None].double(), layer.numerics)[0]  # noqa: E731
            ref64 = run64()
            twins = testing.rounding_twins(run64) if mode == "fp8" else []
        testing.assert_close_to_ref(outs[rid], ref64, [ref32, *twins], what=f"request {rid}")


def _one_shot():
    return [dict(LENGTHS)]


def _random_chunks(seed: int):
    """Interleaved chunks of 1..150 tokens (> 8 and > 128 occur), requests joining in random order."""
    rng = random.Random(seed)
    left = dict(LENGTHS)
    steps = []
    while any(left.values()):
        active = [rid for rid, n in left.items() if n and rng.random() < 0.8] or [rid for rid, n in left.items() if n]
        rng.shuffle(active)
        step = {}
        for rid in active:
            step[rid] = min(left[rid], rng.choice([1, 3, 5, 9, 17, 64, 129, 150]))
            left[rid] -= step[rid]
        steps.append(step)
    return steps


SCHEDULES = {
    "one_shot": _one_shot,
    "chunked": lambda: _random_chunks(1),
    # token-by-token decode through t = 127 and 255, after a short prefill (the CSA boundaries
    # t = 3 mod 4 are crossed every 4 steps).
    "decode": lambda: drivers.decode_after(LENGTHS, 100),
}


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("kind", [SLIDING, CSA, HCA])
def test_serving_equals_stateless(kind, mode, schedule):
    layer, manager, inputs = _setup(kind, mode)
    with torch.no_grad():
        outs = drivers.serve_schedule(layer, manager, inputs, SCHEDULES[schedule]())
    _check_against_stateless(layer, inputs, outs, mode)


# ---- real selection: the indexer picks index_topk = 8 of up to 65 visible entries --------------------
SELECTING = DSV4AttentionConfig.tiny(index_topk=8)


@pytest.mark.parametrize("schedule, compiled", [("chunked", False), ("decode", False), ("chunked", True)],
                         ids=["chunked", "decode", "chunked-compiled"])  # compiled decode: CI time
@pytest.mark.parametrize("mode", sorted(MODES))
def test_serving_with_real_selection_equals_the_oracle(mode, schedule, compiled):
    """Chunked prefill or token-by-token decode, after a request that released its slot (so "a"
    reuses slot 0 and its blocks), with the indexer selecting 8 of up to 65 entries: each token's
    selection is a top-8 of the oracle's scores (up to rounding), and each output equals the oracle
    fed that selection. The indexer's compressor state carries across steps, so a lost or wiped
    state row changes the selection."""
    torch._dynamo.reset()
    layer, manager, inputs = _setup(CSA, mode, cfg=SELECTING)
    fn = torch.compile(layer, backend="aot_eager", fullgraph=True) if compiled else layer
    with torch.no_grad():
        drivers.serve_schedule(fn, manager, {"c": inputs["c"]}, [{"c": 9}])
        manager.release("c")
        sel = {}
        outs = drivers.serve_schedule(fn, manager, {r: inputs[r] for r in ("a", "b")},
                                      [{r: n for r, n in step.items() if r != "c"} for step in SCHEDULES[schedule]()
                                       if set(step) - {"c"}], selections=sel)
    assert manager.slot_of["a"] == 0  # c's released slot, reused
    for rid in ("a", "b"):
        testing.assert_matches_oracle(layer, inputs[rid], outs[rid], sel[rid], what=f"request {rid}")


def _pool_bytes(layer):
    """Every pool and state of the layer's cache, as bytes (not the slot generations, bookkeeping,
    nor the indexer's top-k scratch, which holds no state)."""
    return {name: buf.clone().view(torch.uint8) for name, buf in layer.cache.named_buffers()
            if name not in ("generations", "ran_step", "topk_workspace")}


@pytest.mark.parametrize("kind", [CSA, HCA])
def test_padding_tokens_change_nothing(kind):
    """Every step padded to 400 tokens; padding rows zero vs random rows at random positions: the
    real tokens' outputs and every pool are identical to the bit (same GEMM shapes, so any
    difference is a padding token reading or writing)."""
    steps = _random_chunks(2)
    runs = []
    for garbage in (None, torch.Generator().manual_seed(7)):
        layer, manager, inputs = _setup(kind, "fp8", buckets=(400,))
        with torch.no_grad():
            outs = drivers.serve_schedule(layer, manager, inputs, steps, garbage=garbage)
        runs.append((outs, _pool_bytes(layer)))
    (o1, p1), (o2, p2) = runs
    for rid in LENGTHS:
        assert torch.equal(o1[rid], o2[rid]), rid
    for name in p1:
        assert torch.equal(p1[name], p2[name]), name


@pytest.mark.parametrize("kind", [CSA, HCA])
def test_released_slot_leaks_nothing(kind):
    layer, manager, inputs = _setup(kind, "fp8")
    with torch.no_grad():
        first = drivers.serve_schedule(layer, manager, {"a": inputs["a"]}, [{"a": 200}])
        slot, blocks = manager.slot_of["a"], manager.tables[kind][manager.slot_of["a"]].clone()
        manager.release("a")
        outs = drivers.serve_schedule(layer, manager, {"b": inputs["b"]}, [{"b": 50}, {"b": 81}])
    assert manager.slot_of["b"] == slot  # the slot and its first blocks were reused
    assert torch.equal(manager.tables[kind][slot][: (131 // CFG.compress_ratio(LAYER[kind]) + 63) // 64],
                       blocks[: (131 // CFG.compress_ratio(LAYER[kind]) + 63) // 64])
    assert first["a"].shape[0] == 200
    _check_against_stateless(layer, {"b": inputs["b"]}, outs, "fp8")


# ---- capacity and bad input: raised by prepare_step / admit before any kernel, nothing changes --
def _snapshot(manager, layer):
    return (
        {k: t.clone() for k, t in manager.tables.items()},
        dict(manager.length), dict(manager.slot_of), list(manager.free_slots),
        {k: list(a.free) for k, a in manager.allocators.items()},
        _pool_bytes(layer),
    )


def _assert_same(a, b):
    tables, length, slots, free, blocks, pools = a
    tables2, length2, slots2, free2, blocks2, pools2 = b
    assert all(torch.equal(tables[k], tables2[k]) for k in tables)
    assert (length, slots, free, blocks) == (length2, slots2, free2, blocks2)
    assert all(torch.equal(pools[k], pools2[k]) for k in pools)


@pytest.mark.parametrize(
    "bad, error, match",
    [
        ({"zz": 1}, KeyError, "request_id: 'zz' is not admitted"),
        ({"a": 0}, ValueError, r"new_tokens\['a'\]: expected >= 1 token, got 0"),
        ({"a": 200, "b": 201}, ValueError, "new_tokens: 401 tokens pass max_step_tokens 400"),
        ({"a": 273}, ValueError, r"new_tokens\['a'\]: expected <= 272 tokens per request per step"),
        ({"b": 300}, ValueError, r"new_tokens\['b'\]: expected <= 272 tokens"),
    ],
)
def test_prepare_step_rejects_bad_steps_and_changes_nothing(bad, error, match):
    layer, manager, inputs = _setup(CSA, "fp8", max_request_step_tokens=272)
    with torch.no_grad():
        drivers.serve_schedule(layer, manager, {"a": inputs["a"][:10], "b": inputs["b"][:5]}, [{"a": 10, "b": 5}])
    before = _snapshot(manager, layer)
    with pytest.raises(error, match=match):
        manager.prepare_step(bad)
    _assert_same(before, _snapshot(manager, layer))


def test_position_beyond_max_context_is_rejected():
    layer, manager, inputs = _setup(HCA, "fp8")
    with torch.no_grad():
        drivers.serve_schedule(layer, manager, {"a": inputs["a"]}, [{"a": 260}])
    before = _snapshot(manager, layer)
    with pytest.raises(ValueError, match=r"new_tokens\['a'\]: positions 260..272 pass max_context 272"):
        manager.prepare_step({"a": 13})
    _assert_same(before, _snapshot(manager, layer))


def test_full_cache_and_released_requests_are_rejected():
    # max_total_tokens 256 -> 1 block of 64 CSA entries + 1 partial block per request slot = 5 blocks.
    layer, manager, inputs = _setup(CSA, "fp8", max_total_tokens=256)
    blocks = len(manager.allocators[CSA].free)
    with torch.no_grad():
        drivers.serve_schedule(layer, manager, {"a": inputs["a"]}, [{"a": 260}])
    manager.admit("b")
    manager.admit("c")
    manager.admit("d")
    with pytest.raises(CacheFullError, match="admit: all 4 request slots are in use"):
        manager.admit("e")
    taken = blocks - len(manager.allocators[CSA].free)
    assert taken == 2  # 65 entries of request a
    for rid in ("b", "c", "d"):  # 64 entries = 1 block each: all 5 blocks taken
        drivers.serve_schedule(layer, manager, {rid: inputs["a"]}, [{rid: 256}])
    assert not manager.allocators[CSA].free
    before = _snapshot(manager, layer)
    with pytest.raises(CacheFullError, match=f"prepare_step: the {CSA} pool needs 1 more blocks, 0 are free"):
        manager.prepare_step({"d": 4})  # entry 64 opens a second block for d
    _assert_same(before, _snapshot(manager, layer))
    manager.abort(manager.prepare_step({"d": 3}))  # still inside d's first block: planned
    manager.release("d")
    with pytest.raises(KeyError, match="request_id: 'd' is not admitted"):
        manager.prepare_step({"d": 1})
    with pytest.raises(KeyError, match="request_id: 'd' is not admitted"):
        manager.release("d")


def test_pools_are_non_persistent_buffers_and_weights_still_load():
    layer, manager, _ = _setup(CSA, "fp8")
    names = {n for n, _ in layer.named_buffers()}
    assert {"cache.window", "cache.comp", "cache.state", "cache.index", "cache.index_state"} <= names
    fresh = DeepseekV4Attention(CFG, 1, formats=MODES["fp8"])
    fresh.load_state_dict(layer.state_dict(), strict=True)
    assert not any(k.startswith("cache.") for k in layer.state_dict())


def test_memory_accounting_matches_the_allocated_pools():
    cfg = CacheConfig(max_requests=2, max_context=1024, max_step_tokens=64)
    model = DSV4AttentionConfig.tiny()
    acc = memory(model, cfg)
    total = sum(spec.nbytes for li in range(model.num_layers) for spec in layer_pools(model, li, cfg))
    # Pools hold 2 x 1024 tokens of growth plus the fixed part per request; each compressed pool adds
    # one partial block per request and the rounding of the total up to whole blocks (<= 3 blocks).
    expected = acc["fixed_bytes_per_request"] * 2 + acc["bytes_per_token"] * 2048
    slack = sum(3 * spec.nbytes // spec.shape[0] for li in range(model.num_layers)
                for spec in layer_pools(model, li, cfg) if spec.name in ("comp", "index"))
    assert expected <= total <= expected + slack + 1
    flash = memory(DSV4AttentionConfig.flash(), CacheConfig(max_requests=1, max_context=1 << 20, max_step_tokens=1))
    # Spec 5.5: 3850 B/token for Flash with FP8 indexer keys (584-B entries; we count the 1-B page pad).
    assert abs(flash["bytes_per_token"] - 3850) < 0.01 * 3850


# ---- clear errors (issue 10) --------------------------------------------------------------------
@pytest.mark.parametrize(
    "bad, error, match",
    [
        ({"a": 1.5}, TypeError, r"new_tokens\['a'\]: expected an int token count, got float 1.5"),
        ({"a": "3"}, TypeError, r"new_tokens\['a'\]: expected an int token count, got str '3'"),
        ({"a": True}, TypeError, r"new_tokens\['a'\]: expected an int token count, got bool True"),
        (["a"], TypeError, r"new_tokens: expected a mapping \{request_id: token count\}, got list"),
        ({}, ValueError, r"new_tokens: expected at least one request, got an empty mapping"),
    ],
    ids=["float", "str", "bool", "list", "empty"],
)
def test_prepare_step_rejects_bad_token_counts(bad, error, match):
    _, manager, _ = _setup(CSA, "bf16")
    manager.admit("a")
    with pytest.raises(error, match=match):
        manager.prepare_step(bad)
    assert manager.open_step is None and manager.length == {"a": 0}


def test_serving_forward_needs_an_attached_cache():
    layer = DeepseekV4Attention(CFG, 1)
    manager = KVCacheManager(CFG, CacheConfig(max_requests=1, max_context=16, max_step_tokens=8,
                                              formats=CacheFormats.exact()))
    manager.admit(0)
    with pytest.raises(RuntimeError, match=r"DeepseekV4Attention\(layer 1\): no cache attached; call "
                                           r"layer.attach_cache\(manager\)"), manager.step({0: 8}) as step:
        layer(torch.randn(8, CFG.hidden_size), step)


def test_a_layer_and_a_cache_with_every_default_attach_and_serve():
    """Issue 52: every default was refused ("cache modes kv='fp8' ... the layer computes
    Numerics(kv='exact')"). Both default to CacheFormats.v4(), the serving cache's FP8 formats."""
    layer = testing.randomize_(DeepseekV4Attention(CFG, 1), seed=1)
    manager = KVCacheManager(CFG, CacheConfig(max_requests=1, max_context=16, max_step_tokens=8))
    layer.attach_cache(manager)
    assert layer.formats == manager.cfg.formats == CacheFormats.v4()
    assert layer.cache.fmt == {"window": "fp8_584", "comp": "fp8_584", "state": "", "index": "fp8_132",
                               "index_state": ""}
    manager.admit(0)
    with torch.no_grad(), manager.step({0: 8}) as step:
        y = layer(torch.randn(step.positions.shape[0], CFG.hidden_size), step)
    assert torch.isfinite(y).all()


def test_explicit_formats_that_differ_from_the_cache_are_refused():
    manager = KVCacheManager(CFG, CacheConfig(max_requests=1, max_context=16, max_step_tokens=8))
    layer = DeepseekV4Attention(CFG, 1, formats=CacheFormats.exact())
    with pytest.raises(ValueError, match=r"manager: its pools hold CacheFormats\(window='fp8_584', comp='fp8_584', "
                                         r"index='fp8_132'\), the layer computes CacheFormats\(window='exact', "
                                         r"comp='exact', index='exact'\) \(build the layer with "
                                         r"formats=manager.cfg.formats, or with none to take the cache's\)"):
        layer.attach_cache(manager)
    assert not hasattr(layer, "cache") and not list(manager._caches)


def test_a_layer_without_formats_takes_its_first_caches():
    """Built without formats, a layer computes exact (transformers') until it attaches and takes the
    formats of the first cache it attaches to (its weights stay as they are: the compressors' in the
    model dtype in every format). Then its formats are fixed: another cache's are refused."""
    layer = DeepseekV4Attention(CFG, 1).to(torch.bfloat16)
    assert layer.formats == CacheFormats.exact() and layer.follows_cache
    dtypes = {n: t.dtype for n, t in layer.named_parameters()}
    v4 = CacheConfig(max_requests=1, max_context=16, max_step_tokens=8, formats=CacheFormats.v4(),
                     exact_dtype=torch.bfloat16)
    layer.attach_cache(KVCacheManager(CFG, v4))
    assert layer.formats == CacheFormats.v4() and layer.numerics == reference.Numerics("fp8", "fp8")
    assert {n: t.dtype for n, t in layer.named_parameters()} == dtypes
    with pytest.raises(ValueError, match=r"manager: its pools hold CacheFormats\(window='exact'"):
        layer.attach_cache(KVCacheManager(CFG, dataclasses.replace(v4, formats=CacheFormats.exact())))


def test_v4_refuses_formats_it_cannot_hold_and_the_old_spellings():
    match = (r"formats: a V4 cache holds \(window, comp\) in .*, got \('fp8_528', 'fp4_288'\) \(V4.1's formats "
             r"need a V4.1 stack\)")
    with pytest.raises(ValueError, match=match):
        DeepseekV4Attention(CFG, 1, formats=CacheFormats.v41())
    with pytest.raises(ValueError, match=match):
        KVCacheManager(CFG, CacheConfig(max_requests=1, max_context=16, max_step_tokens=8, formats=CacheFormats.v41()))
    replaced = r"DeepseekV4Attention: numerics was replaced by formats=dsv4ops.CacheFormats\(window=..., comp=..., "
    with pytest.raises(TypeError, match=replaced):
        DeepseekV4Attention(CFG, 1, numerics=CacheFormats.v4())
    with pytest.raises(TypeError, match=replaced):
        DeepseekV4Attention(CFG, 1, reference.Numerics("fp8", "fp8"))
    with pytest.raises(ImportError, match=r"dsv4ops.Numerics was replaced by dsv4ops.CacheFormats"):
        from dsv4ops import Numerics  # noqa: F401


def test_attach_cache_is_refused_while_requests_hold_tokens():
    """Issue 32: a layer attached while the manager's requests held tokens got empty (NaN-poisoned)
    pools for them and returned NaN. Refused, with the layer and the manager left as they were,
    while a step is open or an admitted request holds tokens; a request admitted but not yet run, or
    released, does not stand in the way."""
    layer, manager, inputs = _setup(CSA, "bf16")
    late = DeepseekV4Attention(CFG, 2)
    manager.admit("a")
    with torch.no_grad():
        with manager.step({"a": 40}) as step:
            layer(torch.cat([inputs["a"][:40], inputs["a"].new_zeros(step.positions.shape[0] - 40, CFG.hidden_size)]),
                  step)
            with pytest.raises(RuntimeError, match=r"attach_cache: step \d+ is still open \(requests \['a'\]\)"):
                late.attach_cache(manager)
        with pytest.raises(RuntimeError, match=r"attach_cache: 1 admitted request\(s\) already hold tokens \(e\.g\. "
                                               r"'a': 40\), which the new layer's pools would not have; attach every "
                                               r"layer before the first step, or release those requests first"):
            late.attach_cache(manager)
    assert not hasattr(late, "cache") and set(manager._caches) == {layer.cache}
    manager.admit("b")  # no tokens yet: not in the way
    manager.release("a")
    late.attach_cache(manager)
    assert set(manager._caches) == {layer.cache, late.cache}


def test_attach_cache_is_refused_after_a_single_token():
    """The boundary of the refusal above: one committed token is already a row the new layer's
    pools would not have (a request with none is not in the way)."""
    layer, manager, inputs = _setup(SLIDING, "bf16")
    late = DeepseekV4Attention(CFG, 2)
    manager.admit("a")
    manager.admit("b")
    with torch.no_grad(), manager.step({"a": 1}) as step:
        layer(torch.cat([inputs["a"][:1], inputs["a"].new_zeros(step.positions.shape[0] - 1, CFG.hidden_size)]), step)
    with pytest.raises(RuntimeError, match=r"attach_cache: 1 admitted request\(s\) already hold tokens \(e\.g\. "
                                           r"'a': 1\)"):
        late.attach_cache(manager)
    assert not hasattr(late, "cache") and set(manager._caches) == {layer.cache}


@pytest.mark.parametrize(
    "model, match",
    [
        (DSV4AttentionConfig.tiny(compress_ratios=(0, 0, 0, 0)),
         r"manager: built for a model with compress_ratios \(0, 0, 0, 0\), the layer's config has \(0, 4, 128, 4\)"),
        (DSV4AttentionConfig.tiny(window=64), r"manager: built for a model with window 64, the layer's config has 128"),
    ],
    ids=["layer-types", "window"],
)
def test_attach_cache_rejects_a_manager_of_another_model(model, match):
    layer = DeepseekV4Attention(CFG, 1)
    manager = KVCacheManager(model, CacheConfig(max_requests=1, max_context=16, max_step_tokens=8,
                                                formats=CacheFormats.exact()))
    with pytest.raises(ValueError, match=match):
        layer.attach_cache(manager)
    with pytest.raises(TypeError, match=r"manager: expected a dsv4ops.cache.KVCacheManager, got CacheConfig"):
        layer.attach_cache(manager.cfg)


@pytest.mark.parametrize(
    "capacity, error, match",
    [
        (dict(max_total_tokens=-5), ValueError, r"max_total_tokens: expected >= 1, got -5"),
        (dict(buckets=(0, 8)), ValueError, r"buckets: expected token counts >= 1, got \(0, 8\)"),
        (dict(max_request_step_tokens=0), ValueError, r"max_request_step_tokens: expected >= 1, got 0"),
        (dict(max_context=16.0), TypeError, r"max_context: expected an int, got float 16.0"),
        (dict(exact_dtype=torch.int32), ValueError, r"exact_dtype: expected a float torch.dtype, got torch.int32"),
    ],
    ids=["max_total_tokens", "buckets", "max_request_step_tokens", "float-context", "exact_dtype"],
)
def test_cache_config_rejects_bad_capacity(capacity, error, match):
    base = dict(max_requests=2, max_context=16, max_step_tokens=8)
    with pytest.raises(error, match=match):
        CacheConfig(**(base | capacity))
