"""fp8_linear benchmark: dsv4::fp8_linear (e4m3 weight + 128 x 128 UE8M0 scales, dequantized in
registers) against F.linear (cuBLAS) on the same weight dequantized to bf16, for V4-Flash's
block-FP8 projections at decode batch 1 and 128, in the same run.

Timing: graph-timed like the router's (bench/router.py): one CUDA graph holds one call per copy of
the weights, with enough copies that they exceed 2 x the 50 MB L2 of an H100, so every weight read
comes from HBM as in a model where other layers run in between; median of replays / calls. GB/s
counts the weight bytes only (e4m3 + scales for ours, bf16 for F.linear): the bytes a decode step
cannot avoid reading."""

import torch
import torch.nn.functional as F

from dsv4ops.bench.router import graph_us
from dsv4ops.config import DSV4AttentionConfig
from dsv4ops.fp8_linear import reference
from dsv4ops.fp8_linear.api import fp8_linear

BLOCK = 128
L2_BYTES = 50 << 20


def projections(cfg: DSV4AttentionConfig) -> dict:
    """name -> (out, in) of the projections a keep_fp8 layer computes with fp8_linear."""
    return {"q_a": (cfg.q_lora_rank, cfg.hidden_size), "q_b": (cfg.num_heads * cfg.head_dim, cfg.q_lora_rank),
            "kv": (cfg.head_dim, cfg.hidden_size), "o_b": (cfg.hidden_size, cfg.o_groups * cfg.o_lora_rank),
            "index_q_b": (cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank)}


def bench_case(name: str, n: int, k: int, m: int, gpu: str, device="cuda", l2_bytes: int = L2_BYTES) -> dict:
    tiles = (-(-n // BLOCK), -(-k // BLOCK))
    copies = max(2, -(-2 * l2_bytes // (n * k)))
    fp8 = [(torch.randn(n, k, device=device).to(torch.float8_e4m3fn),
            torch.randint(117, 127, tiles, dtype=torch.uint8, device=device).view(torch.float8_e8m0fnu))
           for _ in range(copies)]
    bf16 = [(reference.dequantize(w, s.view(torch.uint8), BLOCK, torch.bfloat16),) for w, s in fp8]
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    ours = graph_us(lambda w, s: fp8_linear(x, w, s, BLOCK), fp8)
    base = graph_us(lambda w: F.linear(x, w), bf16)
    fp8_bytes, bf16_bytes = n * k + tiles[0] * tiles[1], 2 * n * k
    return dict(projection=name, shape=f"{k} -> {n}", tokens=m, us=ours, **{"GB/s": fp8_bytes / ours / 1e3},
                bf16_us=base, bf16_GBps=bf16_bytes / base / 1e3, speedup=base / ours, gpu=gpu)


def run(model: DSV4AttentionConfig | None = None, tokens=(1, 128), progress=None) -> list[dict]:
    cfg = model or DSV4AttentionConfig.flash()
    gpu = torch.cuda.get_device_name()
    rows = []
    for name, (n, k) in projections(cfg).items():
        for m in tokens:
            rows.append(bench_case(name, n, k, m, gpu))
            if progress:
                progress(rows[-1])
    return rows


COLUMNS = ["projection", "shape", "tokens", "us", "GB/s", "bf16_us", "bf16_GBps", "speedup"]
