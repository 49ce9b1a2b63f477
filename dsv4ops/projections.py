"""The projections of a V4 layer's input x, as few GEMMs as their formats allow (dsv4ops.packing):
the bf16 ones (q_a, kv, the indexer's head weights, both compressors' kv / gate) stacked into one GEMM
with an fp32 output where a compressor reads it, and q_a / kv kept block-FP8 stacked into one W8A16 /
W8A8 GEMM where their tiles line up."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from dsv4ops import invariant as _invariant
from dsv4ops import packing
from dsv4ops.fp8_linear import rule as fp8_rule
from dsv4ops.fp8_linear.api import BlockFP8Linear, fp32_scale, fp8_linear
from dsv4ops.reference.numerics import compressor_dtype

# The compressors' projection weights: bf16 in the checkpoint (spec 1.3) and held in the model dtype.
# Outside exact mode their a, z compute in fp32 (the packed GEMM's fp32 output, dsv4ops.packing).
COMPRESSOR_WEIGHTS = ("compressor.kv_proj.weight", "compressor.gate_proj.weight",
                      "compressor.indexer.kv_proj.weight", "compressor.indexer.gate_proj.weight")
# The bf16 projections of the layer input x, in the order the packed GEMM stacks them (those present
# as nn.Linear: a layer kind without a compressor or indexer, or q_a / kv kept block-FP8, has fewer).
X_PROJECTIONS = ("q_a_proj", "kv_proj", "compressor.indexer.scorer.weights_proj", "compressor.kv_proj",
                 "compressor.gate_proj", "compressor.indexer.kv_proj", "compressor.indexer.gate_proj")


def has(module: nn.Module, path: str) -> bool:
    try:
        module.get_submodule(path)
    except AttributeError:
        return False
    return True


def parameter(module: nn.Module, path: str) -> Tensor | None:
    try:
        return module.get_parameter(path)
    except AttributeError:
        return None


def tie_packs(layer: nn.Module) -> None:
    """Stack the nn.Linear projections of x into the packed GEMM's weight (dsv4ops.packing), their
    parameters becoming views of it. Called after every change of the layer's tensors that could
    cut the views loose (construction, moves, loads, a projection swapped for a block-FP8 one)."""
    members = tuple(n for n in X_PROJECTIONS if has(layer, n) and isinstance(layer.get_submodule(n), nn.Linear))
    layer.x_pack = packing.Pack("x_packed", members)
    layer.x_pack.tie(layer)
    # q_a and kv kept block-FP8 (keep_fp8): one W8A16 / W8A8 GEMM where their tiles line up.
    fp8 = [layer.get_submodule(n) for n in X_PROJECTIONS[:2]]
    same = all(isinstance(m, BlockFP8Linear) for m in fp8) and len(
        {(m.block, m.weight_scale_inv.dtype, m.activations, m.in_features) for m in fp8}) == 1
    layer.x8_pack = packing.Pack("x8_packed", X_PROJECTIONS[:2] if same and fp8[0].out_features % fp8[0].block == 0
                                 else ())
    layer.x8_pack.tie(layer)


def project_x(layer: nn.Module, x: Tensor, invariant: bool = False) -> dict[str, Tensor]:
    """Every projection of x (X_PROJECTIONS the layer has): the packed bf16 GEMM's slices (fp32 where
    a compressor reads them, dsv4ops.packing) and the block-FP8 ones' own GEMMs, each in the dtype its
    consumer computes in: the compressors' in compressor_dtype of their mode, the others in x's.
    invariant: every GEMM batch-invariant (dsv4ops.invariant)."""
    pack = layer.x_pack
    for p in (pack, layer.x8_pack) if not torch.compiler.is_compiling() else ():
        if p.members and not p.tied(layer):
            p.tie(layer)  # a view was cut loose (a move or assignment dsv4ops.packing cannot see)
            if getattr(layer, p.buffer) is None:
                raise RuntimeError(f"{type(layer).__name__}(layer {layer.layer_idx}): the projections {list(p.members)} "
                                   f"must share one device and dtype to run as one GEMM, got "
                                   f"{[(m.weight.device, m.weight.dtype) for m in p.modules(layer)]}")
    fp32 = any(name in COMPRESSOR_OUTPUTS for name in pack.members)
    out = pack.slices(layer, packing.matmul(x, layer.x_packed, fp32, invariant)) if pack.members else {}
    if layer.x8_pack.members:
        out.update(layer.x8_pack.slices(layer, _fp8_pack_gemm(layer, x, invariant)))
    for name in X_PROJECTIONS:
        if name not in out and has(layer, name):
            out[name] = _invariant.linear(layer.get_submodule(name), x, invariant)  # a block-FP8 projection
    for name, y in out.items():
        mode = layer.numerics.indexer if name.startswith("compressor.indexer.") else layer.numerics.kv
        out[name] = y.to(compressor_dtype(mode, x.dtype) if name in COMPRESSOR_OUTPUTS else x.dtype)
    return out


def _fp8_pack_gemm(layer: nn.Module, x: Tensor, invariant: bool) -> Tensor:
    """x @ [q_a; kv]^T from their stacked block-FP8 weights, W8A16 or W8A8 as BlockFP8Linear picks for
    the stacked shape (fp8_linear.rule); invariant: W8A16 in its batch-invariant launch."""
    m = layer.q_a_proj
    w, scale = layer.x8_packed, layer.x8_packed_scale
    if invariant:
        return fp8_linear(x, w, scale, m.block, batch_invariant=True)
    activations = m.activations
    if activations == "auto":
        activations = fp8_rule.pick(math.prod(x.shape[:-1]), w.shape[0], w.shape[1], m.block, m._capability)
    return fp8_linear(x, w, fp32_scale(scale) if activations == "fp8" else scale, m.block, activations)


COMPRESSOR_OUTPUTS = tuple(name.removesuffix(".weight") for name in COMPRESSOR_WEIGHTS)
