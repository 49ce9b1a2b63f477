"""The int32 scratch of `dsv4::indexer_topk`'s CUDA kernel: its layout and size (no triton import,
so the cache can size and account for it anywhere).

One row per token of a launch: the uint32 key of each of the request's entries (n_entries words);
when a row is longer than one chunk, then the candidate lists [count, k entries, k keys] of its
chunks, and of the merge levels (two regions used in turn: see `merge_regions`)."""

# SM count of an H100 SXM: the launch sizes aim at a few programs per SM.
SMS = 132
# Keys a select program holds in registers: 1024 on one warp (H100: 10 us for a 1024-key chunk,
# 19 us for 4096 on 4 warps), at least 2k for a chunk to have candidates to drop; a merge block.
CHUNK = 1024
MERGE_BLOCK = 4096


def chunk(n_entries: int, k: int) -> int:
    """Keys per chunk: a power of two of at least CHUNK and 2k, no more than the row needs."""
    c = 1
    while c < min(max(n_entries, 1), max(CHUNK, 2 * k)):
        c *= 2
    return c


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
    if chunks == 1:
        return n_entries
    a, b, lst = merge_regions(n_entries, k)
    return b + -(-chunks // merge_group(k)) * lst


def workspace_words(tokens: int, n_entries: int, k: int) -> int:
    """int32 words for launches of `tokens` tokens (a step with more tokens runs in several
    launches) over `n_entries` entries per request (the block table's width x block size), top-k."""
    return tokens * row_words(n_entries, k)
