// XLA FFI side of the store, shared by the CPU and CUDA handlers: reads the buffers and
// attributes of one call into a StoreProblem, re-checking what the JAX primitive validated
// so that a malformed call returns an error instead of writing out of bounds.
#pragma once

#include <string>
#include <utility>

#include "ffi_checks.h"
#include "store_kernel.h"
#include "xla/ffi/api/ffi.h"

namespace nvfp4 {

namespace ffi = xla::ffi;

// Name of the FFI target; jax_nvfp4/primitive.py registers the handlers under it.
inline constexpr const char kStoreTarget[] = "jax_nvfp4_reshape_and_cache";

// The CUDA store quantises one 16-value block a thread for stores of at most this many blocks
// (512 tokens of 8 kv heads x 128: a decode step's stores), two a thread above where the head
// size allows (store_cuda.cu; benchmarks/NOTES.md, store v12). Exported for the tests that
// cover both.
inline constexpr int64_t kSmallStoreBlocks = int64_t(1) << 16;

inline ffi::Error InvalidArgument(const std::string& message) {
  return ArgumentError("reshape_and_cache", message);
}

inline ffi::Error MakeStoreProblem(ffi::AnyBuffer key, ffi::AnyBuffer value,
                                   ffi::Buffer<ffi::U8> kv_cache, ffi::AnyBuffer slot_mapping,
                                   ffi::Buffer<ffi::F32> k_scale, ffi::Buffer<ffi::F32> v_scale,
                                   ffi::Result<ffi::Buffer<ffi::U8>> kv_cache_out,
                                   int32_t layout, int32_t scale_search, bool v_scale_swizzle,
                                   StoreProblem* p) {
  const auto key_dims = key.dimensions();
  const auto cache_dims = kv_cache.dimensions();
  const auto slot_dims = slot_mapping.dimensions();
  // Any number of leading stacked axes (layers, head groups, both: nested vmap), the same on
  // key, value and the cache; the kernels see them as one flat axis of num_layers members
  // (row-major, so flattening is pure metadata: no byte moves, the cache stays aliased).
  if (key_dims.size() < 3) return InvalidArgument("key must have rank 3 or more");
  if (cache_dims.size() != key_dims.size() + 2)
    return InvalidArgument("kv_cache rank does not match key rank");
  if (key.element_type() != value.element_type() ||
      key.element_count() != value.element_count())
    return InvalidArgument("key and value differ in dtype or shape");
  if (key.element_type() != ffi::DataType::BF16 && key.element_type() != ffi::DataType::F16)
    return InvalidArgument("key must be bfloat16 or float16");
  if (slot_mapping.element_type() != ffi::DataType::S32 &&
      slot_mapping.element_type() != ffi::DataType::S64)
    return InvalidArgument("slot_mapping must be int32 or int64");
  if (scale_search != int32_t(ScaleSearch::kDefault) &&
      scale_search != int32_t(ScaleSearch::k4Over6))
    return InvalidArgument("unknown scale_search");

  const size_t o = key_dims.size() - 3;  // number of stacked axes: offset of the per-layer axes
  p->num_layers = 1;
  for (size_t i = 0; i < o; ++i) {
    if (cache_dims[i] != key_dims[i])
      return InvalidArgument("kv_cache stacked axes do not match key");
    p->num_layers *= key_dims[i];
  }
  p->num_tokens = key_dims[o];
  // The cache: [stacked axes...,] num_blocks, then the page axes.
  const std::string page_error =
      ReadPageGeometry(cache_dims, o + 1, layout, key_dims[o + 2], v_scale_swizzle, &p->page);
  if (!page_error.empty()) return InvalidArgument(page_error);
  if (p->page.num_kv_heads != key_dims[o + 1])
    return InvalidArgument("kv_cache shape does not match key");
  if (kv_cache_out->element_count() != kv_cache.element_count())
    return InvalidArgument("output is not the size of kv_cache");

  // Slots shared by every member [num_tokens], or one row per member [stacked axes..., T].
  const bool per_layer_slots = o > 0 && slot_dims.size() == o + 1;
  bool slots_match = slot_dims.size() == 1 || per_layer_slots;
  for (size_t i = 0; per_layer_slots && i < o; ++i) slots_match &= slot_dims[i] == key_dims[i];
  if (!slots_match || slot_dims.back() != p->num_tokens)
    return InvalidArgument("slot_mapping shape does not match key");
  const int64_t num_k_scales = int64_t(k_scale.element_count());
  if (num_k_scales != int64_t(v_scale.element_count()) ||
      (num_k_scales != 1 && num_k_scales != p->num_layers))
    return InvalidArgument("k_scale/v_scale must hold 1 or num_layers values");

  p->key = key.untyped_data();
  p->value = value.untyped_data();
  p->slot_mapping = slot_mapping.untyped_data();
  p->k_scale = k_scale.typed_data();
  p->v_scale = v_scale.typed_data();
  p->kv_cache = kv_cache_out->typed_data();
  p->is_f16 = key.element_type() == ffi::DataType::F16;
  p->slots_int64 = slot_mapping.element_type() == ffi::DataType::S64;
  p->num_blocks = cache_dims[o];
  p->slots_layer_stride = per_layer_slots ? p->num_tokens : 0;
  p->scales_layer_stride = num_k_scales == 1 ? 0 : 1;
  p->scale_search = ScaleSearch(scale_search);
  return ffi::Error::Success();
}

// The FFI binding shared by every platform's handler; `platform_args` adds what the platform
// needs first (the stream on CUDA).
template <typename Binding>
auto BindStore(Binding binding) {
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()                // key
      .template Arg<ffi::AnyBuffer>()                // value
      .template Arg<ffi::Buffer<ffi::U8>>()          // kv_cache (aliased to the result)
      .template Arg<ffi::AnyBuffer>()                // slot_mapping
      .template Arg<ffi::Buffer<ffi::F32>>()         // k_scale
      .template Arg<ffi::Buffer<ffi::F32>>()         // v_scale
      .template Ret<ffi::Buffer<ffi::U8>>()          // kv_cache, updated in place
      .template Attr<int32_t>("layout")
      .template Attr<int32_t>("scale_search")
      .template Attr<bool>("v_scale_swizzle");
}

}  // namespace nvfp4
