"""The GEMMs of a batch-invariant step (CacheConfig(batch_invariant=True)): a request's rows get the
same bits whoever shares its steps. torch.mm cannot promise that: on the CPU MKL gives a row other
bits at M = 1, 2, 3 or 7 than at M = 130, and cuBLAS picks tiles, split-K and algorithms by M.

- bf16 / fp32 weights: `dsv4::invariant_linear` (one launch config for every M).
- block-FP8 weights: `dsv4::fp8_linear` with batch_invariant (W8A16 in one launch config for every
  M, o_a_proj in its grouped form): "auto" never switches to W8A8 by token count, and the weight
  stays e4m3 (read once, as the default path reads it)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dsv4ops.fp8_linear.api import BlockFP8Linear, fp8_linear
from dsv4ops.invariant_linear.api import invariant_linear


def mm(x: Tensor, weight: Tensor, out_dtype: torch.dtype) -> Tensor:
    """x [..., K] @ weight [N, K]^T in out_dtype (x's or fp32), fp32 sums, row-invariant."""
    return invariant_linear(x, weight, out_dtype)


def linear(module: nn.Module, x: Tensor, invariant: bool) -> Tensor:
    """module(x) (an nn.Linear or a BlockFP8Linear, grouped or not), row-invariant where `invariant`."""
    if not invariant:
        return module(x)
    if isinstance(module, BlockFP8Linear):
        return fp8_linear(x, module.weight, module.weight_scale_inv, module.block, groups=module.groups,
                          batch_invariant=True)
    return mm(x, module.weight, x.dtype)


def grouped_o_a(o: Tensor, o_a: Tensor, groups: int) -> Tensor:
    """reference.functional.grouped_o_a, row-invariant: o [T, H, D] -> [T, groups x o_lora_rank], one
    invariant GEMM per group of heads."""
    g = o.reshape(o.shape[0], groups, -1)
    w = o_a.view(groups, -1, g.shape[-1]).to(g.dtype)
    return torch.cat([mm(g[:, i], w[i], g.dtype) for i in range(groups)], -1)
