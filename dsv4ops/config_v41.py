"""DeepSeek-V4.1 attention configuration (dsv41-attention-spec.md section 1): the numbers, the layer
roles of section 1.2 resolved as data, presets, and `from_hf` for a V4.1 `text_config`.

V4.1 shares compressed KV, index keys and top-k across layers, so a layer's role decides which caches
it owns and which it reads. `roles[L]` answers that once for every layer (backbone and draft).
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from dsv4ops.config import YarnConfig, rope_inv_freq

# Released V4.1-Flash schedule (spec 1.1): 2 sliding, 18 ratio-2 ("encoder"), 20 ratio-1 ("decoder"), 3 draft.
FLASH_RATIOS = (0, 0) + (2,) * 18 + (1,) * 20 + (0, 0, 0)


@dataclass(frozen=True)
class LayerRole:
    """What layer `layer` does (spec 1.2). kv_source / index_source: the layers whose compressed
    entries and whose top-k it reads (None for a sliding layer)."""

    layer: int
    ratio: int
    kv_source: int | None
    index_source: int | None
    owns_compressor: bool  # a KV source: compressor weights, compressed pool (and state if ratio > 1)
    owns_index_keys: bool  # a KV source that is also an index source: wk, k_norm, the index-key pool
    indexer: bool  # an index source: scores and publishes the top-k of its group
    reindex: bool  # an index source that is not a KV source: scores the keys of its KV source
    candidate_source: bool  # publishes the candidate-block pool
    uses_candidates: bool  # an index source after the candidate source: scores inside the pool
    reuse: bool  # ratio > 0, no compressor and no indexer: reads its sources' entries and top-k
    sliding: bool  # ratio 0: window only

    @property
    def kind(self) -> str:
        """One word for tables and test ids."""
        if self.sliding:
            return "sliding"
        if self.owns_compressor:
            return "source+candidate" if self.candidate_source else "source"
        if self.reindex:
            return "reindex+pool" if self.uses_candidates else "reindex"
        return "reuse"


def _runs_first(ratios, n: int) -> tuple[int, ...]:
    """The first layer of every run of equal ratio > 0 among the backbone layers (HF's default)."""
    return tuple(i for i in range(n) if ratios[i] > 0 and (i == 0 or ratios[i - 1] != ratios[i]))


@dataclass(frozen=True)
class DSV41AttentionConfig:
    hidden_size: int = 5120
    num_layers: int = 40  # backbone layers; draft layers (num_nextn_layers) follow them
    num_nextn_layers: int = 3
    num_heads: int = 64
    head_dim: int = 512
    rope_head_dim: int = 64
    q_lora_rank: int = 1280
    o_groups: int = 8
    o_lora_rank: int = 1024
    window: int = 128
    # One ratio per layer, draft layers included (num_layers + num_nextn_layers entries; a list of
    # num_layers .. num_layers + num_nextn_layers entries is padded, draft entries forced to 0).
    compress_ratios: tuple[int, ...] = FLASH_RATIOS
    kv_source_layers: tuple[int, ...] = (2, 8, 14, 20)
    index_source_layers: tuple[int, ...] = (2, 8, 14, 20, 24, 28, 32, 36)
    candidate_source_layer: int = 20  # negative: no candidate pool
    candidate_topk_blocks: int = 2048
    candidate_block_size: int = 8
    index_n_heads: int = 32
    index_head_dim: int = 128
    index_topk: int = 512
    rope_theta: float = 10000.0
    compress_rope_theta: float = 160000.0
    yarn: YarnConfig | None = YarnConfig()
    max_position_embeddings: int = 1048576
    rms_norm_eps: float = 1e-20
    dspark_block_size: int = 5
    roles: tuple[LayerRole, ...] = field(init=False, repr=False, compare=False)

    def __post_init__(self):
        n, nn = self.num_layers, self.num_nextn_layers
        if n < 1 or nn < 0:
            raise ValueError(f"num_layers, num_nextn_layers: expected >= 1 and >= 0, got {n}, {nn}")
        ratios = tuple(int(r) for r in self.compress_ratios)
        if not n <= len(ratios) <= n + nn:
            raise ValueError(f"compress_ratios: expected {n} to {n + nn} entries (num_layers .. + "
                             f"num_nextn_layers), got {len(ratios)}")
        if any(r < 0 for r in ratios):
            raise ValueError(f"compress_ratios: expected ratios >= 0, got {ratios}")
        # HF: the draft layers' entries are forced to 0.
        object.__setattr__(self, "compress_ratios", ratios[:n] + (0,) * nn)
        for name in ("kv_source_layers", "index_source_layers"):
            layers = tuple(int(i) for i in getattr(self, name))
            if list(layers) != sorted(set(layers)) or any(not 0 <= i < n for i in layers):
                raise ValueError(f"{name}: expected distinct increasing backbone layers in [0, {n}), got {layers}")
            object.__setattr__(self, name, layers)
        self._check_dims()
        self._check_roles()
        object.__setattr__(self, "roles", tuple(self._role(i) for i in range(n + nn)))

    # ---- validation (spec 1.5: HF's rules, then the invariants the math needs) ----------------
    def _check_dims(self):
        for name in ("hidden_size", "num_heads", "q_lora_rank", "o_groups", "o_lora_rank", "window", "index_n_heads",
                     "index_topk", "candidate_topk_blocks", "candidate_block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name}: expected >= 1, got {getattr(self, name)}")
        for name in ("head_dim", "index_head_dim"):
            if getattr(self, name) % 32:
                raise ValueError(f"{name}: expected a multiple of 32 (the FP8 / FP4 cache tiles; transformers "
                                 f"silently skips the fake quantization otherwise), got {getattr(self, name)}")
        if self.rope_head_dim % 2 or not 0 < self.rope_head_dim <= min(self.head_dim, self.index_head_dim):
            raise ValueError(f"rope_head_dim: expected an even number <= head_dim ({self.head_dim}) and <= "
                             f"index_head_dim ({self.index_head_dim}), got {self.rope_head_dim}")
        if self.num_heads % self.o_groups:
            raise ValueError(f"o_groups: expected a divisor of num_heads ({self.num_heads}), got {self.o_groups}")

    def _check_roles(self):
        ratios, kv, idx, cand = self.compress_ratios, self.kv_source_layers, self.index_source_layers, \
            self.candidate_source_layer
        for name, layers in (("kv_source_layers", kv), ("index_source_layers", idx)):
            zero = [i for i in layers if ratios[i] == 0]
            if zero:
                raise ValueError(f"{name}: expected layers with compress ratio > 0, got layer {zero[0]} (ratio 0)")
        for i in idx:
            if not any(s <= i for s in kv):
                raise ValueError(f"index_source_layers: layer {i} has no KV source at or before it "
                                 f"(kv_source_layers {kv})")
        if cand >= 0 and cand not in idx:
            raise ValueError(f"candidate_source_layer: expected one of the index sources {idx}, got {cand}")
        for i in range(self.num_layers):
            if ratios[i] == 0:
                continue
            src = max((s for s in kv if s <= i), default=None)
            if src is None:
                raise ValueError(f"kv_source_layers: layer {i} (ratio {ratios[i]}) has no KV source at or before it "
                                 f"(kv_source_layers {kv})")
            # Entry w covers positions [w m, (w + 1) m) of the source; a reader with another ratio would
            # see other entries (visibility uses the reader's ratio, spec 1.5).
            if ratios[i] != ratios[src]:
                raise ValueError(f"compress_ratios: layer {i} has ratio {ratios[i]} but reads the compressed KV of "
                                 f"layer {src} (ratio {ratios[src]}); every layer of a KV group needs its source's ratio")
        for s in kv:
            # The group's top-k and index keys come from its source: a reindex layer after a source that
            # made no keys would read another group's (or stale) keys, a reuse layer another group's top-k.
            if s not in idx:
                raise ValueError(f"index_source_layers: KV source {s} must also be an index source (its group's "
                                 f"index keys and top-k come from it), got index sources {idx}")
        if cand >= 0:
            group = max(s for s in kv if s <= cand)
            for i in idx:
                if i > cand and max(s for s in kv if s <= i) != group:
                    raise ValueError(f"candidate_source_layer: index source {i} would score inside the candidate "
                                     f"pool of layer {cand}, whose entries belong to KV source {group}, but reads "
                                     f"the keys of KV source {max(s for s in kv if s <= i)}")

    def _role(self, i: int) -> LayerRole:
        ratio = self.compress_ratios[i]
        if ratio == 0 or i >= self.num_layers:
            return LayerRole(i, 0, None, None, False, False, False, False, False, False, False, True)
        kv, idx, cand = self.kv_source_layers, self.index_source_layers, self.candidate_source_layer
        src = max(s for s in kv if s <= i)
        isrc = max(s for s in idx if s <= i)
        owns, indexer = i in kv, i in idx
        return LayerRole(
            layer=i, ratio=ratio, kv_source=src, index_source=isrc, owns_compressor=owns,
            owns_index_keys=owns and indexer, indexer=indexer, reindex=indexer and not owns,
            candidate_source=i == cand, uses_candidates=indexer and 0 <= cand < i, reuse=not owns and not indexer,
            sliding=False,
        )

    # ---- presets -------------------------------------------------------------------------------
    @classmethod
    def v41_flash(cls) -> DSV41AttentionConfig:
        """DeepSeek-V4.1-Flash (spec 1.1 / 1.3)."""
        return cls()

    @classmethod
    def tiny(cls, **overrides) -> DSV41AttentionConfig:
        """Test preset (spec 1.5): every role at short length. The kernels' fixed widths stay (head 512,
        rope 64, index dim 128, 8 heads per output group); counts shrink: 10 layers, ratios
        0 2 2 2 2 1 1 1 1 1, KV sources 1 3 5, index sources 1 3 5 7 (7 reindexes inside the pool of
        5), window 16, top-8, candidate pool 4 blocks x 4 entries (16). At T = 64..128 tokens:
        T > window, T / 2 > index_topk, T > pool."""
        base = dict(
            hidden_size=128, num_layers=10, num_nextn_layers=0, num_heads=16, q_lora_rank=64, o_groups=2,
            o_lora_rank=64, window=16, compress_ratios=(0, 2, 2, 2, 2, 1, 1, 1, 1, 1), kv_source_layers=(1, 3, 5),
            index_source_layers=(1, 3, 5, 7), candidate_source_layer=5, candidate_topk_blocks=4,
            candidate_block_size=4, index_n_heads=4, index_topk=8,
        )
        base.update(overrides)
        return cls(**base)

    def replace(self, **changes) -> DSV41AttentionConfig:
        return dataclasses.replace(self, **changes)

    # ---- per-layer helpers ---------------------------------------------------------------------
    def compress_ratio(self, layer_idx: int) -> int:
        return self.compress_ratios[layer_idx]

    def role(self, layer_idx: int) -> LayerRole:
        return self.roles[layer_idx]

    @property
    def candidate_pool(self) -> int:
        """Entries of a full candidate pool: candidate_topk_blocks x candidate_block_size."""
        return self.candidate_topk_blocks * self.candidate_block_size

    def inv_freq(self, layer_idx: int) -> torch.Tensor:
        """fp32 [rope_head_dim / 2]: the "main" table (theta 10000, no YaRN) for ratio 0, the "compress"
        table (compress_rope_theta + YaRN) for every ratio >= 1, ratio 1 included (spec 3, pitfall 3)."""
        if self.compress_ratios[layer_idx] == 0:
            return rope_inv_freq(self.rope_theta, self.rope_head_dim, None)
        return rope_inv_freq(self.compress_rope_theta, self.rope_head_dim, self.yarn)

    # ---- transformers interop ------------------------------------------------------------------
    @classmethod
    def from_hf(cls, config) -> DSV41AttentionConfig:
        """Read a V4.1 `text_config` (the installed transformers has no V4.1 class): a mapping (the
        text_config itself or a whole config with a "text_config" key), a path to a JSON file of
        either, or a config object (its attributes). Fields that HF may omit take HF's defaults:
        compress_ratios (2 sliding, then (n - 1) // 2 layers of ratio 2, the rest ratio 1),
        kv_source_layer_ids (the first layer of every run of equal ratio > 0), index_source_layer_ids
        (= the KV sources), candidate_source_layer_id (the last KV source, -1 if none)."""
        cfg = _as_mapping(config)
        n = int(cfg["num_hidden_layers"])
        nn = int(cfg.get("num_nextn_predict_layers", 0) or 0)
        ratios = cfg.get("compress_ratios")
        if ratios is None:
            n_slide = min(2, n)
            n_enc = max(0, (n - n_slide + 1) // 2)
            ratios = [0] * n_slide + [2] * n_enc + [1] * (n - n_slide - n_enc)
        ratios = tuple(int(r) for r in ratios)
        kv = cfg.get("kv_source_layer_ids")
        kv = tuple(kv) if kv is not None else _runs_first(ratios, min(n, len(ratios)))
        idx = cfg.get("index_source_layer_ids")
        idx = tuple(idx) if idx is not None else kv
        cand = cfg.get("candidate_source_layer_id")
        cand = int(cand) if cand is not None else (kv[-1] if kv else -1)
        if int(cfg.get("num_key_value_heads", 1)) != 1:
            raise ValueError(f"num_key_value_heads: V4.1 has one shared K = V latent, got {cfg['num_key_value_heads']}")
        main_theta, comp_theta, yarn = _rope(cfg)
        rope_dim = int(cfg.get("qk_rope_head_dim") or round(cfg["head_dim"] * cfg.get("partial_rotary_factor", 0)))
        defaults = cls.__dataclass_fields__
        return cls(
            hidden_size=int(cfg["hidden_size"]), num_layers=n, num_nextn_layers=nn,
            num_heads=int(cfg["num_attention_heads"]), head_dim=int(cfg["head_dim"]), rope_head_dim=rope_dim,
            q_lora_rank=int(cfg["q_lora_rank"]), o_groups=int(cfg["o_groups"]), o_lora_rank=int(cfg["o_lora_rank"]),
            window=int(cfg["sliding_window"]), compress_ratios=ratios, kv_source_layers=kv, index_source_layers=idx,
            candidate_source_layer=cand,
            candidate_topk_blocks=int(cfg.get("candidate_topk_blocks", defaults["candidate_topk_blocks"].default)),
            candidate_block_size=int(cfg.get("candidate_block_size", defaults["candidate_block_size"].default)),
            index_n_heads=int(cfg["index_n_heads"]), index_head_dim=int(cfg["index_head_dim"]),
            index_topk=int(cfg["index_topk"]), rope_theta=main_theta, compress_rope_theta=comp_theta, yarn=yarn,
            max_position_embeddings=int(cfg.get("max_position_embeddings", defaults["max_position_embeddings"].default)),
            rms_norm_eps=float(cfg["rms_norm_eps"]),
            dspark_block_size=int(cfg.get("dspark_block_size", defaults["dspark_block_size"].default)),
        )


def _as_mapping(config) -> Mapping:
    if isinstance(config, (str, os.PathLike)):
        with open(config) as f:
            config = json.load(f)
    elif not isinstance(config, Mapping):
        config = config.to_dict() if hasattr(config, "to_dict") else vars(config)
    config = config.get("text_config", config)
    if not isinstance(config, Mapping):
        config = config.to_dict() if hasattr(config, "to_dict") else vars(config)
    missing = [k for k in ("num_hidden_layers", "hidden_size", "num_attention_heads", "head_dim", "q_lora_rank",
                           "o_groups", "o_lora_rank", "sliding_window", "index_n_heads", "index_head_dim",
                           "index_topk", "rms_norm_eps") if k not in config]
    if missing:
        raise ValueError(f"config: expected a V4.1 text_config with {missing} (got keys {sorted(config)[:12]} ...)")
    return config


def _rope(cfg: Mapping) -> tuple[float, float, YarnConfig | None]:
    """(main theta, compress theta, compress YaRN) from `rope_parameters` {"main", "compress"} (HF's
    save format) or the legacy `rope_theta` / `compress_rope_theta` / `rope_scaling`."""
    params = cfg.get("rope_parameters") or {}
    main = params.get("main") or {}
    comp = params.get("compress") or cfg.get("rope_scaling") or {}
    main_theta = float(main.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    comp_theta = float(comp.get("rope_theta", cfg.get("compress_rope_theta", 160000.0)))
    if main.get("rope_type", "default") not in ("default", None):
        raise ValueError(f"rope_parameters['main']: expected rope_type 'default', got {main.get('rope_type')!r}")
    kind = comp.get("rope_type", comp.get("type", "default"))
    if kind in ("default", None):
        return main_theta, comp_theta, None
    if kind != "yarn":
        raise ValueError(f"rope_parameters['compress']: expected rope_type 'yarn' or 'default', got {kind!r}")
    if float(comp.get("attention_factor") or 1.0) != 1.0:
        raise ValueError(f"rope_parameters['compress']: V4.1 uses no YaRN magnitude scale (transformers forces "
                         f"attention_factor 1.0), got {comp['attention_factor']}")
    yarn = YarnConfig(factor=float(comp["factor"]),
                      original_max_position_embeddings=int(comp["original_max_position_embeddings"]),
                      beta_fast=float(comp.get("beta_fast") or 32.0), beta_slow=float(comp.get("beta_slow") or 1.0))
    return main_theta, comp_theta, yarn
