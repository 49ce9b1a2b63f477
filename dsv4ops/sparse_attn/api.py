"""Public sparse attention (spec 3.5): window + compressed entries + sink, one softmax.

Reference (the specification): dsv4ops/sparse_attn/reference.py.
"""

import torch
from torch import Tensor

from dsv4ops import _values
from dsv4ops import ops as _ops  # noqa: F401  (defines the dsv4:: ops bound below)
from dsv4ops.quant.api import check_slots, pool_slots
from dsv4ops.sparse_attn import checks

_sparse_attn = torch.ops.dsv4.sparse_attn.default


def sparse_attn(q: Tensor, window_cache: Tensor, comp_cache: Tensor, positions: Tensor, req_slots: Tensor,
                comp_idx: Tensor, sinks: Tensor, scale: float, window: int, ring_size: int, window_fmt: str,
                comp_fmt: str, comp_lens: Tensor | None = None, window_ends: Tensor | None = None,
                return_lse: bool = False) -> Tensor | tuple[Tensor, Tensor]:
    """MQA with an attention sink -> out [T, H, D] contiguous, q's dtype.

    return_lse=True -> (out, lse): one shard of a context-parallel step (dsv4ops.parallel.dcp): out is
    normalized over these keys WITHOUT the sink and lse [T, H] fp32 is the natural log of the sum
    of e^(l_j) over them (-inf, with a zero row, for a query without a key); dsv4ops.attn_merge.api
    .attn_merge applies the sink to the shards' (out, lse).

    q [T, H, D] (float, contiguous last dim); window_cache, comp_cache: paged pools of D-wide rows
    in formats window_fmt and comp_fmt (see dsv4ops.quant.api); positions [T] int32 (>= 0); req_slots
    [T] int32 (-1: padding token, zero output row); comp_idx [T, n] int32 global slots of comp_cache
    (-1: none), of which the first comp_lens[t] of row t are read (comp_lens [T] int32; None: all
    n; cost follows comp_lens, not n); window_ends [T] int32 (None: the positions) the last window
    position of each query; sinks [H] fp32. Query t of request r attends, with K = V, to the window
    rows of positions max(0, e - window + 1) .. e, e = window_ends[t] (ring slots r * ring_size +
    p % ring_size; e = t: its causal window, itself included; e = the last position of a draft
    block for every token of the block: the block sees itself both ways) and to the entries in its
    comp_idx row: o = sum_j e^(l_j - M) k_j / (sum_j e^(l_j - M) + e^(sink_h - M)), l_j = scale x
    q . k_j. QK and PV run in q's dtype, the softmax in fp32.

    Checked in eager mode: positions >= 0; req_slots in [-1, window pool slots // ring_size);
    comp_idx in [-1, comp pool slots); comp_lens in [0, n]; window_ends from the token's position to
    the last position of its request in the call (a row the call has not written is never read);
    the tokens of a request span at most ring_size - window + 1 positions (inserted together, a later
    token would overwrite a window row an earlier one reads). ring_size >= window and the shapes are
    checked by the op."""
    out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device) if return_lse else None
    if comp_lens is None:
        comp_lens = torch.full((q.shape[0],), comp_idx.shape[-1], dtype=torch.int32, device=q.device)
    if _values.has_data(q, window_cache, comp_cache, positions, req_slots, comp_idx, comp_lens,
                        *([] if window_ends is None else [window_ends])):
        checks.sparse_attn(q, window_cache, comp_cache, positions, req_slots, comp_idx, comp_lens, window_ends, sinks,
                           out, scale, window, ring_size, window_fmt, comp_fmt, lse)
        requests = pool_slots(window_cache, window_fmt) // ring_size
        _values.in_range("positions", positions, 0, None, "token positions")
        _values.in_range("req_slots", req_slots, -1, requests,
                         f"-1 or one of the {requests} requests of the window pool ({ring_size}-slot rings)")
        _values.in_range("comp_lens", comp_lens, 0, comp_idx.shape[1] + 1, f"entries listed of comp_idx's "
                         f"{comp_idx.shape[1]} columns")
        check_slots("comp_idx", comp_idx, comp_cache, comp_fmt,
                    f"-1 or a slot of comp_cache's {pool_slots(comp_cache, comp_fmt)}")
        _values.request_span(positions, req_slots, ring_size - window + 1,
                             f"ring_size {ring_size} - window {window} + 1")
        if window_ends is not None:
            _values.window_ends(positions, req_slots, window_ends)
    _sparse_attn(q, window_cache, comp_cache, positions, req_slots, comp_idx, comp_lens, window_ends, sinks, out,
                 scale, window, ring_size, window_fmt, comp_fmt, lse)
    return (out, lse) if return_lse else out
