"""Public cache-entry functions: store rows into a paged pool and read them back.

Every pool has a format, passed explicitly (dsv4ops/quant/formats.py has the table): a byte format
is a uint8 pool [blocks, page bytes] (a page is [block_size x data][block_size x scales], padded to
the format's alignment), `exact` a float pool [blocks, block_size, d] of plain rows.
- fp8_584 (V4 window and compressed KV, 512-d): 448 e4m3 (UE8M0 scale per 64) | 64 bf16 rope |
  7 UE8M0 scale bytes + 1 pad byte; pages padded to 576 B.
- fp8_132 (V4 indexer keys, 128-d): 128 e4m3 | one power-of-two fp32 scale.
- fp8_528 (V4.1 window KV, 512-d): 512 e4m3, rope dims too | 16 UE8M0 scales (per 32).
- fp4_288 (V4.1 compressed KV, 512-d): 256 B of e2m1 nibbles | 32 e4m3 scales (per 16).
- mxfp4_68 (V4.1 index keys, 128-d): 64 B of e2m1 nibbles | 4 UE8M0 scales (per 32).
Quantized formats code bf16(x) (the codecs, dsv4ops/quant/codecs.py, are the specification). A
global slot is block * block_size + offset.
"""

import torch
from torch import Tensor

from dsv4ops import _values
from dsv4ops import ops as _ops  # noqa: F401  (defines the dsv4:: ops bound below)
from dsv4ops.quant import checks, formats

_pack_kv = torch.ops.dsv4.pack_kv.default
_unpack_kv = torch.ops.dsv4.unpack_kv.default


def block_size(cache: Tensor, fmt: str) -> int:
    """Rows per page of a pool of format `fmt`."""
    return formats.block_size(cache.shape, fmt)


def pool_slots(cache: Tensor, fmt: str) -> int:
    """Global slots of a pool: blocks x block_size."""
    return cache.shape[0] * block_size(cache, fmt)


def check_slots(name: str, slots: Tensor, cache: Tensor, fmt: str, what: str):
    """Values of `slots` in [-1, pool slots)."""
    _values.in_range(name, slots, -1, pool_slots(cache, fmt), what)


def pack_kv(x: Tensor, slots: Tensor, cache: Tensor, fmt: str) -> None:
    """Store rows x [N, d] (fp32/bf16/fp16) at global `slots` [N] int32 of `cache`, a pool of
    format `fmt`, in place.

    slot -1 skips the row (padding); other slots must lie in [0, blocks x block_size) and be
    distinct (checked in eager mode). Byte formats need d = the format's row width and finite rows
    (checked in eager mode: no format has a code for inf or NaN, and a row's scales come from its
    amax, so an inf would be stored as the largest code with its tile scaled as if it were 448 or
    6); exact pools store x cast to their dtype, inf and NaN included."""
    if _values.has_data(x, slots, cache):
        checks.pack_kv(x, slots, cache, fmt)
        check_slots("slots", slots, cache, fmt, f"-1 or a slot of the pool's {pool_slots(cache, fmt)}")
        _values.distinct("slots", slots, "slots (one row per slot)")
        if fmt != formats.EXACT:  # the rows stored (a skipped row may hold anything)
            _values.finite("x", x.masked_fill((slots < 0)[:, None], 0),
                           f"the rows stored in format {fmt}: its scales come from each tile's amax")
    _pack_kv(x, slots, cache, fmt)


def unpack_kv(cache: Tensor, slots: Tensor, dim: int, dtype: torch.dtype, fmt: str) -> Tensor:
    """Read the `dim`-wide rows at `slots` [N] int32 of `cache` (format `fmt`) -> [N, dim] of
    `dtype`, dequantized. Rows with slot -1 are 0; other slots must lie in [0, blocks x
    block_size)."""
    rows = slots.shape[0] if slots.dim() else 0  # a 0-D slots is reported by the op's checks
    out = torch.empty((rows, dim), dtype=dtype, device=cache.device)
    if _values.has_data(cache, slots):
        checks.unpack_kv(cache, slots, out, fmt)
        check_slots("slots", slots, cache, fmt, f"-1 or a slot of the pool's {pool_slots(cache, fmt)}")
    _unpack_kv(cache, slots, out, fmt)
    return out
