"""sm_90 / sm_100 launcher of `dsv4::indexer_topk`: a scoring kernel writes each token's keys into the
workspace, then a radix select of csrc/indexer/ picks the top k: the grid select (topk_grid.cu:
histogram levels and a look-back emit over a token's 4096-key tiles, one resident CTA a tile or one
CTA walking the row: `grid_ctas`) for rows of more than one tile, else the chunk tree
(topk_select.cu: one CTA for a row of up to 16384 keys; its merges of chunk lists serve only forced
chunk sizes now). Both follow each token's real row (device lengths), not the block table's width.
Same arguments, workspace layout and results as the Triton launcher (dsv4ops/indexer/triton.py).

Scoring: on sm_90, the wgmma kernel of csrc/indexer/score.cu for V4's fp8_132 pages with e4m3
queries and for V4.1's mxfp4_68 pages with MX4 queries (<= 32 heads); the Triton scoring kernel for
every other case (and on sm_100: the C++ kernel's sm_100a build is a trap). Select: the C++ kernel wherever a chunk fits it, the Triton select for k > 8192.

H100, V4-Flash CSA (k = 512), graph-timed indexer_topk with the csrc select, Triton -> csrc scoring:
1 x 4K 9.8 -> 9.5 us, 128 x 4K 19.4 -> 17.3, 32 x 64K 75.4 -> 56.8, 128 x 64K 221.6 -> 138.8, 1 x 1M
66.9 -> 57.0, a 4096-token prefill 220.0 -> 167.6 (the scoring alone at 128 x 64K: 198.1 -> 114.1).
The Triton select on the same layout took 1.3-3.5x the csrc select's time at 64K and 1M context.

The scoring kernel reads 277 MB in 113 us at 128 x 64K, 82% of the copy ceiling. The scoring zeroes
the select's state words (a memset node less), and the scoring, the chunk tree and the
one-CTA-a-token grid select launch with programmatic dependent launch; the scoring does not let the
select in early (its CTAs, resident beside the scoring's, doubled up on the few SMs with room:
147.9 us against 140.4 at 128 x 64K). Where the op misses its targets (H100, README Benchmarks;
ncu at base clocks, caches flushed):
- 1 x 4K (9.0 us, target 8) and 128 x 4K (16.8, target 15): two latency-bound kernels. At 1 x 4K the
  scoring's 17 CTAs run at 0.8% of DRAM peak, 42% of their stall cycles on long scoreboard (the
  block-table load, then the dependent gather); the select's one CTA keeps 23% of issue slots busy
  and spends 37% of its stalls at the barriers of its 4 radix passes. Left: the select fused into
  the scoring's last CTA of a token, fewer radix passes for rows of one chunk.
- 1 x 1M (28.9 = scoring 14.3 + select ~14, target 25): the grid select's 65 CTAs work ~12 us, a
  chain of dependent steps each one to three L2 round trips or barriers (clock64 stamps of one CTA:
  loading its keys 1.7K cycles, the level-0 histogram 3.3K, the token barrier 2.6K, finding the bin
  2.4K, gather and second barrier 5.3K, two candidate levels 3.9K, look-back 1.4K, writes 3.1K); ncu:
  8% of SM throughput, stalls at barriers 26% and on no instruction 23% (the grid barrier's spin).
- 128 x 64K (140.5 = 113.4 + ~27, target 120): the scoring is a memory-bound gather (71% of DRAM
  peak under ncu) within 6% of the target alone; one CTA walks each token's 16384 keys (issue slots
  38% busy). The chunk tree holds them in registers and takes 136.6 us in all, but runs a 16384-key
  CTA whatever the real row (29.8 us against the grid's 19.6 at a 4K context in a 1M table), so the
  launcher takes the grid.
- 4K in a 1M table (1 x: 12.2 against 9.0, 128 x: 19.6 against 16.8): the selects' fixed cost of a
  wider launch (CTAs that leave at once; at batch 128, 512 threads of 8 keys on a 4096-key tile
  against the tree's 512 of 4). The attention core stays within 1.11x of its 4K-table time.

MX4 scoring (V4.1's 68-B keys, H100, whole indexer_topk): 128 x 64K ratio-2 source 262.9
us (1.09 TB/s of keys; the Triton scoring: 486), candidate source 552 us, reindex in the pool 174 us;
1 x 1M 50.7 us. It misses 70% of copy: the kernel is issue-bound, not memory-bound. ncu (base clocks,
the previous build at 138 registers and 3 CTAs an SM; 275 us graph-timed): SM 65% busy, DRAM 28%,
stalls per issue: fixed-latency wait 1.02, not selected 0.71, short scoreboard 0.46, math throttle
0.31. Each 64-key tile costs a thread ~300 instructions: the e2m1 -> e4m3 conversion of its A
fragments (PRMT tables, ~130), four k32 wgmmas a tile (one a scale group) and ~100 to apply the key
groups' scales. What would close it: the key's group scales inside the tensor cores' operand (shift
each group's codes to its row's largest scale where e4m3 holds them exactly, one accumulator, as the
query's fold does), or Blackwell's block-scaled FP4 MMA."""

import torch

from dsv4ops import _arch, csrc
from dsv4ops.indexer import triton as _triton
from dsv4ops.quant import formats
from dsv4ops.indexer import workspace as _ws

MAX_BLOCK = 16384  # csrc/indexer/params.h kMaxBlock
SCORE_TILE = 64  # csrc/indexer/score.cu kTile
MX_HEADS = 32  # heads the MX4 scoring serves (score.cu keeps their group scales in registers)


def serves(n_row: int, k: int) -> bool:
    """Whether the C++ select serves top-k of rows of n_row columns (every chunk and merge group fits a CTA)."""
    return _ws.chunk(n_row, k) <= MAX_BLOCK and _ws.merge_group(k) * k <= MAX_BLOCK


def _aligned(x: torch.Tensor) -> bool:
    return x.data_ptr() % 16 == 0


def score_serves(q, weights, cache, fmt: str, block_size: int) -> bool:
    """Whether the C++ scoring kernel serves these arguments: sm_90, float32 weights, and either
    fp8_132 pages of a multiple of 4 entries (16-B aligned rows) with e4m3 queries of 16-B aligned
    rows, or mxfp4_68 pages with MX4 queries (uint8 68-B rows) of at most 32 heads (V4.1: 32)."""
    cap = _arch.capability()
    if fmt == "fp8_132":
        query = (q.dtype == torch.float8_e4m3fn and q.stride(1) % 16 == 0 and q.stride(0) % 16 == 0
                 and block_size % 4 == 0)
    elif fmt == "mxfp4_68":
        query = q.dtype == torch.uint8 and q.shape[1] <= MX_HEADS and q.stride(1) % 4 == 0 and q.stride(0) % 4 == 0
    else:
        return False
    return (cap is not None and cap[0] == 9 and query and q.stride(2) == 1 and _aligned(q) and weights.stride(1) == 1
            and cache.dtype == torch.uint8 and cache.is_contiguous() and _aligned(cache))


def score_ctas_per_sm(heads: int, mx: bool = False) -> int:
    """Scoring CTAs resident on an SM, by shared memory. fp8_132: a 4-stage ring of 8 KiB tiles and the
    query (41 KiB at <= 64 heads, 49 KiB at 128), 3 tiles' gathers in flight each; mxfp4_68: an 11-stage
    ring of 4.4 KiB tiles (53 KiB at 32 heads; 116 registers a thread), 10 in flight each."""
    if mx:
        return 4
    return 5 if heads <= 64 else 4


def score(q, weights, positions, req_slots, cache, block_table, cand, workspace, fmt: str, t0: int, n: int,
          n_row: int, row_words: int, n_entries: int, ratio: int, block_size: int, cb: int, mode: int,
          zero_words: int = 0) -> bool:
    """The C++ scoring of one launch of n tokens (`triton.indexer_topk`'s `score` hook); False where it
    does not serve the arguments. Programs per token: one wave of resident CTAs over the launch, at most
    one per tile (each walks tiles g, g + G, ... of its token's real row). zero_words: words after each
    row's keys that its first program zeroes (the grid select's state: `indexer_topk`)."""
    if not score_serves(q, weights, cache, fmt, block_size):
        return False
    ctas = score_ctas_per_sm(q.shape[1], fmt == "mxfp4_68")
    programs = max(1, min(-(-n_row // SCORE_TILE), ctas * _ws.SMS // n))
    torch.ops.dsv4_csrc.topk_score(q, weights, positions, req_slots, cache, block_table, cand, workspace, t0, n,
                                   row_words, programs, n_entries, ratio, block_size,
                                   formats.get(fmt).page_bytes(block_size), cb, mode, n_row, zero_words)
    return True


def grid_ctas(tokens: int, n_row: int, device: torch.device) -> int:
    """CTAs a token for the grid select: one a 4096-key tile of the longest row the block table allows
    where the launch fits 2 CTAs an SM (they wait for each other, so all are resident), else one that
    walks the token's real row alone. H100, V4-Flash CSA, whole indexer_topk, one a tile / two / one
    a token: 1 x 1M 30.5 / - / 260.8 us, 32 x 64K 51.9 / - / 58.6; 128 x 64K - / 143.8 / 140.7 (the
    chunk tree: 137.7); 128 x 4K in a 1M table - / 22.3 / 19.9 (tree 29.8)."""
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    tiles = -(-n_row // _ws.GRID_TILE)
    return tiles if tokens * tiles <= 2 * sms else 1


def select(n: int, n_row: int, k: int, keys_at: int, common: tuple, mode: int, nc: int, zeroed: bool = False):
    """The selection hook of `triton.indexer_topk` (arguments as `select_tree`): the grid select where
    the row holds its state, else `select_tree`. zeroed: the scoring zeroed the state words."""
    if not _ws.has_grid(n_row, k):
        select_tree(n, n_row, k, keys_at, common, mode, nc)
        return
    positions, req_slots, block_table, cand, out, workspace, t0 = common[:7]
    n_entries, ratio, block_size, row_words = common[12:16]
    torch.ops.dsv4_csrc.topk_grid(positions, req_slots, block_table, cand, out, workspace, t0, n, row_words, keys_at,
                                  n_row, grid_ctas(n, n_row, out.device), zeroed, n_entries, ratio, block_size,
                                  common[10], mode)


def select_tree(n: int, n_row: int, k: int, keys_at: int, common: tuple, mode: int, nc: int):
    """`triton.select_tree` with the C++ kernel: same workspace layout, launches and results. `common`
    is the tuple triton.indexer_topk builds: (positions, req_slots, block_table, cand, out, workspace,
    t0, 4 strides and counts, cand_block, out stride, n_entries, ratio, block_size, row_words)."""
    if not serves(n_row, k):
        _triton.select_tree(n, n_row, k, keys_at, common, mode, nc)
        return
    positions, req_slots, block_table, cand, out, workspace, t0 = common[:7]
    n_entries, ratio, block_size, row_words = common[12:16]
    cb = common[10]
    ch, gs = _ws.chunk(n_row, k), _ws.merge_group(k)
    region_a = _ws.merge_regions(n_row, k)[0] + keys_at
    sizes = (n_entries, ratio, block_size, cb, ch, gs, mode)
    programs = _triton.select_programs(n, -(-n_row // ch))
    torch.ops.dsv4_csrc.topk_select(positions, req_slots, block_table, cand, out, workspace, t0, n, row_words, keys_at,
                                    region_a, 0, -1, programs, *sizes)
    for level, (a, b, programs) in enumerate(_ws.merge_levels(n_row, k)):
        torch.ops.dsv4_csrc.topk_select(positions, req_slots, block_table, cand, out, workspace, t0, n, row_words, 0,
                                        a + keys_at, b + keys_at, level, programs, *sizes)


def indexer_topk(q, weights, positions, req_slots, cache, block_table, cand, idx_out, cand_out, workspace,
                 ratio: int, cand_block: int, fmt: str) -> None:
    """Launcher of `dsv4::indexer_topk` (same arguments). Where the grid select runs several CTAs a
    token after the C++ scoring, the scoring zeroes its state words instead of a memset node: H100,
    V4-Flash CSA, whole op, memset / scoring: 1 x 1M 30.1 / 29.0 us, 32 x 64K 52.4 / 51.2, 1 x 4K in a
    1M table 13.8 / 12.0."""
    csrc.load()
    k = idx_out.shape[1]
    scored = [False]  # the launch's scoring was the C++ kernel, which zeroed the state words

    def score_zeroing(*args):
        n, n_row = args[10], args[11]
        ctas = grid_ctas(n, n_row, q.device) if _ws.has_grid(n_row, k) else 1
        scored[0] = score(*args, zero_words=_ws.GRID_HEAD + ctas if ctas > 1 else 0)
        return scored[0]

    def select_zeroed(n, n_row, k_, keys_at, common, mode, nc):
        select(n, n_row, k_, keys_at, common, mode, nc, zeroed=scored[0] and keys_at == 0)

    _triton.indexer_topk(q, weights, positions, req_slots, cache, block_table, cand, idx_out, cand_out, workspace,
                         ratio, cand_block, fmt, select=select_zeroed, score=score_zeroing)
