"""Fakes of the cache-entry ops."""

import torch

from dsv4ops.quant import checks


@torch.library.register_fake("dsv4::pack_kv")
def _(x, slots, cache, fmt):
    checks.pack_kv(x, slots, cache, fmt)


@torch.library.register_fake("dsv4::unpack_kv")
def _(cache, slots, out, fmt):
    checks.unpack_kv(cache, slots, out, fmt)
