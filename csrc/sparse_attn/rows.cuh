// SPDX-License-Identifier: MIT
// The cache-row formats the sm_90 sparse_attn kernel reads (dsv4ops/quant/formats.py), each as the
// copy of one slot into a raw row in shared memory and the conversion of that raw row into 64 16-B
// chunks of bf16 (dims 8c .. 8c + 7 in chunk c, the key tile's swizzled layout):
//   fp8_584 (V4 window and compressed): 448 e4m3 x UE8M0 / 64, then 64 bf16 rope dims;
//   fp8_528 (V4.1 window): 512 e4m3 x UE8M0 / 32;
//   fp4_288 (V4.1 compressed, V4's fp4 option): 512 e2m1 x e4m3 / 16, element 2i in the low nibble.
// Every conversion is exact in bf16: e4m3 times a power of two keeps e4m3's 4 significant bits, and
// an e2m1 value (<= 2 bits) times an e4m3 scale (<= 4 bits) has at most 6, within 2^-10 .. 2688.
// A page of B slots is B data rows, then B scale rows (formats.py), so a slot's two parts are copied
// apart and land side by side: [data | scales] at the start of its raw row.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>

#include <cstdint>
#include <type_traits>

#include "../common/sm90.cuh"

namespace dsv4::sparse_attn {

// Codes of the formats (dsv4ops/sparse_attn/cuda.py ROW_FORMATS).
enum RowFormat : int { kFp8_584 = 0, kFp8_528 = 1, kFp4_288 = 2 };

template <int F>
struct Row;
template <>
struct Row<kFp8_584> {
  static constexpr int kData = 576, kScale = 8;
};
template <>
struct Row<kFp8_528> {
  static constexpr int kData = 512, kScale = 16;
};
template <>
struct Row<kFp4_288> {
  static constexpr int kData = 256, kScale = 32;
};

#ifdef DSV4_SM90_BODY
using ::dsv4::sm90::cp_async16;
using ::dsv4::sm90::cp_async8;

// Byte offset of 16-B chunk `chunk` (dims 8 chunk .. 8 chunk + 7) of row `row` in a tile of `rows`
// rows: block chunk / 8 of 64 dims, then the row's 128 B with the 128-B swizzle (the layout the
// wgmma descriptors name).
template <int kRows>
__device__ __forceinline__ uint32_t swizzled(int row, int chunk) {
  return (chunk >> 3) * (kRows * 128) + row * 128 + (((chunk & 7) ^ (row & 7)) << 4);
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
// UE8M0 byte e -> 2^(e - 127): e in fp32's exponent field.
__device__ __forceinline__ float ue8m0(uint32_t byte) { return __uint_as_float((byte & 0xffu) << 23); }

// Eight e2m1 codes (4 bytes, element 2i in the low nibble of byte i) times the e4m3 scale, as 4
// bf16x2 words in element order. Twice each magnitude ({0, 1, 2, 3, 4, 6, 8, 12}: no subnormal) comes
// from two byte tables by PRMT (low and high byte of its bf16), the sign bit is moved in, and one
// bf16 multiply by scale / 2 gives the exact product. `half_scale2` = bf16x2(scale / 2).
__device__ __forceinline__ uint4 dequant_fp4x8(uint32_t codes, __nv_bfloat162 half_scale2) {
  constexpr uint32_t kLow0 = 0x40008000u, kLow1 = 0x4000c080u;   // low bytes of 0, 1, 2, 3 | 4, 6, 8, 12
  constexpr uint32_t kHigh0 = 0x40403f00u, kHigh1 = 0x41414040u;  // high bytes
  uint32_t out[4];
#pragma unroll
  for (int k = 0; k < 2; ++k) {
    const uint32_t x = codes >> (16 * k);  // elements 4k .. 4k + 3, one a nibble
    const uint32_t mag = x & 0x7777u;      // PRMT selectors (bit 3 clear: plain byte picks)
    const uint32_t lo = __byte_perm(kLow0, kLow1, mag), hi = __byte_perm(kHigh0, kHigh1, mag);
    const uint32_t pair[2] = {__byte_perm(lo, hi, 0x5140) | ((x & 0x8u) << 12) | ((x & 0x80u) << 24),
                              __byte_perm(lo, hi, 0x7362) | ((x & 0x800u) << 4) | ((x & 0x8000u) << 16)};
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const __nv_bfloat162 v = __hmul2(*reinterpret_cast<const __nv_bfloat162*>(&pair[j]), half_scale2);
      out[2 * k + j] = *reinterpret_cast<const uint32_t*>(&v);
    }
  }
  return make_uint4(out[0], out[1], out[2], out[3]);
}

// Lane `sub` of the kLanes lanes of a key copies its share of slot `off` of page `page` (of `block`
// slots) into the raw row at shared address `dst`.
template <int F, int kLanes>
__device__ __forceinline__ void copy_row(uint32_t dst, const uint8_t* page, uint32_t off, uint32_t block, int sub) {
  using R = Row<F>;
  const uint8_t* data = page + static_cast<int64_t>(off) * R::kData;
#pragma unroll
  for (int c = sub; c < R::kData / 16; c += kLanes) cp_async16(dst + c * 16, data + c * 16);
  const uint8_t* scales = page + static_cast<int64_t>(block) * R::kData + static_cast<int64_t>(off) * R::kScale;
  if constexpr (R::kScale == 8) {
    if (sub == kLanes / 2) cp_async8(dst + R::kData, scales);  // the lane with one data chunk fewer
  } else {
#pragma unroll
    for (int c = sub; c < R::kScale / 16; c += kLanes) cp_async16(dst + R::kData + c * 16, scales + c * 16);
  }
}

// Lane `sub` of the 8 lanes of a key converts chunks c = sub, sub + 8, ..., 56 + sub of raw row `src`
// into bf16 row `row` of the kRows-row tile at `tile`.
template <int F, int kRows>
__device__ __forceinline__ void dequant_row(const uint8_t* src, uint8_t* tile, int row, int sub) {
  if constexpr (F == kFp8_584) {
    // Chunk sub of each 64-dim block m (one 8-B load brings the row's seven scales), then rope chunk sub.
    const uint2 scales = *reinterpret_cast<const uint2*>(src + Row<F>::kData);
#pragma unroll
    for (int m = 0; m < 7; ++m) {
      const int c = 8 * m + sub;
      const uint2 codes = *reinterpret_cast<const uint2*>(src + c * 8);
      const float scale = ue8m0(m < 4 ? scales.x >> (8 * m) : scales.y >> (8 * (m - 4)));
      *reinterpret_cast<uint4*>(tile + swizzled<kRows>(row, c)) =
          make_uint4(dequant2(codes.x & 0xffff, scale), dequant2(codes.x >> 16, scale),
                     dequant2(codes.y & 0xffff, scale), dequant2(codes.y >> 16, scale));
    }
    *reinterpret_cast<uint4*>(tile + swizzled<kRows>(row, 56 + sub)) =
        *reinterpret_cast<const uint4*>(src + 448 + sub * 16);
  } else if constexpr (F == kFp8_528) {
    // Chunk c = 8 m + sub has scale byte c / 4 = 2 m + sub / 4: byte 2 (m % 2) + sub / 4 of word m / 2.
    const uint4 s = *reinterpret_cast<const uint4*>(src + Row<F>::kData);
    const uint32_t words[4] = {s.x, s.y, s.z, s.w};
    const int shift = 8 * (sub >> 2);
#pragma unroll
    for (int m = 0; m < 8; ++m) {
      const int c = 8 * m + sub;
      const uint2 codes = *reinterpret_cast<const uint2*>(src + c * 8);
      const float scale = ue8m0(words[m >> 1] >> (16 * (m & 1) + shift));
      *reinterpret_cast<uint4*>(tile + swizzled<kRows>(row, c)) =
          make_uint4(dequant2(codes.x & 0xffff, scale), dequant2(codes.x >> 16, scale),
                     dequant2(codes.y & 0xffff, scale), dequant2(codes.y >> 16, scale));
    }
  } else {
    // Chunk c = 8 m + sub: code bytes 4c .. 4c + 3, scale byte c / 2 = 4 m + sub / 2: byte sub / 2 of word m.
    const uint4 s0 = *reinterpret_cast<const uint4*>(src + Row<F>::kData);
    const uint4 s1 = *reinterpret_cast<const uint4*>(src + Row<F>::kData + 16);
    const uint32_t words[8] = {s0.x, s0.y, s0.z, s0.w, s1.x, s1.y, s1.z, s1.w};
    const int shift = 8 * (sub >> 1);
#pragma unroll
    for (int m = 0; m < 8; ++m) {
      const int c = 8 * m + sub;
      const __half_raw sh = __nv_cvt_fp8_to_halfraw(static_cast<__nv_fp8_storage_t>(words[m] >> shift), __NV_E4M3);
      const float half_scale = 0.5f * __half2float(*reinterpret_cast<const __half*>(&sh));
      *reinterpret_cast<uint4*>(tile + swizzled<kRows>(row, c)) = dequant_fp4x8(
          *reinterpret_cast<const uint32_t*>(src + c * 4), __floats2bfloat162_rn(half_scale, half_scale));
    }
  }
}
#endif  // DSV4_SM90_BODY

// fn(WF, CF) with the (window, entries) pair as std::integral_constant: V4 (584, 584), V4 with fp4
// entries (584, 288), V4.1 (528, 288), V4.1's sliding layers (528, 528: their entry list is empty).
// The pair was checked by `serves_formats`.
template <class Fn>
void with_formats(int window_fmt, int comp_fmt, Fn&& fn) {
  using Fp8_584 = std::integral_constant<int, kFp8_584>;
  using Fp8_528 = std::integral_constant<int, kFp8_528>;
  using Fp4_288 = std::integral_constant<int, kFp4_288>;
  if (window_fmt == kFp8_584) {
    if (comp_fmt == kFp8_584) {
      fn(Fp8_584{}, Fp8_584{});
    } else {
      fn(Fp8_584{}, Fp4_288{});
    }
  } else if (comp_fmt == kFp8_528) {
    fn(Fp8_528{}, Fp8_528{});
  } else {
    fn(Fp8_528{}, Fp4_288{});
  }
}

}  // namespace dsv4::sparse_attn
