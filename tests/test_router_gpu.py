"""V4 router on the GPU: every CUDA kernel (csrc gate_topk / hash_route, the CuTe decode gate, the
cuBLAS router_gate path) against the reference, parity with transformers, opcheck on CUDA inputs,
CUDA-graph capture and torch.compile(mode="reduce-overhead") with zero cudagraph skips."""

import pytest
import torch
from test_router import (
    SAMPLES,
    assert_topk_matches,
    assert_weights_close,
    gate_topk_sample,
    hf_router_config,
    hf_v4,
    poisoned,
    router_gate_sample,
    run_opcheck,
)
from torch._dynamo.utils import counters

from dsv4ops.router import reference
from dsv4ops.router import cuda as router_cuda
from dsv4ops.router.modules import DeepseekV4HashRouter, DeepseekV4Router

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
EPS32 = torch.finfo(torch.float32).eps
FLASH, PRO = (4096, 256), (7168, 384)  # (hidden, experts), top-6 both


@pytest.fixture(scope="module", autouse=True)
def _cuda_kernels():
    assert router_cuda.load_cuda_backends(), "the csrc/ build or load failed (see the log)"
    for op in ("gate_topk", "hash_route", "router_gate"):
        assert torch._C._dispatch_has_kernel_for_dispatch_key(f"dsv4::{op}", "CUDA"), op


def key_tol(keys):
    """Two fp32 sqrt(softplus) implementations (CPU libm, CUDA expf/log1pf) differ by a few ulps; 8 ulps
    of the largest key bounds score + bias rounding too."""
    return 8 * EPS32 * keys.abs().max().item()


def is_sm90():
    return torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)


# ---- csrc kernels vs the reference -----------------------------------------------------------
GATE_SHAPES = [(4096, 256, 6), (4096, 384, 6), (33, 64, 8), (5, 1024, 32), (3, 256, 256), (1, 1, 1)]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("tokens,experts,k", GATE_SHAPES)
def test_gate_topk_kernel(tokens, experts, k, dtype):
    logits, bias, weights, indices, scale = gate_topk_sample("cuda", tokens, experts, k, dtype)
    torch.ops.dsv4.gate_topk.default(logits, bias, weights, indices, scale)
    keys = reference.sqrt_softplus(logits.cpu()) + bias.cpu()
    assert_topk_matches(indices, keys, k, key_tol(keys))
    assert_weights_close(weights, logits.cpu().float(), indices, scale)


def test_gate_topk_kernel_ties_nan_and_strides():
    logits = torch.zeros(3, 64, device="cuda")
    logits[0, [40, 7, 33]] = 1.0  # exact ties: lower expert first
    logits[1, 5] = float("nan")  # NaN ranks above every number, as in torch.sort
    logits = logits.t().contiguous().t()  # column-major storage
    bias = torch.zeros(64, device="cuda")
    weights, indices = poisoned((3, 3), torch.float32, "cuda"), poisoned((3, 3), torch.int64, "cuda")
    torch.ops.dsv4.gate_topk.default(logits, bias, weights, indices, 1.0)
    assert indices.tolist() == [[7, 33, 40], [5, 0, 1], [0, 1, 2]]
    ref_w, ref_i = torch.empty(3, 3), torch.empty(3, 3, dtype=torch.int64)
    reference.gate_topk(logits.cpu(), bias.cpu(), ref_w, ref_i, 1.0)
    assert torch.equal(indices.cpu(), ref_i)
    torch.testing.assert_close(weights.cpu(), ref_w, equal_nan=True, atol=0, rtol=4 * EPS32)


@pytest.mark.parametrize("index_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens,experts,k", [(4096, 256, 6), (7, 384, 6), (2, 64, 40)])
def test_hash_route_kernel(tokens, experts, k, dtype, index_dtype):
    logits = torch.randn(tokens, experts, device="cuda", dtype=dtype)
    token_ids = torch.randint(0, 1000, (tokens,), device="cuda", dtype=index_dtype)
    tid2eid = torch.randint(0, experts, (1000, k), device="cuda", dtype=index_dtype)
    weights, indices = poisoned((tokens, k), torch.float32, "cuda"), poisoned((tokens, k), torch.int64, "cuda")
    torch.ops.dsv4.hash_route.default(logits, token_ids, tid2eid, weights, indices, 1.5)
    assert torch.equal(indices.cpu(), tid2eid.cpu()[token_ids.cpu().long()].long())
    assert_weights_close(weights, logits.cpu().float(), indices, 1.5)


def test_hash_route_kernel_reads_nothing_out_of_range():
    # The eager API rejects these; inside the kernel they select nothing (index -1, weight 0).
    logits = torch.randn(3, 16, device="cuda")
    tid2eid = torch.tensor([[1, 2], [3, 99]], device="cuda")
    token_ids = torch.tensor([0, 7, 1], device="cuda")
    weights, indices = poisoned((3, 2), torch.float32, "cuda"), poisoned((3, 2), torch.int64, "cuda")
    torch.ops.dsv4.hash_route.default(logits, token_ids, tid2eid, weights, indices, 1.0)
    assert indices.tolist() == [[1, 2], [-1, -1], [3, -1]]
    assert weights[1].tolist() == [0.0, 0.0] and weights[2, 1].item() == 0.0
    assert weights[2, 0].item() == pytest.approx(1.0, rel=4 * EPS32)


def test_csrc_rejects_bad_metadata_and_writes_nothing():
    logits, bias, weights, indices, scale = gate_topk_sample("cuda", 4, 16, 4)
    with pytest.raises(RuntimeError, match="bias: expected Float, got BFloat16"):
        torch.ops.dsv4.gate_topk.default(logits, bias.bfloat16(), weights, indices, scale)
    with pytest.raises(RuntimeError, match="gate_topk CUDA kernel serves at most 1024 experts, got 2048"):
        torch.ops.dsv4.gate_topk.default(
            torch.randn(4, 2048, device="cuda"), torch.zeros(2048, device="cuda"), weights, indices, scale
        )
    with pytest.raises(RuntimeError, match=r"k: expected at most the number of experts \(2\), got 4"):
        torch.ops.dsv4.gate_topk.default(logits[:, :2], bias[:2], weights, indices, scale)
    with pytest.raises(RuntimeError, match=r"bias: expected shape \(16,\) \(one per expert\), got \(15,\)"):
        torch.ops.dsv4.gate_topk.default(logits, bias[:15], weights, indices, scale)
    assert weights.isnan().all() and (indices == -1).all()


# ---- router_gate: the CuTe decode gate and the cuBLAS path -----------------------------------
def sequential_fp32_gemm(x, weight):
    """x @ weight.T summed term by term in fp32, one rounding per addition: the plain recursive order,
    less accurate than a blocked CPU GEMM; the low-precision reference of the logits budget."""
    x, weight = x.cpu().float(), weight.cpu().float()
    acc = torch.zeros(x.shape[0], weight.shape[0])
    for k in range(x.shape[1]):
        acc += x[:, k, None] * weight[None, :, k]
    return acc


def assert_logits_close(logits, x, weight):
    """The gate GEMM's error against fp64 within twice that of the sequential fp32 GEMM, plus 1 ulp of
    the range: tensor-core and split-K orders must be no worse than the plain one."""
    ref64 = x.cpu().double() @ weight.cpu().double().t()
    budget = 2 * (sequential_fp32_gemm(x, weight).double() - ref64).abs().max().item()
    budget += EPS32 * ref64.abs().max().item()
    err = (logits.cpu().double() - ref64).abs().max().item()
    assert err <= budget, f"logits: max error {err:.3g} over budget {budget:.3g}"


def check_router_gate(x, weight, bias, logits, weights, indices, k, scale):
    assert_logits_close(logits, x, weight)
    keys = reference.sqrt_softplus(logits.cpu()) + bias.cpu()  # selection is checked on the kernel's logits
    assert_topk_matches(indices, keys, k, key_tol(keys))
    assert_weights_close(weights, logits, indices, scale)


@pytest.mark.skipif(not is_sm90(), reason="the WGMMA decode gate is built for sm_90 (sm_90a)")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [FLASH, PRO], ids=["flash", "pro"])
@pytest.mark.parametrize("tokens", [1, 8, 33, 64])
def test_cute_decode_gate(tokens, shape, dtype):
    from dsv4ops.router import cute_sm90

    args = router_gate_sample("cuda", tokens, *shape, 6, dtype)
    cute_sm90.router_gate(*args)
    first = [t.clone() for t in args[3:6]]
    check_router_gate(*args[:6], 6, args[6])
    for t in args[3:6]:
        t.fill_(-7)
    cute_sm90.router_gate(*args)  # deterministic: the split sums run in a fixed order
    for got, want in zip(args[3:6], first):
        assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("tokens", [1, 64, 65, 300])
def test_router_gate_op(tokens, dtype):
    args = router_gate_sample("cuda", tokens, *FLASH, 6, dtype)
    torch.ops.dsv4.router_gate.default(*args)
    check_router_gate(*args[:6], 6, args[6])


# ---- parity with transformers on the GPU (fp32) ------------------------------------------------
def test_routers_match_transformers_on_gpu():
    config = hf_router_config(hidden_size=512, n_routed_experts=256)
    hf, ours = hf_v4.DeepseekV4TopKRouter(config).cuda(), DeepseekV4Router(config).cuda()
    torch.nn.init.normal_(hf.weight, std=0.05)
    hf.e_score_correction_bias.normal_(std=0.1)
    ours.load_state_dict(hf.state_dict())
    x = torch.randn(4, 9, 512, device="cuda")
    with torch.no_grad():
        hf_logits, hf_weights, hf_indices = hf(x)
        logits, weights, indices = ours(x)
    flat = x.reshape(-1, 512)
    check_router_gate(
        flat, ours.weight, ours.e_score_correction_bias, logits, weights, indices, 6, config.routed_scaling_factor
    )
    assert_logits_close(hf_logits, flat, hf.weight)
    keys = reference.sqrt_softplus(hf_logits.cpu()) + ours.e_score_correction_bias.cpu()
    order = hf_indices.argsort(-1)  # transformers' topk is unsorted: compare in key order
    sorted_hf = hf_indices.gather(1, keys.cuda().gather(1, hf_indices).argsort(dim=-1, descending=True, stable=True))
    assert_topk_matches(sorted_hf, keys, 6, key_tol(keys))
    assert_weights_close(
        hf_weights.gather(1, order), hf_logits, hf_indices.gather(1, order), config.routed_scaling_factor
    )

    hhf, hours = hf_v4.DeepseekV4HashRouter(config).cuda(), DeepseekV4HashRouter(config).cuda()
    torch.nn.init.normal_(hhf.weight, std=0.05)
    hhf.tid2eid.copy_(torch.randint(0, 256, hhf.tid2eid.shape))
    hours.load_state_dict(hhf.state_dict())
    ids = torch.randint(0, config.vocab_size, (4, 9), device="cuda")
    with torch.no_grad():
        _, hf_w, hf_i = hhf(x, ids)
        logits, w, i = hours(x, ids)
    assert torch.equal(i, hf_i)
    assert_weights_close(w, logits, i, config.routed_scaling_factor)
    assert_weights_close(hf_w, logits, i, config.routed_scaling_factor)


# ---- registration on CUDA: opcheck, graphs, compile ---------------------------------------------
GPU_SAMPLES = dict(SAMPLES)
GPU_SAMPLES["router_gate-bf16-decode"] = ("router_gate", lambda d: router_gate_sample(d, 8, 256, 64, 4, torch.bfloat16))


@pytest.mark.parametrize("name", list(GPU_SAMPLES))
def test_opcheck_cuda(name):
    run_opcheck(GPU_SAMPLES[name], "cuda")


def make_modules(shape=FLASH, dtype=torch.bfloat16):
    config = hf_router_config(hidden_size=shape[0], n_routed_experts=shape[1], vocab_size=1000)
    router, hash_router = DeepseekV4Router(config), DeepseekV4HashRouter(config)
    for m in (router, hash_router):
        torch.nn.init.normal_(m.weight, std=shape[0] ** -0.5)
    router.e_score_correction_bias.normal_(std=0.1)
    hash_router.tid2eid.copy_(torch.randint(0, shape[1], hash_router.tid2eid.shape))
    return router.to("cuda", dtype), hash_router.to("cuda", dtype)


def check_modules(router, hash_router, x, ids, outputs):
    """Both routers' outputs against the reference oracle (not against another run of the same code)."""
    logits, weights, indices, hash_logits, hash_weights, hash_indices = outputs
    scale = router.routed_scaling_factor
    check_router_gate(x, router.weight, router.e_score_correction_bias.float(), logits, weights, indices, 6, scale)
    assert_logits_close(hash_logits, x, hash_router.weight)
    assert torch.equal(hash_indices, hash_router.tid2eid[ids])
    assert_weights_close(hash_weights, hash_logits, hash_indices, scale)


@pytest.mark.parametrize("tokens", [8, 128])  # the fused decode gate, then cuBLAS + gate_topk
def test_cuda_graph_capture_and_replay(tokens):
    router, hash_router = make_modules()
    x = torch.randn(tokens, 4096, device="cuda", dtype=torch.bfloat16)
    ids = torch.randint(0, 1000, (tokens,), device="cuda")
    with torch.no_grad():
        router(x), hash_router(x, ids)  # warm-up: builds, compiles and allocates outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outputs = router(x) + hash_router(x, ids)
        for _ in range(3):
            x.copy_(torch.randn_like(x))
            ids.copy_(torch.randint(0, 1000, ids.shape, device="cuda"))
            for t in outputs:
                t.fill_(-7)
            graph.replay()
            check_modules(router, hash_router, x, ids, outputs)


def test_compile_reduce_overhead_has_no_cudagraph_skips():
    router, hash_router = make_modules()

    def step(x, ids):
        return router(x) + hash_router(x, ids)

    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(step, mode="reduce-overhead", fullgraph=True)
    with torch.no_grad():
        for tokens in (8, 8, 8, 200, 200, 200):
            x = torch.randn(tokens, 4096, device="cuda", dtype=torch.bfloat16)
            ids = torch.randint(0, 1000, (tokens,), device="cuda")
            check_modules(router, hash_router, x, ids, [t.clone() for t in compiled(x, ids)])
    assert counters["inductor"]["cudagraph_skips"] == 0, dict(counters["inductor"])


def test_first_compiled_call_binds_the_cuda_kernels():
    """A fresh process: tracing binds nothing (fakes have no side effects); the compiled graph's
    first run reaches the op's reference body with CUDA tensors, which binds the csrc/ kernels and
    runs on them (never silently on the reference)."""
    import subprocess
    import sys

    code = (
        "import torch, dsv4ops\n"
        "from dsv4ops import DeepseekV4Router, DSV4AttentionConfig\n"
        "has = lambda: torch._C._dispatch_has_kernel_for_dispatch_key('dsv4::gate_topk', 'CUDA')\n"
        "router = DeepseekV4Router(DSV4AttentionConfig.tiny()).cuda()\n"
        "compiled = torch.compile(router, fullgraph=True)\n"
        "x = torch.randn(100, 256, device='cuda')\n"
        "assert not has()\n"
        "with torch.no_grad():\n"
        "    out = compiled(x)\n"
        "assert has(), 'the first compiled run did not bind the CUDA kernels'\n"
        "with torch.no_grad():\n"
        "    ref = router(x)\n"
        "assert torch.equal(out[2], ref[2])\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
