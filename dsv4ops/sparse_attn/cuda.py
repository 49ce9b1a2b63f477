"""sm_90 launcher of `dsv4::sparse_attn` with the CUDA C++ kernel of csrc/sparse_attn/ (wgmma) for
V4's layout (fp8_584 window and compressed pools, bf16 q and out, int32 comp_idx), and the Triton
kernel for every other case (V4.1 formats, exact pools, fp32 or fp16 activations). Same arguments
as the op.

The arch table selects it on sm_90 (dsv4ops/_arch.py); the sm_100a build of csrc/ compiles the
kernel to a trap, and sm_100 runs the Triton kernel.

The C++ kernel takes a token x 64 heads x one split of its key list per CTA (one CTA per SM: 218 KiB
of shared memory); a batch that would leave SMs idle splits each list (`split_count`), and a second
kernel merges the splits' partial outputs with the sink (workspace allocated per call from static
sizes, so the call stays CUDA-graph safe)."""

import functools

import torch

from dsv4ops import csrc
from dsv4ops.quant import formats
from dsv4ops.sparse_attn import checks as _checks
from dsv4ops.sparse_attn import triton as _triton

KEYS_PER_TILE = 32  # csrc/sparse_attn/sparse_attn.cu kKeys
HEADS_PER_CTA = 64  # kHeads


def serves(q, window_cache, comp_cache, comp_idx, window_fmt: str, comp_fmt: str, lse=None) -> bool:
    """Whether the C++ kernel serves these arguments (the Triton kernel serves the rest, a
    context-parallel shard's partial with `lse` included)."""
    return (window_fmt == comp_fmt == "fp8_584" and q.dtype == torch.bfloat16 and q.shape[-1] == 512
            and comp_idx.dtype == torch.int32 and window_cache.is_contiguous() and comp_cache.is_contiguous()
            and lse is None)


@functools.cache  # launch-time Python: up to a few hundred candidate counts per shape
def split_count(ctas: int, keys: int, sms: int) -> int:
    """Splits of each key list for `ctas` CTAs of one split each: none once they fill half the SMs
    (a second split would only add a wave and the combine), else the count with the least time on
    the busiest SM: whole waves of (tiles of a split + one tile's worth for the CTA's start and
    end), the smaller count on a tie. HCA 32 x 1M (8320 keys, 132 SMs): 4 splits, one wave of 65
    tiles a CTA, where one split per 1024 keys (the Triton kernel's rule, 9) made 3 waves of 29
    (H100: 211 us)."""
    if ctas >= sms // 2:
        return 1
    tiles = -(-keys // KEYS_PER_TILE)
    cost = {s: -(-ctas * s // sms) * (-(-tiles // s) + 1) for s in range(1, tiles + 1)}
    return min(cost, key=lambda s: (cost[s], s))


def sparse_attn(q, window_cache, comp_cache, positions, req_slots, comp_idx, comp_lens, window_ends, sinks, out,
                scale: float, window: int, ring_size: int, window_fmt: str, comp_fmt: str, lse=None) -> None:
    """Launcher of `dsv4::sparse_attn` (same arguments)."""
    if not serves(q, window_cache, comp_cache, comp_idx, window_fmt, comp_fmt, lse):
        _triton.sparse_attn(q, window_cache, comp_cache, positions, req_slots, comp_idx, comp_lens, window_ends,
                            sinks, out, scale, window, ring_size, window_fmt, comp_fmt, lse)
        return
    _checks.sparse_attn(q, window_cache, comp_cache, positions, req_slots, comp_idx, comp_lens, window_ends, sinks, out,
                        window, ring_size, window_fmt, comp_fmt)
    csrc.load()
    t, h, _ = q.shape
    ends = positions if window_ends is None else window_ends
    tile = KEYS_PER_TILE
    window_keys = -(-window // tile) * tile
    keys = window_keys + comp_idx.shape[1]
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    n_split = split_count(t * -(-h // HEADS_PER_CTA), keys, sms)
    per_split = -(-keys // n_split)
    split_keys = -(-per_split // tile) * tile
    n_split = -(-keys // split_keys)
    if n_split > 1:
        partial = torch.empty(t * n_split * h, q.shape[-1], dtype=torch.float32, device=q.device)
        lse = torch.empty(t * n_split * h, dtype=torch.float32, device=q.device)
    else:
        partial = lse = out  # unused
    fmt = formats.get("fp8_584")
    wb, cb = formats.block_size(window_cache.shape, window_fmt), formats.block_size(comp_cache.shape, comp_fmt)
    torch.ops.dsv4_csrc.sparse_attn(q, window_cache, comp_cache, ends, req_slots, comp_idx.contiguous(), comp_lens,
                                    sinks, out, partial, lse, scale, window, ring_size, wb, cb, fmt.page_bytes(wb),
                                    fmt.page_bytes(cb), window_keys, split_keys, n_split)
