// SPDX-License-Identifier: MIT
// gate_topk: scores = sqrt(softplus(logits)); indices = top-k(scores + bias), ties to the lower expert;
// weights = scores[indices] / sum * routed_scaling_factor. One warp per token; expert e lives in lane
// e % 32, register e / 32. Each of the k rounds is a lane-local scan plus two warp reductions.
#include "common.cuh"
#include "params.h"

namespace dsv4::router {
namespace {

template <typename T, int kItems>
__global__ void __launch_bounds__(kWarpsPerBlock * 32) gate_topk_kernel(const GateTopkParams p) {
  const int lane = threadIdx.x & 31;
  const int64_t t = static_cast<int64_t>(blockIdx.x) * kWarpsPerBlock + (threadIdx.x >> 5);
  if (t >= p.tokens) return;

  const T* logits = static_cast<const T*>(p.logits) + t * p.logits_stride[0];
  uint32_t key[kItems];
  float score[kItems];
#pragma unroll
  for (int j = 0; j < kItems; ++j) {
    const int64_t e = j * 32 + lane;
    key[j] = 0;
    score[j] = 0.f;
    if (e < p.experts) {
      score[j] = sqrt_softplus(to_float(logits[e * p.logits_stride[1]]));
      key[j] = order_key(score[j] + p.bias[e * p.bias_stride]);
    }
  }

  float* weights = p.weights + t * p.weights_stride[0];
  int64_t* indices = p.indices + t * p.indices_stride[0];
  float sum = 0.f;
  uint32_t taken = 0;  // bit j: register item j was selected in an earlier round
  for (int64_t r = 0; r < p.k; ++r) {
    // Strict '>' over increasing j keeps the lane's lowest expert among equal keys. Registers are
    // only read with compile-time indices (a runtime index would move them to local memory).
    uint32_t best = 0;
    int best_j = 0;
    float best_score = 0.f;
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      if (!((taken >> j) & 1u) && key[j] > best) {
        best = key[j];
        best_j = j;
        best_score = score[j];
      }
    }
    // k <= experts leaves an untaken real key (> 0) in every round, so `top` is a real expert.
    const uint32_t top = __reduce_max_sync(kFullMask, best);
    const uint32_t winner = __reduce_min_sync(kFullMask, best == top ? best_j * 32u + lane : 0xffffffffu);
    const int owner = winner & 31;
    if (lane == owner) taken |= 1u << best_j;
    const float s = __shfl_sync(kFullMask, best_score, owner);
    sum += s;
    if (lane == 0) {
      weights[r * p.weights_stride[1]] = s;
      indices[r * p.indices_stride[1]] = winner;
    }
  }
  // Lane 0 wrote the raw scores; the warp now rescales them (same expression order as the reference).
  __syncwarp();
  const float denom = sum + 1e-20f;
  for (int64_t r = lane; r < p.k; r += 32) {
    float& w = weights[r * p.weights_stride[1]];
    w = w / denom * p.routed_scaling_factor;
  }
}

template <typename T>
void launch_typed(const GateTopkParams& p, cudaStream_t stream) {
  const dim3 grid((p.tokens + kWarpsPerBlock - 1) / kWarpsPerBlock), block(kWarpsPerBlock * 32);
  // Register items per lane: the smallest listed count that covers the experts (256 -> 8, 384 -> 12).
  if (p.experts <= 64) {
    gate_topk_kernel<T, 2><<<grid, block, 0, stream>>>(p);
  } else if (p.experts <= 128) {
    gate_topk_kernel<T, 4><<<grid, block, 0, stream>>>(p);
  } else if (p.experts <= 256) {
    gate_topk_kernel<T, 8><<<grid, block, 0, stream>>>(p);
  } else if (p.experts <= 384) {
    gate_topk_kernel<T, 12><<<grid, block, 0, stream>>>(p);
  } else if (p.experts <= 512) {
    gate_topk_kernel<T, 16><<<grid, block, 0, stream>>>(p);
  } else {
    gate_topk_kernel<T, 32><<<grid, block, 0, stream>>>(p);
  }
}

}  // namespace

void gate_topk_launch(const GateTopkParams& p, cudaStream_t stream) {
  switch (p.logits_dtype) {
    case Dtype::kFloat32: return launch_typed<float>(p, stream);
    case Dtype::kBFloat16: return launch_typed<__nv_bfloat16>(p, stream);
    case Dtype::kFloat16: return launch_typed<__half>(p, stream);
  }
}

}  // namespace dsv4::router
