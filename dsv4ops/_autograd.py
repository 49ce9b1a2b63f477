"""No `dsv4::` op has a backward: a gradient that would flow through one raises a RuntimeError that
names it, while a forward in grad mode still runs.

- Raw ops (and so the public functions): an Autograd kernel per op (AutogradCPU / AutogradCUDA /
  AutogradMeta; more specific than the generic one custom_op registers) runs the op below autograd.
  If grad mode is on and an input requires grad, the float outputs it writes get a graph node whose
  backward raises; an op that stores into a cache (qkv_prep, compressor_update, pack_kv) raises at
  the call instead, since a gradient would silently stop at the cache.
- Layers: run their ops under no_grad and put one such node on their output (`no_backward`).

The raise sits in the backward graph as a data-dependent host assert (on a CPU copy of one element
of the incoming gradient), so a torch.compile'd forward traces and runs, and its compiled backward
raises when it runs, not while it compiles.
"""

from __future__ import annotations

import torch
from torch import Tensor

# Mutated arguments that are caches (state kept across calls), not outputs of the call.
CACHE_ARGS = frozenset({"window_cache", "state", "cache"})
_HINT = "run inference under torch.inference_mode() or torch.no_grad() (or detach the inputs)"


class _NoBackward(torch.autograd.Function):
    """Identity on `y` (in place when `dirty`) whose backward raises, naming `what`."""

    @staticmethod
    def forward(ctx, what: str, dirty: bool, y: Tensor, *inputs: Tensor):
        ctx.what, ctx.inputs = what, len(inputs)
        if dirty:
            ctx.mark_dirty(y)
            return y
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad: Tensor):
        # A host assert that depends on the gradient's data: the compiler keeps it in the backward.
        v = grad.detach().reshape(-1)[:1].to("cpu")
        torch._assert_async(((v != v) & (v == v)).any(),
                            f"{ctx.what} has no backward (the dsv4:: ops are inference kernels); {_HINT}")
        return (None, None, grad) + (None,) * ctx.inputs


def _needs_grad(tensors) -> list[Tensor]:
    if not torch.is_grad_enabled():
        return []
    return [t for t in tensors if isinstance(t, Tensor) and t.requires_grad]


def no_backward(y: Tensor, inputs, what: str) -> Tensor:
    """`y`, made to raise on backward when grad mode is on and one of `inputs` requires grad."""
    grads = _needs_grad(inputs)
    return _NoBackward.apply(what, False, y, *grads) if grads else y


def _autograd_kernel(op: torch._ops.OpOverload):
    schema = op._schema
    names = [a.name for a in schema.arguments]
    written = {a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write}
    caches = written & CACHE_ARGS
    outputs = [n for n in names if n in written and n not in CACHE_ARGS]
    label = f"dsv4::{schema.name.split('::')[-1]}"

    def kernel(keyset, *args, **kwargs):
        bound = dict(zip(names, args)) | kwargs
        grads = _needs_grad(v for k, v in bound.items() if k not in written)
        if grads and caches:
            raise RuntimeError(f"{label}: an input requires grad, but the op stores it in {sorted(caches)} and has "
                               f"no backward (a gradient would stop at the cache); {_HINT}")
        with torch._C._AutoDispatchBelowAutograd():
            op.redispatch(keyset & torch._C._after_autograd_keyset, *args, **kwargs)
        if grads:
            for name in outputs:
                out = bound.get(name)  # an optional output left out (its default None)
                if out is not None and out.is_floating_point():
                    _NoBackward.apply(label, True, out, *grads)

    return kernel


_LIB = torch.library.Library("dsv4", "IMPL")


def op_names() -> set[str]:
    """Every dsv4:: op defined so far."""
    ns = torch.ops.dsv4
    return {n for n in dir(ns) if isinstance(getattr(ns, n), torch._ops.OpOverloadPacket)}


def _ad_inplace_kernel(op: torch._ops.OpOverload):
    """The ADInplaceOrView kernel of an op with a defaulted mutable argument (sparse_attn's lse):
    bump the version of every mutated tensor given, then run the op below. custom_op's own kernel
    does this in torch 2.13; in torch 2.11 it indexes the mutated arguments by position, and the
    dispatcher drops a trailing argument equal to its default, so every grad-mode call raised
    IndexError (inference mode skips this key)."""
    names = [a.name for a in op._schema.arguments]
    written = [a.name for a in op._schema.arguments if a.alias_info is not None and a.alias_info.is_write]

    def kernel(keyset, *args, **kwargs):
        bound = dict(zip(names, args)) | kwargs
        for name in written:
            if isinstance(bound.get(name), Tensor):
                torch.autograd.graph.increment_version(bound[name])
        return op.redispatch(keyset & torch._C._after_ADInplaceOrView_keyset, *args, **kwargs)

    return kernel


def install_all() -> None:
    """Give every dsv4:: op defined so far the Autograd kernel above (idempotent per op), and the
    ADInplaceOrView kernel above to ops with a defaulted mutable argument."""
    import warnings

    for name in sorted(op_names() - _installed):
        op = getattr(torch.ops.dsv4, name).default
        kernel = _autograd_kernel(op)
        for key in ("AutogradCPU", "AutogradCUDA", "AutogradMeta"):
            _LIB.impl(name, kernel, key, with_keyset=True)
        if any(a.has_default_value() and a.alias_info is not None and a.alias_info.is_write
               for a in op._schema.arguments):
            with warnings.catch_warnings():  # the dispatcher's note that a kernel is replaced
                warnings.simplefilter("ignore", UserWarning)
                _LIB.impl(name, _ad_inplace_kernel(op), "ADInplaceOrView", with_keyset=True, allow_override=True)
        _installed.add(name)


_installed: set[str] = set()
