"""GPU (sm_90): the CUDA C++ sparse_attn kernel (csrc/sparse_attn/, launcher dsv4ops/sparse_attn/cuda.py)
against the float64 reference within the bf16 budget (a bf16 run of the reference). The arch table
does not select it yet: these tests call its launcher. Decode tokens of separate requests (split-KV
and the combine kernel) and a prefill chunk (one split), windows cut short below position 127, -1
entries and shortened comp_lens, padding tokens, draft-block window ends, head counts that leave a
CTA partly empty; outputs poisoned with NaN before the call."""

import pytest
import torch

from dsv4ops import testing
from dsv4ops.sparse_attn import cuda as sparse_attn_cuda
from dsv4ops.sparse_attn import reference as sparse_attn_ref

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] != 9,
                                 reason="needs an sm_90 GPU (the kernel is wgmma, sm_90a)")]

BS, RING, WINDOW, FMT = 64, 256, 128, "fp8_584"


def _case(heads: int, prefill: bool, entries: int = 512, pool=testing.FP8, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    if prefill:  # one request's chunk: positions 60..315 cross the first window's end (127)
        pos = torch.arange(60, 316, dtype=torch.int32, device="cuda")
        req = torch.zeros_like(pos)
    else:  # separate requests, windows cut short below position 127
        pos = torch.tensor([0, 5, 126, 127, 128, 1000, 4095, 70000], dtype=torch.int32, device="cuda")
        req = torch.arange(pos.shape[0], dtype=torch.int32, device="cuda")
    req[3::7] = -1  # padding tokens
    t, n_req = pos.shape[0], int(req.max()) + 1
    wc = testing.fill_pool(testing.page_pool(n_req * RING // BS, BS, 512, pool, device="cuda"), 512, pool)
    cc = testing.fill_pool(testing.page_pool(2 * entries // BS + 1, BS, 512, pool, device="cuda"), 512, pool)
    idx = torch.stack([torch.randperm(cc.shape[0] * BS, device="cuda", generator=g)[:entries] for _ in range(t)]).int()
    idx[torch.rand(idx.shape, device="cuda", generator=g) < 0.1] = -1  # -1 entries inside the list
    lens = torch.randint(0, entries + 1, (t,), device="cuda", generator=g).int()
    lens[::2] = entries
    q = torch.randn(t, heads, 512, device="cuda", generator=g).bfloat16()
    sinks = torch.randn(heads, device="cuda", generator=g)
    return q, wc, cc, pos, req, idx, lens, sinks


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
    assert (sparse_attn_cuda.splits(ctas, 128 + 512, sms) > 1) == (not prefill)
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
