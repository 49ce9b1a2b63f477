"""GPU tier 1: patch_model on CUDA (bf16 model, FP8 paged cache, Triton kernels) under
torch.compile, generate() against the oracle model (tests/test_transformers.py's checks).

The bf16 model's budget (its bf16 oracle run: 2 x bound = 9e-2 on the logits, H100) is wider than
the tiny random model's top-2 logit margins at every one of the 15 steps, so here the logits
check carries the test and the token check covers only the steps that happen to be decisive
(the fp32 CPU tests require half of them to be)."""

import copy

import pytest
import torch
from test_transformers import _check_steps, _double, _generate, _model, _oracle_model, _prompts, _rows, _teacher_forced

from dsv4ops import reference, testing
from dsv4ops.cache import CacheConfig
from dsv4ops.integrations.transformers import patch_model

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("compile", [False, {}, {"mode": "reduce-overhead"}], ids=["eager", "inductor", "graphs"])
def test_patched_generate_on_cuda(compile):
    torch._dynamo.reset()
    base = _model().to("cuda", torch.bfloat16)
    patched = patch_model(copy.deepcopy(base), CacheConfig(max_requests=4, max_context=512, max_step_tokens=512),
                          compile=compile)
    ids, mask = _prompts(3, seed=11).cuda(), torch.ones(3, 136, dtype=torch.long, device="cuda")
    mask[2, :9], ids[2, :9] = 0, 0
    tokens, logits = _generate(patched, ids, mask)
    rows = _rows(ids, mask, tokens)
    numerics = reference.Numerics(kv="fp8", indexer="fp8")
    oracle64 = _double(_oracle_model(base, numerics))
    ref64 = _teacher_forced(oracle64, rows)
    lowp = [_teacher_forced(_oracle_model(base, numerics), rows)]
    lowp += testing.rounding_twins(lambda: _teacher_forced(oracle64, rows))
    _check_steps(tokens, logits, ref64, lowp, f"cuda, compile={compile}", decisive=0.0)
