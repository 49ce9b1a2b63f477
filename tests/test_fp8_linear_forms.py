"""fp8_linear's grouped (block-diagonal) form, V4's o_a_proj kept block-FP8: the reference and the
Triton kernel (interpreter) against a per-group float64 decode of the e4m3 / UE8M0 bits; every
output element written; bad inputs; BlockFP8Linear(groups=...) and a V4 layer whose o_a_proj is
kept FP8 against the same layer dequantized on load, eager and compiled. Its batch-invariant form:
a row's bits whatever the other rows (the CPU op; the GPU kernel: tests/test_fp8_linear_gpu.py)."""

import builders
import format_model as M
import pytest
import torch
import torch.nn.functional as F

from dsv4ops import CacheFormats, DeepseekV4Attention, DSV4AttentionConfig
from dsv4ops import testing as T
from dsv4ops.fp8_linear import reference as fp8_linear_ref
from dsv4ops.fp8_linear import triton as fp8_linear_tt
from dsv4ops.fp8_linear.api import BlockFP8Linear, fp8_linear
from dsv4ops.layer_weights import GroupedLinear
from dsv4ops.layers import COMPRESSOR_WEIGHTS, DEEPSEEK_NAMES

BF16, FP32 = torch.bfloat16, torch.float32
E8M0 = torch.float8_e8m0fnu
# (groups, rows a group, K, tile): tiny o_a's 64-row groups; 96 rows (the kernel's 64-wide column
# tile would straddle two groups, so it takes 32); V4.1's 32 x 32 tiles; K not a multiple of the tile.
SHAPES = [(2, 64, 300, 128), (3, 96, 100, 128), (4, 32, 70, 32)]


def group_decode64(x, weight, scale, block, groups):
    """Each output group's product in float64, its weight rows decoded code by code (no dequantize,
    no einsum: an independent formulation of the grouping and the tile scales)."""
    n, k = weight.shape
    codes = weight.view(torch.uint8).long()
    e4m3 = torch.tensor([M.e4m3_value(c) for c in range(256)], dtype=torch.float64)
    if scale.dtype in (E8M0, torch.uint8):
        tile = torch.tensor([M.ue8m0_value(c) for c in range(256)], dtype=torch.float64)[scale.view(torch.uint8).long()]
    else:
        tile = scale.double()
    rows = torch.arange(n)[:, None] // block
    cols = torch.arange(k)[None, :] // block
    w = e4m3[codes] * tile[rows, cols]
    per = n // groups
    return torch.cat([x[:, g * k:(g + 1) * k].double() @ w[g * per:(g + 1) * per].T for g in range(groups)], 1)


def run(fn, x, weight, scale, block, groups, dtype):
    """fn's output in a poisoned buffer with a stride gap; checks nothing past its columns is written."""
    n = weight.shape[0]
    wide = torch.full((x.shape[0], n + 5), float("nan"), dtype=dtype)
    fn(x.to(dtype), weight, scale, wide[:, :n], block, groups)
    assert wide[:, n:].isnan().all(), "wrote outside out"
    assert not wide[:, :n].isnan().any(), "every element written"
    return wide[:, :n]


@pytest.mark.parametrize("scale_dtype", [E8M0, FP32], ids=["ue8m0", "fp32"])
@pytest.mark.parametrize("dtype", [BF16, FP32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("groups,per,k,block", SHAPES)
def test_grouped_matches_a_per_group_decode(groups, per, k, block, dtype, scale_dtype):
    weight, scale = builders.block_fp8_weight(groups * per, k, block, scale_dtype, seed=groups + k)
    if scale_dtype == E8M0:
        scale = scale.view(torch.uint8)
    for m in (1, 17, 130):  # decode rows padded to 16, 32; a prefill of two 128-row blocks
        x = torch.randn(m, groups * k, generator=torch.Generator().manual_seed(m))
        ref64 = group_decode64(x.to(dtype), weight, scale, block, groups)
        # the low-precision run: the weight rounded to x's dtype, each group's GEMM in x's dtype
        w_lo = fp8_linear_ref.dequantize(weight, scale, block, dtype)
        lowp = torch.cat([F.linear(x.to(dtype)[:, g * k:(g + 1) * k], w_lo[g * per:(g + 1) * per])
                          for g in range(groups)], 1)
        for name, fn in (("reference", fp8_linear_ref.fp8_linear), ("triton", fp8_linear_tt.fp8_linear)):
            got = run(fn, x, weight, scale, block, groups, dtype)
            T.assert_close_to_ref(got, ref64, lowp, what=f"{name} M={m}")


def test_each_group_reads_its_own_columns_of_x():
    # Zero every group's columns of x but one: the other groups' outputs are exactly 0, the kept
    # group's are its own product (a kernel reading group 0's columns for every tile fails both).
    groups, per, k = 3, 64, 128
    weight, scale = builders.block_fp8_weight(groups * per, k, 128, FP32, seed=5)
    for g in range(groups):
        x = torch.zeros(4, groups * k)
        x[:, g * k:(g + 1) * k] = torch.randn(4, k)
        out = run(fp8_linear_tt.fp8_linear, x, weight, scale, 128, groups, FP32)
        mine = slice(g * per, (g + 1) * per)
        assert (out[:, :g * per] == 0).all() and (out[:, (g + 1) * per:] == 0).all()
        T.assert_close_to_ref(out[:, mine], group_decode64(x, weight, scale, 128, groups)[:, mine],
                              fp8_linear(x, weight, scale, 128, groups=groups)[:, mine], what=f"group {g}")


BAD = [
    ("groups 0", dict(groups=0), r"groups: expected a positive count"),
    ("rows not whole 32-column tiles", dict(n=3 * 48), r"out_features a multiple of groups x 32"),
    ("x columns not groups x K", dict(x_cols=2 * 300), r"x: expected 3 x 300 = 900 columns"),
]


@pytest.mark.parametrize("case", BAD, ids=[b[0] for b in BAD])
def test_bad_grouped_input_is_rejected_and_writes_nothing(case):
    _, change, message = case
    n = change.get("n", 3 * 64)
    weight, scale = builders.block_fp8_weight(n, 300, 128, FP32)
    x = torch.randn(2, change.get("x_cols", 3 * 300))
    out = torch.full((2, n), float("nan"))
    with pytest.raises(RuntimeError, match=message):
        torch.ops.dsv4.fp8_linear(x, weight, scale, out, 128, change.get("groups", 3))
    assert out.isnan().all()


def test_grouped_w8a8_is_refused():
    weight, scale = builders.block_fp8_weight(128, 128, 128, FP32)
    with pytest.raises(ValueError, match=r"'fp8' \(W8A8\) has no grouped or batch-invariant kernel"):
        fp8_linear(torch.randn(1, 256), weight, scale, 128, "fp8", groups=2)
    with pytest.raises(ValueError, match=r"groups: expected a count that cuts out_features 96"):
        BlockFP8Linear(128, 96, groups=2)


def test_grouped_module_equals_the_dequantized_grouped_linear():
    groups, per, k = 2, 64, 256
    fp8 = BlockFP8Linear(k, groups * per, 128, groups=groups)
    w, s = builders.block_fp8_weight(groups * per, k, 128, E8M0, seed=9)
    fp8.load_state_dict({"weight": w, "weight_scale_inv": s})
    plain = GroupedLinear(k, groups * per, groups)
    plain.weight.data = fp8_linear_ref.dequantize(w, s, 128, FP32)
    x = torch.randn(5, groups, k)
    ref = torch.einsum("tgk,gnk->tgn", x.double(), plain.weight.double().view(groups, per, k)).flatten(1)
    lowp = torch.einsum("tgk,gnk->tgn", x, plain.weight.view(groups, per, k)).flatten(1)
    T.assert_close_to_ref(fp8(x.flatten(1)), ref, lowp, what="eager")
    compiled = torch.compile(fp8, fullgraph=True, backend="aot_eager")
    T.assert_close_to_ref(compiled(x.flatten(1)), ref, lowp, what="compiled")
    assert "groups=2" in repr(fp8)


def test_layer_keeps_o_a_block_fp8_and_computes_the_dequantized_layer():
    cfg = DSV4AttentionConfig.tiny()
    src = T.randomize_(DeepseekV4Attention(cfg, 1), seed=1)
    inverse = {v: k for k, v in DEEPSEEK_NAMES.items()}
    # the compressors' kv / gate bf16, as in V4's checkpoints
    sd = {f"layers.1.{inverse[n]}": p.detach().to(BF16 if n in COMPRESSOR_WEIGHTS else p.dtype)
          for n, p in src.named_parameters()}
    w, s = builders.block_fp8_weight(*src.o_a_proj.weight.shape, 128, E8M0, seed=3)
    sd["layers.1.attn.wo_a.weight"], sd["layers.1.attn.wo_a.scale"] = w, s
    layers = {}
    for keep in (True, False):
        layers[keep] = DeepseekV4Attention(cfg, 1, formats=CacheFormats.exact()).to(BF16)
        layers[keep].load_deepseek_state_dict(sd, keep_fp8=keep)
    fp8, deq = layers[True], layers[False]
    assert isinstance(fp8.o_a_proj, BlockFP8Linear) and fp8.o_a_proj.weight.dtype == torch.float8_e4m3fn
    assert type(deq.o_a_proj) is GroupedLinear and deq.o_a_proj.weight.dtype == BF16
    ref = DeepseekV4Attention(cfg, 1, formats=CacheFormats.exact())
    ref.load_deepseek_state_dict(sd)
    x = torch.randn(2, 7, cfg.hidden_size)
    with torch.no_grad():
        T.assert_close_to_ref(fp8(x.to(BF16)), ref(x), deq(x.to(BF16)), what="o_a kept FP8")


@pytest.mark.parametrize("groups", [1, 2])
def test_batch_invariant_rows_do_not_depend_on_the_other_rows(groups):
    per, k = 64, 300
    weight, scale = builders.block_fp8_weight(groups * per, k, 128, E8M0, seed=groups)
    x = torch.randn(24, groups * k, generator=torch.Generator().manual_seed(1))
    full = fp8_linear(x, weight, scale, 128, groups=groups, batch_invariant=True)
    T.assert_close_to_ref(full, group_decode64(x, weight, scale, 128, groups),
                          fp8_linear(x, weight, scale, 128, groups=groups), what="batch-invariant")
    for lo, m in ((0, 1), (5, 3), (7, 17)):
        assert torch.equal(fp8_linear(x[lo:lo + m], weight, scale, 128, groups=groups, batch_invariant=True),
                           full[lo:lo + m]), (lo, m)
    with pytest.raises(ValueError, match=r"no grouped or batch-invariant kernel"):
        fp8_linear(x, weight, scale, 128, "fp8", groups=groups, batch_invariant=True)


def test_batch_invariant_launch_config_does_not_depend_on_the_row_count(monkeypatch):
    # The GPU's config (not the interpreter's): every M gets the 64-row config of the weight's shape.
    seen = []
    monkeypatch.setattr(fp8_linear_tt, "launch", lambda kernel, grid, args, consts, **kw: seen.append(
        (grid[0], grid[2], {c: consts[c] for c in ("BM", "BN", "BK", "SPLITS")})))
    monkeypatch.setattr(fp8_linear_tt, "reduce_splits", lambda part, out: None)
    real = fp8_linear_tt.config
    monkeypatch.setattr(fp8_linear_tt, "config", lambda m, n, k, block: real(m, n, k, block, interpret=False))
    weight, scale = builders.block_fp8_weight(512, 4096, 128, FP32)
    for m in (1, 7, 64, 130, 600):
        fp8_linear_tt.fp8_linear(torch.empty(m, 4096), weight, scale, torch.empty(m, 512), 128, 1, True)
    assert len({str(s) for s in seen}) == 1 and seen[0][2]["BM"] == 64, seen
