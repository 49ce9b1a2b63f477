// SPDX-License-Identifier: MIT
// Host entry points of the router's CUDA kernels, bound to the Python-defined `dsv4::` ops in dsv4ops.cpp.
#pragma once
#include <ATen/core/Tensor.h>

namespace dsv4::router {

void gate_topk_cuda(const at::Tensor& logits, const at::Tensor& bias, at::Tensor& weights_out, at::Tensor& indices_out,
                    double routed_scaling_factor);

void hash_route_cuda(const at::Tensor& logits, const at::Tensor& token_ids, const at::Tensor& tid2eid,
                     at::Tensor& weights_out, at::Tensor& indices_out, double routed_scaling_factor);

}  // namespace dsv4::router
