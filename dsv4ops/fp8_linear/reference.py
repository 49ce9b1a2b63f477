"""Reference kernel of `dsv4::fp8_linear`: out = x @ dequant(weight, scale)^T, the projection a layer
computes after dequantizing its block-FP8 checkpoint weight on load (dsv4ops/checkpoint.py).

dequant: each e4m3 weight times its tile's scale in fp32, rounded once to x's dtype. A UE8M0 scale
is a power of two, so the product is exact in fp32 (and in bf16, whose exponent range is fp32's);
an fp32 scale rounds the product to fp32, then to x's dtype, as the dequantize-on-load path does.
The GEMM runs in x's dtype (fp32 accumulation on the tensor cores), its result rounded to x's dtype."""

import torch
import torch.nn.functional as F
from torch import Tensor


def dequantize(weight: Tensor, scale: Tensor, block: int, dtype: torch.dtype) -> Tensor:
    """[N, K] e4m3 weight x its [ceil(N / block), ceil(K / block)] tile scales (a float or UE8M0
    dtype, or UE8M0 bytes: 2^(byte - 127), 0xFF NaN), in `dtype` (also dsv4ops.checkpoint's
    dequantize-on-load, after its checks)."""
    n, k = weight.shape
    s = (scale.view(torch.float8_e8m0fnu) if scale.dtype == torch.uint8 else scale).float()
    s = s.repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
    return (weight.float() * s).to(dtype)


def fp8_linear(x: Tensor, weight: Tensor, scale: Tensor, out: Tensor, block: int) -> None:
    out.copy_(F.linear(x, dequantize(weight, scale, block, x.dtype)))
