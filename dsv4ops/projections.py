"""The projections of a layer's input x, as few GEMMs as their formats allow (dsv4ops.packing), for
V4's and V4.1's layers alike: the layer names them (`X_PROJECTIONS`, in stacking order; a layer
kind or role without a compressor or indexer has fewer), and which of them feed a compressor
(`COMPRESSOR_WEIGHTS`). The nn.Linear ones are stacked into one GEMM with an fp32 output where a
compressor reads it, and q_a / kv kept block-FP8 are stacked into one W8A16 / W8A8 GEMM where their
tiles line up."""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from dsv4ops import invariant as _invariant
from dsv4ops import packing
from dsv4ops.fp8_linear import rule as fp8_rule
from dsv4ops.fp8_linear.api import BlockFP8Linear, fp32_scale, fp8_linear

# The projections keep_fp8 may hold block-FP8, stacked into their own GEMM (every layer has both).
FP8_PACKED = ("q_a_proj", "kv_proj")


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


def compressor_outputs(layer: nn.Module) -> tuple[str, ...]:
    """The members of layer.X_PROJECTIONS whose output a compressor reads."""
    return tuple(name.removesuffix(".weight") for name in layer.COMPRESSOR_WEIGHTS)


def tie_packs(layer: nn.Module) -> None:
    """Stack the nn.Linear projections of x (layer.X_PROJECTIONS the layer has) into the packed GEMM's
    weight (dsv4ops.packing), their parameters becoming views of it. Called after every change of
    the layer's tensors that could cut the views loose (construction, moves, loads, a projection
    swapped for a block-FP8 one)."""
    members = tuple(n for n in layer.X_PROJECTIONS if has(layer, n) and isinstance(layer.get_submodule(n), nn.Linear))
    layer.x_pack = packing.Pack("x_packed", members)
    layer.x_pack.tie(layer)
    # q_a and kv kept block-FP8 (keep_fp8): one W8A16 / W8A8 GEMM where their tiles line up.
    fp8 = [layer.get_submodule(n) for n in FP8_PACKED]
    same = all(isinstance(m, BlockFP8Linear) for m in fp8) and len(
        {(m.block, m.weight_scale_inv.dtype, m.activations, m.in_features) for m in fp8}) == 1
    layer.x8_pack = packing.Pack("x8_packed", FP8_PACKED if same and fp8[0].out_features % fp8[0].block == 0 else ())
    layer.x8_pack.tie(layer)


def project_x(layer: nn.Module, x: Tensor, invariant: bool = False) -> dict[str, Tensor]:
    """Every projection of x (layer.X_PROJECTIONS the layer has): the packed bf16 GEMM's slices (fp32
    where a compressor reads them, dsv4ops.packing) and the block-FP8 ones' own GEMMs, each in the
    dtype its consumer computes in (layer.projection_dtype). invariant: every GEMM batch-invariant
    (dsv4ops.invariant)."""
    pack = layer.x_pack
    for p in (pack, layer.x8_pack) if not torch.compiler.is_compiling() else ():
        if p.members and not p.tied(layer):
            p.tie(layer)  # a view was cut loose (a move or assignment dsv4ops.packing cannot see)
            if getattr(layer, p.buffer) is None:
                raise RuntimeError(f"{type(layer).__name__}(layer {layer.layer_idx}): the projections {list(p.members)} "
                                   f"must share one device and dtype to run as one GEMM, got "
                                   f"{[(m.weight.device, m.weight.dtype) for m in p.modules(layer)]}")
    fp32 = any(name in compressor_outputs(layer) for name in pack.members)
    out = pack.slices(layer, packing.matmul(x, layer.x_packed, fp32, invariant)) if pack.members else {}
    if layer.x8_pack.members:
        out.update(layer.x8_pack.slices(layer, _fp8_pack_gemm(layer, x, invariant)))
    for name in layer.X_PROJECTIONS:
        if name not in out and has(layer, name):
            out[name] = _invariant.linear(layer.get_submodule(name), x, invariant)  # a block-FP8 projection
    return {name: y.to(layer.projection_dtype(name, x.dtype)) for name, y in out.items()}


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
