// SPDX-License-Identifier: MIT
// sm_90 scoring kernel of `dsv4::indexer_topk` for V4's fp8_132 key pages with e4m3 queries and for
// V4.1's mxfp4_68 key pages with MX4 queries (mx4.cuh; the specification is
// dsv4ops/indexer/reference.py; dsv4ops/indexer/triton.py `_score_kernel` serves every other case). It
// writes each scored column's uint32 key (ordered like the score, 0 = no entry) into the token's
// workspace row, for the select of topk_select.cu.
//
// CTA (token, g) of one warpgroup scores the token's 64-column tiles g, g + G, ...: score = sum_h w_h
// relu(q_h . k_e scale_e) of the column's entry e. The 132-B entries are gathered through the block
// table by cp.async into a 4-stage ring (three tiles in flight while the tensor cores work on one):
// the Triton kernel this replaces issued each tile's gather only when it needed the tile, and ran
// the paged key read at 1.41 TB/s (H100, 128 tokens x 64K context, 277 MB; ncu: DRAM 38% busy, 25.6%
// occupancy); this kernel reads it at 2.43 TB/s (114 us, 81% of the 3.0 TB/s copy ceiling).
// S = K Q^T is one m64nNk32 e4m3 wgmma chain (entries x heads, K = 128 in four steps) from shared
// memory, both operands K-major with the 128-B swizzle; the head sum stays inside each quad of lanes
// (the accumulator's row layout). MXFP4 (kMx): the 68-B rows land raw; each thread converts the
// nibbles of its A fragments (the m16n8k32 layout: rows lane / 4 and + 8, k 4 (lane % 4) .. + 3 and
// + 16) to e4m3 in registers, and each scale group is its own k32 wgmma into its own accumulator
// (mx4.cuh), the query converted once into the shared B tile with its group scales folded into its
// codes where that is exact (load_query_mx), which leaves one scale a group of the key to apply.
#include <c10/cuda/CUDAException.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "../common/pdl.cuh"
#include "../common/sm90.cuh"
#include "mx4.cuh"
#include "params.h"
#include "rows.cuh"

namespace dsv4::indexer {
namespace {

constexpr int kTile = 64;  // columns a tile: the wgmma's M
constexpr int kThreads = 128;
constexpr int kStages = 4;     // fp8_132: 4 tiles of 8.4 KB in flight a CTA, 5 CTAs an SM
constexpr int kMxStages = 11;  // mxfp4_68: tiles of 4.4 KB, 4 CTAs an SM (53 KiB each): as many bytes in flight
constexpr int kDim = 128;  // elements of a row = the dot's K = bytes of its e4m3 codes

template <int kN>
struct ScoreSmem {
  alignas(1024) uint8_t k[kStages][kTile * kDim];  // 32 KiB of swizzled key rows
  alignas(1024) uint8_t q[kN * kDim];             // the token's query, kN heads (zero-padded)
  float scale[kStages][kTile];
  uint8_t valid[kStages][kTile];
};
// kMx: raw 68-B rows (nibbles, then the 4 scale bytes as one word), the query as e4m3 codes and its
// group scales.
template <int kN>
struct MxSmem {
  alignas(1024) uint8_t q[kN * kDim];
  alignas(16) uint8_t k[kMxStages][kTile * kMxData];
  uint32_t scale[kMxStages][kTile];
  uint8_t valid[kMxStages][kTile];
  alignas(16) float q_scale[kN][kMxGroups];
  uint32_t q_max[kN];  // each head's largest scale byte
};
template <int kN, bool kMx>
using Smem = std::conditional_t<kMx, MxSmem<kN>, ScoreSmem<kN>>;

#ifdef DSV4_SM90_BODY
using namespace ::dsv4::sm90;

// d[64 x kN] += A[64 x 32] B[32 x kN], e4m3 x e4m3 -> fp32, A and B in shared memory, K-major.
template <int kN>
__device__ __forceinline__ void wgmma_fp8(float (&d)[kN / 2], uint64_t a, uint64_t b);
template <>
__device__ __forceinline__ void wgmma_fp8<16>(float (&d)[8], uint64_t a, uint64_t b) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, 1, 1, 1;\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
      : "l"(a), "l"(b));
}
template <>
__device__ __forceinline__ void wgmma_fp8<32>(float (&d)[16], uint64_t a, uint64_t b) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, %16, %17, 1, 1, 1;\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "l"(a), "l"(b));
}
template <>
__device__ __forceinline__ void wgmma_fp8<64>(float (&d)[32], uint64_t a, uint64_t b) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n64k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31}, %32, %33, 1, 1, 1;\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(a), "l"(b));
}
template <>
__device__ __forceinline__ void wgmma_fp8<128>(float (&d)[64], uint64_t a, uint64_t b) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n128k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, %64, %65, 1, 1, 1;\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "l"(a), "l"(b));
}

// d[64 x kN] = A[64 x 32] B[32 x kN], e4m3 x e4m3 -> fp32, A from registers (the m16n8k32 A layout
// per warp), B in shared memory, K-major. The accumulator is overwritten (scale-d false).
template <int kN>
__device__ __forceinline__ void wgmma_fp8_rs(float (&d)[kN / 2], const uint32_t (&a)[4], uint64_t b);
template <>
__device__ __forceinline__ void wgmma_fp8_rs<16>(float (&d)[8], const uint32_t (&a)[4], uint64_t b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %13, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n16k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7}, {%8, %9, %10, %11}, %12, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(0));
}
template <>
__device__ __forceinline__ void wgmma_fp8_rs<32>(float (&d)[16], const uint32_t (&a)[4], uint64_t b) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %21, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n32k32.f32.e4m3.e4m3 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15}, {%16, %17, %18, %19}, %20, p, 1, 1;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "r"(0));
}

// uint32 key ordered like the fp32 score, -0.0 == +0.0; 0 is never a score's key (triton.py `_key_of`).
__device__ __forceinline__ int32_t key_of(float s) {
  const uint32_t bits = s == 0.f ? 0u : __float_as_uint(s);
  return static_cast<int32_t>(bits ^ (static_cast<uint32_t>(static_cast<int32_t>(bits) >> 31) | 0x80000000u));
}
#endif  // DSV4_SM90_BODY

#ifdef DSV4_SM90_BODY
// The query of token t into sm.q as e4m3 codes, K-major with the 128-B swizzle (rows of heads past the
// last: zeros).
template <int kN>
__device__ __forceinline__ void load_query(ScoreSmem<kN>& sm, const ScoreParams& p, int64_t t, int tid) {
  const uint8_t* q = p.q + t * p.q_stride;
  for (int i = tid; i < kN * 8; i += kThreads) {
    const int h = i >> 3, chunk = i & 7;
    const uint4 v = h < p.heads ? *reinterpret_cast<const uint4*>(q + h * p.q_head_stride + chunk * 16)
                                : make_uint4(0, 0, 0, 0);
    *reinterpret_cast<uint4*>(sm.q + h * kDim + ((chunk ^ (h & 7)) << 4)) = v;
  }
}

// The MX4 query of token t (68-B rows: 64 B of nibbles, 4 UE8M0 bytes) into sm.q as e4m3 codes. Each
// head's groups are scaled by 2^(e_g - e_max) into the codes (the fold) when that is exact for every
// head: e4m3 holds e2m1 x 2^d exactly for d >= -8 (subnormals included), so a group of nonzero codes
// more than 8 binades below its head's largest keeps the CTA on the unfolded codes and per-group
// scales. Returns whether the fold holds; sm.q_scale holds 2^(e_max - 127) of each head in column 0
// (folded) or 2^(e_g - 127) of each group (not).
template <int kN>
__device__ __forceinline__ bool load_query_mx(MxSmem<kN>& sm, const ScoreParams& p, int64_t t, int tid) {
  const uint8_t* q = p.q + t * p.q_stride;
  bool unfoldable = false;
  if (tid < kN) {  // a head a thread (kN <= 32): its largest scale byte, and whether the fold is exact
    uint32_t e_max = 0, scales = 0;
    if (tid < p.heads) {
      const uint8_t* row = q + tid * p.q_head_stride;
      scales = *reinterpret_cast<const uint32_t*>(row + kMxData);  // 68-B rows: 4-B aligned
#pragma unroll
      for (int g = 0; g < kMxGroups; ++g) e_max = max(e_max, (scales >> (8 * g)) & 0xffu);
#pragma unroll
      for (int g = 0; g < kMxGroups; ++g) {
        const auto* w = reinterpret_cast<const uint32_t*>(row + 16 * g);
        const bool nonzero = ((w[0] | w[1] | w[2] | w[3]) & 0x77777777u) != 0;
        unfoldable |= nonzero && ((scales >> (8 * g)) & 0xffu) + 8 < e_max;
      }
    }
    sm.q_max[tid] = e_max;
  }
  const bool fold = !__syncthreads_or(unfoldable);
  for (int i = tid; i < kN * 8; i += kThreads) {
    const int h = i >> 3, chunk = i & 7;  // 16 codes of group chunk / 2
    uint4 v = make_uint4(0, 0, 0, 0);
    if (h < p.heads) {
      const uint8_t* row = q + h * p.q_head_stride;
      const auto* codes = reinterpret_cast<const uint32_t*>(row + chunk * 8);
      const uint32_t c0 = codes[0], c1 = codes[1];
      uint32_t out[4] = {e2m1x4_to_e4m3x4(c0), e2m1x4_to_e4m3x4(c0 >> 16), e2m1x4_to_e4m3x4(c1),
                         e2m1x4_to_e4m3x4(c1 >> 16)};
      const int d = fold ? static_cast<int>(row[kMxData + chunk / 2]) - static_cast<int>(sm.q_max[h]) : 0;
      if (d != 0) {  // exact (d >= -8): each code's value times 2^d, back to e4m3
        const float scale = exp2f(static_cast<float>(d));
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          uint32_t shifted = 0;
#pragma unroll
          for (int b = 0; b < 4; ++b) {
            const __half_raw hr =
                __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(out[k] >> (8 * b)), __NV_E4M3);
            const float x = __half2float(*reinterpret_cast<const __half*>(&hr)) * scale;
            shifted |= static_cast<uint32_t>(__nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3)) << (8 * b);
          }
          out[k] = shifted;
        }
      }
      v = make_uint4(out[0], out[1], out[2], out[3]);
    }
    *reinterpret_cast<uint4*>(sm.q + h * kDim + ((chunk ^ (h & 7)) << 4)) = v;
  }
  for (int i = tid; i < kN * kMxGroups; i += kThreads) {
    const int h = i / kMxGroups, g = i % kMxGroups;
    if (h < p.heads) {
      sm.q_scale[h][g] = ue8m0_value(fold ? (g ? 0u : sm.q_max[h]) : q[h * p.q_head_stride + kMxData + g]);
    } else {
      sm.q_scale[h][g] = 0.f;
    }
  }
  return fold;
}

// The A fragment of scale group g of raw nibble row `row` (the m16n8k32 layout: k 4 (lane % 4) .. + 3,
// nibble bytes 16 g + 2 (lane % 4) and + 1, into `lo`; the same k + 16, 8 bytes on, into `hi`).
// `pick`: PRMT selectors of this lane's two bytes (see `fragment_selectors`).
__device__ __forceinline__ void mx_fragment(uint32_t& lo, uint32_t& hi, const uint8_t* row, int g, uint2 pick) {
  const uint4 w = *reinterpret_cast<const uint4*>(row + 16 * g);
  lo = e2m1x4_to_e4m3x4(__byte_perm(w.x, w.y, pick.x), __byte_perm(w.x, w.y, pick.y));
  hi = e2m1x4_to_e4m3x4(__byte_perm(w.z, w.w, pick.x), __byte_perm(w.z, w.w, pick.y));
}
// Selectors of bytes 2 quad (b) and 2 quad + 1 (b') of 8: x = [b, b'] (the four nibbles) and
// y = [b, b, b', b'] (each nibble's sign bit one move from its e4m3 byte's).
__device__ __forceinline__ uint2 fragment_selectors(int quad) {
  const uint32_t b = 2 * quad, b1 = b + 1;
  return make_uint2(b | b1 << 4, b | b << 4 | b1 << 8 | b1 << 12);
}
#endif  // DSV4_SM90_BODY

template <int kN, bool kCand, bool kMx>
__global__ void __launch_bounds__(kThreads) topk_score_kernel(const __grid_constant__ ScoreParams p) {
#ifdef DSV4_SM90_BODY
  static_assert(!kMx || kN <= 32, "MX4 scoring keeps a (head, group) scale a lane in registers: <= 32 heads");
  extern __shared__ __align__(1024) uint8_t smem[];
  auto& sm = *reinterpret_cast<Smem<kN, kMx>*>(smem);
  // The queries, weights and workspace belong to the kernels before this one. No early trigger for
  // the select: its CTAs, resident beside the scoring's, doubled up on the few SMs with room (H100,
  // V4-Flash, whole indexer_topk, early trigger / none: 128 x 64K 147.9 / 140.4 us, 1 x 4K 8.8 / 9.0).
  pdl::wait_prior_grid();
  const int tid = threadIdx.x, warp = tid >> 5, lane = tid & 31;
  const int64_t tc = blockIdx.x, t = p.t0 + tc;
  int req;
  const int n = row_columns(p, t, kCand ? kCandidateEntries : kEntries, req);
  if (blockIdx.y == 0) {
    int32_t* zero = p.ws + tc * p.row_words + p.zero_at;
    for (int i = tid; i < p.zero_words; i += kThreads) zero[i] = 0;
  }
  const int first = blockIdx.y * kTile, step = gridDim.y * kTile;
  if (first >= n) return;
  const int tiles = (n - first + step - 1) / step;
  const int n_vis = visible_entries(p, t, req);

  // The gather of tile i: thread tid fetches half of row tid / 2 (fp8_132: 4 of its 8 16-B chunks
  // and, for the even thread, the entry's scale; mxfp4_68: 2 of 4 chunks and the scale word). A
  // column without a visible, allocated entry fetches nothing and is marked invalid (its key is 0
  // whatever its rows of S hold). The row's entry is located (candidate list, block table) one tile
  // before its gather is issued: with the page number used right after its load, that L2 round trip
  // was the kernel's top stall (H200, 128 x 64K: 13.7% of the samples) and sat in every tile's
  // critical path.
  const int row = tid >> 1, half = tid & 1;
  constexpr int kData = kMx ? kMxData : kDim;  // bytes of a slot in the page's data plane
  constexpr int kRing = kMx ? kMxStages : kStages;
  const int bs_shift = (p.block_size & (p.block_size - 1)) == 0 ? __ffs(p.block_size) - 1 : -1;
  struct Source {
    int blk;  // the entry's page; -1: no entry
    int at;   // its row in the page
  };
  auto locate = [&](int i) -> Source {
    const int c = first + i * step + row;
    int e = c;
    bool vis = i < tiles && c < n;
    if constexpr (kCand) {
      const int cblk = vis ? p.cand[t * p.cand_stride + c / p.cb] : -1;
      e = cblk * p.cb + c % p.cb;
      vis = vis && cblk >= 0 && e < n_vis;
    }
    // Shifts for a power-of-two page (V4: 64 entries): integer division was ~40 instructions a row.
    const int page = bs_shift >= 0 ? e >> bs_shift : e / p.block_size;
    const int at = bs_shift >= 0 ? e & (p.block_size - 1) : e % p.block_size;
    return {vis ? p.block_table[req * p.bt_stride + page] : -1, at};
  };
  // The loaded page number is first used here, a tile after its load was issued.
  auto issue = [&](int i, Source src) {
    if (i < tiles) {
      const int stage = i % kRing;
      if (src.blk >= 0) {
        const uint8_t* page = p.cache + src.blk * p.page_bytes;
        const uint8_t* data = page + src.at * kData;
        const uint8_t* scale = page + p.block_size * kData + src.at * 4;
        if constexpr (kMx) {
          const uint32_t dst = smem_addr(sm.k[stage]) + row * kMxData;
          cp_async16(dst + half * 32, data + half * 32);
          cp_async16(dst + half * 32 + 16, data + half * 32 + 16);
        } else {
          const uint32_t dst = smem_addr(sm.k[stage]) + row * kDim;
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const int chunk = half * 4 + j;
            cp_async16(dst + ((chunk ^ (row & 7)) << 4), data + chunk * 16);
          }
        }
        if (half == 0) cp_async4(smem_addr(&sm.scale[stage][row]), scale);
      }
      if (half == 0) sm.valid[stage][row] = src.blk >= 0;
    }
    cp_commit();  // one group a tile, empty ones too: cp_wait counts groups
  };
  Source next = locate(0);
  for (int i = 0; i < kRing - 1; ++i) {
    issue(i, next);
    next = locate(i + 1);
  }

  bool fold = false;  // kMx: the query's group scales are in its codes (load_query_mx)
  if constexpr (kMx) {
    fold = load_query_mx(sm, p, t, tid);
  } else {
    load_query(sm, p, t, tid);
  }
  // The accumulator's layout: lane holds rows warp * 16 + lane / 4 (+ 8) and, of each 8 columns
  // (heads) j, the two at 8 j + 2 (lane % 4).
  float w[kN / 4];
#pragma unroll
  for (int j = 0; j < kN / 8; ++j) {
#pragma unroll
    for (int b = 0; b < 2; ++b) {
      const int h = 8 * j + 2 * (lane & 3) + b;
      w[2 * j + b] = h < p.heads ? p.w[t * p.w_stride + h] : 0.f;
    }
  }
  const uint64_t q_desc = descriptor(smem_addr(sm.q), 16, 1024);
  int32_t* out = p.ws + tc * p.row_words;
  const int r = warp * 16 + (lane >> 2), quad = lane & 3;
  const uint2 pick = fragment_selectors(lane & 3);
  for (int i = 0; i < tiles; ++i) {
    cp_wait<kRing - 2>();  // tile i has landed (this thread's part)
    fence_async_shared();
    __syncthreads();  // every part of tile i; every thread is done with tile i - 1's stage
    issue(i + kRing - 1, next);
    next = locate(i + kRing);
    const int stage = i % kRing;
    float a0 = 0.f, a1 = 0.f;
    if constexpr (kMx) {
      if (i == 0 && fold) {  // sm.q_scale is visible: the loop's barrier passed
#pragma unroll
        for (int j = 0; j < kN / 8; ++j) {
#pragma unroll
          for (int b = 0; b < 2; ++b) w[2 * j + b] *= sm.q_scale[8 * j + 2 * quad + b][0];
        }
      }
      // S_g = K_g Q_g^T for each scale group g, then s = sum_g S_g 2^(ek_rg) (x 2^(eq_hg) unless folded):
      // exact products of powers of two.
      float d[kMxGroups][kN / 2];
      uint32_t frag[kMxGroups][4];
      const uint8_t* row0 = sm.k[stage] + r * kMxData;
#pragma unroll
      for (int g = 0; g < kMxGroups; ++g) {
        mx_fragment(frag[g][0], frag[g][2], row0, g, pick);
        mx_fragment(frag[g][1], frag[g][3], row0 + 8 * kMxData, g, pick);
      }
      wgmma_fence();
#pragma unroll
      for (int g = 0; g < kMxGroups; ++g) wgmma_fp8_rs<kN>(d[g], frag[g], advance(q_desc, g * 32));
      wgmma_commit();
      wgmma_wait();
#pragma unroll
      for (int g = 0; g < kMxGroups; ++g) fence_registers(d[g]);
      const uint32_t sw0 = sm.scale[stage][r], sw8 = sm.scale[stage][r + 8];
      float k0[kMxGroups], k8[kMxGroups];
#pragma unroll
      for (int g = 0; g < kMxGroups; ++g) {
        k0[g] = ue8m0_value((sw0 >> (8 * g)) & 0xff);
        k8[g] = ue8m0_value((sw8 >> (8 * g)) & 0xff);
      }
      if (fold) {
#pragma unroll
        for (int j = 0; j < kN / 8; ++j) {
#pragma unroll
          for (int b = 0; b < 2; ++b) {
            float s0 = d[0][4 * j + b] * k0[0], s8 = d[0][4 * j + 2 + b] * k8[0];
#pragma unroll
            for (int g = 1; g < kMxGroups; ++g) {
              s0 = fmaf(d[g][4 * j + b], k0[g], s0);
              s8 = fmaf(d[g][4 * j + 2 + b], k8[g], s8);
            }
            a0 = fmaf(fmaxf(s0, 0.f), w[2 * j + b], a0);
            a1 = fmaf(fmaxf(s8, 0.f), w[2 * j + b], a1);
          }
        }
      } else {  // the query's group scales from shared memory (the rare CTA: registers stay the fold's)
#pragma unroll
        for (int j = 0; j < kN / 8; ++j) {
#pragma unroll
          for (int b = 0; b < 2; ++b) {
            const float4 qv = *reinterpret_cast<const float4*>(sm.q_scale[8 * j + 2 * quad + b]);
            const float qs[kMxGroups] = {qv.x, qv.y, qv.z, qv.w};
            float s0 = 0.f, s8 = 0.f;
#pragma unroll
            for (int g = 0; g < kMxGroups; ++g) {
              s0 = fmaf(d[g][4 * j + b], qs[g] * k0[g], s0);
              s8 = fmaf(d[g][4 * j + 2 + b], qs[g] * k8[g], s8);
            }
            a0 = fmaf(fmaxf(s0, 0.f), w[2 * j + b], a0);
            a1 = fmaf(fmaxf(s8, 0.f), w[2 * j + b], a1);
          }
        }
      }
#pragma unroll
      for (int o = 1; o < 4; o *= 2) {
        a0 += __shfl_xor_sync(0xffffffffu, a0, o);
        a1 += __shfl_xor_sync(0xffffffffu, a1, o);
      }
    } else {
      float d[kN / 2];
#pragma unroll
      for (int x = 0; x < kN / 2; ++x) d[x] = 0.f;
      wgmma_fence();
      const uint64_t k_desc = descriptor(smem_addr(sm.k[stage]), 16, 1024);
#pragma unroll
      for (int kk = 0; kk < 4; ++kk) wgmma_fp8<kN>(d, advance(k_desc, kk * 32), advance(q_desc, kk * 32));
      wgmma_commit();
      wgmma_wait();
      fence_registers(d);
      // relu(d s) = relu(d) s for the entry's power-of-two scale s > 0 (exact), so s multiplies the
      // row's sum once: two instructions an element (max, fma) instead of three.
#pragma unroll
      for (int j = 0; j < kN / 8; ++j) {
        a0 = fmaf(fmaxf(d[4 * j], 0.f), w[2 * j], a0);
        a0 = fmaf(fmaxf(d[4 * j + 1], 0.f), w[2 * j + 1], a0);
        a1 = fmaf(fmaxf(d[4 * j + 2], 0.f), w[2 * j], a1);
        a1 = fmaf(fmaxf(d[4 * j + 3], 0.f), w[2 * j + 1], a1);
      }
#pragma unroll
      for (int o = 1; o < 4; o *= 2) {
        a0 += __shfl_xor_sync(0xffffffffu, a0, o);
        a1 += __shfl_xor_sync(0xffffffffu, a1, o);
      }
      a0 *= sm.scale[stage][r];
      a1 *= sm.scale[stage][r + 8];
    }
    if (quad < 2) {  // lane 4 m writes row r, lane 4 m + 1 row r + 8
      const int rr = r + 8 * quad, c = first + i * step + rr;
      if (c < n) out[c] = sm.valid[stage][rr] ? key_of(quad ? a1 : a0) : 0;
    }
  }
#else
  __trap();
#endif
}

template <int kN, bool kCand, bool kMx>
void launch_with(const ScoreParams& p, dim3 grid, cudaStream_t stream) {
  constexpr int bytes = static_cast<int>(sizeof(Smem<kN, kMx>));
  // Per call (a host-side attribute): the opt-in above 48 KiB (kN = 128) is per device.
  cudaFuncSetAttribute(topk_score_kernel<kN, kCand, kMx>, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  pdl::launch_pdl(topk_score_kernel<kN, kCand, kMx>, grid, dim3(kThreads), bytes, stream, p);  // common/pdl.cuh
}

template <bool kCand>
void launch_heads(const ScoreParams& p, dim3 grid, cudaStream_t stream) {
  if (p.mx) {
    if (p.heads <= 16) {
      launch_with<16, kCand, true>(p, grid, stream);
    } else {
      launch_with<32, kCand, true>(p, grid, stream);
    }
  } else if (p.heads <= 16) {
    launch_with<16, kCand, false>(p, grid, stream);
  } else if (p.heads <= 32) {
    launch_with<32, kCand, false>(p, grid, stream);
  } else if (p.heads <= 64) {
    launch_with<64, kCand, false>(p, grid, stream);
  } else {
    launch_with<128, kCand, false>(p, grid, stream);
  }
}

}  // namespace

void launch_score(const ScoreParams& p, int mode, int tokens, int programs, cudaStream_t stream) {
  const dim3 grid(tokens, programs);
  if (mode == kCandidateEntries) {
    launch_heads<true>(p, grid, stream);
  } else {
    launch_heads<false>(p, grid, stream);
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace dsv4::indexer
