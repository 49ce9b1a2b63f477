"""`python -m dsv4ops bench`: attention (per op, core vs GEMMs, baselines), router and cache memory
tables, as markdown, with the GPU and versions; `--json PATH` writes the rows too."""

import argparse
import importlib.metadata as md
import json
import math

import torch

from dsv4ops.bench import memory


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
    ap.add_argument("--only", default="attention,flashmla,v41,router,memory",
                    help="comma list of: attention, flashmla (sparse_attn beside FlashMLA), v41 (V4.1-Flash ops and "
                         "stack beside V4-Flash's), router, memory")
    ap.add_argument("--quick", action="store_true", help="fewer shapes")
    ap.add_argument("--json", help="write every row here")
    args = ap.parse_args(argv)
    parts = set(args.only.split(","))
    out = {"versions": versions()}
    print("versions:", out["versions"])
    if "memory" in parts:
        out["memory"] = memory.rows()
        print(memory.markdown(out["memory"]))
    if parts & {"attention", "flashmla", "v41", "router"}:
        if not torch.cuda.is_available():
            raise SystemExit("bench: attention and router timings need a CUDA GPU (use --only memory on CPU)")
    if "attention" in parts:
        from dsv4ops.bench import attention

        out["attention"] = attention.run(quick=args.quick, progress=lambda r: print("row", json.dumps(r), flush=True))
        print(table(out["attention"], ["layer", "batch", "context", "tokens", "op", "us", "GB/s", "TFLOP/s",
                                       "ceiling", "pct_ceiling", "reference_us", "flashmla_us"]))
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
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
