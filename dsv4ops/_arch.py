"""GPU capability and the one table that picks the CUDA backend of every op per architecture.

Backends: "triton" (portable: sm_90 and sm_100), "csrc" (CUDA C++ built with -gencode for
sm_90a and sm_100a; for router_gate: cuBLAS GEMM + the csrc gate_topk), "cute_sm90" (CuTe DSL with WGMMA: sm_90a only), "cute_sm100" (CuTe DSL
with tcgen05: sm_100a only), "reference" (the PyTorch reference kernel, any device). An op whose
row names several backends picks among them at run time by problem size (see the op's launcher).
`DSV4OPS_ARCH=sm_90a|sm_100a` overrides the detected GPU (CPU-only compilation, tests).
"""

import os

import torch

# op -> {compute capability major -> backend(s)}
ARCH_TABLE: dict[str, dict[int, tuple[str, ...]]] = {
    "qkv_prep": {9: ("triton",), 10: ("triton",)},
    "compressor_update": {9: ("triton",), 10: ("triton",)},
    "indexer_q_prep": {9: ("triton",), 10: ("triton",)},
    "indexer_k_prep": {9: ("triton",), 10: ("triton",)},
    # sm_90: the wgmma scoring kernel of csrc/indexer/ for fp8_132 keys with e4m3 queries (Triton
    # scoring otherwise; H100, 128 x 64K: 114 us against 198), then the radix select of csrc/indexer/
    # (the Triton select where k > 8192). sm_100: Triton scoring, the same select (plain CUDA, no
    # wgmma or tcgen05; its sm_100a build has not run on a B200). On the H100 the op took 1.3-3.5x
    # longer with the Triton select at 64K and 1M context.
    "indexer_topk": {9: ("csrc", "triton"), 10: ("csrc", "triton")},
    # sm_90: the warp-specialized wgmma kernel of csrc/sparse_attn/ for the byte pools of V4 (fp8_584)
    # and V4.1 (fp8_528 window, fp4_288 entries) with bf16 q (V4: 1.4-3.1x the Triton kernel on the
    # H100 bench shapes), Triton for exact pools and other dtypes.
    "sparse_attn": {9: ("csrc", "triton"), 10: ("triton",)},
    "attn_merge": {9: ("triton",), 10: ("triton",)},
    "visible_entries": {9: ("triton",), 10: ("triton",)},
    "inv_rope": {9: ("triton",), 10: ("triton",)},
    "fp8_linear": {9: ("triton",), 10: ("triton",)},
    "invariant_linear": {9: ("triton",), 10: ("triton",)},
    # The Triton FP8 x FP8 kernel; on sm_90 from some token count act_quant + torch's cuBLASLt blockwise
    # GEMM (fp8_linear/w8a8.py). Its sm_100 build (tcgen05) has not run on a B200; "auto" picks it on sm_90 only.
    "fp8_linear_w8a8": {9: ("triton",), 10: ("triton",)},
    "pack_kv": {9: ("triton",), 10: ("triton",)},
    "unpack_kv": {9: ("triton",), 10: ("triton",)},
    "gate_topk": {9: ("csrc",), 10: ("csrc",)},
    "hash_route": {9: ("csrc",), 10: ("csrc",)},
    # <= 64 tokens: the fused GEMM + top-k CuTe kernel; above: cuBLAS GEMM + the csrc gate_topk. The
    # tcgen05 kernel (cute_sm100) compiles for sm_100a but has not run on a B200: sm_100 keeps cuBLAS.
    "router_gate": {9: ("cute_sm90", "csrc"), 10: ("csrc",)},
}

# Backends that only run on one architecture ('a' targets: wgmma / tcgen05 do not exist elsewhere).
ARCH_ONLY = {"cute_sm90": 9, "cute_sm100": 10}

_ARCH_NAMES = {"sm_90a": (9, 0), "sm_90": (9, 0), "sm_100a": (10, 0), "sm_100": (10, 0)}


def capability() -> tuple[int, int] | None:
    """(major, minor) of the current GPU, the DSV4OPS_ARCH override, or None without a GPU."""
    name = os.environ.get("DSV4OPS_ARCH")
    if name:
        if name not in _ARCH_NAMES:
            raise ValueError(f"DSV4OPS_ARCH: expected one of {sorted(_ARCH_NAMES)}, got {name!r}")
        return _ARCH_NAMES[name]
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_capability()


def backends(op: str, cap: tuple[int, int] | None = None) -> tuple[str, ...]:
    """The CUDA backend(s) of `op` on `cap` (default: this GPU); ("reference",) where none exists."""
    cap = cap or capability()
    if op not in ARCH_TABLE:
        raise KeyError(f"op: {op!r} is not a dsv4:: op with CUDA kernels; known: {sorted(ARCH_TABLE)}")
    if cap is None:
        return ("reference",)
    chosen = ARCH_TABLE[op].get(cap[0], ("reference",))
    for b in chosen:
        if ARCH_ONLY.get(b, cap[0]) != cap[0]:
            raise AssertionError(f"ARCH_TABLE[{op!r}][{cap[0]}] names {b!r}, which runs only on sm_{ARCH_ONLY[b]}x")
    return chosen
