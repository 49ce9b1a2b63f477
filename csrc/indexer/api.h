// SPDX-License-Identifier: MIT
// Host entries of the indexer's kernels, registered as `dsv4_csrc::topk_score`, `dsv4_csrc::topk_select`
// and `dsv4_csrc::topk_grid` in dsv4ops.cpp and called by dsv4ops/indexer/cuda.py: the scoring writes
// the keys, a select picks (topk_select one CTA a chunk, topk_grid a long row over many CTAs).
#pragma once
#include <ATen/core/Tensor.h>

namespace dsv4::indexer {

void topk_select_cuda(const at::Tensor& positions, const at::Tensor& req_slots, const at::Tensor& block_table,
                      const at::Tensor& cand, at::Tensor& out, at::Tensor& workspace, int64_t t0, int64_t tokens,
                      int64_t row_words, int64_t keys_at, int64_t in_at, int64_t out_at, int64_t level,
                      int64_t programs, int64_t n_entries, int64_t ratio, int64_t block_size, int64_t cand_block,
                      int64_t chunk, int64_t group, int64_t mode);

void topk_grid_cuda(const at::Tensor& positions, const at::Tensor& req_slots, const at::Tensor& block_table,
                    const at::Tensor& cand, at::Tensor& out, at::Tensor& workspace, int64_t t0, int64_t tokens,
                    int64_t row_words, int64_t keys_at, int64_t n_row, int64_t ctas, bool zeroed,
                    int64_t n_entries, int64_t ratio, int64_t block_size, int64_t cand_block, int64_t mode);

void topk_score_cuda(const at::Tensor& q, const at::Tensor& weights, const at::Tensor& positions,
                     const at::Tensor& req_slots, const at::Tensor& cache, const at::Tensor& block_table,
                     const at::Tensor& cand, at::Tensor& workspace, int64_t t0, int64_t tokens, int64_t row_words,
                     int64_t programs, int64_t n_entries, int64_t ratio, int64_t block_size, int64_t page_bytes,
                     int64_t cand_block, int64_t mode, int64_t zero_at, int64_t zero_words);

}  // namespace dsv4::indexer
