"""The int32 scratch of `dsv4::indexer_topk`'s CUDA kernel: its layout and size (no triton import,
so the cache can size and account for it anywhere).

One row per token of a launch: the uint32 key of each scored column (the request's n_entries
entries; with V4.1's `cand`, the candidate blocks' cand_blocks x cand_block columns); when a row is
longer than one chunk, then the candidate lists [count, k entries, k keys] of its chunks, and of
the merge levels (two regions used in turn: see `merge_regions`); when a row is longer than one grid
tile, the same words after the keys also hold the grid select's state (`grid_words`: whichever of
the two is longer sets the row's size; a launch uses one of them). With `cand_out` (V4.1's candidate
source) the row continues with the same layout over block keys (one per cand_block entries, top
`keep`): see `layout`."""

# SM count of an H100 SXM: the launch sizes aim at a few programs per SM.
SMS = 132
# Keys one select program holds: at least 2k (a chunk must have candidates to drop), at most 16384
# (csrc/indexer: 1024 threads x 16 keys in registers). With 1024-key chunks and k = 512 a chunk kept
# half its keys and long rows went through merge levels; with 16384 a row up to 64K context is one
# chunk and 1M positions (262144 entries) 16 chunks and one merge. H100, V4-Flash CSA, whole
# indexer_topk with the csrc select, 1024 -> 16384: 32 x 64K 117.9 -> 76.3 us, 128 x 64K 307.9 ->
# 223.0, 1 x 1M 102.4 -> 67.9 (the Triton select got slower with the larger chunks on the same
# layout: 149.9, 299.4, 232.6).
CHUNK = 16384
MERGE_BLOCK = 16384


def chunk(n_entries: int, k: int) -> int:
    """Keys per chunk: a power of two of at least CHUNK and 2k, no more than the row needs."""
    c = 1
    while c < min(max(n_entries, 1), max(CHUNK, 2 * k)):
        c *= 2
    return c


# The grid select (csrc/indexer/topk_grid.cu, params.h GridParams): rows of more than one GRID_TILE
# keys and k <= GRID_MAX_K; per row GRID_STATE words (histograms of 2048 + 2048 + 1024 bins, three
# counters, a list of 4096 candidate keys) and a look-back word a tile. The first GRID_HEAD words
# and the look-back words are zeroed before a launch of several CTAs a token.
GRID_TILE = 4096
GRID_HEAD = 2051
GRID_STATE = GRID_HEAD + 3072 + 4096
GRID_MAX_K = 8192


def has_grid(n_entries: int, k: int) -> bool:
    """Whether a row of n_entries keys holds the grid select's state (so it may use that select)."""
    return n_entries > GRID_TILE and k <= GRID_MAX_K


def grid_words(n_entries: int) -> int:
    """The grid select's state words after a row of n_entries keys."""
    return GRID_STATE + -(-n_entries // GRID_TILE)


def merge_group(k: int) -> int:
    """Candidate lists one merge program selects from: as many k-lists as fit MERGE_BLOCK, at least 2."""
    return max(2, MERGE_BLOCK // k)


def merge_regions(n_entries: int, k: int) -> tuple[int, int, int]:
    """(offset of region A, offset of region B, words of one list): chunk lists go to A, merge level
    i reads A (even i) or B (odd i) and writes the other."""
    chunks = -(-n_entries // chunk(n_entries, k))
    lst = 2 * k + 1
    return n_entries, n_entries + chunks * lst, lst


def row_words(n_entries: int, k: int) -> int:
    """int32 words of one token's row."""
    chunks = -(-n_entries // chunk(n_entries, k))
    words = n_entries
    if chunks > 1:
        a, b, lst = merge_regions(n_entries, k)
        words = b + -(-chunks // merge_group(k)) * lst
    if has_grid(n_entries, k):
        words = max(words, n_entries + grid_words(n_entries))
    return words


def merge_levels(n_entries: int, k: int) -> list[tuple[int, int, int]]:
    """(input region, output region, programs per token) of each merge level of a row of n_entries
    keys, in launch order: each level divides a token's lists by merge_group(k), until one is left."""
    a, b, _ = merge_regions(n_entries, k)
    lists, levels = -(-n_entries // chunk(n_entries, k)), []
    while lists > 1:
        regions = (a, b) if len(levels) % 2 == 0 else (b, a)
        lists = -(-lists // merge_group(k))
        levels.append((*regions, lists))
    return levels


def layout(n_entries: int, k: int, cand_cols: int = 0, keep: int = 0, cand_block: int = 1) -> tuple[int, int, int, int]:
    """(scored columns, offset of the block keys, blocks, words) of one token's row: columns are
    the n_entries entries, or the cand_cols candidate columns when > 0; keep > 0 (cand_out) adds
    the block selection over ceil(n_entries / cand_block) block keys."""
    n_row = cand_cols if cand_cols else n_entries
    block_at = row_words(n_row, k)
    if not keep:
        return n_row, block_at, 0, block_at
    n_blocks = -(-n_entries // cand_block)
    return n_row, block_at, n_blocks, block_at + row_words(n_blocks, keep)


def workspace_words(tokens: int, n_entries: int, k: int, cand_cols: int = 0, keep: int = 0,
                    cand_block: int = 1) -> int:
    """int32 words for launches of `tokens` tokens (a step with more tokens runs in several
    launches) over `n_entries` entries per request (the block table's width x block size), top-k
    (and the candidate options of `layout`)."""
    return tokens * layout(n_entries, k, cand_cols, keep, cand_block)[3]
