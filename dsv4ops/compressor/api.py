"""Public KV compressor step (spec 3.3): per-request state ring, block pooling, entry store.

Reference (the specification): dsv4ops/compressor/reference.py; its stateless twin over a whole
sequence is dsv4ops.reference.compress.
"""

import torch
from torch import Tensor

from dsv4ops import _values
from dsv4ops import ops as _ops  # noqa: F401  (defines the dsv4:: ops bound below)
from dsv4ops.compressor import checks
from dsv4ops.quant.api import block_size, check_slots, pool_slots

_compressor_update = torch.ops.dsv4.compressor_update.default


def compressor_update(kv: Tensor, score: Tensor, ape: Tensor, positions: Tensor, req_slots: Tensor,
                      entry_slots: Tensor, norm_weight: Tensor, inv_freq: Tensor, state: Tensor, cache: Tensor,
                      eps: float, fmt: str, latent: bool = False, hadamard: bool = False,
                      batch_invariant: bool = False) -> Tensor | None:
    """One compressor step over a flat batch of T tokens; mutates `state` and `cache`.

    kv, score [T, coff * d] (float, contiguous last dim): the a and z projections (coff = 2 with the
    CSA overlap, 1 without); ape [m, coff * d] fp32 (m = the ratio); norm_weight [d] float;
    inv_freq [R/2] fp32; positions [T] int32 (>= 0); req_slots [T] int32 (-1: padding, reads and
    writes nothing); entry_slots [T] int32: pool slot of the entry a token closes (read only for
    tokens with (position + 1) % m == 0; -1 stores nothing); state [requests, coff * m, 2 * coff * d]
    fp32: row p % (coff * m) of a request holds (a_p, z_p + ape[p % m]); cache: a paged pool of
    d-wide entries in format `fmt` (see dsv4ops.quant.api).

    Every live token writes its state row, unless a later token of the call maps to the same row;
    a token with (p + 1) % m == 0 closes entry w = p // m: it pools positions p - coff * m + 1 .. p
    (rows of this call where present, the state otherwise, nothing before position 0) with a
    per-channel softmax (CSA: window w - 1's a-stream [:d], window w's b-stream [d:]), casts to the
    entry dtype (the pool's float dtype for exact pools; bf16 before a quantized format), applies
    RMSNorm and RoPE at w * m. V4.1 (no overlap, no position bias): ratio 2 with ape = 0, ratio 1
    with ape = 0 and any finite score (a 1-slot softmax weighs 1).

    hadamard=True (a byte format): the entry after RoPE is rotated by the
    orthonormal Hadamard before its quantizer (quant.reference.rotate: V4's MXFP4 index keys).

    latent=True returns latent [T, d] in the entry dtype: each closing token's entry after the
    RMSNorm and before RoPE (V4.1's index keys are made from it), 0 for the other tokens.

    batch_invariant=True: an entry's bits do not depend on the other tokens of the call or their
    count (CacheConfig(batch_invariant=True)): the GPU pools in one order for every token count,
    the CPU one entry at a time.

    Checked in eager mode: positions >= 0; req_slots in [-1, requests); the tokens of a request are
    one contiguous run with consecutive positions (the pooling finds rows of the call by offset);
    entry_slots in [-1, pool slots), distinct among the closing tokens, each at its entry's offset in
    a block (p // m % block size), and -1 for the other live tokens (slots of another ratio)."""
    latent_out = None
    if latent:
        latent_out = torch.empty(kv.shape[0], norm_weight.shape[0], dtype=checks.entry_dtype(cache, fmt),
                                 device=kv.device)
    if _values.has_data(kv, score, positions, req_slots, entry_slots, state, cache):
        checks.compressor_update(kv, score, ape, positions, req_slots, entry_slots, norm_weight, inv_freq, state,
                                 cache, latent_out, eps, fmt, hadamard)
        m = ape.shape[0]
        _values.in_range("positions", positions, 0, None, "token positions")
        _values.in_range("req_slots", req_slots, -1, state.shape[0],
                         f"-1 or one of the {state.shape[0]} requests of the state")
        _values.request_runs(positions, req_slots)
        check_slots("entry_slots", entry_slots, cache, fmt, f"-1 or a slot of the pool's {pool_slots(cache, fmt)}")
        _values.closing_slots(entry_slots, positions, req_slots, m, block_size(cache, fmt))
    _compressor_update(kv, score, ape, positions, req_slots, entry_slots, norm_weight, inv_freq, state, cache,
                       latent_out, eps, fmt, hadamard, batch_invariant)
    return latent_out
