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
// `cluster` other than 1 x 1 x 1: thread-block clusters of that shape (co-scheduled CTAs that read
// each other's shared memory).
template <bool kCooperative = false, typename... Params, typename... Args>
cudaError_t launch_pdl_clusters(void (*kernel)(Params...), dim3 grid, dim3 block, dim3 cluster, size_t smem,
                                cudaStream_t stream, Args&&... args) {
  cudaLaunchConfig_t config{};
  config.gridDim = grid;
  config.blockDim = block;
  config.dynamicSmemBytes = smem;
  config.stream = stream;
  cudaLaunchAttribute attributes[3]{};
  unsigned n = 0;
  attributes[n].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attributes[n++].val.programmaticStreamSerializationAllowed = 1;
  if (kCooperative) {
    attributes[n].id = cudaLaunchAttributeCooperative;
    attributes[n++].val.cooperative = 1;
  }
  if (cluster.x * cluster.y * cluster.z > 1) {
    attributes[n].id = cudaLaunchAttributeClusterDimension;
    attributes[n].val.clusterDim.x = cluster.x;
    attributes[n].val.clusterDim.y = cluster.y;
    attributes[n++].val.clusterDim.z = cluster.z;
  }
  config.attrs = attributes;
  config.numAttrs = n;
  return cudaLaunchKernelEx(&config, kernel, std::forward<Args>(args)...);
}
template <bool kCooperative = false, typename... Params, typename... Args>
cudaError_t launch_pdl(void (*kernel)(Params...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                       Args&&... args) {
  return launch_pdl_clusters<kCooperative>(kernel, grid, block, dim3(1, 1, 1), smem, stream,
                                           std::forward<Args>(args)...);
}

}  // namespace dsv4::pdl
