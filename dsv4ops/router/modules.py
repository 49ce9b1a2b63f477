"""Drop-in V4 MoE routers: transformers' DeepseekV4TopKRouter / DeepseekV4HashRouter parameter and
buffer names and outputs (logits, weights, indices), built on dsv4ops.router.api.

`config` is a dsv4ops.DSV4AttentionConfig or a transformers DeepseekV4Config (both name the fields
n_routed_experts, num_experts_per_tok, routed_scaling_factor, hidden_size, vocab_size). Differences:
logits are fp32 whatever the weight dtype (transformers returns the weight dtype), and gate indices
come sorted by descending score + bias (transformers' topk is unsorted: same set).
"""

import math

import torch
from torch import Tensor, nn

from dsv4ops.router import api


def _check_scoring(config):
    scoring = getattr(config, "scoring_func", "sqrtsoftplus")
    if scoring != "sqrtsoftplus":
        raise ValueError(f"config.scoring_func: expected 'sqrtsoftplus' (the V4 router), got {scoring!r}")


class _Gate(nn.Module):
    """The learned gate both routers share: `weight` [experts, hidden] and the routing numbers.
    batch_invariant: a token's outputs do not depend on the other tokens of the call (the gate
    GEMM by dsv4::invariant_linear; dsv4ops.router.api.router_gate)."""

    def __init__(self, config, batch_invariant: bool = False):
        super().__init__()
        _check_scoring(config)
        if not isinstance(batch_invariant, bool):
            raise TypeError(f"batch_invariant: expected a bool, got {type(batch_invariant).__name__}")
        self.batch_invariant = batch_invariant
        self.top_k = config.num_experts_per_tok
        self.num_experts = config.n_routed_experts
        self.hidden_dim = config.hidden_size
        self.routed_scaling_factor = config.routed_scaling_factor
        self.weight = nn.Parameter(torch.empty(self.num_experts, self.hidden_dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """As nn.Linear(hidden, experts) initialises its weight (checkpoints overwrite it)."""
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))


class DeepseekV4Router(_Gate):
    """Learned top-k gate: scores sqrt(softplus(x @ weight.T)), experts by score + e_score_correction_bias."""

    def __init__(self, config, batch_invariant: bool = False):
        super().__init__(config, batch_invariant)
        self.e_score_correction_bias = nn.Buffer(torch.zeros(self.num_experts))

    def forward(self, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        flat = hidden_states.reshape(-1, self.hidden_dim)
        # .float(): a model cast to bf16 casts this buffer too; the selection key is fp32.
        bias = self.e_score_correction_bias.float()
        return api.router_gate(flat, self.weight, bias, self.top_k, self.routed_scaling_factor, self.batch_invariant)


class DeepseekV4HashRouter(_Gate):
    """Hash routing of the first MoE layers: experts = tid2eid[input_ids] (a frozen table), weighted by
    the learned gate's renormalised scores."""

    def __init__(self, config, batch_invariant: bool = False):
        super().__init__(config, batch_invariant)
        self.tid2eid = nn.Buffer(torch.zeros(config.vocab_size, self.top_k, dtype=torch.long), persistent=True)

    def forward(self, hidden_states: Tensor, input_ids: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        logits = api.gate_logits(hidden_states.reshape(-1, self.hidden_dim), self.weight, self.batch_invariant)
        weights, indices = api.hash_route(logits, input_ids.reshape(-1), self.tid2eid, self.routed_scaling_factor)
        return logits, weights, indices
