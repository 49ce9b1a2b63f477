"""Cache memory per request for the V4 presets (markdown table)."""

from dsv4ops.cache.config import CacheConfig, memory
from dsv4ops.config import DSV4AttentionConfig


def rows(step_tokens: int = 512) -> list[dict]:
    out = []
    for name in ("flash", "pro"):
        model = getattr(DSV4AttentionConfig, name)()
        for mode in ("fp8", "bf16"):
            for ctx in (128 * 1024, 1 << 20):
                cfg = CacheConfig(max_requests=1, max_context=ctx, max_step_tokens=step_tokens, kv_cache=mode,
                                  indexer_cache=mode)
                m = memory(model, cfg)
                out.append({
                    "model": f"V4-{name.capitalize()}", "cache": mode, "context": ctx,
                    "bytes_per_token": m["bytes_per_token"], "fixed_MiB": m["fixed_bytes_per_request"] / 2**20,
                    "GiB_per_request": (m["bytes_per_token"] * ctx + m["fixed_bytes_per_request"]) / 2**30,
                })
    return out


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
