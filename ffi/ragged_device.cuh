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

// The few-row kernel takes the sequences of 2 or more query tokens whose query rows per kv
// head (tokens x the GQA group) number at most kFewRows (its MMA's N), head sizes up to 128;
// the ragged kernel skips them (and the decode kernel takes those of one token). 16, not 32:
// with 32 rows (4 n-tiles) the kernel spilled and took 514 us at 32 x 8 over 8192 where the
// ragged kernel's tiles take 354 us (H200, benchmarks/NOTES.md).
constexpr int32_t kFewRows = 16;
constexpr int64_t kFewRowsMaxHead = 128;  // its largest head size
__host__ __device__ __forceinline__ bool takes_few_rows(int32_t q_len, int32_t group,
                                                        int64_t head_size) {
  return head_size <= kFewRowsMaxHead && q_len >= 2 && q_len <= kFewRows / group;
}

// What a CTA of either kernel knows of its launch (the few-row kernel has no tile slots).
struct RaggedGrid {
  int32_t tile_slots;     // slots of query tiles; the rest zero the tokens nobody owns
  FastDivmod num_kv_heads;
  FastDivmod group;       // query heads per kv head
  FastDivmod block_size;
};

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

// Head dimension of position p (0..7) of a converted group of 8 (e2m1x8_to_f16x2's order:
// dims 0, 4, 2, 6, 1, 5, 3, 7); position 2c + 1 holds dimension kPermutedDim(2c) + 4.
__device__ __forceinline__ int permuted_dim_even(int c) { return ((c & 1) << 1) | (c >> 1); }

// Writes the result of a query row that attends to nothing in this split: zeros and -inf (one
// split) or an empty partial result (the merge then skips it).
__device__ __forceinline__ void write_empty(const RaggedProblem& p, int64_t row, int split,
                                            int d, int head_size) {
  if (p.num_splits == 1) {
    store_out(p.out, p.q_type, row * head_size + d, 0.f);
    if (d == 0) p.lse[row] = -INFINITY;
  } else if (d == 0) {
    p.partial_lse[row * p.num_splits + split] = -INFINITY;
  }
}

}  // namespace
}  // namespace nvfp4
