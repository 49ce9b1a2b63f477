"""Cache capacity and modes (separate from the model config), the per-layer pool schema, and the
memory accounting."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from dsv4ops.config import CSA, SLIDING, DSV4AttentionConfig
from dsv4ops.indexer.workspace import workspace_words
from dsv4ops.quant import formats
from dsv4ops.reference.numerics import Numerics

KV_CACHE_MODES = ("bf16", "fp8", "fp4")
INDEXER_CACHE_MODES = ("bf16", "fp8", "mxfp4")
# Row formats of (window ring, compressed entries) by kv_cache, and of the index keys by indexer_cache.
KV_FORMATS = {"bf16": (formats.EXACT, formats.EXACT), "fp8": ("fp8_584", "fp8_584"), "fp4": ("fp8_584", "fp4_288")}
INDEXER_FORMATS = {"bf16": formats.EXACT, "fp8": "fp8_132", "mxfp4": "mxfp4_68"}
# Numerics mode of each cache mode (bf16 rows: exact).
_KV_NUMERICS = {"bf16": "exact", "fp8": "fp8", "fp4": "fp4"}
_INDEXER_NUMERICS = {"bf16": "exact", "fp8": "fp8", "mxfp4": "mxfp4"}


def _default_buckets(max_step_tokens: int) -> tuple[int, ...]:
    sizes, b = [], 1
    while b < max_step_tokens:
        sizes.append(b)
        b *= 2
    return tuple(sizes) + (max_step_tokens,)


@dataclass(frozen=True)
class CacheConfig:
    """Capacity of the serving cache.

    max_requests: request slots. max_context: positions per request. max_step_tokens: tokens of one
    step (all requests; padded to a bucket). max_request_step_tokens: tokens one request may add in
    one step (sizes the window ring; defaults to max_step_tokens). kv_cache: "fp8" (584-B window
    rows and compressed entries), "fp4" (584-B window rows, 288-B FP4 compressed entries: e2m1 with
    an e4m3 scale per 16, V4.1's format; V4 was not trained for it) or "bf16" (unquantized rows of
    dtype `exact_dtype`; float32 gives a bit-level comparison with an fp32 model). indexer_cache:
    "fp8" (132-B keys), "mxfp4" (68-B keys: e2m1 with a UE8M0 scale per 32 after V4's Hadamard, the
    reference's trained indexer numerics; its pages hold a multiple of 128 entries: block_size) or
    "bf16". max_total_tokens: context held by all requests at once
    (sizes the compressed pools; defaults to max_requests x max_context). topk_tokens: tokens one
    launch of the indexer's top-k serves (sizes its workspace, one row of max_context / 4 keys per
    token, shared by the CSA layers; defaults to max_step_tokens, at most max(256, 2^25 / max_context)
    (32 MiB of keys): a decode batch in one launch, a long prefill chunk in a few). max_draft_tokens:
    the most tokens `rewind` may drop (the largest draft a verify step checks; 0: no speculative
    decoding): it sizes the window ring and the compressor-state rings (`ring_size`, `state_rows`),
    and bounds how far behind its parent a fork may start.
    """

    max_requests: int
    max_context: int
    max_step_tokens: int
    kv_cache: str = "fp8"
    indexer_cache: str = "fp8"
    block_size: int = 64
    exact_dtype: torch.dtype = torch.bfloat16
    max_request_step_tokens: int | None = None
    max_total_tokens: int | None = None
    topk_tokens: int | None = None
    buckets: tuple[int, ...] = field(default=())
    max_draft_tokens: int = 0

    def __post_init__(self):
        for name in ("max_requests", "max_context", "max_step_tokens", "block_size", "max_request_step_tokens",
                     "max_total_tokens", "max_draft_tokens"):
            value = getattr(self, name)
            if value is None and name in ("max_request_step_tokens", "max_total_tokens"):
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name}: expected an int, got {type(value).__name__} {value!r}")
            low = 0 if name == "max_draft_tokens" else 1
            if value < low:
                raise ValueError(f"{name}: expected >= {low}, got {value}")
        for name, modes in (("kv_cache", KV_CACHE_MODES), ("indexer_cache", INDEXER_CACHE_MODES)):
            if getattr(self, name) not in modes:
                raise ValueError(f"{name}: expected one of {modes}, got {getattr(self, name)!r}")
        for fmt in set(self.formats()) - {formats.EXACT}:
            formats.get(fmt).page_bytes(self.block_size)  # a block size the format cannot page raises here
        if not isinstance(self.exact_dtype, torch.dtype) or not self.exact_dtype.is_floating_point:
            raise ValueError(f"exact_dtype: expected a float torch.dtype, got {self.exact_dtype!r}")
        if not self.buckets:
            object.__setattr__(self, "buckets", _default_buckets(self.max_step_tokens))
        buckets = tuple(self.buckets)
        if any(isinstance(b, bool) or not isinstance(b, int) or b < 1 for b in buckets):
            raise ValueError(f"buckets: expected token counts >= 1, got {buckets}")
        if max(buckets) < self.max_step_tokens:
            raise ValueError(f"buckets: the largest must be >= max_step_tokens ({self.max_step_tokens}), got {buckets}")
        object.__setattr__(self, "buckets", buckets)

    @property
    def request_step_tokens(self) -> int:
        return self.max_request_step_tokens or self.max_step_tokens

    @property
    def topk_launch_tokens(self) -> int:
        """At least 256 tokens, more while their rows of keys (max_context / 4 words each) stay within
        32 MiB: H100, a 4096-token prefill at 8K max_context took 334 us of indexer_topk in 16 launches
        of 256 tokens (score + select, each latency-bound), 247 us in one."""
        return self.topk_tokens or min(self.max_step_tokens, max(256, (1 << 25) // max(self.max_context, 1)))

    @property
    def total_tokens(self) -> int:
        return self.max_total_tokens or self.max_requests * self.max_context

    @property
    def rewind_tokens(self) -> int:
        """Tokens a rewind may drop (past the last position ever written): max_draft_tokens, at least
        1 (a ring of `span` rows already survives dropping one token)."""
        return max(1, self.max_draft_tokens)

    def ring_size(self, window: int) -> int:
        """Window ring per request: W - 1 tokens of history plus a whole step of this request, so no
        token of the step overwrites a key another token of the same step still reads, and plus
        the largest draft, so the rows of the W - 1 positions before a rewound end survive the
        dropped tokens (they wrote the slots of positions W - 1 + n and more behind them)."""
        need = window - 1 + max(self.request_step_tokens, self.rewind_tokens)
        return -(-need // self.block_size) * self.block_size

    def state_rows(self, span: int) -> int:
        """Rows of a compressor-state ring whose entries pool `span` positions (CSA 2m, HCA m, V4.1
        ratio 2: 2): a token closing an entry reads the span - 1 rows before it, and a rewind of n
        <= rewind_tokens tokens must find them after the n dropped tokens wrote their rows (row
        p % rows), so span - 1 + n rows (CSA m = 4 with 5 drafts: 12; HCA: 132)."""
        return span - 1 + self.rewind_tokens

    def formats(self) -> tuple[str, str, str]:
        """Pool formats of (window ring, compressed entries, indexer keys) (dsv4ops/quant/formats.py;
        exact rows for "bf16")."""
        return (*KV_FORMATS[self.kv_cache], INDEXER_FORMATS[self.indexer_cache])

    def numerics(self) -> Numerics:
        return Numerics(kv=_KV_NUMERICS[self.kv_cache], indexer=_INDEXER_NUMERICS[self.indexer_cache])

    @classmethod
    def for_numerics(cls, numerics: Numerics, dtype: torch.dtype, **capacity) -> CacheConfig:
        """The cache of a layer computing `numerics` (exact rows in `dtype`); an MXFP4 indexer's pages
        default to 128 entries (the smallest count its 512-B page alignment pads by less than a row)."""
        kv = {v: k for k, v in _KV_NUMERICS.items()}[numerics.kv]
        indexer = {v: k for k, v in _INDEXER_NUMERICS.items()}[numerics.indexer]
        if indexer == "mxfp4":
            capacity.setdefault("block_size", 128)
        return cls(kv_cache=kv, indexer_cache=indexer, exact_dtype=dtype, **capacity)


@dataclass(frozen=True)
class PoolSpec:
    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    fmt: str = ""  # the pool's row format (dsv4ops/quant/formats.py); "" for compressor states

    @property
    def nbytes(self) -> int:
        n = torch.tensor([], dtype=self.dtype).element_size()
        for s in self.shape:
            n *= s
        return n


def blocks_per_request(cfg: CacheConfig, ratio: int) -> int:
    entries = -(-cfg.max_context // ratio)
    return -(-entries // cfg.block_size)


def pool_blocks(cfg: CacheConfig, ratio: int, shards: int = 1) -> int:
    """Blocks of a compressed pool: every request's partial last block plus the total context.
    Over `shards` context-parallel ranks (the blocks of a request owned in turn): a rank holds at
    most ceil(n / shards) of a request's n blocks, so its share of that count plus one block per
    request."""
    blocks = -(-cfg.total_tokens // ratio // cfg.block_size) + cfg.max_requests
    return blocks if shards == 1 else -(-blocks // shards) + cfg.max_requests


def paged_pool(name: str, cfg: CacheConfig, fmt: str, dim: int, blocks: int) -> PoolSpec:
    """A page pool of `blocks` pages of cfg.block_size rows in format `fmt`."""
    dtype = cfg.exact_dtype if fmt == formats.EXACT else torch.uint8
    return PoolSpec(name, formats.pool_shape(fmt, blocks, cfg.block_size, dim), dtype, fmt)


def layer_pools(model: DSV4AttentionConfig, layer_idx: int, cfg: CacheConfig, shards: int = 1) -> list[PoolSpec]:
    """The buffers of one layer: sliding = window ring; CSA = ring + compressed pool (m=4) + indexer
    pool + both compressor states; HCA = ring + compressed pool (m=128) + state. `shards`: the
    compressed pools of one context-parallel rank (pool_blocks)."""
    kind, ratio = model.layer_type(layer_idx), model.compress_ratio(layer_idx)
    d, di = model.head_dim, model.index_head_dim
    window, comp, index = cfg.formats()
    ring_blocks = cfg.max_requests * cfg.ring_size(model.window) // cfg.block_size
    pools = [paged_pool("window", cfg, window, d, ring_blocks)]
    if kind == SLIDING:
        return pools
    coff = 2 if kind == CSA else 1
    pools.append(paged_pool("comp", cfg, comp, d, pool_blocks(cfg, ratio, shards)))
    pools.append(PoolSpec("state", (cfg.max_requests, cfg.state_rows(coff * ratio), 2 * coff * d), torch.float32))
    if kind == CSA:
        pools.append(paged_pool("index", cfg, index, di, pool_blocks(cfg, ratio, shards)))
        pools.append(PoolSpec("index_state", (cfg.max_requests, cfg.state_rows(2 * ratio), 4 * di), torch.float32))
    return pools


def topk_workspace_words(model: DSV4AttentionConfig, cfg: CacheConfig, shards: int = 1) -> int:
    """int32 words of the indexer top-k workspace all CSA layers share (0 without CSA layers); a
    context-parallel rank scores its share of a request's blocks (`shards`)."""
    if CSA not in {model.layer_type(i) for i in range(model.num_layers)}:
        return 0
    n_entries = -(-blocks_per_request(cfg, model.csa_ratio) // shards) * cfg.block_size
    return workspace_words(cfg.topk_launch_tokens, n_entries, model.index_topk)


def memory(model: DSV4AttentionConfig, cfg: CacheConfig) -> dict[str, float]:
    """Bytes per context token (growth) and fixed bytes per request, over all main layers (of them
    the window rings: `window_bytes_per_request`), and the fixed bytes of the manager (the
    indexer's top-k workspace); paged rows count with their page padding (fp8_584, 64 entries: 37440 B,
    585 B each; fp4_288 and mxfp4_68 pages of 128 entries have none)."""
    window_fmt, comp_fmt, index_fmt = cfg.formats()
    main = row_bytes(cfg, comp_fmt, model.head_dim)
    idx = row_bytes(cfg, index_fmt, model.index_head_dim)
    per_token = fixed = 0.0
    window = model.num_layers * cfg.ring_size(model.window) * row_bytes(cfg, window_fmt, model.head_dim)
    for li in range(model.num_layers):
        kind, ratio = model.layer_type(li), model.compress_ratio(li)
        if kind == SLIDING:
            continue
        coff = 2 if kind == CSA else 1
        per_token += main / ratio
        fixed += cfg.state_rows(coff * ratio) * 2 * coff * model.head_dim * 4
        if kind == CSA:
            per_token += idx / ratio
            fixed += cfg.state_rows(2 * ratio) * 4 * model.index_head_dim * 4
    return {"bytes_per_token": per_token, "fixed_bytes_per_request": fixed + window,
            "window_bytes_per_request": window, "fixed_bytes": 4 * topk_workspace_words(model, cfg)}


def row_bytes(cfg: CacheConfig, fmt: str, dim: int) -> float:
    """Bytes per row of a pool, page padding included (exact rows: dim x the exact dtype's size)."""
    if fmt == formats.EXACT:
        return float(dim * torch.tensor([], dtype=cfg.exact_dtype).element_size())
    return formats.get(fmt).page_bytes(cfg.block_size) / cfg.block_size
