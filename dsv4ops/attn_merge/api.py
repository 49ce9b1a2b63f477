"""Public attn_merge: the sink attention of a context-parallel step from its shards' partials.

Reference (the specification): dsv4ops/attn_merge/reference.py.
"""

import torch
from torch import Tensor

from dsv4ops import ops as _ops  # noqa: F401  (defines the dsv4:: ops bound below)

_attn_merge = torch.ops.dsv4.attn_merge.default


def attn_merge(partials: Tensor, lse: Tensor, sinks: Tensor) -> Tensor:
    """partials [R, T, H, D] (each shard's output normalized over its own keys without the sink, as
    dsv4ops.sparse_attn.api.sparse_attn(..., return_lse=True) returns it; float, contiguous last
    dim), lse [R, T, H] fp32 (natural log of each shard's sum of e^(scaled logit); -inf: no key),
    sinks [H] fp32 -> out [T, H, D] in partials' dtype: sum_r e^(lse_r - M) partials_r /
    (sum_r e^(lse_r - M) + e^(sink - M)), M = max(lse_r, sink), the attention over every shard's
    keys with the sink counted once; 0 for a query no shard has a key for. Shapes, dtypes and
    devices are checked by the op."""
    out = torch.empty(partials.shape[1:], dtype=partials.dtype, device=partials.device)
    _attn_merge(partials, lse, sinks, out)
    return out
