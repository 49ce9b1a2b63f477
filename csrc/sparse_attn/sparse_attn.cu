// SPDX-License-Identifier: MIT
// sm_90 kernel of `dsv4::sparse_attn` for bf16 queries over byte pools: V4's fp8_584 window and
// compressed rows, V4.1's fp8_528 window and fp4_288 compressed rows, and V4 with fp4_288 entries
// (rows.cuh; the specification is dsv4ops/sparse_attn/reference.py; the Triton kernel serves every
// other case).
//
// One CTA = one token x 64 heads x one split of the token's key list [window | entries], four
// warpgroups specialized by role (the producers and the tile handoff are pipeline.cuh's, shared with
// small_heads.cu, the kernel for 8 / 16 / 32 heads a CTA). K = V is one shared 512-d head (MQA), so
// a key tile of 32 keys is gathered and dequantized once for all 64 heads:
//   - two producer warpgroups (warps 8-15) issue cp.async for the raw rows (a slot's data and scale
//     bytes) into a 4-stage ring, three tiles ahead, and dequantize each landed tile (exactly, see
//     rows.cuh) into one of two bf16 tiles. A tile is all window or all entries (the window is
//     rounded up to whole tiles), so each tile has one format, chosen per tile without divergence;
//   - consumer warpgroup h (warps 4h..4h+3) owns output dims 256h..256h+255 for all 64 heads: its
//     accumulator is 64 x 256 fp32, 128 registers a thread (P V as two m64n128 wgmmas). S = q k^T
//     is split the same way over dims: the two add their partial S through shared memory, so both
//     hold the same S (a + b == b + a in IEEE) and run the same online softmax, then P V.
// The roles overlap: while the tensor cores and the softmax work on tile i, the producers convert
// tile i + 1. H100, CSA 128 x 4K: one set of 8 warps doing both spent 41% of its samples in the
// gather and dequantization and 35% in S and the softmax, one after the other (53.8 us); one
// producer warpgroup, a warp per scheduler, left the consumers waiting for tiles 23% of their time
// (50.3 us); two: 43.3 us. Named barriers hand the two bf16 tiles over (FULL: producers ->
// consumers; EMPTY: consumers -> producers), and setmaxnreg moves registers from the producers (64)
// to the consumers (192).
// wgmma (sm_90a): S from q and k in shared memory (K-major), P V with P from registers and the same
// k tile read MN-major. q and k tiles are stored as 8 blocks of 64 dims, each [rows][128 B] with the
// 128-B swizzle (16-B chunk c of row r at c ^ (r % 8)), the layout wgmma's descriptors name.
#include <cuda_bf16.h>

#include <cstdint>

#include "../common/pdl.cuh"
#include "pipeline.cuh"

namespace dsv4::sparse_attn {
namespace {

constexpr int kHeads = 64;  // heads per CTA
constexpr int kRawStages = 4;

struct Smem {
  alignas(1024) uint8_t q[kHeads * kDim * 2];           // 64 KiB
  alignas(1024) uint8_t k[2][kKeys * kDim * 2];         // 64 KiB
  alignas(128) uint8_t raw[kRawStages][kKeys * kRawRow]; // 74 KiB
  float4 s[kConsumers / 32][4][32];                      // partial S exchange, 16 KiB
  uint8_t valid[kRawStages][kKeys];
  uint32_t mask[2][1];  // valid keys of each bf16 tile
};
static_assert(sizeof(Smem) <= 227 * 1024, "shared memory of one CTA on sm_90");

#ifdef DSV4_SM90_BODY
// Named barriers 1-4: the S exchange of warps w and w + 4 (pipeline.cuh has the others).

// d[64 x 128] += A[64 x 16] B[16 x 128]: A from registers (the m16n8k16 A layout per warp), B in
// shared memory, MN-major. (m64n256 would need more registers than the launch's 128 a thread, which
// ptxas checks for each instruction whatever setmaxnreg grants.)
__device__ __forceinline__ void wgmma_o(float* d, const uint32_t (&a)[4], uint64_t b) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {%0, %1, %2, %3, %4, %5, %6, %7, %8, %9, %10, %11, %12, %13, %14, %15, %16, %17, %18, %19, %20, %21, %22, %23, %24, %25, %26, %27, %28, %29, %30, %31, %32, %33, %34, %35, %36, %37, %38, %39, %40, %41, %42, %43, %44, %45, %46, %47, %48, %49, %50, %51, %52, %53, %54, %55, %56, %57, %58, %59, %60, %61, %62, %63}, {%64, %65, %66, %67}, %68, 1, 1, 1, 1;\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]), "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]), "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}
#endif  // DSV4_SM90_BODY

template <int WF, int CF>
__global__ void __launch_bounds__(kThreads, 1) sparse_attn_kernel(const __grid_constant__ Params p) {
#ifdef DSV4_SM90_BODY
  extern __shared__ __align__(128) uint8_t smem[];
  Smem& sm = *reinterpret_cast<Smem*>(smem);
  // q, the lists and `out` belong to the kernels before this one; once every CTA is in, the combine
  // may take the SMs that free up.
  pdl::wait_prior_grid();
  pdl::launch_dependents();
  const int64_t token = blockIdx.x;
  const int head0 = blockIdx.y * kHeads;
  const int split = blockIdx.z;
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;

  const int req = p.req_slots[token];
  int position = 0, end = 0;
  const int begin = split * p.split_keys;
  if (req >= 0) {
    position = p.window_ends[token];
    const int n_len = min(p.comp_lens[token], p.n_idx);
    end = min(begin + p.split_keys, p.window_keys + n_len);
  }
  const int tiles = end > begin ? (end - begin + kKeys - 1) / kKeys : 0;
  // A split past the token's real list leaves at once: the combine reads only the live splits, so the
  // cost follows comp_lens, not the list's width (HCA at 1M max_context has 8192 entries a token).
  if (tiles == 0 && p.splits > 1) return;

  if (warp >= kConsumers / 32) {
    shrink_registers<kProducerRegs>();
    produce<WF, CF, kRawStages, 1, kThreads>(sm, p, token, begin, end, tiles, position, req);
    return;
  }
  grow_registers<kConsumerRegs>();
  // The warpgroup index through a shuffle: the compiler then knows it is warp-uniform and keeps the
  // wgmma descriptors in uniform registers (computed from threadIdx, they cost ~15 instructions per
  // wgmma in vector registers).
  const int group = warp & 3, half = __shfl_sync(0xffffffffu, warp >> 2, 0);

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
  load_q<kHeads, kConsumers>(sm.q, p, token, head0, req, threadIdx.x);
  cp_commit();

  float acc[128];  // acc[4n + v]: the m16n8 C fragment of dims 8n .. 8n + 7 of this warpgroup's 256
#pragma unroll
  for (int n = 0; n < 128; ++n) acc[n] = 0.f;
  cp_wait<0>();
  fence_async_shared();
  bar_sync(kConsumerBar, kConsumers);

  const uint64_t q_desc = descriptor(smem_addr(sm.q) + half * 4 * (kHeads * 128), 16, 1024);
  for (int i = 0; i < tiles; ++i) {
    // Tile i's bf16 rows are in. Every consumer thread passes here each tile, so this also orders
    // the reuse of sm.s: tile i - 1's partial S has been read by the other warp of each pair.
    bar_sync(kFull + (i & 1), kThreads);
    const uint32_t mask = sm.mask[i & 1][0];
    const uint32_t k_base = smem_addr(sm.k[i & 1]);
    // Partial S over this warpgroup's 256 dims (4 blocks of 64, 4 k-steps of 16 each). A tile with no
    // valid key (a window cut short, -1 entries) still runs: its P is zeros.
    float s[16];
#pragma unroll
    for (int n = 0; n < 16; ++n) s[n] = 0.f;
    fence_registers(s);
    wgmma_fence();
    const uint64_t k_desc = descriptor(k_base + half * 4 * (kKeys * 128), 16, 1024);
    const uint64_t v_desc = descriptor(k_base + half * 4 * (kKeys * 128), kKeys * 128, 1024);
#pragma unroll
    for (int kk = 0; kk < 16; ++kk) {
      wgmma_ss<32, 0>(s, advance(q_desc, (kk >> 2) * (kHeads * 128) + (kk & 3) * 32),
                      advance(k_desc, (kk >> 2) * (kKeys * 128) + (kk & 3) * 32));
    }
    wgmma_commit();
    wgmma_wait();
    fence_registers(s);
#pragma unroll
    for (int n = 0; n < 4; ++n) sm.s[warp][n][lane] = make_float4(s[4 * n], s[4 * n + 1], s[4 * n + 2], s[4 * n + 3]);
    // Only warps w and w ^ 4 exchange: a 64-thread named barrier per pair, so a pair need not wait
    // for the slowest warp.
    bar_sync(1 + group, 64);
#pragma unroll
    for (int n = 0; n < 4; ++n) {
      const float4 o = sm.s[warp ^ 4][n][lane];
      s[4 * n] += o.x, s[4 * n + 1] += o.y, s[4 * n + 2] += o.z, s[4 * n + 3] += o.w;
    }

    // Online softmax in the log2 domain; s[4n + v] is key 8n + 2(lane % 4) + v % 2 of row
    // lane / 4 + 8 (v / 2) of the warp's 16 heads.
    float tile_max[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int n = 0; n < 4; ++n) {
#pragma unroll
      for (int v = 0; v < 4; ++v) {
        const int key = n * 8 + 2 * (lane & 3) + (v & 1);
        s[4 * n + v] = (mask >> key) & 1 ? s[4 * n + v] * p.scale_log2 : -INFINITY;
        tile_max[v >> 1] = fmaxf(tile_max[v >> 1], s[4 * n + v]);
      }
    }
    // The running max (`raise_max`): most tiles skip rescaling the 128 accumulators.
    float alpha[2], base[2];
    bool moved = false;
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffffu, tile_max[h], 1));
      tile_max[h] = fmaxf(tile_max[h], __shfl_xor_sync(0xffffffffu, tile_max[h], 2));
      alpha[h] = raise_max(tile_max[h], row_max[h], base[h], moved);
    }
    float tile_sum[2] = {0.f, 0.f};
#pragma unroll
    for (int n = 0; n < 16; ++n) {
      s[n] = exp2_fast(s[n] - base[(n >> 1) & 1]);
      tile_sum[(n >> 1) & 1] += s[n];
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) row_sum[h] = row_sum[h] * alpha[h] + tile_sum[h];
    if (__any_sync(0xffffffffu, moved)) {
#pragma unroll
      for (int n = 0; n < 128; ++n) acc[n] *= alpha[(n >> 1) & 1];
    }

    // O[:, 256h .. 256h + 255] += P V, P in bf16 (DeepSeek's kernel) straight from S's registers.
    // (Leaving it running while the next tile's S is issued makes ptxas serialize every wgmma: it
    // cannot tell which group a wait_group 1 retires.)
    uint32_t a[2][4];
#pragma unroll
    for (int kk = 0; kk < 2; ++kk) {
      a[kk][0] = bf16x2(s[8 * kk], s[8 * kk + 1]);
      a[kk][1] = bf16x2(s[8 * kk + 2], s[8 * kk + 3]);
      a[kk][2] = bf16x2(s[8 * kk + 4], s[8 * kk + 5]);
      a[kk][3] = bf16x2(s[8 * kk + 6], s[8 * kk + 7]);
    }
    fence_registers(acc);
    wgmma_fence();
#pragma unroll
    for (int kk = 0; kk < 2; ++kk) {
      wgmma_o(acc, a[kk], advance(v_desc, kk * 16 * 128));
      wgmma_o(acc + 64, a[kk], advance(v_desc, kk * 16 * 128 + 2 * kKeys * 128));
    }
    wgmma_commit();
    wgmma_wait();
    fence_registers(acc);
    if (i + 2 < tiles) bar_arrive(kEmpty + (i & 1), kThreads);  // the producers may refill tile i % 2
  }

#pragma unroll
  for (int h = 0; h < 2; ++h) {
    float sum = row_sum[h] + __shfl_xor_sync(0xffffffffu, row_sum[h], 1);
    sum += __shfl_xor_sync(0xffffffffu, sum, 2);
    const int head = head0 + group * 16 + (lane >> 2) + 8 * h;
    if (head >= p.heads) continue;
    const int dim0 = half * 256 + 2 * (lane & 3);
    const float inv = 1.f / (sum > 0.f ? sum : 1.f);
    if (p.splits == 1) {
      // Into the output tile in shared memory (q's buffer: the last S wgmma of both warpgroups has
      // completed, as each warp passed its pair barrier after its own): 16-B chunk c of head row r
      // at r * 1024 + (c ^ (r % 8)) * 16, so the 8 rows of a store hit 32 banks.
      const int r = group * 16 + (lane >> 2) + 8 * h;
#pragma unroll
      for (int n = 0; n < 32; ++n) {
        *reinterpret_cast<uint32_t*>(sm.q + r * 1024 + (((half * 32 + n) ^ (r & 7)) << 4) + 4 * (lane & 3)) =
            bf16x2(acc[4 * n + 2 * h] * inv, acc[4 * n + 2 * h + 1] * inv);
      }
    } else {
      // This split's output normalized by its own sum, and log2 of that sum (-inf: no key).
      const int64_t row = (token * p.splits + split) * p.heads + head;
      float* part = p.partial + row * kDim + dim0;
#pragma unroll
      for (int n = 0; n < 32; ++n) {
        *reinterpret_cast<float2*>(part + n * 8) =
            make_float2(acc[4 * n + 2 * h] * inv, acc[4 * n + 2 * h + 1] * inv);
      }
      if (half == 0 && (lane & 3) == 0) p.lse[row] = sum > 0.f ? row_max[h] + log2f(sum) : -INFINITY;
    }
  }
  if (p.splits == 1) {
    bar_sync(kConsumerBar, kConsumers);
    store_out<kHeads, kConsumers>(sm.q, p, token, head0, threadIdx.x);
  }
#else
  __trap();
#endif
}

}  // namespace

// The (window, entries) pairs of the models (rows.cuh `with_formats`).
bool serves_formats(int window_fmt, int comp_fmt) {
  return (window_fmt == kFp8_584 && (comp_fmt == kFp8_584 || comp_fmt == kFp4_288)) ||
         (window_fmt == kFp8_528 && (comp_fmt == kFp8_528 || comp_fmt == kFp4_288));
}

void launch(const Params& p, cudaStream_t stream) {
  if (p.cta_heads < kHeads) {
    launch_small_heads(p, stream);
  } else {
    with_formats(p.window_fmt, p.comp_fmt, [&](auto wf, auto cf) {
      auto* kernel = sparse_attn_kernel<decltype(wf)::value, decltype(cf)::value>;
      // Per call (a host-side attribute, no stream work): the opt-in above 48 KiB is per device. A
      // failure surfaces as the launch error, which the caller checks.
      cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(sizeof(Smem)));
      const dim3 grid(p.tokens, (p.heads + kHeads - 1) / kHeads, p.splits);
      // With programmatic dependent launch (common/pdl.cuh; a launch error is the caller's
      // cudaGetLastError). H100, V4-Flash, with / without: sliding 1 x 4K 9.2 / 10.1 us, CSA 1 x 4K
      // 11.5 / 12.5, CSA 32 x 4K 24.3 / 25.4, V4-Pro CSA 128 x 4K 128.1 / 130.0.
      pdl::launch_pdl(kernel, grid, dim3(kThreads), sizeof(Smem), stream, p);
    });
  }
  if (p.splits > 1) launch_combine(p, stream);
}

}  // namespace dsv4::sparse_attn
