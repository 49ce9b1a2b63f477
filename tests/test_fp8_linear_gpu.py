"""GPU: the Triton kernel of dsv4::fp8_linear against its reference kernel on the same CUDA inputs at
the V4-Flash projection shapes, decode (1, 128 rows) and prefill (4096), UE8M0 and fp32 scales,
V4.1's 32 x 32 tiles; CUDA-graph capture; BlockFP8Linear under torch.compile; a V4 layer loaded
with keep_fp8=True against the same layer dequantized. Issue 15. W8A8 (dsv4::fp8_linear_w8a8: the
Triton FP8 x FP8 kernel, x quantized in its prologue or by act_quant first, and act_quant +
cuBLASLt) at the V4-Flash and V4-Pro shapes against its reference, each route and tile config, the
act_quant kernel bit for bit, graph capture, the "auto" rule in a compiled module and in a layer.
Issue 30.

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
from dsv4ops.fp8_linear.api import BlockFP8Linear, fp32_scale

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
@pytest.mark.parametrize("m", [1, 128, 300, 4096])  # 300: prefill tiles in 3 row blocks, split K (q_a, kv, o_b)
@pytest.mark.parametrize("proj", sorted(FLASH))
def test_triton_matches_the_reference_at_flash_shapes(proj, m, scale_dtype):
    _check(*FLASH[proj], m, 128, scale_dtype)


@pytest.mark.parametrize("m", [1, 17, 128, 300])
def test_triton_matches_the_reference_in_v41_tiles_and_ragged_shapes(m):
    _check(1000, 1000, m, 32, torch.float8_e8m0fnu)  # neither dim a multiple of 32 or of the kernel tiles
    _check(1000, 1000, m, 128, torch.float32)


@pytest.mark.parametrize("m", [1, 32, 128, 300])
@pytest.mark.parametrize("model", ["flash", "pro"])
def test_grouped_o_a_matches_the_reference(model, m):
    # o_a_proj kept block-FP8: groups x o_lora_rank rows, each group reading its heads' columns of x
    cfg = dsv4ops.DSV4AttentionConfig.flash() if model == "flash" else dsv4ops.DSV4AttentionConfig.pro()
    g, n, k = cfg.o_groups, cfg.o_groups * cfg.o_lora_rank, cfg.num_heads * cfg.head_dim // cfg.o_groups
    weight, scale = _weights(n, k, 128, torch.float8_e8m0fnu, seed=m)
    x = torch.randn(m, g * k, device="cuda")

    def run(fn, dt):
        out = torch.full((m, n), float("nan"), dtype=dt, device="cuda")
        fn(x.to(dt), weight, scale, out, 128, g)
        return out

    got = run(torch.ops.dsv4.fp8_linear, BF16)
    assert not got.isnan().any(), "every element written"
    T.assert_close_to_ref(got, run(fp8_linear_ref.fp8_linear, torch.float64), run(fp8_linear_ref.fp8_linear, BF16))


@pytest.mark.parametrize("shape", ["q_a", "o_b", "o_a"])
def test_batch_invariant_rows_do_not_depend_on_the_row_count(shape):
    # One launch config for every M: a row's bits the same alone, in a batch, at any offset in it.
    g = F.o_groups if shape == "o_a" else 1
    n, k = (g * F.o_lora_rank, F.num_heads * F.head_dim // g) if shape == "o_a" else FLASH[shape]
    weight, scale = _weights(n, k, 128, torch.float8_e8m0fnu)
    x = torch.randn(300, g * k, device="cuda", dtype=BF16)

    def run(rows):
        out = torch.full((rows.shape[0], n), float("nan"), dtype=BF16, device="cuda")
        torch.ops.dsv4.fp8_linear(rows, weight, scale, out, 128, g, True)
        return out

    full = run(x)
    assert not full.isnan().any(), "every element written"
    for lo, m in ((0, 1), (3, 1), (5, 7), (0, 64), (17, 128), (30, 256)):
        assert torch.equal(run(x[lo:lo + m]), full[lo:lo + m]), (lo, m)


def test_captures_in_a_cuda_graph():
    n, k = FLASH["kv"]  # split-K: the partials' workspace is allocated inside the capture
    weight, scale = _weights(n, k, 128, torch.float8_e8m0fnu)
    _replays_as_called(torch.ops.dsv4.fp8_linear, 1, weight, scale)


def _replays_as_called(op, m, weight, scale):
    """op on [m, K] x captured in a CUDA graph, replayed on new x, equals a call on it: the same
    kernels on the same inputs (deterministic: no atomics)."""
    n, k = weight.shape
    x = torch.randn(m, k, device="cuda", dtype=BF16)
    out = torch.empty(m, n, device="cuda", dtype=BF16)
    op(x, weight, scale, out, 128)  # compiles outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        op(x, weight, scale, out, 128)
    x.copy_(torch.randn_like(x))
    graph.replay()
    want = torch.empty_like(out)
    op(x, weight, scale, want, 128)
    assert torch.equal(out, want)


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


# ---- W8A8: dsv4::fp8_linear_w8a8 (Triton act_quant + cuBLASLt blockwise FP8 GEMM) -------------------
P = dsv4ops.DSV4AttentionConfig.pro()
PRO = {"q_a": (P.q_lora_rank, P.hidden_size), "q_b": (P.num_heads * P.head_dim, P.q_lora_rank),
       "kv": (P.head_dim, P.hidden_size), "o_b": (P.hidden_size, P.o_groups * P.o_lora_rank),
       "index_q_b": (P.index_n_heads * P.index_head_dim, P.q_lora_rank)}
W8A8_SHAPES = {**{f"flash-{k}": v for k, v in FLASH.items()}, **{f"pro-{k}": v for k, v in PRO.items()}}


def _check_w8a8(n, k, m, scale_dtype, strided_out=False, kernel=torch.ops.dsv4.fp8_linear_w8a8):
    weight, scale = _weights(n, k, 128, scale_dtype, seed=n + m)
    scale = fp32_scale(scale)
    x = torch.randn(m, k, device="cuda").to(BF16)

    def run(fn, dt):
        wide = torch.full((m, n + (8 if strided_out else 0)), float("nan"), dtype=dt, device="cuda")
        fn(x.to(dt), weight, scale, wide[:, :n], 128)
        assert wide[:, n:].isnan().all(), "wrote outside out"
        return wide[:, :n]

    got = run(kernel, BF16)
    assert not got.isnan().any(), "every element written"
    # x's bf16 values in float64: the reference quantizes the very values the kernel reads
    T.assert_close_to_ref(got, run(fp8_linear_ref.fp8_linear_w8a8, torch.float64),
                          run(fp8_linear_ref.fp8_linear_w8a8, BF16))


@pytest.mark.parametrize("m", [1, 3, 16, 128, 300, 4096])
@pytest.mark.parametrize("proj", sorted(W8A8_SHAPES))
def test_w8a8_matches_the_reference_at_flash_and_pro_shapes(proj, m):
    # m = 1 and 3: rows padded to 16 for cuBLASLt (which refused one row), the output copied back
    _check_w8a8(*W8A8_SHAPES[proj], m, torch.float8_e8m0fnu)


def _shards() -> list:
    from dsv4ops.config import CSA, HCA, SLIDING
    from dsv4ops.warmup import _fp8_projections

    return sorted({(n, k) for cfg in (F, P) for tp in (2, 4, 8, 16)
                   for n, k in _fp8_projections(cfg, {SLIDING, CSA, HCA}, tp) if k} - set(W8A8_SHAPES.values()))


@pytest.mark.parametrize("m", [1, 16, 128, 300])
@pytest.mark.parametrize("shape", _shards(), ids=lambda s: f"{s[0]}x{s[1]}")
def test_w8a8_at_tensor_parallel_shard_shapes(shape, m):
    # a rank's q_b_proj / o_b_proj under TP 2 - 16: the launch configs and routes of their own table rows
    _check_w8a8(*shape, m, torch.float8_e8m0fnu)


@pytest.mark.parametrize("m", [5, 128])
def test_w8a8_with_fp32_scales_and_a_strided_out(m):
    _check_w8a8(*FLASH["o_b"], m, torch.float32, strided_out=True)


def _fused(cfg=None):
    from dsv4ops.fp8_linear import triton_w8a8

    return lambda x, weight, scale, out, block: triton_w8a8.fp8_linear_w8a8(x, weight, scale, out, cfg)


@pytest.mark.parametrize("m", [1, 3, 16, 128, 300])
@pytest.mark.parametrize("proj", sorted(W8A8_SHAPES))
def test_fused_w8a8_matches_the_reference_at_flash_and_pro_shapes(proj, m):
    # the Triton FP8 x FP8 kernel with x quantized in its prologue, at its own launch config
    _check_w8a8(*W8A8_SHAPES[proj], m, torch.float8_e8m0fnu, strided_out=m == 3, kernel=_fused())


@pytest.mark.parametrize("quant,bm,bn,split,warps", [(True, 16, 32, 1, 4), (False, 64, 128, 16, 4),
                                                     (False, 128, 128, 3, 8), (True, 128, 64, 1, 8),
                                                     (False, 128, 256, 2, 16), (True, 16, 256, 4, 8)])
def test_fused_w8a8_tiles_and_splits(quant, bm, bn, split, warps):
    # tiles and splits the launch rule may pick elsewhere: x quantized in the prologue or by act_quant
    # first, rows in one and in several row blocks, an uneven last split (3 splits of 32 K blocks),
    # column tiles over two weight tiles (256), fp32 weight scales that are no powers of two
    n, k = FLASH["q_a"]
    k_split = -(-k // 128 // split) * 128
    cfg = dict(QUANT=quant, BM=bm, BN=bn, SPLITS=-(-k // k_split), K_SPLIT=k_split, WARPS=warps, STAGES=3)
    for m in (5, 200):
        _check_w8a8(n, k, m, torch.float32, strided_out=True, kernel=_fused(cfg))


def test_act_quant_kernel_is_the_reference_bit_for_bit():
    from dsv4ops.fp8_linear import triton as fp8_linear_tt

    for k, scale in ((4096, 1.0), (1024, 1e-3), (8192, 300.0)):
        x = (torch.randn(300, k, device="cuda") * scale).to(BF16)
        x[0, :128] = 0  # the 1e-4 floor
        codes = torch.empty(304, k, device="cuda", dtype=torch.float8_e4m3fn)
        scales = torch.empty(k // 128, 304, device="cuda")
        fp8_linear_tt.act_quant(x, codes, scales)
        want_codes, want_scales = fp8_linear_ref.act_quant(x)
        assert builders.bytes_equal(codes[:300], want_codes) and torch.equal(scales.t()[:300], want_scales)
        assert (codes[300:].view(torch.uint8) == 0).all()


@pytest.mark.parametrize("m", [2, 600])
def test_w8a8_serves_what_cublaslt_cannot_on_the_triton_kernel(m):
    # in_features 384 (cuBLASLt wants a multiple of 512), out_features 200 (not a multiple of 16): the
    # launcher routes every token count to the Triton kernel, 600 rows past cuBLASLt's default start
    from dsv4ops.fp8_linear import rule, w8a8

    assert rule.cublaslt_refuses(200, 384, BF16, (9, 0)) is not None
    assert w8a8.route(600, 200, 384, BF16, (9, 0)) == "triton"
    _check_w8a8(200, 384, m, torch.float32, strided_out=True)


@pytest.mark.parametrize("proj,m,route", [("q_b", 1, "triton"), ("q_b", 128, "cublaslt"), ("q_a", 128, "triton")])
def test_w8a8_captures_in_a_cuda_graph(proj, m, route):
    # q_b at 1 token: x quantized in the Triton kernel's prologue; at 128: cuBLASLt; q_a at 128:
    # act_quant, the split-K Triton kernel and the reduce (PDL launches, workspaces inside the capture)
    from dsv4ops.fp8_linear import w8a8

    n, k = FLASH[proj]
    assert w8a8.route(m, n, k, BF16, torch.cuda.get_device_capability()) == route
    weight, scale = _weights(n, k, 128, torch.float8_e8m0fnu)
    _replays_as_called(torch.ops.dsv4.fp8_linear_w8a8, m, weight, fp32_scale(scale))


def test_module_auto_picks_w8a8_under_torch_compile(monkeypatch):
    from dsv4ops.fp8_linear import api, rule

    n, k = FLASH["o_b"]
    weight, scale = builders.block_fp8_weight(n, k, 128)
    module = BlockFP8Linear(k, n, 128).cuda()
    module.load_state_dict({"weight": weight, "weight_scale_inv": scale})
    assert module._capability == torch.cuda.get_device_capability()
    monkeypatch.setattr(rule, "W8A8_FROM", {(n, k): 64})
    compiled = torch.compile(module, fullgraph=True)
    # the function reads the GPU's capability per call: torch.compile folds it to a constant
    function = torch.compile(lambda x: api.fp8_linear(x, module.weight, module.scale_fp32, 128, "auto"), fullgraph=True)
    for m in (8, 128):
        x = torch.randn(m, k, device="cuda", dtype=BF16)
        want = api.fp8_linear(x, module.weight, module.weight_scale_inv, 128, "fp8" if m >= 64 else "exact")
        assert torch.equal(compiled(x), want), m
        assert torch.equal(module(x), want), m
        assert torch.equal(function(x), want), m


def test_layer_with_w8a8_projections_against_a_quantizing_reference(monkeypatch):
    # Shapes cuBLASLt takes (in_features 512) and a rule that picks W8A8 at 66 tokens: the layer's
    # FP8 projections quantize x. Reference: the same keep_fp8 layer with activations "fp8" on the
    # reference kernels (CPU), in fp32 (ref) and in bf16 (its low-precision run).
    from test_fp8_linear import _fp8_checkpoint

    from dsv4ops.fp8_linear import rule

    cfg = dsv4ops.DSV4AttentionConfig.tiny(hidden_size=512, q_lora_rank=512, o_lora_rank=256)
    monkeypatch.setattr(rule, "W8A8_FROM", {})
    monkeypatch.setattr(rule, "DEFAULT_W8A8_FROM", 64)
    for layer_idx in (0, 1):
        src = T.randomize_(dsv4ops.DeepseekV4Attention(cfg, layer_idx), seed=layer_idx)
        sd = _fp8_checkpoint(src, torch.float8_e8m0fnu)
        layers = {}
        for name, device, dtype in (("gpu", "cuda", BF16), ("ref", "cpu", torch.float32), ("lowp", "cpu", BF16)):
            layer = dsv4ops.DeepseekV4Attention(cfg, layer_idx).to(device, dtype)
            layer.load_deepseek_state_dict(sd, keep_fp8=True)
            for mod in layer.modules():
                if isinstance(mod, BlockFP8Linear) and device == "cpu":
                    mod.activations = "fp8"
            layers[name] = layer
        x = torch.randn(2, 33, cfg.hidden_size)
        with torch.no_grad():
            got = layers["gpu"](x.to("cuda", BF16)).cpu()
            T.assert_close_to_ref(got, layers["ref"](x), layers["lowp"](x.to(BF16)), what=f"layer {layer_idx}")
