"""`python -m dsv4ops bench`: attention (per op, core vs GEMMs, baselines), router, fp8_linear (the
block-FP8 projections vs bf16 F.linear) and cache memory tables, as markdown, with the GPU and versions; `--case` picks the attention shapes, `--json PATH`
writes the rows, `--plot PATH.png` draws each kernel's fraction of its ceiling (FlashMLA beside
sparse_attn), also from the rows of an earlier run (`--from-json`, no GPU needed)."""

import argparse
import importlib.metadata as md
import json
import math
import re

import torch

from dsv4ops.bench import memory
from dsv4ops.config import CSA, HCA, SLIDING, DSV4AttentionConfig

KINDS = {"swa": SLIDING, "sliding": SLIDING, "csa": CSA, "hca": HCA}
MODELS = {"flash": DSV4AttentionConfig.flash, "pro": DSV4AttentionConfig.pro}


def parse_case(text: str) -> tuple[str, int, int, int, int | None]:
    """`KIND:BATCHxCONTEXT[:NEW][@MAX_CONTEXT]` -> (layer kind, batch, context, new tokens per
    request, the cache's max_context or None: context + NEW); KIND is swa / sliding / csa / hca,
    numbers take a K (x1024) or M (x1048576) suffix, NEW defaults to 1 (decode; NEW = CONTEXT with
    batch 1 is a prefill from position 0). E.g. csa:128x4K, hca:1x64K, csa:1x4K:4K, csa:1x4K@1M (a
    4K context in a cache sized for 1M positions a request)."""
    m = re.fullmatch(r"(\w+):(\d+[KM]?)x(\d+[KM]?)(?::(\d+[KM]?))?(?:@(\d+[KM]?))?", text.strip(),
                     flags=re.IGNORECASE)
    if not m or m.group(1).lower() not in KINDS:
        raise argparse.ArgumentTypeError(f"expected KIND:BATCHxCONTEXT[:NEW][@MAX_CONTEXT] with KIND in "
                                         f"{sorted(KINDS)} (e.g. csa:128x4K, csa:1x4K:4K, csa:1x4K@1M), got {text!r}")
    batch, context, new = (_count(g) for g in (m.group(2), m.group(3), m.group(4) or "1"))
    if min(batch, context, new) < 1 or new > context:
        raise argparse.ArgumentTypeError(f"expected batch, context >= 1 and 1 <= new tokens <= context, got {text!r}")
    max_context = None if m.group(5) is None else _count(m.group(5))
    if max_context is not None and max_context < context + new:
        raise argparse.ArgumentTypeError(f"expected MAX_CONTEXT >= context + new tokens, got {text!r}")
    return KINDS[m.group(1).lower()], batch, context, new, max_context


def _count(text: str) -> int:
    scale = {"K": 1 << 10, "M": 1 << 20}.get(text[-1].upper(), 1)
    return int(text.rstrip("KMkm")) * scale


def versions() -> dict:
    out = {"torch": torch.__version__, "cuda": torch.version.cuda}
    for name in ("triton", "nvidia-cutlass-dsl", "transformers"):
        try:
            out[name] = md.version(name)
        except md.PackageNotFoundError:
            out[name] = None
    out["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    return out


def table(rows: list[dict], cols: list[str]) -> str:
    def fmt(v):
        if isinstance(v, float):
            return "" if math.isnan(v) else f"{v:.1f}" if abs(v) >= 10 else f"{v:.2f}"
        return "" if v is None else str(v)

    lines = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    lines += ["| " + " | ".join(fmt(r.get(c)) for c in cols) + " |" for r in rows]
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(prog="python -m dsv4ops bench", description=__doc__)
    ap.add_argument("--only", default="attention,flashmla,v41,router,fp8_linear,memory",
                    help="comma list of: attention, flashmla (sparse_attn beside FlashMLA), v41 (V4.1-Flash ops and "
                         "stack beside V4-Flash's), router, fp8_linear (the model's block-FP8 projections at decode "
                         "batch 1 and 128 beside bf16 F.linear), memory, parallel (TP2 / DCP2 against one GPU: "
                         "torchrun --nproc-per-node 2 -m dsv4ops bench --only parallel; not in the default set)")
    ap.add_argument("--quick", action="store_true", help="fewer shapes")
    ap.add_argument("--case", type=parse_case, action="append", metavar="KIND:BATCHxCONTEXT[:NEW][@MAX_CONTEXT]",
                    help="attention shape to run instead of the default set (repeatable), e.g. csa:128x4K, hca:32x1M, "
                         "csa:1x4K:4K (a 4K prefill), csa:128x4K@1M (a cache sized for 1M positions a request)")
    ap.add_argument("--model", choices=sorted(MODELS), default="flash", help="layer dims of the attention cases")
    ap.add_argument("--json", help="write every row here")
    ap.add_argument("--plot", metavar="PATH.png", help="roofline chart of the attention rows")
    ap.add_argument("--from-json", metavar="PATH", help="plot / print the rows of an earlier --json (runs nothing)")
    args = ap.parse_args(argv)
    if args.from_json:
        with open(args.from_json) as f:
            out = json.load(f)
        _plot(args, out)
        return out
    parts = set(args.only.split(","))
    out = {"versions": versions()}
    print("versions:", out["versions"])
    if "memory" in parts:
        out["memory"] = memory.rows()
        print(memory.markdown(out["memory"]))
    if "parallel" in parts:
        return _parallel(args, out)
    if parts & {"attention", "flashmla", "v41", "router", "fp8_linear"}:
        if not torch.cuda.is_available():
            raise SystemExit("bench: attention and router timings need a CUDA GPU (use --only memory on CPU)")
    if "attention" in parts:
        from dsv4ops.bench import attention

        out["attention"] = attention.run(quick=args.quick, progress=lambda r: print("row", json.dumps(r), flush=True),
                                         cases=args.case, model=MODELS[args.model]())
        print(table(out["attention"], ["layer", "batch", "context", "max_context", "tokens", "op", "us", "GB/s", "TFLOP/s",
                                       "ceiling", "pct_ceiling", "reference_us", "flashmla_us", "torch_topk_us"]))
    if "flashmla" in parts:
        from dsv4ops.bench import attention, flashmla

        if not flashmla.available():
            print("flashmla: not importable (see ../shared/bench-kit/README.md); side-by-side table skipped")
        else:
            out["flashmla"] = attention.side_by_side(progress=lambda r: print("row", json.dumps(r), flush=True))
            print(table(out["flashmla"], ["case", "us", "flashmla_us", "vs_flashmla", "GB/s", "TFLOP/s", "ceiling",
                                          "pct_ceiling", "rel_diff"]))
    if "v41" in parts:
        from dsv4ops.bench import v41

        out["v41"] = v41.run(quick=args.quick, progress=lambda r: print("row", json.dumps(r), flush=True))
        print(table(out["v41"], ["batch", "context", "tokens", "op", "us", "per_token_us", "GB/s", "pct_ceiling",
                                 "bytes_per_token", "v4_us", "v4_per_token_us", "v4_bytes_per_token"]))
    if "router" in parts:
        from dsv4ops.bench import router

        out["router"] = router.run(args)
        print(router.markdown(out["router"]))
    if "fp8_linear" in parts:
        from dsv4ops.bench import fp8_linear

        out["fp8_linear"] = fp8_linear.run(model=MODELS[args.model](),
                                           progress=lambda r: print("row", json.dumps(r), flush=True))
        print(table(out["fp8_linear"], fp8_linear.COLUMNS))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    _plot(args, out)
    return out


def _parallel(args, out: dict) -> dict:
    """`--only parallel` under torchrun: every process one GPU of the group (NCCL); rank 0 prints."""
    import os

    import torch.distributed as dist

    from dsv4ops.bench import parallel

    if "WORLD_SIZE" not in os.environ:
        raise SystemExit("bench --only parallel: run under torchrun (torchrun --nproc-per-node 2 -m dsv4ops bench "
                         "--only parallel)")
    if not torch.cuda.is_available():
        raise SystemExit("bench --only parallel: needs one CUDA GPU per process")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl", device_id=torch.device("cuda", torch.cuda.current_device()))
    first = dist.get_rank() == 0
    quick = dict(tp_cases=parallel.TP_CASES[-1:], dcp_cases=parallel.DCP_CASES[-1:],
                 indexer_cases=parallel.INDEXER_CASES[2:3]) if args.quick else {}
    out["parallel"] = parallel.run(model=MODELS[args.model](), progress=(lambda r: print("row", json.dumps(r),
                                                                                        flush=True)) if first else None,
                                   **quick)
    if first:
        print(table(out["parallel"], parallel.COLUMNS))
        if args.json:
            with open(args.json, "w") as f:
                json.dump(out, f, indent=1, default=str)
    dist.destroy_process_group()
    return out


def _plot(args, out: dict) -> None:
    if not args.plot:
        return
    from dsv4ops.bench import roofline

    # The side-by-side rows (--only flashmla) are cases of their own: bars() keys them by their name.
    rows = [*(out.get("attention") or []), *(out.get("flashmla") or [])]
    gpu = (out.get("versions") or {}).get("gpu") or "no GPU recorded"
    roofline.write_png(rows, args.plot, title=f"% of ceiling per kernel (copy, gather: bytes; bf16: flops) - {gpu}")
    print(f"roofline chart: {args.plot}")
