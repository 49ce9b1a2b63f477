"""Fake of `dsv4::visible_entries`."""

import torch

from dsv4ops.visible_entries import checks


@torch.library.register_fake("dsv4::visible_entries")
def _(block_table, positions, req_slots, out, ratio, block_size):
    checks.visible_entries(block_table, positions, req_slots, out, ratio, block_size)
