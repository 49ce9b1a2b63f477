// SPDX-License-Identifier: MIT
// Exact top-k of a long row of the indexer's uint32 score keys (0 = no entry), over all the CTAs of
// its token at once: the same result as topk_select.cu (the keys above the k-th largest key T and
// the lowest-column keys equal to T, in ascending column order, -1 after them) without its chunk
// lists and merges, whose one-CTA-a-16384-key-chunk steps left most SMs idle (H100, V4-Flash CSA, one
// token at 1M positions: 262144 keys selected in ~42 us on 16 CTAs).
//
// One launch after each token's first state words are zeroed (params.h GridParams: by a memset, or
// by the scoring kernel: ScoreParams zero_at), with `ctas` CTAs a token (at most one a 4096-key tile
// of the longest row the block table allows). The tiles of the token's real row (device lengths) are
// split evenly over its first min(ctas, tiles) CTAs, its live ones, and the others leave at once:
// the cost follows the real context. Several live CTAs of a token wait for each other, so all must
// be resident (a cooperative launch); a token of one live CTA selects alone, in shared memory (the
// steps below without the global histogram, the barriers and the look-back). Each live CTA:
//   1. adds its nonzero keys' top 11 bits to the token's global histogram; after a barrier of the
//      token's live CTAs, each reads it and finds T's bin and the keys still wanted there;
//   2. unless that bin is taken whole (then T = its lowest key - 1, no tie to break): when it holds
//      at most kGridCand keys (the usual case; 200-450 in the bench at 64K and 1M), appends its
//      keys of the bin to the token's candidate list; after a second barrier every CTA loads the
//      list and finds T's lower 21 bits from it alone (two shared-memory histogram levels).
//      Otherwise two more global levels as in 1 (bits 20..10, then 9..0 of the keys sharing T's
//      bits so far);
//   3. counts its keys above T and equal to T, learns the counts of the CTAs before it by a
//      decoupled look-back, and writes its selected keys' outputs at their final positions.
// No atomic decides a position: the result is bitwise deterministic.
#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>

#include "../common/pdl.cuh"
#include "params.h"
#include "rows.cuh"
#include "select.cuh"

namespace dsv4::indexer {
namespace {

constexpr int kThreads = 512;
constexpr int kMaxDevices = 64;
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

// A CTA's look-back word: state (bits 31..30: 0 not yet, 1 the CTA's own counts, 2 the counts of
// it and every CTA before), keys equal to T (bits 29..15, saturated at kSat: only min(., take <= k)
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
  int cand_count;   // keys gathered into cand (a one-tile row)
  uint32_t prefix;  // T's digits found so far
  int want;         // keys still to select among those sharing `prefix`
  int bin_count;    // keys sharing `prefix`
  int selected;     // min(k, nonzero keys)
  bool resolved;    // T and take are known: the keys above T and the `take` lowest-column keys equal to T
  uint32_t T;
  int take;
  uint32_t before;  // the look-back's sum over the CTAs before this one
  int sum_above, sum_equal;  // count_selected's sums
};

// Waits until the token's `ctas` live CTAs have all arrived `phase` times (the counter starts at 0).
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

// The CTA's tiles [first, last) of its token's row and the keys of one of them in registers (kItems a
// thread): warp w holds columns tile * kGridTile + w * 32 * kItems + j * 32 + lane (coalesced
// loads; column order is warp, then j, then lane). A CTA of one tile loads it once; a CTA of several
// reloads them (from L2) in each pass.
struct Tiles {
  const uint32_t* keys;
  int n, first, last, loaded;
  uint32_t key[kItems];

  __device__ __forceinline__ int column(int tile, int j) const {
    return tile * kGridTile + threadIdx.x / 32 * (32 * kItems) + threadIdx.x % 32 + 32 * j;
  }
  __device__ __forceinline__ void fetch(int tile) {
    if (tile == loaded) return;
    loaded = tile;
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      const int c = column(tile, j);
      key[j] = c < n ? keys[c] : 0u;
    }
  }
};

// The shared histogram of `level` over the CTA's keys sharing the prefix found so far; at level 0
// also their nonzero count (sh.count, zeroed by the caller).
__device__ void tiles_histogram(Tiles& tl, int level, Shared& sh) {
  zero_hist(sh);
  const uint32_t prefix = sh.prefix;
  int nonzero = 0;
  for (int tile = tl.first; tile < tl.last; ++tile) {
    tl.fetch(tile);
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      count_digit(tl.key[j], shares_prefix(tl.key[j], level, prefix), level, sh.hist);
      nonzero += tl.key[j] != 0;
    }
  }
  if (level == 0) {
    nonzero = __reduce_add_sync(kFull, nonzero);
    if (threadIdx.x % 32 == 0) atomicAdd(&sh.count, nonzero);
  }
  __syncthreads();
}

// The shared histogram's `bins` into the token's global histogram h (and at level 0 sh.count into
// its total). (Adding only the bins from the CTA's own k-th largest key up, which saves most
// atomics, measured the same: H100, 1 x 65 and 128 x 3 tiles a launch.)
__device__ void add_to_token(int32_t* h, int bins, int32_t* total, const Shared& sh) {
  if (total != nullptr && threadIdx.x == 0) atomicAdd(total, sh.count);
  for (int i = threadIdx.x; i < bins; i += kThreads) {
    if (sh.hist[i]) atomicAdd(&h[i], sh.hist[i]);
  }
}

// Appends the CTA's keys of level 0's bin `bin` to `list` at positions taken from `count` (the
// token's global list, or sh.cand when the CTA is the token's only one). Their order does not
// matter: only their histograms are read.
__device__ void gather_bin(Tiles& tl, uint32_t bin, uint32_t* list, int* count) {
  const int lane = threadIdx.x % 32;
  for (int tile = tl.first; tile < tl.last; ++tile) {
    tl.fetch(tile);
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      const bool in = tl.key[j] != 0 && tl.key[j] >> kLevelShift[0] == bin;
      const unsigned voters = __ballot_sync(kFull, in);
      if (voters == 0) continue;
      const int leader = __ffs(voters) - 1;
      int base = 0;
      if (lane == leader) base = atomicAdd(count, __popc(voters));
      base = __shfl_sync(kFull, base, leader);
      if (in) list[base + __popc(voters & ((1u << lane) - 1))] = tl.key[j];
    }
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

// Sum of the look-back words of the CTAs before CTA g, by warp 0 (lane l reads g - 1 - l, 32 CTAs a
// step, until an inclusive word).
__device__ uint32_t look_back(uint32_t* words, int g) {
  const int lane = threadIdx.x % 32;
  int above = 0, equal = 0;
  for (int end = g; end > 0; end -= 32) {
    const int j = end - 1 - lane;
    uint32_t w = 0;
    if (j >= 0) {
      do {
        w = *reinterpret_cast<volatile uint32_t*>(&words[j]);
      } while ((w >> 30) == 0);
    }
    // The nearest inclusive word ends the walk; the CTAs below it are in its counts.
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

// Each warp's keys above T and equal to T, over the CTA's tiles [first, last): into sh.warp_* as
// exclusive prefixes in warp order, their sums into sh.sum_*. Every thread calls it.
__device__ void count_selected(Tiles& tl, int first, int last, uint32_t T, Shared& sh) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int above = 0, equal = 0;
  for (int tile = first; tile < last; ++tile) {
    tl.fetch(tile);
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      above += __popc(__ballot_sync(kFull, tl.key[j] > T));
      equal += __popc(__ballot_sync(kFull, tl.key[j] == T && tl.key[j] != 0));
    }
  }
  if (lane == 0) {
    sh.warp_above[warp] = above;
    sh.warp_equal[warp] = equal;
  }
  __syncthreads();
  if (warp == 0) {
    int a = lane < kWarps ? sh.warp_above[lane] : 0, e = lane < kWarps ? sh.warp_equal[lane] : 0;
    int ia = a, ie = e;
#pragma unroll
    for (int o = 1; o < 32; o *= 2) {
      const int ya = __shfl_up_sync(kFull, ia, o), ye = __shfl_up_sync(kFull, ie, o);
      if (lane >= o) {
        ia += ya;
        ie += ye;
      }
    }
    if (lane < kWarps) {
      sh.warp_above[lane] = ia - a;
      sh.warp_equal[lane] = ie - e;
    }
    if (lane == 31) {
      sh.sum_above = ia;
      sh.sum_equal = ie;
    }
  }
  __syncthreads();
}

// Grid (tokens x ctas): live CTA g of a token holds tiles [g * tiles / live, (g + 1) * tiles / live)
// of its real row. Two CTAs an SM (64 registers a thread): H100, V4-Flash CSA, whole indexer_topk,
// against four (32 registers, 192 B of spill loads): 1 x 1M 30.5 / 30.7 us, 32 x 64K 51.9 / 54.4,
// 1 x 4K in a 1M table 13.5 / 14.3.
__global__ void __launch_bounds__(kThreads, 2) grid_select_kernel(const GridParams p, int mode, int ctas) {
  __shared__ Shared sh;
  pdl::wait_prior_grid();  // the scores
  const int g = blockIdx.x % ctas;
  const int64_t tc = blockIdx.x / ctas, t = p.t0 + tc;
  int req;
  const int n = row_columns(p, t, mode, req);
  // The real row's tiles, split evenly over the first `live` CTAs: they alone meet at its barriers.
  const int tiles = max(1, (n + kGridTile - 1) / kGridTile), live = min(ctas, tiles);
  if (g >= live) return;
  int32_t* row = p.ws + tc * p.row_words;
  int32_t* state = row + p.state_at;
  Tiles tl{reinterpret_cast<const uint32_t*>(row + p.keys_at), n, g * tiles / live, (g + 1) * tiles / live, -1, {}};
  if (threadIdx.x == 0) {
    sh.count = 0;
    sh.cand_count = 0;
    sh.prefix = 0;
    sh.want = p.k;
    sh.resolved = false;
  }
  tiles_histogram(tl, 0, sh);
  if (live > 1) {
    // Levels 1 and 2's global histograms: zero before the first barrier, added to after it.
    int32_t* h12 = level_hist(state, p.zero_words, 1);
    for (int i = g * kThreads + threadIdx.x; i < kGridLevels12; i += live * kThreads) h12[i] = 0;
    add_to_token(state, kMaxBins, &state[kTotal], sh);
    token_barrier(state + kBarrier, live, 1);
  }
  const int total = live > 1 ? __ldcg(&state[kTotal]) : sh.count;
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
    if (live > 1) {
      resolve(0, L2Counts{state}, sh);
    } else {
      resolve(0, sh.hist, sh);
    }
  }
  if (!sh.resolved && sh.bin_count <= kGridCand) {
    // Gather T's bin (the same decision in every CTA of the token: one histogram).
    const int m = sh.bin_count;
    if (live > 1) {
      uint32_t* list = reinterpret_cast<uint32_t*>(cand_list(state, p.zero_words));
      gather_bin(tl, sh.prefix, list, &state[kCandCount]);
      token_barrier(state + kBarrier, live, 2);
      for (int i = threadIdx.x; i < m; i += kThreads) sh.cand[i] = __ldcg(list + i);
    } else {
      gather_bin(tl, sh.prefix, sh.cand, &sh.cand_count);
    }
    __syncthreads();
    for (int level = 1; !sh.resolved; ++level) {
      cand_histogram(m, level, sh);
      resolve(level, sh.hist, sh);
    }
  } else {
    for (int level = 1; !sh.resolved; ++level) {
      tiles_histogram(tl, level, sh);
      if (live > 1) {
        int32_t* h = level_hist(state, p.zero_words, level);
        add_to_token(h, 1 << kLevelBits[level], nullptr, sh);
        token_barrier(state + kBarrier, live, level + 1);
        resolve(level, L2Counts{h}, sh);
      } else {
        resolve(level, sh.hist, sh);
      }
    }
  }
  const uint32_t T = sh.T;
  const int take = sh.take;
  int32_t* out = p.out + t * p.out_stride;
  if (g == 0) {
    for (int i = sh.selected + threadIdx.x; i < p.k; i += kThreads) out[i] = -1;
  }
  // The CTA's counts of keys above T and equal to T (a CTA of one tile: the counts its writes use).
  const bool one_tile = tl.last - tl.first == 1;
  count_selected(tl, tl.first, tl.last, T, sh);
  uint32_t* words = reinterpret_cast<uint32_t*>(state + kWords);  // zeroed by the host
  if (threadIdx.x == 0) sh.before = 0;
  if (live > 1 && threadIdx.x < 32) {
    const uint32_t own = pack(sh.sum_above, sh.sum_equal);
    if (threadIdx.x == 0) atomicExch(&words[g], (g == 0 ? kInclusive : kOwn) | own);
    const uint32_t before = g == 0 ? 0u : look_back(words, g);
    if (threadIdx.x == 0) {
      sh.before = before;
      if (g > 0) {
        atomicExch(&words[g], kInclusive | pack(above_of(before) + sh.sum_above, equal_of(before) + sh.sum_equal));
      }
    }
  }
  __syncthreads();
  // Keys of the row before this CTA's tile, then before each warp's first item of it.
  int row_above = above_of(sh.before), row_equal = equal_of(sh.before);
  const unsigned lower = (1u << (threadIdx.x % 32)) - 1;
  for (int tile = tl.first; tile < tl.last; ++tile) {
    if (!one_tile) count_selected(tl, tile, tile + 1, T, sh);
    tl.fetch(tile);
    int above = row_above + sh.warp_above[threadIdx.x / 32], equal = row_equal + sh.warp_equal[threadIdx.x / 32];
#pragma unroll
    for (int j = 0; j < kItems; ++j) {
      const uint32_t x = tl.key[j];
      const unsigned a = __ballot_sync(kFull, x > T), e = __ballot_sync(kFull, x == T && x != 0);
      const int equal_seen = equal + __popc(e & lower);
      if (((a >> threadIdx.x % 32) & 1) || (((e >> threadIdx.x % 32) & 1) && equal_seen < take)) {
        out[above + __popc(a & lower) + min(equal_seen, take)] = output_of(p, t, req, tl.column(tile, j), mode);
      }
      above += __popc(a);
      equal += __popc(e);
    }
    row_above += sh.sum_above;
    row_equal = min(row_equal + sh.sum_equal, kSat);
    __syncthreads();  // sh.warp_* and sh.sum_* are rewritten for the next tile
  }
}

}  // namespace

int grid_ctas_per_sm(int device) {
  // Queried once a device (the current one, set by the caller's guard): a decode step launches the
  // select in every CSA layer, and the query is a host call of microseconds.
  static std::atomic<int> cached[kMaxDevices];
  TORCH_CHECK(device >= 0 && device < kMaxDevices, "device index out of range: ", device);
  int blocks = cached[device].load(std::memory_order_relaxed);
  if (blocks == 0) {
    C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, grid_select_kernel, kThreads, 0));
    cached[device].store(blocks, std::memory_order_relaxed);
  }
  return blocks;
}

void launch_grid_select(const GridParams& p, int mode, int tokens, int ctas, bool zeroed, cudaStream_t stream) {
  if (ctas == 1) {  // no CTA waits for another: no state, any launch size
    pdl::launch_pdl(grid_select_kernel, dim3(tokens), dim3(kThreads), 0, stream, p, mode, ctas);
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    return;
  }
  // The state words, unless the scoring kernel zeroed them (score.cu zero_at: a graph node less,
  // ~1.1 us on the H100).
  if (!zeroed) {
    C10_CUDA_CHECK(cudaMemset2DAsync(p.ws + p.state_at, p.row_words * sizeof(int32_t), 0,
                                     p.zero_words * sizeof(int32_t), tokens, stream));
  }
  // Cooperative and with programmatic dependent launch (common/pdl.cuh). The scoring does not trigger
  // early, so the CTAs land as its CTAs leave.
  C10_CUDA_CHECK(
      pdl::launch_pdl<true>(grid_select_kernel, dim3(tokens * ctas), dim3(kThreads), 0, stream, p, mode, ctas));
}

}  // namespace dsv4::indexer
