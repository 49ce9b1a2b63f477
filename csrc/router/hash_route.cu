// SPDX-License-Identifier: MIT
// hash_route: indices = tid2eid[token_ids]; weights = renormalised sqrt(softplus(logits))[indices] * scale.
// One warp per token, lane r handles slot r (r < k). A token id outside [0, vocab) or a table entry
// outside [0, experts) reads nothing: its slots get index -1 and weight 0 (the eager API rejects both).
#include "common.cuh"
#include "params.h"

namespace dsv4::router {
namespace {

template <typename T>
__global__ void __launch_bounds__(kWarpsPerBlock * 32) hash_route_kernel(const HashRouteParams p) {
  const int lane = threadIdx.x & 31;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  if (t >= p.tokens) return;

  const T* logits = static_cast<const T*>(p.logits) + t * p.logits_stride[0];
  const int64_t token = load_index(p.token_ids, p.token_ids_int64, t * p.token_ids_stride);
  const bool token_ok = token >= 0 && token < p.vocab;
  float* weights = p.weights + t * p.weights_stride[0];
  int64_t* indices = p.indices + t * p.indices_stride[0];

  float part = 0.f;
  for (int64_t r = lane; r < p.k; r += 32) {
    const int64_t e =
        token_ok ? load_index(p.tid2eid, p.tid2eid_int64, token * p.tid2eid_stride[0] + r * p.tid2eid_stride[1]) : -1;
    const bool ok = e >= 0 && e < p.experts;
    const float s = ok ? sqrt_softplus(to_float(logits[e * p.logits_stride[1]])) : 0.f;
    part += s;
    weights[r * p.weights_stride[1]] = s;
    indices[r * p.indices_stride[1]] = ok ? e : -1;
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) part += __shfl_xor_sync(kFullMask, part, offset);

  // Each lane rescales the slots it wrote itself, so no cross-lane ordering is needed.
  const float denom = part + 1e-20f;
  for (int64_t r = lane; r < p.k; r += 32) {
    float& w = weights[r * p.weights_stride[1]];
    w = w / denom * p.routed_scaling_factor;
  }
}

}  // namespace

void hash_route_launch(const HashRouteParams& p, cudaStream_t stream) {
  const dim3 grid((p.tokens + kWarpsPerBlock - 1) / kWarpsPerBlock), block(kWarpsPerBlock * 32);
  switch (p.logits_dtype) {
    case Dtype::kFloat32: hash_route_kernel<float><<<grid, block, 0, stream>>>(p); return;
    case Dtype::kBFloat16: hash_route_kernel<__nv_bfloat16><<<grid, block, 0, stream>>>(p); return;
    case Dtype::kFloat16: hash_route_kernel<__half><<<grid, block, 0, stream>>>(p); return;
  }
}

}  // namespace dsv4::router
