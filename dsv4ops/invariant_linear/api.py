"""Public invariant_linear: x [..., K] @ weight [N, K]^T whose rows' bits do not depend on how many
rows x has (dsv4::invariant_linear)."""

import torch
from torch import Tensor


def invariant_linear(x: Tensor, weight: Tensor, out_dtype: torch.dtype | None = None) -> Tensor:
    """x [..., K] @ weight [N, K]^T in out_dtype (x's by default, or fp32), fp32 sums."""
    x2 = x.reshape(-1, x.shape[-1])
    out = torch.empty(x2.shape[0], weight.shape[0], dtype=out_dtype or x.dtype, device=x.device)
    torch.ops.dsv4.invariant_linear(x2, weight, out)
    return out.view(*x.shape[:-1], weight.shape[0])
