"""GPU tier 1: the CPU suite's serving cases (one-shot, chunked, decode; every layer type and cache
mode; padding) on CUDA tensors, i.e. through the Triton kernels.

Unquantized pools run an fp32 model (fp32 rows): the kernels match the fp32 reference to its own
fp32 error. FP8 pools run a bf16 model: a one-ulp difference in a kernel's fp32 RoPE can move a
value across a bf16 / e4m3 rounding boundary, which the bf16 reference run's error budget covers
and an fp32 run's does not (seen: 1.9e-5 against a 4.2e-6 fp32 budget)."""

import drivers
import pytest
import torch
from test_serving import LENGTHS, MODES, SCHEDULES, _check_against_stateless, _pool_bytes, _random_chunks, _setup


from dsv4ops.config import CSA, HCA, SLIDING

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("mode", sorted(MODES))
@pytest.mark.parametrize("kind", [SLIDING, CSA, HCA])
def test_serving_equals_stateless_on_cuda(kind, mode, schedule):
    dtype = torch.bfloat16 if mode == "fp8" else torch.float32
    layer, manager, inputs = _setup(kind, mode, device="cuda", dtype=dtype)
    with torch.no_grad():
        outs = drivers.serve_schedule(layer, manager, inputs, SCHEDULES[schedule]())
    _check_against_stateless(layer, inputs, outs, mode)


@pytest.mark.parametrize("kind", [CSA, HCA])
def test_padding_tokens_change_nothing_on_cuda(kind):
    steps = _random_chunks(2)
    runs = []
    for garbage in (None, torch.Generator().manual_seed(7)):
        layer, manager, inputs = _setup(kind, "fp8", buckets=(400,), device="cuda", dtype=torch.bfloat16)
        with torch.no_grad():
            outs = drivers.serve_schedule(layer, manager, inputs, steps, garbage=garbage)
        runs.append((outs, _pool_bytes(layer)))
    (o1, p1), (o2, p2) = runs
    for rid in LENGTHS:
        assert torch.equal(o1[rid], o2[rid]), rid
    for name in p1:
        assert torch.equal(p1[name], p2[name]), name
