"""Reference kernel of `dsv4::sparse_attn`: each query attends to its window (positions
max(0, e - window + 1) .. e of its request's ring, e = window_ends[t], by default its own position t,
itself included) and to the compressed entries listed in comp_idx (global pool slots, -1 = none),
with the per-head sink in the denominator (spec 3.5); only the first comp_lens[t] columns of a row
are listed. A window end past the query's position lets the tokens of a draft block see each other
both ways (DSpark, V4.1 spec 6.6). Padding tokens (request -1, or a slot past the pool) get a zero
row. Keys are read back in their pool's format (V4: fp8_584 or exact; V4.1: fp8_528 window rows and
fp4_288 compressed rows).

With `lse` (a shard of a context-parallel step, dsv4ops.parallel.dcp): out is normalized over this
call's keys WITHOUT the sink, o = sum_j e^(l_j - L) k_j with L = ln sum_j e^(l_j) written to lse
[T, H] (fp32, natural log of the sum of e^(scaled logit)); a query with no key gets a zero row and
lse = -inf. dsv4::attn_merge then applies the sink once over every shard's (o, L)."""

import torch
from torch import Tensor

from dsv4ops.qkv_prep.reference import window_slots
from dsv4ops.quant.reference import unpack_kv, valid_slots
from dsv4ops.reference.functional import acc_dtype, sink_attention

# Elements of one chunk's gathered keys [queries, window + listed entries, d]: 2^22 fp32 = 16 MiB.
# Only the columns some query lists (the first max(comp_lens) of comp_idx) are read, so memory and
# time follow the entries the step's queries see, never comp_idx's width (an HCA key list is
# max_context / 128 columns wide: 8192 at 1M positions).
_CHUNK_ELEMENTS = 1 << 22


def sparse_attn(q: Tensor, window_cache: Tensor, comp_cache: Tensor, positions: Tensor, req_slots: Tensor,
                comp_idx: Tensor, comp_lens: Tensor, window_ends: Tensor | None, sinks: Tensor, out: Tensor,
                scale: float, window: int, ring_size: int, window_fmt: str, comp_fmt: str,
                lse: Tensor | None = None, batch_invariant: bool = False) -> None:
    t = q.shape[0]
    lens = comp_lens.long().clamp(0, comp_idx.shape[1])
    _attend_rows(q, window_cache, comp_cache, positions if window_ends is None else window_ends, req_slots, comp_idx,
                 lens, sinks, out, scale, window, ring_size, window_fmt, comp_fmt, lse, int(lens.max()) if t else 0,
                 batch_invariant)


def _attend_rows(q, window_cache, comp_cache, ends, req_slots, comp_idx, lens, sinks, out, scale, window, ring_size,
                 window_fmt, comp_fmt, lse, n: int, batch_invariant: bool) -> None:
    """sparse_attn over the windows and the first n columns of comp_idx."""
    t, h, d = q.shape
    step = max(1, _CHUNK_ELEMENTS // ((window + n) * max(d, h)))
    listed = torch.arange(n, device=q.device)[None] < lens[:, None]
    back = torch.arange(window - 1, -1, -1, device=q.device)
    # A request slot past the window pool is a padding token; a listed entry past the compressed
    # pool is no entry (kernels never index out of range).
    for s in range(0, t, step):
        qs, end, req = q[s:s + step], ends[s:s + step].long(), req_slots[s:s + step]
        idx = comp_idx[s:s + step, :n].where(listed[s:s + step], -1)
        c = qs.shape[0]
        live = (req >= 0) & valid_slots(req.long() * ring_size, window_cache, window_fmt)
        wpos = end[:, None] - back  # oldest first
        wvalid = (wpos >= 0) & live[:, None]
        wslots = window_slots(wpos.clamp(min=0), req[:, None].expand(-1, window), ring_size).where(wvalid, -1)
        wkeys = torch.empty(c * window, d, dtype=q.dtype, device=q.device)
        unpack_kv(window_cache, wslots.reshape(-1), wkeys, window_fmt)
        cvalid = valid_slots(idx, comp_cache, comp_fmt) & live[:, None]
        ckeys = torch.empty(c * n, d, dtype=q.dtype, device=q.device)
        unpack_kv(comp_cache, idx.where(cvalid, -1).reshape(-1), ckeys, comp_fmt)
        keys = torch.cat([wkeys.view(c, window, d), ckeys.view(c, n, d)], 1)
        valid = torch.cat([wvalid, cvalid], 1)
        if batch_invariant:
            # Decoding is elementwise (codes x exact powers of two), so a query's keys have the same
            # bits in any chunk; the GEMMs run one query at a time over its window and its own listed
            # entries, shapes that depend on the query alone (over the chunk's longest list, torch's
            # CPU GEMMs give other bits at other widths).
            ws = (window + lens[s:s + step]).tolist()
            parts = [_attend(qs[i:i + 1], keys[i:i + 1, :w], valid[i:i + 1, :w], sinks, scale, lse is not None)
                     for i, w in enumerate(ws)]
            o = torch.cat([p[0] for p in parts])
            l_sum = torch.cat([p[1] for p in parts]) if lse is not None else None
        else:
            o, l_sum = _attend(qs, keys, valid, sinks, scale, lse is not None)
        if lse is not None:
            lse[s:s + step] = l_sum.where(live[:, None], float("-inf"))
        out[s:s + step] = o.where(live[:, None, None], 0).to(out.dtype)


def _attend(q: Tensor, keys: Tensor, valid: Tensor, sinks: Tensor, scale: float, partial: bool):
    """(o, lse): sink_attention's o and None, or partial_attention's (o, lse) where `partial`."""
    if partial:
        return partial_attention(q, keys, valid, scale)
    return sink_attention(q, keys, valid, sinks, scale), None


def partial_attention(q: Tensor, keys: Tensor, valid: Tensor, scale: float) -> tuple[Tensor, Tensor]:
    """(o [T, H, D], lse [T, H] fp32): softmax attention over the valid keys without a sink, and the
    natural log of its denominator, sum_j e^(l_j), l_j = scale x q . k_j; a row without a valid key
    gives o = 0, lse = -inf. The rounding points of sink_attention: QK and PV in q's dtype, P cast
    to it, the softmax in fp32."""
    acc = acc_dtype(q.dtype)
    kv = keys.to(q.dtype)
    logits = torch.einsum("thd,tjd->thj", q, kv).to(acc) * scale
    logits = logits.masked_fill(~valid[:, None, :], float("-inf"))
    l_sum = torch.logsumexp(logits, dim=-1)  # -inf for a row of -inf
    probs = torch.exp(logits - l_sum.where(l_sum > float("-inf"), 0.0)[..., None])
    probs = torch.where(valid[:, None, :], probs, 0.0)
    return torch.einsum("thj,tjd->thd", probs.to(q.dtype), kv), l_sum.float()
