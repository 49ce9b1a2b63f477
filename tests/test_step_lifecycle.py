"""The step lifecycle (plan -> forward -> commit, or abort on failure) and the step's identity
(manager id, slot generations): a failed forward leaves every request as it was, eager and
compiled; a foreign, stale, closed or hand-edited step writes nothing. Issue 10."""

import pytest
import torch
from test_serving import CFG, LENGTHS, _check_against_stateless, _pool_bytes, _setup

from dsv4ops import layers, testing
from dsv4ops.cache import KVCacheManager
from dsv4ops.config import CSA, HCA, SLIDING

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
        outs.append(testing.serve_schedule(layer, manager, x, [{"a": FIRST}])["a"])
        before, states = _bookkeeping(manager), _states(layer)
        with monkeypatch.context() as m:
            _fail_after_the_caches_are_written(m)
            with pytest.raises(Injected), manager.step({"a": CHUNK}) as step:
                layer(_step_x(inputs, "a", FIRST, CHUNK, step), step)
        _same_bookkeeping(before, _bookkeeping(manager))
        for name, t in _states(layer).items():
            assert testing.bytes_equal(t, states[name]), f"{name} restored"
        assert manager.open_step is None
        # The same chunk again, then decode to the end: as if the failure never happened.
        rest = [{"a": CHUNK}] + [{"a": 1}] * DECODE
        outs.append(testing.serve_schedule(layer, manager, {"a": inputs["a"][FIRST:]}, rest)["a"])
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
        outs.append(testing.serve_schedule(compiled, manager, {"a": inputs["a"]}, [{"a": FIRST}])["a"])
        before, states = _bookkeeping(manager), _states(layer)
        with pytest.raises(Injected), manager.step({"a": CHUNK}) as step:
            compiled(_step_x(inputs, "a", FIRST, CHUNK, step), step)
            raise Injected("the next layer failed")
        _same_bookkeeping(before, _bookkeeping(manager))
        for name, t in _states(layer).items():
            assert testing.bytes_equal(t, states[name]), f"{name} restored"
        outs.append(testing.serve_schedule(compiled, manager, {"a": inputs["a"][FIRST:]}, [{"a": CHUNK}])["a"])
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
    manager.commit(step)
    assert manager.length == {"a": 70, "b": 3} and manager.open_step is None
    decode = manager.prepare_step({"a": 1})
    with pytest.raises(ValueError, match=r"commit: expected the open step \(\d+\) of manager \d+, got step \d+"):
        manager.commit(step)
    manager.commit(decode)


def test_only_chunks_that_wrap_a_state_ring_are_backed_up():
    """Decode steps and short chunks copy nothing; a chunk that can overwrite a state row still
    needed after a rollback copies its request's rows (per ring, read from the buffer's row count)."""
    layer, manager, inputs = _setup(HCA, "bf16")
    with torch.no_grad():
        testing.serve_schedule(layer, manager, {"a": inputs["a"]}, [{"a": FIRST}])
    for new, backed_up in (({"a": 1}, False), ({"a": 28}, False), ({"a": 29}, True)):
        # From 100, the first HCA entry closes at 127 and pools 0..127: 29 tokens (100..128) rewrite row 0.
        step = manager.prepare_step(new)
        assert bool(manager._open.backups) == backed_up, new
        manager.abort(step)


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


def test_released_request_in_a_compiled_step_is_skipped_and_the_others_run():
    torch._dynamo.reset()
    layer, manager, inputs = _setup(HCA, "bf16")
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    with torch.no_grad():
        first = testing.serve_schedule(compiled, manager, {"b": inputs["b"]}, [{"b": 100}])["b"]
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
