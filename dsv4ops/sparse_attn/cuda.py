"""sm_90 launcher of `dsv4::sparse_attn`: the CUDA C++ kernels of csrc/sparse_attn/ for bf16 q, int32
comp_idx and the models' byte pools (`FORMAT_PAIRS`), the Triton kernel for the rest (and on sm_100:
dsv4ops/_arch.py). A CTA takes a token x `cta_heads` heads x one split of its key list. Where a batch
would leave SMs idle, `split_plan` splits the lists and picks how the splits' partials merge with the
sink: in the kernel over distributed shared memory (a token's splits one thread-block cluster), or by a
second kernel (csrc/sparse_attn/combine.cu). The kernels' designs are in their files' headers."""

import functools

import torch

from dsv4ops import csrc
from dsv4ops.quant import formats
from dsv4ops.sparse_attn import checks as _checks
from dsv4ops.sparse_attn import triton as _triton

KEYS_PER_TILE = 32  # csrc/sparse_attn/pipeline.cuh kKeys: a producer unit, a tile of the 64-head kernel
HEADS_PER_CTA = 64  # csrc/sparse_attn/sparse_attn.cu kHeads
SMALL_HEADS = (8, 16)  # csrc/sparse_attn/small_heads.cu: 64-key tiles (wgmma's M)
ROW_FORMATS = {"fp8_584": 0, "fp8_528": 1, "fp4_288": 2}  # csrc/sparse_attn/rows.cuh RowFormat
# (window, entries) pairs the kernel reads (rows.cuh `serves_formats`): V4, V4 with fp4 entries, V4.1,
# and V4.1's sliding layers (their entry list is empty; the window pool stands in for the entries').
FORMAT_PAIRS = {("fp8_584", "fp8_584"), ("fp8_584", "fp4_288"), ("fp8_528", "fp4_288"), ("fp8_528", "fp8_528")}


def serves(q, window_cache, comp_cache, comp_idx, window_fmt: str, comp_fmt: str, lse=None) -> bool:
    """Whether the C++ kernel serves these arguments (the Triton kernel serves the rest, a
    context-parallel shard's partial with `lse` included)."""
    return ((window_fmt, comp_fmt) in FORMAT_PAIRS and q.dtype == torch.bfloat16 and q.shape[-1] == 512
            and comp_idx.dtype == torch.int32 and window_cache.is_contiguous() and comp_cache.is_contiguous()
            and lse is None)


# split_plan's costs per kernel, keyed by its tile's keys: (us of a tile of a CTA's chain, us of the
# combine kernel, bytes a us of its bf16 partials' traffic, us of a cluster merge, bytes a us a CTA reads
# from its peers there, us more for a grid on over 7/8 of the SMs: 64 clusters of 2 took 14.2 us at HCA
# 64 x 4K against one split's 12.8). Fit on the H100 to forced split counts 1-8 (8-128 heads, batch 1-64,
# sliding, CSA, HCA 4K-1M): the pick is within 3% of the fastest count at 123 of 127 points on
# sparse_attn.cu, 282 of 286 on small_heads.cu (its CTAs read only their heads' rows: no fixed merge cost).
SPLIT_COSTS = {KEYS_PER_TILE: (1.25, 1.5, 2e6, 1.0, 2e4, 1.5), 2 * KEYS_PER_TILE: (2.0, 0.5, 1e6, 0.0, 2e4, 1.5)}
MAX_CLUSTER_SPLITS = 8  # csrc/sparse_attn/params.h kMaxClusterSplits: a portable cluster's CTAs


def cta_heads(heads: int) -> int:
    """Heads per CTA: small_heads.cu's 8 or 16 where they hold all the heads (8 heads CSA 128 x 4K: 32.2
    us against 37.0 on a 64-head CTA), else sparse_attn.cu's 64: padded from 17-32 heads (a 32-head
    small_heads.cu CTA was 5-28% slower at all 198 points measured), several CTAs a token above 64."""
    return next((h for h in SMALL_HEADS if heads <= h), HEADS_PER_CTA)


def tile_keys(cta: int) -> int:
    """Keys of a consumer tile of the kernel with `cta` heads a CTA."""
    return KEYS_PER_TILE if cta == HEADS_PER_CTA else 2 * KEYS_PER_TILE


@functools.cache
def cluster_capacity(device: int, cta: int) -> tuple[int, ...]:
    """Clusters of s CTAs (index s; 0 below 2) of the kernel with `cta` heads a CTA that `device` holds
    at once (csrc/sparse_attn/cluster_merge.cuh `max_clusters`)."""
    csrc.load()
    with torch.cuda.device(device):
        return (0, 0) + tuple(torch.ops.dsv4_csrc.cluster_capacity(cta, s) for s in range(2, MAX_CLUSTER_SPLITS + 1))


@functools.cache  # launch-time Python: up to a few hundred candidate counts per shape
def split_plan(ctas: int, keys: int, sms: int, heads: int = HEADS_PER_CTA, tile: int = KEYS_PER_TILE,
               clusters: tuple[int, ...] = ()) -> tuple[int, bool]:
    """(splits of each key list, whether a token's splits merge in their cluster) for `ctas` CTAs of
    `heads` heads: one split once they fill half the SMs, else the count of least modelled time
    (SPLIT_COSTS): whole waves of (tiles of a split + 1) x a tile's time, plus the cheaper merge, in the
    clusters where all fit the device at once (`clusters`: cluster_capacity) or by the combine. Counts
    the launcher's rounding to whole tiles would change are not candidates; a tie takes the smaller.
    HCA 32 x 1M at 64 heads (8320 keys, 132 SMs): 4 splits of 65 tiles through the combine."""
    if ctas >= sms // 2:
        return 1, False
    tiles = -(-keys // tile)
    rows = heads * 512 * 2  # bytes of a CTA-split's bf16 output
    tile_us, combine_us, partial_bytes_per_us, merge_us, peer_bytes_per_us, full_us = SPLIT_COSTS[tile]

    def cost(s: int) -> tuple[float, bool]:
        chain = -(-ctas * s // sms) * (-(-tiles // s) + 1) * tile_us
        if s == 1:
            return chain, False
        combine = combine_us + ctas * s * 2 * rows / partial_bytes_per_us  # written, then read back
        merge = merge_us + (s - 1) / s * rows / peer_bytes_per_us + (full_us if ctas * s > sms * 7 // 8 else 0.0)
        # A cluster merge saves most of the combine's 22-38% of a split point's time (HCA 8 x 16K: 11.5 us
        # against 13.1), where all clusters are resident (32 of 4 CTAs at CSA 32 x 4K were not: 31.8 vs 19.0).
        if s <= MAX_CLUSTER_SPLITS and s < len(clusters) and ctas <= clusters[s] and merge < combine:
            return chain + merge, True
        return chain + combine, False

    counts = [s for s in range(1, tiles + 1) if -(-tiles // -(-tiles // s)) == s]
    best = min(counts, key=lambda s: (cost(s)[0], s))
    return best, cost(best)[1]


def sparse_attn(q, window_cache, comp_cache, positions, req_slots, comp_idx, comp_lens, window_ends, sinks, out,
                scale: float, window: int, ring_size: int, window_fmt: str, comp_fmt: str, lse=None,
                batch_invariant: bool = False) -> None:
    """Launcher of `dsv4::sparse_attn` (same arguments). batch_invariant: the splits from the key
    list's static width alone (sparse_attn/triton.py invariant_splits) and no cluster merge."""
    if not serves(q, window_cache, comp_cache, comp_idx, window_fmt, comp_fmt, lse):
        _triton.sparse_attn(q, window_cache, comp_cache, positions, req_slots, comp_idx, comp_lens, window_ends,
                            sinks, out, scale, window, ring_size, window_fmt, comp_fmt, lse, batch_invariant)
        return
    _checks.sparse_attn(q, window_cache, comp_cache, positions, req_slots, comp_idx, comp_lens, window_ends, sinks, out,
                        scale, window, ring_size, window_fmt, comp_fmt)
    csrc.load()
    t, h, _ = q.shape
    ends = positions if window_ends is None else window_ends
    sms = torch.cuda.get_device_properties(q.device).multi_processor_count
    cta = cta_heads(h)
    tile = tile_keys(cta)
    window_keys = -(-window // KEYS_PER_TILE) * KEYS_PER_TILE
    keys = window_keys + comp_idx.shape[1]
    ctas = t * -(-h // cta)
    clusters = cluster_capacity(q.device.index, cta) if ctas < sms // 2 else ()
    if batch_invariant:
        n_split, merge = _triton.invariant_splits(ctas, keys, tile), False
    else:
        n_split, merge = split_plan(ctas, keys, sms, min(h, cta), tile, clusters)
    split_keys = -(-keys // n_split // tile) * tile
    n_split = -(-keys // split_keys)
    merge = merge and n_split > 1
    # The combine's workspaces: bf16 partials normalized per split with fp32 log2-sums, half the traffic of
    # fp32 ones (CSA 32 x 4K: 24.4 -> 19.9 us), at most half a bf16 ulp more error before its fp32 sum.
    if n_split > 1 and not merge:
        partial = torch.empty(t * n_split * h, q.shape[-1], dtype=torch.bfloat16, device=q.device)
        split_lse = torch.empty(t * n_split * h, dtype=torch.float32, device=q.device)
    else:
        partial = split_lse = out  # unused
    wb, cb = formats.block_size(window_cache.shape, window_fmt), formats.block_size(comp_cache.shape, comp_fmt)
    torch.ops.dsv4_csrc.sparse_attn(q, window_cache, comp_cache, ends, req_slots, comp_idx.contiguous(), comp_lens,
                                    sinks, out, partial, split_lse, scale, window, ring_size, ROW_FORMATS[window_fmt],
                                    ROW_FORMATS[comp_fmt], wb, cb, formats.get(window_fmt).page_bytes(wb),
                                    formats.get(comp_fmt).page_bytes(cb), window_keys, split_keys, n_split, cta,
                                    merge)
