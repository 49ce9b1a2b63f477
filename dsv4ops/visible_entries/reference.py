"""Reference kernel of `dsv4::visible_entries`: the HCA layer's key list, the pool slot of every
complete compressed entry of each token's request, w < (t + 1) // ratio, through the request's
block table; -1 past them, where the entry's block is unallocated (< 0), and in the whole row of a
padding token (request slot outside [0, requests), or a negative position)."""

import torch
from torch import Tensor


def visible_entries(block_table: Tensor, positions: Tensor, req_slots: Tensor, out: Tensor, ratio: int,
                    block_size: int) -> None:
    n_req, n_blocks = block_table.shape
    live = (req_slots >= 0) & (req_slots < n_req) & (positions >= 0)
    # Padding tokens read an extra all -1 row: no entry is visible through it.
    table = torch.cat([block_table, block_table.new_full((1, n_blocks), -1)]).long()
    blocks = table[torch.where(live, req_slots, n_req).long()].repeat_interleave(block_size, dim=1)  # [T, W]
    w = torch.arange(out.shape[1], device=out.device)
    count = (positions.long() + 1) // ratio  # int64: no overflow at the largest int32 position
    visible = (w < count[:, None]) & (blocks >= 0)
    out.copy_(torch.where(visible, blocks * block_size + w % block_size, -1))
