"""The layer's GPU step: the packed projections of x on the tensor cores against the fp64 product, and
the kernels a compiled decode step launches."""

import pytest
import torch
from test_compile import token_args
from torch._inductor.utils import run_and_get_code

from dsv4ops import DSV4AttentionConfig, packing
from dsv4ops.bench import layer_step
from dsv4ops.bench.attention import Case, new_layer
from dsv4ops.config import CSA, HCA, SLIDING
from dsv4ops.projections import project_x

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

FLASH = DSV4AttentionConfig.flash()


def _truncating_fp32_sum(x: torch.Tensor, w: torch.Tensor, chunk: int = 16) -> torch.Tensor:
    """x @ w^T as an accumulator that keeps fp32 and rounds toward zero after each chunk of `chunk`
    products (summed exactly): a model of the tensor cores' fp32 accumulation, which does not round
    to nearest. The low-precision run the budget is derived from."""
    prods = x.double()[:, None, :] * w.double()[None, :, :]  # [M, N, K]
    acc = torch.zeros(prods.shape[:2], dtype=torch.float64, device=x.device)
    for k in range(0, prods.shape[-1], chunk):
        s = acc + prods[..., k:k + chunk].sum(-1)
        r = s.float().double()
        toward_zero = torch.where(r.abs() > s.abs(), torch.nextafter(r.float(), torch.zeros_like(r.float())).double(), r)
        acc = toward_zero
    return acc


@pytest.mark.parametrize("m", [1, 32, 128])
def test_packed_fp32_gemm_on_tensor_cores_is_within_a_truncating_fp32_accumulation(m):
    """V4-Flash CSA's packed projections (4160 x 4096): mm's fp32 output against the fp64 product,
    within 4x the error of the truncating-accumulator model (measured: the note gives the numbers)."""
    gen = torch.Generator(device="cuda").manual_seed(m)
    x = torch.randn(m, FLASH.hidden_size, device="cuda", generator=gen).bfloat16()
    w = (torch.randn(4160, FLASH.hidden_size, device="cuda", generator=gen) * 0.02).bfloat16()
    y = packing.matmul(x, w, fp32=True)
    exact = x.double() @ w.double().t()
    budget = (_truncating_fp32_sum(x, w[:256]) - exact[:, :256]).abs().max()
    err = (y.double() - exact).abs().max()
    rel = err / exact.abs().max()
    print(f"m={m}: max abs err {err:.3e} (rel {rel:.2e}), truncating model {budget:.3e}")
    assert y.dtype == torch.float32 and err <= 4 * budget


@pytest.mark.parametrize("kind", [SLIDING, CSA, HCA])
def test_project_x_runs_the_packed_gemm_and_the_block_fp8_ones(kind):
    layer = new_layer(kind, FLASH)
    layer_step.to_block_fp8(layer)
    x = torch.randn(8, FLASH.hidden_size, device="cuda").bfloat16()
    with torch.no_grad():
        out = project_x(layer, x)
    assert layer.x_pack.tied(layer)
    for name, y in out.items():
        w = layer.get_submodule(name)
        if name in layer.x_pack.members:
            exact = x.double() @ w.weight.double().t()
            assert (y.double() - exact).abs().max() <= exact.abs().max() * 2.0**-7, name


@pytest.mark.parametrize("kind", [SLIDING, CSA, HCA])
def test_compiled_decode_step_kernels(kind):
    """The kernels one compiled V4-Flash decode step launches (batch 32 x 4K, FP8 projections): printed
    for the note and held at the count this build reaches (KERNELS), so a change that adds kernels shows."""
    layer = new_layer(kind, FLASH)
    layer_step.to_block_fp8(layer)
    case = Case(kind, 32, 4096, 1, model=FLASH, layer=layer)
    compiled = torch.compile(layer, fullgraph=True)
    with torch.no_grad():
        eager_n = layer_step.kernel_count(lambda: layer(case.x, case.step))
        n = layer_step.kernel_count(lambda: compiled(case.x, case.step))
        a = compiled(case.x, case.step)
        b = layer(case.x, case.step)
    print(f"{kind}: {eager_n} kernels eager, {n} compiled")
    assert torch.equal(a, b)  # compiled equals eager bitwise
    assert n <= KERNELS[kind]
    case.release()


KERNELS = {CSA: 40, HCA: 30, SLIDING: 20}


@pytest.mark.parametrize("kind", [SLIDING, CSA, HCA])
def test_compiled_step_ops_read_one_positions_and_one_req_slots_buffer(kind):
    """Issue 51: every dsv4:: op of a compiled V4-Flash decode step reads the live check's one
    positions buffer and one req_slots buffer (Inductor's Triton code), not a recomputed copy of its
    own (a small kernel per op: tests/test_compile.py shows the CPU code's)."""
    layer = new_layer(kind, FLASH)
    layer_step.to_block_fp8(layer)
    case = Case(kind, 32, 4096, 1, model=FLASH, layer=layer)
    torch._dynamo.reset()
    with torch.no_grad():
        _, codes = run_and_get_code(torch.compile(layer, fullgraph=True), case.x, case.step)
    assert {k: len(v) for k, v in token_args("\n".join(codes)).items()} == {"positions": 1, "req_slots": 1}
    case.release()
