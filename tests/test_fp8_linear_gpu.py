"""GPU: the Triton kernel of dsv4::fp8_linear against its reference kernel on the same CUDA inputs at
the V4-Flash projection shapes, decode (1, 128 rows) and prefill (4096), UE8M0 and fp32 scales,
V4.1's 32 x 32 tiles; CUDA-graph capture; BlockFP8Linear under torch.compile; a V4 layer loaded
with keep_fp8=True against the same layer dequantized. Issue 15.

Tolerance: max|kernel - ref64| <= 2 x max|ref_bf16 - ref64| (dsv4ops.testing.assert_close_to_ref),
ref64 the reference kernel in float64 and ref_bf16 the reference kernel on the bf16 inputs.

Run: python -m pytest -m gpu tests/test_fp8_linear_gpu.py
"""

import builders
import pytest
import torch

import dsv4ops
from dsv4ops import testing as T
from dsv4ops.fp8_linear import reference as fp8_linear_ref
from dsv4ops.fp8_linear.api import BlockFP8Linear

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

BF16 = torch.bfloat16
F = dsv4ops.DSV4AttentionConfig.flash()
# (out, in) of V4-Flash's block-FP8 projections: q_a, q_b, kv, o_b, the indexer's q_b.
FLASH = {"q_a": (F.q_lora_rank, F.hidden_size), "q_b": (F.num_heads * F.head_dim, F.q_lora_rank),
         "kv": (F.head_dim, F.hidden_size), "o_b": (F.hidden_size, F.o_groups * F.o_lora_rank),
         "index_q_b": (F.index_n_heads * F.index_head_dim, F.q_lora_rank)}


def _weights(n, k, block, scale_dtype, seed=0):
    weight, scale = builders.block_fp8_weight(n, k, block, scale_dtype, seed=seed)
    if scale_dtype == torch.float8_e8m0fnu:
        scale = scale.view(torch.uint8)
    # ~1/sqrt(K) weights: the scale carries it (as a checkpoint's does)
    scale = scale - 5 if scale.dtype == torch.uint8 else scale * k**-0.5
    return weight.cuda(), scale.cuda()


def _check(n, k, m, block, scale_dtype):
    weight, scale = _weights(n, k, block, scale_dtype, seed=n + m)
    x = torch.randn(m, k, device="cuda")

    def run(fn, dt):
        out = torch.full((m, n), float("nan"), dtype=dt, device="cuda")
        fn(x.to(dt), weight, scale, out, block)
        return out

    got = run(torch.ops.dsv4.fp8_linear, BF16)
    assert not got.isnan().any(), "every element written"
    T.assert_close_to_ref(got, run(fp8_linear_ref.fp8_linear, torch.float64), run(fp8_linear_ref.fp8_linear, BF16))


@pytest.mark.parametrize("scale_dtype", [torch.float8_e8m0fnu, torch.float32], ids=["ue8m0", "fp32"])
@pytest.mark.parametrize("m", [1, 128, 4096])
@pytest.mark.parametrize("proj", sorted(FLASH))
def test_triton_matches_the_reference_at_flash_shapes(proj, m, scale_dtype):
    _check(*FLASH[proj], m, 128, scale_dtype)


@pytest.mark.parametrize("m", [1, 17, 128, 300])
def test_triton_matches_the_reference_in_v41_tiles_and_ragged_shapes(m):
    _check(1000, 1000, m, 32, torch.float8_e8m0fnu)  # neither dim a multiple of 32 or of the kernel tiles
    _check(1000, 1000, m, 128, torch.float32)


def test_captures_in_a_cuda_graph():
    n, k = FLASH["kv"]  # split-K: the partials' workspace is allocated inside the capture
    weight, scale = _weights(n, k, 128, torch.float8_e8m0fnu)
    x = torch.randn(1, k, device="cuda", dtype=BF16)
    out = torch.empty(1, n, device="cuda", dtype=BF16)
    torch.ops.dsv4.fp8_linear(x, weight, scale, out, 128)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.ops.dsv4.fp8_linear(x, weight, scale, out, 128)
    x.copy_(torch.randn_like(x))
    graph.replay()
    want = torch.empty_like(out)
    torch.ops.dsv4.fp8_linear(x, weight, scale, want, 128)
    assert torch.equal(out, want)  # the same kernel on the same inputs: deterministic (no atomics)


def test_module_under_torch_compile():
    n, k = FLASH["q_a"]
    weight, scale = builders.block_fp8_weight(n, k, 128)
    module = BlockFP8Linear(k, n, 128).cuda()
    module.load_state_dict({"weight": weight, "weight_scale_inv": scale})
    x = torch.randn(4, k, device="cuda", dtype=BF16)
    compiled = torch.compile(module, fullgraph=True)
    assert torch.equal(compiled(x), module(x))


@pytest.mark.parametrize("layer_idx", [0, 1])
def test_layer_with_fp8_projections_equals_the_dequantized_layer(layer_idx):
    from test_fp8_linear import _fp8_checkpoint

    cfg = dsv4ops.DSV4AttentionConfig.tiny()
    src = T.randomize_(dsv4ops.DeepseekV4Attention(cfg, layer_idx), seed=layer_idx)
    sd = _fp8_checkpoint(src, torch.float8_e8m0fnu)
    layers = {}
    for name, dtype, keep in (("fp8", BF16, True), ("deq", BF16, False), ("ref", torch.float32, False)):
        layer = dsv4ops.DeepseekV4Attention(cfg, layer_idx).to("cuda", dtype)
        layer.load_deepseek_state_dict(sd, keep_fp8=keep)
        layers[name] = layer
    x = torch.randn(2, 33, cfg.hidden_size, device="cuda")
    with torch.no_grad():
        T.assert_close_to_ref(layers["fp8"](x.to(BF16)), layers["ref"](x), layers["deq"](x.to(BF16)))
