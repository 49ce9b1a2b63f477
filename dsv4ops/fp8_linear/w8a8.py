"""GPU launcher of `dsv4::fp8_linear_w8a8` (reference: fp8_linear/reference.py): per token count,
one of two routes with the same numerics (x's e4m3 codes and power-of-two 1 x 128 scales, FP8
products summed per 128-wide block in fp32, the weight tile's scale applied per block):
- the Triton kernel of fp8_linear/triton_w8a8.py (sm_90 and sm_100): reads the weight once per row
  block, split-K at few tokens;
- from CUBLASLT_FROM tokens on sm_90: the Triton act_quant kernel (fp8_linear/triton.py), then
  torch's cuBLASLt GEMM with DeepSeek-style blockwise scaling (`torch._scaled_mm`: 1 x 128
  activation blocks, 128 x 128 weight tiles, bf16 out), where its layout rules hold
  (rule.cublaslt_refuses). torch._scaled_mm rather than F.scaled_mm: both torch 2.11 and 2.13 have it,
  and its out= variant writes the op's output in place (F.scaled_mm returns a new tensor: one more
  copy, 16 MB of traffic for a 128 x 32768 bf16 output, ~5 us at 3 TB/s; estimated, not measured).

cuBLASLt rows: it refused one token (CUBLAS_STATUS_NOT_SUPPORTED on the H100, issue 30). A likely
cause, not verified: the M-major scale columns of one row are 4 B apart where cuBLASLt wants 16-B
aligned operands. So its codes and scales are padded to a multiple of ROW_MULTIPLE rows (zero codes)
and such a GEMM writes a temporary whose first M rows are copied to `out`, as does an `out` whose rows
have a stride gap. Workspaces are allocated per call from static sizes only (CUDA-graph safe).

A CUDA C++ route for few tokens was built and measured, and is not used (H100, 2026-11-27, graph-timed
over weight copies larger than the L2). Its GEMM was swap-AB: 64 weight rows per warpgroup as wgmma's M,
16-128 tokens as N. It used FP8 wgmma per 128-wide block, promoted into fp32 with two block
accumulators, TMA operand tiles, and split-K as a thread-block cluster whose partials were summed
through distributed shared memory (no workspace, no reduce kernel). It matched the reference at 468
configs, but at 128 tokens it beat the routes above only on o_b. With act_quant, best config, us,
against the fastest route (timed in two other H100 sweeps that day): V4-Flash q_a 9.1 / 9.2-9.4
(W8A16), kv 7.6 / 7.2 (W8A16), indexer q_b 11.0 / 9.5-9.7, o_b 24.1 / 25.9-26.3 (both the Triton W8A8
kernel). At one token it came within 5% of the routes at most shapes. Measurements:
- Its cp.async operand loads streamed ~30 GB/s a CTA (q_a, one split: 8 CTAs of 32 blocks of 32 KB,
  35.7 us); TMA made that 23.3 us.
- A CTA cost ~4-5 us whatever its blocks: the indexer q_b at 128 tokens took 10.0 us as 128 CTAs and
  38.3 us as 1024 CTAs of one block. ncu put half of a one-block CTA's stall samples in the cluster
  reduce: the remote loads and the cluster barrier's release fence.
- Partials pushed to their owner CTA (st.async on its mbarrier) were slower still: q_a 12.1 us."""

import torch

from dsv4ops.fp8_linear import checks as _checks
from dsv4ops.fp8_linear import rule, triton_w8a8
from dsv4ops.fp8_linear.reference import ACT_BLOCK
from dsv4ops.fp8_linear.triton import act_quant

ROW_MULTIPLE = 16

# (N, K) -> the smallest swept M (1, 16, 64, 128, 256) from which cuBLASLt beat the Triton kernel's
# fastest config at every swept M at or above it (same H100 sweep as triton_w8a8.TUNED). Graph-timed
# us, Triton / cuBLASLt: V4-Flash q_b at 64: 19.4 / 20.7, at 128: 24.9 / 21.5; o_b at 128: 25.6 /
# 29.3, at 256: 41.5 / 30.9; indexer q_b at 128: 9.6 / 9.8, at 256: 12.3 / 9.8; V4-Pro q_b at 128: 60.4
# / 51.8; o_b at 16: 49.9 / 54.8, at 64: 58.4 / 56.6; indexer q_b at 128: 11.7 / 10.9. Where the
# Triton kernel won to 256 tokens, a second run at 512 and 1024: kv's start there (V4-Flash at 512:
# 15.9 / 16.8, at 1024: 29.3 / 17.7; V4-Pro at 512: 16.6 / 26.6, at 1024: 33.4 / 27.6); q_a and unlisted
# shapes start at DEFAULT_CUBLASLT_FROM (V4-Flash q_a at 512: 19.2 / 17.2, V4-Pro q_a 37.8 / 25.8).
CUBLASLT_FROM: dict[tuple[int, int], int] = {
    (32768, 1024): 128,  # V4-Flash q_b_proj
    (512, 4096): 1024,  # V4-Flash kv_proj
    (4096, 8192): 256,  # V4-Flash o_b_proj
    (8192, 1024): 256,  # V4-Flash indexer q_b_proj
    (65536, 1536): 128,  # V4-Pro q_b_proj
    (512, 7168): 1024,  # V4-Pro kv_proj
    (7168, 16384): 64,  # V4-Pro o_b_proj
    (8192, 1536): 128,  # V4-Pro indexer q_b_proj
    # tensor-parallel shards (a rank's q_b_proj rows / o_b_proj columns, warmup._fp8_projections at TP 2-16):
    # a second sweep of the same kind, same H100, same day
    (4096, 4096): 256,  # V4-Flash o_b_proj, TP2
    (16384, 1024): 128,  # V4-Flash q_b_proj, TP2
    (4096, 2048): 256,  # V4-Flash o_b_proj, TP4
    (4096, 1024): 256,  # V4-Flash q_b_proj and o_b_proj, TP8
    (7168, 8192): 64,  # V4-Pro o_b_proj, TP2
    (32768, 1536): 128,  # V4-Pro q_b_proj, TP2
    (7168, 4096): 64,  # V4-Pro o_b_proj, TP4
    (16384, 1536): 128,  # V4-Pro q_b_proj, TP4
    (7168, 2048): 128,  # V4-Pro o_b_proj, TP8
    (4096, 1536): 256,  # V4-Pro q_b_proj, TP16
    (7168, 1024): 256,  # V4-Pro o_b_proj, TP16
}
DEFAULT_CUBLASLT_FROM = 512


def route(m: int, n: int, k: int, dtype: torch.dtype, capability: tuple[int, int] | None) -> str:
    """"cublaslt" or "triton" for an [m, k] x [n, k]^T W8A8 projection on this GPU."""
    if rule.cublaslt_refuses(n, k, dtype, capability) is not None:
        return "triton"
    return "cublaslt" if m >= CUBLASLT_FROM.get((n, k), DEFAULT_CUBLASLT_FROM) else "triton"


def fp8_linear_w8a8(x, weight, scale, out, block: int) -> None:
    """Launcher of `dsv4::fp8_linear_w8a8` (same arguments)."""
    _checks.fp8_linear_w8a8(x, weight, scale, out, block)
    m, k = x.shape
    n = weight.shape[0]
    if m == 0 or n == 0:
        return
    if k == 0:
        out.zero_()
        return
    if route(m, n, k, x.dtype, rule.device_capability(x.device)) == "cublaslt":
        cublaslt(x, weight, scale, out)
    else:
        triton_w8a8.fp8_linear_w8a8(x, weight, scale, out)


def cublaslt(x, weight, scale, out) -> None:
    """act_quant + torch's cuBLASLt blockwise GEMM (x [M, K], weight [N, K] e4m3, scale [N / 128,
    K / 128] fp32, out [M, N]; checked by the launcher)."""
    m, k = x.shape
    n = weight.shape[0]
    mp = -(-m // ROW_MULTIPLE) * ROW_MULTIPLE
    codes = torch.empty(mp, k, dtype=torch.float8_e4m3fn, device=x.device)
    scales = torch.empty(k // ACT_BLOCK, mp, dtype=torch.float32, device=x.device)
    act_quant(x, codes, scales)
    direct = mp == m and out.is_contiguous()
    dst = out if direct else torch.empty(mp, n, dtype=out.dtype, device=out.device)
    # scale.t(): the [K / 128, N / 128] K-major view of the [N / 128, K / 128] tile scales.
    try:
        torch._scaled_mm(codes, weight.t(), scales.t(), scale.t(), out_dtype=out.dtype, out=dst)
    except RuntimeError as e:  # out is untouched: the GEMM raised before writing
        raise RuntimeError(f"dsv4::fp8_linear_w8a8: torch {torch.__version__}'s cuBLASLt blockwise GEMM refused "
                           f"[{mp}, {k}] x [{k}, {n}] (activations='exact' runs the W8A16 kernel): {e}") from e
    if not direct:
        out.copy_(dst[:m])
