"""Batch-invariant serving on the GPU (CacheConfig(batch_invariant=True)): at V4-Flash dims (FP8
cache, block-FP8 projections as keep_fp8 loads them), request "a" served alone and beside 1 to 31
others of random lengths (up to 4K) gets bitwise the same outputs, eager and compiled (fullgraph), and
the same bits from the HCA entries it closes in decode steps beside 100 decoding others; the
same for the V4.1 stack (every role, V4.1-Flash widths, QAT cache formats); and the kernel of
dsv4::invariant_linear and the router's batch-invariant gate give a row the same bits whatever rows
share their call. The CPU twin: tests/test_batch_invariant.py."""

import pytest
import torch

from dsv4ops import DSV4AttentionConfig, testing
from dsv4ops.bench import layer_step
from dsv4ops.bench.attention import FP8, new_layer
from dsv4ops.cache import CacheConfig, KVCacheManager
from dsv4ops.cache.v41 import V41CacheManager
from dsv4ops.config import CSA, HCA, SLIDING
from dsv4ops.config_v41 import DSV41AttentionConfig
from dsv4ops.layers_v41 import DeepseekV41AttentionStack
from dsv4ops.router import api as router_api

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

FLASH = DSV4AttentionConfig.flash()
MAX_CONTEXT = 4096  # a few K: long enough for many CSA entries (index_topk 512 of 1024) and HCA ones
A_CHUNKS = [700, 300, 1, 1, 1, 1]  # "a": a prefill in two chunks, then decode steps


def _serve(layer, forward, others: int, seed: int, a_chunks=A_CHUNKS, other_chunk: int = 48) -> torch.Tensor:
    """The outputs of "a" (a_chunks, through `forward`: the layer or its compiled form) on a fresh
    batch-invariant cache; with `others` requests first prefilled (eager) to random lengths up to
    MAX_CONTEXT - 64, then sharing each step of "a" with random chunks of 1 to other_chunk tokens, "a"
    at a random place in the step."""
    gen = torch.Generator().manual_seed(seed)
    lengths = {f"o{i}": n for i, n in enumerate(torch.randint(1, MAX_CONTEXT - 64, (others,), generator=gen).tolist())}
    cfg = CacheConfig(formats=FP8, exact_dtype=torch.bfloat16, max_requests=others + 1, max_context=MAX_CONTEXT,
                      max_step_tokens=2048, batch_invariant=True)
    manager = KVCacheManager(FLASH, cfg, device="cuda")
    layer.attach_cache(manager)
    xa = torch.randn(sum(a_chunks), FLASH.hidden_size, generator=torch.Generator().manual_seed(0))
    xa = xa.to("cuda", torch.bfloat16)

    def rows(r, n, done=0):
        if r == "a":
            return xa[done:done + n]
        return torch.randn(n, FLASH.hidden_size, generator=gen).to("cuda", torch.bfloat16)

    def step(spec: dict, run, done=0):
        with manager.step(spec) as st:
            x = torch.cat([rows(r, n, done) for r, n in spec.items()])
            return run(torch.cat([x, x.new_zeros(st.positions.shape[0] - x.shape[0], x.shape[1])]), st)

    outs, done = [], 0
    with torch.no_grad():
        for r, n in lengths.items():  # the others' earlier steps, without "a"
            manager.admit(r)
            for lo in range(0, n, 2048):
                step({r: min(2048, n - lo)}, layer)
        manager.admit("a")
        for n in a_chunks:
            spec = {"a": n}
            for r, length in list(lengths.items()):
                k = int(torch.randint(1, other_chunk + 1, (1,), generator=gen))
                if length + k <= MAX_CONTEXT and sum(spec.values()) + k <= 2048:
                    spec[r] = k
                    lengths[r] = length + k
            order = [list(spec)[i] for i in torch.randperm(len(spec), generator=gen).tolist()]
            y = step({r: spec[r] for r in order}, forward, done)
            at = sum(spec[r] for r in order[:order.index("a")])
            outs.append(y[at:at + n])
            done += n
    del layer.cache, layer.cache_manager
    return torch.cat(outs)


@pytest.mark.parametrize("compiled", [False, True])
@pytest.mark.parametrize("kind", [SLIDING, CSA, HCA])
def test_a_request_gets_the_same_bits_whoever_shares_its_steps(kind, compiled):
    layer = new_layer(kind, FLASH)
    layer_step.to_block_fp8(layer)
    forward = torch.compile(layer, fullgraph=True) if compiled else layer
    alone = _serve(layer, forward, 0, 0)
    assert alone.shape == (sum(A_CHUNKS), FLASH.hidden_size) and alone.isfinite().all() and alone.abs().sum() > 0
    for others, seed in ((1, 1), (7, 2), (31, 3)):
        busy = _serve(layer, forward, others, seed)
        diff = (busy.float() - alone.float()).abs().max().item()
        assert torch.equal(busy, alone), f"{kind}, {others} others: max difference {diff:.3e}"


# "a"'s HCA entry 7 (positions 896..1023) closes in its fourth step, a decode step.
A_HCA_CHUNKS = [700, 322, 1, 1, 1]


@pytest.mark.parametrize("compiled", [False, True])
def test_hca_entries_closed_in_decode_steps_do_not_depend_on_the_step_size(compiled):
    """V4's HCA pools 128 slots, where the compressor's Triton plan follows the step's token count by
    default (compressor/triton.py pool_plan: 16 channels x 128 slots up to 16 tokens, 32 x 64 up to
    256): "a"'s decode steps alone (1 token) and beside 100 decoding requests (101 tokens), the entry
    closed in one of them and read by it and the next, give "a" the same bits."""
    layer = new_layer(HCA, FLASH)
    layer_step.to_block_fp8(layer)
    forward = torch.compile(layer, fullgraph=True) if compiled else layer
    alone = _serve(layer, forward, 0, 0, A_HCA_CHUNKS, 1)
    assert alone.shape == (sum(A_HCA_CHUNKS), FLASH.hidden_size) and alone.isfinite().all()
    busy = _serve(layer, forward, 100, 4, A_HCA_CHUNKS, 1)
    diff = (busy.float() - alone.float()).abs().max().item()
    assert torch.equal(busy, alone), f"100 others: max difference {diff:.3e}"


@pytest.mark.parametrize("dtype,out_dtype", [(torch.bfloat16, torch.bfloat16), (torch.bfloat16, torch.float32)])
def test_invariant_linear_rows_do_not_depend_on_the_row_count(dtype, out_dtype):
    """Row i of x[lo:lo + m] @ w^T is bitwise row lo + i of the full product for m in 1..256, from a
    tile-aligned and an unaligned lo (V4-Flash's q_b_proj: K 1024, N 4096 cut to 1024), and within
    the fp32 GEMM's error of the fp64 product."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(300, 1024, device="cuda", generator=gen).to(dtype)
    w = (torch.randn(1024, 1024, device="cuda", generator=gen) * 0.03).to(dtype)
    full = torch.ops.dsv4.invariant_linear.default
    out = torch.full((300, 1024), float("nan"), device="cuda", dtype=out_dtype)
    full(x, w, out)
    exact = x.double() @ w.double().t()
    assert (out.double() - exact).abs().max() <= exact.abs().max() * (2.0**-7 if out_dtype == torch.bfloat16 else 1e-5)
    for lo in (0, 37):
        for m in range(1, 257):
            part = torch.full((m, 1024), float("nan"), device="cuda", dtype=out_dtype)
            full(x[lo:lo + m], w, part)
            assert torch.equal(part, out[lo:lo + m]), (lo, m)


# V4.1: the tiny preset's 10 roles (sliding, sources, reindex, reuse, candidate source, reindex in
# the pool) at V4.1-Flash widths; a 512-entry candidate pool (64 blocks of 8), so a 4K context's
# ratio-1 entries are chosen inside it.
_F41 = DSV41AttentionConfig.v41_flash()
V41 = DSV41AttentionConfig.tiny(hidden_size=_F41.hidden_size, num_heads=_F41.num_heads, q_lora_rank=_F41.q_lora_rank,
                                o_groups=_F41.o_groups, o_lora_rank=_F41.o_lora_rank, window=_F41.window,
                                index_n_heads=_F41.index_n_heads, index_topk=_F41.index_topk,
                                candidate_topk_blocks=64, candidate_block_size=8)


def _serve41(stack, forward, others: int, seed: int) -> torch.Tensor:
    """_serve for the V4.1 stack: "a"'s outputs [num_layers, tokens, hidden]."""
    gen = torch.Generator().manual_seed(seed)
    lengths = {f"o{i}": n for i, n in enumerate(torch.randint(1, MAX_CONTEXT - 64, (others,), generator=gen).tolist())}
    cfg = CacheConfig(exact_dtype=torch.bfloat16, max_requests=others + 1, max_context=MAX_CONTEXT,
                      max_step_tokens=2048, batch_invariant=True)
    manager = V41CacheManager(V41, cfg, device="cuda")
    stack.attach_cache(manager)
    n_layers, hidden = V41.num_layers, V41.hidden_size
    xa = torch.randn(n_layers, sum(A_CHUNKS), hidden, generator=torch.Generator().manual_seed(0))
    xa = xa.to("cuda", torch.bfloat16)

    def rows(r, n, done=0):
        if r == "a":
            return xa[:, done:done + n]
        return torch.randn(n_layers, n, hidden, generator=gen).to("cuda", torch.bfloat16)

    def step(spec: dict, run, done=0):
        with manager.step(spec) as st:
            x = torch.cat([rows(r, n, done) for r, n in spec.items()], 1)
            return run(torch.cat([x, x.new_zeros(n_layers, st.positions.shape[0] - x.shape[1], hidden)], 1), st)

    outs, done = [], 0
    with torch.no_grad():
        for r, n in lengths.items():  # the others' earlier steps, without "a"
            manager.admit(r)
            for lo in range(0, n, 2048):
                step({r: min(2048, n - lo)}, stack)
        manager.admit("a")
        for n in A_CHUNKS:
            spec = {"a": n}
            for r, length in list(lengths.items()):
                k = int(torch.randint(1, 49, (1,), generator=gen))
                if length + k <= MAX_CONTEXT and sum(spec.values()) + k <= 2048:
                    spec[r] = k
                    lengths[r] = length + k
            order = [list(spec)[i] for i in torch.randperm(len(spec), generator=gen).tolist()]
            y = step({r: spec[r] for r in order}, forward, done)
            at = sum(spec[r] for r in order[:order.index("a")])
            outs.append(y[:, at:at + n])
            done += n
    del stack.cache, stack.cache_manager
    return torch.cat(outs, 1)


@pytest.mark.parametrize("compiled", [False, True])
def test_a_v41_request_gets_the_same_bits_whoever_shares_its_steps(compiled):
    stack = testing.randomize_(DeepseekV41AttentionStack(V41), seed=0).to("cuda", torch.bfloat16)
    forward = torch.compile(stack, fullgraph=True) if compiled else stack
    alone = _serve41(stack, forward, 0, 0)
    assert alone.shape == (V41.num_layers, sum(A_CHUNKS), V41.hidden_size)
    assert alone.isfinite().all() and alone.abs().sum() > 0
    for others, seed in ((1, 1), (7, 2), (31, 3)):
        busy = _serve41(stack, forward, others, seed)
        diff = (busy.float() - alone.float()).abs().amax(dim=(1, 2)).tolist()
        assert torch.equal(busy, alone), f"{others} others: max difference per layer {diff}"


def test_batch_invariant_router_gate_rows_do_not_depend_on_the_token_count():
    """router_gate(batch_invariant=True) at V4-Flash's gate (256 experts, top-6): row i of a call on
    x[lo:lo + m] is bitwise row lo + i of the call on all 300 rows, m across the fused decode gate's
    64-token limit (the default switches kernels there)."""
    gen = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(300, FLASH.hidden_size, device="cuda", generator=gen).to(torch.bfloat16)
    w = (torch.randn(256, FLASH.hidden_size, device="cuda", generator=gen) * 0.02).to(torch.bfloat16)
    bias = torch.randn(256, device="cuda", generator=gen) * 0.01
    full = router_api.router_gate(x, w, bias, 6, 2.5, batch_invariant=True)
    for lo in (0, 37):
        for m in (1, 2, 7, 64, 65, 200):
            part = router_api.router_gate(x[lo:lo + m], w, bias, 6, 2.5, batch_invariant=True)
            for got, want in zip(part, full):
                assert torch.equal(got, want[lo:lo + m]), (lo, m)
