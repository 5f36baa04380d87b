// Ragged paged attention over the NVFP4 cache on the GPU (jax_nvfp4.ragged_paged_attention):
// several query tokens per sequence (chunked prefill, prefix reuse, speculative decoding, mixed
// batches), causal; built for sm_90a (wgmma) and Blackwell (mma.sync).
//
// Work: one CTA (4 warps) per (query tile, kv head, stacked member, split). A query tile is up
// to kRows = 64 query rows of one sequence, a row being one (query token, query head of this kv
// head): sequence b's q_len_b * group rows, token-major, cut into tiles. The grid's x axis has
// an upper bound of slots (ceil(T * group / 64) + min(S, T)) times the kv heads, the kv head
// varying fastest; each CTA finds its sequence and tile from cu_q_lens with a warp scan (the
// sequence layout is a device value: no host plan), and slots past the last tile exit. A
// further ceil(T / 64) slots write zeros for the tokens no sequence owns. The rules (which
// tokens a sequence owns, which positions a query sees) are those of
// jax_nvfp4.reference.ragged_token_plan.
//
// Per step the CTA converts kKv positions of K and V (the pages of this kv head) from FP4 codes
// to fp16 in shared memory, once for every query row of the tile, exactly (attention_device.cuh;
// head dimensions permuted within groups of 8, q permuted to match, the output written back in
// true order), in the 128-byte-swizzled layout wgmma reads. The raw page bytes reach shared
// memory by cp.async, kStages - 1 steps ahead of their conversion (a ring of stages); two
// barriers a step order the ring and the one fp16 K/V buffer. Then, FlashAttention-2 style with
// a float32 online softmax per row:
//   S = Q K^T   query rows in M, positions in N, head dims in K,
//   O += P V    query rows in M, head dims in N, positions in K (P from the S accumulators).
// A tile of more than 32 rows (prefill chunks) multiplies on wgmma (sm_90a; head sizes 64 and
// 128): the CTA's 4 warps are one warpgroup, q and P in registers, K and V read from shared
// memory through descriptors. Other tiles, head size 256 and other GPUs use mma.sync m16n8k16
// (fp16 in, float32 accumulate; fragments by ldmatrix): a tile of more than 32 rows gives each
// warp 16 rows and all of a step's positions; a tile of 16 or 32 rows (speculative decoding)
// gives each warp a quarter or half of the positions instead (each page is still read once for
// all of the tile's rows), and the warps' partial results are merged through shared memory at
// the end. Long contexts with few tiles split across CTAs (split-KV) and a second kernel merges
// the splits. The sequences that own one query token (the decode tokens of a mixed batch) go to
// the decode kernel (decode_cuda.cu, ragged mode), launched after this one: it reads the pages
// straight into its MMA fragments, faster for one token than a tile through shared memory.
//
// Only the pages a tile needs are read (positions < the end of its last row), page ids are
// clamped into the cache, positions a row may not see are masked (-inf scores), positions past
// what the tile reads are zeros, not loads. A NaN score makes its row NaN (as on the jnp path);
// a NaN in the V of a position that a row may not see but a later row of the tile may (a NaN
// stored among the sequence's own tokens) also reaches that row, through 0 x NaN in P V.
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cmath>
#include <cstdint>

#include "attention_device.cuh"
#include "cuda_common.cuh"
#include "handlers.h"
#include "ragged_device.cuh"
#include "ragged_ffi.h"
#include "wgmma.cuh"

namespace nvfp4 {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kRows = 16 * kWarps;  // query rows per CTA (jax_nvfp4/ragged_primitive.py)
constexpr uint32_t kFullMask = 0xFFFFFFFFu;

template <int kHead>
struct RaggedShape {
  static constexpr int kKv = kHead >= 256 ? 32 : 64;  // positions converted per step
  static constexpr int kStride = kHead + 8;            // halves per shared q row (+16 B: no
                                                       // bank conflicts for ldmatrix)
  static constexpr int kKSteps = kHead / 16;           // MMA k-steps of S
  static constexpr int kSTiles = kKv / 8;              // n-tiles of S
  static constexpr int kOTiles = kHead / 8;            // n-tiles of O
  static constexpr int kPSteps = kKv / 16;             // k-steps of P V
  static constexpr int kScales = kHead / 16;           // E4M3 scales per (head, position)
  // Conversion: 2 * kKv (position, side) head vectors per step over 128 threads.
  static constexpr int kThreadsPerVector = kThreads / (2 * kKv);
  static constexpr int kThreadDims = kHead / kThreadsPerVector;
  static constexpr int kCodeBytes = kThreadDims / 2;
  static constexpr int kCodeWords = kCodeBytes / 4;
  static constexpr int kScaleBytes = kThreadDims / 16;  // 4 or 8
  // q's fragments in registers for the whole CTA (head size 256: from shared memory each step,
  // the O accumulators need the registers).
  static constexpr bool kQInRegisters = kHead <= 128;
  // Tiles of more than 32 rows multiply on wgmma where it exists (sm_90a), with q from
  // registers; the others (and head size 256) on mma.sync.
  static constexpr bool kWgmma = kHasWgmma && kQInRegisters;
  // The raw page bytes of a step are copied (cp.async) into a ring of kStages stages, kStages - 1
  // steps ahead of their conversion: what is in flight per CTA, ~3 x 9 KB, hides the memory
  // latency where a step's tensor-core work is short (few query rows). A staged code row is
  // padded by 16 bytes (conflict-free 16-byte accesses).
  static constexpr int kStages = 4;
  static constexpr int kRawStride = kHead / 2 + 16;
  static constexpr int kRawCodeBytes = 2 * kKv * kRawStride;
  static constexpr int kRawStageBytes = kRawCodeBytes + 2 * kKv * kScales;
  // The fp16 K and V of a step, each [kHead / 64 blocks][kKv positions][64 dims] with 128-byte
  // rows and the 128-byte swizzle (16-byte chunk c of position p at chunk c ^ (p % 8)): the
  // layout wgmma reads through a descriptor, K-major for K in S = Q K^T and MN-major for V in
  // O = P V (checked on an H200 by a probe, benchmarks/NOTES.md), and conflict-free for
  // ldmatrix and the conversion's 16-byte stores.
  static constexpr int kBlockBytes = kKv * 128;          // one 64-dim block of one side
  static constexpr int kSideBytes = kHead / 64 * kBlockBytes;
  static constexpr int kKvBytes = 2 * kSideBytes;
  // Shared memory: the K/V buffer first (1024-byte aligned for the swizzle), q, the raw ring,
  // per-row data. The warps' final states reuse the K/V buffer, q and the ring.
  static constexpr int kQBytes = kRows * kStride * 2;
  static constexpr int kRingBytes = kStages * kRawStageBytes;
  static constexpr int kMergeFloats = kWarps * 16 * (kHead + 2);
  static constexpr int kRowBytes = kRows * 3 * 4;
  static constexpr int kSmemBytes = kKvBytes + kQBytes + kRingBytes + kRowBytes;
  static_assert(kMergeFloats * 4 <= kKvBytes + kQBytes + kRingBytes,
                "the merge reuses the K/V buffer, q and the ring");
  static_assert(kHead % 64 == 0 && kKvBytes % 1024 == 0, "whole 128-byte swizzle atoms");
  static_assert(kScaleBytes == 4 || kScaleBytes == 8, "scale copies of 4 or 8 bytes");
  static_assert(kRawStageBytes % 16 == 0 && kQBytes % 16 == 0 && kKvBytes % 16 == 0,
                "16-byte aligned regions");
};

// Byte offset, in one side of the K/V buffer, of the 16 bytes holding dims [8 c, 8 c + 8) of
// position p (RaggedShape: 64-dim blocks of 128-byte rows, 128-byte swizzle).
template <int kHead>
__device__ __forceinline__ int kv_chunk(int p, int c) {
  return (c >> 3) * RaggedShape<kHead>::kBlockBytes + swizzle128_offset(p, 8 * (c & 7));
}

// ------------------------------------------------------------------------------------------
// The tile a CTA works on.

struct TileWork {
  int32_t seq;    // sequence b
  int32_t start;  // its first query token
  int32_t q_len;  // its query tokens
  int32_t tile;   // which of its tiles (rows tile * kRows ..)
};

// The `slot`-th unit of work of the batch (every lane of the warp gets it), where a sequence of
// q_len query tokens has units_of(q_len) units, numbered from its last one (w->tile: the unit's
// index in its sequence, counted from the first) so that the longest tiles start first.
// Sequence b owns the tokens [start_b, start_{b+1}), start_b = clamp(max(cu_q_lens[0..b]), 0,
// T), b < ns. Returns false for a slot past the last unit.
template <typename UnitsOf>
__device__ __forceinline__ bool find_unit(const int32_t* cu, int32_t ns, int32_t num_tokens,
                                          int32_t slot, int lane, const UnitsOf& units_of,
                                          TileWork* w) {
  int32_t running = INT_MIN;  // max of cu[0 .. base - 1]
  int32_t before = 0;         // units of the sequences before base
  for (int32_t base = 0; base < ns; base += 32) {
    const int32_t b = base + lane;
    const bool live = b < ns;
    const int32_t c0 = live ? __ldg(cu + b) : INT_MIN;
    const int32_t c1 = live ? __ldg(cu + b + 1) : INT_MIN;
    int32_t m = c0;
#pragma unroll
    for (int d = 1; d < 32; d *= 2) {
      const int32_t other = __shfl_up_sync(kFullMask, m, d);
      if (lane >= d) m = max(m, other);
    }
    m = max(m, running);
    const int32_t s0 = min(max(m, 0), num_tokens);
    const int32_t s1 = min(max(max(m, c1), 0), num_tokens);
    const int32_t q_len = live ? s1 - s0 : 0;
    const int32_t units = live ? units_of(q_len) : 0;
    int32_t incl = units;
#pragma unroll
    for (int d = 1; d < 32; d *= 2) {
      const int32_t other = __shfl_up_sync(kFullMask, incl, d);
      if (lane >= d) incl += other;
    }
    const int32_t lo = before + incl - units, hi = before + incl;
    const uint32_t hit = __ballot_sync(kFullMask, live && slot >= lo && slot < hi);
    if (hit) {
      const int src = __ffs(hit) - 1;
      w->seq = __shfl_sync(kFullMask, b, src);
      w->start = __shfl_sync(kFullMask, s0, src);
      w->q_len = __shfl_sync(kFullMask, q_len, src);
      const int32_t local = slot - __shfl_sync(kFullMask, lo, src);
      w->tile = __shfl_sync(kFullMask, units, src) - 1 - local;
      return true;
    }
    running = __shfl_sync(kFullMask, m, 31);
    before = __shfl_sync(kFullMask, hi, 31);
  }
  return false;
}

// The query tiles of a sequence: its q_len x group rows in tiles of kRows.
__host__ __device__ __forceinline__ int32_t tiles_of(int32_t q_len, int32_t group) {
  return (q_len * group + kRows - 1) / kRows;
}

// The `slot`-th query tile of the batch (find_unit: a unit is a tile).
__device__ __forceinline__ bool find_tile(const int32_t* cu, int32_t ns, int32_t num_tokens,
                                          int32_t group, int32_t slot, int lane, TileWork* w) {
  return find_unit(cu, ns, num_tokens, slot, lane,
                   [group](int32_t q_len) { return tiles_of(q_len, group); }, w);
}

// ------------------------------------------------------------------------------------------
// One thread's (position, side, part) of a step: copied from the pages into a ring stage, then
// converted to fp16 into the K/V buffer.

// Where a thread's bytes go in a ring stage: its codes, and the scale bytes of its position's
// plane row (for swizzled V scales these are not its own scales: the 4 positions of a row
// group hold the group's scales between them, docs/format.md §4).
template <int kHead>
struct StageSlot {
  int code_offset;   // in the stage
  int scale_offset;  // in the stage: this (side, position)'s staged plane row of scales
  int scale_part;    // byte of that row this thread copies
};

template <int kHead>
__device__ __forceinline__ StageSlot<kHead> stage_slot(int side, int position, int part) {
  using R = RaggedShape<kHead>;
  const int vector = side * R::kKv + position;
  return {vector * R::kRawStride + part * R::kCodeBytes,
          R::kRawCodeBytes + vector * R::kScales, part * R::kScaleBytes};
}

// Copies this thread's bytes of position `pos` into `stage`: codes when pos < end, scales when
// the position's row group starts before end (swizzled V: the group's 4 plane rows hold the
// scales of all 4 positions; rows past end inside the group are read but never used).
template <int kHead, bool kSwizzle, Layout kLayout>
__device__ __forceinline__ void copy_vector(uint8_t* stage, const StageSlot<kHead>& slot,
                                            const PageView<kLayout>& pv, int32_t page,
                                            uint32_t pos, uint32_t end, uint32_t row, int side,
                                            int part) {
  using R = RaggedShape<kHead>;
  const bool code_valid = pos < end;
  const bool scale_valid = (kSwizzle && side == 1) ? (pos & ~3u) < end : code_valid;
  const uint8_t* side_bytes = pv.cache + pv.page_offset(page) + side * pv.side_bytes;
  const int32_t plane = pv.plane_row(row);
  const uint8_t* codes = code_valid ? side_bytes + plane * (kHead / 2) + part * R::kCodeBytes
                                    : pv.cache;
  const uint8_t* scales = scale_valid
      ? side_bytes + pv.side_data + plane * R::kScales + slot.scale_part : pv.cache;
#pragma unroll
  for (int i = 0; i < R::kCodeBytes / 16; ++i)
    copy_async<16>(stage + slot.code_offset + 16 * i, codes + 16 * i, code_valid);
  copy_async<R::kScaleBytes>(stage + slot.scale_offset + slot.scale_part, scales, scale_valid);
}

// The staged codes times their block scales as fp16 (value * 2^-7 / global scale, exact), 8
// dims per 16-byte store; a position past end is zeros (its staged scale may be a junk row's).
template <int kHead, bool kSwizzle>
__device__ __forceinline__ void convert_vector(const uint8_t* stage,
                                               const StageSlot<kHead>& slot, int side,
                                               int position, int part, bool valid,
                                               uint8_t* side_buffer) {
  using R = RaggedShape<kHead>;
  const int chunk0 = part * R::kThreadDims / 8;
  const auto dst = [&](int w) {
    return reinterpret_cast<uint4*>(side_buffer + kv_chunk<kHead>(position, chunk0 + w));
  };
  if (!valid) {
#pragma unroll
    for (int w = 0; w < R::kCodeWords; ++w) *dst(w) = make_uint4(0, 0, 0, 0);
    return;
  }
  uint32_t scales[R::kScaleBytes / 4];
  if (kSwizzle && side == 1) {
    // Block s of position r: plane row 4 (r / 4) + s / G, column 4 (s % G) + r % 4.
    constexpr int kGroup = R::kScales / 4;
    const uint8_t* group_rows = stage + slot.scale_offset - (position & 3) * R::kScales;
#pragma unroll
    for (int w = 0; w < R::kScaleBytes / 4; ++w) {
      uint32_t word = 0;
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int s = part * R::kScaleBytes + 4 * w + i;
        word |= uint32_t(group_rows[(s / kGroup) * R::kScales + 4 * (s % kGroup) +
                                    (position & 3)]) << (8 * i);
      }
      scales[w] = word;
    }
  } else {
    const uint8_t* own = stage + slot.scale_offset + slot.scale_part;
    if constexpr (R::kScaleBytes == 8) {
      const uint2 v = *reinterpret_cast<const uint2*>(own);
      scales[0] = v.x, scales[1] = v.y;
    } else {
      scales[0] = *reinterpret_cast<const uint32_t*>(own);
    }
  }
  uint32_t codes[R::kCodeWords];
#pragma unroll
  for (int i = 0; i < R::kCodeWords / 4; ++i) {
    const uint4 v = *reinterpret_cast<const uint4*>(stage + slot.code_offset + 16 * i);
    codes[4 * i] = v.x, codes[4 * i + 1] = v.y, codes[4 * i + 2] = v.z, codes[4 * i + 3] = v.w;
  }
#pragma unroll
  for (int pair = 0; pair < R::kScaleBytes / 2; ++pair) {
    const uint32_t scale2 = e4m3x2_to_f16x2_x128(scales[pair / 2] >> (16 * (pair % 2)));
#pragma unroll
    for (int half = 0; half < 2; ++half) {  // block 2 pair + half: code words 4 pair + 2 half, +1
      const uint32_t scale = prmt(scale2, scale2, half ? 0x3232 : 0x1010);
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        const int w = 4 * pair + 2 * half + k;
        uint32_t r[4];
        e2m1x8_to_f16x2(codes[w], r);
        *dst(w) = make_uint4(hmul2(r[0], scale), hmul2(r[1], scale), hmul2(r[2], scale),
                             hmul2(r[3], scale));
      }
    }
  }
}

// ------------------------------------------------------------------------------------------
// The pipelined prefill kernel's constants and the sequences it takes (the kernel is below the
// ragged kernel, which skips those sequences when it runs).

#ifndef NVFP4_RAGGED_PIPELINED
#define NVFP4_RAGGED_PIPELINED 0
#endif

constexpr int kPipelinedHead = 128;
constexpr int32_t kPipelinedMinRows = 32;  // more rows than this: the tiles are wgmma tiles
constexpr int kPipeStages = 4;             // fp16 K/V stages between producer and consumers
constexpr int kPipeThreads = 3 * kThreads;
// 128 x 56 + 256 x 224 registers <= 64 K (the probe: at 24 the producer spilled, D ran 0.64x)
constexpr int kProducerRegisters = 56, kConsumerRegisters = 224;

// Shared memory: the fp16 stages (1024-byte aligned), the raw ring, both tiles' q, row data.
struct PipeShape {
  using R = RaggedShape<kPipelinedHead>;
  static constexpr int kRingOffset = kPipeStages * R::kKvBytes;
  static constexpr int kQOffset = kRingOffset + R::kRingBytes;
  static constexpr int kRowOffset = kQOffset + 2 * kRows * R::kStride * 2;
  static constexpr int kSmemBytes = kRowOffset + 2 * kRows * 3 * 4;
};

// Named barriers (0 is __syncthreads): stage i full (the producer arrives, the consumers wait)
// and empty (the consumers arrive, the producer waits), the producer's own, each consumer's.
__device__ __forceinline__ int full_barrier(int stage) { return 1 + stage; }
__device__ __forceinline__ int empty_barrier(int stage) { return 1 + kPipeStages + stage; }
constexpr int kProducerBarrier = 1 + 2 * kPipeStages;
__device__ __forceinline__ int consumer_barrier(int c) { return 2 + 2 * kPipeStages + c; }

// Whether the pipelined kernel takes a sequence of q_len query tokens (when it runs).
// (kHasWgmma: in code built without sm_90a the kernel is empty, so nothing may be skipped for it;
// the launch also checks, PipelinedPrefillRuns.)
__device__ __forceinline__ bool takes_pipelined(const RaggedProblem& p, int32_t q_len,
                                                int32_t group) {
  return kHasWgmma && p.pipelined && q_len * group > kPipelinedMinRows &&
         !(p.decode_splits > 0 && q_len == 1) && !exceeds_max_q_len(p, q_len);
}

// ------------------------------------------------------------------------------------------
// The kernel.

template <int kHead, bool kSwizzle, Layout kLayout>
__global__ void __launch_bounds__(kThreads, 2)  // 2 CTAs/SM: shared memory allows no more
    RaggedKernel(const RaggedProblem p, const RaggedGrid grid) {
  using R = RaggedShape<kHead>;
  extern __shared__ __align__(1024) uint8_t smem[];
  uint8_t* kv_smem = smem;                                        // [K, V][blocks][kKv][64]
  uint16_t* q_smem = reinterpret_cast<uint16_t*>(smem + R::kKvBytes);
  uint8_t* ring = smem + R::kKvBytes + R::kQBytes;                  // [kStages][stage]
  float* merge_smem = reinterpret_cast<float*>(smem);              // after the loop
  int32_t* row_end = reinterpret_cast<int32_t*>(ring + R::kRingBytes);
  float* row_scale = reinterpret_cast<float*>(row_end + kRows);
  int32_t* row_q = row_end + 2 * kRows;

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, qd = lane & 3;
  // Block x is (slot, kv head), the kv head fastest: every head's tiles of the first sequences
  // are launched first (in a mixed batch the first sequences' long few-row tiles then do not
  // trail in the last wave of the grid).
  uint32_t head;
  const int32_t slot = int32_t(grid.num_kv_heads.divmod(blockIdx.x, &head));
  const int32_t kv_head = int32_t(head);
  const int32_t member = blockIdx.z / p.num_splits, split = blockIdx.z % p.num_splits;
  const int32_t num_tokens = p.num_tokens, max_num_seqs = p.max_num_seqs;
  const int32_t group = int32_t(grid.group.divisor);
  const int32_t* cu = p.cu_q_lens + (p.cu_stacked ? int64_t(member) * (max_num_seqs + 1) : 0);
  const int32_t ns =
      min(max(__ldg(p.num_seqs + (p.num_seqs_stacked ? member : 0)), 0), max_num_seqs);
  const int64_t member_rows = int64_t(member) * num_tokens * p.num_q_heads;

  if (slot >= grid.tile_slots) {  // a fill slot: zeros for the tokens nobody owns
    zero_unowned_tokens<kHead, kThreads>(p, cu, ns, group, kv_head, member_rows, split,
                                         slot - grid.tile_slots, lane);
    return;
  }

  TileWork work;
  if (!find_tile(cu, ns, num_tokens, group, slot, lane, &work)) return;

  // The tile's rows: row r is row row0 + r of the sequence, i.e. query token j = (row0 + r) /
  // group, query head kv_head * group + (row0 + r) % group; it sees positions < its end.
  const int32_t rows_seq = work.q_len * group;
  const int32_t row0 = work.tile * kRows;
  const int rows_here = min(kRows, rows_seq - row0);
  const int32_t block_size = int32_t(grid.block_size.divisor);
  const int32_t capacity = p.max_blocks * block_size;
  const int32_t kv_len =
      max(__ldg(p.seq_lens + (p.lens_stacked ? int64_t(member) * max_num_seqs : 0) + work.seq), 0);
  const auto row_limit = [&](int32_t j) {  // positions query j attends to
    return min(max(kv_len - (work.q_len - 1 - j), 0), capacity);
  };
  // (int64: the FFI checks that every split starts inside the table, so begin fits int32)
  const int32_t begin = int32_t(min(int64_t(split) * p.tokens_per_split, int64_t(capacity)));
  const int32_t split_end =
      int32_t(min(int64_t(split) * p.tokens_per_split + p.tokens_per_split, int64_t(capacity)));
  const int32_t last_end = min(row_limit(grid.group.div(uint32_t(row0 + rows_here - 1))), split_end);
  const auto q_row_of = [&](int r) {  // the row's index among the member's [T, Hq] rows
    uint32_t head;
    const uint32_t j = grid.group.divmod(uint32_t(row0 + r), &head);
    return member_rows + int64_t(work.start + int32_t(j)) * p.num_q_heads + kv_head * group +
           int32_t(head);
  };

  // The few-row kernel (ragged_few_rows.cu) takes speculative decoding's sequences.
  if (takes_few_rows(p, work.q_len, group, kHead)) return;
  if (takes_pipelined(p, work.q_len, group)) return;  // the pipelined prefill kernel's
  if (p.decode_splits > 0 && work.q_len == 1) {
    // The decode kernel, launched after this one, attends for this one-token sequence and
    // writes its rows; with split-KV the merge below reads them first: empty partial results.
    if (p.num_splits > 1)
      for (int r = threadIdx.x; r < rows_here; r += kThreads)
        write_empty(p, q_row_of(r), split, 0, kHead);
    return;
  }
  if (exceeds_max_q_len(p, work.q_len)) {
    for (int i = threadIdx.x; i < rows_here * kHead; i += kThreads)
      write_nan(p, q_row_of(i / kHead), split, i % kHead, kHead);
    return;
  }
  if (begin >= last_end) {  // nothing to attend to in this split
    for (int i = threadIdx.x; i < rows_here * kHead; i += kThreads)
      write_empty(p, q_row_of(i / kHead), split, i % kHead, kHead);
    return;
  }

  // q into shared memory: two threads per row, fp16 after the row's power-of-two scale, head
  // dims permuted like the converted K; the row's end and score scale beside it.
  {
    const int r = threadIdx.x >> 1, half = threadIdx.x & 1;
    const bool valid = r < rows_here;
    constexpr int kDims = kHead / 2;
    const int64_t q_row = valid ? q_row_of(r) : 0;
    const int64_t q_at = q_row * kHead + half * kDims;
    // Two passes over the row's half (the second from L1): its amax, then the fp16 values.
    float amax = 0.f;
    if (valid) {
#pragma unroll 4
      for (int i = 0; i < kDims; i += 8) {
        float v[8];
        load_q8(p.q, p.q_type, q_at + i, v);
#pragma unroll
        for (int k = 0; k < 8; ++k) amax = fmaxf(amax, fabsf(v[k]));
      }
    }
    amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, 1));
    const int exponent = q_exponent(amax);
    // The score scale k_scale * sm_scale with its sign moved into q (exact in fp16), so that
    // each row's scale is >= 0 (or NaN) and the loop's unmasked steps can take the max of the
    // unscaled scores.
    const float k_scale = p.k_scale[p.k_scale_stacked ? member : 0];
    const float sm_scale = p.sm_scale[p.sm_scale_stacked ? member : 0];
    const float qk_scale = k_scale * sm_scale;
    PowerOfTwo times(exponent);
    if (qk_scale < 0.f) times.lo = -times.lo;
    uint16_t* dst = q_smem + r * R::kStride + half * kDims;
#pragma unroll 4
    for (int i = 0; i < kDims; i += 8) {
      float v[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      if (valid) load_q8(p.q, p.q_type, q_at + i, v);
      *reinterpret_cast<uint4*>(dst + i) = make_uint4(
          pack_f16x2(times(v[0]), times(v[4])),
          pack_f16x2(times(v[2]), times(v[6])),
          pack_f16x2(times(v[1]), times(v[5])),
          pack_f16x2(times(v[3]), times(v[7])));
    }
    if (half == 0) {
      row_end[r] = valid ? min(row_limit(grid.group.div(uint32_t(row0 + r))), split_end) : 0;
      row_scale[r] = ldexpf(fabsf(qk_scale) * kLog2e, 7 - exponent);
      row_q[r] = valid ? int32_t(q_row - member_rows) : -1;
    }
  }

  // Warp roles: m-tile mt of the tile's rows, part kp of each step's positions.
  constexpr int kMinRowWarps = kWarps / R::kPSteps;  // a part holds >= 16 positions
  int row_warps = rows_here <= 16 ? 1 : rows_here <= 32 ? 2 : 4;
  row_warps = max(row_warps, kMinRowWarps);
  const int parts = kWarps / row_warps;
  const int mt = warp % row_warps, kp = warp / row_warps;
  const int part_len = R::kKv / parts;  // positions of a step this warp takes
  const int kv0 = kp * part_len;
  const bool has_rows = mt * 16 < rows_here;

  // The pages: a thread loads one (position, side) head vector part per step.
  PageView<kLayout> pv;
  const int32_t num_kv_heads = int32_t(p.page.num_kv_heads);
  const int32_t side_bytes = int32_t(p.page.side_bytes());
  pv.cache = p.kv_cache + int64_t(member) * p.num_blocks * 2 * side_bytes;
  pv.table = p.block_tables +
             ((p.tables_stacked ? int64_t(member) * max_num_seqs : 0) + work.seq) * p.max_blocks;
  pv.page_bytes = 2 * int64_t(side_bytes);
  pv.side_bytes = side_bytes;
  pv.side_data = int32_t(p.page.side_data_bytes());
  pv.head_row = kLayout == Layout::kHND ? kv_head * block_size : kv_head;
  pv.num_kv_heads = num_kv_heads;
  pv.last_page = p.num_blocks - 1;
  pv.block_size = grid.block_size;
  pv.tile_in_page = false;
  const int side = threadIdx.x / (kThreads / 2);
  const int vector = (threadIdx.x % (kThreads / 2)) / R::kThreadsPerVector;  // position in step
  const int part = threadIdx.x % R::kThreadsPerVector;
  uint8_t* const convert_dst = kv_smem + side * R::kSideBytes;
  const StageSlot<kHead> staged = stage_slot<kHead>(side, vector, part);

  const int num_steps = (last_end - begin + R::kKv - 1) / R::kKv;
  const uint32_t end = uint32_t(last_end);
  const auto position = [&](int step) { return uint32_t(begin + step * R::kKv + vector); };
  // The block-table entry of this thread's position, read a step before its copy is issued.
  const auto page_of = [&](int step) {
    const uint32_t pos = position(step);
    return (pos & ~3u) < end ? __ldg(pv.table + grid.block_size.div(pos)) : 0;
  };
  const auto copy_step = [&](int step, int32_t page) {
    const uint32_t pos = position(step);
    uint32_t row;
    grid.block_size.divmod(pos, &row);
    copy_vector<kHead, kSwizzle>(ring + (step % R::kStages) * R::kRawStageBytes, staged, pv,
                                 page, pos, end, row, side, part);
  };
#pragma unroll
  for (int step = 0; step < R::kStages - 1; ++step) {
    if (step < num_steps) copy_step(step, page_of(step));
    copy_async_commit();
  }
  int32_t page_ahead = page_of(R::kStages - 1);

  __syncthreads();  // q and the row data

  uint32_t qf[R::kQInRegisters ? R::kKSteps : 1][4];
  if constexpr (R::kQInRegisters) {
#pragma unroll
    for (int k = 0; k < R::kKSteps; ++k)
      ldmatrix_x4(qf[k], q_smem + (mt * 16 + (lane & 15)) * R::kStride + 16 * k + (lane >> 4) * 8);
  }
  const int my_row0 = mt * 16 + g;
  const int32_t limit[2] = {has_rows ? row_end[my_row0] : 0, has_rows ? row_end[my_row0 + 8] : 0};
  const float score_scale[2] = {row_scale[my_row0], row_scale[my_row0 + 8]};
  // The smallest end among this warp's rows: steps below it need no mask.
  int32_t warp_min_end = INT_MAX;
  if (has_rows) {
    const int r = mt * 16 + (lane & 15);
    warp_min_end = r < rows_here ? row_end[r] : INT_MAX;
#pragma unroll
    for (int d = 8; d > 0; d /= 2)
      warp_min_end = min(warp_min_end, __shfl_xor_sync(kFullMask, warp_min_end, d));
  }

  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  float o[R::kOTiles][4];
#pragma unroll
  for (int t = 0; t < R::kOTiles; ++t)
#pragma unroll
    for (int c = 0; c < 4; ++c) o[t][c] = 0.f;

  // The wgmma descriptors of the K/V buffer (K-major K: dims 16 k .. 16 k + 15 of each row at
  // (k / 4) blocks + (k % 4) * 32 bytes; MN-major V: positions 16 k .. at 16 k rows).
  const uint64_t k_desc = swizzled_desc(kv_smem, 16, 1024);
  const uint64_t v_desc = swizzled_desc(kv_smem + R::kSideBytes, R::kBlockBytes, 1024);

#pragma unroll 1
  for (int step = 0; step < num_steps; ++step) {
    // This step's bytes have landed (this thread's copies; the barrier: everyone's), and every
    // warp is done with the K/V buffer of the step before.
    copy_async_wait<R::kStages - 2>();
    __syncthreads();
    convert_vector<kHead, kSwizzle>(ring + (step % R::kStages) * R::kRawStageBytes, staged,
                                    side, vector, part, position(step) < end, convert_dst);
    // The stage converted a step ago is free: the copies of step + kStages - 1 go there.
    const int ahead = step + R::kStages - 1;
    if (ahead < num_steps) {
      copy_step(ahead, page_ahead);
      page_ahead = page_of(ahead + 1);
    }
    copy_async_commit();
    if constexpr (R::kWgmma) {
      // The converted K/V are read by the tensor cores (the async proxy) next.
      asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
    }
    __syncthreads();  // the K/V buffer is complete
    // A tile of 64 rows on wgmma: the whole warpgroup, every warp (also one without rows).
    const bool wgmma_tile = R::kWgmma && row_warps == kWarps;
    if (!has_rows && !wgmma_tile) continue;
    const uint8_t* k_tile = kv_smem;
    const uint8_t* v_tile = kv_smem + R::kSideBytes;
    const int32_t step_base = begin + step * R::kKv;

    // S = Q K^T over this warp's positions.
    float s[R::kSTiles][4];
#pragma unroll
    for (int t = 0; t < R::kSTiles; ++t)
#pragma unroll
      for (int c = 0; c < 4; ++c) s[t][c] = 0.f;
    if (wgmma_tile) {
      if constexpr (R::kWgmma) {
        float(&acc)[32] = reinterpret_cast<float(&)[32]>(s);
        wgmma_fence_operands(acc);
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < R::kKSteps; ++k)  // K-major B: dims 16 k .. 16 k + 15 of each row
          wgmma_64x64<0>(acc, qf[k], desc_plus(k_desc, (k / 4) * R::kBlockBytes + (k % 4) * 32));
        wgmma_commit_and_wait();
        wgmma_fence_operands(acc);
      }
    } else {
#pragma unroll
      for (int k = 0; k < R::kKSteps; k += 2) {
        uint32_t a0[4], a1[4];
        if constexpr (R::kQInRegisters) {
#pragma unroll
          for (int c = 0; c < 4; ++c) a0[c] = qf[k][c], a1[c] = qf[k + 1][c];
        } else {
          const uint16_t* q_at =
              q_smem + (mt * 16 + (lane & 15)) * R::kStride + (lane >> 4) * 8;
          ldmatrix_x4(a0, q_at + 16 * k);
          ldmatrix_x4(a1, q_at + 16 * (k + 1));
        }
#pragma unroll
        for (int t = 0; t < R::kSTiles; ++t) {
          if (t * 8 >= part_len) break;
          uint32_t b[4];
          ldmatrix_x4(b, k_tile + kv_chunk<kHead>(kv0 + 8 * t + (lane & 7), 2 * k + (lane >> 3)));
          mma_16816(s[t], a0, b[0], b[1]);
          mma_16816(s[t], a1, b[2], b[3]);
        }
      }
    }

    // Online softmax (rows g and g + 8 of the m-tile; a row's 4 lanes share its max), in two
    // forms. A step that reaches past the end of one of the warp's rows scales each score,
    // masks it and exponentiates the difference to the max. Every other step (all but the last
    // few of a long tile) needs no mask: the row scale is >= 0 (its sign is in q), so the max of
    // the scaled scores is the scaled max of the raw ones, and each score's exponent is one
    // fused multiply-add, s * scale - max. (Both forms keep the max in scaled units.)
    const bool masked = step_base + kv0 + part_len > warp_min_end;
    float top[2] = {m[0], m[1]};
    if (masked) {
#pragma unroll
      for (int t = 0; t < R::kSTiles; ++t) {
        if (t * 8 >= part_len) break;
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          float x = s[t][c] * score_scale[c >> 1];
          if (step_base + kv0 + 8 * t + 2 * qd + (c & 1) >= limit[c >> 1]) x = -INFINITY;
          s[t][c] = x;
          top[c >> 1] = fmaxf(top[c >> 1], x);
        }
      }
    } else {
      float raw_top[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int t = 0; t < R::kSTiles; ++t) {
        if (t * 8 >= part_len) break;
#pragma unroll
        for (int c = 0; c < 4; ++c) raw_top[c >> 1] = fmaxf(raw_top[c >> 1], s[t][c]);
      }
#pragma unroll
      for (int h = 0; h < 2; ++h) top[h] = fmaxf(top[h], raw_top[h] * score_scale[h]);
    }
    float alpha[2], offset[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      top[h] = fmaxf(top[h], __shfl_xor_sync(kFullMask, top[h], 1));
      top[h] = fmaxf(top[h], __shfl_xor_sync(kFullMask, top[h], 2));
      offset[h] = top[h] == -INFINITY ? 0.f : top[h];  // nothing seen yet: no -inf - -inf
      alpha[h] = exp2_approx(m[h] - offset[h]);
      m[h] = top[h];
      l[h] *= alpha[h];
    }
    if (__any_sync(kFullMask, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
      for (int t = 0; t < R::kOTiles; ++t)
#pragma unroll
        for (int c = 0; c < 4; ++c) o[t][c] *= alpha[c >> 1];
    }
    if (masked) {
#pragma unroll
      for (int t = 0; t < R::kSTiles; ++t) {
        if (t * 8 >= part_len) break;
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          s[t][c] = exp2_approx(s[t][c] - offset[c >> 1]);
          l[c >> 1] += s[t][c];
        }
      }
    } else {
#pragma unroll
      for (int t = 0; t < R::kSTiles; ++t) {
        if (t * 8 >= part_len) break;
#pragma unroll
        for (int c = 0; c < 4; ++c) {
          s[t][c] = exp2_approx(__fmaf_rn(s[t][c], score_scale[c >> 1], -offset[c >> 1]));
          l[c >> 1] += s[t][c];
        }
      }
    }

    // O += P V: P from the S accumulators (the A fragment of 16 positions is two n-tiles).
    if (wgmma_tile) {
      if constexpr (R::kWgmma) {
        uint32_t a[R::kPSteps][4];
#pragma unroll
        for (int k = 0; k < R::kPSteps; ++k) {
          a[k][0] = pack_f16x2(s[2 * k][0], s[2 * k][1]);
          a[k][1] = pack_f16x2(s[2 * k][2], s[2 * k][3]);
          a[k][2] = pack_f16x2(s[2 * k + 1][0], s[2 * k + 1][1]);
          a[k][3] = pack_f16x2(s[2 * k + 1][2], s[2 * k + 1][3]);
        }
        float(&acc)[R::kOTiles * 4] = reinterpret_cast<float(&)[R::kOTiles * 4]>(o);
        wgmma_fence_operands(acc);
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < R::kPSteps; ++k) {  // MN-major B: positions 16 k .. 16 k + 15
          const uint64_t b = desc_plus(v_desc, 16 * k * 128);
          if constexpr (kHead == 128)
            wgmma_64x128_trans_b(acc, a[k], b);
          else
            wgmma_64x64<1>(acc, a[k], b);
        }
        wgmma_commit_and_wait();
        wgmma_fence_operands(acc);
      }
    } else {
#pragma unroll
      for (int k = 0; k < R::kPSteps; ++k) {
        if (k * 16 >= part_len) break;
        const uint32_t a[4] = {pack_f16x2(s[2 * k][0], s[2 * k][1]),
                               pack_f16x2(s[2 * k][2], s[2 * k][3]),
                               pack_f16x2(s[2 * k + 1][0], s[2 * k + 1][1]),
                               pack_f16x2(s[2 * k + 1][2], s[2 * k + 1][3])};
        const int row = kv0 + 16 * k + (lane & 7) + ((lane >> 3) & 1) * 8;
#pragma unroll
        for (int t = 0; t < R::kOTiles; t += 2) {
          uint32_t b[4];
          ldmatrix_x4_trans(b, v_tile + kv_chunk<kHead>(row, t + (lane >> 4)));
          mma_16816(o[t], a, b[0], b[1]);
          mma_16816(o[t + 1], a, b[2], b[3]);
        }
      }
    }
  }

  // The row sums over the row's 4 lanes.
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l[h] += __shfl_xor_sync(kFullMask, l[h], 1);
    l[h] += __shfl_xor_sync(kFullMask, l[h], 2);
  }

  // Merge the warps of each m-tile (one, two or four) through shared memory, then write each
  // row's result, dims in true order (coalesced).
  copy_async_wait<0>();  // (only empty groups are left; the ring is reused below)
  __syncthreads();  // the K/V buffer and the ring are free
  float* m_smem = merge_smem;                      // [warp][16]
  float* l_smem = merge_smem + kWarps * 16;        // [warp][16]
  float* o_smem = merge_smem + 2 * kWarps * 16;    // [warp][16][kHead]
  if (has_rows) {
    if (qd == 0) {
      m_smem[warp * 16 + g] = m[0], m_smem[warp * 16 + g + 8] = m[1];
      l_smem[warp * 16 + g] = l[0], l_smem[warp * 16 + g + 8] = l[1];
    }
    const int dim = permuted_dim_even(qd);
#pragma unroll
    for (int t = 0; t < R::kOTiles; ++t)
#pragma unroll
      for (int c = 0; c < 4; ++c)
        o_smem[(warp * 16 + g + 8 * (c >> 1)) * kHead + 8 * t + dim + 4 * (c & 1)] = o[t][c];
  }
  __syncthreads();

  const float v_scale = p.v_scale[p.v_scale_stacked ? member : 0];
  for (int i = threadIdx.x; i < rows_here * kHead; i += kThreads) {
    const int r = i / kHead, d = i % kHead;
    const int tile_warp = r / 16, rr = r % 16;
    // A NaN score leaves the running max (fmaxf passes it over) but makes the sum NaN: such a
    // row's result is NaN, as on the jnp path, never an empty row's zeros.
    float top = -INFINITY;
    bool nan = false;
    for (int k = 0; k < parts; ++k) {
      const int w = tile_warp + k * row_warps;
      top = fmaxf(top, m_smem[w * 16 + rr]);
      nan |= isnan(l_smem[w * 16 + rr]);
    }
    const int64_t row = member_rows + row_q[r];
    if (top == -INFINITY && !nan) {  // nothing attended to in this split
      write_empty(p, row, split, d, kHead);
      continue;
    }
    float sum = 0.f, acc = 0.f;
    for (int k = 0; k < parts; ++k) {
      const int w = tile_warp + k * row_warps;
      const float weight = exp2_approx(m_smem[w * 16 + rr] - (top == -INFINITY ? 0.f : top));
      sum += weight * l_smem[w * 16 + rr];
      acc += weight * o_smem[(w * 16 + rr) * kHead + d];
    }
    const float value = acc / sum, lse2 = top + __log2f(sum);
    if (p.num_splits == 1) {
      store_out(p.out, p.q_type, row * kHead + d, value * (v_scale * 128.f));
      if (d == 0) p.lse[row] = lse2 * kLn2;
    } else {
      p.partial_out[(row * p.num_splits + split) * kHead + d] = value;
      if (d == 0) p.partial_lse[row * p.num_splits + split] = lse2;
    }
  }
}

// ------------------------------------------------------------------------------------------
// The pipelined prefill kernel (sm_90a, head size 128; benchmarks/NOTES.md, ragged v9): the
// sequences of more than kPipelinedMinRows query rows per kv head, two 64-row tiles of one
// sequence per CTA (design D of "Prefill: the next kernel", whose structure
// benchmarks/prefill_pipeline_probe.cu measured at 516 TFLOP/s on an H200 against 355 for the
// ragged kernel's). Three warpgroups: the producer copies the raw page bytes of each step (the
// ragged kernel's cp.async ring) and converts them into one of kPipeStages fp16 K/V stages;
// each consumer multiplies its tile's rows by every stage on wgmma, asynchronously: the scores
// of step n and P V of step n - 1 are issued together, the softmax of step n runs while P V
// does, and a stage goes back to the producer (named barrier) once its P V is done. Registers
// move from the producer to the consumers (setmaxnreg). Each consumer keeps every position of
// its rows, so it writes them itself (no merge between warps). The file's rules hold, with one
// widening: a NaN in the V of a position that only rows of consumer 0's (later) tile may see
// reaches consumer 1's rows too when it lies in the 64-position step where consumer 1's rows
// end (through 0 x NaN in P V; the ragged kernel converts such positions as zeros).
// Launched only in a build with -DNVFP4_RAGGED_PIPELINED=1 until it has run on a GPU.
template <bool kSwizzle, Layout kLayout>
__global__ void __launch_bounds__(kPipeThreads, 1)
    PipelinedPrefillKernel(const RaggedProblem p, const RaggedGrid grid) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int kHead = kPipelinedHead;
  using R = RaggedShape<kHead>;
  extern __shared__ __align__(1024) uint8_t smem[];
  uint8_t* const ring = smem + PipeShape::kRingOffset;
  uint16_t* const q_smem = reinterpret_cast<uint16_t*>(smem + PipeShape::kQOffset);
  int32_t* const row_end = reinterpret_cast<int32_t*>(smem + PipeShape::kRowOffset);
  float* const row_scale = reinterpret_cast<float*>(row_end + 2 * kRows);
  int32_t* const row_q = row_end + 4 * kRows;

  const int lane = threadIdx.x & 31;
  const int wg = threadIdx.x / kThreads, t = threadIdx.x % kThreads;
  uint32_t head;
  const int32_t slot = int32_t(grid.num_kv_heads.divmod(blockIdx.x, &head));
  const int32_t kv_head = int32_t(head);
  const int32_t member = blockIdx.z / p.num_splits, split = blockIdx.z % p.num_splits;
  const int32_t num_tokens = p.num_tokens, max_num_seqs = p.max_num_seqs;
  const int32_t group = int32_t(grid.group.divisor);
  const int32_t* cu = p.cu_q_lens + (p.cu_stacked ? int64_t(member) * (max_num_seqs + 1) : 0);
  const int32_t ns =
      min(max(__ldg(p.num_seqs + (p.num_seqs_stacked ? member : 0)), 0), max_num_seqs);
  const int64_t member_rows = int64_t(member) * num_tokens * p.num_q_heads;

  // The CTA's pair of tiles: pair k from a sequence's end holds its tiles T - 1 - 2k (consumer
  // 0) and T - 2 - 2k (consumer 1; none for the first tile of an odd count).
  TileWork work;
  const auto pairs_of = [&](int32_t q_len) {
    return takes_pipelined(p, q_len, group) ? (tiles_of(q_len, group) + 1) / 2 : 0;
  };
  if (!find_unit(cu, ns, num_tokens, slot, lane, pairs_of, &work)) return;
  const int32_t rows_seq = work.q_len * group;
  const int32_t pairs = (tiles_of(work.q_len, group) + 1) / 2;
  const int32_t first_tile = tiles_of(work.q_len, group) - 1 - 2 * (pairs - 1 - work.tile);
  const auto rows_of = [&](int c) {  // rows of consumer c's tile (0: none)
    const int32_t tile = first_tile - c;
    return tile < 0 ? 0 : min(kRows, rows_seq - tile * kRows);
  };

  const int32_t block_size = int32_t(grid.block_size.divisor);
  const int32_t capacity = p.max_blocks * block_size;
  const int32_t kv_len =
      max(__ldg(p.seq_lens + (p.lens_stacked ? int64_t(member) * max_num_seqs : 0) + work.seq), 0);
  const auto row_limit = [&](int32_t j) {  // positions query j attends to
    return min(max(kv_len - (work.q_len - 1 - j), 0), capacity);
  };
  const int32_t begin = int32_t(min(int64_t(split) * p.tokens_per_split, int64_t(capacity)));
  const int32_t split_end =
      int32_t(min(int64_t(split) * p.tokens_per_split + p.tokens_per_split, int64_t(capacity)));
  // Consumer 0's tile is the later one: its last row ends last.
  const int32_t last_end =
      min(row_limit(grid.group.div(uint32_t(first_tile * kRows + rows_of(0) - 1))), split_end);
  const auto q_row_of = [&](int c, int r) {  // row r of consumer c's tile among [T, Hq]
    uint32_t qh;
    const uint32_t j = grid.group.divmod(uint32_t((first_tile - c) * kRows + r), &qh);
    return member_rows + int64_t(work.start + int32_t(j)) * p.num_q_heads + kv_head * group +
           int32_t(qh);
  };
  if (begin >= last_end) {  // nothing to attend to in this split
    if (wg > 0)
      for (int i = t; i < rows_of(wg - 1) * kHead; i += kThreads)
        write_empty(p, q_row_of(wg - 1, i / kHead), split, i % kHead, kHead);
    return;
  }
  const int num_steps = (last_end - begin + R::kKv - 1) / R::kKv;
  const uint32_t end = uint32_t(last_end);

  if (wg == 0) {
    // The producer.
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kProducerRegisters));
    PageView<kLayout> pv;
    const int32_t side_bytes = int32_t(p.page.side_bytes());
    pv.cache = p.kv_cache + int64_t(member) * p.num_blocks * 2 * side_bytes;
    pv.table = p.block_tables +
               ((p.tables_stacked ? int64_t(member) * max_num_seqs : 0) + work.seq) * p.max_blocks;
    pv.page_bytes = 2 * int64_t(side_bytes);
    pv.side_bytes = side_bytes;
    pv.side_data = int32_t(p.page.side_data_bytes());
    pv.head_row = kLayout == Layout::kHND ? kv_head * block_size : kv_head;
    pv.num_kv_heads = int32_t(p.page.num_kv_heads);
    pv.last_page = p.num_blocks - 1;
    pv.block_size = grid.block_size;
    pv.tile_in_page = false;
    static_assert(R::kThreadsPerVector == 1, "one producer thread per (position, side)");
    const int side = t / R::kKv, vector = t % R::kKv;
    const StageSlot<kHead> staged = stage_slot<kHead>(side, vector, 0);
    const auto position = [&](int step) { return uint32_t(begin + step * R::kKv + vector); };
    const auto page_of = [&](int step) {
      const uint32_t pos = position(step);
      return (pos & ~3u) < end ? __ldg(pv.table + grid.block_size.div(pos)) : 0;
    };
    const auto copy_step = [&](int step, int32_t page) {
      const uint32_t pos = position(step);
      uint32_t row;
      grid.block_size.divmod(pos, &row);
      copy_vector<kHead, kSwizzle>(ring + (step % R::kStages) * R::kRawStageBytes, staged, pv,
                                   page, pos, end, row, side, 0);
    };
#pragma unroll
    for (int step = 0; step < R::kStages - 1; ++step) {
      if (step < num_steps) copy_step(step, page_of(step));
      copy_async_commit();
    }
    int32_t page_ahead = page_of(R::kStages - 1);
#pragma unroll 1
    for (int step = 0; step < num_steps; ++step) {
      const int stage = step % kPipeStages;
      // This step's bytes have landed (the barrier: every producer thread's; also every
      // producer thread is done converting the step before, whose ring stage is reused below).
      copy_async_wait<R::kStages - 2>();
      named_sync(kProducerBarrier, kThreads);
      if (step >= kPipeStages) named_sync(empty_barrier(stage), kPipeThreads);
      convert_vector<kHead, kSwizzle>(ring + (step % R::kStages) * R::kRawStageBytes, staged,
                                      side, vector, 0, position(step) < end,
                                      smem + stage * R::kKvBytes + side * R::kSideBytes);
      const int ahead = step + R::kStages - 1;
      if (ahead < num_steps) {
        copy_step(ahead, page_ahead);
        page_ahead = page_of(ahead + 1);
      }
      copy_async_commit();
      asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");  // read by wgmma next
      named_arrive(full_barrier(stage), kPipeThreads);
    }
    copy_async_wait<0>();
    // The stages' last hand-backs, so that no barrier is left mid-phase.
    for (int step = max(num_steps - kPipeStages, 0); step < num_steps; ++step)
      named_sync(empty_barrier(step % kPipeStages), kPipeThreads);
    return;
  }

  // A consumer.
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kConsumerRegisters));
  const int c = wg - 1;
  const int rows_here = rows_of(c);
  const int warp = t >> 5, g = lane >> 2, qd = lane & 3;
  const float k_scale = p.k_scale[p.k_scale_stacked ? member : 0];
  const float sm_scale = p.sm_scale[p.sm_scale_stacked ? member : 0];
  const float qk_scale = k_scale * sm_scale;
  uint16_t* const my_q = q_smem + c * kRows * R::kStride;
  int32_t* const my_end = row_end + c * kRows;
  float* const my_scale = row_scale + c * kRows;
  int32_t* const my_q_row = row_q + c * kRows;
  {
    // q into shared memory as in the ragged kernel: two threads per row, fp16 after the row's
    // power-of-two scale (with the score scale's sign), head dims permuted like K.
    const int r = t >> 1, half = t & 1;
    const bool valid = r < rows_here;
    constexpr int kDims = kHead / 2;
    const int64_t q_row = valid ? q_row_of(c, r) : 0;
    const int64_t q_at = q_row * kHead + half * kDims;
    float amax = 0.f;
    if (valid) {
#pragma unroll 4
      for (int i = 0; i < kDims; i += 8) {
        float v[8];
        load_q8(p.q, p.q_type, q_at + i, v);
#pragma unroll
        for (int k = 0; k < 8; ++k) amax = fmaxf(amax, fabsf(v[k]));
      }
    }
    amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, 1));
    const int exponent = q_exponent(amax);
    PowerOfTwo times(exponent);
    if (qk_scale < 0.f) times.lo = -times.lo;
    uint16_t* dst = my_q + r * R::kStride + half * kDims;
#pragma unroll 4
    for (int i = 0; i < kDims; i += 8) {
      float v[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
      if (valid) load_q8(p.q, p.q_type, q_at + i, v);
      *reinterpret_cast<uint4*>(dst + i) = make_uint4(
          pack_f16x2(times(v[0]), times(v[4])), pack_f16x2(times(v[2]), times(v[6])),
          pack_f16x2(times(v[1]), times(v[5])), pack_f16x2(times(v[3]), times(v[7])));
    }
    if (half == 0) {
      const int32_t row = (first_tile - c) * kRows + r;
      my_end[r] = valid ? min(row_limit(grid.group.div(uint32_t(max(row, 0)))), split_end) : 0;
      my_scale[r] = ldexpf(fabsf(qk_scale) * kLog2e, 7 - exponent);
      my_q_row[r] = valid ? int32_t(q_row - member_rows) : -1;
    }
  }
  named_sync(consumer_barrier(c), kThreads);

  uint32_t qf[R::kKSteps][4];
#pragma unroll
  for (int k = 0; k < R::kKSteps; ++k)
    ldmatrix_x4(qf[k], my_q + (warp * 16 + (lane & 15)) * R::kStride + 16 * k + (lane >> 4) * 8);
  const int my_row0 = warp * 16 + g;
  const int32_t limit[2] = {my_end[my_row0], my_end[my_row0 + 8]};
  const float score_scale[2] = {my_scale[my_row0], my_scale[my_row0 + 8]};
  int32_t warp_min_end = INT_MAX;  // the smallest end among the warp's rows
  {
    const int r = warp * 16 + (lane & 15);
    warp_min_end = r < rows_here ? my_end[r] : INT_MAX;
#pragma unroll
    for (int d = 8; d > 0; d /= 2)
      warp_min_end = min(warp_min_end, __shfl_xor_sync(kFullMask, warp_min_end, d));
  }

  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  float o[R::kOTiles][4];
#pragma unroll
  for (int i = 0; i < R::kOTiles; ++i)
#pragma unroll
    for (int k = 0; k < 4; ++k) o[i][k] = 0.f;
  float s[R::kSTiles][4];
  uint32_t a[R::kPSteps][4];  // P of the step before, wgmma A fragments
  const uint64_t k_desc = swizzled_desc(smem, 16, 1024);
  const uint64_t v_desc = swizzled_desc(smem + R::kSideBytes, R::kBlockBytes, 1024);

  const auto issue_scores = [&](int stage) {
#pragma unroll
    for (int i = 0; i < R::kSTiles; ++i)
#pragma unroll
      for (int k = 0; k < 4; ++k) s[i][k] = 0.f;
    float(&acc)[32] = reinterpret_cast<float(&)[32]>(s);
    wgmma_fence_operands(acc);
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < R::kKSteps; ++k)
      wgmma_64x64<0>(acc, qf[k], desc_plus(k_desc, stage * R::kKvBytes + (k / 4) * R::kBlockBytes +
                                                       (k % 4) * 32));
    wgmma_commit();
  };
  const auto issue_values = [&](int stage) {
    float(&acc)[R::kOTiles * 4] = reinterpret_cast<float(&)[R::kOTiles * 4]>(o);
    wgmma_fence_operands(acc);
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < R::kPSteps; ++k)
      wgmma_64x128_trans_b(acc, a[k], desc_plus(v_desc, stage * R::kKvBytes + 16 * k * 128));
    wgmma_commit();
  };
  // The online softmax of step `step`'s scores (landed), as in the ragged kernel: masked steps
  // scale, mask and subtract; the others take the max of the raw scores and one FFMA each.
  const auto softmax = [&](int step, float (&alpha)[2]) {
    float(&acc)[32] = reinterpret_cast<float(&)[32]>(s);
    wgmma_fence_operands(acc);
    const int32_t step_base = begin + step * R::kKv;
    const bool masked = step_base + R::kKv > warp_min_end;
    float top[2] = {m[0], m[1]};
    if (masked) {
#pragma unroll
      for (int i = 0; i < R::kSTiles; ++i)
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          float x = s[i][k] * score_scale[k >> 1];
          if (step_base + 8 * i + 2 * qd + (k & 1) >= limit[k >> 1]) x = -INFINITY;
          s[i][k] = x;
          top[k >> 1] = fmaxf(top[k >> 1], x);
        }
    } else {
      float raw_top[2] = {-INFINITY, -INFINITY};
#pragma unroll
      for (int i = 0; i < R::kSTiles; ++i)
#pragma unroll
        for (int k = 0; k < 4; ++k) raw_top[k >> 1] = fmaxf(raw_top[k >> 1], s[i][k]);
#pragma unroll
      for (int h = 0; h < 2; ++h) top[h] = fmaxf(top[h], raw_top[h] * score_scale[h]);
    }
    float offset[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      top[h] = fmaxf(top[h], __shfl_xor_sync(kFullMask, top[h], 1));
      top[h] = fmaxf(top[h], __shfl_xor_sync(kFullMask, top[h], 2));
      offset[h] = top[h] == -INFINITY ? 0.f : top[h];
      alpha[h] = exp2_approx(m[h] - offset[h]);
      m[h] = top[h];
      l[h] *= alpha[h];
    }
    if (masked) {
#pragma unroll
      for (int i = 0; i < R::kSTiles; ++i)
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          s[i][k] = exp2_approx(s[i][k] - offset[k >> 1]);
          l[k >> 1] += s[i][k];
        }
    } else {
#pragma unroll
      for (int i = 0; i < R::kSTiles; ++i)
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          s[i][k] = exp2_approx(__fmaf_rn(s[i][k], score_scale[k >> 1], -offset[k >> 1]));
          l[k >> 1] += s[i][k];
        }
    }
    // (the results taken by an empty asm: the softmax is done before the caller's wait)
    wgmma_fence_operands(acc);
  };
  // After the P V of the step before is done: O rescaled to the new max, P packed.
  const auto rescale_and_pack = [&](const float (&alpha)[2]) {
    float(&acc)[R::kOTiles * 4] = reinterpret_cast<float(&)[R::kOTiles * 4]>(o);
    wgmma_fence_operands(acc);
    if (__any_sync(kFullMask, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
      for (int i = 0; i < R::kOTiles; ++i)
#pragma unroll
        for (int k = 0; k < 4; ++k) o[i][k] *= alpha[k >> 1];
    }
#pragma unroll
    for (int k = 0; k < R::kPSteps; ++k) {
      a[k][0] = pack_f16x2(s[2 * k][0], s[2 * k][1]);
      a[k][1] = pack_f16x2(s[2 * k][2], s[2 * k][3]);
      a[k][2] = pack_f16x2(s[2 * k + 1][0], s[2 * k + 1][1]);
      a[k][3] = pack_f16x2(s[2 * k + 1][2], s[2 * k + 1][3]);
    }
  };

  // This consumer's own steps: up to the end of its last row (consumer 1's tile ends before
  // consumer 0's; a consumer without a tile has none). Past them it hands the stages back
  // unread, so that the positions only consumer 0's rows see never enter consumer 1's P V.
  const int32_t own_end =
      rows_here > 0
          ? min(row_limit(grid.group.div(uint32_t((first_tile - c) * kRows + rows_here - 1))),
                split_end)
          : begin;
  const int my_steps = own_end > begin ? (own_end - begin + R::kKv - 1) / R::kKv : 0;
  if (my_steps > 0) {
    float alpha[2];
    named_sync(full_barrier(0), kPipeThreads);
    issue_scores(0);
    wgmma_wait<0>();
    softmax(0, alpha);
    rescale_and_pack(alpha);
    // Then whole rounds of the stages, unrolled: the stage offsets are constants (stage
    // arithmetic in uniform registers while a product is in flight made ptxas wait for it).
#pragma unroll 1
    for (int round = 0; round < my_steps; round += kPipeStages) {
#pragma unroll
      for (int j = 1; j <= kPipeStages; ++j) {
        const int step = round + j;
        if (step >= my_steps) break;
        const int stage = j % kPipeStages, before = j - 1;
        named_sync(full_barrier(stage), kPipeThreads);
        issue_scores(stage);
        issue_values(before);
        wgmma_wait<1>();
        softmax(step, alpha);
        wgmma_wait<0>();
        named_arrive(empty_barrier(before), kPipeThreads);
        rescale_and_pack(alpha);
      }
    }
    const int last = (my_steps - 1) % kPipeStages;
    issue_values(last);
    wgmma_wait<0>();
    named_arrive(empty_barrier(last), kPipeThreads);
    float(&acc)[R::kOTiles * 4] = reinterpret_cast<float(&)[R::kOTiles * 4]>(o);
    wgmma_fence_operands(acc);
  }
  for (int step = my_steps; step < num_steps; ++step) {
    named_sync(full_barrier(step % kPipeStages), kPipeThreads);
    named_arrive(empty_barrier(step % kPipeStages), kPipeThreads);
  }

  // Each thread writes its two rows' dims (8 t + the permuted dim, + 4): the row sums over the
  // row's 4 lanes first. A row that saw nothing in this split gets the empty result.
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    l[h] += __shfl_xor_sync(kFullMask, l[h], 1);
    l[h] += __shfl_xor_sync(kFullMask, l[h], 2);
  }
  const float v_scale = p.v_scale[p.v_scale_stacked ? member : 0];
  const int dim = permuted_dim_even(qd);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = my_row0 + 8 * h;
    if (r >= rows_here) continue;
    const int64_t row = member_rows + my_q_row[r];
    const bool empty = m[h] == -INFINITY && !isnan(l[h]);
    const float lse2 = m[h] + __log2f(l[h]);
#pragma unroll
    for (int i = 0; i < R::kOTiles; ++i)
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        const int d = 8 * i + dim + 4 * k;
        if (empty) {
          write_empty(p, row, split, d, kHead);
          continue;
        }
        const float value = o[i][2 * h + k] / l[h];
        if (p.num_splits == 1) {
          store_out(p.out, p.q_type, row * kHead + d, value * (v_scale * 128.f));
          if (d == 0) p.lse[row] = lse2 * kLn2;
        } else {
          p.partial_out[(row * p.num_splits + split) * kHead + d] = value;
          if (d == 0) p.partial_lse[row * p.num_splits + split] = lse2;
        }
      }
  }
#else
  __trap();  // launched only where the build has sm_90a code (PipelinedPrefillRuns)
#endif
}

// Combines the splits of each (member, token, query head) row.
template <int kHead>
__global__ void __launch_bounds__(kHead) RaggedMergeKernel(const RaggedProblem p) {
  const int64_t row = blockIdx.x;
  const int32_t member = int32_t(row / (int64_t(p.num_tokens) * p.num_q_heads));
  const int d = threadIdx.x;
  float lse2;
  const float value = merge_workspace_splits(p.partial_lse + row * p.num_splits,
                                   p.partial_out + row * p.num_splits * kHead, kHead,
                                   p.num_splits, d, &lse2);
  const float v_scale = p.v_scale[p.v_scale_stacked ? member : 0];
  store_out(p.out, p.q_type, row * kHead + d, value * (v_scale * 128.f));
  if (d == 0) p.lse[row] = lse2 * kLn2;
}

// Slots of the grid's x axis: query tiles (an upper bound whatever cu_q_lens holds), then the
// zero fill of unowned tokens, 64 tokens a slot.
int64_t TileSlots(const RaggedProblem& p) {
  const int64_t group = p.num_q_heads / p.page.num_kv_heads;
  return (int64_t(p.num_tokens) * group + kRows - 1) / kRows +
         std::min<int64_t>(p.max_num_seqs, p.num_tokens);
}
int64_t FillSlots(const RaggedProblem& p) {
  return (int64_t(p.num_tokens) + kFillTokens - 1) / kFillTokens;
}

// More than 48 KB of dynamic shared memory, and all of L1 as shared memory (two CTAs of ~100 KB
// per SM).
template <int kHead, bool kSwizzle, Layout kLayout>
cudaError_t Configure() {
  return ConfigureSharedMemory<RaggedKernel<kHead, kSwizzle, kLayout>>(
      RaggedShape<kHead>::kSmemBytes);
}

// Whether the current GPU runs the pipelined prefill kernel: built in (NVFP4_RAGGED_PIPELINED),
// an sm_90 device, and the build's code for it the sm_90a kernel, whose register hand-over
// (setmaxnreg) needs exactly the launch's 168 registers a thread: asked once per device (an
// attribute query, allowed while XLA captures a command buffer).
template <bool kSwizzle, Layout kLayout>
bool PipelinedPrefillRuns() {
  if (!NVFP4_RAGGED_PIPELINED) return false;
  static std::atomic<uint64_t> asked{0}, runs{0};
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess || device >= 64) return false;
  const uint64_t bit = uint64_t(1) << device;
  if (!(asked.load(std::memory_order_acquire) & bit)) {
    int major = 0, minor = 0;
    cudaFuncAttributes attributes{};
    const bool ok =
        cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device) ==
            cudaSuccess &&
        cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device) ==
            cudaSuccess &&
        major == 9 && minor == 0 &&
        cudaFuncGetAttributes(&attributes, PipelinedPrefillKernel<kSwizzle, kLayout>) ==
            cudaSuccess &&
        attributes.numRegs * kPipeThreads ==
            kThreads * (kProducerRegisters + 2 * kConsumerRegisters);
    if (!ok) cudaGetLastError();  // (a failed query is an answer, not an error of the call)
    if (ok) runs.fetch_or(bit, std::memory_order_release);
    asked.fetch_or(bit, std::memory_order_release);
  }
  return runs.load(std::memory_order_acquire) & bit;
}

template <int kHead, bool kSwizzle, Layout kLayout>
cudaError_t Launch(cudaStream_t stream, const RaggedProblem& caller_problem) {
  using R = RaggedShape<kHead>;
  const auto kernel = RaggedKernel<kHead, kSwizzle, kLayout>;
  const cudaError_t configured = Configure<kHead, kSwizzle, kLayout>();
  if (configured != cudaSuccess) return configured;
  RaggedProblem p = caller_problem;
  const RaggedGrid grid{int32_t(TileSlots(p)), FastDivmod(uint32_t(p.page.num_kv_heads)),
                        FastDivmod(uint32_t(p.num_q_heads / p.page.num_kv_heads)),
                        FastDivmod(uint32_t(p.page.block_size))};
  cudaError_t error = cudaSuccess;
  if constexpr (kHead == kPipelinedHead) {
    // The long sequences on the pipelined prefill kernel, before the ragged kernel, which then
    // skips them. A CTA per pair of tiles: a sequence it takes has more than kPipelinedMinRows
    // rows and at most rows / (kPipelinedMinRows + 1) pairs, so the rows bound the slots (and
    // with a max_q_len bound below them, nothing is launched).
    const int64_t rows = int64_t(p.num_tokens) * (p.num_q_heads / p.page.num_kv_heads);
    const int64_t row_bound =
        p.max_q_len > 0 ? int64_t(p.max_q_len) * (p.num_q_heads / p.page.num_kv_heads) : rows;
    const int64_t pair_slots = std::min(TileSlots(p), rows / (kPipelinedMinRows + 1));
    if (!p.few_rows_only && row_bound > kPipelinedMinRows && pair_slots > 0 &&
        PipelinedPrefillRuns<kSwizzle, kLayout>()) {
      error = ConfigureSharedMemory<PipelinedPrefillKernel<kSwizzle, kLayout>>(
          PipeShape::kSmemBytes);
      if (error != cudaSuccess) return error;
      p.pipelined = 1;
      PipelinedPrefillKernel<kSwizzle, kLayout>
          <<<dim3(uint32_t(pair_slots * p.page.num_kv_heads), 1,
                  uint32_t(p.stacked * p.num_splits)),
             kPipeThreads, PipeShape::kSmemBytes, stream>>>(p, grid);
      error = cudaGetLastError();
      if (error != cudaSuccess) return error;
    }
  }
  const dim3 blocks(uint32_t((TileSlots(p) + FillSlots(p)) * p.page.num_kv_heads), 1,
                    uint32_t(p.stacked * p.num_splits));
  if (!p.few_rows_only) {  // (alone, the few-row kernel takes every sequence and the fill)
    kernel<<<blocks, kThreads, R::kSmemBytes, stream>>>(p, grid);
    error = cudaGetLastError();
  }
  if (error == cudaSuccess) error = LaunchFewRows(stream, p);
  if (error == cudaSuccess && p.num_splits > 1) {
    RaggedMergeKernel<kHead>
        <<<uint32_t(int64_t(p.stacked) * p.num_tokens * p.num_q_heads), kHead, 0, stream>>>(p);
    error = cudaGetLastError();
  }
  // The one-token sequences (decode tokens of a mixed batch), on the decode kernel: after the
  // ragged kernel and its merge, which leave their rows empty.
  if (error == cudaSuccess && p.decode_splits > 0)
    error = LaunchDecodeAttention(stream, OneTokenDecodeProblem(p));
  return error;
}


ffi::Error RaggedCuda(cudaStream_t stream, ffi::AnyBuffer q, ffi::Buffer<ffi::U8> kv_cache,
                      ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> seq_lens,
                      ffi::Buffer<ffi::S32> cu_q_lens, ffi::Buffer<ffi::S32> num_seqs,
                      ffi::Buffer<ffi::F32> k_scale, ffi::Buffer<ffi::F32> v_scale,
                      ffi::Buffer<ffi::F32> sm_scale, ffi::Result<ffi::AnyBuffer> out,
                      ffi::Result<ffi::Buffer<ffi::F32>> lse,
                      ffi::Result<ffi::Buffer<ffi::F32>> partial_out,
                      ffi::Result<ffi::Buffer<ffi::F32>> partial_lse,
                      ffi::Result<ffi::Buffer<ffi::F32>> decode_partial_out,
                      ffi::Result<ffi::Buffer<ffi::F32>> decode_partial_lse, int32_t layout,
                      bool v_scale_swizzle, int32_t num_splits, int32_t tokens_per_split,
                      int32_t decode_splits, int32_t decode_tokens_per_split,
                      bool decode_cluster_merge, int32_t max_q_len, bool few_rows_only) {
  RaggedProblem p;
  ffi::Error error = MakeRaggedProblem(
      q, kv_cache, block_tables, seq_lens, cu_q_lens, num_seqs, k_scale, v_scale, sm_scale, out,
      lse, partial_out, partial_lse, decode_partial_out, decode_partial_lse, layout,
      v_scale_swizzle, num_splits, tokens_per_split, decode_splits, decode_tokens_per_split,
      decode_cluster_merge, max_q_len, few_rows_only, &p);
  if (error.failure()) return error;
  if (decode_cluster_merge && decode_splits > DecodeClusterMergeSplits(int(p.page.head_size)))
    return RaggedArgumentError("decode_cluster_merge with more splits than this GPU places in "
                               "a cluster of the decode kernel");
  if (int64_t(p.stacked) * p.num_tokens * p.num_q_heads == 0) return ffi::Error::Success();
  if (p.num_blocks == 0 && p.max_blocks > 0)
    return RaggedArgumentError("kv_cache has no pages but block_tables has columns");
  if ((TileSlots(p) + FillSlots(p)) * p.page.num_kv_heads >= (int64_t(1) << 31))
    return RaggedArgumentError("more than 2^31 CTAs");
  const cudaError_t launched = WithHeadSize(
      p.page.head_size,
      [&](auto head) {
        return WithPageOptions(p.page, [&](auto swizzle, auto layout) {
          return Launch<decltype(head)::value, decltype(swizzle)::value, decltype(layout)::value>(
              stream, p);
        });
      },
      cudaErrorInvalidValue);
  if (launched != cudaSuccess)
    return CudaError("ragged_paged_attention", "kernel launch", launched);
  return ffi::Error::Success();
}

template <int kHead>
int ResidentCtas() {
  if (Configure<kHead, true, Layout::kHND>() != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return ResidentCtasPerSm(RaggedKernel<kHead, true, Layout::kHND>, kThreads,
                           RaggedShape<kHead>::kSmemBytes);
}

}  // namespace

int RaggedResidentCtasPerSm(int head_size) {
  return WithHeadSize(head_size, [](auto head) { return ResidentCtas<decltype(head)::value>(); },
                      0);
}

}  // namespace nvfp4

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    NvFp4RaggedAttentionCuda, nvfp4::RaggedCuda,
    nvfp4::BindRagged(xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
    {xla::ffi::Traits::kCmdBufferCompatible});
