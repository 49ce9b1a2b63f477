"""Speculative decoding and prefix sharing on the V4.1 stack (V41CacheManager: the same API as V4,
issue 14): verify steps with rewinds equal the accepted tokens alone through the stateless stack
oracle (exact and QAT formats); forks around the ratio-2 groups, the window and the page
boundaries of both ratios continue like fresh requests, with copies on write; draft blocks see
themselves both ways; the memory accounting of shared blocks.

Selection keeps every visible entry here (index_topk and the candidate pool above the entries of
the longest request), so the outputs are compared without tie-aware selections; the serving tests
(test_serving_v41) cover real selection."""

import drivers
import pytest
import torch

from dsv4ops import CacheFormats, testing
from dsv4ops.cache.config import CacheConfig
from dsv4ops.cache.v41 import V41CacheManager, memory
from dsv4ops.config_v41 import DSV41AttentionConfig
from dsv4ops.layers_v41 import DeepseekV41AttentionStack
from dsv4ops.quant import formats
from dsv4ops.reference.v41 import stack_attention

CFG = DSV41AttentionConfig.tiny(index_topk=128, candidate_topk_blocks=64)
NUMERICS = {"exact": CacheFormats.exact(), "qat": CacheFormats.v41()}
DRAFTS = 5
BLOCK = 7  # entries per page: ratio-1 pages end every 7 tokens, ratio-2 pages every 14


def _setup(mode, **capacity):
    stack = testing.randomize_(DeepseekV41AttentionStack(CFG, NUMERICS[mode]), seed=0)
    base = dict(max_requests=4, max_context=112, max_step_tokens=160, block_size=BLOCK, exact_dtype=torch.float32,
                max_draft_tokens=DRAFTS)
    manager = V41CacheManager(CFG, CacheConfig(**(base | capacity), formats=NUMERICS[mode]))
    stack.attach_cache(manager)
    return stack, manager


def _inputs(lengths: dict, seed: int) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {r: torch.randn(CFG.num_layers, n, CFG.hidden_size, generator=g) for r, n in lengths.items()}


def _check(stack, mode, seqs: dict, outs: dict, starts: dict | None = None, window_ends: dict | None = None):
    """outs[r] [layers, tokens from starts[r] on, hidden] against the fp64 stack oracle over the
    whole sequence seqs[r]; budget: the oracle's fp32 run (exact formats) or bf16 run (QAT: FP4 /
    MX4 codes flip between two computations that round differently upstream)."""
    p32 = dict(stack.named_parameters())
    p64 = {k: v.double() for k, v in p32.items()}
    lowp = torch.float32 if mode == "exact" else torch.bfloat16
    plow = {k: v if k.endswith(("sinks", "norm.weight")) else v.to(lowp) for k, v in p32.items()}
    for r, x in seqs.items():
        s = (starts or {}).get(r, 0)
        ends = None if window_ends is None else window_ends[r][None]
        with torch.no_grad():
            ref64 = stack_attention(p64, CFG, x[:, None].double(), NUMERICS[mode], window_ends=ends).y[:, 0, s:]
            low = stack_attention(plow, CFG, x[:, None].to(lowp), NUMERICS[mode], window_ends=ends).y[:, 0, s:]
        testing.assert_close_to_ref(outs[r], ref64, low, what=f"{mode} request {r}")


@pytest.mark.parametrize("mode", sorted(NUMERICS))
def test_verify_steps_with_rewinds_equal_the_accepted_tokens_alone(mode):
    stack, manager = _setup(mode)
    lengths = {"a": 64, "b": 29, "c": 9}
    inputs = _inputs(lengths, 1)
    schedule = drivers.speculative_schedule(lengths, DRAFTS, seed=2, prefill={"a": 30})
    assert sum(n - kept for step in schedule for n, kept in step.values()) > 10
    with torch.no_grad():
        outs = drivers.serve_speculative(stack, manager, inputs, schedule, torch.Generator().manual_seed(3))
    assert manager.length == lengths
    assert stack.cache.state_1.shape[1] == 2 - 1 + DRAFTS  # ratio 2: span 2, slack for 5 drafts
    _check(stack, mode, inputs, outs)


FORKS = (1, 2, 3, 6, 7, 8, 13, 14, 15, 16, 17)  # ratio 2 (1..3), ratio-1 page (6..8), ratio-2 page, window 16
STOPS = (1, 3, 8, 15, 17)
TAIL = (4, 1, 3)


def test_forks_continue_like_fresh_requests():
    """The parent forks 11 children at ratio-2, page and window boundaries; the child forked at 14
    takes back 2 tokens, into blocks it shares with the parent (both ratios: copies on write);
    everyone then runs together, the parent released midway. Each equals the oracle over its whole
    sequence; releasing everyone frees every block."""
    stack, manager = _setup("qat", max_requests=12, max_context=40, max_step_tokens=60)
    x = _inputs({"p": 25}, 4)["p"]
    tails = _inputs({f"f{n}": sum(TAIL) for n in FORKS}, 5)
    parent, done = [], 0
    with torch.no_grad():
        for stop in STOPS:
            parent.append(drivers.serve_speculative(stack, manager, {"p": x[:, done:]}, [{"p": (stop - done,) * 2}],
                                                    torch.Generator())["p"])
            done = stop
            for n in FORKS:
                if n <= stop and f"f{n}" not in manager.slot_of:
                    manager.fork("p", f"f{n}", n)
        manager.rewind("f14", 2)
        starts = {c: int(c[1:]) for c in tails} | {"f14": 12}
        shared = {m: [int(b) for b in manager.tables[m][manager.slot_of["f14"]][:2] if b >= 0] for m in (1, 2)}
        usage = manager.usage()
        _check_usage(manager, usage)
        assert usage["shared_blocks"][1] > 0 and usage["shared_blocks"][2] > 0
        outs = {c: [] for c in tails}
        for i, n in enumerate(TAIL):
            new = {c: (n, n) for c in tails} | ({"p": (n, n)} if i < 2 else {})
            at = sum(TAIL[:i])
            ys = drivers.serve_speculative(stack, manager, {c: t[:, at:] for c, t in tails.items()}
                                           | {"p": x[:, done:]}, [new], torch.Generator())
            for c in tails:
                outs[c].append(ys[c])
            if i < 2:
                parent.append(ys["p"])
                done += n
            if i == 1:
                manager.release("p")
        f14 = {m: manager.tables[m][manager.slot_of["f14"]][:2].tolist() for m in (1, 2)}
    assert f14[1][1] != shared[1][1] and f14[2][0] != shared[2][0]  # the written blocks became private copies
    seqs = {c: torch.cat([x[:, :starts[c]], t], 1) for c, t in tails.items()}
    _check(stack, "qat", {"p": x[:, :done], **seqs},
           {"p": torch.cat(parent, 1), **{c: torch.cat(v, 1) for c, v in outs.items()}}, starts=starts)
    for c in tails:
        manager.release(c)
    for alloc in manager.allocators.values():
        assert sorted(alloc.free) == list(range(len(alloc.refs))) and not any(alloc.refs)


def _check_usage(manager, usage):
    """usage() against a count of the block tables, the formats' page bytes of each ratio's pools
    (compressed entries and index keys of its sources) and memory()'s fixed bytes per request."""
    num, cfg = manager.cfg.formats, manager.cfg
    block_bytes = {m: 0 for m in manager.tables}
    for role in CFG.roles:
        if role.owns_compressor:
            block_bytes[role.ratio] += formats.get(num.comp).page_bytes(cfg.block_size)
            if role.owns_index_keys:
                block_bytes[role.ratio] += formats.get(num.index).page_bytes(cfg.block_size)
    expect = unshared = len(manager.slot_of) * memory(CFG, cfg)["fixed_bytes_per_request"]
    for m, table in manager.tables.items():
        ids = table[table >= 0]
        uniq, count = ids.unique(return_counts=True)
        assert (usage["blocks"][m], usage["block_refs"][m]) == (uniq.numel(), ids.numel())
        assert usage["shared_blocks"][m] == int((count > 1).sum())
        expect += uniq.numel() * block_bytes[m]
        unshared += ids.numel() * block_bytes[m]
    assert (usage["bytes"], usage["bytes_without_sharing"]) == (expect, unshared)


def test_draft_blocks_see_themselves_both_ways():
    stack, manager = _setup("exact")
    x = _inputs({"a": 40, "b": 30}, 6)
    plan = [({"a": 12, "b": 10}, None), ({"a": 5, "b": 3}, {"a": 5}), ({"a": 6, "b": 6}, {"a": 2, "b": 6}),
            ({"a": 5, "b": 1}, {"a": 5})]
    ends = {r: torch.arange(t.shape[1]) for r, t in x.items()}
    done, outs = {"a": 0, "b": 0}, {"a": [], "b": []}
    manager.admit("a")
    manager.admit("b")
    with torch.no_grad():
        for new, blocks in plan:
            with manager.step(new, blocks) as step:
                xs = torch.cat([x[r][:, done[r]:done[r] + n] for r, n in new.items()], 1)
                pad = step.positions.shape[0] - xs.shape[1]
                ys = stack(torch.cat([xs, xs.new_zeros(xs.shape[0], pad, xs.shape[2])], 1), step)
            i = 0
            for r, n in new.items():
                outs[r].append(ys[:, i:i + n])
                b = (blocks or {}).get(r, 0)
                ends[r][done[r] + n - b:done[r] + n] = done[r] + n - 1
                done[r] += n
                i += n
    seqs = {r: x[r][:, :done[r]] for r in x}
    _check(stack, "exact", seqs, {r: torch.cat(v, 1) for r, v in outs.items()},
           window_ends={r: ends[r][:done[r]] for r in x})
