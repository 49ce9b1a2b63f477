// SPDX-License-Identifier: MIT
// Arguments of the indexer kernels: the top-k selects (topk_select.cu, topk_grid.cu, filled by
// topk_select_api.cpp) and the scoring (score.cu, score_api.cpp).
#pragma once
#include <cstdint>

namespace dsv4::indexer {

// Keys one CTA selects from: 1024 threads x 16 keys in registers. dsv4ops/indexer/workspace.py sizes
// its chunks and merge groups to at most this (CHUNK, MERGE_BLOCK).
constexpr int kMaxThreads = 1024;
constexpr int kMaxItems = 16;
constexpr int kMaxBlock = kMaxThreads * kMaxItems;

// What a selected column becomes in the final row (dsv4ops/indexer/triton.py `_select_block` OUT):
// 0 the global pool slot of entry = column, 1 of entry cand[c / cb] * cb + c % cb, 2 the column.
enum Mode : int { kEntries = 0, kCandidateEntries = 1, kBlocks = 2 };

// A token's workspace row as both kernels see it (rows.cuh), filled by row_params.h.
struct RowParams {
  const int32_t* positions;
  const int32_t* req_slots;
  const int32_t* block_table;
  const int32_t* cand;  // kCandidateEntries only
  int32_t* ws;          // one row of row_words int32 per token of the launch
  int64_t t0;           // first token of the launch (ws row 0)
  int64_t bt_stride, cand_stride, row_words;
  int n_cand, cb, n_entries, ratio, block_size;
};

// What both selects write and read besides the token's row: the final rows, the row's keys, k.
struct SelectRowParams : RowParams {
  int32_t* out;  // [tokens, k] final rows
  int64_t out_stride;
  int64_t keys_at;  // the row's keys (the tree's merge passes: unused)
  int k;
};

struct SelectParams : SelectRowParams {
  int64_t in_at;   // merge pass: the lists it reads; chunk pass: where its lists go
  int64_t out_at;  // merge pass: where its lists go
  int level;       // -1: the chunk pass; >= 0: merge level
  int chunk;       // keys per chunk (a power of two)
  int group;       // lists per merge program
};

// The grid select (topk_grid.cu) of a row of more than one tile. Its state words per token row, at
// state_at: level 0's histogram (2048 bins), the barrier arrivals, the candidate count, the nonzero
// keys' count, a look-back word per CTA (at most one a 4096-key tile; these zeroed by the host before
// a launch of several CTAs a token: zero_words), then level 1's and level 2's histograms (2048 + 1024
// bins, zeroed by the kernel) and a list of kGridCand candidate keys. dsv4ops/indexer/workspace.py
// `grid_words` is the same count (with a word a tile).
constexpr int kGridTile = 4096;      // keys of a tile (8 a thread)
constexpr int kGridCand = 4096;
constexpr int kGridHead = 2051;      // level 0's histogram, barrier arrivals, candidate count, nonzero keys
constexpr int kGridLevels12 = 3072;  // level 1's and level 2's histograms
constexpr int kMaxGridK = 8192;      // the look-back words hold counts below 2^15

struct GridParams : SelectRowParams {
  int64_t state_at;
  int zero_words;  // kGridHead + a look-back word a CTA of the token
};

// Arguments of the scoring kernel (score.cu): V4's fp8_132 key pages (per page: block_size entries of 128
// e4m3 codes, then their block_size fp32 power-of-two scales) with e4m3 queries (the UE8M0 scale of
// each (token, head) folded into its weight by `dsv4::indexer_q_prep`), or (mx) mxfp4_68 key pages
// (block_size rows of 64 B of e2m1 nibbles, then their 4 UE8M0 bytes, the page padded to page_bytes)
// with MX4 queries (68-B rows). The keys go to the start of each token's row.
struct ScoreParams : RowParams {
  const uint8_t* q;  // [tokens, heads, 128] e4m3 codes, or (mx) [tokens, heads, 68] MX4 rows
  const float* w;    // [tokens, heads]
  const uint8_t* cache;
  int64_t q_stride, q_head_stride, w_stride;
  int64_t page_bytes;
  int64_t zero_at;  // words [zero_at, zero_at + zero_words) of each row are zeroed: the grid select's
  int zero_words;   // first state words (GridParams), which then needs no memset of its own
  int heads;
  bool mx;
};

}  // namespace dsv4::indexer
