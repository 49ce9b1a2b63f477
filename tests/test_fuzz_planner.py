"""Hypothesis fuzzing of the step planner (KVCacheManager): random admits, releases and steps
(counts from 1 to a quarter of a 1M-token context, zero, negative, bool, float, unknown requests,
empty steps, steps past the context or the step capacity), each step committed or aborted, against
a plain model of what every request holds. After every rule: rejected calls changed nothing, a
planned step lists exactly its requests' next positions (and carries the device block tables, equal
to the planner's), and the block tables own exactly the blocks of the committed lengths, with no
block owned twice or both owned and free."""

import math

import hypothesis.strategies as st
import pytest
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from dsv4ops import DSV4AttentionConfig
from dsv4ops.cache import CacheConfig, CacheFullError, KVCacheManager
from dsv4ops.config import CSA, HCA

MODEL = DSV4AttentionConfig.tiny()
# 1M positions per request, steps of up to 2^18 tokens (a request reaches 1M in four steps), and a
# compressed pool sized for 1.5 requests of 1M (max_total_tokens): the block supply runs out.
CACHE = CacheConfig(max_requests=3, max_context=1 << 20, max_step_tokens=1 << 18,
                    max_total_tokens=3 << 19).for_model(MODEL)  # the formats and block size a manager resolves
IDS = ["a", "b", "c", "d"]
# Valid counts: decode-sized, around block edges (token 259 closes CSA entry 64, the first of a
# request's second block of 64; token 8319 HCA entry 64), or anything up to a step; bad ones: zero,
# negative, bool, float, too many.
COUNTS = st.one_of(st.integers(1, 3), st.sampled_from([64, 255, 256, 259, 260, 261, 8191, 8192, 8319, 8320, 8321]),
                   st.integers(1, 1 << 18))
BAD_COUNTS = st.sampled_from([0, -2, True, 2.5, (1 << 18) + 1])


def _snapshot(m: KVCacheManager):
    return ({k: t.clone() for k, t in m.tables.items()}, dict(m.length), dict(m.slot_of), list(m.free_slots),
            {k: list(a.free) for k, a in m.allocators.items()}, list(m.generation))


def _same(a, b) -> bool:
    return all(torch.equal(a[0][k], b[0][k]) for k in a[0]) and a[1:] == b[1:]


class Planner(RuleBasedStateMachine):
    def __init__(self):
        super().__init__()
        self.m = KVCacheManager(MODEL, CACHE)
        self.lengths: dict = {}  # the model: committed tokens of each admitted request

    @rule(rid=st.sampled_from(IDS))
    def admit(self, rid):
        before = _snapshot(self.m)
        if rid in self.lengths:
            with pytest.raises(ValueError, match=r"is already admitted"):
                self.m.admit(rid)
        elif len(self.lengths) == CACHE.max_requests:
            with pytest.raises(CacheFullError, match=r"all 3 request slots are in use"):
                self.m.admit(rid)
        else:
            slot = self.m.admit(rid)
            assert 0 <= slot < CACHE.max_requests and self.m.generation[slot] != before[5][slot]
            self.lengths[rid] = 0
            return
        assert _same(before, _snapshot(self.m))

    @rule(rid=st.sampled_from(IDS))
    def release(self, rid):
        if rid not in self.lengths:
            before = _snapshot(self.m)
            with pytest.raises(KeyError, match=r"is not admitted"):
                self.m.release(rid)
            assert _same(before, _snapshot(self.m))
            return
        slot = self.m.slot_of[rid]
        self.m.release(rid)
        del self.lengths[rid]
        assert all((t[slot] == -1).all() for t in self.m.tables.values())

    @precondition(lambda self: self.lengths)
    @rule(data=st.data(), commit=st.booleans())
    def step(self, data, commit):
        """A step of admitted requests (valid counts; it may still pass the context, the step or the
        block supply)."""
        new = data.draw(st.dictionaries(st.sampled_from(sorted(self.lengths)), COUNTS, min_size=1, max_size=3))
        self._step(new, commit)

    @rule(new=st.dictionaries(st.sampled_from(IDS), st.one_of(COUNTS, BAD_COUNTS), max_size=3), commit=st.booleans())
    def any_step(self, new, commit):
        """Any mapping: empty, unknown requests, bad counts."""
        self._step(new, commit)

    def _step(self, new, commit):
        before = _snapshot(self.m)
        expected = self._expected_error(new)
        if expected is not None:
            with pytest.raises(expected[0], match=expected[1]):
                self.m.prepare_step(new)
            assert _same(before, _snapshot(self.m)) and self.m.open_step is None
            return
        step = self.m.prepare_step(new)
        self._check_step(step, new)
        if commit:
            self.m.commit(step)
            for rid, n in new.items():
                self.lengths[rid] += n
        else:
            self.m.abort(step)
            after = _snapshot(self.m)
            assert _same((before[0], *before[1:5], after[5]), after)  # only the generations moved
        with pytest.raises(ValueError, match=r"expected the open step \(none is open\)"):
            self.m.commit(step)  # a closed step cannot be committed again

    def _expected_error(self, new):
        """(exception, message) the planner must raise for `new`, in its order of checks, or None."""
        if not new:
            return ValueError, r"expected at least one request, got an empty mapping"
        for rid, n in new.items():
            if rid not in self.lengths:
                return KeyError, r"is not admitted"
            if isinstance(n, bool) or not isinstance(n, int):
                return TypeError, r"expected an int token count"
            if n < 1:
                return ValueError, r"expected >= 1 token"
            if n > CACHE.request_step_tokens:
                return ValueError, r"tokens per request per step"
            if self.lengths[rid] + n > CACHE.max_context:
                return ValueError, r"pass max_context 1048576"
        if sum(new.values()) > CACHE.max_step_tokens:
            return ValueError, r"pass max_step_tokens"
        for kind, ratio in ((CSA, MODEL.csa_ratio), (HCA, MODEL.hca_ratio)):
            need = sum(self._blocks(self.lengths[r] + n, ratio) - self._blocks(self.lengths[r], ratio)
                       for r, n in new.items())
            if need > len(self.m.allocators[kind].free):
                return CacheFullError, rf"the {kind} pool needs {need} more blocks"
        return None

    @staticmethod
    def _blocks(length: int, ratio: int) -> int:
        return math.ceil(length // ratio / CACHE.block_size)

    def _check_step(self, step, new):
        # The step's tables are the device copies, up to date with the planner's after any history.
        for kind in (CSA, HCA):
            assert step.block_table(kind) is self.m.device_tables[kind]
            assert torch.equal(step.block_table(kind), self.m.tables[kind]), kind
        total = sum(new.values())
        bucket = min(b for b in CACHE.buckets if b >= total)
        assert step.positions.shape == (bucket,)
        i = 0
        for rid, n in new.items():
            start, slot = self.lengths[rid], self.m.slot_of[rid]
            assert torch.equal(step.positions[i:i + n], torch.arange(start, start + n, dtype=torch.int32))
            assert (step.req_slots[i:i + n] == slot).all()
            assert (step.req_gens[i:i + n] == self.m.generation[slot]).all()
            for kind, ratio in ((CSA, MODEL.csa_ratio), (HCA, MODEL.hca_ratio)):
                pos = step.positions[i:i + n].long()
                closes = (pos + 1) % ratio == 0
                slots = step.entry_slots(kind)[i:i + n].long()
                assert (slots[~closes] == -1).all()
                # A closing token stores entry w = p // ratio in the block its table row maps it to.
                w = pos[closes] // ratio
                table = self.m.tables[kind][slot].long()
                assert (table[w // CACHE.block_size] >= 0).all(), (kind, "a closing token's block is not allocated")
                assert torch.equal(slots[closes], table[w // CACHE.block_size] * CACHE.block_size
                                   + w % CACHE.block_size)
            i += n
        assert (step.req_slots[i:] == -1).all()

    @invariant()
    def bookkeeping_matches_the_model(self):
        m = self.m
        assert m.open_step is None and m.length == self.lengths and set(m.slot_of) == set(self.lengths)
        assert len(set(m.slot_of.values())) == len(m.slot_of)
        assert sorted(m.free_slots + list(m.slot_of.values())) == list(range(CACHE.max_requests))
        for kind, ratio in ((CSA, MODEL.csa_ratio), (HCA, MODEL.hca_ratio)):
            owned = []
            for rid, length in self.lengths.items():
                row = m.tables[kind][m.slot_of[rid]]
                n = self._blocks(length, ratio)
                assert (row[:n] >= 0).all() and (row[n:] == -1).all(), (kind, rid, length)
                owned += row[:n].tolist()
            free = m.allocators[kind].free
            assert len(set(owned)) == len(owned) and not set(owned) & set(free)
            assert sorted(owned + free) == list(range(len(owned) + len(free)))


TestPlanner = Planner.TestCase
TestPlanner.settings = settings(max_examples=40, stateful_step_count=25, deadline=None,
                                suppress_health_check=[HealthCheck.too_slow])
