"""Fakes of the indexer ops."""

import torch

from dsv4ops.indexer import checks


@torch.library.register_fake("dsv4::indexer_q_prep")
def _(q, weights, positions, inv_freq, q_out, w_out, fmt, hadamard=False):
    checks.indexer_q_prep(q, weights, positions, inv_freq, q_out, w_out, fmt, hadamard)


@torch.library.register_fake("dsv4::indexer_k_prep")
def _(latent, positions, req_slots, entry_slots, wk, k_norm_weight, inv_freq, cache, ratio, eps, fmt,
      batch_invariant=False):
    checks.indexer_k_prep(latent, positions, req_slots, entry_slots, wk, k_norm_weight, inv_freq, cache, ratio, eps,
                          fmt)


@torch.library.register_fake("dsv4::indexer_topk")
def _(q, weights, positions, req_slots, cache, block_table, cand, idx_out, cand_out, workspace, ratio, cand_block, fmt):
    checks.indexer_topk(q, weights, positions, req_slots, cache, block_table, cand, idx_out, cand_out, workspace,
                        ratio, cand_block, fmt)
