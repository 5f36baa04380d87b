// CUDA XLA FFI handler of the store (spec §5), for sm_90 and newer. The e2m1 conversion is the
// software ladder of nvfp4_numerics.h on every architecture, so Hopper and Blackwell write the
// same bytes as the CPU kernel and the jnp reference.
#include <cuda_runtime.h>

#include <string>

#include "store_ffi.h"
#include "store_handlers.h"

namespace nvfp4 {
namespace {

constexpr int kThreadsPerBlock = 256;

// Division by a divisor fixed at launch, as a multiply-high and a shift (Granlund-Montgomery):
// 32-bit integer division is a long instruction sequence on the GPU and the kernel needs
// several per thread. Exact for numerators below 2^31.
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

struct WorkShape {
  FastDivmod blocks_per_head;  // D/16
  FastDivmod num_kv_heads;
  FastDivmod num_tokens;
  FastDivmod block_size;
};

// One thread quantises one 16-element block. Consecutive threads take consecutive blocks of a
// head vector, then heads, then K/V, then tokens, so the loads (32 bytes a thread) and the
// packed stores (8 bytes a thread) are contiguous across a warp. Work items and slots are
// below 2^31 (the handler checks), so all index arithmetic is 32-bit.
template <bool kIsF16>
__global__ void __launch_bounds__(kThreadsPerBlock)
    StoreKernel(const StoreProblem p, const WorkShape shape, uint32_t num_work,
                bool aligned_data) {
  for (uint32_t work = blockIdx.x * blockDim.x + threadIdx.x; work < num_work;
       work += gridDim.x * blockDim.x) {
    uint32_t b, head, token;
    uint32_t rest = shape.blocks_per_head.divmod(work, &b);
    rest = shape.num_kv_heads.divmod(rest, &head);
    const int side = int(rest & 1u);
    const uint32_t layer = shape.num_tokens.divmod(rest >> 1, &token);

    const int64_t slot = p.valid_slot(layer, token);
    if (slot < 0) continue;
    uint32_t row;
    const uint32_t block = shape.block_size.divmod(uint32_t(slot), &row);

    const uint16_t* src = static_cast<const uint16_t*>(side == 0 ? p.key : p.value) +
                          p.input_offset(layer, token, head, b);
    // 32 bytes per block, 32-byte aligned: two 16-byte loads that bypass L1.
    const uint4 lo = __ldg(reinterpret_cast<const uint4*>(src));
    const uint4 hi = __ldg(reinterpret_cast<const uint4*>(src) + 1);
    const uint32_t words[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
    float x[kBlockElems];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      x[2 * i] = widen(uint16_t(words[i] & 0xFFFFu), kIsF16);
      x[2 * i + 1] = widen(uint16_t(words[i] >> 16), kIsF16);
    }

    uint8_t packed[kBlockBytes];
    const uint8_t scale = quantize_block(x, p.store_factor(layer, side), p.scale_search, packed);
    const BlockPlacement at = place_block(p, layer, block, int32_t(row), side, head, int32_t(b));
    if (aligned_data) {
      uint2 v;
      v.x = uint32_t(packed[0]) | uint32_t(packed[1]) << 8 | uint32_t(packed[2]) << 16 |
            uint32_t(packed[3]) << 24;
      v.y = uint32_t(packed[4]) | uint32_t(packed[5]) << 8 | uint32_t(packed[6]) << 16 |
            uint32_t(packed[7]) << 24;
      *reinterpret_cast<uint2*>(p.kv_cache + at.data) = v;
    } else {
#pragma unroll
      for (int k = 0; k < kBlockBytes; ++k) p.kv_cache[at.data + k] = packed[k];
    }
    p.kv_cache[at.scale] = scale;
  }
}

ffi::Error CudaError(const char* what, cudaError_t error) {
  return ffi::Error(ffi::ErrorCode::kInternal, std::string("jax_nvfp4 reshape_and_cache: ") +
                                                   what + ": " + cudaGetErrorString(error));
}

ffi::Error StoreCuda(cudaStream_t stream, ffi::AnyBuffer key, ffi::AnyBuffer value,
                     ffi::Buffer<ffi::U8> kv_cache, ffi::AnyBuffer slot_mapping,
                     ffi::Buffer<ffi::F32> k_scale, ffi::Buffer<ffi::F32> v_scale,
                     ffi::Result<ffi::Buffer<ffi::U8>> kv_cache_out, int32_t layout,
                     int32_t scale_search, bool v_scale_swizzle) {
  StoreProblem p;
  ffi::Error error = MakeStoreProblem(key, value, kv_cache, slot_mapping, k_scale, v_scale,
                                      kv_cache_out, layout, scale_search, v_scale_swizzle, &p);
  if (error.failure()) return error;
  // XLA aliases the result to kv_cache; should it ever hand over two buffers, start from a copy.
  if (kv_cache.untyped_data() != kv_cache_out->untyped_data()) {
    const cudaError_t copied =
        cudaMemcpyAsync(kv_cache_out->untyped_data(), kv_cache.untyped_data(),
                        kv_cache.size_bytes(), cudaMemcpyDeviceToDevice, stream);
    if (copied != cudaSuccess) return CudaError("copying kv_cache", copied);
  }
  const int64_t num_work =
      p.num_layers * p.num_tokens * 2 * p.page.num_kv_heads * (p.page.head_size / kBlockElems);
  if (num_work == 0) return ffi::Error::Success();
  constexpr int64_t kIndexLimit = int64_t(1) << 31;
  if (num_work >= kIndexLimit || p.num_blocks * p.page.block_size >= kIndexLimit)
    return InvalidArgument("more than 2^31 blocks of 16 values or cache slots in one call");
  const WorkShape shape{FastDivmod(uint32_t(p.page.head_size / kBlockElems)),
                        FastDivmod(uint32_t(p.page.num_kv_heads)),
                        FastDivmod(uint32_t(p.num_tokens)),
                        FastDivmod(uint32_t(p.page.block_size))};
  const int64_t grid = (num_work + kThreadsPerBlock - 1) / kThreadsPerBlock;  // < 2^23
  // 8-byte stores need every page side to start 8-byte aligned.
  const bool aligned_data = p.page.side_bytes() % kBlockBytes == 0;
  if (p.is_f16)
    StoreKernel<true><<<grid, kThreadsPerBlock, 0, stream>>>(p, shape, uint32_t(num_work),
                                                             aligned_data);
  else
    StoreKernel<false><<<grid, kThreadsPerBlock, 0, stream>>>(p, shape, uint32_t(num_work),
                                                              aligned_data);
  const cudaError_t launched = cudaGetLastError();
  if (launched != cudaSuccess) return CudaError("kernel launch", launched);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace nvfp4

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    NvFp4StoreCuda, nvfp4::StoreCuda,
    nvfp4::BindStore(xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
    {xla::ffi::Traits::kCmdBufferCompatible});
