"""Public visible_entries: the HCA layer's key list of a step, computed on the device.

Reference (the specification): dsv4ops/visible_entries/reference.py.
"""

import torch
from torch import Tensor

from dsv4ops import _values
from dsv4ops import ops as _ops  # noqa: F401  (defines the dsv4:: ops bound below)
from dsv4ops.visible_entries import checks

_visible_entries = torch.ops.dsv4.visible_entries.default


def visible_entries(block_table: Tensor, positions: Tensor, req_slots: Tensor, ratio: int, block_size: int,
                    pool_blocks: int) -> Tensor:
    """block_table [requests, blocks] int32 (physical block of each block of block_size entries of
    a request, in a pool of pool_blocks blocks; -1 unallocated), positions [T] int32, req_slots [T]
    int32 (-1: padding) -> out [T, blocks x block_size] int32: out[t, w] = block_table[r, w //
    block_size] x block_size + w % block_size, the global pool slot of entry w of the token's
    request r, for every complete entry w < (positions[t] + 1) // ratio; -1 past them, where that
    block is unallocated, and in the whole row of a padding token.

    Checked in eager mode: positions >= 0; req_slots in [-1, requests); block_table in [-1,
    pool_blocks) (a block past the pool would give slots sparse_attn reads as no entry); every live
    token's visible entries fit in the table's width (the op itself cuts a longer list at it). (The
    op turns a token with a request slot out of range or a negative position into padding.)"""
    if not torch.compiler.is_compiling() and (isinstance(pool_blocks, bool) or not isinstance(pool_blocks, int)
                                              or pool_blocks < 0):
        raise ValueError(f"pool_blocks: expected an int >= 0 (the blocks of the pool the table indexes), got "
                         f"{pool_blocks!r}")
    # A bad block_size gets the op's message rather than torch.empty's (a negative width).
    width = block_table.shape[-1] * max(block_size, 0)
    out = torch.empty((positions.shape[0], width), dtype=torch.int32, device=block_table.device)
    if _values.has_data(block_table, positions, req_slots):
        checks.visible_entries(block_table, positions, req_slots, out, ratio, block_size)
        _values.in_range("positions", positions, 0, None, "token positions")
        _values.in_range("req_slots", req_slots, -1, block_table.shape[0],
                         f"-1 or one of the {block_table.shape[0]} requests of block_table")
        _values.in_range("block_table", block_table, -1, pool_blocks, f"-1 or one of the pool's {pool_blocks} blocks")
        _values.table_width(positions, req_slots, block_table, block_size, ratio)
    _visible_entries(block_table, positions, req_slots, out, ratio, block_size)
    return out
