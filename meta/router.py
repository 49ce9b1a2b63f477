"""Fakes of the router ops: the same metadata rules as the kernels, no data touched. A trace that
meets CUDA tensors also binds the router's CUDA kernels (dsv4ops.router.api.load_cuda_backends):
tracing runs these fakes before the compiled graph first runs, and the public functions skip the
loading under torch.compile."""

import torch

from dsv4ops.router import checks


def _bind_cuda_kernels(t):
    if t.device.type == "cuda":
        from dsv4ops.router.api import load_cuda_backends

        load_cuda_backends()


@torch.library.register_fake("dsv4::gate_topk")
def _(logits, bias, weights_out, indices_out, routed_scaling_factor):
    checks.gate_topk(logits, bias, weights_out, indices_out)
    _bind_cuda_kernels(logits)


@torch.library.register_fake("dsv4::hash_route")
def _(logits, token_ids, tid2eid, weights_out, indices_out, routed_scaling_factor):
    checks.hash_route(logits, token_ids, tid2eid, weights_out, indices_out)
    _bind_cuda_kernels(logits)


@torch.library.register_fake("dsv4::router_gate")
def _(x, weight, bias, logits_out, weights_out, indices_out, routed_scaling_factor):
    checks.router_gate(x, weight, bias, logits_out, weights_out, indices_out)
    _bind_cuda_kernels(x)
