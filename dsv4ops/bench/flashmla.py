"""FlashMLA (DeepSeek's kernels, SGLang's `sgl_flash_mla` wheel; SM90 legacy path) on dsv4ops' own
pools, as a same-run baseline and an independent check of the cache layout. Never a dependency:
`available()` says whether it imports.

Decode: FlashMLA's V4 sparse decode reads the 584-B FP8 pools as they are, viewed
[blocks, block_size, 1, 584] with the page stride; window-ring slots are its `indices`, the
compressed entries its `extra_indices_in_kvcache` (global slot = block x block_size + offset,
-1 = none), the layer's sinks its `attn_sink`. Prefill: `flash_mla_sparse_fwd` over the keys gathered
and dequantized to bf16 (the gather is not timed; engines do it in a separate kernel)."""

from __future__ import annotations

import torch
from torch import Tensor

from dsv4ops.quant import formats
from dsv4ops.quant.reference import MAIN_ENTRY_BYTES


def available() -> bool:
    try:
        import flash_mla  # noqa: F401
    except Exception:  # noqa: BLE001 - any import failure means "not available"
        return False
    return True


def _paged(pool: Tensor) -> Tensor:
    bs = formats.block_size(pool.shape, "fp8_584")
    return pool.as_strided((pool.shape[0], bs, 1, MAIN_ENTRY_BYTES), (pool.shape[1], MAIN_ENTRY_BYTES,
                                                                      MAIN_ENTRY_BYTES, 1))


def window_slots(positions: Tensor, req_slots: Tensor, window: int, ring_size: int) -> Tensor:
    """[T, window] ring slots of positions t - window + 1 .. t (-1 before position 0)."""
    wpos = positions[:, None] - torch.arange(window - 1, -1, -1, device=positions.device)
    return torch.where(wpos >= 0, req_slots[:, None] * ring_size + wpos % ring_size, -1).to(torch.int32)


class Decode:
    """FlashMLA's sparse decode over fixed pools and one step's window slots (ring slots built once,
    as engines build them in their step metadata); q, the compressed list and its lengths come per
    call, so a composed step can pass the tensors it computes. One instance per q shape: the
    scheduler metadata is built on the first call (call once before a CUDA-graph capture)."""

    def __init__(self, window_cache: Tensor, comp_cache: Tensor | None, positions: Tensor, req_slots: Tensor,
                 sinks: Tensor, scale: float, window: int, ring_size: int):
        import flash_mla

        self.sched = flash_mla.get_mla_metadata()[0]
        self.window_slots = window_slots(positions, req_slots, window, ring_size)
        self.paged = _paged(window_cache)
        self.comp = None if comp_cache is None else _paged(comp_cache)
        self.sinks, self.scale = sinks, scale

    def __call__(self, q: Tensor, comp_idx: Tensor, comp_lens: Tensor) -> Tensor:
        """out [T, H, 512] bf16 for q [T, H, 512] (H 64 or 128) and comp_idx [T, k] (k = 0: none)."""
        import flash_mla

        t, h, d = q.shape
        kw = dict(indices=self.window_slots.view(t, 1, -1), attn_sink=self.sinks, softmax_scale=self.scale,
                  is_fp8_kvcache=True, use_legacy=True)
        if comp_idx.shape[1]:
            kw.update(extra_k_cache=self.comp, extra_indices_in_kvcache=comp_idx.view(t, 1, -1),
                      extra_topk_length=comp_lens)
        return flash_mla.flash_mla_with_kvcache(q.view(t, 1, h, d), self.paged, None, None, d, self.sched,
                                                **kw)[0].view(t, h, d)


def decode(q: Tensor, window_cache: Tensor, comp_cache: Tensor, positions: Tensor, req_slots: Tensor,
           comp_idx: Tensor, comp_lens: Tensor, sinks: Tensor, scale: float, window: int, ring_size: int):
    """A callable running FlashMLA's sparse decode for these tokens (one query each; no padding
    tokens: FlashMLA has none), returning out [T, H, 512] bf16. Its scheduler metadata is built on
    the first call, so call it once before a CUDA-graph capture."""
    run = Decode(window_cache, comp_cache, positions, req_slots, sinks, scale, window, ring_size)
    return lambda: run(q, comp_idx, comp_lens)


def prefill(q: Tensor, window_cache: Tensor, comp_cache: Tensor, positions: Tensor, req_slots: Tensor,
            comp_idx: Tensor, comp_lens: Tensor, sinks: Tensor, scale: float, window: int, ring_size: int):
    """A callable running FlashMLA's sparse prefill on the same keys, gathered to bf16 once:
    [window rows of the tokens' requests | compressed rows], indices per token."""
    import flash_mla

    from dsv4ops.quant.reference import unpack_kv

    wslots = window_slots(positions, req_slots, window, ring_size)
    cvalid = torch.arange(comp_idx.shape[1], device=q.device)[None] < comp_lens[:, None]
    cslots = comp_idx.where(cvalid, -1)
    uw, wi = torch.unique(wslots.clamp(min=0), return_inverse=True)
    uc, ci = torch.unique(cslots.clamp(min=0), return_inverse=True)
    kv = torch.empty(uw.numel() + uc.numel(), 512, dtype=torch.float32, device=q.device)
    unpack_kv(window_cache, uw.to(torch.int32), kv[:uw.numel()], "fp8_584")
    unpack_kv(comp_cache, uc.to(torch.int32), kv[uw.numel():], "fp8_584")
    kv = kv.to(torch.bfloat16).view(-1, 1, 512)
    idx = torch.cat([wi.where(wslots >= 0, -1), (ci + uw.numel()).where(cslots >= 0, -1)], 1)
    idx = idx.to(torch.int32).view(q.shape[0], 1, -1)
    return lambda: flash_mla.flash_mla_sparse_fwd(q, kv, idx, scale, 512, sinks, use_legacy=True)[0]
