"""GPU tier 1: bitwise determinism run to run.

Two runs of the same serving schedule (fresh layer, manager and pools, same weights and inputs)
must give the same output bits and the same pool bytes, eager and under torch.compile: every
kernel's reductions have a fixed order (the split-KV combine of sparse_attn, the indexer's chunk
merge, the compressor's pooling), and no kernel uses atomics whose order could vary."""

import builders
import drivers
import pytest
import torch
from test_serving import SCHEDULES, _pool_bytes, _setup


from dsv4ops.config import CSA, HCA, SLIDING

pytestmark = pytest.mark.gpu


def _run(kind, compiled: bool):
    layer, manager, inputs = _setup(kind, "fp8", device="cuda", dtype=torch.bfloat16)
    fn = torch.compile(layer, fullgraph=True) if compiled else layer
    with torch.no_grad():
        outs = drivers.serve_schedule(fn, manager, inputs, SCHEDULES["chunked"]())
    torch.cuda.synchronize()
    return outs, _pool_bytes(layer)


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("kind", [SLIDING, CSA, HCA])
def test_bitwise_identical_run_to_run(kind, compiled):
    torch._dynamo.reset()
    (o1, p1), (o2, p2) = _run(kind, compiled), _run(kind, compiled)
    for rid in o1:
        assert builders.bytes_equal(o1[rid], o2[rid]), f"request {rid}: outputs differ between two runs"
    for name in p1:
        assert torch.equal(p1[name], p2[name]), f"pool {name} differs between two runs"

