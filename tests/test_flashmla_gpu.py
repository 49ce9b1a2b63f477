"""GPU: dsv4::sparse_attn and FlashMLA's kernel (when `flash_mla` imports; see the bench kit) read the
same dsv4ops FP8 pools and indices; both must equal the float64 reference within the bf16 budget, so
FlashMLA is an independent check of the cache layout and of the kernel. Decode and prefill-chunk
shapes, -1 entries and shortened comp_lens, windows cut short at positions < 127, padding tokens
(ours only: FlashMLA has none), 64 and 128 heads."""

import pytest
import torch

from dsv4ops import testing
from dsv4ops.bench import flashmla
from dsv4ops.sparse_attn import reference as sparse_attn_ref

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or not flashmla.available(),
                                 reason="needs a CUDA GPU and flash_mla")]

BS, RING, WINDOW, FMT = 64, 256, 128, "fp8_584"


def _case(heads: int, prefill: bool, entries: int = 512, seed: int = 0):
    g = torch.Generator(device="cuda").manual_seed(seed)
    if prefill:  # one request's chunk: positions 60..315 cross the first window's end (127)
        pos = torch.arange(60, 316, dtype=torch.int32, device="cuda")
        req = torch.zeros_like(pos)
    else:  # separate requests, windows cut short below position 127
        pos = torch.tensor([0, 5, 126, 127, 128, 1000, 4095, 70000], dtype=torch.int32, device="cuda")
        req = torch.arange(pos.shape[0], dtype=torch.int32, device="cuda")
    t = pos.shape[0]
    n_req = int(req.max()) + 1
    wc = testing.fill_pool(testing.page_pool(n_req * RING // BS, BS, 512, "fp8", device="cuda"), 512, "fp8")
    cc = testing.fill_pool(testing.page_pool(2 * entries // BS + 1, BS, 512, "fp8", device="cuda"), 512, "fp8")
    n_slots = cc.shape[0] * BS
    idx = torch.stack([torch.randperm(n_slots, device="cuda", generator=g)[:entries] for _ in range(t)]).int()
    idx[torch.rand(idx.shape, device="cuda", generator=g) < 0.1] = -1  # -1 entries inside the list
    lens = torch.randint(0, entries + 1, (t,), device="cuda", generator=g).int()
    lens[::2] = entries
    q = torch.randn(t, heads, 512, device="cuda", generator=g).bfloat16()
    sinks = torch.randn(heads, device="cuda", generator=g)
    return q, wc, cc, pos, req, idx, lens, sinks


def _ours(q, wc, cc, pos, req, idx, lens, sinks):
    out = torch.full_like(q, float("nan"))
    torch.ops.dsv4.sparse_attn(q, wc, cc, pos, req, idx, lens, None, sinks, out, 512**-0.5, WINDOW, RING, FMT, FMT)
    return out


def _reference(dtype, q, wc, cc, pos, req, idx, lens, sinks):
    out = torch.empty(q.shape, dtype=dtype, device="cuda")
    sparse_attn_ref.sparse_attn(q.to(dtype), wc, cc, pos, req, idx, lens, None, sinks, out, 512**-0.5, WINDOW, RING,
                                FMT, FMT)
    return out


@pytest.mark.parametrize("prefill", [False, True], ids=["decode", "prefill-chunk"])
@pytest.mark.parametrize("heads", [64, 128])
def test_sparse_attn_and_flashmla_agree_on_the_same_pools(heads, prefill):
    case = _case(heads, prefill)
    ref64, lowp = _reference(torch.float64, *case), _reference(torch.bfloat16, *case)
    ours = _ours(*case)
    q, wc, cc, pos, req, idx, lens, sinks = case
    fn = (flashmla.prefill if prefill else flashmla.decode)(q, wc, cc, pos, req, idx, lens, sinks, 512**-0.5, WINDOW,
                                                            RING)
    theirs = fn()
    testing.assert_close_to_ref(ours, ref64, lowp, what="dsv4::sparse_attn")
    testing.assert_close_to_ref(theirs, ref64, lowp, what="FlashMLA on dsv4ops pools")


def test_padding_tokens_write_zeros_and_the_live_ones_match_the_reference():
    q, wc, cc, pos, req, idx, lens, sinks = _case(64, prefill=False)
    req = req.clone()
    req[1::3] = -1  # FlashMLA has no padding token: ours must zero them and leave the others right
    case = (q, wc, cc, pos, req, idx, lens, sinks)
    ours = _ours(*case)
    assert (ours[req < 0] == 0).all()
    testing.assert_close_to_ref(ours, _reference(torch.float64, *case), _reference(torch.bfloat16, *case))
