"""Public window-KV insert: the query's norm and RoPE, and the new key row into the window ring.

Reference (the specification): dsv4ops/qkv_prep/reference.py.
"""

import torch
from torch import Tensor

from dsv4ops import _values
from dsv4ops import ops as _ops  # noqa: F401  (defines the dsv4:: ops bound below)
from dsv4ops.qkv_prep import checks
from dsv4ops.qkv_prep.reference import window_slots
from dsv4ops.quant import formats
from dsv4ops.quant.api import pool_slots

_qkv_prep = torch.ops.dsv4.qkv_prep.default


def qkv_prep(q: Tensor, kv: Tensor, positions: Tensor, req_slots: Tensor, inv_freq: Tensor, window_cache: Tensor,
             ring_size: int, eps: float, window_fmt: str, q_norm: bool = True) -> Tensor:
    """q [T, H, D] (fp32/bf16/fp16, contiguous last dim), kv [T, D] (float, contiguous last dim),
    positions [T] int32 (>= 0), req_slots [T] int32 (-1: padding token), inv_freq [R/2] fp32 (RoPE
    of the trailing R channels, interleaved pairs) -> q_out [T, H, D] contiguous, q's dtype:
    RoPE(weightless per-head RMSNorm(q)) with q_norm (V4), RoPE(q) without (V4.1).

    Writes RoPE(kv) into `window_cache`, a paged pool of format `window_fmt` (see dsv4ops.quant.api)
    at slot req * ring_size + position % ring_size; a padding token writes nothing (its q_out row is
    still computed). Request r owns slots [r * ring_size, (r + 1) * ring_size), so req_slots must be
    < pool slots // ring_size, and no two tokens of one call may share a slot (checked in eager).
    A byte format needs the live tokens' kv rows finite (checked in eager, as pack_kv; where no check
    runs, a quantized tile holding a NaN is stored as NaN codes: dsv4ops/quant/codecs.py)."""
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    if _values.has_data(q, kv, positions, req_slots, window_cache):
        checks.qkv_prep(q, kv, positions, req_slots, inv_freq, q_out, window_cache, ring_size, eps, window_fmt)
        requests = pool_slots(window_cache, window_fmt) // ring_size
        _values.in_range("positions", positions, 0, None, "token positions")
        _values.in_range("req_slots", req_slots, -1, requests,
                         f"-1 or one of the {requests} requests of the window pool ({ring_size}-slot rings)")
        _values.distinct("positions", window_slots(positions, req_slots, ring_size),
                         f"window slots (one token per request and position % ring_size = {ring_size})")
        if window_fmt != formats.EXACT:  # as pack_kv: the rows stored (a padding token's may hold anything)
            _values.finite("kv", kv.masked_fill((req_slots < 0)[:, None], 0),
                           f"the live tokens' rows stored in format {window_fmt}: its scales come from each tile's "
                           f"amax")
    _qkv_prep(q, kv, positions, req_slots, inv_freq, q_out, window_cache, ring_size, eps, q_norm, window_fmt)
    return q_out
