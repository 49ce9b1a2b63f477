"""Inside kernels an index out of range means "no entry" (architecture.md): a raw op given one
behaves exactly as with -1 (or a padding token), never writes part of its outputs and then raises.
For every attention op's reference kernel, the router's hash_route, and the Triton kernels of the
ops that write caches (run in the interpreter on CPU). The public functions reject the same values
with a ValueError (their bad-input tables). Issue 10."""

import os
from functools import partial

import builders
import pytest
import torch
from builders import FP8

from dsv4ops.quant.reference import capacity

BF16, FP32, I32 = torch.bfloat16, torch.float32, torch.int32


def _set(key, index, value):
    def mutate(args):
        args[key] = args[key].clone()
        args[key][index] = value

    return mutate


def _both(*mutations):
    def mutate(args):
        for m in mutations:
            m(args)

    return mutate


def _pool_slots(key, fmt="fmt"):
    return lambda args: capacity(args[key], args[fmt])


# (id, op, factory, (key, index, out-of-range value or fn(args)), the same with -1 / padding)
CASES = [
    ("pack_kv-slot", "pack_kv", partial(builders.pack_kv_args, FP32, FP8), ("slots", 0, _pool_slots("cache")),
     _set("slots", 0, -1)),
    ("pack_kv-float-slot", "pack_kv", partial(builders.pack_kv_args, FP32), ("slots", 2, _pool_slots("cache")),
     _set("slots", 2, -1)),
    ("pack_kv-indexer-slot", "pack_kv", partial(builders.pack_kv_args, FP32, FP8, main=False),
     ("slots", 0, _pool_slots("cache")), _set("slots", 0, -1)),
    ("pack_kv-fp4_288-slot", "pack_kv", partial(builders.pack_kv_args, FP32, "fp4_288"), ("slots", 2, _pool_slots("cache")),
     _set("slots", 2, -1)),
    ("pack_kv-mxfp4_68-slot", "pack_kv", partial(builders.pack_kv_args, FP32, "mxfp4_68", block_size=7),
     ("slots", 0, _pool_slots("cache")), _set("slots", 0, -1)),
    ("unpack_kv-slot", "unpack_kv", partial(builders.unpack_kv_args, FP32, FP8), ("slots", 2, lambda a: 10**6),
     _set("slots", 2, -1)),
    ("unpack_kv-fp8_528-slot", "unpack_kv", partial(builders.unpack_kv_args, FP32, "fp8_528"), ("slots", 2, lambda a: 10**6),
     _set("slots", 2, -1)),
    ("qkv_prep-request", "qkv_prep", partial(builders.qkv_prep_args, FP32, FP8), ("req_slots", 1, lambda a: 2),
     _set("req_slots", 1, -1)),
    ("qkv_prep-negative-position", "qkv_prep", partial(builders.qkv_prep_args, FP32, FP8), ("positions", 1, lambda a: -3),
     _both(_set("positions", 1, -3), _set("req_slots", 1, -1))),
    ("compressor-request", "compressor_update", partial(builders.compressor_update_args, FP32, FP8),
     ("req_slots", 2, lambda a: 2), _set("req_slots", 2, -1)),
    ("compressor-negative-position", "compressor_update", partial(builders.compressor_update_args, FP32, FP8),
     ("positions", 5, lambda a: -5), _both(_set("positions", 5, -5), _set("req_slots", 5, -1))),
    # Token 1 (request 0 at position 3) closes an entry: its slot past the pool stores nothing.
    ("compressor-entry-slot", "compressor_update", partial(builders.compressor_update_args, FP32, FP8),
     ("entry_slots", 1, _pool_slots("cache")), _set("entry_slots", 1, -1)),
    ("indexer_k_prep-entry-slot", "indexer_k_prep", partial(builders.indexer_k_prep_args, FP32, "mxfp4_68", block_size=7),
     ("entry_slots", 1, _pool_slots("cache")), _set("entry_slots", 1, -1)),
    ("indexer_topk-request", "indexer_topk", partial(builders.indexer_topk_args, FP32), ("req_slots", 0, lambda a: 2),
     _set("req_slots", 0, -1)),
    # A position past the table's width sees the entries the table has, as its last position does.
    ("indexer_topk-position-past-table", "indexer_topk", partial(builders.indexer_topk_args, FP32),
     ("positions", 0, lambda a: 10**6),
     lambda a: _set("positions", 0, a["block_table"].shape[1] * 4 * a["ratio"] - 1)(a)),
    ("indexer_topk-block", "indexer_topk", partial(builders.indexer_topk_args, FP32), ("block_table", (0, 0), lambda a: 4),
     _set("block_table", (0, 0), -1)),
    ("visible_entries-request", "visible_entries", partial(builders.visible_entries_args, ratio=1),
     ("req_slots", 1, lambda a: 2), _set("req_slots", 1, -1)),
    ("visible_entries-negative-position", "visible_entries", partial(builders.visible_entries_args, ratio=1),
     ("positions", 1, lambda a: -3), _both(_set("positions", 1, -3), _set("req_slots", 1, -1))),
    ("visible_entries-block", "visible_entries", partial(builders.visible_entries_args, ratio=1),
     ("block_table", (0, 0), lambda a: -5), _set("block_table", (0, 0), -1)),
    ("sparse_attn-request", "sparse_attn", partial(builders.sparse_attn_args, FP32), ("req_slots", 3, lambda a: 2),
     _set("req_slots", 3, -1)),
    ("sparse_attn-entry", "sparse_attn", partial(builders.sparse_attn_args, FP32), ("comp_idx", (0, 0), lambda a: 8),
     _set("comp_idx", (0, 0), -1)),
]


def _run(fn, args: dict) -> dict:
    fn(*args.values())
    return {k: v for k, v in args.items() if isinstance(v, torch.Tensor)}


def _assert_same_outputs(name, fn, bad: dict, none: dict):
    """Run fn on both argument sets; every tensor the two sets agreed on before (the outputs and
    caches among them) must agree after."""
    inputs = [k for k, v in bad.items() if isinstance(v, torch.Tensor) and not builders.bytes_equal(v, none[k])]
    got, want = _run(fn, bad), _run(fn, none)
    for k in want:
        if k not in inputs:
            assert builders.bytes_equal(got[k], want[k]), f"{name}: {k} differs from the run with -1"


def _cases(cases):
    return pytest.mark.parametrize("case", cases, ids=[c[0] for c in cases])


@_cases(CASES)
def test_out_of_range_index_is_no_entry(case):
    _, name, factory, (key, index, value), as_none = case
    torch.manual_seed(0)
    bad = factory()
    torch.manual_seed(0)
    none = factory()
    _set(key, index, value(bad))(bad)
    as_none(none)
    _assert_same_outputs(name, getattr(torch.ops.dsv4, name).default, bad, none)


# The Triton kernels that write caches (compiled by the interpreter on CPU; GPU: the same code).
TRITON = {"pack_kv": ("dsv4ops.quant.triton", "pack_kv"), "unpack_kv": ("dsv4ops.quant.triton", "unpack_kv"),
          "qkv_prep": ("dsv4ops.qkv_prep.triton", "qkv_prep"),
          "compressor_update": ("dsv4ops.compressor.triton", "compressor_update"),
          "indexer_k_prep": ("dsv4ops.indexer.triton_prep", "indexer_k_prep")}


def _triton_formats(case) -> bool:
    """The case's pools are in formats the Triton kernels implement (V4.1's join them with issue 13)."""
    from dsv4ops.quant.triton import FMT_CODES

    args = case[2]()
    return all(v in FMT_CODES for k, v in args.items() if k.endswith("fmt"))


@_cases([c for c in CASES if c[1] in TRITON and "float" not in c[0] and _triton_formats(c)])
def test_out_of_range_index_is_no_entry_in_triton(case):
    if not torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("needs the Triton interpreter (conftest sets it without a GPU)")
    import importlib

    _, name, factory, (key, index, value), as_none = case
    module, fn = TRITON[name]
    launcher = getattr(importlib.import_module(module), fn)
    torch.manual_seed(0)
    bad = factory()
    torch.manual_seed(0)
    none = factory()
    _set(key, index, value(bad))(bad)
    as_none(none)
    _assert_same_outputs(name, launcher, bad, none)


def test_hash_route_token_out_of_range_selects_nothing():
    """router/api.py: inside the kernel an out-of-range token id or table entry selects nothing
    (index -1, weight 0; the other slots renormalise among themselves): the csrc kernel's rule."""
    logits = torch.randn(4, 8)
    tid2eid = torch.randint(0, 8, (10, 3))
    tid2eid[2, 1] = 8  # an entry past the experts
    token_ids = torch.tensor([-1, 3, 10, 2])
    weights, indices = torch.empty(4, 3), torch.empty(4, 3, dtype=torch.long)
    torch.ops.dsv4.hash_route(logits, token_ids, tid2eid, weights, indices, 1.5)
    assert (indices[[0, 2]] == -1).all() and (weights[[0, 2]] == 0).all()
    assert indices[3].tolist() == [tid2eid[2, 0].item(), -1, tid2eid[2, 2].item()] and weights[3, 1] == 0
    scores = torch.nn.functional.softplus(logits.double()).sqrt()
    for t, ok in ((1, [0, 1, 2]), (3, [0, 2])):
        picked = scores[t, indices[t, ok]]
        torch.testing.assert_close(weights[t, ok].double(), picked / picked.sum() * 1.5, rtol=4e-7, atol=0)
