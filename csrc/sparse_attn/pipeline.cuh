// SPDX-License-Identifier: MIT
// What the two sm_90 sparse_attn kernels share (sparse_attn.cu: 64 heads a CTA; small_heads.cu: 8, 16
// or 32): the producer warpgroups that gather a token's keys from the byte pools and dequantize them
// into bf16 key tiles, the named barriers that hand those tiles to the consumer warpgroups, and the
// bf16 wgmma with both operands in shared memory.
//
// The producers work in units of 32 keys (kKeys): a unit's raw rows land in a ring of kStages raw
// stages, kStages - 1 units ahead, and are dequantized (exactly, rows.cuh) into part `u % kUnits` of
// bf16 tile `(u / kUnits) % kBufs` of a ring of kBufs, so a consumer tile holds 32 x kUnits keys. A
// unit is all window or all entries (the window is rounded up to whole units), so each unit has one
// format.
#pragma once
#include <cuda_bf16.h>

#include <cstdint>

#include "../common/sm90.cuh"
#include "params.h"
#include "rows.cuh"

namespace dsv4::sparse_attn {

constexpr int kDim = 512;                // head dim
constexpr int kKeys = 32;                // keys of a producer unit
constexpr int kConsumers = 256;          // warps 0-7: two consumer warpgroups
constexpr int kProducers = 256;          // warps 8-15: the gather and dequantization
constexpr int kThreads = kConsumers + kProducers;
[[maybe_unused]] constexpr int kKeyLanes = kProducers / kKeys;  // producer threads per key
// setmaxnreg moves registers within the CTA's own allocation (128 x 512 at launch), so 64 + 192 =
// 2 x 128: asking for more than the producers gave back blocks the consumers for good.
[[maybe_unused]] constexpr int kProducerRegs = 64, kConsumerRegs = 192;
constexpr int kRawRow = 592;  // raw row in shared memory: the largest, fp8_584's 576 + 8, + 8 pad (16-B rows)
[[maybe_unused]] constexpr float kLog2e = 1.4426950408889634f;
[[maybe_unused]] constexpr float kMaxSlack = 8.f;  // log2 units: see `raise_max`

// Named barriers (0 is __syncthreads): FULL / EMPTY of each bf16 key tile (up to three), the
// producers' own, the consumers' own; 1-4 and 13-15 are the kernels' (sparse_attn.cu, small_heads.cu).
[[maybe_unused]] constexpr int kFull = 5, kEmpty = 8, kProducerBar = 11, kConsumerBar = 12;

#ifdef DSV4_SM90_BODY
using namespace ::dsv4::sm90;

__device__ __forceinline__ void bar_sync(int id, int count) {
  asm volatile("bar.sync %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
__device__ __forceinline__ void bar_arrive(int id, int count) {
  asm volatile("bar.arrive %0, %1;\n" ::"r"(id), "r"(count) : "memory");
}
// A warpgroup's registers a thread, from the launch's 64 K / kThreads = 128.
template <int N>
__device__ __forceinline__ void shrink_registers() {
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
}
template <int N>
__device__ __forceinline__ void grow_registers() {
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
}
// 2^x with MUFU.EX2 alone (exp2f adds a denormal-range fix-up; -inf still gives +0).
__device__ __forceinline__ float exp2_fast(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

// The online softmax's running max of one row after a tile whose scores peak at `tile_max` (log2
// units): it moves only when a score passes it by more than kMaxSlack (P <= 2^8 in bf16 loses nothing;
// the sum, the output and the sink all use the same max, so the result is the same, and most tiles
// skip rescaling the accumulators). Returns the factor that rescales the row's sum and output; `base`
// is what the tile's exponents subtract (0 while the row has seen no key and no sink).
__device__ __forceinline__ float raise_max(float tile_max, float& row_max, float& base, bool& moved) {
  float alpha = 1.f;
  if (tile_max > row_max + kMaxSlack) {
    alpha = exp2_fast(row_max - tile_max);
    row_max = tile_max;
    moved = true;
  }
  base = row_max == -INFINITY ? 0.f : row_max;
  return alpha;
}

// d[64 x N] += A[64 x 16] B[16 x N], both in shared memory: B K-major, A K-major (kTransA = 0) or
// MN-major (1). d is the m64nN fp32 fragment: d[i] is row 16 (warp % 4) + lane / 4 + 8 ((i / 2) % 2),
// column 8 (i / 4) + 2 (lane % 4) + i % 2.
template <int N, int kTransA>
__device__ __forceinline__ void wgmma_ss(float* d, uint64_t a, uint64_t b) {
  static_assert(N == 8 || N == 16 || N == 32, "m64n8 / n16 / n32");
  if constexpr (N == 8) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n8k16.f32.bf16.bf16 {%0, %1, %2, %3}, %4, %5, 1, 1, 1, %6, 0;\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "l"(a), "l"(b), "n"(kTransA));
  } else if constexpr (N == 16) {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n16k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7}, %8, %9, 1, 1, 1, "
        "%10, 0;\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7])
        : "l"(a), "l"(b), "n"(kTransA));
  } else {
    asm volatile(
        "wgmma.mma_async.sync.aligned.m64n32k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, "
        "%11, %12, %13, %14, %15}, %16, %17, 1, 1, 1, %18, 0;\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
          "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15])
        : "l"(a), "l"(b), "n"(kTransA));
  }
}

// q rows head0 .. head0 + kRows - 1 of `token` into the swizzled q tile at `tile` (rows of heads past
// the last, or of a padding token, are zeros), by threads t = 0 .. kLoaders - 1; the caller commits
// and waits for the cp.async group.
template <int kRows, int kLoaders>
__device__ __forceinline__ void load_q(uint8_t* tile, const Params& p, int64_t token, int head0, int req, int t) {
  const auto* q = static_cast<const __nv_bfloat16*>(p.q) + token * p.q_stride_token;
  for (int it = t; it < kRows * 64; it += kLoaders) {
    const int row = it >> 6, c = it & 63;
    const int head = head0 + row;
    if (head < p.heads && req >= 0) {
      cp_async16(smem_addr(tile) + swizzled<kRows>(row, c), q + head * p.q_stride_head + c * 8);
    } else {
      *reinterpret_cast<uint4*>(tile + swizzled<kRows>(row, c)) = make_uint4(0, 0, 0, 0);
    }
  }
}

// The bf16 output tile (head row r at r * 1024, 16-B chunk c at c ^ (r % 8)) of heads head0 .. by
// threads t = 0 .. kStorers - 1, whole 16-B chunks, a row's 1 KiB contiguous (global stores of 4 B
// each throttled the LSU): into `out`, or with several splits into the split's bf16 partial rows.
template <int kRows, int kStorers>
__device__ __forceinline__ void store_out(const uint8_t* tile, const Params& p, int64_t token, int head0, int split,
                                          int t) {
  uint8_t* dst;
  int64_t row_stride;  // elements between heads
  if (p.splits == 1) {
    dst = static_cast<uint8_t*>(p.out) + token * p.out_stride_token * 2;
    row_stride = p.out_stride_head;
  } else {
    dst = reinterpret_cast<uint8_t*>(p.partial) + (token * p.splits + split) * p.heads * kDim * 2;
    row_stride = kDim;
  }
  for (int it = t; it < kRows * 64; it += kStorers) {
    const int r = it >> 6, c = it & 63;
    if (head0 + r < p.heads) {
      *reinterpret_cast<uint4*>(dst + ((head0 + r) * row_stride + c * 8) * 2) =
          *reinterpret_cast<const uint4*>(tile + r * 1024 + ((c ^ (r & 7)) << 4));
    }
  }
}

// Producer thread t (0..255) handles key t / kKeyLanes of a unit, lane t % kKeyLanes of it.
struct Lane {
  int row, sub;
};

// This lane's key of the unit starting at key j0: its comp_idx entry, read one unit before
// `gather_unit` needs it, so the load's L2 latency (~600 cycles) is off the unit's critical path.
// Window keys and keys past `end` read nothing.
__device__ __forceinline__ int entry_of(const Params& p, int64_t token, int j0, int end, Lane l) {
  const int j = j0 + l.row;
  return j < end && j >= p.window_keys ? p.comp_idx[token * p.comp_idx_stride + (j - p.window_keys)] : -1;
}

// Gathers the unit starting at key j0 into raw stage `stage` (`idx`: this lane's `entry_of`):
// kKeyLanes lanes per key, each copying every kKeyLanes-th 16-B chunk of the slot's row (rows.cuh
// `copy_row`: window rows in format WF, entries in CF). Keys that are not valid get zero bytes instead
// (stale bytes may hold NaN codes, and 0 x NaN is NaN in P V; zero codes and scales decode to 0 in
// every format), so the dequantization needs no per-key branch.
template <int WF, int CF, class Sm>
__device__ __forceinline__ void gather_unit(Sm& sm, const Params& p, int stage, int j0, int end, int position,
                                            int req, int idx, Lane l) {
  const int j = j0 + l.row;
  const bool window = j0 < p.window_keys;  // the whole unit's
  // Slots fit 32 bits (int32 comp_idx; a pool of 2^31 584-B entries would be 1.2 TB), so the ring
  // and page divisions are FastDiv's 32-bit multiply-high.
  uint32_t slot = 0;
  bool valid = false;
  if (j < end) {
    if (window) {
      const int wpos = position - p.window + 1 + j;
      valid = j < p.window && wpos >= 0;
      const uint32_t ring = p.ring_size.d, lap = p.ring_size.div(static_cast<uint32_t>(wpos));
      slot = static_cast<uint32_t>(req) * ring + static_cast<uint32_t>(wpos) - lap * ring;
    } else {
      valid = idx >= 0;
      slot = static_cast<uint32_t>(idx);
    }
  }
  if (l.sub == 0) sm.valid[stage][l.row] = valid;
  const uint32_t dst = smem_addr(sm.raw[stage]) + l.row * kRawRow;
  if (!valid) {
#pragma unroll
    for (int c = l.sub; c < kRawRow / 16; c += kKeyLanes) {
      *reinterpret_cast<uint4*>(sm.raw[stage] + l.row * kRawRow + c * 16) = uint4{};
    }
    return;
  }
  const FastDiv block = window ? p.window_block : p.comp_block;
  const uint32_t blk = block.div(slot), off = slot - blk * block.d;
  if (window) {
    copy_row<WF, kKeyLanes>(dst, p.window_cache + blk * p.window_page_bytes, off, block.d, l.sub);
  } else {
    copy_row<CF, kKeyLanes>(dst, p.comp_cache + blk * p.comp_page_bytes, off, block.d, l.sub);
  }
}

// Raw stage -> rows 32 part .. 32 part + 31 of bf16 tile `buf` (swizzled, kUnits x 32 rows), and
// that part's valid-key mask. Rows that were not gathered hold zeros (`gather_unit`).
template <int WF, int CF, int kUnits, class Sm>
__device__ __forceinline__ void dequant_unit(Sm& sm, int stage, int buf, int part, bool window, Lane l,
                                             int producer_thread) {
  const uint8_t* src = sm.raw[stage] + l.row * kRawRow;
  const int row = part * kKeys + l.row;
  if (window) {
    dequant_row<WF, kKeys * kUnits>(src, sm.k[buf], row, l.sub);
  } else {
    dequant_row<CF, kKeys * kUnits>(src, sm.k[buf], row, l.sub);
  }
  fence_async_shared();  // these generic-proxy writes are read by wgmma (the async proxy)
  if (producer_thread < 32) {
    const uint32_t m = __ballot_sync(0xffffffffu, sm.valid[stage][producer_thread]);
    if (producer_thread == 0) sm.mask[buf][part] = m;
  }
}

// The producer warpgroups over `units` units from key `begin` (a whole number of tiles): gather unit
// u + kStages - 1 and dequantize unit u into its tile (of a ring of kBufs) once the consumers have
// released that tile (EMPTY, all kThreads threads), then hand a tile over when its last unit is in
// (FULL: the producers arrive, kFullCount - kProducers consumer threads wait).
template <int WF, int CF, int kStages, int kUnits, int kBufs, int kFullCount, class Sm>
__device__ __forceinline__ void produce(Sm& sm, const Params& p, int64_t token, int begin, int end, int units,
                                        int position, int req) {
  const int pt = threadIdx.x - kConsumers;
  const Lane l{pt / kKeyLanes, pt % kKeyLanes};
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    const int j0 = begin + s * kKeys;
    if (s < units) gather_unit<WF, CF>(sm, p, s, j0, end, position, req, entry_of(p, token, j0, end, l), l);
    cp_commit();
  }
  int idx = entry_of(p, token, begin + (kStages - 1) * kKeys, end, l);  // of the unit gathered next
  for (int u = 0; u < units; ++u) {
    cp_wait<kStages - 2>();  // this lane's copies of unit u have landed
    // All lanes' copies of unit u are in, and all lanes are done converting unit u - 1, whose raw
    // stage the gather below reuses.
    bar_sync(kProducerBar, kProducers);
    const int next = u + kStages - 1;
    if (next < units) gather_unit<WF, CF>(sm, p, next % kStages, begin + next * kKeys, end, position, req, idx, l);
    cp_commit();
    idx = entry_of(p, token, begin + (next + 1) * kKeys, end, l);
    const int tile = u / kUnits, part = u % kUnits, buf = tile % kBufs;
    if (part == 0 && tile >= kBufs) bar_sync(kEmpty + buf, kThreads);  // the consumers are done with tile - kBufs
    dequant_unit<WF, CF, kUnits>(sm, u % kStages, buf, part, begin + u * kKeys < p.window_keys, l, pt);
    if (part == kUnits - 1) bar_arrive(kFull + buf, kFullCount);
  }
}

#endif  // DSV4_SM90_BODY

}  // namespace dsv4::sparse_attn
