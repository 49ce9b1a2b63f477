"""Metadata rules of `dsv4::invariant_linear`."""

import torch
from torch import Tensor

from dsv4ops import _checks as c


def invariant_linear(x: Tensor, weight: Tensor, out: Tensor):
    c.ndim("x", x, 2, "[tokens, in_features]")
    c.dtype("x", x, c.FLOATS)
    c.last_dim_contiguous("x", x)
    c.ndim("weight", weight, 2, "[out_features, in_features]")
    c.dtype("weight", weight, (x.dtype,))
    c.last_dim_contiguous("weight", weight)
    c.size("weight", weight, 1, x.shape[1], "in_features of x")
    c.same_device("weight", weight, x, "x")
    torch._check(
        out.dim() == 2 and out.shape[0] == x.shape[0] and out.shape[1] == weight.shape[0],
        lambda: f"out: expected shape ({x.shape[0]}, {weight.shape[0]}) (tokens of x, out_features of weight), got "
        f"{tuple(out.shape)}",
    )
    c.dtype("out", out, tuple(dict.fromkeys((x.dtype, torch.float32))))
    c.last_dim_contiguous("out", out)
    c.same_device("out", out, x, "x")
