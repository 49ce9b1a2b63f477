"""The weight holders of a V4 attention layer (transformers' module tree and parameter names): the
math lives in the ops, the reference and dsv4ops.layers."""

from __future__ import annotations

import math

import torch
from torch import nn

from dsv4ops.config import DSV4AttentionConfig


class RMSNorm(nn.Module):
    """Weight holder of a V4 RMSNorm (the math lives in the ops and the reference)."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))


class GroupedLinear(nn.Module):
    """Block-diagonal `o_a_proj`: weight [groups * out_per_group, in_per_group] (transformers' layout),
    initialised as nn.Linear initialises a weight of that shape (each output reads in_per_group inputs)."""

    def __init__(self, in_per_group: int, out_features: int, groups: int):
        super().__init__()
        self.groups = groups
        self.weight = nn.Parameter(torch.empty(out_features, in_per_group))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))


def linear(n_in: int, n_out: int) -> nn.Linear:
    return nn.Linear(n_in, n_out, bias=False)


class Indexer(nn.Module):
    """Lightning Indexer weights of a CSA layer (its own 128-d compressor, query projection, head weights)."""

    def __init__(self, cfg: DSV4AttentionConfig):
        super().__init__()
        d = cfg.index_head_dim
        self.kv_proj = linear(cfg.hidden_size, 2 * d)
        self.gate_proj = linear(cfg.hidden_size, 2 * d)
        self.position_bias = nn.Parameter(torch.zeros(cfg.csa_ratio, 2 * d))
        self.kv_norm = RMSNorm(d)
        self.q_b_proj = linear(cfg.q_lora_rank, cfg.index_n_heads * d)
        self.scorer = nn.Module()
        self.scorer.weights_proj = linear(cfg.hidden_size, cfg.index_n_heads)


class Compressor(nn.Module):
    """Main KV compressor of a CSA (2d-wide, overlapping windows) or HCA (d-wide) layer."""

    def __init__(self, cfg: DSV4AttentionConfig, ratio: int):
        super().__init__()
        width = (2 if ratio == cfg.csa_ratio else 1) * cfg.head_dim
        self.kv_proj = linear(cfg.hidden_size, width)
        self.gate_proj = linear(cfg.hidden_size, width)
        self.position_bias = nn.Parameter(torch.zeros(ratio, width))
        self.kv_norm = RMSNorm(cfg.head_dim)
        if ratio == cfg.csa_ratio:
            self.indexer = Indexer(cfg)
