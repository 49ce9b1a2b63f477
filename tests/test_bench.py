"""The benchmark harness measures the layer's own computation (CPU smoke run, timers stubbed)."""

import pytest
import torch

from dsv4ops import DSV4AttentionConfig
from dsv4ops.bench import attention
from dsv4ops.config import CSA, HCA, SLIDING
from dsv4ops.reference.functional import grouped_output


@pytest.mark.parametrize("kind", [SLIDING, CSA, HCA])
def test_attention_case_core_is_the_layer_step(kind, monkeypatch):
    monkeypatch.setattr(attention, "graph_time_us", lambda fn, iters=30: (fn(), 1.0)[1])
    monkeypatch.setattr(attention, "eager_time_us", lambda fn, iters=10: (fn(), 2.0)[1])
    monkeypatch.setattr(attention, "ceilings", lambda: {"copy": 1e12, "gather": 1e12, "bf16": 1e14})
    model = DSV4AttentionConfig.tiny()
    case = attention.Case(kind, batch=2, context=300, new_tokens=1, device="cpu", model=model)
    with torch.no_grad():
        rows = attention.bench_case(case, with_reference=True)
        y_layer = case.layer(case.x, case.step)
        case.core()()
        layer = case.layer
        y_core = grouped_output(case.o_rot, layer.o_a_proj.weight, layer.o_b_proj.weight, model.o_groups)
    torch.testing.assert_close(y_core, y_layer, rtol=0, atol=0)
    ops = [r["op"] for r in rows]
    expect = {SLIDING: 3, CSA: 7, HCA: 4}[kind]
    assert len([r for r in rows if "reference_us" in r]) == expect
    assert ops[-3:] == ["attention core (all ops)", "projection GEMMs + norms (layer - core)", "whole layer"]
    assert all(r["pct_ceiling"] > 0 for r in rows if "pct_ceiling" in r)
