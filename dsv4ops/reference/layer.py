"""The stateless whole-layer oracle: one DeepSeek-V4 attention layer over sequences that start at
position 0, in plain PyTorch, straight from spec section 3 (no cache, no paging, dense masks).

`params` maps transformers' parameter names (`q_a_proj.weight`, `compressor.indexer.q_b_proj.weight`,
...) to tensors: `dict(layer.named_parameters())` of a transformers or dsv4ops layer works.
Run it in fp64 for the error budget of a test, and in the model dtype for its low-precision twin.
"""

from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import Tensor

from dsv4ops.config import CSA, SLIDING, DSV4AttentionConfig
from dsv4ops.reference.functional import (
    acc_dtype,
    apply_rope,
    grouped_output,
    head_rms_norm,
    pool_entry,
    rms_norm,
    rope_angles,
    sink_attention,
    stable_topk,
)
from dsv4ops.reference.numerics import (
    Numerics,
    compressor_dtype,
    entry_dtype,
    quantize_indexer_query,
    round_entry,
    round_indexer_key,
    round_kv,
    round_to,
)


def compress(
    x: Tensor, kv_weight: Tensor, gate_weight: Tensor, ape: Tensor, norm_weight: Tensor, ratio: int,
    inv_freq: Tensor, mode: str, eps: float,
) -> Tensor:
    """Compressed entries C_w, w < S // ratio, of one sequence x [S, hidden] (spec 3.3).

    The projections are 2d wide (CSA, overlap) or d wide (HCA). With overlap, entry w pools the
    a-stream ([:d]) of window w-1 and the b-stream ([d:]) of window w over 2*ratio slots; window
    -1 does not exist (score -inf). Softmax per channel, in fp32, after adding ape[p % ratio]."""
    d = norm_weight.shape[0]
    n = x.shape[0] // ratio
    cdt = compressor_dtype(mode, x.dtype)
    acc = acc_dtype(x.dtype)
    width = kv_weight.shape[0]
    a = F.linear(x.to(cdt), kv_weight.to(cdt))[: n * ratio].to(acc).view(n, ratio, width)
    z = F.linear(x.to(cdt), gate_weight.to(cdt))[: n * ratio].to(acc).view(n, ratio, width) + ape.to(acc)
    if a.shape[-1] == 2 * d:
        prev_a = torch.cat([a.new_zeros(1, ratio, d), a[:-1, :, :d]])
        prev_z = torch.cat([z.new_full((1, ratio, d), float("-inf")), z[:-1, :, :d]])
        a = torch.cat([prev_a, a[:, :, d:]], dim=1)
        z = torch.cat([prev_z, z[:, :, d:]], dim=1)
    # The pooled entry, its norm and its RoPE each round to the entry dtype (bf16 in the FP8 modes;
    # the norm and the rotation compute in fp32 from bf16 values).
    edt = entry_dtype(mode, x.dtype)
    hi = acc_dtype(edt)
    c = round_to(rms_norm(round_to(pool_entry(a, z), edt), norm_weight, eps, out_dtype=hi), edt)
    cos, sin = rope_angles(torch.arange(n, device=x.device) * ratio, inv_freq, edt)
    return round_to(apply_rope(c.to(hi), cos, sin), edt)


class _Layer:
    """Names and numbers of one layer, read once."""

    def __init__(self, params: Mapping[str, Tensor], cfg: DSV4AttentionConfig, layer_idx: int, numerics: Numerics):
        self.p, self.cfg, self.numerics = params, cfg, numerics
        self.kind = cfg.layer_type(layer_idx)
        self.ratio = cfg.compress_ratio(layer_idx)
        self.inv_freq = cfg.inv_freq(layer_idx)

    def main_entries(self, x: Tensor) -> Tensor:
        p, c = self.p, self.cfg
        e = compress(
            x, p["compressor.kv_proj.weight"], p["compressor.gate_proj.weight"], p["compressor.position_bias"],
            p["compressor.kv_norm.weight"], self.ratio, self.inv_freq, self.numerics.kv, c.rms_norm_eps,
        )
        # The entries are bf16 here (the mode's entry dtype, cast at a nudged round_to), so the twins
        # need not nudge round_entry: its quantizer reads the same bf16 values as the kernels'.
        return round_entry(e, self.numerics.kv, c.rope_head_dim).to(x.dtype)

    def indexer_scores(self, x: Tensor, qr: Tensor, positions: Tensor) -> Tensor:
        """[S, N] score of every compressed entry for every query; invisible entries -inf."""
        p, c, mode = self.p, self.cfg, self.numerics.indexer
        pre = "compressor.indexer."
        keys = compress(
            x, p[pre + "kv_proj.weight"], p[pre + "gate_proj.weight"], p[pre + "position_bias"],
            p[pre + "kv_norm.weight"], self.ratio, self.inv_freq, mode, c.rms_norm_eps,
        )
        keys = round_indexer_key(keys, mode)
        acc = acc_dtype(x.dtype)
        q = F.linear(qr, p[pre + "q_b_proj.weight"]).view(x.shape[0], c.index_n_heads, c.index_head_dim)
        cos, sin = rope_angles(positions, self.inv_freq, q.dtype)
        q = apply_rope(q, cos[:, None], sin[:, None])
        w = F.linear(x, p[pre + "scorer.weights_proj.weight"]).to(acc)
        w = w * (c.index_head_dim**-0.5 * c.index_n_heads**-0.5)
        q, w = quantize_indexer_query(q, w, mode)
        scores = (torch.einsum("shd,nd->shn", q.to(acc), keys.to(acc)).relu() * w[..., None]).sum(1)
        visible = torch.arange(keys.shape[0], device=x.device)[None] < ((positions + 1) // self.ratio)[:, None]
        return scores.masked_fill(~visible, float("-inf"))

    def topk(self, scores: Tensor, positions: Tensor) -> Tensor:
        """[S, min(index_topk, N)] entry indices, best first, ties to the lower index, -1 if invisible."""
        idx = stable_topk(scores, min(self.cfg.index_topk, scores.shape[-1]))
        return torch.where(idx < ((positions + 1) // self.ratio)[:, None], idx, -1)

    def forward(self, x: Tensor, topk: Tensor | None,
                window_ends: Tensor | None = None) -> tuple[Tensor, Tensor | None]:
        p, c = self.p, self.cfg
        s, eps = x.shape[0], c.rms_norm_eps
        positions = torch.arange(s, device=x.device)
        ends = positions if window_ends is None else window_ends.to(positions)
        cos, sin = rope_angles(positions, self.inv_freq, x.dtype)

        qr = rms_norm(F.linear(x, p["q_a_proj.weight"]), p["q_a_norm.weight"], eps)
        q = head_rms_norm(F.linear(qr, p["q_b_proj.weight"]).view(s, c.num_heads, c.head_dim), eps)
        q = apply_rope(q, cos[:, None], sin[:, None])
        kv = apply_rope(rms_norm(F.linear(x, p["kv_proj.weight"]), p["kv_norm.weight"], eps), cos, sin)
        kv = round_kv(kv, self.numerics.kv, c.rope_head_dim)

        j = torch.arange(s, device=x.device)
        valid = (j[None] <= ends[:, None]) & (j[None] > ends[:, None] - c.window)
        keys = kv
        if self.kind != SLIDING:
            entries = self.main_entries(x)
            n = entries.shape[0]
            if self.kind == CSA:
                if topk is None:
                    topk = self.topk(self.indexer_scores(x, qr, positions), positions)
                chosen = torch.zeros(s, n + 1, dtype=torch.bool, device=x.device)
                chosen.scatter_(1, torch.where(topk >= 0, topk, n).long(), True)
                comp_valid = chosen[:, :n]
            else:
                comp_valid = torch.arange(n, device=x.device)[None] < ((positions + 1) // self.ratio)[:, None]
            keys = torch.cat([kv, entries])
            valid = torch.cat([valid, comp_valid], 1)

        o = sink_attention(q, keys, valid, p["sinks"], c.head_dim**-0.5)
        o = apply_rope(o, cos[:, None], sin[:, None], inverse=True)
        return grouped_output(o, p["o_a_proj.weight"], p["o_b_proj.weight"], c.o_groups), topk


def attention(
    params: Mapping[str, Tensor], cfg: DSV4AttentionConfig, layer_idx: int, x: Tensor,
    numerics: Numerics = Numerics(), topk: Tensor | None = None, window_ends: Tensor | None = None,
) -> Tensor:
    """y [B, S, hidden] of the layer for x [B, S, hidden] at positions 0..S-1.

    `topk` [B, S, k] (entry indices, -1 = none) replaces the indexer's selection in CSA layers, so
    a test can feed the same selection to two implementations. `window_ends` [B, S] (default: the
    positions) is the last position of each token's window: its window is the `window` positions
    ending there (a draft block's tokens, ending at the block's last, see each other both ways)."""
    layer = _Layer(params, cfg, layer_idx, numerics)
    return torch.stack([layer.forward(x[b], None if topk is None else topk[b],
                                      None if window_ends is None else window_ends[b])[0] for b in range(x.shape[0])])


def _indexer(params: Mapping[str, Tensor], cfg: DSV4AttentionConfig, layer_idx: int, x: Tensor,
             numerics: Numerics, select: bool) -> Tensor:
    layer = _Layer(params, cfg, layer_idx, numerics)
    if layer.kind != CSA:
        raise ValueError(f"layer_idx: layer {layer_idx} is {layer.kind}, the indexer exists only in CSA layers")
    out = []
    positions = torch.arange(x.shape[1], device=x.device)
    for b in range(x.shape[0]):
        qr = rms_norm(F.linear(x[b], params["q_a_proj.weight"]), params["q_a_norm.weight"], cfg.rms_norm_eps)
        scores = layer.indexer_scores(x[b], qr, positions)
        out.append(layer.topk(scores, positions) if select else scores)
    return torch.stack(out)


def indexer_topk(
    params: Mapping[str, Tensor], cfg: DSV4AttentionConfig, layer_idx: int, x: Tensor,
    numerics: Numerics = Numerics(),
) -> Tensor:
    """[B, S, min(index_topk, S // ratio)] the Lightning Indexer's selection of a CSA layer."""
    return _indexer(params, cfg, layer_idx, x, numerics, select=True)


def indexer_scores(
    params: Mapping[str, Tensor], cfg: DSV4AttentionConfig, layer_idx: int, x: Tensor,
    numerics: Numerics = Numerics(),
) -> Tensor:
    """[B, S, S // ratio] the Lightning Indexer's score of every compressed entry for every query of
    a CSA layer (-inf where the entry is not visible yet): what a selection is checked against."""
    return _indexer(params, cfg, layer_idx, x, numerics, select=False)
