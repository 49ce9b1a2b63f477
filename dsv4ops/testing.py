"""Helpers to check dsv4ops against references and to try it without a checkpoint.

Models and weights (examples and tests run on these; no download):
- `randomize_(module, seed)`: random weights at scales that keep every branch of a layer alive.
- `hf_config(cfg, **overrides)`: transformers' `DeepseekV4Config` with a config's attention numbers.
- `tiny_causal_lm(cfg, seed)`: a random transformers `DeepseekV4ForCausalLM` of the tiny attention.
- `deepseek_state_dict(module, fp8_block)`: a layer's or stack's weights under DeepSeek's checkpoint
  names, optionally block-FP8 as DeepSeek ships them.
- `hf_attention(hf_layer, hf_cfg, x)`: drive transformers' attention layer as its model does.

Tolerances (expected values from the fp64 reference, budgets from its low-precision run):
- `assert_close_to_ref(out, ref64, lowp)`: within rtol x the low-precision run's error.
- `rounding_twins(fn)`: the oracle with every rounding point nudged up and down (what a one-step
  flip at an FP8 / bf16 boundary costs), to add to an FP8 path's budget.
- `assert_topk_within(entries, scores64, k, tol)`: a top-k checked by score, ties within `tol`.
- `recorded_selections()`, `assert_matches_oracle(layer, x, out, selection)`: a CSA layer's indexer
  selection, and its output against the fp64 oracle fed that selection.

V4.1's tie-aware selection checks are in dsv4ops.testing_v41. Importing this module imports
neither transformers nor triton (the transformers helpers import it when called)."""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

from dsv4ops.config import CSA, HCA, SLIDING, DSV4AttentionConfig


def hf_config(cfg: DSV4AttentionConfig, **overrides):
    """A transformers `DeepseekV4Config` with the same attention numbers (eager attention)."""
    from transformers import DeepseekV4Config

    by_ratio = {0: SLIDING, cfg.csa_ratio: CSA, cfg.hca_ratio: HCA}
    compress = {"rope_type": "default", "rope_theta": cfg.compress_rope_theta}
    if cfg.yarn is not None:
        compress = {
            "rope_type": "yarn", "rope_theta": cfg.compress_rope_theta, "factor": cfg.yarn.factor,
            "original_max_position_embeddings": cfg.yarn.original_max_position_embeddings,
            "beta_fast": cfg.yarn.beta_fast, "beta_slow": cfg.yarn.beta_slow, "attention_factor": 1.0,
        }
    prf = cfg.rope_head_dim / cfg.head_dim
    kwargs = dict(
        hidden_size=cfg.hidden_size, num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        head_dim=cfg.head_dim, q_lora_rank=cfg.q_lora_rank, o_groups=cfg.o_groups, o_lora_rank=cfg.o_lora_rank,
        sliding_window=cfg.window, index_n_heads=cfg.index_n_heads, index_head_dim=cfg.index_head_dim,
        index_topk=cfg.index_topk, layer_types=[by_ratio[r] for r in cfg.compress_ratios],
        compress_rates={CSA: cfg.csa_ratio, HCA: cfg.hca_ratio}, rope_theta=cfg.rope_theta,
        compress_rope_theta=cfg.compress_rope_theta, partial_rotary_factor=prf,
        rope_parameters={
            "main": {"rope_type": "default", "rope_theta": cfg.rope_theta, "partial_rotary_factor": prf},
            "compress": {**compress, "partial_rotary_factor": prf},
        },
        max_position_embeddings=cfg.max_position_embeddings, rms_norm_eps=cfg.rms_norm_eps,
        vocab_size=cfg.vocab_size, n_routed_experts=cfg.n_routed_experts,
        num_experts_per_tok=cfg.num_experts_per_tok, routed_scaling_factor=cfg.routed_scaling_factor,
    )
    kwargs.update(overrides)
    hf = DeepseekV4Config(**kwargs)
    hf._attn_implementation = "eager"
    return hf


def randomize_(module: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Random weights at scales that keep every branch of the layer numerically alive: unit-ish
    norms, sinks and position biases of order 1, projections ~ 1/sqrt(fan_in)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if name.endswith("norm.weight"):
                v = 1.0 + 0.1 * torch.randn(p.shape, generator=g)
            elif name.endswith(("sinks", "position_bias")):
                v = torch.randn(p.shape, generator=g)
            else:
                v = torch.randn(p.shape, generator=g) / p.shape[-1] ** 0.5
            p.copy_(v.to(p.dtype))
    return module


def tiny_causal_lm(cfg: DSV4AttentionConfig | None = None, seed: int = 0):
    """A transformers `DeepseekV4ForCausalLM` with `cfg`'s attention (default
    `DSV4AttentionConfig.tiny()`: 4 layers, hidden 256, vocab 512), random weights (`randomize_`
    per attention layer) and hash-routed experts in every layer (a random token -> experts table,
    so routing cannot flip between two numerically close runs), pad token 0, no EOS; eval mode."""
    from transformers import DeepseekV4ForCausalLM

    cfg = cfg or DSV4AttentionConfig.tiny()
    hc = hf_config(cfg, moe_intermediate_size=32, pad_token_id=0, eos_token_id=None,
                   mlp_layer_types=["hash_moe"] * cfg.num_layers)
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(hc).eval()
    g = torch.Generator().manual_seed(seed)
    for layer in model.model.layers:
        randomize_(layer.self_attn, seed=seed + layer.layer_idx)
        table = torch.stack([torch.randperm(cfg.n_routed_experts, generator=g)[:cfg.num_experts_per_tok]
                             for _ in range(cfg.vocab_size)])
        layer.mlp.gate.tid2eid.copy_(table)
    return model


def deepseek_state_dict(module: torch.nn.Module, fp8_block: int | None = None) -> dict:
    """The weights of `module` (a DeepseekV4Attention or a DeepseekV41AttentionStack) under DeepSeek's
    checkpoint names (`layers.{i}.attn.wq_a.weight`, ...), as a checkpoint shard holds them. With
    `fp8_block`, every 2-D `.weight` is block FP8 as DeepSeek ships it (V4: 128, V4.1: 32): e4m3 bytes
    and a UE8M0 scale per fp8_block x fp8_block tile under `<name>.scale`, the smallest power of two
    that keeps the tile's amax within e4m3's 448."""
    from dsv4ops import layers, layers_v41

    if isinstance(module, layers.DeepseekV4Attention):
        names = {v: k for k, v in layers.DEEPSEEK_NAMES.items()}
        items = [(f"layers.{module.layer_idx}.{names[k]}", v) for k, v in module.state_dict().items()]
    else:
        names = {v: k for k, v in layers_v41.DEEPSEEK_NAMES.items()}
        items = [(f"layers.{k.split('.')[1]}.{names[k.split('.', 2)[2]]}", v) for k, v in module.state_dict().items()]
    sd = {}
    for key, value in items:
        value = value.detach().clone()
        if fp8_block and value.dim() == 2 and key.endswith(".weight"):
            sd[key], sd[key[:-len("weight")] + "scale"] = _block_fp8(value, fp8_block)
        else:
            sd[key] = value
    return sd


def _block_fp8(w: Tensor, block: int) -> tuple[Tensor, Tensor]:
    n, k = w.shape
    tn, tk = -(-n // block), -(-k // block)
    tiles = w.float().new_zeros(tn * block, tk * block)
    tiles[:n, :k] = w.float()
    tiles = tiles.view(tn, block, tk, block)
    amax = tiles.abs().amax((1, 3))
    # Exact powers of two from 2^-127 (UE8M0's smallest; an all-zero tile takes it) up: UE8M0 holds them.
    scale = torch.exp2(torch.ceil(torch.log2(amax / 448.0)).clamp(min=-127))
    q = (tiles / scale[:, None, :, None]).view(tn * block, tk * block)[:n, :k]
    return q.to(torch.float8_e4m3fn), scale.to(torch.float8_e8m0fnu)


def hf_attention(hf_layer, hf_cfg, x: Tensor, cache=None, start: int = 0) -> Tensor:
    """Drive transformers' DeepseekV4Attention the way its model does: rotary embeddings from
    DeepseekV4RotaryEmbedding and the mask from create_sliding_window_causal_mask (without a mask
    transformers drops the causality of compressed entries). `cache` (a DynamicCache) and `start`
    (the first position) run a continuation."""
    from transformers.masking_utils import create_sliding_window_causal_mask
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

    b, s, _ = x.shape
    positions = (torch.arange(s, device=x.device) + start).unsqueeze(0).expand(b, -1)
    rotary = DeepseekV4RotaryEmbedding(hf_cfg).to(x.device)
    emb = {k: rotary(x, positions, layer_type=k) for k in ("main", "compress")}
    mask = create_sliding_window_causal_mask(
        config=hf_cfg, inputs_embeds=x, attention_mask=None, past_key_values=cache, position_ids=positions
    )
    return hf_layer(x, position_embeddings=emb, position_ids=positions, attention_mask=mask,
                    past_key_values=cache)[0]


def assert_close_to_ref(out: Tensor, ref64: Tensor, lowp, rtol: float = 2.0, what: str = "output"):
    """max|out - ref64| <= rtol * max|lowp - ref64| + one ulp (eps) band of the output dtype:
    the error budget is the error of a low-precision run of the reference (FA's rule), plus the
    rounding of the output itself. `lowp` may be a list of such runs (the budget is the largest),
    e.g. the fp32 run and the `rounding_twins` of an FP8 mode."""
    ref = ref64.double()
    err = (out.double() - ref).abs().max().item()
    runs = [lowp] if isinstance(lowp, Tensor) else list(lowp)
    budget = max((r.double() - ref).abs().max().item() for r in runs)
    band = 0.0 if out.dtype == torch.float64 else torch.finfo(out.dtype).eps * ref.abs().max().item()
    assert err <= rtol * budget + band, f"{what}: max abs err {err:.3e} > {rtol} x {budget:.3e} + {band:.3e}"
    return err, budget


# Relative nudge of the twins: 2^-17 = 128 fp32 ulps, above the fp32 drift of any value the oracle
# quantizes between two summation orders (a norm or GEMM over K <= 4096 terms drifts by about
# sqrt(K) <= 64 ulps), and far below a bf16 half-ulp (2^-9), so a nudged value only changes where
# it sits that close to a rounding boundary.
TWIN_NUDGE = 2.0**-17
_LOW = (torch.bfloat16, torch.float16)


@contextlib.contextmanager
def _nudged_rounding(factor: float):
    """Inside: the oracle (dsv4ops.reference.layer) multiplies every value by `factor` just before
    each rounding point of its numerics mode: the bf16 casts of the compressed entries
    (reference.numerics.round_to) and the FP8 quantizers (round_kv, round_indexer_key,
    quantize_indexer_query; their first step is a bf16 cast)."""
    from dsv4ops.reference import layer

    saved = {name: getattr(layer, name) for name in ("round_to", "round_kv", "round_indexer_key",
                                                     "quantize_indexer_query")}

    def round_to(x, dtype):
        return saved["round_to"](x * factor if dtype in _LOW and x.dtype not in _LOW else x, dtype)

    def round_kv(kv, mode, rope_dim):
        return saved["round_kv"](kv if mode == "exact" else kv * factor, mode, rope_dim)

    def round_indexer_key(k, mode):
        return saved["round_indexer_key"](k if mode == "exact" else k * factor, mode)

    def quantize_indexer_query(q, weights, mode):
        return saved["quantize_indexer_query"](q if mode == "exact" else q * factor, weights, mode)

    nudged = dict(round_to=round_to, round_kv=round_kv, round_indexer_key=round_indexer_key,
                  quantize_indexer_query=quantize_indexer_query)
    try:
        for name, fn in nudged.items():
            setattr(layer, name, fn)
        yield
    finally:
        for name, fn in saved.items():
            setattr(layer, name, fn)


def rounding_twins(fn, nudge: float = TWIN_NUDGE) -> list:
    """[fn() with every rounding point of the oracle's numerics nudged up by `nudge`, and down].
    `fn` runs the oracle (in fp64). Between them, every value the oracle rounds within `nudge` of a
    boundary (bf16, e4m3, a UE8M0 scale) lands on the other side once, and nothing else moves: their
    distance to fn() is what one-step flips cost at the boundaries that fp32 noise can cross. An FP8
    path checked against the fp64 oracle adds them to its budget (where the fp32 run happened not
    to cross a boundary that the path did). Model-dtype arithmetic is not nudged (the fp32 run
    covers it); in the exact modes of an fp64 run there is no rounding point, so the twins are fn()."""
    twins = []
    for factor in (1.0 + nudge, 1.0 - nudge):
        with _nudged_rounding(factor):
            twins.append(fn())
    return twins


def assert_topk_within(entries: Tensor, scores64: Tensor, k: int, tol, what: str = "selection"):
    """`entries` [T, k] (entry indices, -1 fill) is a top-k of `scores64` [T, N] (fp64; -inf =
    invisible) up to each score's error bound `tol` (a number or [T, N]): for each token, its first
    min(k, visible) entries are distinct visible ones, the rest -1, and some scores within
    scores64 +- tol rank the chosen entries first: min over chosen of (score + tol) >= max over
    the visible others of (score - tol). Two float implementations may order entries whose scores
    lie within their rounding error either way, so a selection is checked by score, not by index."""
    entries, scores64 = entries.cpu().long(), scores64.cpu().double()
    tol = torch.as_tensor(tol, dtype=torch.float64).expand_as(scores64).cpu()
    for t in range(entries.shape[0]):
        visible = torch.isfinite(scores64[t])
        n = min(k, int(visible.sum()))
        chosen, rest = entries[t, :n], entries[t, n:]
        assert (rest == -1).all(), f"{what}: token {t} sees {int(visible.sum())} entries, got {entries[t].tolist()}"
        assert (chosen >= 0).all() and chosen.unique().numel() == n, f"{what}: token {t}: {chosen.tolist()}"
        if n == 0:
            continue
        assert visible[chosen].all(), f"{what}: token {t} selected an invisible entry: {chosen.tolist()}"
        others = visible.clone()
        others[chosen] = False
        if not others.any():
            continue
        low = (scores64[t, chosen] + tol[t, chosen]).min()
        high = (scores64[t, others] - tol[t, others]).max()
        assert low >= high, (f"{what}: token {t} chose an entry scoring {low.item():.6g} (+ tol) below an unchosen "
                             f"{high.item():.6g} (- tol)")


@contextlib.contextmanager
def recorded_selections():
    """Inside, every CSA layer forward (eager or traced) appends what its indexer selected to the
    yielded list, as [T, k] entry indices of each token's request (-1: none; padding rows all -1),
    translated from global pool slots through the step's block table."""
    import inspect

    from dsv4ops import layers

    original = layers._select
    signature = inspect.signature(original)
    log = []

    def _select(*args, **kwargs):
        idx = original(*args, **kwargs)
        bound = signature.bind(*args, **kwargs).arguments
        log.append(_entries_of(bound["step"], idx, bound["cache"].cfg.block_size))
        return idx

    layers._select = _select
    try:
        yield log
    finally:
        layers._select = original


def _entries_of(step, idx: Tensor, block_size: int) -> Tensor:
    table = step.block_table(CSA)[step.req_slots.clamp(min=0).long()]  # [T, blocks]
    block = (idx.long() // block_size)[..., None]
    hit = table[:, None, :].long() == block  # [T, k, blocks]
    entries = hit.int().argmax(-1) * block_size + idx.long() % block_size
    ok = (idx >= 0) & hit.any(-1) & (step.req_slots >= 0)[:, None]
    return torch.where(ok, entries, -1)


def assert_matches_oracle(layer, x: Tensor, out: Tensor, selection: Tensor | None = None, what: str = "output"):
    """One request of `layer` (a DeepseekV4Attention) from position 0: x [S, hidden], the layer's
    out [S, hidden] and, for a CSA layer, the entries its indexer selected [S, k]. The selection
    must be a top-k of the fp64 oracle's scores up to the scores' rounding error (fp32 run, and the
    rounding twins of an FP8 indexer); the output must equal the fp64 oracle fed that selection,
    within the error of the oracle's fp32 run on it (and its rounding twins in FP8 KV mode)."""
    from dsv4ops import reference

    cfg, li, numerics = layer.config, layer.layer_idx, layer.numerics
    params = {k: v.detach() for k, v in layer.named_parameters()}
    p64 = {k: v.double() for k, v in params.items()}
    x64 = x.detach()[None].double()
    topk = None
    with torch.no_grad():
        if selection is not None:
            s64 = reference.indexer_scores(p64, cfg, li, x64, numerics)[0]
            s32 = reference.indexer_scores(params, cfg, li, x.detach()[None], numerics)[0].double()
            finite = torch.isfinite(s64)
            # Per score: the fp32 run's arithmetic error (where no rounding point is near a boundary:
            # the twins did not move it) plus what the twins moved it by (a one-step flip of an FP8
            # query or key element there); x 2 (rtol).
            moved = torch.zeros_like(s64)
            if numerics.indexer != "exact":
                for twin in rounding_twins(lambda: reference.indexer_scores(p64, cfg, li, x64, numerics)[0]):
                    moved = torch.maximum(moved, (twin - s64).nan_to_num(0.0).abs())
            quiet = finite & (moved == 0)
            noise = (s32 - s64)[quiet].abs().max().item() if quiet.any() else 0.0
            assert_topk_within(selection, s64, cfg.index_topk, 2 * (noise + moved), what=f"{what} selection")
            topk = selection[None].to(x.device)

        def run64():
            return reference.attention(p64, cfg, li, x64, numerics, topk=topk)[0]

        ref64 = run64()
        lowp = [reference.attention(params, cfg, li, x.detach()[None], numerics, topk=topk)[0]]
        if numerics.kv != "exact" or numerics.indexer != "exact":
            lowp += rounding_twins(run64)
    return assert_close_to_ref(out, ref64, lowp, what=what)
