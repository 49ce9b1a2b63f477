"""Metadata rules of `dsv4::compressor_update`."""

import torch
from torch import Tensor

from dsv4ops import _checks as c
from dsv4ops.quant import formats


def compressor_update(kv: Tensor, score: Tensor, ape: Tensor, positions: Tensor, req_slots: Tensor,
                      entry_slots: Tensor, norm_weight: Tensor, inv_freq: Tensor, state: Tensor, cache: Tensor,
                      latent_out: Tensor | None, eps: float, fmt: str, hadamard: bool = False):
    c.ndim("kv", kv, 2, "[tokens, coff * d]")
    c.dtype("kv", kv, c.FLOATS)
    c.last_dim_contiguous("kv", kv)
    t, width = kv.shape
    c.like("score", score, kv, "kv")
    c.dtype("score", score, c.FLOATS)
    c.last_dim_contiguous("score", score)
    c.ndim("norm_weight", norm_weight, 1, "[d]")
    c.dtype("norm_weight", norm_weight, c.FLOATS)
    d = norm_weight.shape[0]
    torch._check(
        width == d or width == 2 * d,
        lambda: f"kv: expected width d = {d} (no overlap) or 2d = {2 * d} (CSA overlap), got {width}",
    )
    c.ndim("ape", ape, 2, "[ratio, coff * d]")
    c.dtype("ape", ape, (torch.float32,))
    c.size("ape", ape, 1, width, "kv width")
    c.same_device("ape", ape, kv, "kv")
    c.same_device("norm_weight", norm_weight, kv, "kv")
    c.index_vector("positions", positions, t, kv, "kv")
    c.index_vector("req_slots", req_slots, t, kv, "kv")
    c.index_vector("entry_slots", entry_slots, t, kv, "kv")
    c.rope_table(inv_freq, d, kv)
    c.ndim("state", state, 3, "[requests, ring rows >= coff * ratio, 2 * coff * d]")
    c.dtype("state", state, (torch.float32,))
    c.contiguous("state", state)
    c.same_device("state", state, kv, "kv")
    span = (width // d) * ape.shape[0]
    torch._check(state.shape[1] >= span, lambda: f"state: expected at least {span} ring rows (coff * ratio, the "
                 f"positions one entry pools) at dim 1, got {state.shape[1]}")
    c.size("state", state, 2, 2 * width, "kv and score rows")
    c.paged_cache("cache", cache, d, kv, fmt, "fmt")
    c.hadamard(hadamard, fmt)
    c.finite_scalar("eps", eps, "the entry RMSNorm's epsilon", inclusive=True)
    if latent_out is not None:
        c.ndim("latent_out", latent_out, 2, "[tokens, d]")
        c.size("latent_out", latent_out, 0, t, "tokens of kv")
        c.size("latent_out", latent_out, 1, d, "d of norm_weight")
        c.dtype("latent_out", latent_out, (entry_dtype(cache, fmt),))
        c.same_device("latent_out", latent_out, kv, "kv")
        c.last_dim_contiguous("latent_out", latent_out)


def entry_dtype(cache: Tensor, fmt: str) -> torch.dtype:
    """dtype of a pooled entry from its cast before the norm on: the pool's dtype for exact pools,
    bf16 before a quantized format (DeepSeek's reference rounds the pooled vector to bf16)."""
    return cache.dtype if fmt == formats.EXACT else torch.bfloat16
