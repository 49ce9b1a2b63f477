// SPDX-License-Identifier: MIT
// Host side: the RowParams (params.h) of a launch of the indexer kernels, from the op's tensors, and
// the check of the int32 index tensors they point to.
#pragma once
#include <ATen/core/Tensor.h>

#include <cstdint>

#include "../common/checks.h"
#include "params.h"

namespace dsv4::indexer {

// An int32 tensor with a contiguous last dim on `device` (the kernels index its rows directly).
inline void check_int32_rows(const at::Tensor& x, const c10::Device& device, const char* name) {
  DSV4_CHECK(x.device() == device, name, ": expected a tensor on ", device, ", got ", x.device());
  DSV4_CHECK(x.scalar_type() == at::kInt, name, ": expected int32, got ", x.scalar_type());
  DSV4_CHECK(x.dim() >= 1 && x.stride(-1) == 1, name, ": expected a contiguous last dim, got shape ", x.sizes());
}

inline RowParams row_params(const at::Tensor& positions, const at::Tensor& req_slots, const at::Tensor& block_table,
                            const at::Tensor& cand, at::Tensor& workspace, int64_t t0, int64_t row_words,
                            int64_t n_entries, int64_t ratio, int64_t block_size, int64_t cand_block, int64_t mode) {
  RowParams p{};
  p.positions = positions.const_data_ptr<int32_t>();
  p.req_slots = req_slots.const_data_ptr<int32_t>();
  p.block_table = block_table.const_data_ptr<int32_t>();
  p.cand = cand.const_data_ptr<int32_t>();
  p.ws = workspace.mutable_data_ptr<int32_t>();
  p.t0 = t0;
  p.bt_stride = block_table.stride(0);
  p.cand_stride = cand.stride(0);
  p.row_words = row_words;
  p.n_cand = mode == kCandidateEntries ? static_cast<int>(cand.size(1)) : 0;
  p.cb = static_cast<int>(cand_block);
  p.n_entries = static_cast<int>(n_entries);
  p.ratio = static_cast<int>(ratio);
  p.block_size = static_cast<int>(block_size);
  return p;
}

}  // namespace dsv4::indexer
