"""dsv4::attn_merge and sparse_attn's partial output (lse): a query's keys split into shards, each
shard's sparse_attn(..., lse) output (normalized without the sink, with its natural-log sum), merged
with the sink once, equal one sparse_attn over all the keys; shards without keys return exact zeros
and lse -inf and are not read; bad inputs. Issue 31."""

from functools import partial

import builders
import pytest
import torch

from dsv4ops import testing as T
from dsv4ops.attn_merge import reference
from dsv4ops.attn_merge.api import attn_merge
from dsv4ops.attn_merge import reference as attn_merge_ref
from dsv4ops.attn_merge import triton as attn_merge_tt
from dsv4ops.sparse_attn import reference as sparse_attn_ref
from dsv4ops.quant.reference import pack_kv
from dsv4ops.sparse_attn.api import sparse_attn

BF16, FP32, I32 = torch.bfloat16, torch.float32, torch.int32
# On a GPU (-m gpu) the same checks run the CUDA dispatch: the Triton kernels of attn_merge and of
# sparse_attn's partial (the C++ kernel takes no lse).
ON_GPU = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
DEVICES = ["cpu", pytest.param("cuda", marks=ON_GPU)]


def _dense(q: torch.Tensor, keys: list[torch.Tensor], sinks: torch.Tensor, scale: float) -> torch.Tensor:
    """Independent of both kernels: per head, softmax over [every shard's logits, sink] with the
    sink's share dropped, times the keys (K = V). q [H, D], keys: [J_r, D] per shard."""
    k = torch.cat(keys)
    logits = (q @ k.T) * scale
    full = torch.cat([logits, sinks.to(q.dtype)[:, None]], 1)
    p = torch.softmax(full, 1)[:, :-1]
    return p @ k


@pytest.mark.parametrize("dtype", [FP32, BF16])
def test_merge_of_dense_partials_equals_attention_over_all_keys(dtype):
    """Shards of 5, 0 and 7 keys per query (an empty shard), partials written out here; the fp64
    merge is the reference kernel's."""
    g = torch.Generator().manual_seed(0)
    t, h, d, scale = 3, 4, 32, 32**-0.5
    q = torch.randn(t, h, d, generator=g)
    keys = [torch.randn(t, n, d, generator=g) for n in (5, 0, 7)]
    sinks = torch.randn(h, generator=g)

    def partials(dt):
        acc = torch.float64 if dt == torch.float64 else torch.float32
        parts, lses = [], []
        for k in keys:
            logits = torch.einsum("thd,tjd->thj", q.to(dt), k.to(dt)).to(acc) * scale
            lse = torch.logsumexp(logits, -1)
            p = torch.exp(logits - lse.nan_to_num(neginf=0)[..., None])
            parts.append(torch.einsum("thj,tjd->thd", p.to(dt), k.to(dt)))
            lses.append(lse if dt == torch.float64 else lse.float())
        return torch.stack(parts), torch.stack(lses)

    got = attn_merge(*partials(dtype), sinks)
    ref64 = torch.empty(t, h, d, dtype=torch.float64)
    reference.attn_merge(*partials(torch.float64), sinks, ref64)
    dense = torch.stack([_dense(q[i].double(), [k[i].double() for k in keys], sinks.double(), scale) for i in range(t)])
    torch.testing.assert_close(ref64, dense)  # the reference kernel is the formula (fp64 defaults)
    low = torch.stack([_dense(q[i].to(dtype).float(), [k[i].to(dtype).float() for k in keys], sinks, scale)
                       for i in range(t)]).to(dtype)
    T.assert_close_to_ref(got, dense, low, what=f"attn_merge {dtype}")


@pytest.mark.parametrize("device", DEVICES)
def test_empty_shards_are_not_read_and_no_key_gives_zero(device):
    """V4 heads and dims (64 x 512); every output element poisoned before the kernel writes it."""
    args = builders.attn_merge_args(FP32, shards=3, tokens=4, heads=64, dim=512)
    args["partials"][args["lse"] == float("-inf")] = float("nan")  # poison: never read
    args = {k: v.to(device) for k, v in args.items()}
    out = torch.full_like(args["out"], float("nan"))
    torch.ops.dsv4.attn_merge(args["partials"], args["lse"], args["sinks"], out)
    assert not out.isnan().any()
    assert (out[-1] == 0).all()  # no shard has a key for the last token
    ref64 = torch.empty(out.shape, dtype=torch.float64)
    reference.attn_merge(args["partials"].cpu().nan_to_num().double(), args["lse"].cpu(), args["sinks"].cpu(), ref64)
    low = torch.empty(out.shape)
    reference.attn_merge(args["partials"].cpu().nan_to_num(), args["lse"].cpu(), args["sinks"].cpu(), low)
    T.assert_close_to_ref(out.cpu(), ref64, low, what=f"attn_merge on {device}")


WINDOW, RING, BS = 4, 8, 4


def _pools(dtype, fmt, comp_fmt):
    """Window rows of request 0 at positions 0..11 and of request 1 at 0..1, 8 compressed entries."""
    dim = 16 if isinstance(fmt, torch.dtype) else 512
    wf, cf = builders.format_name(fmt, dim), builders.format_name(comp_fmt, dim)
    wc, cc = builders.page_pool(4, BS, dim, fmt), builders.page_pool(2, BS, dim, comp_fmt)
    for r, n in ((0, 12), (1, 2)):
        ps = torch.arange(max(0, n - RING), n)
        pack_kv(torch.randn(len(ps), dim), (r * RING + ps % RING).to(I32), wc, wf)
    pack_kv(torch.randn(8, dim), torch.arange(8, dtype=I32), cc, cf)
    return dim, wc, cc, wf, cf


SHARD_CASES = [pytest.param(FP32, FP32, FP32, "cpu", id="fp32")]
for _name, _fmt, _comp_fmt in (("bf16-fp8", builders.FP8, builders.FP8), ("v41", "fp8_528", "fp4_288")):
    SHARD_CASES += [pytest.param(BF16, _fmt, _comp_fmt, "cpu", id=_name),
                    pytest.param(BF16, _fmt, _comp_fmt, "cuda", id=f"{_name}-cuda", marks=ON_GPU)]


@pytest.mark.parametrize("dtype,fmt,comp_fmt,device", SHARD_CASES)
def test_sparse_attn_shards_merged_equal_one_call(dtype, fmt, comp_fmt, device):
    """A token's entries split between two calls (the first also takes the window, the second
    passes window end -1: no window), each with lse; attn_merge of the two equals one sparse_attn
    over everything: |merged - fp64| within 2x |one call - fp64| (the fp64 run: the reference
    kernel on the same pools). Token 1 has no entry in shard 1 and token 3 is padding: lse -inf,
    exact zero rows. 16 heads: V4-Flash's shard at TP4 (the CUDA kernels' tiles are sized for
    heads, the fp32 case's 16-dim rows run on the CPU only)."""
    torch.manual_seed(1)
    dim, wc, cc, wf, cf = _pools(dtype, fmt, comp_fmt)
    wc, cc = wc.to(device), cc.to(device)
    i32 = partial(torch.tensor, dtype=I32, device=device)
    pos, req = i32([9, 10, 1, 0]), i32([0, 0, 1, -1])
    idx = i32([[0, 3, 5, 7], [1, 2, -1, 6], [4, 6, 0, -1], [1, 2, 3, 4]])
    lens = i32([4, 2, 3, 4])
    q, sinks = torch.randn(4, 16, dim, dtype=dtype).to(device), torch.randn(16).to(device)
    scale = dim**-0.5
    call = partial(sparse_attn, window_cache=wc, comp_cache=cc, positions=pos, req_slots=req, sinks=sinks,
                   scale=scale, window=WINDOW, ring_size=RING, window_fmt=wf, comp_fmt=cf)
    whole = call(q, comp_idx=idx, comp_lens=lens)
    shard0 = i32([[0, 3], [1, 2], [4, -1], [1, 2]])
    shard1 = i32([[5, 7], [-1, 6], [6, 0], [3, 4]])
    o0, l0 = call(q, comp_idx=shard0, comp_lens=i32([2, 2, 2, 2]), return_lse=True)
    # Shard 1 through the op: no window (end -1; the public function checks ends), token 1 lists
    # nothing (its entry 6 lies past comp_lens). Outputs poisoned.
    o1, l1 = torch.full_like(q, float("nan")), torch.full((4, 16), float("nan"), device=device)
    torch.ops.dsv4.sparse_attn(q, wc, cc, pos, req, shard1, i32([2, 1, 2, 2]), i32([-1, -1, -1, -1]), sinks, o1, scale,
                               WINDOW, RING, wf, cf, l1)
    assert (o1[1] == 0).all() and (l1[1] == float("-inf")).all()  # no key: exact zeros, -inf
    assert (o0[3] == 0).all() and (o1[3] == 0).all() and (l0[3] == float("-inf")).all()  # padding
    assert torch.isfinite(l0[:3]).all() and torch.isfinite(l1[[0, 2]]).all()
    got = attn_merge(torch.stack([o0, o1]), torch.stack([l0, l1]), sinks)
    as64 = (lambda c: c.cpu() if c.dtype == torch.uint8 else c.cpu().double())
    ref64 = torch.empty(q.shape, dtype=torch.float64)
    sparse_attn_ref.sparse_attn(q.cpu().double(), as64(wc), as64(cc), pos.cpu(), req.cpu(), idx.cpu(), lens.cpu(), None,
                                sinks.cpu(), ref64, scale, WINDOW, RING, wf, cf)
    T.assert_close_to_ref(got.cpu(), ref64, whole.cpu(), what="merged shards vs one call")


# ---- bad inputs: one per rule ------------------------------------------------------------------
wa = builders.with_arg
BAD_MERGE = [
    ("partials-ndim", wa("partials", lambda a: a["partials"][0]), r"partials: expected 4-D \[shards, tokens, heads, "
                                                                  r"head_dim\]"),
    ("partials-dtype", wa("partials", lambda a: a["partials"].double()), r"partials: expected dtype in"),
    ("partials-last-dim", wa("partials", lambda a: a["partials"].transpose(2, 3).contiguous().transpose(2, 3)),
     r"partials: expected a contiguous last dim"),
    ("lse-shape", wa("lse", lambda a: a["lse"][:, :2]), r"lse: expected shape \(2, 3, 2\) \(shards, tokens, heads of "
                                                         r"partials\), got \(2, 2, 2\)"),
    ("lse-dtype", wa("lse", lambda a: a["lse"].double()), r"lse: expected dtype in \[torch.float32\]"),
    ("lse-strides", wa("lse", lambda a: a["lse"].transpose(1, 2).contiguous().transpose(1, 2)),
     r"lse: expected a contiguous tensor"),
    ("lse-device", wa("lse", lambda a: a["lse"].to("meta")), r"lse: expected device cpu \(as partials\), got meta"),
    ("sinks-size", wa("sinks", lambda a: a["sinks"][:1]), r"sinks: expected size 2 \(heads of partials\) at dim 0"),
    ("sinks-dtype", wa("sinks", lambda a: a["sinks"].bfloat16()), r"sinks: expected dtype in \[torch.float32\]"),
    ("out-shape", wa("out", lambda a: a["out"][:2]), r"out: expected shape \(3, 2, 16\) \(tokens, heads, head_dim of "
                                                     r"partials\), got \(2, 2, 16\)", ("op",)),
    ("out-dtype", wa("out", lambda a: a["out"].bfloat16()), r"out: expected dtype in \[torch.float32\]", ("op",)),
]


@pytest.mark.parametrize("case", BAD_MERGE, ids=[b[0] for b in BAD_MERGE])
def test_attn_merge_bad_input_is_rejected_and_writes_nothing(case):
    _, mutate, match, *via = case
    builders.assert_bad_case("attn_merge", builders.attn_merge_args(), mutate, match, via)


def _with_lse(make):
    def mutate(args):
        args["lse"] = make(args)

    return mutate


BAD_LSE = [
    ("lse-ndim", _with_lse(lambda a: torch.empty(6)), r"lse: expected 2-D \[tokens, heads\]"),
    ("lse-shape", _with_lse(lambda a: torch.empty(6, 3)), r"lse: expected shape \(6, 2\) \(tokens, heads of q\), got "
                                                           r"\(6, 3\)"),
    ("lse-dtype", _with_lse(lambda a: torch.empty(6, 2, dtype=BF16)), r"lse: expected dtype in \[torch.float32\]"),
    ("lse-strides", _with_lse(lambda a: torch.empty(2, 6).t()), r"lse: expected a contiguous tensor"),
]


@pytest.mark.parametrize("case", BAD_LSE, ids=[b[0] for b in BAD_LSE])
def test_sparse_attn_bad_lse_is_rejected_and_writes_nothing(case):
    _, mutate, match = case
    builders.assert_bad_case("sparse_attn", builders.sparse_attn_args(FP32), mutate, match, [("op",)])


# ---- the Triton kernel under the interpreter, against the reference (helpers: tests/interp.py) -------------
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_attn_merge(dtype):
    """3 shards over 5 heads x 512 (two head blocks, four column blocks), an empty shard (poisoned:
    not read) and a token without keys; strided partials."""
    args = builders.attn_merge_args(dtype, shards=3, tokens=4, heads=5, dim=512, noncontig=True)
    args["partials"][args["lse"] == float("-inf")] = float("nan")
    got = torch.full_like(args["out"], float("nan"))
    attn_merge_tt.attn_merge(args["partials"], args["lse"], args["sinks"], got)
    want = torch.empty(got.shape, dtype=torch.float64)
    attn_merge_ref.attn_merge(args["partials"].double(), args["lse"], args["sinks"], want)
    low = torch.empty_like(got)
    attn_merge_ref.attn_merge(args["partials"], args["lse"], args["sinks"], low)
    assert not got.isnan().any() and (got[-1] == 0).all()
    T.assert_close_to_ref(got, want, low, what=f"attn_merge {dtype}")
