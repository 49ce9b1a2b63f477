"""Reference kernels of `dsv4::pack_kv` / `dsv4::unpack_kv` (paged pools of every format of
dsv4ops/quant/formats.py, rows coded by dsv4ops/quant/codecs.py), and the V4 fake quantizers of the
reference numerics:
- FP8 e4m3 with power-of-two UE8M0 scales: scale = 2^ceil(log2(max(amax, 1e-4) / 448)), the
  official `act_quant` rule; the exponent is taken with frexp so it is exact at powers of two.
- MXFP4 (E2M1 values, UE8M0 scale per 32) after a 128-point Hadamard, as DeepSeek's reference.
- FP4 with e4m3 scales per 16 (the values of a 288-B fp4_288 row; V4's `kv="fp4"` entries).
All byte offsets are int64.
"""

import math

import torch
from torch import Tensor

from dsv4ops.quant import codecs, formats
from dsv4ops.quant.formats import EXACT

FP8_MAX = 448.0
FP8_AMAX_FLOOR = 1e-4
FP4_MAX = 6.0
FP4_AMAX_FLOOR = 6.0 * 2.0**-126
FP8_BLOCK = 64
FP4_BLOCK = 32
FP4_E4M3_BLOCK = 16  # fp4_288: one e4m3 scale per 16 elements
FP4_E4M3_FLOOR = FP4_MAX * 2.0**-9  # the smallest e4m3 subnormal scale, 2^-9
_E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)

MAIN_DIM = 512
MAIN_ROPE = 64
MAIN_NOPE = MAIN_DIM - MAIN_ROPE  # 448 e4m3 bytes
MAIN_DATA_BYTES = MAIN_NOPE + 2 * MAIN_ROPE  # 576
MAIN_SCALE_BYTES = 8  # 7 UE8M0 scales + 1 pad byte
MAIN_ENTRY_BYTES = MAIN_DATA_BYTES + MAIN_SCALE_BYTES  # 584
INDEXER_DIM = 128
INDEXER_ENTRY_BYTES = INDEXER_DIM + 4  # 132


def pow2_scale_exponent(amax: Tensor, qmax: float, floor: float) -> Tensor:
    """Integer e with 2^e = 2^ceil(log2(max(amax, floor) / qmax)), exact (frexp, no log2 rounding)."""
    mant, exp = torch.frexp(amax.float().clamp(min=floor) / qmax)
    return torch.where(mant == 0.5, exp - 1, exp)


def fp8_roundtrip(x: Tensor, block: int) -> Tensor:
    """e4m3 quantize-dequantize over blocks of `block` channels of the last dim (UE8M0 scales).
    The result is exactly representable in bf16; returned in x.dtype."""
    shape = x.shape
    xb = x.float().reshape(*shape[:-1], shape[-1] // block, block)
    scale = torch.exp2(pow2_scale_exponent(xb.abs().amax(-1, keepdim=True), FP8_MAX, FP8_AMAX_FLOOR).float())
    return ((xb / scale).to(torch.float8_e4m3fn).float() * scale).reshape(shape).to(x.dtype)


def e2m1_round(x: Tensor) -> Tensor:
    """Round to the E2M1 grid {0, .5, 1, 1.5, 2, 3, 4, 6} (signed), ties to the even code."""
    grid = torch.tensor(_E2M1_GRID, dtype=x.dtype, device=x.device)
    a = x.abs().clamp(max=FP4_MAX)
    dist = (a.unsqueeze(-1) - grid).abs()
    best = dist.min(-1, keepdim=True).values
    # Candidates at the minimal distance: the even code (index) wins a tie.
    codes = torch.arange(len(_E2M1_GRID), device=x.device)
    cost = torch.where(dist == best, (codes % 2) * 1.0, torch.inf)
    return grid[cost.argmin(-1)] * torch.sign(x)


def mxfp4_roundtrip(x: Tensor) -> Tensor:
    """E2M1 quantize-dequantize, one UE8M0 scale per 32 channels; returned in x.dtype."""
    shape = x.shape
    xb = x.float().reshape(*shape[:-1], shape[-1] // FP4_BLOCK, FP4_BLOCK)
    scale = torch.exp2(pow2_scale_exponent(xb.abs().amax(-1, keepdim=True), FP4_MAX, FP4_AMAX_FLOOR).float())
    return (e2m1_round(xb / scale) * scale).reshape(shape).to(x.dtype)


def fp4_roundtrip(x: Tensor) -> Tensor:
    """E2M1 quantize-dequantize with one e4m3 scale per 16 channels (the fp4_288 row's values):
    S = e4m3(max(amax, 6 x 2^-9) / 6) rounded to nearest even, where S > 464 (past the midpoint of
    448 and 480) is e4m3's NaN; value = e2m1(x / S) x S. Reads fp32(x); returned in x.dtype."""
    shape = x.shape
    xb = x.float().reshape(*shape[:-1], shape[-1] // FP4_E4M3_BLOCK, FP4_E4M3_BLOCK)
    s = xb.abs().amax(-1, keepdim=True).clamp(min=FP4_E4M3_FLOOR) / FP4_MAX
    s = torch.where(s > 464.0, torch.nan, s.clamp(max=FP8_MAX).to(torch.float8_e4m3fn).float())
    return (e2m1_round(xb / s) * s).reshape(shape).to(x.dtype)


def hadamard(x: Tensor) -> Tensor:
    """Orthonormal Sylvester-Hadamard transform of the last dim (a power of two): x @ H / sqrt(n)."""
    n = x.shape[-1]
    h = torch.ones(1, 1, dtype=x.dtype, device=x.device)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return x @ h / math.sqrt(n)


def rotate(x: Tensor) -> Tensor:
    """DeepSeek's `rotate_activation` (V4's indexer, before its FP4 quantizer) of the last dim: the
    Hadamard of the bf16 row, summed exactly (fp64: 128 bf16 terms), / sqrt(n), as fp32 (the
    quantizer then reads it in bf16, the official bf16 output)."""
    return hadamard(x.to(torch.bfloat16).double()).float()


# ---- paged pools -------------------------------------------------------------------------------
def main_block_bytes(block_size: int) -> int:
    """One page of 584-B entries: data, then scales, padded to a multiple of 576 B (FlashMLA)."""
    return formats.FORMATS["fp8_584"].page_bytes(block_size)


def indexer_block_bytes(block_size: int) -> int:
    return formats.FORMATS["fp8_132"].page_bytes(block_size)


def _page_offsets(slots: Tensor, block_size: int, block_bytes: int) -> tuple[Tensor, Tensor]:
    """(page start, slot within the page) in int64."""
    s = slots.long()
    return (s // block_size) * block_bytes, s % block_size


def _row_offsets(f: formats.Format, slots: Tensor, cache: Tensor) -> tuple[Tensor, Tensor]:
    """int64 byte offsets of each slot's row in the data plane and in the scale plane."""
    bs = f.block_size(cache.shape[1])
    base, off = _page_offsets(slots, bs, cache.shape[1])
    return base + off * f.data_bytes, base + bs * f.data_bytes + off * f.scale_bytes


def _span(at: Tensor, n: int) -> Tensor:
    return (at[:, None] + torch.arange(n, device=at.device)).reshape(-1)


def capacity(cache: Tensor, fmt: str) -> int:
    """Slots a page pool of format `fmt` holds (exact pools [blocks, block_size, dim])."""
    if fmt == EXACT:
        return cache.shape[0] * cache.shape[1]
    return cache.shape[0] * formats.block_size(cache.shape, fmt)


def valid_slots(slots: Tensor, cache: Tensor, fmt: str) -> Tensor:
    """Slots that name an entry of the pool. Inside kernels -1, and any other value out of range,
    means "no entry": written nowhere, read as 0 (the public functions reject out-of-range values),
    so a raw op never half-writes a batch before failing."""
    return (slots >= 0) & (slots < capacity(cache, fmt))


def pack_kv(x: Tensor, slots: Tensor, cache: Tensor, fmt: str) -> None:
    """Store rows x [N, d] at global `slots` (-1 or out of range: skipped) of a pool of format `fmt`:
    byte formats code the rows (dsv4ops/quant/codecs.py); `exact` pools [blocks, block_size, d] take
    them as is."""
    live = valid_slots(slots, cache, fmt)
    x, slots = x[live], slots[live]
    if fmt == EXACT:
        cache.view(-1, cache.shape[-1])[slots.long()] = x.to(cache.dtype)
        return
    f = formats.get(fmt)
    data, scales = codecs.encode(fmt, x)
    data_at, scale_at = _row_offsets(f, slots, cache)
    flat = cache.view(-1)
    flat[_span(data_at, f.data_bytes)] = data.reshape(-1)
    flat[_span(scale_at, f.scale_bytes)] = scales.reshape(-1)


def unpack_kv(cache: Tensor, slots: Tensor, out: Tensor, fmt: str) -> None:
    """Read the rows at `slots` into out [N, d] (dequantized); rows with slot -1 (or out of range)
    become 0."""
    live = valid_slots(slots, cache, fmt)
    safe = slots.where(live, 0)
    if fmt == EXACT:
        rows = cache.view(-1, cache.shape[-1])[safe.long()].to(out.dtype)
    else:
        f = formats.get(fmt)
        data_at, scale_at = _row_offsets(f, safe, cache)
        flat = cache.view(-1)
        data = flat[_span(data_at, f.data_bytes)].view(-1, f.data_bytes)
        scales = flat[_span(scale_at, f.scale_bytes)].view(-1, f.scale_bytes)
        rows = codecs.decode(fmt, data, scales)
    out.copy_(torch.where(live[:, None], rows, 0.0).to(out.dtype))
