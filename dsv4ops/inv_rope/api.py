"""Public inv_rope: inverse RoPE of the attention output (spec 3.6).

Reference (the specification): dsv4ops/inv_rope/reference.py.
"""

import torch
from torch import Tensor

from dsv4ops import _values
from dsv4ops import ops as _ops  # noqa: F401  (defines the dsv4:: ops bound below)
from dsv4ops.inv_rope import checks

_inv_rope = torch.ops.dsv4.inv_rope.default


def inv_rope(o: Tensor, positions: Tensor, inv_freq: Tensor) -> Tensor:
    """o [T, H, D] (float, contiguous last dim), positions [T] int32 (>= 0, checked in eager mode),
    inv_freq [R/2] fp32 -> out [T, H, D] contiguous, o's dtype: o with its trailing R channels
    (interleaved pairs) rotated by -position x inv_freq; the other channels copied."""
    out = torch.empty(o.shape, dtype=o.dtype, device=o.device)
    if _values.has_data(o, positions):
        checks.inv_rope(o, positions, inv_freq, out)
        _values.in_range("positions", positions, 0, None, "token positions")
    _inv_rope(o, positions, inv_freq, out)
    return out
