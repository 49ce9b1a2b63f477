"""Speculative decoding and prefix sharing in the V4 cache (issue 14): verify steps of 1 + k tokens
mixed with prefill chunks and decode, with rewinds of the rejected drafts, equal running the
accepted tokens alone through the stateless oracle (every layer type and cache mode, eager and
compiled); the rewind whose dropped tokens wrapped the compressor-state ring; forks at every ratio,
window and block boundary continue like fresh requests fed the whole sequence, share complete
blocks (copy on write) and release only what nobody else holds; block-causal draft windows; clear
errors that change nothing; the memory accounting of shared blocks."""

import builders
import drivers
import pytest
import torch
from test_serving import CFG, MODES, _pool_bytes
from torch._dynamo.utils import counters

from dsv4ops import DeepseekV4Attention, reference, testing
from dsv4ops.cache import CacheConfig, KVCacheManager
from dsv4ops.cache.config import memory
from dsv4ops.cache.manager import CacheFullError
from dsv4ops.config import CSA, HCA, SLIDING
from dsv4ops.quant import formats

LAYER = {SLIDING: 0, CSA: 1, HCA: 2}
DRAFTS = 5  # DSpark's block: verify steps of 1 + up to 5 tokens
# 260 crosses 127 and 255 (mod 128) and 3 mod 4 many times; "c" stays in the first CSA windows.
LENGTHS = {"a": 260, "b": 131, "c": 9}
PREFILL = {"a": 100, "b": 40}


def _setup(kind, mode, device="cpu", dtype=torch.float32, **capacity):
    layer = testing.randomize_(DeepseekV4Attention(CFG, LAYER[kind], formats=MODES[mode]), seed=LAYER[kind])
    layer = layer.to(device, dtype)
    base = dict(max_requests=4, max_context=280, max_step_tokens=160, formats=MODES[mode],
                exact_dtype=torch.float32, max_draft_tokens=DRAFTS)
    manager = KVCacheManager(CFG, CacheConfig(**(base | capacity)), device=device)
    layer.attach_cache(manager)
    return layer, manager


def _inputs(lengths: dict, seed: int, device="cpu", dtype=torch.float32) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {r: torch.randn(n, CFG.hidden_size, generator=g).to(device, dtype) for r, n in lengths.items()}


def _check(layer, mode, seqs: dict, outs: dict, starts: dict | None = None, window_ends: dict | None = None):
    """outs[r] (the outputs of request r's tokens from starts[r] on) against the fp64 oracle over
    its whole sequence seqs[r] (with its window ends, if given); budget: the oracle's fp32 run and,
    in FP8 modes, its rounding twins."""
    numerics, li = layer.numerics, layer.layer_idx
    params = {k: v.detach() for k, v in layer.named_parameters()}
    p64 = {k: v.double() for k, v in params.items()}
    for r, x in seqs.items():
        s = (starts or {}).get(r, 0)
        ends = None if window_ends is None else window_ends[r][None]
        with torch.no_grad():
            ref32 = reference.attention(params, CFG, li, x[None], numerics, window_ends=ends)[0, s:]
            run64 = lambda: reference.attention(p64, CFG, li, x[None].double(), numerics,  # noqa: E731
                                                window_ends=ends)[0, s:]
            ref64 = run64()
            twins = testing.rounding_twins(run64) if mode == "fp8" else []
        testing.assert_close_to_ref(outs[r], ref64, [ref32, *twins], what=f"request {r}")


def _bookkeeping(manager):
    return ({k: t.clone() for k, t in manager.tables.items()}, dict(manager.length), dict(manager.high),
            dict(manager.slot_of), list(manager.free_slots),
            {k: (list(a.free), list(a.refs)) for k, a in manager.allocators.items()}, list(manager.generation))


def _same(a, b, generations: bool = True):
    """Same bookkeeping; `generations` False: but for the slots' generations (abort gives its
    requests new ones)."""
    assert all(torch.equal(a[0][k], b[0][k]) for k in a[0]), "block tables"
    end = None if generations else -1
    assert a[1:end] == b[1:end], "lengths, high marks, slots, free lists, reference counts or generations"


# ---- verify steps and rewinds ---------------------------------------------------------------------
@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("kind", [SLIDING, CSA, HCA])
def test_verify_steps_with_rewinds_equal_the_accepted_tokens_alone(kind, mode):
    verify_run(kind, mode)


def verify_run(kind, mode, device="cpu", dtype=torch.float32):
    """A random schedule: prefill chunks, then steps mixing verify steps of 1 + k tokens (k = 0..5,
    per request and step), rejected drafts fed random rows and rewound after the step, and chunks:
    every kept token's output equals the fp64 oracle run on the kept tokens only."""
    layer, manager = _setup(kind, mode, device, dtype)
    inputs = _inputs(LENGTHS, 0, device, dtype)
    schedule = drivers.speculative_schedule(LENGTHS, DRAFTS, seed=LAYER[kind], prefill=PREFILL)
    rejected = sum(n - kept for step in schedule for n, kept in step.values())
    assert rejected > 50 and any(len(step) == 3 for step in schedule)
    with torch.no_grad():
        outs = drivers.serve_speculative(layer, manager, inputs, schedule, torch.Generator().manual_seed(1))
    assert manager.length == LENGTHS
    _check(layer, mode, inputs, outs)


@pytest.mark.parametrize("kind", [CSA, HCA])
def test_rewind_after_dropped_drafts_wrapped_the_state_ring(kind):
    """The case a ring of span rows (HCA 128, CSA 8) loses: a verify step at 122..129 keeps 4
    tokens; the 4 dropped ones (126..129) wrote state rows p % rows. With 128 rows they overwrite
    the rows of positions 0 and 1 (HCA; CSA, 8 rows: 120 and 121), which the entry closing at 127
    pools. CacheConfig.state_rows gives span - 1 + 7 rows for 7 drafts: the rows survive, and the
    request continues exactly."""
    layer, manager = _setup(kind, "bf16", max_draft_tokens=7)
    span = {CSA: 2 * CFG.csa_ratio, HCA: CFG.hca_ratio}[kind]
    assert layer.cache.state.shape[1] == span - 1 + 7
    inputs = _inputs({"a": 140}, 3)
    schedule = [{"a": (122, 122)}, {"a": (8, 4)}, {"a": (6, 6)}, {"a": (8, 8)}]
    with torch.no_grad():
        outs = drivers.serve_speculative(layer, manager, inputs, schedule, torch.Generator().manual_seed(1))
    _check(layer, "bf16", inputs, outs)


def test_rewind_drops_the_blocks_past_the_new_end():
    layer, manager = _setup(CSA, "bf16")
    x = _inputs({"a": 260}, 0)["a"]
    with torch.no_grad():
        drivers.serve_schedule(layer, manager, {"a": x}, [{"a": 100}, {"a": 100}, {"a": 60}])
    free = len(manager.allocators[CSA].free)
    assert (manager.tables[CSA][0] >= 0).sum() == 2  # 65 entries of 64
    assert manager.rewindable("a") == DRAFTS
    manager.rewind("a", 5)  # 255: 63 entries, one block
    assert manager.length["a"] == 255 and (manager.tables[CSA][0] >= 0).sum() == 1
    assert len(manager.allocators[CSA].free) == free + 1
    assert manager.rewindable("a") == 0  # the positions up to 259 were written: nothing more to undo
    manager.rewind("a", 0)


# ---- block-causal draft windows ----------------------------------------------------------------
@pytest.mark.parametrize("kind", [SLIDING, CSA])
def test_draft_blocks_see_themselves_both_ways(kind):
    """Steps where request "a" brings a draft block of 5 (blocks={"a": 5}: its tokens' windows end
    at the block's last position) next to causal tokens of "b", around the window boundary (the
    block 125..129 of a window of 128 reaches back to 2 only): equal to the oracle with those
    window ends."""
    layer, manager = _setup(kind, "bf16")
    x = _inputs({"a": 145, "b": 140}, 4)
    plan = [({"a": 120}, None), ({"b": 100}, None), ({"a": 5, "b": 30}, {"a": 3}), ({"a": 5, "b": 1}, {"a": 5}),
            ({"a": 5, "b": 9}, {"a": 5, "b": 2}), ({"a": 10}, {"a": 4})]
    ends = {r: torch.arange(n) for r, n in ((r, t.shape[0]) for r, t in x.items())}
    done = {"a": 0, "b": 0}
    outs = {"a": [], "b": []}
    manager.admit("a")
    manager.admit("b")
    with torch.no_grad():
        for new, blocks in plan:
            with manager.step(new, blocks) as step:
                rows = torch.cat([x[r][done[r]:done[r] + n] for r, n in new.items()])
                y = layer(torch.cat([rows, rows.new_zeros(step.positions.shape[0] - rows.shape[0], rows.shape[1])]),
                          step)
            i = 0
            for r, n in new.items():
                outs[r].append(y[i:i + n])
                b = (blocks or {}).get(r, 0)
                ends[r][done[r] + n - b:done[r] + n] = done[r] + n - 1
                assert torch.equal(step.window_ends[i:i + n], ends[r][done[r]:done[r] + n].int())
                done[r] += n
                i += n
    assert (ends["a"] != torch.arange(145)).sum() > 10
    _check(layer, "bf16", x, {r: torch.cat(v) for r, v in outs.items()}, window_ends=ends)


# ---- forks ---------------------------------------------------------------------------------------
# Around m = 4 (3, 4, 5), a CSA block of 2 entries (7, 8, 9), the window and m = 128 (127, 128,
# 129), and an HCA block of 2 entries (255, 256, 257): pages of 2 entries put block boundaries
# inside the test's lengths.
FORKS = (3, 4, 5, 7, 8, 9, 127, 128, 129, 255, 256, 257)
STOPS = (3, 5, 9, 129, 257)  # the parent's lengths when it forks: at or up to 2 tokens past the fork
TAIL = (6, 1, 1, 1, 7)  # each child's own tokens after its fork, step by step


@pytest.mark.parametrize("kind", [SLIDING, CSA, HCA])
def test_forks_at_every_boundary_continue_like_fresh_requests(kind):
    fork_run(kind)


def fork_run(kind, device="cpu", dtype=torch.float32):
    """One parent forks 12 children at lengths around every ratio, window and block boundary;
    the parent and the children then run together (the parent is released midway), one child
    rewound into its shared blocks (copy on write). Each continues exactly like a fresh request
    fed its whole sequence; no write touches a block while it is shared; releasing everyone
    frees every block."""
    layer, manager = _setup(kind, "fp8", device, dtype, max_requests=13, max_context=300, max_step_tokens=300,
                            block_size=2, max_draft_tokens=4)
    x = _inputs({"p": 266}, 5, device, dtype)["p"]
    tails = _inputs({f"f{n}": sum(TAIL) for n in FORKS}, 6, device, dtype)
    parent = []
    done = 0
    with torch.no_grad():
        for stop in STOPS:
            parent.append(drivers.serve_schedule(layer, manager, {"p": x[done:]}, [{"p": stop - done}])["p"])
            done = stop
            for n in FORKS:
                if n <= stop and f"f{n}" not in manager.slot_of:
                    manager.fork("p", f"f{n}", n)
        starts = {c: int(c[1:]) for c in tails}
        assert [manager.length[c] for c in tails] == list(FORKS)
        # The child forked at 257 takes back 2 tokens: its next token closes entry 63 (CSA, in block
        # 31) / entry 1 (HCA, block 0), blocks it shares with the parent and the fork at 256.
        manager.rewind("f257", 2)
        starts["f257"] = 255
        cow = {CSA: 31, HCA: 0}.get(kind)
        if cow is not None:
            row = lambda c: manager.tables[kind][manager.slot_of[c]]  # noqa: E731
            block = int(row("f257")[cow])
            assert block == int(row("f256")[cow]) == int(row("p")[cow])
        shared = _shared_pages(layer, manager)
        usage = manager.usage()
        _check_usage(manager, usage)
        if kind != SLIDING:
            assert usage["shared_blocks"][kind] > 0 and usage["bytes"] < usage["bytes_without_sharing"]
        outs = {c: [] for c in tails}
        for i, n in enumerate(TAIL):
            new = {c: n for c in tails}
            if i < 4:
                new["p"] = n
            with manager.step(new) as step:
                at = sum(TAIL[:i])
                rows = torch.cat([tails[c][at:at + n] for c in tails] + ([x[done:done + n]] if i < 4 else []))
                y = layer(torch.cat([rows, rows.new_zeros(step.positions.shape[0] - rows.shape[0], rows.shape[1])]),
                          step)
            for j, c in enumerate(tails):
                outs[c].append(y[j * n:(j + 1) * n])
            if i < 4:
                parent.append(y[len(tails) * n:(len(tails) + 1) * n])
                done += n
            if i == 3:
                manager.release("p")
        for name, (pages, before) in shared.items():
            assert builders.bytes_equal(getattr(layer.cache, name)[pages], before), f"a shared {name} block was written"
        if cow is not None:  # f257 wrote a private copy; f256 still lists the shared block
            assert int(row("f257")[cow]) != block and int(row("f256")[cow]) == block
    seqs = {c: torch.cat([x[:starts[c]], t]) for c, t in tails.items()}
    _check(layer, "fp8", {"p": x[:done], **seqs}, {"p": torch.cat(parent), **{c: torch.cat(v) for c, v in outs.items()}},
           starts=starts)
    for c in tails:
        manager.release(c)
    for alloc in manager.allocators.values():
        assert sorted(alloc.free) == list(range(len(alloc.refs))) and not any(alloc.refs)


def _shared_pages(layer, manager) -> dict:
    """{pool: (blocks listed by more than one request now, their bytes)}."""
    out = {}
    for name, kind in layer.cache.block_pools.items():
        refs = torch.tensor(manager.allocators[kind].refs)
        pages = (refs > 1).nonzero().flatten().to(getattr(layer.cache, name).device)
        out[name] = (pages, getattr(layer.cache, name)[pages].clone())
    return out


def _check_usage(manager, usage):
    """usage() against a count of the block tables and the bytes of the formats' pages (every
    layer of the model) plus memory()'s fixed bytes per request."""
    cfg, model = manager.cfg, manager.model
    comp, index = cfg.formats.comp, cfg.formats.index
    page = {f: formats.get(f).page_bytes(cfg.block_size) for f in (comp, index) if f != formats.EXACT}
    layers = [model.layer_type(i) for i in range(model.num_layers)]
    block_bytes = {CSA: layers.count(CSA) * (page[comp] + page[index]), HCA: layers.count(HCA) * page[comp]}
    expect = len(manager.slot_of) * memory(model, cfg)["fixed_bytes_per_request"]
    unshared = expect
    for kind, table in manager.tables.items():
        ids = table[table >= 0]
        uniq, count = ids.unique(return_counts=True)
        assert usage["blocks"][kind] == uniq.numel() and usage["block_refs"][kind] == ids.numel()
        assert usage["shared_blocks"][kind] == int((count > 1).sum())
        expect += uniq.numel() * block_bytes[kind]
        unshared += ids.numel() * block_bytes[kind]
    assert usage["bytes"] == expect and usage["bytes_without_sharing"] == unshared


def test_fork_copies_the_partial_block_and_shares_the_complete_ones():
    layer, manager = _setup(CSA, "bf16", block_size=2)
    x = _inputs({"a": 42}, 0)["a"]
    with torch.no_grad():
        drivers.serve_schedule(layer, manager, {"a": x}, [{"a": 42}])
    manager.fork("a", "b", 41)  # 10 entries: 5 full blocks shared, none partial
    manager.fork("a", "c", 38)  # 9 entries: 4 shared, the 5th block copied
    pa, pb, pc = (manager.tables[CSA][manager.slot_of[r]] for r in "abc")
    assert torch.equal(pb[:5], pa[:5]) and (pb[5:] == -1).all()
    assert torch.equal(pc[:4], pa[:4]) and pc[4] not in pa.tolist() and (pc[5:] == -1).all()
    assert (pa >= 0).sum() == 5 and [manager.allocators[CSA].refs[int(b)] for b in pa[:5]] == [3, 3, 3, 3, 2]
    for name in ("comp", "index"):
        pool = getattr(layer.cache, name)
        assert builders.bytes_equal(pool[int(pc[4])], pool[int(pa[4])])
    sa, sc = manager.slot_of["a"], manager.slot_of["c"]
    for name, n in layer.cache.slot_pools.items():
        pool = getattr(layer.cache, name)
        assert builders.bytes_equal(pool[sc * n:(sc + 1) * n], pool[sa * n:(sa + 1) * n]), name
    blocks = pa[:5].tolist()
    manager.release("a")
    assert [manager.allocators[CSA].refs[b] for b in blocks] == [2, 2, 2, 2, 1]
    assert manager.allocators[CSA].refs[int(pc[4])] == 1


# ---- compiled verify loops -------------------------------------------------------------------------
def test_compiled_verify_loop_has_no_graphs_beyond_the_buckets():
    """torch.compile(fullgraph=True): after one step in each bucket, verify steps with rewinds, a
    fork and a copy on write compile nothing more; outputs equal the oracle."""
    torch._dynamo.reset()
    counters.clear()
    layer, manager = _setup(CSA, "fp8", buckets=(8, 16, 160), block_size=2)
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    inputs = _inputs({"a": 150, "b": 68, "c": 20}, 7)
    warm = [{"a": (100, 100), "b": (40, 40)}, {"a": (6, 2), "b": (8, 8)}, {"a": (3, 1)}]  # buckets 160, 16, 8
    with torch.no_grad():
        first = drivers.serve_speculative(compiled, manager, {r: inputs[r] for r in "ab"}, warm,
                                          torch.Generator().manual_seed(1))
        graphs = counters["stats"]["unique_graphs"]
        # c: b's first 48 tokens (12 entries, 6 full blocks, all shared), then 2 taken back: the
        # entry c closes next (11, at 47) is in a block it shares with b, copied on write.
        manager.fork("b", "c", 48)
        manager.rewind("c", 2)
        rest = drivers.speculative_schedule({"a": 47, "b": 20, "c": 20}, DRAFTS, seed=3)
        more = drivers.serve_speculative(compiled, manager, {"a": inputs["a"][103:], "b": inputs["b"][48:],
                                                             "c": inputs["c"]}, rest, torch.Generator().manual_seed(2))
    assert graphs <= 3 and counters["stats"]["unique_graphs"] == graphs, counters["stats"]
    assert dict(counters["graph_break"]) == {}
    outs = {"a": torch.cat([first["a"], more["a"]]), "b": torch.cat([first["b"], more["b"]]), "c": more["c"]}
    seqs = {"a": inputs["a"], "b": inputs["b"], "c": torch.cat([inputs["b"][:46], inputs["c"]])}
    _check(layer, "fp8", seqs, outs, starts={"c": 46})


# ---- bad requests: clear errors, nothing changed -------------------------------------------------
def _forked():
    """HCA layer, 3 slots: "a" at 140 tokens (written up to 139), "b" forked from it at 137."""
    layer, manager = _setup(HCA, "bf16", max_requests=3)
    x = _inputs({"a": 140}, 0)["a"]
    with torch.no_grad():
        drivers.serve_schedule(layer, manager, {"a": x}, [{"a": 130}, {"a": 10}])
    manager.fork("a", "b", 137)
    return layer, manager


BAD = [
    ("rewind-past-slack", None, lambda m: m.rewind("a", 6), ValueError,
     r"n: rewinding request 'a' by 6 tokens to length 134 puts its end 6 positions behind the furthest position its "
     r"steps wrote \(139\); .* at most 5 \(CacheConfig.max_draft_tokens = 5\); rewindable now: 5"),
    ("rewind-past-slack-of-a-fork", None, lambda m: m.rewind("b", 3), ValueError,
     r"n: rewinding request 'b' by 3 tokens to length 134 puts its end 6 positions behind the furthest position its "
     r"steps wrote \(139\); .* rewindable now: 2"),
    ("rewind-past-length", None, lambda m: m.rewind("a", 141), ValueError,
     r"n: expected at most the 140 tokens of request 'a', got 141"),
    ("rewind-negative", None, lambda m: m.rewind("a", -1), ValueError, r"n: expected >= 0, got -1"),
    ("rewind-float", None, lambda m: m.rewind("a", 1.0), TypeError, r"n: expected an int, got float 1.0"),
    ("rewind-unknown", None, lambda m: m.rewind("zz", 1), KeyError, r"request_id: 'zz' is not admitted"),
    ("rewind-open-step", lambda m: m.prepare_step({"a": 1}), lambda m: m.rewind("a", 1), RuntimeError,
     r"rewind: step \d+ is still open \(requests \['a'\]\); commit\(step\) or abort\(step\) it first"),
    ("fork-unknown-parent", None, lambda m: m.fork("zz", "c", 3), KeyError, r"parent: 'zz' is not admitted"),
    ("fork-longer-than-parent", None, lambda m: m.fork("a", "c", 141), ValueError,
     r"length: expected at most the 140 tokens of parent 'a', got 141"),
    ("fork-too-far-back", None, lambda m: m.fork("a", "c", 134), ValueError,
     r"length: 134 is 6 positions behind the furthest position parent 'a' wrote \(139\); .* at most 5 "
     r"\(CacheConfig.max_draft_tokens = 5\): fork when the parent reaches the prefix"),
    ("fork-zero", None, lambda m: m.fork("a", "c", 0), ValueError, r"length: expected >= 1, got 0"),
    ("fork-admitted-child", None, lambda m: m.fork("a", "b", 3), ValueError, r"child: 'b' is already admitted"),
    ("fork-unhashable-child", None, lambda m: m.fork("a", ["c"], 3), TypeError,
     r"child: expected a hashable id, got list"),
    ("fork-no-slot", lambda m: m.admit("z"), lambda m: m.fork("a", "c", 140), CacheFullError,
     r"fork: all 3 request slots are in use"),
    ("fork-open-step", lambda m: m.prepare_step({"a": 1}), lambda m: m.fork("a", "c", 140), RuntimeError,
     r"fork: step \d+ is still open"),
    ("blocks-not-in-step", None, lambda m: m.prepare_step({"a": 3}, {"b": 2}), ValueError,
     r"blocks: request 'b' has no tokens in this step \(new_tokens: \['a'\]\)"),
    ("blocks-too-long", None, lambda m: m.prepare_step({"a": 3}, {"a": 4}), ValueError,
     r"blocks\['a'\]: expected at most the request's 3 tokens of the step, got 4"),
    ("blocks-zero", None, lambda m: m.prepare_step({"a": 3}, {"a": 0}), ValueError,
     r"blocks\['a'\]: expected >= 1, got 0"),
    ("blocks-list", None, lambda m: m.prepare_step({"a": 3}, ["a"]), TypeError,
     r"blocks: expected a mapping \{request_id: draft-block size\}, got list"),
]


@pytest.mark.parametrize("case", BAD, ids=[b[0] for b in BAD])
def test_bad_requests_raise_and_change_nothing(case):
    _, prepare, call, error, match = case
    layer, manager = _forked()
    if prepare is not None:
        prepare(manager)
    before, pools, open_step = _bookkeeping(manager), _pool_bytes(layer), manager.open_step
    with pytest.raises(error, match=match):
        call(manager)
    _same(before, _bookkeeping(manager))
    after = _pool_bytes(layer)
    assert all(torch.equal(pools[k], after[k]) for k in pools)
    assert manager.open_step is open_step


def _full_pool():
    """CSA, pages of 2 entries, 6 blocks, 4 slots: "a" 16 tokens (4 entries, 2 full blocks), "b"
    forked at 16 (shares both), "z" 32 tokens (4 blocks): no block free, a slot free."""
    layer, manager = _setup(CSA, "bf16", max_requests=4, block_size=2, max_total_tokens=16, max_step_tokens=32)
    x = _inputs({"a": 16, "z": 32}, 0)
    with torch.no_grad():
        drivers.serve_schedule(layer, manager, {"a": x["a"]}, [{"a": 16}])
        manager.fork("a", "b", 16)
        drivers.serve_schedule(layer, manager, {"z": x["z"]}, [{"z": 32}])
    assert not manager.allocators[CSA].free
    return layer, manager


def test_fork_and_copy_on_write_without_a_free_block_raise_and_change_nothing():
    layer, manager = _full_pool()
    manager.rewind("a", 2)  # 14: 3 entries, its 2nd block is partial
    before, pools = _bookkeeping(manager), _pool_bytes(layer)
    with pytest.raises(CacheFullError, match=r"fork: the compressed_sparse_attention pool needs 1 more block \(the "
                                             r"partial last block\), 0 are free"):
        manager.fork("a", "c", 14)
    with pytest.raises(CacheFullError, match=r"prepare_step: the compressed_sparse_attention pool needs 1 more "
                                             r"blocks \(1 of them copies of shared blocks\), 0 are free"):
        manager.prepare_step({"a": 2})  # 14, 15: closes entry 3, in the block "a" shares with "b"
    _same(before, _bookkeeping(manager))
    after = _pool_bytes(layer)
    assert all(torch.equal(pools[k], after[k]) for k in pools)


def test_abort_undoes_a_copy_on_write():
    layer, manager = _full_pool()
    manager.rewind("a", 2)
    manager.release("z")
    before = _bookkeeping(manager)
    row = manager.tables[CSA][manager.slot_of["a"]]
    shared = int(row[1])
    step = manager.prepare_step({"a": 2})
    private = int(row[1])
    assert private != shared and manager.allocators[CSA].refs[shared] == 1
    assert builders.bytes_equal(layer.cache.comp[private], layer.cache.comp[shared])
    manager.abort(step)
    _same(before, _bookkeeping(manager), generations=False)
