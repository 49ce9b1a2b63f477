"""V4.1's packed projections of x (dsv4ops.projections, shared with V4): per role, one GEMM over
the projections that read x (q_a, kv, the indexer's weights_proj, the compressor's wkv / wgate),
equal to each projection computed alone; never stale after a load or an assignment; compressor
weights held bf16, an fp32 one bf16 cannot hold exactly refused by name."""

import pytest
import torch
from torch import nn

from dsv4ops import testing
from dsv4ops.config_v41 import DSV41AttentionConfig
from dsv4ops.layers_v41 import DEEPSEEK_NAMES, DeepseekV41Attention, DeepseekV41AttentionStack
from dsv4ops.projections import project_x

CFG = DSV41AttentionConfig.tiny()
OWN, IDX, COMP = ("q_a_proj", "kv_proj"), ("indexer.weights_proj",), ("compressor.wkv", "compressor.wgate")
# Layer -> its packed members (tiny: ratios 0 2 2 2 2 1 1 1 1 1, KV sources 1 3 5, index sources 1 3 5 7).
ROLES = {0: OWN, 1: OWN + IDX + COMP, 2: OWN, 5: OWN + IDX + COMP[:1], 7: OWN + IDX}
IDS = [CFG.role(i).kind for i in ROLES]


def _layer(i, seed=0, dtype=torch.bfloat16):
    return testing.randomize_(DeepseekV41Attention(CFG, i), seed=seed).to(dtype)


def _states(*seeds) -> list[dict]:
    """Stack state dicts of random weights (one stack randomized again per seed: stacks cost seconds)."""
    stack = DeepseekV41AttentionStack(CFG).to(torch.bfloat16)
    return [{k: v.clone() for k, v in testing.randomize_(stack, seed=s).state_dict().items()} for s in seeds]


def _weights(state: dict, i: int) -> dict[str, torch.Tensor]:
    return {k[len(f"layers.{i}."):].removesuffix(".weight"): v for k, v in state.items() if k.startswith(f"layers.{i}.")}


def _assert_tied(layer, expected: dict[str, torch.Tensor] | None = None):
    """Every member's weight is a view of its rows of the stacked weight, and (given) holds `expected`."""
    assert layer.x_pack.tied(layer)
    row = 0
    for name in layer.x_pack.members:
        w = layer.get_submodule(name).weight
        assert torch.equal(layer.x_packed[row:row + w.shape[0]], w), name
        if expected is not None and name in expected:
            assert torch.equal(w, expected[name]), name
        row += w.shape[0]
    assert row == layer.x_packed.shape[0]
    assert set(expected or ()) <= set(layer.x_pack.members)


@pytest.mark.parametrize("i", list(ROLES), ids=IDS)
def test_each_projection_of_x_is_its_own_gemm_within_the_fp32_summation_bound(i):
    """project_x's slices against each projection computed alone in fp64 from a copy of its own
    weight (the state dict's, taken before the forward): within the worst-case bound of an fp32 sum
    of K products, K * 2^-24 * sum |x_k w_k|, plus half a bf16 ulp where the consumer computes in
    bf16. The ratio-2 compressor reads fp32 (spec 2.3), the ratio-1 one bf16 (the model dtype). A
    slice cut at a wrong offset, or a stale pack, is off by the size of the outputs themselves."""
    layer = _layer(i)
    weights = {k.removesuffix(".weight"): v.clone() for k, v in layer.state_dict().items() if k.endswith(".weight")}
    assert layer.x_pack.members == ROLES[i]
    x = torch.randn(9, CFG.hidden_size, generator=torch.Generator().manual_seed(i)).bfloat16()
    out = project_x(layer, x)
    assert set(out) == set(ROLES[i])
    ratio2 = CFG.role(i).ratio == 2
    for name, y in out.items():
        w = weights[name]
        assert w.dtype == torch.bfloat16, name  # every packed weight is held in the model dtype
        exact = x.double() @ w.double().t()
        bound = CFG.hidden_size * 2.0**-24 * (x.double().abs() @ w.double().abs().t())
        want = torch.float32 if name.startswith("compressor.") and ratio2 else torch.bfloat16
        assert y.dtype == want, name
        if want == torch.bfloat16:
            bound = bound + exact.abs() * 2.0**-8
        assert ((y.double() - exact).abs() <= bound).all(), name


def test_a_second_stack_load_reaches_the_packed_gemm_copied_or_assigned():
    first, second, third = _states(1, 2, 3)
    stack = DeepseekV41AttentionStack(CFG).to(torch.bfloat16)
    x = torch.randn(4, CFG.hidden_size).bfloat16()
    for state, assign in ((first, False), (second, False), (third, True)):
        stack.load_state_dict(state, assign=assign)
        for i, members in ROLES.items():
            layer, theirs = stack.layers[i], _weights(state, i)
            _assert_tied(layer, {n: theirs[n] for n in members})
            for name, y in project_x(layer, x).items():
                exact = x.double() @ theirs[name].double().t()
                assert (y.double() - exact).abs().max() <= exact.abs().max() * 2.0**-7, (i, name)
    # A DeepSeek-named load reaches it too.
    inverse = {v: k for k, v in DEEPSEEK_NAMES.items()}
    stack.load_deepseek_state_dict({f"layers.{k.split('.', 2)[1]}.{inverse[k.split('.', 2)[2]]}": v
                                    for k, v in first.items()})
    for i, members in ROLES.items():
        _assert_tied(stack.layers[i], {n: _weights(first, i)[n] for n in members})


@pytest.mark.parametrize("assign", [False, True], ids=["copy", "assign"])
def test_a_second_layer_load_reaches_the_packed_gemm(assign):
    layer, source = _layer(1, seed=0), _layer(1, seed=1)
    layer.load_state_dict({k: v.clone() for k, v in source.state_dict().items()}, assign=assign)
    _assert_tied(layer, {n: source.get_submodule(n).weight for n in ROLES[1]})


@pytest.mark.parametrize(("i", "name"), [(1, "compressor.wgate"), (5, "compressor.wkv"), (7, "indexer.weights_proj"),
                                         (2, "kv_proj")])
def test_assigning_a_weight_reaches_the_packed_gemm(i, name):
    layer = _layer(i)
    module = layer.get_submodule(name)
    new = torch.randn_like(module.weight)
    module.weight = nn.Parameter(new)
    _assert_tied(layer, {name: new})
    x = torch.randn(3, CFG.hidden_size).bfloat16()
    exact = x.double() @ new.double().t()
    y = project_x(layer, x)[name]
    assert (y.double() - exact).abs().max() <= exact.abs().max() * 2.0**-7
    with pytest.raises(ValueError, match=r"shape"):
        module.weight = nn.Parameter(torch.randn(3, CFG.hidden_size).bfloat16())
    _assert_tied(layer, {name: new})


def test_fp32_compressor_weights_load_when_bf16_holds_them_exactly():
    layer, source = _layer(1, seed=0), _layer(1, seed=1)
    layer.load_state_dict({k: v.float() if k.startswith("compressor.w") else v for k, v in source.state_dict().items()})
    assert layer.compressor.wkv.weight.dtype == torch.bfloat16
    _assert_tied(layer, {n: source.get_submodule(n).weight for n in ROLES[1]})


@pytest.mark.parametrize("key", ["layers.1.compressor.wgate.weight", "layers.5.compressor.wkv.weight"])
def test_fp32_compressor_weights_bf16_cannot_hold_are_refused_and_nothing_changes(key):
    """Through the stack's load and a layer's own: the error names the tensor, nothing is copied."""
    stack = DeepseekV41AttentionStack(CFG).to(torch.bfloat16)
    before = {k: v.clone() for k, v in stack.state_dict().items()}
    (state,) = _states(1)
    state[key] = state[key].float() * (1 + 2.0**-12)
    with pytest.raises(ValueError, match=key.replace(".", r"\.") + r": torch\.float32 values that torch\.bfloat16 "
                                         r"cannot hold exactly"):
        stack.load_state_dict(state)
    i = int(key.split(".")[1])
    with pytest.raises(ValueError, match=key.split(".", 2)[2].replace(".", r"\.") + r": torch\.float32 values"):
        stack.layers[i].load_state_dict({k.split(".", 2)[2]: v for k, v in state.items() if k.startswith(f"layers.{i}.")})
    for k, v in stack.state_dict().items():
        assert torch.equal(v, before[k]), k
    for i in ROLES:
        _assert_tied(stack.layers[i])


def test_moves_and_casts_keep_every_role_tied():
    layers = {i: _layer(i, dtype=torch.float32) for i in ROLES}
    for i, layer in layers.items():
        want = {n: layer.get_submodule(n).weight.detach().clone() for n in ROLES[i]}
        layer.to(torch.bfloat16)
        _assert_tied(layer, {n: w.bfloat16() for n, w in want.items()})
        assert layer.x_packed.dtype == torch.bfloat16


def test_a_meta_built_layer_ties_after_an_assign_load():
    source = DeepseekV41Attention(CFG, 1).to(torch.bfloat16)
    with torch.device("meta"):
        layer = DeepseekV41Attention(CFG, 1)
    assert layer.x_packed is None  # nothing to stack yet
    layer.load_state_dict(source.state_dict(), assign=True)
    _assert_tied(layer, {n: source.get_submodule(n).weight for n in ROLES[1]})
