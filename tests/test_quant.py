"""dsv4::pack_kv / dsv4::unpack_kv and their public functions: the 584-B and 132-B entries byte by
byte, round trips, what a call writes (and that slot -1 writes and reads nothing), int64 offsets,
bad inputs. Issue 3."""

from functools import partial

import pytest
import torch

from dsv4ops import testing as T
from dsv4ops.quant import api
from dsv4ops.quant.reference import (
    INDEXER_ENTRY_BYTES,
    MAIN_DATA_BYTES,
    MAIN_ENTRY_BYTES,
    _page_offsets,
    indexer_block_bytes,
    main_block_bytes,
)
from dsv4ops.reference.numerics import round_indexer_key, round_kv
from dsv4ops.testing import FP8

U8 = torch.uint8


def _fp8_bytes(v: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (v / scale).to(torch.float8_e4m3fn).view(U8)


# ---- byte layout -------------------------------------------------------------------------------
def test_page_sizes():
    # FlashMLA pages: block_size x 584 B rounded up to a multiple of 576 B.
    assert main_block_bytes(64) == 65 * 576 == 37440
    assert main_block_bytes(1) == 2 * 576 and main_block_bytes(3) == 4 * 576
    assert indexer_block_bytes(64) == 64 * 132
    assert api.block_size(torch.empty(5, 37440, dtype=U8), 512) == 64
    assert api.block_size(torch.empty(5, 8448, dtype=U8), 128) == 64
    assert api.pool_slots(torch.empty(5, 7, 16), 16) == 35


def test_main_entry_bytes():
    bs, slot = 3, 4  # block 1, offset 1; a page of 3 entries is 1752 B padded to 2304 B
    pool = T.page_pool(2, bs, 512, FP8)
    x = torch.randn(1, 512) * 0.01
    for j in range(7):  # block j's amax is 448 x 2^(j-3): UE8M0 exponent j - 3, byte 124 + j
        x[0, 64 * j + 5] = 448.0 * 2.0 ** (j - 3)
    api.pack_kv(x, torch.tensor([slot], dtype=torch.int32), pool)

    flat, page = pool.view(-1), 2304
    data = flat[page + 1 * MAIN_DATA_BYTES: page + 2 * MAIN_DATA_BYTES]
    scales = flat[page + bs * MAIN_DATA_BYTES + 8: page + bs * MAIN_DATA_BYTES + 16]
    assert scales.tolist() == [124 + j for j in range(7)] + [0]  # 7 UE8M0 bytes, then the pad byte
    scale = torch.exp2(torch.arange(-3, 4).float()).repeat_interleave(64)
    assert torch.equal(data[:448], _fp8_bytes(x[0, :448].bfloat16().float(), scale))
    assert data[5].item() == 0x7E  # e4m3 448 = 0 1111 110
    assert torch.equal(data[448:], x[0, 448:].bfloat16().view(U8))  # bf16 rope, little endian
    written = torch.zeros_like(flat, dtype=torch.bool)
    written[page + MAIN_DATA_BYTES: page + 2 * MAIN_DATA_BYTES] = True
    written[page + bs * MAIN_DATA_BYTES + 8: page + bs * MAIN_DATA_BYTES + 16] = True
    assert (flat[~written] == 0xFF).all()  # other entries, other scales and the page padding


def test_indexer_entry_bytes():
    bs, slot = 3, 4
    pool = T.page_pool(2, bs, 128, FP8)
    x = torch.randn(1, 128) * 0.001
    x[0, 7] = -448.0 * 2.0**-5  # amax / 448 = 2^-5: the fp32 scale
    api.pack_kv(x, torch.tensor([slot], dtype=torch.int32), pool)

    flat, page = pool.view(-1), indexer_block_bytes(bs)
    data = flat[page + 128: page + 256]
    scale = flat[page + bs * 128 + 4: page + bs * 128 + 8]
    assert torch.equal(scale.view(torch.float32), torch.tensor([2.0**-5]))
    assert torch.equal(data, _fp8_bytes(x[0].bfloat16().float(), torch.tensor(2.0**-5)))
    assert data[7].item() == 0xFE  # e4m3 -448
    written = torch.zeros_like(flat, dtype=torch.bool)
    written[page + 128: page + 256] = True
    written[page + bs * 128 + 4: page + bs * 128 + 8] = True
    assert (flat[~written] == 0xFF).all()


def test_byte_offsets_are_int64():
    # A pool of 70000 pages of 64 main entries is 2.6e9 B > 2^31: the last slot's offsets only fit
    # in int64. Computed with the layout helpers on int32 slots, nothing allocated.
    blocks, bs = 70_000, 64
    page = main_block_bytes(bs)
    slot = blocks * bs - 1
    base, off = _page_offsets(torch.tensor([slot], dtype=torch.int32), bs, page)
    assert base.dtype == off.dtype == torch.int64
    data_at = base + off * MAIN_DATA_BYTES
    scale_at = base + bs * MAIN_DATA_BYTES + off * 8
    assert data_at.item() == (blocks - 1) * page + 63 * 576 > 2**31
    assert scale_at.item() + 8 == blocks * page - (page - bs * MAIN_ENTRY_BYTES)  # last scale byte, then padding
    pool = torch.empty(blocks, page, dtype=U8, device="meta")
    assert api.pool_slots(pool, 512) == blocks * bs
    big = 300_000  # 300000 x 64 x 132 B = 2.5e9 B
    ibase, _ = _page_offsets(torch.tensor([big * bs - 1], dtype=torch.int32), bs, indexer_block_bytes(bs))
    assert ibase.item() == (big - 1) * 64 * INDEXER_ENTRY_BYTES > 2**31


# ---- round trips -------------------------------------------------------------------------------
def _varied_rows(n: int, dim: int) -> torch.Tensor:
    """Rows whose 64-channel blocks span 1e-6 .. 1e3 in magnitude, plus an all-zero block."""
    x = torch.randn(n, dim // 64, 64) * torch.logspace(-6, 3, n * dim // 64).view(n, dim // 64, 1)
    x[0, 1] = 0
    return x.view(n, dim)


def test_main_round_trip():
    x = _varied_rows(4, 512)
    slots = torch.tensor([6, 0, 3, 7], dtype=torch.int32)
    pool = T.page_pool(2, 4, 512, FP8)
    api.pack_kv(x, slots, pool)
    y = api.unpack_kv(pool, slots, 512, torch.float32)
    assert torch.equal(y[:, 448:], x[:, 448:].bfloat16().float())  # the rope half is bit exact
    # Bit equality with the numerics' rounding is sound here: both sides are one bf16 cast, a
    # division and a multiplication by a power of two (exact) and one e4m3 cast, each correctly
    # rounded, so no CPU vector path or summation order can change a bit.
    assert torch.equal(y, round_kv(x, "fp8", 64))
    v = x[:, :448].bfloat16().float().view(4, 7, 64)
    scale = torch.exp2(torch.ceil(torch.log2(v.abs().amax(-1, keepdim=True).clamp(min=1e-4) / 448)))
    # e4m3 keeps 3 mantissa bits: half an ulp is 2^-4 relative; subnormals: half of 2^-9 x scale.
    err = (y[:, :448].view(4, 7, 64) - v).abs()
    assert (err <= torch.maximum(v.abs() * 2**-4, scale * 2**-10)).all()
    assert (y[0, 64:128] == 0).all()


def test_indexer_round_trip():
    x = torch.randn(5, 128) * torch.logspace(-4, 3, 5)[:, None]
    slots = torch.tensor([2, 9, 0, 4, 11], dtype=torch.int32)
    pool = T.page_pool(3, 4, 128, FP8)
    api.pack_kv(x, slots, pool)
    y = api.unpack_kv(pool, slots, 128, torch.float32)
    assert torch.equal(y, round_indexer_key(x, "fp8"))
    v = x.bfloat16().float()
    scale = torch.exp2(torch.ceil(torch.log2(v.abs().amax(-1, keepdim=True) / 448)))
    assert ((y - v).abs() <= torch.maximum(v.abs() * 2**-4, scale * 2**-10)).all()


@pytest.mark.parametrize("fmt,dtype", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)])
def test_float_pool_round_trip(fmt, dtype):
    x = torch.randn(3, 16, dtype=dtype)
    slots = torch.tensor([7, 1, 4], dtype=torch.int32)
    pool = T.page_pool(2, 4, 16, fmt)
    api.pack_kv(x, slots, pool)
    assert torch.equal(api.unpack_kv(pool, slots, 16, dtype), x.to(fmt).to(dtype))


# ---- what a call writes ------------------------------------------------------------------------
@pytest.mark.parametrize("fmt,dim", [(FP8, 512), (FP8, 128), (torch.float32, 16)], ids=["main", "indexer", "float"])
def test_pack_writes_its_slots_only(fmt, dim):
    bs = 4
    pool = T.page_pool(3, bs, dim, fmt)
    slots = torch.tensor([9, -1, 2, -1], dtype=torch.int32)
    x = torch.randn(4, dim)
    api.pack_kv(x, slots, pool)
    fresh = T.page_pool(3, bs, dim, fmt)
    for s, row in zip([9, 2], [x[0], x[2]], strict=True):  # each written entry, alone, into a fresh pool
        api.pack_kv(row[None], torch.tensor([s], dtype=torch.int32), fresh)
    assert T.bytes_equal(pool, fresh)  # rows with slot -1 wrote nothing; nothing else changed
    poisoned = T.page_pool(3, bs, dim, fmt)
    touched = (pool.view(U8) != poisoned.view(U8)) if fmt == FP8 else ~pool.isnan()
    per_entry = MAIN_ENTRY_BYTES if dim == 512 else INDEXER_ENTRY_BYTES if fmt == FP8 else dim
    assert int(touched.sum()) <= 2 * per_entry


@pytest.mark.parametrize("fmt,dim", [(FP8, 512), (FP8, 128), (torch.bfloat16, 16)], ids=["main", "indexer", "float"])
def test_unpack_slot_minus_one_reads_nothing(fmt, dim):
    pool = T.page_pool(2, 4, dim, fmt)  # all poison: any read is NaN
    out = torch.full((3, dim), float("nan"))
    T.call_op("unpack_kv", dict(cache=pool, slots=torch.full((3,), -1, dtype=torch.int32), out=out))
    assert (out == 0).all()


def test_unpack_writes_every_row():
    args = T.unpack_kv_args(torch.float32, FP8, slots=(5, -1, 0))
    args["out"].fill_(float("nan"))
    T.call_op("unpack_kv", args)
    assert not args["out"].isnan().any() and (args["out"][1] == 0).all()


# ---- bad inputs: one per rule ------------------------------------------------------------------
PACK_FP32 = partial(T.pack_kv_args, torch.float32)
PACK_FP8 = partial(T.pack_kv_args, torch.float32, FP8)
UNPACK_FP32 = partial(T.unpack_kv_args, torch.float32)
I32 = torch.int32
BAD = [
    # (id, op, factory, mutation, error, message, paths)
    ("x-ndim", "pack_kv", PACK_FP32, T.with_arg("x", lambda a: a["x"][None]), r"x: expected 2-D \[rows, dim\]"),
    ("x-dtype", "pack_kv", PACK_FP32, T.with_arg("x", lambda a: a["x"].double()), r"x: expected dtype in"),
    ("slots-ndim", "pack_kv", PACK_FP32, T.with_arg("slots", lambda a: a["slots"][:, None]), r"slots: expected 1-D"),
    ("slots-dtype", "pack_kv", PACK_FP32, T.with_arg("slots", lambda a: a["slots"].long()),
     r"slots: expected dtype in \[torch.int32\], got torch.int64"),
    ("slots-size", "pack_kv", PACK_FP32, T.with_arg("slots", lambda a: a["slots"][:2]),
     r"slots: expected size 3 \(tokens of x\) at dim 0, got 2"),
    ("slots-device", "pack_kv", PACK_FP32, T.with_arg("slots", lambda a: a["slots"].to("meta")),
     r"slots: expected device cpu \(as x\), got meta"),
    ("cache-contiguous", "pack_kv", PACK_FP32, T.with_arg("cache", lambda a: a["cache"].transpose(0, 1)),
     r"cache: expected a contiguous tensor"),
    ("cache-device", "pack_kv", PACK_FP32, T.with_arg("cache", lambda a: a["cache"].to("meta")),
     r"cache: expected device cpu \(as the activations\), got meta"),
    ("cache-fp8-ndim", "pack_kv", PACK_FP8, T.with_arg("cache", lambda a: a["cache"][None]),
     r"cache: expected 2-D \[blocks, block bytes\]"),
    ("cache-fp8-width", "pack_kv", PACK_FP8, T.with_arg("x", lambda a: a["x"][:, :256]),
     r"cache: FP8 entries exist for 512-d \(584 B\) and 128-d \(132 B\) rows, got 256-d"),
    ("cache-fp8-page", "pack_kv", PACK_FP8, T.with_arg("cache", lambda a: a["cache"][:, :-1].contiguous()),
     r"cache: expected a page of whole 584-B entries \(2880 B for 4 entries\), got 2879 B"),
    ("cache-dtype", "pack_kv", PACK_FP32, T.with_arg("cache", lambda a: a["cache"].double()),
     r"cache: expected dtype in"),
    ("cache-ndim", "pack_kv", PACK_FP32, T.with_arg("cache", lambda a: a["cache"][0]),
     r"cache: expected 3-D \[blocks, block_size, dim\]"),
    ("cache-width", "pack_kv", PACK_FP32, T.with_arg("x", lambda a: a["x"][:, :8]),
     r"cache: expected size 8 \(row width\) at dim 2, got 16"),
    ("out-ndim", "unpack_kv", UNPACK_FP32, T.with_arg("out", lambda a: a["out"][None]), r"out: expected 2-D", ("op",)),
    ("out-dtype", "unpack_kv", UNPACK_FP32, T.with_arg("out", lambda a: a["out"].int()), r"out: expected dtype in",
     ("op",)),
    ("unpack-slots-dtype", "unpack_kv", UNPACK_FP32, T.with_arg("slots", lambda a: a["slots"].long()),
     r"slots: expected dtype in \[torch.int32\]"),
    ("unpack-slots-ndim", "unpack_kv", UNPACK_FP32, T.with_arg("slots", lambda a: a["slots"][None]),
     r"slots: expected 1-D"),
    # Values (public functions only; eager).
    ("slots-high", "pack_kv", PACK_FP8, T.with_arg("slots", lambda a: torch.tensor([1, 8, 0], dtype=I32)),
     r"slots: expected values in \[-1, 8\) \(-1 or a slot of the pool's 8\), got 8 at index 1", ("public",)),
    ("slots-low", "pack_kv", PACK_FP32, T.with_arg("slots", lambda a: torch.tensor([1, -2, 0], dtype=I32)),
     r"slots: expected values in \[-1, 8\) .*got -2 at index 1", ("public",)),
    ("slots-distinct", "pack_kv", PACK_FP32, T.with_arg("slots", lambda a: torch.tensor([3, -1, 3], dtype=I32)),
     r"slots: expected distinct slots \(one row per slot\), got 3 \(2 times\)", ("public",)),
    ("unpack-slots-high", "unpack_kv", UNPACK_FP32, T.with_arg("slots", lambda a: torch.tensor([0, -1, 9], dtype=I32)),
     r"slots: expected values in \[-1, 8\) .*got 9 at index 2", ("public",)),
]


@pytest.mark.parametrize("case", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_rejected_and_writes_nothing(case):
    _, name, factory, mutate, match, *via = case
    T.assert_bad_case(name, factory(), mutate, match, via)
