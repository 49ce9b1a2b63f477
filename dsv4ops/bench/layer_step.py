"""The whole V4 layer's decode step (projections + attention core) beside the same step built as an
engine without dsv4ops would: FlashMLA's sparse decode for the core and bf16 cuBLAS GEMMs for the
projections (issue 30), at batch 1 / 32 / 128 x 4K, per layer kind, V4-Flash (64 heads) and V4-Pro
(128; its sliding layer: the MTP layer's dims, bench/sweep.model_config).

- ours: `layer(x, step)` with the FP8_PROJECTIONS kept block-FP8 (BlockFP8Linear, activations
  "auto": the W8A16 or W8A8 kernel per shape, fp8_linear/rule.py) and the dsv4:: ops.
- ours_bf16_gemms: the same step with bf16 F.linear projections (our core alone against FlashMLA's).
- flashmla_bf16_gemms: bf16 F.linear projections, FlashMLA's decode for the core; every other op
  (norms, RoPE and cache insert, compressors, indexer, inverse RoPE, grouped o_a) is the layer's own,
  so the two steps differ in the projections and the core only. FlashMLA's window-ring indices
  are built once per step outside the timed graph, as engines build them in their step metadata.
The bf16 weights are the FP8 ones dequantized (the same values); `rel_diff` compares the outputs
(W8A8 quantizes activations: ~1e-2 expected). `composed_step` mirrors layers._attend with the
projections and the core swappable; test_bench checks it equals `layer(x, step)` with the layer's own.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dsv4ops.bench import flashmla
from dsv4ops.bench.attention import Case, new_layer
from dsv4ops.bench.sweep import KIND_NAMES, model_config
from dsv4ops.cache.step import live_tokens, visible_counts
from dsv4ops.config import CSA, HCA, SLIDING
from dsv4ops.fp8_linear import reference as fp8_reference
from dsv4ops.layers import FP8_PROJECTIONS, _compress
from dsv4ops.quant.reference import FP8_MAX, pow2_scale_exponent
from dsv4ops.reference.functional import grouped_o_a, rms_norm

BATCHES = (1, 32, 128)
QUICK_BATCHES = (1, 128)
CONTEXT = 4096
BLOCK = 128


def quantize_block_fp8(w: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight [N, K] as a block-FP8 checkpoint stores it: e4m3 codes and one UE8M0 scale per
    block x block tile (2^ceil(log2(amax / 448)))."""
    n, k = w.shape
    tiles = (-(-n // block), -(-k // block))
    padded = w.new_zeros(tiles[0] * block, tiles[1] * block, dtype=torch.float32)
    padded[:n, :k] = w
    amax = padded.view(tiles[0], block, tiles[1], block).abs().amax((1, 3))
    scale = torch.exp2(pow2_scale_exponent(amax, FP8_MAX, 2.0**-120).float())
    codes = (padded / scale.repeat_interleave(block, 0).repeat_interleave(block, 1))[:n, :k]
    return codes.to(torch.float8_e4m3fn), scale.to(torch.float8_e8m0fnu)


def to_block_fp8(layer) -> dict[str, torch.Tensor]:
    """Turn the layer's FP8_PROJECTIONS into BlockFP8Linear modules holding their weights' block-FP8
    quantization, as keep_fp8=True loads a checkpoint; returns name -> that weight dequantized to
    bf16 (the bf16 GEMMs' weights)."""
    bf16 = {}
    for name in FP8_PROJECTIONS:
        try:
            module = layer.get_submodule(name)
        except AttributeError:  # no indexer: a sliding or HCA layer
            continue
        codes, scale = quantize_block_fp8(module.weight.detach())
        layer._set_projection(name, BLOCK, torch.float8_e8m0fnu)
        layer.get_submodule(name).load_state_dict({"weight": codes, "weight_scale_inv": scale})
        bf16[name] = fp8_reference.dequantize(codes, scale, BLOCK, torch.bfloat16)
    return bf16


def composed_step(case: Case, proj, core):
    """A callable running layers._attend's ops for the case's step with `proj(name, x)` for the
    projections named in FP8_PROJECTIONS and `core(q_rot, pos, req, comp_cache, comp_fmt, comp_idx,
    comp_lens) -> o` for the attention core."""
    layer, cache, st, cfg, x = case.layer, case.layer.cache, case.step, case.model, case.x
    ops, fmt, eps = torch.ops.dsv4, cache.fmt, cfg.rms_norm_eps

    def step():
        pos, req = live_tokens(st, cache)
        t = x.shape[0]
        qr = rms_norm(proj("q_a_proj", x), layer.q_a_norm.weight, eps)
        q = proj("q_b_proj", qr).view(t, cfg.num_heads, cfg.head_dim)
        kv = rms_norm(proj("kv_proj", x), layer.kv_norm.weight, eps)
        q_rot = torch.empty_like(q)
        ops.qkv_prep(q, kv, pos, req, layer.inv_freq, q_rot, cache.window, cache.ring_size, eps, True, fmt["window"])
        comp_cache, comp_fmt = cache.window, fmt["window"]
        comp_idx = torch.empty(t, 0, dtype=torch.int32, device=x.device)
        comp_lens = torch.zeros_like(pos)
        if layer.compressor is not None:
            c, kind = layer.compressor, layer.layer_type
            _compress(c, x, pos, req, st.entry_slots(kind), layer.inv_freq, cache.state, cache.comp, fmt["comp"],
                      layer.numerics.kv, eps)
            comp_cache, comp_fmt = cache.comp, fmt["comp"]
            if kind == CSA:
                ix = c.indexer
                _compress(ix, x, pos, req, st.entry_slots(kind), layer.inv_freq, cache.index_state, cache.index,
                          fmt["index"], layer.numerics.indexer, eps)
                qi = proj("compressor.indexer.q_b_proj", qr).view(t, cfg.index_n_heads, cfg.index_head_dim)
                wi = F.linear(x, ix.scorer.weights_proj.weight)
                q_dtype = torch.float8_e4m3fn if fmt["index"] == "fp8_132" else qi.dtype
                qi_out = torch.empty(qi.shape, dtype=q_dtype, device=x.device)
                wi_out = torch.empty(wi.shape, dtype=torch.float32, device=x.device)
                ops.indexer_q_prep(qi, wi, pos, layer.inv_freq, qi_out, wi_out, fmt["index"])
                comp_idx = torch.empty(t, cfg.index_topk, dtype=torch.int32, device=x.device)
                ops.indexer_topk(qi_out, wi_out, pos, req, cache.index, st.block_table(CSA), None, comp_idx, None,
                                 cache.topk_workspace, cfg.csa_ratio, 0, fmt["index"])
            else:
                table, bs = st.block_table(kind), cache.cfg.block_size
                comp_idx = torch.empty(t, table.shape[1] * bs, dtype=torch.int32, device=x.device)
                ops.visible_entries(table, pos, req, comp_idx, cfg.compress_ratio(layer.layer_idx), bs)
            comp_lens = visible_counts(pos, req, cfg.compress_ratio(layer.layer_idx)).clamp(max=comp_idx.shape[1])
        o = core(q_rot, pos, req, comp_cache, comp_fmt, comp_idx, comp_lens)
        o_rot = torch.empty_like(o)
        ops.inv_rope(o, pos, layer.inv_freq, o_rot)
        return proj("o_b_proj", grouped_o_a(o_rot, layer.o_a_proj.weight, cfg.o_groups))

    return step


def module_proj(layer):
    """The layer's own projection modules (nn.Linear or BlockFP8Linear)."""
    return lambda name, x: layer.get_submodule(name)(x)


def bf16_proj(weights: dict[str, torch.Tensor]):
    return lambda name, x: F.linear(x, weights[name])


def ours_core(case: Case):
    layer, cache, st, cfg = case.layer, case.layer.cache, case.step, case.model

    def core(q_rot, pos, req, comp_cache, comp_fmt, comp_idx, comp_lens):
        o = torch.empty_like(q_rot)
        torch.ops.dsv4.sparse_attn(q_rot, cache.window, comp_cache, pos, req, comp_idx, comp_lens, st.window_ends,
                                   layer.sinks, o, cfg.head_dim**-0.5, cfg.window, cache.ring_size,
                                   cache.fmt["window"], comp_fmt)
        return o
    return core


def flashmla_core(case: Case):
    layer, cache, st, cfg = case.layer, case.layer.cache, case.step, case.model
    comp = cache.comp if layer.compressor is not None else cache.window
    run = flashmla.Decode(cache.window, comp, st.positions, st.req_slots, layer.sinks, cfg.head_dim**-0.5,
                          cfg.window, cache.ring_size)
    return lambda q_rot, pos, req, comp_cache, comp_fmt, comp_idx, comp_lens: run(q_rot, comp_idx, comp_lens)


@torch.no_grad()
def run(quick: bool = False, progress=print, device="cuda", timer=None) -> list[dict]:
    from dsv4ops.bench.timing import graph_time_us

    timer = timer or graph_time_us
    rows = []
    for model in ("flash", "pro"):
        for kind in (SLIDING, CSA, HCA):
            cfg = model_config(model, kind)
            layer = new_layer(kind, cfg, device)
            bf16 = to_block_fp8(layer)
            for batch in QUICK_BATCHES if quick else BATCHES:
                case = Case(kind, batch, CONTEXT, 1, device=device, model=cfg, layer=layer)
                ours = lambda: case.layer(case.x, case.step)  # noqa: E731
                steps = {"us": ours, "ours_bf16_gemms_us": composed_step(case, bf16_proj(bf16), ours_core(case))}
                if flashmla.available():
                    steps["flashmla_bf16_gemms_us"] = composed_step(case, bf16_proj(bf16), flashmla_core(case))
                row = dict(model=model, layer=KIND_NAMES[kind], batch=batch, context=CONTEXT, heads=cfg.num_heads)
                row.update({name: timer(fn) for name, fn in steps.items()})
                if "flashmla_bf16_gemms_us" in row:
                    row["vs_flashmla_bf16"] = row["us"] / row["flashmla_bf16_gemms_us"]
                    a, b = ours().float(), steps["flashmla_bf16_gemms_us"]().float()
                    row["rel_diff"] = ((a - b).abs().max() / b.abs().max()).item()
                progress(row)
                rows.append(row)
                case.release()
                del case, steps
            del layer
            if device == "cuda":
                torch.cuda.empty_cache()
    return rows


COLUMNS = ["model", "layer", "batch", "context", "heads", "us", "ours_bf16_gemms_us", "flashmla_bf16_gemms_us",
           "vs_flashmla_bf16", "rel_diff"]
