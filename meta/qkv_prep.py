"""Fake of `dsv4::qkv_prep`."""

import torch

from dsv4ops.qkv_prep import checks


@torch.library.register_fake("dsv4::qkv_prep")
def _(q, kv, positions, req_slots, inv_freq, q_out, window_cache, ring_size, eps, q_norm, window_fmt):
    checks.qkv_prep(q, kv, positions, req_slots, inv_freq, q_out, window_cache, ring_size, eps, window_fmt)
