"""Reference kernel of `dsv4::compressor_update` (spec 3.3 and 3.7, engine form).

For every live token p of a request: its row (a_p, z_p + ape[p % m]) goes to the request's fp32
state ring at row p % rows (rows = state.shape[1] >= coff*m: rows past coff*m are the slack that
lets a rewind drop tokens without losing rows). Every token with (p + 1) % m == 0 closes entry
w = p // m: it pools positions [p - coff*m + 1, p] (the step's own rows when they are in this step,
the state ring otherwise, -inf before position 0), per channel softmax in fp32 (CSA: the first m slots use the
a-stream [:d], the last m the b-stream [d:]), casts to the entry dtype (the cache's float dtype; bf16
for FP8 pools), RMSNorm, RoPE at w*m, and stores the entry at entry_slots[token] (with `hadamard`,
rotated first: quant.reference.rotate).

Tokens of one request are contiguous in the step with consecutive positions (the step planner's
invariant); a state row is written only by the last token of the step that maps to it. A request
slot past the state or a negative position makes a token padding.
"""

import torch
from torch import Tensor

from dsv4ops.compressor.checks import entry_dtype
from dsv4ops.quant.reference import pack_kv, rotate
from dsv4ops.reference.functional import apply_rope, pool_entry, rms_norm, rope_angles


def compressor_update(kv: Tensor, score: Tensor, ape: Tensor, positions: Tensor, req_slots: Tensor,
                      entry_slots: Tensor, norm_weight: Tensor, inv_freq: Tensor, state: Tensor, cache: Tensor,
                      latent_out: Tensor | None, eps: float, fmt: str, hadamard: bool = False,
                      batch_invariant: bool = False) -> None:
    t, width = kv.shape
    m, rows = ape.shape[0], state.shape[1]
    pos, req = positions.long(), req_slots.long()
    # Padding: request -1, or any slot past the state (kernels never index out of range), or a
    # negative position. A closing token's entry slot past the pool stores nothing (pack_kv).
    live = (req >= 0) & (req < state.shape[0]) & (pos >= 0)
    a = kv.float()
    z = score.float() + ape.float()[pos % m]

    close = (live & ((pos + 1) % m == 0)).nonzero().flatten()
    if latent_out is not None:
        latent_out.zero_()
    if close.numel():
        # batch_invariant: one entry at a time. torch's CPU softmax over the slot dim splits the
        # [entries x d] columns between threads and takes the scalar exp (not the vector one) at a
        # chunk's edge: with 3 threads an entry's bits change with how many entries share the call.
        for group in close.split(1) if batch_invariant else (close,):
            _store_entries(group, a, z, pos, req, entry_slots, norm_weight, inv_freq, m, state, cache, latent_out,
                           eps, fmt, hadamard)

    nxt = torch.arange(t, device=kv.device) + rows
    later = nxt < t
    nxt = nxt.clamp(max=t - 1)
    later &= (req[nxt] == req) & (pos[nxt] == pos + rows)
    keep = live & ~later
    state[req[keep], pos[keep] % rows] = torch.cat([a[keep], z[keep]], -1)


def _store_entries(close: Tensor, a: Tensor, z: Tensor, pos: Tensor, req: Tensor, entry_slots: Tensor,
                   norm_weight: Tensor, inv_freq: Tensor, m: int, state: Tensor, cache: Tensor,
                   latent_out: Tensor | None, eps: float, fmt: str, hadamard: bool) -> None:
    """The entries closed by the tokens `close` of the step (a, z: its rows; state: before the step)."""
    width, d = a.shape[1], norm_weight.shape[0]
    span, rows = (width // d) * m, state.shape[1]
    p, r = pos[close, None], req[close, None]
    q = p - (span - 1) + torch.arange(span, device=a.device)  # [n, span] positions pooled
    src = close[:, None] - (span - 1) + torch.arange(span, device=a.device)
    src_ok = src >= 0
    src = src.clamp(min=0)
    in_step = src_ok & (req[src] == r) & (pos[src] == q)
    held = state[r, q % rows]  # [n, span, 2 * width]
    rows_a = torch.where(in_step[..., None], a[src], held[..., :width])
    rows_z = torch.where(in_step[..., None], z[src], held[..., width:])
    before_start = (q < 0)[..., None]
    rows_a = rows_a.masked_fill(before_start, 0.0)
    rows_z = rows_z.masked_fill(before_start, float("-inf"))
    if width == 2 * d:  # CSA: previous window's a-stream, current window's b-stream
        rows_a = torch.cat([rows_a[:, :m, :d], rows_a[:, m:, d:]], 1)
        rows_z = torch.cat([rows_z[:, :m, :d], rows_z[:, m:, d:]], 1)
    edt = entry_dtype(cache, fmt)
    entry = rms_norm(pool_entry(rows_a, rows_z).to(edt), norm_weight, eps)
    if latent_out is not None:
        latent_out[close] = entry
    cos, sin = rope_angles((pos[close] // m) * m, inv_freq, edt)
    entry = apply_rope(entry, cos, sin)
    pack_kv(rotate(entry) if hadamard else entry, entry_slots[close], cache, fmt)
