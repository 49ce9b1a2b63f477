"""The launcher rule of fp8_linear's `activations="auto"`: per shape (tokens M, out_features N,
in_features K), the faster of the two block-FP8 paths measured on the H100:
- "exact": dsv4::fp8_linear, the Triton W8A16 kernel (x as it is, the e4m3 weight dequantized in
  registers): reads every weight byte once, no activation rounding;
- "fp8": dsv4::fp8_linear_w8a8, x quantized per 1 x 128 block, FP8 x FP8 tensor-core products: the
  Triton kernel of fp8_linear/triton_w8a8.py (x quantized in its prologue or by act_quant first)
  or, from the token count fp8_linear/w8a8.py's CUBLASLT_FROM names, torch's cuBLASLt blockwise GEMM.
bf16 F.linear on a dequantized weight is no candidate: a keep_fp8 layer holds no bf16 weight.
Only "fp8" changes the numerics (x is quantized), so it must win by MARGIN: within it, "exact" keeps
the tie. The table is the H100's: "auto" runs "exact" on other GPUs (w8a8_refuses says why, or
sm_100: no B200 here to measure). `pick` is plain Python on static values (a symbolic M adds a guard
under torch.compile); BlockFP8Linear reads the GPU's capability when it moves, not per call.
"""

from __future__ import annotations

import functools
import warnings

import torch

from dsv4ops import _arch
from dsv4ops.fp8_linear.checks import W8A8_BLOCK
from dsv4ops.fp8_linear.launch_table import LAUNCH

ACTIVATIONS = ("exact", "fp8", "auto")
# "fp8" must be 5% faster than "exact": most swept points repeat within 3% from run to run, some move
# 5-10% (V4-Pro q_b at one token, W8A16: 42.1 us in the sweep, 48.1 in the bench run after it).
MARGIN = 1.05

# (N, K) -> the smallest M from which "fp8" runs (None: never): launch_table.LAUNCH's w8a8_from.
W8A8_FROM: dict[tuple[int, int], int | None] = {shape: r.w8a8_from for shape, r in LAUNCH.items()}
DEFAULT_W8A8_FROM = 1024  # shapes not swept: "fp8" beat "exact" from 1024 tokens at every swept shape


def w8a8_refuses(k: int, block: int, capability: tuple[int, int] | None) -> str | None:
    """Why dsv4::fp8_linear_w8a8 runs no GPU kernel for in_features k in block x block tiles on this GPU,
    or None."""
    if capability is None:
        return "no CUDA GPU"
    if _arch.backends("fp8_linear_w8a8", capability) == ("reference",):
        return f"its Triton kernel is built for sm_90 and sm_100, this GPU is sm_{capability[0]}{capability[1]}"
    if block != W8A8_BLOCK:
        return (f"block {block}: W8A8 quantizes x in 1 x {W8A8_BLOCK} blocks under {W8A8_BLOCK} x {W8A8_BLOCK} "
                f"weight tiles")
    if k % W8A8_BLOCK:
        return f"in_features {k}: W8A8 needs whole 1 x {W8A8_BLOCK} activation blocks"
    return None


def cublaslt_refuses(n: int, k: int, dtype: torch.dtype, capability: tuple[int, int] | None) -> str | None:
    """Why torch's cuBLASLt blockwise FP8 GEMM cannot serve this W8A8 shape on this GPU, or None."""
    if capability is None or capability[0] != 9:
        return ("cuBLASLt's 1 x 128 / 128 x 128 scaled FP8 GEMM runs on sm_90 only (torch's DeepSeek-style "
                "scaling check)")
    if not hasattr(torch, "_scaled_mm"):
        return f"torch {torch.__version__} has no torch._scaled_mm"
    if dtype != torch.bfloat16:
        return f"x of {dtype}: cuBLASLt's blockwise FP8 GEMM writes bf16"
    if n % 16:
        return f"out_features {n}: cuBLASLt's FP8 GEMM needs a multiple of 16"
    if k % (4 * W8A8_BLOCK):
        return (f"in_features {k}: cuBLASLt needs 16-byte aligned rows of the fp32 128 x 128 weight scales, "
                f"in_features a multiple of {4 * W8A8_BLOCK}")
    return None


def pick(m: int, n: int, k: int, block: int, capability: tuple[int, int] | None) -> str:
    """"fp8" or "exact" for an [m, k] x [n, k]^T projection (rule in the module docstring)."""
    if w8a8_refuses(k, block, capability) is not None or capability[0] != 9:
        return "exact"
    start = W8A8_FROM.get((n, k), DEFAULT_W8A8_FROM)
    return "fp8" if start is not None and m >= start else "exact"


def suggest_from(times: dict[int, tuple[float, float]], margin: float = MARGIN) -> int | None:
    """W8A8_FROM's entry for one shape from its bench times {M: (exact_us, fp8_us)}: the smallest
    swept M from which "fp8" is faster by `margin` at every swept M at or above it (None: never)."""
    start = None
    for m in sorted(times, reverse=True):
        exact_us, fp8_us = times[m]
        if not fp8_us * margin < exact_us:
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
