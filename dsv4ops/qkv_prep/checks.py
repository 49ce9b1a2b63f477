"""Metadata rules of `dsv4::qkv_prep`."""

import torch
from torch import Tensor

from dsv4ops import _checks as c


def qkv_prep(q: Tensor, kv: Tensor, positions: Tensor, req_slots: Tensor, inv_freq: Tensor, q_out: Tensor,
             window_cache: Tensor, ring_size: int, eps: float, window_fmt: str):
    c.ndim("q", q, 3, "[tokens, heads, head_dim]")
    c.dtype("q", q, c.FLOATS)
    c.last_dim_contiguous("q", q)
    t, d = q.shape[0], q.shape[2]
    c.ndim("kv", kv, 2, "[tokens, head_dim]")
    c.dtype("kv", kv, c.FLOATS)
    c.like("kv", kv, q.select(1, 0), "q[:, 0]")
    c.last_dim_contiguous("kv", kv)
    c.index_vector("positions", positions, t, q, "q")
    c.index_vector("req_slots", req_slots, t, q, "q")
    c.rope_table(inv_freq, d, q)
    c.like("q_out", q_out, q, "q")
    c.dtype("q_out", q_out, (q.dtype,))
    c.last_dim_contiguous("q_out", q_out)
    bs = c.paged_cache("window_cache", window_cache, d, q, window_fmt, "window_fmt")
    torch._check(ring_size > 0, lambda: f"ring_size: expected > 0, got {ring_size}")
    c.finite_scalar("eps", eps, "the RMSNorm's epsilon", inclusive=True)
    torch._check(
        ring_size <= window_cache.shape[0] * bs,
        lambda: f"ring_size: expected <= the pool's {window_cache.shape[0] * bs} slots, got {ring_size}",
    )
