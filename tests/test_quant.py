"""dsv4::pack_kv / dsv4::unpack_kv and their public functions for every format (V4: fp8_584,
fp8_132; V4.1: fp8_528, fp4_288, mxfp4_68; exact rows): bytes against an independent float64 model
of the formats (tests/format_model.py, from the spec's tables), the scale rules at their boundaries
(transformers' FP8 floor, the e4m3 scale overflow, pow2ceil at powers of two), e2m1 nibble order,
ties and signed zeros, page planes and alignment, round trips, what a call writes (and that slot -1
writes and reads nothing), int64 offsets, bad inputs. Issues 3, 16."""

from functools import partial

import builders
import pytest
import torch
from builders import FP8

import format_model as M
from interp import i32, new_pool, pool_fmt
from dsv4ops.quant import api, codecs, formats
from dsv4ops.quant import reference as quant_ref
from dsv4ops.quant import triton as quant_tt
from dsv4ops.quant.reference import (
    INDEXER_ENTRY_BYTES,
    MAIN_DATA_BYTES,
    MAIN_ENTRY_BYTES,
    _page_offsets,
    indexer_block_bytes,
    main_block_bytes,
)
from dsv4ops.reference.numerics import round_indexer_key, round_kv

U8 = torch.uint8
BYTE_FORMATS = sorted(formats.FORMATS)
# Entries per page in these tests: odd and small so slots cross pages; mxfp4_68 pages (aligned to
# 512 B) need a count whose padding is shorter than a 68-B row (7 x 68 = 476 B in a 512-B page).
BS = {"fp8_584": 3, "fp8_132": 3, "fp8_528": 3, "fp4_288": 3, "mxfp4_68": 7}


def _fp8_bytes(v: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (v / scale).to(torch.float8_e4m3fn).view(U8)


# ---- byte layout -------------------------------------------------------------------------------
def test_page_sizes():
    # FlashMLA pages: block_size x 584 B rounded up to a multiple of 576 B.
    assert main_block_bytes(64) == 65 * 576 == 37440
    assert main_block_bytes(1) == 2 * 576 and main_block_bytes(3) == 4 * 576
    assert indexer_block_bytes(64) == 64 * 132
    # V4.1 (spec 4.1): vLLM's 32-row SWA page is 16896 B; 128 index keys fill 17 pages of 512 B.
    assert formats.FORMATS["fp8_528"].page_bytes(32) == 16896
    assert formats.FORMATS["fp4_288"].page_bytes(64) == 18432 and formats.FORMATS["fp4_288"].page_bytes(3) == 1024
    assert formats.FORMATS["mxfp4_68"].page_bytes(128) == 8704 and formats.FORMATS["mxfp4_68"].page_bytes(7) == 512
    for name in BYTE_FORMATS:
        for bs in (BS[name], 128):
            assert formats.FORMATS[name].page_bytes(bs) == M.page_bytes(name, bs)
            assert api.block_size(torch.empty(2, M.page_bytes(name, bs), dtype=U8), name) == bs
    assert api.block_size(torch.empty(5, 37440, dtype=U8), "fp8_584") == 64
    assert api.pool_slots(torch.empty(5, 7, 16), "exact") == 35


def test_a_page_whose_padding_holds_a_row_is_rejected():
    # 64 x 68 B = 4352 B padded to 4608 B: 256 B of padding would read back as 67 rows.
    with pytest.raises(ValueError, match=r"block_size: mxfp4_68 pages are padded to a multiple of 512 B; 64 rows "
                                         r"\(4352 B\) leave 256 B of padding, more than one 68-B row"):
        formats.FORMATS["mxfp4_68"].page_bytes(64)
    with pytest.raises(ValueError, match="block_size: expected >= 1 slots per page, got 0"):
        formats.FORMATS["fp8_528"].page_bytes(0)


def _rows(name: str, n: int) -> torch.Tensor:
    """Rows that reach every rule of a format: groups spanning 1e-7 .. 1e4, an all-zero group, signed
    zeros, exact e2m1 ties under a unit scale (amax 6), and (fp4_288) a group whose scale overflows."""
    dim, group = formats.FORMATS[name].dim, formats.FORMATS[name].group
    x = torch.randn(n, dim // group, group) * torch.logspace(-7, 4, n * dim // group).view(n, dim // group, 1)
    x = x.view(n, dim)
    x[0, :group] = 0
    x[0, group: 2 * group] = -0.0
    ties = torch.tensor([6.0, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -0.1, -0.0, 0.0, 5.5, 4.5, 1.0, -6.0])
    x[1, : ties.numel()] = ties
    x[1, ties.numel(): group] = 0.0
    if name == "fp4_288":
        x[2, 16:32] = 3000.0 * torch.sign(torch.randn(16))  # amax / 6 = 500 > 464: the NaN scale code
    return x


@pytest.mark.parametrize("name", BYTE_FORMATS)
def test_pool_bytes_equal_the_independent_model(name):
    bs, blocks = BS[name], 3
    x = _rows(name, 5)
    slots = [2 * bs - 1, 0, bs, 3 * bs - 1, 1]  # page ends and starts, first and last page
    pool = builders.page_pool(blocks, bs, formats.FORMATS[name].dim, name)
    api.pack_kv(x, torch.tensor(slots, dtype=torch.int32), pool, name)
    want = M.pool_bytes(name, blocks, bs, {s: x[i].tolist() for i, s in enumerate(slots)})
    got = bytes(pool.view(-1).tolist())
    bad = [i for i in range(len(want)) if got[i] != want[i]]
    assert not bad, f"{name}: {len(bad)} bytes differ, first at {bad[0]}: {got[bad[0]]:#x} != {want[bad[0]]:#x}"


def test_nibble_order_ties_and_signed_zero():
    # Element 2i in the low nibble: [1.0, -6.0] -> 0xF2; ties go to the even code; -0.1 and -0.0
    # round to the sign-zero nibble 0x8.
    for name in ("fp4_288", "mxfp4_68"):
        f = formats.FORMATS[name]
        x = torch.zeros(1, f.dim)
        x[0, :8] = torch.tensor([1.0, -6.0, 0.25, 0.75, 1.25, 1.75, -0.1, -0.0])
        x[0, 8:12] = torch.tensor([2.5, 3.5, 5.0, 6.0])
        data, scales = codecs.encode(name, x)
        assert data[0, :6].tolist() == [0xF2, 0x20, 0x42, 0x88, 0x64, 0x76], name
        assert scales[0, 0].item() == (0x38 if name == "fp4_288" else 127)  # scale 1: e4m3 0x38, UE8M0 127


def test_fp8_528_scale_follows_transformers_floor_on_amax():
    # transformers: scale = pow2ceil(max(amax, 1e-4) / 448); vLLM floors amax / 448 at 1e-4 instead.
    # They differ for tiles with amax <= 448 x 2^-14 = 0.02734375 (exactly 1.75 x 2^-6 in bf16).
    cases = {0.0: 105, 5e-5: 105, 1.75 * 2**-14: 105, (1.75 + 2**-7) * 2**-14: 106,  # the 1e-4 floor: 2^-22
             1.75 * 2**-6: 113, (1.75 + 2**-7) * 2**-6: 114,  # vLLM: 114 for both (2^-13)
             448.0: 127, 450.0: 128, 1.75 * 2**10: 129}  # pow2ceil exact at 448 x 2^k
    x = torch.zeros(1, 512)
    for j, amax in enumerate(cases):
        x[0, 32 * j] = -amax
    _, scales = codecs.encode("fp8_528", x)
    assert scales[0, : len(cases)].tolist() == list(cases.values())


def test_fp4_288_scale_has_no_upper_clamp():
    # S = e4m3(amax / 6): 464 (amax 2784) is a tie that rounds to 448 (0x7E); above it the e4m3fn NaN
    # code 0x7F (transformers; vLLM clamps to 448). The floor: S >= 2^-9 (0x01).
    x = torch.zeros(1, 512)
    for j, amax in enumerate((2784.0, 2800.0, 0.0, 6 * 2**-10, 6.0)):
        x[0, 16 * j] = amax
    data, scales = codecs.encode("fp4_288", x)
    assert scales[0, :5].tolist() == [0x7E, 0x7F, 0x01, 0x01, 0x38]
    back = codecs.decode("fp4_288", data, scales)
    assert back[0, 16:32].isnan().all() and not back[0, :16].isnan().any() and back[0, 0] == 6 * 448


def test_mxfp4_68_scale_is_pow2ceil_of_amax_over_6():
    x = torch.zeros(1, 128)
    for j, amax in enumerate((6.0, 6.0 * (1 + 2**-7), 0.0, 3 * 2**-120)):
        x[0, 32 * j] = amax
    _, scales = codecs.encode("mxfp4_68", x)
    assert scales[0].tolist() == [127, 128, 1, 6]  # 2^0, 2^1, the floor 2^-126, 2^-121 (no bump at 2^k)


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
    assert api.pool_slots(pool, "fp8_584") == blocks * bs
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
    pool = builders.page_pool(2, 4, 512, FP8)
    api.pack_kv(x, slots, pool, "fp8_584")
    y = api.unpack_kv(pool, slots, 512, torch.float32, "fp8_584")
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
    pool = builders.page_pool(3, 4, 128, FP8)
    api.pack_kv(x, slots, pool, "fp8_132")
    y = api.unpack_kv(pool, slots, 128, torch.float32, "fp8_132")
    assert torch.equal(y, round_indexer_key(x, "fp8"))
    v = x.bfloat16().float()
    scale = torch.exp2(torch.ceil(torch.log2(v.abs().amax(-1, keepdim=True) / 448)))
    assert ((y - v).abs() <= torch.maximum(v.abs() * 2**-4, scale * 2**-10)).all()


@pytest.mark.parametrize("name", ["fp8_528", "fp4_288", "mxfp4_68"])
def test_v41_round_trip_reads_back_the_model_values(name):
    # The dequantized rows are the model's codes times its scales, element for element.
    f = formats.FORMATS[name]
    x = _rows(name, 4).clamp(-1000, 1000)  # no overflowing fp4_288 scale here (amax / 6 < 464)
    slots = torch.tensor([1, 0, 2 * BS[name] - 1, BS[name]], dtype=torch.int32)
    pool = builders.page_pool(2, BS[name], f.dim, name)
    api.pack_kv(x, slots, pool, name)
    y = api.unpack_kv(pool, slots, f.dim, torch.float32, name).double()
    for i in range(4):
        assert y[i].tolist() == M.roundtrip(name, x[i].tolist()), (name, i)
    # The values are exact in bf16 (the attention reads them in the activations' dtype).
    assert torch.equal(y.bfloat16().double(), y)


@pytest.mark.parametrize("name", ["fp8_528", "fp4_288", "mxfp4_68"])
def test_v41_quantization_error_is_within_half_a_step(name):
    f = formats.FORMATS[name]
    x = torch.randn(8, f.dim) * torch.logspace(-3, 2, 8)[:, None]
    data, scales = codecs.encode(name, x)
    y = codecs.decode(name, data, scales).double()
    v = x.bfloat16().double().view(8, -1, f.group)
    err = (y.view_as(v) - v).abs()
    amax = v.abs().amax(-1, keepdim=True)
    if name == "fp4_288":
        scale = scales.view(torch.float8_e4m3fn).double().unsqueeze(-1)
        normal = amax / 6 >= 2**-6  # e4m3 normals: 3 mantissa bits, half an ulp is 2^-4 relative
        assert ((scale - amax / 6).abs() <= amax / 6 * 2**-4)[normal].all()
        assert (scale[amax / 6 < 2**-9] == 2**-9).all()  # the floor
    else:
        scale = torch.exp2(scales.double() - 127).unsqueeze(-1)
    if name == "fp8_528":  # e4m3 codes: half an ulp is 2^-4 relative (subnormal codes: 2^-10 x scale)
        assert ((scale * 448 >= amax) & (scale * 224 < amax) | (scale == 2**-22)).all()
        assert (err <= torch.maximum(v.abs() * 2**-4, scale * 2**-10)).all()
    else:  # the widest e2m1 step (4 -> 6) is 2 scales: half a step is 1 scale; codes stop at 6 scales
        if name == "mxfp4_68":
            assert ((scale * 6 >= amax) & (scale * 3 < amax)).all()
        clipped = (v.abs() - 6 * scale).clamp(min=0)  # e4m3 subnormal scales round down by up to 1/2
        assert (err <= clipped + scale).all()
        assert (err[clipped == 0] <= scale.expand_as(err)[clipped == 0]).all()


@pytest.mark.parametrize("fmt,dtype", [(torch.float32, torch.bfloat16), (torch.bfloat16, torch.float32)])
def test_float_pool_round_trip(fmt, dtype):
    x = torch.randn(3, 16, dtype=dtype)
    slots = torch.tensor([7, 1, 4], dtype=torch.int32)
    pool = builders.page_pool(2, 4, 16, fmt)
    api.pack_kv(x, slots, pool, "exact")
    assert torch.equal(api.unpack_kv(pool, slots, 16, dtype, "exact"), x.to(fmt).to(dtype))


# ---- what a call writes ------------------------------------------------------------------------
FORMAT_CASES = [(name, formats.FORMATS[name].dim) for name in BYTE_FORMATS] + [(torch.float32, 16)]
FORMAT_IDS = BYTE_FORMATS + ["exact"]


@pytest.mark.parametrize("fmt,dim", FORMAT_CASES, ids=FORMAT_IDS)
def test_pack_writes_its_slots_only(fmt, dim):
    bs = BS.get(fmt, 4)
    name = builders.format_name(fmt, dim)
    pool = builders.page_pool(3, bs, dim, fmt)
    slots = torch.tensor([2 * bs + 1, -1, 2, -1], dtype=torch.int32)
    x = torch.randn(4, dim)
    api.pack_kv(x, slots, pool, name)
    fresh = builders.page_pool(3, bs, dim, fmt)
    for s, row in zip([2 * bs + 1, 2], [x[0], x[2]], strict=True):  # each written entry, alone, into a fresh pool
        api.pack_kv(row[None], torch.tensor([s], dtype=torch.int32), fresh, name)
    assert builders.bytes_equal(pool, fresh)  # rows with slot -1 wrote nothing; nothing else changed
    poisoned = builders.page_pool(3, bs, dim, fmt)
    touched = (pool.view(U8) != poisoned.view(U8)) if pool.dtype == U8 else ~pool.isnan()
    per_entry = formats.FORMATS[name].row_bytes if pool.dtype == U8 else dim
    assert int(touched.sum()) <= 2 * per_entry


@pytest.mark.parametrize("fmt,dim", FORMAT_CASES, ids=FORMAT_IDS)
def test_unpack_slot_minus_one_reads_nothing(fmt, dim):
    pool = builders.page_pool(2, BS.get(fmt, 4), dim, fmt)  # all poison: any read is NaN
    out = torch.full((3, dim), float("nan"))
    builders.call_op("unpack_kv", dict(cache=pool, slots=torch.full((3,), -1, dtype=torch.int32), out=out,
                                fmt=builders.format_name(fmt, dim)))
    assert (out == 0).all()


@pytest.mark.parametrize("fmt", [FP8, "fp4_288", "mxfp4_68"])
def test_unpack_writes_every_row(fmt):
    args = builders.unpack_kv_args(torch.float32, fmt, slots=(5, -1, 0), block_size=BS.get(fmt, 4))
    args["out"].fill_(float("nan"))
    builders.call_op("unpack_kv", args)
    assert not args["out"].isnan().any() and (args["out"][1] == 0).all()


# ---- bad inputs: one per rule ------------------------------------------------------------------
PACK_FP32 = partial(builders.pack_kv_args, torch.float32)
PACK_FP8 = partial(builders.pack_kv_args, torch.float32, FP8)
PACK_MX4 = partial(builders.pack_kv_args, torch.float32, "mxfp4_68", block_size=7)
UNPACK_FP32 = partial(builders.unpack_kv_args, torch.float32)
I32 = torch.int32
BAD = [
    # (id, op, factory, mutation, error, message, paths)
    ("x-ndim", "pack_kv", PACK_FP32, builders.with_arg("x", lambda a: a["x"][None]), r"x: expected 2-D \[rows, dim\]"),
    ("x-dtype", "pack_kv", PACK_FP32, builders.with_arg("x", lambda a: a["x"].double()), r"x: expected dtype in"),
    ("slots-ndim", "pack_kv", PACK_FP32, builders.with_arg("slots", lambda a: a["slots"][:, None]), r"slots: expected 1-D"),
    ("slots-dtype", "pack_kv", PACK_FP32, builders.with_arg("slots", lambda a: a["slots"].long()),
     r"slots: expected dtype in \[torch.int32\], got torch.int64"),
    ("slots-size", "pack_kv", PACK_FP32, builders.with_arg("slots", lambda a: a["slots"][:2]),
     r"slots: expected size 3 \(tokens of x\) at dim 0, got 2"),
    ("slots-device", "pack_kv", PACK_FP32, builders.with_arg("slots", lambda a: a["slots"].to("meta")),
     r"slots: expected device cpu \(as x\), got meta"),
    ("cache-contiguous", "pack_kv", PACK_FP32, builders.with_arg("cache", lambda a: a["cache"].transpose(0, 1)),
     r"cache: expected a contiguous tensor"),
    ("cache-device", "pack_kv", PACK_FP32, builders.with_arg("cache", lambda a: a["cache"].to("meta")),
     r"cache: expected device cpu \(as the activations\), got meta"),
    ("cache-fp8-ndim", "pack_kv", PACK_FP8, builders.with_arg("cache", lambda a: a["cache"][None]),
     r"cache: expected 2-D \[blocks, page bytes\] \(fp8_584 pages\)"),
    ("cache-fp8-width", "pack_kv", PACK_FP8, builders.with_arg("x", lambda a: a["x"][:, :256]),
     r"cache: format fp8_584 stores 512-d rows, got 256-d rows"),
    ("cache-fp8-page", "pack_kv", PACK_FP8, builders.with_arg("cache", lambda a: a["cache"][:, :-1].contiguous()),
     r"cache: expected a page of whole 584-B fp8_584 rows \(2880 B for 4 rows\), got 2879 B"),
    ("cache-mx4-page", "pack_kv", PACK_MX4, builders.with_arg("cache", lambda a: a["cache"][:, :-4].contiguous()),
     r"cache: expected a page of whole 68-B mxfp4_68 rows \(512 B for 7 rows\), got 508 B"),
    ("fmt-unknown", "pack_kv", PACK_FP8, builders.with_arg("fmt", lambda a: "fp8"),
     r"fmt: expected one of \['fp8_584', 'fp8_132', 'fp8_528', 'fp4_288', 'mxfp4_68', 'exact'\], got 'fp8'"),
    ("fmt-other-format", "pack_kv", PACK_FP8, builders.with_arg("fmt", lambda a: "fp4_288"),
     r"cache: expected a page of whole 288-B fp4_288 rows"),
    ("fmt-exact-on-bytes", "unpack_kv", partial(builders.unpack_kv_args, torch.float32, "fp8_528"),
     builders.with_arg("fmt", lambda a: "exact"), r"cache: expected dtype in \[torch.float32, torch.bfloat16, "),
    ("cache-dtype", "pack_kv", PACK_FP32, builders.with_arg("cache", lambda a: a["cache"].double()),
     r"cache: expected dtype in"),
    ("cache-ndim", "pack_kv", PACK_FP32, builders.with_arg("cache", lambda a: a["cache"][0]),
     r"cache: expected 3-D \[blocks, block_size, dim\]"),
    ("cache-width", "pack_kv", PACK_FP32, builders.with_arg("x", lambda a: a["x"][:, :8]),
     r"cache: expected size 8 \(row width\) at dim 2, got 16"),
    ("out-ndim", "unpack_kv", UNPACK_FP32, builders.with_arg("out", lambda a: a["out"][None]), r"out: expected 2-D", ("op",)),
    ("out-dtype", "unpack_kv", UNPACK_FP32, builders.with_arg("out", lambda a: a["out"].int()), r"out: expected dtype in",
     ("op",)),
    ("unpack-slots-dtype", "unpack_kv", UNPACK_FP32, builders.with_arg("slots", lambda a: a["slots"].long()),
     r"slots: expected dtype in \[torch.int32\]"),
    ("unpack-slots-ndim", "unpack_kv", UNPACK_FP32, builders.with_arg("slots", lambda a: a["slots"][None]),
     r"slots: expected 1-D"),
    # Values (public functions only; eager).
    ("slots-high", "pack_kv", PACK_FP8, builders.with_arg("slots", lambda a: torch.tensor([1, 8, 0], dtype=I32)),
     r"slots: expected values in \[-1, 8\) \(-1 or a slot of the pool's 8\), got 8 at index 1", ("public",)),
    ("slots-low", "pack_kv", PACK_FP32, builders.with_arg("slots", lambda a: torch.tensor([1, -2, 0], dtype=I32)),
     r"slots: expected values in \[-1, 8\) .*got -2 at index 1", ("public",)),
    ("slots-distinct", "pack_kv", PACK_FP32, builders.with_arg("slots", lambda a: torch.tensor([3, -1, 3], dtype=I32)),
     r"slots: expected distinct slots \(one row per slot\), got 3 \(2 times\)", ("public",)),
    ("unpack-slots-high", "unpack_kv", UNPACK_FP32, builders.with_arg("slots", lambda a: torch.tensor([0, -1, 9], dtype=I32)),
     r"slots: expected values in \[-1, 8\) .*got 9 at index 2", ("public",)),
    # Issue 32: +inf in the e4m3 part of an fp8_584 row was stored as 448 (scale 1 for its tile).
    ("x-inf-fp8", "pack_kv", PACK_FP8, builders.with_arg("x", lambda a: _with(a["x"], (2, 5), float("inf"))),
     r"x: expected finite values \(the rows stored in format fp8_584: its scales come from each tile's amax\), "
     r"got inf at index \(2, 5\)", ("public",)),
    ("x-nan-mx4", "pack_kv", PACK_MX4, builders.with_arg("x", lambda a: _with(a["x"], (0, 127), float("nan"))),
     r"x: expected finite values \(the rows stored in format mxfp4_68.*got nan at index \(0, 127\)", ("public",)),
]


def _with(x: torch.Tensor, at: tuple, value: float) -> torch.Tensor:
    x = x.clone()
    x[at] = value
    return x


def test_non_finite_values_are_stored_where_nothing_is_coded():
    """A skipped row (slot -1) may hold anything, and an exact pool stores inf and NaN as they are."""
    args = PACK_FP8()
    args["x"] = _with(args["x"], (1, 0), float("inf"))  # slot -1: skipped
    api.pack_kv(args["x"], args["slots"], args["cache"], args["fmt"])
    exact = PACK_FP32()
    exact["x"] = _with(_with(exact["x"], (0, 3), float("-inf")), (2, 1), float("nan"))
    api.pack_kv(exact["x"], exact["slots"], exact["cache"], exact["fmt"])
    rows = exact["cache"].view(-1, exact["x"].shape[1])
    assert torch.equal(rows[5], exact["x"][0]) and torch.isnan(rows[0, 1])


@pytest.mark.parametrize("case", BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_rejected_and_writes_nothing(case):
    _, name, factory, mutate, match, *via = case
    builders.assert_bad_case(name, factory(), mutate, match, via)


# ---- the Triton kernel under the interpreter, against the reference (helpers: tests/interp.py) -------------
@pytest.mark.parametrize("dim", [512, 128])
@pytest.mark.parametrize("pool", ["fp8", torch.bfloat16, torch.float32], ids=["fp8", "bf16", "fp32"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_pack_unpack_bit_exact(dim, pool, dtype):
    # Rows spanning 6 decades, a zero block (amax floor), an exact power-of-two amax (the frexp
    # edge), signed zeros and a padding slot (-1).
    x = (torch.randn(7, dim) * torch.logspace(-3, 3, 7)[:, None]).to(dtype)
    x[0, :64] = 0
    x[1, 5] = 448 * 2.0**-3
    x[2] = -0.0
    slots = i32(0, 11, -1, 5, 3, 2, 7)
    got, want = new_pool(pool, dim, 4), new_pool(pool, dim, 4)
    out, expect = _pack_unpack_both(x, slots, got, want, pool_fmt(got, dim))
    assert builders.bytes_equal(out, expect)


def _pack_unpack_both(x, slots, got, want, fmt):
    """Pack x at slots with the kernel into `got` and with the reference into `want` (the bytes must
    be equal), then unpack `want` both ways: (kernel rows, poisoned first; reference rows)."""
    quant_tt.pack_kv(x, slots, got, fmt)
    quant_ref.pack_kv(x, slots, want, fmt)
    assert builders.bytes_equal(got, want)
    out, expect = torch.full(x.shape, 7.0, dtype=x.dtype), torch.empty_like(x)
    quant_tt.unpack_kv(want, slots, out, fmt)
    quant_ref.unpack_kv(want, slots, expect, fmt)
    return out, expect


V41_BS = {"fp8_528": 4, "fp4_288": 4, "mxfp4_68": 7}  # mxfp4_68 pages (512-B aligned) need 7 or 128 rows


@pytest.mark.parametrize("fmt", sorted(V41_BS))
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_pack_unpack_v41_formats_bit_exact(fmt, dtype):
    # Rows over 8 decades; a zero row (the amax floors); a row past fp4_288's scale range (amax / 6
    # > 464: the NaN scale code); e2m1 tie points (0.25, 0.75, ..., 5 times a power of two: ties to
    # the even code); signed zeros; subnormal e4m3 scales; a padding slot (-1).
    dim = formats.FORMATS[fmt].dim
    x = (torch.randn(9, dim) * torch.logspace(-4, 4, 9)[:, None]).to(dtype)
    x[0] = 0
    x[1, :40] = 3000.0
    ties = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 6.0])
    x[2] = (ties.repeat(dim // 8) * torch.tensor([1.0, -1.0]).repeat_interleave(4).repeat(dim // 8)).to(dtype)
    x[3] = -0.0
    x[4] = x[4] * 1e-3
    bs = V41_BS[fmt]
    slots = i32(0, 11, -1, 5, 3, 2, 7, 9, 1)
    got, want = builders.page_pool(3, bs, dim, fmt), builders.page_pool(3, bs, dim, fmt)
    out, expect = _pack_unpack_both(x, slots, got, want, fmt)
    # The NaN-scale groups read back NaN on both sides (payloads may differ); the rest bit for bit.
    nan = expect.isnan()
    assert torch.equal(out.isnan(), nan) and builders.bytes_equal(out[~nan], expect[~nan])


def test_fp8_casts_match_torch_on_every_code():
    # Every e4m3 code decodes as torch does, and values between and around codes encode as torch
    # rounds them (nearest even), through the same helpers the kernels use.
    codes = torch.arange(256, dtype=torch.int32)
    finite = codes[(codes & 0x7F) != 0x7F]
    vals = finite.to(torch.uint8).view(torch.float8_e4m3fn).float()
    mids = torch.cat([vals, (vals[:-1] + vals[1:]) / 2, vals * (1 + 2**-10), vals * (1 - 2**-10)])
    mids = mids[mids.abs() <= 448].reshape(1, -1)
    mids = torch.nn.functional.pad(mids, (0, 128 - mids.shape[1] % 128)).reshape(-1, 128)
    # Pack with scale 1: make each row's amax 448 so the UE8M0 exponent is 0.
    mids[:, 0] = 448.0
    slots = torch.arange(mids.shape[0], dtype=torch.int32)
    got, want = new_pool("fp8", 128, mids.shape[0]), new_pool("fp8", 128, mids.shape[0])
    quant_tt.pack_kv(mids.to(torch.float32), slots, got, "fp8_132")
    quant_ref.pack_kv(mids.to(torch.float32), slots, want, "fp8_132")
    assert torch.equal(got, want)
