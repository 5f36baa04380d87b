// Device code of the kernels of ragged paged attention (ragged_cuda.cu: query tiles through
// shared memory, any number of rows; ragged_few_rows.cu: the sequences of a few query rows,
// speculative decoding): which sequences the few-row kernel takes, what a CTA knows of its
// launch, and the result of a row that sees nothing (both kernels); fragment loads from shared
// memory and the order of converted head dims (the ragged kernel's).
#pragma once

#include <cstdint>

#include "attention_device.cuh"
#include "cuda_common.cuh"
#include "ragged_ffi.h"
#include "wgmma.cuh"

namespace nvfp4 {
namespace {

// The few-row kernel takes the sequences of 2 or more query tokens (1 or more when it runs
// alone, p.few_rows_only) whose query rows per kv head (tokens x the GQA group) number at most
// p.few_rows_max (16, or 32 at head size 128 on sm_90a: ragged_ffi.h), head sizes up to
// kFewRowsMaxHead; the ragged kernel skips them (and
// the decode kernel takes those of one token).
__host__ __device__ __forceinline__ bool takes_few_rows(const RaggedProblem& p, int32_t q_len,
                                                        int32_t group, int64_t head_size) {
  return head_size <= kFewRowsMaxHead && q_len >= (p.few_rows_only ? 1 : 2) &&
         q_len <= p.few_rows_max / group;
}

// A sequence with more query tokens than the caller's bound (p.max_q_len > 0) breaks the
// call's contract: its rows are NaN (as on the jnp path), never another sequence's work.
__device__ __forceinline__ bool exceeds_max_q_len(const RaggedProblem& p, int32_t q_len) {
  return p.max_q_len > 0 && q_len > p.max_q_len;
}

// What a CTA of either kernel knows of its launch (the few-row kernel has no tile slots).
struct RaggedGrid {
  int32_t tile_slots;     // slots of query tiles; the rest zero the tokens nobody owns
  FastDivmod num_kv_heads;
  FastDivmod group;       // query heads per kv head
  FastDivmod block_size;
};

// Where a CTA of the three kernels stands: block x is (slot, kv head), the kv head fastest
// (every head's tiles of the first sequences are launched first: in a mixed batch the first
// sequences' long tiles then do not trail in the last wave); block z is (stacked member,
// split). With the member's sequences: its cu_q_lens row, its sequence count (clamped to
// [0, max_num_seqs]) and the first of its [num_tokens, num_q_heads] rows.
struct RaggedCta {
  int32_t slot, kv_head, member, split, group;
  const int32_t* cu;
  int32_t ns;
  int64_t member_rows;
};

__device__ __forceinline__ RaggedCta ragged_cta(const RaggedProblem& p, const RaggedGrid& grid) {
  RaggedCta c;
  uint32_t head;
  c.slot = int32_t(grid.num_kv_heads.divmod(blockIdx.x, &head));
  c.kv_head = int32_t(head);
  c.member = blockIdx.z / p.num_splits;
  c.split = blockIdx.z % p.num_splits;
  c.group = int32_t(grid.group.divisor);
  c.cu = p.cu_q_lens + (p.cu_stacked ? int64_t(c.member) * (p.max_num_seqs + 1) : 0);
  c.ns = min(max(__ldg(p.num_seqs + (p.num_seqs_stacked ? c.member : 0)), 0), p.max_num_seqs);
  c.member_rows = int64_t(c.member) * p.num_tokens * p.num_q_heads;
  return c;
}

// ------------------------------------------------------------------------------------------
// Shared-memory fragment loads.

__device__ __forceinline__ void ldmatrix_x4(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(p)));
}

__device__ __forceinline__ void ldmatrix_x4_trans(uint32_t (&r)[4], const void* p) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(shared_address(p)));
}

// Four 8x8 16-bit matrices from registers (a lane's row g, columns 2q, 2q + 1 of each) into
// shared memory transposed: lane L gives the address of row L % 8 of matrix L / 8 of the result.
// (The address as a shared-memory address, or a generic pointer.)
__device__ __forceinline__ void stmatrix_x4_trans(uint32_t at, uint32_t r0, uint32_t r1,
                                                  uint32_t r2, uint32_t r3) {
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1,%2,%3,%4};\n" ::"r"(at),
               "r"(r0), "r"(r1), "r"(r2), "r"(r3)
               : "memory");
}
__device__ __forceinline__ void stmatrix_x4_trans(void* p, uint32_t r0, uint32_t r1, uint32_t r2,
                                                  uint32_t r3) {
  stmatrix_x4_trans(shared_address(p), r0, r1, r2, r3);
}

// Head dimension of position p (0..7) of a converted group of 8 (e2m1x8_to_f16x2's order:
// dims 0, 4, 2, 6, 1, 5, 3, 7); position 2c + 1 holds dimension kPermutedDim(2c) + 4.
__device__ __forceinline__ int permuted_dim_even(int c) { return ((c & 1) << 1) | (c >> 1); }

// The factor a member's normalised values are stored with in out: its v_scale x 2^7 (the
// kernels' fp16 V values are the values / v_scale x 2^-7: ragged_tiles.cuh, convert_vector).
__device__ __forceinline__ float member_out_scale(const RaggedProblem& p, int32_t member) {
  return p.v_scale[p.v_scale_stacked ? member : 0] * 128.f;
}
// The factor a split's values are stored with: member_out_scale with one split (into out), 1
// for a partial result (the merge kernel scales the merged row).
__device__ __forceinline__ float split_out_scale(const RaggedProblem& p, int32_t member) {
  return p.num_splits == 1 ? member_out_scale(p, member) : 1.f;
}

// A query row's lse in this split from its log2 lse: natural log into lse with one split, the
// log2 partial for the merge kernel otherwise. -inf (nothing attended) and NaN (a rule broken)
// stay what they are through the product.
__device__ __forceinline__ void write_row_lse(const RaggedProblem& p, int64_t row, int split,
                                              float lse2) {
  const bool one_split = p.num_splits == 1;
  *(one_split ? p.lse + row : p.partial_lse + row * p.num_splits + split) =
      one_split ? lse2 * kLn2 : lse2;
}

// A query row's partial result of this split in the split-KV workspace [rows, splits, D].
__device__ __forceinline__ float* partial_row(const RaggedProblem& p, int64_t row, int split,
                                              int head_size) {
  return p.partial_out + (row * p.num_splits + split) * head_size;
}

// Where a query row's float32 values go in this split: its row of out with one split (where out
// is float32), else its partial_row.
__device__ __forceinline__ float* row_values_f32(const RaggedProblem& p, int64_t row, int split,
                                                 int head_size) {
  return p.num_splits == 1 ? static_cast<float*>(p.out) + row * head_size
                           : partial_row(p, row, split, head_size);
}

// Writes the result of a query row that attends to nothing in this split: zeros and -inf (one
// split) or an empty partial result (the merge then skips it).
__device__ __forceinline__ void write_empty(const RaggedProblem& p, int64_t row, int split,
                                            int d, int head_size) {
  if (p.num_splits == 1) store_out(p.out, p.q_type, row * head_size + d, 0.f);
  if (d == 0) write_row_lse(p, row, split, -INFINITY);
}

// Writes a query row's result in this split, dim d: its value (normalised by its own sum) and
// log2 lse, times out_scale into out with one split, or as a partial result (the merge kernel
// scales it).
__device__ __forceinline__ void write_result(const RaggedProblem& p, int64_t row, int split, int d,
                                             int head_size, float value, float lse2,
                                             float out_scale) {
  if (p.num_splits == 1)
    store_out(p.out, p.q_type, row * head_size + d, value * out_scale);
  else
    partial_row(p, row, split, head_size)[d] = value;
  if (d == 0) write_row_lse(p, row, split, lse2);
}

// Writes NaN for a query row of a sequence that breaks max_q_len (its result, or with split-KV
// a NaN partial lse, which the merge turns into a NaN row).
__device__ __forceinline__ void write_nan(const RaggedProblem& p, int64_t row, int split, int d,
                                          int head_size) {
  if (p.num_splits == 1) store_out(p.out, p.q_type, row * head_size + d, NAN);
  if (d == 0) write_row_lse(p, row, split, NAN);
}

// The readers' rule for an invalid global scale (jax_nvfp4.checks.nan_if_invalid), which the
// kernels of a ragged call apply themselves (no select over the output after them): where
// member's k_scale or v_scale is outside [kMinScale, kMaxScale] or NaN, every row a CTA owes
// is write_nan's (with split-KV a NaN partial lse, which the merge makes a NaN row), the
// unowned tokens' too; the decode kernel does the same for the one-token sequences.
__device__ __forceinline__ bool member_scales_valid(const RaggedProblem& p, int32_t member) {
  return scale_is_valid(p.k_scale[p.k_scale_stacked ? member : 0]) &&
         scale_is_valid(p.v_scale[p.v_scale_stacked ? member : 0]);
}

// A sequence's positions in one split of a ragged call (every kernel's): what query token j sees
// (causal, up to its own position, inside the block table) and the split's share of the table.
struct SplitRange {
  int32_t kv_len, q_len, capacity, begin, split_end;
  __device__ __forceinline__ int32_t row_limit(int32_t j) const {
    return min(max(kv_len - (q_len - 1 - j), 0), capacity);
  }
  // The end of sequence row `row`'s positions (its query token row / group) in this split.
  __device__ __forceinline__ int32_t row_end(const RaggedGrid& grid, int32_t row) const {
    return min(row_limit(int32_t(grid.group.div(uint32_t(row)))), split_end);
  }
};

__device__ __forceinline__ SplitRange split_range(const RaggedProblem& p, const RaggedGrid& grid,
                                                  int32_t member, int32_t seq, int32_t q_len,
                                                  int32_t split) {
  SplitRange r;
  r.kv_len = max(__ldg(p.seq_lens + (p.lens_stacked ? int64_t(member) * p.max_num_seqs : 0) + seq),
                 0);
  r.q_len = q_len;
  r.capacity = p.max_blocks * int32_t(grid.block_size.divisor);
  // (int64: the FFI checks that every split starts inside the table, so begin fits int32)
  r.begin = int32_t(min(int64_t(split) * p.tokens_per_split, int64_t(r.capacity)));
  r.split_end =
      int32_t(min(int64_t(split) * p.tokens_per_split + p.tokens_per_split, int64_t(r.capacity)));
  return r;
}

// The pages of sequence `seq` of `member` for kv head `kv_head`; tiles of 16 positions lie in one
// page where the block size is a multiple of 16 (fetch_pages' one entry a tile).
template <Layout kLayout>
__device__ __forceinline__ PageView<kLayout> sequence_page_view(const RaggedProblem& p,
                                                                const RaggedGrid& grid,
                                                                int32_t member, int32_t seq,
                                                                int32_t kv_head) {
  PageView<kLayout> pv;
  const int32_t side_bytes = int32_t(p.page.side_bytes());
  const int32_t block_size = int32_t(grid.block_size.divisor);
  pv.cache = p.kv_cache + int64_t(member) * p.num_blocks * 2 * side_bytes;
  pv.table = p.block_tables +
             ((p.tables_stacked ? int64_t(member) * p.max_num_seqs : 0) + seq) * p.max_blocks;
  pv.page_bytes = 2 * int64_t(side_bytes);
  pv.side_bytes = side_bytes;
  pv.side_data = int32_t(p.page.side_data_bytes());
  pv.head_row = kLayout == Layout::kHND ? kv_head * block_size : kv_head;
  pv.num_kv_heads = int32_t(p.page.num_kv_heads);
  pv.last_page = p.num_blocks - 1;
  pv.block_size = grid.block_size;
  pv.tile_in_page = block_size % 16 == 0;
  return pv;
}

// One CTA's sequence in the few-row kernel (either path, ragged_few_rows.cu and
// few_rows_wide.cuh): its rows (query tokens x the query heads of one kv head), the positions
// of this split they attend to, and where each row's results go.
struct FewRowsSequence {
  const RaggedProblem& p;
  const RaggedGrid& grid;
  SplitRange range;
  int64_t member_rows;   // the first of the member's [T, Hq] rows
  int32_t start, kv_head, group, rows;
  int32_t begin, last_end;  // positions [begin, last_end): the last row's in this split

  __device__ __forceinline__ FewRowsSequence(const RaggedProblem& p_, const RaggedGrid& grid_,
                                             int32_t b, int32_t kv_head_, int32_t member,
                                             int32_t split, int32_t start_, int32_t q_len)
      : p(p_),
        grid(grid_),
        range(split_range(p_, grid_, member, b, q_len, split)),
        member_rows(int64_t(member) * p_.num_tokens * p_.num_q_heads),
        start(start_),
        kv_head(kv_head_),
        group(int32_t(grid_.group.divisor)),
        rows(q_len * int32_t(grid_.group.divisor)),
        begin(range.begin),
        last_end(min(range.row_limit(q_len - 1), range.split_end)) {}

  // Row r's index among the member's [T, Hq] rows.
  __device__ __forceinline__ int64_t q_row(int r) const {
    uint32_t h;
    const uint32_t j = grid.group.divmod(uint32_t(r), &h);
    return member_rows + int64_t(start + int32_t(j)) * p.num_q_heads + kv_head * group +
           int32_t(h);
  }
  // The end of row r's positions in this split (a row past `rows`: none).
  __device__ __forceinline__ uint32_t row_end(int r) const {
    return r < rows ? uint32_t(max(range.row_end(grid, r), begin)) : uint32_t(begin);
  }
  // Whether the split has nothing for the rows to attend to; then the CTA's kThreads threads
  // write their empty results.
  template <int kHead, int kThreads>
  __device__ __forceinline__ bool nothing_to_attend(int32_t split) const {
    if (begin < last_end) return false;
    for (int i = threadIdx.x; i < rows * kHead; i += kThreads)
      write_empty(p, q_row(i / kHead), split, i % kHead, kHead);
    return true;
  }
};

// [start_0, start_ns): the tokens some sequence owns (every lane gets them).
__device__ __forceinline__ void owned_tokens(const int32_t* cu, int32_t ns, int32_t num_tokens,
                                             int lane, int32_t* first, int32_t* last) {
  int32_t unused;
  sequence_tokens(cu, ns - 1, num_tokens, lane, &unused, last);  // start_ns
  *first = min(max(__ldg(cu), 0), num_tokens);
}

// Tokens a fill slot of either kernel's grid covers.
constexpr int32_t kFillTokens = 64;
// The fill slots of a call (kFillTokens tokens each), on the grid's x axis after the
// sequences' slots of whichever kernel zeroes the unowned tokens.
inline int64_t FillSlots(const RaggedProblem& p) {
  return (int64_t(p.num_tokens) + kFillTokens - 1) / kFillTokens;
}

// Fill slot `fill` of a CTA of kThreads threads: empty results (write_empty) for the rows of
// the CTA's kv head of the tokens [64 fill, 64 fill + 64) that no sequence owns, those before
// start_0 and those from start_ns on (NaN rows where the member's global scales are invalid:
// member_scales_valid). Only these are visited: a loop over all 64 tokens' rows cost ~22 us
// per call on an H200 where every token is owned (speculative decoding).
template <int kHead, int kThreads>
__device__ __forceinline__ void zero_unowned_tokens(const RaggedProblem& p, const RaggedCta& cta,
                                                    int32_t fill, int lane) {
  int32_t first, last;
  owned_tokens(cta.cu, cta.ns, p.num_tokens, lane, &first, &last);
  const bool valid = member_scales_valid(p, cta.member);
  const int32_t group = cta.group;
  const int32_t t0 = fill * kFillTokens, t_end = min(t0 + kFillTokens, p.num_tokens);
  for (int part = 0; part < 2; ++part) {
    const int32_t lo = part == 0 ? t0 : max(max(last, first), t0);
    const int32_t hi = part == 0 ? min(first, t_end) : t_end;
    const int32_t count = max(hi - lo, 0) * group;
    for (int32_t i = threadIdx.x; i < count * kHead; i += kThreads) {
      const int32_t r = i / kHead, d = i % kHead;
      const int32_t t = lo + r / group;
      const int64_t row =
          cta.member_rows + int64_t(t) * p.num_q_heads + cta.kv_head * group + r % group;
      if (valid)
        write_empty(p, row, cta.split, d, kHead);
      else
        write_nan(p, row, cta.split, d, kHead);
    }
  }
}

}  // namespace
}  // namespace nvfp4
