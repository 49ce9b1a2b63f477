"""Metadata rules of `dsv4::visible_entries`."""

import torch
from torch import Tensor

from dsv4ops import _checks as c


def visible_entries(block_table: Tensor, positions: Tensor, req_slots: Tensor, out: Tensor, ratio: int,
                    block_size: int):
    c.ndim("block_table", block_table, 2, "[requests, blocks per request]")
    c.dtype("block_table", block_table, c.INDEX)
    c.ndim("positions", positions, 1, "[tokens]")
    c.dtype("positions", positions, c.INDEX)
    c.same_device("positions", positions, block_table, "block_table")
    t = positions.shape[0]
    c.index_vector("req_slots", req_slots, t, positions, "positions")
    torch._check(ratio > 0, lambda: f"ratio: expected > 0, got {ratio}")
    torch._check(block_size > 0, lambda: f"block_size: expected > 0 entries per block, got {block_size}")
    c.ndim("out", out, 2, "[tokens, blocks x block_size]")
    c.dtype("out", out, c.INDEX)
    c.size("out", out, 0, t, "tokens of positions")
    c.size("out", out, 1, block_table.shape[1] * block_size,
           f"{block_table.shape[1]} blocks of block_table x block_size {block_size}")
    c.same_device("out", out, block_table, "block_table")
    c.last_dim_contiguous("out", out)
