"""Triton kernel of `dsv4::inv_rope` (inv_rope/reference.py is the specification): out = o with the
trailing 64 dims of every head rotated by -position x theta; the other dims are copied.
Grid (tokens, head blocks)."""

import triton
import triton.language as tl

from dsv4ops.inv_rope import checks as _checks
from dsv4ops.quant.reference import MAIN_DIM, MAIN_ROPE
from dsv4ops.triton_helpers import (
    INTERPRET,
    apply_rope,
    launch,
    require_layout,
    rope_coeffs,
    round_to,
    to_f32,
    wait_prior_grid,
)


@triton.jit(do_not_specialize=["n_heads"])
def _inv_rope_kernel(o_ptr, pos_ptr, freq_ptr, out_ptr, so_t, so_h, sout_t, sout_h, n_heads, D: tl.constexpr,
                     ROPE: tl.constexpr, HB: tl.constexpr, SOFT: tl.constexpr):
    wait_prior_grid()
    t = tl.program_id(0).to(tl.int64)
    heads = tl.program_id(1) * HB + tl.arange(0, HB)
    hm = heads < n_heads
    h64 = heads.to(tl.int64)
    cols = tl.arange(0, D)
    cos, sin, rot = rope_coeffs(freq_ptr, tl.load(pos_ptr + t), D, ROPE)
    x = to_f32(tl.load(o_ptr + t * so_t + h64[:, None] * so_h + cols[None, :], mask=hm[:, None], other=0.0), SOFT)
    y = apply_rope(x, cos, sin, rot, HB, D, True)
    tl.store(out_ptr + t * sout_t + h64[:, None] * sout_h + cols[None, :], round_to(y, out_ptr.dtype.element_ty, SOFT),
             mask=hm[:, None])


def inv_rope(o, positions, inv_freq, out) -> None:
    """Launcher of `dsv4::inv_rope` (same arguments)."""
    _checks.inv_rope(o, positions, inv_freq, out)
    t, h, d = o.shape
    require_layout("inv_rope", d, inv_freq.shape[0], dims=(MAIN_DIM,))
    if t == 0 or h == 0:
        return
    hb = 8
    launch(_inv_rope_kernel, (t, triton.cdiv(h, hb)),
           (o, positions, inv_freq, out, o.stride(0), o.stride(1), out.stride(0), out.stride(1), h),
           dict(D=d, ROPE=MAIN_ROPE, HB=hb, SOFT=INTERPRET), pdl=True)
