"""Public cache-entry functions: store rows into a paged pool and read them back.

A pool is uint8 [blocks, block bytes] of FP8 entries or float [blocks, block_size, d] of plain rows.
FP8 entries (the reference, dsv4ops/quant/reference.py, is the specification):
- d = 512, the 584-B main entry: 448 e4m3 (UE8M0 scale per 64 channels) | 64 bf16 rope | 7 UE8M0
  scale bytes | 1 pad byte; a page is [block_size x 576 B data][block_size x 8 B scales], padded
  to a multiple of 576 B.
- d = 128, the 132-B indexer entry: 128 e4m3 | one power-of-two fp32 scale; a page is
  [block_size x 128 B][block_size x 4 B].
Rows are rounded to bf16 before FP8 quantization. A global slot is block * block_size + offset.
"""

import torch
from torch import Tensor

from dsv4ops import _values
from dsv4ops import ops as _ops  # noqa: F401  (defines the dsv4:: ops bound below)
from dsv4ops.quant import checks
from dsv4ops.quant.reference import MAIN_DIM, indexer_block_size, main_block_size

_pack_kv = torch.ops.dsv4.pack_kv.default
_unpack_kv = torch.ops.dsv4.unpack_kv.default


def block_size(cache: Tensor, dim: int) -> int:
    """Entries per block of a pool of `dim`-wide rows."""
    if cache.dtype == torch.uint8:
        return (main_block_size if dim == MAIN_DIM else indexer_block_size)(cache.shape[1])
    return cache.shape[1]


def pool_slots(cache: Tensor, dim: int) -> int:
    """Global slots of a pool of `dim`-wide rows: blocks x block_size."""
    return cache.shape[0] * block_size(cache, dim)


def check_slots(name: str, slots: Tensor, cache: Tensor, dim: int, what: str):
    """Values of `slots` in [-1, pool slots)."""
    _values.in_range(name, slots, -1, pool_slots(cache, dim), what)


def pack_kv(x: Tensor, slots: Tensor, cache: Tensor) -> None:
    """Store rows x [N, d] (fp32/bf16/fp16) at global `slots` [N] int32 of `cache`, in place.

    slot -1 skips the row (padding); other slots must lie in [0, blocks x block_size) and be
    distinct (checked in eager mode). uint8 pools take d = 512 or 128 (FP8 entries); float pools
    store x cast to their dtype."""
    if _values.has_data(x, slots, cache):
        checks.pack_kv(x, slots, cache)
        check_slots("slots", slots, cache, x.shape[1], f"-1 or a slot of the pool's {pool_slots(cache, x.shape[1])}")
        _values.distinct("slots", slots, "slots (one row per slot)")
    _pack_kv(x, slots, cache)


def unpack_kv(cache: Tensor, slots: Tensor, dim: int, dtype: torch.dtype) -> Tensor:
    """Read the `dim`-wide rows at `slots` [N] int32 of `cache` -> [N, dim] of `dtype` (dequantized
    for FP8 pools: e4m3 x 2^(e - 127) and the bf16 rope part; fp32 scale for 132-B entries).
    Rows with slot -1 are 0; other slots must lie in [0, blocks x block_size)."""
    rows = slots.shape[0] if slots.dim() else 0  # a 0-D slots is reported by the op's checks
    out = torch.empty((rows, dim), dtype=dtype, device=cache.device)
    if _values.has_data(cache, slots):
        checks.unpack_kv(cache, slots, out)
        check_slots("slots", slots, cache, dim, f"-1 or a slot of the pool's {pool_slots(cache, dim)}")
    _unpack_kv(cache, slots, out)
    return out
