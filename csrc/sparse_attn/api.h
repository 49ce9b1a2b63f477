// SPDX-License-Identifier: MIT
// Host entry of the sm_90 sparse_attn kernel, registered as `dsv4_csrc::sparse_attn` in dsv4ops.cpp
// and called by dsv4ops/sparse_attn/cuda.py (which has run the op's checks and sized the splits).
#pragma once
#include <ATen/core/Tensor.h>

namespace dsv4::sparse_attn {

void sparse_attn_cuda(const at::Tensor& q, const at::Tensor& window_cache, const at::Tensor& comp_cache,
                      const at::Tensor& window_ends, const at::Tensor& req_slots, const at::Tensor& comp_idx,
                      const at::Tensor& comp_lens, const at::Tensor& sinks, at::Tensor& out, at::Tensor& partial,
                      at::Tensor& lse, double scale, int64_t window,
                      int64_t ring_size, int64_t window_fmt, int64_t comp_fmt, int64_t window_block, int64_t comp_block,
                      int64_t window_page_bytes, int64_t comp_page_bytes, int64_t window_keys, int64_t split_keys,
                      int64_t splits, int64_t cta_heads, bool cluster_merge);
// Clusters of `splits` CTAs of the kernel with `cta_heads` heads a CTA that the current device holds at
// once (dsv4_csrc::cluster_capacity: the launcher merges a token's splits in their cluster only where
// the grid's clusters fit).
int64_t cluster_capacity_cuda(int64_t cta_heads, int64_t splits);

}  // namespace dsv4::sparse_attn
