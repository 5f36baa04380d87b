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

// One thread quantises one 16-element block; consecutive threads take consecutive blocks of a
// head vector, then heads, then K/V, then tokens, so loads (32 bytes each) and packed stores
// (8 bytes each) are contiguous across a warp.
template <bool kIsF16>
__global__ void __launch_bounds__(kThreadsPerBlock)
    StoreKernel(const StoreProblem p, int64_t num_work, bool aligned_data) {
  const int64_t blocks_per_head = p.page.head_size / kBlockElems;
  for (int64_t work = int64_t(blockIdx.x) * blockDim.x + threadIdx.x; work < num_work;
       work += int64_t(gridDim.x) * blockDim.x) {
    int64_t rest = work;
    const int64_t b = rest % blocks_per_head;
    rest /= blocks_per_head;
    const int64_t head = rest % p.page.num_kv_heads;
    rest /= p.page.num_kv_heads;
    const int side = int(rest % 2);
    rest /= 2;
    const int64_t token = rest % p.num_tokens;
    const int64_t layer = rest / p.num_tokens;

    const int64_t slot = p.valid_slot(layer, token);
    if (slot < 0) continue;

    const uint16_t* src = static_cast<const uint16_t*>(side == 0 ? p.key : p.value) +
                          p.input_offset(layer, token, head, b);
    // 32 bytes per block, 32-byte aligned: two 16-byte loads.
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
    const BlockPlacement at = place_block(p, layer, slot, side, head, b);
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
  // Blocks beyond this loop in the kernel; the cap keeps the grid within CUDA's limit.
  const int64_t grid = std::min<int64_t>((num_work + kThreadsPerBlock - 1) / kThreadsPerBlock,
                                         int64_t(1) << 30);
  // 8-byte stores need every page side to start 8-byte aligned.
  const bool aligned_data = p.page.side_bytes() % kBlockBytes == 0;
  if (p.is_f16)
    StoreKernel<true><<<grid, kThreadsPerBlock, 0, stream>>>(p, num_work, aligned_data);
  else
    StoreKernel<false><<<grid, kThreadsPerBlock, 0, stream>>>(p, num_work, aligned_data);
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
