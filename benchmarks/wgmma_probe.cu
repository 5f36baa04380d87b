// Probe of the wgmma operand layouts the ragged-attention kernel (ffi/ragged_cuda.cu) uses on
// sm_90a, one warpgroup, against the CPU:
//   S[64 x 64]  = Q[64 x 128] K[64 x 128]^T     A = Q, B = K: shared memory, K-major, 128B swizzle
//   O[64 x 128] = P[64 x 64] V[64 x 128]        A = P from registers, B = V: MN-major, 128B swizzle
// (the kernel takes q from registers too; the shared-memory layout of K and V is the one here).
// Prints max |err| for each (LBO, SBO) candidate of V's descriptor. On an H200 (2026-12-01):
// S exact; O exact for LBO = 8192 (the bytes between 64-dim blocks), SBO = 1024 (between
// 8-position groups), wrong for the other three. Build and run on a Hopper GPU:
//   nvcc -gencode arch=compute_90a,code=sm_90a -O2 -o wgmma_probe benchmarks/wgmma_probe.cu
//   ./wgmma_probe
#include <cuda_fp16.h>
#include <cstdio>
#include <cstdint>
#include <cstdlib>
#include <cmath>
#include <vector>

#define CHECK(x) do { cudaError_t e = (x); if (e != cudaSuccess) { printf("CUDA %s at %d\n", cudaGetErrorString(e), __LINE__); exit(1);} } while (0)

// Byte offset of element (row, col) of a [rows x 64] fp16 block, 128-byte rows, 128B swizzle.
__host__ __device__ inline int sw128(int row, int col) {
  return row * 128 + ((((col * 2) / 16) ^ (row % 8)) * 16) + (col * 2) % 16;
}

__device__ inline uint64_t desc(const void* smem, int lbo, int sbo) {
  const uint32_t addr = uint32_t(__cvta_generic_to_shared(smem));
  uint64_t d = 0;
  d |= uint64_t((addr & 0x3FFFF) >> 4);
  d |= uint64_t((lbo >> 4) & 0x3FFF) << 16;
  d |= uint64_t((sbo >> 4) & 0x3FFF) << 32;
  d |= uint64_t(1) << 62;  // 128B swizzle
  return d;
}

__device__ inline void fence() { asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory"); }
__device__ inline void commit() { asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory"); }
__device__ inline void wait0() { asm volatile("wgmma.wait_group.sync.aligned 0;\n" ::: "memory"); }

// S += A(desc) B(desc)^T, m64n64k16, both K-major.
__device__ inline void wgmma_ss_64x64(float (&d)[32], uint64_t a, uint64_t b, int scale_d) {
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %34, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,"
      "%24,%25,%26,%27,%28,%29,%30,%31}, %32, %33, p, 1, 1, 0, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]),
        "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]),
        "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "l"(a), "l"(b), "r"(scale_d));
}

// O += A(registers) B(desc), m64n128k16, B transposed (MN-major).
__device__ inline void wgmma_rs_64x128(float (&d)[64], const uint32_t (&a)[4], uint64_t b) {
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,"
      "%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,"
      "%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, "
      "{%64,%65,%66,%67}, %68, 1, 1, 1, 1;\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]),
        "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]),
        "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]),
        "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]),
        "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]),
        "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]),
        "+f"(d[62]), "+f"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
}

// Q, K: [64][128] fp16 row-major in global; P: [64][64]; V: [64 positions][128 dims].
// s_out [64][64], o_out [64][128] float.
__global__ void probe(const __half* q, const __half* k, const __half* p, const __half* v,
                      float* s_out, float* o_out, int v_lbo, int v_sbo) {
  extern __shared__ __align__(1024) uint8_t smem[];
  uint8_t* qs = smem;               // 2 blocks of [64 x 64]: 16 KB
  uint8_t* ks = smem + 16384;       // 16 KB
  uint8_t* vs = smem + 32768;       // 2 dim blocks of [64 positions x 64 dims]: 16 KB
  const int t = threadIdx.x;
  for (int i = t; i < 64 * 128; i += 128) {
    const int r = i / 128, c = i % 128;
    *reinterpret_cast<__half*>(qs + (c / 64) * 8192 + sw128(r, c % 64)) = q[i];
    *reinterpret_cast<__half*>(ks + (c / 64) * 8192 + sw128(r, c % 64)) = k[i];
    *reinterpret_cast<__half*>(vs + (c / 64) * 8192 + sw128(r, c % 64)) = v[i];
  }
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
  __syncthreads();

  const int warp = t / 32, lane = t % 32, g = lane / 4, qd = lane % 4;
  float s[32];
  for (int i = 0; i < 32; ++i) s[i] = 0.f;
  fence();
  for (int kk = 0; kk < 128; kk += 16) {
    const int block = kk / 64, off = (kk % 64) * 2;
    wgmma_ss_64x64(s, desc(qs + block * 8192 + off, 16, 1024),
                   desc(ks + block * 8192 + off, 16, 1024), 1);
  }
  commit();
  wait0();
  for (int j = 0; j < 8; ++j)
    for (int c = 0; c < 4; ++c) {
      const int row = 16 * warp + g + 8 * (c >> 1), col = 8 * j + 2 * qd + (c & 1);
      s_out[row * 64 + col] = s[4 * j + c];
    }

  float o[64];
  for (int i = 0; i < 64; ++i) o[i] = 0.f;
  fence();
  for (int kk = 0; kk < 64; kk += 16) {
    uint32_t a[4];
    const auto at = [&](int row, int col) {
      const __half2 h = __halves2half2(p[row * 64 + col], p[row * 64 + col + 1]);
      return *reinterpret_cast<const uint32_t*>(&h);
    };
    const int r0 = 16 * warp + g;
    a[0] = at(r0, kk + 2 * qd);
    a[1] = at(r0 + 8, kk + 2 * qd);
    a[2] = at(r0, kk + 2 * qd + 8);
    a[3] = at(r0 + 8, kk + 2 * qd + 8);
    // 16 positions = two 8-row groups of the atom: start at position kk.
    wgmma_rs_64x128(o, a, desc(vs + kk * 128, v_lbo, v_sbo));
  }
  commit();
  wait0();
  for (int j = 0; j < 16; ++j)
    for (int c = 0; c < 4; ++c) {
      const int row = 16 * warp + g + 8 * (c >> 1), col = 8 * j + 2 * qd + (c & 1);
      o_out[row * 128 + col] = o[4 * j + c];
    }
}

int main() {
  std::vector<__half> q(64 * 128), k(64 * 128), p(64 * 64), v(64 * 128);
  std::vector<float> qf(q.size()), kf(k.size()), pf(p.size()), vf(v.size());
  srand(1);
  auto rnd = [] { return float(rand() % 17 - 8) / 8.f; };  // exact in fp16
  for (size_t i = 0; i < q.size(); ++i) { qf[i] = rnd(); q[i] = __float2half(qf[i]); }
  for (size_t i = 0; i < k.size(); ++i) { kf[i] = rnd(); k[i] = __float2half(kf[i]); }
  for (size_t i = 0; i < p.size(); ++i) { pf[i] = rnd(); p[i] = __float2half(pf[i]); }
  for (size_t i = 0; i < v.size(); ++i) { vf[i] = rnd(); v[i] = __float2half(vf[i]); }
  std::vector<double> s_ref(64 * 64), o_ref(64 * 128);
  for (int r = 0; r < 64; ++r)
    for (int c = 0; c < 64; ++c) {
      double acc = 0;
      for (int d = 0; d < 128; ++d) acc += double(qf[r * 128 + d]) * kf[c * 128 + d];
      s_ref[r * 64 + c] = acc;
    }
  for (int r = 0; r < 64; ++r)
    for (int c = 0; c < 128; ++c) {
      double acc = 0;
      for (int t = 0; t < 64; ++t) acc += double(pf[r * 64 + t]) * vf[t * 128 + c];
      o_ref[r * 128 + c] = acc;
    }
  __half *dq, *dk, *dp, *dv;
  float *ds, *dO;
  CHECK(cudaMalloc(&dq, q.size() * 2)); CHECK(cudaMalloc(&dk, k.size() * 2));
  CHECK(cudaMalloc(&dp, p.size() * 2)); CHECK(cudaMalloc(&dv, v.size() * 2));
  CHECK(cudaMalloc(&ds, 64 * 64 * 4)); CHECK(cudaMalloc(&dO, 64 * 128 * 4));
  CHECK(cudaMemcpy(dq, q.data(), q.size() * 2, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(dk, k.data(), k.size() * 2, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(dp, p.data(), p.size() * 2, cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(dv, v.data(), v.size() * 2, cudaMemcpyHostToDevice));
  CHECK(cudaFuncSetAttribute(probe, cudaFuncAttributeMaxDynamicSharedMemorySize, 49152 + 1024));
  const int candidates[][2] = {{8192, 1024}, {1024, 8192}, {16, 1024}, {1024, 16}};
  for (const auto& cand : candidates) {
    CHECK(cudaMemset(ds, 0xFF, 64 * 64 * 4));
    CHECK(cudaMemset(dO, 0xFF, 64 * 128 * 4));
    probe<<<1, 128, 49152>>>(dq, dk, dp, dv, ds, dO, cand[0], cand[1]);
    CHECK(cudaGetLastError());
    CHECK(cudaDeviceSynchronize());
    std::vector<float> s(64 * 64), o(64 * 128);
    CHECK(cudaMemcpy(s.data(), ds, s.size() * 4, cudaMemcpyDeviceToHost));
    CHECK(cudaMemcpy(o.data(), dO, o.size() * 4, cudaMemcpyDeviceToHost));
    double es = 0, eo = 0;
    for (size_t i = 0; i < s.size(); ++i) es = fmax(es, std::isnan(s[i]) ? 1e30 : fabs(s[i] - s_ref[i]));
    for (size_t i = 0; i < o.size(); ++i) eo = fmax(eo, std::isnan(o[i]) ? 1e30 : fabs(o[i] - o_ref[i]));
    printf("V desc LBO=%5d SBO=%5d: S max err %.3g   O max err %.3g\n", cand[0], cand[1], es, eo);
  }
  return 0;
}
