"""patch_model: a transformers DeepseekV4ForCausalLM on dsv4ops (generate with the paged cache,
padding, stateless, routers, compile, FP8 checkpoint weights) against the unpatched model.

Expected values: the unpatched model run stateless on each row's whole unpadded sequence (prompt +
the tokens the patched model generated), in fp64; the budget is its fp32 run's distance to that
(FP8 caches: the same model with the fp64 oracle in each attention, plus its rounding twins). A
generated token must equal the reference's argmax wherever the reference's top-2 margin exceeds
twice the budget. The tiny model (dsv4ops' tiny attention: sliding, CSA, HCA, CSA; index_topk 128
>= the visible entries, so exact = transformers) routes its experts by token id (hash MoE in every
layer): the routing cannot flip between two runs, so logits move only by attention's differences."""

import copy

import format_model as M
import pytest
import torch
from torch import nn
from transformers import DeepseekV4ForCausalLM, DynamicCache

from dsv4ops import CacheFormats, DSV4AttentionConfig, checkpoint, reference, testing
from dsv4ops.cache import CacheConfig, CacheFullError
from dsv4ops.integrations.transformers import PagedCache, TransformersAttention, patch_model

CFG = DSV4AttentionConfig.tiny(index_topk=128)
PROMPT = 136  # crosses the 128-token window and closes HCA entry 0 (t = 127)
NEW = 5
EXACT = CacheConfig(max_requests=4, max_context=512, max_step_tokens=512, formats=CacheFormats.exact(),
                    exact_dtype=torch.float32)
FP8 = CacheConfig(max_requests=4, max_context=512, max_step_tokens=512)


def _model(mlp: tuple[str, ...] = ("hash_moe",) * CFG.num_layers, seed: int = 0) -> DeepseekV4ForCausalLM:
    hc = testing.hf_config(CFG, moe_intermediate_size=32, pad_token_id=0, eos_token_id=None,
                           mlp_layer_types=list(mlp))
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(hc).eval()
    g = torch.Generator().manual_seed(seed)
    for layer in model.model.layers:
        testing.randomize_(layer.self_attn, seed=seed + layer.layer_idx)
        if hasattr(layer.mlp.gate, "tid2eid"):
            table = torch.stack([torch.randperm(CFG.n_routed_experts, generator=g)[:CFG.num_experts_per_tok]
                                 for _ in range(CFG.vocab_size)])
            layer.mlp.gate.tid2eid.copy_(table)
    return model


@pytest.fixture(scope="module")
def base():
    return _model()


def _double(model):
    """An fp64 copy (its experts through the eager loop: the grouped GEMM takes no fp64)."""
    model = copy.deepcopy(model).double()
    model.set_experts_implementation("eager")
    return model


def _patched(model, cache_config=EXACT, **kw):
    return patch_model(copy.deepcopy(model), cache_config, **kw)


def _prompts(batch: int, seed: int = 1) -> torch.Tensor:
    return torch.randint(2, CFG.vocab_size, (batch, PROMPT), generator=torch.Generator().manual_seed(seed))


def _generate(model, ids, mask=None, **kw):
    with torch.no_grad():
        out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, **kw)
    return out.sequences[:, ids.shape[1]:], torch.stack(out.logits, 1)


def _rows(ids, mask, new_tokens) -> list[torch.Tensor]:
    """Each row's unpadded sequence: its real prompt tokens, then the generated ones."""
    mask = torch.ones_like(ids) if mask is None else mask
    return [torch.cat([ids[r][mask[r].bool()], new_tokens[r]]) for r in range(ids.shape[0])]


def _teacher_forced(model, rows: list[torch.Tensor]) -> torch.Tensor:
    """[rows, NEW, vocab]: the logits `model` gives each generated position, from a stateless run on
    the row's whole sequence."""
    with torch.no_grad():
        return torch.stack([model(seq[None], use_cache=False).logits[0, -NEW - 1:-1] for seq in rows])


def _check_steps(tokens, logits, ref64, lowp, what, decisive=0.5):
    """Per-step logits within the budget of the reference, and greedy tokens equal to its argmax
    where its margin exceeds twice the budget (at least a `decisive` share of the steps, or the
    token check saw nothing)."""
    err, budget = testing.assert_close_to_ref(logits, ref64, lowp, what=f"{what}: logits")
    bound = 2 * budget + torch.finfo(logits.dtype).eps * ref64.abs().max().item()
    top2 = ref64.topk(2, dim=-1).values
    sure = (top2[..., 0] - top2[..., 1]) > 2 * bound
    assert sure.float().mean() >= decisive, f"{what}: margins above {2 * bound:.2e} at only {sure.sum()} steps"
    assert torch.equal(tokens[sure], ref64.argmax(-1)[sure]), f"{what}: {tokens.tolist()} vs {ref64.argmax(-1)}"


def _against_transformers(base, patched, ids, mask=None, what="", **kw):
    tokens, logits = _generate(patched, ids, mask, **kw)
    rows = _rows(ids, mask, tokens)
    ref64 = _teacher_forced(_double(base), rows)
    _check_steps(tokens, logits, ref64, _teacher_forced(base, rows), what)
    return tokens, logits


def test_generate_matches_transformers(base):
    """Batch of 2 without padding: the paged exact-mode cache (prefill of 136, then decode steps)."""
    patched = _patched(base)
    ids = _prompts(2)
    tokens, _ = _against_transformers(base, patched, ids, what="generate")
    assert all(isinstance(layer.self_attn, TransformersAttention) for layer in patched.model.layers)
    manager = patched.model.layers[0].self_attn.cache_manager
    assert manager.slot_of == {}  # generate's PagedCache is gone: its requests were released



def test_stateless_generate_with_padding(base):
    """use_cache=False: every step reruns each row's real tokens from position 0 (rows grouped by
    length), no cache touched; left-padded rows of 40 / 33 / 40 tokens."""
    patched = _patched(base)
    ids, mask = _prompts(3, seed=10)[:, :40], torch.ones(3, 40, dtype=torch.long)
    mask[1, :7], ids[1, :7] = 0, 0
    _against_transformers(base, patched, ids, mask, what="stateless", use_cache=False)
    for layer in patched.model.layers:  # the pools are still poisoned (NaN) as allocated
        assert torch.isnan(layer.self_attn.cache.window).all()


@pytest.mark.parametrize("side", ["left", "right"])
def test_padded_rows_equal_their_unpadded_runs(base, side):
    """Rows padded by 0 / 7 / 30 columns (left or right) continue their own requests: the prefill's
    logits at every real token and two teacher-forced decode steps equal transformers' run of the
    row alone (the unpatched model on the padded batch would pool the padding into its compressed
    entries). Left padding also through generate()."""
    patched = _patched(base)
    ids, mask = _prompts(3, seed=2), torch.ones(3, PROMPT, dtype=torch.long)
    for r, pad in enumerate((0, 7, 30)):
        cols = slice(0, pad) if side == "left" else slice(PROMPT - pad, PROMPT)
        mask[r, cols], ids[r, cols] = 0, 0
    nxt = torch.randint(2, CFG.vocab_size, (3, 2), generator=torch.Generator().manual_seed(3))
    logits = []
    with torch.no_grad():
        out = patched(ids, attention_mask=mask)
        cache = out.past_key_values
        logits.append(out.logits)
        for i in range(2):
            mask = torch.cat([mask, torch.ones(3, 1, dtype=torch.long)], 1)
            logits.append(patched(nxt[:, i:i + 1], attention_mask=mask, past_key_values=cache).logits)
    assert isinstance(cache, PagedCache) and cache.lengths() == [PROMPT + 2 - p for p in (0, 7, 30)]
    assert cache.get_seq_length() == PROMPT + 2
    ours = torch.cat(logits, 1)[mask.bool()].split([PROMPT + 2 - p for p in (0, 7, 30)])
    rows = [torch.cat([ids[r][mask[r, :PROMPT].bool()], nxt[r]]) for r in range(3)]
    with torch.no_grad():
        ref32 = [base(s[None], use_cache=False).logits[0] for s in rows]
        base64 = _double(base)
        ref64 = [base64(s[None], use_cache=False).logits[0] for s in rows]
    testing.assert_close_to_ref(torch.cat(ours), torch.cat(ref64), torch.cat(ref32), what=f"{side} padding")
    cache.release()
    if side == "left":
        _against_transformers(base, patched, ids, mask[:, :PROMPT], what="left-padded generate")


def _oracle_model(base, numerics: reference.Numerics):
    """`base` with each attention replaced by the fp64-capable oracle (dsv4ops.reference.attention,
    stateless over the whole sequence) in `numerics`: the FP8 cache's expected values."""
    model = copy.deepcopy(base)
    for layer in model.model.layers:
        layer.self_attn = _Oracle(layer.self_attn, numerics)
    return model


class _Oracle(nn.Module):
    def __init__(self, hf_attn, numerics):
        super().__init__()
        self.attn, self.numerics = hf_attn, numerics

    def forward(self, hidden_states, **kwargs):
        params = dict(self.attn.named_parameters())
        return reference.attention(params, CFG, self.attn.layer_idx, hidden_states, self.numerics), None


def test_generate_with_the_fp8_cache_matches_the_oracle(base):
    """The default cache (584-B FP8 entries, FP8 indexer keys): per-step logits of the patched
    model vs the oracle model in FP8 numerics (fp64), budget its fp32 run and rounding twins."""
    patched = _patched(base, FP8)
    ids = _prompts(2, seed=4)
    tokens, logits = _generate(patched, ids)
    rows = _rows(ids, None, tokens)
    numerics = reference.Numerics(kv="fp8", indexer="fp8")
    oracle64 = _double(_oracle_model(base, numerics))
    ref64 = _teacher_forced(oracle64, rows)
    lowp = [_teacher_forced(_oracle_model(base, numerics), rows)]
    lowp += testing.rounding_twins(lambda: _teacher_forced(oracle64, rows))
    _check_steps(tokens, logits, ref64, lowp, "fp8 cache")


def test_routers_swapped_too(base):
    """routers=True: the learned top-k router (layer 3) and the hash routers are dsv4ops'; logits
    stay within transformers' budget. The top-k router's choices are checked margin-safe first:
    every token's k-th and (k+1)-th expert scores differ by far more than fp32 noise."""
    from dsv4ops.router.modules import DeepseekV4HashRouter, DeepseekV4Router

    model = _model(("hash_moe",) * 3 + ("moe",))
    testing.randomize_(model.model.layers[3].mlp.gate)
    patched = _patched(model, routers=True)
    kinds = [type(layer.mlp.gate) for layer in patched.model.layers]
    assert kinds == [DeepseekV4HashRouter] * 3 + [DeepseekV4Router]
    ids = _prompts(1, seed=5)
    tokens, _ = _against_transformers(model, patched, ids, what="routers")
    with torch.no_grad():
        seen = {}
        hook = model.model.layers[3].mlp.gate.register_forward_hook(lambda m, a, o: seen.update(x=a[0]))
        model(torch.cat([ids[0], tokens[0]])[None], use_cache=False)
        hook.remove()
        gate = model.model.layers[3].mlp.gate
        scores = torch.nn.functional.softplus(seen["x"].reshape(-1, CFG.hidden_size).double()
                                              @ gate.weight.double().T).sqrt()
        top = scores.topk(CFG.num_experts_per_tok + 1, dim=-1).values
    assert (top[:, -2] - top[:, -1]).min() > 1e-5


def test_compiled_layers_generate_the_same(base):
    """compile=...: every layer's serving step under torch.compile (aot_eager on CI: the same ops,
    Dynamo's graphs), one graph per layer and bucket shape, no graph break; the second generate with
    another prompt length runs compiled too (no fallback to eager at Dynamo's recompile limit)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    patched = _patched(base, compile={"backend": "aot_eager"})
    ids = _prompts(2, seed=6)
    _against_transformers(base, patched, ids, what="compiled")
    assert dict(counters["graph_break"]) == {}
    graphs = counters["stats"]["unique_graphs"]
    assert graphs >= CFG.num_layers
    _against_transformers(base, patched, ids[:, :40], what="compiled, second prompt")
    assert counters["stats"]["unique_graphs"] >= graphs
    assert not counters["dynamo"].get("recompile_limit_hit") and dict(counters["graph_break"]) == {}


def test_chunked_prefill_through_generate(base):
    """A prompt longer than the cache's step (max_step_tokens 64): generate's prefill_chunk_size
    splits it; without it the step is refused with that advice, before anything changes."""
    small = CacheConfig(max_requests=2, max_context=512, max_step_tokens=64, formats=CacheFormats.exact(),
                        exact_dtype=torch.float32)
    patched = _patched(base, small)
    ids = _prompts(1, seed=7)
    with pytest.raises(ValueError, match=r"input: 136 tokens \(136 in one row\) pass the cache's step capacity "
                                         r"\(max_step_tokens 64, 64 per row\); split the prompt, e\.g\. "
                                         r"generate\(\.\.\., prefill_chunk_size=64\)"):
        _generate(patched, ids)
    assert patched.model.layers[0].self_attn.cache_manager.slot_of == {}
    _against_transformers(base, patched, ids, what="chunked prefill", prefill_chunk_size=48)


def test_paged_cache_interface_and_errors(base):
    patched = _patched(base)
    manager = patched.model.layers[0].self_attn.cache_manager
    ids = _prompts(2, seed=8)[:, :20]
    with torch.no_grad():
        cache = patched(ids).past_key_values
        assert (cache.get_seq_length(), cache.lengths(), cache.batch_size) == (20, [20, 20], 2)
        assert len(manager.slot_of) == 2
        with pytest.raises(ValueError, match=r"input: this cache holds 2 rows, got a batch of 3"):
            patched(_prompts(3)[:, :1], past_key_values=cache)
        # An all-padding column: no step, nothing stored; the column still counts for generate.
        patched(ids[:, :1], attention_mask=torch.cat([torch.ones(2, 20), torch.zeros(2, 1)], 1), past_key_values=cache)
        assert (cache.get_seq_length(), cache.lengths()) == (21, [20, 20])
        cache.release()
        assert manager.slot_of == {} and cache.get_seq_length() == 0
        held = patched(ids[:, :3]).past_key_values
        assert len(manager.slot_of) == 2
        del held  # garbage-collected: its requests go back to the manager
        assert manager.slot_of == {}
        caches = [patched(ids[:1, :3]).past_key_values for _ in range(EXACT.max_requests)]
        with pytest.raises(CacheFullError, match=r"a batch of 2 rows needs 2 free requests; release\(\) the caches"):
            patched(ids[:, :3])
        assert len(manager.slot_of) == EXACT.max_requests
        del caches
        with pytest.raises(TypeError, match=r"past_key_values: a patched model keeps its KV in dsv4ops' PagedCache, "
                                            r"got a DynamicCache holding 3 tokens"):
            filled = DynamicCache(config=base.config)
            base(ids[:, :3], past_key_values=filled)
            patched(ids[:, :1], past_key_values=filled)
        with pytest.raises(ValueError, match=r"attention_mask: expected the 2-D padding mask \[batch 2, >= 20 "
                                             r"columns\] \(1 = token, 0 = padding\), got shape \(2, 1, 20, 20\)"):
            patched(ids, attention_mask=torch.zeros(2, 1, 20, 20))
        with pytest.raises(RuntimeError, match=r"runs inside the patched model's forward"):
            patched.model.layers[1].self_attn(torch.randn(1, 4, CFG.hidden_size))
        with pytest.raises(ValueError, match=r"model: already patched by dsv4ops"):
            patch_model(patched)
        with pytest.raises(NotImplementedError, match=r"beam search"):
            _generate(patched, ids, num_beams=2)
        assert manager.slot_of == {} and manager.open_step is None


def test_a_transformers_cache_passed_again_is_refused_and_the_returned_cache_continues(base):
    """Issue 32: `c = DynamicCache(...); model(ids, past_key_values=c); model(next, past_key_values=c)`
    ran the second call on nothing before the new token (logits 1.42 off). The first call takes the
    empty cache (generate's way); passing it again is refused before anything runs, and the
    PagedCache the model returned continues the sequence as the unpatched model's DynamicCache does
    (within the budget of its fp32 run against its fp64 run)."""
    patched = _patched(base)
    manager = patched.model.layers[0].self_attn.cache_manager
    ids = _prompts(1, seed=12)[:, :30]
    nxt = _prompts(1, seed=13)[:, :1]
    with torch.no_grad():
        given = DynamicCache(config=base.config)
        first = patched(ids, past_key_values=given)
        assert isinstance(first.past_key_values, PagedCache) and first.past_key_values.lengths() == [30]
        with pytest.raises(TypeError, match=r"past_key_values: this DynamicCache was passed to the patched model "
                                            r"before and holds none of that call's tokens .* pass the PagedCache the "
                                            r"model returned \(output.past_key_values\) to continue"):
            patched(nxt, past_key_values=given)
        assert first.past_key_values.lengths() == [30] and manager.open_step is None
        logits = patched(nxt, past_key_values=first.past_key_values).logits[0, -1]
        refs = []
        for model in (_double(base), base):
            c = DynamicCache(config=model.config)
            model(ids, past_key_values=c)
            refs.append(model(nxt, past_key_values=c).logits[0, -1])
    testing.assert_close_to_ref(logits, *refs, what="continued through the returned PagedCache")
    first.past_key_values.release()


def test_a_mask_with_holes_is_refused(base):
    """Issue 32: generate() without an attention_mask on a prompt holding pad_token_id: transformers
    infers a mask with 0s between 1s, which the patched model took for padding (the tokens dropped,
    later positions shifted: the first generated token differed from the unpatched model's). A 0
    between 1s in a call's columns is refused before anything changes (cached and stateless); left
    and right padding stay padding, and with an explicit mask the prompt generates as transformers."""
    patched = _patched(base)
    manager = patched.model.layers[0].self_attn.cache_manager
    ids = _prompts(1, seed=14)[:, :40]
    ids[0, [10, 11, 25]] = base.config.pad_token_id
    message = (r"attention_mask: expected each row's tokens \(1\) in one run with padding \(0\) only before or after "
               r"them, got a 0 between 1s in row 0 at column 10 of the call's 40; .* pass the attention_mask, 1 for "
               r"every token of the sequence")
    with pytest.raises(ValueError, match=message):
        _generate(patched, ids)
    with torch.no_grad(), pytest.raises(ValueError, match=message):
        patched(ids, attention_mask=(ids != 0).long(), use_cache=False)
    assert manager.slot_of == {} and manager.open_step is None
    for layer in patched.model.layers:  # nothing was written: the pools are as allocated (NaN)
        assert torch.isnan(layer.self_attn.cache.window).all()
    _against_transformers(base, patched, ids, torch.ones_like(ids), what="pad id inside the prompt, explicit mask")


def test_fp8_checkpoint_weights_dequantized_on_patch(base):
    """A model whose attention projections are transformers' FP8Linear (e4m3 weight + UE8M0
    weight_scale_inv per 128 x 128 tile) patches to dsv4ops layers holding the dequantized weights,
    checked against a decode of both formats from their bits (tests/format_model.py)."""
    from transformers.integrations.finegrained_fp8 import FP8Linear

    model = copy.deepcopy(base)
    model.config.quantization_config = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    expected = {}
    g = torch.Generator().manual_seed(9)
    for layer in model.model.layers:
        for name in ("q_a_proj", "q_b_proj", "kv_proj", "o_b_proj"):
            lin = getattr(layer.self_attn, name)
            fp8 = FP8Linear(lin.in_features, lin.out_features, block_size=(128, 128), scale_fmt="ue8m0")
            w = lin.weight.detach()
            scale = torch.randint(120, 131, fp8.weight_scale_inv.shape, generator=g, dtype=torch.uint8)
            fp8.weight_scale_inv.data = scale.view(torch.float8_e8m0fnu)
            big = _decode(scale, M.ue8m0_value).repeat_interleave(128, 0)[:w.shape[0]].repeat_interleave(128, 1)
            fp8.weight.data = (w.double() / big[:, :w.shape[1]]).to(torch.float8_e4m3fn)
            expected[(layer.layer_idx, name)] = _decode(fp8.weight.data.view(torch.uint8), M.e4m3_value) * big[
                :, :w.shape[1]]
            setattr(layer.self_attn, name, fp8)
    patched = patch_model(model, EXACT)
    for (li, name), want in expected.items():
        got = getattr(patched.model.layers[li].self_attn, name).weight
        assert got.dtype == torch.float32 and torch.equal(got.double(), want), (li, name)
    assert checkpoint.V4_BLOCK == 128
    with torch.no_grad():
        assert torch.isfinite(patched(_prompts(1)[:, :9]).logits).all()


def test_patching_a_bf16_model_keeps_every_projection_in_bf16_with_the_fp8_caches(base):
    """With FP8 caches the compressor projections' a, z compute in fp32 (DeepSeek's reference) from the
    packed GEMM's fp32 output: the patched bf16 model holds every projection weight in bf16, its values
    unchanged, and only the sinks, position biases and norm weights in fp32."""
    model = copy.deepcopy(base).to(torch.bfloat16)
    before = {(layer.layer_idx, n): p.clone() for layer in model.model.layers for n, p in
              layer.self_attn.named_parameters()}
    patched = patch_model(model, FP8)
    for layer in patched.model.layers:
        for name, p in layer.self_attn.named_parameters():
            fp32 = name.endswith(("sinks", "position_bias", "norm.weight"))
            assert p.dtype == (torch.float32 if fp32 else torch.bfloat16), (layer.layer_idx, name)
            assert torch.equal(p.to(torch.bfloat16), before[layer.layer_idx, name].to(torch.bfloat16)), name


def _decode(codes: torch.Tensor, value) -> torch.Tensor:
    """float64 values of uint8 `codes` through a table of `value(code)` for every byte."""
    return torch.tensor([value(c) for c in range(256)], dtype=torch.float64)[codes.long()]


def test_a_released_paged_cache_is_refused_and_a_reset_one_starts_over(base):
    """Issue 52: a PagedCache passed back after release() restarted its rows at position 0 without a
    word (the continuation ran on nothing before it). It is refused before anything runs; reset()
    (transformers' way to reuse a cache) starts it over explicitly."""
    patched = _patched(base)
    manager = patched.model.layers[0].self_attn.cache_manager
    ids = _prompts(1, seed=15)[:, :12]
    with torch.no_grad():
        cache = patched(ids).past_key_values
        cache.release()
        with pytest.raises(ValueError, match=r"past_key_values: this PagedCache was released \(its requests freed, "
                                             r"its tokens gone\); pass PagedCache\(model\) or None to start a new "
                                             r"sequence, or reset\(\) it first"):
            patched(ids[:, :1], past_key_values=cache)
        assert manager.slot_of == {} and manager.open_step is None and cache.get_seq_length() == 0
        cache.reset()
        assert patched(ids, past_key_values=cache).past_key_values.lengths() == [12]
    cache.release()


def test_inputs_embeds_runs_as_input_ids_unless_a_layer_routes_by_token_id(base):
    """Issue 52: `model(inputs_embeds=...)` raised AttributeError 'NoneType' ... 'reshape' (transformers'
    hash router reads input_ids). A model whose MoE routes by scores runs it as transformers does (the
    same logits as input_ids); a hash-routed one is refused with what is missing, before anything runs."""
    ids = _prompts(1, seed=16)[:, :12]
    patched = _patched(base)
    manager = patched.model.layers[0].self_attn.cache_manager
    with torch.no_grad(), pytest.raises(ValueError, match=r"input_ids: expected the token ids \(the hash-routed MoE "
                                                          r"of layers \[0, 1, 2, 3\] picks experts by token id\), got "
                                                          r"inputs_embeds only"):
        patched(inputs_embeds=base.model.embed_tokens(ids))
    assert manager.slot_of == {} and manager.open_step is None
    routed = _model(("moe",) * CFG.num_layers)
    patched = _patched(routed)
    with torch.no_grad():
        by_ids = patched(ids)
        by_embeds = patched(inputs_embeds=routed.model.embed_tokens(ids))
    assert by_embeds.past_key_values.lengths() == [12]
    torch.testing.assert_close(by_embeds.logits, by_ids.logits)
