"""GPU: dsv4::sparse_attn and FlashMLA's kernel (when `flash_mla` imports; see the bench kit) read the
same dsv4ops FP8 pools and indices; both must equal the float64 reference within the bf16 budget, so
FlashMLA is an independent check of the cache layout and of the kernel. Decode and prefill-chunk
shapes, -1 entries and shortened comp_lens, windows cut short at positions < 127, padding tokens
(ours only: FlashMLA has none), 64 and 128 heads."""

import builders
import pytest
import torch

from dsv4ops import testing
from dsv4ops.bench import flashmla
from dsv4ops.sparse_attn import reference as sparse_attn_ref

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or not flashmla.available(),
                                 reason="needs a CUDA GPU and flash_mla")]

BS, RING, WINDOW, FMT = 64, 256, 128, "fp8_584"


def _case(heads: int, prefill: bool):
    return builders.sparse_attn_gpu_case(heads, prefill, block_size=BS, ring=RING)


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


@pytest.mark.parametrize("heads", [8, 16, 32])
def test_flashmla_padded_for_a_tensor_parallel_shard(heads):
    # As engines run FlashMLA for a rank's h < 64 heads: q zero-padded to 64 heads, the output sliced.
    # Both it and ours at h heads must equal the reference on those heads.
    q, wc, cc, pos, req, idx, lens, sinks = _case(64, prefill=False)
    q, sinks = q[:, :heads].contiguous(), sinks[:heads].contiguous()
    case = (q, wc, cc, pos, req, idx, lens, sinks)
    ref64, lowp = _reference(torch.float64, *case), _reference(torch.bfloat16, *case)
    q_pad = torch.zeros(q.shape[0], 64, 512, dtype=q.dtype, device="cuda")
    q_pad[:, :heads] = q
    sinks_pad = torch.zeros(64, dtype=sinks.dtype, device="cuda")
    sinks_pad[:heads] = sinks
    run = flashmla.Decode(wc, cc, pos, req, sinks_pad, 512**-0.5, WINDOW, RING)
    theirs = run(q_pad, idx, lens)[:, :heads]
    testing.assert_close_to_ref(_ours(*case), ref64, lowp, what=f"dsv4::sparse_attn, {heads} heads")
    testing.assert_close_to_ref(theirs, ref64, lowp, what=f"FlashMLA padded to 64 heads, sliced to {heads}")
