"""Reference kernels of `dsv4::fp8_linear` and `dsv4::fp8_linear_w8a8`: out = x @ dequant(weight, scale)^T,
the projection a layer computes after dequantizing its block-FP8 checkpoint weight on load
(dsv4ops/checkpoint.py); the W8A8 op first quantizes x as DeepSeek's inference does (`act_quant`).

dequant: each e4m3 weight times its tile's scale in fp32, rounded once to x's dtype. A UE8M0 scale
is a power of two, so the product is exact in fp32 (and in bf16, whose exponent range is fp32's);
an fp32 scale rounds the product to fp32, then to x's dtype, as the dequantize-on-load path does.
The GEMM runs in x's dtype (fp32 accumulation on the tensor cores), its result rounded to x's dtype.

act_quant (W8A8): each 1 x 128 block of a row of x (in fp32) gets the scale 2^e, e = ceil(log2(
max(amax, 1e-4) / 448)), the power-of-two UE8M0 rule of DeepSeek's act_quant taken exactly (frexp,
dsv4ops.quant.reference.pow2_scale_exponent), and e4m3 codes x / 2^e rounded to nearest even
(|x / 2^e| <= 448 by the choice of e; the division by a power of two is exact). The W8A8 product is
then (codes x 2^e) @ (weight x its tile scale)^T in fp32, rounded to x's dtype: every factor is
exact in fp32, so the only roundings are the fp32 sum and the output's."""

import torch
import torch.nn.functional as F
from torch import Tensor

from dsv4ops.quant.reference import FP8_AMAX_FLOOR, FP8_MAX, pow2_scale_exponent

ACT_BLOCK = 128  # activation elements per scale (1 x 128 blocks, as the 128 x 128 weight tiles' K side)


def dequantize(weight: Tensor, scale: Tensor, block: int, dtype: torch.dtype) -> Tensor:
    """[N, K] e4m3 weight x its [ceil(N / block), ceil(K / block)] tile scales (a float or UE8M0
    dtype, or UE8M0 bytes: 2^(byte - 127), 0xFF NaN), in `dtype` (also dsv4ops.checkpoint's
    dequantize-on-load, after its checks)."""
    n, k = weight.shape
    s = (scale.view(torch.float8_e8m0fnu) if scale.dtype == torch.uint8 else scale).float()
    s = s.repeat_interleave(block, 0)[:n].repeat_interleave(block, 1)[:, :k]
    return (weight.float() * s).to(dtype)


def fp8_linear(x: Tensor, weight: Tensor, scale: Tensor, out: Tensor, block: int, groups: int = 1,
               batch_invariant: bool = False) -> None:
    w = dequantize(weight, scale, block, x.dtype)
    if batch_invariant:  # one product a row: the CPU's GEMM picks its kernel by M (invariant_linear/reference.py)
        for i in range(x.shape[0]):
            fp8_linear(x[i:i + 1].clone(), weight, scale, out[i:i + 1], block, groups)
    elif groups == 1:
        out.copy_(F.linear(x, w))
    else:  # block-diagonal: output group g reads x's g-th slice of K columns
        y = torch.einsum("mgk,gnk->mgn", x.unflatten(1, (groups, -1)), w.view(groups, -1, w.shape[1]))
        out.copy_(y.flatten(1))


def act_quant(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [M, K] (K a multiple of 128) -> (e4m3 codes [M, K], fp32 scales [M, K / 128], powers of
    two): x ~ codes x scale per 1 x 128 block (the rule in the module docstring)."""
    m, k = x.shape
    xb = x.float().view(m, k // ACT_BLOCK, ACT_BLOCK)
    e = pow2_scale_exponent(xb.abs().amax(-1), FP8_MAX, FP8_AMAX_FLOOR)
    scale = torch.exp2(e.float())
    codes = (xb / scale[..., None]).to(torch.float8_e4m3fn)
    return codes.view(m, k), scale


def fp8_linear_w8a8(x: Tensor, weight: Tensor, scale: Tensor, out: Tensor, block: int) -> None:
    # float64 x (the tests' high-precision run): the same codes, the product in float64.
    dt = torch.float64 if x.dtype == torch.float64 else torch.float32
    codes, xs = act_quant(x)
    xq = (codes.to(dt).view(x.shape[0], -1, ACT_BLOCK) * xs[..., None]).view(x.shape)
    out.copy_(F.linear(xq, dequantize(weight, scale, block, dt)))
