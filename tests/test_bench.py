"""The benchmark harness measures the layer's own computation (CPU smoke run, timers stubbed)."""

import pytest
import torch

from dsv4ops import DSV4AttentionConfig
from dsv4ops.bench import attention
from dsv4ops.config import CSA, HCA, SLIDING
from dsv4ops.reference.functional import grouped_output


@pytest.mark.parametrize("kind, cache", [(SLIDING, "fp8"), (CSA, "fp8"), (HCA, "fp8"), (CSA, "fp4"), (HCA, "fp4")])
def test_attention_case_core_is_the_layer_step(kind, cache, monkeypatch):
    monkeypatch.setattr(attention, "graph_time_us", lambda fn, iters=30: (fn(), 1.0)[1])
    monkeypatch.setattr(attention, "eager_time_us", lambda fn, iters=10: (fn(), 2.0)[1])
    monkeypatch.setattr(attention, "ceilings", lambda: {"copy": 1e12, "gather": 1e12, "bf16": 1e14})
    model = DSV4AttentionConfig.tiny()
    case = attention.Case(kind, batch=2, context=300, new_tokens=1, device="cpu", model=model,
                          numerics=attention.CACHES[cache])
    with torch.no_grad():
        rows = attention.bench_case(case, with_reference=True)
        y_layer = case.layer(case.x, case.step)
        case.core()()
        layer = case.layer
        y_core = grouped_output(case.o_rot, layer.o_a_proj.weight, layer.o_b_proj.weight, model.o_groups)
    torch.testing.assert_close(y_core, y_layer, rtol=0, atol=0)
    ops = [r["op"] for r in rows]
    expect = {SLIDING: 3, CSA: 7, HCA: 5}[kind]
    assert len([r for r in rows if "reference_us" in r]) == expect
    assert ops[-3:] == ["attention core (all ops)", "projection GEMMs + norms (layer - core)", "whole layer"]
    assert all(r["pct_ceiling"] > 0 for r in rows if "pct_ceiling" in r)
    assert [r["torch_topk_us"] for r in rows if r["op"] == "indexer_topk"] == ([1.0] if kind == CSA else [])


def test_stack_rows_time_both_caches_and_count_their_bytes(monkeypatch):
    """The FP8 / FP4 stack comparison (timers stubbed: every op 1 us): each layer's ops, times the
    layers of its kind; the cache bytes a decode step reads per request from the pools' row sizes."""
    monkeypatch.setattr(attention, "graph_time_us", lambda fn, iters=30: (fn(), 1.0)[1])
    model = DSV4AttentionConfig.tiny(index_topk=8)  # sliding, CSA, HCA, CSA
    with torch.no_grad():
        rows = attention.stack_rows([(2, 300)], progress=lambda r: None, model=model, device="cpu")
    assert [r["cache"] for r in rows] == ["fp8", "fp4"]
    # ops a step: sliding 3, CSA 7 (two compressor updates), HCA 5
    assert [r["us"] for r in rows] == [3 + 2 * 7 + 5] * 2 and rows[1]["vs_fp8"] == 1.0
    # Per request, its token at position 299: every attention layer reads a window of 128 584-B rows and
    # its q and o (4 heads x 512 bf16 each); the CSA layers score 300 // 4 = 75 keys (and read q, 4 x 128
    # bytes) and attend 8 selected entries; the HCA layer its 300 // 128 = 2 entries.
    for row, (entry, key) in zip(rows, ((584, 132), (288, 68))):
        window = 128 * 584 + 4 * 512 * 2 * 2
        assert row["bytes_per_token"] == 4 * window + 2 * (75 * key + 4 * 128 + 8 * entry) + 2 * entry, row


# ---- the CLI: shapes, JSON, the roofline chart ----------------------------------------------------

def test_case_shapes_from_the_command_line():
    import argparse

    from dsv4ops.bench.cli import parse_case

    assert parse_case("csa:128x4K") == (CSA, 128, 4096, 1, None)
    assert parse_case("SWA:1x4096:4K") == (SLIDING, 1, 4096, 4096, None)
    assert parse_case("hca:32x1M") == (HCA, 32, 1 << 20, 1, None)
    assert parse_case("csa:128x4K@1M") == (CSA, 128, 4096, 1, 1 << 20)
    for bad in ("mla:1x4K", "csa:128", "csa:0x4K", "csa:1x4K:8K", "csa:1x4Q", "csa:1x4K@4K", "csa:1x4K@"):
        with pytest.raises(argparse.ArgumentTypeError, match=r"expected"):
            parse_case(bad)


def test_run_takes_the_given_cases(monkeypatch):
    import functools

    monkeypatch.setattr(attention, "graph_time_us", lambda fn, iters=30: (fn(), 4.0)[1])
    monkeypatch.setattr(attention, "ceilings", lambda: {"copy": 1e12, "gather": 1e12, "bf16": 1e14})
    monkeypatch.setattr(attention, "Case", functools.partial(attention.Case, device="cpu"))
    seen = []
    with torch.no_grad():
        rows = attention.run(cases=[(HCA, 2, 300, 1, 32768), (SLIDING, 1, 40, 40, None)],
                             model=DSV4AttentionConfig.tiny(), progress=seen.append)
    assert rows == seen
    shapes = {(r["layer"], r["batch"], r["context"], r["max_context"], r["tokens"]) for r in rows}
    assert shapes == {(HCA, 2, 300, 32768, 1), (SLIDING, 1, 40, 80, 40)}
    # The HCA key list is as wide as max_context allows: 2 tokens x 32768 / ratio int32 entries.
    hca_keys = next(r for r in rows if r["layer"] == HCA and r["op"] == "visible_entries")
    assert hca_keys["GB/s"] * 1e9 * 4e-6 == pytest.approx(2 * 32768 // DSV4AttentionConfig.tiny().hca_ratio * 4)
    assert not any("transformers" in r["op"] for r in rows)  # explicit cases: no baselines


def _rows():
    base = {"batch": 128, "context": 4096, "tokens": 1, "timing": "graph", "ceiling": "copy"}
    return [
        {**base, "layer": CSA, "op": "qkv_prep", "us": 5.0, "pct_ceiling": 100.0},
        {**base, "layer": CSA, "op": "sparse_attn", "us": 120.0, "pct_ceiling": 30.0, "flashmla_us": 40.0},
        {**base, "layer": CSA, "op": "attention core (all ops)", "us": 200.0},  # no ceiling: not drawn
        {**base, "layer": HCA, "context": 65536, "op": "inv_rope", "us": 4.0, "pct_ceiling": 150.0},
    ]


def _read_png(data: bytes):
    """Decode an 8-bit RGB, filter-0 PNG (what bench/png.py writes) with zlib and struct only."""
    import struct
    import zlib

    from dsv4ops.bench.png import Canvas

    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, idat, size = 8, b"", None
    while pos < len(data):
        (n,) = struct.unpack(">I", data[pos:pos + 4])
        kind, body = data[pos + 4:pos + 8], data[pos + 8:pos + 8 + n]
        assert struct.unpack(">I", data[pos + 8 + n:pos + 12 + n])[0] == zlib.crc32(kind + body), kind
        if kind == b"IHDR":
            size = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
    width, height, depth, color_type = size[:4]
    assert (depth, color_type) == (8, 2)
    raw = zlib.decompress(idat)
    canvas = Canvas(width, height)
    for y in range(height):
        line = raw[y * (3 * width + 1):(y + 1) * (3 * width + 1)]
        assert line[0] == 0
        canvas.pixels[3 * y * width:3 * (y + 1) * width] = line[1:]
    return canvas


def test_roofline_bars_and_flashmla_point():
    from dsv4ops.bench import roofline

    groups = roofline.bars(_rows())
    assert groups == [("CSA 128x4K", [("qkv_prep", 100.0), ("sparse_attn", 30.0), ("FlashMLA", 90.0)]),
                      ("HCA 128x64K", [("inv_rope", 150.0)])]
    c = _read_png(roofline.chart(_rows()).png())
    y0 = roofline.TOP + roofline.PLOT_H  # the 0% line; the axis tops at 150%
    x = roofline.LEFT + roofline.GAP // 2
    for i, (name, pct) in enumerate(groups[0][1]):
        col = x + i * roofline.BAR + roofline.BAR // 2
        height = round(roofline.PLOT_H * pct / 150)
        assert c.get(col, y0 - height + 1) == roofline.COLORS[name], name  # the bar reaches its value
        assert c.get(col, y0 - height - 2) != roofline.COLORS[name], name  # and stops there
    with pytest.raises(ValueError, match=r"rows: no kernel row with a % of ceiling"):
        roofline.chart([r for r in _rows() if "pct_ceiling" not in r])


def test_cli_plots_and_writes_json_without_a_gpu(tmp_path, capsys):
    import json

    from dsv4ops.bench import cli

    rows = tmp_path / "rows.json"
    rows.write_text(json.dumps({"versions": {"gpu": "NVIDIA H100"}, "attention": _rows()}))
    png = tmp_path / "roofline.png"
    cli.main(["--from-json", str(rows), "--plot", str(png)])
    assert _read_png(png.read_bytes()).width > 100
    out = tmp_path / "memory.json"
    cli.main(["--only", "memory", "--json", str(out)])
    assert json.loads(out.read_text())["memory"][0]["model"] == "V4-Flash"
    assert "roofline chart:" in capsys.readouterr().out


def test_cli_plots_side_by_side_rows(tmp_path):
    """`--only flashmla --plot`: its rows (no attention section) are drawn, one case per name, the
    V4-Pro case apart from Flash's of the same batch x context."""
    import json

    from dsv4ops.bench import cli, roofline

    base = {"layer": CSA, "batch": 128, "context": 4096, "tokens": 1, "op": "sparse_attn", "ceiling": "gather"}
    rows = [{**base, "case": "CSA 128 x 4K", "us": 98.0, "pct_ceiling": 33.0, "flashmla_us": 49.0},
            {**base, "case": "V4-Pro CSA 128 x 4K", "us": 300.0, "pct_ceiling": 20.0, "flashmla_us": 100.0}]
    assert roofline.bars(rows) == [("CSA 128 x 4K", [("sparse_attn", 33.0), ("FlashMLA", 66.0)]),
                                   ("V4-Pro CSA 128 x 4K", [("sparse_attn", 20.0), ("FlashMLA", 60.0)])]
    path = tmp_path / "flashmla.json"
    path.write_text(json.dumps({"versions": {"gpu": "NVIDIA H100"}, "flashmla": rows}))
    cli.main(["--from-json", str(path), "--plot", str(tmp_path / "roofline.png")])
    assert _read_png((tmp_path / "roofline.png").read_bytes()).width > 100


def test_fp8_linear_rows_time_both_sides_on_the_same_weights(monkeypatch):
    from dsv4ops.bench import fp8_linear

    calls = []
    monkeypatch.setattr(fp8_linear, "graph_us", lambda fn, args: (calls.append([fn(*a) for a in args]), 2.0)[1])
    row = fp8_linear.bench_case("kv", 256, 512, 3, "cpu", device="cpu", l2_bytes=256 * 512)
    ours, base = calls
    assert len(ours) == len(base) >= 2  # weight copies beyond the L2, the same ones on both sides
    for o, b in zip(ours, base):
        torch.testing.assert_close(o, b, rtol=0, atol=0)  # the op's CPU kernel is F.linear on them
    assert row["speedup"] == 1.0 and row["GB/s"] == (256 * 512 + 2 * 4) / 2.0 / 1e3
    assert {"us", "bf16_us", "bf16_GBps"} <= set(row) and set(fp8_linear.COLUMNS) <= set(row)
    assert set(fp8_linear.projections(DSV4AttentionConfig.flash()).values()) == {
        (1024, 4096), (32768, 1024), (512, 4096), (4096, 8192), (8192, 1024)}
