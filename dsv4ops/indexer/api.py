"""Public Lightning Indexer functions (spec 3.4): query preparation and top-k selection.

Reference (the specification): dsv4ops/indexer/reference.py.
"""

import torch
from torch import Tensor

from dsv4ops import _values
from dsv4ops import ops as _ops  # noqa: F401  (defines the dsv4:: ops bound below)
from dsv4ops.indexer import checks
from dsv4ops.indexer.workspace import workspace_words
from dsv4ops.quant.api import block_size

_indexer_q_prep = torch.ops.dsv4.indexer_q_prep.default
_indexer_topk = torch.ops.dsv4.indexer_topk.default


def indexer_q_prep(q: Tensor, weights: Tensor, positions: Tensor, inv_freq: Tensor,
                   fp8: bool = False) -> tuple[Tensor, Tensor]:
    """q [T, H, d] (float, contiguous last dim), weights [T, H] (float), positions [T] int32 (>= 0),
    inv_freq [R/2] fp32 -> (q_out [T, H, d] contiguous, w_out [T, H] fp32).

    q_out = RoPE(q) at the token position, in q's dtype, or with fp8=True float8_e4m3fn with one
    power-of-two scale per (token, head) (q rounded to bf16 first); w_out = weights x d^-1/2 x
    H^-1/2, times that scale with fp8=True, so sum_h w_out relu(q_out . k) is the score."""
    q_out = torch.empty(q.shape, dtype=torch.float8_e4m3fn if fp8 else q.dtype, device=q.device)
    w_out = torch.empty(weights.shape, dtype=torch.float32, device=weights.device)
    if _values.has_data(q, weights, positions):
        checks.indexer_q_prep(q, weights, positions, inv_freq, q_out, w_out)
        _values.in_range("positions", positions, 0, None, "token positions")
    _indexer_q_prep(q, weights, positions, inv_freq, q_out, w_out)
    return q_out, w_out


def _check_visible_blocks(positions: Tensor, req_slots: Tensor, block_table: Tensor, bs: int, ratio: int):
    """Every entry a live token sees (w < (t + 1) // ratio) lies in an allocated block of its request."""
    live = req_slots >= 0
    pos, req = positions[live].long(), req_slots[live].long()
    need = -(-((pos + 1) // ratio) // bs)  # blocks holding the visible entries
    width = block_table.shape[1]
    if bool((need > width).any()):
        i = (need > width).nonzero()[0, 0].item()
        raise ValueError(f"block_table: expected {need[i].item()} blocks for the {(pos[i].item() + 1) // ratio} "
                         f"visible entries of request {req[i].item()} at position {pos[i].item()}, got a table "
                         f"{width} blocks wide")
    cols = torch.arange(width, device=block_table.device)
    missing = (cols[None] < need[:, None]) & (block_table[req] < 0)
    if bool(missing.any()):
        i, b = missing.nonzero()[0].tolist()
        raise ValueError(f"block_table: expected an allocated block (>= 0) for every visible entry, got -1 at "
                         f"block {b} of request {req[i].item()} (position {pos[i].item()} sees "
                         f"{(pos[i].item() + 1) // ratio} entries)")


def indexer_topk(q: Tensor, weights: Tensor, positions: Tensor, req_slots: Tensor, cache: Tensor,
                 block_table: Tensor, k: int, ratio: int) -> Tensor:
    """The k best compressed entries of each token -> idx [T, k] int32 of global pool slots.

    q [T, H, d] (float or float8_e4m3fn, contiguous last dim) and weights [T, H] fp32 from
    indexer_q_prep; positions [T] int32 (>= 0); req_slots [T] int32 (-1: padding, all -1 row);
    cache: a paged pool of d-wide keys (uint8 132-B entries need d = 128; see dsv4ops.quant.api);
    block_table [requests, blocks] int32: physical block of each block of a request's entries
    (-1 unallocated). Score of entry w: sum_h w_h relu(q_h . K_w) over the visible entries
    w < (t + 1) // ratio; the k best (exact ties to the lower entry) in ascending entry order,
    -1 after them. The CUDA kernel's scratch (indexer.workspace) is allocated per call here; the
    serving layers hold one, sized by the cache config.

    Checked in eager mode: k >= 1; positions >= 0; req_slots in [-1, requests); block_table values
    in [-1, pool blocks), and allocated for every visible entry of a live token."""
    if not torch.compiler.is_compiling() and k < 1:
        raise ValueError(f"k: expected >= 1 entries per token, got {k}")
    idx = torch.empty((q.shape[0], k), dtype=torch.int32, device=q.device)
    n_entries = block_table.shape[-1] * block_size(cache, q.shape[-1])  # shapes are checked below
    workspace = torch.empty(workspace_words(q.shape[0], n_entries, k), dtype=torch.int32, device=q.device)
    if _values.has_data(q, weights, positions, req_slots, cache, block_table):
        checks.indexer_topk(q, weights, positions, req_slots, cache, block_table, idx, workspace, ratio)
        _values.in_range("positions", positions, 0, None, "token positions")
        _values.in_range("req_slots", req_slots, -1, block_table.shape[0],
                         f"-1 or one of the {block_table.shape[0]} requests of block_table")
        _values.in_range("block_table", block_table, -1, cache.shape[0],
                         f"-1 or one of the pool's {cache.shape[0]} blocks")
        _check_visible_blocks(positions, req_slots, block_table, block_size(cache, q.shape[2]), ratio)
    _indexer_topk(q, weights, positions, req_slots, cache, block_table, idx, workspace, ratio)
    return idx
