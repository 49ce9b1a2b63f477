"""Drop-in DeepSeek-V4.1 attention: one module per layer (its weights, by role) and the STACK that
owns the shared caches and runs the layers of a step in order.

Parameter names are transformers' newest port: the attention's own `q_a_proj`, `q_a_norm`,
`q_b_proj`, `kv_proj`, `kv_norm`, `o_a_proj`, `o_b_proj`, `sinks` (as its V4), the compressor's and
indexer's as DeepSeek's (spec 1.4, pitfall 22): `compressor.wkv`, `compressor.wgate` (ratio > 1),
`compressor.norm`, `indexer.wq_b`, `indexer.weights_proj`, `indexer.wk`, `indexer.k_norm`.
`DeepseekV41AttentionStack.load_deepseek_state_dict` reads DeepSeek's checkpoint names
(DEEPSEEK_NAMES): `layers.{i}.attn.wq_a.weight` -> `layers.{i}.q_a_proj.weight`, ...

The serving forward runs each layer through the dsv4:: ops: qkv_prep (no per-head q norm, the window
row in the window format) -> compressor_update (KV sources; ratio 2 = a 2-slot pool without position
bias, ratio 1 = a 1-slot pool) -> indexer_k_prep (from the compressor's pre-RoPE latent) ->
indexer_q_prep + indexer_topk (index sources; the candidate source publishes its pool, later index
sources score inside it) -> sparse_attn (own window + the group's entries picked by the index
source) -> inv_rope -> grouped output. Within a step every source writes before its readers read
(layer order); the top-k and pool travel in a per-step dict, so a reader whose source has not run in
the same step raises instead of reading a stale buffer (spec pitfall 14).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dsv4ops import checkpoint, invariant, projections
from dsv4ops._autograd import no_backward
from dsv4ops.cache.config import CacheConfig
from dsv4ops.cache.step import live_tokens
from dsv4ops.cache.v41 import V41CacheManager, V41StackCache, V41StepMeta
from dsv4ops.config_v41 import DSV41AttentionConfig
from dsv4ops.parallel import Group, all_reduce
from dsv4ops import layers_dcp as _dcp
from dsv4ops.indexer.reference import query_values
from dsv4ops.layer_weights import RMSNorm, linear
from dsv4ops.layers import DEEPSEEK_CORE_NAMES
from dsv4ops.layers_common import AttentionLayer, check_manager, indexer_query, query, serving_cache
from dsv4ops.quant.formats import CacheFormats
from dsv4ops.reference.functional import grouped_output
from dsv4ops.reference.v41 import compressor_dtype, entry_dtype

# Rows per page of the stateless forward's private cache: a size every format pages (mxfp4_68 pages
# are padded to 512 B: 128 x 68 B = 17 x 512 B).
STATELESS_BLOCK = 128

# DeepSeek's checkpoint names (inference/model.py) -> this module's, under `layers.{i}.`.
DEEPSEEK_NAMES = {
    **DEEPSEEK_CORE_NAMES,
    "attn.compressor.wkv.weight": "compressor.wkv.weight",
    "attn.compressor.wgate.weight": "compressor.wgate.weight",
    "attn.compressor.norm.weight": "compressor.norm.weight",
    "attn.indexer.wq_b.weight": "indexer.wq_b.weight",
    "attn.indexer.weights_proj.weight": "indexer.weights_proj.weight",
    "attn.indexer.wk.weight": "indexer.wk.weight",
    "attn.indexer.k_norm.weight": "indexer.k_norm.weight",
}


class V41Compressor(nn.Module):
    """A KV source's compressor: wkv, wgate (ratio > 1: the per-channel softmax gate), norm. No
    position bias in V4.1: `ape` is a zero buffer (compressor_update's bias argument)."""

    def __init__(self, cfg: DSV41AttentionConfig, ratio: int):
        super().__init__()
        self.ratio = ratio
        self.wkv = linear(cfg.hidden_size, cfg.head_dim)
        self.wgate = linear(cfg.hidden_size, cfg.head_dim) if ratio > 1 else None
        self.norm = RMSNorm(cfg.head_dim)
        self.register_buffer("ape", torch.zeros(ratio, cfg.head_dim), persistent=False)


class V41Indexer(nn.Module):
    """An index source's indexer: wq_b (from the shared q latent), weights_proj; the KV source's also
    wk and k_norm (its group's index keys, spec 2.4)."""

    def __init__(self, cfg: DSV41AttentionConfig, owns_keys: bool):
        super().__init__()
        self.wq_b = linear(cfg.q_lora_rank, cfg.index_n_heads * cfg.index_head_dim)
        self.weights_proj = linear(cfg.hidden_size, cfg.index_n_heads)
        self.wk = linear(cfg.head_dim, cfg.index_head_dim) if owns_keys else None
        self.k_norm = RMSNorm(cfg.index_head_dim) if owns_keys else None


class DeepseekV41Attention(AttentionLayer):
    """The weights of one V4.1 attention layer (which exist depends on its role, `config.role(i)`)
    and its serving forward over a step (run by DeepseekV41AttentionStack). The projections of x
    its role has (q_a, kv, the indexer's weights_proj, the compressor's wkv / wgate) run as one GEMM
    (dsv4ops.projections), fp32 out where a compressor reads it; the compressor weights are held in
    the model dtype (bf16 in the checkpoint: an fp32 load bf16 cannot hold exactly is refused).

    `process_group`: tensor parallelism as DeepseekV4Attention's (this rank's `heads` and `groups`;
    dsv4ops.parallel.tp); forward then returns this rank's share of the output, which the stack sums
    over the ranks."""

    NAME = "DeepseekV41Attention"
    X_PROJECTIONS = ("q_a_proj", "kv_proj", "indexer.weights_proj", "compressor.wkv", "compressor.wgate")
    COMPRESSOR_WEIGHTS = ("compressor.wkv.weight", "compressor.wgate.weight")
    KEEP_FP32 = ("sinks", "norm.weight", "ape")  # as transformers (ape: the compressor's zero bias)

    def __init__(self, config: DSV41AttentionConfig, layer_idx: int, process_group=None):
        super().__init__()
        if not isinstance(config, DSV41AttentionConfig):
            raise TypeError(f"config: expected a DSV41AttentionConfig, got {type(config).__name__} (a V4 config: "
                            f"dsv4ops.DeepseekV4Attention)")
        cfg = config
        self.role = cfg.role(layer_idx)
        self._init_core(cfg, layer_idx, process_group)
        self.compressor = V41Compressor(cfg, self.role.ratio) if self.role.owns_compressor else None
        self.indexer = V41Indexer(cfg, self.role.owns_index_keys) if self.role.indexer else None
        self._keep_fp32()  # also when built under another default dtype

    def projection_dtype(self, name: str, dtype: torch.dtype) -> torch.dtype:
        """The compressor's a and gate: fp32 at ratio 2, the model dtype at ratio 1 (spec 2.3); the
        others in x's dtype."""
        return compressor_dtype(self.role.ratio, dtype) if name.startswith("compressor.") else dtype

    def forward(self, x: Tensor, step: V41StepMeta, cache: V41StackCache, shared: dict,
                live: tuple[Tensor, ...] | None = None) -> Tensor:
        """x [T, hidden] (the step's flat batch) -> [T, hidden]. `shared` is the step's dict of
        published top-k rows and candidate pool (written by sources, read by later layers). `live`:
        the step's (positions, req_slots, visible, comp_lens) at this layer's ratio, which the stack
        computes once per step (live_counts); None: computed here."""
        return _attend(self, x, step, cache, shared, live)


def live_counts(cfg: DSV41AttentionConfig, ratio: int) -> tuple[int, int]:
    """The (ratio, width) of live_tokens' visible and comp_lens rows for a layer of `ratio`: comp_lens
    lists the top-k's first min(visible, k) columns (it lists the entries first); none when sliding."""
    return ratio, 0 if ratio == 0 else cfg.index_topk


def _attend(layer: DeepseekV41Attention, x: Tensor, step: V41StepMeta, cache: V41StackCache, shared: dict,
            live: tuple[Tensor, ...] | None = None) -> Tensor:
    """The ops of one layer, called directly (the step planner checked every value; the public
    functions' eager value checks would sync the host each step). No data-dependent branch."""
    cfg, role, ops = layer.config, layer.role, torch.ops.dsv4
    pos, req, _, lens = live if live is not None else live_tokens(step, cache, live_counts(cfg, role.ratio))
    t, i = x.shape[0], layer.layer_idx
    fmt = cache.fmt
    inv = cache.cfg.batch_invariant  # every GEMM's rows independent of the step's other tokens
    px = projections.project_x(layer, x, inv)
    window = getattr(cache, f"window_{i}")
    qr, q_rot = query(layer, px, pos, req, window, cache.ring_size, fmt[f"window_{i}"], head_norm=False,
                      invariant=inv)

    if role.owns_compressor:
        _compress(layer, px, step, pos, req, cache)
    if role.indexer:
        _select(layer, px["indexer.weights_proj"], qr, step, pos, req, cache, shared)
    if role.sliding:
        comp, comp_fmt = window, fmt[f"window_{i}"]
        comp_idx, comp_lens = torch.empty(t, 0, dtype=torch.int32, device=x.device), lens
    else:
        comp, comp_fmt = getattr(cache, f"comp_{role.kv_source}"), fmt[f"comp_{role.kv_source}"]
        if ("topk", role.index_source) not in shared:
            raise RuntimeError(f"layer {i} reads the top-k of index source {role.index_source}, which has not run in "
                               f"this step: run the layers of a step in order (a stale top-k would be read)")
        comp_idx = shared["topk", role.index_source]
        comp_lens = lens
        if cache.dcp.size > 1:  # the selection's entries in this rank's blocks, as its pool slots
            comp_idx, comp_lens = _dcp.front(_dcp.local_slots(comp_idx, req, step.block_table(role.ratio),
                                                              cache.cfg.block_size, cache.dcp))
    if cache.dcp.size == 1 or role.sliding:
        o = torch.empty_like(q_rot)
        ops.sparse_attn(q_rot, window, comp, pos, req, comp_idx, comp_lens, step.window_ends, layer.sinks, o,
                        cfg.head_dim**-0.5, cfg.window, cache.ring_size, fmt[f"window_{i}"], comp_fmt, None, inv)
    else:  # context parallel: this rank's share, merged over the ranks with the sink
        o = _dcp.attend(q_rot, window, comp, pos, req, comp_idx, comp_lens, step.window_ends, layer.sinks,
                        cfg.head_dim**-0.5, cfg.window, cache.ring_size, fmt[f"window_{i}"], comp_fmt, cache.dcp)
    o_rot = torch.empty_like(o)
    ops.inv_rope(o, pos, layer.inv_freq, o_rot)
    if inv:
        z = invariant.grouped_o_a(o_rot, layer.o_a_proj.weight, layer.groups)
        return invariant.mm(z, layer.o_b_proj.weight.to(z.dtype), z.dtype)
    return grouped_output(o_rot, layer.o_a_proj.weight, layer.o_b_proj.weight, layer.groups)


def _compress(layer: DeepseekV41Attention, px: dict[str, Tensor], step: V41StepMeta, pos: Tensor, req: Tensor,
              cache: V41StackCache) -> None:
    """Spec 2.3-2.4: the source's entries (ratio 2: fp32 a and gate, a 2-slot pool; ratio 1: the
    model-dtype projection, a 1-slot pool with score 0) and, from their pre-RoPE latent, the keys.
    a and the gate are slices of the packed projection of x (project_x: no copies)."""
    role, c, i, eps = layer.role, layer.compressor, layer.layer_idx, layer.config.rms_norm_eps
    m, fmt = role.ratio, cache.fmt[f"comp_{i}"]
    a = px["compressor.wkv"]
    if m > 1:
        score = px["compressor.wgate"]
    else:
        score = a.new_zeros(1, a.shape[1]).expand_as(a)  # a 1-slot softmax of a finite score weighs exactly 1
    slots = step.entry_slots(m)
    comp = getattr(cache, f"comp_{i}")
    latent = None
    if role.owns_index_keys:  # the entries before RoPE, in the pool's entry dtype
        latent = torch.empty(a.shape[0], a.shape[1], dtype=entry_dtype(fmt, comp.dtype), device=a.device)
    torch.ops.dsv4.compressor_update(a, score, c.ape, pos, req, slots, c.norm.weight,
                                     layer.inv_freq, getattr(cache, f"state_{i}"), comp, latent, eps, fmt, False,
                                     cache.cfg.batch_invariant)
    if latent is not None:
        ix = layer.indexer
        torch.ops.dsv4.indexer_k_prep(latent, pos, req, slots, ix.wk.weight, ix.k_norm.weight,
                                      layer.inv_freq, getattr(cache, f"keys_{i}"), m, eps, cache.fmt[f"keys_{i}"],
                                      cache.cfg.batch_invariant)


def _select(layer: DeepseekV41Attention, w: Tensor, qr: Tensor, step: V41StepMeta, pos: Tensor, req: Tensor,
            cache: V41StackCache, shared: dict) -> None:
    """Spec 2.5-2.8: score the group's keys, publish the top-k (and, at the candidate source, the
    pool); an index source after the candidate source scores only inside that pool. w: the head
    weights' projection of x."""
    cfg, role, ix, t = layer.config, layer.role, layer.indexer, w.shape[0]
    src, m = role.kv_source, role.ratio
    kfmt = cache.fmt[f"keys_{src}"]
    q = invariant.linear(ix.wq_b, qr, cache.cfg.batch_invariant).view(t, cfg.index_n_heads, cfg.index_head_dim)
    q_out = indexer_query(q, kfmt)
    w_out = torch.empty(w.shape, dtype=torch.float32, device=w.device)
    torch.ops.dsv4.indexer_q_prep(q, w, pos, layer.inv_freq, q_out, w_out, kfmt)
    if role.uses_candidates and "pool" not in shared:
        raise RuntimeError(f"layer {role.layer} scores inside the candidate pool of layer "
                           f"{cfg.candidate_source_layer}, which has not run in this step: run the layers in order")
    if cache.dcp.size > 1:
        _select_dcp(layer, q_out, w_out, step, pos, req, cache, shared)
        return
    cand = shared["pool"] if role.uses_candidates else None
    cand_out = None
    if role.candidate_source:
        cand_out = torch.empty(t, cfg.candidate_topk_blocks, dtype=torch.int32, device=w.device)
    idx = torch.empty(t, cfg.index_topk, dtype=torch.int32, device=w.device)
    torch.ops.dsv4.indexer_topk(q_out, w_out, pos, req, getattr(cache, f"keys_{src}"),
                                step.block_table(m), cand, idx, cand_out, cache.topk_workspace, m,
                                cfg.candidate_block_size, kfmt)
    shared["topk", role.layer] = idx
    if cand_out is not None:
        shared["pool"] = cand_out


def _select_dcp(layer: DeepseekV41Attention, q_out: Tensor, w_out: Tensor, step: V41StepMeta, pos: Tensor,
                req: Tensor, cache: V41StackCache, shared: dict) -> None:
    """Context parallel (dsv4ops.parallel.dcp): this rank's top-k (inside its share of the candidate
    pool, for a reindex layer) merged over the group ("exact") or kept ("union"), published as
    entries of the tokens' requests; the candidate source's pool likewise, as global candidate
    blocks (exact: each rank proposes one block more than the pool holds, since a rank forces its
    own newest block)."""
    cfg, role, t, g = layer.config, layer.role, q_out.shape[0], cache.dcp
    src, m, cb, bs = role.kv_source, role.ratio, cfg.candidate_block_size, cache.cfg.block_size
    kfmt, keys, table = cache.fmt[f"keys_{src}"], getattr(cache, f"keys_{src}"), step.block_table(m)
    exact = cache.dcp_topk == "exact"
    n = torch.where(req >= 0, (pos + 1) // m, 0)
    n_local = _dcp.owned_count(n, bs, g)
    cand = _dcp.local_blocks(shared["pool"], cb, bs, g) if role.uses_candidates else None
    cand_out = None
    if role.candidate_source:
        cand_out = torch.empty(t, cfg.candidate_topk_blocks + exact, dtype=torch.int32, device=q_out.device)
    idx = torch.empty(t, cfg.index_topk, dtype=torch.int32, device=q_out.device)
    torch.ops.dsv4.indexer_topk(q_out, w_out, n_local - 1, req, keys, table, cand, idx, cand_out, cache.topk_workspace,
                                1, cb, kfmt)
    entries = _dcp.slot_entries(idx, getattr(cache, f"block_index_{m}"), bs)
    q_values = query_values(q_out) if exact else None
    if exact:
        entries = _dcp.merge_best(entries, _dcp.entry_scores(q_values, w_out, keys, idx, kfmt), cfg.index_topk, g)
    shared["topk", role.layer] = entries
    if cand_out is not None:
        blocks = _dcp.global_blocks(cand_out, cb, bs, g)
        if exact:
            score = _dcp.block_scores(cand_out, n_local, q_values, w_out, keys, req, table, cb, bs, kfmt)
            newest = ((n - 1) // cb)[:, None]
            score = torch.where((blocks == newest) & (n >= 1)[:, None], float("inf"), score)
            blocks = _dcp.merge_best(blocks, score, cfg.candidate_topk_blocks, g)
        shared["pool"] = blocks


class DeepseekV41AttentionStack(nn.Module):
    """Every backbone attention layer of a V4.1 model and, once attached, their shared cache.

    forward(xs, step=None):
    - step=None: xs [num_layers, B, S, hidden], layer L's attention input of B sequences from
      position 0 (a private cache is built for the call) -> [num_layers, B, S, hidden];
    - with a step (from the attached V41CacheManager): xs [num_layers, T, hidden], the step's flat
      batch per layer (padded to its bucket) -> [num_layers, T, hidden], reading and writing the
      attached cache.
    `formats` (a `dsv4ops.CacheFormats`): the caches' row formats, i.e. the stack's fake quantizers.
    None (the default): the formats of the first cache the stack attaches to, and without a cache
    the cache's default, CacheFormats.v41() (the QAT formats; CacheFormats.exact() for none). Given
    explicitly, a cache of other formats is refused.

    `process_group`: tensor parallelism over its ranks (every layer holds this rank's query heads and
    output groups, dsv4ops.parallel.tp); the layers' outputs are summed over the ranks by one all-reduce
    of the stacked [num_layers, T, hidden] (the layers' inputs are given, so no layer waits for
    another's sum). Every rank runs the same forward on the same inputs."""

    def __init__(self, config: DSV41AttentionConfig, formats: CacheFormats | None = None, process_group=None,
                 **renamed):
        super().__init__()
        if "numerics" in renamed:
            raise TypeError("DeepseekV41AttentionStack: numerics was replaced by formats=dsv4ops.CacheFormats(window=..., "
                            "comp=..., index=...) (presets CacheFormats.v41(), .exact(); None: the attached cache's)")
        if renamed:
            raise TypeError(f"DeepseekV41AttentionStack: unexpected keyword argument {sorted(renamed)[0]!r}")
        if formats is not None and not isinstance(formats, CacheFormats):
            raise TypeError(f"formats: expected a dsv4ops.CacheFormats or None, got {type(formats).__name__}")
        # The formats decide no weight's dtype here (the compressors' follow their ratio), so a stack
        # built without formats can take its first cache's.
        self.follows_cache = formats is None
        self.config, self.formats = config, CacheFormats.v41() if formats is None else formats
        self.tp_group = Group.of(process_group)
        self.layers = nn.ModuleList(DeepseekV41Attention(config, i, process_group) for i in range(config.num_layers))

    def _apply(self, fn, recurse=True):
        """`.to(dtype)` keeps the compressor states fp32 (each layer keeps its own fp32 tensors, RoPE
        table and packed projections: AttentionLayer._apply). The compressor weights follow the
        model dtype: their products are exact in fp32, which the packed GEMM's fp32 output keeps."""
        super()._apply(fn, recurse)
        for name, t in self.named_buffers():
            if name.rsplit(".", 1)[-1].startswith("state_") and t.is_floating_point() and t.dtype != torch.float32:
                t.data = t.data.float()
        return self

    def attach_cache(self, manager: V41CacheManager) -> None:
        """Give the stack its pools (sized by the manager's CacheConfig, on the stack's device) and
        register them with the manager (abort restores the ratio-2 sources' states; `generations`
        follow the manager's slots). Attach after moving the stack, before compiling."""
        if not isinstance(manager, V41CacheManager):
            raise TypeError(f"manager: expected a dsv4ops V41CacheManager, got {type(manager).__name__}")
        if manager.model != self.config:
            raise ValueError("manager: it was built for another DSV41AttentionConfig than this stack's")
        device = self.layers[0].sinks.device
        check_manager(self, manager, device, "stack")
        cache = V41StackCache(self.config, manager.cfg, device=device, dcp=manager.dcp,
                              dcp_topk=manager.dcp_topk)
        manager.attach(cache)
        self.formats, self.follows_cache = manager.cfg.formats, False
        self.cache = cache
        self.cache_manager = manager

    def forward(self, xs: Tensor, step: V41StepMeta | None = None, published: dict | None = None) -> Tensor:
        """`published`, if given, receives the step's top-k rows {("topk", L): [T, k] global slots},
        candidate pool {"pool": [T, blocks] entry blocks} and the step itself {"step": V41StepMeta}
        (its block tables map slots back to entries): tie-aware comparisons need the selections.
        With a context-parallel cache the top-k rows are entries of the tokens' requests (the
        merged selection; "union": this rank's own).

        With a step, the contract of DeepseekV4Attention.forward holds: in eager mode a step that is
        not the attached manager's open step raises before anything is written; compiled, a token
        whose slot generation differs from the step's, or whose position is out of range, becomes
        padding (reads and writes nothing)."""
        with torch.no_grad():
            ys = self._forward(xs, step, published)
        if not torch.is_grad_enabled():
            return ys
        return no_backward(ys, (xs, *self.parameters()), f"{type(self).__name__}")

    def _forward(self, xs: Tensor, step: V41StepMeta | None, published: dict | None) -> Tensor:
        if step is not None:
            cache = serving_cache(self, type(self).__name__, "stack", "xs", xs, step, 3, "[num_layers, tokens, hidden]",
                                  xs.shape[1])
            return self._serve(xs, step, cache, published)
        if not torch.compiler.is_compiling():
            self._check_input(xs, 4, "[num_layers, batch, seq, hidden]")
        n, b, s, _ = xs.shape
        cfg = CacheConfig(max_requests=b, max_context=s, max_step_tokens=b * s, max_request_step_tokens=s,
                          buckets=(b * s,), block_size=STATELESS_BLOCK, exact_dtype=xs.dtype, formats=self.formats)
        manager = V41CacheManager(self.config, cfg, device=xs.device)
        cache = V41StackCache(self.config, cfg, device=xs.device)
        manager.attach(cache)
        for r in range(b):
            manager.admit(r)
        step = manager.prepare_step({r: s for r in range(b)})  # a private manager: never committed
        return self._serve(xs.reshape(n, b * s, -1), step, cache, published).view(n, b, s, -1)

    def _check_input(self, xs, dim: int, layout: str):
        if not isinstance(xs, Tensor):
            raise TypeError(f"xs: expected a Tensor {layout}, got {type(xs).__name__}")
        weight = self.layers[0].q_a_proj.weight
        if xs.dim() != dim or xs.shape[0] != self.config.num_layers or xs.shape[-1] != self.config.hidden_size:
            raise ValueError(f"xs: expected {dim}-D {layout} with num_layers {self.config.num_layers} and hidden "
                             f"{self.config.hidden_size}, got shape {tuple(xs.shape)}")
        if xs.dtype != weight.dtype or xs.device != weight.device:
            raise ValueError(f"xs: expected {weight.dtype} on {weight.device} (the stack's weights), got {xs.dtype} "
                             f"on {xs.device}")

    def _serve(self, xs: Tensor, step: V41StepMeta, cache: V41StackCache, published: dict | None) -> Tensor:
        shared: dict = {} if published is None else published
        shared.clear()  # a step reads only what its own sources published
        # The live-token check once per step for every layer: each ratio's rows of one tensor.
        ratios = sorted({layer.role.ratio for layer in self.layers})
        rows = live_tokens(step, cache, *(live_counts(self.config, r) for r in ratios))
        live = {r: (*rows[:2], *rows[2 + 2 * j:4 + 2 * j]) for j, r in enumerate(ratios)}
        ys = torch.stack([layer(xs[i], step, cache, shared, live[layer.role.ratio])
                          for i, layer in enumerate(self.layers)])
        if self.tp_group is not None:
            ys = all_reduce(ys, self.tp_group)
        if published is not None:
            published["step"] = step
        return ys

    def load_deepseek_state_dict(self, state_dict: dict, strict: bool = True, block: int = checkpoint.V41_BLOCK):
        """Load DeepSeek's checkpoint names (DEEPSEEK_NAMES under `layers.{i}.`; other keys, e.g. the
        MoE's or `attn_norm`, are not the attention's and are skipped). Block-FP8 weights (e4m3 +
        `.scale` / `.weight_scale_inv` per `block` x `block` tile, UE8M0 or fp32) are dequantized on
        load, in fp32 (where e4m3 x scale is exact); the parameters keep their dtypes."""
        attn = {}
        for key, value in state_dict.items():
            head, _, rest = key.partition(".")
            layer, _, name = rest.partition(".")
            if head == "layers" and layer.isdigit() and name.startswith("attn."):
                attn[key] = value
        attn = checkpoint.dequantize_state_dict(attn, block, torch.float32)
        mapped = {}
        for key, value in attn.items():
            _, layer, name = key.split(".", 2)
            if name not in DEEPSEEK_NAMES:
                raise ValueError(f"state_dict: {key} is not a V4.1 attention parameter (known: {sorted(DEEPSEEK_NAMES)})")
            if int(layer) < self.config.num_layers:
                mapped[f"layers.{layer}.{DEEPSEEK_NAMES[name]}"] = value
        return self.load_state_dict(mapped, strict=strict)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """nn.Module.load_state_dict, all or nothing: every layer's split parameters (cut to this rank's
        share as each layer loads, dsv4ops.parallel.tp), then every key, shape and dtype rule, are
        checked before anything is copied, so a failed load leaves the stack as it was."""
        for i, layer in enumerate(self.layers):
            layer.shard(state_dict, f"layers.{i}.", cut=False)
        result = checkpoint.load_all_or_nothing(self, super().load_state_dict, state_dict, strict, assign)
        for layer in self.layers:
            layer.tie_packs()  # an assign=True load replaced the members' parameters
        return result

