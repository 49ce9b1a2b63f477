// SPDX-License-Identifier: MIT
// sm_90 kernel of `dsv4::sparse_attn` for V4's fp8_584 pools with bf16 queries (the specification is
// dsv4ops/sparse_attn/reference.py; the Triton kernel serves every other case).
//
// One CTA = one token x 64 heads x one split of the token's key list [window | entries], 8 warps.
// K = V is one shared 512-d head (MQA), so a key tile is gathered and dequantized once for all 64
// heads. Per tile of 32 keys:
//   - cp.async brings the raw 584-B entries (576 data + 8 scale bytes) into a 4-stage ring, three
//     tiles ahead of the one being multiplied: the gather's DRAM latency hides behind the math;
//   - all threads dequantize the next tile (e4m3 x UE8M0 -> bf16 is exact, see the Triton kernel's
//     docstring) into one of two swizzled bf16 tiles while the current one is multiplied;
//   - warp (g, h) owns heads 16g..16g+15 and output dims 256h..256h+255: its accumulator is
//     16 x 256 fp32, 128 registers a thread (the Triton kernel holds 64 x 512 on 8 warps and spills).
//     S = q k^T is split the same way over dims: the two warps of a head group add their partial S
//     through shared memory, so both hold the same S (a + b == b + a in IEEE) and run the same
//     online softmax, each for its half of the output.
// mma.sync m16n8k16 (bf16 in, fp32 accumulate) with ldmatrix from XOR-swizzled rows (16-B chunk
// c of row r at c ^ (r % 8): the 8 rows an ldmatrix reads hit 8 different bank groups).
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>

#include "params.h"

namespace dsv4::sparse_attn {
namespace {

constexpr int kDim = 512;        // head dim: 448 e4m3 + 64 bf16 rope dims
constexpr int kQuantChunks = 56; // 16-B bf16 chunks of the 448 quantized dims
constexpr int kEntryData = 576;  // bytes of an entry's data (448 e4m3 + 128 B of bf16 rope)
constexpr int kEntryScale = 8;   // 7 UE8M0 scales (one per 64 dims) + 1 pad byte
constexpr int kHeads = 64;       // heads per CTA
constexpr int kKeys = 32;        // keys per tile
constexpr int kWarps = 8;
constexpr int kThreads = kWarps * 32;
constexpr int kRawStages = 4;
constexpr int kRowBytes = kDim * 2;  // a bf16 row of the q and key tiles
constexpr int kRawRow = 592;         // raw entry in shared memory: 576 + 8 + 8 pad (16-B rows)
constexpr float kLog2e = 1.4426950408889634f;

struct Smem {
  alignas(128) uint8_t q[kHeads * kRowBytes];            // 64 KiB
  alignas(128) uint8_t k[2][kKeys * kRowBytes];          // 64 KiB
  alignas(128) uint8_t raw[kRawStages][kKeys * kRawRow]; // 74 KiB
  float4 s[kWarps][4][32];                               // partial S exchange, 16 KiB
  uint8_t valid[kRawStages][kKeys];
  uint32_t mask[2];  // valid keys of each bf16 tile
};
static_assert(sizeof(Smem) <= 227 * 1024, "shared memory of one CTA on sm_90");

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ uint32_t swizzled(int row, int chunk) {
  return row * kRowBytes + ((chunk ^ (row & 7)) << 4);
}
__device__ __forceinline__ void cp_async16(uint32_t dst, const void* src) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void cp_async8(uint32_t dst, const void* src) {
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(dst), "l"(src));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N));
}
__device__ __forceinline__ void pair_barrier(int id) { asm volatile("bar.sync %0, 64;\n" ::"r"(id)); }

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], uint32_t addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(addr));
}
__device__ __forceinline__ void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
__device__ __forceinline__ uint32_t bf16x2(float lo, float hi) {
  const __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&v);
}
// Two e4m3 codes (low byte first) times a power of two, as bf16x2: exact (e4m3 -> f16 is exact, and
// the product has e4m3's 4 significant bits).
__device__ __forceinline__ uint32_t dequant2(uint32_t codes, float scale) {
  const __half2_raw h = __nv_cvt_fp8x2_to_halfraw2(static_cast<__nv_fp8x2_storage_t>(codes), __NV_E4M3);
  const float2 f = __half22float2(*reinterpret_cast<const __half2*>(&h));
  return bf16x2(f.x * scale, f.y * scale);
}

// Gathers tile `tile` of this CTA's key list into raw stage `stage`: 8 threads per key, each
// copying its 16-B chunks (thread 4 of a key also its 8 scale bytes). Keys that are not valid copy
// nothing; the dequantization writes zeros for them (0 x p stays 0 in P V).
__device__ __forceinline__ void gather_tile(Smem& sm, const Params& p, int stage, int64_t token, int j0, int end,
                                            int position, int req) {
  const int row = threadIdx.x >> 3, sub = threadIdx.x & 7;
  const int j = j0 + row;
  const uint8_t* pool = nullptr;
  int64_t slot = -1, page = 0;
  int block = 1;
  if (j < end) {
    if (j < p.window_keys) {
      const int wpos = position - p.window + 1 + j;
      if (j < p.window && wpos >= 0) {
        slot = static_cast<int64_t>(req) * p.ring_size + wpos % p.ring_size;
        pool = p.window_cache, page = p.window_page_bytes, block = p.window_block;
      }
    } else {
      const int idx = p.comp_idx[token * p.comp_idx_stride + (j - p.window_keys)];
      if (idx >= 0) slot = idx, pool = p.comp_cache, page = p.comp_page_bytes, block = p.comp_block;
    }
  }
  if (sub == 0) sm.valid[stage][row] = slot >= 0;
  if (slot < 0) return;
  const uint8_t* base = pool + (slot / block) * page;
  const int64_t off = slot % block;
  const uint8_t* data = base + off * kEntryData;
  const uint32_t dst = smem_addr(sm.raw[stage]) + row * kRawRow;
#pragma unroll
  for (int c = sub; c < kEntryData / 16; c += 8) cp_async16(dst + c * 16, data + c * 16);
  if (sub == 4) cp_async8(dst + kEntryData, base + static_cast<int64_t>(block) * kEntryData + off * kEntryScale);
}

// Raw stage -> bf16 tile `buf` (swizzled rows of 512 dims), and the tile's valid-key mask.
__device__ __forceinline__ void dequant_tile(Smem& sm, int stage, int buf) {
  const uint8_t* raw = sm.raw[stage];
#pragma unroll
  for (int it = threadIdx.x; it < kKeys * 64; it += kThreads) {
    const int row = it >> 6, c = it & 63;
    uint4 v = make_uint4(0, 0, 0, 0);
    if (sm.valid[stage][row]) {
      const uint8_t* src = raw + row * kRawRow;
      if (c < kQuantChunks) {
        const uint2 codes = *reinterpret_cast<const uint2*>(src + c * 8);
        // UE8M0 byte e -> 2^(e - 127): e in fp32's exponent field.
        const float scale = __uint_as_float(static_cast<uint32_t>(src[kEntryData + (c >> 3)]) << 23);
        v = make_uint4(dequant2(codes.x & 0xffff, scale), dequant2(codes.x >> 16, scale),
                       dequant2(codes.y & 0xffff, scale), dequant2(codes.y >> 16, scale));
      } else {
        v = *reinterpret_cast<const uint4*>(src + 448 + (c - kQuantChunks) * 16);
      }
    }
    *reinterpret_cast<uint4*>(sm.k[buf] + swizzled(row, c)) = v;
  }
  if (threadIdx.x < 32) {
    const uint32_t m = __ballot_sync(0xffffffffu, sm.valid[stage][threadIdx.x]);
    if (threadIdx.x == 0) sm.mask[buf] = m;
  }
}

__global__ void __launch_bounds__(kThreads, 1) sparse_attn_kernel(const __grid_constant__ Params p) {
  extern __shared__ __align__(128) uint8_t smem[];
  Smem& sm = *reinterpret_cast<Smem*>(smem);
  const int64_t token = blockIdx.x;
  const int head0 = blockIdx.y * kHeads;
  const int split = blockIdx.z;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int group = warp & 3, half = warp >> 2;

  const int req = p.req_slots[token];
  int position = 0, end = 0;
  const int begin = split * p.split_keys;
  if (req >= 0) {
    position = p.window_ends[token];
    const int n_len = min(p.comp_lens[token], p.n_idx);
    end = min(begin + p.split_keys, p.window_keys + n_len);
  }
  const int tiles = end > begin ? (end - begin + kKeys - 1) / kKeys : 0;

  // q -> shared memory (rows of heads past the last, or of a padding token, are zeros); it lands
  // with the first key tile's copy group.
  const auto* q = static_cast<const __nv_bfloat16*>(p.q) + token * p.q_stride_token;
  for (int it = threadIdx.x; it < kHeads * 64; it += kThreads) {
    const int row = it >> 6, c = it & 63;
    const int head = head0 + row;
    if (head < p.heads && req >= 0) {
      cp_async16(smem_addr(sm.q) + swizzled(row, c), q + head * p.q_stride_head + c * 8);
    } else {
      *reinterpret_cast<uint4*>(sm.q + swizzled(row, c)) = make_uint4(0, 0, 0, 0);
    }
  }
#pragma unroll
  for (int s = 0; s < kRawStages - 1; ++s) {
    if (s < tiles) gather_tile(sm, p, s, token, begin + s * kKeys, end, position, req);
    cp_commit();
  }
  cp_wait<kRawStages - 2>();
  __syncthreads();
  if (tiles > 0) dequant_tile(sm, 0, 0);

  // Rows r = lane / 4 and r + 8 of the warp's 16 heads; the sink opens the online softmax (running
  // max s_h, running sum e^0 = 1 on one lane of the row's quad, no value) when there is one split.
  float row_max[2], row_sum[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int head = head0 + group * 16 + (lane >> 2) + 8 * h;
    if (p.splits == 1) {
      row_max[h] = head < p.heads ? p.sinks[head] * kLog2e : 0.f;
      row_sum[h] = (lane & 3) == 0 ? 1.f : 0.f;
    } else {
      row_max[h] = -INFINITY;
      row_sum[h] = 0.f;
    }
  }
  float acc[32][4];
#pragma unroll
  for (int n = 0; n < 32; ++n) acc[n][0] = acc[n][1] = acc[n][2] = acc[n][3] = 0.f;

  const uint32_t q_base = smem_addr(sm.q);
  for (int i = 0; i < tiles; ++i) {
    const int next = i + kRawStages - 1;
    if (next < tiles) gather_tile(sm, p, next % kRawStages, token, begin + next * kKeys, end, position, req);
    cp_commit();
    cp_wait<kRawStages - 2>();
    __syncthreads();  // tile i + 1's raw bytes and tile i's bf16 rows are in; tile i - 1 is done
    if (i + 1 < tiles) dequant_tile(sm, (i + 1) % kRawStages, (i + 1) & 1);
    const uint32_t mask = sm.mask[i & 1];
    if (mask == 0) continue;
    const uint32_t k_base = smem_addr(sm.k[i & 1]);

    // Partial S over this warp's 256 dims: 16 heads x 32 keys.
    float s[4][4];
#pragma unroll
    for (int n = 0; n < 4; ++n) s[n][0] = s[n][1] = s[n][2] = s[n][3] = 0.f;
#pragma unroll
    for (int kk = 0; kk < 16; ++kk) {
      const int c0 = half * 32 + kk * 2;
      uint32_t a[4];
      ldmatrix_x4(a, q_base + swizzled(group * 16 + (lane & 15), c0 + (lane >> 4)));
#pragma unroll
      for (int np = 0; np < 2; ++np) {
        uint32_t b[4];
        ldmatrix_x4(b, k_base + swizzled(np * 16 + (lane & 7) + ((lane >> 4) << 3), c0 + ((lane >> 3) & 1)));
        mma(s[2 * np], a, b[0], b[1]);
        mma(s[2 * np + 1], a, b[2], b[3]);
      }
    }
#pragma unroll
    for (int n = 0; n < 4; ++n) sm.s[warp][n][lane] = make_float4(s[n][0], s[n][1], s[n][2], s[n][3]);
    pair_barrier(1 + group);
#pragma unroll
    for (int n = 0; n < 4; ++n) {
      const float4 o = sm.s[warp ^ 4][n][lane];
      s[n][0] += o.x, s[n][1] += o.y, s[n][2] += o.z, s[n][3] += o.w;
    }

    // Online softmax in the log2 domain; element v of n-tile n is key 8n + 2(lane % 4) + v % 2 of
    // row lane / 4 + 8 (v / 2).
    float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int n = 0; n < 4; ++n) {
#pragma unroll
      for (int v = 0; v < 4; ++v) {
        const int key = n * 8 + 2 * (lane & 3) + (v & 1);
        s[n][v] = (mask >> key) & 1 ? s[n][v] * p.scale_log2 : -INFINITY;
        tile_max[v >> 1] = fmaxf(tile_max[v >> 1], s[n][v]);
      }
    }
    float alpha[2], base[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffffu, tile_max[h], 1));
      tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffffu, tile_max[h], 2));
      const float m_new = fmaxf(row_max[h], tile_max[h]);
      base[h] = m_new == -INFINITY ? 0.f : m_new;  // no key and no sink seen yet
      alpha[h] = exp2f(row_max[h] - base[h]);
      row_max[h] = m_new;
    }
    float tile_sum[2] = {0.f, 0.f};
#pragma unroll
    for (int n = 0; n < 4; ++n) {
#pragma unroll
      for (int v = 0; v < 4; ++v) {
        s[n][v] = exp2f(s[n][v] - base[v >> 1]);
        tile_sum[v >> 1] += s[n][v];
      }
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) row_sum[h] = row_sum[h] * alpha[h] + tile_sum[h];
#pragma unroll
    for (int n = 0; n < 32; ++n) {
      acc[n][0] *= alpha[0], acc[n][1] *= alpha[0];
      acc[n][2] *= alpha[1], acc[n][3] *= alpha[1];
    }

    // O[:, 256h .. 256h + 255] += P V, P in bf16 (DeepSeek's kernel) straight from S's registers.
#pragma unroll
    for (int kk = 0; kk < 2; ++kk) {
      const uint32_t a[4] = {bf16x2(s[2 * kk][0], s[2 * kk][1]), bf16x2(s[2 * kk][2], s[2 * kk][3]),
                             bf16x2(s[2 * kk + 1][0], s[2 * kk + 1][1]), bf16x2(s[2 * kk + 1][2], s[2 * kk + 1][3])};
#pragma unroll
      for (int dp = 0; dp < 16; ++dp) {
        uint32_t b[4];
        ldmatrix_x4_trans(b, k_base + swizzled(kk * 16 + (lane & 7) + (((lane >> 3) & 1) << 3),
                                               half * 32 + dp * 2 + (lane >> 4)));
        mma(acc[2 * dp], a, b[0], b[1]);
        mma(acc[2 * dp + 1], a, b[2], b[3]);
      }
    }
  }

#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float sum = row_sum[h] + __shfl_xor_sync(0xffffffffu, row_sum[h], 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    const int head = head0 + group * 16 + (lane >> 2) + 8 * h;
    if (head >= p.heads) continue;
    const int dim0 = half * 256 + 2 * (lane & 3);
    if (p.splits == 1) {
      auto* out = static_cast<__nv_bfloat16*>(p.out) + token * p.out_stride_token + head * p.out_stride_head + dim0;
#pragma unroll
      for (int n = 0; n < 32; ++n) {
        *reinterpret_cast<uint32_t*>(out + n * 8) = bf16x2(acc[n][2 * h] / sum, acc[n][2 * h + 1] / sum);
      }
    } else {
      // This split's output normalized by its own sum, and log2 of that sum (-inf: no key).
      const int64_t row = (token * p.splits + split) * p.heads + head;
      const float safe = sum > 0.f ? sum : 1.f;
      float* part = p.partial + row * kDim + dim0;
#pragma unroll
      for (int n = 0; n < 32; ++n) {
        *reinterpret_cast<float2*>(part + n * 8) = make_float2(acc[n][2 * h] / safe, acc[n][2 * h + 1] / safe);
      }
      if (half == 0 && (lane & 3) == 0) p.lse[row] = sum > 0.f ? row_max[h] + log2f(sum) : -INFINITY;
    }
  }
}

// out = sum_s 2^lse_s o_s / (sum_s 2^lse_s + e^sink): one CTA per (token, head), 4 dims a thread.
__global__ void __launch_bounds__(128) combine_kernel(const __grid_constant__ Params p) {
  const int64_t token = blockIdx.x;
  const int head = blockIdx.y;
  const int dim = threadIdx.x * 4;
  auto* out = static_cast<__nv_bfloat16*>(p.out) + token * p.out_stride_token + head * p.out_stride_head + dim;
  float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
  if (p.req_slots[token] >= 0) {
    const float sink = p.sinks[head] * kLog2e;
    const int64_t row0 = token * p.splits * p.heads + head;
    float m = sink;
    for (int s = 0; s < p.splits; ++s) m = fmaxf(m, p.lse[row0 + s * p.heads]);
    float den = exp2f(sink - m);
    for (int s = 0; s < p.splits; ++s) {
      const int64_t row = row0 + s * p.heads;
      const float w = exp2f(p.lse[row] - m);
      const float4 o = *reinterpret_cast<const float4*>(p.partial + row * kDim + dim);
      den += w;
      acc.x += w * o.x, acc.y += w * o.y, acc.z += w * o.z, acc.w += w * o.w;
    }
    acc.x /= den, acc.y /= den, acc.z /= den, acc.w /= den;
  }
  *reinterpret_cast<uint2*>(out) = make_uint2(bf16x2(acc.x, acc.y), bf16x2(acc.z, acc.w));
}

}  // namespace

void launch(const Params& p, cudaStream_t stream) {
  // Per call (a host-side attribute, no stream work): the opt-in above 48 KiB is per device. A
  // failure surfaces as the launch error, which the caller checks.
  cudaFuncSetAttribute(sparse_attn_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(sizeof(Smem)));
  const dim3 grid(p.tokens, (p.heads + kHeads - 1) / kHeads, p.splits);
  sparse_attn_kernel<<<grid, kThreads, sizeof(Smem), stream>>>(p);
  if (p.splits > 1) combine_kernel<<<dim3(p.tokens, p.heads), kDim / 4, 0, stream>>>(p);
}

}  // namespace dsv4::sparse_attn
