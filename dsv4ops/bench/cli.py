"""`python -m dsv4ops bench`: attention (per op, core vs GEMMs, baselines), router, fp8_linear (the
block-FP8 projections vs bf16 F.linear), the V4 stack's decode step with the FP8 cache and the FP4
cache option (fp4_cache) and cache memory tables, as markdown, with the GPU and versions; `--case`
picks the attention shapes, `--kv-cache fp4` runs the attention cases on the FP4 cache, `--json PATH`
writes the rows, `--plot PATH.png` draws each kernel's fraction of its ceiling (FlashMLA beside
sparse_attn), also from the rows of an earlier run (`--from-json`, no GPU needed)."""

import argparse
import importlib.metadata as md
import json
import math
import re

import torch

from dsv4ops.bench import layer_rows, layer_step, memory, sweep
from dsv4ops.config import CSA, HCA, SLIDING, DSV4AttentionConfig

KINDS = {"swa": SLIDING, "sliding": SLIDING, "csa": CSA, "hca": HCA}
# Every part --only names (its help describes each); a name outside it is refused before anything runs.
PARTS = ("attention", "flashmla", "v41", "router", "fp8_linear", "fp8_tune", "fp4_cache", "layer", "memory", "parallel")
MODELS = {"flash": DSV4AttentionConfig.flash, "pro": DSV4AttentionConfig.pro}
# The parts whose shapes --model picks among V4's (MODELS); --model v41 is the layer part's alone.
V4_MODEL_PARTS = ("attention", "fp4_cache", "fp8_linear", "fp8_tune", "parallel")


def parse_case(text: str) -> tuple[str, int, int, int, int | None]:
    """`KIND:BATCHxCONTEXT[:NEW][@MAX_CONTEXT]` -> (layer kind, batch, context, new tokens per
    request, the cache's max_context or None: context + NEW); KIND is swa / sliding / csa / hca,
    numbers take a K (x1024) or M (x1048576) suffix, NEW defaults to 1 (decode). CONTEXT counts the
    step's own tokens: each request holds CONTEXT - NEW cached tokens and its NEW tokens sit at
    positions CONTEXT - NEW .. CONTEXT - 1 (NEW = CONTEXT: a prefill from position 0; NEW < CONTEXT
    with NEW > 1: a chunk of prefill at that offset, as engines run chunked prefill). E.g.
    csa:128x4K, hca:1x64K, csa:1x4K:4K, csa:1x34K:2K (a 2K chunk after 32K cached tokens), csa:1x4K@1M
    (a 4K context in a cache sized for 1M positions a request)."""
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


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m dsv4ops bench", description=__doc__)
    ap.add_argument("--only", default="attention,flashmla,v41,router,fp8_linear,memory",
                    help="comma list of: attention, flashmla (sparse_attn beside FlashMLA), v41 (V4.1-Flash ops and "
                         "stack beside V4-Flash's), router, fp8_linear (the model's block-FP8 projections, W8A16 and W8A8, at "
                         "1 .. 4096 tokens beside bf16 F.linear, and the rule table they give), fp8_tune (the sweep of "
                         "the W8A8 Triton kernel's configs behind fp8_linear's launch tables, ~20 s a shape; not in the "
                         "default set), fp4_cache (the V4 "
                         "stack's decode step, FP8 cache and FP4 cache option, at 64K and 1M context or the --case "
                         "shapes), layer (the whole layer's decode step, eager and compiled in CUDA graphs, against "
                         "its floor and beside FlashMLA + bf16 GEMMs; --model picks flash, pro or v41 (V4.1-Flash, a "
                         "row per layer role), --quick batch 1 and 128; not in the default set), memory, parallel "
                         "(TP2 / DCP2 against one GPU: torchrun --nproc-per-node 2 -m dsv4ops bench "
                         "--only parallel; not in the default set)")
    ap.add_argument("--quick", action="store_true", help="fewer shapes")
    ap.add_argument("--case", type=parse_case, action="append", metavar="KIND:BATCHxCONTEXT[:NEW][@MAX_CONTEXT]",
                    help="attention shape to run instead of the default set (repeatable), e.g. csa:128x4K, hca:32x1M, "
                         "csa:1x4K:4K (a 4K prefill from position 0), csa:1x34K:2K (a 2K-token prefill chunk at "
                         "positions 32K .. 34K - 1, reading the 32K cached tokens: CONTEXT counts the step's tokens), "
                         "csa:128x4K@1M (a cache sized for 1M positions a request)")
    ap.add_argument("--model", choices=sorted([*MODELS, "v41"]), default="flash",
                    help="layer dims of the attention cases, the layer rows and the fp8_linear / fp8_tune "
                         "projections; v41 (V4.1-Flash) only with --only layer")
    ap.add_argument("--tp", type=lambda s: tuple(int(v) for v in s.split(",")), default=(1,), metavar="N[,N...]",
                    help="fp8_tune: the tensor-parallel sizes whose rank shapes it sweeps (1: the full projections), "
                         "e.g. 1,2,4,8,16")
    ap.add_argument("--kv-cache", choices=("fp8", "fp4"), default="fp8",
                    help="the attention cases' cache: fp8 (584-B entries, 132-B index keys) or fp4 (288-B FP4 "
                         "entries, 68-B MXFP4 index keys; the window ring stays 584-B FP8)")
    ap.add_argument("--json", help="write every row here")
    ap.add_argument("--plot", metavar="PATH.png", help="roofline chart of the attention rows")
    ap.add_argument("--from-json", metavar="PATH", help="plot / print the rows of an earlier --json (runs nothing)")
    sweep = ap.add_mutually_exclusive_group()
    sweep.add_argument("--sweep", action="store_true",
                       help="instead of --only: sparse_attn / FlashMLA over batch 1-256 x context 4K-1M for each layer "
                            "kind, model and head count (TP shards: FlashMLA padded to 64 heads), the whole layer's "
                            "decode step beside FlashMLA + bf16 GEMMs, and the summary (worst / median ratio) last")
    sweep.add_argument("--sweep-quick", action="store_true", help="--sweep on a subset of the grid")
    return ap


def main(argv=None):
    ap = build_parser()
    args = ap.parse_args(argv)
    unknown = [p for p in args.only.split(",") if p not in PARTS]
    if unknown:
        ap.error(f"--only: unknown part {unknown[0]!r}; expected a comma list of: {', '.join(PARTS)}")
    v4_only = [p for p in args.only.split(",") if p in V4_MODEL_PARTS]
    if args.model == "v41" and v4_only and not (args.sweep or args.sweep_quick or args.from_json):
        ap.error(f"--model v41: only the layer part has V4.1 rows (--only layer), got --only with {v4_only[0]!r}")
    if args.sweep or args.sweep_quick:
        return _sweep(args)
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
    if parts & {"attention", "flashmla", "v41", "router", "fp8_linear", "fp8_tune", "fp4_cache", "layer"}:
        if not torch.cuda.is_available():
            raise SystemExit("bench: attention and router timings need a CUDA GPU (use --only memory on CPU)")
    if "attention" in parts:
        from dsv4ops.bench import attention

        out["attention"] = attention.run(quick=args.quick, progress=lambda r: print("row", json.dumps(r), flush=True),
                                         cases=args.case, model=MODELS[args.model](),
                                         formats=attention.CACHES[args.kv_cache])
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

        cases = [(b, c, n) for _, b, c, n, _ in args.case] if args.case else None  # the kind is V4's: ignored
        out["v41"] = v41.run(quick=args.quick, progress=lambda r: print("row", json.dumps(r), flush=True), cases=cases)
        print(table(out["v41"], ["batch", "context", "tokens", "op", "us", "per_token_us", "GB/s", "pct_ceiling",
                                 "v4_kernel_us", "flashmla_us", "vs_flashmla", "rel_diff", "route_us", "v4_us",
                                 "vs_v4", "bytes_per_token", "v4_bytes_per_token"]))
    if "fp4_cache" in parts:
        from dsv4ops.bench import attention

        shapes = [(b, c) for _, b, c, _, _ in args.case] if args.case else None  # decode; the kind is ignored
        if shapes is None and args.quick:
            shapes = [(1, 65536), (1, 1 << 20)]
        out["fp4_cache"] = attention.stack_rows(shapes, progress=lambda r: print("row", json.dumps(r), flush=True),
                                                model=MODELS[args.model]())
        print(table(out["fp4_cache"], ["batch", "context", "cache", "op", "us", "per_token_us", "bytes_per_token",
                                       "vs_fp8"]))
    if "layer" in parts:
        out["layer"] = layer_rows.run(quick=args.quick, progress=lambda r: print("row", json.dumps(r), flush=True),
                                      models=(args.model,))
        print(table(out["layer"], layer_step.COLUMNS))
    if "router" in parts:
        from dsv4ops.bench import router

        out["router"] = router.run(args)
        print(router.markdown(out["router"]))
    if "fp8_linear" in parts:
        from dsv4ops.bench import fp8_linear

        out["fp8_linear"] = fp8_linear.run(model=MODELS[args.model](),
                                           tokens=fp8_linear.QUICK_TOKENS if args.quick else fp8_linear.TOKENS,
                                           progress=lambda r: print("row", json.dumps(r), flush=True))
        print(table(out["fp8_linear"], fp8_linear.COLUMNS))
        print("fp8_linear/rule.py, measured (W8A16 vs W8A8 per shape):")
        print(fp8_linear.suggested_table(out["fp8_linear"]))
    if "fp8_tune" in parts:
        from dsv4ops.bench import fp8_tune

        out["fp8_tune"] = fp8_tune.run(MODELS[args.model](), tps=args.tp,
                                       tokens=fp8_tune.QUICK_TOKENS if args.quick else fp8_tune.TOKENS,
                                       progress=lambda r: print("row", json.dumps(r), flush=True))
        print(table(out["fp8_tune"], fp8_tune.COLUMNS))
        print("fp8_linear launch tables, measured (triton_w8a8.TUNED, w8a8.CUBLASLT_FROM, rule.W8A8_FROM):")
        print(fp8_tune.tables(out["fp8_tune"]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    _plot(args, out)
    return out


def _sweep(args) -> dict:
    from dsv4ops.bench import flashmla, layer_rows, layer_step, sweep

    if not torch.cuda.is_available():
        raise SystemExit("bench --sweep: needs a CUDA GPU")
    out = {"versions": versions()}
    print("versions:", out["versions"])
    if not flashmla.available():
        print("flashmla: not importable (see ../shared/bench-kit/README.md): ours only, no ratios")
    quick = args.sweep_quick
    progress = lambda r: print("row", json.dumps(r), flush=True)  # noqa: E731
    out["sweep"] = sweep.run(quick=quick, progress=progress)
    out["layer_step"] = layer_rows.run(quick=quick, progress=progress)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    print(sweep_report(out))
    return out


def sweep_report(out: dict) -> str:
    """The sweep's tables: every point, the skipped points, the layer steps, then the summary."""
    s = out["sweep"]
    parts = [table(s["rows"], sweep.COLUMNS)]
    parts.append("skipped (estimate over the free GPU memory): "
                 + (", ".join(f"{label} ({gb:.1f} GB)" for label, gb in s["skipped"]) or "none"))
    parts.append(table(out["layer_step"], layer_step.COLUMNS))
    parts.append(f"sweep: {len(s['rows'])} rows in {s['seconds']:.0f} s on {out['versions']['gpu']}; summary "
                 f"(ours / FlashMLA, target <= {sweep.TARGET}; large_batch: batch >= {sweep.SHARD_BATCH}, where a "
                 f"rank's shard of the heads targets <= {sweep.SHARD_TARGET}):")
    parts.append(table(s["summary"], sweep.SUMMARY_COLUMNS))
    return "\n".join(parts)


def _parallel(args, out: dict) -> dict:
    """`--only parallel` under torchrun: every process one GPU of the group (NCCL); rank 0 prints."""
    import os

    import torch.distributed as dist

    from dsv4ops.bench import parallel
    from dsv4ops.parallel import destroy_process_group

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
    destroy_process_group()
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
