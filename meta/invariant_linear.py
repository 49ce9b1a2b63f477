"""Fake of `dsv4::invariant_linear`."""

import torch

from dsv4ops.invariant_linear import checks


@torch.library.register_fake("dsv4::invariant_linear")
def _(x, weight, out):
    checks.invariant_linear(x, weight, out)
