"""`bench --only layer --model v41`: a V4.1-Flash layer's decode step per role (sliding, the ratio-2
source and its reuse layers, the ratio-1 source that publishes the candidate pool, a reindex layer
inside that pool, the ratio-1 reuse layers), with bench/layer_step's columns and timers, and the
whole 40-layer stack's step: each role's row times its count of layers (V4.1-Flash's roles).

- eager_us / compiled_us / kernels: one layer's `forward(x, step, cache, shared)` on the stack's
  cache (its sources' top-k and candidate pool published by an eager run of the same step), in a
  CUDA graph, eager and under `torch.compile(fullgraph=True)`; the projections bf16 as the V4.1
  layers hold them (the checkpoint's block-FP8 weights dequantized at load).
- floor_us: the checkpoint's bytes of the role's weights (spec 1.4: q_a, q_b, kv, o_a, o_b and the
  indexer's wq_b block-FP8, one e4m3 byte a weight and one UE8M0 byte a 32 x 32 tile; the rest as
  held: compressor and indexer weights bf16, norms and sinks fp32) plus the KV rows the step reads
  (window; the group's selected entries; an index source's scored keys: every visible key, or those
  of the candidate pool after the candidate source), as layer_step's floor. The layer reads its
  FP8 projections as bf16 today (twice those bytes), so its ratio to the floor carries that.
- flashmla_bf16_us: none. V4.1's layer has no core seam, and FlashMLA on sm_90 does not read V4.1's
  528 / 288-B rows (bench-kit README); `--only v41` times the engines' route (rows re-encoded to V4's).
- invariant_us: the compiled step on a CacheConfig(batch_invariant=True) cache, once the stack
  accepts one (None while its attach_cache raises NotImplementedError).

The roles are timed on ROLES, V4.1-Flash's widths with one layer of each role (and the sources its
readers need): every layer of a role runs the same shapes as in the 40-layer stack (its weights,
its window ring, its group's pools and top-k), in 6 layers' memory."""

from __future__ import annotations

import collections

import torch
from torch import nn

from dsv4ops import CacheFormats, testing
from dsv4ops.bench.attention import _fill, _prefilled
from dsv4ops.bench.layer_step import step_columns, stack_rows, weight_bytes, weight_elements
from dsv4ops.cache.config import CacheConfig
from dsv4ops.cache.v41 import V41CacheManager
from dsv4ops.checkpoint import V41_BLOCK
from dsv4ops.config_v41 import DSV41AttentionConfig, LayerRole
from dsv4ops.layers_v41 import DeepseekV41AttentionStack
from dsv4ops.projections import has
from dsv4ops.quant import formats

FLASH = DSV41AttentionConfig.v41_flash()
# Layers: 0 sliding; 1 ratio-2 source, 2 its reuse; 3 ratio-1 source and candidate source, 4 its
# reuse; 5 reindex inside 3's pool.
ROLES = FLASH.replace(num_layers=6, num_nextn_layers=0, compress_ratios=(0, 2, 2, 1, 1, 1), kv_source_layers=(1, 3),
                      index_source_layers=(1, 3, 5), candidate_source_layer=3)
# The projections DeepSeek's V4.1 checkpoint stores block-FP8 (spec 1.4: wq_a, wq_b, wkv, wo_a, wo_b,
# indexer.wq_b), by this package's names.
FP8_WEIGHTS = ("q_a_proj", "q_b_proj", "kv_proj", "o_a_proj", "o_b_proj", "indexer.wq_b")


def role_name(role: LayerRole) -> str:
    """The row's `layer`: the role's kind and, for a compressed one, its ratio (a ratio-2 and a
    ratio-1 reuse layer read pools of different sizes)."""
    return role.kind if role.sliding else f"{role.kind} (ratio {role.ratio})"


def role_counts(cfg: DSV41AttentionConfig) -> dict[str, int]:
    """Role name -> backbone layers of that role."""
    return dict(collections.Counter(role_name(r) for r in cfg.roles[: cfg.num_layers]))


def role_layers(cfg: DSV41AttentionConfig) -> dict[str, int]:
    """Role name -> the first backbone layer of that role."""
    out = {}
    for r in cfg.roles[: cfg.num_layers]:
        out.setdefault(role_name(r), r.layer)
    return out


def checkpoint_bytes(layer) -> int:
    """The layer's weights as its checkpoint stores them: FP8_WEIGHTS block-FP8 (one byte a weight,
    one UE8M0 byte a V41_BLOCK x V41_BLOCK tile), every other tensor as held (weight_bytes)."""
    total = weight_bytes(layer)
    for name in FP8_WEIGHTS:
        if not has(layer, name):
            continue
        w = layer.get_submodule(name).weight
        if w.element_size() == 1:  # held block-FP8: weight_bytes counted its codes and scales
            continue
        tiles = -(-w.shape[0] // V41_BLOCK) * -(-w.shape[1] // V41_BLOCK)
        total += w.numel() + tiles - w.numel() * w.element_size()
    return total


class OneLayer(nn.Module):
    """Layer i of the stack over the stack's cache: what one compiled layer step runs."""

    def __init__(self, stack: DeepseekV41AttentionStack, i: int):
        super().__init__()
        self.stack, self.i = stack, i

    def forward(self, x, step, shared):
        return self.stack.layers[self.i](x, step, self.stack.cache, shared)


def new_stack(cfg: DSV41AttentionConfig = ROLES, device="cuda") -> DeepseekV41AttentionStack:
    """The stack of `cfg`, random weights (testing.randomize_), bf16."""
    return testing.randomize_(DeepseekV41AttentionStack(cfg), seed=0).to(device, torch.bfloat16)


class V41Case:
    """The stack attached to a new cache whose `batch` requests hold `context - 1` tokens of random
    rows (every pool and compressor state), the decode step of one token each, every layer's input
    and what the stack's eager run of that step published (each reader's sources' top-k and pool).
    batch_invariant: the cache's CacheConfig.batch_invariant (the stack may refuse it)."""

    def __init__(self, stack: DeepseekV41AttentionStack, batch: int, context: int, device="cuda",
                 batch_invariant: bool = False):
        cfg = stack.config
        self.stack, self.batch, self.context = stack, batch, context
        cache_cfg = CacheConfig(formats=CacheFormats.v41(), exact_dtype=torch.bfloat16, max_requests=batch,
                                max_context=context + 1, max_total_tokens=batch * (context + 1), max_step_tokens=batch,
                                buckets=(batch,), batch_invariant=batch_invariant)
        self.manager = V41CacheManager(cfg, cache_cfg, device=device)
        stack.attach_cache(self.manager)
        for r in range(batch):
            _prefilled(self.manager, r, context - 1)
        gen = torch.Generator(device=device).manual_seed(0)
        cache = self.cache = stack.cache
        for name, fmt in cache.fmt.items():
            if name.startswith(("window_", "comp_", "keys_")):
                _fill(getattr(cache, name), cfg.index_head_dim if name.startswith("keys_") else cfg.head_dim, fmt, gen)
        for name, _, _ in cache.state_rings:
            getattr(cache, name).normal_(generator=gen)
        self.step = self.manager.prepare_step({r: 1 for r in range(batch)})
        self.xs = torch.randn(cfg.num_layers, batch, cfg.hidden_size, device=device, dtype=torch.bfloat16,
                              generator=gen)
        published = {}
        with torch.no_grad():
            stack(self.xs, self.step, published)
        self.published = {k: v for k, v in published.items() if k != "step"}

    def shared(self) -> dict:
        """A fresh copy of the published top-k and pool (a source layer publishes into it again)."""
        return dict(self.published)

    def kv_bytes(self, i: int) -> int:
        """The KV rows layer i's step reads: each token's window (up to `window` rows), its group's
        selected entries (up to index_topk of the visible ones) and, at an index source, the keys it
        scores (every visible key, or those of the candidate pool when it scores inside it)."""
        cfg, role, st, fmt = self.stack.config, self.stack.config.role(i), self.step, self.cache.fmt
        pos = st.positions[st.req_slots >= 0].long()
        total = int((pos + 1).clamp(max=cfg.window).sum()) * formats.FORMATS[fmt[f"window_{i}"]].row_bytes
        if role.sliding:
            return total
        visible = (pos + 1) // role.ratio
        total += int(visible.clamp(max=cfg.index_topk).sum()) * formats.FORMATS[fmt[f"comp_{role.kv_source}"]].row_bytes
        if role.indexer:
            scored = visible.clamp(max=cfg.candidate_pool) if role.uses_candidates else visible
            total += int(scored.sum()) * formats.FORMATS[fmt[f"keys_{role.kv_source}"]].row_bytes
        return total

    def release(self) -> None:
        """Detach the cache from the stack (its pools are freed once this case goes)."""
        del self.stack.cache, self.stack.cache_manager


@torch.no_grad()
def run(progress, device, timer, rates, points, model: DSV41AttentionConfig = ROLES,
        full: DSV41AttentionConfig = FLASH) -> list[dict]:
    """One row per role of `full` and (batch, context) point, timed on `model` (one layer of each
    role at full's widths), then `full`'s stack rows. rates: layer_step.measured_rates."""
    layers, counts = role_layers(model), role_counts(full)
    if set(layers) != set(counts):
        raise ValueError(f"model: expected one layer of each role of the full stack {sorted(counts)}, got "
                         f"{sorted(layers)}")
    stack = new_stack(model, device)
    steps = {name: OneLayer(stack, i) for name, i in layers.items()}
    compiled = {name: torch.compile(step, fullgraph=True, dynamic=False) for name, step in steps.items()}
    rows = []
    for batch, context in points:
        torch._dynamo.reset()  # the roles share OneLayer.forward: a point's compiles stay under its cache limit
        case = V41Case(stack, batch, context, device)
        point = {}
        for name, i in layers.items():
            layer, x = stack.layers[i], case.xs[i]
            eager = lambda: steps[name](x, case.step, case.shared())  # noqa: E731, B023
            comp = lambda: compiled[name](x, case.step, case.shared())  # noqa: E731, B023
            row = dict(model="v41", layer=name, batch=batch, context=context, heads=model.num_heads)
            row.update(step_columns(timer, eager, comp, checkpoint_bytes(layer) + case.kv_bytes(i),
                                    2 * batch * weight_elements(layer), batch, rates))
            point[name] = row
        case.release()
        torch._dynamo.reset()
        try:
            case = V41Case(stack, batch, context, device, batch_invariant=True)
        except NotImplementedError:  # the stack refuses the flag: no column
            case = None
        for name, i in layers.items():
            row = point[name]
            row["invariant_us"] = row["vs_default"] = None
            if case is not None:
                row["invariant_us"] = timer(lambda: compiled[name](case.xs[i], case.step, case.shared()))  # noqa: B023
                row["vs_default"] = row["invariant_us"] / row["compiled_us"]
            progress(row)
            rows.append(row)
        if case is not None:
            case.release()
        if device == "cuda":
            torch.cuda.empty_cache()
    stack_part = stack_rows(rows, "v41", counts, full.num_heads)
    for row in stack_part:
        progress(row)
    return rows + stack_part
