// SPDX-License-Identifier: MIT
// The merge of a token's splits inside both sm_90 sparse_attn kernels (sparse_attn.cu, 64 heads a
// CTA; small_heads.cu, 8 / 16): the token's splits are one thread-block cluster (launch: cluster
// 1 x 1 x splits, so a CTA's rank is its split), and each CTA has staged its split's normalized bf16
// output in a tile of its shared memory (head row r at r * 1024, 16-B chunk c at c ^ (r % 8): the
// tile store_out reads) and its heads' log2-sums beside it (-inf: no key, nothing staged). Between
// two cluster barriers, split r merges heads r, r + S, ... of every split over distributed shared
// memory, the combine's
//   out = sum_s 2^lse_s o_s / (sum_s 2^lse_s + 2^sink),
// 8 dims a thread (one 16-B load a split); the second barrier keeps each CTA's shared memory alive
// until its peers have read it. No partial output leaves the SMs and no second kernel runs.
// H100, V4-Flash HCA 8 x 16K, graph-timed us: the combine kernel 13.3, this merge 11.5-11.6 (8-B loads:
// 12.1-12.2), the two barriers alone 8.5-8.6 (a timing probe): what is left is the (S - 1) / S x H KiB
// a CTA reads from its peers, ~14 B a cycle an SM.
// Each kernel merges in an instantiation of its own (kMerge): with the cluster instructions in the one
// kernel, small_heads.cu took 2-4% more at one split (H100, same call, us, at 8 / 16 / 32 heads: CSA
// 128 x 4K 32.6-32.8 / 34.9-35.0 / 38.0-38.2 against 31.9-32.5 / 34.0-34.6 / 37.1-37.8 before the
// merge, sliding 256 x 4K 16.3-16.6 / 18.3-18.7 / 24.7-25.2 against 15.8-16.0 / 17.7-18.0 / 24.1-24.4);
// with its own, 31.7-31.8 / 33.9-34.1 / 37.6-37.7 against 31.6-31.7 / 33.7-33.8 / 37.1-37.3, sliding
// 15.9 / 18.1-18.2 / 24.7 against 15.6-16.0 / 17.5-17.9 / 24.0-24.4 (1-2% left at 16 and 32 heads, not
// found), and sparse_attn.cu's one-split kernel 0-1% faster than with the cluster instructions.
#pragma once
#include <cuda_bf16.h>

#include <cstdint>

#include "pipeline.cuh"

namespace dsv4::sparse_attn {

#ifdef DSV4_SM90_BODY
// Threads t = 0 .. kMergers - 1 of each CTA of the cluster merge the staged tiles (`tile`: kRows
// rows, `lse`: kRows floats, at the same offsets in every CTA) of heads head0 ..; every other thread
// of the cluster passes the two barriers with `merge_barriers`.
template <int kRows, int kMergers>
__device__ __forceinline__ void merge_splits(const uint8_t* tile, const float* lse, const Params& p, int64_t token,
                                             int head0, int t) {
  cluster_sync();
  const int splits = p.splits;
  const int rank = static_cast<int>(cluster_rank());
  const uint32_t tile_base = smem_addr(tile), lse_base = smem_addr(lse);
  const int chunk = t & 63;  // 16-B chunk of a 1024-B row: dims 8 chunk .. 8 chunk + 7
  for (int h = rank + splits * (t >> 6); h < kRows && head0 + h < p.heads; h += splits * (kMergers / 64)) {
    const int head = head0 + h;
    const uint32_t at = tile_base + h * 1024 + ((chunk ^ (h & 7)) << 4);
    float l[kMaxClusterSplits];
    uint4 o[kMaxClusterSplits];  // 8 bf16
    const float sink = p.sinks[head] * kLog2e;
    float m = sink;
#pragma unroll
    for (int s = 0; s < kMaxClusterSplits; ++s) {
      if (s < splits) {
        l[s] = ld_peer_f32(peer_addr(lse_base + 4 * h, s));
        o[s] = ld_peer_u4(peer_addr(at, s));
        m = fmaxf(m, l[s]);
      }
    }
    float den = exp2f(sink - m), acc[8] = {};
#pragma unroll
    for (int s = 0; s < kMaxClusterSplits; ++s) {
      // A split with no key staged nothing (its weight is 0, its bytes may be anything).
      if (s < splits && l[s] > -INFINITY) {
        const float e = exp2f(l[s] - m);
        const uint32_t w[4] = {o[s].x, o[s].y, o[s].z, o[s].w};
        den += e;
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          acc[2 * i] += e * __uint_as_float(w[i] << 16);
          acc[2 * i + 1] += e * __uint_as_float(w[i] & 0xffff0000u);
        }
      }
    }
    const float inv = 1.f / den;
    auto* out = static_cast<__nv_bfloat16*>(p.out) + token * p.out_stride_token + head * p.out_stride_head + 8 * chunk;
    *reinterpret_cast<uint4*>(out) = make_uint4(bf16x2(acc[0] * inv, acc[1] * inv), bf16x2(acc[2] * inv, acc[3] * inv),
                                                bf16x2(acc[4] * inv, acc[5] * inv), bf16x2(acc[6] * inv, acc[7] * inv));
  }
  cluster_sync();
}

// The two barriers of `merge_splits` for the threads that merge nothing.
__device__ __forceinline__ void merge_barriers() {
  cluster_sync();
  cluster_sync();
}
#endif  // DSV4_SM90_BODY

// Clusters of `splits` CTAs of `kernel` (one CTA an SM: `smem` bytes, kThreads threads) that the device
// holds at once (cudaOccupancyMaxActiveClusters, after the kernel's shared-memory opt-in; 0 if the query
// fails). Clusters of whole-SM CTAs pack by GPC, not by SM count: the H100's 132 SMs hold 66 clusters of
// 2, 39 of 3, 30 of 4, 22 of 5, 17 of 6 and 15 of 7 or 8. The launcher (dsv4ops/sparse_attn/cuda.py)
// merges in clusters only where the grid's fit at once: 32 clusters of 4 merged took 31.8 us at CSA 32 x
// 4K, 19.0 with the combine.
int max_clusters(const void* kernel, int splits, int smem);

}  // namespace dsv4::sparse_attn
