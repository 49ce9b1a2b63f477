// SPDX-License-Identifier: MIT
// Exact top-k of the indexer's uint32 score keys (ordered like the scores, 0 = no entry; written by
// the Triton scoring kernel of dsv4ops/indexer/triton.py into the workspace laid out by
// dsv4ops/indexer/workspace.py). One CTA selects from one chunk of a token's row (the chunk pass) or
// from one group of the chunks' candidate lists (a merge level), up to 16384 keys held in registers.
//
// A 4-pass radix select (8-bit digits, top first; warp-aggregated histograms in shared memory, one
// warp scans the 256 bins) finds T, the want-th largest nonzero key, want = min(k, nonzero keys), and
// how many keys equal to T are taken. One block-wide scan then places the keys above T and the
// lowest-column keys equal to T in ascending column order: exact ties go to the lower entry and the
// result is bitwise deterministic (no atomic decides a position). The Triton select this replaces on
// sm_90 and sm_100 ran a 32-step binary search over 1024-key chunks: H100, V4-Flash CSA, 128 tokens x 64K,
// select + merges 131 us of the op's 300.
#include <c10/cuda/CUDAException.h>
#include <cuda_runtime.h>

#include <cstdint>

#include "../common/pdl.cuh"
#include "params.h"
#include "rows.cuh"
#include "select.cuh"

namespace dsv4::indexer {
namespace {

constexpr int kBins = 256;

struct Shared {
  int hist[kBins];
  int warp_sums[kMaxThreads / 32];
  int digit;
  int want;      // keys still to select at the current digit (0: all nonzero keys are selected)
  int selected;  // min(k, nonzero keys)
};

// Exclusive prefix sum of v over the CTA in thread order (every thread calls it).
__device__ int exclusive_scan(int v, Shared& sh) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  int x = v;
#pragma unroll
  for (int o = 1; o < 32; o *= 2) {
    const int y = __shfl_up_sync(kFull, x, o);
    if (lane >= o) x += y;
  }
  if (lane == 31) sh.warp_sums[warp] = x;
  __syncthreads();
  if (warp == 0) {
    const int s = lane < static_cast<int>(blockDim.x / 32) ? sh.warp_sums[lane] : 0;
    int w = s;
#pragma unroll
    for (int o = 1; o < 32; o *= 2) {
      const int y = __shfl_up_sync(kFull, w, o);
      if (lane >= o) w += y;
    }
    if (lane < static_cast<int>(blockDim.x / 32)) sh.warp_sums[lane] = w - s;
  }
  __syncthreads();
  return x - v + sh.warp_sums[warp];
}

// T and `take`: the keys above T and the `take` lowest-column keys equal to T are the top
// min(k, nonzero keys) (sh.selected). With at most k nonzero keys, T = 0 and take = 0: all of them.
// Every thread calls it.
template <int ITEMS>
__device__ void kth_key(const uint32_t (&key)[ITEMS], int k, Shared& sh, uint32_t& T, int& take) {
  const int lane = threadIdx.x % 32;
  uint32_t prefix = 0;
#pragma unroll 1
  for (int pass = 0; pass < 4; ++pass) {
    const int shift = 24 - 8 * pass;
    for (int i = threadIdx.x; i < kBins; i += blockDim.x) sh.hist[i] = 0;
    __syncthreads();
#pragma unroll
    for (int j = 0; j < ITEMS; ++j) {
      const uint32_t x = key[j];
      const bool in = x != 0 && (pass == 0 || (x >> (shift + 8)) == (prefix >> (shift + 8)));
      const unsigned voters = __ballot_sync(kFull, in);
      if (voters == 0) continue;  // later passes see only the keys of one bin: most warps skip
      const int d = static_cast<int>((x >> shift) & 0xff);
      const int first = __shfl_sync(kFull, d, __ffs(voters) - 1);  // every lane: a full-mask shuffle
      // One atomic for a warp whose keys share a digit (ReLU makes many scores exactly 0, and a
      // bin then gets most keys: same-address atomics would serialize), else one per key.
      if (__all_sync(kFull, !in || d == first)) {
        const int leader = __ffs(voters) - 1;
        if (lane == leader) atomicAdd(&sh.hist[d], __popc(voters));
      } else if (in) {
        atomicAdd(&sh.hist[d], 1);
      }
    }
    __syncthreads();
    if (threadIdx.x < 32) {  // lane l holds bins 255 - 8l .. 248 - 8l, so lane order is bin order, top first
      int c[8], sum = 0;
#pragma unroll
      for (int j = 0; j < 8; ++j) sum += (c[j] = sh.hist[kBins - 1 - 8 * lane - j]);
      int incl = sum;
#pragma unroll
      for (int o = 1; o < 32; o *= 2) {
        const int y = __shfl_up_sync(kFull, incl, o);
        if (lane >= o) incl += y;
      }
      int want = sh.want;
      if (pass == 0) {
        const int total = __shfl_sync(kFull, incl, 31);
        want = total <= k ? 0 : k;  // 0: every nonzero key is selected, no digit to find
        if (lane == 0) sh.selected = min(k, total);
      }
      __syncwarp();
      int before = incl - sum;
      if (want > 0 && before < want && want <= incl) {
#pragma unroll
        for (int j = 0; j < 8; ++j) {
          if (before + c[j] >= want) {
            sh.digit = kBins - 1 - 8 * lane - j;
            sh.want = want - before;
            break;
          }
          before += c[j];
        }
      } else if (want == 0 && lane == 0) {
        sh.want = 0;
      }
    }
    __syncthreads();
    if (sh.want == 0) {
      T = 0;
      take = 0;
      return;
    }
    prefix |= static_cast<uint32_t>(sh.digit) << shift;
  }
  T = prefix;
  take = sh.want;
}

// Selects the top min(k, nonzero keys) of the CTA's keys (thread i holds columns i * ITEMS ..,
// ascending) into the token's final row (-1 after them) or into a candidate list [count, k columns,
// k keys] at `list`.
template <int ITEMS>
__device__ void select(const SelectParams& p, const uint32_t (&key)[ITEMS], const int (&col)[ITEMS], bool final,
                       int64_t t, int req, int mode, int32_t* list, Shared& sh) {
  uint32_t T;
  int take;
  kth_key<ITEMS>(key, p.k, sh, T, take);
  int above = 0, equal = 0;
#pragma unroll
  for (int j = 0; j < ITEMS; ++j) {
    above += key[j] > T;
    equal += key[j] == T;
  }
  // Both counts in one scan: each is at most kMaxBlock = 16384 < 2^16, so the halves never carry.
  const int before = exclusive_scan((equal << 16) | above, sh);
  int equal_seen = before >> 16;
  int at = (before & 0xffff) + min(equal_seen, take);
  const int selected = sh.selected;
  int32_t* row = p.out + t * p.out_stride;
#pragma unroll
  for (int j = 0; j < ITEMS; ++j) {
    const bool tie = key[j] == T;
    if (key[j] > T || (tie && equal_seen < take)) {
      if (final) {
        row[at] = output_of(p, t, req, col[j], mode);
      } else {
        list[1 + at] = col[j];
        list[1 + p.k + at] = static_cast<int32_t>(key[j]);
      }
      ++at;
    }
    equal_seen += tie;
  }
  if (final) {
    for (int i = selected + threadIdx.x; i < p.k; i += blockDim.x) row[i] = -1;
  } else if (threadIdx.x == 0) {
    list[0] = selected;
  }
  __syncthreads();  // sh is reused by the CTA's next chunk
}

template <int ITEMS>
__global__ void __launch_bounds__(kMaxThreads) topk_select_kernel(const SelectParams p, int mode) {
  __shared__ Shared sh;
  pdl::wait_prior_grid();  // the scores, or the level before
  const int64_t tc = blockIdx.x, t = p.t0 + tc;
  int req;
  const int n = row_columns(p, t, mode, req);
  int32_t* row = p.ws + tc * p.row_words;
  const int list_words = 2 * p.k + 1;
  uint32_t key[ITEMS];
  int col[ITEMS];
  if (p.level < 0) {
    const int chunks = max((n + p.chunk - 1) / p.chunk, 1);
    for (int c = blockIdx.y; c < chunks; c += gridDim.y) {
#pragma unroll
      for (int j = 0; j < ITEMS; ++j) {
        const int i = threadIdx.x * ITEMS + j;
        col[j] = c * p.chunk + i;
        key[j] = i < p.chunk && col[j] < n ? static_cast<uint32_t>(row[p.keys_at + col[j]]) : 0u;
      }
      select<ITEMS>(p, key, col, chunks == 1, t, req, mode, row + p.in_at + static_cast<int64_t>(c) * list_words, sh);
    }
    return;
  }
  int lists = (n + p.chunk - 1) / p.chunk;
  for (int l = 0; l < p.level; ++l) lists = (lists + p.group - 1) / p.group;
  const int g = blockIdx.y;
  if (lists <= 1 || g * p.group >= lists) return;
#pragma unroll
  for (int j = 0; j < ITEMS; ++j) {
    const int i = threadIdx.x * ITEMS + j, list = g * p.group + i / p.k, at = i % p.k;
    const int32_t* in = row + p.in_at + static_cast<int64_t>(list) * list_words;
    const bool ok = i < p.group * p.k && list < lists && at < in[0];
    key[j] = ok ? static_cast<uint32_t>(in[1 + p.k + at]) : 0u;
    col[j] = ok ? in[1 + at] : 0;
  }
  select<ITEMS>(p, key, col, lists <= p.group, t, req, mode, row + p.out_at + static_cast<int64_t>(g) * list_words,
                sh);
}

}  // namespace

void launch_select(const SelectParams& p, int mode, int tokens, int programs, int threads, int items,
                   cudaStream_t stream) {
  // Programmatic dependent launch (common/pdl.cuh): the launch hides behind the scoring's tail. H100,
  // V4-Flash, whole indexer_topk with / without: 1 x 4K 8.9 / 9.6 us, 128 x 4K 16.4 / 17.0.
  const dim3 grid(tokens, programs);
  switch (items) {
    case 1: pdl::launch_pdl(topk_select_kernel<1>, grid, dim3(threads), 0, stream, p, mode); break;
    case 2: pdl::launch_pdl(topk_select_kernel<2>, grid, dim3(threads), 0, stream, p, mode); break;
    case 4: pdl::launch_pdl(topk_select_kernel<4>, grid, dim3(threads), 0, stream, p, mode); break;
    case 8: pdl::launch_pdl(topk_select_kernel<8>, grid, dim3(threads), 0, stream, p, mode); break;
    default: pdl::launch_pdl(topk_select_kernel<16>, grid, dim3(threads), 0, stream, p, mode); break;
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace dsv4::indexer
