// XLA FFI side of the decode-attention kernel (decode_cuda.cu): the call's buffers and
// attributes read into a DecodeProblem, re-checking what jax_nvfp4/attention_primitive.py
// validated, so that a malformed call returns an error instead of reading out of bounds.
//
// Operands (the primitive's canonical form, L = stacked layers or head groups, 1 for a plain
// call; several stacked axes are flattened into L on the JAX side, per device:
// attention_primitive.on_one_stacked_axis): q [L, B, Hq, D] bf16/f16/f32; kv_cache [L, num_blocks, 2, ...] uint8 in either layout;
// block_tables [1 or L, B, M] and seq_lens [1 or L, B] int32; k_scale, v_scale, sm_scale float32
// [1 or L]. Results: out [L, B, Hq, D] (q's dtype), lse [L, B, Hq] float32, and the split-KV
// workspace partial_out [L, B, Hq, S, D], partial_lse [L, B, Hq, S] float32 (S = num_splits, or
// 0 when num_splits == 1 or the splits merge in a cluster).
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>

#include "ffi_checks.h"
#include "nvfp4_numerics.h"
#include "xla/ffi/api/ffi.h"

namespace nvfp4 {

namespace ffi = xla::ffi;

// Name of the FFI target; jax_nvfp4/attention_primitive.py registers the handler under it.
inline constexpr const char kDecodeTarget[] = "jax_nvfp4_paged_attention";

struct DecodeProblem : AttentionOperands {
  int32_t batch;  // B
  // 1: the splits of one (member, sequence, kv head, head tile) run as one thread-block
  // cluster (num_splits <= kMaxClusterSplits CTAs) and merge through distributed shared memory,
  // with no merge kernel and no workspace (then partial_out and partial_lse are empty).
  int32_t cluster_merge;
  // Ragged mode, set by ragged_cuda.cu for the one-token sequences of a ragged call (batch =
  // max_num_seqs): q, out and lse rows are then tokens, [L, num_tokens, Hq]. A sequence b <
  // num_seqs that owns exactly one query token (jax_nvfp4.reference.ragged_token_plan) is
  // decoded into that token's rows; every other sequence is left to the ragged kernel. The
  // split-KV workspace keeps its rows per sequence. nullptr: rows are sequences, [L, B, Hq].
  const int32_t* cu_q_lens = nullptr;  // [1 or L, B + 1]
  const int32_t* num_seqs = nullptr;   // [1 or L]
  int32_t num_tokens = 0;
  int32_t cu_stacked = 0;
  int32_t num_seqs_stacked = 0;
};

// Positions one CTA step of the decode kernel takes (4 warps x 32): a split is a multiple of it
// (jax_nvfp4/attention_primitive.py, _TOKENS_PER_CTA_STEP).
inline constexpr int64_t kDecodeSplitStep = 128;
// Most splits one cluster merges: 16, the largest (non-portable) cluster size of sm_90, where
// the GPU can place such a cluster of the kernel (decode_cuda.cu, DecodeClusterMergeSplits; the plan
// asks through _ffi.decode_cluster_merge_splits).
inline constexpr int32_t kMaxClusterSplits = 16;

// What is wrong with merging `splits` splits in a cluster ("" if nothing): 2 to
// kMaxClusterSplits (whether this GPU places that many is the handlers' launch-time check).
inline std::string ClusterMergeRangeError(const char* attribute, int32_t splits) {
  if (splits >= 2 && splits <= kMaxClusterSplits) return "";
  return std::string(attribute) + " takes 2 to " + std::to_string(kMaxClusterSplits) +
         " splits";
}

inline ffi::Error DecodeArgumentError(const std::string& message) {
  return ArgumentError("paged_attention", message);
}

inline ffi::Error MakeDecodeProblem(ffi::AnyBuffer q, ffi::Buffer<ffi::U8> kv_cache,
                                    ffi::Buffer<ffi::S32> block_tables,
                                    ffi::Buffer<ffi::S32> seq_lens,
                                    ffi::Buffer<ffi::F32> k_scale, ffi::Buffer<ffi::F32> v_scale,
                                    ffi::Buffer<ffi::F32> sm_scale, ffi::Result<ffi::AnyBuffer> out,
                                    ffi::Result<ffi::Buffer<ffi::F32>> lse,
                                    ffi::Result<ffi::Buffer<ffi::F32>> partial_out,
                                    ffi::Result<ffi::Buffer<ffi::F32>> partial_lse,
                                    int32_t layout, bool v_scale_swizzle, int32_t num_splits,
                                    int32_t tokens_per_split, bool cluster_merge,
                                    DecodeProblem* p) {
  const auto q_dims = q.dimensions();
  const auto cache_dims = kv_cache.dimensions();
  const auto table_dims = block_tables.dimensions();
  const auto len_dims = seq_lens.dimensions();
  if (q_dims.size() != 4) return DecodeArgumentError("q must have rank 4 [L, B, Hq, D]");
  if (table_dims.size() != 3 || len_dims.size() != 2)
    return DecodeArgumentError("block_tables must have rank 3 and seq_lens rank 2");
  const std::string operand_error =
      ReadAttentionOperands(q, kv_cache, out, {&k_scale, &v_scale, &sm_scale}, layout,
                            v_scale_swizzle, &p->q_type, &p->page);
  if (!operand_error.empty()) return DecodeArgumentError(operand_error);
  const int64_t stacked = q_dims[0], batch = q_dims[1], num_q_heads = q_dims[2];
  const int64_t head_size = q_dims[3];
  const int64_t block_size = p->page.block_size;
  if ((table_dims[0] != 1 && table_dims[0] != stacked) || table_dims[1] != batch ||
      (len_dims[0] != 1 && len_dims[0] != stacked) || len_dims[1] != batch)
    return DecodeArgumentError("block_tables/seq_lens shapes do not match q");
  const int64_t capacity = table_dims[2] * block_size;
  if (num_splits > 65535 ||
      !SplitPlanCovers(num_splits, tokens_per_split, kDecodeSplitStep, capacity))
    return DecodeArgumentError(
        "num_splits x tokens_per_split (a multiple of 128) must cover the block table, every "
        "split starting inside it");
  const std::string cluster_error =
      cluster_merge ? ClusterMergeRangeError("cluster_merge", num_splits) : "";
  if (!cluster_error.empty()) return DecodeArgumentError(cluster_error);
  const int64_t partial = num_splits > 1 && !cluster_merge ? num_splits : 0;
  if (lse->element_count() != size_t(stacked * batch * num_q_heads) ||
      partial_out->element_count() != size_t(stacked * batch * num_q_heads * partial * head_size) ||
      partial_lse->element_count() != size_t(stacked * batch * num_q_heads * partial))
    return DecodeArgumentError("result shapes do not match q and num_splits");
  constexpr int64_t kLimit = (int64_t(1) << 31) - 1;
  if (stacked * batch * num_q_heads > kLimit || cache_dims[1] > kLimit || capacity > kLimit ||
      2 * p->page.side_bytes() > kLimit)
    return DecodeArgumentError("sizes beyond 2^31");

  SetAttentionOperands(q, kv_cache, block_tables, seq_lens, k_scale, v_scale, sm_scale, out, lse,
                       partial_out, partial_lse, num_splits, tokens_per_split, p);
  p->batch = int32_t(batch);
  p->cluster_merge = cluster_merge;
  return ffi::Error::Success();
}

#if defined(__CUDACC__)
// The decode kernel (and, with several splits, its merge) on `stream` (decode_cuda.cu); the
// ragged kernel's handler calls it in ragged mode.
cudaError_t LaunchDecodeAttention(cudaStream_t stream, const DecodeProblem& p);
#endif

template <typename Binding>
auto BindDecode(Binding binding) {
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()           // q
      .template Arg<ffi::Buffer<ffi::U8>>()     // kv_cache (read only)
      .template Arg<ffi::Buffer<ffi::S32>>()    // block_tables
      .template Arg<ffi::Buffer<ffi::S32>>()    // seq_lens
      .template Arg<ffi::Buffer<ffi::F32>>()    // k_scale
      .template Arg<ffi::Buffer<ffi::F32>>()    // v_scale
      .template Arg<ffi::Buffer<ffi::F32>>()    // sm_scale
      .template Ret<ffi::AnyBuffer>()           // out
      .template Ret<ffi::Buffer<ffi::F32>>()    // lse
      .template Ret<ffi::Buffer<ffi::F32>>()    // partial_out (split-KV workspace)
      .template Ret<ffi::Buffer<ffi::F32>>()    // partial_lse
      .template Attr<int32_t>("layout")
      .template Attr<bool>("v_scale_swizzle")
      .template Attr<int32_t>("num_splits")
      .template Attr<int32_t>("tokens_per_split")
      .template Attr<bool>("cluster_merge");
}

}  // namespace nvfp4
