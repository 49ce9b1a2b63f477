"""CUDA kernel of `dsv4::fp8_linear_w8a8` (reference: fp8_linear/reference.py): the Triton act_quant
kernel (fp8_linear/triton.py) writes x's e4m3 codes and M-major 1 x 128 scales, then torch's
cuBLASLt GEMM with DeepSeek-style blockwise scaling (`torch._scaled_mm`: 1 x 128 activation blocks,
128 x 128 weight tiles, fp32 accumulation, bf16 out) writes `out`. sm_90 only (rule.w8a8_refuses says
why elsewhere). torch._scaled_mm rather than F.scaled_mm: both torch 2.11 and 2.13 have it, and its
out= variant writes the op's output in place (F.scaled_mm returns a new tensor: one more copy, 16 MB
of traffic for a 128 x 32768 bf16 output, ~5 us at 3 TB/s; estimated, not measured).

Rows: cuBLASLt refused one token (CUBLAS_STATUS_NOT_SUPPORTED on the H100, issue 30). A likely cause,
not verified: the M-major scale columns of one row are 4 B apart where cuBLASLt wants 16-B aligned
operands. So the codes and scales are padded to a multiple of ROW_MULTIPLE rows (zero codes) and such
a GEMM writes a temporary whose first M rows are copied to `out`, as does an `out` whose rows have a
stride gap; the GPU tests run M = 1 and 3 through it.
Workspaces are allocated per call from static sizes only (CUDA-graph safe)."""

import torch

from dsv4ops.fp8_linear import checks as _checks
from dsv4ops.fp8_linear import rule
from dsv4ops.fp8_linear.reference import ACT_BLOCK
from dsv4ops.fp8_linear.triton import act_quant

ROW_MULTIPLE = 16


def fp8_linear_w8a8(x, weight, scale, out, block: int) -> None:
    """Launcher of `dsv4::fp8_linear_w8a8` (same arguments)."""
    _checks.fp8_linear_w8a8(x, weight, scale, out, block)
    m, k = x.shape
    n = weight.shape[0]
    reason = rule.w8a8_refuses(n, k, block, x.dtype, rule.device_capability(x.device))
    if reason is not None:
        raise NotImplementedError(f"dsv4::fp8_linear_w8a8: the CUDA kernel cannot serve this call: {reason} "
                                  f"(activations='exact' runs the W8A16 kernel)")
    if m == 0 or n == 0:
        return
    if k == 0:
        out.zero_()
        return
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
