// SPDX-License-Identifier: MIT
// Host side of the indexer scoring kernel: layout checks -> params -> launch on the current stream. The
// values (positions, request slots, block tables, candidate lists) were checked by the op in Python;
// these checks guard what the kernel's addressing relies on (dtypes, 16-B aligned rows, sizes).
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>

#include "../common/checks.h"
#include "api.h"
#include "mx4.cuh"
#include "params.h"
#include "row_params.h"

namespace dsv4::indexer {

void launch_score(const ScoreParams& p, int mode, int tokens, int programs, cudaStream_t stream);

namespace {

bool aligned16(const at::Tensor& x) { return reinterpret_cast<uintptr_t>(x.const_data_ptr()) % 16 == 0; }

}  // namespace

void topk_score_cuda(const at::Tensor& q, const at::Tensor& weights, const at::Tensor& positions,
                     const at::Tensor& req_slots, const at::Tensor& cache, const at::Tensor& block_table,
                     const at::Tensor& cand, at::Tensor& workspace, int64_t t0, int64_t tokens, int64_t row_words,
                     int64_t programs, int64_t n_entries, int64_t ratio, int64_t block_size, int64_t page_bytes,
                     int64_t cand_block, int64_t mode, int64_t zero_at, int64_t zero_words) {
  DSV4_CHECK_CUDA(q);
  for (const auto& [x, name] : {std::pair{&weights, "weights"}, {&cache, "cache"}}) {
    DSV4_CHECK(x->device() == q.device(), name, ": expected a tensor on ", q.device(), ", got ", x->device());
  }
  for (const auto& [x, name] : {std::pair{&positions, "positions"}, {&req_slots, "req_slots"},
                                {&block_table, "block_table"}, {&cand, "cand"}, {&workspace, "workspace"}}) {
    check_int32_rows(*x, q.device(), name);
  }
  // fp8_132 keys with e4m3 queries [tokens, heads, 128], or mxfp4_68 keys with MX4 queries [tokens, heads, 68]
  // (uint8, at most 32 heads: score.cu keeps their group scales in registers).
  const bool mx = q.scalar_type() == at::kByte;
  DSV4_CHECK((mx ? q.size(2) == kMxData + kMxScale && q.stride(1) % 4 == 0 && q.size(1) <= 32
                 : q.scalar_type() == at::kFloat8_e4m3fn && q.size(2) == 128 && q.stride(1) % 16 == 0 &&
                       q.size(1) <= 128) &&
                 q.dim() == 3 && q.stride(2) == 1 && q.stride(0) % 4 == 0 && aligned16(q) && q.size(1) >= 1,
             "q: expected e4m3 [tokens, 1..128 heads, 128] with 16-B aligned rows or uint8 MX4 rows [tokens, "
             "1..32 heads, 68], got ", q.scalar_type(), " ", q.sizes());
  DSV4_CHECK(weights.scalar_type() == at::kFloat && weights.dim() == 2 && weights.size(1) == q.size(1) &&
                 weights.stride(1) == 1,
             "weights: expected float32 [tokens, heads] with contiguous heads, got ", weights.scalar_type(), " ",
             weights.sizes());
  DSV4_CHECK(cache.scalar_type() == at::kByte && cache.is_contiguous() && aligned16(cache),
             "cache: expected a contiguous 16-B aligned uint8 pool, got ", cache.scalar_type());
  DSV4_CHECK(block_table.dim() == 2 && cand.dim() == 2, "block_table / cand: expected 2-D");
  DSV4_CHECK(tokens >= 0 && t0 >= 0 && t0 + tokens <= q.size(0) && t0 + tokens <= weights.size(0) &&
                 t0 + tokens <= positions.numel() && positions.numel() == req_slots.numel(),
             "t0 / tokens: expected a range of the step's tokens, got ", t0, " + ", tokens, " of ", q.size(0));
  DSV4_CHECK(workspace.is_contiguous() && workspace.numel() >= tokens * row_words, "workspace: expected ",
             tokens * row_words, " contiguous int32 words, got ", workspace.numel());
  // 16-B aligned entry rows: an fp8_132 page is block_size x 132 B (a multiple of 4 entries); an
  // mxfp4_68 page is block_size x 68 B padded to a multiple of 512 (dsv4ops/quant/formats.py), its
  // 64-B rows and 4-B scales aligned for any block_size.
  const int64_t row_bytes = mx ? kMxData + kMxScale : 132;
  DSV4_CHECK(block_size >= 1 && (mx || block_size % 4 == 0) && n_entries >= 0 && n_entries < (int64_t{1} << 31) &&
                 block_table.size(1) * block_size >= n_entries && page_bytes >= block_size * row_bytes &&
                 page_bytes % 16 == 0 && cache.numel() % page_bytes == 0,
             "block_size / page_bytes / n_entries: expected a multiple of 4 entries an fp8_132 page, whole pages and a "
             "table covering n_entries, got ", block_size, ", ", page_bytes, " and ", n_entries);
  DSV4_CHECK((mode == kEntries || mode == kCandidateEntries) && programs >= 1 && programs < 65536 && ratio >= 1 &&
                 cand_block >= 1,
             "mode / programs / ratio / cand_block: out of range");
  const int64_t columns = mode == kCandidateEntries ? cand.size(1) * cand_block : n_entries;
  DSV4_CHECK(row_words >= columns, "row_words: expected room for a row of ", columns, " keys, got ", row_words);
  DSV4_CHECK(zero_at >= columns && zero_words >= 0 && zero_at + zero_words <= row_words, "zero_at / zero_words: ",
             "expected words after the row's keys and within its ", row_words, ", got ", zero_at, " + ", zero_words);
  if (tokens == 0) return;
  const c10::cuda::CUDAGuard guard(q.device());
  ScoreParams p{};
  static_cast<RowParams&>(p) = row_params(positions, req_slots, block_table, cand, workspace, t0, row_words, n_entries,
                                          ratio, block_size, cand_block, mode);
  p.q = static_cast<const uint8_t*>(q.const_data_ptr());
  p.w = weights.const_data_ptr<float>();
  p.cache = cache.const_data_ptr<uint8_t>();
  p.q_stride = q.stride(0);
  p.q_head_stride = q.stride(1);
  p.w_stride = weights.stride(0);
  p.zero_at = zero_at;
  p.zero_words = static_cast<int>(zero_words);
  p.heads = static_cast<int>(q.size(1));
  p.page_bytes = page_bytes;
  p.mx = mx;
  launch_score(p, static_cast<int>(mode), static_cast<int>(tokens), static_cast<int>(programs),
               c10::cuda::getCurrentCUDAStream(q.get_device()).stream());
}

}  // namespace dsv4::indexer
