"""The CPU reference kernels' memory and time follow a step's real context, not max_context.

One step of 300 prefill tokens and one decode token of a request, through a tiny V4 CSA layer and
HCA layer (FP8 pools) and through the tiny V4.1 stack (QAT pools: the ratio-2 sources' top-k, the
candidate source and the reindex layers scoring inside its pool), with `CacheConfig(max_context=1M)`
against the same steps at max_context 4096; and the HCA key list op alone on a table 1M entries
wide. The CSA block table of a 1M-position request is 4096 blocks wide (ratio 4, 64 entries a
block: 262,144 entries), the HCA key list 8192 columns, and the steps' work is the same at both
sizes: 75 visible CSA entries, 2 HCA entries, 150 V4.1 ratio-2 entries, 300 ratio-1 entries.
`max_total_tokens` keeps the pools small (the configured capacity is not what is measured).

Each size runs in a subprocess (torch's CPU allocations do not show in tracemalloc; RSS is what a
machine runs out of): after a warm-up (the first step loads kernels' code and fills the
allocator), the peak RSS of the measured steps above the RSS before them (VmHWM reset through
/proc/self/clear_refs; where that is not writable, ru_maxrss, which also counts the warm-up). The
address space is capped 4 GiB above the warm state, so a step that builds max_context-sized tensors
fails with an allocation error instead of swapping the machine. Before the fix the same 300-token
step took 1.0 GB at max_context 4096 and 3.7 GB at 16384 for the CSA layer and 4.1 GB at 4096 for
the V4.1 stack (indexer_topk unpacked every column of the block table per token), sparse_attn
gathered 64 queries x every column of the HCA key list (2.4 GB a chunk at 1M), and visible_entries
built int64 copies of its [tokens, table width] output (1.6 GB above the output here).

Budget, from the real work of the step (a 512-token bucket): activations of [512, heads, 512] fp32
are 4 MiB (V4, 4 heads) / 16 MiB (V4.1, 16 heads) each, a few alive at a time; the reference kernels
gather at most 2^22 fp32 key elements a chunk (16 MiB), and reading a chunk of 576-B FP8 rows takes
int64 byte offsets (8 B per byte of a row: 2.25x the fp32 row) and the decoded copies, about 6 x
16 MiB. That is ~150 MiB (measured 140-175 MiB at both sizes); the budget is 256 MiB. The 1M step
may exceed the 4096 one by allocator noise only (64 MiB): nothing in these steps is sized by the
table's width but the HCA key list the layer allocates (512 x 8192 int32 = 16 MiB). Time: the 1M
steps within 4x the 4096 ones plus 5 s (a loaded 2-core machine swings; unloaded they are equal
within noise).
"""

import json
import os
import subprocess
import sys

import pytest

_SCRIPT = r"""
import json, resource, sys, time
import torch
from dsv4ops import (DeepseekV4Attention, DeepseekV41AttentionStack, DSV4AttentionConfig, DSV41AttentionConfig,
                     testing)
from dsv4ops.cache import CacheConfig, KVCacheManager, V41CacheManager

max_context = int(sys.argv[1])
torch.manual_seed(0)


def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024


def reset_peak():
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_growth(warm_up, run):  # peak RSS of run() above the RSS before it (after warm_up()), its seconds
    with torch.no_grad():
        warm_up()
        base = status("VmRSS")
        resource.setrlimit(resource.RLIMIT_AS, (status("VmSize") + (4 << 30), resource.RLIM_INFINITY))
        exact_peak = reset_peak()
        start = time.perf_counter()
        run()
        elapsed = time.perf_counter() - start
        resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    peak = status("VmHWM") if exact_peak else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"growth": peak - base, "seconds": elapsed, "exact_peak": exact_peak}


def serve(module, manager, rows):  # a warm-up request's 8-token step; request r's 300 tokens, then 1
    def steps(request, counts):
        manager.admit(request)
        for n in counts:
            with manager.step({request: n}) as step:
                module(rows(step), step)
        manager.release(request)

    return peak_growth(lambda: steps("warm-up", (8,)), lambda: steps("r", (300, 1)))


# max_total_tokens sizes the pools for these steps; the block tables stay max_context wide.
capacity = dict(max_requests=2, max_context=max_context, max_step_tokens=512, max_total_tokens=4096)
cfg = DSV4AttentionConfig.tiny()
manager = KVCacheManager(cfg, CacheConfig(**capacity))
layers = [testing.randomize_(DeepseekV4Attention(cfg, i)) for i in (1, 2)]  # the cache's default formats: FP8
for layer in layers:
    layer.attach_cache(manager)
csa_hca = lambda x, step: layers[1](layers[0](x, step), step)
result = {"v4_layers": serve(csa_hca, manager, lambda step: torch.randn(step.positions.shape[0], cfg.hidden_size))}

cfg41 = DSV41AttentionConfig.tiny()
stack = testing.randomize_(DeepseekV41AttentionStack(cfg41))
manager41 = V41CacheManager(cfg41, CacheConfig(**capacity))  # V4.1's default formats, pages of 128 keys
stack.attach_cache(manager41)
result["v41_stack"] = serve(stack, manager41,
                           lambda step: torch.randn(cfg41.num_layers, step.positions.shape[0], cfg41.hidden_size))
# The HCA key list op alone, at its widest: ratio 1 over a table of max_context entries (out, the op's
# [tokens, entries] output, is allocated and written before the measure).
table = torch.arange(max_context // 64, dtype=torch.int32)[None]
pos = torch.arange(236, 300, dtype=torch.int32)
out = torch.full((pos.shape[0], max_context), 7, dtype=torch.int32)
call = lambda: torch.ops.dsv4.visible_entries(table, pos, torch.zeros_like(pos), out, 1, 64)
result["visible_entries"] = peak_growth(call, call)
print(json.dumps(result))
"""

MiB = 1 << 20
BUDGET = 256 * MiB
NOISE = 64 * MiB


def _run(max_context: int) -> dict:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", _SCRIPT, str(max_context)], capture_output=True, text=True,
                          cwd=root, timeout=600)
    assert proc.returncode == 0, f"max_context {max_context}: the step failed:\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/status")
def test_a_step_at_1m_max_context_costs_what_its_real_context_costs():
    small, large = _run(4096), _run(1 << 20)
    for model in ("v4_layers", "v41_stack", "visible_entries"):
        s, g = small[model], large[model]
        report = (f"{model}: peak RSS growth {g['growth'] / MiB:.0f} MiB at max_context 1M, "
                  f"{s['growth'] / MiB:.0f} MiB at 4096; {g['seconds']:.2f} s vs {s['seconds']:.2f} s")
        print(report)
        assert g["growth"] <= BUDGET, report
        assert g["growth"] <= s["growth"] + NOISE, report
        assert g["seconds"] <= 4 * s["seconds"] + 5.0, report
