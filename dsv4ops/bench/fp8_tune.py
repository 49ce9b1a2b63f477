"""`--only fp8_tune`: the sweep behind fp8_linear's launch tables. For each block-FP8 projection of the
model (and, with `--tp`, each rank's share of q_b_proj / o_b_proj) and token counts 1 .. 256 it
times, graph-timed over weight copies larger than the L2 (bench/fp8_linear.weight_copies): W8A16,
act_quant + cuBLASLt, bf16 F.linear, and every candidate config of the W8A8 Triton kernel
(`candidates`: x quantized in the prologue up to 64 rows or by act_quant first; 16 / 64 / 128-row
blocks; 32- to 256-column tiles; 1-16 K splits; 4-16 warps; 3 or 4 stages). `tables` prints the rows
of fp8_linear/triton_w8a8.TUNED, w8a8.CUBLASLT_FROM and rule.W8A8_FROM that the timings give.
About 20 s a shape on an H100 (mostly Triton compiles)."""

import torch
import torch.nn.functional as F
import triton

from dsv4ops.bench.fp8_linear import BLOCK, L2_BYTES, over_shapes, projections, weight_copies
from dsv4ops.bench.router import graph_us
from dsv4ops.config import CSA, HCA, SLIDING, DSV4AttentionConfig
from dsv4ops.fp8_linear import rule, triton_w8a8, w8a8

TOKENS = (1, 16, 64, 128, 256)  # triton_w8a8.TUNED's buckets
QUICK_TOKENS = (1, 128)
SPLITS = (1, 2, 4, 8, 16)


def candidates(m: int, n: int, k: int):
    """The W8A8 kernel's configs tried at m rows (config dicts as triton_w8a8.config returns)."""
    tiles = k // BLOCK
    rows = min(128, max(16, triton.next_power_of_2(m)))
    for quant in (True, False) if m <= 64 else (False,):
        for bm in sorted({rows, 64} if m <= 64 or not quant else {rows}):
            for bn in (32, 64, 128, 256) if quant else (64, 128, 256):
                for split in SPLITS:
                    if split > tiles or split * max(m, bm) > k:
                        continue
                    k_split = -(-tiles // split) * BLOCK
                    for warps in (8, 16) if bn == 256 else (4, 8) if bm * bn >= 64 * 128 else (4,):
                        for stages in (3,) if quant else (3, 4):
                            yield dict(QUANT=quant, BM=bm, BN=bn, SPLITS=-(-k // k_split), K_SPLIT=k_split,
                                       WARPS=warps, STAGES=stages)


def shapes(cfg: DSV4AttentionConfig, tps=(1,)) -> dict:
    """name -> (out, in): the model's block-FP8 projections, and for each tp > 1 a rank's q_b_proj
    and o_b_proj (the projections tensor parallelism splits) not already listed."""
    from dsv4ops.warmup import _fp8_projections

    out = {name: shape for name, shape in projections(cfg).items()} if 1 in tps else {}
    full = set(projections(cfg).values())
    for tp in sorted(t for t in tps if t > 1):
        for n, k in sorted(_fp8_projections(cfg, {SLIDING, CSA, HCA}, tp)):
            if k and (n, k) not in full and (n, k) not in out.values():
                out[f"TP{tp} {n}x{k}"] = (n, k)
    return out


def tune_shape(name: str, n: int, k: int, m: int, device="cuda", l2_bytes: int = L2_BYTES) -> dict:
    fp8, fp32, bf16 = weight_copies(n, k, device, l2_bytes)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    out = torch.empty(m, n, device=device, dtype=torch.bfloat16)
    cap = rule.device_capability(x.device)
    row = dict(projection=name, n=n, k=k, tokens=m,
               exact_us=graph_us(lambda w, s: torch.ops.dsv4.fp8_linear(x, w, s.view(torch.uint8), out, BLOCK), fp8),
               bf16_us=graph_us(lambda w: F.linear(x, w), bf16), cublaslt_us=None)
    if rule.cublaslt_refuses(n, k, x.dtype, cap) is None:
        row["cublaslt_us"] = graph_us(lambda w, s: w8a8.cublaslt(x, w, s, out), fp32)
    best = None
    for cfg in candidates(m, n, k):
        us = graph_us(lambda w, s: triton_w8a8.fp8_linear_w8a8(x, w, s, out, cfg), fp32)
        if best is None or us < best[1]:
            best = (cfg, us)
    row["triton_us"], row["config"] = best[1], best[0]
    return row


def run(model: DSV4AttentionConfig, tps=(1,), tokens=TOKENS, progress=None, device="cuda") -> list[dict]:
    return over_shapes(shapes(model, tps), tokens, lambda name, n, k, m: tune_shape(name, n, k, m, device), progress)


def tables(rows: list[dict]) -> str:
    """The rows' entries of TUNED, CUBLASLT_FROM and W8A8_FROM as Python source (W8A8 timed on the
    route CUBLASLT_FROM's entry would give it; a shape whose Triton kernel won at every token count
    gets no CUBLASLT_FROM entry: the launcher's default)."""
    by: dict[tuple[int, int], dict] = {}
    names = {}
    for r in rows:
        by.setdefault((r["n"], r["k"]), {})[r["tokens"]] = r
        names[(r["n"], r["k"])] = r["projection"]
    tuned, cublaslt, w8a8_from = [], [], []
    inf = float("inf")
    for (n, k), ms in by.items():
        cfgs = ", ".join(f"{m}: ({c['QUANT']}, {c['BM']}, {c['BN']}, {c['SPLITS']}, {c['WARPS']}, {c['STAGES']})"
                         for m, c in ((m, ms[m]["config"]) for m in sorted(ms)))
        tuned.append(f"    ({n}, {k}): {{{cfgs}}},  # {names[(n, k)]}")
        start = rule.suggest_from({m: (r["triton_us"], r["cublaslt_us"] or inf) for m, r in ms.items()}, margin=1.0)
        if start is not None:
            cublaslt.append(f"    ({n}, {k}): {start},  # {names[(n, k)]}")
        first = w8a8.DEFAULT_CUBLASLT_FROM if start is None else start
        fp8 = {m: r["cublaslt_us"] if m >= first else r["triton_us"] for m, r in ms.items()}
        w8a8_from.append(f"    ({n}, {k}): {rule.suggest_from({m: (ms[m]['exact_us'], fp8[m]) for m in ms})!r},  "
                         f"# {names[(n, k)]}")
    return "\n".join(["TUNED = {", *tuned, "}", "CUBLASLT_FROM = {", *cublaslt, "}", "W8A8_FROM = {", *w8a8_from, "}"])


COLUMNS = ["projection", "n", "k", "tokens", "exact_us", "cublaslt_us", "triton_us", "bf16_us", "config"]
