"""GPU tier 3: a tiny run of every CUDA kernel, for
`compute-sanitizer --tool memcheck --error-exitcode 1 python tests/sanitize_run.py`
(prints one line per kernel family it ran)."""

import torch

from dsv4ops import DeepseekV4Attention, DSV4AttentionConfig, Numerics, testing
from dsv4ops.cache import CacheConfig, KVCacheManager


def main():
    cfg = DSV4AttentionConfig.tiny(index_topk=8)
    for numerics in (Numerics(kv="fp8", indexer="fp8"), Numerics()):
        for li in range(3):
            layer = testing.randomize_(DeepseekV4Attention(cfg, li, numerics=numerics), seed=li)
            layer = layer.to("cuda", torch.bfloat16)
            mode = "fp8" if numerics.kv == "fp8" else "bf16"
            manager = KVCacheManager(cfg, CacheConfig(max_requests=2, max_context=300, max_step_tokens=160,
                                                      kv_cache=mode, indexer_cache=mode), device="cuda")
            layer.attach_cache(manager)
            manager.admit(0)
            manager.admit(1)
            with torch.no_grad():
                # A prefill chunk that crosses t = 127 (HCA entry 0), then padded decode steps.
                with manager.step({0: 150, 1: 3}) as step:
                    layer(torch.randn(160, cfg.hidden_size, device="cuda", dtype=torch.bfloat16), step)
                for _ in range(3):
                    with manager.step({0: 1, 1: 1}) as step:
                        layer(torch.randn(step.positions.shape[0], cfg.hidden_size, device="cuda",
                                          dtype=torch.bfloat16), step)
            torch.cuda.synchronize()
            print(f"sanitize: layer {li} ({layer.layer_type}), cache {mode}: ok", flush=True)
    from dsv4ops.router import modules

    router = testing.randomize_(modules.DeepseekV4Router(cfg)).to("cuda")
    for tokens in (3, 100):
        router(torch.randn(tokens, cfg.hidden_size, device="cuda"))
    hash_router = testing.randomize_(modules.DeepseekV4HashRouter(cfg)).to("cuda")
    hash_router(torch.randn(5, cfg.hidden_size, device="cuda"), torch.arange(5, device="cuda"))
    torch.cuda.synchronize()
    print("sanitize: router kernels: ok", flush=True)


if __name__ == "__main__":
    main()
