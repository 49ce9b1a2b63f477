"""Cache memory per request for the V4 and V4.1 presets (markdown tables)."""

from dsv4ops.cache import v41
from dsv4ops.cache.config import CacheConfig, memory
from dsv4ops.config import DSV4AttentionConfig
from dsv4ops.config_v41 import DSV41AttentionConfig
from dsv4ops.quant.formats import CacheFormats

CONTEXTS = (64 * 1024, 128 * 1024, 1 << 20)
# V4's cache formats: (label, CacheFormats). fp4: 288-B FP4 entries and 68-B MXFP4 keys (pages of
# 128 rows, the MXFP4 page's smallest, CacheConfig's default for them; the 584-B window rows pad
# alike at 64 and 128).
V4_FORMATS = (("fp8", CacheFormats.v4()), ("fp4 (584 / 288 / 68 B)", CacheFormats("fp8_584", "fp4_288", "mxfp4_68")),
              ("bf16", CacheFormats.exact()))
V41_FORMATS = (("qat (528 / 288 / 68 B)", CacheFormats.v41()),
               ("fp8 keys (528 / 288 / 132 B)", CacheFormats.v41().replace(index="fp8_132")),
               ("bf16", CacheFormats.exact()))


def rows(step_tokens: int = 512) -> list[dict]:
    out = []
    for name in ("flash", "pro"):
        model = getattr(DSV4AttentionConfig, name)()
        for label, fmts in V4_FORMATS:
            for ctx in CONTEXTS:
                cfg = CacheConfig(max_requests=1, max_context=ctx, max_step_tokens=step_tokens, formats=fmts)
                out.append(_row(f"V4-{name.capitalize()}", label, ctx, memory(model, cfg)))
    flash41 = DSV41AttentionConfig.v41_flash()
    for label, fmts in V41_FORMATS:
        for ctx in CONTEXTS:
            cfg = CacheConfig(max_requests=1, max_context=ctx, max_step_tokens=step_tokens, block_size=128, formats=fmts)
            out.append(_row("V4.1-Flash", label, ctx, v41.memory(flash41, cfg)))
    return out


def _row(model: str, cache: str, ctx: int, m: dict) -> dict:
    return {"model": model, "cache": cache, "context": ctx, "bytes_per_token": m["bytes_per_token"],
            "fixed_MiB": m["fixed_bytes_per_request"] / 2**20,
            "GiB_per_request": (m["bytes_per_token"] * ctx + m["fixed_bytes_per_request"]) / 2**30}


def markdown(table: list[dict], step_tokens: int = 512) -> str:
    lines = [
        f"| model | cache | context | bytes / token | fixed per request (MiB, ring W-1+{step_tokens}, fp32 states) "
        "| per request (GiB) |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in table:
        ctx = f"{r['context'] // 1024}K" if r["context"] < 1 << 20 else "1M"
        lines.append(f"| {r['model']} | {r['cache']} | {ctx} | {r['bytes_per_token']:.0f} | {r['fixed_MiB']:.1f} "
                     f"| {r['GiB_per_request']:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(markdown(rows()))
