"""dsv4::fp8_linear, fp8_linear.api and BlockFP8Linear: x @ (e4m3 weight x tile scale)^T against a
tile-by-tile decode of the e4m3 and UE8M0 bits in float64 (tests/format_model.py); every output
element written; bad inputs; the module through dtype casts, load_state_dict and torch.compile;
a V4 layer loaded with keep_fp8=True against the same layer dequantized on load. Issue 15."""

from functools import partial

import builders
import drivers
import format_model as M
import pytest
import torch
import torch.nn.functional as F
import triton

import dsv4ops
from dsv4ops import CacheFormats, DeepseekV4Attention, DSV4AttentionConfig
from dsv4ops import testing as T
from dsv4ops.cache import CacheConfig, KVCacheManager
from dsv4ops.fp8_linear.api import BlockFP8Linear, fp8_linear
from dsv4ops.fp8_linear import reference as fp8_linear_ref
from dsv4ops.fp8_linear import triton as fp8_linear_tt
from dsv4ops.fp8_linear import triton_w8a8 as w8a8_tt
from dsv4ops.layer_weights import GroupedLinear
from dsv4ops.layers import DEEPSEEK_NAMES, FP8_PROJECTIONS
from dsv4ops.layers import COMPRESSOR_WEIGHTS

BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
E8M0 = torch.float8_e8m0fnu
E4M3_VALUES = torch.tensor([M.e4m3_value(c) for c in range(256)], dtype=torch.float64)
UE8M0_VALUES = torch.tensor([M.ue8m0_value(c) for c in range(256)], dtype=torch.float64)
SHAPES = {128: (200, 300), 32: (70, 100)}  # (N, K) per tile size: neither a multiple of the tile


def dequant64(weight: torch.Tensor, scale: torch.Tensor, block: int) -> torch.Tensor:
    """The weight in float64, decoded from its bits tile by tile (no repeat_interleave, unlike the
    reference kernel)."""
    codes = weight.view(torch.uint8).long()
    ue8m0 = scale.dtype in (E8M0, torch.uint8)
    per_tile = UE8M0_VALUES[scale.view(torch.uint8).long()] if ue8m0 else scale.double()
    full = torch.empty(weight.shape, dtype=torch.float64)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            rows, cols = slice(i * block, (i + 1) * block), slice(j * block, (j + 1) * block)
            full[rows, cols] = E4M3_VALUES[codes[rows, cols]] * per_tile[i, j]
    return full


def check_against_dequant64(out, x, weight, scale, block, what):
    """out within the data-derived budget: the same product with the weight rounded once to x's
    dtype and multiplied in x's dtype, against float64 throughout."""
    w64 = dequant64(weight, scale, block)
    ref64 = x.double() @ w64.T
    lowp = F.linear(x, w64.to(x.dtype))
    T.assert_close_to_ref(out, ref64, lowp, what=what)


@pytest.mark.parametrize("scale_dtype", [E8M0, FP32], ids=["ue8m0", "fp32"])
@pytest.mark.parametrize("block", [128, 32])
@pytest.mark.parametrize("dtype", [BF16, FP16, FP32], ids=["bf16", "fp16", "fp32"])
def test_matches_a_tile_by_tile_decode(dtype, block, scale_dtype):
    n, k = SHAPES[block]
    weight, scale = builders.block_fp8_weight(n, k, block, scale_dtype, seed=block)
    for m in (1, 3, 17, 130):
        x = torch.randn(m, k).to(dtype)
        out = fp8_linear(x, weight, scale, block)
        assert out.shape == (m, n) and out.dtype == dtype
        check_against_dequant64(out, x, weight, scale, block, f"M={m}")


def test_leading_dims_and_empty_batches():
    weight, scale = builders.block_fp8_weight(70, 100, 32)
    x = torch.randn(2, 3, 100)
    out = fp8_linear(x, weight, scale, 32)
    assert out.shape == (2, 3, 70)
    check_against_dequant64(out.view(6, 70), x.view(6, 100), weight, scale, 32, "[2, 3, K]")
    assert fp8_linear(torch.randn(0, 100), weight, scale, 32).shape == (0, 70)


def test_writes_every_output_element_and_nothing_else():
    args = builders.fp8_linear_args(BF16, noncontig=True)  # x rows with a stride gap
    wide = torch.full((3, 76), float("nan"), dtype=BF16)
    args["out"] = wide[:, :70]  # out rows with a stride gap: the gap must stay poisoned
    builders.call_op("fp8_linear", args)
    assert not args["out"].isnan().any()
    assert wide[:, 70:].isnan().all()
    check_against_dequant64(args["out"], args["x"], args["weight"], args["scale"], 32, "strided out")


# ---- bad inputs: one per rule ------------------------------------------------------------------
ARGS = partial(builders.fp8_linear_args, FP32)
wa = builders.with_arg
BAD = [
    ("block", wa("block", lambda a: 64), r"block: expected a tile size in \[32, 128\], got 64"),
    ("x-ndim", wa("x", lambda a: a["x"][0]), r"x: expected 2-D \[tokens, in_features\]", ("op",)),
    ("x-dtype", wa("x", lambda a: a["x"].int()), r"x: expected dtype in"),
    ("x-last-dim", wa("x", lambda a: a["x"].t().contiguous().t()), r"x: expected a contiguous last dim"),
    ("weight-ndim", wa("weight", lambda a: a["weight"][0]), r"weight: expected 2-D \[out_features, in_features\]"),
    ("weight-dtype", wa("weight", lambda a: a["weight"].float()),
     r"weight: expected dtype in \[torch.float8_e4m3fn\], got torch.float32"),
    ("weight-layout", wa("weight", lambda a: a["weight"].t().contiguous().t()),
     r"weight: expected a contiguous tensor"),
    ("weight-in-features", wa("weight", lambda a: a["weight"][:, :50].contiguous()),
     r"weight: expected size 100 \(in_features of x\) at dim 1, got 50"),
    ("weight-device", wa("weight", lambda a: a["weight"].to("meta")), r"weight: expected device cpu \(as x\), got meta"),
    ("scale-ndim", wa("scale", lambda a: a["scale"].flatten()), r"scale: expected 2-D"),
    ("scale-dtype", wa("scale", lambda a: a["scale"].float().bfloat16()),
     r"scale: expected UE8M0 bytes \(torch.uint8, a float8_e8m0fnu tensor's view\) or torch.float32, got "
     r"torch.bfloat16"),
    ("scale-shape", wa("scale", lambda a: a["scale"][:, :2].contiguous()),
     r"scale: expected shape \(3, 4\) \(a \[70, 100\] weight in 32 x 32 tiles\), got \(3, 2\)"),
    ("scale-block", wa("block", lambda a: 128),
     r"scale: expected shape \(1, 1\) \(a \[70, 100\] weight in 128 x 128 tiles\), got \(3, 4\)"),
    ("scale-device", wa("scale", lambda a: a["scale"].to("meta")), r"scale: expected device cpu \(as x\), got meta"),
    ("out-shape", wa("out", lambda a: a["out"][:1]), r"out: expected shape \(3, 70\)", ("op",)),
    ("out-dtype", wa("out", lambda a: a["out"].bfloat16()), r"out: expected dtype in \[torch.float32\]", ("op",)),
    ("out-last-dim", wa("out", lambda a: a["out"].t().contiguous().t()), r"out: expected a contiguous last dim",
     ("op",)),
]


@pytest.mark.parametrize("case", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_rejected_and_writes_nothing(case):
    _, mutate, match, *via = case
    builders.assert_bad_case("fp8_linear", ARGS(), mutate, match, via)


# ---- BlockFP8Linear ----------------------------------------------------------------------------
def _module(scale_dtype=E8M0) -> BlockFP8Linear:
    weight, scale = builders.block_fp8_weight(70, 100, 32, scale_dtype)
    module = BlockFP8Linear(100, 70, 32, scale_dtype)
    module.load_state_dict({"weight": weight, "weight_scale_inv": scale})
    return module


@pytest.mark.parametrize("scale_dtype", [E8M0, FP32], ids=["ue8m0", "fp32"])
def test_module_keeps_the_checkpoint_bytes_through_dtype_casts(scale_dtype):
    module = _module(scale_dtype)
    weight, scale = module.weight.clone(), module.weight_scale_inv.clone()
    for cast in (lambda m: m.to(BF16), lambda m: m.half(), lambda m: m.float(), lambda m: m.to("cpu", BF16)):
        cast(module)
        assert builders.bytes_equal(module.weight, weight) and builders.bytes_equal(module.weight_scale_inv, scale)
    x = torch.randn(4, 100).to(BF16)
    check_against_dequant64(module(x), x, weight, scale, 32, "module")


def test_module_rejects_a_float_weight_instead_of_casting_it():
    module = _module()
    before = module.weight.clone()
    with pytest.raises(RuntimeError, match=r"weight: expected dtype torch.float8_e4m3fn \(a block-FP8 projection"):
        module.load_state_dict({"weight": torch.randn(70, 100), "weight_scale_inv": module.weight_scale_inv})
    assert builders.bytes_equal(module.weight, before)
    with pytest.raises(ValueError, match=r"block: expected a tile size in \[32, 128\], got 64"):
        BlockFP8Linear(100, 70, 64)


def test_module_compiles_without_graph_breaks():
    torch._dynamo.reset()
    module = _module()
    x = torch.randn(5, 100).to(BF16)
    compiled = torch.compile(module, fullgraph=True)
    # The op's CPU kernel is the reference in both runs: the same computation.
    assert torch.equal(compiled(x), module(x))


# ---- a V4 layer with its projections kept in block FP8 -------------------------------------------
CFG = DSV4AttentionConfig.tiny()


def _fp8_checkpoint(layer, scale_dtype) -> dict:
    """DeepSeek checkpoint dict of `layer`: every 2-D projection block-FP8 (128 x 128 tiles) but the
    compressors' kv / gate, bf16 as in V4's checkpoints (spec 1.3)."""
    inverse = {v: k for k, v in DEEPSEEK_NAMES.items()}
    sd = {}
    for i, (name, p) in enumerate(layer.named_parameters()):
        key = f"layers.{layer.layer_idx}.{inverse[name]}"
        if name in COMPRESSOR_WEIGHTS:
            sd[key] = p.detach().to(torch.bfloat16)
        elif p.dim() == 2 and name.endswith("proj.weight"):
            w, s = builders.block_fp8_weight(*p.shape, 128, scale_dtype, seed=i)
            # ~1/sqrt(fan_in) weights, as randomize_ makes them: the scale carries it
            sd[key], sd[key[: -len("weight")] + "scale"] = w, (s.float() * p.shape[1] ** -0.5).to(s.dtype)
        else:
            sd[key] = p.detach().clone()
    return sd


def _loaded(layer_idx, sd, dtype, keep_fp8):
    layer = DeepseekV4Attention(CFG, layer_idx, formats=CacheFormats.exact()).to(dtype)
    layer.load_deepseek_state_dict(sd, keep_fp8=keep_fp8)
    return layer


@pytest.mark.parametrize("scale_dtype", [E8M0, FP32], ids=["ue8m0", "fp32"])
@pytest.mark.parametrize("layer_idx", [0, 1])
def test_layer_with_fp8_projections_equals_the_dequantized_layer(layer_idx, scale_dtype):
    src = T.randomize_(DeepseekV4Attention(CFG, layer_idx), seed=layer_idx)
    sd = _fp8_checkpoint(src, scale_dtype)
    fp8, deq, ref = _loaded(layer_idx, sd, BF16, True), _loaded(layer_idx, sd, BF16, False), _loaded(
        layer_idx, sd, FP32, False)
    names = [n for n in FP8_PROJECTIONS if n.split(".")[0] != "compressor" or fp8.compressor is not None]
    assert all(isinstance(fp8.get_submodule(n), BlockFP8Linear) for n in names)
    assert not any(isinstance(m, BlockFP8Linear) for m in deq.modules())
    assert fp8.o_a_proj.groups == CFG.o_groups  # o_a block-FP8 too, in fp8_linear's grouped form
    if fp8.compressor is not None:  # bf16 in the checkpoint, bf16 as held
        assert fp8.compressor.kv_proj.weight.dtype == BF16
    x = torch.randn(2, 9, CFG.hidden_size)
    with torch.no_grad():
        T.assert_close_to_ref(fp8(x.to(BF16)), ref(x), deq(x.to(BF16)), what="stateless")
    # A dequantized load turns the projections back into nn.Linear modules (o_a: GroupedLinear) of the
    # model dtype.
    fp8.load_deepseek_state_dict(sd)
    plain = {n: GroupedLinear if n == "o_a_proj" else torch.nn.Linear for n in names}
    assert all(type(fp8.get_submodule(n)) is plain[n] and fp8.get_submodule(n).weight.dtype == BF16 for n in names)


def test_layer_with_fp8_projections_serves_like_the_dequantized_layer():
    src = T.randomize_(DeepseekV4Attention(CFG, 1), seed=1)
    sd = _fp8_checkpoint(src, E8M0)
    g = torch.Generator().manual_seed(0)
    inputs = {0: torch.randn(12, CFG.hidden_size, generator=g), 1: torch.randn(6, CFG.hidden_size, generator=g)}
    schedule = [{0: 9, 1: 5}, {0: 3, 1: 1}]
    outs = {}
    for name, dtype, keep in (("fp8", BF16, True), ("deq", BF16, False), ("ref", FP32, False)):
        layer = _loaded(1, sd, dtype, keep)
        cache = CacheConfig(max_requests=2, max_context=64, max_step_tokens=16, formats=CacheFormats.exact(),
                            exact_dtype=dtype)
        manager = KVCacheManager(CFG, cache)
        layer.attach_cache(manager)
        with torch.no_grad():
            outs[name] = drivers.serve_schedule(layer, manager, {r: v.to(dtype) for r, v in inputs.items()}, schedule)
    for r in inputs:
        T.assert_close_to_ref(outs["fp8"][r], outs["ref"][r], outs["deq"][r], what=f"request {r}")


def test_keep_fp8_rejects_a_tile_size_without_a_kernel_and_keeps_the_layer():
    src = T.randomize_(DeepseekV4Attention(CFG, 0), seed=0)
    inverse = {v: k for k, v in DEEPSEEK_NAMES.items()}
    sd = {f"layers.0.{inverse[n]}": p.detach().clone() for n, p in src.named_parameters()}
    key = "layers.0.attn.wq_a.weight"
    sd[key], sd["layers.0.attn.wq_a.scale"] = builders.block_fp8_weight(*src.q_a_proj.weight.shape, 64)
    layer = DeepseekV4Attention(CFG, 0)
    with pytest.raises(ValueError, match=r"block: expected a tile size in \[32, 128\], got 64"):
        layer.load_deepseek_state_dict(sd, block=64, keep_fp8=True)
    assert type(layer.q_a_proj) is torch.nn.Linear


# ---- W8A8: dsv4::fp8_linear_w8a8 (x quantized per 1 x 128 block, DeepSeek's act_quant) -------------
def model_act_quant(x: torch.Tensor) -> tuple[list, list]:
    """(e4m3 codes, scale exponents) of each row of x from the V4 rule in tests/format_model.py:
    e = ceil(log2(fp32(max(amax, 1e-4) / 448))) per 1 x 128 block, codes the nearest e4m3 of
    v / 2^e (ties to the even code). Plain Python floats."""
    codes, exps = [], []
    for row in x.float().tolist():
        for j in range(0, len(row), 128):
            block = row[j:j + 128]
            e = M.pow2ceil_exp(M.f32(max(max(abs(v) for v in block), M.f32(1e-4)) / 448))
            exps.append(e)
            codes += [M.e4m3_code(v / 2.0**e) for v in block]
    return codes, exps


def act_quant_inputs(dtype):
    """Rows whose blocks hit the rule's edges: an amax of exactly 448 x 2^e and one ulp above it,
    an amax under the 1e-4 floor, an all-zero block, e4m3 ties (odd multiples of half a quantum), a
    large and a small magnitude, and random values."""
    x = torch.randn(6, 256, generator=torch.Generator().manual_seed(3)).to(dtype).float()
    x[0, 0], x[0, 128] = 448 * 2.0**-3, torch.nextafter(torch.tensor(448 * 2.0**2), torch.tensor(1e9)).item()
    x[1, :128] *= 1e-6
    x[1, 128:] = 0
    x[2, :128] = torch.arange(128) * 0.5 + 0.25 if dtype != torch.float16 else torch.arange(128) * 0.125 + 1 / 16
    x[3, :128] *= 300.0
    x[4] *= 1e-3
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [BF16, FP16, FP32], ids=["bf16", "fp16", "fp32"])
def test_act_quant_follows_the_pow2_rule_bit_for_bit(dtype):
    from dsv4ops.fp8_linear import reference

    x = act_quant_inputs(dtype)
    codes, scales = reference.act_quant(x)
    want_codes, want_exps = model_act_quant(x)
    assert codes.view(torch.uint8).flatten().tolist() == want_codes
    assert scales.flatten().tolist() == [2.0**e for e in want_exps]


def w8a8_model(x, weight, scale):
    """The W8A8 product in float64 from the independent act_quant model: codes x 2^e @ dequant64^T."""
    codes, exps = model_act_quant(x)
    m, k = x.shape
    xq = (E4M3_VALUES[torch.tensor(codes)].view(m, k // 128, 128)
          * torch.tensor([2.0**e for e in exps], dtype=torch.float64).view(m, -1, 1)).view(m, k)
    return xq, xq @ dequant64(weight, scale, 128).T


@pytest.mark.parametrize("scale_dtype", [E8M0, FP32], ids=["ue8m0", "fp32"])
@pytest.mark.parametrize("dtype", [BF16, FP16, FP32], ids=["bf16", "fp16", "fp32"])
def test_w8a8_is_the_product_of_the_quantized_activations(dtype, scale_dtype):
    weight, scale = builders.block_fp8_weight(200, 384, 128, scale_dtype, seed=7)
    for m in (1, 5):
        x = torch.randn(m, 384).to(dtype)
        out = fp8_linear(x, weight, scale, 128, activations="fp8")
        assert out.shape == (m, 200) and out.dtype == dtype
        xq, ref64 = w8a8_model(x, weight, scale)
        # the same product with the quantized operands in x's dtype
        lowp = F.linear(xq.to(dtype), dequant64(weight, scale, 128).to(dtype))
        T.assert_close_to_ref(out, ref64, lowp, what=f"M={m}")


def test_w8a8_differs_from_w8a16_by_the_activation_quantization():
    # The activations' e4m3 rounding (about 2^-5 relative per element) is far outside the W8A16
    # budget: the two modes are different products, not two orders of one sum.
    weight, scale = builders.block_fp8_weight(128, 256, 128, seed=1)
    x = torch.randn(4, 256).to(BF16)
    a8, a16 = (fp8_linear(x, weight, scale, 128, activations=a) for a in ("fp8", "exact"))
    w64 = dequant64(weight, scale, 128)
    budget = (F.linear(x, w64.to(BF16)).double() - x.double() @ w64.T).abs().max()
    assert (a8.double() - a16.double()).abs().max() > 4 * budget


ARGS8 = partial(builders.fp8_linear_w8a8_args, FP32)
BAD8 = [
    ("block", wa("block", lambda a: 32), r"block: expected 128 \(W8A8 quantizes x in 1 x 128 blocks"),
    ("scale-dtype", wa("scale", lambda a: a["scale"].view(torch.int32)),
     r"scale: expected torch.float32 \(BlockFP8Linear keeps an fp32 copy of UE8M0 scales\), got torch.int32"),
    ("in-features", lambda a: a.update(x=a["x"][:, :300].contiguous(), weight=a["weight"][:, :300].contiguous(),
                                       scale=a["scale"][:, :3].contiguous()),
     r"x: expected in_features a multiple of 128 \(whole 1 x 128 activation blocks\), got 300"),
    ("scale-shape", wa("scale", lambda a: a["scale"][:, :2].contiguous()),
     r"scale: expected shape \(2, 3\) \(a \[200, 384\] weight in 128 x 128 tiles\), got \(2, 2\)"),
    ("x-dtype", wa("x", lambda a: a["x"].double()), r"x: expected dtype in"),
    ("out-dtype", wa("out", lambda a: a["out"].bfloat16()), r"out: expected dtype in \[torch.float32\]", ("op",)),
]


@pytest.mark.parametrize("case", BAD8, ids=[b[0] for b in BAD8])
def test_w8a8_bad_input_is_rejected_and_writes_nothing(case):
    _, mutate, match, *via = case
    builders.assert_bad_case("fp8_linear_w8a8", ARGS8(), mutate, match, via)


def test_activations_must_be_a_known_mode():
    weight, scale = builders.block_fp8_weight(128, 128, 128)
    with pytest.raises(ValueError, match=r"activations: expected one of \['exact', 'fp8', 'auto'\], got 'int8'"):
        fp8_linear(torch.randn(2, 128), weight, scale, 128, activations="int8")
    with pytest.raises(ValueError, match=r"activations: expected one of .*, got 'w8a8'"):
        BlockFP8Linear(128, 128, activations="w8a8")


# ---- the "auto" rule ---------------------------------------------------------------------------------
def test_rule_picks_w8a8_from_the_table_on_sm90(monkeypatch):
    from dsv4ops.fp8_linear import rule

    monkeypatch.setattr(rule, "W8A8_FROM", {(4096, 8192): 128, (512, 4096): None})
    monkeypatch.setattr(rule, "DEFAULT_W8A8_FROM", 512)
    h100 = (9, 0)
    assert [rule.pick(m, 4096, 8192, 128, h100) for m in (1, 127, 128, 4096)] == ["exact"] * 2 + ["fp8"] * 2
    assert rule.pick(4096, 512, 4096, 128, h100) == "exact"  # None: never
    assert [rule.pick(m, 2048, 2048, 128, h100) for m in (511, 512)] == ["exact", "fp8"]  # the default
    # shapes cuBLASLt refuses: the Triton kernel serves them
    assert rule.pick(4096, 4104, 8320, 128, h100) == "fp8" and rule.w8a8_refuses(8320, 128, h100) is None
    # never where the W8A8 op has no GPU kernel, whatever the table says
    for args, why in (((4096, 8192, 128, None), "no CUDA GPU"), ((4096, 8192, 128, (8, 0)), "sm_80"),
                      ((4096, 8192, 32, h100), "block 32"), ((4096, 8256, 128, h100), "in_features 8256")):
        assert why in rule.w8a8_refuses(*args[1:]) and rule.pick(4096, *args) == "exact", args
    # sm_100 runs the op's Triton kernel, but "auto" keeps W8A16 there: the table is the H100's
    assert rule.w8a8_refuses(8192, 128, (10, 0)) is None and rule.pick(4096, 4096, 8192, 128, (10, 0)) == "exact"


def test_w8a8_routes_to_cublaslt_from_its_table_where_cublaslt_serves(monkeypatch):
    from dsv4ops.fp8_linear import rule, w8a8

    monkeypatch.setattr(w8a8, "CUBLASLT_FROM", {(4096, 8192): 128})
    monkeypatch.setattr(w8a8, "DEFAULT_CUBLASLT_FROM", 512)
    h100 = (9, 0)
    assert [w8a8.route(m, 4096, 8192, BF16, h100) for m in (1, 127, 128)] == ["triton"] * 2 + ["cublaslt"]
    assert [w8a8.route(m, 2048, 2048, BF16, h100) for m in (511, 512)] == ["triton", "cublaslt"]  # the default
    for args in ((4096, 8192, BF16, (10, 0)), (4096, 8192, FP16, h100), (4104, 8192, BF16, h100),
                 (4096, 8320, BF16, h100)):
        assert rule.cublaslt_refuses(*args) is not None and w8a8.route(4096, *args) == "triton", args
    assert "sm_90 only" in rule.cublaslt_refuses(4096, 8192, BF16, (10, 0))
    assert "multiple of 512" in rule.cublaslt_refuses(4096, 8320, BF16, h100)


def test_rule_suggestion_is_the_start_of_the_last_winning_run():
    from dsv4ops.fp8_linear.rule import suggest_from

    assert suggest_from({1: (5.0, 9.0), 64: (9.0, 8.0), 128: (12.0, 8.0), 4096: (300.0, 150.0)}) == 64
    assert suggest_from({1: (5.0, 4.0), 64: (9.0, 10.0), 128: (12.0, 8.0)}) == 128  # a loss at 64 breaks the run
    assert suggest_from({1: (5.0, 9.0), 128: (8.0, 8.0)}) is None  # a tie is no win
    assert suggest_from({1: (5.0, 9.0), 128: (8.0, 7.7)}) is None  # nor a win within the 5% margin
    assert suggest_from({1: (5.0, 9.0), 128: (8.0, 7.7)}, margin=1.0) == 128


def test_rule_table_covers_every_v4_flash_and_pro_projection():
    from dsv4ops.bench.fp8_linear import projections
    from dsv4ops.fp8_linear import rule

    from dsv4ops.config import CSA, HCA, SLIDING
    from dsv4ops.fp8_linear import triton_w8a8, w8a8
    from dsv4ops.warmup import _fp8_projections

    shapes = {*projections(DSV4AttentionConfig.flash()).values(), *projections(DSV4AttentionConfig.pro()).values()}
    # and every tensor-parallel rank's share (TP 2 - 16) of q_b_proj's rows and o_b_proj's columns
    shards = {(n, k) for cfg in (DSV4AttentionConfig.flash(), DSV4AttentionConfig.pro()) for tp in (2, 4, 8, 16)
              for n, k in _fp8_projections(cfg, {SLIDING, CSA, HCA}, tp) if k}
    assert len(shards - shapes) == 12
    assert shapes | shards == set(rule.W8A8_FROM) == set(triton_w8a8.TUNED) >= set(w8a8.CUBLASLT_FROM)


def test_module_auto_runs_w8a8_where_the_rule_picks_it(monkeypatch):
    from dsv4ops.fp8_linear import rule

    module = _module_128()
    x = torch.randn(130, 512).to(BF16)
    exact, w8a8 = (fp8_linear(x, module.weight, module.weight_scale_inv, 128, activations=a) for a in ("exact", "fp8"))
    assert module._capability is None
    assert torch.equal(module(x), exact)  # CPU: "exact"
    monkeypatch.setattr(module, "_capability", (9, 0))
    monkeypatch.setattr(rule, "W8A8_FROM", {(128, 512): 130})
    assert torch.equal(module(x), w8a8)
    assert torch.equal(module(x[:129]), fp8_linear(x[:129], module.weight, module.weight_scale_inv, 128))
    module.activations = "exact"
    assert torch.equal(module(x), exact)


def _module_128(scale_dtype=E8M0) -> BlockFP8Linear:
    weight, scale = builders.block_fp8_weight(128, 512, 128, scale_dtype, seed=2)
    module = BlockFP8Linear(512, 128, 128, scale_dtype)
    module.load_state_dict({"weight": weight, "weight_scale_inv": scale})
    return module


@pytest.mark.parametrize("scale_dtype", [E8M0, FP32], ids=["ue8m0", "fp32"])
def test_module_keeps_fp32_scales_for_w8a8_in_step_with_its_buffers(scale_dtype):
    module = _module_128(scale_dtype)
    assert module.scale_fp32.dtype == FP32 and torch.equal(module.scale_fp32, module.weight_scale_inv.float())
    assert set(module.state_dict()) == {"weight", "weight_scale_inv"}  # derived: not saved
    module.to(BF16)
    assert module.scale_fp32.dtype == FP32
    _, other = builders.block_fp8_weight(128, 512, 128, scale_dtype, seed=9)
    module.load_state_dict({"weight": module.weight.clone(), "weight_scale_inv": other})
    assert torch.equal(module.scale_fp32, other.float())
    module.activations = "fp8"
    x = torch.randn(3, 512).to(BF16)
    assert torch.equal(module(x), fp8_linear(x, module.weight, other, 128, activations="fp8"))
    module.weight_scale_inv.copy_(module.weight_scale_inv.float().mul(2).to(scale_dtype))
    module.refresh()
    assert torch.equal(module.scale_fp32, other.float() * 2)


# ---- the Triton kernel under the interpreter, against the reference (helpers: tests/interp.py) -------------
# (N, K, block): K over two tiles (split-K: partials + _reduce_kernel in the interpreter), within one
# tile (direct store), V4.1's 32 x 32 tiles; none a multiple of its tile.
FP8_SHAPES = [(200, 300, 128), (200, 100, 128), (70, 100, 32)]


@pytest.mark.parametrize("scale_dtype", [torch.float8_e8m0fnu, torch.float32], ids=["ue8m0", "fp32"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("n,k,block", FP8_SHAPES)
def test_fp8_linear(n, k, block, dtype, scale_dtype):
    weight, scale = builders.block_fp8_weight(n, k, block, scale_dtype, seed=n + k)
    if scale_dtype == torch.float8_e8m0fnu:
        scale = scale.view(torch.uint8)
    # The scales end right before a NaN (UE8M0 0xFF): a K step past the last tile column that read
    # its scale would turn 0 x scale into NaN.
    after = torch.full((scale.numel() + 1,), 255 if scale.dtype == torch.uint8 else float("nan"), dtype=scale.dtype)
    after[:-1] = scale.flatten()
    scale = after[:-1].view(scale.shape)
    for m in (1, 3, 17, 130):  # decode rows padded to 16, 32; a prefill of two 128-row blocks
        x = torch.randn(m, k)

        def run(fn, dt):
            wide = torch.full((m, n + 3), float("nan"), dtype=dt)  # rows with a stride gap, poisoned
            fn(x.to(dt), weight, scale, wide[:, :n], block)
            assert wide[:, n:].isnan().all(), "wrote outside out"
            return wide[:, :n]

        def in_order(out_dtype):
            # The reference's math with its K sum taken term by term in fp32 (the accumulation the
            # tensor cores keep), then rounded to x's dtype: a second low-precision run, so the
            # budget covers a summation order other than F.linear's (AMD EPYC, fp32, M = 3: the CPU
            # GEMM came within 1 ulp of float64 there, the kernel's tile order 3 ulps).
            w = fp8_linear_ref.dequantize(weight, scale, block, out_dtype).float()
            xs = x.to(out_dtype).float()
            acc = torch.zeros(m, n)
            for j in range(k):
                acc += xs[:, j, None] * w[:, j]
            return acc.to(out_dtype)

        got = run(fp8_linear_tt.fp8_linear, dtype)
        assert not got.isnan().any(), "every element written"
        T.assert_close_to_ref(got, run(fp8_linear_ref.fp8_linear, torch.float64),
                                    [run(fp8_linear_ref.fp8_linear, dtype), in_order(dtype)], what=f"M={m}")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_act_quant(dtype):
    # W8A8's activation quantization: exact math (power-of-two scales, round to nearest even), so bit
    # for bit against the reference; rows past M (the GEMM's padding) zero codes; scales M-major.
    x = act_quant_inputs(dtype)
    wide = torch.full((x.shape[0], x.shape[1] + 8), float("nan"), dtype=dtype)
    wide[:, :x.shape[1]] = x  # rows with a stride gap
    for m in (1, 6):
        mp = 16 if m == 1 else 6  # padded, and not
        codes = torch.full((mp, x.shape[1]), 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn)  # NaN
        scales = torch.full((x.shape[1] // 128, mp), float("nan"))
        fp8_linear_tt.act_quant(wide[:m, :x.shape[1]], codes, scales)
        want_codes, want_scales = fp8_linear_ref.act_quant(x[:m])
        assert builders.bytes_equal(codes[:m], want_codes), m
        assert builders.bytes_equal(scales.t()[:m].contiguous(), want_scales), m
        assert (codes[m:].view(torch.uint8) == 0).all() and not scales.isnan().any()


@pytest.mark.parametrize("scale_dtype", [torch.float8_e8m0fnu, torch.float32], ids=["ue8m0", "fp32"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32], ids=["bf16", "fp16", "fp32"])
def test_fused_w8a8(dtype, scale_dtype):
    # The FP8 x FP8 kernel with act_quant in its prologue: N ragged (200: a 128-tile and a partial
    # one), three 1 x 128 blocks over two K splits (partials + _reduce_kernel) or one; rows padded
    # to a 64-row block and in two row blocks; fp32 weight scales that are no powers of two.
    n, k = 200, 384
    weight, scale = builders.block_fp8_weight(n, k, 128, scale_dtype, seed=11)
    scale = scale.float() * (k**-0.5 if scale_dtype == torch.float32 else 1.0)
    x0 = torch.randn(130, k)
    x0[1, :128] *= 1e-6  # a block under the amax floor
    x0[2, 128:256] *= 300.0
    # x quantized in the kernel's prologue, or by act_quant first (QUANT False); column tiles of 64
    # (one weight tile's scale) and of 256 (a scale per column)
    for m, split, quant, bn in ((1, 2, True, 64), (3, 1, True, 256), (3, 2, False, 64), (130, 2, False, 256),
                                (130, 1, True, 64)):
        x = x0[:m]
        cfg = dict(w8a8_tt.config(m, n, k), SPLITS=split, K_SPLIT=256 if split == 2 else 384, QUANT=quant, BN=bn)

        def run(fn, dt, **kw):
            wide = torch.full((m, n + 3), float("nan"), dtype=dt)  # rows with a stride gap, poisoned
            fn(x.to(dt), weight, scale, wide[:, :n], **kw)
            assert wide[:, n:].isnan().all(), "wrote outside out"
            return wide[:, :n]

        def in_order(out_dtype):
            # the W8A8 product from the reference's act_quant, its K sum term by term in fp32
            codes, xs = fp8_linear_ref.act_quant(x.to(out_dtype))
            xq = (codes.float().view(m, -1, 128) * xs[..., None]).view(m, k)
            w = fp8_linear_ref.dequantize(weight, scale, 128, torch.float32)
            acc = torch.zeros(m, n)
            for j in range(k):
                acc += xq[:, j, None] * w[:, j]
            return acc.to(out_dtype)

        got = run(w8a8_tt.fp8_linear_w8a8, dtype, cfg=cfg)
        assert not got.isnan().any(), "every element written"
        ref = [run(fp8_linear_ref.fp8_linear_w8a8, d, block=128) for d in (torch.float64, dtype)]
        # x's values in dtype, in float64: the reference quantizes the values the kernel reads
        ref[0] = run(lambda xx, *a, **kw: fp8_linear_ref.fp8_linear_w8a8(xx.to(dtype).double(), *a, **kw),
                     torch.float64, block=128)
        T.assert_close_to_ref(got, ref[0], [ref[1], in_order(dtype)], what=f"M={m}, quant={quant}")


def _scaled_mm_model(a, b, scale_a, scale_b, out_dtype=None, out=None):
    """torch._scaled_mm's blockwise contract (ScaledBlas.cpp, DeepSeek-style 1 x 128 / 128 x 128):
    a [M, K] row-major, b [K, N] column-major, scale_a [M, K / 128] M-major (strides (1, M)),
    scale_b [K / 128, N / 128] K-major (strides (1, K / 128)); the product in float64."""
    (m, k), n = a.shape, b.shape[1]
    kb, nb = k // 128, -(-n // 128)
    assert a.is_contiguous() and b.t().is_contiguous() and a.dtype == b.dtype == torch.float8_e4m3fn
    assert scale_a.shape == (m, kb) and scale_a.stride() == (1, m), (scale_a.shape, scale_a.stride())
    assert scale_b.shape == (kb, nb) and scale_b.stride() == (1, kb), (scale_b.shape, scale_b.stride())
    assert out.shape == (m, n) and out.is_contiguous() and out.dtype == out_dtype
    xa = a.double().view(m, kb, 128) * scale_a.double()[:, :, None]
    wb = b.t().double() * scale_b.t().double().repeat_interleave(128, 0)[:n].repeat_interleave(128, 1)
    out.copy_(xa.view(m, k) @ wb.t())
    return out


def test_w8a8_launcher_hands_cublaslt_the_blockwise_layouts(monkeypatch):
    # The CUDA launcher's cuBLASLt route on CPU (routed from one token here): act_quant in the
    # interpreter, torch._scaled_mm replaced by a model that asserts the layouts torch's blockwise
    # check wants; rows padded to 16 and copied back, an out with a stride gap through a temporary;
    # nothing written past out.
    from dsv4ops.fp8_linear import rule
    from dsv4ops.fp8_linear import w8a8

    monkeypatch.setattr(rule, "device_capability", lambda device: (9, 0))
    monkeypatch.setattr(w8a8, "DEFAULT_CUBLASLT_FROM", 1)
    monkeypatch.setattr(torch, "_scaled_mm", _scaled_mm_model)
    n, k = 272, 512  # N: two 128-tiles and a partial one
    weight, scale = builders.block_fp8_weight(n, k, 128, seed=4)
    scale = scale.float()
    for m, gap in ((3, 0), (32, 0), (32, 5)):
        x = torch.randn(m, k).bfloat16()
        wide = torch.full((m, n + gap), float("nan"), dtype=torch.bfloat16)
        w8a8.fp8_linear_w8a8(x, weight, scale, wide[:, :n], 128)
        assert wide[:, n:].isnan().all() and not wide[:, :n].isnan().any()
        want = torch.empty(m, n, dtype=torch.float64)
        fp8_linear_ref.fp8_linear_w8a8(x.double(), weight, scale, want, 128)
        T.assert_close_to_ref(wide[:, :n], want, want.bfloat16(), what=f"M={m}, gap={gap}")
    before = wide.clone()

    def refuse(*args, **kwargs):
        raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED")

    monkeypatch.setattr(torch, "_scaled_mm", refuse)
    with pytest.raises(RuntimeError, match=r"blockwise GEMM refused \[32, 512\] x \[512, 272\] .*NOT_SUPPORTED"):
        w8a8.fp8_linear_w8a8(x, weight, scale, wide[:, :n], 128)
    assert builders.bytes_equal(wide, before)
    # sm_100 (no cuBLASLt blockwise scaling): the Triton kernel serves every token count
    monkeypatch.setattr(rule, "device_capability", lambda device: (10, 0))
    wide.fill_(float("nan"))
    w8a8.fp8_linear_w8a8(x, weight, scale, wide[:, :n], 128)
    T.assert_close_to_ref(wide[:, :n], want, want.bfloat16(), what="sm_100")
    assert wide[:, n:].isnan().all()


def test_w8a8_probe_uses_the_launchers_layouts_and_turns_auto_off_where_torch_refuses(monkeypatch):
    # The probe's call passes torch's blockwise contract (the model above asserts the layouts); a
    # torch whose _scaled_mm refuses it turns "auto" to W8A16 (capability None), with a warning.
    from dsv4ops.fp8_linear import rule

    probe, cpu = rule.probe.__wrapped__, torch.device("cpu")  # uncached
    monkeypatch.setattr(torch, "_scaled_mm", _scaled_mm_model)
    assert probe(cpu) is None

    def refuse(*args, **kwargs):
        raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED\nmore")

    monkeypatch.setattr(torch, "_scaled_mm", refuse)
    with pytest.warns(UserWarning, match=r"W8A8 path is off on cpu .*refused 1 x 128 / 128 x 128 scaling: "
                                         r"CUBLAS_STATUS_NOT_SUPPORTED\); activations='auto' runs W8A16"):
        why = probe(cpu)
    assert why.endswith("CUBLAS_STATUS_NOT_SUPPORTED")
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(rule, "device_capability", lambda device: (9, 0))
    monkeypatch.setattr(rule, "probe", lambda dev: why)
    assert rule.serving_capability(cuda) is None
    monkeypatch.setattr(rule, "probe", lambda dev: None)
    assert rule.serving_capability(cuda) == (9, 0)
    monkeypatch.setattr(rule, "device_capability", lambda device: (10, 0))
    monkeypatch.setattr(rule, "probe", lambda dev: pytest.fail("probed off sm_90"))
    assert rule.serving_capability(cuda) == (10, 0)  # pick's own reason applies there


def test_fp8_linear_runs_the_gpus_prefill_config():
    # What config() gives a GPU at 300 tokens of kv (4096 -> 512), run here: 3 row blocks (the last of
    # 44 rows) x 6 splits of K (the last 256 wide): the partials of several row blocks and the reduce.
    n, k, m = 512, 4096, 300
    cfg = fp8_linear_tt.config(m, n, k, 128, interpret=False)
    assert (cfg["BM"], cfg["SPLITS"], cfg["K_SPLIT"]) == (128, 6, 768)
    weight, scale = builders.block_fp8_weight(n, k, 128, torch.float32, seed=1)
    scale = scale * k**-0.5
    x = torch.randn(m, k)

    def run(fn, dt, **kw):
        out = torch.full((m, n), float("nan"), dtype=dt)
        fn(x.to(dt), weight, scale, out, 128, **kw)
        return out

    got = run(fp8_linear_tt.fp8_linear, torch.bfloat16, cfg=cfg)
    assert not got.isnan().any(), "every element written"
    T.assert_close_to_ref(got, run(fp8_linear_ref.fp8_linear, torch.float64),
                                run(fp8_linear_ref.fp8_linear, torch.bfloat16))


def test_fp8_linear_launch_config_fills_the_h100():
    # The V4-Flash projections (q_a, q_b, kv, o_b) at decode batch 1 and 128: at least a wave of
    # programs on the 132 SMs, every weight byte read by one row block, split-K partials within 2x
    # the weight bytes; a prefill runs 128 x 128 tiles, split where they leave SMs idle (q_a at 256
    # rows: 16 tiles, 60 us unsplit on an H200) as far as partials within 2x the weight bytes allow.
    f = dsv4ops.DSV4AttentionConfig.flash()
    shapes = [(f.q_lora_rank, f.hidden_size), (f.num_heads * f.head_dim, f.q_lora_rank), (f.head_dim, f.hidden_size),
              (f.hidden_size, f.o_groups * f.o_lora_rank)]
    assert shapes == [(1024, 4096), (32768, 1024), (512, 4096), (4096, 8192)]
    for n, k in shapes:
        for m in (1, 128):
            c = fp8_linear_tt.config(m, n, k, 128, interpret=False)
            programs = triton.cdiv(n, c["BN"]) * c["SPLITS"]
            assert c["BM"] >= m and programs >= 128 and 4 * c["SPLITS"] * c["BM"] * n <= 2 * n * k, (n, k, m, c)
            assert (c["SPLITS"] - 1) * c["K_SPLIT"] < k <= c["SPLITS"] * c["K_SPLIT"]
        c = fp8_linear_tt.config(4096, n, k, 128, interpret=False)
        assert (c["BM"], c["BN"], c["SPLITS"]) == (128, 128, 1)
        for m in (256, 512, 1024):
            c = fp8_linear_tt.config(m, n, k, 128, interpret=False)
            tiles = triton.cdiv(n, 128) * triton.cdiv(m, 128)
            assert (c["BM"], c["BN"]) == (128, 128), (n, k, m, c)
            assert c["SPLITS"] == 1 or 4 * c["SPLITS"] * m * n <= 2 * n * k, (n, k, m, c)
            assert tiles * c["SPLITS"] >= 128 or c["SPLITS"] == min(8, k // (2 * m)), (n, k, m, c)


# ---- the launch table ----------------------------------------------------------------------------
# The three tables launch_table.LAUNCH replaced, copied as they were: each reader's pick must be theirs.
OLD_W8A8_FROM = {
    (1024, 4096): 256,  # V4-Flash q_a_proj
    (32768, 1024): 64,  # V4-Flash q_b_proj
    (512, 4096): 256,  # V4-Flash kv_proj
    (4096, 8192): 1,  # V4-Flash o_b_proj
    (8192, 1024): 64,  # V4-Flash indexer q_b_proj
    (1536, 7168): 1,  # V4-Pro q_a_proj
    (65536, 1536): 64,  # V4-Pro q_b_proj
    (512, 7168): 1,  # V4-Pro kv_proj
    (7168, 16384): 1,  # V4-Pro o_b_proj
    (8192, 1536): 64,  # V4-Pro indexer q_b_proj
    (4096, 4096): 1,  # V4-Flash o_b_proj, TP2
    (16384, 1024): 64,  # V4-Flash q_b_proj, TP2
    (4096, 2048): 64,  # V4-Flash o_b_proj, TP4
    (4096, 1024): 16,  # V4-Flash q_b_proj and o_b_proj, TP8
    (2048, 1024): 128,  # V4-Flash q_b_proj, TP16
    (7168, 8192): 1,  # V4-Pro o_b_proj, TP2
    (32768, 1536): 64,  # V4-Pro q_b_proj, TP2
    (7168, 4096): 1,  # V4-Pro o_b_proj, TP4
    (16384, 1536): 64,  # V4-Pro q_b_proj, TP4
    (7168, 2048): 1,  # V4-Pro o_b_proj, TP8
    (4096, 1536): 64,  # V4-Pro q_b_proj, TP16
    (7168, 1024): 64,  # V4-Pro o_b_proj, TP16
}
OLD_CUBLASLT_FROM = {
    (32768, 1024): 128,  # V4-Flash q_b_proj
    (512, 4096): 1024,  # V4-Flash kv_proj
    (4096, 8192): 256,  # V4-Flash o_b_proj
    (8192, 1024): 256,  # V4-Flash indexer q_b_proj
    (65536, 1536): 128,  # V4-Pro q_b_proj
    (512, 7168): 1024,  # V4-Pro kv_proj
    (7168, 16384): 64,  # V4-Pro o_b_proj
    (8192, 1536): 128,  # V4-Pro indexer q_b_proj
    (4096, 4096): 256,  # V4-Flash o_b_proj, TP2
    (16384, 1024): 128,  # V4-Flash q_b_proj, TP2
    (4096, 2048): 256,  # V4-Flash o_b_proj, TP4
    (4096, 1024): 256,  # V4-Flash q_b_proj and o_b_proj, TP8
    (7168, 8192): 64,  # V4-Pro o_b_proj, TP2
    (32768, 1536): 128,  # V4-Pro q_b_proj, TP2
    (7168, 4096): 64,  # V4-Pro o_b_proj, TP4
    (16384, 1536): 128,  # V4-Pro q_b_proj, TP4
    (7168, 2048): 128,  # V4-Pro o_b_proj, TP8
    (4096, 1536): 256,  # V4-Pro q_b_proj, TP16
    (7168, 1024): 256,  # V4-Pro o_b_proj, TP16
}
OLD_TUNED = {
    (1024, 4096): {1: (False, 16, 64, 8, 4, 3), 16: (True, 16, 64, 8, 4, 3), 64: (False, 64, 64, 8, 4, 4),
                   128: (False, 64, 128, 8, 8, 4), 256: (False, 64, 64, 4, 4, 4)},  # V4-Flash q_a
    (32768, 1024): {1: (True, 16, 256, 1, 8, 3), 16: (True, 16, 128, 1, 4, 3), 64: (False, 64, 128, 1, 4, 3),
                    128: (False, 128, 64, 1, 4, 4), 256: (False, 128, 64, 1, 4, 4)},  # V4-Flash q_b
    (512, 4096): {1: (True, 16, 64, 16, 4, 3), 16: (True, 16, 64, 16, 4, 3), 64: (True, 64, 64, 16, 4, 3),
                  128: (False, 64, 64, 8, 4, 4), 256: (False, 64, 128, 8, 8, 4)},  # V4-Flash kv
    (4096, 8192): {1: (True, 16, 128, 8, 4, 3), 16: (True, 16, 128, 8, 4, 3), 64: (False, 64, 64, 4, 4, 4),
                   128: (False, 128, 64, 4, 4, 4), 256: (False, 128, 128, 2, 8, 4)},  # V4-Flash o_b
    (8192, 1024): {1: (False, 16, 128, 4, 4, 4), 16: (False, 16, 128, 1, 4, 4), 64: (False, 64, 64, 1, 4, 4),
                   128: (False, 128, 64, 1, 8, 3), 256: (False, 128, 64, 1, 4, 3)},  # V4-Flash index q_b
    (1536, 7168): {1: (True, 16, 64, 14, 4, 3), 16: (True, 16, 64, 14, 4, 3), 64: (False, 64, 64, 14, 4, 3),
                   128: (False, 64, 64, 8, 4, 3), 256: (False, 64, 64, 4, 4, 4)},  # V4-Pro q_a
    (65536, 1536): {1: (False, 16, 128, 1, 4, 3), 16: (False, 16, 128, 1, 4, 3), 64: (False, 64, 128, 1, 4, 3),
                    128: (False, 128, 64, 1, 4, 4), 256: (False, 128, 64, 1, 4, 4)},  # V4-Pro q_b
    (512, 7168): {1: (True, 16, 64, 14, 4, 3), 16: (True, 16, 64, 14, 4, 3), 64: (False, 64, 64, 14, 4, 3),
                  128: (False, 64, 64, 14, 4, 4), 256: (False, 128, 64, 8, 4, 3)},  # V4-Pro kv
    (7168, 16384): {1: (False, 16, 64, 4, 4, 3), 16: (True, 16, 128, 4, 4, 3), 64: (False, 64, 64, 2, 4, 4),
                    128: (False, 128, 64, 2, 4, 4), 256: (False, 128, 128, 1, 8, 4)},  # V4-Pro o_b
    (8192, 1536): {1: (False, 16, 128, 1, 4, 4), 16: (True, 16, 64, 2, 4, 3), 64: (False, 64, 64, 1, 4, 4),
                   128: (False, 128, 64, 1, 4, 4), 256: (False, 128, 64, 1, 4, 4)},  # V4-Pro index q_b
    (4096, 4096): {1: (True, 16, 128, 8, 4, 3), 16: (False, 16, 128, 4, 4, 4), 64: (False, 64, 64, 4, 4, 4),
                   128: (False, 128, 64, 4, 4, 4), 256: (False, 128, 64, 2, 4, 4)},  # V4-Flash o_b_proj, TP2
    (16384, 1024): {1: (False, 16, 64, 1, 4, 4), 16: (False, 16, 128, 1, 4, 4), 64: (False, 64, 128, 1, 4, 4),
                    128: (False, 128, 64, 1, 4, 4), 256: (False, 128, 64, 1, 4, 4)},  # V4-Flash q_b_proj, TP2
    (4096, 2048): {1: (True, 16, 64, 4, 4, 3), 16: (True, 16, 64, 4, 4, 3), 64: (False, 64, 64, 4, 4, 4),
                   128: (False, 64, 64, 1, 4, 4), 256: (False, 128, 64, 1, 4, 3)},  # V4-Flash o_b_proj, TP4
    (4096, 1024): {1: (False, 16, 128, 8, 4, 4), 16: (True, 16, 32, 2, 4, 3), 64: (False, 64, 64, 1, 4, 4),
                   128: (False, 64, 64, 1, 4, 4), 256: (False, 128, 64, 1, 4, 3)},  # V4-Flash q_b and o_b, TP8
    (2048, 1024): {1: (True, 16, 64, 8, 4, 3), 16: (True, 16, 32, 2, 4, 3), 64: (True, 64, 64, 8, 4, 3),
                   128: (False, 64, 64, 1, 4, 4), 256: (False, 64, 64, 1, 4, 4)},  # V4-Flash q_b_proj, TP16
    (7168, 8192): {1: (False, 16, 64, 4, 4, 3), 16: (False, 16, 128, 2, 4, 4), 64: (False, 64, 128, 2, 4, 4),
                   128: (False, 128, 64, 2, 4, 4), 256: (False, 128, 64, 1, 4, 4)},  # V4-Pro o_b_proj, TP2
    (32768, 1536): {1: (True, 16, 128, 1, 4, 3), 16: (False, 16, 128, 1, 4, 4), 64: (False, 64, 128, 1, 4, 3),
                    128: (False, 128, 64, 1, 4, 4), 256: (False, 128, 64, 1, 4, 4)},  # V4-Pro q_b_proj, TP2
    (7168, 4096): {1: (True, 16, 64, 4, 4, 3), 16: (True, 16, 128, 4, 4, 3), 64: (False, 64, 64, 2, 4, 4),
                   128: (False, 128, 64, 2, 4, 4), 256: (False, 128, 64, 1, 4, 4)},  # V4-Pro o_b_proj, TP4
    (16384, 1536): {1: (False, 16, 128, 1, 4, 4), 16: (False, 16, 128, 1, 4, 4), 64: (False, 64, 64, 1, 4, 4),
                    128: (False, 128, 64, 1, 4, 4), 256: (False, 128, 64, 1, 4, 4)},  # V4-Pro q_b_proj, TP4
    (7168, 2048): {1: (True, 16, 128, 4, 4, 3), 16: (True, 16, 128, 4, 4, 3), 64: (False, 64, 64, 1, 4, 4),
                   128: (False, 128, 64, 1, 4, 4), 256: (False, 128, 64, 1, 4, 4)},  # V4-Pro o_b_proj, TP8
    (4096, 1536): {1: (True, 16, 64, 4, 4, 3), 16: (True, 16, 64, 4, 4, 3), 64: (False, 64, 64, 1, 4, 4),
                   128: (False, 64, 64, 1, 4, 4), 256: (False, 128, 64, 1, 4, 3)},  # V4-Pro q_b_proj, TP16
    (7168, 1024): {1: (False, 16, 64, 1, 4, 4), 16: (False, 16, 128, 1, 4, 4), 64: (False, 64, 64, 1, 4, 4),
                   128: (False, 128, 64, 1, 4, 4), 256: (False, 128, 64, 1, 4, 4)},  # V4-Pro o_b_proj, TP16
}


def test_launch_table_picks_what_the_three_tables_picked():
    from dsv4ops.fp8_linear import launch_table, rule, triton_w8a8, w8a8

    assert set(launch_table.LAUNCH) == set(OLD_W8A8_FROM) == set(OLD_TUNED) >= set(OLD_CUBLASLT_FROM)
    h100, unlisted = (9, 0), [(384, 2048)]  # an unlisted shape takes each reader's default
    for n, k in [*OLD_TUNED, *unlisted]:
        assert rule.cublaslt_refuses(n, k, torch.bfloat16, h100) is None, (n, k)
        for m in (1, 2, 15, 16, 17, 63, 64, 65, 127, 128, 129, 255, 256, 257, 511, 512, 1023, 1024, 1025, 4096):
            start = OLD_W8A8_FROM.get((n, k), 1024)
            assert rule.pick(m, n, k, 128, h100) == ("fp8" if start is not None and m >= start else "exact"), (n, k, m)
            want_route = "cublaslt" if m >= OLD_CUBLASLT_FROM.get((n, k), 512) else "triton"
            assert w8a8.route(m, n, k, torch.bfloat16, h100) == want_route, (n, k, m)
            cfg = triton_w8a8.config(m, n, k, interpret=False)
            buckets = OLD_TUNED.get((n, k))
            if buckets is None:
                assert (n, k) not in triton_w8a8.TUNED
                continue
            quant, bm, bn, split, warps, stages = buckets[min((b for b in buckets if b >= m), default=max(buckets))]
            k_split = -(-(k // 128) // min(split, k // 128)) * 128
            want = dict(QUANT=quant, BM=bm, BN=bn, SPLITS=-(-k // k_split), K_SPLIT=k_split, WARPS=warps, STAGES=stages)
            assert cfg == want, (n, k, m)
