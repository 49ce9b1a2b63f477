"""`bench --only layer`: the whole V4 layer's decode step against its floor, and beside the step an
engine without dsv4ops would run (FlashMLA's sparse decode for the core, bf16 cuBLAS GEMMs for the
projections).

- eager_us / compiled_us: `layer(x, step)` captured in a CUDA graph, eager and under
  `torch.compile(fullgraph=True)`, the FP8_PROJECTIONS kept block-FP8 as `keep_fp8=True` loads a
  checkpoint (BlockFP8Linear, activations "auto") and the dsv4:: ops; kernels: the kernels one compiled
  step launches (torch.profiler, memcpy / memset not counted).
- invariant_us: the compiled step of the same layer and batch on a CacheConfig(batch_invariant=True)
  cache (a request's bits independent of its neighbours); vs_default: invariant_us / compiled_us.
- floor_us: the bytes the step must read (the layer's weights as held, which are its checkpoint's: FP8
  where the checkpoint is FP8, o_a_proj included, bf16 where it is bf16; plus the KV rows its tokens
  read: window, selected or visible entries, indexer keys) at the copy bandwidth measured in the same
  run; at batch >= 128 the larger of that and the GEMM FLOPs (2 x tokens x weight elements) at the
  bf16 dense rate measured in the same run.
- flashmla_bf16_us: the same layer with bf16 projections (the FP8 weights dequantized: the same
  values) and FlashMLA's decode as its core, through `_attend`'s core seam, captured likewise in eager.

V4-Flash and V4-Pro rows are per layer kind; V4.1-Flash rows per layer role (bench/layer_step_v41:
the same columns and timers, no FlashMLA one). After each model's rows, its whole stack's
(`stack_rows`).
"""

from __future__ import annotations

import copy

import torch

from dsv4ops.bench import flashmla
from dsv4ops.bench.attention import Case, new_layer
from dsv4ops.bench.sweep import KIND_NAMES, model_config
from dsv4ops.cache.step import visible_counts
from dsv4ops.config import CSA, HCA, SLIDING, DSV4AttentionConfig
from dsv4ops.fp8_linear import reference as fp8_reference
from dsv4ops.layers import FP8_PROJECTIONS, _attend
from dsv4ops.quant import formats
from dsv4ops.quant.reference import FP8_MAX, pow2_scale_exponent

# (batch, context) points: decode at 4K context, and one request at 1M.
POINTS = ((1, 4096), (32, 4096), (128, 4096), (1, 1 << 20))
QUICK_POINTS = ((1, 4096), (128, 4096))
BLOCK = 128
FLOPS_FROM = 128  # the batch from which the GEMM FLOPs may bound the step (the floor's max)


def quantize_block_fp8(w: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight [N, K] as a block-FP8 checkpoint stores it: e4m3 codes and one UE8M0 scale per
    block x block tile (2^ceil(log2(amax / 448)))."""
    n, k = w.shape
    tiles = (-(-n // block), -(-k // block))
    padded = w.new_zeros(tiles[0] * block, tiles[1] * block, dtype=torch.float32)
    padded[:n, :k] = w
    amax = padded.view(tiles[0], block, tiles[1], block).abs().amax((1, 3))
    scale = torch.exp2(pow2_scale_exponent(amax, FP8_MAX, 2.0**-120).float())
    codes = (padded / scale.repeat_interleave(block, 0).repeat_interleave(block, 1))[:n, :k]
    return codes.to(torch.float8_e4m3fn), scale.to(torch.float8_e8m0fnu)


def to_block_fp8(layer) -> dict[str, torch.Tensor]:
    """Turn the layer's FP8_PROJECTIONS into BlockFP8Linear modules holding their weights' block-FP8
    quantization, as keep_fp8=True loads a checkpoint; returns name -> that weight dequantized to
    bf16 (the bf16 GEMMs' weights)."""
    bf16 = {}
    for name in FP8_PROJECTIONS:
        try:
            module = layer.get_submodule(name)
        except AttributeError:  # no indexer: a sliding or HCA layer
            continue
        codes, scale = quantize_block_fp8(module.weight.detach())
        layer._set_projection(name, BLOCK, torch.float8_e8m0fnu)
        layer.get_submodule(name).load_state_dict({"weight": codes, "weight_scale_inv": scale})
        bf16[name] = fp8_reference.dequantize(codes, scale, BLOCK, torch.bfloat16)
    return bf16


def bf16_twin(layer, bf16: dict[str, torch.Tensor]):
    """A copy of a block-FP8 layer (to_block_fp8) whose projections are bf16 nn.Linear modules holding
    the dequantized weights, without the cache."""
    cache = layer._modules.pop("cache", None)
    try:
        twin = copy.deepcopy(layer)
    finally:
        if cache is not None:
            layer._modules["cache"] = cache
    twin.__dict__.pop("cache_manager", None)
    for name, w in bf16.items():
        twin._set_projection(name, None, None)
        twin.get_submodule(name).weight.data.copy_(w)
    return twin


def flashmla_core(case: Case):
    """FlashMLA's decode as `_attend`'s core (its window-ring indices built once, outside the timed graph,
    as engines build them in their step metadata)."""
    layer, cache, st, cfg = case.layer, case.layer.cache, case.step, case.model
    comp = cache.comp if layer.compressor is not None else cache.window
    run = flashmla.Decode(cache.window, comp, st.positions, st.req_slots, layer.sinks, cfg.head_dim**-0.5,
                          cfg.window, cache.ring_size)
    return lambda q_rot, comp_cache, comp_fmt, comp_idx, comp_lens: run(q_rot, comp_idx, comp_lens)


def weight_bytes(layer) -> int:
    """The bytes of the layer's weights as held (each storage once: the packed projections' members are
    views of their pack), its cache excluded."""
    seen = {}
    for name, t in [*layer.named_parameters(), *layer.named_buffers()]:
        if t is not None and not name.startswith("cache."):
            seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def weight_elements(layer) -> int:
    """Multiply-adds per token of the layer's projections (each weight element once)."""
    seen = {}
    for name, t in layer.named_parameters():
        if t.dim() == 2:
            seen[name] = t.numel()
    for name, t in layer.named_buffers():
        if name.endswith(".weight") and t.dim() == 2 and not name.startswith("cache."):  # BlockFP8Linear
            seen[name] = t.numel()
    return sum(seen.values())


def kv_bytes(case: Case) -> int:
    """The KV rows the step's tokens read: each token's window (up to `window` rows), its selected
    (CSA) or visible (HCA) compressed entries, and (CSA) every visible indexer key."""
    layer, st, cfg = case.layer, case.step, case.model
    fmt = layer.cache.fmt
    pos = st.positions[st.req_slots >= 0].long()
    row = formats.FORMATS[fmt["window"]].row_bytes
    total = int((pos + 1).clamp(max=cfg.window).sum()) * row
    if layer.layer_type == SLIDING:
        return total
    ratio = cfg.compress_ratio(layer.layer_idx)
    visible = visible_counts(st.positions, st.req_slots, ratio)[st.req_slots >= 0].long()
    comp_row = formats.FORMATS[fmt["comp"]].row_bytes
    if layer.layer_type == CSA:
        total += int(visible.clamp(max=cfg.index_topk).sum()) * comp_row
        total += int(visible.sum()) * formats.FORMATS[fmt["index"]].row_bytes
    else:
        total += int(visible.sum()) * comp_row
    return total


def measured_rates(timer) -> tuple[float, float]:
    """(copy bandwidth in B/s, read + write; bf16 dense GEMM rate in FLOP/s), measured now."""
    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    copy_us = timer(lambda: dst.copy_(src))
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    mm_us = timer(lambda: a @ a)
    return 2 * (1 << 30) / (copy_us * 1e-6), 2 * 8192**3 / (mm_us * 1e-6)


def kernel_count(fn) -> int:
    """Kernels one call of fn launches (torch.profiler; memcpy and memset are not kernels)."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kinds = ("memcpy", "memset")
    return sum(1 for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA
               and not any(k in e.name.lower() for k in kinds))


def step_columns(timer, eager, compiled, nbytes: int, gemm_flops: float, batch: int, rates) -> dict:
    """eager_us, compiled_us, kernels, floor_us, copy_TBps, vs_floor of one layer step: `nbytes` (the
    bytes it must read) at the copy bandwidth of `rates` (measured_rates), at batch >= FLOPS_FROM the
    larger of that and `gemm_flops` at its GEMM rate."""
    bandwidth, flops = rates
    row = {"eager_us": timer(eager), "compiled_us": timer(compiled), "kernels": kernel_count(compiled)}
    floor = nbytes / bandwidth
    if batch >= FLOPS_FROM:
        floor = max(floor, gemm_flops / flops)
    row["floor_us"], row["copy_TBps"] = floor * 1e6, bandwidth / 1e12
    row["vs_floor"] = row["compiled_us"] / row["floor_us"]
    return row


@torch.no_grad()
def run(progress, device, timer, rates, points, models=("flash", "pro"), kinds=(SLIDING, CSA, HCA)) -> list[dict]:
    """The rows of the V4 `models` (flash, pro) per layer kind at `points`, each model's stack rows
    after its own (bench/layer_rows.py runs V4.1's beside them). rates: measured_rates(timer)."""
    rows = []
    for model in models:
        for kind in kinds:
            cfg = model_config(model, kind)
            layer = new_layer(kind, cfg, device)
            bf16 = to_block_fp8(layer)
            twin = bf16_twin(layer, bf16) if flashmla.available() else None
            for batch, context in points:
                # A graph per point, static shapes: one compiled module reused over the points would
                # turn dynamic at the second batch size and time symbolic-shape kernels from then on.
                torch._dynamo.reset()
                compiled = torch.compile(layer, fullgraph=True, dynamic=False)
                case = Case(kind, batch, context, 1, device=device, model=cfg, layer=layer)
                eager = lambda: layer(case.x, case.step)  # noqa: E731
                comp = lambda: compiled(case.x, case.step)  # noqa: E731
                row = dict(model=model, layer=KIND_NAMES[kind], batch=batch, context=context, heads=cfg.num_heads)
                row.update(step_columns(timer, eager, comp, weight_bytes(layer) + kv_bytes(case),
                                        2 * case.x.shape[0] * weight_elements(layer), batch, rates))
                if twin is not None:
                    base = _attend_with(twin, case, flashmla_core(case))
                    row["flashmla_bf16_us"] = timer(base)
                    row["vs_flashmla_bf16"] = row["compiled_us"] / row["flashmla_bf16_us"]
                    a, b = comp().float(), base().float()
                    row["rel_diff"] = ((a - b).abs().max() / b.abs().max()).item()
                case.release()
                case = Case(kind, batch, context, 1, device=device, model=cfg, layer=layer, batch_invariant=True)
                row["invariant_us"] = timer(lambda: compiled(case.x, case.step))  # noqa: B023
                row["vs_default"] = row["invariant_us"] / row["compiled_us"]
                case.release()
                progress(row)
                rows.append(row)
            torch._dynamo.reset()
            if device == "cuda":
                torch.cuda.empty_cache()
        for row in stack_rows([r for r in rows if r["model"] == model], model):
            progress(row)
            rows.append(row)
    return rows


STACK_SUMS = ("eager_us", "compiled_us", "kernels", "floor_us", "flashmla_bf16_us")


def stack_rows(rows: list[dict], model: str, counts: dict[str, int] | None = None, heads: int | None = None
               ) -> list[dict]:
    """The whole attention stack's step per (batch, context) point: the model's layers of each kind
    times that kind's measured row (the layers of a kind run the same shapes, so the same kernels),
    summed; only where every kind of the stack was measured. A sum of separately timed graphs, not
    one graph of the whole stack: the launches between layers overlap in neither. counts: row name
    (`layer`) -> layers of it in the stack (default: the V4 model's kinds), heads: the model's."""
    if counts is None:
        cfg = DSV4AttentionConfig.flash() if model == "flash" else DSV4AttentionConfig.pro()
        counts, heads = {}, cfg.num_heads
        for i in range(cfg.num_layers):
            counts[KIND_NAMES[cfg.layer_type(i)]] = counts.get(KIND_NAMES[cfg.layer_type(i)], 0) + 1
    out = []
    for batch, context in dict.fromkeys((r["batch"], r["context"]) for r in rows):
        by_kind = {r["layer"]: r for r in rows if (r["batch"], r["context"]) == (batch, context)}
        if not set(counts) <= set(by_kind):
            continue
        row = dict(model=model, layer=f"stack of {sum(counts.values())}", batch=batch, context=context, heads=heads)
        for col in STACK_SUMS:
            if all(col in by_kind[k] for k in counts):
                row[col] = sum(n * by_kind[k][col] for k, n in counts.items())
        row["copy_TBps"] = by_kind[next(iter(counts))]["copy_TBps"]
        row["vs_floor"] = row["compiled_us"] / row["floor_us"]
        if "flashmla_bf16_us" in row:
            row["vs_flashmla_bf16"] = row["compiled_us"] / row["flashmla_bf16_us"]
        out.append(row)
    return out


def _attend_with(twin, case: Case, core):
    """The twin layer's step on the case's cache and step, with `core` as the attention core."""
    return lambda: _attend(twin, case.x, case.step, case.layer.cache, core=core)


COLUMNS = ["model", "layer", "batch", "context", "heads", "eager_us", "compiled_us", "kernels", "floor_us", "copy_TBps",
           "vs_floor", "flashmla_bf16_us", "vs_flashmla_bf16", "rel_diff", "invariant_us", "vs_default"]
