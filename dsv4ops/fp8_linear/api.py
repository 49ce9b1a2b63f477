"""Public fp8_linear: a projection with a block-FP8 weight, W8A16 or W8A8 (`activations`), and
`BlockFP8Linear`, the module that holds a checkpoint's e4m3 bytes and tile scales.

Reference (the specification): dsv4ops/fp8_linear/reference.py; the "auto" rule: rule.py.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from dsv4ops import ops as _ops  # noqa: F401  (defines the dsv4:: ops bound below)
from dsv4ops.fp8_linear import rule
from dsv4ops.fp8_linear.checks import BLOCKS, GROUP_ROWS

SCALE_DTYPES = (torch.float8_e8m0fnu, torch.float32)  # BlockFP8Linear's: UE8M0 or V3-style fp32

_fp8_linear = torch.ops.dsv4.fp8_linear.default
_fp8_linear_w8a8 = torch.ops.dsv4.fp8_linear_w8a8.default


def fp8_linear(x: Tensor, weight: Tensor, scale: Tensor, block: int, activations: str = "exact",
               groups: int = 1, batch_invariant: bool = False) -> Tensor:
    """x [..., K] (bf16 / fp16 / fp32, contiguous last dim), weight [N, K] float8_e4m3fn, scale
    [ceil(N / block), ceil(K / block)] float8_e8m0fnu (UE8M0; or its uint8 bytes) or fp32, block
    128 (V4) or 32 (V4.1)
    -> [..., N] in x's dtype: x @ (weight x tile scale)^T, fp32 accumulation. activations:
    - "exact" (W8A16, dsv4::fp8_linear): x as it is, the weight dequantized in registers (never
      stored: e4m3 x scale in fp32, rounded to x's dtype). Equals F.linear on the weight that
      dsv4ops.checkpoint dequantizes on load, up to the GEMM's summation order.
    - "fp8" (W8A8, dsv4::fp8_linear_w8a8, as DeepSeek's inference runs its FP8 linears): x first
      quantized to e4m3 with one power-of-two scale per 1 x 128 block (x's error: up to 2^-4
      relative per element), then a blockwise-scaled FP8 GEMM. block 128, K a multiple of 128; a
      UE8M0 scale is converted to fp32 per call (BlockFP8Linear keeps the fp32 copy).
    - "auto": per shape, whichever of the two rule.pick chooses (the faster on the H100 by a margin;
      "exact" on the CPU, on GPUs other than sm_90 and for other tile sizes).
    groups > 1 (W8A16 only; "auto" runs "exact"): the block-diagonal projection of V4's o_a, x [...,
    groups x K] and weight [N, K] of `groups` stacked [N / groups, K] blocks (N / groups a multiple of
    32; the tile scales are the [N, K] weight's): output group g = x's g-th K columns @ block g^T.
    batch_invariant (W8A16 only; "auto" runs "exact"): a row's bits do not depend on the other rows
    or their count (one launch config for every M: dsv4ops.invariant)."""
    if activations not in rule.ACTIVATIONS:
        raise ValueError(f"activations: expected one of {list(rule.ACTIVATIONS)}, got {activations!r}")
    if (groups != 1 or batch_invariant) and activations == "fp8":
        raise ValueError(f"activations: 'fp8' (W8A8) has no grouped or batch-invariant kernel; groups={groups}, "
                         f"batch_invariant={batch_invariant} run 'exact' or 'auto'")
    lead = x.shape[:-1]
    rows = x.reshape(-1, x.shape[-1])
    n = weight.shape[0]  # the op checks the rest
    if activations == "auto":
        activations = "exact" if groups != 1 or batch_invariant else rule.pick(rows.shape[0], n, x.shape[-1], block,
                                                            rule.device_capability(x.device))
    out = torch.empty(rows.shape[0], n, dtype=x.dtype, device=x.device)
    if activations == "fp8":
        _fp8_linear_w8a8(rows, weight, fp32_scale(scale), out, block)
    else:
        _fp8_linear(rows, weight, scale.view(torch.uint8) if scale.dtype == torch.float8_e8m0fnu else scale, out, block,
                    groups, batch_invariant)
    return out.view(*lead, n)


def fp32_scale(scale: Tensor) -> Tensor:
    """UE8M0 tile scales (or their uint8 bytes) as fp32, exactly (powers of two); other dtypes as they
    are (the op names a wrong one)."""
    if scale.dtype == torch.uint8:
        scale = scale.view(torch.float8_e8m0fnu)
    return scale.float() if scale.dtype == torch.float8_e8m0fnu else scale


class BlockFP8Linear(nn.Module):
    """A bias-free linear layer whose weight stays block-FP8: buffers `weight` [out, in] e4m3 and
    `weight_scale_inv` [ceil(out / block), ceil(in / block)] (UE8M0 or fp32; the name of
    transformers' FP8 modules; the scale multiplies). forward(x [..., in]) = fp8_linear(x, ...,
    activations) in x's dtype. Half the weight bytes of a bf16 nn.Linear, which is what a decode
    step reads. activations "auto" (the default) lets rule.pick choose W8A16 or W8A8 per token
    count: x is quantized per 1 x 128 block where W8A8 runs (fp8_linear's docstring).

    `.to(dtype)` / `.half()` leave the buffers as they are (the checkpoint's bytes; x's dtype picks
    the compute dtype), `.to(device)` moves them. load_state_dict takes e4m3 weights and scales of
    the buffers' dtypes only: a bf16 weight would otherwise be cast to e4m3 silently. The W8A8 path
    reads `scale_fp32`, the scales in fp32 (not saved): set on load_state_dict; after writing
    weight_scale_inv in place, call refresh().

    groups > 1: V4's grouped o_a (fp8_linear's block-diagonal form): forward takes x [..., groups x
    in_features] and runs W8A16 ("auto" runs "exact"; there is no grouped W8A8 kernel)."""

    def __init__(self, in_features: int, out_features: int, block: int = 128,
                 scale_dtype: torch.dtype = torch.float8_e8m0fnu, device=None, activations: str = "auto",
                 groups: int = 1):
        super().__init__()
        if block not in BLOCKS:
            raise ValueError(f"block: expected a tile size in {list(BLOCKS)}, got {block!r}")
        if scale_dtype not in SCALE_DTYPES:
            raise ValueError(f"scale_dtype: expected one of {list(SCALE_DTYPES)}, got {scale_dtype}")
        if activations not in rule.ACTIVATIONS:
            raise ValueError(f"activations: expected one of {list(rule.ACTIVATIONS)}, got {activations!r}")
        if groups < 1 or (groups > 1 and (out_features % (groups * GROUP_ROWS) or activations == "fp8")):
            raise ValueError(f"groups: expected a count that cuts out_features {out_features} into multiples of "
                             f"{GROUP_ROWS} rows, with activations 'exact' or 'auto' (no grouped W8A8 kernel), got "
                             f"groups={groups}, activations={activations!r}")
        self.in_features, self.out_features, self.block = in_features, out_features, block
        self.activations, self.groups = activations, groups
        tiles = (-(-out_features // block), -(-in_features // block))
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=torch.float8_e4m3fn,
                                                   device=device))
        self.register_buffer("weight_scale_inv", torch.ones(tiles, dtype=scale_dtype, device=device))
        self.register_buffer("scale_fp32", None, persistent=False)
        self.refresh()

    def refresh(self) -> None:
        """Recompute what is derived from the buffers: scale_fp32 and the GPU capability rule.pick reads
        (rule.serving_capability, read here and on a move, not per call: it may run a probe kernel,
        and a torch.compile'd forward then reads a constant)."""
        self.scale_fp32 = fp32_scale(self.weight_scale_inv)
        self._capability = rule.serving_capability(self.weight.device)

    def forward(self, x: Tensor) -> Tensor:
        if self.groups > 1:
            return fp8_linear(x, self.weight, self.weight_scale_inv, self.block, groups=self.groups)
        activations = self.activations
        if activations == "auto":
            activations = rule.pick(math.prod(x.shape[:-1]), self.out_features, self.in_features, self.block,
                                    self._capability)
        if activations == "fp8":
            return fp8_linear(x, self.weight, self.scale_fp32, self.block, "fp8")
        return fp8_linear(x, self.weight, self.weight_scale_inv, self.block)

    def extra_repr(self) -> str:
        return (f"in_features={self.in_features}, out_features={self.out_features}, block={self.block}, "
                f"scale={self.weight_scale_inv.dtype}, activations={self.activations}"
                + (f", groups={self.groups}" if self.groups > 1 else ""))

    def _apply(self, fn, recurse=True):
        # float8 dtypes count as floating point, so Module.to(dtype) would cast the bytes; as uint8
        # views they only move (device) or stay.
        for name, t in self._buffers.items():
            self._buffers[name] = fn(t.view(torch.uint8)).view(t.dtype)
        self._capability = rule.serving_capability(self.weight.device)
        return self

    def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                              error_msgs):
        for name, t in self._buffers.items():
            given = state_dict.get(prefix + name)
            if given is not None and given.dtype != t.dtype:
                error_msgs.append(f"{prefix}{name}: expected dtype {t.dtype} (a block-FP8 projection keeps the "
                                  f"checkpoint's bytes), got {given.dtype}")
                return
        errors = len(error_msgs)
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)
        if len(error_msgs) == errors:
            self.refresh()
