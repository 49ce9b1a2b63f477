"""Drop-in layers. Parameter names equal transformers' `DeepseekV4Attention`, so
`layer.load_state_dict(hf_layer.state_dict(), strict=True)` works; `load_deepseek_state_dict` reads
DeepSeek's checkpoint names (DEEPSEEK_NAMES) and block-FP8 weights (dequantized, or kept as FP8 in
the bf16 projections: FP8_PROJECTIONS)."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dsv4ops import checkpoint, invariant, projections
from dsv4ops import layers_dcp as _dcp
from dsv4ops._autograd import no_backward
from dsv4ops.cache.config import CacheConfig, v4_numerics
from dsv4ops.cache.manager import KVCacheManager
from dsv4ops.cache.pools import LayerCache
from dsv4ops.cache.step import StepMeta, live_tokens
from dsv4ops.config import CSA, SLIDING, DSV4AttentionConfig
from dsv4ops.fp8_linear.api import BlockFP8Linear
from dsv4ops.layer_weights import Compressor, GroupedLinear, linear
from dsv4ops.layers_common import TP_FP8, AttentionLayer, check_manager, indexer_query, query, serving_cache
from dsv4ops.indexer.reference import query_values
from dsv4ops.parallel import all_reduce
from dsv4ops.parallel import tp as _tp
from dsv4ops.quant.formats import CacheFormats
from dsv4ops.reference.functional import grouped_o_a
from dsv4ops.reference.numerics import Numerics, compressor_dtype


# DeepSeek's checkpoint names (inference/model.py) -> this module's (transformers'), under
# `layers.{i}.`: the renames transformers' conversion mapping applies to DeepSeek-V4 checkpoints.
# The attention core's names, V4's and V4.1's:
DEEPSEEK_CORE_NAMES = {
    "attn.wq_a.weight": "q_a_proj.weight",
    "attn.q_norm.weight": "q_a_norm.weight",
    "attn.wq_b.weight": "q_b_proj.weight",
    "attn.wkv.weight": "kv_proj.weight",
    "attn.kv_norm.weight": "kv_norm.weight",
    "attn.wo_a.weight": "o_a_proj.weight",
    "attn.wo_b.weight": "o_b_proj.weight",
    "attn.attn_sink": "sinks",
}
DEEPSEEK_NAMES = {
    **DEEPSEEK_CORE_NAMES,
    "attn.compressor.wkv.weight": "compressor.kv_proj.weight",
    "attn.compressor.wgate.weight": "compressor.gate_proj.weight",
    "attn.compressor.ape": "compressor.position_bias",
    "attn.compressor.norm.weight": "compressor.kv_norm.weight",
    "attn.indexer.wq_b.weight": "compressor.indexer.q_b_proj.weight",
    "attn.indexer.weights_proj.weight": "compressor.indexer.scorer.weights_proj.weight",
    "attn.indexer.compressor.wkv.weight": "compressor.indexer.kv_proj.weight",
    "attn.indexer.compressor.wgate.weight": "compressor.indexer.gate_proj.weight",
    "attn.indexer.compressor.ape": "compressor.indexer.position_bias",
    "attn.indexer.compressor.norm.weight": "compressor.indexer.kv_norm.weight",
}


# The projections `load_deepseek_state_dict(..., keep_fp8=True)` keeps block-FP8 (BlockFP8Linear):
# every block-FP8 one of V4's checkpoints (o_a_proj grouped: fp8_linear's block-diagonal form). The
# compressors' are bf16 in the checkpoint and stay so.
FP8_PROJECTIONS = ("q_a_proj", "q_b_proj", "kv_proj", "o_a_proj", "o_b_proj", "compressor.indexer.q_b_proj")
_DEEPSEEK_KEY = {v: k for k, v in DEEPSEEK_NAMES.items()}
# The compressors' projection weights: bf16 in the checkpoint (spec 1.3) and held in the model dtype.
# Outside exact mode their a, z compute in fp32 (the packed GEMM's fp32 output, dsv4ops.packing).
COMPRESSOR_WEIGHTS = ("compressor.kv_proj.weight", "compressor.gate_proj.weight",
                      "compressor.indexer.kv_proj.weight", "compressor.indexer.gate_proj.weight")
# The projections of the layer input x, in the order the packed GEMM stacks them (those present as
# nn.Linear: a layer kind without a compressor or indexer, or q_a / kv kept block-FP8, has fewer).
X_PROJECTIONS = ("q_a_proj", "kv_proj", "compressor.indexer.scorer.weights_proj", "compressor.kv_proj",
                 "compressor.gate_proj", "compressor.indexer.kv_proj", "compressor.indexer.gate_proj")


class DeepseekV4Attention(AttentionLayer):
    """One DeepSeek-V4 attention layer (sliding window, CSA or HCA by `layer_idx`).

    `config` is a `DSV4AttentionConfig` or a transformers `DeepseekV4Config`. `formats` (a
    `dsv4ops.CacheFormats`) are the row formats of the cache pools, i.e. the rounding of the window
    KV, the compressed entries and the indexer (`self.numerics`: their modes in the oracle,
    `dsv4ops.reference.numerics`); CacheFormats.exact() = transformers. None (the default): the
    formats of the first cache the layer attaches to (CacheConfig's default: CacheFormats.v4()),
    and until then exact, the drop-in transformers layer. Given explicitly, a cache of other formats
    is refused. The compressor projection weights are held in the model dtype in every format
    (their GEMM accumulates and writes fp32: dsv4ops.projections).

    forward(hidden_states [B, S, hidden]) -> [B, S, hidden]: causal attention over each sequence
    from position 0 (stateless). An inference module: forward runs in grad mode too, and a backward
    through its output raises a RuntimeError (the dsv4:: ops have no backward).

    `process_group` (torch.distributed): tensor parallelism over its ranks (dsv4ops.parallel.tp). This
    rank holds `heads` = num_heads / ranks query heads and `groups` = o_groups / ranks output groups
    (parameter names unchanged, shapes this rank's); the rest is replicated, and forward returns
    the whole layer's output (its o_b share summed over the ranks, one all-reduce). Every rank runs
    the same forward on the same input. `load_state_dict` and `load_deepseek_state_dict` take the
    full tensors and keep this rank's share."""

    NAME = "DeepseekV4Attention"
    X_PROJECTIONS, COMPRESSOR_WEIGHTS = X_PROJECTIONS, COMPRESSOR_WEIGHTS
    KEEP_FP32 = ("sinks", "position_bias", "norm.weight", "state")  # as transformers (and the compressor states)

    def __init__(self, config, layer_idx: int, formats: CacheFormats | None = None, process_group=None, **renamed):
        super().__init__()
        if "numerics" in renamed or isinstance(formats, Numerics):
            raise TypeError("DeepseekV4Attention: numerics was replaced by formats=dsv4ops.CacheFormats(window=..., "
                            "comp=..., index=...) (presets CacheFormats.v4(), .exact(); None: the attached cache's)")
        if renamed:
            raise TypeError(f"DeepseekV4Attention: unexpected keyword argument {sorted(renamed)[0]!r}")
        if isinstance(config, DSV4AttentionConfig):
            cfg = config
        elif hasattr(config, "compress_rates"):  # a transformers DeepseekV4Config
            cfg = DSV4AttentionConfig.from_hf(config)
        else:
            raise TypeError(f"config: expected a DSV4AttentionConfig or a transformers DeepseekV4Config, got "
                            f"{type(config).__name__} (from a config.json dict: transformers.DeepseekV4Config(**d); "
                            f"a V4.1 config: DeepseekV41AttentionStack)")
        # Without formats the layer computes exact until a cache gives it formats.
        self.follows_cache = formats is None
        self.formats = CacheFormats.exact() if formats is None else formats
        self.numerics = v4_numerics(self.formats)
        self.layer_type = cfg.layer_type(layer_idx)  # checks 0 <= layer_idx < num_layers
        self._init_core(cfg, layer_idx, process_group)
        self.compressor = None if self.layer_type == SLIDING else Compressor(cfg, cfg.compress_ratio(layer_idx))
        self._keep_fp32()  # also when built under another default dtype

    def projection_dtype(self, name: str, dtype: torch.dtype) -> torch.dtype:
        """The compressors' a, z in compressor_dtype of their mode, the others in x's dtype."""
        if name + ".weight" not in COMPRESSOR_WEIGHTS:
            return dtype
        return compressor_dtype(self.numerics.indexer if name.startswith("compressor.indexer.") else self.numerics.kv,
                                dtype)

    def load_deepseek_state_dict(self, state_dict: dict, strict: bool = True, block: int = checkpoint.V4_BLOCK,
                                 keep_fp8: bool = False):
        """Load this layer's weights from a DeepSeek-V4 checkpoint dict (DEEPSEEK_NAMES under
        `layers.{layer_idx}.`; other layers' and non-attention keys are skipped). Block-FP8 weights
        (e4m3 + `.scale` / `.weight_scale_inv` per `block` x `block` tile, UE8M0 or fp32) are
        dequantized on load, in fp32 (where e4m3 x scale is exact); the parameters keep their dtypes.

        keep_fp8=True: the FP8_PROJECTIONS that arrive block-FP8 become BlockFP8Linear modules
        holding the checkpoint's bytes and scales (fp32 for bf16 / fp16 scales; block 128 or 32),
        computed by dsv4::fp8_linear (half the weight bytes per decode step); the compressors'
        projections and o_a_proj are dequantized as before. A projection loaded from a dequantized
        weight becomes an nn.Linear again."""
        prefix = f"layers.{self.layer_idx}."
        mine = {k[len(prefix):]: v for k, v in state_dict.items() if k.startswith(prefix + "attn.")}
        kept = {}  # projection -> (e4m3 weight, scale)
        for name in FP8_PROJECTIONS if keep_fp8 else ():
            key = _DEEPSEEK_KEY[name + ".weight"]
            sk = checkpoint.scale_key(mine, key)
            if key in mine and sk is not None:
                checkpoint.check_block_fp8(mine[key], mine[sk], block, name=prefix + key)
                if self.tp_group is not None and name in TP_FP8:
                    _tp.check_fp8_split(prefix + key, tuple(mine[key].shape), _tp.SPLIT[name + ".weight"][0],
                                        self.tp_group, block)
                scale = mine.pop(sk)
                kept[name] = (mine.pop(key), scale if scale.dtype == torch.float8_e8m0fnu else scale.float())
        mine = checkpoint.dequantize_state_dict(mine, block, torch.float32)
        unknown = sorted(set(mine) - set(DEEPSEEK_NAMES))
        if unknown:
            raise ValueError(f"state_dict: {prefix}{unknown[0]} is not a V4 attention parameter (known: "
                             f"{sorted(DEEPSEEK_NAMES)})")
        mapped = {DEEPSEEK_NAMES[k]: v for k, v in mine.items()}
        swapped = {}  # projection -> the module it replaced
        try:
            for name in FP8_PROJECTIONS:
                if name in kept:
                    w, scale = kept[name]
                    mapped[name + ".weight"], mapped[name + ".weight_scale_inv"] = w, scale
                    swapped[name] = self._set_projection(name, block, scale.dtype)
                elif name + ".weight" in mapped:
                    swapped[name] = self._set_projection(name, None, None)
            return self.load_state_dict(mapped, strict=strict)
        except Exception:
            for name, module in swapped.items():
                owner, _, attr = name.rpartition(".")
                setattr(self.get_submodule(owner), attr, module)
            self.tie_packs()
            raise

    def _set_projection(self, name: str, block: int | None, scale_dtype) -> nn.Module:
        """Make projection `name` a BlockFP8Linear of `block` x `block` tiles with `scale_dtype`
        scales (block None: an nn.Linear, or o_a_proj's GroupedLinear, in the model dtype); returns the
        module it replaces."""
        owner, _, attr = name.rpartition(".")
        parent = self.get_submodule(owner)
        old = getattr(parent, attr)
        n, k = old.weight.shape
        device, grouped = old.weight.device, name == "o_a_proj"
        if block is not None:
            same = isinstance(old, BlockFP8Linear) and (old.block, old.weight_scale_inv.dtype) == (block, scale_dtype)
            new = old if same else BlockFP8Linear(k, n, block, scale_dtype, device=device,
                                                  groups=self.groups if grouped else 1)
        elif isinstance(old, GroupedLinear if grouped else nn.Linear):
            new = old
        else:
            new = (GroupedLinear(k, n, self.groups) if grouped else linear(k, n)).to(device, self.dtype_anchor.dtype)
        setattr(parent, attr, new)
        self.tie_packs()
        return old

    def attach_cache(self, manager: KVCacheManager) -> None:
        """Give the layer its pools (sized by the manager's CacheConfig, on the layer's device) and
        register them with the manager (abort restores their compressor states; their `generations`
        follow the manager's slots). Attach after moving the layer, before compiling; the serving
        forward then reads and writes the pools in place."""
        if not all(hasattr(manager, name) for name in ("model", "cfg", "device", "attach", "check_step")):
            raise TypeError(f"manager: expected a dsv4ops.cache.KVCacheManager, got {type(manager).__name__}")
        for field in _CACHE_LAYOUT:
            mine, theirs = getattr(self.config, field), getattr(manager.model, field)
            if mine != theirs:
                raise ValueError(f"manager: built for a model with {field} {theirs}, the layer's config has {mine}")
        cfg, device, dcp = manager.cfg, self.q_a_proj.weight.device, manager.dcp
        check_manager(self, manager, device, "layer")
        cache = LayerCache(self.config, self.layer_idx, cfg, device=device, topk_workspace=manager.topk_workspace(device),
                           dcp=dcp, dcp_topk=getattr(manager, "dcp_topk", "exact"))
        manager.attach(cache)
        if self.follows_cache:
            self._take_formats(cfg.formats)
        self.cache = cache
        self.cache_manager = manager

    def _take_formats(self, fmts: CacheFormats) -> None:
        """Compute `fmts` from now on (a layer built without formats, at its first attach). No weight
        changes: the compressors' are held in the model dtype in every format (dsv4ops.projections)."""
        self.formats, self.numerics, self.follows_cache = fmts, v4_numerics(fmts), False

    def forward(self, hidden_states: Tensor, step: StepMeta | None = None) -> Tensor:
        """step=None: hidden_states [B, S, hidden], each row a sequence from position 0 (a private
        cache is built for the call). With a step: hidden_states [T, hidden], the step's flat batch
        (padded to its bucket), reading and writing the attached cache.

        The step must be the open step of the manager this layer is attached to, planned while its
        requests held their current slots: in eager mode a foreign, stale or closed step (or, on
        the CPU, one edited by hand) raises before anything is written. A compiled forward cannot
        raise without a host sync, so it keeps the contract on the device: a token whose slot's
        generation differs from the step's (KVCacheManager gives slots a new generation on admit,
        release, commit and abort; generations are unique across managers), or whose position is
        outside [0, max_context), becomes padding: it reads and writes nothing and its row is 0."""
        # Inference only: the ops run without autograd, and a backward through the output raises.
        with torch.no_grad():
            y = self._forward(hidden_states, step)
        if not torch.is_grad_enabled():
            return y
        return no_backward(y, (hidden_states, *self.parameters()),
                           f"{type(self).__name__}(layer {self.layer_idx}, {self.layer_type})")

    def _forward(self, hidden_states: Tensor, step: StepMeta | None) -> Tensor:
        if step is not None:
            cache = serving_cache(self, f"{type(self).__name__}(layer {self.layer_idx})", "layer", "x", hidden_states,
                                  step, 2, "[tokens, hidden]", hidden_states.shape[0])
            return _attend(self, hidden_states, step, cache)
        if not torch.compiler.is_compiling():
            self._check_input(hidden_states, 3, "[batch, seq, hidden]")
            _tp.agree(self, f"{type(self).__name__}(layer {self.layer_idx}).forward", {"shape": hidden_states.shape})
        b, s, _ = hidden_states.shape
        cfg = CacheConfig(max_requests=b, max_context=s, max_step_tokens=b * s, max_request_step_tokens=s,
                          buckets=(b * s,), formats=self.formats, exact_dtype=hidden_states.dtype)
        manager = KVCacheManager(self.config, cfg, device=hidden_states.device)
        cache = LayerCache(self.config, self.layer_idx, cfg, device=hidden_states.device)
        manager.attach(cache)
        for r in range(b):
            manager.admit(r)
        step = manager.prepare_step({r: s for r in range(b)})  # a private manager: never committed
        return _attend(self, hidden_states.reshape(b * s, -1), step, cache).view(b, s, -1)

    def _check_input(self, x, dim: int, layout: str):
        if not isinstance(x, Tensor):
            raise TypeError(f"hidden_states: expected a Tensor {layout}, got {type(x).__name__}")
        weight = self.dtype_anchor  # the model dtype (every projection may hold e4m3 bytes)
        if x.dim() != dim:
            raise ValueError(f"hidden_states: expected {dim}-D {layout}, got shape {tuple(x.shape)}")
        if x.shape[-1] != self.config.hidden_size:
            raise ValueError(f"hidden_states: expected hidden size {self.config.hidden_size} (last dim), got "
                             f"{x.shape[-1]}")
        if x.dtype != weight.dtype:
            raise ValueError(f"hidden_states: expected dtype {weight.dtype} (the layer's weights), got {x.dtype}")
        if x.device != weight.device:
            raise ValueError(f"hidden_states: expected device {weight.device} (the layer's), got {x.device}")
        if dim == 3 and 0 in x.shape[:2]:
            raise ValueError(f"hidden_states: expected at least one sequence of at least one token, got shape "
                             f"{tuple(x.shape)}")


# The model numbers a cache's layout depends on: a manager built for other values would hand the
# layer pools and tables of another shape.
_CACHE_LAYOUT = ("window", "head_dim", "rope_head_dim", "index_head_dim", "csa_ratio", "hca_ratio", "compress_ratios")


def _attend(layer: DeepseekV4Attention, x: Tensor, step: StepMeta, cache: LayerCache, core=None) -> Tensor:
    """kv insert -> compressors (before attention) -> indexer -> sparse attention -> output, through
    the dsv4:: ops; no host sync, no data-dependent branch. The ops are called directly rather than
    through the public functions: the step planner has already checked every value, and their eager
    value checks would sync the host each step. `core(q_rot, comp_cache, comp_fmt, comp_idx, comp_lens)
    -> o` replaces dsv4::sparse_attn (one rank): the benchmark's seam for another library's kernel."""
    cfg, ops = layer.config, torch.ops.dsv4
    eps = cfg.rms_norm_eps
    t, kind, ratio = x.shape[0], layer.layer_type, cfg.compress_ratio(layer.layer_idx)
    # comp_idx's columns: none (sliding); the indexer's top-k (CSA: it lists the entries first, so the
    # first min(visible, k) columns hold them all); every entry of the request's block table (HCA).
    width = (0 if kind == SLIDING else cfg.index_topk if kind == CSA
             else step.block_table(kind).shape[1] * cache.cfg.block_size)
    pos, req, visible, comp_lens = live_tokens(step, cache, (ratio, width))
    inv = cache.cfg.batch_invariant  # every GEMM's rows independent of the step's other tokens
    px = projections.project_x(layer, x, inv)
    fmt = cache.fmt
    qr, q_rot = query(layer, px, pos, req, cache.window, cache.ring_size, fmt["window"], head_norm=True,
                      invariant=inv)

    comp_cache, comp_fmt = cache.window, fmt["window"]
    comp_idx = torch.empty(t, 0, dtype=torch.int32, device=x.device)
    if layer.compressor is not None:
        c = layer.compressor
        _compress(c, px["compressor.kv_proj"], px["compressor.gate_proj"], pos, req, step.entry_slots(kind),
                  layer.inv_freq, cache.state, cache.comp, fmt["comp"], eps, inv)
        comp_cache, comp_fmt = cache.comp, fmt["comp"]
        dcp = cache.dcp
        if kind == CSA:
            _compress(c.indexer, px["compressor.indexer.kv_proj"], px["compressor.indexer.gate_proj"], pos, req,
                      step.entry_slots(kind), layer.inv_freq, cache.index_state, cache.index, fmt["index"], eps, inv,
                      hadamard=indexer_rotates(layer.numerics))
            w = px["compressor.indexer.scorer.weights_proj"]
            if dcp.size == 1:
                comp_idx = _select(c.indexer, w, qr, step, pos, req, layer, cache)
            else:
                comp_idx, comp_lens, _ = _select_dcp(c.indexer, w, qr, step, pos, req, layer, cache, visible)
        else:  # HCA: every complete entry of the token's request (context parallel: of this rank's blocks)
            table, bs = step.block_table(kind), cache.cfg.block_size
            comp_idx = torch.empty(t, width, dtype=torch.int32, device=x.device)
            if dcp.size == 1:
                ops.visible_entries(table, pos, req, comp_idx, ratio, bs)
            else:  # the rank's compact entries c < n_local, as ratio-1 entries of "position" n_local - 1
                n_local = _dcp.owned_count(visible, bs, dcp)
                ops.visible_entries(table, n_local - 1, req, comp_idx, 1, bs)
                comp_lens = n_local.clamp(max=comp_idx.shape[1])

    if core is not None and cache.dcp.size == 1:
        o = core(q_rot, comp_cache, comp_fmt, comp_idx, comp_lens)
    elif cache.dcp.size == 1:
        o = torch.empty_like(q_rot)
        ops.sparse_attn(q_rot, cache.window, comp_cache, pos, req, comp_idx, comp_lens, step.window_ends, layer.sinks,
                        o, cfg.head_dim**-0.5, cfg.window, cache.ring_size, fmt["window"], comp_fmt, None, inv)
    else:  # context parallel: this rank's share, merged over the ranks with the sink
        o = _dcp.attend(q_rot, cache.window, comp_cache, pos, req, comp_idx, comp_lens, step.window_ends, layer.sinks,
                        cfg.head_dim**-0.5, cfg.window, cache.ring_size, fmt["window"], comp_fmt, cache.dcp)
    o_rot = torch.empty_like(o)
    ops.inv_rope(o, pos, layer.inv_freq, o_rot)
    o_a = layer.o_a_proj
    if isinstance(o_a, BlockFP8Linear):  # grouped block-FP8 (keep_fp8)
        z = invariant.linear(o_a, o_rot.flatten(1), inv)
    else:
        z = (invariant.grouped_o_a if inv else grouped_o_a)(o_rot, o_a.weight, layer.groups)
    y = invariant.linear(layer.o_b_proj, z, inv)
    # Tensor parallel: this rank's heads' share of the output; the sum over the ranks is the layer's.
    return y if layer.tp_group is None else all_reduce(y, layer.tp_group)


def indexer_rotates(numerics: Numerics) -> bool:
    """V4's MXFP4 indexer rotates its query and keys by the Hadamard before E2M1 (spec 3.3, 3.4: the
    numerics it was trained with; one side alone would change every score)."""
    return numerics.indexer == "mxfp4"


def _compress(c, a, z, pos, req, entry_slots, inv_freq, state, pool, fmt, eps, inv, hadamard=False):
    torch.ops.dsv4.compressor_update(a, z, c.position_bias, pos, req, entry_slots, c.kv_norm.weight, inv_freq, state,
                                     pool, None, eps, fmt, hadamard, inv)


def _index_query(indexer, w, qr, pos, layer, cache) -> tuple[Tensor, Tensor]:
    """(q_out, w_out) of indexer_q_prep: the indexer's prepared query and head weights (w: the head
    weights' projection of x)."""
    cfg, t = layer.config, w.shape[0]
    q = invariant.linear(indexer.q_b_proj, qr, cache.cfg.batch_invariant)
    q = q.view(t, cfg.index_n_heads, cfg.index_head_dim)
    fmt = cache.fmt["index"]
    q_out = indexer_query(q, fmt)
    w_out = torch.empty(w.shape, dtype=torch.float32, device=w.device)
    torch.ops.dsv4.indexer_q_prep(q, w, pos, layer.inv_freq, q_out, w_out, fmt, indexer_rotates(layer.numerics))
    return q_out, w_out


def _select(indexer, w, qr, step, pos, req, layer, cache):
    """The indexer's top-k: [T, index_topk] global slots of the CSA pools (-1: none)."""
    cfg, t = layer.config, w.shape[0]
    q_out, w_out = _index_query(indexer, w, qr, pos, layer, cache)
    idx = torch.empty(t, cfg.index_topk, dtype=torch.int32, device=w.device)
    torch.ops.dsv4.indexer_topk(q_out, w_out, pos, req, cache.index, step.block_table(CSA), None, idx, None,
                                cache.topk_workspace, cfg.csa_ratio, 0, cache.fmt["index"])
    return idx


def _select_dcp(indexer, w, qr, step, pos, req, layer, cache, visible):
    """Context parallel (dsv4ops.parallel.dcp): the top-k of this rank's entries, merged over the group
    ("exact") or kept ("union") -> (this rank's key list [T, k] pool slots, valid first; their
    count [T]; the selection as entries of the tokens' requests [T, k], -1 none). visible: the
    tokens' complete CSA entries (live_tokens)."""
    cfg, t, g = layer.config, w.shape[0], cache.dcp
    bs, fmt, table = cache.cfg.block_size, cache.fmt["index"], step.block_table(CSA)
    q_out, w_out = _index_query(indexer, w, qr, pos, layer, cache)
    n_local = _dcp.owned_count(visible, bs, g)
    idx = torch.empty(t, cfg.index_topk, dtype=torch.int32, device=w.device)
    torch.ops.dsv4.indexer_topk(q_out, w_out, n_local - 1, req, cache.index, table, None, idx, None,
                                cache.topk_workspace, 1, 0, fmt)
    entries = _dcp.slot_entries(idx, getattr(cache, f"block_index_{CSA}"), bs)
    if cache.dcp_topk == "union":
        return idx, (idx >= 0).sum(1).to(torch.int32), entries
    scores = _dcp.entry_scores(query_values(q_out), w_out, cache.index, idx, fmt)
    merged = _dcp.merge_best(entries, scores, cfg.index_topk, g)
    return (*_dcp.front(_dcp.local_slots(merged, req, table, bs, g)), merged)
