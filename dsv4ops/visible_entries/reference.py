"""Reference kernel of `dsv4::visible_entries`: the HCA layer's key list, the pool slot of every
complete compressed entry of each token's request, w < (t + 1) // ratio, through the request's
block table; -1 past them, where the entry's block is unallocated (< 0), and in the whole row of a
padding token (request slot outside [0, requests), or a negative position)."""

import torch
from torch import Tensor


def visible_entries(block_table: Tensor, positions: Tensor, req_slots: Tensor, out: Tensor, ratio: int,
                    block_size: int) -> None:
    n_req = block_table.shape[0]
    live = (req_slots >= 0) & (req_slots < n_req) & (positions >= 0)
    # int64: no overflow at the largest int32 position; a padding token sees nothing.
    count = torch.where(live, (positions.long() + 1) // ratio, 0).clamp(max=out.shape[1])
    out.fill_(-1)
    # Only the first max(count) columns hold entries: the work follows the tokens' real context, not
    # the table's width (max_context / ratio columns).
    n = int(count.max()) if count.numel() else 0
    w = torch.arange(n, device=out.device)
    blocks = block_table[req_slots.clamp(0, max(n_req - 1, 0)).long()[:, None], (w // block_size)[None]].long()
    visible = (w < count[:, None]) & (blocks >= 0)
    out[:, :n] = torch.where(visible, blocks * block_size + w % block_size, -1).to(out.dtype)
