// SPDX-License-Identifier: MIT
// Launch parameters of the sm_90 `dsv4::sparse_attn` kernel (byte pools of rows.cuh, bf16 q / out).
#pragma once
#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

namespace dsv4::sparse_attn {

// n / d for 0 <= n < 2^31 as a multiply-high, an add and a shift (Granlund & Montgomery's round-up
// method; n + hi stays below 2^32): the integer division it replaces took ~15 instructions in every
// key's address math (ring position, page of a slot).
struct FastDiv {
  uint32_t d = 1, mul = 1, shift = 0;
  FastDiv() = default;
  explicit FastDiv(uint32_t divisor) : d(divisor) {
    while ((uint64_t{1} << shift) < d) ++shift;
    mul = static_cast<uint32_t>((uint64_t{1} << 32) * ((uint64_t{1} << shift) - d) / d + 1);
  }
#ifdef __CUDACC__
  __device__ __forceinline__ uint32_t div(uint32_t n) const { return (__umulhi(n, mul) + n) >> shift; }
#endif
};

// Splits a token's cluster may hold: a portable cluster's CTAs. More splits keep the combine kernel.
constexpr int kMaxClusterSplits = 8;

struct Params {
  const void* q;  // [tokens, heads, 512] bf16, last dim contiguous
  int64_t q_stride_token, q_stride_head;
  const uint8_t* window_cache;  // paged byte pools (dsv4ops/quant/formats.py)
  const uint8_t* comp_cache;
  int window_fmt, comp_fmt;      // their rows.cuh RowFormat codes
  int64_t window_page_bytes, comp_page_bytes;
  FastDiv window_block, comp_block;  // entries per page
  const int32_t* window_ends;    // [tokens]: the last window position of each query
  const int32_t* req_slots;      // [tokens]: -1 = padding token
  const int32_t* comp_idx;       // [tokens, n_idx]: global comp_cache slots, -1 = none
  int64_t comp_idx_stride;
  const int32_t* comp_lens;  // [tokens]: columns of comp_idx listed
  const float* sinks;        // [heads]
  void* out;                 // [tokens, heads, 512] bf16, last dim contiguous
  int64_t out_stride_token, out_stride_head;
  __nv_bfloat16* partial;  // [tokens * splits * heads, 512] bf16 (splits > 1): each split's normalized output
  float* lse;  // [tokens * splits * heads] log2 of each split's softmax sum (splits > 1)
  int tokens, heads, n_idx, window;
  FastDiv ring_size;
  int window_keys;  // window rounded up to whole 32-key units: a producer unit is all window or all entries
  int split_keys;   // keys of the list [window | entries] per split, a whole number of tiles
  int splits;
  int cta_heads;     // heads per CTA: 64 (sparse_attn.cu) or 8 / 16 (small_heads.cu)
  int cluster_merge; // a token's 2 to 8 splits are one cluster and merge in the kernel (cluster_merge.cuh)
  float scale_log2;  // softmax scale x log2(e)
};

bool serves_formats(int window_fmt, int comp_fmt);
// Clusters of `splits` CTAs of the kernel with `cta_heads` heads a CTA that the device holds at once.
int cluster_capacity(int cta_heads, int splits);
int cluster_capacity_small(int cta_heads, int splits);  // small_heads.cu
// The main kernel, then (p.splits > 1, unless p.cluster_merge) the merge of the splits' partials.
void launch(const Params& p, cudaStream_t stream);
void launch_small_heads(const Params& p, cudaStream_t stream);  // small_heads.cu: the same for 8 / 16 heads
void launch_combine(const Params& p, cudaStream_t stream);      // combine.cu

}  // namespace dsv4::sparse_attn
