"""Fake of `dsv4::sparse_attn`."""

import torch

from dsv4ops.sparse_attn import checks


@torch.library.register_fake("dsv4::sparse_attn")
def _(q, window_cache, comp_cache, positions, req_slots, comp_idx, comp_lens, window_ends, sinks, out, scale, window,
      ring_size, window_fmt, comp_fmt, lse=None, batch_invariant=False):
    checks.sparse_attn(q, window_cache, comp_cache, positions, req_slots, comp_idx, comp_lens, window_ends, sinks, out,
                       scale, window, ring_size, window_fmt, comp_fmt, lse)
