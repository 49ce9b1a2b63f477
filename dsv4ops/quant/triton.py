"""Triton kernels of `dsv4::pack_kv` / `dsv4::unpack_kv` and the paged cache entry formats (load /
store) every attention kernel reads and writes.

Formats (quant/formats.py and quant/codecs.py are the specification), mapped by name to the FMT
constexpr: 0 = `exact` (float pools [blocks, bs, d]); the byte formats are paged as [bs x data]
[bs x scales], padded to the format's alignment: 1 = `fp8_584` (d = 512), 2 = `fp8_132` (d = 128),
3 = `fp8_528` (d = 512), 4 = `fp4_288` (d = 512), 5 = `mxfp4_68` (d = 128). All byte offsets are
int64. Every quantizer reads bf16(x) and computes its scale from the fp32 bits (no log2), so the
codes equal the reference codec's bit for bit (the e4m3 / e2m1 roundings are to nearest even).
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

FMT_FLOAT, FMT_MAIN, FMT_INDEXER, FMT_528, FMT_288, FMT_68 = 0, 1, 2, 3, 4, 5
FMT_CODES = {formats.EXACT: FMT_FLOAT, "fp8_584": FMT_MAIN, "fp8_132": FMT_INDEXER, "fp8_528": FMT_528,
             "fp4_288": FMT_288, "mxfp4_68": FMT_68}


def not_yet(op: str, what: str):
    """A launcher given a case its Triton kernel does not cover."""
    raise NotImplementedError(f"dsv4::{op}: the Triton kernel does not implement {what}; the reference kernel "
                              f"does: with dsv4ops.ops.{op}.set_kernel_enabled('cuda', False)")


def fmt_code(op: str, arg: str, fmt: str, allowed=None) -> int:
    """The FMT constexpr of pool format `fmt` (argument `arg` of dsv4::`op`); `allowed`: the
    formats the op's kernel reads, when not all."""
    names = sorted(FMT_CODES if allowed is None else allowed)
    if fmt not in names:
        not_yet(op, f"{arg}={fmt!r} (it reads and writes pools of {names})")
    return FMT_CODES[fmt]


def block_size(cache: torch.Tensor, fmt: str) -> int:
    return formats.block_size(cache.shape, fmt)


# ---- paged entries -----------------------------------------------------------------------------
@triton.jit
def page_offsets(slots, block_size, DATA: tl.constexpr, SCALE: tl.constexpr, ALIGN: tl.constexpr):
    """(data, scale) byte offsets of int64 `slots` in pages of [bs x DATA][bs x SCALE] padded to
    a multiple of ALIGN bytes."""
    page = ((block_size * (DATA + SCALE) + ALIGN - 1) // ALIGN) * ALIGN
    blk = slots // block_size
    off = slots % block_size
    base = blk * page
    return base + off * DATA, base + block_size * DATA + off * SCALE


@triton.jit
def main_offsets(slots, block_size):
    return page_offsets(slots, block_size, 576, 8, 576)


@triton.jit
def pow2ceil_exponent(v):
    """e with 2^e the smallest power of two >= v (positive normal fp32), from the bits."""
    bits = v.to(tl.int32, bitcast=True)
    return ((bits >> 23) & 0xFF) - 127 + ((bits & 0x7FFFFF) != 0).to(tl.int32)


@triton.jit
def e2m1_nibbles(q, x):
    """Nibbles sign(x) << 3 | code(|q|), the code rounding |q| to {0, .5, 1, 1.5, 2, 3, 4, 6} with
    ties to the even code; a NaN q gives code 0 (its row reads back NaN through the scale)."""
    a = tl.abs(q)
    code = ((a > 0.25).to(tl.int32) + (a >= 0.75).to(tl.int32) + (a > 1.25).to(tl.int32)
            + (a >= 1.75).to(tl.int32) + (a > 2.5).to(tl.int32) + (a >= 3.5).to(tl.int32) + (a > 5.0).to(tl.int32))
    sign = (x.to(tl.int32, bitcast=True) >> 28) & 8
    return code | sign


@triton.jit
def e2m1_to_f32(nib):
    """fp32 value of e2m1 nibbles: 0b s e e m, exponent bias 1, one subnormal step of 0.5."""
    e = (nib >> 1) & 3
    m = (nib & 1).to(tl.float32)
    mag = tl.where(e == 0, m * 0.5, (1.0 + m * 0.5) * (1 << tl.maximum(e - 1, 0)).to(tl.float32))
    return (mag.to(tl.uint32, bitcast=True) | ((nib & 8).to(tl.uint32) << 28)).to(tl.float32, bitcast=True)


@triton.jit
def pack_nibbles(nib, R: tl.constexpr, D: tl.constexpr):
    """[R, D] nibbles -> [R, D // 2] bytes, element 2i in the low nibble."""
    lo, hi = tl.split(tl.reshape(nib, [R, D // 2, 2]))
    return (lo | (hi << 4)).to(tl.uint8)


@triton.jit
def unpack_nibbles(data, R: tl.constexpr, D: tl.constexpr):
    """[R, D // 2] bytes -> [R, D] nibbles (int32)."""
    b = data.to(tl.int32)
    return tl.reshape(tl.join(b & 0xF, b >> 4), [R, D])


@triton.jit
def store_rows(cache_ptr, slots, mask, x, block_size, R: tl.constexpr, D: tl.constexpr, FMT: tl.constexpr,
               SOFT: tl.constexpr):
    """Write fp32 rows x [R, D] at int64 `slots` [R] (rows with mask False: nothing).
    Float pools get x rounded to their dtype; byte formats quantize bf16(x) as the reference codec."""
    if FMT == 0:
        cols = tl.arange(0, D)
        v = round_to(x, cache_ptr.dtype.element_ty, SOFT)
        tl.store(cache_ptr + slots[:, None] * D + cols[None, :], v, mask=mask[:, None])
    elif FMT == 1:
        data_at, scale_at = main_offsets(slots, block_size)
        v = tl.reshape(round_via(x, tl.bfloat16, SOFT), [R, 8, 64])
        nan = tl.max((v != v).to(tl.int32), axis=2) > 0  # a tile with a NaN: NaN codes (codecs.py)
        e = tl.where(nan, 0, ue8m0_exponent(tl.max(tl.abs(v), axis=2)))  # [R, 8]; block 7 is the bf16 rope part
        codes = tl.where(nan[:, :, None], 0x7F, f32_to_e4m3_bits(v * pow2(-e)[:, :, None], SOFT)).to(tl.uint8)
        blk = tl.arange(0, 8)[None, :, None]
        c64 = tl.arange(0, 64)[None, None, :]
        m3 = mask[:, None, None]
        tl.store(cache_ptr + data_at[:, None, None] + blk * 64 + c64, codes, mask=m3 & (blk < 7))
        rope_ptr = (cache_ptr + data_at + 448).to(tl.pointer_type(tl.bfloat16))
        tl.store(rope_ptr[:, None, None] + c64 + blk * 0, f32_to_bf16(v, SOFT), mask=m3 & (blk == 7))
        b8 = tl.arange(0, 8)[None, :]
        tl.store(cache_ptr + scale_at[:, None] + b8, tl.where(b8 < 7, e + 127, 0).to(tl.uint8), mask=mask[:, None])
    elif FMT == 2:
        data_at, scale_at = page_offsets(slots, block_size, 128, 4, 1)
        cols = tl.arange(0, D)
        v = round_via(x, tl.bfloat16, SOFT)
        e = ue8m0_exponent(tl.max(tl.abs(v), axis=1))  # [R]
        codes = f32_to_e4m3_bits(v * pow2(-e)[:, None], SOFT)
        tl.store(cache_ptr + data_at[:, None] + cols[None, :], codes, mask=mask[:, None])
        scale_ptr = (cache_ptr + scale_at).to(tl.pointer_type(tl.float32))
        tl.store(scale_ptr, pow2(e), mask=mask)
    elif FMT == 3:  # fp8_528: UE8M0 per 32, rope dims too; the floor is on amax (codecs.py)
        data_at, scale_at = page_offsets(slots, block_size, 512, 16, 512)
        v = tl.reshape(round_via(x, tl.bfloat16, SOFT), [R, 16, 32])
        nan = tl.max((v != v).to(tl.int32), axis=2) > 0  # a tile with a NaN: NaN codes (codecs.py)
        e = tl.where(nan, 0, pow2ceil_exponent(tl.maximum(tl.max(tl.abs(v), axis=2), 1e-4) * (1 / 448)))  # [R, 16]
        codes = f32_to_e4m3_bits(tl.clamp(v * pow2(-e)[:, :, None], -448.0, 448.0), SOFT)
        codes = tl.where(nan[:, :, None], 0x7F, codes).to(tl.uint8)
        cols = tl.arange(0, D)
        tl.store(cache_ptr + data_at[:, None] + cols[None, :], tl.reshape(codes, [R, D]), mask=mask[:, None])
        g = tl.arange(0, 16)[None, :]
        tl.store(cache_ptr + scale_at[:, None] + g, (e + 127).to(tl.uint8), mask=mask[:, None])
    elif FMT == 4:  # fp4_288: e4m3 scale per 16, amax / 6 past 464 is the NaN code (codecs.py)
        data_at, scale_at = page_offsets(slots, block_size, 256, 32, 256)
        v = tl.reshape(round_via(x, tl.bfloat16, SOFT), [R, 32, 16])
        sv = tl.math.div_rn(tl.maximum(tl.max(tl.abs(v), axis=2), 6 * 2.0**-9), tl.full([R, 32], 6.0, tl.float32))
        sbits = tl.where(sv > 464.0, 0x7F, f32_to_e4m3_bits(tl.minimum(sv, 448.0), SOFT).to(tl.int32))
        scale = e4m3_bits_to_f32(sbits.to(tl.uint8), SOFT)
        q = tl.math.div_rn(v, tl.broadcast_to(scale[:, :, None], [R, 32, 16]))
        nib = tl.reshape(e2m1_nibbles(q, v), [R, D])
        bytes_ = tl.arange(0, D // 2)[None, :]
        tl.store(cache_ptr + data_at[:, None] + bytes_, pack_nibbles(nib, R, D), mask=mask[:, None])
        g = tl.arange(0, 32)[None, :]
        tl.store(cache_ptr + scale_at[:, None] + g, sbits.to(tl.uint8), mask=mask[:, None])
    else:
        data_at, scale_at = page_offsets(slots, block_size, 64, 4, 512)
        data, scales = mx4_encode(x, R, D, SOFT)
        tl.store(cache_ptr + data_at[:, None] + tl.arange(0, D // 2)[None, :], data, mask=mask[:, None])
        tl.store(cache_ptr + scale_at[:, None] + tl.arange(0, D // 32)[None, :], scales, mask=mask[:, None])


@triton.jit
def mx4_encode(x, R: tl.constexpr, D: tl.constexpr, SOFT: tl.constexpr):
    """mxfp4_68 rows of fp32 x [R, D] (codecs.py: UE8M0 per 32 of bf16(x)): (data [R, D // 2],
    scale bytes [R, D // 32]) uint8."""
    v = tl.reshape(round_via(x, tl.bfloat16, SOFT), [R, D // 32, 32])
    e = pow2ceil_exponent(tl.maximum(tl.max(tl.abs(v), axis=2), 6 * 2.0**-126) * (1 / 6))  # [R, D // 32]
    nib = tl.reshape(e2m1_nibbles(v * pow2(-e)[:, :, None], v), [R, D])
    return pack_nibbles(nib, R, D), (e + 127).to(tl.uint8)


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
    elif FMT == 2:
        data_at, scale_at = page_offsets(slots, block_size, 128, 4, 1)
        cols = tl.arange(0, D)
        codes = tl.load(cache_ptr + data_at[:, None] + cols[None, :], mask=mask[:, None], other=0)
        scale = tl.load((cache_ptr + scale_at).to(tl.pointer_type(tl.float32)), mask=mask, other=0.0)
        return e4m3_bits_to_f32(codes, SOFT) * scale[:, None]
    elif FMT == 3:
        data_at, scale_at = page_offsets(slots, block_size, 512, 16, 512)
        cols = tl.arange(0, D)
        codes = tl.load(cache_ptr + data_at[:, None] + cols[None, :], mask=mask[:, None], other=0)
        g = tl.arange(0, 16)[None, :]
        sc = tl.load(cache_ptr + scale_at[:, None] + g, mask=mask[:, None], other=127).to(tl.int32)
        v = tl.reshape(e4m3_bits_to_f32(codes, SOFT), [R, 16, 32]) * pow2(sc - 127)[:, :, None]
        return tl.reshape(v, [R, D])
    elif FMT == 4:
        data_at, scale_at = page_offsets(slots, block_size, 256, 32, 256)
        bytes_ = tl.arange(0, D // 2)[None, :]
        data = tl.load(cache_ptr + data_at[:, None] + bytes_, mask=mask[:, None], other=0)
        g = tl.arange(0, 32)[None, :]
        sc = e4m3_bits_to_f32(tl.load(cache_ptr + scale_at[:, None] + g, mask=mask[:, None], other=0), SOFT)
        v = tl.reshape(e2m1_to_f32(unpack_nibbles(data, R, D)), [R, 32, 16]) * sc[:, :, None]
        return tl.reshape(v, [R, D])
    else:
        data_at, scale_at = page_offsets(slots, block_size, 64, 4, 512)
        bytes_ = tl.arange(0, D // 2)[None, :]
        data = tl.load(cache_ptr + data_at[:, None] + bytes_, mask=mask[:, None], other=0)
        g = tl.arange(0, 4)[None, :]
        sc = tl.load(cache_ptr + scale_at[:, None] + g, mask=mask[:, None], other=127).to(tl.int32)
        v = tl.reshape(e2m1_to_f32(unpack_nibbles(data, R, D)), [R, 4, 32]) * pow2(sc - 127)[:, :, None]
        return tl.reshape(v, [R, D])


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
_FLOAT_DIMS = (512, 128)  # exact pools of the attention's row widths (byte formats fix theirs)



def pack_kv(x: torch.Tensor, slots: torch.Tensor, cache: torch.Tensor, fmt: str) -> None:
    """Launcher of `dsv4::pack_kv` (same arguments)."""
    _checks.pack_kv(x, slots, cache, fmt)
    code = fmt_code("pack_kv", "fmt", fmt)
    n, d = x.shape
    require(code != FMT_FLOAT or d in _FLOAT_DIMS, "pack_kv", "x", f"exact rows of {_FLOAT_DIMS} dims", d)
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
    require(code != FMT_FLOAT or d in _FLOAT_DIMS, "unpack_kv", "out", f"exact rows of {_FLOAT_DIMS} dims", d)
    require(out.stride(1) == 1, "unpack_kv", "out", "a contiguous last dim", out.stride())
    if n == 0:
        return
    launch(_unpack_kernel, (triton.cdiv(n, _ROWS),),
           (cache, slots, out, n, capacity(cache, fmt), out.stride(0), block_size(cache, fmt)),
           dict(D=d, FMT=code, ROWS=_ROWS, SOFT=INTERPRET))
