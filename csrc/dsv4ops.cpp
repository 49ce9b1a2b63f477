// SPDX-License-Identifier: MIT
// Binds the CUDA kernels of csrc/ to the `dsv4::` ops defined in Python (dsv4ops/ops.py), and defines
// the kernels that Python launchers call: `dsv4_csrc::sparse_attn` (dsv4ops/sparse_attn/cuda.py,
// for the cases it serves), `dsv4_csrc::topk_score`, `dsv4_csrc::topk_select` and
// `dsv4_csrc::topk_grid` (dsv4ops/indexer/cuda.py, the scoring and the two selects of
// `dsv4::indexer_topk`). Loaded as a plain shared library by dsv4ops/csrc.py.
#include <torch/library.h>

#include "indexer/api.h"
#include "router/api.h"
#include "sparse_attn/api.h"

TORCH_LIBRARY_IMPL(dsv4, CUDA, m) {
  m.impl("gate_topk", &dsv4::router::gate_topk_cuda);
  m.impl("hash_route", &dsv4::router::hash_route_cuda);
}

TORCH_LIBRARY(dsv4_csrc, m) {
  m.def(
      "sparse_attn(Tensor q, Tensor window_cache, Tensor comp_cache, Tensor window_ends, Tensor req_slots, "
      "Tensor comp_idx, Tensor comp_lens, Tensor sinks, Tensor(a!) out, Tensor(b!) partial, Tensor(c!) lse, "
      "float scale, int window, int ring_size, int window_fmt, int comp_fmt, int window_block, "
      "int comp_block, int window_page_bytes, int comp_page_bytes, int window_keys, int split_keys, int splits, int cta_heads, "
      "bool cluster_merge) -> ()");
  // No tensor to dispatch on: one kernel for every key, on the current CUDA device.
  m.def("cluster_capacity(int cta_heads, int splits) -> int", &dsv4::sparse_attn::cluster_capacity_cuda);
  m.def(
      "topk_score(Tensor q, Tensor weights, Tensor positions, Tensor req_slots, Tensor cache, Tensor block_table, "
      "Tensor cand, Tensor(a!) workspace, int t0, int tokens, int row_words, int programs, int n_entries, int ratio, "
      "int block_size, int page_bytes, int cand_block, int mode, int zero_at, int zero_words) -> ()");
  m.def(
      "topk_select(Tensor positions, Tensor req_slots, Tensor block_table, Tensor cand, Tensor(a!) out, "
      "Tensor(b!) workspace, int t0, int tokens, int row_words, int keys_at, int in_at, int out_at, int level, "
      "int programs, int n_entries, int ratio, int block_size, int cand_block, int chunk, int group, int mode) -> ()");
  m.def(
      "topk_grid(Tensor positions, Tensor req_slots, Tensor block_table, Tensor cand, Tensor(a!) out, "
      "Tensor(b!) workspace, int t0, int tokens, int row_words, int keys_at, int n_row, int ctas, bool zeroed, "
      "int n_entries, int ratio, int block_size, int cand_block, int mode) -> ()");
}

TORCH_LIBRARY_IMPL(dsv4_csrc, CUDA, m) {
  m.impl("sparse_attn", &dsv4::sparse_attn::sparse_attn_cuda);
  m.impl("topk_score", &dsv4::indexer::topk_score_cuda);
  m.impl("topk_select", &dsv4::indexer::topk_select_cuda);
  m.impl("topk_grid", &dsv4::indexer::topk_grid_cuda);
}
