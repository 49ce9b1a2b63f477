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
                          formats=attention.CACHES[cache])
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


def test_fp8_linear_rows_time_w8a8_where_it_runs_and_suggest_the_rule(monkeypatch):
    from dsv4ops.bench import fp8_linear
    from dsv4ops.fp8_linear import rule
    from dsv4ops.fp8_linear.api import fp8_linear as fp8_linear_fn

    monkeypatch.setattr(rule, "device_capability", lambda device: (9, 0))  # as on an H100; the ops run on CPU
    calls = []
    times = iter([4.0, 3.0, 5.0])  # W8A16, W8A8, bf16
    monkeypatch.setattr(fp8_linear, "graph_us", lambda fn, args: (calls.append((fn, args)), next(times))[1])
    row = fp8_linear.bench_case("kv", 256, 512, 3, "cpu", device="cpu", l2_bytes=256 * 512)
    (_, w16), (w8a8, w32), _ = calls
    x = torch.randn(3, 512).bfloat16()
    for (w, s), (w2, s32) in zip(w16, w32):
        assert w is w2 and torch.equal(s.float(), s32) and s32.dtype == torch.float32  # the same weights
    assert row["w8a8_us"] == 3.0 and row["w8a8_refused"] is None and row["speedup"] == 5.0 / 3.0
    w, s = w32[0]
    assert row["rule"] == rule.pick(3, 256, 512, 128, (9, 0))
    # the timed W8A8 callable is the W8A8 op on those weights (x is the bench's own: compare shapes only)
    assert w8a8(w, s).shape == fp8_linear_fn(x, w, s, 128, "fp8").shape == (3, 256)
    monkeypatch.setattr(rule, "device_capability", lambda device: (8, 0))
    times = iter([4.0, 5.0])
    row = fp8_linear.bench_case("kv", 256, 512, 3, "cpu", device="cpu", l2_bytes=256 * 512)
    assert row["w8a8_us"] is None and "sm_80" in row["w8a8_refused"] and row["rule"] == "exact"
    rows = [{"projection": "kv", "n": 512, "k": 4096, "tokens": m, "us": e, "w8a8_us": f}
            for m, e, f in ((1, 5.0, 9.0), (128, 8.0, 7.0), (4096, 90.0, 50.0))]
    rows += [{"projection": "o_b", "n": 4096, "k": 8192, "tokens": m, "us": e, "w8a8_us": f}
             for m, e, f in ((1, 5.0, 4.9), (128, 8.0, 7.0))]  # 1: a win within the margin
    rows += [{"projection": "q_a", "n": 1024, "k": 4096, "tokens": m, "us": 1.0, "w8a8_us": None} for m in (1, 128)]
    table = fp8_linear.suggested_table(rows)
    assert "    (512, 4096): 128,  # kv, swept M [1, 128, 4096]" in table
    assert "    (1024, 4096): None,  # q_a" in table
    assert eval(table.split("=", 1)[1]) == {(512, 4096): 128, (4096, 8192): 128, (1024, 4096): None}


def test_fp8_tune_candidates_hold_every_tuned_config():
    # the launch table could come from this sweep: each entry is one of the candidates at its bucket
    from dsv4ops.bench import fp8_tune
    from dsv4ops.fp8_linear import triton_w8a8

    for (n, k), buckets in triton_w8a8.TUNED.items():
        assert sorted(buckets) == list(fp8_tune.TOKENS)
        for m, entry in buckets.items():
            tried = {(c["QUANT"], c["BM"], c["BN"], c["SPLITS"], c["WARPS"], c["STAGES"])
                     for c in fp8_tune.candidates(m, n, k)}
            assert entry in tried, (n, k, m, entry)
    assert set(triton_w8a8.TUNED) == {s for cfg in (DSV4AttentionConfig.flash(), DSV4AttentionConfig.pro())
                                      for s in fp8_tune.shapes(cfg, (1, 2, 4, 8, 16)).values()}


def test_fp8_tune_times_every_candidate_and_keeps_the_fastest(monkeypatch):
    from dsv4ops.bench import fp8_tune

    seen = []
    monkeypatch.setattr(fp8_tune.triton_w8a8, "fp8_linear_w8a8", lambda x, w, s, out, cfg: seen.append(cfg))

    def timer(fn, args):
        before = len(seen)
        fn(*args[0])
        if len(seen) == before:
            return 5.0  # W8A16 or bf16
        c = seen[-1]  # a candidate: fastest at 16 warps x 256 columns, then the most splits
        return 10.0 - 0.1 * c["SPLITS"] - (c["BN"] == 256 and c["WARPS"] == 16)

    monkeypatch.setattr(fp8_tune, "graph_us", timer)
    row = fp8_tune.tune_shape("kv", 256, 512, 3, device="cpu", l2_bytes=256 * 512)
    assert seen == list(fp8_tune.candidates(3, 256, 512)) and len(seen) > 20
    assert (row["config"]["BN"], row["config"]["WARPS"], row["config"]["SPLITS"]) == (256, 16, 4)
    assert row["triton_us"] == 10.0 - 0.4 - 1 and row["exact_us"] == row["bf16_us"] == 5.0
    assert row["cublaslt_us"] is None  # CPU: cuBLASLt refuses


def test_fp8_tune_runs_each_shape_at_each_token_count(monkeypatch):
    from dsv4ops.bench import fp8_tune

    monkeypatch.setattr(fp8_tune, "tune_shape", lambda name, n, k, m, device: dict(projection=name, n=n, k=k, tokens=m))
    seen = []
    rows = fp8_tune.run(DSV4AttentionConfig.flash(), tps=(1, 8), tokens=(1, 128), progress=seen.append, device="cpu")
    assert seen == rows and [(r["projection"], r["tokens"]) for r in rows] == [
        (name, m) for name in ("q_a", "q_b", "kv", "o_b", "index_q_b", "TP8 4096x1024") for m in (1, 128)]
    assert rows[-1]["n"] == 4096 and rows[-1]["k"] == 1024  # TP8: a rank's 8 heads of q_b, o_b's 1024 columns


def test_fp8_tune_tables_follow_the_launchers_rules():
    from dsv4ops.bench import fp8_tune

    cfg = dict(QUANT=False, BM=64, BN=64, SPLITS=2, WARPS=4, STAGES=4)
    # (tokens, W8A16, cuBLASLt, Triton): cuBLASLt wins from 128; W8A8 beats W8A16 by 5% from 64
    times = ((1, 5.0, 9.0, 4.9), (64, 9.0, 9.5, 8.0), (128, 12.0, 8.0, 10.0))
    rows = [dict(projection="o_b", n=4096, k=8192, tokens=m, exact_us=e, cublaslt_us=c, triton_us=t, config=cfg)
            for m, e, c, t in times]
    rows += [dict(projection="kv", n=512, k=4096, tokens=m, exact_us=5.0, cublaslt_us=None, triton_us=6.0,
                  config=dict(cfg, QUANT=True)) for m in (1, 128)]
    text = fp8_tune.tables(rows)
    tables = {}
    exec(text, {}, tables)
    assert tables["TUNED"] == {(4096, 8192): {m: (False, 64, 64, 2, 4, 4) for m in (1, 64, 128)},
                               (512, 4096): {m: (True, 64, 64, 2, 4, 4) for m in (1, 128)}}
    assert tables["CUBLASLT_FROM"] == {(4096, 8192): 128}  # kv: the launcher's default
    assert tables["W8A8_FROM"] == {(4096, 8192): 64, (512, 4096): None}
    assert "# o_b" in text and "# kv" in text


# ---- the sweep (--sweep): grid, memory plan, one point, the summary ------------------------------------
def test_sweep_grid_covers_every_kind_model_batch_and_context():
    from dsv4ops.bench import sweep

    points = sweep.grid()
    assert len(points) == len(set(points)) == 2 * 3 * 6 * 5
    assert {(p.model, p.kind) for p in points} == {(m, k) for m in ("flash", "pro") for k in (SLIDING, CSA, HCA)}
    assert {p.batch for p in points} == {1, 8, 32, 64, 128, 256}
    assert {p.context for p in points} == {4096, 16384, 65536, 262144, 1 << 20}
    # one layer per (model, kind): its points run back to back
    keys = [(p.model, p.kind) for p in points]
    assert all(keys.index(k) + keys.count(k) - 1 == len(keys) - 1 - keys[::-1].index(k) for k in set(keys))
    quick = sweep.grid(quick=True)
    assert set(quick) < set(points) and {p.batch for p in quick} == {1, 32, 128}
    assert sweep.heads_of("flash") == (64, 32, 16, 8) and sweep.heads_of("pro") == (128, 16, 8)
    assert [sweep.flashmla_heads(h) for h in (8, 16, 32, 64, 128)] == [64, 64, 64, 64, 128]
    assert sweep.model_config("pro", SLIDING).num_heads == 128  # Pro's MTP layer: sliding, Pro's dims
    assert sweep.model_config("pro", SLIDING).layer_type(0) == SLIDING
    assert sweep.Point("pro", HCA, 32, 1 << 20).label == "pro HCA 32 x 1M"


def test_sweep_skips_the_points_whose_pools_exceed_the_budget():
    from dsv4ops.bench import sweep

    points = sweep.grid()
    run, skipped = sweep.plan(points, 80 * 10**9)
    assert not skipped and run == points  # the largest: CSA 256 x 1M, 67M entries x (585 + 132) B = 48 GB
    biggest = sweep.Point("flash", CSA, 256, 1 << 20)
    assert 48e9 < sweep.cache_bytes(biggest) < 49e9
    run, skipped = sweep.plan(points, 30 * 10**9)
    assert [p.label for p, _ in skipped] == ["flash CSA 256 x 1M", "pro CSA 256 x 1M"]  # 128 x 1M: 24 GB fits
    assert all(need > 30 * 10**9 for _, need in skipped) and len(run) + len(skipped) == len(points)
    # the estimate grows with batch and context
    for p in points:
        for q in points:
            if (p.model, p.kind) == (q.model, q.kind) and p.batch <= q.batch and p.context <= q.context:
                assert sweep.point_bytes(p, (8,)) <= sweep.point_bytes(q, (8,))


@pytest.mark.parametrize("kind", [SLIDING, CSA, HCA])
def test_sweep_cache_estimate_is_what_a_case_allocates(kind):
    from dsv4ops.bench import sweep

    model = DSV4AttentionConfig.tiny()
    case = attention.Case(kind, batch=3, context=300, new_tokens=1, device="cpu", model=model)
    cache = case.layer.cache
    # generations, ran_step and block_index_*: the manager's small tables (block_index_* one tensor
    # shared by every layer cache), not the layer's pools
    held = sum(b.numel() * b.element_size() for name, b in cache.named_buffers()
               if name not in ("generations", "ran_step", "topk_workspace") and not name.startswith("block_index_"))
    held += case.manager.topk_workspace("cpu").numel() * 4
    assert sweep.cache_bytes(sweep.Point("flash", kind, 3, 300), model) == held


@pytest.mark.parametrize("kind", [SLIDING, CSA, HCA])
def test_sweep_point_times_each_head_shard_of_the_step(kind, monkeypatch):
    # Each head count's callable is sparse_attn on the first heads of the step's q: attention is per
    # head, so its output is the full-head output's first heads (up to the reference's sum order).
    from dsv4ops.bench import flashmla, sweep

    monkeypatch.setattr(flashmla, "available", lambda: False)
    model = DSV4AttentionConfig.tiny()
    outs = {}

    def timer(fn, iters, reps):
        outs[len(outs)] = fn().clone()
        return float(len(outs))

    layer = attention.new_layer(kind, model, "cpu")
    with torch.no_grad():
        rows = sweep.run_point(sweep.Point("flash", kind, 2, 300), layer, (4, 2, 1), timer, "cpu", model)
    assert [r["heads"] for r in rows] == [4, 2, 1] and [r["us"] for r in rows] == [1.0, 2.0, 3.0]
    assert all(r["vs_flashmla"] is None and r["flashmla_heads"] == 64 for r in rows)
    for i, h in ((1, 2), (2, 1)):
        assert outs[i].shape[1] == h
        torch.testing.assert_close(outs[i], outs[0][:, :h])
    assert not hasattr(layer, "cache")  # released: the pools go with the case


def test_sweep_summary_reports_worst_and_median_per_group():
    from dsv4ops.bench import sweep

    rows = [dict(model="flash", layer="CSA", heads=64, batch=b, context=c, vs_flashmla=v, flashmla_heads=64)
            for b, c, v in ((1, 4096, 0.8), (32, 4096, 1.2), (128, 1 << 20, 0.85))]
    rows += [dict(model="flash", layer="CSA", heads=8, batch=1, context=4096, vs_flashmla=None, error="x")]
    # a rank's 16 heads against FlashMLA at 64: at batch >= 32, 0.7 misses the shard target, 0.5 meets it
    rows += [dict(model="flash", layer="CSA", heads=16, batch=b, context=4096, vs_flashmla=v, flashmla_heads=64)
             for b, v in ((1, 0.95), (32, 0.7), (256, 0.5))]
    full, shard = sweep.summarize(rows)
    assert (full["layer"], full["model"], full["heads"], full["points"]) == ("CSA", "flash", 64, 3)
    assert full["worst"] == 1.2 and full["worst_at"] == "32 x 4K" and full["median"] == 0.85 and full["over_target"] == 1
    assert full["large_batch_worst"] == 1.2 and full["large_batch_median"] == (1.2 + 0.85) / 2
    assert full["shard_over_target"] is None  # not a shard: FlashMLA runs its own heads
    assert (shard["heads"], shard["over_target"], shard["large_batch_worst"]) == (16, 1, 0.7)
    assert shard["shard_over_target"] == 1


def test_sweep_flags_parse_and_the_report_ends_with_the_summary():
    from dsv4ops.bench import cli

    ap = cli.build_parser()
    assert ap.parse_args(["--sweep"]).sweep and ap.parse_args(["--sweep-quick"]).sweep_quick
    with pytest.raises(SystemExit):
        ap.parse_args(["--sweep", "--sweep-quick"])
    row = dict(model="pro", layer="HCA", batch=1, context=4096, heads=16, us=30.0, flashmla_heads=64,
               flashmla_us=40.0, vs_flashmla=0.75)
    from dsv4ops.bench import sweep

    out = {"versions": {"gpu": "NVIDIA H100"}, "layer_step": [dict(model="flash", layer="CSA", batch=1, compiled_us=90.0)],
           "sweep": {"rows": [row], "skipped": [("flash CSA 256 x 1M", 48.5)], "seconds": 200.0,
                     "summary": sweep.summarize([row])}}
    text = cli.sweep_report(out)
    assert "flash CSA 256 x 1M (48.5 GB)" in text and "| flash | CSA | 1 |  |  |  | 90.0 |" in text  # the layer step
    last = text.strip().splitlines()
    assert last[-3].startswith("| layer | model | heads | points | worst")
    assert last[-1] == "| HCA | pro | 16 | 1 | 0.75 | 1 x 4K | 0.75 | 0 |  |  |  |"  # no point at batch >= 32


# ---- the whole layer's decode step beside FlashMLA + bf16 GEMMs ----------------------------------------
@pytest.mark.parametrize("kind", [SLIDING, CSA, HCA])
def test_layer_bench_baseline_is_the_layer_with_bf16_projections_and_another_core(kind):
    """The FlashMLA baseline runs the layer's own forward (`_attend`) on a bf16 twin: its projections
    nn.Linear modules holding the block-FP8 weights dequantized, no cache of its own; through the core
    seam, a core that runs dsv4::sparse_attn gives the twin's own step bit for bit (CPU kernels)."""
    from dsv4ops.bench import layer_step
    from dsv4ops.fp8_linear.api import BlockFP8Linear
    from dsv4ops.fp8_linear.reference import dequantize
    from dsv4ops.layers import _attend

    model = DSV4AttentionConfig.tiny()
    layer = attention.new_layer(kind, model, "cpu")
    with torch.no_grad():
        bf16 = layer_step.to_block_fp8(layer)
        twin = layer_step.bf16_twin(layer, bf16)
        assert not hasattr(twin, "cache") and not any(isinstance(m, BlockFP8Linear) for m in twin.modules())
        for name, w in bf16.items():
            fp8 = layer.get_submodule(name)
            assert torch.equal(twin.get_submodule(name).weight, dequantize(fp8.weight, fp8.weight_scale_inv, 128,
                                                                          torch.bfloat16)), name
        case = attention.Case(kind, batch=2, context=300, new_tokens=1, device="cpu", model=model, layer=layer)
        cache, st = layer.cache, case.step

        def ours(q_rot, comp_cache, comp_fmt, comp_idx, comp_lens):
            o = torch.empty_like(q_rot)
            torch.ops.dsv4.sparse_attn(q_rot, cache.window, comp_cache, st.positions, st.req_slots, comp_idx,
                                       comp_lens, st.window_ends, twin.sinks, o, model.head_dim**-0.5, model.window,
                                       cache.ring_size, cache.fmt["window"], comp_fmt)
            return o

        x = case.x
        snapshot = {k: v.clone() for k, v in cache.state_dict().items()}
        want = _attend(twin, x, st, cache)
        cache.load_state_dict(snapshot)
        got = _attend(twin, x, st, cache, core=ours)
        assert torch.equal(got, want)
        case.release()
    assert set(bf16) == {"q_a_proj", "q_b_proj", "kv_proj", "o_a_proj", "o_b_proj"} | (
        {"compressor.indexer.q_b_proj"} if kind == CSA else set())


@pytest.mark.parametrize("kind", [SLIDING, CSA, HCA])
def test_layer_floor_counts_each_weight_once_and_the_rows_the_step_reads(kind):
    from dsv4ops.bench import layer_step
    from dsv4ops.quant import formats

    model = DSV4AttentionConfig.tiny()
    layer = attention.new_layer(kind, model, "cpu")
    layer_step.to_block_fp8(layer)
    # every parameter and buffer once (the pack's members are views of x_packed: its bytes are theirs)
    want = sum(t.numel() * t.element_size() for n, t in [*layer.named_parameters(), *layer.named_buffers()]
               if t is not None and n != "x_packed")
    assert layer_step.weight_bytes(layer) == want
    oa = layer.o_a_proj  # held as the checkpoint holds it: one e4m3 byte a weight, one UE8M0 byte a tile
    assert oa.weight.dtype == torch.float8_e4m3fn and oa.weight_scale_inv.numel() == -(-oa.weight.shape[0] // 128) * -(
        -oa.weight.shape[1] // 128)
    case = attention.Case(kind, batch=2, context=300, new_tokens=1, device="cpu", model=model, layer=layer)
    fmt = layer.cache.fmt
    # two tokens at position 299: a full window each, and 299 // ratio + ... entries by the spec's count
    rows = 2 * model.window * formats.FORMATS[fmt["window"]].row_bytes
    if kind != SLIDING:
        ratio = model.compress_ratio(layer.layer_idx)
        n = 300 // ratio
        comp = formats.FORMATS[fmt["comp"]].row_bytes
        rows += 2 * (min(n, model.index_topk) * comp + n * formats.FORMATS[fmt["index"]].row_bytes
                     if kind == CSA else n * comp)
    assert layer_step.kv_bytes(case) == rows
    case.release()


def test_block_fp8_quantization_of_a_weight():
    from dsv4ops.bench.layer_step import quantize_block_fp8
    from dsv4ops.fp8_linear.reference import dequantize

    w = torch.randn(200, 300) * torch.logspace(-3, 2, 300)  # tiles of very different magnitudes
    w[5, 7] = -50 * w[:128, :128].abs().max()  # a tile whose amax is a negative weight
    codes, scale = quantize_block_fp8(w)
    assert codes.dtype == torch.float8_e4m3fn and scale.dtype == torch.float8_e8m0fnu and scale.shape == (2, 3)
    s = scale.float().repeat_interleave(128, 0)[:200].repeat_interleave(128, 1)[:, :300]
    assert (codes.float().abs() <= 448).all() and (codes.float().abs().amax() > 224)  # the scale uses the range
    # the scales: 2^ceil(log2(tile amax / 448)), by frexp on plain floats (tests/format_model.py)
    import format_model as M

    amax = [[max(abs(v) for row in w[i:i + 128].tolist() for v in row[j:j + 128]) for j in range(0, 300, 128)]
            for i in range(0, 200, 128)]
    assert scale.float().tolist() == [[2.0 ** M.pow2ceil_exp(a / 448) for a in r] for r in amax]
    err = (dequantize(codes, scale, 128, torch.float32) - w).abs()
    assert (err <= w.abs() * 2.0**-4 + s * 2.0**-10).all()  # e4m3: half a quantum (3 mantissa bits, subnormals)


def test_sweep_run_reuses_one_layer_per_kind_and_lists_skipped_points(monkeypatch):
    from dsv4ops.bench import flashmla, sweep

    tiny = DSV4AttentionConfig.tiny()
    points = [sweep.Point("flash", k, b, 300) for k in (SLIDING, HCA) for b in (1, 2)] + [
        sweep.Point("flash", CSA, 3, 5000)]
    monkeypatch.setattr(flashmla, "available", lambda: False)
    monkeypatch.setattr(sweep, "grid", lambda quick: points)
    monkeypatch.setattr(sweep, "model_config", lambda model, kind: tiny)
    monkeypatch.setattr(sweep, "heads_of", lambda model, quick=False: (4, 2))
    built = []
    real_new_layer = attention.new_layer
    monkeypatch.setattr(attention, "new_layer", lambda *a: (built.append(a[0]), real_new_layer(*a))[1])
    budget = max(sweep.point_bytes(p, (4, 2)) for p in points[:4])  # the CSA point's pools are larger
    seen = []
    out = sweep.run(progress=seen.append, device="cpu", budget=budget, timer=lambda fn, iters, reps: 1.0)
    assert built == [SLIDING, HCA]  # one layer per kind, none for the skipped point
    assert out["rows"] == seen and len(seen) == 4 * 2
    assert out["skipped"] == [("flash CSA 3 x 4K", sweep.point_bytes(points[4], (4, 2)) / 1e9)]
    assert out["summary"] == []  # no FlashMLA: no ratios


def test_cli_refuses_an_unknown_part_before_doing_anything(capsys):
    """Issue 52: `--only nonsense` printed the versions and exited 0; it exits 2 (argparse's usage
    error) naming the valid parts, before anything runs."""
    from dsv4ops.bench import cli

    with pytest.raises(SystemExit) as exit_:
        cli.main(["--only", "memory,nonsense"])
    assert exit_.value.code == 2
    captured = capsys.readouterr()
    assert "versions:" not in captured.out
    assert "--only: unknown part 'nonsense'; expected a comma list of: attention, flashmla" in captured.err
    assert "memory, parallel" in captured.err


def test_layer_stack_rows_weigh_each_kind_by_its_layer_count():
    from dsv4ops.bench import layer_step

    def row(model, kind, batch, context, us):
        return dict(model=model, layer=kind, batch=batch, context=context, eager_us=2 * us, compiled_us=us,
                    kernels=10, floor_us=us / 2, copy_TBps=2.5)

    # V4-Flash: 2 sliding, 21 CSA, 20 HCA layers; the 1M point lacks HCA, so it gets no stack row.
    rows = [row("flash", "sliding", 1, 4096, 100.0), row("flash", "CSA", 1, 4096, 200.0),
            row("flash", "HCA", 1, 4096, 150.0), row("flash", "CSA", 1, 1 << 20, 300.0),
            row("flash", "sliding", 1, 1 << 20, 100.0)]
    (stack,) = layer_step.stack_rows(rows, "flash")
    assert stack["layer"] == "stack of 43" and (stack["batch"], stack["context"]) == (1, 4096)
    assert stack["compiled_us"] == 2 * 100 + 21 * 200 + 20 * 150
    assert stack["eager_us"] == 2 * stack["compiled_us"] and stack["kernels"] == 430
    assert stack["vs_floor"] == 2.0 and "vs_flashmla_bf16" not in stack
    # V4-Pro's stack has no sliding layer (its sliding layer is the MTP layer): 30 CSA + 31 HCA.
    pro = [row("pro", "CSA", 1, 4096, 10.0), row("pro", "HCA", 1, 4096, 1.0)]
    assert layer_step.stack_rows(pro, "pro")[0]["compiled_us"] == 30 * 10 + 31 * 1


# ---- V4.1-Flash's layer rows per role; a prefill chunk at an offset ----------------------------------
def _v41_tiny():
    """V4.1's tiny preset (10 layers: 1 sliding, 2 ratio-2 sources with 2 reuse layers, the ratio-1
    source and candidate source, 3 ratio-1 reuse layers, 1 reindex inside the pool) and the 6-layer
    stack with one layer of each of its roles, as layer_step_v41.ROLES is to V4.1-Flash."""
    from dsv4ops.config_v41 import DSV41AttentionConfig

    full = DSV41AttentionConfig.tiny()
    return full, full.replace(num_layers=6, compress_ratios=(0, 2, 2, 1, 1, 1), kv_source_layers=(1, 3),
                              index_source_layers=(1, 3, 5), candidate_source_layer=3)


def _v41_step_bytes(cfg, role, batch: int, pos: int) -> int:
    """What a V4.1 layer's decode step must read, from the spec's shapes and dtypes (section 1.4):
    the checkpoint's block-FP8 projections one e4m3 byte a weight and one UE8M0 byte a 32 x 32 tile,
    the compressor's and indexer's bf16 weights, fp32 norms, sinks, RoPE table and the compressor's
    zero bias; then `batch` tokens at position `pos`: their window rows (528 B), the group's selected
    entries (288 B) and, at an index source, the index keys it scores (68 B)."""
    def fp8(n, k):
        return n * k + -(-n // 32) * -(-k // 32)

    h, q, d, heads, g, r = cfg.hidden_size, cfg.q_lora_rank, cfg.head_dim, cfg.num_heads, cfg.o_groups, cfg.o_lora_rank
    w = fp8(q, h) + fp8(heads * d, q) + fp8(d, h) + fp8(g * r, heads * d // g) + fp8(h, g * r)
    w += 4 * (q + d + heads + cfg.rope_head_dim // 2)
    if role.owns_compressor:
        w += 2 * h * d * (2 if role.ratio > 1 else 1) + 4 * d + 4 * role.ratio * d
    if role.indexer:
        w += fp8(cfg.index_n_heads * cfg.index_head_dim, q) + 2 * cfg.index_n_heads * h
    if role.owns_index_keys:
        w += 2 * cfg.index_head_dim * d + 4 * cfg.index_head_dim
    kv = min(pos + 1, cfg.window) * 528
    if not role.sliding:
        visible = (pos + 1) // role.ratio
        kv += min(visible, cfg.index_topk) * 288
        if role.indexer:
            kv += (min(visible, cfg.candidate_pool) if role.uses_candidates else visible) * 68
    return w + batch * kv


def test_v41_layer_rows_per_role_with_their_floor_and_the_stack_weighted_by_role(monkeypatch):
    """`bench --only layer --model v41` on V4.1's tiny preset (timers stubbed, the compile a no-op):
    a row per role and point, its floor the bytes the step must read (computed here from the
    shapes and dtypes), the stack row each role's row times its layers; the invariant column empty
    where the stack refuses CacheConfig(batch_invariant=True), timed where it accepts it."""
    from dsv4ops.bench import layer_step, layer_step_v41

    full, roles = _v41_tiny()
    monkeypatch.setattr(torch, "compile", lambda module, **kw: module)
    monkeypatch.setattr(layer_step, "kernel_count", lambda fn: (fn(), 7)[1])
    asked = []

    class Case(layer_step_v41.V41Case):  # the stack refuses the flag at batch 2, accepts it at batch 1
        def __init__(self, stack, batch, context, device, batch_invariant=False):
            asked.append((batch, batch_invariant))
            if batch_invariant and batch == 2:
                raise NotImplementedError("manager: CacheConfig(batch_invariant=True) is not supported")
            super().__init__(stack, batch, context, device)

    monkeypatch.setattr(layer_step_v41, "V41Case", Case)
    seen = []
    with torch.no_grad():
        rows = layer_step_v41.run(seen.append, "cpu", lambda fn: (fn(), 2.0)[1], (1e12, 1e14), [(2, 300), (1, 40)],
                                  roles, full)
    assert rows == seen and asked == [(2, False), (2, True), (1, False), (1, True)]
    counts = {"sliding": 1, "source (ratio 2)": 2, "reuse (ratio 2)": 2, "source+candidate (ratio 1)": 1,
              "reuse (ratio 1)": 3, "reindex+pool (ratio 1)": 1}
    assert layer_step_v41.role_counts(full) == counts
    layer_of = {"sliding": 0, "source (ratio 2)": 1, "reuse (ratio 2)": 2, "source+candidate (ratio 1)": 3,
                "reuse (ratio 1)": 4, "reindex+pool (ratio 1)": 5}
    for batch, context in ((2, 300), (1, 40)):
        point = {r["layer"]: r for r in rows if (r["batch"], r["context"]) == (batch, context)}
        stack = point.pop("stack of 10")
        assert set(point) == set(counts)
        for name, row in point.items():
            assert row["model"] == "v41" and row["heads"] == 16 and row["kernels"] == 7
            want = _v41_step_bytes(roles, roles.role(layer_of[name]), batch, context - 1)
            assert row["floor_us"] == pytest.approx(want / 1e12 * 1e6, rel=1e-12), name
            assert row["vs_floor"] == 2.0 / row["floor_us"] and "flashmla_bf16_us" not in row
            assert (row["invariant_us"], row["vs_default"]) == ((None, None) if batch == 2 else (2.0, 1.0))
        assert stack["floor_us"] == pytest.approx(sum(n * point[k]["floor_us"] for k, n in counts.items()))
        assert stack["compiled_us"] == 10 * 2.0 and stack["kernels"] == 10 * 7 and stack["heads"] == 16


def test_v41_role_stack_holds_every_role_of_v41_flash_at_its_shapes():
    """layer_step_v41.ROLES times each role on one layer: the same weights (shapes, dtypes) as the
    first layer of that role in V4.1-Flash, whose 40 layers the stack row counts by role (spec 1.3)."""
    from dsv4ops.bench import layer_step_v41 as v41
    from dsv4ops.layers_v41 import DeepseekV41Attention

    assert v41.role_counts(v41.FLASH) == {"sliding": 2, "source (ratio 2)": 3, "reuse (ratio 2)": 15,
                                          "source+candidate (ratio 1)": 1, "reuse (ratio 1)": 15,
                                          "reindex+pool (ratio 1)": 4}
    flash = v41.role_layers(v41.FLASH)
    assert flash == {"sliding": 0, "source (ratio 2)": 2, "reuse (ratio 2)": 3, "source+candidate (ratio 1)": 20,
                     "reuse (ratio 1)": 21, "reindex+pool (ratio 1)": 24}
    for name, i in v41.role_layers(v41.ROLES).items():
        with torch.device("meta"):
            ours, theirs = DeepseekV41Attention(v41.ROLES, i), DeepseekV41Attention(v41.FLASH, flash[name])
        shapes = [{n: (t.shape, t.dtype) for n, t in [*m.named_parameters(), *m.named_buffers()]}
                  for m in (ours, theirs)]
        assert shapes[0] == shapes[1], name
        role, flash_role = v41.ROLES.role(i), v41.FLASH.role(flash[name])
        assert (role.uses_candidates, role.candidate_source) == (flash_role.uses_candidates, flash_role.candidate_source)


def test_layer_bench_runs_v41_rows_and_the_cli_keeps_v41_to_them(monkeypatch, capsys):
    from dsv4ops.bench import cli, layer_rows, layer_step, layer_step_v41

    got = []
    monkeypatch.setattr(layer_step, "measured_rates", lambda timer: (2e12, 5e14))
    monkeypatch.setattr(layer_step_v41, "run", lambda *a: (got.append(a), [{"model": "v41"}])[1])
    timer = lambda fn: 1.0  # noqa: E731
    assert layer_rows.run(models=("v41",), timer=timer, points=[(3, 500)], device="cpu") == [{"model": "v41"}]
    assert got == [(print, "cpu", timer, (2e12, 5e14), [(3, 500)])]
    assert cli.build_parser().parse_args(["--only", "layer", "--model", "v41"]).model == "v41"
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--only", "memory,attention", "--model", "v41"])
    assert exit_.value.code == 2
    captured = capsys.readouterr()
    assert "versions:" not in captured.out and "--model v41: only the layer part" in captured.err


def test_case_of_a_prefill_chunk_reads_the_cached_context(monkeypatch):
    """`--case csa:1x640:128`: one request holding 512 cached tokens, a 128-token chunk of prefill at
    positions 512..639 (as engines run chunked prefill; CONTEXT counts the chunk), not a prefill
    from 0: the chunk's first token attends cached compressed entries and a window of cached rows,
    its bytes count them, and FlashMLA's prefill gets the ring slots of those cached positions."""
    from dsv4ops.bench import flashmla
    from dsv4ops.bench.cli import parse_case

    assert parse_case("csa:1x34K:2K") == (CSA, 1, 34 << 10, 2 << 10, None)
    assert parse_case("csa:1x640:128") == (CSA, 1, 640, 128, None)
    model = DSV4AttentionConfig.tiny()  # window 128, top-16 of the ratio-4 entries
    case = attention.Case(CSA, 1, 640, 128, device="cpu", model=model)
    st, cache = case.step, case.layer.cache
    assert torch.equal(st.positions, torch.arange(512, 640, dtype=torch.int32))
    assert case.manager.length[0] == 512  # the cached context the chunk follows
    calls = case.op_calls()
    with torch.no_grad():
        for call in calls.values():
            call()
        before = case.o.clone()
        # Every compressed entry the chunk's first token sees (513 // 4 = 128) closed before the chunk:
        # new values in the pool's cached rows change its output.
        attention._fill(cache.comp, 512, cache.fmt["comp"], torch.Generator().manual_seed(1))
        calls["sparse_attn"]()
    assert not torch.equal(case.o[0], before[0])
    pos = st.positions.long()
    assert (case.lens == ((pos + 1) // 4).clamp(max=16)).all() and case.lens[0] == 16
    # Bytes: every token of the chunk reads a full window (127 cached rows for the first) and 16
    # selected entries; the indexer scores (p + 1) // 4 keys for each.
    nbytes, _, ceiling = case.work("sparse_attn")
    assert nbytes == 128 * (128 * 584 + 16 * 584 + 4 * 512 * 2 * 2) and ceiling == "bf16"
    assert case.work("indexer_topk")[0] == int(((pos + 1) // 4).sum()) * 132 + 128 * 4 * 128
    slots = flashmla.window_slots(st.positions, st.req_slots, model.window, cache.ring_size)
    want = (pos[:, None] - torch.arange(127, -1, -1)) % cache.ring_size
    assert torch.equal(slots.long(), want) and slots[0, 0] == 385 % cache.ring_size
    case.release()
