// XLA FFI side of the ragged paged-attention kernel (ragged_cuda.cu): the call's buffers and
// attributes read into a RaggedProblem, re-checking what jax_nvfp4/ragged_primitive.py
// validated, so that a malformed call returns an error instead of reading out of bounds.
//
// Operands (the primitive's canonical form, L = stacked layers or head groups, 1 for a plain
// call; S = max_num_seqs, T = num_tokens): q [L, T, Hq, D] bf16/f16/f32; kv_cache
// [L, num_blocks, 2, ...] uint8 in either layout; block_tables [1 or L, S, M], seq_lens
// [1 or L, S], cu_q_lens [1 or L, S + 1], num_seqs [1 or L] int32; k_scale, v_scale, sm_scale
// float32 [1 or L]. Results: out [L, T, Hq, D] (q's dtype), lse [L, T, Hq] float32, the
// split-KV workspace partial_out [L, T, Hq, P, D], partial_lse [L, T, Hq, P] float32
// (P = num_splits, or 0 when num_splits == 1), and that of the decode kernel, which takes the
// sequences with one query token (decode_splits > 0): decode_partial_out [L, S, Hq, P', D],
// decode_partial_lse [L, S, Hq, P'] (P' = decode_splits, or 0 when it is 0 or 1 or the decode
// splits merge in a cluster).
#pragma once

#include <algorithm>
#include <cstdint>
#include <string>
#include <utility>

#include "decode_ffi.h"
#include "ffi_checks.h"
#include "nvfp4_numerics.h"
#include "xla/ffi/api/ffi.h"

namespace nvfp4 {

namespace ffi = xla::ffi;

// Name of the FFI target; jax_nvfp4/ragged_primitive.py registers the handler under it.
inline constexpr const char kRaggedTarget[] = "jax_nvfp4_ragged_paged_attention";

// Positions the ragged kernel converts per CTA step: a split is a multiple of it
// (jax_nvfp4/ragged_primitive.py, KV_TILE).
inline constexpr int64_t kRaggedSplitStep = 64;

// The few-row kernel (ragged_few_rows.cu) takes the sequences whose query rows per kv head
// (tokens x the GQA group) number at most kFewRows (its MMA's N), head sizes up to
// kFewRowsMaxHead (jax_nvfp4/ragged_primitive.py, FEW_ROWS and FEW_ROWS_MAX_HEAD_SIZE). 16 on
// its mma.sync loop: with 32 rows (4 n-tiles) a warp spilled and took 514 us at 32 x 8 over
// 8192, and pairs of warps sharing each chunk took 385 us; the wgmma path below (one
// warpgroup, the accumulators spread over its 128 threads) takes 196 us (H200,
// benchmarks/NOTES.md).
inline constexpr int32_t kFewRows = 16;
inline constexpr int64_t kFewRowsMaxHead = 128;
// At head size kFewRowsWideHead the kernel also takes up to kFewRowsWide rows on wgmma (the
// wgmma's N; few_rows_wide.cuh), where the build has sm_90a code for the GPU: FewRowsMaxRows
// says, and the handler sets RaggedProblem's few_rows_max (and checks few_rows_only) from it.
inline constexpr int32_t kFewRowsWide = 32;
inline constexpr int32_t kFewRowsWideHead = 128;

struct RaggedProblem : AttentionOperands {  // q's rows are tokens: [L, T, Hq, D]
  const int32_t* cu_q_lens;
  const int32_t* num_seqs;
  int32_t num_tokens;        // T
  int32_t max_num_seqs;      // S, rows of block_tables
  int32_t cu_stacked;        // 1 when cu_q_lens has a row per member, 0 when shared
  int32_t num_seqs_stacked;  // likewise for num_seqs
  // The sequences with one query token go to the decode kernel (launched after this one) when
  // decode_splits > 0, with this split plan and workspace; the ragged kernel skips them.
  int32_t decode_splits;
  int32_t decode_tokens_per_split;
  int32_t decode_cluster_merge;  // its splits merge in a cluster (DecodeProblem::cluster_merge)
  float* decode_partial_out;
  float* decode_partial_lse;
  // The caller's bound on any sequence's query tokens (0: none): a sequence with more gets NaN
  // rows. few_rows_only: the bound lets the few-row kernel take every sequence (one-token ones
  // too) and zero the unowned tokens, launched alone (no ragged or decode kernel).
  int32_t max_q_len;
  int32_t few_rows_only;
  // Set by the launch, not the caller: 1 when the pipelined prefill kernel runs and takes the
  // sequences of more than kPipelinedMinRows query rows per kv head; the ragged kernel skips them.
  int32_t pipelined = 0;
  // Set by the handler: the most query rows per kv head the few-row kernel takes on this GPU
  // (FewRowsMaxRows: kFewRows, or kFewRowsWide at head size 128 with sm_90a code).
  int32_t few_rows_max = kFewRows;
};

inline ffi::Error RaggedArgumentError(const std::string& message) {
  return ArgumentError("ragged_paged_attention", message);
}

inline ffi::Error MakeRaggedProblem(
    ffi::AnyBuffer q, ffi::Buffer<ffi::U8> kv_cache, ffi::Buffer<ffi::S32> block_tables,
    ffi::Buffer<ffi::S32> seq_lens, ffi::Buffer<ffi::S32> cu_q_lens,
    ffi::Buffer<ffi::S32> num_seqs, ffi::Buffer<ffi::F32> k_scale,
    ffi::Buffer<ffi::F32> v_scale, ffi::Buffer<ffi::F32> sm_scale,
    ffi::Result<ffi::AnyBuffer> out, ffi::Result<ffi::Buffer<ffi::F32>> lse,
    ffi::Result<ffi::Buffer<ffi::F32>> partial_out,
    ffi::Result<ffi::Buffer<ffi::F32>> partial_lse,
    ffi::Result<ffi::Buffer<ffi::F32>> decode_partial_out,
    ffi::Result<ffi::Buffer<ffi::F32>> decode_partial_lse, int32_t layout, bool v_scale_swizzle,
    int32_t num_splits, int32_t tokens_per_split, int32_t decode_splits,
    int32_t decode_tokens_per_split, bool decode_cluster_merge, int32_t max_q_len,
    bool few_rows_only, RaggedProblem* p) {
  const auto q_dims = q.dimensions();
  const auto cache_dims = kv_cache.dimensions();
  const auto table_dims = block_tables.dimensions();
  const auto len_dims = seq_lens.dimensions();
  const auto cu_dims = cu_q_lens.dimensions();
  if (q_dims.size() != 4) return RaggedArgumentError("q must have rank 4 [L, T, Hq, D]");
  if (table_dims.size() != 3 || len_dims.size() != 2 || cu_dims.size() != 2 ||
      num_seqs.dimensions().size() != 1)
    return RaggedArgumentError(
        "block_tables must have rank 3, seq_lens and cu_q_lens rank 2, num_seqs rank 1");
  const std::string operand_error =
      ReadAttentionOperands(q, kv_cache, out, {&k_scale, &v_scale, &sm_scale}, layout,
                            v_scale_swizzle, &p->q_type, &p->page);
  if (!operand_error.empty()) return RaggedArgumentError(operand_error);
  const int64_t stacked = q_dims[0], num_tokens = q_dims[1], num_q_heads = q_dims[2];
  const int64_t head_size = q_dims[3];
  const int64_t max_num_seqs = table_dims[1];
  const auto leading_ok = [stacked](int64_t n) { return n == 1 || n == stacked; };
  if (!leading_ok(table_dims[0]) || !leading_ok(len_dims[0]) || len_dims[1] != max_num_seqs ||
      !leading_ok(cu_dims[0]) || cu_dims[1] != max_num_seqs + 1 ||
      !leading_ok(int64_t(num_seqs.element_count())))
    return RaggedArgumentError("block_tables/seq_lens/cu_q_lens/num_seqs shapes do not match");
  const int64_t capacity = table_dims[2] * p->page.block_size;
  if (!SplitPlanCovers(num_splits, tokens_per_split, kRaggedSplitStep, capacity))
    return RaggedArgumentError(
        "num_splits x tokens_per_split (a multiple of 64) must cover the block table, every "
        "split starting inside it");
  if (int64_t(num_splits) * stacked > 65535)
    return RaggedArgumentError("stacked members x num_splits must be at most 65535");
  const int64_t partial = num_splits > 1 ? num_splits : 0;
  const int64_t rows = stacked * num_tokens * num_q_heads;
  if (lse->element_count() != size_t(rows) ||
      partial_out->element_count() != size_t(rows * partial * head_size) ||
      partial_lse->element_count() != size_t(rows * partial))
    return RaggedArgumentError("result shapes do not match q and num_splits");
  if (decode_splits < 0 || decode_splits > 65535 ||
      (decode_splits > 0 && !SplitPlanCovers(decode_splits, decode_tokens_per_split,
                                             kDecodeSplitStep, capacity)))
    return RaggedArgumentError(
        "decode_splits x decode_tokens_per_split (a multiple of 128) must cover the block "
        "table, every split starting inside it");
  if (max_q_len < 0) return RaggedArgumentError("max_q_len must be >= 0 (0: no bound)");
  // (its bound on max_q_len x the GQA group depends on the GPU: the handler checks it)
  if (few_rows_only && (max_q_len < 1 || head_size > kFewRowsMaxHead || decode_splits != 0))
    return RaggedArgumentError(
        "few_rows_only needs max_q_len >= 1, a head size <= 128 and no decode launch "
        "(decode_splits == 0)");
  const std::string cluster_error =
      decode_cluster_merge ? ClusterMergeRangeError("decode_cluster_merge", decode_splits) : "";
  if (!cluster_error.empty()) return RaggedArgumentError(cluster_error);
  const int64_t decode_partial = decode_splits > 1 && !decode_cluster_merge ? decode_splits : 0;
  const int64_t decode_rows = stacked * max_num_seqs * num_q_heads;
  if (decode_partial_out->element_count() != size_t(decode_rows * decode_partial * head_size) ||
      decode_partial_lse->element_count() != size_t(decode_rows * decode_partial))
    return RaggedArgumentError("decode workspace shapes do not match decode_splits");
  constexpr int64_t kLimit = (int64_t(1) << 31) - 1;
  if (rows * head_size > kLimit || rows * partial * head_size > kLimit ||
      decode_rows > kLimit || decode_rows * decode_partial * head_size > kLimit ||
      cache_dims[1] > kLimit || capacity > kLimit || max_num_seqs + 1 > kLimit ||
      2 * p->page.side_bytes() > kLimit)
    return RaggedArgumentError("sizes beyond 2^31");

  SetAttentionOperands(q, kv_cache, block_tables, seq_lens, k_scale, v_scale, sm_scale, out, lse,
                       partial_out, partial_lse, num_splits, tokens_per_split, p);
  p->cu_q_lens = cu_q_lens.typed_data();
  p->num_seqs = num_seqs.typed_data();
  p->num_tokens = int32_t(num_tokens);
  p->max_num_seqs = int32_t(max_num_seqs);
  p->cu_stacked = cu_dims[0] == stacked && stacked > 1;
  p->num_seqs_stacked = num_seqs.element_count() > 1;
  p->decode_splits = decode_splits;
  p->decode_tokens_per_split = decode_tokens_per_split;
  p->decode_cluster_merge = decode_cluster_merge;
  p->decode_partial_out = decode_partial_out->typed_data();
  p->decode_partial_lse = decode_partial_lse->typed_data();
  p->max_q_len = max_q_len;
  p->few_rows_only = few_rows_only;
  p->pipelined = 0;
  p->few_rows_max = kFewRows;
  return ffi::Error::Success();
}

// The decode kernel's problem in ragged mode for the one-token sequences of `p`
// (p.decode_splits > 0): the same operands, the sequences as its batch.
inline DecodeProblem OneTokenDecodeProblem(const RaggedProblem& p) {
  DecodeProblem d;
  static_cast<AttentionOperands&>(d) = p;  // the same operands; the decode launch's own plan:
  d.partial_out = p.decode_partial_out;
  d.partial_lse = p.decode_partial_lse;
  d.num_splits = p.decode_splits;
  d.tokens_per_split = p.decode_tokens_per_split;
  d.cluster_merge = p.decode_cluster_merge;  // (the decode reader's plan, merge included)
  d.batch = p.max_num_seqs;
  d.cu_q_lens = p.cu_q_lens;
  d.num_seqs = p.num_seqs;
  d.num_tokens = p.num_tokens;
  d.cu_stacked = p.cu_stacked;
  d.num_seqs_stacked = p.num_seqs_stacked;
  return d;
}

#if defined(__CUDACC__)
// The few-row kernel for the sequences it takes (ragged_few_rows.cu, takes_few_rows), writing
// their rows of out and lse or, with several splits, of the split-KV workspace; the ragged
// kernel's handler launches it after the ragged kernel and before the merge, or alone
// (p.few_rows_only). `fill`: its grid also has the ragged kernel's fill slots (zeros for the
// tokens no sequence owns), where it serves the call alone or the ragged kernel, with no tile
// to do, is not launched (ragged_cuda.cu, RaggedTilesIdle).
cudaError_t LaunchFewRows(cudaStream_t stream, const RaggedProblem& p, bool fill);
// The pipelined prefill kernel (ragged_pipelined.cu, takes_pipelined) for the long sequences,
// where it runs (built in, an sm_90 GPU, head size 128): it sets p->pipelined, and the ragged
// kernel, launched next with *p, skips those sequences. Otherwise it launches nothing.
cudaError_t LaunchPipelinedPrefill(cudaStream_t stream, RaggedProblem* p);
// Whether the build has sm_90a code (wgmma) for the current GPU (ragged_pipelined.cu: the
// pipelined kernel's registers tell).
bool WgmmaCodeRuns();
#endif

template <typename Binding>
auto BindRagged(Binding binding) {
  return std::move(binding)
      .template Arg<ffi::AnyBuffer>()           // q
      .template Arg<ffi::Buffer<ffi::U8>>()     // kv_cache (read only)
      .template Arg<ffi::Buffer<ffi::S32>>()    // block_tables
      .template Arg<ffi::Buffer<ffi::S32>>()    // seq_lens
      .template Arg<ffi::Buffer<ffi::S32>>()    // cu_q_lens
      .template Arg<ffi::Buffer<ffi::S32>>()    // num_seqs
      .template Arg<ffi::Buffer<ffi::F32>>()    // k_scale
      .template Arg<ffi::Buffer<ffi::F32>>()    // v_scale
      .template Arg<ffi::Buffer<ffi::F32>>()    // sm_scale
      .template Ret<ffi::AnyBuffer>()           // out
      .template Ret<ffi::Buffer<ffi::F32>>()    // lse
      .template Ret<ffi::Buffer<ffi::F32>>()    // partial_out (split-KV workspace)
      .template Ret<ffi::Buffer<ffi::F32>>()    // partial_lse
      .template Ret<ffi::Buffer<ffi::F32>>()    // decode_partial_out (the decode kernel's)
      .template Ret<ffi::Buffer<ffi::F32>>()    // decode_partial_lse
      .template Attr<int32_t>("layout")
      .template Attr<bool>("v_scale_swizzle")
      .template Attr<int32_t>("num_splits")
      .template Attr<int32_t>("tokens_per_split")
      .template Attr<int32_t>("decode_splits")
      .template Attr<int32_t>("decode_tokens_per_split")
      .template Attr<bool>("decode_cluster_merge")
      .template Attr<int32_t>("max_q_len")
      .template Attr<bool>("few_rows_only");
}

}  // namespace nvfp4
