// SPDX-License-Identifier: MIT
// Programmatic dependent launch (sm_90+). A kernel launched with `launch_pdl` may be scheduled while
// the kernel before it in the stream is still running (once every CTA of that one has called
// `launch_dependents` or exited), so its launch latency hides behind the other's tail. Its CTAs must
// call `wait_prior_grid` before any global read or write: that returns once the previous grid has
// completed and its writes are visible. The wait comes first in every CTA, early exits included: a
// grid whose CTAs all left before waiting could complete before its own predecessor, and the next
// kernel's wait would then no longer cover that one. In a grid launched without the attribute both
// are no-ops. Captured into CUDA graphs as programmatic edges (CUDA >= 12.3).
#pragma once
#include <cuda_runtime.h>

#include <utility>

namespace dsv4::pdl {

__device__ __forceinline__ void wait_prior_grid() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory");
#endif
}

// kCooperative: also a cooperative launch (every CTA resident at once, for grid-wide barriers).
template <bool kCooperative = false, typename... Params, typename... Args>
cudaError_t launch_pdl(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                       Args&&... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attributes[2]{};
  attributes[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attributes[0].val.programmaticStreamSerializationAllowed = 1;
  attributes[1].id = cudaLaunchAttributeCooperative;
  attributes[1].val.cooperative = 1;
  config.attrs = attributes;
  config.numAttrs = kCooperative ? 2 : 1;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}

}  // namespace dsv4::pdl
