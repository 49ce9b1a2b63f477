"""Metadata rules of `dsv4::inv_rope`."""

from torch import Tensor

from dsv4ops import _checks as c


def inv_rope(o: Tensor, positions: Tensor, inv_freq: Tensor, out: Tensor):
    c.ndim("o", o, 3, "[tokens, heads, head_dim]")
    c.dtype("o", o, c.FLOATS)
    c.last_dim_contiguous("o", o)
    c.index_vector("positions", positions, o.shape[0], o, "o")
    c.rope_table(inv_freq, o.shape[2], o)
    c.like("out", out, o, "o")
    c.dtype("out", out, (o.dtype,))
    c.last_dim_contiguous("out", out)
