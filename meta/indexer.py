"""Fakes of the Lightning Indexer ops."""

import torch

from dsv4ops.indexer import checks


@torch.library.register_fake("dsv4::indexer_q_prep")
def _(q, weights, positions, inv_freq, q_out, w_out):
    checks.indexer_q_prep(q, weights, positions, inv_freq, q_out, w_out)


@torch.library.register_fake("dsv4::indexer_topk")
def _(q, weights, positions, req_slots, cache, block_table, idx_out, workspace, ratio):
    checks.indexer_topk(q, weights, positions, req_slots, cache, block_table, idx_out, workspace, ratio)
