// SPDX-License-Identifier: MIT
// The merge of the split-KV partials of both sparse_attn kernels (p.splits > 1):
//   out = sum_s 2^lse_s o_s / (sum_s 2^lse_s + 2^sink)
// over the live splits (those holding keys of the token's list: the window's tiles and its comp_lens
// entries; split 0 always); o_s is split s's output normalized by its own sum (bf16), lse_s log2 of
// that sum (fp32).
//
// Two kernels. With many (token, head) pairs or few splits, serial_kernel: one CTA a pair, a thread 4
// dims walking the splits in rounds of loads. With few pairs and many splits (a few tokens of HCA at
// long contexts), grouped_kernel: a CTA holds one pair and C of its four 128-dim chunks (a lane 4 dims)
// with W warps a chunk; the W warps take the splits round robin, kLoads splits' loads in flight at
// once, and add their sums through shared memory; C shrinks as W grows so that a CTA stays at 16
// warps. launch_combine picks W. H100, sparse_attn with its combine at one token of
// HCA 1 x 1M (130 splits at 16 heads): 43.3 us with serial_kernel, 17.8 with grouped_kernel.
#include <cuda_bf16.h>

#include <cstdint>

#include "../common/pdl.cuh"
#include "pipeline.cuh"

namespace dsv4::sparse_attn {
namespace {

constexpr int kChunk = 128;         // dims of a chunk: 32 lanes x 4
constexpr int kChunks = kDim / kChunk;
constexpr int kMaxWarps = 16;       // warps of a CTA at most
constexpr int kLoads = 4;           // splits a warp loads before it adds them

#ifdef DSV4_SM90_BODY
__device__ __forceinline__ float warp_max(float x) {
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) x = fmaxf(x, __shfl_xor_sync(0xffffffffu, x, d));
  return x;
}
// Four bf16 (in memory order) as floats: a bf16 is the top half of its fp32.
__device__ __forceinline__ float4 bf16x4_to_float4(uint2 v) {
  return make_float4(__uint_as_float(v.x << 16), __uint_as_float(v.x & 0xffff0000u), __uint_as_float(v.y << 16),
                     __uint_as_float(v.y & 0xffff0000u));
}
__device__ __forceinline__ float warp_sum(float x) {
#pragma unroll
  for (int d = 16; d > 0; d >>= 1) x += __shfl_xor_sync(0xffffffffu, x, d);
  return x;
}
#endif

// Block (32, W, C): lane, split group, chunk of the CTA; grid (tokens, heads, kChunks / C). Three CTAs
// of 16 warps a SM hold 40 registers a thread: four loads in flight without spilling.
__global__ void __launch_bounds__(kMaxWarps * 32, 3) grouped_kernel(const __grid_constant__ Params p) {
#ifdef DSV4_SM90_BODY
  __shared__ float4 sums[kMaxWarps][32];
  pdl::wait_prior_grid();  // the splits' partial outputs
  const int64_t token = blockIdx.x;
  const int head = blockIdx.y, lane = threadIdx.x, group = threadIdx.y, groups = blockDim.y;
  const int dim = (blockIdx.z * blockDim.z + threadIdx.z) * kChunk + 4 * lane;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  float den = 1.f;
  if (p.req_slots[token] >= 0) {
    const float sink = p.sinks[head] * kLog2e;
    const int64_t row0 = token * p.splits * p.heads + head;
    const int keys = p.window_keys + min(p.comp_lens[token], p.n_idx);
    const int live = min(p.splits, (keys + p.split_keys - 1) / p.split_keys);
    // A round: kLoads splits of this warp, their partials and exponents loaded together. The first
    // round's loads are issued before the largest exponent is known (they do not depend on it).
    const int stride = kLoads * groups;
    uint2 o[kLoads];  // 4 bf16
    float l[kLoads];
    // 32-bit offsets from the token-head's first row (splits x heads x 512 < 2^31, checked on the host):
    // 64-bit addresses per load cost the registers that keep four loads in flight.
    const __nv_bfloat16* part = p.partial + row0 * kDim + dim;
    const float* lse = p.lse + row0;
    auto load = [&](int s0) {
#pragma unroll
      for (int u = 0; u < kLoads; ++u) {
        const int s = s0 + u * groups;
        const bool in = s < live;
        o[u] = in ? __ldg(reinterpret_cast<const uint2*>(part + s * p.heads * kDim)) : make_uint2(0, 0);
        l[u] = in ? __ldg(lse + s * p.heads) : -INFINITY;
      }
    };
    load(group);
    // The largest exponent and the denominator, the splits over the lanes (every warp the same).
    float m = sink;
    for (int s = lane; s < live; s += 32) m = fmaxf(m, lse[s * p.heads]);
    m = warp_max(m);
    float d = 0.f;
    for (int s = lane; s < live; s += 32) d += exp2f(lse[s * p.heads] - m);
    den = warp_sum(d) + exp2f(sink - m);
    for (int s0 = group; s0 < live; s0 += stride) {
#pragma unroll
      for (int u = 0; u < kLoads; ++u) {
        const float w = exp2f(l[u] - m);
        const float4 v = bf16x4_to_float4(o[u]);
        acc.x += w * v.x, acc.y += w * v.y, acc.z += w * v.z, acc.w += w * v.w;
      }
      if (s0 + stride < live) load(s0 + stride);
    }
  }
  const int warp = threadIdx.z * groups + group;
  sums[warp][lane] = acc;
  __syncthreads();
  if (group != 0) return;
  for (int g = 1; g < groups; ++g) {
    const float4 o = sums[warp + g][lane];
    acc.x += o.x, acc.y += o.y, acc.z += o.z, acc.w += o.w;
  }
  auto* out = static_cast<__nv_bfloat16*>(p.out) + token * p.out_stride_token + head * p.out_stride_head + dim;
  *reinterpret_cast<uint2*>(out) = make_uint2(bf16x2(acc.x / den, acc.y / den), bf16x2(acc.z / den, acc.w / den));
#else
  __trap();
#endif
}

// One CTA per (token, head), a thread 4 dims: the kernel for one split group. The splits come in rounds
// of kRound whose exponents and partials are loaded together and merged into the running max and sums
// (rescaled when a round raises the max), so a token of up to kRound live splits costs one round trip
// to L2 after its row inputs, the same sums in the same order as one pass at the largest exponent.
// kRound follows the split count (2, 4, else 8; at most 40 registers a thread): rounds of 16 took 96,
// and at 4 splits (CSA 32 x 4K: 2048 CTAs) cost more than the round trips saved, by the register
// count the lower occupancy (not profiled; H100, 24.3 us against 19.4-19.9); rounds of 4 at 2 splits
// cost V4-Pro CSA 32 x 4K 40.7-40.9 us against 39.8-39.9 (rounds of 2: 39.0-39.2).
template <int kRound>
__global__ void __launch_bounds__(kDim / 4) serial_kernel(const __grid_constant__ Params p) {
#ifdef DSV4_SM90_BODY
  pdl::wait_prior_grid();  // the splits' partial outputs
  const int64_t token = blockIdx.x;
  const int head = blockIdx.y;
  const int dim = threadIdx.x * 4;
  auto* out = static_cast<__nv_bfloat16*>(p.out) + token * p.out_stride_token + head * p.out_stride_head + dim;
  // Loaded together: none depends on another.
  const int req = p.req_slots[token], comp_len = p.comp_lens[token];
  const float sink = p.sinks[head] * kLog2e;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  if (req >= 0) {
    const int64_t row0 = token * p.splits * p.heads + head;
    const int keys = p.window_keys + min(comp_len, p.n_idx);
    const int live = min(p.splits, (keys + p.split_keys - 1) / p.split_keys);
    const __nv_bfloat16* part = p.partial + row0 * kDim + dim;
    const float* lse = p.lse + row0;
    float m = sink, den = 1.f;  // the sink's term e^(sink - m)
    for (int s0 = 0; s0 < live; s0 += kRound) {
      float l[kRound];
      uint2 o[kRound];  // 4 bf16
#pragma unroll
      for (int u = 0; u < kRound; ++u) {
        const int s = s0 + u;
        const bool in = s < live;
        // 32-bit offsets (splits x heads x 512 < 2^31, checked on the host), as in grouped_kernel.
        l[u] = in ? __ldg(lse + s * p.heads) : -INFINITY;
        o[u] = in ? __ldg(reinterpret_cast<const uint2*>(part + s * p.heads * kDim)) : make_uint2(0, 0);
      }
      float mr = m;
#pragma unroll
      for (int u = 0; u < kRound; ++u) mr = fmaxf(mr, l[u]);
      const float c = exp2f(m - mr);
      den *= c, acc.x *= c, acc.y *= c, acc.z *= c, acc.w *= c;
#pragma unroll
      for (int u = 0; u < kRound; ++u) {
        const float w = exp2f(l[u] - mr);
        const float4 v = bf16x4_to_float4(o[u]);
        den += w;
        acc.x += w * v.x, acc.y += w * v.y, acc.z += w * v.z, acc.w += w * v.w;
      }
      m = mr;
    }
    acc.x /= den, acc.y /= den, acc.z /= den, acc.w /= den;
  }
  *reinterpret_cast<uint2*>(out) = make_uint2(bf16x2(acc.x, acc.y), bf16x2(acc.z, acc.w));
#else
  __trap();
#endif
}

}  // namespace

void launch_combine(const Params& p, cudaStream_t stream) {
  int device = 0, sms = 0;
  cudaGetDevice(&device);
  cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device);
  // Split groups (a power of two) while a group has more than kLoads splits to load and the threads
  // stay within one wave (1536 a SM at 40 registers): many (token, head) pairs already fill the GPU,
  // and more groups there only add waves.
  const int64_t pairs = static_cast<int64_t>(p.tokens) * p.heads;
  int groups = 1;
  while (groups < kMaxWarps && groups * kLoads < p.splits && pairs * 128 * groups * 2 <= int64_t{sms} * 1536) {
    groups *= 2;
  }
  if (groups == 1) {
    // H100, 2 splits of CSA 64 x 4K at 32 heads (2048 pairs): 31.3 us here, 36.2 through grouped_kernel
    // with one group (the same occupancy; not understood, not profiled).
    auto* kernel = p.splits <= 2 ? serial_kernel<2> : p.splits <= 4 ? serial_kernel<4> : serial_kernel<8>;
    pdl::launch_pdl(kernel, dim3(p.tokens, p.heads), dim3(kDim / 4), 0, stream, p);
    return;
  }
  const int chunks = groups <= kMaxWarps / kChunks ? kChunks : kMaxWarps / groups;
  pdl::launch_pdl(grouped_kernel, dim3(p.tokens, p.heads, kChunks / chunks), dim3(32, groups, chunks), 0, stream, p);
}

}  // namespace dsv4::sparse_attn
