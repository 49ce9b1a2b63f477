"""Cache capacity and modes (separate from the model config), the per-layer pool schema, and the
memory accounting."""

from __future__ import annotations

import dataclasses
import inspect
from dataclasses import dataclass, field

import torch

from dsv4ops.config import CSA, SLIDING, DSV4AttentionConfig
from dsv4ops.indexer.workspace import workspace_words
from dsv4ops.config_v41 import DSV41AttentionConfig
from dsv4ops.quant import formats
from dsv4ops.quant.formats import CacheFormats
from dsv4ops.reference.numerics import Numerics

# The V4 oracle's numerics mode of each V4 pairing of pool formats (dsv4ops.reference.numerics).
_V4_KV = {(formats.EXACT, formats.EXACT): "exact", ("fp8_584", "fp8_584"): "fp8", ("fp8_584", "fp4_288"): "fp4"}
_V4_INDEX = {formats.EXACT: "exact", "fp8_132": "fp8", "mxfp4_68": "mxfp4"}
# CacheConfig's spellings before CacheFormats: the error names the new one.
_RENAMED = {"kv_cache": "formats=CacheFormats(window=..., comp=..., index=...)",
            "indexer_cache": "formats=CacheFormats(window=..., comp=..., index=...)"}


def v4_numerics(fmts: CacheFormats) -> Numerics:
    """The V4 layer's numerics for pool formats `fmts`; ValueError for formats V4 cannot hold (its
    window ring and compressed entries: exact/exact, fp8_584/fp8_584 or fp8_584/fp4_288)."""
    if not isinstance(fmts, CacheFormats):
        raise TypeError(f"formats: expected a dsv4ops.CacheFormats, got {type(fmts).__name__}")
    kv = _V4_KV.get((fmts.window, fmts.comp))
    if kv is None:
        raise ValueError(f"formats: a V4 cache holds (window, comp) in {list(_V4_KV)}, got ({fmts.window!r}, "
                         f"{fmts.comp!r}) (V4.1's formats need a V4.1 stack)")
    return Numerics(kv=kv, indexer=_V4_INDEX[fmts.index])


def default_formats(model) -> CacheFormats:
    """The formats a cache of `model` holds by default, and a layer computes by default: V4's serving
    cache (fp8_584 window rows and entries, fp8_132 keys: DeepSeek's V4 inference formats) or V4.1's
    QAT formats (fp8_528 / fp4_288 / mxfp4_68, what the released V4.1 was trained with)."""
    return CacheFormats.v41() if isinstance(model, DSV41AttentionConfig) else CacheFormats.v4()


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
    one step (sizes the window ring; defaults to max_step_tokens). formats: the CacheFormats of
    the pools (window ring, compressed entries, index keys), which the attached layers compute
    with; None: the model's default (`default_formats`: V4 CacheFormats.v4(), V4.1
    CacheFormats.v41()), resolved by the manager (`for_model`). "exact" pools hold rows of dtype
    `exact_dtype` (float32 gives a bit-level comparison with an fp32 model). block_size: entries
    per page; None: 128 where the index keys are mxfp4_68 (their 512-B page alignment pads 64 keys
    by more than a row), else 64. max_total_tokens: context held by all requests at once
    (sizes the compressed pools; defaults to max_requests x max_context). topk_tokens: tokens one
    launch of the indexer's top-k serves (sizes its workspace, one row of max_context / 4 keys per
    token, shared by the CSA layers; defaults to max_step_tokens, at most max(256, 2^25 / max_context)
    (32 MiB of keys): a decode batch in one launch, a long prefill chunk in a few). max_draft_tokens:
    the most tokens `rewind` may drop (the largest draft a verify step checks; 0: no speculative
    decoding): it sizes the window ring and the compressor-state rings (`ring_size`, `state_rows`),
    and bounds how far behind its parent a fork may start. batch_invariant: the attached layers
    compute every request's rows with schedules fixed independently of the rest of the step (GEMM
    tiles and algorithm, attention splits, fp8_linear's W8A16 / W8A8 choice), so a request's outputs
    are bitwise the same whoever shares its steps (dsv4ops.invariant); False: the fastest schedule
    for each step's size.
    """

    max_requests: int
    max_context: int
    max_step_tokens: int
    formats: CacheFormats | None = None
    block_size: int | None = None
    exact_dtype: torch.dtype = torch.bfloat16
    max_request_step_tokens: int | None = None
    max_total_tokens: int | None = None
    topk_tokens: int | None = None
    buckets: tuple[int, ...] = field(default=())
    max_draft_tokens: int = 0
    batch_invariant: bool = False

    def __post_init__(self):
        if not isinstance(self.batch_invariant, bool):
            raise TypeError(f"batch_invariant: expected a bool, got {type(self.batch_invariant).__name__} "
                            f"{self.batch_invariant!r}")
        if self.formats is not None and not isinstance(self.formats, CacheFormats):
            raise TypeError(f"formats: expected a dsv4ops.CacheFormats or None (the model's default), got "
                            f"{type(self.formats).__name__} {self.formats!r}")
        if self.block_size is None and self.formats is not None:
            object.__setattr__(self, "block_size", 128 if self.formats.index == "mxfp4_68" else 64)
        for name in ("max_requests", "max_context", "max_step_tokens", "block_size", "max_request_step_tokens",
                     "max_total_tokens", "max_draft_tokens"):
            value = getattr(self, name)
            if value is None and name in ("max_request_step_tokens", "max_total_tokens", "block_size"):
                continue
            if isinstance(value, bool) or not isinstance(value, int):
                raise TypeError(f"{name}: expected an int, got {type(value).__name__} {value!r}")
            low = 0 if name == "max_draft_tokens" else 1
            if value < low:
                raise ValueError(f"{name}: expected >= {low}, got {value}")
        if self.formats is not None:
            for fmt in {self.formats.window, self.formats.comp, self.formats.index} - {formats.EXACT}:
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

    def for_model(self, model) -> CacheConfig:
        """This config with its formats (and block size) resolved for `model`, the formats checked
        against what the model's layers hold (a V4 cache refuses V4.1's window format)."""
        fmts = self.formats or default_formats(model)
        if not isinstance(model, DSV41AttentionConfig):
            v4_numerics(fmts)
        return self if fmts == self.formats else dataclasses.replace(self, formats=fmts)


def _refuse_renamed(init):
    """CacheConfig.__init__, with a clear error for the spellings CacheFormats replaced."""
    def __init__(self, *args, **kwargs):
        old = sorted(set(kwargs) & set(_RENAMED))
        if old:
            raise TypeError(f"CacheConfig: {old[0]}= was replaced by {_RENAMED[old[0]]} (dsv4ops.CacheFormats; "
                            f"presets CacheFormats.v4(), .v41(), .exact())")
        init(self, *args, **kwargs)
    __init__.__doc__, __init__.__signature__ = init.__doc__, inspect.signature(init)
    return __init__


CacheConfig.__init__ = _refuse_renamed(CacheConfig.__init__)


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
    cfg = cfg.for_model(model)
    kind, ratio = model.layer_type(layer_idx), model.compress_ratio(layer_idx)
    d, di = model.head_dim, model.index_head_dim
    window, comp, index = cfg.formats.window, cfg.formats.comp, cfg.formats.index
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
    cfg = cfg.for_model(model)
    n_entries = -(-blocks_per_request(cfg, model.csa_ratio) // shards) * cfg.block_size
    return workspace_words(cfg.topk_launch_tokens, n_entries, model.index_topk)


def memory(model: DSV4AttentionConfig, cfg: CacheConfig) -> dict[str, float]:
    """Bytes per context token (growth) and fixed bytes per request, over all main layers (of them
    the window rings: `window_bytes_per_request`), and the fixed bytes of the manager (the
    indexer's top-k workspace); paged rows count with their page padding (fp8_584, 64 entries: 37440 B,
    585 B each; fp4_288 and mxfp4_68 pages of 128 entries have none)."""
    cfg = cfg.for_model(model)
    window_fmt, comp_fmt, index_fmt = cfg.formats.window, cfg.formats.comp, cfg.formats.index
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
