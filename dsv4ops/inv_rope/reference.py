"""Reference kernel of `dsv4::inv_rope`: rotate the trailing rope dims of each head's output by
-t x theta (K = V carries rotated channels; this makes each value's rope part relative)."""

from torch import Tensor

from dsv4ops.reference.functional import apply_rope, rope_angles


def inv_rope(o: Tensor, positions: Tensor, inv_freq: Tensor, out: Tensor) -> None:
    cos, sin = rope_angles(positions, inv_freq, o.dtype)
    out.copy_(apply_rope(o, cos[:, None], sin[:, None], inverse=True))
