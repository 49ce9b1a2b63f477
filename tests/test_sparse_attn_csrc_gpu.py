"""GPU (sm_90): the CUDA C++ sparse_attn kernel (csrc/sparse_attn/, launcher dsv4ops/sparse_attn/cuda.py)
against the float64 reference within the bf16 budget (a bf16 run of the reference), through its
launcher (the arch table selects it on sm_90, so the op-level tiers run it too). Decode tokens of separate requests (split-KV
and the combine kernel) and a prefill chunk (one split), windows cut short below position 127, -1
entries and shortened comp_lens, padding tokens, draft-block window ends, head counts that leave a
CTA partly empty; outputs poisoned with NaN before the call."""

import builders
import pytest
import torch

from dsv4ops import testing
from dsv4ops.sparse_attn import cuda as sparse_attn_cuda
from dsv4ops.sparse_attn import reference as sparse_attn_ref

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                                 reason="needs an sm_90 GPU (the kernel is wgmma, sm_90a)")]

BS, RING, WINDOW, FMT = 64, 256, 128, "fp8_584"


def _case(heads: int, prefill: bool, entries: int = 512, pool=builders.FP8):
    return builders.sparse_attn_gpu_case(heads, prefill, entries, pool, padding=True, block_size=BS, ring=RING)


def _run(fn, dtype, q, wc, cc, pos, req, idx, lens, sinks, ends=None, fmt=FMT):
    out = torch.full(q.shape, float("nan"), dtype=dtype, device="cuda")
    fn(q.to(dtype), wc, cc, pos, req, idx, lens, ends, sinks, out, 512**-0.5, WINDOW, RING, fmt, fmt)
    return out


def _check(case, ends=None, fmt=FMT):
    got = _run(sparse_attn_cuda.sparse_attn, torch.bfloat16, *case, ends=ends, fmt=fmt)
    req = case[4]
    assert got.isfinite().all() and (got[req < 0] == 0).all(), "every row written, padding rows zero"
    testing.assert_close_to_ref(got, _run(sparse_attn_ref.sparse_attn, torch.float64, *case, ends=ends, fmt=fmt),
                                _run(sparse_attn_ref.sparse_attn, torch.bfloat16, *case, ends=ends, fmt=fmt),
                                what="csrc sparse_attn")
    return got


@pytest.mark.parametrize("heads", [64, 128, 16, 72])
@pytest.mark.parametrize("prefill", [False, True], ids=["decode", "prefill"])
def test_matches_the_reference(heads, prefill):
    case = _case(heads, prefill)
    t = case[0].shape[0]
    ctas = t * -(-heads // sparse_attn_cuda.HEADS_PER_CTA)
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    # decode runs the split-KV path (partials + combine kernel), prefill the single-split one
    assert (sparse_attn_cuda.split_count(ctas, 128 + 512, sms) > 1) == (not prefill)
    _check(case)


def test_draft_block_window_ends():
    """Draft blocks of 5 tokens: each token's window ends at its block's last position."""
    case = _case(64, prefill=True)
    pos, req = case[3], case[4]
    live = req >= 0
    start, last = pos[live].min(), pos[live].max()
    ends = torch.where(live, torch.minimum(start + ((pos - start) // 5 + 1) * 5 - 1, last), 0).to(torch.int32)
    _check(case, ends=ends)


def test_long_entry_lists_split_many_ways():
    """HCA-like: 4096 entries per token, few tokens: many splits merged by the combine kernel."""
    _check(_case(64, prefill=False, entries=4096))


def test_lists_much_wider_than_their_lengths():
    """HCA at a large max_context: 8192-entry lists holding 0 to 300 real entries. Most splits hold
    no key of their token: they leave at once and the combine reads only the live ones."""
    case = list(_case(64, prefill=False, entries=8192))
    lens = case[6]
    case[6] = (torch.arange(lens.numel(), device=lens.device, dtype=lens.dtype) * 37) % 301
    t = case[0].shape[0]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert sparse_attn_cuda.split_count(t, 128 + 8192, sms) > 8
    _check(tuple(case))


def test_run_to_run_bitwise_identical():
    case = _case(64, prefill=False)
    first = _run(sparse_attn_cuda.sparse_attn, torch.bfloat16, *case)
    again = _run(sparse_attn_cuda.sparse_attn, torch.bfloat16, *case)
    assert torch.equal(first, again)


def test_other_formats_run_the_triton_kernel():
    case = _case(64, prefill=False, pool=torch.bfloat16)
    wc, cc = case[1], case[2]
    assert not sparse_attn_cuda.serves(case[0], wc, cc, case[5], "exact", "exact")
    _check(case, fmt="exact")


@pytest.mark.parametrize("tokens", [16, 132], ids=["split", "one-split"])
def test_one_key_returns_its_dequantized_row_bit_for_bit(tokens):
    """Each token sees one key (position 0, no entries), q = 0 and no sink (-inf): its softmax weight
    is exactly 1, so its output is that key's row, and the kernel's e4m3 x UE8M0 -> bf16 conversion
    must equal the reference unpack bit for bit: every e4m3 code but the NaNs, subnormals included,
    in every dim, at scales 2^-27 .. 2^13 (bytes 100 .. 140)."""
    from dsv4ops.quant import formats
    from dsv4ops.quant.reference import unpack_kv

    heads, f = 64, formats.get(FMT)
    slots = torch.arange(tokens, dtype=torch.int32, device="cuda") * RING  # request r's position 0
    wc = builders.fill_pool(builders.page_pool(tokens * RING // BS, BS, 512, builders.FP8, device="cuda"), 512,
                           builders.FP8)
    rows = torch.arange(tokens, device="cuda")[:, None]
    codes = (torch.arange(448, device="cuda") + 37 * rows) % 256
    codes = torch.where(codes % 128 == 127, codes - 1, codes).to(torch.uint8)  # 0x7f / 0xff are NaN
    scales = (100 + (rows * 7 + torch.arange(8, device="cuda")) * 3 % 41).to(torch.uint8)
    page = wc.view(wc.shape[0], -1)
    blk, off = (slots // BS).long(), (slots % BS).long()
    page[blk[:, None], off[:, None] * f.data_bytes + torch.arange(448, device="cuda")] = codes
    page[blk[:, None], BS * f.data_bytes + off[:, None] * f.scale_bytes + torch.arange(8, device="cuda")] = scales
    expected = torch.empty(tokens, 512, dtype=torch.float32, device="cuda")
    unpack_kv(wc, slots, expected, FMT)
    expected = expected.bfloat16()
    assert expected.isfinite().all() and (expected[:, :448] == 0).float().mean() < 0.05

    q = torch.zeros(tokens, heads, 512, dtype=torch.bfloat16, device="cuda")
    pos = torch.zeros(tokens, dtype=torch.int32, device="cuda")
    idx = torch.empty(tokens, 0, dtype=torch.int32, device="cuda")
    sinks = torch.full((heads,), float("-inf"), device="cuda")
    out = _run(sparse_attn_cuda.sparse_attn, torch.bfloat16, q, wc, wc, pos, slots // RING, idx, pos, sinks)
    assert torch.equal(out, expected[:, None].expand_as(out))
