"""The router's CUDA kernels, bound at the first run with CUDA tensors (never while tracing): the
CUDA C++ gate_topk and hash_route of csrc/ (they register themselves to the `dsv4::` CUDA dispatch
key when csrc/ loads), and dsv4::router_gate's CUDA kernel below (the fused CuTe DSL decode gate
on sm_90 at <= DECODE_GATE_MAX_TOKENS tokens; otherwise cuBLAS fp32-out GEMM + gate_topk).

The ops' reference bodies (dsv4ops/ops.py) call `bind_cuda_kernel` when they meet CUDA tensors, and
the public functions (dsv4ops/router/api.py) before an eager call: this module imports neither, so
the op definitions and the public API do not import each other."""

import functools

import torch
from torch import Tensor

from dsv4ops import _arch
from dsv4ops import csrc as _csrc
from dsv4ops.router import checks as _checks


# Largest token count served by the fused decode gate (GEMM + top-k in one kernel); above it cuBLAS
# has enough rows to fill the GPU and the separate gate_topk kernel costs one extra launch.
DECODE_GATE_MAX_TOKENS = 64


def _decode_gate_backend(num_tokens: int, capability: tuple[int, int]) -> str:
    """Backend of dsv4::router_gate on CUDA, from the arch table: its first entry (a fused CuTe
    kernel where one exists) for decode-sized batches, else "csrc" (torch.mm with fp32 output + the
    gate_topk kernel)."""
    choices = _arch.backends("router_gate", capability)
    if num_tokens <= DECODE_GATE_MAX_TOKENS and choices[0].startswith("cute"):
        return choices[0]
    return "csrc"


def _gate_logits_into(x: Tensor, weight: Tensor, logits_out: Tensor):
    if x.dtype == torch.float32:
        torch.mm(x, weight.t(), out=logits_out)
    else:  # cuBLAS accumulates in fp32 and writes fp32: no bf16 rounding of the logits
        torch.mm(x, weight.t(), out_dtype=torch.float32, out=logits_out)


def _router_gate_cuda(
    x: Tensor,
    weight: Tensor,
    bias: Tensor,
    logits_out: Tensor,
    weights_out: Tensor,
    indices_out: Tensor,
    routed_scaling_factor: float,
):
    _checks.router_gate(x, weight, bias, logits_out, weights_out, indices_out, routed_scaling_factor)
    if _decode_gate_backend(x.shape[0], torch.cuda.get_device_capability(x.device)) == "cute_sm90":
        from dsv4ops.router import cute, cute_sm90

        if cute.supports(x, weight, bias, logits_out, weights_out, indices_out):
            cute_sm90.router_gate(x, weight, bias, logits_out, weights_out, indices_out, routed_scaling_factor)
            return
    _gate_logits_into(x, weight, logits_out)
    torch.ops.dsv4.gate_topk.default(logits_out, bias, weights_out, indices_out, routed_scaling_factor)


@functools.cache
def load_cuda_backends() -> bool:
    """Binds the router's CUDA kernels (csrc/ gate_topk + hash_route, and router_gate below) and
    returns True; raises a RuntimeError with the reason when csrc/ cannot be built or loaded."""
    _csrc.load()
    torch.library.register_kernel("dsv4::router_gate", "cuda", _router_gate_cuda)
    return True


def bind_cuda_kernel(op: str, capability: tuple[int, int]) -> bool:
    """Whether `op` has a CUDA kernel on a GPU of `capability`: False where the arch table names the
    reference (no row for the architecture); otherwise binds the kernels (a failed build raises) and
    returns True. Called by the ops' reference bodies when they meet CUDA tensors."""
    if _arch.backends(op, capability) == ("reference",):
        return False
    load_cuda_backends()
    if not torch._C._dispatch_has_kernel_for_dispatch_key(f"dsv4::{op}", "CUDA"):
        raise RuntimeError(f"dsv4::{op}: the CUDA kernels were loaded but none is registered for this op")
    return True
