"""Reference kernel of `dsv4::qkv_prep`: RoPE of q (after a weightless per-head RMSNorm in V4; V4.1
has none); RoPE of the new kv row and its insert (in the window pool's format) into the request's
window ring."""

from torch import Tensor

from dsv4ops.quant.reference import pack_kv
from dsv4ops.reference.functional import apply_rope, head_rms_norm, rope_angles


def window_slots(positions: Tensor, req_slots: Tensor, ring_size: int) -> Tensor:
    """Global slot of (request, position) in the window ring pool; -1 for padding tokens and for
    negative positions (a request slot past the pool gives a slot past it: no entry either)."""
    slots = req_slots.long() * ring_size + positions.long() % ring_size
    return slots.where((req_slots >= 0) & (positions >= 0), -1)


def qkv_prep(q: Tensor, kv: Tensor, positions: Tensor, req_slots: Tensor, inv_freq: Tensor, q_out: Tensor,
             window_cache: Tensor, ring_size: int, eps: float, q_norm: bool, window_fmt: str) -> None:
    cos, sin = rope_angles(positions, inv_freq, q.dtype)
    q_out.copy_(apply_rope(head_rms_norm(q, eps) if q_norm else q, cos[:, None], sin[:, None]))
    pack_kv(apply_rope(kv, cos, sin), window_slots(positions, req_slots, ring_size), window_cache, window_fmt)
