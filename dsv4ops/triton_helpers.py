"""Triton building blocks every dsv4ops kernel shares: launching (one place, so the AOT compile test
records every launch), layout requirements, exact casts (fp32 <-> bf16 / e4m3 with round to nearest
even, UE8M0 exponents from bits), interleaved RoPE and a tl.dot that also runs in the interpreter.

Exactness: the UE8M0 exponent comes from the bits of the amax (no division, so it equals the
reference's frexp rule bit for bit), scaling is by exact powers of two, and the casts round to
nearest even. Triton's interpreter truncates fp32 -> bf16 and rounds fp8 ties away from zero, so
under the interpreter (SOFT) the casts run as integer code with the same results as the GPU's cvt.
"""

import ast
import contextlib
import inspect
import textwrap

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_wait

from dsv4ops.quant.reference import MAIN_DIM, MAIN_ROPE

INTERPRET = bool(triton.knobs.runtime.interpret)

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


def launch(kernel, grid, args: tuple, constexprs: dict, num_warps: int = 4, pdl: bool = False):
    """kernel[grid](*args, **constexprs) on the current stream (Triton's default). pdl: with
    programmatic dependent launch (see `wait_prior_grid`)."""
    if pdl:
        _check_waits_first(kernel)
    if _recorder is not None:
        _recorder.append((kernel, args, dict(constexprs), num_warps))
        return
    options = {"launch_pdl": True} if pdl and not INTERPRET else {}
    kernel[grid](*args, **constexprs, num_warps=num_warps, **options)


# ---- programmatic dependent launch (sm_90+) ------------------------------------------------------
# A kernel launched with `launch(..., pdl=True)` may be scheduled while the previous kernel of the
# stream is still finishing, so its launch latency hides behind that one's tail (csrc/common/pdl.cuh
# does the same for the C++ kernels). Its first statement must be `wait_prior_grid()`: no program
# may touch global memory before the previous grid has completed. `launch` checks that from the
# source, so a kernel that forgets fails its first launch, CPU tests included. The interpreter has no
# grids to wait for.
PDL = tl.constexpr(not INTERPRET)


@triton.jit
def wait_prior_grid():
    """Returns once the previous kernel of the stream has completed and its writes are visible (a
    no-op in a launch without PDL)."""
    if PDL:
        gdc_wait()


_waits_first: set = set()


def _check_waits_first(kernel) -> None:
    fn = kernel.fn
    if fn in _waits_first:
        return
    body = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0].body
    if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
        body = body[1:]  # the docstring
    first = body[0] if body else None
    call = first.value if isinstance(first, ast.Expr) else None
    if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "wait_prior_grid"):
        raise RuntimeError(f"{fn.__name__}: a kernel launched with pdl=True must start with wait_prior_grid()")
    _waits_first.add(fn)


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


@triton.jit
def dot(a, b, acc, SOFT: tl.constexpr):
    """acc + a @ b: fp32 (IEEE) for fp32 operands and in the interpreter (which stores bf16 as
    uint16 and cannot multiply it), else the operands' dtype on the tensor cores with fp32
    accumulation."""
    if SOFT or a.dtype == tl.float32:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        return tl.dot(a, b, acc)


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


# ---- the Hadamard rotation of V4's MXFP4 indexer -----------------------------------------------
@triton.jit
def rotate(x, R: tl.constexpr, D: tl.constexpr, SOFT: tl.constexpr):
    """quant.reference.rotate of fp32 rows x [R, D] (D a power of two, at most 1024): the orthonormal
    Hadamard of bf16(x), as log2(D) butterfly stages in fp64 (where 128 bf16 terms add exactly, so
    the result is the reference's bit for bit), / sqrt(D), as fp32."""
    v = round_via(x, tl.bfloat16, SOFT).to(tl.float64)
    for s in tl.static_range(10):
        if (1 << s) < D:
            # Elements i and i + 2^s (bit s of i clear) -> (x_i + x_j, x_i - x_j).
            a, b = tl.split(tl.permute(tl.reshape(v, [R, D >> (s + 1), 2, 1 << s]), (0, 1, 3, 2)))
            v = tl.reshape(tl.permute(tl.join(a + b, a - b), (0, 1, 3, 2)), [R, D])
    return (v / tl.sqrt(tl.full([R, D], D, tl.float64))).to(tl.float32)  # fp64: sqrt.rn, div.rn
