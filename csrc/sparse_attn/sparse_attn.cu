// SPDX-License-Identifier: MIT
// sm_90 kernel of `dsv4::sparse_attn` for bf16 queries over byte pools: V4's fp8_584 window and
// compressed rows, V4.1's fp8_528 window and fp4_288 compressed rows, and V4 with fp4_288 entries
// (rows.cuh; the specification is dsv4ops/sparse_attn/reference.py; the Triton kernel serves every
// other case).
//
// One CTA = one token x 64 heads x one split of the token's key list [window | entries], four
// warpgroups specialized by role (the producers and the tile handoff are pipeline.cuh's, shared with
// small_heads.cu, the kernel for 8 / 16 heads a CTA). K = V is one shared 512-d head (MQA), so
// a key tile of 32 keys is gathered and dequantized once for all 64 heads:
//   - two producer warpgroups (warps 8-15) issue cp.async for the raw rows (a slot's data and scale
//     bytes) into a 3-stage ring, two tiles ahead, and dequantize each landed tile (exactly, see
//     rows.cuh) into one of three bf16 tiles. A tile is all window or all entries (the window is
//     rounded up to whole tiles), so each tile has one format, chosen per tile without divergence;
//   - warpgroup 0 (warps 0-3) computes S = q k^T over all 512 dims, runs the online softmax and
//     hands P (bf16) and the rows' rescale factors to warpgroup 1 through shared memory;
//   - warpgroup h owns output dims 256h..256h+255 for all 64 heads: its accumulator is 64 x 256
//     fp32, 128 registers a thread (P V as two m64n128 wgmmas). Warpgroup 1 adds tile i's P V while
//     warpgroup 0 is on tile i + 1's S, and warpgroup 0 issues its own half of tile i's P V in one
//     wgmma group with tile i + 1's S.
// The roles overlap: while the tensor cores and the softmax work on tile i, the producers convert
// tile i + 1. H100, CSA 128 x 4K: one set of 8 warps doing both spent 41% of its samples in the
// gather and dequantization and 35% in S and the softmax, one after the other (53.8 us); one
// producer warpgroup, a warp per scheduler, left the consumers waiting for tiles 23% of their time
// (50.3 us); two: 43.3 us. The consumers split S by dims before (each warpgroup half of S, added
// through 16 KiB of shared memory, and the same softmax run twice, then both halves of P V, in
// step): one warpgroup's chain per tile of S, exchange, softmax and P V. H100, same runs,
// V4-Pro CSA 128 x 4K / V4-Flash CSA 128 x 4K, us: split S 129.2-132.6 / 42.1-43.0; S on warpgroup 0
// with P handed over 118.8-120.8 / 39.8-40.8; with three bf16 tiles and three raw stages
// 118.5-119.9 / 39.2-39.5; with warpgroup 0's P V beside the next S 116.2-117.2 / 38.6-38.7 (the
// kernel as built). Named barriers hand the bf16 tiles over (FULL: producers -> warpgroup 0; EMPTY:
// both consumer warpgroups -> producers), and setmaxnreg moves registers from the producers (64) to
// the consumers (192).
// wgmma (sm_90a): S from q and k in shared memory (K-major), P V with P from registers and the same
// k tile read MN-major. q and k tiles are stored as 8 blocks of 64 dims, each [rows][128 B] with the
// 128-B swizzle (16-B chunk c of row r at c ^ (r % 8)), the layout wgmma's descriptors name.
#include <cuda_bf16.h>

#include <cstdint>
#include <map>
#include <mutex>
#include <tuple>

#include "../common/pdl.cuh"
#include "cluster_merge.cuh"
#include "pipeline.cuh"

namespace dsv4::sparse_attn {
namespace {

constexpr int kHeads = 64;  // heads per CTA
// Three bf16 key tiles and three raw stages (227 KiB holds no more): warpgroup 0 holds two tiles at
// once (`score_tiles`), so with two the producers could fill none ahead.
constexpr int kRawStages = 3;
constexpr int kBufs = 3;
constexpr int kGroup = 128;  // threads of a warpgroup
// A tile's handoff from warpgroup 0 to 1, a word per thread t (0..127) of each, [word][t]: P's A
// fragments of the two k-steps (8 bf16x2 words, the m16n8k16 A layout, so warpgroup 1's thread t
// feeds them to its own wgmma as they are: warp w of either group holds heads 16 (w % 4) ..) and the
// two rows' rescale factors.
constexpr int kHandoffWords = 10;

struct Smem {
  alignas(1024) uint8_t q[kHeads * kDim * 2];            // 64 KiB
  alignas(1024) uint8_t k[kBufs][kKeys * kDim * 2];      // 96 KiB
  alignas(128) uint8_t raw[kRawStages][kKeys * kRawRow]; // 55.5 KiB
  uint32_t handoff[2][kHandoffWords][kGroup];            // 10 KiB
  float2 inv[kGroup];                                    // the rows' 1 / softmax sum, at the end
  uint8_t valid[kRawStages][kKeys];
  uint32_t mask[kBufs][1];  // valid keys of each bf16 tile
};
static_assert(sizeof(Smem) <= 227 * 1024, "shared memory of one CTA on sm_90");

// Named barriers 1-4: tile b's handoff written (kHandoffFull + b: warpgroup 0 -> 1) and read
// (kHandoffEmpty + b: 1 -> 0); pipeline.cuh has the others.
[[maybe_unused]] constexpr int kHandoffFull = 1, kHandoffEmpty = 3;

#ifdef DSV4_SM90_BODY
// d[64 x 128] += A[64 x 16] B[16 x 128]: A from registers (the m16n8k16 A layout per warp), B in
// shared memory, MN-major. (m64n256 would need more registers than the launch's 128 a thread, which
// ptxas checks for each instruction whatever setmaxnreg grants.)
__device__ __forceinline__ void wgmma_o(float* d, const uint32_t (&a)[4], uint64_t b) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, 1, 1, 1, 1;\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}

// O[:, 256 half .. 256 half + 255] += P V for the tile at k_base: two k-steps of 16 keys, two m64n128
// halves each (issued only: the caller commits and waits).
__device__ __forceinline__ void issue_pv(float (&acc)[128], const uint32_t (&a)[2][4], uint32_t k_base, int half) {
  const uint64_t v_desc = descriptor(k_base + half * 4 * (kKeys * 128), kKeys * 128, 1024);
#pragma unroll
  for (int kk = 0; kk < 2; ++kk) {
    wgmma_o(acc, a[kk], advance(v_desc, kk * 16 * 128));
    wgmma_o(acc + 64, a[kk], advance(v_desc, kk * 16 * 128 + 2 * kKeys * 128));
  }
}

// s (zeros) += q k^T of the tile at k_base over all 512 dims (32 wgmmas; issued only).
__device__ __forceinline__ void issue_s(float (&s)[16], uint64_t q_desc, uint32_t k_base) {
  const uint64_t k_desc = descriptor(k_base, 16, 1024);
#pragma unroll
  for (int kk = 0; kk < 32; ++kk) {
    wgmma_ss<32, 0>(s, advance(q_desc, (kk >> 2) * (kHeads * 128) + (kk & 3) * 32),
                    advance(k_desc, (kk >> 2) * (kKeys * 128) + (kk & 3) * 32));
  }
}

// Warpgroup 0: per tile, the online softmax of its S, P and the rescale factors handed to warpgroup 1,
// then its own half of P V issued in one wgmma group with the next tile's S, so the tensor cores run
// the two together and the warpgroup waits once a tile (the consumers then hold two key tiles, the
// producers fill the third). Rows r = lane / 4 and r + 8 of the warp's 16 heads; s[4n + v] is key
// 8n + 2(lane % 4) + v % 2 of row lane / 4 + 8 (v / 2).
__device__ __forceinline__ void score_tiles(Smem& sm, const Params& p, int tiles, float (&acc)[128],
                                            float (&row_max)[2], float (&row_sum)[2]) {
  const int t = threadIdx.x, lane = t & 31;
  const uint64_t q_desc = descriptor(smem_addr(sm.q), 16, 1024);
  float s[16];
#pragma unroll
  for (int n = 0; n < 16; ++n) s[n] = 0.f;
  if (tiles > 0) {
    bar_sync(kFull, kProducers + kGroup);
    fence_registers(s);
    wgmma_fence();
    issue_s(s, q_desc, smem_addr(sm.k[0]));
    wgmma_commit();
    wgmma_wait();
    fence_registers(s);
  }
  for (int i = 0; i < tiles; ++i) {
    const int b = i & 1, kb = i % kBufs;
    // A tile with no valid key (a window cut short, -1 entries) still runs: its P is zeros.
    const uint32_t mask = sm.mask[kb][0];
    float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int n = 0; n < 4; ++n) {
#pragma unroll
      for (int v = 0; v < 4; ++v) {
        const int key = n * 8 + 2 * (lane & 3) + (v & 1);
        s[4 * n + v] = (mask >> key) & 1 ? s[4 * n + v] * p.scale_log2 : -INFINITY;
        tile_max[v >> 1] = fmaxf(tile_max[v >> 1], s[4 * n + v]);
      }
    }
    // The running max (`raise_max`): most tiles skip rescaling the 128 accumulators.
    float alpha[2], base[2];
    bool moved = false;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffffu, tile_max[h], 1));
      tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffffu, tile_max[h], 2));
      alpha[h] = raise_max(tile_max[h], row_max[h], base[h], moved);
    }
    float tile_sum[2] = {0.f, 0.f};
#pragma unroll
    for (int n = 0; n < 16; ++n) {
      s[n] = exp2_fast(s[n] - base[(n >> 1) & 1]);
      tile_sum[(n >> 1) & 1] += s[n];
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) row_sum[h] = row_sum[h] * alpha[h] + tile_sum[h];
    // P in bf16 (DeepSeek's kernel) straight from S's registers.
    uint32_t a[2][4];
#pragma unroll
    for (int kk = 0; kk < 2; ++kk) {
#pragma unroll
      for (int w = 0; w < 4; ++w) a[kk][w] = bf16x2(s[8 * kk + 2 * w], s[8 * kk + 2 * w + 1]);
    }
    if (i >= 2) bar_sync(kHandoffEmpty + b, 2 * kGroup);  // warpgroup 1 has read tile i - 2's
#pragma unroll
    for (int w = 0; w < 8; ++w) sm.handoff[b][w][t] = a[w >> 2][w & 3];
    sm.handoff[b][8][t] = __float_as_uint(alpha[0]);
    sm.handoff[b][9][t] = __float_as_uint(alpha[1]);
    bar_arrive(kHandoffFull + b, 2 * kGroup);

    if (__any_sync(0xffffffffu, moved)) {
#pragma unroll
      for (int n = 0; n < 128; ++n) acc[n] *= alpha[(n >> 1) & 1];
    }
    const bool next = i + 1 < tiles;
    if (next) bar_sync(kFull + (i + 1) % kBufs, kProducers + kGroup);  // tile i + 1's bf16 rows are in
#pragma unroll
    for (int n = 0; n < 16; ++n) s[n] = 0.f;
    fence_registers(s);
    fence_registers(acc);
    wgmma_fence();
    issue_pv(acc, a, smem_addr(sm.k[kb]), 0);
    if (next) issue_s(s, q_desc, smem_addr(sm.k[(i + 1) % kBufs]));
    wgmma_commit();
    wgmma_wait();
    fence_registers(acc);
    fence_registers(s);
    if (i + kBufs < tiles) bar_arrive(kEmpty + kb, kThreads);  // the producers may refill tile kb
  }
}

// Warpgroup 1, per tile: rescales its accumulator and adds its half of P V, with tile i's P from
// warpgroup 0 while that one is on tile i + 1's S.
__device__ __forceinline__ void value_tiles(Smem& sm, int tiles, float (&acc)[128]) {
  const int t = threadIdx.x - kGroup;
  for (int i = 0; i < tiles; ++i) {
    const int b = i & 1;
    bar_sync(kHandoffFull + b, 2 * kGroup);
    uint32_t a[2][4];
#pragma unroll
    for (int w = 0; w < 8; ++w) a[w >> 2][w & 3] = sm.handoff[b][w][t];
    const float alpha[2] = {__uint_as_float(sm.handoff[b][8][t]), __uint_as_float(sm.handoff[b][9][t])};
    if (i + 2 < tiles) bar_arrive(kHandoffEmpty + b, 2 * kGroup);
    if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
      for (int n = 0; n < 128; ++n) acc[n] *= alpha[(n >> 1) & 1];
    }
    fence_registers(acc);
    wgmma_fence();
    issue_pv(acc, a, smem_addr(sm.k[i % kBufs]), 1);
    wgmma_commit();
    wgmma_wait();
    fence_registers(acc);
    if (i + kBufs < tiles) bar_arrive(kEmpty + i % kBufs, kThreads);
  }
}

// The cluster's merge (cluster_merge.cuh) by all kThreads threads: the normalized output staged in q's
// buffer, the heads' log2-sums in sm.inv's first 64 floats.
__device__ __forceinline__ void merge(Smem& sm, const Params& p, int64_t token, int head0) {
  merge_splits<kHeads, kThreads>(sm.q, reinterpret_cast<const float*>(sm.inv), p, token, head0, threadIdx.x);
}
#endif  // DSV4_SM90_BODY

// kMerge = p.cluster_merge: an instantiation of its own, so the kernel that merges nothing holds no
// cluster instruction (cluster_merge.cuh has what that cost at one split).
template <int WF, int CF, bool kMerge>
__global__ void __launch_bounds__(kThreads, 1) sparse_attn_kernel(const __grid_constant__ Params p) {
#ifdef DSV4_SM90_BODY
  extern __shared__ __align__(128) uint8_t smem[];
  Smem& sm = *reinterpret_cast<Smem*>(smem);
  // q, the lists and `out` belong to the kernels before this one; once every CTA is in, the combine
  // may take the SMs that free up.
  pdl::wait_prior_grid();
  pdl::launch_dependents();
  const int64_t token = blockIdx.x;
  const int head0 = blockIdx.y * kHeads;
  const int split = blockIdx.z;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;

  const int req = p.req_slots[token];
  int position = 0, end = 0;
  const int begin = split * p.split_keys;
  if (req >= 0) {
    position = p.window_ends[token];
    const int n_len = min(p.comp_lens[token], p.n_idx);
    end = min(begin + p.split_keys, p.window_keys + n_len);
  }
  const int tiles = end > begin ? (end - begin + kKeys - 1) / kKeys : 0;
  // A split past the token's real list leaves at once: the combine reads only the live splits, so the
  // cost follows comp_lens, not the list's width (HCA at 1M max_context has 8192 entries a token). In
  // a cluster it stays for the merge, with no key.
  if (tiles == 0 && p.splits > 1) {
    if constexpr (kMerge) {
      if (threadIdx.x < kHeads) reinterpret_cast<float*>(sm.inv)[threadIdx.x] = -INFINITY;
      merge(sm, p, token, head0);
    }
    return;
  }

  if (warp >= kConsumers / 32) {
    shrink_registers<kProducerRegs>();
    produce<WF, CF, kRawStages, 1, kBufs, kProducers + kGroup>(sm, p, token, begin, end, tiles, position, req);
    if constexpr (kMerge) merge(sm, p, token, head0);
    return;
  }
  grow_registers<kConsumerRegs>();
  // The warpgroup index through a shuffle: the compiler then knows it is warp-uniform and keeps the
  // wgmma descriptors in uniform registers (computed from threadIdx, they cost ~15 instructions per
  // wgmma in vector registers).
  const int group = warp & 3, half = __shfl_sync(0xffffffffu, warp >> 2, 0);

  // Warpgroup 0's rows: the sink opens the online softmax (running max s_h, running sum e^0 = 1 on
  // one lane of the row's quad, no value) when there is one split.
  float row_max[2], row_sum[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int head = head0 + group * 16 + (lane >> 2) + 8 * h;
    if (p.splits == 1) {
      row_max[h] = head < p.heads ? p.sinks[head] * kLog2e : 0.f;
      row_sum[h] = (lane & 3) == 0 ? 1.f : 0.f;
    } else {
      row_max[h] = -INFINITY;
      row_sum[h] = 0.f;
    }
  }
  load_q<kHeads, kConsumers>(sm.q, p, token, head0, req, threadIdx.x);
  cp_commit();

  float acc[128];  // acc[4n + v]: the m16n8 C fragment of dims 8n .. 8n + 7 of this warpgroup's 256
#pragma unroll
  for (int n = 0; n < 128; ++n) acc[n] = 0.f;
  cp_wait<0>();
  fence_async_shared();
  bar_sync(kConsumerBar, kConsumers);

  float inv[2], lse[2];
  if (half == 0) {
    score_tiles(sm, p, tiles, acc, row_max, row_sum);
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      float sum = row_sum[h] + __shfl_xor_sync(0xffffffffu, row_sum[h], 1);
      sum += __shfl_xor_sync(0xffffffffu, sum, 2);
      inv[h] = 1.f / (sum > 0.f ? sum : 1.f);
      // A split's log2 of its softmax sum (-inf: no key), for the combine or the cluster's merge.
      const int head = head0 + group * 16 + (lane >> 2) + 8 * h;
      lse[h] = sum > 0.f ? row_max[h] + log2f(sum) : -INFINITY;
      if (p.splits > 1 && !kMerge && head < p.heads && (lane & 3) == 0) {
        p.lse[(token * p.splits + split) * p.heads + head] = lse[h];
      }
    }
    sm.inv[threadIdx.x] = make_float2(inv[0], inv[1]);
  } else {
    value_tiles(sm, tiles, acc);
  }
  // The sums to warpgroup 1; also, warpgroup 0's last S wgmma has completed, so q's buffer is free.
  bar_sync(kConsumerBar, kConsumers);
  if (half == 1) {
    const float2 v = sm.inv[threadIdx.x - kGroup];
    inv[0] = v.x, inv[1] = v.y;
  }

  // The output normalized by the sum (a split's by its own) into a bf16 tile in shared memory (q's
  // buffer): 16-B chunk c of head row r at r * 1024 + (c ^ (r % 8)) * 16, so the 8 rows of a store hit
  // 32 banks; then `out`, or the split's partial rows.
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = group * 16 + (lane >> 2) + 8 * h;
#pragma unroll
    for (int n = 0; n < 32; ++n) {
      *reinterpret_cast<uint32_t*>(sm.q + r * 1024 + (((half * 32 + n) ^ (r & 7)) << 4) + 4 * (lane & 3)) =
          bf16x2(acc[4 * n + 2 * h] * inv[h], acc[4 * n + 2 * h + 1] * inv[h]);
    }
  }
  bar_sync(kConsumerBar, kConsumers);
  if constexpr (kMerge) {
    // sm.inv's reads by warpgroup 1 are before the barrier above.
    if (half == 0 && (lane & 3) == 0) {
#pragma unroll
      for (int h = 0; h < 2; ++h) reinterpret_cast<float*>(sm.inv)[group * 16 + (lane >> 2) + 8 * h] = lse[h];
    }
    merge(sm, p, token, head0);
    return;
  }
  store_out<kHeads, kConsumers>(sm.q, p, token, head0, split, threadIdx.x);
#else
  __trap();
#endif
}

}  // namespace

// The (window, entries) pairs of the models (rows.cuh `with_formats`).
bool serves_formats(int window_fmt, int comp_fmt) {
  return (window_fmt == kFp8_584 && (comp_fmt == kFp8_584 || comp_fmt == kFp4_288)) ||
         (window_fmt == kFp8_528 && (comp_fmt == kFp8_528 || comp_fmt == kFp4_288));
}

int max_clusters(const void* kernel, int splits, int smem) {
  static std::mutex mutex;
  static std::map<std::tuple<int, const void*, int>, int> cache;
  int device = 0;
  cudaGetDevice(&device);
  const std::lock_guard<std::mutex> lock(mutex);
  const auto key = std::make_tuple(device, kernel, splits);
  if (const auto it = cache.find(key); it != cache.end()) return it->second;
  // The opt-in above 48 KiB of shared memory, without which the query finds no room for a CTA.
  cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
  cudaLaunchConfig_t config{};
  config.gridDim = dim3(1, 1, splits);
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = smem;
  cudaLaunchAttribute cluster{};
  cluster.id = cudaLaunchAttributeClusterDimension;
  cluster.val.clusterDim.x = 1;
  cluster.val.clusterDim.y = 1;
  cluster.val.clusterDim.z = splits;
  config.attrs = &cluster;
  config.numAttrs = 1;
  int n = 0;
  if (cudaOccupancyMaxActiveClusters(&n, kernel, &config) != cudaSuccess) {
    cudaGetLastError();  // a failed query is not a launch error: no merge in clusters
    n = 0;
  }
  return cache[key] = n;
}

int cluster_capacity(int cta_heads, int splits) {
  if (cta_heads < kHeads) return cluster_capacity_small(cta_heads, splits);
  // Every format pair's kernel has the same threads and shared memory.
  return max_clusters(reinterpret_cast<const void*>(sparse_attn_kernel<kFp8_584, kFp8_584, true>), splits,
                      sizeof(Smem));
}

void launch(const Params& p, cudaStream_t stream) {
  if (p.cta_heads < kHeads) {
    launch_small_heads(p, stream);
    return;
  }
  with_formats(p.window_fmt, p.comp_fmt, [&](auto wf, auto cf) {
    auto* kernel = p.cluster_merge ? sparse_attn_kernel<decltype(wf)::value, decltype(cf)::value, true>
                                   : sparse_attn_kernel<decltype(wf)::value, decltype(cf)::value, false>;
    // Per call (a host-side attribute, no stream work): the opt-in above 48 KiB is per device. A
    // failure surfaces as the launch error, which the caller checks.
    cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(sizeof(Smem)));
    const dim3 grid(p.tokens, (p.heads + kHeads - 1) / kHeads, p.splits);
    // With programmatic dependent launch (common/pdl.cuh; a launch error is the caller's
    // cudaGetLastError). H100, V4-Flash, with / without: sliding 1 x 4K 9.2 / 10.1 us, CSA 1 x 4K
    // 11.5 / 12.5, CSA 32 x 4K 24.3 / 25.4, V4-Pro CSA 128 x 4K 128.1 / 130.0.
    pdl::launch_pdl_clusters(kernel, grid, dim3(kThreads), dim3(1, 1, p.cluster_merge ? p.splits : 1), sizeof(Smem),
                             stream, p);
    if (p.splits > 1 && !p.cluster_merge) launch_combine(p, stream);
  });
}

}  // namespace dsv4::sparse_attn
