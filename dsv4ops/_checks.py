"""Metadata checks shared by every op and its fake: `torch._check` only (no host sync, works on
symbolic shapes). Each error names the argument, what was expected and what came."""

import math

import torch
from torch import Tensor

from dsv4ops.quant import formats

FLOATS = (torch.float32, torch.bfloat16, torch.float16)
INDEX = (torch.int32,)


def ndim(name: str, t: Tensor, n: int, layout: str):
    torch._check(t.dim() == n, lambda: f"{name}: expected {n}-D {layout}, got shape {tuple(t.shape)}")


def dtype(name: str, t: Tensor, allowed: tuple):
    torch._check(t.dtype in allowed, lambda: f"{name}: expected dtype in {list(allowed)}, got {t.dtype}")


def size(name: str, t: Tensor, dim: int, expect, what: str):
    torch._check(t.shape[dim] == expect, lambda: f"{name}: expected size {expect} ({what}) at dim {dim}, got {t.shape[dim]}")


def same_device(name: str, t: Tensor, ref: Tensor, ref_name: str):
    torch._check(t.device == ref.device, lambda: f"{name}: expected device {ref.device} (as {ref_name}), got {t.device}")


def last_dim_contiguous(name: str, t: Tensor):
    torch._check(t.stride(-1) == 1, lambda: f"{name}: expected a contiguous last dim, got strides {t.stride()}")


def contiguous(name: str, t: Tensor):
    torch._check(t.is_contiguous(), lambda: f"{name}: expected a contiguous tensor, got strides {t.stride()}")


def finite_scalar(name: str, v: float, what: str, low: float = 0.0, inclusive: bool = False):
    """A float argument: finite and > low (>= low with `inclusive`). NaN fails every comparison; two
    checks and no `and`, so a symbolic float is checked, not specialized."""
    def msg():
        return f"{name}: expected a finite value {'>=' if inclusive else '>'} {low:g} ({what}), got {v}"

    torch._check(v >= low if inclusive else v > low, msg)
    torch._check(v < math.inf, msg)


def index_vector(name: str, t: Tensor, n, ref: Tensor, ref_name: str):
    """A 1-D int32 per-token vector (positions, request slots, slot mappings)."""
    ndim(name, t, 1, "[tokens]")
    dtype(name, t, INDEX)
    size(name, t, 0, n, f"tokens of {ref_name}")
    same_device(name, t, ref, ref_name)


def like(name: str, t: Tensor, ref: Tensor, ref_name: str):
    torch._check(
        t.shape == ref.shape, lambda: f"{name}: expected shape {tuple(ref.shape)} (as {ref_name}), got {tuple(t.shape)}"
    )
    same_device(name, t, ref, ref_name)


def rope_table(inv_freq: Tensor, width: int, ref: Tensor):
    ndim("inv_freq", inv_freq, 1, "[rope_dim / 2]")
    dtype("inv_freq", inv_freq, (torch.float32,))
    torch._check(
        2 * inv_freq.shape[0] <= width,
        lambda: f"inv_freq: expected at most {width // 2} frequencies (head dim {width}), got {inv_freq.shape[0]}",
    )
    same_device("inv_freq", inv_freq, ref, "q")


def paged_cache(name: str, cache: Tensor, width: int, ref: Tensor, fmt: str, fmt_name: str) -> int:
    """A page pool of `width`-d rows in format `fmt` (dsv4ops/quant/formats.py): uint8 [blocks,
    page bytes] of a byte format (its row width, whole pages), or an `exact` float [blocks,
    block_size, width]. Returns the block size."""
    torch._check(fmt in formats.NAMES, lambda: f"{fmt_name}: expected one of {list(formats.NAMES)}, got {fmt!r}")
    contiguous(name, cache)
    same_device(name, cache, ref, "the activations")
    if fmt == formats.EXACT:
        dtype(name, cache, FLOATS)
        ndim(name, cache, 3, "[blocks, block_size, dim] (exact rows)")
        size(name, cache, 2, width, "row width")
        return cache.shape[1]
    f = formats.FORMATS[fmt]
    dtype(name, cache, (torch.uint8,))
    ndim(name, cache, 2, f"[blocks, page bytes] ({fmt} pages)")
    torch._check(width == f.dim, lambda: f"{name}: format {fmt} stores {f.dim}-d rows, got {width}-d rows")
    bs = f.block_size(cache.shape[1])
    expect = f.padded(max(bs, 1))
    torch._check(
        bs >= 1 and cache.shape[1] == expect,
        lambda: f"{name}: expected a page of whole {f.row_bytes}-B {fmt} rows ({expect} B for {max(bs, 1)} rows), "
        f"got {cache.shape[1]} B",
    )
    return bs


def hadamard(flag: bool, fmt: str):
    """`hadamard=True` rotates bf16 rows before a quantizer: a byte format (whose rows are 128 or 512
    wide, powers of two as the Hadamard needs)."""
    torch._check(not flag or fmt != formats.EXACT, lambda: f"hadamard: expected a byte format (it rotates bf16 rows "
                 f"before their quantizer), got fmt {fmt!r}")
