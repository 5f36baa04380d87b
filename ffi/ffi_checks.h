// Argument checks shared by the FFI handlers (store, decode and ragged attention). They re-check what
// the JAX side validated, so that a malformed call returns an error instead of reading or
// writing out of bounds.
#pragma once

#include <cstddef>
#include <cstdint>
#include <initializer_list>
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

// What the attention readers' kernels (decode, ragged) read alike, in their problems
// (DecodeProblem and RaggedProblem extend it): L members (stacked layers or head groups) of rows
// of q [L, rows, Hq, D], each row attending over the pages of its block-table row.
struct AttentionOperands {
  const void* q;
  const uint8_t* kv_cache;
  const int32_t* block_tables;
  const int32_t* seq_lens;
  const float* k_scale;
  const float* v_scale;
  const float* sm_scale;
  void* out;
  float* lse;
  float* partial_out;  // the split-KV workspace (empty with one split)
  float* partial_lse;
  QType q_type;
  int32_t stacked;          // L
  int32_t num_q_heads;      // Hq
  int32_t num_blocks;       // pages per member
  int32_t max_blocks;       // M, columns of block_tables
  int32_t tables_stacked;   // 1 when block_tables has a row per member, 0 when shared
  int32_t lens_stacked;     // likewise for seq_lens
  int32_t k_scale_stacked;  // likewise for each scale
  int32_t v_scale_stacked;
  int32_t sm_scale_stacked;
  int32_t num_splits;
  int32_t tokens_per_split;
  PageGeometry page;
};

// *p's addresses, sizes and per-member flags from a call's buffers, once the handler has checked
// them (ReadAttentionOperands, which set q_type and page, and its own shape checks): q
// [L, rows, Hq, D], kv_cache [L, num_blocks, 2, ...], block_tables [1 or L, sequences, M],
// seq_lens [1 or L, sequences], scales of 1 or L values.
inline void SetAttentionOperands(ffi::AnyBuffer q, ffi::Buffer<ffi::U8> kv_cache,
                                 ffi::Buffer<ffi::S32> block_tables,
                                 ffi::Buffer<ffi::S32> seq_lens, ffi::Buffer<ffi::F32> k_scale,
                                 ffi::Buffer<ffi::F32> v_scale, ffi::Buffer<ffi::F32> sm_scale,
                                 ffi::Result<ffi::AnyBuffer>& out,
                                 ffi::Result<ffi::Buffer<ffi::F32>>& lse,
                                 ffi::Result<ffi::Buffer<ffi::F32>>& partial_out,
                                 ffi::Result<ffi::Buffer<ffi::F32>>& partial_lse,
                                 int32_t num_splits, int32_t tokens_per_split,
                                 AttentionOperands* p) {
  const int64_t stacked = q.dimensions()[0];
  const auto table_dims = block_tables.dimensions();
  p->q = q.untyped_data();
  p->kv_cache = kv_cache.typed_data();
  p->block_tables = block_tables.typed_data();
  p->seq_lens = seq_lens.typed_data();
  p->k_scale = k_scale.typed_data();
  p->v_scale = v_scale.typed_data();
  p->sm_scale = sm_scale.typed_data();
  p->out = out->untyped_data();
  p->lse = lse->typed_data();
  p->partial_out = partial_out->typed_data();
  p->partial_lse = partial_lse->typed_data();
  p->stacked = int32_t(stacked);
  p->num_q_heads = int32_t(q.dimensions()[2]);
  p->num_blocks = int32_t(kv_cache.dimensions()[1]);
  p->max_blocks = int32_t(table_dims[2]);
  p->tables_stacked = table_dims[0] == stacked && stacked > 1;
  p->lens_stacked = seq_lens.dimensions()[0] == stacked && stacked > 1;
  p->k_scale_stacked = k_scale.element_count() > 1;
  p->v_scale_stacked = v_scale.element_count() > 1;
  p->sm_scale_stacked = sm_scale.element_count() > 1;
  p->num_splits = num_splits;
  p->tokens_per_split = tokens_per_split;
}

// The operands the attention readers (decode, ragged) share, after the caller checked q's rank
// 4 [L, rows, Hq, D]: q's dtype, out of q's dtype and size, a head size the kernels are built
// for, the cache [L, num_blocks, 2, ...] of that head size (its page geometry into *page) with
// num_q_heads a multiple of its kv heads, and scales of 1 or L values. Returns what is wrong, or
// an empty string.
inline std::string ReadAttentionOperands(ffi::AnyBuffer q, ffi::Buffer<ffi::U8> kv_cache,
                                         ffi::Result<ffi::AnyBuffer>& out,
                                         std::initializer_list<const ffi::Buffer<ffi::F32>*> scales,
                                         int32_t layout, bool v_scale_swizzle, QType* q_type,
                                         PageGeometry* page) {
  const auto q_dims = q.dimensions();
  const auto cache_dims = kv_cache.dimensions();
  if (cache_dims.size() != 6) return "kv_cache must have rank 6";
  if (!ReadQType(q.element_type(), q_type)) return "q must be bfloat16, float16 or float32";
  if (out->element_type() != q.element_type() || out->element_count() != q.element_count())
    return "out must have q's dtype and shape";
  // The kernels read q in 16-byte loads (attention_device.cuh, load_q8 and load_q_values);
  // XLA's buffers are aligned more than that.
  if (reinterpret_cast<uintptr_t>(q.untyped_data()) % 16 != 0) return "q is not 16-byte aligned";
  const int64_t stacked = q_dims[0], num_q_heads = q_dims[2], head_size = q_dims[3];
  if (head_size != 64 && head_size != 128 && head_size != 256)
    return "the kernel supports head sizes 64, 128 and 256";
  const std::string page_error =
      ReadPageGeometry(cache_dims, 2, layout, head_size, v_scale_swizzle, page);
  if (!page_error.empty()) return page_error;
  if (num_q_heads % page->num_kv_heads != 0)
    return "num_q_heads must be a multiple of num_kv_heads";
  if (cache_dims[0] != stacked) return "kv_cache shape does not match q";
  for (const auto* scale : scales) {
    const int64_t n = int64_t(scale->element_count());
    if (n != 1 && n != stacked) return "scales must hold 1 or L values";
  }
  return "";
}

// A split-KV plan of an attention kernel: num_splits splits of tokens_per_split positions (a
// multiple of `step`, the kernel's CTA step) cover the block table's `capacity` positions, and
// every split starts inside it (a split that starts past it would read past the table).
inline bool SplitPlanCovers(int64_t num_splits, int64_t tokens_per_split, int64_t step,
                            int64_t capacity) {
  return num_splits >= 1 && tokens_per_split > 0 && tokens_per_split % step == 0 &&
         num_splits * tokens_per_split >= capacity &&
         (num_splits - 1) * tokens_per_split < (capacity > 1 ? capacity : 1);
}

}  // namespace nvfp4
