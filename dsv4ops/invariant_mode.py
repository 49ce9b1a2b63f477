"""`mode()`: a context in which the aten ops whose row bits follow the batch run row-invariant forms,
for a whole model's forward (patch_model with CacheConfig(batch_invariant=True) enters it around
every call). dsv4ops' own layers need no mode (their cache's flag picks their schedules); the
model around them does: its experts, hyper-connections, MLPs, routers and lm_head.

What the mode replaces, and why (x86-64 AVX2, torch 2.13; CUDA's reasons in brackets):
- aten.mm (and its out_dtype form), addmm, bmm, baddbmm, _grouped_mm: by dsv4::invariant_linear
  (fp32 sums, one rounding; a bias added in fp32 before it). MKL picks its GEMM kernel by M, and a
  row's bits change with it [cuBLAS picks tiles, split-K and algorithms by M]; a grouped GEMM's
  groups are the other tokens' routing.
- the transcendental pointwise ops (sigmoid, silu, softplus, exp, ...), on the CPU only: ATen runs
  2 x SIMD width elements at a time (Sleef) and the rest one at a time (libm), which differ by an
  ulp, and the rest is wherever the tensor's size (or a thread's chunk, past 32768 elements) ends:
  a row's place in the batch (37 rows of 12 values: sigmoid changes 14 rows, silu 17, softplus 27
  against each row alone). Here the flat tensor is padded to a multiple of 64 and cut into calls of
  < 32768 elements, so every element takes the SIMD path. (CUDA's kernels compute each element by
  the same code: left as they are.)
Not replaced, being row-wise already: IEEE-exact pointwise ops (add, mul, div, sqrt, rsqrt, pow by
2), softmax (ATen's CPU kernel works a row at a time), reductions of a row's own values to more than
one output (mean, sum, amax: ATen splits only a reduction to one value across threads), indexing,
sorting and argmax.

A GEMM overload the mode does not replace (the out= forms, _scaled_mm, addbmm, a 3-D x 3-D grouped
GEMM) raises rather than run batch-dependently. The mode is eager: Dynamo does not trace under it,
so a compiled region whose own ops are invariant (dsv4ops' layers with a batch-invariant cache)
runs inside `suspended()`.
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from dsv4ops.invariant_linear.api import invariant_linear

aten = torch.ops.aten

# Elements per CPU pointwise call: a multiple of 64 (any SIMD width's 2 x width) below ATen's
# parallel grain (32768), so one thread runs the call with no scalar remainder.
_PAD = 64
_CHUNK = 32768 - _PAD


def _simd_only(fn, x: Tensor) -> Tensor:
    """fn (a pointwise op) of x with every element on ATen's SIMD path (CPU)."""
    flat = x.contiguous().view(-1)
    n = flat.numel()
    padded = torch.nn.functional.pad(flat, (0, -n % _PAD))
    return torch.cat([fn(c) for c in padded.split(_CHUNK)])[:n].view(x.shape)


def _linear(a: Tensor, weight: Tensor, out_dtype: torch.dtype) -> Tensor:
    return invariant_linear(a.contiguous(), weight.contiguous(), out_dtype)


def _mm(a: Tensor, b: Tensor) -> Tensor:
    return _linear(a, b.t(), a.dtype)


def _addmm(bias: Tensor, a: Tensor, b: Tensor, *, beta=1, alpha=1) -> Tensor:
    y = _linear(a, b.t(), torch.float32)
    return (y * alpha + bias.float() * beta).to(a.dtype)


def _mm_dtype(a: Tensor, b: Tensor, out_dtype: torch.dtype) -> Tensor:
    return _linear(a, b.t(), out_dtype)


def _bmm(a: Tensor, b: Tensor) -> Tensor:
    return torch.stack([_mm(a[i], b[i]) for i in range(a.shape[0])]) if a.shape[0] else torch.bmm(a, b)


def _baddbmm(c: Tensor, a: Tensor, b: Tensor, *, beta=1, alpha=1) -> Tensor:
    c = c.expand(a.shape[0], a.shape[1], b.shape[2])
    return torch.stack([_addmm(c[i], a[i], b[i], beta=beta, alpha=alpha) for i in range(a.shape[0])]) if a.shape[0] \
        else torch.baddbmm(c, a, b, beta=beta, alpha=alpha)


def _grouped_mm(a: Tensor, b: Tensor, offs: Tensor | None = None, bias: Tensor | None = None,
                out_dtype: torch.dtype | None = None) -> Tensor:
    if a.dim() != 2 or b.dim() != 3 or offs is None:
        raise NotImplementedError(f"dsv4ops.invariant_mode: aten._grouped_mm of a {a.dim()}-D and a {b.dim()}-D "
                                  f"operand{'' if offs is not None else ' without offs'} has no row-invariant form "
                                  f"here (only [tokens, K] x [groups, K, N] with offs)")
    dtype = out_dtype or a.dtype
    out = a.new_zeros(a.shape[0], b.shape[2], dtype=dtype)
    lo = 0
    for g, hi in enumerate(offs.tolist()):
        if hi > lo:
            y = _linear(a[lo:hi], b[g].t(), torch.float32)
            out[lo:hi] = (y if bias is None else y + bias[g].float()).to(dtype)
        lo = hi
    return out


_GEMMS = {aten.mm.default: _mm, aten.addmm.default: _addmm, aten.bmm.default: _bmm, aten.baddbmm.default: _baddbmm,
          aten._grouped_mm.default: _grouped_mm}
if "dtype" in aten.mm.overloads():  # torch.mm(..., out_dtype=)
    _GEMMS[aten.mm.dtype] = _mm_dtype
_REFUSED = {getattr(getattr(aten, op), o) for op in ("mm", "addmm", "bmm", "baddbmm", "addbmm", "_scaled_mm")
            for o in getattr(aten, op).overloads()} - set(_GEMMS)
_POINTWISE = {aten.sigmoid.default: torch.sigmoid, aten.silu.default: torch.nn.functional.silu,
              aten.exp.default: torch.exp, aten.tanh.default: torch.tanh, aten.log.default: torch.log,
              aten.log1p.default: torch.log1p, aten.expm1.default: torch.expm1, aten.erf.default: torch.erf,
              aten.cos.default: torch.cos, aten.sin.default: torch.sin}
_IN_PLACE = {aten.sigmoid_.default: torch.sigmoid, aten.silu_.default: torch.nn.functional.silu,
             aten.exp_.default: torch.exp, aten.tanh_.default: torch.tanh}


def _cpu_float(x) -> bool:
    return isinstance(x, Tensor) and x.device.type == "cpu" and x.is_floating_point()


class _Mode(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _GEMMS and args[0].is_floating_point():
            return _GEMMS[func](*args, **kwargs)
        if func in _REFUSED:
            raise NotImplementedError(f"dsv4ops.invariant_mode: {func} has no row-invariant form here (the modes' "
                                      f"GEMMs: {sorted(map(str, _GEMMS))})")
        if args and _cpu_float(args[0]):
            x = args[0]
            if func in _POINTWISE:
                return _simd_only(_POINTWISE[func], x)
            if func in _IN_PLACE:
                return x.copy_(_simd_only(_IN_PLACE[func], x))
            if func is aten.softplus.default:
                beta = args[1] if len(args) > 1 else kwargs.get("beta", 1)
                threshold = args[2] if len(args) > 2 else kwargs.get("threshold", 20)
                return _simd_only(lambda c: torch.nn.functional.softplus(c, beta, threshold), x)
            if func is aten.gelu.default:
                return _simd_only(lambda c: torch.nn.functional.gelu(c, approximate=kwargs.get("approximate", "none")),
                                  x)
        return func(*args, **kwargs)


@contextlib.contextmanager
def suspended():
    """The dispatch modes (this one among them) popped for a while, pushed back after."""
    with _disable_current_modes():
        yield


@contextlib.contextmanager
def mode():
    """Within it, every aten GEMM and (on the CPU) transcendental pointwise op runs a row-invariant
    form: a token's rows get the same bits whatever other rows share the tensors."""
    with _Mode():
        yield
