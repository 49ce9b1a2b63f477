"""Metadata rules of the router ops, shared by the real kernels and the fakes (no host sync)."""

import torch
from torch import Tensor

from dsv4ops._checks import finite_scalar

_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def _same_device(name: str, t: Tensor, ref: Tensor, ref_name: str):
    torch._check(
        t.device == ref.device, lambda: f"{name}: expected device {ref.device} (as {ref_name}), got {t.device}"
    )


def _outputs(logits_rows, weights_out: Tensor, indices_out: Tensor, ref: Tensor):
    torch._check(weights_out.dim() == 2, lambda: f"weights_out: expected 2-D [tokens, k], got {weights_out.dim()}-D")
    torch._check(
        weights_out.dtype == torch.float32, lambda: f"weights_out: expected torch.float32, got {weights_out.dtype}"
    )
    torch._check(
        indices_out.dtype == torch.int64, lambda: f"indices_out: expected torch.int64, got {indices_out.dtype}"
    )
    torch._check(
        indices_out.shape == weights_out.shape,
        lambda: f"indices_out: expected shape {tuple(weights_out.shape)} (as weights_out), got {tuple(indices_out.shape)}",
    )
    torch._check(
        weights_out.shape[0] == logits_rows,
        lambda: f"weights_out: expected {logits_rows} rows (one per token), got {weights_out.shape[0]}",
    )
    _same_device("weights_out", weights_out, ref, "logits")
    _same_device("indices_out", indices_out, ref, "logits")


def check_logits(logits: Tensor, k: int):
    torch._check(logits.dim() == 2, lambda: f"logits: expected 2-D [tokens, experts], got {logits.dim()}-D")
    torch._check(logits.dtype in _FLOATS, lambda: f"logits: expected a float dtype, got {logits.dtype}")
    torch._check(
        k <= logits.shape[1],
        lambda: f"k: expected at most the number of experts ({logits.shape[1]}), got {k}",
    )


def scaling_factor(routed_scaling_factor: float):
    finite_scalar("routed_scaling_factor", routed_scaling_factor, "the sum of a token's routed weights")


def gate_topk(logits: Tensor, bias: Tensor, weights_out: Tensor, indices_out: Tensor, routed_scaling_factor: float):
    check_logits(logits, weights_out.shape[-1] if weights_out.dim() == 2 else 0)
    scaling_factor(routed_scaling_factor)
    torch._check(
        bias.dim() == 1 and bias.shape[0] == logits.shape[1],
        lambda: f"bias: expected shape ({logits.shape[1]},) (one per expert), got {tuple(bias.shape)}",
    )
    torch._check(bias.dtype == torch.float32, lambda: f"bias: expected torch.float32, got {bias.dtype}")
    _same_device("bias", bias, logits, "logits")
    _outputs(logits.shape[0], weights_out, indices_out, logits)


def hash_route(logits: Tensor, token_ids: Tensor, tid2eid: Tensor, weights_out: Tensor, indices_out: Tensor,
               routed_scaling_factor: float):
    check_logits(logits, weights_out.shape[-1] if weights_out.dim() == 2 else 0)
    scaling_factor(routed_scaling_factor)
    torch._check(
        token_ids.dim() == 1 and token_ids.shape[0] == logits.shape[0],
        lambda: f"token_ids: expected shape ({logits.shape[0]},) (one per token), got {tuple(token_ids.shape)}",
    )
    torch._check(
        token_ids.dtype in (torch.int32, torch.int64), lambda: f"token_ids: expected int32 or int64, got {token_ids.dtype}"
    )
    torch._check(tid2eid.dim() == 2, lambda: f"tid2eid: expected 2-D [vocab, k], got {tid2eid.dim()}-D")
    torch._check(
        tid2eid.dtype in (torch.int32, torch.int64), lambda: f"tid2eid: expected int32 or int64, got {tid2eid.dtype}"
    )
    _same_device("token_ids", token_ids, logits, "logits")
    _same_device("tid2eid", tid2eid, logits, "logits")
    _outputs(logits.shape[0], weights_out, indices_out, logits)
    torch._check(
        weights_out.shape[1] == tid2eid.shape[1],
        lambda: f"weights_out: expected k = {tid2eid.shape[1]} (tid2eid columns), got {weights_out.shape[1]}",
    )


def router_gate(x: Tensor, weight: Tensor, bias: Tensor, logits_out: Tensor, weights_out: Tensor, indices_out: Tensor,
                routed_scaling_factor: float):
    torch._check(x.dim() == 2, lambda: f"x: expected 2-D [tokens, hidden], got {x.dim()}-D")
    torch._check(x.dtype in _FLOATS, lambda: f"x: expected a float dtype, got {x.dtype}")
    torch._check(
        weight.dim() == 2 and weight.shape[1] == x.shape[1],
        lambda: f"weight: expected [experts, {x.shape[1]}], got {tuple(weight.shape)}",
    )
    torch._check(weight.dtype == x.dtype, lambda: f"weight: expected {x.dtype} (as x), got {weight.dtype}")
    torch._check(
        logits_out.shape == (x.shape[0], weight.shape[0]) and logits_out.dtype == torch.float32,
        lambda: f"logits_out: expected float32 [{x.shape[0]}, {weight.shape[0]}], got {logits_out.dtype} "
        f"{tuple(logits_out.shape)}",
    )
    _same_device("weight", weight, x, "x")
    _same_device("logits_out", logits_out, x, "x")
    gate_topk(logits_out, bias, weights_out, indices_out, routed_scaling_factor)
