// Probe of the wgmma operand layouts the ragged-attention kernel (ffi/ragged_cuda.cu) uses on
// sm_90a, with the kernel's own helpers (ffi/wgmma.cuh), one warpgroup, against the CPU:
//   S[64 x 64]  = Q[64 x 128] K[64 x 128]^T   A = Q from registers, B = K in shared memory:
//                                             K-major, 128-byte swizzle, 64-dim blocks
//   O[64 x 128] = P[64 x 64] V[64 x 128]      A = P from registers, B = V, the same storage
//                                             read MN-major
// Prints max |err| for each (LBO, SBO) candidate of V's descriptor (the kernel uses the first:
// the bytes between 64-dim blocks, between 8-position groups). On an H200 (2026-12-01, with the
// helpers inline in the kernel then): S exact; O exact for the first candidate, wrong for the
// other three. Build and run on a Hopper GPU, from the repository root:
//   nvcc -gencode arch=compute_90a,code=sm_90a -O2 -I ffi -o wgmma_probe benchmarks/wgmma_probe.cu
//   ./wgmma_probe
#include <cuda_fp16.h>

#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "cuda_check.h"
#include "wgmma.cuh"

using namespace nvfp4;

constexpr int kBlockBytes = 64 * 128;  // one 64-dim block of 64 positions (rows)

// The A fragment of rows 16 w .. 16 w + 15, columns k0 .. k0 + 15 of a row-major [64 x cols]
// fp16 matrix (the mma.sync A layout, which wgmma takes from registers).
__device__ void a_fragment(const __half* m, int cols, int k0, uint32_t (&a)[4]) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, q = lane % 4;
  const auto at = [&](int row, int col) {
    const __half2 h = __halves2half2(m[row * cols + col], m[row * cols + col + 1]);
    return *reinterpret_cast<const uint32_t*>(&h);
  };
  const int r0 = 16 * warp + g;
  a[0] = at(r0, k0 + 2 * q);
  a[1] = at(r0 + 8, k0 + 2 * q);
  a[2] = at(r0, k0 + 2 * q + 8);
  a[3] = at(r0 + 8, k0 + 2 * q + 8);
}

__device__ void store_accumulators(const float* d, int cols, float* out) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, g = lane / 4, q = lane % 4;
  for (int j = 0; j < cols / 8; ++j)
    for (int c = 0; c < 4; ++c)
      out[(16 * warp + g + 8 * (c >> 1)) * cols + 8 * j + 2 * q + (c & 1)] = d[4 * j + c];
}

// q, k: [64][128]; p: [64][64]; v: [64 positions][128 dims], row-major fp16 in global memory.
__global__ void probe(const __half* q, const __half* k, const __half* p, const __half* v,
                      float* s_out, float* o_out, int v_lbo, int v_sbo) {
  extern __shared__ __align__(1024) uint8_t smem[];
  uint8_t* ks = smem;                 // [2 dim blocks][64 positions][64 dims]
  uint8_t* vs = smem + 2 * kBlockBytes;
  for (int i = threadIdx.x; i < 64 * 128; i += 128) {
    const int r = i / 128, c = i % 128;
    *reinterpret_cast<__half*>(ks + (c / 64) * kBlockBytes + swizzle128_offset(r, c % 64)) = k[i];
    *reinterpret_cast<__half*>(vs + (c / 64) * kBlockBytes + swizzle128_offset(r, c % 64)) = v[i];
  }
  fence_proxy_async_shared();
  __syncthreads();

  float s[32] = {};
  uint32_t a[4];
  wgmma_fence();
  for (int kk = 0; kk < 128; kk += 16) {  // as the kernel: dims 16 k .. of each K row
    a_fragment(q, 128, kk, a);
    wgmma_64x64<0>(s, a, swizzled_desc(ks + (kk / 64) * kBlockBytes + (kk % 64) * 2, 16, 1024));
  }
  wgmma_commit_and_wait();
  store_accumulators(s, 64, s_out);

  float o[64] = {};
  wgmma_fence();
  for (int kk = 0; kk < 64; kk += 16) {  // as the kernel: positions 16 k .., MN-major
    a_fragment(p, 64, kk, a);
    wgmma_64x128<1>(o, a, swizzled_desc(vs + kk * 128, v_lbo, v_sbo));
  }
  wgmma_commit_and_wait();
  store_accumulators(o, 128, o_out);
}

int main() {
  std::vector<__half> q(64 * 128), k(64 * 128), p(64 * 64), v(64 * 128);
  std::vector<float> qf(q.size()), kf(k.size()), pf(p.size()), vf(v.size());
  srand(1);
  const auto rnd = [] { return float(rand() % 17 - 8) / 8.f; };  // exact in fp16
  for (size_t i = 0; i < q.size(); ++i) q[i] = __float2half(qf[i] = rnd());
  for (size_t i = 0; i < k.size(); ++i) k[i] = __float2half(kf[i] = rnd());
  for (size_t i = 0; i < p.size(); ++i) p[i] = __float2half(pf[i] = rnd());
  for (size_t i = 0; i < v.size(); ++i) v[i] = __float2half(vf[i] = rnd());
  std::vector<double> s_ref(64 * 64, 0.0), o_ref(64 * 128, 0.0);
  for (int r = 0; r < 64; ++r)
    for (int c = 0; c < 64; ++c)
      for (int d = 0; d < 128; ++d) s_ref[r * 64 + c] += double(qf[r * 128 + d]) * kf[c * 128 + d];
  for (int r = 0; r < 64; ++r)
    for (int c = 0; c < 128; ++c)
      for (int t = 0; t < 64; ++t) o_ref[r * 128 + c] += double(pf[r * 64 + t]) * vf[t * 128 + c];

  __half *dq, *dk, *dp, *dv;
  float *ds, *dO;
  CHECK(cudaMalloc(&dq, q.size() * 2));
  CHECK(cudaMalloc(&dk, k.size() * 2));
  CHECK(cudaMalloc(&dp, p.size() * 2));
  CHECK(cudaMalloc(&dv, v.size() * 2));
  CHECK(cudaMalloc(&ds, s_ref.size() * 4));
  CHECK(cudaMalloc(&dO, o_ref.size() * 4));
  CHECK(cudaMemcpy(dq, q.data(), q.size() * 2, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(dk, k.data(), k.size() * 2, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(dp, p.data(), p.size() * 2, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(dv, v.data(), v.size() * 2, cudaMemcpyHostToDevice));
  const int smem = 4 * kBlockBytes;
  CHECK(cudaFuncSetAttribute(probe, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  const int candidates[][2] = {{kBlockBytes, 1024}, {1024, kBlockBytes}, {16, 1024}, {1024, 16}};
  int failures = 0;
  for (const auto& cand : candidates) {
    CHECK(cudaMemset(ds, 0xFF, s_ref.size() * 4));  // NaN: every output must be written
    CHECK(cudaMemset(dO, 0xFF, o_ref.size() * 4));
    probe<<<1, 128, smem>>>(dq, dk, dp, dv, ds, dO, cand[0], cand[1]);
    CHECK(cudaGetLastError());
    CHECK(cudaDeviceSynchronize());
    std::vector<float> s(s_ref.size()), o(o_ref.size());
    CHECK(cudaMemcpy(s.data(), ds, s.size() * 4, cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(o.data(), dO, o.size() * 4, cudaMemcpyDeviceToHost));
    double es = 0, eo = 0;
    for (size_t i = 0; i < s.size(); ++i) es = fmax(es, std::isnan(s[i]) ? 1e30 : fabs(s[i] - s_ref[i]));
    for (size_t i = 0; i < o.size(); ++i) eo = fmax(eo, std::isnan(o[i]) ? 1e30 : fabs(o[i] - o_ref[i]));
    printf("V descriptor LBO=%5d SBO=%5d: S max err %.3g, O max err %.3g\n", cand[0], cand[1], es,
           eo);
    if (&cand == &candidates[0]) failures += es != 0 || eo != 0;  // the kernel's choice: exact
  }
  printf(failures ? "FAILED: the kernel's layout is not exact\n" : "the kernel's layout: exact\n");
  return failures;
}
