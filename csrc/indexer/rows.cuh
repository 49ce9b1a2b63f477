// SPDX-License-Identifier: MIT
// A token's row of the indexer workspace, as the scoring and select kernels both see it
// (dsv4ops/indexer/triton.py `_row_len`). P: SelectParams or ScoreParams (params.h).
#pragma once
#include <cstdint>

#include "params.h"

namespace dsv4::indexer {

// Entries visible to token t: w < (position + 1) / ratio, at most n_entries; 0 for padding (req < 0).
template <typename P>
__device__ __forceinline__ int visible_entries(const P& p, int64_t t, int req) {
  return req >= 0 ? static_cast<int>(min((static_cast<int64_t>(p.positions[t]) + 1) / p.ratio,
                                         static_cast<int64_t>(p.n_entries)))
                  : 0;
}

// Columns of token t's row and its request: the visible entries (kEntries), the listed candidate
// blocks x cb (kCandidateEntries; blocks first, -1 after them, checked by the op), or the candidate
// blocks over the visible entries (kBlocks); 0 for padding. Every thread of the CTA calls it.
template <typename P>
__device__ int row_columns(const P& p, int64_t t, int mode, int& req) {
  req = p.req_slots[t];
  if (mode == kCandidateEntries) {
    int listed = 0;
    for (int j0 = 0; j0 < p.n_cand; j0 += blockDim.x) {
      const int j = j0 + threadIdx.x;
      listed += __syncthreads_count(j < p.n_cand && p.cand[t * p.cand_stride + j] >= 0);
    }
    return req >= 0 ? listed * p.cb : 0;
  }
  const int n_vis = visible_entries(p, t, req);
  return mode == kBlocks ? (n_vis + p.cb - 1) / p.cb : n_vis;
}

}  // namespace dsv4::indexer
