"""Metadata rules of `dsv4::attn_merge`."""

import torch
from torch import Tensor

from dsv4ops import _checks as c


def attn_merge(partials: Tensor, lse: Tensor, sinks: Tensor, out: Tensor):
    c.ndim("partials", partials, 4, "[shards, tokens, heads, head_dim]")
    c.dtype("partials", partials, c.FLOATS)
    c.last_dim_contiguous("partials", partials)
    r, t, h, d = partials.shape
    c.ndim("lse", lse, 3, "[shards, tokens, heads]")
    c.dtype("lse", lse, (torch.float32,))
    torch._check(tuple(lse.shape) == (r, t, h),
                 lambda: f"lse: expected shape {(r, t, h)} (shards, tokens, heads of partials), got {tuple(lse.shape)}")
    c.same_device("lse", lse, partials, "partials")
    c.contiguous("lse", lse)
    c.ndim("sinks", sinks, 1, "[heads]")
    c.dtype("sinks", sinks, (torch.float32,))
    c.size("sinks", sinks, 0, h, "heads of partials")
    c.same_device("sinks", sinks, partials, "partials")
    c.ndim("out", out, 3, "[tokens, heads, head_dim]")
    torch._check(tuple(out.shape) == (t, h, d),
                 lambda: f"out: expected shape {(t, h, d)} (tokens, heads, head_dim of partials), got {tuple(out.shape)}")
    c.dtype("out", out, (partials.dtype,))
    c.same_device("out", out, partials, "partials")
    c.last_dim_contiguous("out", out)
