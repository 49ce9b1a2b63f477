"""The arch table (dsv4ops/_arch.py) and the launcher each op resolves to on sm_90, sm_100 and other
GPUs."""

import pytest

import dsv4ops
from dsv4ops import _arch


@pytest.mark.parametrize("op", sorted(_arch.ARCH_TABLE))
def test_arch_table_never_picks_an_sm90a_only_backend_on_sm100(op):
    chosen = _arch.backends(op, (10, 0))
    assert chosen and all(_arch.ARCH_ONLY.get(b, 10) == 10 for b in chosen), chosen
    assert "cute_sm90" not in chosen


def test_attention_ops_run_triton_on_sm90_and_sm100():
    """Triton everywhere but the CUDA C++ launchers (Triton for what they do not serve): sparse_attn
    on sm_90 (its wgmma kernel), indexer_topk on sm_90 and sm_100 (its plain-CUDA select)."""
    from dsv4ops import backends
    from dsv4ops.indexer import cuda as indexer_cuda
    from dsv4ops.sparse_attn import cuda as sparse_attn_cuda

    csrc_on = {"sparse_attn": (9,), "indexer_topk": (9, 10)}
    assert set(csrc_on) == set(backends.CSRC_LAUNCHERS)
    for op in backends.TRITON_LAUNCHERS:
        for major in (9, 10):
            want = ("csrc", "triton") if major in csrc_on.get(op, ()) else ("triton",)
            assert _arch.backends(op, (major, 0)) == want
        if 10 not in csrc_on.get(op, ()):
            assert backends.resolve(op, (10, 0)) is backends.triton_launcher(op)
        assert backends.resolve(op, (8, 0)) is getattr(dsv4ops.ops, op)._init_fn  # no row: the reference
    assert backends.resolve("sparse_attn", (9, 0)) is sparse_attn_cuda.sparse_attn
    for major in (9, 10):
        assert backends.resolve("indexer_topk", (major, 0)) is indexer_cuda.indexer_topk
