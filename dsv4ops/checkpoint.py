"""Block-FP8 checkpoint weights: an e4m3 `weight` with one scale per (block x block) tile, named
`<name>.scale` (DeepSeek's checkpoints) or `<name>.weight_scale_inv` (transformers' FP8 modules).
The scale multiplies: w = float(weight[i, j]) * scale[i // block, j // block]. DeepSeek-V4 ships
128 x 128 tiles with UE8M0 scales (`torch.float8_e8m0fnu`, 2^(e - 127)); V4.1 32 x 32; V3-style
checkpoints carry fp32 scales. Dequantized on load: the layers compute in the model dtype."""

from __future__ import annotations

import warnings

import torch
from torch import Tensor, nn

from dsv4ops.fp8_linear import reference as fp8_linear_reference

V4_BLOCK = 128
V41_BLOCK = 32
SCALE_SUFFIXES = (".scale", ".weight_scale_inv")
_SCALE_DTYPES = (torch.float8_e8m0fnu, torch.float32, torch.bfloat16, torch.float16)


def check_block_fp8(weight: Tensor, scale: Tensor, block: int, name: str = "weight") -> None:
    """Raise ValueError unless `weight` is a 2-D e4m3 tensor with finite [ceil(N / block),
    ceil(K / block)] tile scales of a scale dtype (one host sync: a load-time check)."""
    if weight.dtype != torch.float8_e4m3fn or weight.dim() != 2:
        raise ValueError(f"{name}: expected a 2-D torch.float8_e4m3fn weight, got {weight.dtype} of shape "
                         f"{tuple(weight.shape)}")
    if scale.dtype not in _SCALE_DTYPES:
        raise ValueError(f"{name}: expected scales of dtype float8_e8m0fnu (UE8M0) or a float type, got {scale.dtype}")
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise ValueError(f"block: expected a tile size >= 1, got {block!r}")
    n, k = weight.shape
    tiles = (-(-n // block), -(-k // block))
    if tuple(scale.shape) != tiles:
        raise ValueError(f"{name}: a [{n}, {k}] weight in {block} x {block} tiles needs scales of shape {tiles}, got "
                         f"{tuple(scale.shape)} (wrong block size?)")
    if not torch.isfinite(scale.float()).all():
        raise ValueError(f"{name}: the scales hold NaN or inf (a UE8M0 0xFF byte?)")


def dequantize_block_fp8(weight: Tensor, scale: Tensor, block: int, dtype: torch.dtype, name: str = "weight") -> Tensor:
    """[N, K] e4m3 `weight` times its [ceil(N / block), ceil(K / block)] tile scales, computed in
    fp32 (an e4m3 value times a power of two is exact there), returned in `dtype`."""
    check_block_fp8(weight, scale, block, name)
    return fp8_linear_reference.dequantize(weight, scale, block, dtype)


def scale_key(state_dict: dict, weight_key: str) -> str | None:
    """The key of `weight_key`'s tile scales in `state_dict` (`X.weight` -> `X.scale` or
    `X.weight_scale_inv`), or None for a weight without scales."""
    base = weight_key[: -len(".weight")] if weight_key.endswith(".weight") else None
    if base is None:
        return None
    found = [base + s for s in SCALE_SUFFIXES if base + s in state_dict]
    if len(found) > 1:
        raise ValueError(f"state_dict: {weight_key} has two scale tensors, {found}")
    return found[0] if found else None


def dequantize_state_dict(state_dict: dict, block: int, dtype: torch.dtype) -> dict:
    """`state_dict` with every e4m3 weight that has tile scales dequantized to `dtype` and the scale
    keys dropped; other tensors pass unchanged. A scale without its weight, or an e4m3 weight without
    scales, raises (loading either as is would give wrong numbers)."""
    out, used = {}, set()
    for key, value in state_dict.items():
        if key.endswith(SCALE_SUFFIXES):
            continue
        sk = scale_key(state_dict, key)
        if sk is not None:
            out[key] = dequantize_block_fp8(value, state_dict[sk], block, dtype, name=key)
            used.add(sk)
        elif isinstance(value, Tensor) and value.dtype == torch.float8_e4m3fn:
            raise ValueError(f"state_dict: {key} is an e4m3 weight without tile scales ({key[:-7]}.scale or "
                             f"{key[:-7]}.weight_scale_inv)")
        else:
            out[key] = value
    orphans = sorted(k for k in state_dict if k.endswith(SCALE_SUFFIXES) and k not in used)
    if orphans:
        raise ValueError(f"state_dict: scales without an e4m3 weight: {orphans[:4]}")
    return out


def check_exact_cast(t: Tensor, dtype: torch.dtype, name: str) -> None:
    """Refuse a tensor `name` that `dtype` cannot hold exactly (a load would round it silently)."""
    if t.is_floating_point() and not torch.equal(t.to(dtype).to(t.dtype), t):
        bad = (t.to(dtype).to(t.dtype) != t).sum().item()
        raise ValueError(f"{name}: {t.dtype} values that {dtype} cannot hold exactly ({bad} of {t.numel()} would "
                         f"round); the layer keeps this weight in {dtype} (the checkpoint's dtype for it is bf16)")


def load_all_or_nothing(module: nn.Module, load, state_dict, strict: bool, assign: bool):
    """`load(state_dict, strict=strict, assign=assign)` (a module's nn.Module.load_state_dict) that
    changes nothing when it fails. torch copies tensor by tensor and raises at the end: a strict
    load with one bad key or shape left 9-18 of a V4 layer's 18 tensors overwritten. So a dry run
    first, on meta twins of every parameter and buffer (torch's own checks: keys, shapes, values that
    are not tensors, the modules' load hooks, e.g. BlockFP8Linear's dtypes; nothing is copied), then
    the load itself."""
    saved = []
    for mod in module.modules():
        for store in (mod._parameters, mod._buffers):
            for name, t in store.items():
                if t is not None:
                    saved.append((store, name, t))
                    twin = torch.empty_like(t, device="meta")
                    store[name] = nn.Parameter(twin, t.requires_grad) if isinstance(t, nn.Parameter) else twin
    try:
        with warnings.catch_warnings():  # torch notes that a copy into a meta tensor is a no-op: it is the point
            warnings.filterwarnings("ignore", message=".*to a meta parameter in the current model.*")
            load(state_dict, strict=strict, assign=assign)
    finally:
        for store, name, t in saved:
            store[name] = t
    return load(state_dict, strict=strict, assign=assign)
