"""Numerics modes of the reference: every rounding point, once.

Main KV mode (`kv`) and indexer mode (`indexer`) are independent. `exact` everywhere is Hugging
Face transformers' `DeepseekV4Attention` (no quantization; activations in the model dtype). The
other modes follow DeepSeek's official inference code (`inference/model.py`, `kernel.py`);
`kv="fp4"` is a cache option V4 was not trained for (its compressed entries in V4.1's 288-B FP4
rows, as NVFP4-compressed V4 caches of the engines).

| where                              | exact (HF)              | kv=fp8 / indexer=fp8         | kv=fp4 / indexer=mxfp4        |
|------------------------------------|-------------------------|------------------------------|-------------------------------|
| projections q_a, q_b, kv, o_a, o_b | model dtype             | model dtype                  | model dtype                   |
| norms, softmaxes                   | fp32, cast to dtype     | fp32, cast to dtype          | fp32, cast to dtype           |
| compressor a, z (x @ W^T)          | model dtype             | fp32 (official keeps fp32)   | fp32                          |
| compressor pool                    | fp32 -> model dtype     | fp32 -> bf16 before the norm | fp32 -> bf16 before the norm  |
| window KV nope (448)               | model dtype             | bf16, then e4m3, UE8M0 / 64  | kv=fp4: as kv=fp8             |
| window KV rope (64)                | model dtype             | bf16                         | kv=fp4: as kv=fp8             |
| compressed KV (512)                | model dtype             | as the window KV             | kv=fp4: bf16, E2M1, e4m3 / 16 |
| indexer key (128)                  | model dtype             | bf16, then e4m3, one pow2    | bf16, Hadamard-128, bf16,     |
|                                    |                         | fp32 scale per entry         | E2M1, UE8M0 / 32              |
| indexer query (H_I x 128)          | model dtype             | bf16, e4m3, pow2 scale per   | bf16, Hadamard-128, bf16,     |
|                                    |                         | (token, head) folded into w  | E2M1, UE8M0 / 32              |
| indexer head weights w             | fp32                    | fp32 (x q-scale)             | fp32                          |
| attention QK, PV                   | model dtype, P -> dtype | model dtype, P -> dtype      | model dtype, P -> dtype       |
| inverse RoPE of o                  | model dtype             | model dtype                  | model dtype                   |

UE8M0 scale = 2^ceil(log2(max(amax, 1e-4) / 448)) for e4m3 and 2^ceil(log2(max(amax, 6*2^-126) / 6))
for E2M1; the fp4 entry's e4m3 scale = e4m3(max(amax, 6*2^-9) / 6) (dsv4ops.quant.codecs, fp4_288).
Casts round to nearest even. FP8 quantizers see bf16 values (the official activations are bf16), so
the stored value is e4m3 x 2^k, exact in bf16. The Hadamard is DeepSeek's `rotate_activation`: a bf16
row in, H x / sqrt(128) out in bf16; the sum is exact here (fp64: 128 bf16 terms), as in the kernels.
"""

from dataclasses import dataclass

import torch
from torch import Tensor

from dsv4ops.quant.reference import (
    FP8_AMAX_FLOOR,
    FP8_BLOCK,
    FP8_MAX,
    fp4_roundtrip,
    fp8_roundtrip,
    mxfp4_roundtrip,
    pow2_scale_exponent,
    rotate,
)

KV_MODES = ("exact", "fp8", "fp4")
INDEXER_MODES = ("exact", "fp8", "mxfp4")


@dataclass(frozen=True)
class Numerics:
    kv: str = "exact"
    indexer: str = "exact"

    def __post_init__(self):
        if self.kv not in KV_MODES:
            raise ValueError(f"kv: expected one of {KV_MODES}, got {self.kv!r}")
        if self.indexer not in INDEXER_MODES:
            raise ValueError(f"indexer: expected one of {INDEXER_MODES}, got {self.indexer!r}")


def round_to(x: Tensor, dtype: torch.dtype) -> Tensor:
    """A rounding point of the oracle outside the quantizers below: the cast of a value to the
    (narrower) dtype the mode stores it in. One name, so a test can nudge every rounding point
    (dsv4ops.testing.rounding_twins)."""
    return x.to(dtype)


def compressor_dtype(mode: str, model_dtype: torch.dtype) -> torch.dtype:
    """dtype of the compressor projections a, z for a mode."""
    return model_dtype if mode == "exact" else torch.float32


def entry_dtype(mode: str, model_dtype: torch.dtype) -> torch.dtype:
    """dtype a pooled entry is cast to before its RMSNorm (and in which norm and RoPE return)."""
    return model_dtype if mode == "exact" else torch.bfloat16


def round_kv(kv: Tensor, mode: str, rope_dim: int) -> Tensor:
    """The window-KV value a query reads back (and, in fp8 mode, a compressed entry's: round_entry)."""
    if mode == "exact":
        return kv
    nope = fp8_roundtrip(kv[..., :-rope_dim].to(torch.bfloat16), FP8_BLOCK)
    rope = kv[..., -rope_dim:].to(torch.bfloat16)
    return torch.cat([nope, rope], -1).to(kv.dtype)


def round_entry(entry: Tensor, mode: str, rope_dim: int) -> Tensor:
    """The compressed-entry value a query reads back: fp4 = E2M1 with an e4m3 scale per 16 over all
    dims (rope dims too) of the bf16 entry; the other modes round it as the window KV."""
    if mode != "fp4":
        return round_kv(entry, mode, rope_dim)
    return fp4_roundtrip(entry.to(torch.bfloat16)).to(entry.dtype)


def fp8_row_scale(x: Tensor) -> Tensor:
    """One power-of-two fp32 scale per row (last dim), the 132-B indexer entry's scale."""
    return torch.exp2(pow2_scale_exponent(x.abs().amax(-1, keepdim=True), FP8_MAX, FP8_AMAX_FLOOR).float())


def round_indexer_key(k: Tensor, mode: str) -> Tensor:
    if mode == "exact":
        return k
    if mode == "fp8":
        v = k.to(torch.bfloat16).float()
        s = fp8_row_scale(v)
        return ((v / s).to(torch.float8_e4m3fn).float() * s).to(k.dtype)
    return mxfp4_roundtrip(rotate(k).to(torch.bfloat16)).to(k.dtype)


def quantize_indexer_query(q: Tensor, weights: Tensor, mode: str) -> tuple[Tensor, Tensor]:
    """(q', w') such that sum_h w'_h relu(q'_h . k) is the mode's score. q [..., H, d], weights
    [..., H] fp32 (already x d^-1/2 x H^-1/2). fp8 folds the per-(token, head) scale into w'."""
    if mode == "exact":
        return q, weights
    if mode == "fp8":
        v = q.to(torch.bfloat16).float()
        s = fp8_row_scale(v)
        return (v / s).to(torch.float8_e4m3fn).float(), weights * s.squeeze(-1)
    return mxfp4_roundtrip(rotate(q).to(torch.bfloat16)).float(), weights
