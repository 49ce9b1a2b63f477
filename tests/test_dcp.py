"""Decode context parallelism on 2 gloo processes (CPU): compressed entries (and V4.1 index keys)
sharded over the ranks by block, the indexer's top-k merged exactly over the ranks (or per rank,
"union"), each rank's partial attention merged with the sink by dsv4::attn_merge. Every V4 layer
kind and the V4.1 stack equal the single-process layer through a serving scenario (mixed prefill /
decode steps, a rewound verify step, a fork with copy on write); each rank's pools hold about half
the blocks; ranks that disagree on a step fail clearly with nothing changed. Issue 31."""

import copy

import pytest
import torch
import torch.distributed as dist

import dist_cases
import multiproc
from dsv4ops import CacheFormats, DeepseekV4Attention, DSV4AttentionConfig, layers, reference, testing
from dsv4ops.cache import CacheConfig, KVCacheManager, V41CacheManager
from dsv4ops.cache.config import pool_blocks
from dsv4ops.config import CSA, HCA
from dsv4ops.config_v41 import DSV41AttentionConfig
from dsv4ops.layers_v41 import DeepseekV41AttentionStack
from dsv4ops.reference.v41 import stack_attention

# HCA ratio 16: the scenario's requests close up to 8 HCA entries; index_topk 8 < the 34 CSA entries
# of the longest request (a real selection). Blocks of 4 entries: both ranks own blocks of every
# request past 4 entries, the fork's point (100 // 4 = 25 entries) falls inside a block.
CFG = DSV4AttentionConfig.tiny(hca_ratio=16, compress_ratios=(0, 4, 16, 4), index_topk=8)
MODES = {"exact": CacheFormats.exact(), "fp8": CacheFormats.v4()}
BLOCK = 4


def _cache(fmts, **kw):
    return CacheConfig(formats=fmts, exact_dtype=torch.float32, max_requests=3, max_context=160, max_step_tokens=96,
                       block_size=BLOCK, max_draft_tokens=dist_cases.MAX_DRAFT, **kw)


def _serve(layer, manager, record):
    layer.attach_cache(manager)
    rows = dist_cases.inputs(CFG.hidden_size, seed=7)
    sels = {r: [] for r in rows}

    def on_step(step, spec):
        if record:
            for r, s in dist_cases.kept_rows(record.pop(), spec).items():
                sels[r].append(s)

    with torch.no_grad():
        outs = dist_cases.serve(layer, manager, rows, on_step=on_step)
    return rows, outs, {r: torch.cat(v) for r, v in sels.items() if v}


def _record_single():
    log = []
    original = layers._select

    def wrapped(*args, **kwargs):
        idx = original(*args, **kwargs)
        step, cache = args[3], args[7]
        log.append(testing._entries_of(step, idx, cache.cfg.block_size))
        return idx

    return log, original, wrapped


def _v4_body(rank, group, li, mode, topk):
    numerics = MODES[mode]
    full = testing.randomize_(DeepseekV4Attention(CFG, li, formats=numerics), seed=li)
    sharded = copy.deepcopy(full)
    log1, log2 = [], []
    original, original_dcp = layers._select, layers._select_dcp

    def select(*args):
        idx = original(*args)
        log1.append(testing._entries_of(args[3], idx, BLOCK))
        return idx

    def select_dcp(*args):
        out = original_dcp(*args)
        log2.append(out[2])
        return out

    layers._select, layers._select_dcp = select, select_dcp
    try:
        rows, single, sel1 = _serve(full, KVCacheManager(CFG, _cache(numerics)), log1)
        manager = KVCacheManager(CFG, _cache(numerics), dcp_group=group, topk=topk)
        _, got, sel2 = _serve(sharded, manager, log2)
    finally:
        layers._select, layers._select_dcp = original, original_dcp
    # Each rank's compressed pools: its share of the blocks (about half).
    if full.compressor is not None:
        ratio = CFG.compress_ratio(li)
        assert sharded.cache.comp.shape[0] == pool_blocks(manager.cfg, ratio, 2) < full.cache.comp.shape[0]
    fork = next(op for op in dist_cases.PLAN if op[0] == "fork")
    _, parent, child, at = fork
    single = dict(single, **{child: torch.cat([single[parent][:at], single[child]])})
    got = dict(got, **{child: torch.cat([got[parent][:at], got[child]])})
    for s in (sel1, sel2):
        if s:
            s[child] = torch.cat([s[parent][:at], s[child]])
    for r, x in rows.items():
        if topk == "union" and sel2:
            # Union: the oracle fed every rank's own top-k together (up to 2 x index_topk entries).
            mine = sel2[r]
            every = [torch.empty_like(mine) for _ in range(2)]
            dist.all_gather(every, mine, group=group)
            union = torch.cat(every, 1)
            p64 = {k: v.detach().double() for k, v in full.named_parameters()}
            p32 = {k: v.detach() for k, v in full.named_parameters()}
            ref64 = reference.attention(p64, CFG, li, x[None].double(), full.numerics, topk=union[None])[0]
            low = reference.attention(p32, CFG, li, x[None], full.numerics, topk=union[None])[0]
            testing.assert_close_to_ref(got[r], ref64, low, what=f"rank {rank} union request {r}")
            continue
        err, budget = testing.assert_matches_oracle(full, x, got[r], sel2.get(r), what=f"rank {rank} request {r}")
        if sel1 and not torch.equal(sel1[r].sort(1).values, sel2[r].sort(1).values):
            continue  # a near-tie picked the other way (checked by score above): outputs may differ there
        diff = (got[r] - single[r]).abs().max().item()
        band = torch.finfo(torch.float32).eps * single[r].abs().max().item()
        assert diff <= 2 * budget + band, f"request {r}: |DCP - one process| {diff:.3e} > 2 x {budget:.3e}"
    return {r: v for r, v in got.items()}


@pytest.mark.parametrize("li,mode,topk", [(1, "exact", "exact"), (2, "exact", "exact"), (1, "fp8", "exact"),
                                          (2, "fp8", "exact"), (1, "exact", "union")])
def test_dcp_layer_equals_one_process(li, mode, topk):
    outs = multiproc.run(_v4_body, li, mode, topk)
    for r in outs[0]:  # both ranks hold the whole output
        assert torch.equal(outs[0][r], outs[1][r])


# ---- V4.1 ---------------------------------------------------------------------------------------
CFG41 = DSV41AttentionConfig.tiny()
# Exact pools: 4-entry blocks (whole candidate blocks of 4); QAT: 52 (mxfp4_68 pages 52 x 68 B in
# 3584 B; 52 = 13 candidate blocks): the ratio-2 sources' 69 entries of request a span 2 blocks.
BLOCK41 = {"exact": 4, "qat": 52}


def _v41_body(rank, group, mode):
    numerics = CacheFormats.exact() if mode == "exact" else CacheFormats.v41()
    full = testing.randomize_(DeepseekV41AttentionStack(CFG41, numerics), seed=5)
    sharded = copy.deepcopy(full)
    cache = CacheConfig(max_requests=3, max_context=160, max_step_tokens=96, block_size=BLOCK41[mode],
                        exact_dtype=torch.float32, max_draft_tokens=dist_cases.MAX_DRAFT, formats=numerics)
    rows, single, topk1, pools1 = dist_cases.serve_v41(full, V41CacheManager(CFG41, cache), BLOCK41[mode])
    manager = V41CacheManager(CFG41, cache, dcp_group=group)
    _, got, topk2, pools2 = dist_cases.serve_v41(sharded, manager, BLOCK41[mode])
    assert sharded.cache.comp_5.shape[0] == pool_blocks(cache, 1, 2) < full.cache.comp_5.shape[0]
    lowp = torch.float32 if mode == "exact" else torch.bfloat16
    budgets = dist_cases.check_v41_oracle(full, numerics, lowp, rows, got, topk2, pools2, f"rank {rank}")
    for r in rows:
        same = torch.equal(pools1[r], pools2[r]) and all(
            torch.equal(topk1[r][k].sort(1).values, topk2[r][k].sort(1).values) for k in topk1[r])
        if same:  # the one-process run selected the same: the outputs agree to within the budget
            diff = (got[r] - single[r]).abs().max().item()
            assert diff <= 2 * budgets[r] + 1e-6 * single[r].abs().max().item(), \
                f"request {r}: |DCP - one process| {diff:.3e}"
    return {r: v for r, v in got.items()}


@pytest.mark.parametrize("mode", ["exact", "qat"])
def test_dcp_v41_stack_equals_one_process(mode):
    outs = multiproc.run(_v41_body, mode)
    for r in outs[0]:
        assert torch.equal(outs[0][r], outs[1][r])


# ---- bad use ------------------------------------------------------------------------------------
def _state(manager):
    return (dict(manager.length), dict(manager.slot_of), {k: list(a.free) for k, a in manager.allocators.items()},
            {k: t.clone() for k, t in manager.tables.items()}, {k: t.clone() for k, t in manager.device_tables.items()},
            manager.open_step)


def _same(a, b) -> bool:
    return a[:3] == b[:3] and all(torch.equal(a[3][k], b[3][k]) and torch.equal(a[4][k], b[4][k]) for k in a[3]) \
        and a[5] is b[5]


def _disagree_body(rank, group):
    manager = KVCacheManager(CFG, _cache(CacheFormats.exact()), dcp_group=group)
    layer = DeepseekV4Attention(CFG, 1)
    layer.attach_cache(manager)
    manager.admit("a")
    with manager.step({"a": 40}) as step:
        layer(torch.zeros(step.positions.shape[0], CFG.hidden_size), step)
    before = _state(manager)
    def match(field):
        return rf"prepare_step: the ranks of the context-parallel group disagree \({field}: rank 0 .*, rank 1 .*\); " \
               rf"ranks \[{rank}\] agree with rank {rank}, of 2; every rank must build the same managers"

    # Different token counts; a request only one rank knows (its own check would raise on that rank
    # alone, and the other would wait in the next collective): every rank raises the same error.
    for new in ({"a": 5 + rank}, {"a": 1} if rank else {"zz": 1}, {"a": 1, "b": 1} if rank else {"b": 1, "a": 1}):
        with pytest.raises(RuntimeError, match=match("new_tokens")):
            manager.prepare_step(new)
        assert _same(_state(manager), before)
    # A speculative step's draft blocks (each valid alone): another block size, or a block on one
    # rank only, would give the ranks different window ends for the same tokens.
    for blocks in ({"a": 3 if rank else 2}, {"a": 3} if rank else None):
        with pytest.raises(RuntimeError, match=match("blocks")):
            manager.prepare_step({"a": 3}, blocks)
        assert _same(_state(manager), before)
    if rank == 1:  # a history one rank does not share (an extra request)
        manager.admit("only here")
    with pytest.raises(RuntimeError, match=match("slots")):
        manager.prepare_step({"a": 1})
    if rank == 1:
        manager.release("only here")
    with manager.step({"a": 1}) as step:  # the ranks agree again: the step runs
        assert step.positions.shape[0] == 1
        layer(torch.zeros(1, CFG.hidden_size), step)
    # Both process groups at once; a top-k mode that does not exist; V4.1 blocks that split a
    # candidate block.
    with pytest.raises(NotImplementedError, match="a context-parallel cache for a tensor-parallel layer"):
        DeepseekV4Attention(CFG, 1, process_group=group).attach_cache(manager)
    # Batch-invariant serving: the ranks' merge sums in an order that follows the step's size.
    invariant = KVCacheManager(CFG, _cache(CacheFormats.exact(), batch_invariant=True), dcp_group=group)
    fresh = DeepseekV4Attention(CFG, 1)
    with pytest.raises(NotImplementedError, match=r"manager: CacheConfig\(batch_invariant=True\) is not supported with "
                                                  r"tensor or context parallelism"):
        fresh.attach_cache(invariant)
    assert fresh._modules.get("cache") is None and not list(invariant._caches)
    from dsv4ops.integrations.transformers import patch_model

    with pytest.raises(NotImplementedError, match=r"patch_model: process_group \(tensor parallel\) and dcp_group"):
        patch_model(torch.nn.Module(), process_group=group, dcp_group=group)
    with pytest.raises(ValueError, match=r"topk: expected one of \('exact', 'union'\), got 'all'"):
        KVCacheManager(CFG, _cache(CacheFormats.exact()), dcp_group=group, topk="all")
    with pytest.raises(ValueError, match=r"block_size: context parallelism keeps each candidate block of 4 entries on "
                                         r"one rank; expected a multiple of 4, got 6"):
        V41CacheManager(CFG41, CacheConfig(max_requests=2, max_context=64, max_step_tokens=16, block_size=6,
                                           exact_dtype=torch.float32, formats=CacheFormats.exact()), dcp_group=group)
    return True


def test_dcp_ranks_that_disagree_fail_clearly_and_change_nothing():
    assert multiproc.run(_disagree_body) == [True, True]


# ---- compiled ------------------------------------------------------------------------------------
def _compiled_body(rank, group):
    """The serving step of a CSA and an HCA layer compiled whole (fullgraph): the graph holds the
    all-gathers and dsv4::attn_merge; outputs equal eager. (The V4.1 stack: the GPU tier.)"""
    from torch._dynamo.backends.common import aot_autograd

    graphs = []

    def record(gm, example_inputs):
        graphs.append([str(n.args[0] if "auto_functionalized" in str(n.target) else n.target)
                       for n in gm.graph.nodes if n.op == "call_function"])
        return gm.forward

    backend = aot_autograd(fw_compiler=record)
    for li in (1, 2):
        layer = testing.randomize_(DeepseekV4Attention(CFG, li), seed=li)
        manager = KVCacheManager(CFG, _cache(CacheFormats.exact()), dcp_group=group)
        layer.attach_cache(manager)
        torch._dynamo.reset()
        fn = torch.compile(layer, fullgraph=True, backend=backend)
        g = torch.Generator().manual_seed(li)
        manager.admit("r")
        with torch.no_grad():
            for n in (70, 1, 1):
                with manager.step({"r": n}) as step:
                    x = torch.randn(step.positions.shape[0], CFG.hidden_size, generator=g)
                    assert torch.equal(fn(x, step), layer(x, step))
    # One graph per layer and bucket (96 and 1): the step whole, with its all-gathers: the CSA
    # layer's two (selection, attention), the HCA layer's one (attention).
    assert len(graphs) == 4
    for names, gathers in zip(graphs, (2, 2, 1, 1)):
        assert sum("attn_merge" in n for n in names) >= 1
        assert sum("all_gather_into_tensor" in n for n in names) == gathers, names
    return True


def test_dcp_step_compiles_into_one_graph_with_its_collectives():
    assert multiproc.run(_compiled_body) == [True, True]


def _patch_body(rank, group):
    import test_transformers as T

    base = T._model()
    cache = CacheConfig(max_requests=4, max_context=512, max_step_tokens=512, formats=CacheFormats.exact(),
                        exact_dtype=torch.float32, block_size=4)
    patched = T._patched(base, cache, dcp_group=group)
    manager = patched.model.layers[0].self_attn.cache_manager
    assert manager.dcp.size == 2 and all(layer.self_attn.tp_group is None for layer in patched.model.layers)
    tokens, _ = T._against_transformers(base, patched, T._prompts(2), what=f"rank {rank} generate")
    return tokens


def test_dcp_patch_model_generates_like_transformers():
    """patch_model(..., dcp_group=group): the cache's entries shared by the
    ranks (blocks of 4 entries), every rank generates the tokens transformers' model does."""
    tokens = multiproc.run(_patch_body)
    assert torch.equal(tokens[0], tokens[1])


def test_dcp_demo_under_torchrun():
    """`torchrun --nproc-per-node 2 -m dsv4ops --parallel dcp`: every request within its fp64-oracle
    budget, rank 0 printing."""
    out = dist_cases.torchrun_demo("dcp")
    assert "dcp over 2 processes" in out and out.count("within budget") == 2, out


def test_the_managers_group_is_dcp_group():
    """A layer's process_group is its tensor-parallel group, a manager's group is dcp_group: the old
    spellings (a manager's process_group=, patch_model's parallel=) name the new ones."""
    import test_transformers as T

    cache = _cache(CacheFormats.exact())
    with pytest.raises(TypeError, match=r"KVCacheManager: process_group was renamed dcp_group=: the "
                                        r"decode-context-parallel group \(a layer's process_group is its tensor-parallel"):
        KVCacheManager(CFG, cache, process_group=None)
    with pytest.raises(TypeError, match=r"V41CacheManager: process_group was renamed dcp_group="):
        V41CacheManager(CFG41, cache, process_group=None)
    with pytest.raises(TypeError, match=r"patch_model: parallel= was removed: pass process_group=group for tensor "
                                        r"parallel, dcp_group=group for decode context parallel"):
        T._patched(T._model(), parallel="dcp")


def _bench_body(rank, group):
    from dsv4ops.bench import parallel

    rows = parallel.run(model=CFG, tp_cases=((2, 256),), dcp_cases=((1, 4096),), indexer_cases=((2, 256),))
    return rows


def test_parallel_bench_runs_on_two_processes():
    """The 2-GPU bench's code path at tiny dims on 2 gloo processes (host-clock times): every part
    gives its rows; a rank's compressed pools are smaller than one process's."""
    rows = multiproc.run(_bench_body)[0]
    parts = [r["part"] for r in rows]
    assert parts == ["TP2", "TP2", "DCP2", "DCP2", "indexer"], parts
    for r in rows:
        assert all(r[k] > 0 for k in ("one_gpu_us", "parallel_us", "collective_us") if k in r), r
    for r in rows[2:4]:
        assert r["kv_bytes_per_rank"] < r["kv_bytes_one_gpu"], r
    assert rows[4]["faster"] in ("replicated", "split (lower bound)") and "note" not in rows[4], rows[4]


def test_parallel_bench_needs_torchrun_and_gpus(monkeypatch):
    from dsv4ops.bench import cli

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit, match="bench --only parallel: run under torchrun"):
        cli.main(["--only", "parallel"])
    monkeypatch.setenv("WORLD_SIZE", "2")
    if not torch.cuda.is_available():
        with pytest.raises(SystemExit, match="bench --only parallel: needs one CUDA GPU per process"):
            cli.main(["--only", "parallel"])


def _v41_union_body(rank, group):
    """topk="union": each rank's index sources select inside its own blocks (and the reindex layer
    inside its own candidate pool); the output equals the fp64 oracle fed every rank's selections
    together (up to 2 x index_topk entries a token), within its fp32 run's error."""
    numerics = CacheFormats.exact()
    stack = testing.randomize_(DeepseekV41AttentionStack(CFG41, numerics), seed=5)
    cache = CacheConfig(max_requests=3, max_context=160, max_step_tokens=96, block_size=BLOCK41["exact"],
                        exact_dtype=torch.float32, max_draft_tokens=dist_cases.MAX_DRAFT, formats=numerics)
    manager = V41CacheManager(CFG41, cache, dcp_group=group, topk="union")
    rows, got, topk, _ = dist_cases.serve_v41(stack, manager, BLOCK41["exact"])
    p32 = dict(stack.named_parameters())
    p64 = {k: v.double() for k, v in p32.items()}
    fork = next(op for op in dist_cases.PLAN if op[0] == "fork")
    for r, x in rows.items():
        start = fork[3] if r == fork[2] else 0
        sel = {}
        for layer, mine in topk[r].items():
            if start:
                mine = torch.cat([topk[fork[1]][layer][:start], mine])
            owned = mine[mine >= 0] // BLOCK41["exact"] % 2
            assert (owned == rank).all(), f"layer {layer}: rank {rank} selected another rank's entries"
            every = [torch.empty_like(mine) for _ in range(2)]
            dist.all_gather(every, mine.contiguous(), group=group)
            sel[layer] = torch.cat(every, 1)[None]
        ref64 = stack_attention(p64, CFG41, x[:, None].double(), numerics, sel)
        low = stack_attention(p32, CFG41, x[:, None], numerics, sel)
        testing.assert_close_to_ref(got[r], ref64.y[:, 0, start:], low.y[:, 0, start:], what=f"rank {rank} union {r}")
    return True


def test_dcp_v41_union_equals_the_oracle_on_every_ranks_selection():
    assert multiproc.run(_v41_union_body) == [True, True]


# ---- the merge's collectives ----------------------------------------------------------------------------
class _Counting:
    """torch.ops._c10d_functional with its collectives counted (wait_tensor is not one)."""

    def __init__(self, ops):
        self.ops, self.calls = ops, []

    def __getattr__(self, name):
        op = getattr(self.ops, name)
        if name == "wait_tensor":
            return op

        def counted(*args):
            self.calls.append(name)
            return op(*args)

        return counted


def _collectives_body(rank, group):
    """A V4 CSA (exact top-k) and HCA layer step make at most two collectives each (issue 55: the
    selection's ids and scores in one all-gather, the attention's (out, lse) in another); merge_best
    of candidates with tied scores picks what one process picks: the k best, ties to the lower id."""
    import dsv4ops.parallel as par
    from dsv4ops.parallel.dcp import Ownership, merge_best

    counts = {}
    for li in (1, 2):
        layer = testing.randomize_(DeepseekV4Attention(CFG, li), seed=li)
        manager = KVCacheManager(CFG, _cache(CacheFormats.exact()), dcp_group=group)
        layer.attach_cache(manager)
        manager.admit("r")
        counting, original = _Counting(par._C10D), par._C10D
        par._C10D = counting
        try:
            with torch.no_grad():
                for n in (70, 1, 1):
                    with manager.step({"r": n}) as step:
                        counting.calls.clear()
                        layer(torch.randn(step.positions.shape[0], CFG.hidden_size), step)
                        counts.setdefault(layer.layer_type, []).append(list(counting.calls))
        finally:
            par._C10D = original
    assert counts == {CSA: [["all_gather_into_tensor"] * 2] * 3, HCA: [["all_gather_into_tensor"]] * 3}, counts
    # Ties: scores from {0, 1, 2} (and -inf: not eligible, -1: no candidate) over 3 tokens, each
    # rank holding its own entries (blocks of 4, alternate ranks).
    g = torch.Generator().manual_seed(11)
    k, c = 5, 6
    ids, scores = [], []
    for r in range(2):
        mine = torch.tensor([w for w in range(64) if w // 4 % 2 == r])
        ids.append(torch.stack([mine[torch.randperm(len(mine), generator=g)[:c]] for _ in range(3)]).int())
        scores.append(torch.randint(0, 3, (3, c), generator=g).float())
        scores[r][0, :2] = float("-inf")
        ids[r][1, -1] = -1
    got = merge_best(ids[rank], scores[rank], k, Ownership(group))
    every_id, every_score = torch.cat(ids, 1), torch.cat(scores, 1)
    for t in range(3):
        pool = sorted((-s, int(i)) for i, s in zip(every_id[t].tolist(), every_score[t].tolist())
                      if i >= 0 and s > float("-inf"))
        want = sorted(i for _, i in pool[:k])
        assert got[t].tolist() == want + [-1] * (k - len(want)), (t, got[t], want)
    return counts


def test_dcp_layer_step_makes_at_most_two_collectives_and_merges_ties_like_one_process():
    counts = multiproc.run(_collectives_body)
    assert counts[0] == counts[1]


# ---- ownership arithmetic, against an enumeration ------------------------------------------------
@pytest.mark.parametrize("size, block_size, cand_block", [(2, 4, 4), (3, 8, 4), (4, 8, 2)])
def test_compact_entries_are_the_ranks_owned_entries_in_order(size, block_size, cand_block):
    """Rank r owns the global entries of blocks b with b % size == r; its compact entry c is its
    c-th owned entry, counted here one entry at a time. global_blocks (V4.1's candidate blocks,
    through compact_to_global) and local_blocks (its inverse) and owned_count against that list."""
    from dsv4ops.parallel import Group
    from dsv4ops.parallel import dcp

    n = 10 * size * block_size
    for rank in range(size):
        group = Group("g", rank, size)
        owned = [w for w in range(n) if (w // block_size) % size == rank]
        c = torch.arange(len(owned))
        assert dcp.compact_to_global(c, block_size, group).tolist() == owned
        cand = torch.tensor([list(range(len(owned) // cand_block)) + [-1]], dtype=torch.int32)
        want = [owned[b * cand_block] // cand_block for b in range(len(owned) // cand_block)] + [-1]
        assert dcp.global_blocks(cand, cand_block, block_size, group).tolist() == [want]
        assert dcp.local_blocks(torch.tensor([want]), cand_block, block_size, group).tolist() == cand.tolist()
        counts = torch.arange(n + 1)
        assert dcp.owned_count(counts, block_size, group).tolist() == [sum(w < k for w in owned) for k in range(n + 1)]
