"""The int32 scratch of `dsv4::indexer_topk`'s CUDA kernel: its layout and size (no triton import,
so the cache can size and account for it anywhere).

One row per token of a launch: the uint32 key of each of the request's entries (n_entries words),
then, when a row is longer than one CHUNK, each chunk's candidates: [count, cut key, k entries,
k keys] (see cand_at)."""

# SM count of an H100 SXM: the launch sizes aim at a few programs per SM.
SMS = 132
# Keys one select program holds in registers (32 a thread at 4 warps).
CHUNK = 4096


def chunks(n_entries: int) -> int:
    return -(-n_entries // CHUNK)


def cand_at(n_entries: int) -> int:
    """Offset of the chunk candidates in a row: after the keys, and after the 2 x CHUNK words the
    merge gathers into (it reuses the keys' words, free by then)."""
    return max(n_entries, 2 * CHUNK)


def row_words(n_entries: int, k: int) -> int:
    """int32 words of one token's row."""
    c = chunks(n_entries)
    return n_entries if c == 1 else cand_at(n_entries) + c * (2 * k + 2)


def workspace_words(tokens: int, n_entries: int, k: int) -> int:
    """int32 words for launches of `tokens` tokens (a step with more tokens runs in several
    launches) over `n_entries` entries per request (the block table's width x block size), top-k."""
    return tokens * row_words(n_entries, k)
