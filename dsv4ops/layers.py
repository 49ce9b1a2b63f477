"""Drop-in layers. Parameter names equal transformers' `DeepseekV4Attention`, so
`layer.load_state_dict(hf_layer.state_dict(), strict=True)` works."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dsv4ops.config import CSA, SLIDING, DSV4AttentionConfig
from dsv4ops.reference.numerics import Numerics


class RMSNorm(nn.Module):
    """Weight holder of a V4 RMSNorm (the math lives in the ops and the reference)."""

    def __init__(self, dim: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))


class GroupedLinear(nn.Module):
    """Block-diagonal `o_a_proj`: weight [groups * out_per_group, in_per_group] (transformers' layout)."""

    def __init__(self, in_per_group: int, out_features: int, groups: int):
        super().__init__()
        self.groups = groups
        self.weight = nn.Parameter(torch.empty(out_features, in_per_group))


def _linear(n_in: int, n_out: int) -> nn.Linear:
    return nn.Linear(n_in, n_out, bias=False)


class Indexer(nn.Module):
    """Lightning Indexer weights of a CSA layer (its own 128-d compressor, query projection, head weights)."""

    def __init__(self, cfg: DSV4AttentionConfig):
        super().__init__()
        d = cfg.index_head_dim
        self.kv_proj = _linear(cfg.hidden_size, 2 * d)
        self.gate_proj = _linear(cfg.hidden_size, 2 * d)
        self.position_bias = nn.Parameter(torch.zeros(cfg.csa_ratio, 2 * d))
        self.kv_norm = RMSNorm(d)
        self.q_b_proj = _linear(cfg.q_lora_rank, cfg.index_n_heads * d)
        self.scorer = nn.Module()
        self.scorer.weights_proj = _linear(cfg.hidden_size, cfg.index_n_heads)


class Compressor(nn.Module):
    """Main KV compressor of a CSA (2d-wide, overlapping windows) or HCA (d-wide) layer."""

    def __init__(self, cfg: DSV4AttentionConfig, ratio: int):
        super().__init__()
        width = (2 if ratio == cfg.csa_ratio else 1) * cfg.head_dim
        self.kv_proj = _linear(cfg.hidden_size, width)
        self.gate_proj = _linear(cfg.hidden_size, width)
        self.position_bias = nn.Parameter(torch.zeros(ratio, width))
        self.kv_norm = RMSNorm(cfg.head_dim)
        if ratio == cfg.csa_ratio:
            self.indexer = Indexer(cfg)


class DeepseekV4Attention(nn.Module):
    """One DeepSeek-V4 attention layer (sliding window, CSA or HCA by `layer_idx`).

    `config` is a `DSV4AttentionConfig` or a transformers `DeepseekV4Config`. `numerics` picks the
    rounding of the main KV and indexer (see `dsv4ops.reference.numerics`); exact = transformers.

    forward(hidden_states [B, S, hidden]) -> [B, S, hidden]: causal attention over each sequence
    from position 0 (stateless)."""

    def __init__(self, config, layer_idx: int, numerics: Numerics = Numerics()):
        super().__init__()
        cfg = config if isinstance(config, DSV4AttentionConfig) else DSV4AttentionConfig.from_hf(config)
        self.config, self.layer_idx, self.numerics = cfg, layer_idx, numerics
        self.layer_type = cfg.layer_type(layer_idx)
        h, d = cfg.num_heads, cfg.head_dim
        self.q_a_proj = _linear(cfg.hidden_size, cfg.q_lora_rank)
        self.q_a_norm = RMSNorm(cfg.q_lora_rank)
        self.q_b_proj = _linear(cfg.q_lora_rank, h * d)
        self.kv_proj = _linear(cfg.hidden_size, d)
        self.kv_norm = RMSNorm(d)
        self.o_a_proj = GroupedLinear(h * d // cfg.o_groups, cfg.o_groups * cfg.o_lora_rank, cfg.o_groups)
        self.o_b_proj = _linear(cfg.o_groups * cfg.o_lora_rank, cfg.hidden_size)
        self.sinks = nn.Parameter(torch.zeros(h))
        self.compressor = None if self.layer_type == SLIDING else Compressor(cfg, cfg.compress_ratio(layer_idx))
        self.register_buffer("inv_freq", cfg.inv_freq(layer_idx), persistent=False)

    @property
    def is_csa(self) -> bool:
        return self.layer_type == CSA

    def forward(self, hidden_states: Tensor, step=None) -> Tensor:
        from dsv4ops import reference

        if step is not None:
            raise NotImplementedError("step: the serving path is not built yet")
        return reference.attention(dict(self.named_parameters()), self.config, self.layer_idx, hidden_states,
                                   self.numerics)
