"""GPU: the --sweep harness end to end on small points (CUDA-graph timings of our kernel and FlashMLA
on the same keys, the head shards, the whole layer's decode step and its FlashMLA + bf16 GEMM
composition). rel_diff compares two bf16 kernels on the same keys: ~1e-3 (bench kit: 2e-3 .. 3e-4);
a key list or pool the two read differently gives O(1), which is what the bound catches. Issue 30.

Run: python -m pytest -m gpu tests/test_bench_gpu.py
"""

import pytest
import torch

from dsv4ops.bench import flashmla, layer_step, sweep
from dsv4ops.bench.attention import new_layer
from dsv4ops.bench.timing import graph_time_us
from dsv4ops.config import CSA, HCA, SLIDING

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or not flashmla.available(),
                                 reason="needs a CUDA GPU and flash_mla")]

SAME_KEYS = 0.02


@pytest.mark.parametrize("model,kind", [("flash", SLIDING), ("flash", CSA), ("pro", HCA)])
def test_sweep_point_times_ours_and_flashmla_on_the_same_keys(model, kind):
    point = sweep.Point(model, kind, 8, 16384)
    layer = new_layer(kind, sweep.model_config(model, kind))
    with torch.no_grad():
        rows = sweep.run_point(point, layer, sweep.heads_of(model), graph_time_us)
    assert [r["heads"] for r in rows] == list(sweep.heads_of(model))
    for r in rows:
        assert r["error"] is None and r["us"] > 0 and r["flashmla_us"] > 0, r
        assert r["flashmla_heads"] == sweep.flashmla_heads(r["heads"]) and r["rel_diff"] < SAME_KEYS, r
        assert ("vs_flashmla_128" in r) == (model == "pro" and r["heads"] < 128)
    assert not hasattr(layer, "cache")


@pytest.mark.parametrize("kind", [SLIDING, CSA, HCA])
def test_layer_step_and_its_flashmla_composition_capture_and_agree(kind):
    from dsv4ops.bench.attention import Case

    cfg = sweep.model_config("flash", kind)
    layer = new_layer(kind, cfg)
    bf16 = layer_step.to_block_fp8(layer)
    twin = layer_step.bf16_twin(layer, bf16)
    with torch.no_grad():
        case = Case(kind, 32, 4096, 1, model=cfg, layer=layer)
        ours = lambda: case.layer(case.x, case.step)  # noqa: E731
        base = layer_step._attend_with(twin, case, layer_step.flashmla_core(case))
        mixed = layer_step._attend_with(twin, case, None)
        for fn in (ours, base, mixed):
            assert graph_time_us(fn, iters=3, reps=2) > 0
        a, b, c = ours().float(), base().float(), mixed().float()
    # same projections, two cores on the same keys; the block-FP8 step's output is whole
    assert ((c - b).abs().max() / b.abs().max()).item() < SAME_KEYS
    assert a.shape == b.shape and a.isfinite().all()


def test_v41_layer_rows_capture_every_role_compiled():
    """`bench --only layer --model v41` at one small point: every V4.1-Flash role's step captured
    eager and compiled (fullgraph) in CUDA graphs, its kernels counted, its floor positive; the stack
    row sums the 40 layers."""
    from dsv4ops.bench import layer_step_v41

    timer = lambda fn: graph_time_us(fn, iters=3, reps=2)  # noqa: E731
    with torch.no_grad():
        rows = layer_step_v41.run(lambda r: None, "cuda", timer, layer_step.measured_rates(timer), [(8, 4096)])
    roles = layer_step_v41.role_counts(layer_step_v41.FLASH)
    assert [r["layer"] for r in rows] == [*roles, "stack of 40"]
    for r in rows:
        assert r["eager_us"] > 0 and r["compiled_us"] > 0 and r["kernels"] > 0 and r["floor_us"] > 0, r


def test_prefill_chunk_at_an_offset_runs_ours_and_flashmla_on_the_same_keys():
    """`--case csa:1x6K:2K`: a 2K-token chunk after 4K cached tokens; sparse_attn and FlashMLA's sparse
    prefill (on the same window slots and selected entries, gathered to bf16) agree, and the attention
    rows time both."""
    from dsv4ops.bench import attention

    case = attention.Case(CSA, 1, 6144, 2048)
    assert case.step.positions[0].item() == 4096
    calls = case.op_calls()
    with torch.no_grad():
        for call in calls.values():
            call()
        theirs = case.flashmla_call()().float()
    assert ((case.o.float() - theirs).abs().max() / theirs.abs().max()).item() < SAME_KEYS
    with torch.no_grad():
        rows = attention.bench_case(case, with_reference=False)
    row = next(r for r in rows if r["op"] == "sparse_attn")
    assert row["tokens"] == 2048 and row["us"] > 0 and row["flashmla_us"] > 0
