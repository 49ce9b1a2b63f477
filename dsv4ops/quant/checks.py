"""Metadata rules of `dsv4::pack_kv` and `dsv4::unpack_kv`."""

from torch import Tensor

from dsv4ops import _checks as c


def pack_kv(x: Tensor, slots: Tensor, cache: Tensor, fmt: str):
    c.ndim("x", x, 2, "[rows, dim]")
    c.dtype("x", x, c.FLOATS)
    c.index_vector("slots", slots, x.shape[0], x, "x")
    c.paged_cache("cache", cache, x.shape[1], x, fmt, "fmt")


def unpack_kv(cache: Tensor, slots: Tensor, out: Tensor, fmt: str):
    c.ndim("out", out, 2, "[rows, dim]")
    c.dtype("out", out, c.FLOATS)
    c.index_vector("slots", slots, out.shape[0], out, "out")
    c.paged_cache("cache", cache, out.shape[1], out, fmt, "fmt")
