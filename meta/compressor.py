"""Fake of `dsv4::compressor_update`."""

import torch

from dsv4ops.compressor import checks


@torch.library.register_fake("dsv4::compressor_update")
def _(kv, score, ape, positions, req_slots, entry_slots, norm_weight, inv_freq, state, cache, latent_out, eps, fmt,
      hadamard=False, batch_invariant=False):
    checks.compressor_update(kv, score, ape, positions, req_slots, entry_slots, norm_weight, inv_freq, state, cache,
                             latent_out, eps, fmt, hadamard)
