"""Fake of `dsv4::inv_rope`."""

import torch

from dsv4ops.inv_rope import checks


@torch.library.register_fake("dsv4::inv_rope")
def _(o, positions, inv_freq, out):
    checks.inv_rope(o, positions, inv_freq, out)
