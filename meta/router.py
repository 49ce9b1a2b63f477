"""Fakes of the router ops: the same metadata rules as the kernels, no data touched and no side
effect (no build, no kernel registration: tracing must not change what a later run dispatches to;
the CUDA kernels bind on the first run with CUDA tensors, see dsv4ops.router.api)."""

import torch

from dsv4ops.router import checks


@torch.library.register_fake("dsv4::gate_topk")
def _(logits, bias, weights_out, indices_out, routed_scaling_factor):
    checks.gate_topk(logits, bias, weights_out, indices_out, routed_scaling_factor)


@torch.library.register_fake("dsv4::hash_route")
def _(logits, token_ids, tid2eid, weights_out, indices_out, routed_scaling_factor):
    checks.hash_route(logits, token_ids, tid2eid, weights_out, indices_out, routed_scaling_factor)


@torch.library.register_fake("dsv4::router_gate")
def _(x, weight, bias, logits_out, weights_out, indices_out, routed_scaling_factor):
    checks.router_gate(x, weight, bias, logits_out, weights_out, indices_out, routed_scaling_factor)
