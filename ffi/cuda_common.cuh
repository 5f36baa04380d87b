// CUDA helpers shared by the kernels (store, decode and ragged attention).
#pragma once

#include <cuda_runtime.h>

#include <atomic>
#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace nvfp4 {

// Shared memory an sm_90 CTA may have, static and dynamic together (232448 bytes).
constexpr int kMaxSmemPerCta = 227 * 1024;

// Division by a divisor fixed at launch, as a multiply-high and a shift (Granlund-Montgomery):
// 32-bit integer division is a long instruction sequence on the GPU. Exact for numerators
// below 2^31.
struct FastDivmod {
  uint32_t divisor = 1, multiplier = 0, shift = 0;

  FastDivmod() = default;
  explicit FastDivmod(uint32_t d) : divisor(d) {
    if (d == 1) return;
    uint32_t log2_ceil = 0;
    while ((uint64_t(1) << log2_ceil) < d) ++log2_ceil;
    shift = log2_ceil - 1;
    multiplier = uint32_t(((uint64_t(1) << 32) * ((uint64_t(1) << log2_ceil) - d)) / d + 1);
  }
  __device__ __forceinline__ uint32_t div(uint32_t n) const {
    if (divisor == 1) return n;
    const uint32_t t = __umulhi(n, multiplier);
    return (t + ((n - t) >> 1)) >> shift;
  }
  __device__ __forceinline__ uint32_t divmod(uint32_t n, uint32_t* rem) const {
    const uint32_t q = div(n);
    *rem = n - q * divisor;
    return q;
  }
};

// A CUDA failure as an FFI error naming the operation (e.g. "reshape_and_cache") and the step.
inline xla::ffi::Error CudaError(const char* operation, const char* what, cudaError_t error) {
  return xla::ffi::Error(xla::ffi::ErrorCode::kInternal, std::string("jax_nvfp4 ") + operation +
                                                             ": " + what + ": " +
                                                             cudaGetErrorString(error));
}

// Runs `set` (-> cudaError_t) once per device that it succeeds on, `done` holding a bit per
// device (devices 64+: every time). For function attributes: they belong to the device's
// module, and setting them on every launch would cost driver calls a step.
template <typename Set>
cudaError_t OncePerDevice(std::atomic<uint64_t>& done, Set&& set) {
  int device = 0;
  cudaError_t error = cudaGetDevice(&device);
  if (error != cudaSuccess) return error;
  const uint64_t bit = device < 64 ? uint64_t(1) << device : 0;
  if (bit && (done.load(std::memory_order_acquire) & bit)) return cudaSuccess;
  error = set();
  if (error == cudaSuccess) done.fetch_or(bit, std::memory_order_release);
  return error;
}

// A kernel's `bytes` of dynamic shared memory (more than the default 48 KB) and all of L1 as
// shared memory where possible, once per device.
template <auto kKernel>
cudaError_t ConfigureSharedMemory(int bytes) {
  static std::atomic<uint64_t> configured{0};
  return OncePerDevice(configured, [&] {
    cudaError_t error =
        cudaFuncSetAttribute(kKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
    if (error == cudaSuccess)
      error = cudaFuncSetAttribute(kKernel, cudaFuncAttributePreferredSharedMemoryCarveout,
                                   cudaSharedmemCarveoutMaxShared);
    return error;
  });
}

// The same where the kernel takes any dynamic shared memory; nothing to set where it takes none.
template <auto kKernel>
cudaError_t ConfigureDynamicSmem(int bytes) {
  return bytes > 0 ? ConfigureSharedMemory<kKernel>(bytes) : cudaSuccess;
}

// CTAs of kKernel (launched with `threads` threads and `smem_bytes` of dynamic shared memory,
// configured first: ConfigureDynamicSmem) that fit on one SM of the current GPU, as the split
// plans ask (0, the error cleared, if CUDA fails).
template <auto kKernel>
int ResidentCtasPerSm(int threads, int smem_bytes) {
  int ctas = 0;
  if (ConfigureDynamicSmem<kKernel>(smem_bytes) != cudaSuccess ||
      cudaOccupancyMaxActiveBlocksPerMultiprocessor(&ctas, kKernel, threads, smem_bytes) !=
          cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return ctas;
}

// Asynchronous global -> shared copies (cp.async, sm_80 and up), zero-filled without reading
// when !valid. The commit and the wait are compiler memory barriers too: shared memory the
// copies fill is read after the wait, not before.
// The destination as a shared-memory address (copy_async_to) or a generic pointer (copy_async).
template <int kBytes>
__device__ __forceinline__ void copy_async_to(uint32_t dst, const void* src, bool valid) {
  static_assert(kBytes == 4 || kBytes == 8 || kBytes == 16, "cp.async copies 4, 8 or 16 bytes");
  const uint32_t n = valid ? kBytes : 0;
  if constexpr (kBytes == 16)
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" :: "r"(dst), "l"(src), "r"(n));
  else
    asm volatile("cp.async.ca.shared.global [%0], [%1], %2, %3;\n"
                 :: "r"(dst), "l"(src), "n"(kBytes), "r"(n));
}
template <int kBytes>
__device__ __forceinline__ void copy_async(void* dst, const void* src, bool valid) {
  copy_async_to<kBytes>(uint32_t(__cvta_generic_to_shared(dst)), src, valid);
}
// A 16-byte store to a shared-memory address (like copy_async_to's destination: addresses
// worked out as 32-bit shared addresses, e.g. with XOR swizzles, which a generic pointer would
// turn into a generic store).
__device__ __forceinline__ void store_shared(uint32_t address, uint4 v) {
  asm volatile("st.shared.v4.b32 [%0], {%1, %2, %3, %4};\n" ::"r"(address), "r"(v.x), "r"(v.y),
               "r"(v.z), "r"(v.w) : "memory");
}
__device__ __forceinline__ void copy_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
template <int kPending>
__device__ __forceinline__ void copy_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" :: "n"(kPending) : "memory");
}

// The self-checks: how many of the 2^32 bit patterns u of a 32-bit word (a float, or eight E2M1
// codes) a rule fails on (differs(u): 0 or 1). -1 if CUDA failed.
template <typename Differs>
__global__ void Every32BitsKernel(unsigned long long* mismatches, Differs differs) {
  unsigned long long local = 0;
  for (uint64_t u = uint64_t(blockIdx.x) * blockDim.x + threadIdx.x; u <= 0xFFFFFFFFull;
       u += uint64_t(gridDim.x) * blockDim.x)
    local += differs(uint32_t(u));
  atomicAdd(mismatches, local);
}

template <typename Differs>
int64_t CountOnEvery32Bits(Differs differs) {
  unsigned long long* count = nullptr;
  if (cudaMalloc(&count, sizeof(*count)) != cudaSuccess) return -1;
  unsigned long long host = 0;
  bool ok = cudaMemset(count, 0, sizeof(*count)) == cudaSuccess;
  if (ok) {
    Every32BitsKernel<<<1024, 256>>>(count, differs);
    ok = cudaGetLastError() == cudaSuccess &&
         cudaMemcpy(&host, count, sizeof(host), cudaMemcpyDeviceToHost) == cudaSuccess;
  }
  cudaFree(count);
  return ok ? int64_t(host) : -1;
}

}  // namespace nvfp4
