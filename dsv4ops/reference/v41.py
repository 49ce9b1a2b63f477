"""The stateless oracle of a DeepSeek-V4.1 attention STACK (dsv41-attention-spec.md section 2).

V4.1 layers share caches: a KV source's compressed entries and index keys are read by its whole
group, an index source's top-k by its reuse layers, the candidate source's pool by the later index
sources. So the oracle is model-level: `stack_attention` runs every backbone layer over sequences
from position 0, in layer order, with plain tensors (no cache, no paging, dense masks).

The attention sub-layer's input of every layer is given (xs [L, B, S, hidden]): in the model it is
attn_norm(hc_pre(residual)), which depends on everything outside attention; the layers interact here
only through the shared entries, keys, top-k and pool of the same forward (spec 2.9, pitfall 14).

Numerics (`CacheFormats`): the format each cache stores is its fake quantizer (spec 2.0, 4): window
rows (fp8_528: FQ8 over all 512 dims, after RoPE, before attention, the current chunk included),
compressed entries (fp4_288: FQ4 after RoPE at w * m), index keys (mxfp4_68: MX4 after RoPE, and the
index query MX4 alike). `exact` turns a point off. Every quantizer reads bf16(x) (the released model
runs bf16; quant/codecs.py); a pooled entry is cast to bf16 before its norm when its format is
quantized (spec 2.3), the model dtype otherwise. Run in fp64 for a test's error budget and in the
model dtype for its low-precision twin. Rounding points follow the engines where transformers-bf16
differs (spec 4.6): RMSNorm multiplies its weight in fp32; RoPE uses fp32 cos/sin; QK and PV run in
the activations' dtype with fp32 softmax.

`params` maps the stack's parameter names (`layers.{i}.q_a_proj.weight`, `layers.{i}.compressor.wkv.weight`,
`layers.{i}.indexer.wk.weight`, ...): `dict(stack.named_parameters())` of a DeepseekV41AttentionStack.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from dsv4ops.config_v41 import DSV41AttentionConfig, LayerRole
from dsv4ops.quant import codecs, formats
from dsv4ops.quant.formats import CacheFormats
from dsv4ops.reference.functional import (
    acc_dtype,
    apply_rope,
    candidate_blocks,
    grouped_output,
    pool_entry,
    rms_norm,
    rope_angles,
    sink_attention,
    stable_topk,
)

def compressor_dtype(ratio: int, dtype: torch.dtype) -> torch.dtype:
    """dtype of the compressor projections: fp32 for the ratio-2 pool (the reference keeps wkv /
    wgate in fp32, spec 1.4), the model dtype for ratio 1 (transformers; spec 4.6); fp64 runs stay fp64."""
    if dtype == torch.float64:
        return dtype
    return torch.float32 if ratio > 1 else dtype


def entry_dtype(fmt: str, dtype: torch.dtype) -> torch.dtype:
    """dtype a pooled entry is cast to before its norm (and in which norm, RoPE and the key path
    run): bf16 before a quantized format, the model dtype otherwise (compressor_update's rule)."""
    return dtype if fmt == formats.EXACT else torch.bfloat16


def quantize_query(q: Tensor, w: Tensor, fmt: str) -> tuple[Tensor, Tensor]:
    """(q', w') of an index query [.., H, d] and its weights [.., H] such that sum_h w'_h relu(q'_h . k)
    is the score: MX4 per head row (mxfp4_68), e4m3 with its power-of-two scale folded into w'
    (fp8_132), or as is (exact)."""
    if fmt == formats.EXACT:
        return q, w
    rows = q.reshape(-1, q.shape[-1])
    data, scales = codecs.encode(fmt, rows)
    if fmt == "fp8_132":
        return (data.view(torch.float8_e4m3fn).to(q.dtype).view(q.shape),
                w * scales.view(torch.float32).view(w.shape).to(w.dtype))
    return codecs.decode(fmt, data, scales).to(q.dtype).view(q.shape), w


@dataclass
class StackTrace:
    """What a stack forward published: per-layer outputs y [L, B, S, hidden]; per index source its
    top-k (entry indices [B, S, k], -1 none) and its score rows ([B, S, N], -inf where it may not
    pick); per candidate source its pool ([B, S, blocks] entry blocks, -1 none)."""

    y: Tensor
    topk: dict[int, Tensor] = field(default_factory=dict)
    scores: dict[int, Tensor] = field(default_factory=dict)
    pools: dict[int, Tensor] = field(default_factory=dict)


class _Layer:
    def __init__(self, params: Mapping[str, Tensor], cfg: DSV41AttentionConfig, role: LayerRole):
        self.p = {k[len(f"layers.{role.layer}."):]: v for k, v in params.items()
                  if k.startswith(f"layers.{role.layer}.")}
        self.cfg, self.role = cfg, role
        self.inv_freq = cfg.inv_freq(role.layer)


def _sequence(layers: list[_Layer], cfg: DSV41AttentionConfig, xs: Tensor, formats: CacheFormats,
              topk_in: dict, pools_in: dict, window_ends: Tensor | None = None):
    """One sequence (xs [L, S, hidden]) through every layer: (ys [L, S, hidden], topk, scores, pools)."""
    s = xs.shape[1]
    eps, md = cfg.rms_norm_eps, xs.dtype
    acc = acc_dtype(md)
    pos = torch.arange(s, device=xs.device)
    ends = pos if window_ends is None else window_ends.to(pos)
    entries, keys, topk, scores, pools, ys = {}, {}, {}, {}, {}, []
    for layer in layers:
        p, role = layer.p, layer.role
        x = xs[role.layer]
        cos, sin = rope_angles(pos, layer.inv_freq, md)
        # Spec 2.1-2.2: Q (no per-head norm) and the window row, quantized before attention.
        qr = rms_norm(F.linear(x, p["q_a_proj.weight"]), p["q_a_norm.weight"], eps)
        q = apply_rope(F.linear(qr, p["q_b_proj.weight"]).view(s, cfg.num_heads, cfg.head_dim), cos[:, None],
                       sin[:, None])
        kv = apply_rope(rms_norm(F.linear(x, p["kv_proj.weight"]), p["kv_norm.weight"], eps), cos, sin)
        kv = codecs.roundtrip(formats.window, kv)
        m = role.ratio
        if role.owns_compressor:  # spec 2.3-2.4
            cdt = compressor_dtype(m, md)
            a = F.linear(x.to(cdt), p["compressor.wkv.weight"].to(cdt))
            n = s // m
            if m > 1:
                g = F.linear(x.to(cdt), p["compressor.wgate.weight"].to(cdt))
                pooled = pool_entry(a[: n * m].view(n, m, -1), g[: n * m].view(n, m, -1))
            else:
                pooled = a
            edt = entry_dtype(formats.comp, md)
            latent = rms_norm(pooled.to(edt), p["compressor.norm.weight"], eps)
            ccos, csin = rope_angles(torch.arange(n, device=xs.device) * m, layer.inv_freq, edt)
            entries[role.layer] = codecs.roundtrip(formats.comp, apply_rope(latent, ccos, csin)).to(md)
            if role.owns_index_keys:
                k = rms_norm(F.linear(latent, p["indexer.wk.weight"].to(edt)), p["indexer.k_norm.weight"], eps)
                keys[role.layer] = codecs.roundtrip(formats.index, apply_rope(k, ccos, csin))
        if role.indexer:  # spec 2.5-2.8
            qi = F.linear(qr, p["indexer.wq_b.weight"]).view(s, cfg.index_n_heads, cfg.index_head_dim)
            qi = apply_rope(qi, cos[:, None], sin[:, None])
            wi = F.linear(x, p["indexer.weights_proj.weight"]).to(acc) * (cfg.index_head_dim**-0.5
                                                                            * cfg.index_n_heads**-0.5)
            qi, wi = quantize_query(qi, wi, formats.index)
            kk = keys[role.kv_source].to(acc)
            sc = (torch.einsum("shd,nd->shn", qi.to(acc), kk).relu() * wi[..., None]).sum(1)
            n_vis = (pos + 1) // m
            sc = sc.masked_fill(torch.arange(kk.shape[0], device=xs.device)[None] >= n_vis[:, None], float("-inf"))
            if role.candidate_source:
                pools[role.layer] = pools_in.get(role.layer, candidate_blocks(sc, n_vis, cfg.candidate_block_size,
                                                                              cfg.candidate_topk_blocks))
            if role.uses_candidates:
                sc = sc.masked_fill(~_pool_mask(pools[cfg.candidate_source_layer], kk.shape[0], cfg), float("-inf"))
            scores[role.layer] = sc
            if role.layer in topk_in:
                topk[role.layer] = topk_in[role.layer]
            else:
                best = stable_topk(sc, min(cfg.index_topk, sc.shape[1]))
                topk[role.layer] = best.where(sc.gather(1, best) > float("-inf"), -1)
        # Spec 2.10-2.11: window (own rows) + the group's entries picked by the index source.
        j = torch.arange(s, device=xs.device)
        valid = (j[None] <= ends[:, None]) & (j[None] > ends[:, None] - cfg.window)
        kset = kv
        if not role.sliding:
            ent = entries[role.kv_source]
            chosen = torch.zeros(s, ent.shape[0] + 1, dtype=torch.bool, device=xs.device)
            sel = topk[role.index_source]
            chosen.scatter_(1, torch.where(sel >= 0, sel, ent.shape[0]).long(), True)
            kset = torch.cat([kv, ent])
            valid = torch.cat([valid, chosen[:, :-1]], 1)
        o = sink_attention(q, kset, valid, p["sinks"], cfg.head_dim**-0.5)
        o = apply_rope(o, cos[:, None], sin[:, None], inverse=True)
        ys.append(grouped_output(o, p["o_a_proj.weight"], p["o_b_proj.weight"], cfg.o_groups))
    return torch.stack(ys), topk, scores, pools


def _pool_mask(pool: Tensor, n: int, cfg: DSV41AttentionConfig) -> Tensor:
    """[S, n] entries inside each row's candidate blocks."""
    cb = cfg.candidate_block_size
    block = torch.arange(n, device=pool.device) // cb
    return (block[None, :, None] == pool[:, None, :]).any(-1)


def stack_attention(params: Mapping[str, Tensor], cfg: DSV41AttentionConfig, xs: Tensor,
                    formats: CacheFormats = CacheFormats.v41(), topk: Mapping[int, Tensor] | None = None,
                    pools: Mapping[int, Tensor] | None = None, window_ends: Tensor | None = None) -> StackTrace:
    """Every backbone layer of the stack over xs [num_layers, B, S, hidden] (layer L's attention
    input at positions 0..S-1) -> StackTrace (y [num_layers, B, S, hidden], top-k, scores, pools).

    `topk` {index source: [B, S, k] entry indices} and `pools` {candidate source: [B, S, blocks]}
    replace what those layers would select, so a test can feed one implementation's selections to
    another: top-k of FP4 scores with ReLU has exact ties at the cut-off (spec pitfall 18).
    `window_ends` [B, S] (default: the positions): the last position of each token's window (see
    reference.attention)."""
    if xs.shape[0] != cfg.num_layers:
        raise ValueError(f"xs: expected one input per backbone layer ({cfg.num_layers}) at dim 0, got {xs.shape[0]}")
    layers = [_Layer(params, cfg, cfg.role(i)) for i in range(cfg.num_layers)]
    topk, pools = dict(topk or {}), dict(pools or {})
    out = [_sequence(layers, cfg, xs[:, b], formats, {k: v[b] for k, v in topk.items()},
                     {k: v[b] for k, v in pools.items()}, None if window_ends is None else window_ends[b])
           for b in range(xs.shape[1])]
    return StackTrace(
        y=torch.stack([o[0] for o in out], 1),
        topk={k: torch.stack([o[1][k] for o in out]) for k in out[0][1]},
        scores={k: torch.stack([o[2][k] for o in out]) for k in out[0][2]},
        pools={k: torch.stack([o[3][k] for o in out]) for k in out[0][3]},
    )
