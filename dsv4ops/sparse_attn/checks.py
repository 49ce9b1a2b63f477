"""Metadata rules of `dsv4::sparse_attn`."""

import torch
from torch import Tensor

from dsv4ops import _checks as c


def sparse_attn(q: Tensor, window_cache: Tensor, comp_cache: Tensor, positions: Tensor, req_slots: Tensor,
                comp_idx: Tensor, comp_lens: Tensor, window_ends: Tensor | None, sinks: Tensor, out: Tensor,
                scale: float, window: int, ring_size: int, window_fmt: str, comp_fmt: str, lse: Tensor | None = None):
    c.ndim("q", q, 3, "[tokens, heads, head_dim]")
    c.dtype("q", q, c.FLOATS)
    c.last_dim_contiguous("q", q)
    t, h, d = q.shape
    c.paged_cache("window_cache", window_cache, d, q, window_fmt, "window_fmt")
    c.paged_cache("comp_cache", comp_cache, d, q, comp_fmt, "comp_fmt")
    c.index_vector("positions", positions, t, q, "q")
    c.index_vector("req_slots", req_slots, t, q, "q")
    c.ndim("comp_idx", comp_idx, 2, "[tokens, entries]")
    c.dtype("comp_idx", comp_idx, c.INDEX)
    c.size("comp_idx", comp_idx, 0, t, "tokens of q")
    c.same_device("comp_idx", comp_idx, q, "q")
    c.index_vector("comp_lens", comp_lens, t, q, "q")
    if window_ends is not None:
        c.index_vector("window_ends", window_ends, t, q, "q")
    c.ndim("sinks", sinks, 1, "[heads]")
    c.dtype("sinks", sinks, (torch.float32,))
    c.size("sinks", sinks, 0, h, "heads of q")
    c.same_device("sinks", sinks, q, "q")
    c.like("out", out, q, "q")
    c.dtype("out", out, (q.dtype,))
    c.last_dim_contiguous("out", out)
    if lse is not None:
        c.ndim("lse", lse, 2, "[tokens, heads]")
        c.dtype("lse", lse, (torch.float32,))
        torch._check(tuple(lse.shape) == (t, h), lambda: f"lse: expected shape {(t, h)} (tokens, heads of q), got "
                                                          f"{tuple(lse.shape)}")
        c.same_device("lse", lse, q, "q")
        c.contiguous("lse", lse)
    c.finite_scalar("scale", scale, "the logits' multiplier")
    torch._check(window > 0, lambda: f"window: expected > 0, got {window}")
    torch._check(ring_size >= window, lambda: f"ring_size: expected >= window ({window}), got {ring_size}")
