// CPU XLA FFI handler of the store (docs/format.md §5). Serial: the CPU backend exists so that
// every machine can run and test the exact arithmetic, not for speed.
#include <cstring>

#if defined(__x86_64__) || defined(__i386__) || defined(_M_X64)
#include <xmmintrin.h>
#endif

#include "store_ffi.h"
#include "handlers.h"

namespace nvfp4 {
namespace {

// Float32 subnormals flush to zero as inputs and results (nvfp4_numerics.h): set the CPU's
// flush-to-zero and denormals-are-zero modes for the duration of a call, whatever the caller
// (XLA sets them already; a standalone caller may not), and restore them after.
class FlushDenormalsScope {
 public:
#if defined(__x86_64__) || defined(__i386__) || defined(_M_X64)
  FlushDenormalsScope() : saved_(_mm_getcsr()) { _mm_setcsr(saved_ | kFtz | kDaz); }
  ~FlushDenormalsScope() { _mm_setcsr(saved_); }

 private:
  static constexpr unsigned kFtz = 0x8000, kDaz = 0x0040;
  unsigned saved_;
#elif defined(__aarch64__)
  FlushDenormalsScope() {
    asm volatile("mrs %0, fpcr" : "=r"(saved_));
    asm volatile("msr fpcr, %0" : : "r"(saved_ | kFz));
  }
  ~FlushDenormalsScope() { asm volatile("msr fpcr, %0" : : "r"(saved_)); }

 private:
  static constexpr uint64_t kFz = uint64_t(1) << 24;  // FZ flushes inputs and results
  uint64_t saved_;
#else
#error "jax_nvfp4: set flush-to-zero for this CPU architecture in FlushDenormalsScope"
#endif
};

void StoreAll(const StoreProblem& p) {
  const int64_t num_heads = p.page.num_kv_heads;
  const int64_t blocks_per_head = p.page.head_size / kBlockElems;
  for (int64_t layer = 0; layer < p.num_layers; ++layer) {
    for (int side = 0; side < 2; ++side) {
      const StoreFactor factor = p.factor(layer, side);
      const uint16_t* src = static_cast<const uint16_t*>(side == 0 ? p.key : p.value);
      for (int64_t token = 0; token < p.num_tokens; ++token) {
        const int64_t slot = p.valid_slot(layer, token);
        if (slot < 0) continue;
        for (int64_t head = 0; head < num_heads; ++head) {
          for (int64_t b = 0; b < blocks_per_head; ++b) {
            const uint16_t* in = src + p.input_offset(layer, token, head, b);
            float x[kBlockElems];
            for (int i = 0; i < kBlockElems; ++i) x[i] = widen(in[i], p.is_f16);
            const BlockPlacement at =
                place_block(p, layer, slot / p.page.block_size,
                            int32_t(slot % p.page.block_size), side, head, int32_t(b));
            const QuantizedBlock q = quantize_block(x, factor, p.scale_search);
            for (int k = 0; k < kBlockBytes; ++k)
              p.kv_cache[at.data + k] = uint8_t(q.packed[k / 4] >> (8 * (k % 4)));
            p.kv_cache[at.scale] = q.scale;
          }
        }
      }
    }
  }
}

ffi::Error StoreCpu(ffi::AnyBuffer key, ffi::AnyBuffer value, ffi::Buffer<ffi::U8> kv_cache,
                    ffi::AnyBuffer slot_mapping, ffi::Buffer<ffi::F32> k_scale,
                    ffi::Buffer<ffi::F32> v_scale, ffi::Result<ffi::Buffer<ffi::U8>> kv_cache_out,
                    int32_t layout, int32_t scale_search, bool v_scale_swizzle) {
  StoreProblem p;
  ffi::Error error = MakeStoreProblem(key, value, kv_cache, slot_mapping, k_scale, v_scale,
                                      kv_cache_out, layout, scale_search, v_scale_swizzle, &p);
  if (error.failure()) return error;
  // XLA aliases the result to kv_cache; should it ever hand over two buffers, start from a copy.
  if (kv_cache.untyped_data() != kv_cache_out->untyped_data())
    std::memcpy(kv_cache_out->untyped_data(), kv_cache.untyped_data(), kv_cache.size_bytes());
  const FlushDenormalsScope flush_denormals;
  StoreAll(p);
  return ffi::Error::Success();
}

}  // namespace
}  // namespace nvfp4

XLA_FFI_DEFINE_HANDLER_SYMBOL(NvFp4StoreCpu, nvfp4::StoreCpu,
                              nvfp4::BindStore(xla::ffi::Ffi::Bind()));
