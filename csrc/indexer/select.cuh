// SPDX-License-Identifier: MIT
// What both indexer selects (topk_select.cu: one CTA a chunk; topk_grid.cu: a token's row over many
// CTAs) write for a selected column.
#pragma once
#include <cstdint>

#include "params.h"

namespace dsv4::indexer {

constexpr unsigned kFull = 0xffffffffu;

// The output of a selected column: the global pool slot of its entry (kEntries: entry = column;
// kCandidateEntries: entry cand[c / cb] * cb + c % cb) or the column (kBlocks). 32-bit entry
// arithmetic (entries < 2^31, checked by the host), shifts for a power-of-two page: the 64-bit
// divisions this replaced ran ~70 instructions for each selected key of a warp's item slot.
__device__ __forceinline__ int32_t output_of(const RowParams& p, int64_t t, int req, int col, int mode) {
  if (mode == kBlocks) return col;
  int e = col;
  if (mode == kCandidateEntries) e = p.cand[t * p.cand_stride + col / p.cb] * p.cb + col % p.cb;
  const bool pow2 = (p.block_size & (p.block_size - 1)) == 0;
  const int page = pow2 ? e >> (__ffs(p.block_size) - 1) : e / p.block_size;
  const int at = pow2 ? e & (p.block_size - 1) : e % p.block_size;
  return p.block_table[req * p.bt_stride + page] * p.block_size + at;
}

}  // namespace dsv4::indexer
