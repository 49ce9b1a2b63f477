// SPDX-License-Identifier: MIT
// Binds the CUDA kernels of csrc/ to the `dsv4::` ops defined in Python (dsv4ops/ops.py), and defines
// `dsv4_csrc::sparse_attn`, the sm_90 kernel that the Python launcher of `dsv4::sparse_attn`
// (dsv4ops/sparse_attn/cuda.py) calls for the cases it serves. Loaded as a plain shared library by
// dsv4ops/csrc.py.
#include <torch/library.h>

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
      "float scale, int window, int ring_size, int window_block, int comp_block, int window_page_bytes, "
      "int comp_page_bytes, int window_keys, int split_keys, int splits) -> ()");
}

TORCH_LIBRARY_IMPL(dsv4_csrc, CUDA, m) { m.impl("sparse_attn", &dsv4::sparse_attn::sparse_attn_cuda); }
