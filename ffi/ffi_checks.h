// Argument checks shared by the FFI handlers (store, decode and ragged attention). They re-check what
// the JAX side validated, so that a malformed call returns an error instead of reading or
// writing out of bounds.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "nvfp4_numerics.h"
#include "xla/ffi/api/ffi.h"

namespace nvfp4 {

namespace ffi = xla::ffi;

// The dtypes of the attention readers' q (and output).
enum class QType : int32_t { kBF16 = 0, kF16 = 1, kF32 = 2 };

// q's dtype as a QType; false for any other dtype.
inline bool ReadQType(ffi::DataType type, QType* q_type) {
  switch (type) {
    case ffi::DataType::BF16: *q_type = QType::kBF16; return true;
    case ffi::DataType::F16: *q_type = QType::kF16; return true;
    case ffi::DataType::F32: *q_type = QType::kF32; return true;
    default: return false;
  }
}

// An invalid-argument error of operation `op` ("reshape_and_cache", "paged_attention").
inline ffi::Error ArgumentError(const char* op, const std::string& message) {
  return ffi::Error(ffi::ErrorCode::kInvalidArgument,
                    std::string("jax_nvfp4 ") + op + ": " + message);
}

// The page geometry of a cache whose page axes, [2, heads, block_size, F] (HND) or
// [2, block_size, heads, F] (NHD) with F = head_size/2 + head_size/16 (docs/format.md §4),
// start at cache_dims[first]; head_size comes from the caller's other operands. Returns what
// is wrong, or an empty string. The caller checks the rank.
template <typename Dims>
std::string ReadPageGeometry(const Dims& cache_dims, size_t first, int32_t layout,
                             int64_t head_size, bool v_scale_swizzle, PageGeometry* page) {
  if (layout != int32_t(Layout::kHND) && layout != int32_t(Layout::kNHD)) return "unknown layout";
  const bool hnd = Layout(layout) == Layout::kHND;
  *page = PageGeometry{cache_dims[first + (hnd ? 1 : 2)], cache_dims[first + (hnd ? 2 : 1)],
                       head_size, Layout(layout), v_scale_swizzle};
  if (head_size <= 0 || head_size % kBlockElems != 0)
    return "head_size must be a positive multiple of 16";
  if (page->block_size <= 0 || page->block_size % 4 != 0)
    return "block_size must be a positive multiple of 4";
  if (page->num_kv_heads <= 0) return "num_kv_heads must be positive";
  if (v_scale_swizzle && head_size % 64 != 0)
    return "swizzled V scales need head_size % 64 == 0";
  if (cache_dims[first] != 2 ||
      cache_dims[first + 3] != page->data_bytes_per_head_token() + page->scales_per_head_token())
    return "kv_cache shape does not match the head size";
  return "";
}

}  // namespace nvfp4
