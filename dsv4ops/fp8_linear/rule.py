"""The launcher rule of fp8_linear's `activations="auto"`: per shape (tokens M, out_features N,
in_features K), the faster of the two block-FP8 paths measured on the H100:
- "exact": dsv4::fp8_linear, the Triton W8A16 kernel (x as it is, the e4m3 weight dequantized in
  registers): reads every weight byte once, best at decode;
- "fp8": dsv4::fp8_linear_w8a8, x quantized per 1 x 128 block (a Triton kernel) then torch's
  cuBLASLt blockwise-scaled FP8 GEMM: the FP8 tensor-core rate, best where the GEMM is compute-bound.
bf16 F.linear on a dequantized weight is no candidate: a keep_fp8 layer holds no bf16 weight.
Only "fp8" changes the numerics (x is quantized); the rule never picks it where its CUDA kernel
cannot run (w8a8_refuses). `pick` is plain Python on static values (a symbolic M adds a guard
under torch.compile); BlockFP8Linear reads the GPU's capability when it moves, not per call.
"""

from __future__ import annotations

import functools
import warnings

import torch

from dsv4ops.fp8_linear.checks import W8A8_BLOCK

ACTIVATIONS = ("exact", "fp8", "auto")

# (N, K) -> the smallest M from which "fp8" beat "exact" at every swept M at or above it (M = 1, 16,
# 64, 128, 256, 512, 1024, 4096); None: "exact" at every swept M. From `python -m dsv4ops bench --only
# fp8_linear --model flash` and `--model pro` (their printed tables), graph-timed on an NVIDIA H100 80GB
# HBM3, torch 2.11.0+cu130, 2026-11-27 (the H200 run before it gave the same starts but V4-Flash
# o_b's, 1). The activation quantization is inside the fp8 times. Times behind each start, exact /
# fp8 us: V4-Flash q_a at 256: 15.4 / 16.4, at 512: 22.2 / 16.9; kv at 256: 13.6 / 16.1, at 512:
# 20.6 / 16.6; q_b at 16: 17.2 / 19.3, at 64: 26.8 / 20.5; o_b at 1: 21.3 / 23.0, at 16: 21.7 / 21.6
# (a tie), at 64: 35.6 / 29.2; indexer q_b at 16: 7.1 / 9.0, at 64: 9.8 / 9.0; V4-Pro q_a at 128:
# 17.8 / 24.4, at 256: 35.8 / 24.8; kv at 512: 21.8 / 24.9; q_b at 64: 74.2 / 51.7; o_b at 1: 69.4 /
# 58.0. Below ~16 us the fp8 path is its own floor (act_quant and cuBLASLt's blockwise kernel: 15.5-17
# us on q_a and kv at any M up to 512).
W8A8_FROM: dict[tuple[int, int], int | None] = {
    (1024, 4096): 512,  # V4-Flash q_a_proj
    (32768, 1024): 64,  # V4-Flash q_b_proj
    (512, 4096): 512,  # V4-Flash kv_proj
    (4096, 8192): 16,  # V4-Flash o_b_proj
    (8192, 1024): 64,  # V4-Flash indexer q_b_proj
    (1536, 7168): 256,  # V4-Pro q_a_proj
    (65536, 1536): 64,  # V4-Pro q_b_proj
    (512, 7168): 1024,  # V4-Pro kv_proj
    (7168, 16384): 1,  # V4-Pro o_b_proj
    (8192, 1536): 64,  # V4-Pro indexer q_b_proj
}
DEFAULT_W8A8_FROM = 1024  # "fp8" was faster from 1024 tokens on every measured shape


def w8a8_refuses(n: int, k: int, block: int, dtype: torch.dtype, capability: tuple[int, int] | None) -> str | None:
    """Why dsv4::fp8_linear_w8a8's CUDA kernel cannot serve this shape on this GPU, or None."""
    if capability is None:
        return "no CUDA GPU"
    if capability[0] != 9:
        return (f"cuBLASLt's 1 x 128 / 128 x 128 scaled FP8 GEMM runs on sm_90 only (torch's DeepSeek-style "
                f"scaling check), this GPU is sm_{capability[0]}{capability[1]}")
    if not hasattr(torch, "_scaled_mm"):
        return f"torch {torch.__version__} has no torch._scaled_mm"
    if block != W8A8_BLOCK:
        return f"block {block}: cuBLASLt's blockwise scaling takes {W8A8_BLOCK} x {W8A8_BLOCK} weight tiles only"
    if dtype != torch.bfloat16:
        return f"x of {dtype}: the kernel writes bf16 (cuBLASLt's blockwise FP8 output)"
    if n % 16:
        return f"out_features {n}: cuBLASLt's FP8 GEMM needs a multiple of 16"
    if k % (4 * W8A8_BLOCK):
        return (f"in_features {k}: cuBLASLt needs 16-byte aligned rows of the fp32 128 x 128 weight scales, "
                f"in_features a multiple of {4 * W8A8_BLOCK}")
    return None


def pick(m: int, n: int, k: int, block: int, dtype: torch.dtype, capability: tuple[int, int] | None) -> str:
    """"fp8" or "exact" for an [m, k] x [n, k]^T projection (rule in the module docstring)."""
    if w8a8_refuses(n, k, block, dtype, capability) is not None:
        return "exact"
    start = W8A8_FROM.get((n, k), DEFAULT_W8A8_FROM)
    return "fp8" if start is not None and m >= start else "exact"


def suggest_from(times: dict[int, tuple[float, float]]) -> int | None:
    """W8A8_FROM's entry for one shape from its bench times {M: (exact_us, fp8_us)}: the smallest
    swept M from which "fp8" is faster at every swept M at or above it (None: never)."""
    start = None
    for m in sorted(times, reverse=True):
        exact_us, fp8_us = times[m]
        if not fp8_us < exact_us:
            break
        start = m
    return start


def device_capability(device: torch.device) -> tuple[int, int] | None:
    """(major, minor) of a CUDA device, None for other devices (from torch.cuda.get_device_properties,
    which torch.compile folds to a constant)."""
    if device.type != "cuda":
        return None
    props = torch.cuda.get_device_properties(device.index if device.index is not None else torch.cuda.current_device())
    return props.major, props.minor


def serving_capability(device: torch.device) -> tuple[int, int] | None:
    """device_capability, or None where this torch's blockwise FP8 GEMM refused a probe call (warned
    once): what BlockFP8Linear and dsv4ops.warmup hand to pick, so that "auto" stays on the W8A16
    kernel there instead of raising in a layer. Runs a kernel: call it eagerly (not while tracing)."""
    capability = device_capability(device)
    if capability is None or capability[0] != 9:
        return capability
    index = device.index if device.index is not None else torch.cuda.current_device()
    return capability if probe(torch.device("cuda", index)) is None else None


@functools.cache
def probe(dev: torch.device) -> str | None:
    """Why one 16 x 128 x 512 call of torch._scaled_mm in the W8A8 launcher's layouts fails on `dev`,
    or None."""
    if not hasattr(torch, "_scaled_mm"):
        why = f"torch {torch.__version__} has no torch._scaled_mm"
    else:
        codes = torch.zeros(16, 512, dtype=torch.float8_e4m3fn, device=dev)
        weight = torch.zeros(128, 512, dtype=torch.float8_e4m3fn, device=dev)
        out = torch.empty(16, 128, dtype=torch.bfloat16, device=dev)
        try:
            torch._scaled_mm(codes, weight.t(), torch.ones(4, 16, device=dev).t(), torch.ones(1, 4, device=dev).t(),
                             out_dtype=torch.bfloat16, out=out)
            return None
        except RuntimeError as e:
            why = f"torch {torch.__version__}'s torch._scaled_mm refused 1 x 128 / 128 x 128 scaling: {e}".splitlines()[0]
    warnings.warn(f"dsv4ops: fp8_linear's W8A8 path is off on {dev} ({why}); activations='auto' runs W8A16")
    return why
