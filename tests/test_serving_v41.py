"""The V4.1 stack's serving path (V41CacheManager + the stack's forward(xs, step)) against the stateless
oracle dsv4ops.reference.v41: one-shot, chunked and decode schedules with mixed prefill / decode
steps, in exact and QAT formats, with real selection and a pruning candidate pool; padding, slot
reuse, bad steps, stale top-k, memory accounting. Issue 16.

Tie-aware (spec pitfall 18): the oracle is run with the serving path's own top-k and pool, and those
selections are checked against the oracle's fp64 scores within a band the data sets (twice the
score error of a low-precision oracle run). The error budget of the outputs: the fp32 oracle's
(exact formats) or the bf16 oracle's (QAT formats: FP4 / MX4 codes flip between any two
computations that differ by a rounding upstream)."""

import dataclasses
import random

import builders
import drivers
import pytest
import torch
from drivers_v41 import serve_schedule

from dsv4ops import CacheFormats, testing
from dsv4ops.cache.config import CacheConfig
from dsv4ops.cache.manager import CacheFullError, KVCacheManager
from dsv4ops.config import DSV4AttentionConfig
from dsv4ops.cache.v41 import V41CacheManager, memory, stack_pools
from dsv4ops.config_v41 import DSV41AttentionConfig
from dsv4ops.layers_v41 import STATELESS_BLOCK, DeepseekV41AttentionStack
from dsv4ops.quant import formats
from dsv4ops.reference.v41 import stack_attention
from dsv4ops.testing_v41 import check_pool, check_selection, slots_to_entries

CFG = DSV41AttentionConfig.tiny()
NUMERICS = {"exact": CacheFormats.exact(), "qat": CacheFormats.v41()}
# 96 > window 16, 96 / 2 = 48 > index_topk 8 (ratio 2), 96 > the 16-entry pool (ratio 1); 37 and 9
# end mid ratio-2 group and inside the first pool.
LENGTHS = {"a": 96, "b": 37, "c": 9}
BLOCK = 7  # odd: slots cross pages often; pages mxfp4_68 can pad (7 x 68 B in 512 B)


def _setup(mode, seed=0, max_step_tokens=160, **capacity):
    stack = testing.randomize_(DeepseekV41AttentionStack(CFG, NUMERICS[mode]), seed=seed)
    cache_cfg = CacheConfig(max_requests=4, max_context=112, max_step_tokens=max_step_tokens, block_size=BLOCK,
                            exact_dtype=torch.float32, formats=NUMERICS[mode], **capacity)
    manager = V41CacheManager(CFG, cache_cfg)
    stack.attach_cache(manager)
    g = torch.Generator().manual_seed(seed + 1)
    inputs = {rid: torch.randn(CFG.num_layers, n, CFG.hidden_size, generator=g) for rid, n in LENGTHS.items()}
    return stack, manager, inputs


def _check_against_oracle(stack, mode, inputs, outs, topk, pools):
    p32 = dict(stack.named_parameters())
    p64 = {k: v.double() for k, v in p32.items()}
    lowp_dtype = torch.float32 if mode == "exact" else torch.bfloat16
    plow = {k: v if k.endswith(("sinks", "norm.weight")) else v.to(lowp_dtype) for k, v in p32.items()}
    num = NUMERICS[mode]
    for rid, x in inputs.items():
        sel = {k: v[None] for k, v in topk[rid].items()}
        pool = {k: v[None] for k, v in pools[rid].items()}
        ref64 = stack_attention(p64, CFG, x[:, None].double(), num, sel, pool)
        low = stack_attention(plow, CFG, x[:, None].to(lowp_dtype), num, sel, pool)
        testing.assert_close_to_ref(outs[rid], ref64.y[:, 0], low.y[:, 0], what=f"{mode} request {rid}")
        for layer, picked in topk[rid].items():
            check_selection(picked, ref64.scores[layer][0], low.scores[layer][0], f"request {rid} layer {layer}")
        for layer, pk in pools[rid].items():
            # The source's scores: candidates are chosen from its unrestricted rows.
            check_pool(pk, ref64.scores[layer][0], low.scores[layer][0], CFG, f"request {rid} pool")


def _one_shot():
    return [dict(LENGTHS)]


def _random_chunks(seed: int):
    """Interleaved chunks of 1..40 tokens (odd and even ends of ratio-2 groups), requests joining in
    random order: steps mix prefill chunks and decode tokens."""
    rng = random.Random(seed)
    left = dict(LENGTHS)
    steps = []
    while any(left.values()):
        active = [rid for rid, n in left.items() if n and rng.random() < 0.8] or [rid for rid, n in left.items() if n]
        rng.shuffle(active)
        step = {}
        for rid in active:
            step[rid] = min(left[rid], rng.choice([1, 2, 3, 5, 8, 17, 40]))
            left[rid] -= step[rid]
        steps.append(step)
    return steps


SCHEDULES = {"one_shot": _one_shot, "chunked": lambda: _random_chunks(1), "decode": lambda: drivers.decode_after(LENGTHS, 70)}


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("mode", sorted(NUMERICS))
def test_serving_equals_the_stateless_oracle(mode, schedule):
    stack, manager, inputs = _setup(mode)
    with torch.no_grad():
        outs, topk, pools = serve_schedule(stack, manager, inputs, SCHEDULES[schedule]())
    assert set(topk["a"]) == {1, 3, 5, 7} and set(pools["a"]) == {5}
    _check_against_oracle(stack, mode, inputs, outs, topk, pools)


def test_stateless_forward_equals_the_oracle():
    stack, _, inputs = _setup("qat")
    xs = torch.stack([inputs["a"][:, :64], inputs["b"][:, :37].new_zeros(CFG.num_layers, 64, CFG.hidden_size)], 1)
    xs[:, 1, :37] = inputs["b"][:, :37]
    published = {}
    with torch.no_grad():
        ys = stack(xs, published=published)
    assert ys.shape == (CFG.num_layers, 2, 64, CFG.hidden_size)
    step = published["step"]
    for b, n in ((0, 64), (1, 64)):
        rows = slice(b * 64, b * 64 + n)
        topk = {L: slots_to_entries(published["topk", L][rows], step.block_table(CFG.role(L).ratio)[b],
                                    STATELESS_BLOCK) for L in (1, 3, 5, 7)}
        pools = {5: published["pool"][rows].long()}
        _check_against_oracle(stack, "qat", {"x": xs[:, b]}, {"x": ys[:, b]}, {"x": topk}, {"x": pools})


def test_the_candidate_pool_prunes_and_the_reindex_layer_picks_inside_it():
    stack, manager, inputs = _setup("exact")
    with torch.no_grad():
        _, topk, pools = serve_schedule(stack, manager, {"a": inputs["a"]}, [{"a": 96}])
    pool, reindex, source = pools["a"][5], topk["a"][7], topk["a"][5]
    cb = CFG.candidate_block_size
    for t in range(96):
        inside = {e for b in pool[t].tolist() if b >= 0 for e in range(b * cb, (b + 1) * cb) if e <= t}
        kept = min(-(-(t + 1) // cb), CFG.candidate_topk_blocks)  # spec 2.6.4: the newest block is partial
        assert len(inside) == cb * (kept - 1) + t % cb + 1
        assert set(reindex[t].tolist()) - {-1} <= inside
    # Beyond 16 tokens the pool leaves entries out; the source still picks its full top-8 over every
    # visible entry (pitfall 13), the reindex layer its top-8 inside the pool.
    late = range(40, 96)
    assert all(len(set(pool[t].tolist())) * cb < t + 1 for t in late)
    assert all(len(set(source[t].tolist()) - {-1}) == len(set(reindex[t].tolist()) - {-1}) == CFG.index_topk
               for t in late)


def _pool_bytes(stack):
    """Every pool and state of the stack's cache (not the slot generations, bookkeeping such as the
    block index, nor the indexers' scratch, which holds no state)."""
    return {name: buf.clone().view(torch.uint8) for name, buf in stack.cache.named_buffers()
            if name not in ("generations", "ran_step", "topk_workspace") and not name.startswith("block_index_")}


def test_padding_tokens_change_nothing():
    """Every step padded to 64 tokens; padding rows zero vs random rows at random positions: the
    tokens' outputs and every pool are identical to the bit (same GEMM shapes)."""
    steps = [{"c": 9, "a": 30, "b": 20}, {"a": 30, "b": 17}, {"a": 36}]
    runs = []
    for garbage in (None, torch.Generator().manual_seed(7)):
        stack, manager, inputs = _setup("qat", max_step_tokens=64, buckets=(64,))
        with torch.no_grad():
            outs, _, _ = serve_schedule(stack, manager, inputs, steps, garbage=garbage)
        runs.append((outs, _pool_bytes(stack)))
    (o1, p1), (o2, p2) = runs
    assert all(torch.equal(o1[rid], o2[rid]) for rid in LENGTHS)
    assert all(torch.equal(p1[name], p2[name]) for name in p1)


def test_released_slot_is_reused_and_leaks_nothing():
    stack, manager, inputs = _setup("exact")
    with torch.no_grad():
        serve_schedule(stack, manager, {"a": inputs["a"]}, [{"a": 60}])
        slot = manager.slot_of["a"]
        manager.release("a")
        outs, topk, pools = serve_schedule(stack, manager, {"b": inputs["b"]}, [{"b": 20}, {"b": 17}])
    assert manager.slot_of["b"] == slot
    _check_against_oracle(stack, "exact", {"b": inputs["b"]}, outs, topk, pools)


def test_a_reader_whose_source_has_not_run_raises():
    stack, manager, inputs = _setup("exact")
    manager.admit("a")
    step = manager.prepare_step({"a": 4})
    x = inputs["a"][:, :4]
    shared = {}
    with torch.no_grad(), pytest.raises(RuntimeError, match="layer 2 reads the top-k of index source 1, which has "
                                                            "not run in this step"):
        stack.layers[2](x[2], step, stack.cache, shared)
    with torch.no_grad(), pytest.raises(RuntimeError, match="layer 7 scores inside the candidate pool of layer 5"):
        stack.layers[7](x[7], step, stack.cache, shared)


# ---- the step lifecycle (KVCacheManager's, shared with V4: tests/test_step_lifecycle.py) --------
def _states(stack):
    return {name: getattr(stack.cache, name).clone() for name, *_ in stack.cache.state_rings}


def test_an_aborted_step_is_rolled_back_and_the_request_continues():
    """A 33-token chunk from position 21 wraps the ratio-2 sources' 2-row state rings while its
    first token's group still pools position 20 from before the step (so their rows are backed
    up); its forward writes every cache, then the step is aborted: states, tables and lengths are
    restored, and the same chunk again plus decode equals the oracle."""
    stack, manager, inputs = _setup("exact")
    x = inputs["a"][:, :60]
    with torch.no_grad():
        first = serve_schedule(stack, manager, {"a": x}, [{"a": 21}])
        states, tables = _states(stack), {k: t.clone() for k, t in manager.tables.items()}
        assert len(states) == 2  # the two ratio-2 sources
        step = manager.prepare_step({"a": 33})
        stack(torch.cat([x[:, 21:54], x.new_zeros(CFG.num_layers, step.positions.shape[0] - 33, CFG.hidden_size)], 1),
              step)
        assert any(not builders.bytes_equal(t, states[n]) for n, t in _states(stack).items())  # the forward wrote
        manager.abort(step)
        assert all(builders.bytes_equal(t, states[n]) for n, t in _states(stack).items())
        assert all(torch.equal(t, tables[k]) for k, t in manager.tables.items()) and manager.length["a"] == 21
        rest = serve_schedule(stack, manager, {"a": x[:, 21:]}, [{"a": 33}] + [{"a": 1}] * 6)
    outs = {"a": torch.cat([first[0]["a"], rest[0]["a"]], 1)}
    topk = {"a": {L: torch.cat([first[1]["a"][L], rest[1]["a"][L]]) for L in first[1]["a"]}}
    pools = {"a": {L: torch.cat([first[2]["a"][L], rest[2]["a"][L]]) for L in first[2]["a"]}}
    _check_against_oracle(stack, "exact", {"a": x}, outs, topk, pools)


def test_eager_forward_rejects_foreign_stale_and_closed_steps():
    stack, manager, _ = _setup("exact")
    other = V41CacheManager(CFG, dataclasses.replace(manager.cfg, formats=NUMERICS["exact"]))
    for m in (manager, other):
        m.admit("a")
    xs = torch.randn(CFG.num_layers, 8, CFG.hidden_size)
    before = _pool_bytes(stack)
    with torch.no_grad():
        with other.step({"a": 8}) as foreign, pytest.raises(ValueError, match=r"step: planned by \w+ \d+, but this"):
            stack(xs, foreign)
        step = manager.prepare_step({"a": 8})
        manager.release("a")
        with pytest.raises(ValueError, match=r"request 'a' \(slot 0\) was released or re-admitted"):
            stack(xs, step)
        manager.abort(step)
        manager.admit("a")
        # The refused forward ran nothing: the commit refuses the step and rolls it back (closed).
        with pytest.raises(RuntimeError, match=r"commit: step \d+ ran on 0 of the 1 attached layer caches"):
            with manager.step({"a": 8}) as step, pytest.raises(ValueError, match=r"expected 8 rows"):
                stack(xs[:, :7], step)
        with pytest.raises(ValueError, match=r"step: step \d+ is closed"):
            stack(xs, step)
    after = _pool_bytes(stack)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_compiled_forward_masks_a_stale_step():
    """Compiled, a stale step cannot raise (no sync): its tokens become padding on the device,
    nothing is written and every row is 0."""
    torch._dynamo.reset()
    stack, manager, _ = _setup("exact")
    manager.admit("a")
    compiled = torch.compile(stack, backend="aot_eager", fullgraph=True)
    step = manager.prepare_step({"a": 8})
    manager.release("a")
    before = _pool_bytes(stack)
    with torch.no_grad():
        y = compiled(torch.randn(CFG.num_layers, 8, CFG.hidden_size), step)
    after = _pool_bytes(stack)
    assert (y == 0).all() and all(torch.equal(before[k], after[k]) for k in before)
    manager.abort(step)


# ---- capacity and bad steps: raised before any kernel, nothing changes --------------------------
def _snapshot(manager, stack):
    return ({k: t.clone() for k, t in manager.tables.items()}, dict(manager.length), dict(manager.slot_of),
            {k: list(a.free) for k, a in manager.allocators.items()}, _pool_bytes(stack))


def _same(a, b):
    assert all(torch.equal(a[0][k], b[0][k]) for k in a[0]) and a[1:4] == b[1:4]
    assert all(torch.equal(a[4][k], b[4][k]) for k in a[4])


@pytest.mark.parametrize("bad, error, match", [
    ({"zz": 1}, KeyError, "request_id: 'zz' is not admitted"),
    ({"a": 0}, ValueError, r"new_tokens\['a'\]: expected >= 1 token, got 0"),
    ({"a": 100, "b": 61}, ValueError, "new_tokens: 161 tokens pass max_step_tokens 160"),
    ({"a": 103}, ValueError, r"new_tokens\['a'\]: positions 10..112 pass max_context 112"),
])
def test_bad_steps_are_rejected_and_change_nothing(bad, error, match):
    stack, manager, inputs = _setup("qat")
    with torch.no_grad():
        serve_schedule(stack, manager, {"a": inputs["a"][:, :10], "b": inputs["b"][:, :5]}, [{"a": 10, "b": 5}])
    before = _snapshot(manager, stack)
    with pytest.raises(error, match=match):
        manager.prepare_step(bad)
    _same(before, _snapshot(manager, stack))


def test_full_pools_are_rejected_before_anything_changes():
    # 56 tokens of shared context: ratio 1 holds 56 entries = 8 blocks of 7, + 1 partial per request.
    stack, manager, inputs = _setup("qat", max_total_tokens=56)
    with torch.no_grad():
        serve_schedule(stack, manager, {"a": inputs["a"][:, :70]}, [{"a": 70}])
    manager.admit("b")
    before = _snapshot(manager, stack)
    free = len(manager.allocators[1].free)
    with pytest.raises(CacheFullError, match=r"prepare_step: the 1 pool needs \d+ more blocks, \d+ are free"):
        manager.prepare_step({"b": 7 * (free + 1)})
    _same(before, _snapshot(manager, stack))


def test_a_block_size_the_formats_cannot_page_is_rejected():
    with pytest.raises(ValueError, match=r"block_size: mxfp4_68 pages are padded to a multiple of 512 B; 64 rows"):
        V41CacheManager(CFG, CacheConfig(max_requests=1, max_context=64, max_step_tokens=8, block_size=64))
    # Every default: V4.1's QAT formats, pages of 128 keys (the smallest mxfp4_68 page without padding).
    manager = V41CacheManager(CFG, CacheConfig(max_requests=1, max_context=64, max_step_tokens=8))
    assert (manager.cfg.formats, manager.cfg.block_size) == (CacheFormats.v41(), 128)


@pytest.mark.parametrize("fmts", [CacheFormats.v41().replace(window="fp8_584"),
                                  CacheFormats.v41().replace(comp="fp8_528", index="fp8_132"),
                                  CacheFormats("fp4_288", "exact", "exact")], ids=str)
def test_the_manager_honours_every_field_of_the_cache_config(fmts):
    """Issue 52: V41CacheManager read its formats from an argument of its own and ignored the cache
    config's. Each pool takes its format from CacheConfig.formats, exact pools its exact_dtype, every
    pool its block_size; a stack built without formats takes them, and a step runs on them."""
    stack = testing.randomize_(DeepseekV41AttentionStack(CFG), seed=0)
    manager = V41CacheManager(CFG, CacheConfig(max_requests=1, max_context=32, max_step_tokens=8, block_size=BLOCK,
                                               formats=fmts, exact_dtype=torch.float32))
    stack.attach_cache(manager)
    assert stack.formats == fmts
    want = {"window": fmts.window, "comp": fmts.comp, "keys": fmts.index}
    for name, fmt in stack.cache.fmt.items():
        kind = name.rsplit("_", 1)[0]
        if kind == "state":
            continue
        pool = getattr(stack.cache, name)
        assert fmt == want[kind], name
        assert pool.dtype == (torch.float32 if fmt == "exact" else torch.uint8), name  # not the default bf16
        assert formats.block_size(pool.shape, fmt) == BLOCK, name
    manager.admit("a")
    with torch.no_grad(), manager.step({"a": 8}) as step:
        y = stack(torch.randn(CFG.num_layers, step.positions.shape[0], CFG.hidden_size), step)
    assert torch.isfinite(y).all()


def test_a_manager_of_the_other_version_is_named():
    """Issue 32: a V4 config given to V41CacheManager ended in AttributeError: ... 'roles'."""
    cfg = CacheConfig(max_requests=1, max_context=64, max_step_tokens=8, block_size=BLOCK)
    for manager, model in ((V41CacheManager, DSV4AttentionConfig.tiny()), (KVCacheManager, CFG)):
        want = "DSV41AttentionConfig" if manager is V41CacheManager else "DSV4AttentionConfig"
        with pytest.raises(TypeError, match=rf"model: expected a {want}, got {type(model).__name__} \(V4: "
                                            rf"KVCacheManager\(DSV4AttentionConfig, \.\.\.\); V4.1: "
                                            rf"V41CacheManager\(DSV41AttentionConfig, \.\.\.\)\)"):
            manager(model, cfg)
    with pytest.raises(TypeError, match=r"cfg: expected a CacheConfig, got dict"):
        V41CacheManager(CFG, {"max_requests": 1})


def test_the_old_numerics_spellings_name_cache_formats():
    cfg = CacheConfig(max_requests=1, max_context=64, max_step_tokens=8, block_size=BLOCK)
    replaced = r"V41CacheManager: numerics was replaced by CacheConfig\(formats=CacheFormats\(...\)\)"
    with pytest.raises(TypeError, match=replaced):
        V41CacheManager(CFG, cfg, CacheFormats.exact())
    with pytest.raises(TypeError, match=replaced):
        V41CacheManager(CFG, cfg, numerics=CacheFormats.exact())
    with pytest.raises(TypeError, match=r"DeepseekV41AttentionStack: numerics was replaced by formats=dsv4ops.CacheFormats"):
        DeepseekV41AttentionStack(CFG, numerics=CacheFormats.exact())
    with pytest.raises(ImportError, match=r"dsv4ops.V41Numerics was replaced by dsv4ops.CacheFormats"):
        from dsv4ops import V41Numerics  # noqa: F401


def test_attach_checks_formats_and_model():
    cfg = CacheConfig(max_requests=1, max_context=64, max_step_tokens=8, block_size=BLOCK, formats=CacheFormats.exact())
    explicit = DeepseekV41AttentionStack(CFG, CacheFormats.v41())
    with pytest.raises(ValueError, match=r"manager: its pools hold CacheFormats\(window='exact', comp='exact', "
                                         r"index='exact'\), the stack computes CacheFormats\(window='fp8_528', "
                                         r"comp='fp4_288', index='mxfp4_68'\) \(build the stack with "
                                         r"formats=manager.cfg.formats, or with none to take the cache's\)"):
        explicit.attach_cache(V41CacheManager(CFG, cfg))
    assert not hasattr(explicit, "cache")
    # Without formats: the first cache's, then fixed.
    follows = DeepseekV41AttentionStack(CFG)
    follows.attach_cache(V41CacheManager(CFG, cfg))
    assert follows.formats == CacheFormats.exact()
    with pytest.raises(ValueError, match=r"manager: its pools hold CacheFormats\(window='fp8_528'"):
        follows.attach_cache(V41CacheManager(CFG, dataclasses.replace(cfg, formats=CacheFormats.v41())))
    with pytest.raises(ValueError, match="manager: it was built for another DSV41AttentionConfig"):
        DeepseekV41AttentionStack(CFG).attach_cache(V41CacheManager(DSV41AttentionConfig.tiny(window=8), cfg))


def test_attach_is_refused_while_requests_hold_tokens():
    """A stack attached to a manager whose requests hold tokens would read its empty (NaN) pools."""
    stack, manager, _ = _setup("qat")
    manager.admit("a")
    with torch.no_grad(), manager.step({"a": 5}) as step:
        stack(torch.randn(CFG.num_layers, step.positions.shape[0], CFG.hidden_size), step)
    other = DeepseekV41AttentionStack(CFG, NUMERICS["qat"])
    with pytest.raises(RuntimeError, match=r"attach_cache: 1 admitted request\(s\) already hold tokens "
                                           r"\(e\.g\. 'a': 5\)"):
        other.attach_cache(manager)
    assert not hasattr(other, "cache")


# ---- memory ------------------------------------------------------------------------------------
def test_memory_accounting_matches_the_allocated_pools():
    cfg = CacheConfig(max_requests=2, max_context=448, max_step_tokens=64, block_size=BLOCK)
    acc = memory(CFG, cfg)
    total = sum(spec.nbytes for spec in stack_pools(CFG, cfg))
    expected = acc["fixed_bytes_per_request"] * 2 + acc["bytes_per_token"] * 2 * 448
    slack = sum(3 * spec.nbytes // spec.shape[0] for spec in stack_pools(CFG, cfg)
                if spec.name.startswith(("comp_", "keys_")))
    assert expected <= total <= expected + slack + 1


def test_flash_memory_matches_the_spec():
    # Spec 6.2: 3 x 288 / 2 + 288 + 3 x 68 / 2 + 68 = 890 B of shared KV per token (pages of 128 rows
    # carry no padding in any V4.1 format); window rows 528 B: W = 128 rows per layer is 2,703,360 B for
    # the 40 backbone layers (our ring also holds a step's tokens: W - 1 + step, rounded to pages).
    flash = DSV41AttentionConfig.v41_flash()
    cfg = CacheConfig(max_requests=1, max_context=1 << 20, max_step_tokens=1, block_size=128)
    acc = memory(flash, cfg)
    assert acc["bytes_per_token"] == 890
    assert acc["ring_size"] == 128
    states = 3 * 2 * 2 * 512 * 4 + 1 * 1 * 2 * 512 * 4  # ratio-2 rings of 2 rows, the ratio-1 row
    assert acc["fixed_bytes_per_request"] == 40 * 128 * 528 + states
    assert memory(flash, cfg, layers=43)["fixed_bytes_per_request"] - states == 2_906_112
    fp8_keys = memory(flash, dataclasses.replace(cfg, formats=CacheFormats.v41().replace(index="fp8_132")))
    assert fp8_keys["bytes_per_token"] == 1050


def test_a_step_the_stack_did_not_run_is_refused_at_commit_and_rolled_back():
    """Issue 52, as test_step_lifecycle's V4 case: a step committed without the stack's forward
    raises and is rolled back; the request then runs as if it had never been planned."""
    stack, manager, inputs = _setup("exact")
    manager.admit("a")
    with pytest.raises(RuntimeError, match=r"commit: step \d+ ran on 0 of the 1 attached layer caches"):
        with manager.step({"a": 4}):
            pass
    assert manager.length == {"a": 0} and manager.open_step is None
    x = inputs["a"][:, :4]
    with manager.step({"a": 4}) as step:
        y = stack(x, step)
    assert manager.length == {"a": 4}
    torch.testing.assert_close(y, stack(x[:, None])[:, 0], rtol=1e-4, atol=1e-4)
