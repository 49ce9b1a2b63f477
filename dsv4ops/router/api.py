"""Public V4 router functions: validate values (eager only), allocate outputs, call the `dsv4::` ops.

Semantics (the reference is dsv4ops/router/reference.py): scores = sqrt(softplus(logits)) in fp32;
gate_topk selects the k largest scores + bias (bias only steers the selection; exact ties pick the lower
expert; the indices come sorted by that key), hash_route selects tid2eid[token_id]; both return
weights = selected scores / their sum * routed_scaling_factor (fp32) and int64 indices.

CUDA: the kernels bind at the first run with CUDA tensors, never while tracing (the fakes have no
side effects): an eager public function binds them before calling the op, and an op that reaches
its reference body with CUDA tensors (a compiled graph's first run, a raw op call) binds them there
and runs again on the CUDA kernel (dsv4ops/router/cuda.py: `bind_cuda_kernel`). `dsv4ops.warmup(..., "cuda")` binds them
ahead of a CUDA-graph capture. Where the arch table names a CUDA backend and it cannot be built, the
call raises; only the table (an architecture without a row) sends CUDA tensors to the reference.
"""

import torch
import torch.nn.functional as F
from torch import Tensor
from torch._subclasses.fake_tensor import is_fake

from dsv4ops import ops as _ops  # noqa: F401  (defines the dsv4:: ops called below)
from dsv4ops.invariant_linear.api import invariant_linear
from dsv4ops.router.cuda import bind_cuda_kernel

_gate_topk = torch.ops.dsv4.gate_topk.default
_hash_route = torch.ops.dsv4.hash_route.default
_router_gate = torch.ops.dsv4.router_gate.default

def _prepare(t: Tensor):
    """Bind the CUDA kernels before an eager call with real CUDA tensors (not while tracing)."""
    if t.device.type == "cuda" and not torch.compiler.is_compiling() and not is_fake(t):
        bind_cuda_kernel("gate_topk", torch.cuda.get_device_capability(t.device))


def _check_k(k: int, experts: int):
    if not 1 <= k <= experts:
        raise ValueError(f"k: expected 1 <= k <= {experts} (the number of experts), got {k}")


def _values_readable(t: Tensor) -> bool:
    """Value checks read data on the host: not while compiling or capturing a CUDA graph (no syncs
    there), nor on meta or fake tensors (shape-only runs)."""
    if torch.compiler.is_compiling() or t.device.type == "meta" or is_fake(t):
        return False
    return not (t.is_cuda and torch.cuda.is_current_stream_capturing())


def _check_range(name: str, t: Tensor, low: int, high: int, what: str):
    if t.numel() == 0:
        return
    lo, hi = torch.aminmax(t)
    lo, hi = int(lo), int(hi)  # one host sync per call, eager only
    if lo < low or hi >= high:
        bad = lo if lo < low else hi
        raise ValueError(f"{name}: expected values in [{low}, {high}) ({what}), got {bad}")


def gate_topk(logits: Tensor, bias: Tensor, k: int, routed_scaling_factor: float) -> tuple[Tensor, Tensor]:
    """logits [tokens, experts] (fp32/bf16/fp16), bias [experts] fp32 -> (weights [tokens, k] fp32,
    indices [tokens, k] int64), indices sorted by descending score + bias."""
    if not torch.compiler.is_compiling():
        _check_k(k, logits.shape[-1])
    _prepare(logits)
    weights = logits.new_empty((logits.shape[0], k), dtype=torch.float32)
    indices = logits.new_empty((logits.shape[0], k), dtype=torch.int64)
    _gate_topk(logits, bias, weights, indices, routed_scaling_factor)
    return weights, indices


def hash_route(
    logits: Tensor, token_ids: Tensor, tid2eid: Tensor, routed_scaling_factor: float
) -> tuple[Tensor, Tensor]:
    """logits [tokens, experts], token_ids [tokens] int32/int64, tid2eid [vocab, k] int32/int64 ->
    (weights [tokens, k] fp32, indices = tid2eid[token_ids] as int64). Token ids must lie in
    [0, vocab) and the looked-up table entries in [0, experts) (checked in eager mode, outside CUDA-graph
    capture; inside the kernel an out-of-range id or entry selects nothing: index -1, weight 0)."""
    if _values_readable(token_ids):
        _check_range("token_ids", token_ids, 0, tid2eid.shape[0], "rows of tid2eid")
        if token_ids.dim() == 1:  # a bad shape is left to the op's metadata checks
            rows = tid2eid[token_ids.long()]
            _check_range("tid2eid", rows, 0, logits.shape[-1], "experts, at the looked-up rows")
    _prepare(logits)
    k = tid2eid.shape[-1]
    weights = logits.new_empty((logits.shape[0], k), dtype=torch.float32)
    indices = logits.new_empty((logits.shape[0], k), dtype=torch.int64)
    _hash_route(logits, token_ids, tid2eid, weights, indices, routed_scaling_factor)
    return weights, indices


def gate_logits(x: Tensor, weight: Tensor, batch_invariant: bool = False) -> Tensor:
    """fp32 logits x @ weight.T [tokens, experts], accumulated in fp32 (the hash layers' gate GEMM).
    batch_invariant: a token's logits do not depend on the other tokens (dsv4::invariant_linear:
    torch.mm picks its kernel by the token count, on the CPU and in cuBLAS)."""
    if batch_invariant:
        return invariant_linear(x, weight, torch.float32)
    if x.device.type == "cuda" and x.dtype != torch.float32:
        return torch.mm(x, weight.t(), out_dtype=torch.float32)  # cuBLAS writes fp32: no bf16 rounding
    return F.linear(x.float(), weight.float())


def router_gate(
    x: Tensor, weight: Tensor, bias: Tensor, k: int, routed_scaling_factor: float, batch_invariant: bool = False
) -> tuple[Tensor, Tensor, Tensor]:
    """x [tokens, hidden], weight [experts, hidden] (same float dtype), bias [experts] fp32 ->
    (logits [tokens, experts] fp32, weights [tokens, k] fp32, indices [tokens, k] int64): the gate
    GEMM and gate_topk, fused into one kernel for decode-sized batches on sm_90.

    batch_invariant: a token's outputs are bitwise the same whatever other tokens share the call.
    The gate GEMM is the one part that depends on them (the CPU's GEMM and cuBLAS pick their kernel
    by the token count; on CUDA the fused kernel serves <= 64 tokens, cuBLAS more): here it runs
    dsv4::invariant_linear, then gate_topk (row-wise on every backend)."""
    if not torch.compiler.is_compiling():
        _check_k(k, weight.shape[0])
    if batch_invariant:
        logits = gate_logits(x, weight, batch_invariant=True)
        return (logits, *gate_topk(logits, bias, k, routed_scaling_factor))
    _prepare(x)
    logits = x.new_empty((x.shape[0], weight.shape[0]), dtype=torch.float32)
    weights = x.new_empty((x.shape[0], k), dtype=torch.float32)
    indices = x.new_empty((x.shape[0], k), dtype=torch.int64)
    _router_gate(x, weight, bias, logits, weights, indices, routed_scaling_factor)
    return logits, weights, indices
