"""Projections that read the same input, run as one GEMM.

A V4-Flash CSA layer has seven bf16 projections of its input x (q_a, kv, the indexer's head weights,
and the kv / gate projections of its two compressors): 4160 output rows over hidden 4096. Seven GEMMs
read x seven times and pay seven launches; one GEMM over their stacked weights reads x once and each
weight byte once (the weight bytes are the floor of a decode step).

The stacked weight is the storage of the projections' own parameters: each member's `weight` is a
view of its rows, so `load_state_dict`, in-place edits and optimizers reach the packed GEMM (one source
of truth). What would cut a view loose is mended:
- assigning a member's weight (`layer.kv_proj.weight = nn.Parameter(w)`, `load_state_dict(assign=True)`):
  the parameter-registration hook below copies the value into the pack and registers the view instead
  (or, while the members disagree in device or dtype, e.g. mid-way through a meta-device assign,
  leaves the pack stale for `tie` to rebuild);
- `.to()` / `.cuda()` (Module._apply moves each tensor on its own): the owner calls `tie` again;
- anything else: the owner's eager forward checks `tied` (pointer compares, no sync) and re-ties.

A pack's output is fp32 when it serves a compressor (their a, z compute in fp32 outside exact mode,
spec 3.3): bf16 x bf16 products are exact in fp32, so `torch.mm(..., out_dtype=torch.float32)` on the
tensor cores computes what the fp32 GEMM of the upcast operands computes, up to summation order
(2-5e-6 relative on an H100, against 1-6e-7 for fp32 on CUDA cores and 2-3e-3 for a bf16 output),
at 8-10 us instead of 15-70 us for V4-Flash's CSA compressors at 1-128 tokens (H100). The members
that compute in the model dtype round their slice to it: the one rounding a bf16-output GEMM does.
"""

from __future__ import annotations

import weakref

import torch
from torch import Tensor, nn

from dsv4ops import invariant as _invariant


# The tensors a member holds, stacked by row: an nn.Linear's weight parameter, a BlockFP8Linear's e4m3
# weight and tile-scale buffers (tile rows: a member's rows must fill whole tiles, but the last's).
_TENSORS = {"weight": "", "weight_scale_inv": "_scale"}


def _held(module: nn.Module) -> list[str]:
    return [name for name in _TENSORS if name in module._parameters or module._buffers.get(name) is not None]


class Pack:
    """The member projections (module paths under the owner: nn.Linear modules, or BlockFP8Linear
    modules of one tile size and scale dtype) stacked in non-persistent buffers of the owner named
    `buffer` (weights) and `buffer + "_scale"` (tile scales), in this order."""

    def __init__(self, buffer: str, members: tuple[str, ...]):
        self.buffer, self.members = buffer, members

    def modules(self, owner: nn.Module) -> list[nn.Module]:
        return [owner.get_submodule(name) for name in self.members]

    def tie(self, owner: nn.Module) -> None:
        """(Re)build the stacked tensors from the members' current values and make each member's tensors
        views of their rows (a member's Parameter objects stay the same)."""
        mods = self.modules(owner)
        names = _held(mods[0]) if mods else []
        for name in names:
            parts = [getattr(m, name) for m in mods]
            p0 = parts[0]
            if p0.is_meta or any(p.device != p0.device or p.dtype != p0.dtype for p in parts):
                for n in _TENSORS.values():
                    owner.register_buffer(self.buffer + n, None, persistent=False)
                return
        for name in names:
            stacked = torch.cat([getattr(m, name).detach() for m in mods])
            owner.register_buffer(self.buffer + _TENSORS[name], stacked, persistent=False)
            row = 0
            for m in mods:
                n = getattr(m, name).shape[0]
                if name in m._parameters:
                    m._parameters[name].data = stacked[row:row + n]
                else:
                    m._buffers[name] = stacked[row:row + n]
                m.__dict__.setdefault("_dsv4_pack", {})[name] = (weakref.ref(owner), self, row)
                row += n
        if not mods:
            owner.register_buffer(self.buffer, None, persistent=False)

    def tied(self, owner: nn.Module) -> bool:
        """Whether every member's tensors are still views of their rows of the stacked ones."""
        mods = self.modules(owner)
        if not mods:
            return True
        for name in _held(mods[0]):
            stacked = owner._buffers.get(self.buffer + _TENSORS[name])
            if stacked is None:
                return False
            row, base, step = 0, stacked.data_ptr(), stacked.stride(0) * stacked.element_size()
            for m in mods:
                t = getattr(m, name)
                if t.data_ptr() != base + row * step or t.dtype != stacked.dtype or t.device != stacked.device:
                    return False
                row += t.shape[0]
            if row != stacked.shape[0]:
                return False
        return True

    def slices(self, owner: nn.Module, y: Tensor) -> dict[str, Tensor]:
        """The members' outputs: column slices of y = x @ stacked^T (views, no copies)."""
        out, col = {}, 0
        for name, m in zip(self.members, self.modules(owner)):
            n = m.weight.shape[0]
            out[name] = y[..., col:col + n]
            col += n
        return out


def matmul(x: Tensor, weight: Tensor, fp32: bool, invariant: bool = False) -> Tensor:
    """x [T, K] @ weight[N, K]^T, in fp32 (fp32=True) or x's dtype. A 16-bit fp32-output product
    runs on the tensor cores where torch has the kernel (CUDA: mm's out_dtype); elsewhere it is the
    fp32 GEMM of the upcast operands (the same products, exact in fp32). invariant: the batch-invariant
    GEMM (dsv4ops.invariant), whose rows' bits do not depend on T."""
    if invariant:
        return _invariant.mm(x, weight, torch.float32 if fp32 else x.dtype)
    if not fp32 or x.dtype == torch.float32:
        y = x @ weight.t()
        return y.float() if fp32 else y
    if x.is_cuda:
        return torch.mm(x, weight.t(), out_dtype=torch.float32)
    return x.float() @ weight.float().t()


def _on_register(module: nn.Module, name: str, tensor):
    """Global parameter- and buffer-registration hook: a pack member's new weight (or tile scales) is
    copied into its rows of the stacked tensor, and the view is registered in its place (one source
    of truth)."""
    link = module.__dict__.get("_dsv4_pack", {}).get(name)
    if link is None or tensor is None:
        return None
    ref, pack, row = link
    owner = ref()
    stacked = None if owner is None else owner._buffers.get(pack.buffer + _TENSORS[name])
    old = module._parameters.get(name) if name in module._parameters else module._buffers.get(name)
    if stacked is None or old is None:
        return None
    if tensor.shape != old.shape:
        raise ValueError(f"{type(module).__name__}.{name}: expected shape {tuple(old.shape)} (a projection packed "
                         f"with {list(pack.members)}), got {tuple(tensor.shape)}")
    if tensor.device != stacked.device or tensor.dtype != stacked.dtype or tensor.is_meta:
        module.__dict__["_dsv4_pack"].pop(name)  # the owner's `tie` rebuilds the pack once the members agree
        owner.register_buffer(pack.buffer + _TENSORS[name], None, persistent=False)
        return None
    view = stacked[row:row + old.shape[0]]
    with torch.no_grad():
        view.copy_(tensor)
    return nn.Parameter(view, requires_grad=tensor.requires_grad) if isinstance(tensor, nn.Parameter) else view


nn.modules.module.register_module_parameter_registration_hook(_on_register)
nn.modules.module.register_module_buffer_registration_hook(_on_register)
