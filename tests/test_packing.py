"""The packed projections of x (dsv4ops.packing): one GEMM over the stacked weights, equal to the
projections it replaces, and never stale whatever changes a member's weight."""

import pytest
import torch
from torch import nn

from dsv4ops import CacheFormats, DeepseekV4Attention, DSV4AttentionConfig, packing, testing
from dsv4ops.layers import X_PROJECTIONS
from dsv4ops.projections import project_x

CFG = DSV4AttentionConfig.tiny(index_topk=16)
FP8 = CacheFormats.v4()
MEMBERS = {0: X_PROJECTIONS[:2], 1: X_PROJECTIONS, 2: X_PROJECTIONS[:2] + X_PROJECTIONS[3:5]}  # sliding, CSA, HCA


def _layer(layer_idx=1, dtype=torch.bfloat16, seed=0):
    return testing.randomize_(DeepseekV4Attention(CFG, layer_idx, formats=FP8), seed=seed).to(dtype)


def _assert_tied(layer, expected: dict[str, torch.Tensor] | None = None):
    """Every member's weight is a view of its rows of the stacked weight, and (given) holds `expected`."""
    assert layer.x_pack.tied(layer)
    assert set(expected or ()) <= set(layer.x_pack.members)
    row = 0
    for name in layer.x_pack.members:
        w = layer.get_submodule(name).weight
        assert torch.equal(layer.x_packed[row:row + w.shape[0]], w), name
        if expected is not None and name in expected:
            assert torch.equal(w, expected[name]), name
        row += w.shape[0]
    assert row == layer.x_packed.shape[0]


@pytest.mark.parametrize("layer_idx", [0, 1, 2], ids=["sliding", "CSA", "HCA"])
def test_each_projection_of_x_is_its_own_gemm_within_the_fp32_summation_bound(layer_idx):
    """project_x's slices against each projection computed alone in fp64 from the same bf16 values:
    within the worst-case bound of an fp32 sum of K products, K * 2^-24 * sum |x_k w_k| (rounded
    once more to bf16 where the consumer computes in bf16). A slice cut at a wrong offset is off by
    the size of the outputs themselves."""
    layer = _layer(layer_idx)
    assert layer.x_pack.members == MEMBERS[layer_idx]
    x = torch.randn(9, CFG.hidden_size).bfloat16()
    out = project_x(layer, x)
    assert set(out) == set(MEMBERS[layer_idx])
    k = CFG.hidden_size
    for name, y in out.items():
        w = layer.get_submodule(name).weight
        exact = x.double() @ w.double().t()
        bound = k * 2.0**-24 * (x.double().abs() @ w.double().abs().t())
        if y.dtype == torch.bfloat16:  # one more rounding, half an ulp of bf16
            bound = bound + exact.abs() * 2.0**-8
        else:
            assert y.dtype == torch.float32 and name.startswith("compressor.") and "scorer" not in name, name
        assert ((y.double() - exact).abs() <= bound).all(), name


def test_load_state_dict_reaches_the_packed_gemm():
    layer, source = _layer(seed=0), _layer(seed=1)
    layer.load_state_dict(source.state_dict())
    _assert_tied(layer, {n: source.get_submodule(n).weight for n in MEMBERS[1]})


def test_assign_load_and_meta_built_layers_are_tied():
    source = _layer(seed=1)
    with torch.device("meta"):
        layer = DeepseekV4Attention(CFG, 1, formats=FP8)
    assert layer.x_packed is None  # nothing to stack yet
    layer.load_state_dict(source.state_dict(), assign=True)
    _assert_tied(layer, {n: source.get_submodule(n).weight for n in MEMBERS[1]})


def test_assigning_a_weight_copies_it_into_the_pack():
    layer = _layer()
    param = layer.compressor.gate_proj.weight
    new = torch.randn_like(param)
    layer.compressor.gate_proj.weight = nn.Parameter(new)
    _assert_tied(layer, {"compressor.gate_proj": new})
    with pytest.raises(ValueError, match=r"compressor\.gate_proj|shape"):
        layer.compressor.gate_proj.weight = nn.Parameter(torch.randn(3, CFG.hidden_size).bfloat16())
    _assert_tied(layer, {"compressor.gate_proj": new})


def test_moves_and_casts_keep_the_pack_tied():
    layer = _layer(dtype=torch.float32)
    want = {n: layer.get_submodule(n).weight.detach().clone() for n in MEMBERS[1]}
    layer.to(torch.bfloat16)
    _assert_tied(layer, {n: w.bfloat16() for n, w in want.items()})
    layer.float()
    assert layer.x_packed.dtype == torch.float32
    _assert_tied(layer)


def test_a_forward_reties_a_view_cut_loose_behind_its_back():
    """`.data =` bypasses every hook: the eager forward notices and stacks the new value."""
    layer = _layer()
    new = torch.randn_like(layer.kv_proj.weight)
    layer.kv_proj.weight.data = new.clone()
    assert not layer.x_pack.tied(layer)
    x = torch.randn(5, CFG.hidden_size).bfloat16()
    y = project_x(layer, x)["kv_proj"]
    _assert_tied(layer, {"kv_proj": new})
    exact = (x.double() @ new.double().t())
    assert (y.double() - exact).abs().max() <= exact.abs().max() * 2.0**-7


def test_a_block_fp8_projection_leaves_the_pack():
    layer = _layer()
    layer._set_projection("q_a_proj", 128, torch.float8_e8m0fnu)
    assert "q_a_proj" not in layer.x_pack.members and "kv_proj" in layer.x_pack.members
    _assert_tied(layer)
    out = project_x(layer, torch.randn(3, CFG.hidden_size).bfloat16())
    assert out["q_a_proj"].shape == (3, CFG.q_lora_rank) and out["q_a_proj"].dtype == torch.bfloat16


def test_fp32_compressor_weights_load_when_bf16_holds_them_exactly():
    layer, source = _layer(seed=0), _layer(seed=1)
    state = {k: v.float() if "compressor" in k and k.endswith("proj.weight") else v
             for k, v in source.state_dict().items()}
    layer.load_state_dict(state)
    _assert_tied(layer, {n: source.get_submodule(n).weight for n in MEMBERS[1]})


def test_fp32_compressor_weights_bf16_cannot_hold_are_refused_and_nothing_changes():
    layer, source = _layer(seed=0), _layer(seed=1)
    before = {k: v.clone() for k, v in layer.state_dict().items()}
    state = dict(source.state_dict())
    key = "compressor.indexer.kv_proj.weight"
    state[key] = state[key].float() * (1 + 2.0**-12)
    with pytest.raises(ValueError, match=r"compressor\.indexer\.kv_proj\.weight: torch\.float32 values"):
        layer.load_state_dict(state)
    for k, v in layer.state_dict().items():
        assert torch.equal(v, before[k]), k
    _assert_tied(layer)


def test_cpu_fp32_products_are_the_upcast_gemm():
    x, w = torch.randn(4, 64).bfloat16(), torch.randn(8, 64).bfloat16()
    assert torch.equal(packing.matmul(x, w, fp32=True), x.float() @ w.float().t())
    assert packing.matmul(x, w, fp32=False).dtype == torch.bfloat16


def _fp8_layer(seed=0, block=32):
    """q_a and kv block-FP8 as keep_fp8 loads them, in 32 x 32 tiles (the tiny config's q_a has 64 rows)."""
    from dsv4ops.bench.layer_step import quantize_block_fp8

    layer = _layer(seed=seed)
    for name in ("q_a_proj", "kv_proj"):
        codes, scale = quantize_block_fp8(layer.get_submodule(name).weight.detach().float(), block)
        layer._set_projection(name, block, torch.float8_e8m0fnu)
        layer.get_submodule(name).load_state_dict({"weight": codes, "weight_scale_inv": scale})
    return layer


def test_block_fp8_q_a_and_kv_run_as_one_gemm_and_follow_their_loads():
    """keep_fp8 projections: q_a and kv stacked (e4m3 rows and tile scales), equal to each module alone
    within the fp32 sum bound; a load into a member and a move reach the stacked tensors."""
    layer, source = _fp8_layer(0), _fp8_layer(1)
    assert layer.x8_pack.members == ("q_a_proj", "kv_proj") and "q_a_proj" not in layer.x_pack.members
    layer.load_state_dict(source.state_dict())
    assert layer.x8_pack.tied(layer)
    for name in ("q_a_proj", "kv_proj"):
        for t in ("weight", "weight_scale_inv"):
            mine, theirs = getattr(layer.get_submodule(name), t), getattr(source.get_submodule(name), t)
            assert torch.equal(mine.view(torch.uint8), theirs.view(torch.uint8)), (name, t)
    layer.to(torch.float32)
    assert layer.x8_packed.dtype == torch.float8_e4m3fn and layer.x8_pack.tied(layer)
    layer.to(torch.bfloat16)
    x = torch.randn(6, CFG.hidden_size).bfloat16()
    out = project_x(layer, x)
    for name in ("q_a_proj", "kv_proj"):
        alone = layer.get_submodule(name)(x)
        assert (out[name].double() - alone.double()).abs().max() <= alone.double().abs().max() * 2.0**-7, name
    scale = layer.kv_proj.weight_scale_inv
    layer.kv_proj.weight_scale_inv = torch.full_like(scale, 2.0)  # a buffer assigned: copied into the stack
    assert layer.x8_pack.tied(layer) and (layer.x8_packed_scale[-scale.shape[0]:].float() == 2.0).all()
