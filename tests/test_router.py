"""V4 router on CPU: parity with transformers, selection rules, bad inputs, op registration (schemas,
opcheck, fakes, torch.compile) and the CuTe decode-gate kernels compiled for sm_90a / sm_100a.
Helpers here are shared with tests/test_router_gpu.py."""

import importlib.util
import math
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F
from expecttest import assert_expected_inline
from torch._subclasses.fake_tensor import FakeTensorMode

import dsv4ops  # noqa: F401  (defines the dsv4:: ops)
from dsv4ops import testing
from dsv4ops.config import DSV4AttentionConfig
from dsv4ops.router import api, reference
from dsv4ops.router import cuda as router_cuda
from dsv4ops.router.modules import DeepseekV4HashRouter, DeepseekV4Router

hf_v4 = pytest.importorskip("transformers.models.deepseek_v4.modeling_deepseek_v4")
hf_config = pytest.importorskip("transformers.models.deepseek_v4.configuration_deepseek_v4")

OPS = {name: getattr(torch.ops.dsv4, name).default for name in ("gate_topk", "hash_route", "router_gate")}
EPS32 = torch.finfo(torch.float32).eps


# ---- shared helpers ------------------------------------------------------------------------------
def weights_fp64(logits, indices, scale):
    """The renormalised weights of `indices`, in fp64: the oracle for tolerance budgets."""
    scores = F.softplus(logits.double()).sqrt().gather(1, indices.long())
    return scores / (scores.sum(-1, keepdim=True) + 1e-20) * scale


def assert_weights_close(actual, logits, indices, scale):
    """Rule: |actual - fp64| <= 2 |fp32 reference - fp64| + 1 ulp of the scale (anchors-style rule 11)."""
    logits, indices = logits.cpu(), indices.cpu()
    ref64 = weights_fp64(logits, indices, scale)
    ref32 = reference.renormalize(reference.sqrt_softplus(logits), indices.long(), scale)
    budget = 2 * (ref32.double() - ref64).abs().max().item() + EPS32 * scale
    err = (actual.cpu().double() - ref64).abs().max().item()
    assert err <= budget, f"weights: max error {err:.3g} over budget {budget:.3g}"


def assert_topk_matches(indices, keys, k, tol=0.0):
    """`indices` must equal the stable top-k of the reference `keys` wherever the sorted keys around
    the choice are more than `tol` apart (`tol`: the ulps two float implementations may differ by);
    elsewhere every chosen key must lie within `tol` of the k-th largest."""
    indices, keys = indices.cpu().long(), keys.cpu().double()
    expect = reference.stable_topk(keys, k)
    sorted_keys = keys.sort(-1, descending=True).values[:, : min(k + 1, keys.shape[1])]
    gaps = (sorted_keys[:, :-1] - sorted_keys[:, 1:]).abs()
    clear = (gaps > tol).all(-1) if gaps.shape[1] else torch.ones(keys.shape[0], dtype=torch.bool)
    assert torch.equal(indices[clear], expect[clear]), "indices differ from the reference top-k"
    if not clear.all():
        chosen = keys[~clear].gather(1, indices[~clear])
        assert (chosen >= sorted_keys[~clear][:, k - 1 : k] - tol).all(), "a chosen key is below the k-th"


def tie_free_logits(tokens, experts, device="cpu", dtype=torch.float32, spacing=1e-2):
    """Each row a random permutation of an evenly spaced grid: keys differ by >= `spacing` (before
    the bias), far above any rounding difference between kernels."""
    grid = (torch.arange(experts, dtype=torch.float64) - experts / 2) * spacing * 40 / experts
    perm = torch.argsort(torch.rand(tokens, experts), dim=-1)
    return grid[perm].to(dtype=dtype, device=device)


def hf_router_config(**overrides):
    base = dict(hidden_size=64, n_routed_experts=32, num_experts_per_tok=6, vocab_size=97, routed_scaling_factor=2.5)
    base.update(overrides)
    return hf_config.DeepseekV4Config(**base)


def poisoned(shape, dtype, device="cpu"):
    fill = float("nan") if dtype.is_floating_point else -1
    return torch.full(shape, fill, dtype=dtype, device=device)


def gate_topk_sample(device, tokens=5, experts=16, k=4, dtype=torch.float32, transposed=False):
    logits = (
        torch.randn(experts, tokens, device=device).t().to(dtype)
        if transposed
        else (torch.randn(tokens, experts, device=device, dtype=dtype))
    )
    bias = torch.randn(experts, device=device) * 0.1
    return (logits, bias, poisoned((tokens, k), torch.float32, device), poisoned((tokens, k), torch.int64, device), 2.5)


def hash_route_sample(device, tokens=4, experts=16, vocab=10, k=3, dtype=torch.float32, index=torch.int64):
    logits = torch.randn(tokens, experts, device=device, dtype=dtype)
    token_ids = torch.randint(0, vocab, (tokens,), device=device, dtype=index)
    tid2eid = torch.randint(0, experts, (vocab, k), device=device, dtype=index)
    return (
        logits,
        token_ids,
        tid2eid,
        poisoned((tokens, k), torch.float32, device),
        poisoned((tokens, k), torch.int64, device),
        1.5,
    )


def router_gate_sample(device, tokens=4, hidden=32, experts=16, k=4, dtype=torch.float32):
    x = torch.randn(tokens, hidden, device=device, dtype=dtype)
    weight = (torch.randn(experts, hidden, device=device) / math.sqrt(hidden)).to(dtype)
    bias = torch.randn(experts, device=device) * 0.1
    return (
        x,
        weight,
        bias,
        poisoned((tokens, experts), torch.float32, device),
        poisoned((tokens, k), torch.float32, device),
        poisoned((tokens, k), torch.int64, device),
        1.5,
    )


# Size-1 dims, bf16 and fp32, int32 ids, a transposed (non-contiguous) input and an empty batch.
SAMPLES = {
    "gate_topk-fp32": ("gate_topk", lambda d: gate_topk_sample(d)),
    "gate_topk-bf16": ("gate_topk", lambda d: gate_topk_sample(d, 3, 8, 2, torch.bfloat16)),
    "gate_topk-size1": ("gate_topk", lambda d: gate_topk_sample(d, 1, 1, 1)),
    "gate_topk-transposed": ("gate_topk", lambda d: gate_topk_sample(d, 6, 12, 3, transposed=True)),
    "gate_topk-empty": ("gate_topk", lambda d: gate_topk_sample(d, 0, 8, 2)),
    "hash_route-fp32": ("hash_route", lambda d: hash_route_sample(d)),
    "hash_route-bf16-int32": ("hash_route", lambda d: hash_route_sample(d, 3, 8, 5, 2, torch.bfloat16, torch.int32)),
    "hash_route-size1": ("hash_route", lambda d: hash_route_sample(d, 1, 1, 1, 1)),
    "router_gate-fp32": ("router_gate", lambda d: router_gate_sample(d)),
    "router_gate-bf16": ("router_gate", lambda d: router_gate_sample(d, 2, 16, 8, 2, torch.bfloat16)),
    "router_gate-size1": ("router_gate", lambda d: router_gate_sample(d, 1, 1, 1, 1)),
}


def run_opcheck(sample, device):
    op_name, make_args = sample
    args = make_args(device)
    tol = dict(atol=0, rtol=0)  # the same kernel runs in eager and traced mode: bit-equal
    result = torch.library.opcheck(OPS[op_name], args, raise_exception=False, **tol)
    assert all(v == "SUCCESS" for v in result.values()), result


# ---- schemas -------------------------------------------------------------------------------------
def test_schemas():
    assert_expected_inline(
        str(OPS["gate_topk"]._schema),
        """dsv4::gate_topk(Tensor logits, Tensor bias, Tensor(a2!) weights_out, Tensor(a3!) indices_out, float routed_scaling_factor) -> ()""",
    )
    assert_expected_inline(
        str(OPS["hash_route"]._schema),
        """dsv4::hash_route(Tensor logits, Tensor token_ids, Tensor tid2eid, Tensor(a3!) weights_out, Tensor(a4!) indices_out, float routed_scaling_factor) -> ()""",
    )
    assert_expected_inline(
        str(OPS["router_gate"]._schema),
        """dsv4::router_gate(Tensor x, Tensor weight, Tensor bias, Tensor(a3!) logits_out, Tensor(a4!) weights_out, Tensor(a5!) indices_out, float routed_scaling_factor) -> ()""",
    )


# ---- parity with transformers (fp32, tie-free) ---------------------------------------------------
@pytest.mark.parametrize(
    "make_config",
    [hf_router_config, lambda: DSV4AttentionConfig.tiny(hidden_size=64)],
    ids=["transformers-config", "dsv4-config"],
)
def test_topk_router_matches_transformers(make_config):
    config = make_config()
    hf = hf_v4.DeepseekV4TopKRouter(
        hf_router_config(
            hidden_size=config.hidden_size,
            n_routed_experts=config.n_routed_experts,
            num_experts_per_tok=config.num_experts_per_tok,
            routed_scaling_factor=config.routed_scaling_factor,
        )
    )
    torch.nn.init.normal_(hf.weight, std=0.2)
    hf.e_score_correction_bias.normal_(std=0.1)
    ours = DeepseekV4Router(config)
    ours.load_state_dict(hf.state_dict())
    x = torch.randn(3, 7, config.hidden_size)
    with torch.no_grad():
        hf_logits, hf_weights, hf_indices = hf(x)
        logits, weights, indices = ours(x)
    torch.testing.assert_close(logits, hf_logits, atol=0, rtol=0)  # the same fp32 GEMM on CPU
    keys = reference.sqrt_softplus(logits) + ours.e_score_correction_bias
    assert_topk_matches(indices, keys, config.num_experts_per_tok)
    # transformers' topk is unsorted: compare (index, weight) pairs in index order.
    order, hf_order = indices.argsort(-1), hf_indices.argsort(-1)
    assert torch.equal(indices.gather(1, order), hf_indices.gather(1, hf_order))
    assert_weights_close(weights.gather(1, order), logits, indices.gather(1, order), config.routed_scaling_factor)
    assert_weights_close(hf_weights.gather(1, hf_order), logits, indices.gather(1, order), config.routed_scaling_factor)


def test_hash_router_matches_transformers():
    config = hf_router_config()
    hf = hf_v4.DeepseekV4HashRouter(config)
    torch.nn.init.normal_(hf.weight, std=0.2)
    hf.tid2eid.copy_(torch.randint(0, config.n_routed_experts, hf.tid2eid.shape))
    ours = DeepseekV4HashRouter(config)
    ours.load_state_dict(hf.state_dict())
    x, ids = torch.randn(2, 5, config.hidden_size), torch.randint(0, config.vocab_size, (2, 5))
    with torch.no_grad():
        hf_logits, hf_weights, hf_indices = hf(x, ids)
        logits, weights, indices = ours(x, ids)
    torch.testing.assert_close(logits, hf_logits, atol=0, rtol=0)
    assert torch.equal(indices, hf_indices)
    assert_weights_close(weights, logits, indices, config.routed_scaling_factor)
    assert_weights_close(hf_weights, logits, indices, config.routed_scaling_factor)


def test_module_names_and_config_check():
    router = DeepseekV4Router(DSV4AttentionConfig.tiny())
    assert set(router.state_dict()) == {"weight", "e_score_correction_bias"}
    assert set(DeepseekV4HashRouter(DSV4AttentionConfig.tiny()).state_dict()) == {"weight", "tid2eid"}
    with pytest.raises(ValueError, match="scoring_func: expected 'sqrtsoftplus'.*'softmax'"):
        DeepseekV4Router(hf_router_config(scoring_func="softmax"))


# ---- selection rules -----------------------------------------------------------------------------
def test_exact_ties_pick_the_lower_expert():
    logits = torch.zeros(2, 10)
    logits[0, [7, 3, 5]] = 2.0  # three equal best keys
    logits[1, [9, 2]] = 1.0
    weights, indices = api.gate_topk(logits, torch.zeros(10), 2, 1.0)
    assert indices.tolist() == [[3, 5], [2, 9]]
    torch.testing.assert_close(weights, torch.full((2, 2), 0.5), atol=0, rtol=0)


def test_bias_ties_and_unbiased_weights():
    # Equal keys from different scores: the bias only orders, the weights use the raw scores.
    logits = torch.tensor([[0.0, 1.0, -1.0, 0.5]])
    scores = reference.sqrt_softplus(logits)[0]
    bias = torch.tensor([1.0, 1.0 + scores[0] - scores[1], 0.0, -5.0])  # keys 0 and 1 tie exactly
    assert (scores[0] + bias[0]).item() == (scores[1] + bias[1]).item()
    weights, indices = api.gate_topk(logits, bias, 2, 3.0)
    assert indices.tolist() == [[0, 1]]
    assert_weights_close(weights, logits, indices, 3.0)


def test_all_equal_scores():
    weights, indices = api.gate_topk(torch.full((3, 16), 0.25), torch.zeros(16), 6, 1.5)
    assert indices.tolist() == [list(range(6))] * 3
    torch.testing.assert_close(weights, torch.full((3, 6), 1.5 / 6), atol=0, rtol=EPS32)


def test_k_equals_number_of_experts():
    logits, bias = tie_free_logits(4, 12), torch.randn(12) * 1e-3
    weights, indices = api.gate_topk(logits, bias, 12, 2.0)
    assert torch.equal(indices.sort(-1).values, torch.arange(12).expand(4, 12))
    assert_topk_matches(indices, reference.sqrt_softplus(logits) + bias, 12)
    torch.testing.assert_close(weights.sum(-1), torch.full((4,), 2.0), atol=0, rtol=4 * EPS32)


# ---- batch invariance ----------------------------------------------------------------------------
# 12 experts: not a multiple of the CPU's SIMD width, so a row alone and a row inside a 37-row call
# meet ATen's softplus on different paths unless the reference pads them (reference.sqrt_softplus).
def _rows_alone(fn, *rows_args):
    """fn over each row of the per-token arguments alone, stacked per output."""
    outs = [fn(*(a[i:i + 1].clone() for a in rows_args)) for i in range(rows_args[0].shape[0])]
    return [torch.cat(parts) for parts in zip(*outs)]


def test_reference_routing_rows_do_not_depend_on_the_other_tokens():
    """gate_topk and hash_route (the CPU kernels): a token's weights and indices are bitwise those of
    the token alone."""
    g = torch.Generator().manual_seed(5)
    logits, bias = torch.randn(37, 12, generator=g) * 3, torch.randn(12, generator=g) * 0.1
    ids, tid2eid = torch.randint(0, 50, (37,), generator=g), torch.randint(0, 12, (50, 4), generator=g)
    busy = api.gate_topk(logits, bias, 4, 1.5)
    for got, want in zip(busy, _rows_alone(lambda lg: api.gate_topk(lg, bias, 4, 1.5), logits)):
        assert torch.equal(got, want)
    busy = api.hash_route(logits, ids, tid2eid, 1.5)
    for got, want in zip(busy, _rows_alone(lambda lg, i: api.hash_route(lg, i, tid2eid, 1.5), logits, ids)):
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_invariant_gate_rows_do_not_depend_on_the_other_tokens(dtype):
    """router_gate / gate_logits and the modules with batch_invariant: a token's logits, weights and
    indices are bitwise those of the token alone (the default gate GEMM is torch.mm's, whose rows
    change with the row count on the CPU: MKL picks its kernel by M). The logits stay the fp32 GEMM."""
    config = DSV4AttentionConfig.tiny(hidden_size=64, n_routed_experts=12, num_experts_per_tok=4)
    router, hashed = DeepseekV4Router(config, batch_invariant=True), DeepseekV4HashRouter(config, batch_invariant=True)
    torch.nn.init.normal_(router.weight, std=0.2)
    router.e_score_correction_bias.normal_(std=0.1)
    hashed.weight.data.copy_(router.weight)
    hashed.tid2eid.copy_(torch.randint(0, 12, hashed.tid2eid.shape))
    router.to(dtype), hashed.to(dtype)
    x, ids = torch.randn(37, 64).to(dtype), torch.randint(0, config.vocab_size, (37,))
    with torch.no_grad():
        busy = router(x)
        w = router.weight
        testing.assert_close_to_ref(busy[0], x.double() @ w.double().t(), [x.float() @ w.float().t()], what="logits")
        for got, want in zip(busy, _rows_alone(router, x)):
            assert torch.equal(got, want)
        for got, want in zip(hashed(x, ids), _rows_alone(hashed, x, ids)):
            assert torch.equal(got, want)
    with pytest.raises(TypeError, match="batch_invariant: expected a bool, got str"):
        DeepseekV4Router(config, batch_invariant="yes")


# ---- bad inputs ----------------------------------------------------------------------------------
def test_bad_values_are_rejected_by_the_api():
    logits, tid2eid = torch.randn(3, 8), torch.randint(0, 8, (10, 2))
    with pytest.raises(ValueError, match=r"token_ids: expected values in \[0, 10\) \(rows of tid2eid\), got 10"):
        api.hash_route(logits, torch.tensor([0, 10, 2]), tid2eid, 1.0)
    with pytest.raises(ValueError, match=r"token_ids: expected values in \[0, 10\).*got -1"):
        api.hash_route(logits, torch.tensor([-1, 0, 2]), tid2eid, 1.0)
    tid2eid[4, 1] = 8
    with pytest.raises(
        ValueError, match=r"tid2eid: expected values in \[0, 8\) \(experts, at the looked-up rows\), got 8"
    ):
        api.hash_route(logits, torch.tensor([0, 4, 2]), tid2eid, 1.0)
    api.hash_route(logits, torch.tensor([0, 1, 2]), tid2eid, 1.0)  # row 4 is not looked up: fine
    with pytest.raises(ValueError, match=r"k: expected 1 <= k <= 8 \(the number of experts\), got 9"):
        api.gate_topk(logits, torch.zeros(8), 9, 1.0)
    with pytest.raises(ValueError, match=r"k: expected 1 <= k <= 8 \(the number of experts\), got 0"):
        api.router_gate(torch.randn(3, 4), torch.randn(8, 4), torch.zeros(8), 0, 1.0)


BAD_METADATA = [
    ("gate_topk", lambda a: (a[0].int(), *a[1:]), "logits: expected a float dtype, got torch.int32"),
    ("gate_topk", lambda a: (a[0], a[1].bfloat16(), *a[2:]), "bias: expected torch.float32, got torch.bfloat16"),
    (
        "gate_topk",
        lambda a: (a[0], torch.zeros(15), *a[2:]),
        r"bias: expected shape \(16,\) \(one per expert\), got \(15,\)",
    ),
    ("gate_topk", lambda a: (*a[:3], a[3].int(), a[4]), "indices_out: expected torch.int64, got torch.int32"),
    (
        "gate_topk",
        lambda a: (a[0][:, :3], torch.zeros(3), *a[2:]),
        r"k: expected at most the number of experts \(3\), got 4",
    ),
    ("hash_route", lambda a: (a[0], a[1].float(), *a[2:]), "token_ids: expected int32 or int64, got torch.float32"),
    (
        "hash_route",
        lambda a: (*a[:3], a[3][:, :2], a[4][:, :2], a[5]),
        r"weights_out: expected k = 3 \(tid2eid columns\), got 2",
    ),
    (
        "router_gate",
        lambda a: (a[0], a[1].bfloat16(), *a[2:]),
        r"weight: expected torch.float32 \(as x\), got torch.bfloat16",
    ),
    ("router_gate", lambda a: (a[0], a[1][:15], *a[2:]), r"logits_out: expected float32 \[4, 15\]"),
    # Issue 52: float scalars are checked (a NaN factor gave NaN weights).
    ("gate_topk", lambda a: (*a[:4], float("nan")),
     r"routed_scaling_factor: expected a finite value > 0 \(the sum of a token's routed weights\), got nan"),
    ("hash_route", lambda a: (*a[:5], float("inf")), r"routed_scaling_factor: expected a finite value > 0 .*got inf"),
    ("router_gate", lambda a: (*a[:6], 0.0), r"routed_scaling_factor: expected a finite value > 0 .*got 0.0"),
]


@pytest.mark.parametrize("op_name,corrupt,message", BAD_METADATA, ids=[m[:40] for _, _, m in BAD_METADATA])
def test_bad_metadata_raises_and_writes_nothing(op_name, corrupt, message, device="cpu"):
    make = {"gate_topk": gate_topk_sample, "hash_route": hash_route_sample, "router_gate": router_gate_sample}[op_name]
    args = corrupt(make(device))
    outputs = [a for a in args if isinstance(a, torch.Tensor) and a.dtype in (torch.float32, torch.int64)][-2:]
    before = [o.clone() for o in outputs]
    with pytest.raises(RuntimeError, match=message):
        OPS[op_name](*args)
    for o, b in zip(outputs, before):
        torch.testing.assert_close(o, b, equal_nan=True, atol=0, rtol=0)


# ---- registration: opcheck, fakes, compile -------------------------------------------------------
@pytest.mark.parametrize("name", list(SAMPLES))
def test_opcheck(name):
    run_opcheck(SAMPLES[name], "cpu")


def public_calls(device):
    logits, bias = torch.randn(5, 16, device=device), torch.zeros(16, device=device)
    token_ids, tid2eid = torch.randint(0, 9, (5,), device=device), torch.randint(0, 16, (9, 6), device=device)
    x, weight = (
        torch.randn(5, 32, device=device, dtype=torch.bfloat16),
        torch.randn(16, 32, device=device, dtype=torch.bfloat16),
    )
    return {
        "gate_topk": lambda: api.gate_topk(logits, bias, 6, 1.5),
        "hash_route": lambda: api.hash_route(logits, token_ids, tid2eid, 1.5),
        "router_gate": lambda: api.router_gate(x, weight, bias, 6, 1.5),
        "gate_logits": lambda: (api.gate_logits(x, weight),),
    }


def _meta(ts):
    return [(tuple(t.shape), t.dtype, t.stride()) for t in ts]


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_public_functions_under_fake_tensors(device):
    real = {name: _meta(call()) for name, call in public_calls("cpu").items()}
    with FakeTensorMode(allow_non_fake_inputs=False):
        fake = {name: call() for name, call in public_calls(device).items()}
    for name, outs in fake.items():
        assert all(t.device.type == device for t in outs), name
        assert _meta(outs) == real[name], name


def test_modules_compile_fullgraph():
    config = DSV4AttentionConfig.tiny(hidden_size=64)
    router, hash_router = DeepseekV4Router(config), DeepseekV4HashRouter(config)
    torch.nn.init.normal_(router.weight, std=0.2)
    torch.nn.init.normal_(hash_router.weight, std=0.2)
    hash_router.tid2eid.copy_(torch.randint(0, config.n_routed_experts, hash_router.tid2eid.shape))
    x, ids = torch.randn(2, 3, 64), torch.randint(0, config.vocab_size, (2, 3))
    torch._dynamo.reset()
    with torch.no_grad():
        for module, args in ((router, (x,)), (hash_router, (x, ids))):
            compiled = torch.compile(module, fullgraph=True, backend="aot_eager")
            for got, want in zip(compiled(*args), module(*args)):
                torch.testing.assert_close(got, want, atol=0, rtol=0)


# ---- dispatch and import hygiene -----------------------------------------------------------------
def test_decode_gate_backend_table():
    assert router_cuda._decode_gate_backend(1, (9, 0)) == "cute_sm90"
    assert router_cuda._decode_gate_backend(64, (9, 0)) == "cute_sm90"
    assert router_cuda._decode_gate_backend(65, (9, 0)) == "csrc"
    assert router_cuda._decode_gate_backend(8, (10, 0)) == "csrc"  # tcgen05 kernel not yet run on hardware
    assert router_cuda._decode_gate_backend(8, (8, 0)) == "csrc"


def test_import_loads_no_backend():
    code = (
        "import sys, dsv4ops, dsv4ops.router.api, dsv4ops.router.cuda, dsv4ops.router.modules\n"
        "bad = [m for m in ('cutlass', 'triton', 'torch.utils.cpp_extension') if m in sys.modules]\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# ---- CuTe decode gate: compile-only on CPU -------------------------------------------------------
requires_cutlass = pytest.mark.skipif(
    importlib.util.find_spec("cutlass") is None, reason="nvidia-cutlass-dsl is not installed (pip install dsv4ops[gpu])"
)


def test_plan_fits_the_grid_in_the_sms():
    from dsv4ops.router.cute import plan  # imports no cutlass symbol at call time, but the module needs it

    assert plan(4096, 256, 132) == (2, 32)  # Flash: 128 CTAs
    assert plan(7168, 384, 132) == (7, 16)  # Pro: 96 CTAs
    assert plan(4096, 256, 114) == (4, 16)  # H100 PCIe
    with pytest.raises(ValueError, match="experts"):
        plan(64, 64 * 200, 132)


test_plan_fits_the_grid_in_the_sms = requires_cutlass(test_plan_fits_the_grid_in_the_sms)


@requires_cutlass
@pytest.mark.parametrize("arch", ["sm90", "sm100"])
@pytest.mark.parametrize("shape", [(4096, 256), (7168, 384)], ids=["flash", "pro"])
def test_cute_decode_gate_compiles(arch, shape):
    from dsv4ops.router import cute

    module = importlib.import_module(f"dsv4ops.router.cute_{arch}")
    kernel_cls = {"sm90": "RouterGateSm90", "sm100": "RouterGateSm100"}[arch]
    compiled, splits = cute.compile_kernel(getattr(module, kernel_cls), torch.bfloat16, *shape, 6, 132)
    assert callable(compiled)
    assert splits == cute.plan(*shape, 132)[1]


# ---- CUDA backends: bound at a run, never while tracing; a failed build raises --------------------
def test_router_fakes_have_no_side_effects(monkeypatch):
    """Tracing (here: the fakes on CUDA fake tensors) neither builds csrc/ nor registers a kernel."""
    from dsv4ops import csrc

    def forbidden(*args, **kwargs):
        raise AssertionError("a router fake tried to build or bind the CUDA kernels")

    monkeypatch.setattr(csrc, "load", forbidden)
    monkeypatch.setattr(router_cuda, "load_cuda_backends", forbidden)
    with FakeTensorMode():
        for name, call in public_calls("cuda").items():
            call()
        for name, make in (("gate_topk", gate_topk_sample), ("hash_route", hash_route_sample),
                           ("router_gate", router_gate_sample)):
            OPS[name](*make("cuda"))


def test_failed_csrc_build_raises(monkeypatch):
    from torch.utils import cpp_extension

    from dsv4ops import csrc

    def nvcc_fails(**kwargs):
        raise RuntimeError("Error building extension 'dsv4ops_csrc': nvcc exited with 1")

    monkeypatch.setattr(csrc, "_unavailable_reason", lambda: None)
    monkeypatch.setattr(cpp_extension, "load", nvcc_fails)
    csrc.load.cache_clear()
    try:
        with pytest.raises(RuntimeError, match=r"the CUDA C\+\+ kernels \(csrc/\) are required on this GPU by "
                                               r"the arch table .* building csrc/ failed: Error building extension"):
            csrc.load()
        router_cuda.load_cuda_backends.cache_clear()
        with pytest.raises(RuntimeError, match="building csrc/ failed"):  # where an op meets CUDA tensors
            router_cuda.bind_cuda_kernel("hash_route", (9, 0))
    finally:
        csrc.load.cache_clear()
        router_cuda.load_cuda_backends.cache_clear()
    # Only the arch table sends CUDA tensors to the reference: an architecture without a row.
    assert router_cuda.bind_cuda_kernel("hash_route", (8, 0)) is False
