"""Metadata rules of `dsv4::indexer_q_prep` and `dsv4::indexer_topk`."""

import torch
from torch import Tensor

from dsv4ops import _checks as c
from dsv4ops.indexer.workspace import workspace_words

_Q_OUT = c.FLOATS + (torch.float8_e4m3fn,)


def indexer_q_prep(q: Tensor, weights: Tensor, positions: Tensor, inv_freq: Tensor, q_out: Tensor, w_out: Tensor):
    c.ndim("q", q, 3, "[tokens, index_heads, index_head_dim]")
    c.dtype("q", q, c.FLOATS)
    c.last_dim_contiguous("q", q)
    t, h, d = q.shape
    c.ndim("weights", weights, 2, "[tokens, index_heads]")
    c.dtype("weights", weights, c.FLOATS)
    c.like("weights", weights, q.select(-1, 0), "q[..., 0]")
    c.index_vector("positions", positions, t, q, "q")
    c.rope_table(inv_freq, d, q)
    c.like("q_out", q_out, q, "q")
    c.dtype("q_out", q_out, _Q_OUT)
    c.last_dim_contiguous("q_out", q_out)
    c.like("w_out", w_out, weights, "weights")
    c.dtype("w_out", w_out, (torch.float32,))


def indexer_topk(q: Tensor, weights: Tensor, positions: Tensor, req_slots: Tensor, cache: Tensor,
                 block_table: Tensor, idx_out: Tensor, workspace: Tensor, ratio: int):
    c.ndim("q", q, 3, "[tokens, index_heads, index_head_dim]")
    c.dtype("q", q, _Q_OUT)
    c.last_dim_contiguous("q", q)
    t = q.shape[0]
    c.ndim("weights", weights, 2, "[tokens, index_heads]")
    c.dtype("weights", weights, (torch.float32,))
    c.like("weights", weights, q.select(-1, 0), "q[..., 0]")
    c.index_vector("positions", positions, t, q, "q")
    c.index_vector("req_slots", req_slots, t, q, "q")
    c.paged_cache("cache", cache, q.shape[2], q)
    c.ndim("block_table", block_table, 2, "[requests, blocks per request]")
    c.dtype("block_table", block_table, c.INDEX)
    c.same_device("block_table", block_table, q, "q")
    c.ndim("idx_out", idx_out, 2, "[tokens, top-k]")
    c.dtype("idx_out", idx_out, c.INDEX)
    c.size("idx_out", idx_out, 0, t, "tokens of q")
    c.same_device("idx_out", idx_out, q, "q")
    c.ndim("workspace", workspace, 1, "[int32 words]")
    c.dtype("workspace", workspace, c.INDEX)
    c.contiguous("workspace", workspace)
    c.same_device("workspace", workspace, q, "q")
    n_entries = block_table.shape[1] * (c.paged_cache("cache", cache, q.shape[2], q))
    need = workspace_words(1, n_entries, idx_out.shape[1])
    torch._check(workspace.shape[0] >= need, lambda: f"workspace: expected >= {need} int32 words (one token's row: "
                 f"indexer.workspace.workspace_words(1, {n_entries}, {idx_out.shape[1]})), got {workspace.shape[0]}")
    torch._check(ratio > 0, lambda: f"ratio: expected > 0, got {ratio}")
