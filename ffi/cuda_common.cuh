// CUDA helpers shared by the kernels (store_cuda.cu, decode_cuda.cu).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

#include "xla/ffi/api/ffi.h"

namespace nvfp4 {

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

}  // namespace nvfp4
