// SPDX-License-Identifier: MIT
// sm_90 kernel of `dsv4::sparse_attn` for 8 or 16 heads a CTA: a tensor-parallel rank's share of
// V4-Flash's 64 query heads (TP8 / TP4) or V4-Pro's 128 (TP16 / TP8). sparse_attn.cu's 64-head CTA
// runs them as 64 rows of which 8 are real, so its tensor work and its per-tile chain do not shrink
// with the heads; this kernel sizes the tensor work to the heads by swapping the operands
// (the keys become wgmma's M of 64, the heads its N):
//   S^T [64 keys x H] = K [64 x 512] q^T                 (A = the key tile, B = q, both K-major)
//   O^T [512 x H]    += V^T [512 x 64 keys] P^T [64 x H]  (A = the same key tile read MN-major,
//                                                          B = P^T, written to shared memory)
// so a 64-key tile costs 32 + 32 wgmmas of m64nHk16: at 8 heads an eighth of the 64-head kernel's
// tensor work on the same keys.
// A 32-head instantiation (three raw stages beside its buffers) was slower than sparse_attn.cu's
// 64-head CTA running the 32 heads with 32 rows of padding at every point measured, 24-512 tokens
// (H200, us, 32-head / 64-head CTA: CSA 128 x 4K 37.1 / 34.6, 512 x 4K 138.6 / 130.5,
// sliding 256 x 4K 23.5 / 21.3, HCA 512 x 4K 61.3 / 51.8), so 17-32 heads run on that one; at 16
// heads this kernel wins on sliding layers (256 x 4K 18.3 / 20.3) and is within 5% at most CSA and
// HCA points (6-14% either way at four of 24), at 8 heads it wins at every point (4-47%).
//
// One CTA = one token x H heads x one split of its key list; warpgroups by role:
//   - producers (warps 8-15, pipeline.cuh): two 32-key units a 64-key bf16 tile, two tiles;
//   - warpgroup 0 (warps 0-3): S^T of tile i, its online softmax, P^T into one of two buffers, the
//     heads' rescale factors beside it; each head's keys are spread over the four warps, so a tile's
//     running max takes one exchange through shared memory (the sums need none until the end);
//   - warpgroup 1 (warps 4-7): rescales its O^T accumulator (all 512 dims, 4H registers a thread)
//     and adds P^T V of tile i while warpgroup 0 is on tile i + 1's S^T and softmax.
// Each of warpgroup 0 and warpgroup 1 issues 32 wgmmas a tile, so the two chains overlap across
// tiles; the ring of two key tiles does not let the producers' dequantization overlap them as well
// (a tile is refilled only after its P V): H100, CSA 128 x 4K at 8 heads, 32.8 us, of which taking
// out the dequantization, the wgmmas or the gather saved 6.9 / 4.2 / 7.2 (dsv4ops/sparse_attn/cuda.py).
#include <cuda_bf16.h>

#include <cstdint>

#include "../common/pdl.cuh"
#include "cluster_merge.cuh"
#include "pipeline.cuh"

namespace dsv4::sparse_attn {
namespace {

constexpr int kTileKeys = 2 * kKeys;  // wgmma's M
constexpr int kRawStages = 4;  // three 32-key units gathered ahead of the one being converted

template <int H>
struct SmallSmem {
  alignas(1024) uint8_t q[H * kDim * 2];             // 8 blocks of [H heads][128 B]; the output tile at the end
  alignas(1024) uint8_t k[2][kTileKeys * kDim * 2];  // 8 blocks of [64 keys][128 B]
  alignas(1024) uint8_t pt[2][H * 128];              // P^T: [H heads][64 keys] bf16, 128-B swizzle
  alignas(128) uint8_t raw[kRawStages][kKeys * kRawRow];
  float red[2][4][H];  // warpgroup 0's per-warp head maxima of a tile; the sums at the end
  float alpha[2][H];   // the heads' rescale factors of a tile, warpgroup 0 -> 1
  float inv[H];        // 1 / each head's softmax sum, warpgroup 0 -> 1 at the end
  float lse[H];        // each head's log2-sum, for the cluster's merge (cluster_merge.cuh)
  int moved[2];        // whether any head's running max moved in a tile
  uint8_t valid[kRawStages][kKeys];
  uint32_t mask[2][2];  // valid keys of each bf16 tile, by unit
};
static_assert(sizeof(SmallSmem<8>) <= 227 * 1024 && sizeof(SmallSmem<16>) <= 227 * 1024,
              "shared memory of one CTA on sm_90");

// Named barriers beyond pipeline.cuh's: P^T of a tile written (warpgroup 0 -> 1) and read (1 -> 0),
// warpgroup 0's own, warpgroup 1's own, the final sums (0 -> 1).
[[maybe_unused]] constexpr int kFullP = 1, kEmptyP = 3, kGroup0Bar = 13, kGroup1Bar = 14, kSumsBar = 15;
[[maybe_unused]] constexpr int kGroup = 128;  // threads of a warpgroup

#ifdef DSV4_SM90_BODY
// Column j of this thread's fragment (j = 2 n + e): head 8 n + 2 (lane % 4) + e of the CTA's H.
__device__ __forceinline__ int head_of(int j, int lane) { return 8 * (j >> 1) + 2 * (lane & 3) + (j & 1); }

// Warpgroup 0 (threads 0-127): q into shared memory, then per tile S^T, the online softmax and P^T;
// at the end each head's sum (and, for a split, its log2-sum-exp: into sm.lse where the cluster
// merges, else into p.lse for the combine).
template <int H, bool kMerge>
__device__ __forceinline__ void scores(SmallSmem<H>& sm, const Params& p, int64_t token, int head0, int split,
                                       int tiles, int req) {
  constexpr int J = H / 4;  // heads a thread holds (columns of the m64nH fragment)
  const int lane = threadIdx.x & 31, warp = __shfl_sync(0xffffffffu, threadIdx.x >> 5, 0);
  load_q<H, kGroup>(sm.q, p, token, head0, req, threadIdx.x);
  cp_commit();
  // The sink opens each head's softmax (running max s_h, e^0 = 1 on one thread of the head) when
  // there is one split; the sums are per thread (its keys) until the end.
  float row_max[J], row_sum[J];
#pragma unroll
  for (int j = 0; j < J; ++j) {
    const int head = head0 + head_of(j, lane);
    if (p.splits == 1) {
      row_max[j] = head < p.heads ? p.sinks[head] * kLog2e : 0.f;
      row_sum[j] = warp == 0 && lane < 4 ? 1.f : 0.f;
    } else {
      row_max[j] = -INFINITY;
      row_sum[j] = 0.f;
    }
  }
  cp_wait<0>();
  fence_async_shared();
  bar_sync(kGroup0Bar, kGroup);

  const uint64_t q_desc = descriptor(smem_addr(sm.q), 16, 1024);
  for (int i = 0; i < tiles; ++i) {
    const int b = i & 1;
    bar_sync(kFull + b, kProducers + kGroup);
    const uint64_t mask = sm.mask[b][0] | static_cast<uint64_t>(sm.mask[b][1]) << 32;
    float s[H / 2];
#pragma unroll
    for (int n = 0; n < H / 2; ++n) s[n] = 0.f;
    fence_registers(s);
    wgmma_fence();
    const uint64_t k_desc = descriptor(smem_addr(sm.k[b]), 16, 1024);
#pragma unroll
    for (int kk = 0; kk < 32; ++kk) {
      wgmma_ss<H, 0>(s, advance(k_desc, (kk >> 2) * (kTileKeys * 128) + (kk & 3) * 32),
                     advance(q_desc, (kk >> 2) * (H * 128) + (kk & 3) * 32));
    }
    wgmma_commit();
    wgmma_wait();
    fence_registers(s);
    if (i + 2 < tiles) bar_arrive(kEmpty + b, kThreads);  // warpgroup 1 arrives after its P V

    // s[x]: key 16 warp + lane / 4 + 8 ((x / 2) % 2) of the tile, column j = 2 (x / 4) + x % 2.
    float tile_max[J];
#pragma unroll
    for (int j = 0; j < J; ++j) tile_max[j] = -INFINITY;
#pragma unroll
    for (int x = 0; x < H / 2; ++x) {
      const int key = 16 * warp + (lane >> 2) + 8 * ((x >> 1) & 1), j = 2 * (x >> 2) + (x & 1);
      s[x] = (mask >> key) & 1 ? s[x] * p.scale_log2 : -INFINITY;
      tile_max[j] = fmaxf(tile_max[j], s[x]);
    }
#pragma unroll
    for (int j = 0; j < J; ++j) {
#pragma unroll
      for (int d = 4; d < 32; d <<= 1) tile_max[j] = fmaxf(tile_max[j], __shfl_xor_sync(0xffffffffu, tile_max[j], d));
      if (lane < 4) sm.red[b][warp][head_of(j, lane)] = tile_max[j];
    }
    // red[b] is rewritten two tiles on, after every warp has passed this barrier of the next tile.
    bar_sync(kGroup0Bar, kGroup);
    float alpha[J], base[J];
    bool moved = false;
#pragma unroll
    for (int j = 0; j < J; ++j) {
      const int h = head_of(j, lane);
      tile_max[j] = fmaxf(fmaxf(sm.red[b][0][h], sm.red[b][1][h]), fmaxf(sm.red[b][2][h], sm.red[b][3][h]));
      alpha[j] = raise_max(tile_max[j], row_max[j], base[j], moved);
      row_sum[j] *= alpha[j];
    }
#pragma unroll
    for (int x = 0; x < H / 2; ++x) {
      const int j = 2 * (x >> 2) + (x & 1);
      s[x] = exp2_fast(s[x] - base[j]);
      row_sum[j] += s[x];
    }
    // P^T[head][key] in bf16 (the P of DeepSeek's kernel), once warpgroup 1 is done with tile i - 2's.
    if (i >= 2) bar_sync(kEmptyP + b, 2 * kGroup);
    uint8_t* pt = sm.pt[b];
#pragma unroll
    for (int x = 0; x < H / 2; ++x) {
      const int key = 16 * warp + (lane >> 2) + 8 * ((x >> 1) & 1), h = head_of(2 * (x >> 2) + (x & 1), lane);
      *reinterpret_cast<__nv_bfloat16*>(pt + h * 128 + (((key >> 3) ^ (h & 7)) << 4) + (key & 7) * 2) =
          __float2bfloat16_rn(s[x]);
    }
    // Every warp holds every head's factors (they follow from the shared maxima).
    if (warp == 0 && lane < 4) {
#pragma unroll
      for (int j = 0; j < J; ++j) sm.alpha[b][head_of(j, lane)] = alpha[j];
    }
    const bool any_moved = __any_sync(0xffffffffu, moved);
    if (warp == 0 && lane == 0) sm.moved[b] = any_moved;
    fence_async_shared();  // P^T is read by wgmma (the async proxy)
    bar_arrive(kFullP + b, 2 * kGroup);
  }

  // Each head's sum over all keys: the lanes of a warp, then the four warps (through red[tiles % 2],
  // last read two tiles ago).
  float* red = &sm.red[tiles & 1][0][0];
#pragma unroll
  for (int j = 0; j < J; ++j) {
#pragma unroll
    for (int d = 4; d < 32; d <<= 1) row_sum[j] += __shfl_xor_sync(0xffffffffu, row_sum[j], d);
    if (lane < 4) red[warp * H + head_of(j, lane)] = row_sum[j];
  }
  bar_sync(kGroup0Bar, kGroup);
  if (warp == 0 && lane < 4) {
#pragma unroll
    for (int j = 0; j < J; ++j) {
      const int h = head_of(j, lane);
      const float sum = red[h] + red[H + h] + red[2 * H + h] + red[3 * H + h];
      sm.inv[h] = 1.f / (sum > 0.f ? sum : 1.f);
      // A split's log2 of its softmax sum (-inf: no key), for the cluster's merge or the combine.
      const float lse = sum > 0.f ? row_max[j] + log2f(sum) : -INFINITY;
      if constexpr (kMerge) {
        sm.lse[h] = lse;
      } else if (p.splits > 1 && head0 + h < p.heads) {
        p.lse[(token * p.splits + split) * p.heads + head0 + h] = lse;
      }
    }
  }
  bar_arrive(kSumsBar, 2 * kGroup);
}

// Warpgroup 1 (threads 128-255): O^T += V^T P^T per tile, then the normalized output: bf16 rows of
// `out` (or of a split's partial) through shared memory (q's buffer, free once warpgroup 0 is done).
template <int H, bool kMerge>
__device__ __forceinline__ void values(SmallSmem<H>& sm, const Params& p, int64_t token, int head0, int split,
                                       int tiles) {
  constexpr int J = H / 4, F = H / 2;  // heads a thread holds; fragment registers of a 64-dim block
  const int t = threadIdx.x - kGroup, lane = t & 31, warp = __shfl_sync(0xffffffffu, t >> 5, 0);
  float acc[8 * F];  // acc[F b + x]: dim 64 b + 16 warp + lane / 4 + 8 ((x / 2) % 2), column 2 (x / 4) + x % 2
#pragma unroll
  for (int x = 0; x < 8 * F; ++x) acc[x] = 0.f;
  for (int i = 0; i < tiles; ++i) {
    const int b = i & 1;
    bar_sync(kFullP + b, 2 * kGroup);
    if (sm.moved[b]) {
      float alpha[J];
#pragma unroll
      for (int j = 0; j < J; ++j) alpha[j] = sm.alpha[b][head_of(j, lane)];
#pragma unroll
      for (int x = 0; x < 8 * F; ++x) acc[x] *= alpha[2 * ((x % F) >> 2) + (x & 1)];
    }
    fence_registers(acc);
    wgmma_fence();
    // V^T block m (dims 64 m .. 64 m + 63) is the key tile's block m read MN-major; k-step kk is
    // keys 16 kk .. 16 kk + 15 (8-key groups 1 KiB apart).
    const uint64_t v_desc = descriptor(smem_addr(sm.k[b]), kTileKeys * 128, 1024);
    const uint64_t p_desc = descriptor(smem_addr(sm.pt[b]), 16, 1024);
#pragma unroll
    for (int m = 0; m < 8; ++m) {
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) {
        wgmma_ss<H, 1>(acc + F * m, advance(v_desc, m * (kTileKeys * 128) + kk * 16 * 128), advance(p_desc, kk * 32));
      }
    }
    wgmma_commit();
    wgmma_wait();
    fence_registers(acc);
    if (i + 2 < tiles) {
      bar_arrive(kEmptyP + b, 2 * kGroup);
      bar_arrive(kEmpty + b, kThreads);
    }
  }
  bar_sync(kSumsBar, 2 * kGroup);
  float inv[J];
#pragma unroll
  for (int j = 0; j < J; ++j) inv[j] = sm.inv[head_of(j, lane)];
  // The output normalized by the sum (a split's by its own) into a bf16 tile in shared memory (q's
  // buffer: head row h at h * 1024, 16-B chunk c at c ^ (h % 8), so the four heads of a store land in
  // four chunks and its 32 lanes hit 16 banks); then `out`, or the split's partial rows.
#pragma unroll
  for (int x = 0; x < 8 * F; ++x) {
    const int dim = 64 * (x / F) + 16 * warp + (lane >> 2) + 8 * ((x >> 1) & 1);
    const int j = 2 * ((x % F) >> 2) + (x & 1), h = head_of(j, lane);
    *reinterpret_cast<__nv_bfloat16*>(sm.q + h * 1024 + (((dim >> 3) ^ (h & 7)) << 4) + (dim & 7) * 2) =
        __float2bfloat16_rn(acc[x] * inv[j]);
  }
  bar_sync(kGroup1Bar, kGroup);
  if constexpr (!kMerge) store_out<H, kGroup>(sm.q, p, token, head0, split, t);
}
#endif  // DSV4_SM90_BODY

// kMerge = p.cluster_merge, an instantiation of its own (as sparse_attn.cu's).
template <int H, int WF, int CF, bool kMerge>
__global__ void __launch_bounds__(kThreads, 1) small_heads_kernel(const __grid_constant__ Params p) {
#ifdef DSV4_SM90_BODY
  extern __shared__ __align__(128) uint8_t smem[];
  auto& sm = *reinterpret_cast<SmallSmem<H>*>(smem);
  pdl::wait_prior_grid();
  pdl::launch_dependents();
  const int64_t token = blockIdx.x;
  const int head0 = blockIdx.y * H, split = blockIdx.z;
  const int warp = threadIdx.x >> 5;

  const int req = p.req_slots[token];
  int position = 0, end = 0;
  const int begin = split * p.split_keys;
  if (req >= 0) {
    position = p.window_ends[token];
    end = min(begin + p.split_keys, p.window_keys + min(p.comp_lens[token], p.n_idx));
  }
  const int tiles = end > begin ? (end - begin + kTileKeys - 1) / kTileKeys : 0;
  // A split past the token's real list leaves at once (the combine reads only the live splits). In a
  // cluster it stays for the merge, with no key.
  if (tiles == 0 && p.splits > 1) {
    if constexpr (kMerge) {
      if (threadIdx.x < H) sm.lse[threadIdx.x] = -INFINITY;
      if (warp < kConsumers / 32) {
        merge_splits<H, kConsumers>(sm.q, sm.lse, p, token, head0, threadIdx.x);
      } else {
        merge_barriers();
      }
    }
    return;
  }

  if (warp >= kConsumers / 32) {
    shrink_registers<kProducerRegs>();
    // Both units of every tile: a unit past `end` is zeros (its keys masked, and 0 x a stale NaN
    // would be NaN in P V).
    produce<WF, CF, kRawStages, 2, 2, kProducers + kGroup>(sm, p, token, begin, end, 2 * tiles, position, req);
    // The consumers merge (on the producers' path the merge made ptxas spill inside the gather loop,
    // 8-24 B at their 64 registers).
    if constexpr (kMerge) merge_barriers();
    return;
  }
  grow_registers<kConsumerRegs>();
  if (warp < 4) {
    scores<H, kMerge>(sm, p, token, head0, split, tiles, req);
  } else {
    values<H, kMerge>(sm, p, token, head0, split, tiles);
  }
  // Warpgroup 1 staged the normalized output in q's buffer, warpgroup 0 the log2-sums.
  if constexpr (kMerge) merge_splits<H, kConsumers>(sm.q, sm.lse, p, token, head0, threadIdx.x);
#else
  __trap();
#endif
}

template <int H>
void launch_heads(const Params& p, cudaStream_t stream) {
  with_formats(p.window_fmt, p.comp_fmt, [&](auto wf, auto cf) {
    auto* kernel = p.cluster_merge ? small_heads_kernel<H, decltype(wf)::value, decltype(cf)::value, true>
                                   : small_heads_kernel<H, decltype(wf)::value, decltype(cf)::value, false>;
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(sizeof(SmallSmem<H>)));
    const dim3 grid(p.tokens, (p.heads + H - 1) / H, p.splits);
    pdl::launch_pdl_clusters(kernel, grid, dim3(kThreads), dim3(1, 1, p.cluster_merge ? p.splits : 1),
                             sizeof(SmallSmem<H>), stream, p);
    if (p.splits > 1 && !p.cluster_merge) launch_combine(p, stream);
  });
}

template <int H>
int capacity(int splits) {
  // Every format pair's kernel has the same threads and shared memory.
  return max_clusters(reinterpret_cast<const void*>(small_heads_kernel<H, kFp8_584, kFp8_584, true>), splits,
                      sizeof(SmallSmem<H>));
}

}  // namespace

int cluster_capacity_small(int cta_heads, int splits) {
  return cta_heads == 8 ? capacity<8>(splits) : capacity<16>(splits);
}

void launch_small_heads(const Params& p, cudaStream_t stream) {
  if (p.cta_heads == 8) {
    launch_heads<8>(p, stream);
  } else {
    launch_heads<16>(p, stream);
  }
}

}  // namespace dsv4::sparse_attn
