"""Fake (meta) kernels of every `dsv4::` op, installed as `dsv4ops._meta`; one module per family.
Each fake runs the family's metadata checks, so a bad shape fails at trace time too."""

from dsv4ops._meta import (  # noqa: F401
    attn_merge, compressor, fp8_linear, indexer, inv_rope, invariant_linear, qkv_prep, quant, router, sparse_attn, visible_entries,
)
