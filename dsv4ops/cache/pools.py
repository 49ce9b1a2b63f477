"""The per-layer cache module: its pools are non-persistent buffers (a strict `load_state_dict`
of the weights ignores them), allocated once and never reassigned (CUDA graphs keep their address)."""

import torch
from torch import nn

from dsv4ops.cache.config import CacheConfig, layer_pools, topk_workspace_words
from dsv4ops.config import CSA, SLIDING, DSV4AttentionConfig


class LayerCache(nn.Module):
    """Buffers `window` (ring of every request), and for compressed layers `comp` (paged entries)
    and `state` (fp32 compressor ring), and for CSA layers `index`, `index_state` and
    `topk_workspace` (the indexer's scratch, one tensor shared by every CSA layer of a manager);
    `generations` (int32 [max_requests]): each request slot's current generation, kept by the
    manager the cache is attached to (a token whose step carries another generation reads and
    writes nothing)."""

    def __init__(self, model: DSV4AttentionConfig, layer_idx: int, cfg: CacheConfig, device=None,
                 topk_workspace: torch.Tensor | None = None):
        super().__init__()
        self.cfg = cfg
        self.ring_size = cfg.ring_size(model.window)
        self.fmt: dict[str, str] = {}  # pool name -> its row format (the ops take it explicitly)
        for spec in layer_pools(model, layer_idx, cfg):
            self.fmt[spec.name] = spec.fmt
            # Poisoned at birth: FP8 pools with 0xFF (e4m3 NaN), float pools and states with NaN, so
            # any read of an entry that was never written shows up in the output.
            fill = 255 if spec.dtype == torch.uint8 else float("nan")
            self.register_buffer(spec.name, torch.full(spec.shape, fill, dtype=spec.dtype, device=device),
                                 persistent=False)
        if model.layer_type(layer_idx) == CSA:
            if topk_workspace is None:
                topk_workspace = torch.empty(topk_workspace_words(model, cfg), dtype=torch.int32, device=device)
            self.register_buffer("topk_workspace", topk_workspace, persistent=False)
        # -1 matches no step until a manager attaches the cache (KVCacheManager.attach).
        self.register_buffer("generations", torch.full((cfg.max_requests,), -1, dtype=torch.int32, device=device),
                             persistent=False)
        # (state buffer, compress ratio, positions one entry pools): what abort may have to restore.
        kind, ratio = model.layer_type(layer_idx), model.compress_ratio(layer_idx)
        self.state_rings = []
        if kind != SLIDING:
            self.state_rings.append(("state", ratio, (2 if kind == CSA else 1) * ratio))
        if kind == CSA:
            self.state_rings.append(("index_state", ratio, 2 * ratio))
