"""The GEMMs of a batch-invariant step (CacheConfig(batch_invariant=True)): every projection through
`dsv4::invariant_linear`, whose schedule does not depend on the step's token count, so a request's
rows get the same bits whoever shares its steps. torch.mm cannot promise that: on the CPU MKL gives
a row other bits at M = 1, 2, 3 or 7 than at M = 130, and cuBLAS picks tiles, split-K and
algorithms by M.

A block-FP8 projection is dequantized here as dsv4::fp8_linear's W8A16 does in registers (e4m3 x
tile scale in fp32, rounded once to x's dtype) and runs the same GEMM: "auto" never switches it to
W8A8 by token count. Its cost: the dequantized weight is written and read once per call."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dsv4ops.fp8_linear.api import BlockFP8Linear
from dsv4ops.fp8_linear.reference import dequantize
from dsv4ops.invariant_linear.api import invariant_linear


def mm(x: Tensor, weight: Tensor, out_dtype: torch.dtype) -> Tensor:
    """x [..., K] @ weight [N, K]^T in out_dtype (x's or fp32), fp32 sums, row-invariant."""
    return invariant_linear(x, weight, out_dtype)


def weight_of(module: nn.Module, dtype: torch.dtype) -> Tensor:
    """The [N, K] weight of an nn.Linear or GroupedLinear, or of a BlockFP8Linear dequantized to `dtype`."""
    if isinstance(module, BlockFP8Linear):
        return dequantize(module.weight, module.weight_scale_inv, module.block, dtype)
    return module.weight


def linear(module: nn.Module, x: Tensor, invariant: bool) -> Tensor:
    """module(x), row-invariant where `invariant`."""
    return mm(x, weight_of(module, x.dtype), x.dtype) if invariant else module(x)


def grouped_o_a(o: Tensor, o_a: Tensor, groups: int) -> Tensor:
    """reference.functional.grouped_o_a, row-invariant: o [T, H, D] -> [T, groups x o_lora_rank], one
    invariant GEMM per group of heads."""
    g = o.reshape(o.shape[0], groups, -1)
    w = o_a.view(groups, -1, g.shape[-1]).to(g.dtype)
    return torch.cat([mm(g[:, i], w[i], g.dtype) for i in range(groups)], -1)
