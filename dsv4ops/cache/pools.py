"""The per-layer cache module: its pools are non-persistent buffers (a strict `load_state_dict`
of the weights ignores them), allocated once and never reassigned (CUDA graphs keep their address)."""

import torch
from torch import nn

from dsv4ops.cache.config import CacheConfig, layer_pools, topk_workspace_words
from dsv4ops.config import CSA, SLIDING, DSV4AttentionConfig
from dsv4ops.parallel.dcp import Ownership


class PoolCache(nn.Module):
    """Base of the cache modules (LayerCache, V41StackCache): what a fork copies per request slot
    and a copy on write per block. `slot_pools` {buffer: leading rows per request slot} (the window
    rings: ring_size / block_size pages; compressor states: 1 row of [requests, rows, width]);
    `block_pools` {buffer: its pool group} (compressed entries and index keys, paged by the
    manager's block table of that group). Copies are in place on the buffers' device, issued
    between steps (the buffers keep their addresses: CUDA graphs stay valid).

    `dcp` (the manager's dsv4ops.parallel.dcp.Ownership): which blocks this rank holds; its block
    pools hold those only (block id = local block x ranks + rank; one rank: every block)."""

    slot_pools: dict
    block_pools: dict
    dcp: Ownership = Ownership()

    def register_step_state(self, cfg: CacheConfig, device) -> None:
        """`generations` (int32 [max_requests]): each request slot's current generation, -1 (matches
        no step) until a manager attaches the cache (KVCacheManager.attach); `ran_step` (int32 [1]):
        the mark of the last step a forward ran on this cache (its first token's generation, written
        on the device by live_tokens), which the manager's commit checks."""
        self.register_buffer("generations", torch.full((cfg.max_requests,), -1, dtype=torch.int32, device=device),
                             persistent=False)
        self.register_buffer("ran_step", torch.full((1,), -1, dtype=torch.int32, device=device), persistent=False)

    def copy_slot(self, src: int, dst: int) -> None:
        """Request slot dst's window rings and compressor states become slot src's."""
        for name, n in self.slot_pools.items():
            buf = getattr(self, name)
            buf[dst * n:(dst + 1) * n] = buf[src * n:(src + 1) * n]

    def copy_blocks(self, group, src: list[int], dst: list[int]) -> None:
        """Blocks dst[i] of the group's pools become copies of blocks src[i] (context parallel: the
        pairs this rank holds; a copy stays on the rank of its block's index, so src[i] and dst[i]
        have the same owner)."""
        n, mine = self.dcp.size, [(a, b) for a, b in zip(src, dst) if a % self.dcp.size == self.dcp.rank]
        src, dst = [a // n for a, _ in mine], [b // n for _, b in mine]
        if not src:
            return
        for name, g in self.block_pools.items():
            if g == group:
                buf = getattr(self, name)
                at = torch.tensor(src, dtype=torch.long, device=buf.device)
                buf.index_copy_(0, torch.tensor(dst, dtype=torch.long, device=buf.device), buf.index_select(0, at))


class LayerCache(PoolCache):
    """Buffers `window` (ring of every request), and for compressed layers `comp` (paged entries)
    and `state` (fp32 compressor ring), and for CSA layers `index`, `index_state` and
    `topk_workspace` (the indexer's scratch, one tensor shared by every CSA layer of a manager);
    `generations` (int32 [max_requests]): each request slot's current generation, kept by the
    manager the cache is attached to (a token whose step carries another generation reads and
    writes nothing). Context parallel (`dcp`, the manager's group; `dcp_topk`, its top-k merge):
    the compressed pools hold this rank's blocks, and the manager adds `block_index_{CSA,HCA}`
    (each local block's index in its request's table)."""

    def __init__(self, model: DSV4AttentionConfig, layer_idx: int, cfg: CacheConfig, device=None,
                 topk_workspace: torch.Tensor | None = None, dcp: Ownership = Ownership(), dcp_topk: str = "exact"):
        super().__init__()
        cfg = cfg.for_model(model)
        self.model, self.layer_idx, self.cfg, self.dcp, self.dcp_topk = model, layer_idx, cfg, dcp, dcp_topk
        self.ring_size = cfg.ring_size(model.window)
        self.fmt: dict[str, str] = {}  # pool name -> its row format (the ops take it explicitly)
        for spec in layer_pools(model, layer_idx, cfg, dcp.size):
            self.fmt[spec.name] = spec.fmt
            # Poisoned at birth: FP8 pools with 0xFF (e4m3 NaN), float pools and states with NaN, so
            # any read of an entry that was never written shows up in the output.
            fill = 255 if spec.dtype == torch.uint8 else float("nan")
            self.register_buffer(spec.name, torch.full(spec.shape, fill, dtype=spec.dtype, device=device),
                                 persistent=False)
        if model.layer_type(layer_idx) == CSA:
            if topk_workspace is None:
                topk_workspace = torch.empty(topk_workspace_words(model, cfg, dcp.size),
                                             dtype=torch.int32, device=device)
            self.register_buffer("topk_workspace", topk_workspace, persistent=False)
        self.register_step_state(cfg, device)
        # (state buffer, compress ratio, positions one entry pools): what abort may have to restore.
        kind, ratio = model.layer_type(layer_idx), model.compress_ratio(layer_idx)
        self.state_rings = []
        if kind != SLIDING:
            self.state_rings.append(("state", ratio, (2 if kind == CSA else 1) * ratio))
        if kind == CSA:
            self.state_rings.append(("index_state", ratio, 2 * ratio))
        self.slot_pools = {"window": self.ring_size // cfg.block_size, **{name: 1 for name, *_ in self.state_rings}}
        self.block_pools = {name: kind for name in ("comp", "index") if name in self.fmt}
