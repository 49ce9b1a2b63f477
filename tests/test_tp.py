"""Tensor parallelism on 2 gloo processes (CPU): every V4 layer kind and the V4.1 stack, split over
the ranks' heads and output groups, equal the single-process layer through a serving scenario
(mixed prefill / decode steps, a rewound verify step, a fork); the step compiles into one graph with
its all-reduce; weights load from full checkpoints by transformers' and DeepSeek's names; bad use
(a group that does not divide the heads or groups, a shard given to a layer without a group or to
a rank) fails clearly and changes nothing. Issue 31."""

import builders
import pytest
import torch

import dist_cases
import multiproc
from dsv4ops import CacheFormats, DeepseekV4Attention, DSV4AttentionConfig, testing
from dsv4ops.cache import CacheConfig, KVCacheManager, V41CacheManager
from dsv4ops.config_v41 import DSV41AttentionConfig
from dsv4ops.layers import DEEPSEEK_NAMES
from dsv4ops.layers_v41 import DEEPSEEK_NAMES as DEEPSEEK_NAMES_V41
from dsv4ops.layers_v41 import DeepseekV41AttentionStack

# HCA ratio 16 so that the scenario's requests (up to 138 tokens) close several HCA entries;
# index_topk 16 < the 34 CSA entries of the longest request: a real selection.
CFG = DSV4AttentionConfig.tiny(hca_ratio=16, compress_ratios=(0, 4, 16, 4))
CFG41 = DSV41AttentionConfig.tiny()
BLOCK41 = 7  # rows per page that every V4.1 format pages (mxfp4_68: 7 x 68 B in 512 B)
MODES = {"exact": CacheFormats.exact(), "fp8": CacheFormats.v4()}


def _cache(fmts, **kw):
    return CacheConfig(formats=fmts, exact_dtype=torch.float32, max_requests=3, max_context=160, max_step_tokens=96,
                       block_size=4, max_draft_tokens=dist_cases.MAX_DRAFT, **kw)


def _serve_v4(layer, numerics):
    manager = KVCacheManager(CFG, _cache(numerics))
    layer.attach_cache(manager)
    rows = dist_cases.inputs(CFG.hidden_size, seed=7)
    sels = {r: [] for r in rows}
    with testing.recorded_selections() as log:
        def record(step, spec):
            if log:
                for r, s in dist_cases.kept_rows(log[-1], spec).items():
                    sels[r].append(s)
                log.clear()

        with torch.no_grad():
            outs = dist_cases.serve(layer, manager, rows, on_step=record)
    return rows, outs, {r: torch.cat(v) for r, v in sels.items() if v}


def _whole(outs: dict, sels: dict) -> tuple[dict, dict]:
    """Each request's outputs and selections from position 0: the fork's prefix rows are its parent's."""
    fork = next(op for op in dist_cases.PLAN if op[0] == "fork")
    _, parent, child, at = fork
    outs = dict(outs, **{child: torch.cat([outs[parent][:at], outs[child]])})
    if sels:
        sels = dict(sels, **{child: torch.cat([sels[parent][:at], sels[child]])})
    return outs, sels


def _v4_body(rank, group, li, mode, compiled):
    numerics = MODES[mode]
    full = testing.randomize_(DeepseekV4Attention(CFG, li, formats=numerics), seed=li)
    tp = DeepseekV4Attention(CFG, li, formats=numerics, process_group=group)
    tp.load_state_dict(full.state_dict())
    assert tp.heads == CFG.num_heads // 2 and tp.q_b_proj.weight.shape[0] == CFG.num_heads // 2 * CFG.head_dim
    rows, single, sel1 = _serve_v4(full, numerics)
    if compiled:
        torch._dynamo.reset()
        fn = torch.compile(tp, fullgraph=True, backend="aot_eager")
        _, got, sel2 = _serve_v4(_Compiled(tp, fn), numerics)
    else:
        _, got, sel2 = _serve_v4(tp, numerics)
    single, sel1 = _whole(single, sel1)
    got, sel2 = _whole(got, sel2)
    out = {}
    for r, x in rows.items():
        if sel2:  # the indexer is replicated: every rank selects what one process selects
            assert torch.equal(sel1[r], sel2[r]), f"request {r}: the selection differs from one process's"
        err, budget = testing.assert_matches_oracle(full, x, got[r], sel2.get(r), what=f"rank {rank} request {r}")
        diff = (got[r] - single[r]).abs().max().item()
        band = torch.finfo(torch.float32).eps * single[r].abs().max().item()
        assert diff <= 2 * budget + band, f"request {r}: |TP - one process| {diff:.3e} > 2 x {budget:.3e}"
        out[r] = got[r]
    return out


class _Compiled(torch.nn.Module):
    """A compiled layer that still attaches its cache (the scenario attaches before the first step)."""

    def __init__(self, layer, fn):
        super().__init__()
        self.layer, self.__dict__["fn"] = layer, fn

    def attach_cache(self, manager):
        self.layer.attach_cache(manager)

    def forward(self, x, step):
        return self.fn(x, step)


@pytest.mark.parametrize("li,mode", [(0, "exact"), (1, "exact"), (2, "exact"), (1, "fp8"), (2, "fp8")])
def test_tp_layer_equals_one_process(li, mode):
    outs = multiproc.run(_v4_body, li, mode, False)
    for r in outs[0]:  # both ranks hold the whole output
        assert torch.equal(outs[0][r], outs[1][r])


def _count_collectives(gm, example_inputs):
    names = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
    _GRAPHS.append(names)
    return gm.forward


_GRAPHS: list = []


def _compiled_body(rank, group):
    from torch._dynamo.backends.common import aot_autograd

    full = testing.randomize_(DeepseekV4Attention(CFG, 1), seed=1)
    tp = DeepseekV4Attention(CFG, 1, process_group=group)
    tp.load_state_dict(full.state_dict())
    manager = KVCacheManager(CFG, _cache(CacheFormats.exact()))
    tp.attach_cache(manager)
    torch._dynamo.reset()
    fn = torch.compile(tp, fullgraph=True, backend=aot_autograd(fw_compiler=_count_collectives))
    manager.admit("r")
    with torch.no_grad(), manager.step({"r": 40}) as step:
        x = torch.randn(step.positions.shape[0], CFG.hidden_size)
        got = fn(x, step)
        want = tp(x, step)
    assert torch.equal(got, want)
    assert len(_GRAPHS) == 1 and sum("all_reduce" in n for n in _GRAPHS[0]) == 1, _GRAPHS
    return True


def test_tp_step_compiles_into_one_graph_with_its_all_reduce():
    assert multiproc.run(_compiled_body) == [True, True]


def test_tp_compiled_scenario_equals_one_process():
    multiproc.run(_v4_body, 1, "exact", True)


def _v41_serve(stack, numerics):
    cache = CacheConfig(max_requests=3, max_context=160, max_step_tokens=96, block_size=BLOCK41,
                        exact_dtype=torch.float32, max_draft_tokens=dist_cases.MAX_DRAFT, formats=numerics)
    return dist_cases.serve_v41(stack, V41CacheManager(CFG41, cache), BLOCK41)


def _v41_body(rank, group, mode):
    numerics = CacheFormats.exact() if mode == "exact" else CacheFormats.v41()
    full = testing.randomize_(DeepseekV41AttentionStack(CFG41, numerics), seed=5)
    tp = DeepseekV41AttentionStack(CFG41, numerics, process_group=group)
    # DeepSeek's names: every rank cuts its share out of the full tensors.
    deepseek = {f"layers.{k.split('.', 2)[1]}.{_DS41[k.split('.', 2)[2]]}": v for k, v in full.state_dict().items()}
    tp.load_deepseek_state_dict(deepseek)
    rows, single, topk1, pools1 = _v41_serve(full, numerics)
    _, got, topk2, pools2 = _v41_serve(tp, numerics)
    for r in rows:
        for layer in topk1[r]:
            assert torch.equal(topk1[r][layer], topk2[r][layer]), f"request {r} layer {layer}: the selection differs"
        assert torch.equal(pools1[r], pools2[r])
    lowp = torch.float32 if mode == "exact" else torch.bfloat16
    budgets = dist_cases.check_v41_oracle(full, numerics, lowp, rows, got, topk2, pools2, f"rank {rank}")
    for r in rows:
        diff = (got[r] - single[r]).abs().max().item()
        assert diff <= 2 * budgets[r] + 1e-6 * single[r].abs().max().item(), f"request {r}: |TP - one process| {diff:.3e}"
    return True


_DS41 = {v: k for k, v in DEEPSEEK_NAMES_V41.items()}


@pytest.mark.parametrize("mode", ["exact", "qat"])
def test_tp_v41_stack_equals_one_process(mode):
    assert multiproc.run(_v41_body, mode) == [True, True]


def _deepseek_v4(full: DeepseekV4Attention, block: int) -> dict:
    """The layer's weights by DeepSeek's names, q_b_proj and o_b_proj as block-FP8 (e4m3 + UE8M0
    tile scales; the layer's own weights become their dequantized values)."""
    inverse = {v: k for k, v in DEEPSEEK_NAMES.items()}
    prefix = f"layers.{full.layer_idx}."
    out = {prefix + inverse[k]: v.clone() for k, v in full.state_dict().items()}
    for i, name in enumerate(("q_b_proj", "o_a_proj", "o_b_proj")):
        n, k = getattr(full, name).weight.shape
        w, scale = builders.block_fp8_weight(n, k, block, seed=i)
        getattr(full, name).weight.data = (w.float() * scale.float().repeat_interleave(block, 0)[:n]
                                           .repeat_interleave(block, 1)[:, :k])
        out[prefix + inverse[name + ".weight"]] = w
        out[prefix + inverse[name + ".weight"][:-len(".weight")] + ".scale"] = scale
    return out


def _load_body(rank, group):
    full = testing.randomize_(DeepseekV4Attention(CFG, 1), seed=1)
    ds = _deepseek_v4(full, 32)
    want = {"q_b_proj.weight": full.q_b_proj.weight.chunk(2, 0)[rank], "sinks": full.sinks.chunk(2)[rank],
            "o_a_proj.weight": full.o_a_proj.weight.chunk(2, 0)[rank],
            "o_b_proj.weight": full.o_b_proj.weight.chunk(2, 1)[rank], "kv_proj.weight": full.kv_proj.weight,
            "compressor.indexer.q_b_proj.weight": full.compressor.indexer.q_b_proj.weight}
    tp = DeepseekV4Attention(CFG, 1, process_group=group)
    tp.load_deepseek_state_dict(ds, block=32)
    for k, v in want.items():
        assert torch.equal(tp.get_parameter(k), v), k
    # keep_fp8: the e4m3 bytes and tile scales of this rank's rows / columns.
    tp.load_deepseek_state_dict(ds, block=32, keep_fp8=True)
    for name, dim in (("q_b_proj", 0), ("o_a_proj", 0), ("o_b_proj", 1)):
        key = f"layers.1.attn.{dict(q_b_proj='wq_b', o_a_proj='wo_a', o_b_proj='wo_b')[name]}"
        m = getattr(tp, name)
        assert torch.equal(m.weight.view(torch.uint8), ds[key + ".weight"].chunk(2, dim)[rank].view(torch.uint8))
        assert torch.equal(m.weight_scale_inv.view(torch.uint8), ds[key + ".scale"].chunk(2, dim)[rank].view(torch.uint8))
    x = torch.randn(1, 9, CFG.hidden_size)  # 2 CSA entries, fewer than index_topk: all selected
    with torch.no_grad():
        got = tp(x)
    testing.assert_matches_oracle(full, x[0], got[0], what="keep_fp8 TP layer")
    # 128 x 128 tiles: o_a_proj's 128 rows (o_b_proj's 128 columns) split into 64, half a tile:
    # refused, nothing changed.
    before = {k: v.clone() for k, v in tp.state_dict().items()}
    with pytest.raises(ValueError, match=r"keep_fp8: layers.1.attn.wo_a.weight \[128, 1024\] splits over 2 ranks "
                                         r"along dim 0 into 64, not a multiple of its 128 x 128 scale tiles"):
        tp.load_deepseek_state_dict(_deepseek_v4(full, 128), keep_fp8=True)
    assert all(builders.bytes_equal(v, before[k]) for k, v in tp.state_dict().items())
    return tp.state_dict()


def test_tp_loads_this_ranks_share_by_transformers_and_deepseek_names():
    shards = multiproc.run(_load_body)
    # A shard without a process group: refused with the reason, the layer unchanged.
    layer = DeepseekV4Attention(CFG, 1)
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    plain = {k: v for k, v in shards[0].items() if v.dtype != torch.float8_e4m3fn and not k.endswith("scale_inv")}
    plain["q_b_proj.weight"] = torch.zeros(CFG.num_heads // 2 * CFG.head_dim, CFG.q_lora_rank)
    plain["o_b_proj.weight"] = torch.zeros(CFG.hidden_size, CFG.o_groups // 2 * CFG.o_lora_rank)
    with pytest.raises(ValueError, match=r"state_dict: q_b_proj.weight has shape \[1024, 64\], 1/2 of the full "
                                         r"\[2048, 64\] along dim 0: a tensor-parallel shard, but "
                                         r"DeepseekV4Attention\(layer 1\) has no process_group"):
        layer.load_state_dict(plain)
    assert all(torch.equal(v, before[k]) for k, v in layer.state_dict().items())
    stack = DeepseekV41AttentionStack(CFG41)
    sd = stack.state_dict()
    sd["layers.3.o_a_proj.weight"] = sd["layers.3.o_a_proj.weight"][:CFG41.o_lora_rank]
    with pytest.raises(ValueError, match=r"layers.3.o_a_proj.weight has shape \[64, 4096\], 1/2 of the full "
                                         r"\[128, 4096\] along dim 0: a tensor-parallel shard"):
        stack.load_state_dict(sd)


def _bad_body(rank, group):
    for cfg, match in ((DSV4AttentionConfig.tiny(num_heads=6, o_groups=3),
                        r"process_group: DeepseekV4Attention\(layer 0\) splits its o_groups \(3\) over the group's 2 "
                        r"ranks; expected a group size that divides 3"),
                       (DSV4AttentionConfig.tiny(num_heads=3, o_groups=1),
                        r"splits its num_heads \(3\) over the group's 2 ranks")):
        with pytest.raises(ValueError, match=match):
            DeepseekV4Attention(cfg, 0, process_group=group)
    with pytest.raises(ValueError, match=r"DeepseekV41Attention\(layer 0\) splits its o_groups \(1\)"):
        DeepseekV41AttentionStack(DSV41AttentionConfig.tiny(o_groups=1), process_group=group)
    with pytest.raises(TypeError, match="process_group: expected a torch.distributed ProcessGroup, got str"):
        DeepseekV4Attention(CFG, 0, process_group="world")
    # A rank given a shard (its own, even): each rank cuts its share of the full tensors.
    full = DeepseekV4Attention(CFG, 2)
    tp = DeepseekV4Attention(CFG, 2, process_group=group)
    tp.load_state_dict(full.state_dict())
    before = {k: v.clone() for k, v in tp.state_dict().items()}
    with pytest.raises(ValueError, match=r"q_b_proj.weight has shape \[1024, 64\], 1/2 of the full \[2048, 64\] along "
                                         r"dim 0; "
                                         r"DeepseekV4Attention\(layer 2\) \(rank \d of 2\) cuts its share out of the "
                                         r"full tensor: load the full checkpoint on every rank"):
        tp.load_state_dict(tp.state_dict())
    assert all(torch.equal(v, before[k]) for k, v in tp.state_dict().items())
    # Batch-invariant serving: the all-reduce sums in an order the collective picks by message size.
    manager = KVCacheManager(CFG, _cache(CacheFormats.exact(), batch_invariant=True))
    with pytest.raises(NotImplementedError, match=r"manager: CacheConfig\(batch_invariant=True\) is not supported with "
                                                  r"tensor or context parallelism"):
        tp.attach_cache(manager)
    assert tp._modules.get("cache") is None and not list(manager._caches)
    return True


def test_tp_bad_use_fails_clearly():
    assert multiproc.run(_bad_body) == [True, True]


def _patch_body(rank, group):
    import test_transformers as T

    base = T._model()
    patched = T._patched(base, process_group=group)
    assert all(layer.self_attn.heads == CFG.num_heads // 2 for layer in patched.model.layers)
    tokens, logits = T._against_transformers(base, patched, T._prompts(2), what=f"rank {rank} generate")
    return tokens


def test_tp_patch_model_generates_like_transformers():
    """patch_model(..., process_group=group): every rank generates the tokens transformers' model
    does (logits within its fp32 run's budget of the fp64 run)."""
    tokens = multiproc.run(_patch_body)
    assert torch.equal(tokens[0], tokens[1])


def test_tp_demo_under_torchrun():
    """`torchrun --nproc-per-node 2 -m dsv4ops --parallel tp`: every request within its fp64-oracle
    budget (the oracle on the full weights), rank 0 printing."""
    out = dist_cases.torchrun_demo("tp")
    assert "tp over 2 processes" in out and out.count("within budget") == 2, out


def test_demo_parallel_needs_torchrun():
    from dsv4ops.bench import demo

    with pytest.raises(SystemExit):
        demo.main(["--parallel", "tp"])


@pytest.mark.parametrize("heads, groups, size", [(4, 2, 2), (8, 4, 4)])
def test_each_rank_cuts_its_own_heads_and_groups(heads, groups, size):
    """parallel.tp.shard_ with no process (a Group is a rank and a size): rank r's share of a full
    state dict is heads r*H/size .. and output groups r*G/size .. of each split parameter, cut here
    through each tensor's head / group axis (q_b_proj: [heads, head_dim, q_lora], o_a_proj:
    [groups, o_lora, ...], o_b_proj: [hidden, groups, o_lora], sinks: [heads])."""
    from dsv4ops.parallel import Group, tp

    cfg = DSV4AttentionConfig.tiny(num_heads=heads, o_groups=groups)
    full = {k: v for k, v in DeepseekV4Attention(cfg, 1).state_dict().items() if k in tp.SPLIT}
    g = torch.Generator().manual_seed(0)
    full = {k: torch.randn(v.shape, generator=g) for k, v in full.items()}
    h, o = heads // size, groups // size
    for rank in range(size):
        share = dict(full)
        tp.shard_(share, "", Group("tp", rank, size), {k: tuple(v.shape) for k, v in full.items()}, "test")
        heads_of = slice(rank * h, (rank + 1) * h)
        groups_of = slice(rank * o, (rank + 1) * o)
        want = {
            "q_b_proj.weight": full["q_b_proj.weight"].view(heads, cfg.head_dim, -1)[heads_of].flatten(0, 1),
            "sinks": full["sinks"][heads_of],
            "o_a_proj.weight": full["o_a_proj.weight"].view(groups, cfg.o_lora_rank, -1)[groups_of].flatten(0, 1),
            "o_b_proj.weight": full["o_b_proj.weight"].view(cfg.hidden_size, groups, -1)[:, groups_of].flatten(1),
        }
        assert want.keys() == share.keys()
        for k, v in want.items():
            assert torch.equal(share[k], v), (k, rank)
