"""Public fp8_linear: a projection with a block-FP8 weight (W8A16), and `BlockFP8Linear`, the module
that holds a checkpoint's e4m3 bytes and tile scales.

Reference (the specification): dsv4ops/fp8_linear/reference.py.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dsv4ops import ops as _ops  # noqa: F401  (defines the dsv4:: ops bound below)
from dsv4ops.fp8_linear.checks import BLOCKS

SCALE_DTYPES = (torch.float8_e8m0fnu, torch.float32)  # BlockFP8Linear's: UE8M0 or V3-style fp32

_fp8_linear = torch.ops.dsv4.fp8_linear.default


def fp8_linear(x: Tensor, weight: Tensor, scale: Tensor, block: int) -> Tensor:
    """x [..., K] (bf16 / fp16 / fp32, contiguous last dim), weight [N, K] float8_e4m3fn, scale
    [ceil(N / block), ceil(K / block)] float8_e8m0fnu (UE8M0; or its uint8 bytes) or fp32, block
    128 (V4) or 32 (V4.1)
    -> [..., N] in x's dtype: x @ (weight x tile scale)^T, the weight dequantized in registers
    (never stored: e4m3 x scale in fp32, rounded to x's dtype), fp32 accumulation. Equals F.linear
    on the weight that dsv4ops.checkpoint dequantizes on load, up to the GEMM's summation order."""
    lead = x.shape[:-1]
    rows = x.reshape(-1, x.shape[-1])
    out = torch.empty(rows.shape[0], weight.shape[0], dtype=x.dtype, device=x.device)
    if scale.dtype == torch.float8_e8m0fnu:
        scale = scale.view(torch.uint8)
    _fp8_linear(rows, weight, scale, out, block)
    return out.view(*lead, weight.shape[0])


class BlockFP8Linear(nn.Module):
    """A bias-free linear layer whose weight stays block-FP8: buffers `weight` [out, in] e4m3 and
    `weight_scale_inv` [ceil(out / block), ceil(in / block)] (UE8M0 or fp32; the name of
    transformers' FP8 modules; the scale multiplies). forward(x [..., in]) = fp8_linear(x, ...) in
    x's dtype. Half the weight bytes of a bf16 nn.Linear, which is what a decode step reads.

    `.to(dtype)` / `.half()` leave both buffers as they are (the checkpoint's bytes; x's dtype
    picks the compute dtype), `.to(device)` moves them. load_state_dict takes e4m3 weights and
    scales of the buffers' dtypes only: a bf16 weight would otherwise be cast to e4m3 silently."""

    def __init__(self, in_features: int, out_features: int, block: int = 128,
                 scale_dtype: torch.dtype = torch.float8_e8m0fnu, device=None):
        super().__init__()
        if block not in BLOCKS:
            raise ValueError(f"block: expected a tile size in {list(BLOCKS)}, got {block!r}")
        if scale_dtype not in SCALE_DTYPES:
            raise ValueError(f"scale_dtype: expected one of {list(SCALE_DTYPES)}, got {scale_dtype}")
        self.in_features, self.out_features, self.block = in_features, out_features, block
        tiles = (-(-out_features // block), -(-in_features // block))
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.float8_e4m3fn,
                                                   device=device))
        self.register_buffer("weight_scale_inv", torch.ones(tiles, dtype=scale_dtype, device=device))

    def forward(self, x: Tensor) -> Tensor:
        return fp8_linear(x, self.weight, self.weight_scale_inv, self.block)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, block={self.block}, "
                f"scale={self.weight_scale_inv.dtype}")

    def _apply(self, fn, recurse=True):
        # float8 dtypes count as floating point, so Module.to(dtype) would cast the bytes; as uint8
        # views they only move (device) or stay.
        for name, t in self._buffers.items():
            self._buffers[name] = fn(t.view(torch.uint8)).view(t.dtype)
        return self

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        for name, t in self._buffers.items():
            given = state_dict.get(prefix + name)
            if given is not None and given.dtype != t.dtype:
                error_msgs.append(f"{prefix}{name}: expected dtype {t.dtype} (a block-FP8 projection keeps the "
                                  f"checkpoint's bytes), got {given.dtype}")
                return
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
