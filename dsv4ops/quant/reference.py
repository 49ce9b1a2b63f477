"""Low-precision formats of DeepSeek-V4 attention, in plain PyTorch.

- FP8 e4m3 with power-of-two UE8M0 scales: scale = 2^ceil(log2(max(amax, 1e-4) / 448)), the
  official `act_quant` rule; the exponent is taken with frexp so it is exact at powers of two.
- MXFP4 (E2M1 values, UE8M0 scale per 32) after a 128-point Hadamard, as DeepSeek's reference.
- The cache entries: the 584-byte main entry (448 e4m3 + 64 bf16 rope + 7 UE8M0 + 1 pad; paged as
  [block_size x 576 B data][block_size x 8 B scales], padded to a multiple of 576 B) and the
  132-byte indexer entry (128 e4m3 + one fp32 scale; paged as [bs x 128 B][bs x 4 B]).
All byte offsets are int64.
"""

import math

import torch
from torch import Tensor

FP8_MAX = 448.0
FP8_AMAX_FLOOR = 1e-4
FP4_MAX = 6.0
FP4_AMAX_FLOOR = 6.0 * 2.0**-126
FP8_BLOCK = 64
FP4_BLOCK = 32
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


def hadamard(x: Tensor) -> Tensor:
    """Orthonormal Sylvester-Hadamard transform of the last dim (a power of two): x @ H / sqrt(n)."""
    n = x.shape[-1]
    h = torch.ones(1, 1, dtype=x.dtype, device=x.device)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return x @ h / math.sqrt(n)


# ---- paged cache entries -----------------------------------------------------------------------
def main_block_bytes(block_size: int) -> int:
    """One page of 584-B entries: data, then scales, padded to a multiple of 576 B (FlashMLA)."""
    return -(-block_size * MAIN_ENTRY_BYTES // MAIN_DATA_BYTES) * MAIN_DATA_BYTES


def main_block_size(block_bytes: int) -> int:
    return block_bytes // MAIN_ENTRY_BYTES  # the pad is < 576 < 584 bytes, so this inverts main_block_bytes


def indexer_block_bytes(block_size: int) -> int:
    return block_size * INDEXER_ENTRY_BYTES


def indexer_block_size(block_bytes: int) -> int:
    return block_bytes // INDEXER_ENTRY_BYTES


def _flat_pages(cache: Tensor) -> Tensor:
    return cache.view(-1)


def capacity(cache: Tensor, dim: int) -> int:
    """Entries a page pool holds: uint8 pools of 584-B (dim 512) or 132-B entries, float pools
    [blocks, block_size, dim] of rows."""
    if cache.dtype != torch.uint8:
        return cache.shape[0] * cache.shape[1]
    size = main_block_size if dim == MAIN_DIM else indexer_block_size
    return cache.shape[0] * size(cache.shape[1])


def valid_slots(slots: Tensor, cache: Tensor, dim: int) -> Tensor:
    """Slots that name an entry of the pool. Inside kernels -1, and any other value out of range,
    means "no entry": written nowhere, read as 0 (the public functions reject out-of-range values)."""
    return (slots >= 0) & (slots < capacity(cache, dim))


def _page_offsets(slots: Tensor, block_size: int, block_bytes: int) -> tuple[Tensor, Tensor]:
    s = slots.long()
    return (s // block_size) * block_bytes, s % block_size


def pack_main(x: Tensor, slots: Tensor, cache: Tensor) -> None:
    """Write rows x [N, 512] as 584-B FP8 entries at `slots` (-1 or out of range: skipped) of a uint8
    page pool."""
    keep = valid_slots(slots, cache, MAIN_DIM)
    x, slots = x[keep], slots[keep]
    bs = main_block_size(cache.shape[1])
    base, off = _page_offsets(slots, bs, cache.shape[1])
    flat = _flat_pages(cache)
    nope = x[:, :MAIN_NOPE].to(torch.bfloat16).float().reshape(-1, MAIN_NOPE // FP8_BLOCK, FP8_BLOCK)
    exp = pow2_scale_exponent(nope.abs().amax(-1, keepdim=True), FP8_MAX, FP8_AMAX_FLOOR)
    q = (nope / torch.exp2(exp.float())).to(torch.float8_e4m3fn).reshape(-1, MAIN_NOPE).view(torch.uint8)
    rope = x[:, MAIN_NOPE:].to(torch.bfloat16).contiguous().view(torch.uint8)
    scales = torch.cat([(exp.squeeze(-1) + 127).to(torch.uint8), torch.zeros_like(exp[:, :1, 0], dtype=torch.uint8)], 1)
    data_at = base + off * MAIN_DATA_BYTES
    scale_at = base + bs * MAIN_DATA_BYTES + off * MAIN_SCALE_BYTES
    cols = torch.arange(MAIN_DATA_BYTES, device=cache.device)
    flat[(data_at[:, None] + cols).reshape(-1)] = torch.cat([q, rope], 1).reshape(-1)
    cols = torch.arange(MAIN_SCALE_BYTES, device=cache.device)
    flat[(scale_at[:, None] + cols).reshape(-1)] = scales.reshape(-1)


def unpack_main(cache: Tensor, slots: Tensor, out: Tensor) -> None:
    """Read 584-B entries at `slots` into out [N, 512] (nope = e4m3 x 2^(e-127), rope = bf16);
    rows with slot -1 (or out of range) become 0."""
    bs = main_block_size(cache.shape[1])
    ok = valid_slots(slots, cache, MAIN_DIM)
    safe = slots.where(ok, 0)
    base, off = _page_offsets(safe, bs, cache.shape[1])
    flat = _flat_pages(cache)
    data = flat[(base + off * MAIN_DATA_BYTES)[:, None] + torch.arange(MAIN_DATA_BYTES, device=cache.device)]
    scales = flat[(base + bs * MAIN_DATA_BYTES + off * MAIN_SCALE_BYTES)[:, None]
                  + torch.arange(MAIN_NOPE // FP8_BLOCK, device=cache.device)]
    nope = data[:, :MAIN_NOPE].contiguous().view(torch.float8_e4m3fn).float().reshape(-1, MAIN_NOPE // FP8_BLOCK, FP8_BLOCK)
    nope = nope * torch.exp2(scales.float() - 127).unsqueeze(-1)
    rope = data[:, MAIN_NOPE:].contiguous().view(torch.bfloat16).float()
    rows = torch.cat([nope.reshape(-1, MAIN_NOPE), rope], 1)
    out.copy_(torch.where(ok[:, None], rows, 0.0).to(out.dtype))


def pack_indexer(x: Tensor, slots: Tensor, cache: Tensor) -> None:
    """Write rows x [N, 128] as 132-B FP8 entries (one power-of-two fp32 scale per entry)."""
    keep = valid_slots(slots, cache, INDEXER_DIM)
    x, slots = x[keep], slots[keep]
    bs = indexer_block_size(cache.shape[1])
    base, off = _page_offsets(slots, bs, cache.shape[1])
    flat = _flat_pages(cache)
    v = x.to(torch.bfloat16).float()
    scale = torch.exp2(pow2_scale_exponent(v.abs().amax(-1, keepdim=True), FP8_MAX, FP8_AMAX_FLOOR).float())
    q = (v / scale).to(torch.float8_e4m3fn).view(torch.uint8)
    flat[((base + off * INDEXER_DIM)[:, None] + torch.arange(INDEXER_DIM, device=cache.device)).reshape(-1)] = q.reshape(-1)
    at = (base + bs * INDEXER_DIM + off * 4)[:, None] + torch.arange(4, device=cache.device)
    flat[at.reshape(-1)] = scale.contiguous().view(torch.uint8).reshape(-1)


def unpack_indexer(cache: Tensor, slots: Tensor, out: Tensor) -> None:
    bs = indexer_block_size(cache.shape[1])
    ok = valid_slots(slots, cache, INDEXER_DIM)
    safe = slots.where(ok, 0)
    base, off = _page_offsets(safe, bs, cache.shape[1])
    flat = _flat_pages(cache)
    q = flat[(base + off * INDEXER_DIM)[:, None] + torch.arange(INDEXER_DIM, device=cache.device)]
    s = flat[(base + bs * INDEXER_DIM + off * 4)[:, None] + torch.arange(4, device=cache.device)]
    rows = q.contiguous().view(torch.float8_e4m3fn).float() * s.contiguous().view(torch.float32)
    out.copy_(torch.where(ok[:, None], rows, 0.0).to(out.dtype))


def pack_kv(x: Tensor, slots: Tensor, cache: Tensor) -> None:
    """Store rows at global slots of a paged pool: uint8 pools hold FP8 entries (512-d: 584 B,
    128-d: 132 B); float pools [blocks, block_size, dim] hold the rows as they are (exact mode).
    A slot of -1 or out of range stores nothing (and the other rows are still stored in full)."""
    if cache.dtype == torch.uint8:
        (pack_main if x.shape[-1] == MAIN_DIM else pack_indexer)(x, slots, cache)
        return
    keep = valid_slots(slots, cache, x.shape[-1])
    cache.view(-1, cache.shape[-1])[slots[keep].long()] = x[keep].to(cache.dtype)


def unpack_kv(cache: Tensor, slots: Tensor, out: Tensor) -> None:
    if cache.dtype == torch.uint8:
        (unpack_main if out.shape[-1] == MAIN_DIM else unpack_indexer)(cache, slots, out)
        return
    ok = valid_slots(slots, cache, out.shape[-1])
    rows = cache.view(-1, cache.shape[-1])[slots.where(ok, 0).long()]
    out.copy_(torch.where(ok[:, None], rows.to(out.dtype), 0))
