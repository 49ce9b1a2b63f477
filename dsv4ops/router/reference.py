"""Pure-PyTorch V4 router kernels: the CPU kernels of the `dsv4::` router ops and the oracle for
every router backend. Semantics follow transformers' DeepseekV4TopKRouter / DeepseekV4HashRouter.

Row-invariant: a token's weights and indices are bitwise the same whatever other tokens share the
call (gate_topk, hash_route; router_gate's GEMM is not: dsv4ops.router.api.router_gate's
batch_invariant)."""

import torch
import torch.nn.functional as F
from torch import Tensor

# ATen's CPU softplus runs 2 x SIMD width elements at a time (Sleef's exp / log1p) and a call's last
# < 2 x width elements, and those before each thread's chunk boundary (calls of >= 32768 elements),
# one at a time (libm's): the two differ by an ulp, so a token's scores would follow its place in
# the batch (12 experts, 37 tokens: 3 of 37 rows differ from the row alone, x86-64 AVX2). Rows
# padded to a multiple of 64 values, in calls of < 32768 values, run every element on the SIMD path.
_ROW_PAD = 64
_GRAIN = 32768


def sqrt_softplus(logits: Tensor) -> Tensor:
    """The V4 router score: sqrt(softplus(x)), computed in fp32, each row's bits its own."""
    x = logits.float()
    e = x.shape[-1]
    if x.numel() == 0:
        return x
    rows = x.reshape(-1, e)
    padded = F.pad(rows, (0, -e % _ROW_PAD))
    per_call = max(1, (_GRAIN - 1) // padded.shape[1])
    out = torch.cat([F.softplus(chunk) for chunk in padded.split(per_call)])
    return out[:, :e].sqrt().view(x.shape)


def stable_topk(values: Tensor, k: int) -> Tensor:
    """Indices of the k largest entries along the last dim; exact ties pick the lower index."""
    return torch.sort(values, dim=-1, descending=True, stable=True).indices[..., :k]


def renormalize(scores: Tensor, indices: Tensor, routed_scaling_factor: float) -> Tensor:
    weights = scores.gather(-1, indices)
    # 1e-20 keeps an all-zero row finite, as in transformers.
    return weights / (weights.sum(dim=-1, keepdim=True) + 1e-20) * routed_scaling_factor


def gate_topk(logits: Tensor, bias: Tensor, weights_out: Tensor, indices_out: Tensor, routed_scaling_factor: float):
    """Bias only steers the selection; the weights come from the unbiased scores."""
    scores = sqrt_softplus(logits)
    indices = stable_topk(scores + bias.float(), indices_out.shape[-1])
    weights_out.copy_(renormalize(scores, indices, routed_scaling_factor))
    indices_out.copy_(indices)


def hash_route(
    logits: Tensor, token_ids: Tensor, tid2eid: Tensor, weights_out: Tensor, indices_out: Tensor,
    routed_scaling_factor: float,
):
    """A token id outside [0, vocab) or a table entry outside [0, experts) selects nothing: index -1,
    weight 0, and the other slots renormalise among themselves (as the CUDA kernel)."""
    scores = sqrt_softplus(logits)
    ids = token_ids.long()
    token_ok = (ids >= 0) & (ids < tid2eid.shape[0])
    indices = tid2eid[ids.where(token_ok, 0)].long()
    ok = token_ok[:, None] & (indices >= 0) & (indices < logits.shape[-1])
    indices = indices.where(ok, -1)
    picked = scores.gather(-1, indices.clamp(min=0)).where(ok, 0.0)
    weights_out.copy_(picked / (picked.sum(dim=-1, keepdim=True) + 1e-20) * routed_scaling_factor)
    indices_out.copy_(indices)


def router_gate(
    x: Tensor, weight: Tensor, bias: Tensor, logits_out: Tensor, weights_out: Tensor, indices_out: Tensor,
    routed_scaling_factor: float,
):
    """Gate GEMM (fp32 accumulate, fp32 logits) followed by gate_topk."""
    logits = F.linear(x.float(), weight.float())
    logits_out.copy_(logits)
    gate_topk(logits, bias, weights_out, indices_out, routed_scaling_factor)
