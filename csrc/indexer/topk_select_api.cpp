// SPDX-License-Identifier: MIT
// Host side of the indexer top-k select: layout checks -> params -> launch on the current stream. The
// values (positions, request slots, block tables, candidate lists) were checked by the op in Python;
// these checks guard the indexing the kernel relies on (dtypes, contiguous rows, the workspace's size).
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <algorithm>
#include <cstdint>

#include "../common/checks.h"
#include "api.h"
#include "params.h"
#include "row_params.h"

namespace dsv4::indexer {

void launch_select(const SelectParams& p, int mode, int tokens, int programs, int threads, int items,
                   cudaStream_t stream);
void launch_grid_select(const GridParams& p, int mode, int tokens, int ctas, bool zeroed, cudaStream_t stream);
int grid_ctas_per_sm(int device);

namespace {

// Checks shared by both selects; returns k.
int64_t check_select(const at::Tensor& positions, const at::Tensor& req_slots, const at::Tensor& block_table,
                     const at::Tensor& cand, const at::Tensor& out, const at::Tensor& workspace, int64_t t0,
                     int64_t tokens, int64_t row_words, int64_t programs, int64_t n_entries, int64_t ratio,
                     int64_t block_size, int64_t cand_block, int64_t mode) {
  for (const auto& [x, name] : {std::pair{&positions, "positions"}, {&req_slots, "req_slots"},
                                {&block_table, "block_table"}, {&cand, "cand"}, {&out, "out"},
                                {&workspace, "workspace"}}) {
    check_int32_rows(*x, out.device(), name);
  }
  DSV4_CHECK_CUDA(out);
  DSV4_CHECK(out.dim() == 2 && block_table.dim() == 2 && cand.dim() == 2, "out / block_table / cand: expected 2-D");
  DSV4_CHECK(tokens >= 0 && t0 >= 0 && t0 + tokens <= positions.numel() && t0 + tokens <= out.size(0) &&
                 positions.numel() == req_slots.numel(),
             "t0 / tokens: expected a range of the step's tokens, got ", t0, " + ", tokens, " of ", out.size(0));
  DSV4_CHECK(workspace.is_contiguous() && workspace.numel() >= tokens * row_words, "workspace: expected ",
             tokens * row_words, " contiguous int32 words, got ", workspace.numel());
  DSV4_CHECK(mode >= kEntries && mode <= kBlocks && programs >= 1 && programs < 65536 && ratio >= 1 &&
                 block_size >= 1 && cand_block >= 1 && n_entries >= 0 && n_entries < (int64_t{1} << 31),
             "mode / programs / ratio / block_size / cand_block / n_entries: out of range");
  return out.size(1);
}

SelectRowParams select_row_params(const at::Tensor& positions, const at::Tensor& req_slots,
                                  const at::Tensor& block_table, const at::Tensor& cand, at::Tensor& out,
                                  at::Tensor& workspace, int64_t t0, int64_t row_words, int64_t keys_at, int64_t n_entries,
                                  int64_t ratio, int64_t block_size, int64_t cand_block, int64_t mode) {
  SelectRowParams p{};
  static_cast<RowParams&>(p) = row_params(positions, req_slots, block_table, cand, workspace, t0, row_words, n_entries,
                                          ratio, block_size, cand_block, mode);
  p.out = out.mutable_data_ptr<int32_t>();
  p.out_stride = out.stride(0);
  p.keys_at = keys_at;
  p.k = static_cast<int>(out.size(1));
  return p;
}

}  // namespace

void topk_select_cuda(const at::Tensor& positions, const at::Tensor& req_slots, const at::Tensor& block_table,
                      const at::Tensor& cand, at::Tensor& out, at::Tensor& workspace, int64_t t0, int64_t tokens,
                      int64_t row_words, int64_t keys_at, int64_t in_at, int64_t out_at, int64_t level,
                      int64_t programs, int64_t n_entries, int64_t ratio, int64_t block_size, int64_t cand_block,
                      int64_t chunk, int64_t group, int64_t mode) {
  const int64_t k = check_select(positions, req_slots, block_table, cand, out, workspace, t0, tokens, row_words,
                                 programs, n_entries, ratio, block_size, cand_block, mode);
  DSV4_CHECK(chunk >= 1 && chunk <= kMaxBlock && (chunk & (chunk - 1)) == 0, "chunk: expected a power of two <= ",
             kMaxBlock, ", got ", chunk);
  DSV4_CHECK(k >= 1 && group >= 1 && group * k <= kMaxBlock, "group x k: expected at most ", kMaxBlock,
             " keys a merge program, got ", group, " x ", k);
  if (tokens == 0) return;
  const int64_t block = level < 0 ? chunk : group * k;
  int64_t keys = 32;  // a power of two: whole warps, and items of 1 .. 16 per thread
  while (keys < block) keys *= 2;
  // A launch of a few CTAs an SM (decode) is latency-bound: 4 keys a thread (up to 16 on 1024
  // threads), so each of the select's ~15 barriers has little work between. A launch of more (a
  // prefill chunk) is throughput-bound: 16 keys a thread, smaller CTAs, more of them resident.
  int sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, out.get_device()));
  const int64_t per_thread = tokens * programs >= 4 * sms ? kMaxItems : 4;
  const int64_t threads = std::min<int64_t>(kMaxThreads, std::max<int64_t>(32, keys / per_thread));

  const c10::cuda::CUDAGuard guard(out.device());
  SelectParams p{};
  static_cast<SelectRowParams&>(p) = select_row_params(positions, req_slots, block_table, cand, out, workspace, t0,
                                                       row_words, keys_at, n_entries, ratio, block_size, cand_block,
                                                       mode);
  p.in_at = in_at;
  p.out_at = out_at;
  p.level = static_cast<int>(level);
  p.chunk = static_cast<int>(chunk);
  p.group = static_cast<int>(group);
  launch_select(p, static_cast<int>(mode), static_cast<int>(tokens), static_cast<int>(programs),
                static_cast<int>(threads), static_cast<int>(keys / threads),
                c10::cuda::getCurrentCUDAStream(out.get_device()).stream());
}

void topk_grid_cuda(const at::Tensor& positions, const at::Tensor& req_slots, const at::Tensor& block_table,
                    const at::Tensor& cand, at::Tensor& out, at::Tensor& workspace, int64_t t0, int64_t tokens,
                    int64_t row_words, int64_t keys_at, int64_t n_row, int64_t ctas, bool zeroed,
                    int64_t n_entries, int64_t ratio, int64_t block_size, int64_t cand_block, int64_t mode) {
  const int64_t k = check_select(positions, req_slots, block_table, cand, out, workspace, t0, tokens, row_words, 1,
                                 n_entries, ratio, block_size, cand_block, mode);
  DSV4_CHECK(k >= 1 && k <= kMaxGridK, "k: expected 1 ..", kMaxGridK, " for the grid select, got ", k);
  DSV4_CHECK(n_row >= 0 && n_row < (int64_t{1} << 31), "n_row: out of range: ", n_row);
  // The row's keys, then its state words (params.h GridParams).
  const int64_t tiles = std::max<int64_t>(1, (n_row + kGridTile - 1) / kGridTile);
  DSV4_CHECK(ctas >= 1 && ctas <= tiles, "ctas: expected 1 .. ", tiles, " CTAs a token (one a tile at most), got ",
             ctas);
  const int64_t zero_words = kGridHead + ctas, state_words = kGridHead + tiles + kGridLevels12 + kGridCand;
  DSV4_CHECK(keys_at >= 0 && keys_at + n_row + state_words <= row_words, "row_words: expected room for ", n_row,
             " keys at ", keys_at, " and ", state_words, " state words, got ", row_words);
  if (tokens == 0) return;
  const c10::cuda::CUDAGuard guard(out.device());
  // Several CTAs a token wait for each other: all must be resident (the cooperative launch fails
  // otherwise; the launcher takes at most 2 CTAs an SM: dsv4ops/indexer/cuda.py grid_ctas).
  if (ctas > 1) {
    int sms = 0;
    C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, out.get_device()));
    const int64_t resident = static_cast<int64_t>(grid_ctas_per_sm(out.get_device())) * sms;
    DSV4_CHECK(tokens * ctas <= resident, "tokens x ctas: ", tokens, " x ", ctas, " CTAs exceed the ", resident,
               " resident CTAs of the GPU");
  }
  GridParams p{};
  static_cast<SelectRowParams&>(p) = select_row_params(positions, req_slots, block_table, cand, out, workspace, t0,
                                                       row_words, keys_at, n_entries, ratio, block_size, cand_block,
                                                       mode);
  p.state_at = keys_at + n_row;
  p.zero_words = static_cast<int>(zero_words);
  launch_grid_select(p, static_cast<int>(mode), static_cast<int>(tokens), static_cast<int>(ctas), zeroed,
                     c10::cuda::getCurrentCUDAStream(out.get_device()).stream());
}

}  // namespace dsv4::indexer
