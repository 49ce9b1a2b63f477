"""The roofline chart of `python -m dsv4ops bench --plot out.png`: for every benchmarked case, one
bar per kernel at its fraction of its ceiling (copy or gather bandwidth, or the bf16 tensor-core
rate: bench/timing.py), and FlashMLA's kernel on the same case beside `sparse_attn` (black)."""

from __future__ import annotations

from dsv4ops.bench.png import GLYPH_H, GLYPH_W, Canvas
from dsv4ops.config import CSA, HCA, SLIDING

OPS = ("qkv_prep", "compressor_update", "compressor_update (indexer)", "indexer_q_prep", "indexer_topk",
       "visible_entries", "sparse_attn", "inv_rope")
COLORS = {
    "qkv_prep": (31, 119, 180), "compressor_update": (255, 127, 14), "compressor_update (indexer)": (188, 189, 34),
    "indexer_q_prep": (44, 160, 44), "indexer_topk": (214, 39, 40), "visible_entries": (140, 86, 75),
    "sparse_attn": (148, 103, 189), "inv_rope": (23, 190, 207), "FlashMLA": (0, 0, 0),
}
SHORT = {SLIDING: "SWA", CSA: "CSA", HCA: "HCA"}
BAR, GAP, LEFT, TOP, BOTTOM, PLOT_H = 8, 14, 60, 40, 70, 300
GRID = (220, 220, 220)
LEGEND_W = GLYPH_W * 32  # one legend column: a swatch and the longest op name


def _case_label(r: dict) -> str:
    if r.get("case"):  # a side-by-side row names its case (V4-Pro dims share Flash's batch x context)
        return r["case"]
    ctx = f"{r['context'] // 1024}K" if r["context"] % 1024 == 0 else str(r["context"])
    return f"{SHORT.get(r['layer'], r['layer'])} {r['batch']}x{ctx}" + (" P" if r["tokens"] > 1 else "")


def bars(rows: list[dict]) -> list[tuple[str, list[tuple[str, float]]]]:
    """[(case label, [(series, % of ceiling), ...])] from benchmark rows, in row order: the op rows
    with a ceiling, then FlashMLA's point where the sparse_attn row carries its time (same bytes and
    flops, so its fraction is ours x our time / its time)."""
    cases: dict[tuple, list] = {}
    labels: dict[tuple, str] = {}
    for r in rows:
        if r.get("pct_ceiling") is None or r.get("op") not in OPS:
            continue
        key = (r.get("case"), r["layer"], r["batch"], r["context"], r["tokens"])
        labels[key] = _case_label(r)
        series = cases.setdefault(key, [])
        series.append((r["op"], float(r["pct_ceiling"])))
        if r["op"] == "sparse_attn" and r.get("flashmla_us"):
            series.append(("FlashMLA", float(r["pct_ceiling"]) * r["us"] / r["flashmla_us"]))
    return [(labels[k], v) for k, v in cases.items()]


def chart(rows: list[dict], title: str = "") -> Canvas:
    """The chart as a Canvas: y from 0 to the next 25% at or above max(100%, the largest value)."""
    groups = bars(rows)
    if not groups:
        raise ValueError("rows: no kernel row with a % of ceiling (run the attention benchmark first)")
    top = max(100.0, max(v for _, s in groups for _, v in s))
    top = 25.0 * -(-top // 25)
    widths = [max(len(s) * BAR, GLYPH_W * len(label)) + GAP for label, s in groups]
    width = LEFT + sum(widths) + 20
    legend = [*OPS, "FlashMLA"]
    width = max(width, LEFT + 4 * LEGEND_W, LEFT + GLYPH_W * (len(title) + 2))
    height = TOP + PLOT_H + BOTTOM + GLYPH_H * 2 * ((len(legend) + 3) // 4) + GLYPH_H * 2
    c = Canvas(width, height)
    c.text(LEFT, 10, title or "% of ceiling per kernel")
    y0 = TOP + PLOT_H  # the 0% line
    for pct in range(0, int(top) + 1, 25):
        y = y0 - round(PLOT_H * pct / top)
        c.rect(LEFT, y, width - 10, y + 1, GRID if pct else (0, 0, 0))
        label = f"{pct}%"
        c.text(LEFT - 6 - GLYPH_W * len(label), y - GLYPH_H // 2, label)
    x = LEFT + GAP // 2
    for (label, series), w in zip(groups, widths):
        for i, (name, value) in enumerate(series):
            h = round(PLOT_H * min(value, top) / top)
            c.rect(x + i * BAR, y0 - h, x + (i + 1) * BAR - 1, y0, COLORS.get(name, (128, 128, 128)))
        c.text(x, y0 + 6, label)
        x += w
    c.text(LEFT, y0 + 6 + GLYPH_H * 2, "cases: layer batch x context (P: a prefill of the whole context); bars: "
                                         "kernels in this order")
    ly = y0 + 6 + GLYPH_H * 4
    for i, name in enumerate(legend):
        lx = LEFT + (i % 4) * LEGEND_W
        yy = ly + (i // 4) * GLYPH_H * 2
        c.rect(lx, yy, lx + 10, yy + 7, COLORS[name])
        c.text(lx + 14, yy, name)
    return c


def write_png(rows: list[dict], path: str, title: str = "") -> None:
    with open(path, "wb") as f:
        f.write(chart(rows, title).png())
