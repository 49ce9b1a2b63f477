"""Every `dsv4::` operator, defined once with its pure-PyTorch reference kernel.

Rules (docs: architecture.md): one op per meaning; out-variant (outputs and caches are preallocated
and listed in `mutates_args`, the op returns None); the reference kernel is registered for every
device (CompositeExplicitAutograd), so it serves CPU and is the "reference backend" on GPU; CUDA
backends attach with `register_kernel("cuda")` (Python) or `TORCH_LIBRARY_IMPL(dsv4, CUDA, m)`
(csrc). Metadata is validated with `torch._check` by the same functions the fakes in `meta/` run.
"""

from torch import Tensor
from torch.library import custom_op

from dsv4ops.router import checks as _router_checks
from dsv4ops.router import reference as _router


# ---- router ------------------------------------------------------------------------------------
@custom_op("dsv4::gate_topk", mutates_args=("weights_out", "indices_out"))
def gate_topk(
    logits: Tensor, bias: Tensor, weights_out: Tensor, indices_out: Tensor, routed_scaling_factor: float
) -> None:
    """scores = sqrt(softplus(logits)); indices = top-k(scores + bias) (ties: lower index);
    weights = scores[indices] / sum * routed_scaling_factor. k = indices_out.shape[1]."""
    _router_checks.gate_topk(logits, bias, weights_out, indices_out)
    _router.gate_topk(logits, bias, weights_out, indices_out, routed_scaling_factor)


@custom_op("dsv4::hash_route", mutates_args=("weights_out", "indices_out"))
def hash_route(
    logits: Tensor, token_ids: Tensor, tid2eid: Tensor, weights_out: Tensor, indices_out: Tensor,
    routed_scaling_factor: float,
) -> None:
    """indices = tid2eid[token_ids]; weights = renormalised sqrt(softplus(logits))[indices] * scale."""
    _router_checks.hash_route(logits, token_ids, tid2eid, weights_out, indices_out)
    _router.hash_route(logits, token_ids, tid2eid, weights_out, indices_out, routed_scaling_factor)


@custom_op("dsv4::router_gate", mutates_args=("logits_out", "weights_out", "indices_out"))
def router_gate(
    x: Tensor, weight: Tensor, bias: Tensor, logits_out: Tensor, weights_out: Tensor, indices_out: Tensor,
    routed_scaling_factor: float,
) -> None:
    """logits = x @ weight.T (fp32), then gate_topk; one kernel for decode-sized batches on GPU."""
    _router_checks.router_gate(x, weight, bias, logits_out, weights_out, indices_out)
    _router.router_gate(x, weight, bias, logits_out, weights_out, indices_out, routed_scaling_factor)
