"""Argument sets of the dsv4:: ops (tiny, valid, fresh per call), the ops' public functions on
them, and helpers of the bad-input tables."""

from __future__ import annotations

import torch
from torch import Tensor

import dsv4ops  # noqa: F401  (registers the dsv4:: ops these arguments are for)

# Tiny valid argument sets, built fresh per call (the ops mutate them), as dicts in schema order.
# Exact pools take rows of any width, so the default rows are 16-d (rope 8); byte formats fix the
# width (512-d main rows, 128-d index rows) and take 64 rope dims. `fmt` is a float dtype (an exact
# pool of that dtype), a format name of dsv4ops/quant/formats.py, or FP8: the V4 format of the
# width (fp8_584 for 512-d rows, fp8_132 for 128-d rows).
FP8 = "fp8"


def format_name(fmt, dim: int) -> str:
    """The format name of a factory's `fmt` for `dim`-wide rows."""
    from dsv4ops.quant import formats

    if isinstance(fmt, torch.dtype):
        return formats.EXACT
    if fmt == FP8:
        return "fp8_584" if dim == 512 else "fp8_132"
    return fmt


def page_pool(blocks: int, block_size: int, dim: int, fmt, device=None) -> Tensor:
    """A poisoned page pool: a byte format (uint8, every byte 0xFF, an e4m3 NaN) or exact float rows
    (NaN)."""
    from dsv4ops.quant import formats

    name = format_name(fmt, dim)
    shape = formats.pool_shape(name, blocks, block_size, dim)
    if name == formats.EXACT:
        return torch.full(shape, float("nan"), dtype=fmt, device=device)
    return torch.full(shape, 255, dtype=torch.uint8, device=device)


def fill_pool(pool: Tensor, dim: int, fmt) -> Tensor:
    """Store a random N(0, 1) row in every slot of `pool` (through the reference pack); returns it."""
    from dsv4ops.quant.api import pool_slots
    from dsv4ops.quant.reference import pack_kv

    name = format_name(fmt, dim)
    n = pool_slots(pool, name)
    pack_kv(torch.randn(n, dim, device=pool.device), torch.arange(n, dtype=torch.int32, device=pool.device), pool,
            name)
    return pool


def step_tokens(*runs: tuple[int, int, int], pad: int = 0, device=None) -> tuple[Tensor, Tensor]:
    """(positions, req_slots) int32 of a flat step: each run (request, first position, count), then
    `pad` padding tokens (request -1, position 0)."""
    pos = [p for _, start, n in runs for p in range(start, start + n)] + [0] * pad
    req = [r for r, _, n in runs for _ in range(n)] + [-1] * pad
    return (torch.tensor(pos, dtype=torch.int32, device=device), torch.tensor(req, dtype=torch.int32, device=device))


def complex_rope(x: Tensor, positions: Tensor, inv_freq: Tensor, inverse: bool = False) -> Tensor:
    """RoPE written independently of reference.functional (for expected values): the trailing 2n
    channels of x [T, ..., D] as n complex numbers (interleaved pairs) times e^(+-i t theta), in fp32
    (fp64 for fp64 inputs), the result in x's dtype."""
    acc = torch.float64 if x.dtype == torch.float64 else torch.float32
    n = inv_freq.shape[0]
    z = torch.view_as_complex(x[..., -2 * n:].to(acc).unflatten(-1, (n, 2)).contiguous())
    angle = positions.to(acc)[:, None] * inv_freq.to(acc)
    angle = angle.view(angle.shape[0], *([1] * (x.dim() - 2)), n)
    rotated = torch.view_as_real(z * torch.polar(torch.ones_like(angle), -angle if inverse else angle)).flatten(-2)
    return torch.cat([x[..., :-2 * n], rotated.to(x.dtype)], -1)


def rope_table(rope_dim: int) -> Tensor:
    """fp32 inverse frequencies of theta 10000 over `rope_dim` trailing channels."""
    from dsv4ops.config import rope_inv_freq

    return rope_inv_freq(10000.0, rope_dim, None)


def _rows(shape, dtype, noncontig: bool) -> Tensor:
    """randn rows; noncontig: a view whose leading strides have a gap (the last dim stays contiguous)."""
    if not noncontig:
        return torch.randn(shape, dtype=dtype)
    return torch.randn(*shape[:-1], shape[-1] + 8, dtype=dtype)[..., : shape[-1]]


def _dims(fmt, dim: int, main: bool = True) -> tuple[int, int]:
    """(row width, rope dims): byte formats fix the width (V4's FP8: 512 main, 128 indexer) and take
    64 rope dims."""
    from dsv4ops.quant import formats

    if isinstance(fmt, torch.dtype):
        return dim, min(8, dim)
    if fmt == FP8:
        return (512 if main else 128), 64
    return formats.get(fmt).dim, 64


DEFAULT_RUNS = ((0, 5, 3), (1, 0, 2))  # request 0 continues at position 5, request 1 starts; + padding


def pack_kv_args(dtype=torch.float32, fmt=None, dim=16, main=True, slots=(5, -1, 0), blocks=2,
                 block_size=4) -> dict:
    fmt = fmt or dtype
    dim, _ = _dims(fmt, dim, main)
    name = format_name(fmt, dim)
    return dict(x=torch.randn(len(slots), dim, dtype=dtype), slots=torch.tensor(slots, dtype=torch.int32),
                cache=fill_pool(page_pool(blocks, block_size, dim, fmt), dim, fmt), fmt=name)


def unpack_kv_args(dtype=torch.float32, fmt=None, dim=16, main=True, slots=(5, -1, 0), blocks=2,
                   block_size=4) -> dict:
    fmt = fmt or dtype
    dim, _ = _dims(fmt, dim, main)
    return dict(cache=fill_pool(page_pool(blocks, block_size, dim, fmt), dim, fmt),
                slots=torch.tensor(slots, dtype=torch.int32), out=torch.empty(len(slots), dim, dtype=dtype),
                fmt=format_name(fmt, dim))


def qkv_prep_args(dtype=torch.float32, fmt=None, heads=2, dim=16, runs=DEFAULT_RUNS, pad=1, ring=8, requests=2,
                  block_size=4, noncontig=False, q_norm=True) -> dict:
    fmt = fmt or dtype
    dim, rope = _dims(fmt, dim)
    positions, req_slots = step_tokens(*runs, pad=pad)
    t = positions.shape[0]
    return dict(q=_rows((t, heads, dim), dtype, noncontig), kv=torch.randn(t, dim, dtype=dtype), positions=positions,
                req_slots=req_slots, inv_freq=rope_table(rope), q_out=torch.empty(t, heads, dim, dtype=dtype),
                window_cache=fill_pool(page_pool(requests * ring // block_size, block_size, dim, fmt), dim, fmt),
                ring_size=ring, eps=1e-6, q_norm=q_norm, window_fmt=format_name(fmt, dim))


def entry_slots_of(positions: Tensor, req_slots: Tensor, ratio: int, per_request: int) -> Tensor:
    """Pool slot r * per_request + p // ratio for the tokens that close an entry, else -1."""
    pos, req = positions.long(), req_slots.long()
    closes = (req >= 0) & ((pos + 1) % ratio == 0)
    return torch.where(closes, req * per_request + pos // ratio, -1).to(torch.int32)


def compressor_update_args(dtype=torch.float32, fmt=None, dim=8, ratio=4, overlap=True, main=True,
                           runs=((0, 2, 5), (1, 0, 3)), pad=1, requests=2, blocks=4, block_size=4,
                           latent=False, hadamard=False, batch_invariant=False) -> dict:
    """latent: a latent_out buffer (in the entry dtype) instead of None; hadamard, batch_invariant: the
    op's flags (the second only when set)."""
    from dsv4ops.compressor.checks import entry_dtype

    fmt = fmt or dtype
    d, rope = _dims(fmt, dim, main)
    rope = min(rope, d // 2)
    width = (2 if overlap else 1) * d
    positions, req_slots = step_tokens(*runs, pad=pad)
    t = positions.shape[0]
    cache = fill_pool(page_pool(blocks, block_size, d, fmt), d, fmt)
    name = format_name(fmt, d)
    args = dict(
        kv=torch.randn(t, width, dtype=dtype), score=torch.randn(t, width, dtype=dtype),
        ape=torch.randn(ratio, width), positions=positions, req_slots=req_slots,
        entry_slots=entry_slots_of(positions, req_slots, ratio, blocks * block_size // requests),
        norm_weight=1 + 0.1 * torch.randn(d), inv_freq=rope_table(rope),
        state=torch.randn(requests, width // d * ratio, 2 * width), cache=cache,
        latent_out=torch.empty(t, d, dtype=entry_dtype(cache, name)) if latent else None, eps=1e-6, fmt=name,
        hadamard=hadamard,
    )
    return dict(args, batch_invariant=True) if batch_invariant else args


def indexer_q_prep_args(dtype=torch.float32, fmt="exact", heads=2, dim=16, tokens=3, noncontig=False,
                        hadamard=False) -> dict:
    """fmt: the query's format (exact, fp8_132 or mxfp4_68; the last two take 128-d rows);
    hadamard: the op's flag."""
    from dsv4ops.quant import formats

    if fmt != formats.EXACT:
        dim = formats.get(fmt).dim
    out = {formats.EXACT: ((tokens, heads, dim), dtype), "fp8_132": ((tokens, heads, dim), torch.float8_e4m3fn),
           "mxfp4_68": ((tokens, heads, 68), torch.uint8)}[fmt]
    return dict(q=_rows((tokens, heads, dim), dtype, noncontig), weights=torch.randn(tokens, heads, dtype=dtype),
                positions=torch.arange(3, 3 + tokens, dtype=torch.int32), inv_freq=rope_table(min(8, dim)),
                q_out=torch.empty(*out[0], dtype=out[1]), w_out=torch.empty(tokens, heads), fmt=fmt, hadamard=hadamard)


def mx4_query(q: Tensor) -> Tensor:
    """Packed 68-B MX4 rows [T, H, 68] of a float query [T, H, 128] (the mxfp4_68 codec)."""
    from dsv4ops.quant import codecs

    t, h, d = q.shape
    data, scales = codecs.encode("mxfp4_68", q.reshape(t * h, d))
    return torch.cat([data, scales], 1).view(t, h, -1)


def indexer_k_prep_args(dtype=torch.float32, fmt=None, dim=16, di=16, runs=((0, 2, 5), (1, 0, 3)), pad=1, ratio=2,
                        requests=2, blocks=4, block_size=4, noncontig=False) -> dict:
    """Keys of `fmt` (a dtype, FP8 or a format name; byte formats take 128-d keys)."""
    fmt = fmt or dtype
    di, rope = _dims(fmt, di, main=False)
    positions, req_slots = step_tokens(*runs, pad=pad)
    t = positions.shape[0]
    return dict(latent=_rows((t, dim), dtype, noncontig), positions=positions, req_slots=req_slots,
                entry_slots=entry_slots_of(positions, req_slots, ratio, blocks * block_size // requests),
                wk=torch.randn(di, dim) / dim**0.5, k_norm_weight=1 + 0.1 * torch.randn(di),
                inv_freq=rope_table(min(rope, di // 2)),
                cache=fill_pool(page_pool(blocks, block_size, di, fmt), di, fmt), ratio=ratio, eps=1e-6,
                fmt=format_name(fmt, di))


def indexer_topk_args(dtype=torch.float32, fmt=None, heads=2, dim=16, runs=DEFAULT_RUNS, pad=1, ratio=2, k=3,
                      requests=2, table_blocks=2, block_size=4, noncontig=False, cand_blocks=0, pool_blocks=0,
                      cand_block=2) -> dict:
    """Request r owns blocks r * table_blocks ..; q is e4m3 when dtype is torch.float8_e4m3fn and
    packed MX4 rows when dtype is torch.uint8. cand_blocks > 0: a `cand` of that many candidate
    blocks per token (the first ones, then -1); pool_blocks > 0: a `cand_out` of that width."""
    fmt = fmt or (torch.float32 if dtype in (torch.float8_e4m3fn, torch.uint8) else dtype)
    dim, _ = _dims(fmt, dim, main=False)
    if dtype == torch.uint8:
        dim = 128
    positions, req_slots = step_tokens(*runs, pad=pad)
    t = positions.shape[0]
    q = _rows((t, heads, dim), torch.float32, noncontig)
    q = mx4_query(q) if dtype == torch.uint8 else q.to(dtype)
    table = torch.arange(requests * table_blocks, dtype=torch.int32).view(requests, table_blocks)
    cand = None
    if cand_blocks:
        cand = torch.arange(cand_blocks, dtype=torch.int32).repeat(t, 1)
        cand[:, -1] = -1
    return dict(q=q, weights=torch.randn(t, heads), positions=positions, req_slots=req_slots,
                cache=fill_pool(page_pool(requests * table_blocks, block_size, dim, fmt), dim, fmt), block_table=table,
                cand=cand, idx_out=torch.empty(t, k, dtype=torch.int32),
                cand_out=torch.empty(t, pool_blocks, dtype=torch.int32) if pool_blocks else None,
                workspace=topk_workspace(t, table_blocks * block_size, k), ratio=ratio,
                cand_block=cand_block if cand_blocks or pool_blocks else 0, fmt=format_name(fmt, dim))


def topk_workspace(tokens: int, n_entries: int, k: int, device=None, cand_cols: int = 0, keep: int = 0,
                   cand_block: int = 1) -> Tensor:
    """A poisoned indexer_topk workspace for launches of `tokens` tokens (int32 0x7FFFFFFF); the
    candidate options as indexer.workspace.layout."""
    from dsv4ops.indexer.workspace import workspace_words

    words = workspace_words(tokens, n_entries, k, cand_cols, keep, cand_block)
    return torch.full((words,), 2**31 - 1, dtype=torch.int32, device=device)


def sparse_attn_args(dtype=torch.float32, fmt=None, heads=2, dim=16, runs=DEFAULT_RUNS, pad=1, window=4, ring=8,
                     requests=2, block_size=4, comp_blocks=2, entries=3, noncontig=False, comp_fmt=None,
                     blocks=False) -> dict:
    """comp_idx rows: random slots of the compressed pool, the last column -1; comp_lens lists every
    column but the first token's last one (a listed -1 and an unlisted slot both read nothing).
    comp_fmt: the compressed pool's format when it differs from the window's (V4.1: fp8_528 /
    fp4_288). blocks: window_ends = the last position of each token's run (each run one draft block
    that sees itself both ways); otherwise None (causal windows)."""
    fmt = fmt or dtype
    comp_fmt = comp_fmt or fmt
    dim, _ = _dims(fmt, dim)
    positions, req_slots = step_tokens(*runs, pad=pad)
    t = positions.shape[0]
    comp_idx = torch.randint(0, comp_blocks * block_size, (t, entries), dtype=torch.int32)
    comp_idx[:, -1] = -1
    comp_lens = torch.full((t,), entries, dtype=torch.int32)
    comp_lens[0] = entries - 1
    window_ends = None
    if blocks:
        window_ends = torch.tensor([start + n - 1 for _, start, n in runs for _ in range(n)] + [0] * pad,
                                   dtype=torch.int32)
    return dict(q=_rows((t, heads, dim), dtype, noncontig),
                window_cache=fill_pool(page_pool(requests * ring // block_size, block_size, dim, fmt), dim, fmt),
                comp_cache=fill_pool(page_pool(comp_blocks, block_size, dim, comp_fmt), dim, comp_fmt),
                positions=positions, req_slots=req_slots, comp_idx=comp_idx, comp_lens=comp_lens,
                window_ends=window_ends, sinks=torch.randn(heads), out=torch.empty(t, heads, dim, dtype=dtype),
                scale=dim**-0.5, window=window, ring_size=ring, window_fmt=format_name(fmt, dim),
                comp_fmt=format_name(comp_fmt, dim))


def attn_merge_args(dtype=torch.float32, shards=2, tokens=3, heads=2, dim=16, noncontig=False) -> dict:
    """R shards' partials and log-sum-exps: with 3 tokens or more, token 1's shard 0 has no key (lse
    -inf, a zero row) and the last token no key in any shard (a padding token's row)."""
    lse = torch.randn(shards, tokens, heads) * 3
    if tokens > 2:
        lse[0, 1] = float("-inf")
        lse[:, -1] = float("-inf")
    partials = _rows((shards, tokens, heads, dim), dtype, noncontig)
    partials[lse == float("-inf")] = 0
    return dict(partials=partials, lse=lse, sinks=torch.randn(heads), out=torch.empty(tokens, heads, dim, dtype=dtype))


def sparse_attn_gpu_case(heads: int, prefill: bool, entries: int = 512, pool=FP8, padding: bool = False,
                         seed: int = 0, block_size: int = 64, ring: int = 256):
    """(q, window_cache, comp_cache, positions, req_slots, comp_idx, comp_lens, sinks) on CUDA, V4
    dims: decode tokens of separate requests at positions 0, 5, 126, 127, 128, 1000, 4095, 70000
    (windows cut short below 127), or one request's prefill chunk at positions 60..315 (across the
    first window's end); 10% -1 entries inside comp_idx rows and every other row's comp_lens cut at
    random; with `padding`, every 7th token from the 4th a padding token (request -1)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    if prefill:
        pos = torch.arange(60, 316, dtype=torch.int32, device="cuda")
        req = torch.zeros_like(pos)
    else:
        pos = torch.tensor([0, 5, 126, 127, 128, 1000, 4095, 70000], dtype=torch.int32, device="cuda")
        req = torch.arange(pos.shape[0], dtype=torch.int32, device="cuda")
    t, n_req = pos.shape[0], int(req.max()) + 1
    if padding:
        req[3::7] = -1
    wc = fill_pool(page_pool(n_req * ring // block_size, block_size, 512, pool, device="cuda"), 512, pool)
    cc = fill_pool(page_pool(2 * entries // block_size + 1, block_size, 512, pool, device="cuda"), 512, pool)
    n_slots = cc.shape[0] * block_size
    idx = torch.stack([torch.randperm(n_slots, device="cuda", generator=g)[:entries] for _ in range(t)]).int()
    idx[torch.rand(idx.shape, device="cuda", generator=g) < 0.1] = -1
    lens = torch.randint(0, entries + 1, (t,), device="cuda", generator=g).int()
    lens[::2] = entries
    q = torch.randn(t, heads, 512, device="cuda", generator=g).bfloat16()
    sinks = torch.randn(heads, device="cuda", generator=g)
    return q, wc, cc, pos, req, idx, lens, sinks


def visible_entries_args(ratio=2, block_size=4, blocks=3, requests=2, runs=DEFAULT_RUNS, pad=1) -> dict:
    """A block table of distinct random blocks of a pool of requests x blocks blocks (its numel: the
    public function's pool_blocks) whose last column is unallocated (-1), the tokens of `runs` then
    `pad` padding tokens, and out poisoned (int32 max) so an unwritten element shows."""
    positions, req_slots = step_tokens(*runs, pad=pad)
    table = torch.randperm(requests * blocks).to(torch.int32).view(requests, blocks)
    table[:, -1] = -1
    return dict(block_table=table, positions=positions, req_slots=req_slots,
                out=torch.full((positions.shape[0], blocks * block_size), 2**31 - 1, dtype=torch.int32), ratio=ratio,
                block_size=block_size)


def inv_rope_args(dtype=torch.float32, heads=2, dim=16, tokens=3, noncontig=False) -> dict:
    return dict(o=_rows((tokens, heads, dim), dtype, noncontig), positions=torch.arange(tokens, dtype=torch.int32) * 7,
                inv_freq=rope_table(min(8, dim)), out=torch.empty(tokens, heads, dim, dtype=dtype))


def block_fp8_weight(n: int, k: int, block: int, scale_dtype=torch.float8_e8m0fnu, seed: int = 0):
    """(e4m3 weight [n, k] ~ N(0, 1) in its bytes, tile scales [ceil(n / block), ceil(k / block)]):
    UE8M0 scales 2^-10 .. 2^10 (bytes 117..137), or fp32 scales in [0.25, 1.25) (not powers of two)."""
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=g).to(torch.float8_e4m3fn)
    tiles = (-(-n // block), -(-k // block))
    if scale_dtype == torch.float8_e8m0fnu:
        scale = torch.randint(117, 138, tiles, generator=g, dtype=torch.uint8).view(torch.float8_e8m0fnu)
    else:
        scale = (torch.rand(tiles, generator=g) + 0.25).to(scale_dtype)
    return weight, scale


def fp8_linear_args(dtype=torch.float32, block=32, n=70, k=100, tokens=3, scale_dtype=torch.float8_e8m0fnu,
                    noncontig=False, groups=1, batch_invariant=False) -> dict:
    """groups > 1: the block-diagonal form, x [tokens, groups x k] (n a multiple of groups x 32);
    batch_invariant: its one-config-for-every-M form."""
    weight, scale = block_fp8_weight(n, k, block, scale_dtype)
    if scale.dtype == torch.float8_e8m0fnu:
        scale = scale.view(torch.uint8)  # the op takes UE8M0 scales as their bytes
    args = dict(x=_rows((tokens, groups * k), dtype, noncontig), weight=weight, scale=scale,
                out=torch.empty(tokens, n, dtype=dtype), block=block)
    return args if (groups, batch_invariant) == (1, False) else dict(args, groups=groups, batch_invariant=batch_invariant)


def fp8_linear_w8a8_args(dtype=torch.float32, n=200, k=384, tokens=3, scale_dtype=torch.float8_e8m0fnu,
                         noncontig=False) -> dict:
    """fp8_linear_args for the W8A8 op: 128 x 128 tiles (N ragged), K in whole 1 x 128 blocks, fp32 scales
    (UE8M0 values, or V3-style ones)."""
    args = fp8_linear_args(dtype, 128, n, k, tokens, scale_dtype, noncontig)
    args["scale"] = (args["scale"].view(torch.float8_e8m0fnu) if args["scale"].dtype == torch.uint8
                     else args["scale"]).float()
    return args


def invariant_linear_args(dtype=torch.float32, n=70, k=40, tokens=3, out_dtype=None, noncontig=False) -> dict:
    """x [tokens, k] (rows strided with `noncontig`), weight [n, k], out [tokens, n] in out_dtype (x's)."""
    return dict(x=_rows((tokens, k), dtype, noncontig), weight=torch.randn(n, k).to(dtype),
                out=torch.empty(tokens, n, dtype=out_dtype or dtype))


_PUBLIC = {
    "pack_kv": lambda api, a: api.pack_kv(a["x"], a["slots"], a["cache"], a["fmt"]),
    "unpack_kv": lambda api, a: api.unpack_kv(a["cache"], a["slots"], a["out"].shape[1], a["out"].dtype, a["fmt"]),
    "qkv_prep": lambda api, a: api.qkv_prep(a["q"], a["kv"], a["positions"], a["req_slots"], a["inv_freq"],
                                            a["window_cache"], a["ring_size"], a["eps"], a["window_fmt"],
                                            q_norm=a["q_norm"]),
    "compressor_update": lambda api, a: api.compressor_update(
        a["kv"], a["score"], a["ape"], a["positions"], a["req_slots"], a["entry_slots"], a["norm_weight"],
        a["inv_freq"], a["state"], a["cache"], a["eps"], a["fmt"], latent=a["latent_out"] is not None,
        hadamard=a.get("hadamard", False)),
    "indexer_q_prep": lambda api, a: api.indexer_q_prep(a["q"], a["weights"], a["positions"], a["inv_freq"],
                                                        fmt=a["fmt"], hadamard=a.get("hadamard", False)),
    "indexer_k_prep": lambda api, a: api.indexer_k_prep(a["latent"], a["positions"], a["req_slots"],
                                                        a["entry_slots"], a["wk"], a["k_norm_weight"], a["inv_freq"],
                                                        a["cache"], a["ratio"], a["eps"], a["fmt"]),
    "indexer_topk": lambda api, a: api.indexer_topk(
        a["q"], a["weights"], a["positions"], a["req_slots"], a["cache"], a["block_table"], a["idx_out"].shape[1],
        a["ratio"], a["fmt"], cand=a["cand"], cand_block=a["cand_block"],
        pool_blocks=0 if a["cand_out"] is None else a["cand_out"].shape[1]),
    "sparse_attn": lambda api, a: api.sparse_attn(a["q"], a["window_cache"], a["comp_cache"], a["positions"],
                                                  a["req_slots"], a["comp_idx"], a["sinks"], a["scale"], a["window"],
                                                  a["ring_size"], a["window_fmt"], a["comp_fmt"],
                                                  comp_lens=a["comp_lens"], window_ends=a["window_ends"]),
    "attn_merge": lambda api, a: api.attn_merge(a["partials"], a["lse"], a["sinks"]),
    "visible_entries": lambda api, a: api.visible_entries(a["block_table"], a["positions"], a["req_slots"], a["ratio"],
                                                          a["block_size"], a["block_table"].numel()),
    "inv_rope": lambda api, a: api.inv_rope(a["o"], a["positions"], a["inv_freq"]),
    "fp8_linear": lambda api, a: api.fp8_linear(a["x"], a["weight"], a["scale"], a["block"],
                                                groups=a.get("groups", 1)),
    "fp8_linear_w8a8": lambda api, a: api.fp8_linear(a["x"], a["weight"], a["scale"], a["block"], "fp8"),
    "invariant_linear": lambda api, a: api.invariant_linear(a["x"], a["weight"], a["out"].dtype),
}
_FAMILY = {"pack_kv": "quant", "unpack_kv": "quant", "qkv_prep": "qkv_prep", "compressor_update": "compressor",
           "indexer_q_prep": "indexer", "indexer_k_prep": "indexer", "indexer_topk": "indexer",
           "visible_entries": "visible_entries", "sparse_attn": "sparse_attn", "attn_merge": "attn_merge",
           "inv_rope": "inv_rope",
           "fp8_linear": "fp8_linear", "fp8_linear_w8a8": "fp8_linear", "invariant_linear": "invariant_linear"}


def public(name: str):
    """fn(args): the public function of `dsv4::name` (dsv4ops.<family>.api) called on the op's
    arguments from the factories above; the op's outputs are dropped (their width, dtype or k are
    passed where the function takes them). Traceable by torch.compile."""
    import functools
    import importlib

    return functools.partial(_PUBLIC[name], importlib.import_module(f"dsv4ops.{_FAMILY[name]}.api"))


def call_public(name: str, args: dict):
    return public(name)(args)


def call_op(name: str, args: dict) -> None:
    getattr(torch.ops.dsv4, name).default(*args.values())


def bytes_equal(a: Tensor, b: Tensor) -> bool:
    """Bit-for-bit equality (NaN payloads included)."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))


def assert_rejected(name: str, args: dict, error: type, match: str, via: tuple[str, ...] = ("op", "public")):
    """Calling `dsv4::name` (via "op") and its public function (via "public") on `args` raises
    `error` matching `match`, and leaves every tensor argument bit-for-bit as it was."""
    import pytest

    before = {k: v.clone() for k, v in args.items() if isinstance(v, Tensor) and v.device.type != "meta"}
    for path in via:
        with pytest.raises(error, match=match):
            (call_op if path == "op" else call_public)(name, args)
        for k, v in before.items():
            assert bytes_equal(args[k], v), f"{name} via {path}: the rejected call changed {k}"


def assert_bad_case(name: str, args: dict, mutate, match: str, via: list):
    """One row of a bad-input table: mutate the arguments, then the op and/or its public function
    reject them (metadata: RuntimeError from torch._check in both; values: ValueError from the public
    function only) and write nothing. `via` is the row's optional tail: [] (both paths) or [paths]."""
    mutate(args)
    paths = via[0] if via else ("op", "public")
    assert_rejected(name, args, ValueError if paths == ("public",) else RuntimeError, match, paths)


def with_arg(key: str, make):
    """A mutation of an argument dict: args[key] = make(args) (for tables of bad inputs)."""

    def mutate(args: dict):
        args[key] = make(args)

    return mutate


ROUTER_OPS = frozenset({"gate_topk", "hash_route", "router_gate"})


def dsv4_ops() -> set[str]:
    """Names of every registered dsv4:: op."""
    ns = torch.ops.dsv4
    return {n for n in dir(ns) if isinstance(getattr(ns, n), torch._ops.OpOverloadPacket)}
