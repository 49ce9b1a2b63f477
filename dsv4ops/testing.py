"""Test helpers: transformers interop, random weights, and reference-relative tolerances."""

from __future__ import annotations

import torch
from torch import Tensor

from dsv4ops.config import CSA, HCA, SLIDING, DSV4AttentionConfig


def hf_config(cfg: DSV4AttentionConfig, **overrides):
    """A transformers `DeepseekV4Config` with the same attention numbers (eager attention)."""
    from transformers import DeepseekV4Config

    by_ratio = {0: SLIDING, cfg.csa_ratio: CSA, cfg.hca_ratio: HCA}
    compress = {"rope_type": "default", "rope_theta": cfg.compress_rope_theta}
    if cfg.yarn is not None:
        compress = {
            "rope_type": "yarn", "rope_theta": cfg.compress_rope_theta, "factor": cfg.yarn.factor,
            "original_max_position_embeddings": cfg.yarn.original_max_position_embeddings,
            "beta_fast": cfg.yarn.beta_fast, "beta_slow": cfg.yarn.beta_slow, "attention_factor": 1.0,
        }
    prf = cfg.rope_head_dim / cfg.head_dim
    kwargs = dict(
        hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        head_dim=cfg.head_dim, q_lora_rank=cfg.q_lora_rank, o_groups=cfg.o_groups, o_lora_rank=cfg.o_lora_rank,
        sliding_window=cfg.window, index_n_heads=cfg.index_n_heads, index_head_dim=cfg.index_head_dim,
        index_topk=cfg.index_topk, layer_types=[by_ratio[r] for r in cfg.compress_ratios],
        compress_rates={CSA: cfg.csa_ratio, HCA: cfg.hca_ratio}, rope_theta=cfg.rope_theta,
        compress_rope_theta=cfg.compress_rope_theta, partial_rotary_factor=prf,
        rope_parameters={
            "main": {"rope_type": "default", "rope_theta": cfg.rope_theta, "partial_rotary_factor": prf},
            "compress": {**compress, "partial_rotary_factor": prf},
        },
        max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.rms_norm_eps,
        vocab_size=cfg.vocab_size, n_routed_experts=cfg.n_routed_experts,
        num_experts_per_tok=cfg.num_experts_per_tok, routed_scaling_factor=cfg.routed_scaling_factor,
    )
    kwargs.update(overrides)
    hf = DeepseekV4Config(**kwargs)
    hf._attn_implementation = "eager"
    return hf


def randomize_(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Random weights at scales that keep every branch of the layer numerically alive: unit-ish
    norms, sinks and position biases of order 1, projections ~ 1/sqrt(fan_in)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight"):
                v = 1.0 + 0.1 * torch.randn(p.shape, generator=g)
            elif name.endswith(("sinks", "position_bias")):
                v = torch.randn(p.shape, generator=g)
            else:
                v = torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5
            p.copy_(v.to(p.dtype))
    return module


def hf_attention(hf_layer, hf_cfg, x: Tensor) -> Tensor:
    """Drive transformers' DeepseekV4Attention the way its model does: rotary embeddings from
    DeepseekV4RotaryEmbedding and the mask from create_sliding_window_causal_mask (without a mask
    transformers drops the causality of compressed entries)."""
    from transformers.masking_utils import create_sliding_window_causal_mask
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

    b, s, _ = x.shape
    positions = torch.arange(s).unsqueeze(0).expand(b, -1)
    rotary = DeepseekV4RotaryEmbedding(hf_cfg)
    emb = {k: rotary(x, positions, layer_type=k) for k in ("main", "compress")}
    mask = create_sliding_window_causal_mask(
        config=hf_cfg, inputs_embeds=x, attention_mask=None, past_key_values=None, position_ids=positions
    )
    return hf_layer(x, position_embeddings=emb, position_ids=positions, attention_mask=mask)[0]


def assert_close_to_ref(out: Tensor, ref64: Tensor, lowp: Tensor, rtol: float = 2.0, what: str = "output"):
    """max|out - ref64| <= rtol * max|lowp - ref64| + one ulp (eps) band of the output dtype:
    the error budget is the error of a low-precision run of the reference (FA's rule), plus the
    rounding of the output itself."""
    ref = ref64.double()
    err = (out.double() - ref).abs().max().item()
    budget = (lowp.double() - ref).abs().max().item()
    band = 0.0 if out.dtype == torch.float64 else torch.finfo(out.dtype).eps * ref.abs().max().item()
    assert err <= rtol * budget + band, f"{what}: max abs err {err:.3e} > {rtol} x {budget:.3e} + {band:.3e}"
    return err, budget
