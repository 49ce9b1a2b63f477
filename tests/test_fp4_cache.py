"""V4 layers with the low-bit cache option (issue 29, item 5): CacheFormats("fp8_584", "fp4_288",
"mxfp4_68") (288-B FP4 compressed entries beside the 584-B FP8 window ring, 68-B MXFP4 index keys,
query and keys rotated by V4's Hadamard), the oracle's Numerics(kv="fp4", indexer="mxfp4"). The cache
formats (one vocabulary for V4 and V4.1, issue 52) and memory, and the serving layer against the fp64
oracle of the same mode (one-shot, chunked, decode, compiled; with real selection). The Triton kernels
are checked in each op's test file (tests/interp.py)."""

import pytest
import torch
import drivers
from torch._dynamo.testing import AotEagerAndRecordGraphs, normalize_gm

from dsv4ops import CacheFormats, DeepseekV4Attention, DSV4AttentionConfig, reference, testing
from dsv4ops.cache.config import CacheConfig, layer_pools, memory, v4_numerics
from dsv4ops.cache.manager import KVCacheManager
from dsv4ops.config import CSA, HCA
from dsv4ops.reference import Numerics

FP4 = CacheFormats("fp8_584", "fp4_288", "mxfp4_68")  # mxfp4_68 pages: 128 keys (formats.py), CacheConfig's default
# index_topk >= the visible entries (260 // 4 = 65): every entry is selected, so the outputs compare
# without near-ties; SELECTING picks 8 of up to 65 (the selection itself checked against the oracle).
CFG = DSV4AttentionConfig.tiny(index_topk=128)
SELECTING = DSV4AttentionConfig.tiny(index_topk=8)
LAYER = {CSA: 1, HCA: 2}
LENGTHS = {"a": 260, "b": 131, "c": 9}


# ---- configuration --------------------------------------------------------------------------------
def test_cache_formats_give_the_v4_numerics_and_the_block_size():
    cfg = CacheConfig(max_requests=2, max_context=512, max_step_tokens=16, formats=FP4)
    assert cfg.block_size == 128 and v4_numerics(cfg.formats) == Numerics("fp4", "mxfp4")
    mixed = CacheConfig(max_requests=2, max_context=512, max_step_tokens=16, formats=FP4.replace(index="fp8_132"))
    assert mixed.block_size == 64 and v4_numerics(mixed.formats) == Numerics("fp4", "fp8")
    assert v4_numerics(CacheFormats.v4()) == Numerics("fp8", "fp8")
    assert v4_numerics(CacheFormats.exact()) == Numerics()
    # Unresolved until a manager or a pool function knows the model: V4's default, V4.1's default.
    bare = CacheConfig(max_requests=2, max_context=512, max_step_tokens=16)
    assert (bare.formats, bare.block_size) == (None, None)
    assert bare.for_model(CFG).formats == CacheFormats.v4() and bare.for_model(CFG).block_size == 64


@pytest.mark.parametrize("kwargs, error, match", [
    (dict(formats=CacheFormats.v4().replace(index="mxfp4_68"), block_size=64), ValueError,
     # 64 keys of 68 B = 4352 B, padded to 4608 (512-B alignment): 256 B of padding, more than a row.
     r"block_size: mxfp4_68 pages are padded to a multiple of 512 B; 64 rows \(4352 B\) leave 256 B of padding"),
    (dict(formats=Numerics("fp8", "fp8")), TypeError,
     r"formats: expected a dsv4ops.CacheFormats or None \(the model's default\), got Numerics"),
    (dict(kv_cache="fp8"), TypeError, r"CacheConfig: kv_cache= was replaced by formats=CacheFormats\(window=..., "
                                      r"comp=..., index=...\) \(dsv4ops.CacheFormats; presets CacheFormats.v4\(\)"),
    (dict(indexer_cache="mxfp4"), TypeError, r"CacheConfig: indexer_cache= was replaced by formats=CacheFormats\("),
], ids=["mxfp4-block-size", "numerics", "old-kv_cache", "old-indexer_cache"])
def test_bad_cache_configs_are_rejected(kwargs, error, match):
    with pytest.raises(error, match=match):
        CacheConfig(max_requests=1, max_context=64, max_step_tokens=8, **kwargs)


@pytest.mark.parametrize("fields, match", [
    (dict(window="fp4_288"), None), (dict(comp="mxfp4_68"), r"comp: expected one of \['exact', 'fp8_584', "),
    (dict(index="fp4_288"), r"index: expected one of \['exact', 'fp8_132', 'mxfp4_68'\], got 'fp4_288'"),
    (dict(window="fp8"), r"window: expected one of \['exact', 'fp8_584', 'fp8_528', 'fp4_288'\], got 'fp8'"),
], ids=["fp4-window", "comp", "index", "mode-name"])
def test_cache_formats_take_format_names_only(fields, match):
    if match is None:  # a V4.1 stack may hold any 512-d rows; V4 cannot
        fmts = CacheFormats.v41().replace(**fields)
        with pytest.raises(ValueError, match=r"formats: a V4 cache holds \(window, comp\) in .*, got \('fp4_288', "
                                             r"'fp4_288'\) \(V4.1's formats need a V4.1 stack\)"):
            v4_numerics(fmts)
        return
    with pytest.raises(ValueError, match=match):
        CacheFormats.v4().replace(**fields)


def test_layer_pools_are_pages_of_the_formats():
    cfg = CacheConfig(max_requests=2, max_context=512, max_step_tokens=16, formats=FP4)
    pools = {p.name: p for p in layer_pools(CFG, LAYER[CSA], cfg)}
    # Page bytes from the spec's row sizes: 128 x 584 = 74752 B padded to 576 B: 74880; 128 x 288;
    # 128 x 68 = 8704 B = 17 x 512.
    want = {"window": ("fp8_584", 74880), "comp": ("fp4_288", 128 * 288), "index": ("mxfp4_68", 8704)}
    for name, (fmt, page) in want.items():
        assert (pools[name].fmt, pools[name].dtype, pools[name].shape[1]) == (fmt, torch.uint8, page), name


def test_memory_per_context_token_of_v4_flash():
    """Bytes a token adds over V4-Flash's 21 CSA and 20 HCA layers, from the rows' sizes (spec V4 5.5,
    V4.1 4.1): FP8 584-B entries (585 B with page padding) and 132-B keys, or 288-B FP4 entries and
    68-B keys; the window rings and compressor states per request stay the same."""
    flash = DSV4AttentionConfig.flash()
    cfg = {mode: CacheConfig(max_requests=1, max_context=1 << 20, max_step_tokens=512, **kw)
           for mode, kw in (("fp8", dict(formats=CacheFormats.v4())), ("fp4", dict(formats=FP4)))}
    got = {mode: memory(flash, c) for mode, c in cfg.items()}
    assert got["fp8"]["bytes_per_token"] == pytest.approx(21 * (585 + 132) / 4 + 20 * 585 / 128)  # 3855.8
    assert got["fp4"]["bytes_per_token"] == pytest.approx(21 * (288 + 68) / 4 + 20 * 288 / 128)  # 1914.0
    ring = {mode: c.ring_size(flash.window) for mode, c in cfg.items()}
    for mode in cfg:  # 43 rings of 584-B rows (585 B with page padding) in both modes
        assert got[mode]["window_bytes_per_request"] == pytest.approx(43 * ring[mode] * 585)


# ---- the serving layer against the fp64 oracle -----------------------------------------------------
def _setup(kind, cfg=CFG, seed=0, device="cpu", dtype=torch.float32):
    layer = testing.randomize_(DeepseekV4Attention(cfg, LAYER[kind], formats=FP4), seed=LAYER[kind]).to(device, dtype)
    manager = KVCacheManager(cfg, CacheConfig(max_requests=4, max_context=272, max_step_tokens=400, formats=FP4),
                             device=device)
    layer.attach_cache(manager)
    g = torch.Generator().manual_seed(seed)
    return layer, manager, {rid: torch.randn(n, cfg.hidden_size, generator=g).to(device, dtype)
                            for rid, n in LENGTHS.items()}


def check_against_oracle(layer, inputs: dict, outs: dict):
    """Every request's outputs against the fp64 oracle in the FP4 mode; budget: its run in the
    layer's dtype and its rounding twins (a chunked or decode schedule sums the values it quantizes
    in another order, so a value at a bf16 boundary may round the other way, and with it an FP4 code
    or an e4m3 scale)."""
    cfg, li = layer.config, layer.layer_idx
    params = {k: v.detach() for k, v in layer.named_parameters()}
    p64 = {k: v.double() for k, v in params.items()}
    for rid, x in inputs.items():
        with torch.no_grad():
            lowp = reference.attention(params, cfg, li, x[None], layer.numerics)[0]
            run64 = lambda: reference.attention(p64, cfg, li, x[None].double(), layer.numerics)[0]  # noqa: E731
            ref64 = run64()
            twins = testing.rounding_twins(run64)
        testing.assert_close_to_ref(outs[rid], ref64, [lowp, *twins], what=f"request {rid}")


# Chunks that end mid-block, cross t = 127 and 255, interleave the requests; decode tokens (every 4th
# closes a CSA entry).
SCHEDULES = {
    "one_shot": lambda: [dict(LENGTHS)],
    "chunked": lambda: [{"a": 5, "b": 129}, {"a": 150, "c": 3}, {"b": 2, "c": 6, "a": 1}, {"a": 104}],
    "decode": lambda: drivers.decode_after(LENGTHS, 200),  # through t = 255
}


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("kind", [CSA, HCA])
def test_serving_equals_the_oracle(kind, schedule):
    layer, manager, inputs = _setup(kind)
    with torch.no_grad():
        outs = drivers.serve_schedule(layer, manager, inputs, SCHEDULES[schedule]())
    check_against_oracle(layer, inputs, outs)


@pytest.mark.parametrize("schedule, compiled", [("chunked", False), ("decode", False), ("chunked", True)],
                         ids=["chunked", "decode", "chunked-compiled"])
def test_serving_with_real_selection_equals_the_oracle(schedule, compiled):
    """The MXFP4 indexer selecting 8 of up to 65 entries: each token's selection is a top-8 of the
    oracle's scores (rotated MX4 queries and keys) up to their rounding, and each output equals the
    oracle fed that selection. A key or query left unrotated moves every score (not only near-ties)."""
    torch._dynamo.reset()
    layer, manager, inputs = _setup(CSA, cfg=SELECTING)
    fn = torch.compile(layer, backend="aot_eager", fullgraph=True) if compiled else layer
    sel = {}
    with torch.no_grad():
        outs = drivers.serve_schedule(fn, manager, {r: inputs[r] for r in ("a", "b")},
                                      [{r: n for r, n in step.items() if r != "c"} for step in SCHEDULES[schedule]()
                                       if set(step) - {"c"}], selections=sel)
    for rid in ("a", "b"):
        testing.assert_matches_oracle(layer, inputs[rid], outs[rid], sel[rid], what=f"request {rid}")


def test_stateless_forward_in_the_fp4_mode_equals_the_oracle():
    layer = testing.randomize_(DeepseekV4Attention(SELECTING, LAYER[CSA], formats=FP4), seed=5)
    x = torch.randn(2, 70, SELECTING.hidden_size, generator=torch.Generator().manual_seed(5))
    with torch.no_grad(), testing.recorded_selections() as log:
        y = layer(x)
    sel = log[-1].view(2, 70, -1)
    for b in range(2):
        testing.assert_matches_oracle(layer, x[b], y[b], sel[b], what=f"sequence {b}")


def test_compiled_csa_step_is_one_graph_over_the_low_bit_pools():
    torch._dynamo.reset()
    layer, manager, _ = _setup(CSA)
    manager.admit(0)
    backend = AotEagerAndRecordGraphs()
    with torch.no_grad():
        torch.compile(layer, backend=backend, fullgraph=True)(torch.randn(16, CFG.hidden_size),
                                                              manager.prepare_step({0: 16}))
    assert len(backend.graphs) == 1 and len(backend.fw_graphs) == 1
    text = normalize_gm(backend.fw_graphs[0].print_readable(print_output=False))
    calls = [ln for ln in text.splitlines() if "torch.ops.dsv4." in ln]
    main, index = [ln for ln in calls if "compressor_update" in ln]
    assert "fmt = 'fp4_288', hadamard = False" in main and "fmt = 'mxfp4_68', hadamard = True" in index
    (q_prep,) = [ln for ln in calls if "indexer_q_prep" in ln]
    assert "fmt = 'mxfp4_68', hadamard = True" in q_prep
    (attn,) = [ln for ln in calls if "sparse_attn" in ln]
    assert "window_fmt = 'fp8_584', comp_fmt = 'fp4_288'" in attn


# The indexer keys' and queries' Hadamard follows the indexer's format alone: pairs whose kv and
# indexer modes disagree on it (a flag read from the kv field rotates an FP8 indexer or leaves an
# MXFP4 one unrotated, moving every score, not only near-ties).
MIXED = [CacheFormats("fp8_584", "fp8_584", "mxfp4_68"), CacheFormats("fp8_584", "fp4_288", "fp8_132"),
         CacheFormats("exact", "exact", "mxfp4_68"), CacheFormats("fp8_584", "fp4_288", "exact")]


@pytest.mark.parametrize("fmts", MIXED, ids=lambda f: f"{f.comp}-{f.index}")
def test_mixed_kv_and_indexer_modes_select_and_attend_as_the_oracle(fmts):
    layer = testing.randomize_(DeepseekV4Attention(SELECTING, LAYER[CSA], formats=fmts), seed=LAYER[CSA])
    manager = KVCacheManager(SELECTING, CacheConfig(formats=fmts, exact_dtype=torch.float32, max_requests=2,
                                                    max_context=272, max_step_tokens=200))
    layer.attach_cache(manager)
    x = torch.randn(80, SELECTING.hidden_size, generator=torch.Generator().manual_seed(0))
    sel = {}
    with torch.no_grad():
        outs = drivers.serve_schedule(layer, manager, {"a": x}, [{"a": 40}, {"a": 1}, {"a": 39}], selections=sel)
    testing.assert_matches_oracle(layer, x, outs["a"], sel["a"], what=f"{fmts}")
