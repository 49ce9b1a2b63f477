"""Batch-invariant serving (CacheConfig(batch_invariant=True)): a request's outputs are bitwise the same
whoever shares its steps. Issue: batch-invariant serving.

Bitwise equality is the property itself here: request "a" runs the same computation on the same
rows under two batch compositions. fp32 layers: on the CPU torch's fp32 GEMM gives a row other bits
at other row counts (MKL, M = 1, 2, 3, 7 against 130), which is what the default path shows.
"""

import copy
import dataclasses
import functools

import builders
import drivers_v41
import pytest
import torch

from dsv4ops import CacheFormats, DeepseekV4Attention, DSV4AttentionConfig, testing
from dsv4ops.cache.config import CacheConfig
from dsv4ops.cache.manager import KVCacheManager
from dsv4ops.cache.v41 import V41CacheManager
from dsv4ops.config import CSA, HCA, SLIDING
from dsv4ops.config_v41 import DSV41AttentionConfig
from dsv4ops.invariant_linear import reference as inv_ref
from dsv4ops.layers_v41 import DeepseekV41AttentionStack

_ROW_BY_ROW = inv_ref.invariant_linear

# index_topk 3 of up to 5 visible entries: the indexer's selection decides which entries a query
# sees, so a score that moved by one bit would show.
CFG = DSV4AttentionConfig.tiny(index_topk=3)
LAYER = {SLIDING: 0, CSA: 1, HCA: 2}
FORMATS = {"fp8": CacheFormats.v4(), "fp4": CacheFormats(window="fp8_584", comp="fp4_288", index="mxfp4_68")}
LENGTHS = {"a": 20, "b": 24, "c": 10, "d": 6}
# "a" alone: a prefill in two chunks, then decode (5 CSA entries: more than index_topk).
ALONE = [{"a": 9}, {"a": 6}] + [{"a": 1}] * 5
# The same chunks of "a", beside others that join, prefill in chunks, decode and leave, and a step
# without "a".
BUSY = ([{"a": 9, "b": 11}, {"c": 3, "a": 6, "b": 5}] + [{"b": 1, "a": 1, "c": 1}] * 2
        + [{"a": 1, "d": 2}, {"d": 4, "a": 1}, {"b": 3}, {"a": 1, "c": 2}])


def _serve(kind, fmt, schedule, invariant=True, drafts=None):
    """Request outputs of `schedule` (steps of {request: tokens}, or with `drafts` {request: (tokens,
    kept)} whose rejected tokens are rewound) on a fresh fp32 layer and cache."""
    layer = testing.randomize_(DeepseekV4Attention(CFG, LAYER[kind], formats=FORMATS[fmt]), seed=LAYER[kind])
    cfg = CacheConfig(max_requests=4, max_context=48, max_step_tokens=32, formats=FORMATS[fmt],
                      exact_dtype=torch.float32, max_draft_tokens=3, batch_invariant=invariant)
    manager = KVCacheManager(CFG, cfg)
    layer.attach_cache(manager)
    g = torch.Generator().manual_seed(0)
    inputs = {r: torch.randn(n, CFG.hidden_size, generator=g) for r, n in LENGTHS.items()}
    done, outs = dict.fromkeys(LENGTHS, 0), {r: [] for r in LENGTHS}
    draft_rng = {r: torch.Generator().manual_seed(i + 1) for i, r in enumerate(LENGTHS)}  # each request's own
    for spec in schedule:
        spec = {r: v if isinstance(v, tuple) else (v, v) for r, v in spec.items()}
        for r in spec:
            if r not in manager.slot_of:
                manager.admit(r)
        with manager.step({r: n for r, (n, _) in spec.items()}) as step:
            rows = []
            for r, (n, kept) in spec.items():
                drafts = torch.randn(n - kept, CFG.hidden_size, generator=draft_rng[r])
                rows += [inputs[r][done[r]:done[r] + kept], drafts]
            x = torch.cat(rows)
            y = layer(torch.cat([x, x.new_zeros(step.positions.shape[0] - x.shape[0], x.shape[1])]), step)
        i = 0
        for r, (n, kept) in spec.items():
            outs[r].append(y[i:i + kept])
            done[r] += kept
            i += n
            manager.rewind(r, n - kept)
    return torch.cat(outs["a"])


@functools.cache
def _alone(kind, fmt):
    return _serve(kind, fmt, ALONE)


# Every layer kind in FP8; FP4 once, on CSA, the kind whose compressed and indexer caches both
# take the FP4 formats (a sliding layer's window is fp8_584 in both).
@pytest.mark.parametrize("kind,fmt", [(SLIDING, "fp8"), (CSA, "fp8"), (HCA, "fp8"), (CSA, "fp4")])
def test_request_outputs_do_not_depend_on_who_shares_the_steps(kind, fmt):
    alone = _alone(kind, fmt)
    assert alone.shape == (LENGTHS["a"], CFG.hidden_size) and alone.abs().sum() > 0
    assert torch.equal(_serve(kind, fmt, BUSY), alone)


# Verify steps of "a" (1 + drafts, kept), the same in both runs; beside others in the busy run.
SPEC_ALONE = [{"a": 9}, {"a": (4, 2)}, {"a": (3, 3)}, {"a": (4, 1)}] + [{"a": (2, 1)}] * 5
SPEC_BUSY = ([{"a": 9, "b": (9, 9)}, {"b": (4, 1), "a": (4, 2)}, {"c": 6, "a": (3, 3)}, {"a": (4, 1), "c": (4, 4)}]
             + [{"a": (2, 1), "b": (3, 2)}] * 3 + [{"a": (2, 1)}] * 2)


def test_verify_steps_and_rewinds_keep_the_property():
    alone = _serve(CSA, "fp8", SPEC_ALONE)
    assert alone.shape == (LENGTHS["a"], CFG.hidden_size)
    assert torch.equal(_serve(CSA, "fp8", SPEC_BUSY), alone)


def _split_by_batch(x, weight, out):
    """A batch-dependent GEMM: K summed in two halves once the step has more than one row (a split-K
    rule reading the step's size)."""
    if x.shape[0] == 1:
        return _ROW_BY_ROW(x, weight, out)
    h = x.shape[1] // 2
    out.copy_((x[:, :h].double() @ weight[:, :h].double().t()).float()
              + (x[:, h:].double() @ weight[:, h:].double().t()).float())


def test_a_batch_dependent_gemm_put_back_is_caught(monkeypatch):
    alone = _alone(CSA, "fp8")
    monkeypatch.setattr(inv_ref, "invariant_linear", _split_by_batch)
    assert not torch.equal(_serve(CSA, "fp8", BUSY), alone)


# ---- V4.1: every role of the tiny stack (sliding, source+indexer, reindex, reuse, candidate source,
# reindex inside the pool) in one run; its 20 tokens see 10 ratio-2 entries (index_topk 8) and 20
# ratio-1 entries (a 16-entry candidate pool), so the selections decide what a query sees.
CFG41 = DSV41AttentionConfig.tiny()
BLOCK41 = 7  # odd: slots cross pages


def _serve41(schedule, invariant=True):
    """Request "a"'s outputs [num_layers, 20, hidden] through `schedule` on a fresh fp32 stack and
    cache (QAT formats); padding tokens get random rows and positions (they must change nothing)."""
    stack = testing.randomize_(DeepseekV41AttentionStack(CFG41, CacheFormats.v41()), seed=3)
    cfg = CacheConfig(max_requests=4, max_context=48, max_step_tokens=32, block_size=BLOCK41,
                      formats=CacheFormats.v41(), exact_dtype=torch.float32, batch_invariant=invariant)
    manager = V41CacheManager(CFG41, cfg)
    stack.attach_cache(manager)
    g = torch.Generator().manual_seed(0)
    inputs = {r: torch.randn(CFG41.num_layers, n, CFG41.hidden_size, generator=g) for r, n in LENGTHS.items()}
    served = {r: inputs[r] for r in dict.fromkeys(r for spec in schedule for r in spec)}
    outs, _, _ = drivers_v41.serve_schedule(stack, manager, served, schedule, garbage=torch.Generator().manual_seed(9))
    return outs["a"]


@functools.cache
def _alone41():
    return _serve41(ALONE)


def test_v41_request_outputs_do_not_depend_on_who_shares_the_steps():
    alone = _alone41()
    assert alone.shape == (CFG41.num_layers, LENGTHS["a"], CFG41.hidden_size) and alone.abs().sum() > 0
    assert torch.equal(_serve41(BUSY), alone)


def test_v41_a_batch_dependent_gemm_put_back_is_caught(monkeypatch):
    alone = _alone41()
    monkeypatch.setattr(inv_ref, "invariant_linear", _split_by_batch)
    assert not torch.equal(_serve41(BUSY), alone)


# Request 0's 7 tokens (3 closing ratio-2 entries) alone, then beside request 1's 30 (at positions
# 3..32) whose entry slots are -1: they compute everything (the GEMM's M, the kernels' grids) and
# store no entry, so every pool byte and request 0's state and latent rows must come out the same.
ALONE_RUN, BUSY_RUNS = (0, 0, 7), ((0, 0, 7), (1, 3, 30))


def _alone_and_busy(args, per_token):
    busy = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in args.items()}
    busy["entry_slots"][ALONE_RUN[2]:] = -1
    alone = {k: v[:ALONE_RUN[2]].clone() if k in per_token else v.clone() if isinstance(v, torch.Tensor) else v
             for k, v in args.items()}
    return alone, busy


@pytest.fixture
def threads():
    """torch.set_num_threads for the test, restored after it."""
    before = torch.get_num_threads()
    yield torch.set_num_threads
    torch.set_num_threads(before)


@pytest.mark.parametrize("path", ["reference", "triton"])
@pytest.mark.parametrize("ratio", [2, 1])
def test_v41_compressor_rows_do_not_depend_on_the_other_tokens(path, ratio, threads):
    """dsv4::compressor_update with batch_invariant as V4.1 runs it (no overlap, a latent out): a
    request's entries, state and latent rows are the same whatever other tokens share the call. On 5
    CPU threads the reference without the flag gives the ratio-2 entries other bits (3 closing
    entries alone, 18 busy: torch's softmax takes the scalar exp at other columns); the Triton
    kernel pools a span < 64 in one plan for every token count (compressor/triton.py pool_plan)."""
    from dsv4ops.compressor import triton as comp_triton

    threads(5)
    run = torch.ops.dsv4.compressor_update if path == "reference" else comp_triton.compressor_update
    args = builders.compressor_update_args(dim=512, ratio=ratio, overlap=False, runs=BUSY_RUNS, pad=0, blocks=16,
                                           latent=True)
    args["inv_freq"] = builders.rope_table(64)
    alone, busy = _alone_and_busy(args, ("kv", "score", "positions", "req_slots", "entry_slots", "latent_out"))
    for a in (alone, busy):
        run(**a, batch_invariant=True)
    assert alone["latent_out"].abs().sum() > 0
    assert torch.equal(alone["cache"], busy["cache"]) and not torch.equal(alone["cache"], args["cache"])
    assert torch.equal(alone["state"][0], busy["state"][0])
    assert torch.equal(alone["latent_out"], busy["latent_out"][:ALONE_RUN[2]])


# V4's HCA pools 128 slots: request 0 closes entry 0 (position 127) in a step of 1, 17 or 257 tokens
# (the smallest of each size class of compressor/triton.py pool_plan), the others request 1's from
# position 112 on (they close entries 0 and 1 too, computed and stored nowhere: the pool's every
# byte is request 0's entry or the fill).
HCA_RUNS, HCA_TOKENS = ((0, 127, 1), (1, 112, 256)), (1, 17, 257)


def _hca_entry(run, tokens: int, batch_invariant: bool) -> tuple:
    """(pool, latent row, state) of request 0 after closing its entry 0 in a step of `tokens` tokens."""
    torch.manual_seed(5)  # the same rows for every step size
    args = builders.compressor_update_args(dim=128, ratio=128, overlap=False, runs=HCA_RUNS, pad=0, latent=True)
    args["inv_freq"] = builders.rope_table(64)  # the kernel's V4 layout (d 128: the indexer's)
    args["entry_slots"][1:] = -1
    step = {k: v[:tokens] if k in ("kv", "score", "positions", "req_slots", "entry_slots", "latent_out") else v
            for k, v in args.items()}
    fill = args["cache"].clone()
    run(**step, batch_invariant=batch_invariant)
    assert not torch.equal(step["cache"], fill)  # the entry was stored
    return step["cache"], step["latent_out"][0], step["state"][0]


@pytest.mark.parametrize("path", ["reference", "triton"])
def test_hca_entry_does_not_depend_on_the_step_size(path, threads):
    """dsv4::compressor_update with batch_invariant: an HCA entry's bits are the same in a step of 1,
    17 and 257 tokens. Triton: without the flag they are not; pool_plan (channels x slots a loop step,
    warps) gives 16 x 128 on 8 warps, 32 x 64 on 4 and one program a token with 8 slots a step at
    these sizes, and the slots a step pools order the softmax sums; with the flag the first at every
    size. The reference on 7 CPU threads (test_reference_pooling_is_not_row_wise says why it needs
    the flag there)."""
    from dsv4ops.compressor import triton as comp_triton

    if path == "reference":
        threads(7)
        run, modes = torch.ops.dsv4.compressor_update, (True,)
    else:
        run, modes = comp_triton.compressor_update, (True, False)
        plans = [comp_triton.pool_plan(128, t, 128) for t in HCA_TOKENS]
        assert len(set(plans)) == 3
        assert {comp_triton.pool_plan(128, t, 128, True) for t in (*HCA_TOKENS, 4096)} == {plans[0]}
    for invariant in modes:
        (pool, latent, state), *others = (_hca_entry(run, t, invariant) for t in HCA_TOKENS)
        for tokens, (o_pool, o_latent, o_state) in zip(HCA_TOKENS[1:], others, strict=True):
            assert torch.equal(o_state, state)  # the state rows: the step's rows as they came
            same = torch.equal(o_pool, pool) and torch.equal(o_latent, latent)
            assert same == invariant, (tokens, invariant)


def test_reference_pooling_is_not_row_wise(threads):
    """Why the reference compressor pools one entry at a time with batch_invariant: torch's CPU
    softmax over the slot dim (reference.functional.pool_entry) splits the [entries x d] columns
    between threads and takes the scalar exp, not the vector one, at the edge of each thread's
    share, so on 3 threads an entry pooled beside 39 others gets other bits than alone."""
    from dsv4ops.reference.functional import pool_entry

    threads(3)
    g = torch.Generator().manual_seed(0)
    a, z = torch.randn(2, 40, 128, 128, generator=g)
    alone = torch.cat([pool_entry(a[i:i + 1], z[i:i + 1]) for i in range(40)])
    assert not torch.equal(pool_entry(a, z), alone)


@pytest.mark.parametrize("path", ["reference", "triton"])
def test_v41_index_keys_do_not_depend_on_the_other_tokens(path):
    """dsv4::indexer_k_prep with batch_invariant: a request's keys are the same whatever other tokens
    share the call. Its GEMM (latent @ wk^T over the step's closing tokens) is the op's one
    batch-dependent part by default: MKL / cuBLAS pick their kernel by M."""
    from dsv4ops.indexer import triton_prep

    run = torch.ops.dsv4.indexer_k_prep if path == "reference" else triton_prep.indexer_k_prep
    args = builders.indexer_k_prep_args(dim=512, di=128, runs=BUSY_RUNS, pad=0, blocks=16)
    args["inv_freq"] = builders.rope_table(64)
    alone, busy = _alone_and_busy(args, ("latent", "positions", "req_slots", "entry_slots"))
    for a in (alone, busy):
        run(**a, batch_invariant=True)
    assert not torch.equal(alone["cache"], args["cache"])
    assert torch.equal(alone["cache"], busy["cache"])


@pytest.mark.parametrize("m", [1, 17])
@pytest.mark.parametrize("dtype,out_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                             (torch.bfloat16, torch.float32)])
def test_invariant_linear_rows_do_not_depend_on_the_row_count(m, dtype, out_dtype):
    """The op (CPU reference) and its Triton kernel (interpreter): row i of x[lo:lo + m] @ w^T is bitwise
    row lo + i of x @ w^T, wherever the rows start; the product is the fp32 GEMM."""
    from dsv4ops.invariant_linear import triton as inv_triton

    g = torch.Generator().manual_seed(m)
    x, w = torch.randn(24, 80, generator=g).to(dtype), torch.randn(70, 80, generator=g).to(dtype)
    want = x.double() @ w.double().t()
    for run in (torch.ops.dsv4.invariant_linear, inv_triton.invariant_linear):
        full = torch.full((24, 70), float("nan"), dtype=out_dtype)
        run(x, w, full)
        testing.assert_close_to_ref(full, want, [(x.float() @ w.float().t()).to(out_dtype)], what="x @ w^T")
        for lo in (0, 5):
            part = torch.full((m, 70), float("nan"), dtype=out_dtype)
            run(x[lo:lo + m], w, part)
            assert torch.equal(part, full[lo:lo + m]), (m, lo)


# ---- the model around the layers: dsv4ops.invariant_mode ----------------------------------------
def _split_mm(a, b):
    """A batch-dependent mm: K summed in two halves once there is more than one row."""
    if a.shape[0] == 1:
        return a @ b
    h = a.shape[1] // 2
    return ((a[:, :h].double() @ b[:h].double()).float() + (a[:, h:].double() @ b[h:].double()).float()).to(a.dtype)


_W = torch.randn(12, 40, generator=torch.Generator().manual_seed(2))


def _grouped(x, w):
    """Rows [0, 12) x group 0, [12, 18) x group 1, the rest x group 2 (of x's 37 rows; a part of them:
    the offsets clamped to its rows)."""
    offs = torch.tensor([12, 18, 37], dtype=torch.int32).clamp(max=x.shape[0])
    if x.dtype == torch.float64:  # no fp64 grouped GEMM: the groups one by one
        return torch.cat([x[lo:hi] @ w[4 * g:4 * g + 4].t() for g, (lo, hi) in enumerate(zip([0, *offs[:2]], offs))])
    return torch._grouped_mm(x, w.view(3, 4, 40).transpose(1, 2), offs)


MODE_OPS = {  # (x [37, 40], w [12, 40]) -> rows that must be those of each row alone
    "linear": lambda x, w: torch.nn.functional.linear(x, w),
    "linear+bias": lambda x, w: torch.nn.functional.linear(x, w, w[:, 0]),
    "bmm": lambda x, w: torch.bmm(x.view(-1, 4, 10), w[:, :10].t().expand(x.shape[0], 10, 12)),
    "baddbmm": lambda x, w: torch.baddbmm(w[:, 0], x.view(-1, 4, 10), w[:, :10].t().expand(x.shape[0], 10, 12)),
    "grouped_mm": _grouped,
    "sigmoid": lambda x, w: torch.sigmoid(x[:, :12] * 3),
    "silu": lambda x, w: torch.nn.functional.silu(x[:, :12] * 3),
    "softplus": lambda x, w: torch.nn.functional.softplus(x[:, :12] * 3),
}


@pytest.mark.parametrize("op", MODE_OPS)
def test_invariant_mode_rows_do_not_depend_on_the_other_rows(op):
    """Inside dsv4ops.invariant_mode.mode() each op's row bits are those of the row alone (37 rows
    of 12 values: the CPU's SIMD remainder falls on some rows; a grouped GEMM's rows beside other
    groups' or alone), its values torch's; outside, the ops are torch's again (the mode does not
    leak)."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    from dsv4ops.invariant_mode import mode

    fn = MODE_OPS[op]
    x = torch.randn(37, 40, generator=torch.Generator().manual_seed(3))
    with mode():
        busy = fn(x, _W)
        alone = {i: fn(x[i:i + 1].clone(), _W) for i in (0, 5, 11, 36)} if op != "grouped_mm" else {}
        if op == "grouped_mm":  # rows 12 .. 17 (group 1) alone: an empty group 0 before them
            part = torch._grouped_mm(x[12:18], _W.view(3, 4, 40).transpose(1, 2), torch.tensor([0, 6, 6]).int())
            assert torch.equal(part, busy[12:18])
    assert _get_current_dispatch_mode() is None
    testing.assert_close_to_ref(busy, fn(x.double(), _W.double()), [fn(x, _W)], what=op)
    for i, row in alone.items():
        assert torch.equal(row[0], busy[i]), i


def test_invariant_mode_refuses_what_it_cannot_make_invariant():
    from dsv4ops.invariant_mode import mode

    with mode(), pytest.raises(NotImplementedError, match=r"aten._grouped_mm of a 3-D and a 3-D operand has no "
                                                           r"row-invariant form"):
        torch._grouped_mm(torch.randn(2, 3, 8), torch.randn(2, 8, 4), torch.tensor([1, 2], dtype=torch.int32))
    out = torch.full((3, 4), 7.0)
    with mode(), pytest.raises(NotImplementedError, match=r"aten.mm.out has no row-invariant form here"):
        torch.mm(torch.randn(3, 8), torch.randn(8, 4), out=out)
    assert (out == 7.0).all()


# A 2-layer model (CSA, sliding), its hash MoE and hyper-connections: prompt 0 alone, then left-padded
# beside two others (shorter and longer).
GEN_LENS = (7, 3, 10)


@functools.cache
def _gen_model():
    from transformers import DeepseekV4ForCausalLM

    hc = testing.hf_config(DSV4AttentionConfig.tiny(num_layers=2, compress_ratios=(4, 0)), moe_intermediate_size=32,
                           pad_token_id=0, eos_token_id=None)
    torch.manual_seed(0)
    model = DeepseekV4ForCausalLM(hc).eval()
    for layer in model.model.layers:
        testing.randomize_(layer.self_attn, seed=layer.layer_idx)
    return model


def _generate(rows, new=3):
    """(tokens [rows, new], logits [rows, new, vocab]) of greedy generate() on a fresh patched copy."""
    from dsv4ops.integrations.transformers import patch_model

    model = patch_model(copy.deepcopy(_gen_model()), CacheConfig(max_requests=4, max_context=32, max_step_tokens=64,
                                                                  batch_invariant=True))
    w = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), w, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, r in enumerate(rows):
        ids[i, w - len(r):], mask[i, w - len(r):] = r, 1
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=new, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
    return out.sequences[:, w:], torch.stack(out.logits, 1)


@functools.cache
def _prompts():
    g = torch.Generator().manual_seed(1)
    return tuple(torch.randint(2, 64, (n,), generator=g) for n in GEN_LENS)


@functools.cache
def _alone_generated(new):
    return _generate(_prompts()[:1], new)


def test_patch_model_generate_alone_equals_in_a_padded_batch():
    """Issue: greedy generate() of a prompt alone gives the same tokens and logits, bitwise, as inside
    a left-padded batch of others (patch_model with CacheConfig(batch_invariant=True)). Without the
    mode around the model (its GEMMs and sigmoids torch's) the logits differ (1e-6 here)."""
    tokens, logits = _alone_generated(3)
    busy_tokens, busy_logits = _generate(_prompts())
    assert logits.abs().sum() > 0
    assert torch.equal(busy_tokens[0], tokens[0]) and torch.equal(busy_logits[0], logits[0])


def test_patch_model_generate_with_a_batch_dependent_mm_put_back_is_caught(monkeypatch):
    from dsv4ops import invariant_mode

    _, logits = _alone_generated(3)
    monkeypatch.setitem(invariant_mode._GEMMS, torch.ops.aten.mm.default, _split_mm)
    _, busy_logits = _generate(_prompts(), new=1)  # the prefill's logits already differ
    assert not torch.equal(busy_logits[0, 0], logits[0, 0])


def test_patch_model_compiled_layers_run_outside_the_mode():
    """compile= with a batch-invariant cache: Dynamo does not trace under a dispatch mode (fullgraph
    found no frame), so the compiled layers run with the mode suspended; with the aot_eager backend
    (the same ops) the logits are those of the eager run, bit for bit."""
    from dsv4ops.integrations.transformers import patch_model

    model = patch_model(copy.deepcopy(_gen_model()), CacheConfig(max_requests=4, max_context=32, max_step_tokens=64,
                                                                  batch_invariant=True), compile={"backend": "aot_eager"})
    with torch.no_grad():
        out = model.generate(_prompts()[0][None], max_new_tokens=2, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
    assert torch.equal(torch.stack(out.logits, 1)[0], _alone_generated(3)[1][0, :2])


def test_patch_model_gives_the_flag_to_every_layers_cache():
    """patch_model(model, CacheConfig(batch_invariant=True)): the manager it makes and every patched
    layer's cache compute batch-invariantly; its default cache config keeps the fast schedules."""
    from transformers import DeepseekV4ForCausalLM

    from dsv4ops.integrations.transformers import default_cache_config, patch_model

    hc = testing.hf_config(DSV4AttentionConfig.tiny(num_layers=2, compress_ratios=(4, 0)), moe_intermediate_size=32)
    model = DeepseekV4ForCausalLM(hc).eval()
    assert default_cache_config(hc).batch_invariant is False
    patch_model(model, dataclasses.replace(default_cache_config(hc), max_requests=2, batch_invariant=True))
    caches = [layer.self_attn.cache for layer in model.model.layers]
    assert len(caches) == 2 and all(c.cfg.batch_invariant for c in caches)


def test_bad_input_is_refused():
    with pytest.raises(TypeError, match="batch_invariant: expected a bool, got str"):
        CacheConfig(max_requests=1, max_context=8, max_step_tokens=4, batch_invariant="yes")
    # (Tensor and context parallelism: test_tp.py / test_dcp.py's bad-use bodies.)
    x, w = torch.randn(3, 8), torch.randn(5, 8, dtype=torch.bfloat16)
    out = torch.full((3, 5), 7.0)
    with pytest.raises(RuntimeError, match=r"weight: expected dtype in \[torch.float32\], got torch.bfloat16"):
        torch.ops.dsv4.invariant_linear(x, w, out)
    with pytest.raises(RuntimeError, match=r"out: expected shape \(3, 4\)"):
        torch.ops.dsv4.invariant_linear(x, w.float()[:4], out)
    assert (out == 7.0).all()


@pytest.mark.parametrize("partial", [False, True])
def test_sparse_attn_rows_do_not_depend_on_the_other_queries_lists(partial):
    """dsv4::sparse_attn with batch_invariant (its CPU reference): query 0 (3 listed entries) served
    beside queries listing 72 gets the bits it gets alone, out and lse. The default schedule's GEMMs
    over the step's longest list give it other bits here (checked), which the layer tests' short
    lists do not reach. The CUDA kernels' splits: tests/test_batch_invariant_gpu.py."""
    a = builders.sparse_attn_args(entries=72, comp_blocks=32, pad=0)
    a["comp_lens"][:] = 72
    a["comp_lens"][0] = 3
    alone = {k: v[:1] if k in ("q", "positions", "req_slots", "comp_idx", "comp_lens") else v for k, v in a.items()}
    rows = []
    for args in (a, alone):
        out = torch.full_like(args["q"], float("nan"))
        lse = torch.full(args["q"].shape[:2], float("nan")) if partial else None
        torch.ops.dsv4.sparse_attn(**dict(args, out=out), lse=lse, batch_invariant=True)
        rows.append((out[0], lse[0]) if partial else (out[0],))
    assert rows[0][0].abs().sum() > 0
    for busy, own in zip(*rows):
        assert torch.equal(busy, own)
