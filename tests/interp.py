"""Helpers of the tests that run an op's Triton kernel on CPU: under TRITON_INTERPRET=1 (conftest sets
it when there is no GPU), launched directly (the op would dispatch CPU tensors to the reference), against
the reference kernels.

Shapes are tiny because the interpreter runs programs one at a time in numpy: a few tokens, 2-3
heads (the kernels pad heads to a tl.dot tile), window 8 instead of 128 where the op allows it; the
512-d head, 64 rope dims and 128-d indexer rows are the V4 layout the kernels require.
Tolerances: bit-exact where the math is exact (FP8 packing, state rows, integer-valued indexer
scores); elsewhere the error of the kernel against a high-precision run of the reference must stay
within 2x the error of the reference's own low-precision run (dsv4ops.testing.assert_close_to_ref).
"""

import os

import builders
import torch

import dsv4ops
from dsv4ops.quant import formats
from dsv4ops.quant import reference as quant_ref

AOT_PROCESS = os.environ.get("DSV4OPS_TRITON_AOT") == "1"  # test_triton_aot.py's compile-only subprocess
if not AOT_PROCESS and not torch.cuda.is_available():
    assert os.environ.get("TRITON_INTERPRET") == "1", "conftest.py sets TRITON_INTERPRET=1 before collection"

CFG = dsv4ops.DSV4AttentionConfig.tiny()
INV_FREQ = CFG.inv_freq(1)  # the YaRN / 160000 table of a compressed layer
BS = 4  # entries per page: small, so slots cross pages


def new_pool(fmt, dim: int, blocks: int, bs: int = BS) -> torch.Tensor:
    """A page pool poisoned like LayerCache: FP8 bytes 0xFF (NaN), float rows NaN."""
    return builders.page_pool(blocks, bs, dim, fmt)


def pool_fmt(pool: torch.Tensor, dim: int) -> str:
    """The V4 format of a pool: fp8_584 / fp8_132 by width for uint8 pools, exact otherwise."""
    return builders.format_name("fp8" if pool.dtype == torch.uint8 else pool.dtype, dim)


def pool_rows(pool: torch.Tensor, dim: int, dtype=torch.float64, fmt: str | None = None) -> torch.Tensor:
    """Every entry of a pool of format `fmt` (default: the V4 format of its dtype and width),
    dequantized (unwritten byte entries read as NaN)."""
    fmt = fmt or pool_fmt(pool, dim)
    n = pool.shape[0] * formats.block_size(pool.shape, fmt)
    out = torch.empty(n, dim, dtype=torch.float32)
    quant_ref.unpack_kv(pool, torch.arange(n, dtype=torch.int32), out, fmt)
    return out.to(dtype)


def i32(*values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32)
