// SPDX-License-Identifier: MIT
// Kernel parameters of the router ops: plain data, no torch types, so the .cu files build without torch headers.
#pragma once
#include <cstdint>

#include <cuda_runtime_api.h>

namespace dsv4::router {

enum class Dtype { kFloat32, kBFloat16, kFloat16 };

// Strides are in elements, int64 so that no byte offset overflows.
struct GateTopkParams {
  const void* logits;        // [tokens, experts], `logits_dtype`
  const float* bias;         // [experts]
  float* weights;            // [tokens, k]
  int64_t* indices;          // [tokens, k]
  int64_t tokens, experts, k;
  int64_t logits_stride[2], bias_stride, weights_stride[2], indices_stride[2];
  float routed_scaling_factor;
  Dtype logits_dtype;
};

struct HashRouteParams {
  const void* logits;        // [tokens, experts], `logits_dtype`
  const void* token_ids;     // [tokens], int64 if `token_ids_int64` else int32
  const void* tid2eid;       // [vocab, k], int64 if `tid2eid_int64` else int32
  float* weights;            // [tokens, k]
  int64_t* indices;          // [tokens, k]
  int64_t tokens, experts, vocab, k;
  int64_t logits_stride[2], token_ids_stride, tid2eid_stride[2], weights_stride[2], indices_stride[2];
  float routed_scaling_factor;
  Dtype logits_dtype;
  bool token_ids_int64, tid2eid_int64;
};

// The largest expert count gate_topk serves: 32 lanes x 32 register items per lane.
constexpr int64_t kMaxExperts = 1024;

void gate_topk_launch(const GateTopkParams& p, cudaStream_t stream);
void hash_route_launch(const HashRouteParams& p, cudaStream_t stream);

}  // namespace dsv4::router
