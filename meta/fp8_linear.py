"""Fakes of `dsv4::fp8_linear` and `dsv4::fp8_linear_w8a8`."""

import torch

from dsv4ops.fp8_linear import checks


@torch.library.register_fake("dsv4::fp8_linear")
def _(x, weight, scale, out, block, groups=1, batch_invariant=False):
    checks.fp8_linear(x, weight, scale, out, block, groups)


@torch.library.register_fake("dsv4::fp8_linear_w8a8")
def _(x, weight, scale, out, block):
    checks.fp8_linear_w8a8(x, weight, scale, out, block)
