// SPDX-License-Identifier: MIT
// Host side of the sm_90 sparse_attn kernel: layout checks -> params -> launch on the current stream
// (not api.cpp: cpp_extension names objects by basename, and router/api.cpp exists). The values
// (positions, slots, lengths) were checked by the op in Python; these checks guard the pointer
// arithmetic the kernel relies on (dtypes, contiguous rows, 16-B alignment).
#include "api.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cmath>
#include <cstdint>
#include <initializer_list>

#include "../common/checks.h"
#include "params.h"

namespace dsv4::sparse_attn {
namespace {

constexpr int64_t kDim = 512;

void check_rows(const at::Tensor& x, const char* name) {
  DSV4_CHECK(x.dim() == 3 && x.size(2) == kDim && x.stride(2) == 1, name,
             ": expected [tokens, heads, 512] with a contiguous last dim, got shape ", x.sizes());
  DSV4_CHECK(x.stride(0) % 8 == 0 && x.stride(1) % 8 == 0 && reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0,
             name, ": expected 16-B aligned rows (strides multiples of 8 elements)");
  DSV4_CHECK_DTYPE(x, at::kBFloat16);
}

void check_pool(const at::Tensor& x, const char* name) {
  DSV4_CHECK_DTYPE(x, at::kByte);
  DSV4_CHECK(x.is_contiguous() && reinterpret_cast<uintptr_t>(x.data_ptr()) % 16 == 0, name,
             ": expected a contiguous, 16-B aligned byte pool");
}

void check_int_vector(const at::Tensor& x, int64_t n, const char* name) {
  DSV4_CHECK_DTYPE(x, at::kInt);
  DSV4_CHECK(x.dim() == 1 && x.size(0) == n && x.stride(0) == 1, name, ": expected a contiguous [", n,
             "] vector, got shape ", x.sizes());
}

}  // namespace

void sparse_attn_cuda(const at::Tensor& q, const at::Tensor& window_cache, const at::Tensor& comp_cache,
                      const at::Tensor& window_ends, const at::Tensor& req_slots, const at::Tensor& comp_idx,
                      const at::Tensor& comp_lens, const at::Tensor& sinks, at::Tensor& out, at::Tensor& partial,
                      at::Tensor& lse, double scale, int64_t window,
                      int64_t ring_size, int64_t window_fmt, int64_t comp_fmt, int64_t window_block, int64_t comp_block,
                      int64_t window_page_bytes, int64_t comp_page_bytes, int64_t window_keys, int64_t split_keys,
                      int64_t splits, int64_t cta_heads, bool cluster_merge) {
  DSV4_CHECK_CUDA(q);
  DSV4_CHECK(serves_formats(static_cast<int>(window_fmt), static_cast<int>(comp_fmt)),
             "window_fmt / comp_fmt: expected a pair of rows.cuh formats the kernel reads, got ",
             window_fmt, " / ", comp_fmt);
  check_rows(q, "q");
  check_rows(out, "out");
  DSV4_CHECK(out.sizes() == q.sizes(), "out: expected shape ", q.sizes(), " (as q), got ", out.sizes());
  check_pool(window_cache, "window_cache");
  check_pool(comp_cache, "comp_cache");
  const int64_t tokens = q.size(0), heads = q.size(1);
  check_int_vector(window_ends, tokens, "window_ends");
  check_int_vector(req_slots, tokens, "req_slots");
  check_int_vector(comp_lens, tokens, "comp_lens");
  DSV4_CHECK_DTYPE(comp_idx, at::kInt);
  DSV4_CHECK(comp_idx.dim() == 2 && comp_idx.size(0) == tokens && comp_idx.stride(1) == 1,
             "comp_idx: expected [tokens, n] int32 with contiguous rows, got shape ", comp_idx.sizes());
  DSV4_CHECK_DTYPE(sinks, at::kFloat);
  DSV4_CHECK(sinks.dim() == 1 && sinks.size(0) == heads && sinks.stride(0) == 1, "sinks: expected [", heads,
             "] fp32, got shape ", sinks.sizes());
  DSV4_CHECK(cta_heads == 8 || cta_heads == 16 || cta_heads == 64, "cta_heads: expected 8, 16 or 64, got ",
             cta_heads);
  // Key tiles: 32 keys a tile at 64 heads a CTA, 64 (wgmma's M) below; the window in 32-key units.
  const int64_t tile_keys = cta_heads == 64 ? 32 : 64;
  DSV4_CHECK(splits >= 1 && split_keys % tile_keys == 0 && window_keys % 32 == 0 && window_keys >= window,
             "splits / split_keys / window_keys: expected whole ", tile_keys, "-key tiles and a window of whole "
             "32-key units");
  DSV4_CHECK(ring_size > 0 && ring_size < (int64_t{1} << 31) && window_block > 0 && comp_block > 0 &&
                 window_block < (int64_t{1} << 31) && comp_block < (int64_t{1} << 31),
             "ring_size / window_block / comp_block: expected positive 32-bit sizes");
  DSV4_CHECK(!cluster_merge || (splits >= 2 && splits <= kMaxClusterSplits),
             "cluster_merge: expected 2 to ", kMaxClusterSplits, " splits (a portable cluster), got ", splits);
  const bool combine = splits > 1 && !cluster_merge;  // the workspaces of the combine kernel
  if (combine) {
    DSV4_CHECK_DTYPE(partial, at::kBFloat16);
    DSV4_CHECK_DTYPE(lse, at::kFloat);
    DSV4_CHECK(partial.is_contiguous() && partial.numel() == tokens * splits * heads * kDim && lse.is_contiguous() &&
                   lse.numel() == tokens * splits * heads,
               "partial / lse: expected the [tokens x splits x heads] (x 512) bf16 / fp32 workspaces");
    // combine.cu addresses a (token, head)'s splits with 32-bit offsets.
    DSV4_CHECK(splits * heads * kDim < (int64_t{1} << 31), "splits x heads x 512 must stay below 2^31, got ",
               splits, " x ", heads, " x 512");
  }
  for (const at::Tensor* t : std::initializer_list<const at::Tensor*>{
           &window_cache, &comp_cache, &window_ends, &req_slots, &comp_idx, &comp_lens, &sinks, &out, &partial, &lse}) {
    DSV4_CHECK_SAME_DEVICE(*t, q);
  }
  if (tokens == 0 || heads == 0) return;

  const c10::cuda::CUDAGuard guard(q.device());
  Params p{};
  p.q = q.const_data_ptr();
  p.q_stride_token = q.stride(0);
  p.q_stride_head = q.stride(1);
  p.window_cache = window_cache.const_data_ptr<uint8_t>();
  p.comp_cache = comp_cache.const_data_ptr<uint8_t>();
  p.window_fmt = static_cast<int>(window_fmt);
  p.comp_fmt = static_cast<int>(comp_fmt);
  p.window_page_bytes = window_page_bytes;
  p.comp_page_bytes = comp_page_bytes;
  p.window_block = FastDiv(static_cast<uint32_t>(window_block));
  p.comp_block = FastDiv(static_cast<uint32_t>(comp_block));
  p.window_ends = window_ends.const_data_ptr<int32_t>();
  p.req_slots = req_slots.const_data_ptr<int32_t>();
  p.comp_idx = comp_idx.const_data_ptr<int32_t>();
  p.comp_idx_stride = comp_idx.stride(0);
  p.comp_lens = comp_lens.const_data_ptr<int32_t>();
  p.sinks = sinks.const_data_ptr<float>();
  p.out = out.mutable_data_ptr();
  p.out_stride_token = out.stride(0);
  p.out_stride_head = out.stride(1);
  p.partial = combine ? static_cast<__nv_bfloat16*>(partial.mutable_data_ptr()) : nullptr;
  p.lse = combine ? lse.mutable_data_ptr<float>() : nullptr;
  p.tokens = static_cast<int>(tokens);
  p.heads = static_cast<int>(heads);
  p.n_idx = static_cast<int>(comp_idx.size(1));
  p.window = static_cast<int>(window);
  p.ring_size = FastDiv(static_cast<uint32_t>(ring_size));
  p.window_keys = static_cast<int>(window_keys);
  p.split_keys = static_cast<int>(split_keys);
  p.splits = static_cast<int>(splits);
  p.cta_heads = static_cast<int>(cta_heads);
  p.cluster_merge = cluster_merge;
  p.scale_log2 = static_cast<float>(scale * M_LOG2E);
  launch(p, c10::cuda::getCurrentCUDAStream(q.get_device()).stream());
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

int64_t cluster_capacity_cuda(int64_t cta_heads, int64_t splits) {
  DSV4_CHECK(cta_heads == 8 || cta_heads == 16 || cta_heads == 64, "cta_heads: expected 8, 16 or 64, got ",
             cta_heads);
  DSV4_CHECK(splits >= 1 && splits <= kMaxClusterSplits, "splits: expected 1 to ", kMaxClusterSplits, ", got ",
             splits);
  return cluster_capacity(static_cast<int>(cta_heads), static_cast<int>(splits));
}

}  // namespace dsv4::sparse_attn
