"""Metadata rules of `dsv4::fp8_linear` and `dsv4::fp8_linear_w8a8`."""

import torch
from torch import Tensor

from dsv4ops import _checks as c

# Tile sizes of the checkpoints: DeepSeek-V4 128 x 128, V4.1 32 x 32 (dsv4ops/checkpoint.py).
BLOCKS = (32, 128)
# UE8M0 scales reach the op as their exponent bytes (uint8): Inductor (torch 2.11 - 2.13) cannot
# compile a custom op taking a float8_e8m0fnu tensor ("auto_functionalized_v2 was not removed"),
# while a dtype view of one is fine. fp32 scales (V3-style checkpoints) as they are.
SCALE_DTYPES = (torch.uint8, torch.float32)
# W8A8: 1 x 128 activation blocks under 128 x 128 weight tiles (DeepSeek's act_quant, and the only
# blockwise layout of cuBLASLt's FP8 GEMM), weight scales in fp32 (BlockFP8Linear converts its
# UE8M0 bytes once).
W8A8_BLOCK = 128
# Grouped fp8_linear: an output group is a whole number of the kernel's narrowest column tile, so a
# tile never straddles two groups (V4's o_a: 1024 rows a group; tiles in the weight's own scale grid).
GROUP_ROWS = 32


def fp8_linear(x: Tensor, weight: Tensor, scale: Tensor, out: Tensor, block: int, groups: int = 1):
    torch._check(block in BLOCKS, lambda: f"block: expected a tile size in {list(BLOCKS)}, got {block}")
    torch._check(groups >= 1, lambda: f"groups: expected a positive count of output groups, got {groups}")
    if groups > 1:
        c.ndim("weight", weight, 2, "[out_features, in_features per group]")
        n = weight.shape[0]
        torch._check(n % (groups * GROUP_ROWS) == 0, lambda: f"weight: expected out_features a multiple of groups x "
                     f"{GROUP_ROWS} ({groups} x {GROUP_ROWS}: each output group whole {GROUP_ROWS}-column tiles of the "
                     f"kernel), got {n}")
    _operands(x, weight, scale, out, block, SCALE_DTYPES, "UE8M0 bytes (torch.uint8, a float8_e8m0fnu tensor's view) "
              "or torch.float32", groups)


def fp8_linear_w8a8(x: Tensor, weight: Tensor, scale: Tensor, out: Tensor, block: int):
    torch._check(block == W8A8_BLOCK, lambda: f"block: expected {W8A8_BLOCK} (W8A8 quantizes x in 1 x 128 blocks "
                 f"under 128 x 128 weight tiles), got {block}")
    _operands(x, weight, scale, out, block, (torch.float32,), "torch.float32 (BlockFP8Linear keeps an fp32 copy of "
              "UE8M0 scales)")
    torch._check(x.shape[1] % W8A8_BLOCK == 0, lambda: f"x: expected in_features a multiple of {W8A8_BLOCK} (whole "
                 f"1 x {W8A8_BLOCK} activation blocks), got {x.shape[1]}")


def _operands(x: Tensor, weight: Tensor, scale: Tensor, out: Tensor, block: int, scale_dtypes: tuple,
              scale_what: str, groups: int = 1):
    c.ndim("x", x, 2, "[tokens, in_features]")
    c.dtype("x", x, c.FLOATS)
    c.last_dim_contiguous("x", x)
    c.ndim("weight", weight, 2, "[out_features, in_features]")
    c.dtype("weight", weight, (torch.float8_e4m3fn,))
    c.contiguous("weight", weight)
    if groups == 1:
        c.size("weight", weight, 1, x.shape[1], "in_features of x")
    else:
        torch._check(x.shape[1] == groups * weight.shape[1], lambda: f"x: expected {groups} x {weight.shape[1]} = "
                     f"{groups * weight.shape[1]} columns (groups x the weight's in_features), got {x.shape[1]}")
    c.same_device("weight", weight, x, "x")
    n, k = weight.shape
    tiles = ((n + block - 1) // block, (k + block - 1) // block)
    c.ndim("scale", scale, 2, "[ceil(out_features / block), ceil(in_features / block)]")
    torch._check(scale.dtype in scale_dtypes, lambda: f"scale: expected {scale_what}, got {scale.dtype}")
    c.contiguous("scale", scale)
    torch._check(
        scale.shape[0] == tiles[0] and scale.shape[1] == tiles[1],
        lambda: f"scale: expected shape {tiles} (a [{n}, {k}] weight in {block} x {block} tiles), got "
        f"{tuple(scale.shape)}",
    )
    c.same_device("scale", scale, x, "x")
    torch._check(
        out.dim() == 2 and out.shape[0] == x.shape[0] and out.shape[1] == n,
        lambda: f"out: expected shape ({x.shape[0]}, {n}) (tokens of x, out_features of weight), got "
        f"{tuple(out.shape)}",
    )
    c.dtype("out", out, (x.dtype,))
    c.last_dim_contiguous("out", out)
    c.same_device("out", out, x, "x")
