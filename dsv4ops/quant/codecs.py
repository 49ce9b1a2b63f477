"""Row codecs of the byte formats (dsv4ops/quant/formats.py): `encode(name, x)` turns rows
x [N, dim] into (data [N, data_bytes], scales [N, scale_bytes]) uint8, `decode(name, data, scales)`
turns them back into fp32 rows. Every quantizer reads bf16(x) (the writers of DeepSeek's reference
and of the engines see bf16 activations; spec V4 6, V4.1 2.0 and 4.6 "quantizer input").

Scale rules (spec V4 5.2, V4.1 4.2-4.5; where transformers' QAT port and vLLM differ, V4.1 follows
transformers, the training reference):
- fp8_584 / fp8_132 (V4): scale = 2^ceil(log2(max(amax, 1e-4) / 448)) (DeepSeek's `act_quant`).
- fp8_528: scale = pow2ceil(fp32(max(amax, 1e-4) x fp32(1/448))): the floor is on amax (vLLM floors
  amax / 448 instead; the scale bytes differ for tiles with amax <= 448 x 2^-14).
- fp4_288: S = e4m3_RNE(fp32(max(amax, 6 x 2^-9) / 6)) with no upper clamp: amax / 6 > 464 gives the
  e4m3fn NaN code 0x7F (vLLM clamps to 448); q = clamp(x / S, -6, 6) with IEEE division.
- mxfp4_68: scale = pow2ceil(fp32(max(amax, 6 x 2^-126) x fp32(1/6))).
pow2ceil(v) = 2^(E - 127 + [mantissa != 0]) from the fp32 bit fields (exact; no log2).
fp8_584 / fp8_528: a tile holding a NaN has no scale; its codes are all the NaN code 0x7F, its
scale byte 127 (2^0), so it decodes to NaN, never to finite numbers (the public functions refuse
such rows; a compiled step cannot, and stores them so).
e2m1: |q| rounds to {0, .5, 1, 1.5, 2, 3, 4, 6}, ties to the even code; the nibble's sign bit is
x's sign bit, so a negative value that rounds to 0 is 0x8.
"""

import torch
from torch import Tensor

from dsv4ops.quant import formats

FP8_MAX = 448.0
E4M3_NAN = 0x7F
FP4_MAX = 6.0
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
_F32 = torch.float32


def _f32(v: float) -> Tensor:
    return torch.tensor(v, dtype=_F32)


def pow2ceil_exponent(v: Tensor) -> Tensor:
    """int32 e with 2^e = the smallest power of two >= v, for positive normal fp32 v."""
    bits = v.to(_F32).view(torch.int32)
    return ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(torch.int32)


def v4_scale_exponent(amax: Tensor) -> Tensor:
    """V4 e4m3 scale exponent: ceil(log2(max(amax, 1e-4) / 448)), exact (frexp)."""
    mant, exp = torch.frexp(amax.to(_F32).clamp(min=1e-4) / FP8_MAX)
    return torch.where(mant == 0.5, exp - 1, exp)


def e4m3_bits(x: Tensor) -> Tensor:
    """e4m3fn codes (uint8) of fp32 values within +-448, round to nearest even."""
    return x.to(torch.float8_e4m3fn).view(torch.uint8)


def e4m3_scale_bits(v: Tensor) -> Tensor:
    """e4m3fn codes of positive scales with transformers' overflow: v > 464 (above the midpoint of
    448 and the next step, 480) rounds to the NaN code 0x7F; torch's cast would saturate to 448."""
    return torch.where(v > 464.0, 0x7F, e4m3_bits(v.clamp(max=FP8_MAX)).to(torch.int32)).to(torch.uint8)


def e2m1_nibbles(q: Tensor, negative: Tensor) -> Tensor:
    """Nibbles sign << 3 | code of q (|q| <= 6), ties to the even code (0.25 -> 0, 0.75 -> 1,
    1.25 -> 1, 1.75 -> 2, 2.5 -> 2, 3.5 -> 4, 5 -> 4)."""
    a = q.abs()
    code = ((a > 0.25).int() + (a >= 0.75).int() + (a > 1.25).int() + (a >= 1.75).int() + (a > 2.5).int()
            + (a >= 3.5).int() + (a > 5.0).int())
    return (code | (negative.int() << 3)).to(torch.uint8)


def e2m1_values(nibbles: Tensor) -> Tensor:
    grid = torch.tensor(E2M1_VALUES, dtype=_F32, device=nibbles.device)
    mag = grid[(nibbles & 7).long()]
    return torch.where((nibbles & 8) != 0, -mag, mag)


def _pack_nibbles(nib: Tensor) -> Tensor:
    """[N, 2k] nibbles -> [N, k] bytes, element 2i in the low nibble."""
    return nib[:, 0::2] | (nib[:, 1::2] << 4)


def _unpack_nibbles(data: Tensor) -> Tensor:
    return torch.stack([data & 0xF, data >> 4], -1).flatten(-2)


def _groups(x: Tensor, group: int) -> Tensor:
    """bf16(x) as fp32 [N, dim / group, group]."""
    return x.to(torch.bfloat16).to(_F32).reshape(x.shape[0], x.shape[1] // group, group)


def _per_group(v: Tensor, group: int) -> Tensor:
    """[N, k] -> [N, k / group, group] (explicit sizes: N may be 0)."""
    return v.reshape(v.shape[0], v.shape[1] // group, group)


# ---- encoders: rows [N, dim] -> (data, scales) --------------------------------------------------
def _enc_fp8_584(x: Tensor) -> tuple[Tensor, Tensor]:
    f = formats.FORMATS["fp8_584"]
    v = _groups(x[:, : f.quantized], f.group)
    nan = v.isnan().any(-1, keepdim=True)
    e = v4_scale_exponent(v.abs().amax(-1, keepdim=True)).masked_fill(nan, 0)
    codes = e4m3_bits(v * torch.exp2(-e.to(_F32))).masked_fill(nan, E4M3_NAN).reshape(x.shape[0], f.quantized)
    rope = x[:, f.quantized:].to(torch.bfloat16).contiguous().view(torch.uint8)
    pad = torch.zeros(x.shape[0], 1, dtype=torch.uint8, device=x.device)
    return torch.cat([codes, rope], 1), torch.cat([(e.squeeze(-1) + 127).to(torch.uint8), pad], 1)


def _enc_fp8_132(x: Tensor) -> tuple[Tensor, Tensor]:
    v = _groups(x, 128)
    scale = torch.exp2(v4_scale_exponent(v.abs().amax(-1, keepdim=True)).to(_F32))
    return e4m3_bits(v / scale).reshape(x.shape[0], 128), scale.reshape(x.shape[0], 1).contiguous().view(torch.uint8)


def _enc_fp8_528(x: Tensor) -> tuple[Tensor, Tensor]:
    v = _groups(x, 32)
    amax = v.abs().amax(-1, keepdim=True)
    nan = v.isnan().any(-1, keepdim=True)
    e = pow2ceil_exponent(torch.maximum(amax, _f32(1e-4)) * _f32(1 / FP8_MAX)).masked_fill(nan, 0)
    codes = e4m3_bits((v * torch.exp2(-e.to(_F32))).clamp(-FP8_MAX, FP8_MAX)).masked_fill(nan, E4M3_NAN)
    return codes.reshape(x.shape), (e.squeeze(-1) + 127).to(torch.uint8)


def _enc_fp4_288(x: Tensor) -> tuple[Tensor, Tensor]:
    v = _groups(x, 16)
    amax = v.abs().amax(-1, keepdim=True)
    sbits = e4m3_scale_bits(torch.maximum(amax, _f32(FP4_MAX * 2.0**-9)) / FP4_MAX)
    scale = sbits.view(torch.float8_e4m3fn).to(_F32)
    q = (v / scale).clamp(-FP4_MAX, FP4_MAX)
    nib = e2m1_nibbles(q, torch.signbit(v)).reshape(x.shape)
    return _pack_nibbles(nib), sbits.reshape(x.shape[0], x.shape[1] // 16)


def _enc_mxfp4_68(x: Tensor) -> tuple[Tensor, Tensor]:
    v = _groups(x, 32)
    amax = v.abs().amax(-1, keepdim=True)
    e = pow2ceil_exponent(torch.maximum(amax, _f32(FP4_MAX * 2.0**-126)) * _f32(1 / FP4_MAX))
    q = (v * torch.exp2(-e.to(_F32))).clamp(-FP4_MAX, FP4_MAX)
    nib = e2m1_nibbles(q, torch.signbit(v)).reshape(x.shape)
    return _pack_nibbles(nib), (e.squeeze(-1) + 127).to(torch.uint8)


# ---- decoders: (data, scales) -> fp32 rows -------------------------------------------------------
def _ue8m0(scales: Tensor) -> Tensor:
    return torch.exp2(scales.to(_F32) - 127)


def _dec_fp8_584(data: Tensor, scales: Tensor) -> Tensor:
    f = formats.FORMATS["fp8_584"]
    n = data.shape[0]
    nope = _per_group(data[:, : f.quantized].contiguous().view(torch.float8_e4m3fn).to(_F32), f.group)
    nope = nope * _ue8m0(scales[:, : f.quantized // f.group]).unsqueeze(-1)
    rope = data[:, f.quantized:].contiguous().view(torch.bfloat16).to(_F32)
    return torch.cat([nope.reshape(n, f.quantized), rope], 1)


def _dec_fp8_132(data: Tensor, scales: Tensor) -> Tensor:
    return data.contiguous().view(torch.float8_e4m3fn).to(_F32) * scales.contiguous().view(_F32)


def _dec_fp8_528(data: Tensor, scales: Tensor) -> Tensor:
    v = _per_group(data.contiguous().view(torch.float8_e4m3fn).to(_F32), 32)
    return (v * _ue8m0(scales).unsqueeze(-1)).reshape(data.shape)


def _dec_fp4_288(data: Tensor, scales: Tensor) -> Tensor:
    v = _per_group(e2m1_values(_unpack_nibbles(data)), 16)
    scale = scales.contiguous().view(torch.float8_e4m3fn).to(_F32).unsqueeze(-1)
    return (v * scale).reshape(data.shape[0], 2 * data.shape[1])


def _dec_mxfp4_68(data: Tensor, scales: Tensor) -> Tensor:
    v = _per_group(e2m1_values(_unpack_nibbles(data)), 32)
    return (v * _ue8m0(scales).unsqueeze(-1)).reshape(data.shape[0], 2 * data.shape[1])


_ENCODERS = {"fp8_584": _enc_fp8_584, "fp8_132": _enc_fp8_132, "fp8_528": _enc_fp8_528, "fp4_288": _enc_fp4_288,
             "mxfp4_68": _enc_mxfp4_68}
_DECODERS = {"fp8_584": _dec_fp8_584, "fp8_132": _dec_fp8_132, "fp8_528": _dec_fp8_528, "fp4_288": _dec_fp4_288,
             "mxfp4_68": _dec_mxfp4_68}


def encode(name: str, x: Tensor) -> tuple[Tensor, Tensor]:
    """Rows x [N, dim] (float) -> (data [N, data_bytes], scales [N, scale_bytes]) uint8."""
    return _ENCODERS[name](x)


def decode(name: str, data: Tensor, scales: Tensor) -> Tensor:
    """(data, scales) uint8 -> fp32 rows [N, dim]."""
    return _DECODERS[name](data, scales)


def roundtrip(name: str, x: Tensor) -> Tensor:
    """The value a reader gets back for rows x [..., dim] stored in format `name` (x as is for
    `exact`), in x's dtype: the fake quantizer of a cache format."""
    if name == formats.EXACT:
        return x
    rows = x.reshape(-1, x.shape[-1])
    return decode(name, *encode(name, rows)).reshape(x.shape).to(x.dtype)
