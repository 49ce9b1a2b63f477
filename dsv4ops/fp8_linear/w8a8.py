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

No CUDA C++ route: a swap-AB FP8 wgmma GEMM with split-K over a thread-block cluster matched the
reference but, with act_quant, beat the routes above at 128 tokens only on o_b (24.1 against 25.9 us;
V4-Flash q_a 9.1 against 9.2, indexer q_b 11.0 against 9.5, H100): a CTA cost ~4-5 us whatever its
blocks (ncu: half a one-block CTA's stalls in the cluster reduce)."""

import torch

from dsv4ops.fp8_linear import checks as _checks
from dsv4ops.fp8_linear import rule, triton_w8a8
from dsv4ops.fp8_linear.launch_table import LAUNCH
from dsv4ops.fp8_linear.reference import ACT_BLOCK
from dsv4ops.fp8_linear.triton import act_quant

ROW_MULTIPLE = 16

# (N, K) -> the smallest M from which cuBLASLt runs: launch_table.LAUNCH's cublaslt_from, where it names one.
CUBLASLT_FROM: dict[tuple[int, int], int] = {shape: r.cublaslt_from for shape, r in LAUNCH.items()
                                             if r.cublaslt_from is not None}
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
