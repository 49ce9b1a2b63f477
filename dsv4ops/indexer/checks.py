"""Metadata rules of `dsv4::indexer_q_prep`, `dsv4::indexer_k_prep` and `dsv4::indexer_topk`."""

import torch
from torch import Tensor

from dsv4ops import _checks as c
from dsv4ops.indexer.workspace import workspace_words
from dsv4ops.quant import formats

Q_FORMATS = (formats.EXACT, "fp8_132", "mxfp4_68")
# A prepared query: float (exact), e4m3 (fp8_132, scale in the weights) or the packed MX4 row (uint8).
_Q_IN = c.FLOATS + (torch.float8_e4m3fn, torch.uint8)
MX4 = formats.FORMATS["mxfp4_68"]


def indexer_q_prep(q: Tensor, weights: Tensor, positions: Tensor, inv_freq: Tensor, q_out: Tensor, w_out: Tensor,
                   fmt: str, hadamard: bool = False):
    c.ndim("q", q, 3, "[tokens, index_heads, index_head_dim]")
    c.dtype("q", q, c.FLOATS)
    c.last_dim_contiguous("q", q)
    t, h, d = q.shape
    c.ndim("weights", weights, 2, "[tokens, index_heads]")
    c.dtype("weights", weights, c.FLOATS)
    c.like("weights", weights, q.select(-1, 0), "q[..., 0]")
    c.index_vector("positions", positions, t, q, "q")
    c.rope_table(inv_freq, d, q)
    torch._check(fmt in Q_FORMATS, lambda: f"fmt: expected one of {list(Q_FORMATS)}, got {fmt!r}")
    c.hadamard(hadamard, fmt)
    c.ndim("q_out", q_out, 3, "[tokens, index_heads, row]")
    c.same_device("q_out", q_out, q, "q")
    c.last_dim_contiguous("q_out", q_out)
    if fmt == formats.EXACT:
        c.like("q_out", q_out, q, "q")
        c.dtype("q_out", q_out, c.FLOATS)
    else:
        f = formats.FORMATS[fmt]
        torch._check(d == f.dim, lambda: f"q: format {fmt} quantizes {f.dim}-d rows, got {d}-d rows")
        c.dtype("q_out", q_out, (torch.float8_e4m3fn,) if fmt == "fp8_132" else (torch.uint8,))
        c.size("q_out", q_out, 0, t, "tokens of q")
        c.size("q_out", q_out, 1, h, "heads of q")
        c.size("q_out", q_out, 2, d if fmt == "fp8_132" else f.row_bytes, f"{fmt} query row")
    c.like("w_out", w_out, weights, "weights")
    c.dtype("w_out", w_out, (torch.float32,))


def query_width(q: Tensor) -> int:
    """Key width a prepared query meets: its last dim, or 128 for a packed 68-B MX4 row."""
    return MX4.dim if q.dtype == torch.uint8 else q.shape[2]


def indexer_k_prep(latent: Tensor, positions: Tensor, req_slots: Tensor, entry_slots: Tensor, wk: Tensor,
                   k_norm_weight: Tensor, inv_freq: Tensor, cache: Tensor, ratio: int, eps: float, fmt: str):
    c.ndim("latent", latent, 2, "[tokens, d]")
    c.dtype("latent", latent, c.FLOATS)
    c.last_dim_contiguous("latent", latent)
    t, d = latent.shape
    c.index_vector("positions", positions, t, latent, "latent")
    c.index_vector("req_slots", req_slots, t, latent, "latent")
    c.index_vector("entry_slots", entry_slots, t, latent, "latent")
    c.ndim("wk", wk, 2, "[index_head_dim, d]")
    c.dtype("wk", wk, c.FLOATS)
    c.size("wk", wk, 1, d, "d of latent")
    c.same_device("wk", wk, latent, "latent")
    di = wk.shape[0]
    c.ndim("k_norm_weight", k_norm_weight, 1, "[index_head_dim]")
    c.dtype("k_norm_weight", k_norm_weight, c.FLOATS)
    c.size("k_norm_weight", k_norm_weight, 0, di, "rows of wk")
    c.same_device("k_norm_weight", k_norm_weight, latent, "latent")
    c.rope_table(inv_freq, di, latent)
    c.paged_cache("cache", cache, di, latent, fmt, "fmt")
    torch._check(ratio > 0, lambda: f"ratio: expected > 0, got {ratio}")
    c.finite_scalar("eps", eps, "the key RMSNorm's epsilon", inclusive=True)


def indexer_topk(q: Tensor, weights: Tensor, positions: Tensor, req_slots: Tensor, cache: Tensor,
                 block_table: Tensor, cand: Tensor | None, idx_out: Tensor, cand_out: Tensor | None, workspace: Tensor,
                 ratio: int, cand_block: int, fmt: str):
    c.ndim("q", q, 3, "[tokens, index_heads, index_head_dim]")
    c.dtype("q", q, _Q_IN)
    c.last_dim_contiguous("q", q)
    if q.dtype == torch.uint8:
        c.size("q", q, 2, MX4.row_bytes, "bytes of a packed mxfp4_68 query row")
    t = q.shape[0]
    c.ndim("weights", weights, 2, "[tokens, index_heads]")
    c.dtype("weights", weights, (torch.float32,))
    c.like("weights", weights, q.select(-1, 0), "q[..., 0]")
    c.index_vector("positions", positions, t, q, "q")
    c.index_vector("req_slots", req_slots, t, q, "q")
    bs = c.paged_cache("cache", cache, query_width(q), q, fmt, "fmt")
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
    torch._check(ratio > 0, lambda: f"ratio: expected > 0, got {ratio}")
    torch._check(cand is None or cand_out is None,
                 lambda: "cand, cand_out: expected at most one (a pool is published from unrestricted scores)")
    for name, blocks in (("cand", cand), ("cand_out", cand_out)):
        if blocks is not None:
            c.ndim(name, blocks, 2, "[tokens, candidate blocks]")
            c.dtype(name, blocks, c.INDEX)
            c.size(name, blocks, 0, t, "tokens of q")
            c.same_device(name, blocks, q, "q")
            torch._check(cand_block > 0,
                         lambda: f"cand_block: expected > 0 entries per candidate block with {name}, got {cand_block}")
    n_entries = block_table.shape[1] * bs
    cols = cand.shape[1] * cand_block if cand is not None else 0
    keep = cand_out.shape[1] if cand_out is not None else 0
    need = workspace_words(1, n_entries, idx_out.shape[1], cols, keep, max(cand_block, 1))
    torch._check(workspace.shape[0] >= need, lambda: f"workspace: expected >= {need} int32 words (one token's row: "
                 f"indexer.workspace.workspace_words(1, {n_entries}, {idx_out.shape[1]}, {cols}, {keep}, "
                 f"{max(cand_block, 1)})), got {workspace.shape[0]}")
