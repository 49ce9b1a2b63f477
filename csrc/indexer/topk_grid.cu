// SPDX-License-Identifier: MIT
// Exact top-k of a long row of the indexer's uint32 score keys (0 = no entry), over all the CTAs of
// its token at once: the same result as topk_select.cu (the keys above the k-th largest key T and
// the lowest-column keys equal to T, in ascending column order, -1 after them) without its chunk
// lists and merges, whose one-CTA-a-16384-key-chunk steps left most SMs idle (H100, V4-Flash CSA, one
// token at 1M positions: 262144 keys selected in ~42 us on 16 CTAs).
//
// One cooperative launch (every CTA resident: the CTAs of a token wait for each other), after a
// memset of each token's first state words (params.h GridParams). CTA g of a token holds tile g of
// its row (kItems keys a thread, loaded once) and:
//   1. adds its nonzero keys' top 11 bits to the token's global histogram; after a barrier of the
//      token's CTAs, each reads it and finds T's bin and the keys still wanted there;
//   2. unless that bin is taken whole (then T = its lowest key - 1, no tie to break): when it holds
//      at most kGridCand keys (the usual case; 200-450 in the bench at 64K and 1M), appends its
//      keys of the bin to the token's candidate list; after a second barrier every CTA loads the
//      list and finds T's lower 21 bits from it alone (two shared-memory histogram levels).
//      Otherwise two more global levels as in 1 (bits 20..10, then 9..0 of the keys sharing T's
//      bits so far);
//   3. counts its keys above T and equal to T, learns the counts of the tiles before it by a
//      decoupled look-back, and writes its selected keys' outputs at their final positions.
// No atomic decides a position: the result is bitwise deterministic.
#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "params.h"
#include "rows.cuh"
#include "select.cuh"

namespace dsv4::indexer {
namespace {

constexpr int kThreads = 512;
constexpr int kWarps = kThreads / 32;
constexpr int kItems = kGridTile / kThreads;  // keys a thread holds
constexpr int kMaxBins = 2048;
__device__ constexpr int kLevelBits[3] = {11, 11, 10};
__device__ constexpr int kLevelShift[3] = {21, 10, 0};
// State words (after the row's keys): see params.h GridParams.
constexpr int kBarrier = 2048, kCandCount = 2049, kTotal = 2050, kWords = kGridHead;
__device__ __forceinline__ int32_t* level_hist(int32_t* state, int zero_words, int level) {
  return level == 0 ? state : state + zero_words + (level == 1 ? 0 : 2048);
}
__device__ __forceinline__ int32_t* cand_list(int32_t* state, int zero_words) {
  return state + zero_words + kGridLevels12;
}

// A tile's look-back word: state (bits 31..30: 0 not yet, 1 the tile's own counts, 2 the counts of
// it and every tile before), keys equal to T (bits 29..15, saturated at kSat: only min(., take <= k)
// is used) and keys above T (bits 14..0: fewer than k <= kMaxGridK).
constexpr int kSat = (1 << 15) - 1;
constexpr uint32_t kOwn = 1u << 30, kInclusive = 2u << 30;
__device__ __forceinline__ uint32_t pack(int above, int equal) {
  return static_cast<uint32_t>(min(equal, kSat)) << 15 | static_cast<uint32_t>(above);
}
__device__ __forceinline__ int above_of(uint32_t w) { return static_cast<int>(w & 0x7fff); }
__device__ __forceinline__ int equal_of(uint32_t w) { return static_cast<int>((w >> 15) & kSat); }

struct Shared {
  int hist[kMaxBins];
  uint32_t cand[kGridCand];
  int warp_above[kWarps], warp_equal[kWarps];
  int found_bin, found_above, found_count;  // find_bin's result
  int count;        // this CTA's nonzero keys
  uint32_t prefix;  // T's digits found so far
  int want;         // keys still to select among those sharing `prefix`
  int bin_count;    // keys sharing `prefix`
  int selected;     // min(k, nonzero keys)
  bool resolved;    // T and take are known: the keys above T and the `take` lowest-column keys equal to T
  uint32_t T;
  int take;
  uint32_t before;  // the look-back's sum over the tiles before this one
};

// Waits until all `ctas` CTAs of the token have arrived `phase` times (the counter starts at 0).
__device__ void token_barrier(int32_t* arrivals, int ctas, int phase) {
  __syncthreads();
  if (threadIdx.x == 0) {
    __threadfence();  // this CTA's histogram atomics and candidates are visible before its arrival
    atomicAdd(arrivals, 1);
    while (*reinterpret_cast<volatile int32_t*>(arrivals) < ctas * phase) {
    }
    __threadfence();
  }
  __syncthreads();
}

// Adds x to the shared histogram at its digit of `level` if `in`. The whole warp calls it.
__device__ __forceinline__ void count_digit(uint32_t x, bool in, int level, int* hist) {
  const unsigned voters = __ballot_sync(kFull, in);
  if (voters == 0) return;  // later levels see only the keys of one bin: most warps skip
  const int d = static_cast<int>((x >> kLevelShift[level]) & ((1 << kLevelBits[level]) - 1));
  const int first = __shfl_sync(kFull, d, __ffs(voters) - 1);
  // One atomic for a warp whose keys share a digit (ReLU makes many scores exactly 0, and a bin
  // then gets most keys: same-address atomics would serialize), else one per key.
  if (__all_sync(kFull, !in || d == first)) {
    if (threadIdx.x % 32 == __ffs(voters) - 1) atomicAdd(&hist[d], __popc(voters));
  } else if (in) {
    atomicAdd(&hist[d], 1);
  }
}

__device__ __forceinline__ bool shares_prefix(uint32_t x, int level, uint32_t prefix) {
  return x != 0 && (level == 0 || (x >> kLevelShift[level - 1]) == prefix);
}

__device__ void zero_hist(Shared& sh) {
  for (int i = threadIdx.x; i < kMaxBins; i += kThreads) sh.hist[i] = 0;
  __syncthreads();
}

// The token's global histogram after a barrier: read at L2 (other CTAs' atomics wrote it).
struct L2Counts {
  const int32_t* h;
  __device__ __forceinline__ int operator[](int i) const { return __ldcg(h + i); }
};

// Over `bins` counts h[0 .. bins) taken top bin first, the bin where the running count reaches want
// (1 <= want <= the total), the count above it and in it: into sh.found (every thread calls it).
// Thread i holds bins bins - 1 - i * per - j (one round of loads), warps scan their sums, each warp
// adds the sums of the warps before it: two barriers.
template <typename H>
__device__ void find_bin(H h, int bins, int want, Shared& sh) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int per = bins / kThreads, top = bins - 1 - threadIdx.x * per;
  int c[kMaxBins / kThreads], sum = 0;
#pragma unroll
  for (int j = 0; j < kMaxBins / kThreads; ++j) sum += (c[j] = j < per ? h[top - j] : 0);
  int incl = sum;
#pragma unroll
  for (int o = 1; o < 32; o *= 2) {
    const int y = __shfl_up_sync(kFull, incl, o);
    if (lane >= o) incl += y;
  }
  if (lane == 31) sh.warp_above[warp] = incl;
  __syncthreads();
  int before = incl - sum;
  for (int w = 0; w < warp; ++w) before += sh.warp_above[w];
  if (before < want && want <= before + sum) {
#pragma unroll
    for (int j = 0; j < kMaxBins / kThreads; ++j) {
      if (j < per && before < want && want <= before + c[j]) {
        sh.found_bin = top - j;
        sh.found_above = before;
        sh.found_count = c[j];
      }
      before += c[j];
    }
  }
  __syncthreads();
}

// After find_bin at `level` (one thread): T's digit joins the prefix; T is known once its bin is
// taken whole (then T = the bin's lowest key - 1 and take = 0: no tie to break) or at level 2.
__device__ void take_bin(int level, Shared& sh) {
  const int d = sh.found_bin, above = sh.found_above, count = sh.found_count;
  const uint32_t prefix = sh.prefix << kLevelBits[level] | static_cast<uint32_t>(d);
  const int want = sh.want - above;
  sh.prefix = prefix;
  sh.want = want;
  sh.bin_count = count;
  if (level == 2) {
    sh.resolved = true;
    sh.T = prefix;
    sh.take = want;
  } else if (count == want) {
    sh.resolved = true;
    sh.T = max(prefix << kLevelShift[level], 1u) - 1;
    sh.take = 0;
  }
}

// Level 0: this CTA's keys into the shared histogram, then into the token's global one; its nonzero
// count into the token's total. (Adding only the bins from the CTA's own k-th largest key up, which
// saves most atomics, measured the same: H100, 1 x 65 and 128 x 3 tiles a launch.)
__device__ void level0_histogram(const uint32_t (&key)[kItems], int32_t* state, Shared& sh) {
  zero_hist(sh);
  int nonzero = 0;
#pragma unroll
  for (int j = 0; j < kItems; ++j) {
    count_digit(key[j], key[j] != 0, 0, sh.hist);
    nonzero += key[j] != 0;
  }
  nonzero = __reduce_add_sync(kFull, nonzero);
  if (threadIdx.x % 32 == 0) atomicAdd(&sh.count, nonzero);
  __syncthreads();
  if (threadIdx.x == 0) atomicAdd(&state[kTotal], sh.count);
  for (int i = threadIdx.x; i < kMaxBins; i += kThreads) {
    if (sh.hist[i]) atomicAdd(&state[i], sh.hist[i]);
  }
}

// Levels 1, 2 without the candidate list: this CTA's keys sharing the prefix into the token's histogram.
__device__ void global_histogram(const uint32_t (&key)[kItems], int level, int32_t* h, Shared& sh) {
  zero_hist(sh);
  const uint32_t prefix = sh.prefix;
#pragma unroll
  for (int j = 0; j < kItems; ++j) count_digit(key[j], shares_prefix(key[j], level, prefix), level, sh.hist);
  __syncthreads();
  for (int i = threadIdx.x; i < (1 << kLevelBits[level]); i += kThreads) {
    if (sh.hist[i]) atomicAdd(&h[i], sh.hist[i]);
  }
}

// The shared histogram of `level` over the m candidates in sh.cand sharing the prefix found so far.
__device__ void cand_histogram(int m, int level, Shared& sh) {
  zero_hist(sh);
  const uint32_t prefix = sh.prefix;
  for (int i0 = 0; i0 < m; i0 += kThreads) {  // whole warps iterate together
    const int i = i0 + threadIdx.x;
    const uint32_t x = i < m ? sh.cand[i] : 0u;
    count_digit(x, shares_prefix(x, level, prefix), level, sh.hist);
  }
  __syncthreads();
}

// T's digit of `level` from a complete histogram (the token's global one: L2Counts; or sh.hist).
// Every thread calls it.
template <typename H>
__device__ void resolve(int level, H h, Shared& sh) {
  find_bin(h, 1 << kLevelBits[level], sh.want, sh);
  if (threadIdx.x == 0) take_bin(level, sh);
  __syncthreads();
}

// Sum of the look-back words of the tiles before `tile`, by warp 0 (lane l reads tile - 1 - l, 32
// tiles a step, until an inclusive word).
__device__ uint32_t look_back(uint32_t* words, int tile) {
  const int lane = threadIdx.x % 32;
  int above = 0, equal = 0;
  for (int end = tile; end > 0; end -= 32) {
    const int j = end - 1 - lane;
    uint32_t w = 0;
    if (j >= 0) {
      do {
        w = *reinterpret_cast<volatile uint32_t*>(&words[j]);
      } while ((w >> 30) == 0);
    }
    // The nearest inclusive word ends the walk; the tiles below it are in its counts.
    const unsigned inclusive = __ballot_sync(kFull, j >= 0 && (w >> 30) == 2);
    const int stop = inclusive ? __ffs(inclusive) - 1 : 31;
    if (j >= 0 && lane <= stop) {
      above += above_of(w);
      equal += equal_of(w);
    }
    if (inclusive) break;
  }
#pragma unroll
  for (int o = 16; o > 0; o /= 2) {
    above += __shfl_xor_sync(kFull, above, o);
    equal = min(equal + __shfl_xor_sync(kFull, equal, o), kSat);
  }
  return pack(above, equal);
}

// Grid (tokens x ctas): CTA g of a token holds tile g of its row. Warp w holds columns
// g * tile + w * 32 * kItems + j * 32 + lane (coalesced loads; column order is warp, then j, then lane).
__global__ void __launch_bounds__(kThreads, 4) grid_select_kernel(const GridParams p, int mode, int ctas) {
  __shared__ Shared sh;
  const int tile = blockIdx.x % ctas;
  const int64_t tc = blockIdx.x / ctas, t = p.t0 + tc;
  int req;
  const int n = row_columns(p, t, mode, req);
  int32_t* row = p.ws + tc * p.row_words;
  int32_t* state = row + p.state_at;
  const uint32_t* keys = reinterpret_cast<const uint32_t*>(row + p.keys_at);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int c0 = tile * kGridTile + warp * (32 * kItems) + lane;
  uint32_t key[kItems];
#pragma unroll
  for (int j = 0; j < kItems; ++j) key[j] = c0 + 32 * j < n ? keys[c0 + 32 * j] : 0u;
  // Levels 1 and 2's global histograms: zero before the first barrier, added to after it.
  int32_t* h12 = level_hist(state, p.zero_words, 1);
  for (int i = tile * kThreads + threadIdx.x; i < kGridLevels12; i += ctas * kThreads) h12[i] = 0;
  if (threadIdx.x == 0) {
    sh.count = 0;
    sh.prefix = 0;
    sh.want = p.k;
    sh.resolved = false;
  }
  level0_histogram(key, state, sh);
  token_barrier(state + kBarrier, ctas, 1);
  const int total = __ldcg(&state[kTotal]);
  if (total <= p.k) {  // every nonzero key is selected
    if (threadIdx.x == 0) {
      sh.selected = total;
      sh.resolved = true;
      sh.T = 0;
      sh.take = 0;
    }
    __syncthreads();
  } else {
    if (threadIdx.x == 0) sh.selected = p.k;
    resolve(0, L2Counts{state}, sh);
  }
  if (!sh.resolved && sh.bin_count <= kGridCand) {
    // Gather T's bin (the same decision in every CTA of the token: one global histogram).
    uint32_t* list = reinterpret_cast<uint32_t*>(cand_list(state, p.zero_words));
    const uint32_t bin = sh.prefix;
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      const bool in = key[j] != 0 && key[j] >> kLevelShift[0] == bin;
      const unsigned voters = __ballot_sync(kFull, in);
      if (voters == 0) continue;
      const int leader = __ffs(voters) - 1;
      int base = 0;
      if (lane == leader) base = atomicAdd(&state[kCandCount], __popc(voters));
      base = __shfl_sync(kFull, base, leader);
      if (in) list[base + __popc(voters & ((1u << lane) - 1))] = key[j];
    }
    token_barrier(state + kBarrier, ctas, 2);
    const int m = sh.bin_count;
    for (int i = threadIdx.x; i < m; i += kThreads) sh.cand[i] = __ldcg(list + i);
    __syncthreads();
    for (int level = 1; !sh.resolved; ++level) {
      cand_histogram(m, level, sh);
      resolve(level, sh.hist, sh);
    }
  } else {
    for (int level = 1; !sh.resolved; ++level) {
      int32_t* h = level_hist(state, p.zero_words, level);
      global_histogram(key, level, h, sh);
      token_barrier(state + kBarrier, ctas, level + 1);
      resolve(level, L2Counts{h}, sh);
    }
  }
  const uint32_t T = sh.T;
  const int take = sh.take;
  int32_t* out = p.out + t * p.out_stride;
  if (tile == 0) {
    for (int i = sh.selected + threadIdx.x; i < p.k; i += kThreads) out[i] = -1;
  }
  // Keys above T and keys equal to T, counted by ballots (recomputed when placing: registers stay
  // within the 32 a thread that 4 resident CTAs an SM allow at 8 keys a thread).
  const unsigned lower = (1u << lane) - 1;
  int above = 0, equal = 0;
#pragma unroll
  for (int j = 0; j < kItems; ++j) {
    above += __popc(__ballot_sync(kFull, key[j] > T));
    equal += __popc(__ballot_sync(kFull, key[j] == T && key[j] != 0));
  }
  if (lane == 0) {
    sh.warp_above[warp] = above;
    sh.warp_equal[warp] = equal;
  }
  __syncthreads();
  uint32_t* words = reinterpret_cast<uint32_t*>(state + kWords);  // zeroed by the host
  if (warp == 0) {
    // The warps' exclusive prefixes and the tile's totals (each < 2^13: no carry between halves).
    const int v = lane < kWarps ? sh.warp_equal[lane] << 16 | sh.warp_above[lane] : 0;
    int incl = v;
#pragma unroll
    for (int o = 1; o < 32; o *= 2) {
      const int y = __shfl_up_sync(kFull, incl, o);
      if (lane >= o) incl += y;
    }
    const int total = __shfl_sync(kFull, incl, 31);
    if (lane < kWarps) {
      sh.warp_above[lane] = (incl - v) & 0xffff;
      sh.warp_equal[lane] = (incl - v) >> 16;
    }
    if (lane == 0) atomicExch(&words[tile], (tile == 0 ? kInclusive : kOwn) | pack(total & 0xffff, total >> 16));
    const uint32_t before = tile == 0 ? 0u : look_back(words, tile);
    if (lane == 0) {
      sh.before = before;
      if (tile > 0) {
        atomicExch(&words[tile], kInclusive | pack(above_of(before) + (total & 0xffff), equal_of(before) + (total >> 16)));
      }
    }
  }
  __syncthreads();
  above = above_of(sh.before) + sh.warp_above[warp];  // keys of the row before the warp's j-th item
  equal = equal_of(sh.before) + sh.warp_equal[warp];
#pragma unroll
  for (int j = 0; j < kItems; ++j) {
    const unsigned a = __ballot_sync(kFull, key[j] > T), e = __ballot_sync(kFull, key[j] == T && key[j] != 0);
    const int equal_seen = equal + __popc(e & lower);
    if (((a >> lane) & 1) || (((e >> lane) & 1) && equal_seen < take)) {
      out[above + __popc(a & lower) + min(equal_seen, take)] = output_of(p, t, req, c0 + 32 * j, mode);
    }
    above += __popc(a);
    equal += __popc(e);
  }
}

}  // namespace

int grid_ctas_per_sm() {
  int blocks = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, grid_select_kernel, kThreads, 0));
  return blocks;
}

void launch_grid_select(const GridParams& p, int mode, int tokens, int ctas, cudaStream_t stream) {
  C10_CUDA_CHECK(cudaMemset2DAsync(p.ws + p.state_at, p.row_words * sizeof(int32_t), 0, p.zero_words * sizeof(int32_t),
                                   tokens, stream));
  GridParams args = p;
  void* kernel_args[] = {&args, &mode, &ctas};
  C10_CUDA_CHECK(cudaLaunchCooperativeKernel(reinterpret_cast<const void*>(grid_select_kernel), dim3(tokens * ctas),
                                             dim3(kThreads), kernel_args, 0, stream));
}

}  // namespace dsv4::indexer
