"""Public indexer functions (V4 spec 3.4; V4.1 spec 2.4-2.8): query preparation, index keys, and
top-k selection (optionally restricted to, or publishing, a candidate-block pool).

Reference (the specification): dsv4ops/indexer/reference.py.
"""

import torch
from torch import Tensor

from dsv4ops import _values
from dsv4ops import ops as _ops  # noqa: F401  (defines the dsv4:: ops bound below)
from dsv4ops.indexer import checks
from dsv4ops.indexer.workspace import workspace_words
from dsv4ops.quant import formats
from dsv4ops.quant.api import block_size, check_slots, pool_slots

_indexer_q_prep = torch.ops.dsv4.indexer_q_prep.default
_indexer_k_prep = torch.ops.dsv4.indexer_k_prep.default
_indexer_topk = torch.ops.dsv4.indexer_topk.default


def indexer_q_prep(q: Tensor, weights: Tensor, positions: Tensor, inv_freq: Tensor,
                   fmt: str = formats.EXACT, hadamard: bool = False) -> tuple[Tensor, Tensor]:
    """q [T, H, d] (float, contiguous last dim), weights [T, H] (float), positions [T] int32 (>= 0),
    inv_freq [R/2] fp32 -> (q_out, w_out [T, H] fp32).

    q_out = RoPE(q) at the token position, quantized per (token, head) like keys of format `fmt`:
    `exact`: [T, H, d] in q's dtype; `fp8_132` (d = 128): float8_e4m3fn [T, H, d] of bf16(q) with
    one power-of-two scale per row, folded into w_out; `mxfp4_68` (d = 128): uint8 [T, H, 68], the
    packed row (64 B of e2m1 nibbles, 4 UE8M0 bytes; V4.1's FP4 query). w_out = weights x d^-1/2 x
    H^-1/2 (x the fp8 scale), so sum_h w_out relu(q_out . k) is the score. hadamard=True (a byte
    format): bf16(RoPE(q)) is rotated by the orthonormal Hadamard before the quantizer
    (quant.reference.rotate: V4's MXFP4 indexer, whose keys are rotated alike)."""
    t, h, d = q.shape if q.dim() == 3 else (0, 0, 0)  # other ranks are reported by the op's checks
    if fmt == "fp8_132":
        q_out = torch.empty(q.shape, dtype=torch.float8_e4m3fn, device=q.device)
    elif fmt == "mxfp4_68":
        q_out = torch.empty((t, h, formats.FORMATS[fmt].row_bytes), dtype=torch.uint8, device=q.device)
    else:
        q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    w_out = torch.empty(weights.shape, dtype=torch.float32, device=weights.device)
    if _values.has_data(q, weights, positions):
        checks.indexer_q_prep(q, weights, positions, inv_freq, q_out, w_out, fmt, hadamard)
        _values.in_range("positions", positions, 0, None, "token positions")
    _indexer_q_prep(q, weights, positions, inv_freq, q_out, w_out, fmt, hadamard)
    return q_out, w_out


def indexer_k_prep(latent: Tensor, positions: Tensor, req_slots: Tensor, entry_slots: Tensor, wk: Tensor,
                   k_norm_weight: Tensor, inv_freq: Tensor, cache: Tensor, ratio: int, eps: float, fmt: str) -> None:
    """Store the index keys of the entries this step closes (V4.1 spec 2.4); mutates `cache`.

    latent [T, d] (float, contiguous last dim): each closing token's compressed entry after its
    RMSNorm and before RoPE (compressor_update(..., latent=True)); positions, req_slots (-1:
    padding), entry_slots [T] int32: the key pool slot of the entry a token closes (read only for
    tokens with (p + 1) % ratio == 0; -1 stores nothing); wk [di, d], k_norm_weight [di] (float);
    inv_freq [R/2] fp32; cache: a paged pool of di-wide keys in format `fmt`.
    Key of entry w = p // ratio: RoPE at w * ratio (the trailing R dims) of RMSNorm(latent @ wk^T)
    (the GEMM in latent's dtype, the norm in fp32 with its weight, cast back).

    Checked in eager mode: positions >= 0; entry_slots in [-1, pool slots), distinct among the
    closing tokens, each at its entry's offset in a block (p // ratio % block size), and -1 for the
    other live tokens (slots of another ratio)."""
    if _values.has_data(latent, positions, req_slots, entry_slots, cache):
        checks.indexer_k_prep(latent, positions, req_slots, entry_slots, wk, k_norm_weight, inv_freq, cache, ratio,
                              eps, fmt)
        _values.in_range("positions", positions, 0, None, "token positions")
        check_slots("entry_slots", entry_slots, cache, fmt, f"-1 or a slot of the pool's {pool_slots(cache, fmt)}")
        _values.closing_slots(entry_slots, positions, req_slots, ratio, block_size(cache, fmt))
    _indexer_k_prep(latent, positions, req_slots, entry_slots, wk, k_norm_weight, inv_freq, cache, ratio, eps, fmt)


def _check_visible_blocks(positions: Tensor, req_slots: Tensor, block_table: Tensor, bs: int, ratio: int):
    """Every entry a live token sees (w < (t + 1) // ratio) lies in an allocated block of its request."""
    need = _values.table_width(positions, req_slots, block_table, bs, ratio)  # blocks holding the visible entries
    live = req_slots >= 0
    pos, req = positions[live].long(), req_slots[live].long()
    cols = torch.arange(block_table.shape[1], device=block_table.device)
    missing = (cols[None] < need[:, None]) & (block_table[req] < 0)
    if bool(missing.any()):
        i, b = missing.nonzero()[0].tolist()
        raise ValueError(f"block_table: expected an allocated block (>= 0) for every visible entry, got -1 at "
                         f"block {b} of request {req[i].item()} (position {pos[i].item()} sees "
                         f"{(pos[i].item() + 1) // ratio} entries)")


def _check_candidates(cand: Tensor, n_blocks: int):
    """Candidate block ids in [-1, n_blocks), strictly ascending per row with the -1 fill after them
    (the order cand_out is written in: the kernels break score ties by column)."""
    _values.in_range("cand", cand, -1, n_blocks, f"-1 or one of the {n_blocks} candidate blocks of the table")
    listed = cand >= 0
    bad = (listed[:, 1:] & ~listed[:, :-1]) | (listed[:, 1:] & (cand[:, 1:] <= cand[:, :-1]))
    if bool(bad.any()):
        i, j = bad.nonzero()[0].tolist()
        raise ValueError(f"cand: expected distinct candidate blocks in ascending order, -1 after them (as cand_out "
                         f"is written), got {cand[i, j].item()} then {cand[i, j + 1].item()} for token {i}")


def _workspace_words(q: Tensor, cache: Tensor, block_table: Tensor, k: int, fmt: str, cand: Tensor | None,
                     pool_blocks: int, cand_block: int) -> int:
    """Words of the kernel's scratch for this call (at least one token's row, which the op requires
    even of an empty step); 0 for arguments the checks below reject (an unknown format, a pool its
    format cannot page), so the caller gets their error, not this one's."""
    try:
        cols = cand.shape[-1] * cand_block if cand is not None else 0
        return workspace_words(max(q.shape[0], 1), block_table.shape[-1] * block_size(cache, fmt), k, cols,
                               pool_blocks, max(cand_block, 1))
    except (ValueError, IndexError):
        return 0


def indexer_topk(q: Tensor, weights: Tensor, positions: Tensor, req_slots: Tensor, cache: Tensor,
                 block_table: Tensor, k: int, ratio: int, fmt: str, cand: Tensor | None = None, cand_block: int = 0,
                 pool_blocks: int = 0) -> Tensor | tuple[Tensor, Tensor]:
    """The k best compressed entries of each token -> idx [T, k] int32 of global pool slots.

    q [T, H, d] and weights [T, H] fp32 from indexer_q_prep (q float, float8_e4m3fn, or uint8
    [T, H, 68] packed MX4 rows); positions [T] int32 (>= 0); req_slots [T] int32 (-1: padding, all
    -1 row); cache: a paged pool of the keys in format `fmt` (see dsv4ops.quant.api); block_table
    [requests, blocks] int32: physical block of each block of a request's entries (-1
    unallocated). Score of entry w: sum_h w_h relu(q_h . K_w) over the visible entries
    w < (t + 1) // ratio; the k best (exact ties to the lower entry) in ascending entry order,
    -1 after them. The CUDA kernel's scratch (indexer.workspace) is allocated per call here; the
    serving layers hold one, sized by the cache config.

    cand [T, n] int32 (V4.1 reindex layers): only the entries of these candidate blocks (entries
    b * cand_block .. b * cand_block + cand_block - 1 of block b), ascending, -1 after them (as
    cand_out is written), are scored.
    pool_blocks > 0 (V4.1 candidate source): also returns cand_out [T, pool_blocks] int32, the
    candidate blocks of the same (unrestricted) scores: block score = max over its entries, the
    block of the newest visible entry forced in, then the best blocks (ties to the lower block),
    blocks with no visible entry dropped; in ascending block order, -1 after them; returns
    (idx, cand_out).

    Checked in eager mode: k >= 1; positions >= 0; req_slots in [-1, requests); block_table values
    in [-1, pool blocks), and allocated for every visible entry of a live token; cand values in
    [-1, blocks of the table), ascending, -1 after them."""
    if not torch.compiler.is_compiling():
        if k < 1:
            raise ValueError(f"k: expected >= 1 entries per token, got {k}")
        if pool_blocks < 0:
            raise ValueError(f"pool_blocks: expected >= 0 candidate blocks to publish, got {pool_blocks}")
    idx = torch.empty((q.shape[0], k), dtype=torch.int32, device=q.device)
    cand_out = None
    if pool_blocks:
        cand_out = torch.empty((q.shape[0], pool_blocks), dtype=torch.int32, device=q.device)
    workspace = torch.empty(_workspace_words(q, cache, block_table, k, fmt, cand, pool_blocks, cand_block),
                            dtype=torch.int32, device=q.device)
    if _values.has_data(q, weights, positions, req_slots, cache, block_table):
        checks.indexer_topk(q, weights, positions, req_slots, cache, block_table, cand, idx, cand_out, workspace,
                            ratio, cand_block, fmt)
        _values.in_range("positions", positions, 0, None, "token positions")
        _values.in_range("req_slots", req_slots, -1, block_table.shape[0],
                         f"-1 or one of the {block_table.shape[0]} requests of block_table")
        _values.in_range("block_table", block_table, -1, cache.shape[0],
                         f"-1 or one of the pool's {cache.shape[0]} blocks")
        bs = block_size(cache, fmt)
        _check_visible_blocks(positions, req_slots, block_table, bs, ratio)
        if cand is not None:
            _check_candidates(cand, -(-block_table.shape[1] * bs // cand_block))
    _indexer_topk(q, weights, positions, req_slots, cache, block_table, cand, idx, cand_out, workspace, ratio,
                  cand_block, fmt)
    return idx if cand_out is None else (idx, cand_out)
