"""The int32 scratch of `dsv4::indexer_topk`'s CUDA kernel: its layout and size (no triton import,
so the cache can size and account for it anywhere)."""

# SM count of an H100 SXM: the kernel cuts a small batch's rows into chunks for about two programs
# per SM, and each (token, chunk) program of a launch keeps up to k candidates.
SMS = 132
CAND_PROGRAMS = 2 * SMS


def workspace_words(tokens: int, n_entries: int, k: int) -> int:
    """int32 words for launches of `tokens` tokens (a step with more tokens runs in several
    launches) over `n_entries` entries per request (the block table's width x block size), top-k:
    the chunk candidates (key and entry of k per program), then one uint32 key per entry per token."""
    return 2 * CAND_PROGRAMS * k + tokens * n_entries


def rows(words: int, n_entries: int, k: int) -> int:
    """Tokens per launch a workspace of `words` words serves (0: too small for one)."""
    return max(0, words - 2 * CAND_PROGRAMS * k) // max(n_entries, 1)
