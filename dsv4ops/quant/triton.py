"""Triton kernels of `dsv4::pack_kv` / `dsv4::unpack_kv` and the paged cache entry formats (load /
store) every attention kernel reads and writes.

Formats (quant/formats.py and quant/codecs.py are the specification), mapped by name to the FMT
constexpr: 0 = `exact` (float pools [blocks, bs, d]), 1 = `fp8_584` (paged as [bs x 576 B data]
[bs x 8 B scales], padded to a multiple of 576 B; d = 512), 2 = `fp8_132` ([bs x 128 B]
[bs x 4 B fp32 scale]; d = 128). The V4.1 formats (fp8_528, fp4_288, mxfp4_68) have no Triton
code yet: the launchers raise for them (`fmt_code`). All byte offsets are int64.
"""

import torch
import triton
import triton.language as tl

from dsv4ops.quant import checks as _checks
from dsv4ops.quant import formats
from dsv4ops.quant.reference import capacity
from dsv4ops.triton_helpers import (
    INTERPRET,
    e4m3_bits_to_f32,
    f32_to_bf16,
    f32_to_e4m3_bits,
    launch,
    pow2,
    require,
    round_to,
    round_via,
    to_f32,
    ue8m0_exponent,
)

FMT_FLOAT, FMT_MAIN, FMT_INDEXER = 0, 1, 2
FMT_CODES = {formats.EXACT: FMT_FLOAT, "fp8_584": FMT_MAIN, "fp8_132": FMT_INDEXER}


def not_yet(op: str, what: str):
    """The Triton kernels cover the V4 layouts; V4.1's GPU kernels are a later issue."""
    raise NotImplementedError(f"dsv4::{op}: the Triton kernel does not implement {what} yet (V4.1 GPU kernels are "
                              f"a later issue); the reference kernel does: with "
                              f"dsv4ops.ops.{op}.set_kernel_enabled('cuda', False)")


def fmt_code(op: str, arg: str, fmt: str) -> int:
    """The FMT constexpr of pool format `fmt` (argument `arg` of dsv4::`op`)."""
    if fmt not in FMT_CODES:
        not_yet(op, f"{arg}={fmt!r} (it reads and writes pools of {sorted(FMT_CODES)})")
    return FMT_CODES[fmt]


def block_size(cache: torch.Tensor, fmt: str) -> int:
    return formats.block_size(cache.shape, fmt)


# ---- paged entries -----------------------------------------------------------------------------
@triton.jit
def main_offsets(slots, block_size):
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
        data_at, scale_at = main_offsets(slots, block_size)
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
    data_at, scale_at = main_offsets(slots, block_size)
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
def _pack_kernel(x_ptr, slots_ptr, cache_ptr, n_rows, n_slots, stride_x, block_size, D: tl.constexpr,
                 FMT: tl.constexpr, ROWS: tl.constexpr, SOFT: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    in_range = rows < n_rows
    slots = tl.load(slots_ptr + rows, mask=in_range, other=-1).to(tl.int64)
    keep = in_range & (slots >= 0) & (slots < n_slots)  # -1 or out of range: no entry
    cols = tl.arange(0, D)
    x = to_f32(tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=keep[:, None], other=0.0), SOFT)
    store_rows(cache_ptr, tl.maximum(slots, 0), keep, x, block_size, ROWS, D, FMT, SOFT)


@triton.jit(do_not_specialize=["n_rows"])
def _unpack_kernel(cache_ptr, slots_ptr, out_ptr, n_rows, n_slots, stride_out, block_size, D: tl.constexpr,
                   FMT: tl.constexpr, ROWS: tl.constexpr, SOFT: tl.constexpr):
    rows = tl.program_id(0).to(tl.int64) * ROWS + tl.arange(0, ROWS)
    in_range = rows < n_rows
    slots = tl.load(slots_ptr + rows, mask=in_range, other=-1).to(tl.int64)
    ok = in_range & (slots >= 0) & (slots < n_slots)  # -1 or out of range: a row of zeros
    x = load_rows(cache_ptr, tl.where(ok, slots, 0), ok, block_size, ROWS, D, FMT, SOFT)
    cols = tl.arange(0, D)
    tl.store(out_ptr + rows[:, None] * stride_out + cols[None, :], round_to(x, out_ptr.dtype.element_ty, SOFT),
             mask=in_range[:, None])


_ROWS = 4


_V4_DIMS = (512, 128)


def pack_kv(x: torch.Tensor, slots: torch.Tensor, cache: torch.Tensor, fmt: str) -> None:
    """Launcher of `dsv4::pack_kv` (same arguments)."""
    _checks.pack_kv(x, slots, cache, fmt)
    code = fmt_code("pack_kv", "fmt", fmt)
    n, d = x.shape
    require(d in _V4_DIMS, "pack_kv", "x", f"rows of {_V4_DIMS[0]} or {_V4_DIMS[1]} dims (V4 layout)", d)
    require(x.stride(1) == 1, "pack_kv", "x", "a contiguous last dim", x.stride())
    if n == 0:
        return
    launch(_pack_kernel, (triton.cdiv(n, _ROWS),),
           (x, slots, cache, n, capacity(cache, fmt), x.stride(0), block_size(cache, fmt)),
           dict(D=d, FMT=code, ROWS=_ROWS, SOFT=INTERPRET))


def unpack_kv(cache: torch.Tensor, slots: torch.Tensor, out: torch.Tensor, fmt: str) -> None:
    """Launcher of `dsv4::unpack_kv` (same arguments)."""
    _checks.unpack_kv(cache, slots, out, fmt)
    code = fmt_code("unpack_kv", "fmt", fmt)
    n, d = out.shape
    require(d in _V4_DIMS, "unpack_kv", "out", f"rows of {_V4_DIMS[0]} or {_V4_DIMS[1]} dims (V4 layout)", d)
    require(out.stride(1) == 1, "unpack_kv", "out", "a contiguous last dim", out.stride())
    if n == 0:
        return
    launch(_unpack_kernel, (triton.cdiv(n, _ROWS),),
           (cache, slots, out, n, capacity(cache, fmt), out.stride(0), block_size(cache, fmt)),
           dict(D=d, FMT=code, ROWS=_ROWS, SOFT=INTERPRET))
