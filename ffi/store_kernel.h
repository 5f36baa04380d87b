// The store of docs/format.md §5 for one 16-element block, shared by the CPU and CUDA kernels.
//
// A call may carry leading stacked axes (vmap over stacked per-layer caches or head groups,
// nested or not), seen here as one flat layer axis (store_ffi.h flattens them): key/value
// [num_layers, num_tokens, num_kv_heads, head_size], kv_cache [num_layers, num_blocks, 2, ...],
// slot_mapping and the global scales either shared by all layers or one per layer.
#pragma once

#include "nvfp4_numerics.h"

namespace nvfp4 {

struct StoreProblem {
  const void* key;           // bf16 or fp16 bits, [num_layers, num_tokens, num_kv_heads, head_size]
  const void* value;
  const void* slot_mapping;  // int32 or int64, [num_tokens] or [num_layers, num_tokens]
  const float* k_scale;      // dequantisation multipliers, 1 or num_layers of them
  const float* v_scale;
  uint8_t* kv_cache;         // [num_layers, num_blocks, 2, page side bytes]
  bool is_f16;
  bool slots_int64;
  int64_t num_layers;
  int64_t num_tokens;
  int64_t num_blocks;
  int64_t slots_layer_stride;   // 0 when all layers share slot_mapping, else num_tokens
  int64_t scales_layer_stride;  // 0 when all layers share the scales, else 1
  PageGeometry page;
  ScaleSearch scale_search;

  NVFP4_HD int64_t layer_cache_bytes() const { return num_blocks * 2 * page.side_bytes(); }

  // Slot of a token, or -1 when nothing may be written for it: negative slots are padding and
  // slots past the cache are skipped (docs/format.md §5).
  NVFP4_HD int64_t valid_slot(int64_t layer, int64_t token) const {
    const int64_t i = layer * slots_layer_stride + token;
    const int64_t slot = slots_int64 ? static_cast<const int64_t*>(slot_mapping)[i]
                                     : int64_t(static_cast<const int32_t*>(slot_mapping)[i]);
    return (slot < 0 || slot >= num_blocks * page.block_size) ? -1 : slot;
  }

  // One layer's global scale of K (side 0) or V (side 1), as given.
  NVFP4_HD const float* scale_of(int64_t layer, int side) const {
    return (side == 0 ? k_scale : v_scale) + layer * scales_layer_stride;
  }

  // g = 1/scale and 1/g (docs/format.md §2) for a global scale `s`. A scale outside
  // [kMinScale, kMaxScale] is NaN here (jax_nvfp4.checks.sanitize_scale, which the jnp
  // reference applies): every value it stores reads back NaN.
  NVFP4_HD static StoreFactor factor_of_scale(float s) {
    return store_factor(scale_is_valid(s) ? s : NAN);
  }

  // The same for one layer's K (side 0) or V (side 1).
  NVFP4_HD StoreFactor factor(int64_t layer, int side) const {
    return factor_of_scale(*scale_of(layer, side));
  }

  // First input element of block b of head vector `vector` of K or V: (layer, token, head)
  // flat over [num_layers, num_tokens, num_kv_heads].
  NVFP4_HD int64_t vector_input_offset(int64_t vector, int64_t b) const {
    return vector * page.head_size + b * kBlockElems;
  }

  // The same for (layer, token, head).
  NVFP4_HD int64_t input_offset(int64_t layer, int64_t token, int64_t head, int64_t b) const {
    return vector_input_offset((layer * num_tokens + token) * page.num_kv_heads + head, b);
  }
};

// Where block b of (head, slot) of one side goes, as byte offsets into the whole cache.
struct BlockPlacement {
  int64_t data;
  int64_t scale;
};

NVFP4_HD BlockPlacement place_block(const StoreProblem& p, int64_t layer, int64_t block,
                                    int32_t row, int side, int64_t head, int32_t b) {
  const int64_t side_base =
      layer * p.layer_cache_bytes() + (block * 2 + side) * p.page.side_bytes();
  return {side_base + p.page.data_offset(head, row) + b * kBlockBytes,
          side_base + p.page.scale_offset(side == 1, head, row, b)};
}

NVFP4_HD float widen(const uint16_t bits, bool is_f16) {
  return is_f16 ? f16_bits_to_float(bits) : bf16_bits_to_float(bits);
}

}  // namespace nvfp4
