"""DeepSeek-V4 attention configuration: the numbers of spec section 1, presets, and `from_hf`."""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass

import torch

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)


@dataclass(frozen=True)
class YarnConfig:
    """Frequency-only YaRN ("NTK-by-parts") of the compressed layers; no magnitude scale (spec 2)."""

    factor: float = 16.0
    original_max_position_embeddings: int = 65536
    beta_fast: float = 32.0
    beta_slow: float = 1.0


@dataclass(frozen=True)
class DSV4AttentionConfig:
    hidden_size: int = 4096
    num_layers: int = 43
    num_heads: int = 64
    head_dim: int = 512
    rope_head_dim: int = 64
    q_lora_rank: int = 1024
    o_groups: int = 8
    o_lora_rank: int = 1024
    window: int = 128
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    csa_ratio: int = 4
    hca_ratio: int = 128
    # One ratio per main layer: 0 sliding, csa_ratio CSA, hca_ratio HCA. The MTP layer is sliding.
    compress_ratios: tuple[int, ...] = ()
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    yarn: YarnConfig | None = YarnConfig()
    max_position_embeddings: int = 1048576
    rms_norm_eps: float = 1e-6
    num_mtp_layers: int = 1
    # MoE router numbers (the router lives beside attention in dsv4ops).
    vocab_size: int = 129280
    n_routed_experts: int = 256
    num_experts_per_tok: int = 6
    routed_scaling_factor: float = 1.5
    num_hash_layers: int = 3

    def __post_init__(self):
        # V4.1's config refuses the same (DSV41AttentionConfig._check_dims): a 0 here used to pass
        # and fail at the first forward (window 0) or select nothing (index_topk 0).
        for name in ("hidden_size", "num_layers", "num_heads", "head_dim", "q_lora_rank", "o_groups", "o_lora_rank",
                     "window", "index_n_heads", "index_head_dim", "index_topk", "csa_ratio", "hca_ratio"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name}: expected an int >= 1, got {value!r}")
        if not self.compress_ratios:
            object.__setattr__(self, "compress_ratios", _flash_schedule(self.num_layers, self.csa_ratio, self.hca_ratio))
        if len(self.compress_ratios) != self.num_layers:
            raise ValueError(
                f"compress_ratios: expected {self.num_layers} entries (num_layers), got {len(self.compress_ratios)}"
            )
        allowed = {0, self.csa_ratio, self.hca_ratio}
        bad = sorted(set(self.compress_ratios) - allowed)
        if bad:
            raise ValueError(f"compress_ratios: entries must be in {sorted(allowed)}, got {bad}")
        if self.rope_head_dim % 2 or self.rope_head_dim > self.head_dim or self.rope_head_dim > self.index_head_dim:
            raise ValueError(
                f"rope_head_dim: expected an even number <= head_dim ({self.head_dim}) and <= index_head_dim "
                f"({self.index_head_dim}), got {self.rope_head_dim}"
            )
        if self.num_heads % self.o_groups:
            raise ValueError(f"o_groups: expected a divisor of num_heads ({self.num_heads}), got {self.o_groups}")

    # ---- presets -------------------------------------------------------------------------------
    @classmethod
    def flash(cls) -> DSV4AttentionConfig:
        """DeepSeek-V4-Flash: 2 sliding layers, then CSA/HCA alternating (43 main layers)."""
        return cls()

    @classmethod
    def pro(cls) -> DSV4AttentionConfig:
        """DeepSeek-V4-Pro: 2 HCA layers, then CSA/HCA alternating (61 main layers)."""
        n = 61
        ratios = (128, 128) + tuple(4 if i % 2 == 0 else 128 for i in range(2, n))
        return cls(
            hidden_size=7168, num_layers=n, num_heads=128, q_lora_rank=1536, o_groups=16, index_topk=1024,
            compress_ratios=ratios, n_routed_experts=384,
        )

    @classmethod
    def tiny(cls, **overrides) -> DSV4AttentionConfig:
        """Test preset: V4 layout dims (head 512, rope 64, indexer 128, window 128, ratios 4/128),
        few heads and a small hidden size, so real layouts and the 127-mod-128 boundaries are hit."""
        base = dict(
            hidden_size=256, num_layers=4, num_heads=4, q_lora_rank=64, o_groups=2, o_lora_rank=64,
            index_n_heads=4, index_topk=16, compress_ratios=(0, 4, 128, 4), vocab_size=512,
            n_routed_experts=16, num_experts_per_tok=4,
        )
        base.update(overrides)
        return cls(**base)

    def replace(self, **changes) -> DSV4AttentionConfig:
        return dataclasses.replace(self, **changes)

    # ---- per-layer helpers ---------------------------------------------------------------------
    def compress_ratio(self, layer_idx: int) -> int:
        if isinstance(layer_idx, bool) or not isinstance(layer_idx, int) or not 0 <= layer_idx < self.num_layers:
            raise ValueError(f"layer_idx: expected an int in [0, {self.num_layers}) (num_layers), got {layer_idx!r}")
        return self.compress_ratios[layer_idx]

    def layer_type(self, layer_idx: int) -> str:
        ratio = self.compress_ratio(layer_idx)
        return SLIDING if ratio == 0 else CSA if ratio == self.csa_ratio else HCA

    def nope_head_dim(self) -> int:
        return self.head_dim - self.rope_head_dim

    def inv_freq(self, layer_idx: int) -> torch.Tensor:
        """fp32 [rope_head_dim/2]: theta 10000 without YaRN on sliding layers, compress_rope_theta with
        frequency-only YaRN on compressed layers (the same table serves Q, KV, compressed KV and indexer)."""
        if self.compress_ratio(layer_idx) == 0:
            return rope_inv_freq(self.rope_theta, self.rope_head_dim, None)
        return rope_inv_freq(self.compress_rope_theta, self.rope_head_dim, self.yarn)

    # ---- transformers interop ------------------------------------------------------------------
    @classmethod
    def from_hf(cls, hf_config) -> DSV4AttentionConfig:
        """Read a transformers `DeepseekV4Config`: `layer_types`, `compress_rates`,
        `rope_parameters["main"/"compress"]` and the partial rotary factor (not the legacy keys)."""
        missing = [k for k in _HF_KEYS if not hasattr(hf_config, k)]
        if missing:
            hint = (" (a config.json dict: DSV4AttentionConfig.from_hf(transformers.DeepseekV4Config(**d)))"
                    if isinstance(hf_config, Mapping) else "")
            raise TypeError(f"hf_config: expected a transformers DeepseekV4Config, got a {type(hf_config).__name__} "
                            f"without {', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}{hint}")
        rates = hf_config.compress_rates
        csa, hca = rates["compressed_sparse_attention"], rates["heavily_compressed_attention"]
        by_type = {SLIDING: 0, CSA: csa, HCA: hca}
        ratios = tuple(by_type[t] for t in hf_config.layer_types)
        main, comp = hf_config.rope_parameters["main"], hf_config.rope_parameters["compress"]
        rope_dim = int(hf_config.head_dim * comp.get("partial_rotary_factor", hf_config.partial_rotary_factor))
        if main.get("rope_type", "default") != "default":
            raise ValueError(f"rope_parameters['main']: expected rope_type 'default', got {main.get('rope_type')!r}")
        yarn = None
        if comp.get("rope_type", "default") == "yarn":
            if comp.get("attention_factor", 1.0) != 1.0:
                raise ValueError(
                    f"rope_parameters['compress']: V4 uses no YaRN magnitude scale, got attention_factor="
                    f"{comp['attention_factor']}"
                )
            yarn = YarnConfig(
                factor=float(comp["factor"]),
                original_max_position_embeddings=int(comp["original_max_position_embeddings"]),
                beta_fast=float(comp.get("beta_fast") or 32.0),
                beta_slow=float(comp.get("beta_slow") or 1.0),
            )
        mlp_types = getattr(hf_config, "mlp_layer_types", None) or []
        return cls(
            hidden_size=hf_config.hidden_size,
            num_layers=hf_config.num_hidden_layers,
            num_heads=hf_config.num_attention_heads,
            head_dim=hf_config.head_dim,
            rope_head_dim=rope_dim,
            q_lora_rank=hf_config.q_lora_rank,
            o_groups=hf_config.o_groups,
            o_lora_rank=hf_config.o_lora_rank,
            window=hf_config.sliding_window,
            index_n_heads=hf_config.index_n_heads,
            index_head_dim=hf_config.index_head_dim,
            index_topk=hf_config.index_topk,
            csa_ratio=csa,
            hca_ratio=hca,
            compress_ratios=ratios,
            rope_theta=float(main["rope_theta"]),
            compress_rope_theta=float(comp["rope_theta"]),
            yarn=yarn,
            max_position_embeddings=hf_config.max_position_embeddings,
            rms_norm_eps=hf_config.rms_norm_eps,
            num_mtp_layers=hf_config.num_nextn_predict_layers,
            vocab_size=hf_config.vocab_size,
            n_routed_experts=hf_config.n_routed_experts,
            num_experts_per_tok=hf_config.num_experts_per_tok,
            routed_scaling_factor=hf_config.routed_scaling_factor,
            num_hash_layers=sum(t == "hash_moe" for t in mlp_types),
        )


# The transformers DeepseekV4Config attributes from_hf reads (and mlp_layer_types where present).
_HF_KEYS = ("compress_rates", "layer_types", "rope_parameters", "partial_rotary_factor", "hidden_size",
            "num_hidden_layers", "num_attention_heads", "head_dim", "q_lora_rank", "o_groups", "o_lora_rank",
            "sliding_window", "index_n_heads", "index_head_dim", "index_topk", "max_position_embeddings",
            "rms_norm_eps", "num_nextn_predict_layers", "vocab_size", "n_routed_experts", "num_experts_per_tok",
            "routed_scaling_factor")


def _flash_schedule(n: int, csa: int, hca: int) -> tuple[int, ...]:
    return tuple(0 if i < 2 else (csa if i % 2 == 0 else hca) for i in range(n))


def rope_inv_freq(theta: float, rope_dim: int, yarn: YarnConfig | None) -> torch.Tensor:
    """Interleaved-pair inverse frequencies, fp32, computed with the same float ops as transformers so
    the tables agree bit for bit."""
    pos_freqs = theta ** (torch.arange(0, rope_dim, 2, dtype=torch.float) / rope_dim)
    if yarn is None:
        return 1.0 / pos_freqs

    def correction_dim(rotations: float) -> float:
        return rope_dim * math.log(yarn.original_max_position_embeddings / (rotations * 2 * math.pi)) / (
            2 * math.log(theta)
        )

    low = max(math.floor(correction_dim(yarn.beta_fast)), 0)
    high = min(math.ceil(correction_dim(yarn.beta_slow)), rope_dim - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(rope_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    return (1.0 / (yarn.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
