"""The step lifecycle (plan -> forward -> commit, or abort on failure) and the step's identity
(manager id, slot generations): a failed forward leaves every request as it was, eager and
compiled; a foreign, stale, closed or hand-edited step writes nothing. Issue 10."""

import builders
import drivers
import pytest
import torch
from test_serving import CFG, LENGTHS, _check_against_stateless, _pool_bytes, _setup
from torch.utils._python_dispatch import TorchDispatchMode

from dsv4ops import DeepseekV4Attention, layers, testing
from dsv4ops.cache import CacheConfig, KVCacheManager
from dsv4ops.cache.v41 import V41CacheManager
from dsv4ops.config import CSA, HCA, SLIDING
from dsv4ops.config_v41 import DSV41AttentionConfig

# Request "a" (260 tokens): a 100-token prefill, then a 150-token chunk that fails once and is
# retried, then 10 decode steps. The chunk (positions 100..249) wraps every compressor-state ring
# (HCA: 128 rows, CSA: 8), so it overwrites rows that its first closing token pools from before
# position 100 (HCA: 0..99, CSA: 96..99): only a restore of those rows makes the retry right.
FIRST, CHUNK, DECODE = 100, 150, 10


class Injected(RuntimeError):
    pass


def _fail_after_the_caches_are_written(monkeypatch):
    """The layer's last step (the output projection) raises: every cache write of the step is done."""
    def grouped_o_a(*args, **kwargs):
        raise Injected("injected failure after the step wrote its caches")

    monkeypatch.setattr(layers, "grouped_o_a", grouped_o_a)


def _bookkeeping(manager):
    return ({k: t.clone() for k, t in manager.tables.items()}, dict(manager.length), dict(manager.slot_of),
            list(manager.free_slots), {k: list(a.free) for k, a in manager.allocators.items()})


def _same_bookkeeping(a, b):
    assert all(torch.equal(a[0][k], b[0][k]) for k in a[0]), "block tables"
    assert a[1:] == b[1:], "lengths, slots or free lists"


def _states(layer):
    return {n: getattr(layer.cache, n).clone() for n, *_ in layer.cache.state_rings}


def _step_x(inputs, rid, start, n, step):
    x = inputs[rid][start:start + n]
    return torch.cat([x, x.new_zeros(step.positions.shape[0] - n, x.shape[1])])


@pytest.mark.parametrize("mode", ["bf16", "fp8"])
@pytest.mark.parametrize("kind", [SLIDING, CSA, HCA])
def test_failed_forward_is_rolled_back_and_the_request_continues(kind, mode, monkeypatch):
    layer, manager, inputs = _setup(kind, mode)
    x = {"a": inputs["a"]}
    outs = []
    with torch.no_grad():
        outs.append(drivers.serve_schedule(layer, manager, x, [{"a": FIRST}])["a"])
        before, states = _bookkeeping(manager), _states(layer)
        with monkeypatch.context() as m:
            _fail_after_the_caches_are_written(m)
            with pytest.raises(Injected), manager.step({"a": CHUNK}) as step:
                layer(_step_x(inputs, "a", FIRST, CHUNK, step), step)
        _same_bookkeeping(before, _bookkeeping(manager))
        for name, t in _states(layer).items():
            assert builders.bytes_equal(t, states[name]), f"{name} restored"
        assert manager.open_step is None
        # The same chunk again, then decode to the end: as if the failure never happened.
        rest = [{"a": CHUNK}] + [{"a": 1}] * DECODE
        outs.append(drivers.serve_schedule(layer, manager, {"a": inputs["a"][FIRST:]}, rest)["a"])
    assert FIRST + CHUNK + DECODE == LENGTHS["a"]
    _check_against_stateless(layer, {"a": inputs["a"]}, {"a": torch.cat(outs)}, mode)


@pytest.mark.parametrize("kind", [CSA, HCA])
def test_rollback_under_torch_compile(kind):
    """A compiled forward that completed, then a failure in the caller's code before commit (e.g. a
    later layer): abort restores what the compiled graph wrote; the compiled layer then continues."""
    torch._dynamo.reset()
    layer, manager, inputs = _setup(kind, "bf16")
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    outs = []
    with torch.no_grad():
        outs.append(drivers.serve_schedule(compiled, manager, {"a": inputs["a"]}, [{"a": FIRST}])["a"])
        before, states = _bookkeeping(manager), _states(layer)
        with pytest.raises(Injected), manager.step({"a": CHUNK}) as step:
            compiled(_step_x(inputs, "a", FIRST, CHUNK, step), step)
            raise Injected("the next layer failed")
        _same_bookkeeping(before, _bookkeeping(manager))
        for name, t in _states(layer).items():
            assert builders.bytes_equal(t, states[name]), f"{name} restored"
        outs.append(drivers.serve_schedule(compiled, manager, {"a": inputs["a"][FIRST:]}, [{"a": CHUNK}])["a"])
    _check_against_stateless(layer, {"a": inputs["a"][:FIRST + CHUNK]}, {"a": torch.cat(outs)}, "bf16")


def test_explicit_commit_and_abort():
    layer, manager, inputs = _setup(CSA, "bf16")
    manager.admit("a")
    manager.admit("b")
    before = _bookkeeping(manager)
    step = manager.prepare_step({"a": 70, "b": 3})
    assert manager.open_step is step
    with pytest.raises(RuntimeError, match=r"prepare_step: step \d+ is still open \(requests \['a', 'b'\]\); "
                                           r"commit\(step\) or abort\(step\) it first"):
        manager.prepare_step({"a": 1})
    assert manager.length == {"a": 0, "b": 0}  # lengths move at commit
    manager.abort(step)
    _same_bookkeeping(before, _bookkeeping(manager))
    with pytest.raises(ValueError, match=r"abort: expected the open step \(none is open\) of manager \d+, got step"):
        manager.abort(step)
    with pytest.raises(ValueError, match=r"commit: expected the open step \(none is open\)"):
        manager.commit(step)
    step = manager.prepare_step({"a": 70, "b": 3})
    x = torch.cat([inputs["a"][:70], inputs["b"][:3]])
    layer(torch.cat([x, x.new_zeros(step.positions.shape[0] - 73, x.shape[1])]), step)
    manager.commit(step)
    assert manager.length == {"a": 70, "b": 3} and manager.open_step is None
    decode = manager.prepare_step({"a": 1})
    with pytest.raises(ValueError, match=r"commit: expected the open step \(\d+\) of manager \d+, got step \d+"):
        manager.commit(step)
    layer(_step_x(inputs, "a", 70, 1, decode), decode)
    manager.commit(decode)


def test_only_chunks_that_wrap_a_state_ring_are_backed_up():
    """Decode steps and short chunks copy nothing; a chunk that can overwrite a state row still
    needed after a rollback copies its request's rows (per ring, read from the buffer's row count)."""
    layer, manager, inputs = _setup(HCA, "bf16")
    with torch.no_grad():
        drivers.serve_schedule(layer, manager, {"a": inputs["a"]}, [{"a": FIRST}])
    for new, backed_up in (({"a": 1}, False), ({"a": 28}, False), ({"a": 29}, True)):
        # From 100, the first HCA entry closes at 127 and pools 0..127: 29 tokens (100..128) rewrite row 0.
        step = manager.prepare_step(new)
        assert bool(manager._open.backups) == backed_up, new
        manager.abort(step)


@pytest.mark.parametrize("kind, sizes", [(CSA, range(1, 14)), (HCA, (1, 27, 28, 29, 30, 140))], ids=["csa", "hca"])
def test_abort_restores_every_state_row_the_next_entry_pools(kind, sizes):
    """Whatever abort backs up: after a chunk of n tokens from position 100 overwrote its state
    rows (row q % rows for each q it covers, as compressor_update does; here NaN) and was aborted,
    the rows of positions c - span + 1 .. 99 (c: the first position >= 100 closing an entry, span
    its pool) hold what they held, for every n around where a ring wraps (CSA: rows 8, from n = 5)."""
    layer, manager, inputs = _setup(kind, "bf16")
    with torch.no_grad():
        drivers.serve_schedule(layer, manager, {"a": inputs["a"]}, [{"a": FIRST}])
    slot = manager.slot_of["a"]
    for n in sizes:
        step = manager.prepare_step({"a": n})
        before = {}
        for name, ratio, span in layer.cache.state_rings:
            state = getattr(layer.cache, name)
            rows = state.shape[1]
            c = -(-(FIRST + 1) // ratio) * ratio - 1
            needed = [q % rows for q in range(max(0, c - span + 1), FIRST)]
            before[name] = (needed, state[slot, needed].clone())
            state[slot, [q % rows for q in range(FIRST, FIRST + n)]] = float("nan")
        manager.abort(step)
        for name, (needed, rows_before) in before.items():
            assert torch.equal(getattr(layer.cache, name)[slot, needed], rows_before), (name, n)


# ---- the step's identity -------------------------------------------------------------------------
def _rejected(layer, x, step, match):
    pools = _pool_bytes(layer)
    with pytest.raises(ValueError, match=match), torch.no_grad():
        layer(x, step)
    after = _pool_bytes(layer)
    assert all(torch.equal(pools[k], after[k]) for k in pools), "a rejected step wrote a pool"


def test_eager_forward_rejects_foreign_stale_closed_and_edited_steps():
    layer, manager, inputs = _setup(CSA, "fp8")
    other = KVCacheManager(CFG, manager.cfg)
    for m in (manager, other):
        m.admit("a")
    x = torch.randn(16, CFG.hidden_size)
    with other.step({"a": 16}) as foreign:
        _rejected(layer, x, foreign, r"step: planned by KVCacheManager \d+, but this layer's cache belongs to "
                                     r"KVCacheManager \d+")
    step = manager.prepare_step({"a": 16})
    manager.release("a")
    _rejected(layer, x, step, r"step: request 'a' \(slot 0\) was released or re-admitted after step \d+ was planned")
    manager.admit("a")  # the same slot again, a new generation: still stale
    _rejected(layer, x, step, r"request 'a' \(slot 0\) was released or re-admitted")
    manager.abort(step)
    step = manager.prepare_step({"a": 13})  # padded to 16: tokens 13..15 are padding
    step.positions[3] = -4
    _rejected(layer, x, step, r"step: positions is not what step \d+ was planned with \(edited by hand\?\)")
    step.positions[3] = 3
    step.positions[-1] = 77  # a padding token's position is free (it reads and writes nothing)...
    step.req_slots[-1] = 0  # ...but it must stay padding
    _rejected(layer, x, step, r"step: req_slots is not what step \d+ was planned with")
    step.req_slots[-1] = -1
    _rejected(layer, x[:15], step, r"hidden_states: expected 16 rows \(the step's tokens, padded to its bucket\), "
                                   r"got 15")
    with torch.no_grad():
        layer(x, step)
    manager.commit(step)
    _rejected(layer, x, step, r"step: step \d+ is closed \(committed or aborted\); plan the next step")


def _compiled_run_writes_nothing(layer, x, step):
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    pools = _pool_bytes(layer)
    with torch.no_grad():
        y = compiled(x, step)
    after = _pool_bytes(layer)
    assert all(torch.equal(pools[k], after[k]) for k in pools), "a masked token wrote a pool"
    return y


def test_compiled_forward_masks_foreign_stale_and_negative_tokens():
    """Under torch.compile the checks cannot raise without a sync: the device masks every token of
    a foreign or stale step, or at a negative position, into padding: nothing written, rows 0."""
    torch._dynamo.reset()
    layer, manager, inputs = _setup(CSA, "fp8")
    other = KVCacheManager(CFG, manager.cfg)
    for m in (manager, other):
        m.admit("a")
    x = torch.randn(16, CFG.hidden_size)
    with other.step({"a": 16}) as foreign:
        y = _compiled_run_writes_nothing(layer, x, foreign)
    assert (y == 0).all()
    step = manager.prepare_step({"a": 16})
    manager.release("a")
    assert (_compiled_run_writes_nothing(layer, x, step) == 0).all()
    manager.abort(step)
    manager.admit("a")
    step = manager.prepare_step({"a": 16})
    step.positions.fill_(-7)  # hand-edited: every token at a negative position
    y = _compiled_run_writes_nothing(layer, x, step)
    assert torch.isfinite(y).all() and (y == 0).all()
    manager.abort(step)


def test_compiled_forward_masks_tokens_past_max_context():
    """Issue 32: only the lower bound of live_tokens' position guard was tested. A hand-edited step
    whose tokens sit at max_context or past it (up to the largest int32) runs compiled as padding:
    nothing written (the window ring would take slot p % ring_size, the compressor states row p %
    rows), rows 0."""
    torch._dynamo.reset()
    layer, manager, _ = _setup(CSA, "fp8")
    manager.admit("a")
    step = manager.prepare_step({"a": 16})
    top = manager.cfg.max_context
    step.positions.copy_(torch.tensor([top, top + 1, top + 3, 2 * top - 1, 2**31 - 1] + list(range(top, top + 11)),
                                      dtype=torch.int32))
    y = _compiled_run_writes_nothing(layer, torch.randn(16, CFG.hidden_size), step)
    assert torch.isfinite(y).all() and (y == 0).all()
    manager.abort(step)


def test_released_request_in_a_compiled_step_is_skipped_and_the_others_run():
    torch._dynamo.reset()
    layer, manager, inputs = _setup(HCA, "bf16")
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        first = drivers.serve_schedule(compiled, manager, {"b": inputs["b"]}, [{"b": 100}])["b"]
        manager.admit("a")
        step = manager.prepare_step({"a": 8, "b": 31})
        manager.release("a")  # between planning and the forward
        x = torch.cat([inputs["a"][:8], inputs["b"][100:]])
        x = torch.cat([x, x.new_zeros(step.positions.shape[0] - x.shape[0], x.shape[1])])
        y = compiled(x, step)
        manager.commit(step)  # "a" is skipped
    assert (y[:8] == 0).all()
    assert manager.length == {"b": 131}
    _check_against_stateless(layer, {"b": inputs["b"]}, {"b": torch.cat([first, y[8:39]])}, "bf16")


# ---- the block tables on the device --------------------------------------------------------------
class _TableTraffic(TorchDispatchMode):
    """Counts the block-table elements (int32, 2-D) that copies read: clones, dtype / device copies,
    copy_ and index_copy_ sources."""

    def __init__(self):
        super().__init__()
        self.elements = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        aten = torch.ops.aten
        src = {aten.clone.default: 0, aten._to_copy.default: 0, aten.copy_.default: 1,
               aten.index_copy_.default: 3, aten.index_copy.default: 3}.get(func)
        if src is not None and args[src].dtype == torch.int32 and args[src].dim() == 2:
            self.elements += args[src].numel()
        return func(*args, **(kwargs or {}))


def _planned_traffic(manager, new):
    with _TableTraffic() as traffic:
        step = manager.prepare_step(new)
    manager.commit(step)
    return step, traffic.elements


def _manager(kind, device):
    """A manager of 16 requests and the length after which a request's next token opens a block
    (V4: CSA entry 64 at token 259, blocks of 16 entries; V4.1: ratio-1 entry 63 at token 63, blocks
    of 7), no other table changing."""
    if kind == "v4":
        cache_cfg = CacheConfig(max_requests=16, max_context=4096, max_step_tokens=512, block_size=16)
        return KVCacheManager(CFG, cache_cfg, device=device), 259
    cache_cfg = CacheConfig(max_requests=16, max_context=4096, max_step_tokens=512, block_size=7)
    return V41CacheManager(DSV41AttentionConfig.tiny(), cache_cfg, device=device), 63


@pytest.mark.parametrize("manager_kind", ["v4", "v41"])
@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_a_step_moves_only_the_block_table_rows_written_since_the_last_step(device, manager_kind):
    """16 requests; after the first step, a decode step in which one request opens a block moves one
    row per table that changed (host -> device), and a decode step that opens none moves nothing.
    Every step carries the same table tensors, equal to the planner's host tables."""
    manager, long = _manager(manager_kind, device)
    for r in range(16):
        manager.admit(r)
    first, _ = _planned_traffic(manager, {r: (long if r == 0 else 5) for r in range(16)})
    width = sum(t.shape[1] for t in manager.tables.values())
    before = {k: t.clone() for k, t in manager.tables.items()}
    step, moved = _planned_traffic(manager, {r: 1 for r in range(16)})
    changed = sum(int((before[k] != t).any(1).sum()) for k, t in manager.tables.items())
    # Before: the whole tables, 16 rows each, cloned (and, on a GPU, copied to it) every step.
    assert changed == 1 and moved <= 2 * (width + 1), moved
    step, moved = _planned_traffic(manager, {r: 1 for r in range(16)})
    assert moved == 0
    for kind, table in manager.tables.items():
        assert step.block_table(kind) is first.block_table(kind) is manager.device_tables[kind]
        assert step.block_table(kind).device.type == device and torch.equal(step.block_table(kind).cpu(), table)


def test_eager_forward_rejects_an_edited_or_replaced_block_table_and_the_next_step_restores_it():
    """The steps share the manager's device tables: an in-place edit of any row (even one the step
    does not read: the next step would) or a replaced table is rejected on the CPU, and the next
    planned step brings the edited row back. A row written since planning (a request released while
    the step is open) is not an edit."""
    layer, manager, inputs = _setup(CSA, "fp8")
    for rid in "abc":
        manager.admit(rid)
    with torch.no_grad():
        drivers.serve_schedule(layer, manager, {r: inputs[r] for r in "bc"}, [{"b": 100, "c": 9}])
    x = torch.randn(16, CFG.hidden_size)
    step = manager.prepare_step({"a": 16})
    table, b = step.block_table(CSA), manager.slot_of["b"]
    table[b, 0] += 1
    _rejected(layer, x, step, r"step: the compressed_sparse_attention block table is not what step \d+ was planned "
                              r"with \(edited by hand\?\)")
    manager.abort(step)
    step = manager.prepare_step({"a": 16})
    assert step.block_table(CSA) is table and torch.equal(table, manager.tables[CSA])
    step.block_table_csa = table.clone()
    _rejected(layer, x, step, r"step: its compressed_sparse_attention block table is not the manager's \(replaced by "
                              r"hand\?\)")
    step.block_table_csa = table
    c = manager.slot_of["c"]
    manager.release("c")  # its host row is cleared, the device row follows at the next step
    assert (table[c] >= 0).any() and (manager.tables[CSA][c] == -1).all()
    with torch.no_grad():
        layer(x, step)
    manager.commit(step)
    step = manager.prepare_step({"a": 1})
    assert torch.equal(step.block_table(CSA), manager.tables[CSA]) and (table[c] == -1).all()
    manager.abort(step)


def test_every_table_write_reaches_the_device_tables_at_the_next_step():
    """Fork, rewind, release and abort write host rows of requests that the next step does not run:
    that step's (device) tables equal the planner's all the same."""
    manager = KVCacheManager(CFG, CacheConfig(max_requests=4, max_context=1024, max_step_tokens=512, block_size=16,
                                              max_draft_tokens=5))

    def step_of(new, commit=True):
        step = manager.prepare_step(new)
        for kind, table in manager.tables.items():
            assert torch.equal(step.block_table(kind), table), (new, kind)
        (manager.commit if commit else manager.abort)(step)

    manager.admit("a")
    step_of({"a": 260})  # CSA: 65 entries, 5 blocks of 16
    manager.fork("a", "b", 256)  # shares 4 CSA blocks (no partial one), copies HCA's partial block
    step_of({"a": 1})
    manager.rewind("a", 4)  # back to 257: 64 entries, the fifth block dropped
    step_of({"b": 1})
    manager.release("b")
    step_of({"a": 1})
    manager.admit("c")
    step_of({"c": 300}, commit=False)
    step_of({"a": 1})


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_live_tokens_is_the_elementwise_rule(compiled):
    """live_tokens (the compiled forward's only guard) against its rule written out token by token:
    live iff 0 <= p < max_context, 0 <= request slot < slots and the slot's generation is the
    step's; a dead token gets request -1, and position 0 where p is outside [0, max_context). A live
    token sees (p + 1) // ratio entries (listed: at most width), a dead one none; ratio 0 (sliding):
    none."""
    from types import SimpleNamespace

    from dsv4ops.cache.step import live_tokens

    top, slots = 64, 3
    cache = SimpleNamespace(generations=torch.tensor([5, 6, 7], dtype=torch.int32),
                            cfg=SimpleNamespace(max_context=top), ran_step=torch.zeros(1, dtype=torch.int32))
    pos = [-2**31, -1, 0, 1, top - 2, top - 1, top, top + 1, 2 * top, 2**31 - 1]
    cases = [(p, r, g) for p in pos for r in (-1, 0, 2, slots) for g in (True, False)]
    step = SimpleNamespace(positions=torch.tensor([p for p, _, _ in cases], dtype=torch.int32),
                           req_slots=torch.tensor([r for _, r, _ in cases], dtype=torch.int32),
                           req_gens=torch.tensor([(5 + min(max(r, 0), slots - 1)) if g else 0 for _, r, g in cases],
                                                 dtype=torch.int32))
    fn = torch.compile(live_tokens, backend="aot_eager", fullgraph=True) if compiled else live_tokens
    torch._dynamo.reset()
    counts = ((4, 5), (128, 64), (0, 0))
    got = [t.tolist() for t in fn(step, cache, *counts)]
    for i, (p, r, g) in enumerate(cases):
        in_range = 0 <= p < top
        live = in_range and 0 <= r < slots and g
        want = [p if in_range else 0, r if live else -1]
        for ratio, width in counts:
            visible = (p + 1) // ratio if live and ratio else 0
            want += [visible, min(visible, width)]
        assert [row[i] for row in got] == want, (p, r, g)


def test_a_step_that_no_layer_ran_is_refused_at_commit_and_rolled_back():
    """Issue 52: `with manager.step({"a": 5}): pass` committed a step nothing wrote: the request moved
    on over positions that hold no entry, and its next output was all NaN. The commit raises, the
    step is rolled back (the request stays as before it), and the request then runs as if the step
    had never been planned. A step that only some of the attached layers ran is refused the same
    way (the others' pools would miss its tokens). A step of a manager without layers commits."""
    layer, manager, inputs = _setup(CSA, "bf16")
    other = testing.randomize_(DeepseekV4Attention(CFG, 2), seed=2)  # an HCA layer: the cache's formats
    other.attach_cache(manager)
    manager.admit("a")
    before = _bookkeeping(manager)
    with pytest.raises(RuntimeError, match=r"commit: step \d+ ran on 0 of the 2 attached layer caches \(each runs "
                                           r"every step\); it was rolled back \(abort\): its requests stay as before it"):
        with manager.step({"a": 5}):
            pass
    _same_bookkeeping(before, _bookkeeping(manager))
    assert manager.open_step is None and manager.length == {"a": 0}
    with pytest.raises(RuntimeError, match=r"commit: step \d+ ran on 1 of the 2 attached layer caches"):
        with manager.step({"a": 5}) as step:
            layer(_step_x(inputs, "a", 0, 5, step), step)
    _same_bookkeeping(before, _bookkeeping(manager))
    x = inputs["a"][:6]
    outs = []
    for start, n in ((0, 5), (5, 1)):
        with manager.step({"a": n}) as step:
            outs.append(layer(_step_x(inputs, "a", start, n, step), step)[:n])
            other(_step_x(inputs, "a", start, n, step), step)
    assert manager.length == {"a": 6}
    torch.testing.assert_close(torch.cat(outs), layer(x[None])[0], rtol=1e-4, atol=1e-4)

    bare = KVCacheManager(CFG, CacheConfig(max_requests=1, max_context=64, max_step_tokens=16))
    bare.admit("a")
    with bare.step({"a": 4}):
        pass
    assert bare.length == {"a": 4}

