"""Triton kernels of `dsv4::pack_kv` / `dsv4::unpack_kv`, and the Triton building blocks every
attention kernel shares: exact casts, the paged cache entry formats (load / store), RoPE, launch.

Formats (quant/reference.py is the specification): the 584-B main entry paged as
[bs x 576 B data][bs x 8 B scales] padded to a multiple of 576 B; the 132-B indexer entry paged
as [bs x 128 B][bs x 4 B fp32 scale]; float pools [blocks, bs, d]. FMT constexpr: 0 = float
pool, 1 = main FP8 entry (d = 512), 2 = indexer FP8 entry (d = 128).

Exactness: the UE8M0 exponent comes from the bits of the amax (no division, so it equals the
reference's frexp rule bit for bit), scaling is by exact powers of two, and the casts round to
nearest even. Triton's interpreter truncates fp32 -> bf16 and rounds fp8 ties away from zero, so
under the interpreter (SOFT) the casts run as integer code with the same results as the GPU's cvt.
All byte offsets are int64.
"""

import contextlib

import torch
import triton
import triton.language as tl

from dsv4ops.quant import checks as _checks
from dsv4ops.quant.reference import INDEXER_DIM, MAIN_DIM, MAIN_ROPE

INTERPRET = bool(triton.knobs.runtime.interpret)

FMT_FLOAT, FMT_MAIN, FMT_INDEXER = 0, 1, 2
TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


# ---- launching (one place, so the AOT compile test can record every launch) ---------------------
_recorder: list | None = None


@contextlib.contextmanager
def recording():
    """Record launches instead of running them: yields a list of (kernel, args, constexprs,
    num_warps). The CPU test compiles each recorded launch ahead of time for sm_90 / sm_100."""
    global _recorder
    saved, _recorder = _recorder, []
    try:
        yield _recorder
    finally:
        _recorder = saved


def launch(kernel, grid, args: tuple, constexprs: dict, num_warps: int = 4):
    """kernel[grid](*args, **constexprs) on the current stream (Triton's default)."""
    if _recorder is not None:
        _recorder.append((kernel, args, dict(constexprs), num_warps))
        return
    kernel[grid](*args, **constexprs, num_warps=num_warps)


def pool_format(cache: torch.Tensor, width: int) -> int:
    if cache.dtype != torch.uint8:
        return FMT_FLOAT
    return FMT_MAIN if width == MAIN_DIM else FMT_INDEXER


def block_size(cache: torch.Tensor, fmt: int) -> int:
    from dsv4ops.quant.reference import indexer_block_size, main_block_size

    if fmt == FMT_MAIN:
        return main_block_size(cache.shape[1])
    if fmt == FMT_INDEXER:
        return indexer_block_size(cache.shape[1])
    return cache.shape[1]


def require(ok: bool, op: str, arg: str, expected: str, got):
    """The kernels take the V4 layout dims only; the reference kernel serves the rest."""
    if not ok:
        raise ValueError(f"{arg}: the Triton kernel of dsv4::{op} expects {expected}, got {got} "
                         f"(the reference kernel serves other layouts)")


def require_layout(op: str, head_dim: int, rope_pairs: int, dims=(MAIN_DIM,)):
    require(head_dim in dims, op, "head_dim", f"one of {list(dims)} (V4 layout)", head_dim)
    require(rope_pairs == MAIN_ROPE // 2, op, "inv_freq", f"{MAIN_ROPE // 2} frequencies (rope dim {MAIN_ROPE})",
            rope_pairs)


# ---- exact casts -------------------------------------------------------------------------------
@triton.jit
def f32_to_bf16(x, SOFT: tl.constexpr):
    """Round to nearest even (the interpreter's own cast truncates)."""
    if SOFT:
        b = x.to(tl.uint32, bitcast=True)
        b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16
        return b.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    else:
        return x.to(tl.bfloat16)


@triton.jit
def to_f32(x, SOFT: tl.constexpr):
    if SOFT and x.dtype == tl.bfloat16:
        return (x.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        return x.to(tl.float32)


@triton.jit
def round_to(x, DT: tl.constexpr, SOFT: tl.constexpr):
    """fp32 x -> dtype DT, round to nearest even."""
    if DT == tl.bfloat16:
        return f32_to_bf16(x, SOFT)
    else:
        return x.to(DT)


@triton.jit
def round_via(x, DT: tl.constexpr, SOFT: tl.constexpr):
    """fp32 x rounded to dtype DT, returned as fp32 (the value a tensor of dtype DT holds)."""
    return to_f32(round_to(x, DT, SOFT), SOFT)


@triton.jit
def f32_to_e4m3_bits(x, SOFT: tl.constexpr):
    """e4m3 (fn) code of x, round to nearest even, saturating at 448 (|x| <= 448 here)."""
    if SOFT:
        bits = x.to(tl.int32, bitcast=True)
        sign = (bits >> 24) & 0x80
        e = ((bits >> 23) & 0xFF) - 127
        qe = tl.maximum(e, -6) - 3  # exponent of one quantum at x's binade (subnormals: 2^-9)
        n = tl.abs(x) * ((127 - qe) << 23).to(tl.float32, bitcast=True)  # exact: power-of-two scaling
        f = n.to(tl.int32)
        frac = n - f.to(tl.float32)
        f = f + ((frac > 0.5) | ((frac == 0.5) & ((f & 1) == 1))).to(tl.int32)
        code = tl.where(e >= -6, ((e + 7) << 3) + f - 8, f)  # f == 16 carries into the exponent
        code = tl.minimum(code, 0x7E)
        return (code | sign).to(tl.uint8)
    else:
        return x.to(tl.float8e4nv).to(tl.uint8, bitcast=True)


@triton.jit
def e4m3_bits_to_f32(c, SOFT: tl.constexpr):
    if SOFT:
        ci = c.to(tl.int32)
        e = (ci >> 3) & 15
        m = ci & 7
        normal = (8 + m).to(tl.float32) * ((e + 117) << 23).to(tl.float32, bitcast=True)
        mag = tl.where(e == 0, m.to(tl.float32) * 0.001953125, normal)
        mag = tl.where((ci & 0x7F) == 0x7F, float("nan"), mag)
        # the sign as a bit (Triton's unary minus is 0 - x, which turns -0 into +0)
        return (mag.to(tl.uint32, bitcast=True) | ((ci & 0x80).to(tl.uint32) << 24)).to(tl.float32, bitcast=True)
    else:
        return c.to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def pow2(e):
    """2^e as fp32 for integer e in [-126, 127], exactly."""
    return ((e + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def ue8m0_exponent(amax):
    """e = ceil(log2(max(amax, 1e-4) / 448)) exactly as the reference's frexp rule: with
    amax = 1.f x 2^E, amax <= 448 x 2^k  <=>  k >= E - 8 (1.f <= 1.75) or k >= E - 7."""
    bits = tl.maximum(amax, 1e-4).to(tl.int32, bitcast=True)
    return ((bits >> 23) & 0xFF) - 127 - 8 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)


# ---- RoPE --------------------------------------------------------------------------------------
@triton.jit
def rope_coeffs(freq_ptr, pos, D: tl.constexpr, ROPE: tl.constexpr):
    """cos, sin [D // 2] of the interleaved pairs of a D-wide row whose trailing ROPE dims rotate
    (pair p <-> channels 2p, 2p + 1), and the mask of rotating pairs. angle = fp32(pos) x inv_freq."""
    p = tl.arange(0, D // 2)
    fi = p - (D - ROPE) // 2
    rot = fi >= 0
    freq = tl.load(freq_ptr + tl.maximum(fi, 0), mask=rot, other=0.0)
    ang = pos.to(tl.float32) * freq
    return tl.cos(ang), tl.sin(ang), rot


@triton.jit
def apply_rope(x, cos, sin, rot, R: tl.constexpr, D: tl.constexpr, INVERSE: tl.constexpr):
    """Rotate the trailing rope pairs of fp32 rows x [R, D]; other channels pass unchanged."""
    x0, x1 = tl.split(tl.reshape(x, [R, D // 2, 2]))
    c = cos[None, :]
    s = sin[None, :]
    if INVERSE:
        s = s * -1.0  # not -s: Triton's unary minus is 0 - x, which loses the sign of zero
    y0 = tl.where(rot[None, :], x0 * c - x1 * s, x0)
    y1 = tl.where(rot[None, :], x0 * s + x1 * c, x1)
    return tl.reshape(tl.join(y0, y1), [R, D])


# ---- paged entries -----------------------------------------------------------------------------
@triton.jit
def _main_offsets(slots, block_size):
    block_bytes = ((block_size * 584 + 575) // 576) * 576
    blk = slots // block_size
    off = slots % block_size
    base = blk * block_bytes
    return base + off * 576, base + block_size * 576 + off * 8


@triton.jit
def _indexer_offsets(slots, block_size):
    blk = slots // block_size
    off = slots % block_size
    base = blk * (block_size * 132)
    return base + off * 128, base + block_size * 128 + off * 4


@triton.jit
def store_rows(cache_ptr, slots, mask, x, block_size, R: tl.constexpr, D: tl.constexpr, FMT: tl.constexpr,
               SOFT: tl.constexpr):
    """Write fp32 rows x [R, D] at int64 `slots` [R] (rows with mask False: nothing).
    Float pools get x rounded to their dtype; FP8 entries quantize bf16(x) as the reference packer."""
    if FMT == 0:
        cols = tl.arange(0, D)
        v = round_to(x, cache_ptr.dtype.element_ty, SOFT)
        tl.store(cache_ptr + slots[:, None] * D + cols[None, :], v, mask=mask[:, None])
    elif FMT == 1:
        data_at, scale_at = _main_offsets(slots, block_size)
        v = tl.reshape(round_via(x, tl.bfloat16, SOFT), [R, 8, 64])
        e = ue8m0_exponent(tl.max(tl.abs(v), axis=2))  # [R, 8]; block 7 is the bf16 rope part
        codes = f32_to_e4m3_bits(v * pow2(-e)[:, :, None], SOFT)
        blk = tl.arange(0, 8)[None, :, None]
        c64 = tl.arange(0, 64)[None, None, :]
        m3 = mask[:, None, None]
        tl.store(cache_ptr + data_at[:, None, None] + blk * 64 + c64, codes, mask=m3 & (blk < 7))
        rope_ptr = (cache_ptr + data_at + 448).to(tl.pointer_type(tl.bfloat16))
        tl.store(rope_ptr[:, None, None] + c64 + blk * 0, f32_to_bf16(v, SOFT), mask=m3 & (blk == 7))
        b8 = tl.arange(0, 8)[None, :]
        tl.store(cache_ptr + scale_at[:, None] + b8, tl.where(b8 < 7, e + 127, 0).to(tl.uint8), mask=mask[:, None])
    else:
        data_at, scale_at = _indexer_offsets(slots, block_size)
        cols = tl.arange(0, D)
        v = round_via(x, tl.bfloat16, SOFT)
        e = ue8m0_exponent(tl.max(tl.abs(v), axis=1))  # [R]
        codes = f32_to_e4m3_bits(v * pow2(-e)[:, None], SOFT)
        tl.store(cache_ptr + data_at[:, None] + cols[None, :], codes, mask=mask[:, None])
        scale_ptr = (cache_ptr + scale_at).to(tl.pointer_type(tl.float32))
        tl.store(scale_ptr, pow2(e), mask=mask)


@triton.jit
def load_main_codes(cache_ptr, slots, mask, block_size, R: tl.constexpr, SOFT: tl.constexpr):
    """The 584-B entries at `slots` [R] as fp32 [R, 8, 64]: blocks 0..6 = e4m3 x 2^(s - 127),
    block 7 = the bf16 rope dims. Masked rows read nothing and hold 0."""
    data_at, scale_at = _main_offsets(slots, block_size)
    blk = tl.arange(0, 8)[None, :, None]
    c64 = tl.arange(0, 64)[None, None, :]
    m3 = mask[:, None, None]
    codes = tl.load(cache_ptr + data_at[:, None, None] + blk * 64 + c64, mask=m3 & (blk < 7), other=0)
    b8 = tl.arange(0, 8)[None, :]
    sc = tl.load(cache_ptr + scale_at[:, None] + b8, mask=mask[:, None] & (b8 < 7), other=127).to(tl.int32)
    nope = e4m3_bits_to_f32(codes, SOFT) * (sc << 23).to(tl.float32, bitcast=True)[:, :, None]
    rope_ptr = (cache_ptr + data_at + 448).to(tl.pointer_type(tl.bfloat16))
    rope = to_f32(tl.load(rope_ptr[:, None, None] + c64 + blk * 0, mask=m3 & (blk == 7), other=0.0), SOFT)
    return tl.where(blk < 7, nope, rope)


@triton.jit
def load_rows(cache_ptr, slots, mask, block_size, R: tl.constexpr, D: tl.constexpr, FMT: tl.constexpr,
              SOFT: tl.constexpr):
    """fp32 rows [R, D] of the entries at int64 `slots` [R] (dequantized); masked rows are 0."""
    if FMT == 0:
        cols = tl.arange(0, D)
        return to_f32(tl.load(cache_ptr + slots[:, None] * D + cols[None, :], mask=mask[:, None], other=0.0), SOFT)
    elif FMT == 1:
        return tl.reshape(load_main_codes(cache_ptr, slots, mask, block_size, R, SOFT), [R, D])
    else:
        data_at, scale_at = _indexer_offsets(slots, block_size)
        cols = tl.arange(0, D)
        codes = tl.load(cache_ptr + data_at[:, None] + cols[None, :], mask=mask[:, None], other=0)
        scale = tl.load((cache_ptr + scale_at).to(tl.pointer_type(tl.float32)), mask=mask, other=0.0)
        return e4m3_bits_to_f32(codes, SOFT) * scale[:, None]


# ---- pack_kv / unpack_kv -----------------------------------------------------------------------
@triton.jit(do_not_specialize=["n_rows"])
def _pack_kernel(x_ptr, slots_ptr, cache_ptr, n_rows, stride_x, block_size, D: tl.constexpr, FMT: tl.constexpr,
                 ROWS: tl.constexpr, SOFT: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    in_range = rows < n_rows
    slots = tl.load(slots_ptr + rows, mask=in_range, other=-1).to(tl.int64)
    keep = in_range & (slots >= 0)
    cols = tl.arange(0, D)
    x = to_f32(tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=keep[:, None], other=0.0), SOFT)
    store_rows(cache_ptr, tl.maximum(slots, 0), keep, x, block_size, ROWS, D, FMT, SOFT)


@triton.jit(do_not_specialize=["n_rows"])
def _unpack_kernel(cache_ptr, slots_ptr, out_ptr, n_rows, stride_out, block_size, D: tl.constexpr,
                   FMT: tl.constexpr, ROWS: tl.constexpr, SOFT: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    in_range = rows < n_rows
    slots = tl.load(slots_ptr + rows, mask=in_range, other=-1).to(tl.int64)
    x = load_rows(cache_ptr, tl.maximum(slots, 0), in_range & (slots >= 0), block_size, ROWS, D, FMT, SOFT)
    cols = tl.arange(0, D)
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], round_to(x, out_ptr.dtype.element_ty, SOFT),
             mask=in_range[:, None])


_ROWS = 4


def pack_kv(x: torch.Tensor, slots: torch.Tensor, cache: torch.Tensor) -> None:
    """Launcher of `dsv4::pack_kv` (same arguments)."""
    _checks.pack_kv(x, slots, cache)
    n, d = x.shape
    require(d in (MAIN_DIM, INDEXER_DIM), "pack_kv", "x", f"rows of {MAIN_DIM} or {INDEXER_DIM} dims (V4 layout)", d)
    require(x.stride(1) == 1, "pack_kv", "x", "a contiguous last dim", x.stride())
    if n == 0:
        return
    fmt = pool_format(cache, d)
    launch(_pack_kernel, (triton.cdiv(n, _ROWS),), (x, slots, cache, n, x.stride(0), block_size(cache, fmt)),
           dict(D=d, FMT=fmt, ROWS=_ROWS, SOFT=INTERPRET))


def unpack_kv(cache: torch.Tensor, slots: torch.Tensor, out: torch.Tensor) -> None:
    """Launcher of `dsv4::unpack_kv` (same arguments)."""
    _checks.unpack_kv(cache, slots, out)
    n, d = out.shape
    require(d in (MAIN_DIM, INDEXER_DIM), "unpack_kv", "out", f"rows of {MAIN_DIM} or {INDEXER_DIM} dims (V4 layout)",
            d)
    require(out.stride(1) == 1, "unpack_kv", "out", "a contiguous last dim", out.stride())
    if n == 0:
        return
    fmt = pool_format(cache, d)
    launch(_unpack_kernel, (triton.cdiv(n, _ROWS),), (cache, slots, out, n, out.stride(0), block_size(cache, fmt)),
           dict(D=d, FMT=fmt, ROWS=_ROWS, SOFT=INTERPRET))
