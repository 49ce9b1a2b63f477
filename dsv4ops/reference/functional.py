"""The math pieces of one V4 attention layer (spec section 3), shared by the whole-layer oracle and
the reference kernels of the ops. Dimension-generic; activations keep their dtype where
transformers keeps it, norms and softmaxes run in fp32 (fp64 when the input is fp64)."""

import torch
import torch.nn.functional as F
from torch import Tensor


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def rms_norm(x: Tensor, weight: Tensor | None, eps: float, out_dtype: torch.dtype | None = None) -> Tensor:
    """RMSNorm over the last dim in fp32 (the weight multiplies in fp32, one cast at the end).
    `weight=None` is the weightless per-head norm of the query."""
    acc = acc_dtype(x.dtype)
    xf = x.to(acc)
    y = xf * torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = weight.to(acc) * y
    return y.to(out_dtype or x.dtype)


def head_rms_norm(q: Tensor, eps: float) -> Tensor:
    """Weightless per-head RMSNorm of q, as transformers: the fp32 rsqrt is cast to q's dtype
    before the multiply."""
    acc = acc_dtype(q.dtype)
    return q * torch.rsqrt(q.to(acc).square().mean(-1, keepdim=True) + eps).to(q.dtype)


def rope_angles(positions: Tensor, inv_freq: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """cos, sin [..., R/2] of positions x inv_freq; the product is fp32 (fp64 for fp64 runs)."""
    acc = acc_dtype(dtype)
    freqs = positions.to(acc)[..., None] * inv_freq.to(device=positions.device, dtype=acc)
    return freqs.cos(), freqs.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor, inverse: bool = False) -> Tensor:
    """Interleaved (GPT-J) rotation of the trailing 2*cos.shape[-1] channels of x: pair i is
    channels (nope + 2i, nope + 2i + 1). cos/sin broadcast against x[..., pairs]. `inverse`
    rotates by -angle. Math in fp32, result in x.dtype."""
    r = 2 * cos.shape[-1]
    nope, rope = x[..., :-r], x[..., -r:]
    pairs = rope.to(cos.dtype).unflatten(-1, (-1, 2))
    x0, x1 = pairs[..., 0], pairs[..., 1]
    s = -sin if inverse else sin
    rotated = torch.stack((x0 * cos - x1 * s, x0 * s + x1 * cos), dim=-1).flatten(-2)
    return torch.cat([nope, rotated.to(x.dtype)], dim=-1)


def pool_entry(kv: Tensor, score: Tensor) -> Tensor:
    """Per-channel softmax pooling over the slot dim (-2): sum_slot softmax(score) * kv, in fp32.
    Slots with score -inf weigh 0."""
    acc = acc_dtype(kv.dtype)
    return (torch.softmax(score.to(acc), dim=-2) * kv.to(acc)).sum(-2)


def stable_topk(values: Tensor, k: int) -> Tensor:
    """Indices of the k largest along the last dim, descending; exact ties pick the lower index."""
    return torch.sort(values, dim=-1, descending=True, stable=True).indices[..., :k]


def sink_attention(q: Tensor, keys: Tensor, valid: Tensor, sinks: Tensor, scale: float) -> Tensor:
    """o[t, h] = sum_j e^(l_j - M) k_j / (sum_j e^(l_j - M) + e^(s_h - M)), l_j = scale * q.k_j.

    q [T, H, D]; keys [T, J, D] per query or [J, D] shared (K = V); valid [T, J] bool; sinks [H]
    fp32. QK and PV run in the
    activations' dtype with P cast to it (as transformers and DeepSeek's kernel), the softmax in
    fp32. A row with no valid key returns 0."""
    acc = acc_dtype(q.dtype)
    kv = keys.to(q.dtype)
    shared = kv.dim() == 2
    logits = torch.einsum("thd,jd->thj" if shared else "thd,tjd->thj", q, kv).to(acc) * scale
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    sink = sinks.to(acc)[None, :, None].expand(logits.shape[0], -1, 1)
    probs = torch.softmax(torch.cat([logits, sink], dim=-1), dim=-1)[..., :-1]
    probs = torch.where(valid[:, None, :], probs, 0.0)
    return torch.einsum("thj,jd->thd" if shared else "thj,tjd->thd", probs.to(q.dtype), kv)


def grouped_output(o: Tensor, o_a: Tensor, o_b: Tensor, groups: int) -> Tensor:
    """Block-diagonal o_a over `groups` contiguous head groups, then o_b. o [..., H, D]."""
    z = grouped_o_a(o, o_a, groups)
    return torch.nn.functional.linear(z, o_b.to(z.dtype))


def grouped_o_a(o: Tensor, o_a: Tensor, groups: int) -> Tensor:
    """The block-diagonal o_a of grouped_output: o [..., H, D] -> [..., groups x o_lora_rank]."""
    lead = o.shape[:-2]
    g = o.reshape(*lead, groups, -1)
    w = o_a.view(groups, -1, g.shape[-1])
    return torch.einsum("...gi,goi->...go", g, w.to(g.dtype)).flatten(-2)


def candidate_blocks(scores: Tensor, n_visible: Tensor, cand_block: int, keep: int) -> Tensor:
    """V4.1's candidate-block pool (spec V4.1 2.6): [T, keep] blocks of score rows [T, N] over entries
    0..N-1 (-inf = invisible). Block b = entries [b * cand_block, (b + 1) * cand_block) scores the max
    of its entries; the block of the newest visible entry (n_visible - 1) scores +inf; the best
    `keep` blocks, ties to the lower block, in ascending block order; blocks scoring -inf dropped
    (-1 after the kept ones)."""
    t, n = scores.shape
    n_blocks = -(-n // cand_block)
    out = torch.full((t, keep), -1, dtype=torch.long, device=scores.device)
    if n_blocks == 0:
        return out
    padded = F.pad(scores, (0, n_blocks * cand_block - n), value=float("-inf"))
    block_score = padded.view(t, n_blocks, cand_block).amax(-1)
    newest = ((n_visible - 1) // cand_block).clamp(min=0)
    forced = torch.zeros_like(block_score, dtype=torch.bool).scatter_(1, newest[:, None], (n_visible >= 1)[:, None])
    block_score = block_score.masked_fill(forced, float("inf"))
    kk = min(keep, n_blocks)
    best = stable_topk(block_score, kk)
    # The kept blocks in ascending order, then the -1 fill (the order the kernels write).
    kept = best.where(block_score.gather(1, best) > float("-inf"), n_blocks).sort(dim=1).values
    out[:, :kk] = kept.where(kept < n_blocks, -1)
    return out
