// racecheck's reports on named-barrier hand-offs, reproduced on a kernel whose synchronization is
// correct. csrc/sparse_attn's kernels hand tiles between warpgroups with bar.arrive -> bar.sync on
// named barriers that count fewer threads than the CTA (warp specialization); compute-sanitizer's
// racecheck (CUDA 13.0, H100) reports hazards on such hand-offs, and on a later bar.sync exchange
// between the same warpgroups, although PTX orders every access below (a bar.arrive's prior accesses
// are visible to the threads that bar.sync on the same barrier). 512 threads: warps 0-3 = A, 4-7 = B,
// 8-15 = P, the roles of sparse_attn.cu's warpgroup 0, warpgroup 1 and producers.
//
//   nvcc -gencode=arch=compute_90a,code=sm_90a tests/racecheck_named_barriers.cu -o /tmp/rnb
//   compute-sanitizer --tool racecheck /tmp/rnb 0   # A -> B exchange alone: 0 hazards
//   compute-sanitizer --tool racecheck /tmp/rnb 1   # after the hand-offs: hazards on both
//
// Mode 1: P hands 16 tiles to A (P arrives on FULL, 384 threads; A and B arrive on EMPTY, 512, P
// syncs), A hands each tile's result to B through two buffers (FULL / EMPTY pairs of 256 threads),
// then both modes run the same exchange: A writes z, A and B bar.sync (256), B reads z.
#include <cstdio>
#include <cstdlib>

__device__ __forceinline__ void arrive(int id, int n) { asm volatile("bar.arrive %0, %1;" ::"r"(id), "r"(n) : "memory"); }
__device__ __forceinline__ void sync(int id, int n) { asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(n) : "memory"); }

constexpr int kTiles = 16;

__global__ void handoffs(float* out, int mode) {
  __shared__ float tile[3][256];  // P -> A
  __shared__ float pass[2][128];  // A -> B
  __shared__ float z[128];        // the final exchange
  const int w = threadIdx.x >> 5, t = threadIdx.x & 127;
  float acc = 0.f;
  if (mode == 1) {
    for (int i = 0; i < kTiles; ++i) {
      const int b = i & 1, kb = i % 3;
      if (w >= 8) {
        const int tp = threadIdx.x - 256;
        if (i >= 3) sync(8 + kb, 512);
        tile[kb][tp] = tp + i;
        arrive(5 + kb, 384);
      } else if (w < 4) {
        sync(5 + kb, 384);
        const float x = tile[kb][t] + tile[kb][t + 128];
        if (i >= 2) sync(3 + b, 256);
        pass[b][t] = x;
        arrive(1 + b, 256);
        if (i + 3 < kTiles) arrive(8 + kb, 512);
      } else {
        sync(1 + b, 256);
        acc += pass[b][t ^ 1];
        if (i + 2 < kTiles) arrive(3 + b, 256);
        if (i + 3 < kTiles) arrive(8 + kb, 512);
      }
    }
  }
  if (w < 4) z[t] = static_cast<float>(t);
  if (w < 8) sync(12, 256);
  if (w >= 4 && w < 8) out[t] = z[t ^ 1] + acc;
}

int main(int argc, char** argv) {
  const int mode = argc > 1 ? atoi(argv[1]) : 1;
  float* out;
  cudaMalloc(&out, 128 * sizeof(float));
  handoffs<<<1, 512>>>(out, mode);
  float h[128];
  cudaMemcpy(h, out, sizeof h, cudaMemcpyDeviceToHost);
  // B's thread t reads A's t ^ 1: z = t ^ 1, and in mode 1 the sum over tiles of tile[t ^ 1] + tile[(t ^ 1) + 128].
  double want = 5.0;
  for (int i = 0; mode == 1 && i < kTiles; ++i) want += (5 + i) + (5 + 128 + i);
  printf("mode %d: out[4] = %g (want %g) %s\n", mode, h[4], want, cudaGetErrorString(cudaGetLastError()));
  return h[4] == want ? 0 : 1;
}
