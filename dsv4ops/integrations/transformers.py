"""Run a transformers DeepSeek-V4 model on dsv4ops.

    model = DeepseekV4ForCausalLM.from_pretrained(path, dtype=torch.bfloat16, device_map="cuda")
    patch_model(model, CacheConfig(max_requests=8, max_context=8192, max_step_tokens=2048))
    out = model.generate(**tokenizer(prompts, padding=True, return_tensors="pt").to("cuda"))

`patch_model` swaps every attention module (and, with `routers=True`, every MoE router) for
dsv4ops' with the same weights (block-FP8 ones dequantized) and keeps the KV in one KVCacheManager
per model, so `model(...)` and `model.generate(...)` run the dsv4:: ops over the paged cache.

How a call maps onto the cache. `past_key_values` is a `PagedCache` (transformers' `Cache`
interface; the patched model makes one where transformers would make its own): each batch row is a
request of the manager. A row's real tokens (attention_mask 1; left or right padding alike) continue
its request at the request's own length, so positions come from the cache, not from
`position_ids`, and padding is neither stored nor attended. One forward is one step of every row's
real tokens, committed when the forward returns and aborted if it raises. An empty transformers
cache passed in (generate's first call) is replaced by a PagedCache, which the model returns in its
output: passing the transformers cache again is refused (it holds none of the tokens). A mask is
padding only before or after a row's tokens: a 0 between 1s (what generate infers when a prompt
holds pad_token_id and no attention_mask is given) is refused. Without a cache
(`use_cache=False`) each row's real tokens run stateless from position 0. The unpatched model has no
per-row lengths: with padding its compressors pool the padding into compressed entries, so a padded
row differs there from the same prompt alone; a patched model's padded row equals its unpadded run.

transformers builds no attention mask for a patched model (the cache holds the causality): its
config's attention implementation becomes "dsv4ops". A prompt longer than the cache's tokens per
step runs with `generate(..., prefill_chunk_size=n)`. transformers has no DeepSeek-V4.1 model; V4.1
runs through `dsv4ops.DeepseekV41AttentionStack`.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import itertools
import weakref
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from transformers import Cache
from transformers.models.deepseek_v4 import modeling_deepseek_v4 as hf

from dsv4ops import checkpoint, invariant_mode
from dsv4ops.cache.config import CacheConfig
from dsv4ops.cache.manager import CacheFullError, KVCacheManager
from dsv4ops.cache.step import StepMeta
from dsv4ops.config import DSV4AttentionConfig
from dsv4ops.layers import DeepseekV4Attention
from dsv4ops.router.modules import DeepseekV4HashRouter, DeepseekV4Router

# transformers builds masks only for the implementations it registers masks for; this name is not one.
ATTN_IMPLEMENTATION = "dsv4ops"
_REQUEST_IDS = itertools.count()
# The empty transformers caches a patched model took a call's tokens from (weakly held).
_ADOPTED: weakref.WeakSet = weakref.WeakSet()


def default_cache_config(config) -> CacheConfig:
    """8 requests of up to 4096 positions, 1024 tokens per step, FP8 pools (V4's 584-B entries)."""
    return CacheConfig(max_requests=8, max_context=min(4096, config.max_position_embeddings), max_step_tokens=1024)


def patch_model(model: nn.Module, cache_config: CacheConfig | None = None, *, routers: bool = False,
                compile: bool | dict = False, process_group=None, dcp_group=None, **renamed) -> nn.Module:
    """Swap the attention of a transformers `DeepseekV4ForCausalLM` / `DeepseekV4Model` for
    dsv4ops' (in place; returns `model`). Move and cast the model first: the pools are allocated on
    its device, the layers take its dtype (the compressor projection weights too, bf16 as in the
    checkpoint: their GEMM writes fp32). `cache_config` sizes the paged cache and picks its formats
    (default: `default_cache_config`); `routers=True` swaps the MoE routers too; `compile=True` (or
    a dict of `torch.compile` options) compiles each layer's serving step (fullgraph; one graph per
    layer and batch bucket). Parallel (torch.distributed groups; every rank runs the same calls, the
    rest of the model replicated; one of the two): `process_group`, tensor parallel, each attention
    layer keeps this rank's heads and output groups of the model's weights and sums its output over
    the ranks (dsv4ops.parallel.tp); `dcp_group`, decode context parallel, the ranks share the
    cache's compressed entries by block and merge their attention (dsv4ops.parallel.dcp)."""
    if "parallel" in renamed:
        raise TypeError("patch_model: parallel= was removed: pass process_group=group for tensor parallel, "
                        "dcp_group=group for decode context parallel")
    if renamed:
        raise TypeError(f"patch_model: unexpected keyword argument {sorted(renamed)[0]!r}")
    if process_group is not None and dcp_group is not None:
        raise NotImplementedError("patch_model: process_group (tensor parallel) and dcp_group (decode context "
                                  "parallel) at once is not supported; pass one")
    inner = _decoder(model)
    if hasattr(inner, "_dsv4ops_patch"):
        raise ValueError("model: already patched by dsv4ops")
    if cache_config is not None and not isinstance(cache_config, CacheConfig):
        raise TypeError(f"cache_config: expected a dsv4ops CacheConfig or None, got {type(cache_config).__name__}")
    cfg = DSV4AttentionConfig.from_hf(inner.config)
    cache_config = cache_config or default_cache_config(inner.config)
    embed = inner.embed_tokens.weight
    manager = KVCacheManager(cfg, cache_config, device=embed.device, dcp_group=dcp_group)
    patch = _Patch(manager, _compile_options(compile))
    block = _fp8_block(inner.config)
    for decoder_layer in inner.layers:
        attn = TransformersAttention(decoder_layer.self_attn, cfg, patch, embed.dtype, block, process_group)
        attn.attach_cache(manager)
        decoder_layer.self_attn = attn
        if routers:
            decoder_layer.mlp.gate = _router(decoder_layer.mlp.gate, inner.config, cache_config.batch_invariant)
    inner._dsv4ops_patch = patch
    inner.forward = _patched_forward(inner, patch)
    if cache_config.batch_invariant:  # the model's own GEMMs and pointwise ops too (lm_head's included)
        model.forward = _invariant_forward(model.forward)
    inner.config._attn_implementation = ATTN_IMPLEMENTATION
    return model


@dataclass
class _Call:
    """What one model forward runs: `shape` (batch, columns); `rows`: flat indices (into batch x
    columns) of the real tokens, row by row; `step`: the cache step they form, or None; `groups`
    (no step): [rows, tokens] flat indices of the rows that run stateless, one tensor per length."""

    shape: tuple[int, int]
    rows: Tensor
    step: StepMeta | None
    groups: list[Tensor]


class _Patch:
    """The state a patched model's modules share: the manager, the compile options, the call."""

    def __init__(self, manager: KVCacheManager, compile_options: dict | None):
        self.manager, self.compile_options = manager, compile_options
        self.call: _Call | None = None


class PagedCache(Cache):
    """transformers' `past_key_values` of a patched model: one request of the model's
    KVCacheManager per batch row (admitted at the first forward, released by `release()`, `reset()`
    or when the cache is garbage-collected; a released cache is refused by the model, a reset one
    starts over). `get_seq_length()` counts the columns seen, padding included (what `generate`
    slices its inputs by); `lengths()` the tokens each row holds. Beam search and cropping
    (rewinding a compressor state) are not supported."""

    is_compileable = False

    def __init__(self, model: nn.Module):
        super().__init__(layers=[])
        patch = getattr(_decoder(model), "_dsv4ops_patch", None) if isinstance(model, nn.Module) else model
        if not isinstance(patch, _Patch):
            raise TypeError("model: expected a model patched by dsv4ops.integrations.transformers.patch_model")
        self._patch = patch
        self.request_ids: list | None = None
        self.seen = 0
        self._finalizer = None
        self.released = False

    # ---- transformers' Cache interface ------------------------------------------------------------
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.seen

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self._patch.manager.cfg.max_context

    @property
    def batch_size(self) -> int:
        return -1 if self.request_ids is None else len(self.request_ids)

    def reset(self):
        """Release the rows' requests and take the cache back into use: the next forward starts over."""
        self.release()
        self.released = False

    def reorder_cache(self, beam_idx):
        raise NotImplementedError("PagedCache: beam search (reordering requests) is not supported")

    def crop(self, tokens_to_remove: int):
        raise NotImplementedError("PagedCache: cropping is not supported (compressor states do not rewind)")

    def batch_repeat_interleave(self, repeats: int):
        raise NotImplementedError("PagedCache: expanding the batch is not supported (num_return_sequences > 1)")

    def batch_select_indices(self, indices):
        raise NotImplementedError("PagedCache: selecting batch rows is not supported")

    # ---- the requests -----------------------------------------------------------------------------
    def lengths(self) -> list[int]:
        """Tokens each batch row's request holds ([] before the first forward)."""
        manager = self._patch.manager
        return [] if self.request_ids is None else [manager.length[r] for r in self.request_ids]

    def release(self) -> None:
        """Free the rows' requests (their slots and blocks go back to the manager). The cache holds
        nothing after: passed to the model again it is refused (its rows would restart at position 0
        under a continuation), unless reset() takes it back into use."""
        if self._finalizer is not None:
            self._finalizer()
        self.request_ids, self.seen, self._finalizer, self.released = None, 0, None, True

    def _new_tokens(self, real: Tensor) -> dict:
        """{request: real tokens of its row} of one call (rows without any left out), admitting one
        request per row at the first call; checks the step's capacity before anything changes."""
        manager = self._patch.manager
        cfg = manager.cfg
        counts = real.sum(1).tolist()
        if self.request_ids is not None and len(self.request_ids) != len(counts):
            raise ValueError(f"input: this cache holds {len(self.request_ids)} rows, got a batch of {len(counts)}")
        longest = max(counts)
        if longest > cfg.request_step_tokens or sum(counts) > cfg.max_step_tokens:
            raise ValueError(f"input: {sum(counts)} tokens ({longest} in one row) pass the cache's step capacity "
                             f"(max_step_tokens {cfg.max_step_tokens}, {cfg.request_step_tokens} per row); split the "
                             f"prompt, e.g. generate(..., prefill_chunk_size={cfg.request_step_tokens // len(counts)})")
        if self.request_ids is None:
            self._admit(len(counts))
        return {rid: n for rid, n in zip(self.request_ids, counts) if n}

    def _admit(self, rows: int) -> None:
        manager, ids = self._patch.manager, []
        try:
            for _ in range(rows):
                ids.append(("PagedCache", next(_REQUEST_IDS)))
                manager.admit(ids[-1])
        except CacheFullError as e:
            _release(manager, ids[:-1])
            raise CacheFullError(f"{e}: a batch of {rows} rows needs {rows} free requests; release() the caches of "
                                 f"finished generations (or drop them) or raise CacheConfig.max_requests") from None
        self.request_ids = ids
        self._finalizer = weakref.finalize(self, _release, manager, list(ids))


def _release(manager: KVCacheManager, ids: list) -> None:
    for rid in ids:
        if rid in manager.slot_of:
            manager.release(rid)


class TransformersAttention(DeepseekV4Attention):
    """dsv4ops' DeepseekV4Attention behind transformers' attention call: forward(hidden_states
    [batch, columns, hidden], position_embeddings, position_ids, attention_mask, past_key_values,
    **kwargs) -> (output, None). The tokens and their positions come from the call the patched
    model planned (its step, or the stateless row groups); the other arguments are transformers'
    and are not read. Parameter names and state dict are transformers'."""

    def __init__(self, hf_attn: nn.Module, cfg: DSV4AttentionConfig, patch: _Patch, dtype: torch.dtype, block: int,
                 process_group=None):
        with torch.device("meta"):  # the weights come from hf_attn: no second allocation
            super().__init__(cfg, hf_attn.layer_idx, patch.manager.cfg.formats, process_group)
        # transformers' FP8Linear modules hold e4m3 weights and tile scales: dequantized to `dtype`
        # (under tensor parallelism, this rank's share of them: load_state_dict cuts it).
        state = checkpoint.dequantize_state_dict(hf_attn.state_dict(), block, dtype)
        self.load_state_dict(state, strict=True, assign=True)
        device = hf_attn.q_a_proj.weight.device
        self.inv_freq = cfg.inv_freq(hf_attn.layer_idx).to(device)
        self._keep_fp32()
        self._patch = patch
        # Kept out of the module tree (a compiled wrapper is an nn.Module itself).
        self.__dict__["_serve"] = (functools.partial(DeepseekV4Attention.forward, self)
                                   if patch.compile_options is None else _compiled(self, patch))

    def forward(self, hidden_states: Tensor, position_embeddings=None, position_ids=None, attention_mask=None,
                past_key_values=None, **kwargs) -> tuple[Tensor, None]:
        call = self._patch.call
        if call is None:
            raise RuntimeError(f"{type(self).__name__}(layer {self.layer_idx}): runs inside the patched model's "
                               f"forward (which plans the step its layers share); call the model, not the layer")
        b, s, h = hidden_states.shape
        if (b, s) != call.shape:
            raise ValueError(f"hidden_states: expected [batch, columns] {call.shape} (the model's input), got {(b, s)}")
        flat = hidden_states.reshape(b * s, h)
        out = torch.zeros_like(flat)
        if call.step is not None:
            n = call.rows.numel()
            x = flat.new_zeros(call.step.positions.shape[0], h)
            x[:n] = flat[call.rows]
            out[call.rows] = self._serve(x, call.step)[:n]
        for idx in call.groups:
            out[idx.flatten()] = DeepseekV4Attention.forward(self, flat[idx]).reshape(-1, h)
        return out.view(b, s, h), None


class _Serving(nn.Module):
    """The serving forward of one layer as a module of its own (what `torch.compile` wraps)."""

    def __init__(self, layer: TransformersAttention):
        super().__init__()
        self.layer = layer

    def forward(self, x: Tensor, step: StepMeta) -> Tensor:
        return DeepseekV4Attention.forward(self.layer, x, step)


def _compiled(layer: TransformersAttention, patch: _Patch):
    """The layer's serving step under torch.compile. Every layer's step is a frame of
    `_Serving.forward`, one graph per layer and batch bucket; Dynamo's default limit of 8 graphs per
    frame would send the rest to eager, so the limit is raised to that count while the step runs."""
    fn = torch.compile(_Serving(layer), **patch.compile_options)
    manager = patch.manager
    limit = max(8, manager.model.num_layers * len(manager.cfg.buckets))

    # A batch-invariant model runs inside invariant_mode.mode(), under which Dynamo does not trace;
    # the layer's own ops are invariant by its cache's flag.
    outside = invariant_mode.suspended if manager.cfg.batch_invariant else contextlib.nullcontext

    def serve(x: Tensor, step: StepMeta) -> Tensor:
        with torch._dynamo.config.patch(recompile_limit=limit, accumulated_recompile_limit=max(256, limit)), outside():
            return fn(x, step)

    return serve


def _patched_forward(inner: nn.Module, patch: _Patch):
    """DeepseekV4Model.forward planning the call: the cache (a PagedCache, made where transformers
    would make its own), the rows' real tokens, and the step every layer of this forward runs."""
    original = inner.forward
    names = [p for p, v in inspect.signature(original).parameters.items() if v.kind != v.VAR_KEYWORD]

    @functools.wraps(original)
    def forward(*args, **kwargs):
        if len(args) > len(names) or set(names[:len(args)]) & set(kwargs):
            return original(*args, **kwargs)  # let transformers report the bad call
        kwargs.update(zip(names, args))
        src = kwargs.get("input_ids")
        src = kwargs.get("inputs_embeds") if src is None else src
        if src is None:
            return original(**kwargs)
        kinds = getattr(inner.config, "mlp_layer_types", None) or []
        hashed = [i for i, kind in enumerate(kinds) if kind == "hash_moe"]
        if kwargs.get("input_ids") is None and hashed:
            # transformers' hash router reads input_ids (an AttributeError on None, patched or not).
            raise ValueError(f"input_ids: expected the token ids (the hash-routed MoE of layers {hashed} picks experts "
                             f"by token id), got inputs_embeds only")
        b, s = src.shape[:2]
        real = _real_tokens(kwargs.get("attention_mask"), b, s)
        use_cache = kwargs.get("use_cache")
        use_cache = inner.config.use_cache if use_cache is None else use_cache
        given = kwargs.get("past_key_values")
        cache = _paged_cache(given, use_cache, patch)
        kwargs["past_key_values"] = cache
        rows = real.flatten().nonzero().squeeze(1).to(src.device)
        if cache is None:
            return _run(patch, _Call((b, s), rows, None, _stateless_groups(real, src.device)), original, kwargs)
        new_tokens = cache._new_tokens(real)
        if not new_tokens:  # every row is padding here: nothing to store or attend
            out = _run(patch, _Call((b, s), rows, None, []), original, kwargs)
        else:
            with patch.manager.step(new_tokens) as step:
                out = _run(patch, _Call((b, s), rows, step, []), original, kwargs)
        cache.seen += s
        if given is not None and given is not cache:
            _ADOPTED.add(given)  # the call's tokens are in `cache`, not in the transformers cache given
        return out

    return forward


def _invariant_forward(forward):
    """forward inside dsv4ops.invariant_mode.mode(): every row of the call gets the bits it gets alone."""

    @functools.wraps(forward)
    def run(*args, **kwargs):
        with invariant_mode.mode():
            return forward(*args, **kwargs)

    return run


def _run(patch: _Patch, call: _Call, original, kwargs):
    if patch.call is not None:
        raise RuntimeError("model: a patched model's forward is already running (no reentrant calls)")
    patch.call = call
    try:
        return original(**kwargs)
    finally:
        patch.call = None


def _real_tokens(mask, b: int, s: int) -> Tensor:
    """[b, s] bool on the host: which of the call's columns are tokens (the last s columns of a 2-D
    padding mask), all of them without a mask."""
    if mask is None:
        return torch.ones(b, s, dtype=torch.bool)
    if not isinstance(mask, Tensor) or mask.dim() != 2 or mask.shape[0] != b or mask.shape[1] < s:
        got = f"shape {tuple(mask.shape)}" if isinstance(mask, Tensor) else type(mask).__name__
        raise ValueError(f"attention_mask: expected the 2-D padding mask [batch {b}, >= {s} columns] (1 = token, "
                         f"0 = padding), got {got}")
    real = mask[:, mask.shape[1] - s:].cpu() != 0
    # Padding sits before or after a row's tokens. A 0 between 1s is a token the unpatched model
    # keeps at its position and only hides from attention; here it would be dropped and every later
    # position would shift, so it is refused.
    seen = real.int()
    hole = ~real & (seen.cummax(1).values > 0) & (seen.flip(1).cummax(1).values.flip(1) > 0)
    if bool(hole.any()):
        r, c = hole.nonzero()[0].tolist()
        raise ValueError(f"attention_mask: expected each row's tokens (1) in one run with padding (0) only before or "
                         f"after them, got a 0 between 1s in row {r} at column {c} of the call's {s}; a masked-out "
                         f"token inside a sequence is not padding (generate() infers such a mask when the prompt "
                         f"holds pad_token_id and no attention_mask is given): pass the attention_mask, 1 for "
                         f"every token of the sequence")
    return real


def _paged_cache(cache, use_cache: bool, patch: _Patch) -> PagedCache | None:
    if isinstance(cache, PagedCache):
        if cache._patch is not patch:
            raise ValueError("past_key_values: a PagedCache of another patched model")
        if cache.released:
            raise ValueError("past_key_values: this PagedCache was released (its requests freed, its tokens gone); "
                             "pass PagedCache(model) or None to start a new sequence, or reset() it first")
        return cache
    if cache is None:
        return PagedCache(patch) if use_cache else None
    if isinstance(cache, Cache) and cache.get_seq_length() == 0:
        # An empty transformers cache (generate makes one for the first call, then passes the
        # model's output.past_key_values): nothing to carry over. A call's tokens go to a PagedCache,
        # so the same object passed again holds none of them: refused, not served from nothing.
        if cache in _ADOPTED:
            raise TypeError(f"past_key_values: this {type(cache).__name__} was passed to the patched model before and "
                            f"holds none of that call's tokens (a patched model keeps its KV in dsv4ops' PagedCache): "
                            f"pass the PagedCache the model returned (output.past_key_values) to continue, or "
                            f"PagedCache(model) or None to start over")
        return PagedCache(patch)
    raise TypeError(f"past_key_values: a patched model keeps its KV in dsv4ops' PagedCache, got a "
                    f"{type(cache).__name__} holding {cache.get_seq_length()} tokens")


def _stateless_groups(real: Tensor, device) -> list[Tensor]:
    """The rows with real tokens grouped by count: per count n, [rows, n] flat indices of their tokens."""
    counts = real.sum(1)
    flat = torch.arange(real.numel()).view(real.shape)
    groups = []
    for n in sorted(set(counts.tolist()) - {0}):
        rows = (counts == n).nonzero().squeeze(1)
        groups.append(flat[rows][real[rows]].view(rows.numel(), n).to(device))
    return groups


def _decoder(model: nn.Module) -> nn.Module:
    if isinstance(model, hf.DeepseekV4Model):
        return model
    inner = getattr(model, "model", None)
    if isinstance(inner, hf.DeepseekV4Model):
        return inner
    raise TypeError(f"model: expected a transformers DeepseekV4ForCausalLM or DeepseekV4Model, got "
                    f"{type(model).__name__}")


def _fp8_block(config) -> int:
    """The tile of block-FP8 weights from the model's quantization config (V4: 128 x 128)."""
    qc = getattr(config, "quantization_config", None)
    size = (qc.get("weight_block_size") if isinstance(qc, dict) else getattr(qc, "weight_block_size", None)) or [
        checkpoint.V4_BLOCK, checkpoint.V4_BLOCK]
    if len(size) != 2 or size[0] != size[1]:
        raise ValueError(f"quantization_config.weight_block_size: expected square tiles, got {size}")
    return int(size[0])


def _router(gate: nn.Module, config, batch_invariant: bool) -> nn.Module:
    """dsv4ops' router with the weights (and tensors, dtypes kept) of transformers' `gate`."""
    kind = DeepseekV4HashRouter if isinstance(gate, hf.DeepseekV4HashRouter) else DeepseekV4Router
    if not isinstance(gate, (hf.DeepseekV4HashRouter, hf.DeepseekV4TopKRouter)):
        raise TypeError(f"gate: expected a transformers DeepSeek-V4 router, got {type(gate).__name__}")
    with torch.device("meta"):
        ours = kind(config, batch_invariant)
    ours.load_state_dict(gate.state_dict(), strict=True, assign=True)
    return ours


def _compile_options(compile: bool | dict) -> dict | None:
    if compile is False:
        return None
    if compile is not True and not isinstance(compile, dict):
        raise TypeError(f"compile: expected a bool or a dict of torch.compile options, got {type(compile).__name__}")
    return {"fullgraph": True, **({} if compile is True else compile)}
