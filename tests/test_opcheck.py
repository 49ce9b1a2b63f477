"""torch.library.opcheck (schema, autograd registration, fake tensor, AOT dispatch with dynamic
shapes) on every attention op, from one table of sample inputs per op (V4 and V4.1 formats and
options). Issues 3, 16."""

from functools import partial

import builders
import pytest
import torch
from builders import FP8


BF16, FP32 = torch.bfloat16, torch.float32

def sparse_attn_lse_args(*args, **kw) -> dict:
    """sparse_attn's arguments with lse (a context-parallel shard's partial output)."""
    a = builders.sparse_attn_args(*args, **kw)
    a["lse"] = torch.empty(a["q"].shape[:2])
    return a


# Each factory builds fresh arguments (the ops mutate them). Cases cover fp32 and bf16 activations,
# float and FP8 (uint8) pools, size-1 dims (one token, one head) and a q / o view whose head stride
# has a gap (allowed: only the last dim must be contiguous).
SAMPLES = {
    "pack_kv": [
        partial(builders.pack_kv_args, FP32),
        partial(builders.pack_kv_args, FP32, BF16, slots=(1,)),
        partial(builders.pack_kv_args, BF16, FP8),
        partial(builders.pack_kv_args, FP32, FP8, main=False),
        partial(builders.pack_kv_args, BF16, "fp8_528"),
        partial(builders.pack_kv_args, FP32, "fp4_288", slots=(1, 2)),
        partial(builders.pack_kv_args, BF16, "mxfp4_68", block_size=7, slots=(13, -1)),
    ],
    "unpack_kv": [
        partial(builders.unpack_kv_args, FP32),
        partial(builders.unpack_kv_args, BF16, slots=(-1,)),
        partial(builders.unpack_kv_args, BF16, FP8),
        partial(builders.unpack_kv_args, FP32, FP8, main=False),
        partial(builders.unpack_kv_args, BF16, "fp8_528"),
        partial(builders.unpack_kv_args, FP32, "fp4_288"),
        partial(builders.unpack_kv_args, FP32, "mxfp4_68", block_size=7, slots=(13, -1)),
    ],
    "qkv_prep": [
        partial(builders.qkv_prep_args, FP32),
        partial(builders.qkv_prep_args, BF16, FP8),
        partial(builders.qkv_prep_args, BF16, heads=1, runs=((1, 3, 1),), pad=0),
        partial(builders.qkv_prep_args, FP32, noncontig=True),
        partial(builders.qkv_prep_args, BF16, "fp8_528", q_norm=False),
    ],
    "compressor_update": [
        partial(builders.compressor_update_args, FP32),
        partial(builders.compressor_update_args, BF16, FP8),
        partial(builders.compressor_update_args, FP32, FP8, main=False),
        partial(builders.compressor_update_args, BF16, ratio=128, overlap=False, runs=((1, 125, 4),), pad=0),
        partial(builders.compressor_update_args, FP32, runs=((0, 3, 1),), pad=0),
        partial(builders.compressor_update_args, FP32, "fp4_288", ratio=2, overlap=False, latent=True),
        partial(builders.compressor_update_args, BF16, ratio=1, overlap=False, latent=True),
        partial(builders.compressor_update_args, FP32, "mxfp4_68", block_size=7, hadamard=True),  # V4's MXFP4 keys
        partial(builders.compressor_update_args, BF16, "fp4_288", ratio=128, overlap=False, runs=((1, 125, 4),), pad=0),
        partial(builders.compressor_update_args, FP32, ratio=128, overlap=False, runs=((0, 125, 4), (1, 120, 8)), pad=0,
                batch_invariant=True),  # two HCA entries, the reference one at a time
    ],
    "indexer_q_prep": [
        partial(builders.indexer_q_prep_args, FP32),
        partial(builders.indexer_q_prep_args, BF16, "fp8_132"),
        partial(builders.indexer_q_prep_args, FP32, "mxfp4_68"),
        partial(builders.indexer_q_prep_args, BF16, "mxfp4_68", hadamard=True),
        partial(builders.indexer_q_prep_args, BF16, heads=1, tokens=1),
        partial(builders.indexer_q_prep_args, FP32, noncontig=True),
    ],
    "indexer_topk": [
        partial(builders.indexer_topk_args, FP32),
        partial(builders.indexer_topk_args, torch.float8_e4m3fn, FP8),
        partial(builders.indexer_topk_args, BF16, heads=1, runs=((0, 7, 1),), pad=0, k=1),
        partial(builders.indexer_topk_args, FP32, noncontig=True),
        partial(builders.indexer_topk_args, torch.uint8, "mxfp4_68", block_size=7),
        partial(builders.indexer_topk_args, FP32, ratio=1, pool_blocks=3),
        partial(builders.indexer_topk_args, BF16, ratio=1, cand_blocks=3),
    ],
    "indexer_k_prep": [
        partial(builders.indexer_k_prep_args, FP32),
        partial(builders.indexer_k_prep_args, BF16, "mxfp4_68", block_size=7, blocks=2),
        partial(builders.indexer_k_prep_args, FP32, FP8, ratio=1, noncontig=True),
    ],
    "sparse_attn": [
        partial(builders.sparse_attn_args, FP32),
        partial(builders.sparse_attn_args, BF16, FP8),
        partial(builders.sparse_attn_args, BF16, heads=1, runs=((1, 2, 1),), pad=0),
        partial(builders.sparse_attn_args, FP32, noncontig=True),
        partial(builders.sparse_attn_args, BF16, "fp8_528", comp_fmt="fp4_288"),
        partial(builders.sparse_attn_args, BF16, FP8, comp_fmt="fp4_288"),  # V4 with CacheFormats comp="fp4_288"
        partial(builders.sparse_attn_args, FP32, blocks=True),
        partial(sparse_attn_lse_args, BF16, FP8),
        partial(sparse_attn_lse_args, FP32, "fp8_528", comp_fmt="fp4_288", blocks=True),
    ],
    "attn_merge": [
        partial(builders.attn_merge_args, FP32),
        partial(builders.attn_merge_args, BF16, shards=1, tokens=1, heads=1),
        partial(builders.attn_merge_args, FP32, shards=3, noncontig=True),
    ],
    "visible_entries": [
        partial(builders.visible_entries_args),
        partial(builders.visible_entries_args, ratio=1, runs=((0, 9, 2),), pad=0),  # reaches the unallocated block
        partial(builders.visible_entries_args, ratio=128, block_size=64, runs=((1, 127, 1),), pad=2),
    ],
    "inv_rope": [
        partial(builders.inv_rope_args, FP32),
        partial(builders.inv_rope_args, BF16),
        partial(builders.inv_rope_args, BF16, heads=1, tokens=1),
        partial(builders.inv_rope_args, FP32, noncontig=True),
    ],
    "fp8_linear": [
        partial(builders.fp8_linear_args, FP32),
        partial(builders.fp8_linear_args, BF16, 128, n=200, k=300, scale_dtype=FP32),
        partial(builders.fp8_linear_args, BF16, tokens=1, noncontig=True),
        partial(builders.fp8_linear_args, BF16, 128, n=192, k=300, noncontig=True, groups=3),  # o_a's grouped form
        partial(builders.fp8_linear_args, FP32, tokens=4, batch_invariant=True),
    ],
    "invariant_linear": [
        partial(builders.invariant_linear_args, FP32),
        partial(builders.invariant_linear_args, BF16, out_dtype=FP32, noncontig=True),
    ],
    "fp8_linear_w8a8": [
        partial(builders.fp8_linear_w8a8_args, FP32),
        partial(builders.fp8_linear_w8a8_args, BF16, n=128, k=128, tokens=1, scale_dtype=FP32, noncontig=True),
    ],
}


def test_every_attention_op_has_samples():
    assert set(SAMPLES) == builders.dsv4_ops() - builders.ROUTER_OPS  # the router's opchecks live with the router


def _id(factory: partial) -> str:
    kw = ",".join(f"{k}={v}" for k, v in factory.keywords.items())
    args = ",".join(str(a).replace("torch.", "") for a in factory.args)
    return f"{factory.func.__name__[:-5]}[{args}{',' if kw else ''}{kw}]"


CASES = [pytest.param(name, f, id=_id(f)) for name, fs in SAMPLES.items() for f in fs]


ALL_CHECKS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.mark.parametrize("name,factory", CASES)
def test_opcheck(name, factory):
    args = factory()
    op = getattr(torch.ops.dsv4, name).default
    checks = ALL_CHECKS
    if any(isinstance(a, torch.Tensor) and a.dtype == torch.float8_e4m3fn for a in args.values()):
        # test_schema detects mutation with torch.allclose, which has no CPU float8 kernel in torch
        # 2.13 ("mul_cpu_reduced_float" not implemented for 'Float8_e4m3fn'). The op's mutation
        # annotations do not depend on dtypes; the op's other cases run test_schema.
        checks = ALL_CHECKS[1:]
    # The CPU kernel is the reference itself, so eager and traced runs agree bit for bit: no atol.
    res = torch.library.opcheck(op, tuple(args.values()), test_utils=checks, raise_exception=False)
    # (opcheck's test_schema also proves that every listed mutable argument, cand_out and latent_out
    # included, is declared: an undeclared write fails it.)
    assert set(res) == set(checks) and all(v == "SUCCESS" for v in res.values()), res
