"""fp8_linear benchmark: the two block-FP8 paths of a keep_fp8 projection, W8A16 (dsv4::fp8_linear,
Triton, e4m3 weight dequantized in registers) and W8A8 (dsv4::fp8_linear_w8a8 on the route its
launcher takes: the Triton FP8 kernel, or act_quant then cuBLASLt's blockwise GEMM, timed together), against F.linear (cuBLAS) on the same weight
dequantized to bf16, for the model's block-FP8 projections over token counts 1 .. 4096, in the same
run. `suggested_table` turns the rows into fp8_linear/rule.py's W8A8_FROM (printed by the CLI).

Timing: graph-timed like the router's (bench/router.py): one CUDA graph holds one call per copy of
the weights, with enough copies that they exceed 2 x the 50 MB L2 of an H100, so every weight read
comes from HBM as in a model where other layers run in between; median of replays / calls. GB/s
counts the weight bytes only (e4m3 + scales for ours, bf16 for F.linear): the bytes a decode step
cannot avoid reading."""

import torch
import torch.nn.functional as F

from dsv4ops.bench.router import graph_us
from dsv4ops.config import DSV4AttentionConfig
from dsv4ops.fp8_linear import reference, rule
from dsv4ops.fp8_linear.api import fp8_linear

BLOCK = 128
L2_BYTES = 50 << 20
TOKENS = (1, 16, 64, 128, 256, 512, 1024, 4096)
QUICK_TOKENS = (1, 128)


def projections(cfg: DSV4AttentionConfig) -> dict:
    """name -> (out, in) of the projections a keep_fp8 layer computes with fp8_linear."""
    return {"q_a": (cfg.q_lora_rank, cfg.hidden_size), "q_b": (cfg.num_heads * cfg.head_dim, cfg.q_lora_rank),
            "kv": (cfg.head_dim, cfg.hidden_size), "o_b": (cfg.hidden_size, cfg.o_groups * cfg.o_lora_rank),
            "index_q_b": (cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank)}


def _w8a8_us(x, fp8: list) -> tuple[float | None, str | None]:
    """W8A8's time, or (None, why) where its kernel refuses the shape (checked by one eager call)."""
    n, k = fp8[0][0].shape
    why = rule.w8a8_refuses(k, BLOCK, rule.device_capability(x.device))
    if why is None:
        try:
            fp8_linear(x, fp8[0][0], fp8[0][1], BLOCK, "fp8")
            if x.is_cuda:
                torch.cuda.synchronize(x.device)
        except RuntimeError as e:  # cuBLASLt's refusal (CUBLAS_STATUS_NOT_SUPPORTED), reported in the row
            why = str(e).splitlines()[0][:120]
    if why is not None:
        return None, why
    return graph_us(lambda w, s: fp8_linear(x, w, s, BLOCK, "fp8"), fp8), None


def weight_copies(n: int, k: int, device="cuda", l2_bytes: int = L2_BYTES) -> tuple[list, list, list]:
    """Copies of one random [n, k] block-FP8 weight, more bytes than 2 x the L2 in all (a graph of one
    call per copy reads every weight from HBM), in the three forms the paths take: (e4m3, UE8M0
    scales), (e4m3, fp32 scales: BlockFP8Linear's cached copy) and the bf16 dequantized weight."""
    tiles = (-(-n // BLOCK), -(-k // BLOCK))
    copies = max(2, -(-2 * l2_bytes // (n * k)))
    fp8 = [(torch.randn(n, k, device=device).to(torch.float8_e4m3fn),
            torch.randint(117, 127, tiles, dtype=torch.uint8, device=device).view(torch.float8_e8m0fnu))
           for _ in range(copies)]
    fp32 = [(w, s.float()) for w, s in fp8]
    bf16 = [(reference.dequantize(w, s.view(torch.uint8), BLOCK, torch.bfloat16),) for w, s in fp8]
    return fp8, fp32, bf16


def bench_case(name: str, n: int, k: int, m: int, gpu: str, device="cuda", l2_bytes: int = L2_BYTES) -> dict:
    tiles = (-(-n // BLOCK), -(-k // BLOCK))
    fp8, fp32, bf16 = weight_copies(n, k, device, l2_bytes)
    x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
    ours = graph_us(lambda w, s: fp8_linear(x, w, s, BLOCK), fp8)
    w8a8, refused = _w8a8_us(x, fp32)
    base = graph_us(lambda w: F.linear(x, w), bf16)
    fp8_bytes, bf16_bytes = n * k + tiles[0] * tiles[1], 2 * n * k
    best = ours if w8a8 is None else min(ours, w8a8)
    pick = rule.pick(m, n, k, BLOCK, rule.device_capability(x.device))
    return dict(projection=name, shape=f"{k} -> {n}", n=n, k=k, tokens=m, us=ours,
                **{"GB/s": fp8_bytes / ours / 1e3}, w8a8_us=w8a8, w8a8_refused=refused, bf16_us=base,
                bf16_GBps=bf16_bytes / base / 1e3, speedup=base / best, rule=pick,
                rule_us=w8a8 if pick == "fp8" else ours, gpu=gpu)


def run(model: DSV4AttentionConfig | None = None, tokens=TOKENS, progress=None) -> list[dict]:
    gpu = torch.cuda.get_device_name()
    return over_shapes(projections(model or DSV4AttentionConfig.flash()), tokens,
                       lambda name, n, k, m: bench_case(name, n, k, m, gpu), progress)


def over_shapes(shapes: dict, tokens, case, progress=None) -> list[dict]:
    """case(name, n, k, m) for each (name -> (n, k)) of `shapes` and m of `tokens`, in order."""
    rows = []
    for name, (n, k) in shapes.items():
        for m in tokens:
            rows.append(case(name, n, k, m))
            if progress:
                progress(rows[-1])
            torch.cuda.empty_cache()
    return rows


def suggested_table(rows: list[dict]) -> str:
    """rule.W8A8_FROM's entries from the rows (rule.suggest_from per shape), as Python source."""
    times: dict[tuple[int, int], dict] = {}
    names = {}
    for r in rows:
        key = (r["n"], r["k"])
        names[key] = r["projection"]
        times.setdefault(key, {})[r["tokens"]] = (r["us"], float("inf") if r["w8a8_us"] is None else r["w8a8_us"])
    lines = [f"    ({n}, {k}): {rule.suggest_from(t)!r},  # {names[(n, k)]}, swept M {sorted(t)}"
             for (n, k), t in times.items()]
    return "W8A8_FROM = {\n" + "\n".join(lines) + "\n}"


COLUMNS = ["projection", "shape", "tokens", "us", "GB/s", "w8a8_us", "bf16_us", "bf16_GBps", "speedup", "rule",
           "rule_us", "w8a8_refused"]
