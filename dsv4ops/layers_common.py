"""What V4's and V4.1's attention layers share, in one place (a cross-cutting change lands in both):
the core weights every layer has, the dtype and packing rules kept through moves and loads, the
load hooks (tensor-parallel cut, exact-cast check), the projections of x (dsv4ops.projections), the
query path into the window and the serving checks."""

from __future__ import annotations

import torch
from torch import Tensor, nn

from dsv4ops import checkpoint, projections
from dsv4ops import invariant as _invariant
from dsv4ops.fp8_linear.api import BlockFP8Linear
from dsv4ops.layer_weights import GroupedLinear, RMSNorm, linear
from dsv4ops.parallel import Group
from dsv4ops.parallel import tp as _tp
from dsv4ops.quant import formats
from dsv4ops.reference.functional import rms_norm


TP_FP8 = ("q_b_proj", "o_a_proj", "o_b_proj")  # the block-FP8 projections tensor parallelism splits


class AttentionLayer(nn.Module):
    """The core every V4 / V4.1 attention layer has (transformers' names): q_a_proj, q_a_norm,
    q_b_proj, kv_proj, kv_norm, o_a_proj, o_b_proj, sinks, the fp32 RoPE table `inv_freq`; this
    rank's `heads` and `groups` under tensor parallelism (dsv4ops.parallel.tp).

    A subclass names `NAME` (for messages), `X_PROJECTIONS` (the projections of x, in the packed
    GEMM's order), `COMPRESSOR_WEIGHTS` (those a compressor reads: held in the model dtype, an fp32
    load that it cannot hold exactly is refused), `KEEP_FP32` (name endings `.to(dtype)` keeps fp32)
    and `projection_dtype(name, dtype)` (the dtype projection `name`'s consumer computes in)."""

    NAME = ""
    X_PROJECTIONS: tuple[str, ...] = ()
    COMPRESSOR_WEIGHTS: tuple[str, ...] = ()
    KEEP_FP32: tuple[str, ...] = ()

    def _init_core(self, cfg, layer_idx: int, process_group) -> None:
        self.config, self.layer_idx = cfg, layer_idx
        self.tp_group = Group.of(process_group)
        _tp.check_divides(self.tp_group, cfg.num_heads, cfg.o_groups, f"{self.NAME}(layer {layer_idx})")
        ranks = 1 if self.tp_group is None else self.tp_group.size
        self.heads, self.groups = cfg.num_heads // ranks, cfg.o_groups // ranks  # this rank's
        h, d = self.heads, cfg.head_dim
        self.q_a_proj = linear(cfg.hidden_size, cfg.q_lora_rank)
        self.q_a_norm = RMSNorm(cfg.q_lora_rank)
        self.q_b_proj = linear(cfg.q_lora_rank, h * d)
        self.kv_proj = linear(cfg.hidden_size, d)
        self.kv_norm = RMSNorm(d)
        self.o_a_proj = GroupedLinear(cfg.num_heads * d // cfg.o_groups, self.groups * cfg.o_lora_rank, self.groups)
        self.o_b_proj = linear(self.groups * cfg.o_lora_rank, cfg.hidden_size)
        self.sinks = nn.Parameter(torch.zeros(h))
        self.register_buffer("inv_freq", cfg.inv_freq(layer_idx), persistent=False)
        # The model dtype, when every projection may hold e4m3 bytes (keep_fp8): an empty tensor that
        # `.to(dtype)` casts with the weights (not saved).
        self.register_buffer("dtype_anchor", torch.empty(0), persistent=False)

    def projection_dtype(self, name: str, dtype: torch.dtype) -> torch.dtype:
        raise NotImplementedError

    def _apply(self, fn, recurse=True):
        """`.to(dtype)` keeps the KEEP_FP32 tensors and the fp32 RoPE table in fp32; the packed
        projections are tied again (Module._apply moves each tensor on its own)."""
        super()._apply(fn, recurse)
        self._keep_fp32()
        return self

    def _keep_fp32(self) -> None:
        for name, t in [*self.named_parameters(), *self.named_buffers()]:
            if name.endswith(self.KEEP_FP32) and t.is_floating_point() and t.dtype != torch.float32:
                t.data = t.data.float()
        # Rebuilt, not widened: `.to(bfloat16)` rounded it, and no checkpoint restores a non-persistent
        # buffer. A bf16 frequency is off by up to 2^-9 relative: 1.2 rad of angle at position 740.
        self.inv_freq.data = self.config.inv_freq(self.layer_idx).to(self.inv_freq.device)
        self.tie_packs()

    def tie_packs(self) -> None:
        """Stack the projections of x into their packed GEMMs (dsv4ops.projections.tie_packs)."""
        projections.tie_packs(self)

    def load_state_dict(self, state_dict, strict: bool = True, assign: bool = False):
        """nn.Module.load_state_dict, all or nothing: every key, shape and dtype rule is checked before
        anything is copied, so a failed load leaves the layer as it was."""
        result = checkpoint.load_all_or_nothing(self, super().load_state_dict, state_dict, strict, assign)
        if assign:  # the loaded tensors replaced the parameters: the model dtype and device are theirs
            held = [p for n, p in self.named_parameters() if not n.endswith(self.KEEP_FP32) and p.element_size() > 1]
            dtype = held[0].dtype if held else self.dtype_anchor.dtype
            self.dtype_anchor = torch.empty(0, dtype=dtype, device=self.sinks.device)
        self.tie_packs()  # an assign=True load replaced the members' parameters
        return result

    def shard(self, state_dict: dict, prefix: str, cut: bool = True) -> None:
        """Cut the full tensors of the split parameters in state_dict to this rank's share (cut=False:
        only check them; dsv4ops.parallel.tp.shard_: a shard raises, with or without a process group)."""
        blocks = {n: m.block for n in TP_FP8 if isinstance(m := getattr(self, n), BlockFP8Linear)}
        _tp.shard_(state_dict, prefix, self.tp_group, _tp.full_shapes(self.config, blocks),
                   f"{self.NAME}(layer {self.layer_idx})", cut)

    def _load_from_state_dict(self, state_dict, prefix, *args, **kwargs):
        """Loading (as a module of its own or inside another) cuts the split parameters to this rank's
        share and refuses a compressor weight its parameter's dtype cannot hold exactly, before
        anything loads."""
        self.shard(state_dict, prefix)
        for name in self.COMPRESSOR_WEIGHTS:
            given, mine = state_dict.get(prefix + name), projections.parameter(self, name)
            if isinstance(given, Tensor) and mine is not None and given.dtype != mine.dtype:
                checkpoint.check_exact_cast(given, mine.dtype, prefix + name)
        super()._load_from_state_dict(state_dict, prefix, *args, **kwargs)


def query(layer: AttentionLayer, px: dict[str, Tensor], pos: Tensor, req: Tensor, window: Tensor, ring: int,
          fmt: str, head_norm: bool, invariant: bool = False) -> tuple[Tensor, Tensor]:
    """(qr, q_rot): the q latent (q_a, normed; the indexer's query reads it) and the roped query,
    through qkv_prep, which also writes the tokens' kv rows (kv, normed) into `window` (format
    `fmt`). head_norm: V4's per-head query RMSNorm (V4.1 has none). invariant: q_b batch-invariant
    (dsv4ops.invariant)."""
    cfg, eps = layer.config, layer.config.rms_norm_eps
    qr = rms_norm(px["q_a_proj"], layer.q_a_norm.weight, eps)
    q = _invariant.linear(layer.q_b_proj, qr, invariant).view(qr.shape[0], layer.heads, cfg.head_dim)
    kv = rms_norm(px["kv_proj"], layer.kv_norm.weight, eps)
    q_rot = torch.empty_like(q)
    torch.ops.dsv4.qkv_prep(q, kv, pos, req, layer.inv_freq, q_rot, window, ring, eps, head_norm, fmt)
    return qr, q_rot


def indexer_query(q: Tensor, fmt: str) -> Tensor:
    """The indexer_q_prep output for query q [T, H, d] and key format `fmt`: e4m3 rows (fp8_132),
    packed 68-B rows (mxfp4_68) or rows in q's dtype."""
    if fmt == "mxfp4_68":
        return torch.empty(q.shape[0], q.shape[1], formats.FORMATS[fmt].row_bytes, dtype=torch.uint8, device=q.device)
    return torch.empty(q.shape, dtype=torch.float8_e4m3fn if fmt == "fp8_132" else q.dtype, device=q.device)


def serving_cache(module: nn.Module, who: str, owner: str, arg: str, x: Tensor, step, ndim: int, dims: str,
                  tokens: int):
    """The attached cache of a serving forward(x, step); in eager mode first the checks that keep a
    bad call from writing anything: a cache is attached, x has the serving shape, the step is this
    manager's open step for `tokens` rows."""
    cache = module._modules.get("cache")
    if not torch.compiler.is_compiling():
        if cache is None:
            raise RuntimeError(f"{who}: no cache attached; call {owner}.attach_cache(manager) before a serving forward "
                               f"(forward({arg}, step))")
        module._check_input(x, ndim, dims)
        module.cache_manager.check_step(step, tokens)
        _tp.agree(module, f"{who}.forward", {"step": step.origin.step_id, "tokens": tokens})
    return cache


def check_manager(owner: nn.Module, manager, device: torch.device, what: str) -> None:
    """attach_cache's checks that V4's layer and V4.1's stack share: the manager's formats (unless the
    owner follows its cache's), device, and not context parallel under tensor parallelism."""
    if manager.cfg.formats != owner.formats and not owner.follows_cache:
        raise ValueError(f"manager: its pools hold {manager.cfg.formats}, the {what} computes {owner.formats} (build "
                         f"the {what} with formats=manager.cfg.formats, or with none to take the cache's)")
    if manager.device != device:
        raise ValueError(f"manager: plans steps on {manager.device}, the {what} is on {device}")
    if manager.dcp.size > 1 and owner.tp_group is not None:
        raise NotImplementedError(f"manager: a context-parallel cache for a tensor-parallel {what} (both process "
                                  f"groups at once) is not supported; use one or the other")
    if manager.cfg.batch_invariant and (manager.dcp.size > 1 or owner.tp_group is not None):
        # The all-reduce / the ranks' merge sums in an order the collective picks by message size.
        raise NotImplementedError("manager: CacheConfig(batch_invariant=True) is not supported with tensor or "
                                  "context parallelism (their reductions' order follows the step's size)")
    at = f"(layer {owner.layer_idx})" if hasattr(owner, "layer_idx") else ""
    _tp.agree(owner, f"{type(owner).__name__}{at}.attach_cache", {})
