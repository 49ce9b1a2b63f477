// SPDX-License-Identifier: MIT
// MXFP4 rows for the sm_90 scoring kernel (score.cu): V4.1's 68-B index keys and MX4 queries, 128 e2m1
// values (element 2i in the low nibble of byte i) with a UE8M0 scale per 32 (dsv4ops/quant/formats.py
// mxfp4_68). Hopper has no FP4 tensor-core input, but every e2m1 value is exact in e4m3, so a row
// becomes 128 e4m3 codes whose 32-element groups each feed one k32 e4m3 wgmma; the group scales
// 2^(eq + ek) multiply the four groups' fp32 products afterwards (a scale per row could not: a row's
// groups have different scales), which keeps the dot exact up to fp32 accumulation, as the reference's.
#pragma once
#include <cstdint>

namespace dsv4::indexer {

constexpr int kMxData = 64;   // bytes of a row's nibbles (the data plane)
constexpr int kMxScale = 4;   // its UE8M0 bytes (the scale plane)
constexpr int kMxGroups = 4;  // scale groups of 32 = the K of one e4m3 wgmma

#ifdef __CUDACC__
// Four e2m1 codes (16 bits, element i in bits 4i .. 4i + 3) -> four e4m3 codes (byte i): magnitudes
// 0, 0.5, 1, 1.5, 2, 3, 4, 6 are e4m3 0x00 0x30 0x38 0x3c 0x40 0x44 0x48 0x4c (one PRMT from an 8-byte
// table), the sign bit moves from bit 3 of the nibble to bit 7 of the byte.
__device__ __forceinline__ uint32_t e2m1x4_to_e4m3x4(uint32_t x) {
  constexpr uint32_t kLow = 0x3c383000u, kHigh = 0x4c484440u;
  return __byte_perm(kLow, kHigh, x & 0x7777u) | ((x & 0x8u) << 4) | ((x & 0x80u) << 8) | ((x & 0x800u) << 12) |
         ((x & 0x8000u) << 16);
}
// The same from x (its low 16 bits: the codes' two bytes b, b') and y = [b, b, b', b']: the sign bits
// of elements 0 and 2 sit 4 below their byte's bit 7 in y, those of 1 and 3 on it (two operations
// instead of eight).
__device__ __forceinline__ uint32_t e2m1x4_to_e4m3x4(uint32_t x, uint32_t y) {
  constexpr uint32_t kLow = 0x3c383000u, kHigh = 0x4c484440u;
  return __byte_perm(kLow, kHigh, x & 0x7777u) | ((y << 4) & 0x00800080u) | (y & 0x80008000u);
}

// UE8M0 byte e -> 2^(e - 127) (e = 0: 2^-127, a subnormal fp32; no UE8M0 writer stores it).
__device__ __forceinline__ float ue8m0_value(uint32_t byte) {
  return byte ? __uint_as_float((byte & 0xffu) << 23) : 0x1p-127f;
}
#endif

}  // namespace dsv4::indexer
