// SPDX-License-Identifier: MIT
// Device helpers shared by the router kernels: the V4 score, an order-preserving key, loads by dtype.
#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

namespace dsv4::router {

constexpr unsigned kFullMask = 0xffffffffu;
constexpr int kWarpsPerBlock = 4;  // one warp per token; 128 threads keep 16 blocks resident per SM

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }

// sqrt(softplus(x)) as torch computes it in fp32: softplus passes x through above threshold 20.
__device__ __forceinline__ float sqrt_softplus(float x) { return sqrtf(x > 20.f ? x : log1pf(expf(x))); }

// Maps a float to a uint32 whose unsigned order is the float order, with NaN above +inf as in
// torch.sort. 0 is no float's key (-inf maps to 0x007fffff), so it marks padding.
__device__ __forceinline__ uint32_t order_key(float x) {
  if (isnan(x)) return 0xffffffffu;
  const uint32_t b = __float_as_uint(x);
  return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

__device__ __forceinline__ int64_t load_index(const void* base, bool is_int64, int64_t offset) {
  return is_int64 ? static_cast<const int64_t*>(base)[offset] : static_cast<const int32_t*>(base)[offset];
}

}  // namespace dsv4::router
