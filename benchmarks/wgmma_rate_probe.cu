// Probe of wgmma's rate at the wide path's shape (ffi/few_rows_wide.cuh: S^T = K Q^T as
// m64n32k16, A from registers, B K-major with the 128-byte swizzle in shared memory), against
// m64n64k16 and m64n128k16, with 1 to 4 one-warpgroup CTAs a SM (shared memory sized so that
// exactly that many fit). Each CTA runs chains of 8 products on one accumulator (one or two
// chains in flight), waits, and repeats. Prints the cycles an iteration takes a CTA, the
// cycles a product takes the SM (all its CTAs at once) and TFLOP/s.
//
// Why (benchmarks/NOTES.md, "Where it stands (end of the thirty-seventh session)"): the wide
// kernel took the same time with ~2 and ~3 CTAs a SM, so a unit the CTAs share limits it; its
// 16 m64n32k16 a step of 64 positions would be that unit if a narrow product costs the tensor
// pipe much more than its FLOPs. Written in the thirty-seventh session; run in the
// thirty-eighth on an H100: m64n32k16 16.0 cycles of the SM a product from two CTAs a SM on,
// the pipe's full FLOP rate, so not that unit (benchmarks/NOTES.md, "Where it stands (end of
// the thirty-eighth session)"). Build and run on a Hopper GPU, from the repository root:
//   nvcc -gencode arch=compute_90a,code=sm_90a -O2 -I ffi -o probe benchmarks/wgmma_rate_probe.cu
//   ./probe
#include <cuda_fp16.h>

#include <cstdint>
#include <cstdio>

#include "cuda_check.h"
#include "wgmma.cuh"

using namespace nvfp4;

// B operands read: up to two 64-dim blocks of N rows x 128 bytes (N = 128: 32 KB).
constexpr int kBytes = 2 * 128 * 128;

template <int N, int kChains>
__global__ void __launch_bounds__(128) rate(int iters, float* sink, long long* cycles) {
  extern __shared__ __align__(1024) uint8_t smem[];
  // fp16 values near 1 (no zeros, no subnormals: the pipe's rate should not depend on them)
  for (int i = threadIdx.x; i < kBytes / 4; i += 128)
    reinterpret_cast<uint32_t*>(smem)[i] = 0x3C003C00u ^ (i * 2654435761u & 0x03FF03FFu);
  __syncthreads();
  fence_proxy_async_shared();
  uint32_t a[8][4];
  for (int k = 0; k < 8; ++k)
    for (int r = 0; r < 4; ++r) a[k][r] = 0x3C003C00u ^ ((threadIdx.x * 7 + k * 13 + r) & 0xFF00FF);
  const uint64_t desc = swizzled_desc(smem, 16, 1024);
  float d[kChains][N / 2];
  for (int c = 0; c < kChains; ++c)
    for (int r = 0; r < N / 2; ++r) d[c][r] = 0.f;
  const long long t0 = clock64();
  for (int it = 0; it < iters; ++it) {
    for (int c = 0; c < kChains; ++c) wgmma_fence_operands(d[c]);
    wgmma_fence();
#pragma unroll
    for (int c = 0; c < kChains; ++c)
#pragma unroll
      for (int k = 0; k < 8; ++k) {  // 128 dims in k16 steps, as the wide kernel's S^T
        const uint64_t b = desc_plus(desc, (k >> 2) * (N * 128) + (k & 3) * 32);
        if constexpr (N == 32)
          wgmma_64x32(d[c], a[k], b);
        else if constexpr (N == 64)
          wgmma_64x64<0>(d[c], a[k], b);
        else
          wgmma_64x128<0>(d[c], a[k], b);
      }
    wgmma_commit();
    wgmma_wait<0>();
    for (int c = 0; c < kChains; ++c) wgmma_fence_operands(d[c]);
  }
  const long long t1 = clock64();
  float s = 0.f;
  for (int c = 0; c < kChains; ++c)
    for (int r = 0; r < N / 2; ++r) s += d[c][r];
  if (s == 12345.f) sink[threadIdx.x] = s;  // keeps the products
  if (threadIdx.x == 0) cycles[blockIdx.x] = t1 - t0;
}

template <int N, int kChains>
void run(int sms, int per_sm) {
  constexpr int kIters = 2000;
  float* sink;
  long long* cycles;
  CHECK(cudaMalloc(&sink, 128 * sizeof(float)));
  CHECK(cudaMalloc(&cycles, sizeof(long long) * sms * per_sm));
  const auto kernel = rate<N, kChains>;
  // Shared memory sized so that exactly per_sm CTAs fit an SM (228 KB a SM), each >= kBytes.
  const int smem = (per_sm == 1 ? 120 : per_sm == 2 ? 100 : per_sm == 3 ? 70 : 50) * 1024;
  CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  kernel<<<sms * per_sm, 128, smem>>>(10, sink, cycles);  // warm-up
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  CHECK(cudaEventRecord(e0));
  kernel<<<sms * per_sm, 128, smem>>>(kIters, sink, cycles);
  CHECK(cudaEventRecord(e1));
  CHECK(cudaEventSynchronize(e1));
  CHECK(cudaGetLastError());
  float ms;
  CHECK(cudaEventElapsedTime(&ms, e0, e1));
  long long c0;
  CHECK(cudaMemcpy(&c0, cycles, sizeof(c0), cudaMemcpyDeviceToHost));
  const double products = 8.0 * kChains;
  const double flop = 2.0 * 64 * N * 16 * products * kIters * sms * per_sm;
  std::printf("m64n%-3dk16, %d chain(s), %d CTA(s) a SM: %8.1f cycles an iteration a CTA, "
              "%6.1f cycles a product a SM, %6.1f TFLOP/s\n",
              N, kChains, per_sm, double(c0) / kIters, double(c0) / kIters / (products * per_sm),
              flop / (ms * 1e-3) / 1e12);
  CHECK(cudaFree(sink));
  CHECK(cudaFree(cycles));
}

int main() {
  int sms;
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
  for (int per_sm = 1; per_sm <= 4; ++per_sm) run<32, 1>(sms, per_sm);
  for (int per_sm = 1; per_sm <= 3; ++per_sm) run<32, 2>(sms, per_sm);
  for (int per_sm = 1; per_sm <= 3; ++per_sm) run<64, 1>(sms, per_sm);
  for (int per_sm = 1; per_sm <= 2; ++per_sm) run<128, 1>(sms, per_sm);
  return 0;
}
