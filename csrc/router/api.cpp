// SPDX-License-Identifier: MIT
// Host side of gate_topk / hash_route: checks -> params -> launch on the current stream. The checks
// mirror dsv4ops/router/checks.py (the op's Python body is not run once this CUDA kernel is bound).
#include "api.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include "../common/checks.h"
#include "params.h"

namespace dsv4::router {
namespace {

Dtype logits_dtype(const at::Tensor& logits) {
  switch (logits.scalar_type()) {
    case at::kFloat: return Dtype::kFloat32;
    case at::kBFloat16: return Dtype::kBFloat16;
    case at::kHalf: return Dtype::kFloat16;
    default: DSV4_CHECK(false, "logits: expected a float dtype (float32, bfloat16, float16), got ", logits.scalar_type());
  }
}

// Shared by both ops: logits [tokens, experts] and the [tokens, k] fp32 / int64 outputs.
void check_logits_and_outputs(const at::Tensor& logits, const at::Tensor& weights_out, const at::Tensor& indices_out) {
  DSV4_CHECK_CUDA(logits);
  DSV4_CHECK_DIM(logits, 2);
  logits_dtype(logits);
  DSV4_CHECK_DIM(weights_out, 2);
  DSV4_CHECK_DTYPE(weights_out, at::kFloat);
  DSV4_CHECK_DTYPE(indices_out, at::kLong);
  DSV4_CHECK(indices_out.sizes() == weights_out.sizes(), "indices_out: expected shape ", weights_out.sizes(),
              " (as weights_out), got ", indices_out.sizes());
  DSV4_CHECK(weights_out.size(0) == logits.size(0), "weights_out: expected ", logits.size(0),
              " rows (one per token), got ", weights_out.size(0));
  DSV4_CHECK(weights_out.size(1) <= logits.size(1), "k: expected at most the number of experts (", logits.size(1),
              "), got ", weights_out.size(1));
  DSV4_CHECK_SAME_DEVICE(weights_out, logits);
  DSV4_CHECK_SAME_DEVICE(indices_out, logits);
}

}  // namespace

void gate_topk_cuda(const at::Tensor& logits, const at::Tensor& bias, at::Tensor& weights_out, at::Tensor& indices_out,
                    double routed_scaling_factor) {
  check_logits_and_outputs(logits, weights_out, indices_out);
  DSV4_CHECK(bias.dim() == 1 && bias.size(0) == logits.size(1), "bias: expected shape (", logits.size(1),
              ",) (one per expert), got ", bias.sizes());
  DSV4_CHECK_DTYPE(bias, at::kFloat);
  DSV4_CHECK_SAME_DEVICE(bias, logits);
  DSV4_CHECK(logits.size(1) <= kMaxExperts, "logits: the gate_topk CUDA kernel serves at most ", kMaxExperts,
              " experts, got ", logits.size(1));
  if (logits.size(0) == 0 || weights_out.size(1) == 0) return;

  const c10::cuda::CUDAGuard guard(logits.device());
  GateTopkParams p{};
  p.logits = logits.const_data_ptr();
  p.bias = bias.const_data_ptr<float>();
  p.weights = weights_out.mutable_data_ptr<float>();
  p.indices = indices_out.mutable_data_ptr<int64_t>();
  p.tokens = logits.size(0);
  p.experts = logits.size(1);
  p.k = weights_out.size(1);
  p.logits_stride[0] = logits.stride(0);
  p.logits_stride[1] = logits.stride(1);
  p.bias_stride = bias.stride(0);
  p.weights_stride[0] = weights_out.stride(0);
  p.weights_stride[1] = weights_out.stride(1);
  p.indices_stride[0] = indices_out.stride(0);
  p.indices_stride[1] = indices_out.stride(1);
  p.routed_scaling_factor = static_cast<float>(routed_scaling_factor);
  p.logits_dtype = logits_dtype(logits);
  gate_topk_launch(p, c10::cuda::getCurrentCUDAStream(logits.get_device()).stream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

void hash_route_cuda(const at::Tensor& logits, const at::Tensor& token_ids, const at::Tensor& tid2eid,
                     at::Tensor& weights_out, at::Tensor& indices_out, double routed_scaling_factor) {
  check_logits_and_outputs(logits, weights_out, indices_out);
  DSV4_CHECK(token_ids.dim() == 1 && token_ids.size(0) == logits.size(0), "token_ids: expected shape (",
              logits.size(0), ",) (one per token), got ", token_ids.sizes());
  DSV4_CHECK_INDEX_DTYPE(token_ids);
  DSV4_CHECK_DIM(tid2eid, 2);
  DSV4_CHECK_INDEX_DTYPE(tid2eid);
  DSV4_CHECK_SAME_DEVICE(token_ids, logits);
  DSV4_CHECK_SAME_DEVICE(tid2eid, logits);
  DSV4_CHECK(weights_out.size(1) == tid2eid.size(1), "weights_out: expected k = ", tid2eid.size(1),
              " (tid2eid columns), got ", weights_out.size(1));
  if (logits.size(0) == 0 || weights_out.size(1) == 0) return;

  const c10::cuda::CUDAGuard guard(logits.device());
  HashRouteParams p{};
  p.logits = logits.const_data_ptr();
  p.token_ids = token_ids.const_data_ptr();
  p.tid2eid = tid2eid.const_data_ptr();
  p.weights = weights_out.mutable_data_ptr<float>();
  p.indices = indices_out.mutable_data_ptr<int64_t>();
  p.tokens = logits.size(0);
  p.experts = logits.size(1);
  p.vocab = tid2eid.size(0);
  p.k = weights_out.size(1);
  p.logits_stride[0] = logits.stride(0);
  p.logits_stride[1] = logits.stride(1);
  p.token_ids_stride = token_ids.stride(0);
  p.tid2eid_stride[0] = tid2eid.stride(0);
  p.tid2eid_stride[1] = tid2eid.stride(1);
  p.weights_stride[0] = weights_out.stride(0);
  p.weights_stride[1] = weights_out.stride(1);
  p.indices_stride[0] = indices_out.stride(0);
  p.indices_stride[1] = indices_out.stride(1);
  p.routed_scaling_factor = static_cast<float>(routed_scaling_factor);
  p.logits_dtype = logits_dtype(logits);
  p.token_ids_int64 = token_ids.scalar_type() == at::kLong;
  p.tid2eid_int64 = tid2eid.scalar_type() == at::kLong;
  hash_route_launch(p, c10::cuda::getCurrentCUDAStream(logits.get_device()).stream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace dsv4::router
