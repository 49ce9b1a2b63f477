"""Every public attention function under FakeTensorMode (CPU and CUDA fake inputs, on the CPU
build), on the meta device and under torch.compile(fullgraph=True): outputs match a real CPU run;
value checks are skipped (fakes have no data, a compiled graph takes no host sync); bad shapes
still raise the checks' message. Issue 3."""

from functools import partial

import builders
import pytest
import torch
from builders import FP8
from torch._subclasses.fake_tensor import FakeTensorMode


BF16, FP32 = torch.bfloat16, torch.float32


# The op whose public function runs, and the factory of its arguments (bf16 and FP8 pools where
# they apply, strided views of q / o where allowed).
CALLS = {
    "pack_kv": partial(builders.pack_kv_args, BF16, FP8),
    "unpack_kv": partial(builders.unpack_kv_args, BF16, FP8),
    "qkv_prep": partial(builders.qkv_prep_args, BF16, FP8, noncontig=True),
    "compressor_update": partial(builders.compressor_update_args, BF16, FP8),
    "indexer_q_prep": partial(builders.indexer_q_prep_args, BF16, "mxfp4_68", noncontig=True),
    "indexer_k_prep": partial(builders.indexer_k_prep_args, BF16, "mxfp4_68", block_size=7, blocks=2),
    "indexer_topk": partial(builders.indexer_topk_args, torch.uint8, "mxfp4_68", block_size=7, ratio=1, pool_blocks=2),
    "sparse_attn": partial(builders.sparse_attn_args, BF16, "fp8_528", comp_fmt="fp4_288", noncontig=True, blocks=True),
    "attn_merge": partial(builders.attn_merge_args, BF16, noncontig=True),
    "visible_entries": partial(builders.visible_entries_args, ratio=1),
    "inv_rope": partial(builders.inv_rope_args, BF16, noncontig=True),
    "fp8_linear": partial(builders.fp8_linear_args, BF16, noncontig=True),
    "fp8_linear_w8a8": partial(builders.fp8_linear_w8a8_args, BF16, noncontig=True),
    "invariant_linear": partial(builders.invariant_linear_args, BF16, out_dtype=torch.float32, noncontig=True),
}


def _outputs(result) -> list:
    if result is None:
        return []
    return list(result) if isinstance(result, tuple) else [result]


def _fake_args(args: dict, device: str) -> dict:
    """Same metadata as `args` (strides of views included), no data. Call inside the fake mode."""
    return {k: torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device=device) if isinstance(v, torch.Tensor)
            else v for k, v in args.items()}


@pytest.mark.parametrize("device", ["cpu", "cuda", "meta"])
@pytest.mark.parametrize("name", CALLS)
def test_public_function_matches_a_real_run(name, device):
    real = _outputs(builders.call_public(name, CALLS[name]()))
    args = CALLS[name]()
    if device == "meta":
        got = _outputs(builders.call_public(name, _fake_args(args, "meta")))
    else:
        with FakeTensorMode():
            got = _outputs(builders.call_public(name, _fake_args(args, device)))
    assert len(got) == len(real)
    for g, r in zip(got, real, strict=True):
        assert (g.shape, g.dtype, g.stride(), g.device.type) == (r.shape, r.dtype, r.stride(), device)


@pytest.mark.parametrize("name", CALLS)
def test_public_function_compiles_without_graph_breaks(name):
    torch._dynamo.reset()
    eager = CALLS[name]()
    traced = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in eager.items()}
    want = _outputs(builders.call_public(name, eager))
    got = _outputs(torch.compile(builders.public(name), fullgraph=True, backend="aot_eager")(traced))
    # Same reference kernels in both runs: outputs and every mutated argument agree bit for bit.
    assert all(builders.bytes_equal(g, w) for g, w in zip(got, want, strict=True))
    assert all(builders.bytes_equal(traced[k], v) for k, v in eager.items() if isinstance(v, torch.Tensor))


# name -> (argument to replace, its bad replacement, the checks' message). Replacements are new
# tensors: Python indexing of a fake CUDA tensor fails on the CPU-only build.
BAD_SHAPES = {
    "pack_kv": ("x", lambda a: a["x"].new_empty(3, 256), "cache: format fp8_584 stores 512-d rows, got 256-d"),
    "unpack_kv": ("slots", lambda a: a["slots"].new_empty(1, 3), r"slots: expected 1-D \[tokens\], got shape"),
    "qkv_prep": ("kv", lambda a: a["kv"].new_empty(5, 512), r"kv: expected shape \(6, 512\) \(as q\[:, 0\]\)"),
    "compressor_update": ("state", lambda a: a["state"].new_empty(2, 7, 2048),
                          r"state: expected at least 8 ring rows \(coff \* ratio"),
    "indexer_q_prep": ("weights", lambda a: a["weights"].new_empty(3, 1), r"weights: expected shape \(3, 2\)"),
    "indexer_k_prep": ("wk", lambda a: a["wk"].new_empty(128, 8), r"wk: expected size 16 \(d of latent\)"),
    "indexer_topk": ("block_table", lambda a: a["block_table"].new_empty(2), r"block_table: expected 2-D"),
    "sparse_attn": ("sinks", lambda a: a["sinks"].new_empty(1), r"sinks: expected size 2 \(heads of q\)"),
    "attn_merge": ("lse", lambda a: a["lse"].new_empty(2, 3, 1),
                   r"lse: expected shape \(2, 3, 2\) \(shards, tokens, heads of partials\), got \(2, 3, 1\)"),
    "visible_entries": ("req_slots", lambda a: a["req_slots"].new_empty(2),
                        r"req_slots: expected size 6 \(tokens of positions\)"),
    "inv_rope": ("positions", lambda a: a["positions"].new_empty(2), r"positions: expected size 3 \(tokens of o\)"),
    "fp8_linear": ("scale", lambda a: a["scale"].new_empty(3, 2),
                   r"scale: expected shape \(3, 4\) \(a \[70, 100\] weight in 32 x 32 tiles\)"),
    "fp8_linear_w8a8": ("scale", lambda a: a["scale"].new_empty(3, 2),
                        r"scale: expected shape \(2, 3\) \(a \[200, 384\] weight in 128 x 128 tiles\)"),
    "invariant_linear": ("weight", lambda a: a["weight"].new_empty(70, 39),
                         r"weight: expected size 40 \(in_features of x\) at dim 1, got 39"),
}


def test_every_public_function_is_covered():
    assert set(CALLS) == set(BAD_SHAPES) == builders.dsv4_ops() - builders.ROUTER_OPS  # the router is tested on its own


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("name", BAD_SHAPES)
def test_bad_shape_raises_under_fake_mode(name, device):
    key, bad, match = BAD_SHAPES[name]
    real = CALLS[name]()
    with FakeTensorMode():
        args = _fake_args(real, device)
        args[key] = bad(args)
        with pytest.raises(RuntimeError, match=match):
            builders.call_public(name, args)
