// Device code of the ragged-attention kernels that take query tiles through shared memory: the
// ragged kernel (ragged_cuda.cu) and the pipelined prefill kernel (ragged_pipelined.cu). The
// shape of a tile step, the scan that finds a CTA's tile, the copies of page bytes into a ring
// and their conversion to fp16, and what both kernels set up the same way.
#pragma once

#include <climits>
#include <cstdint>

#include "attention_device.cuh"
#include "cuda_common.cuh"
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
// (kBlockBytes: the bytes of one 64-dim block, kKv x 128 by default; the pipelined kernel's
// stages of more positions pass theirs.)
template <int kHead, int kBlockBytes = RaggedShape<kHead>::kBlockBytes>
__device__ __forceinline__ int kv_chunk(int p, int c) {
  return (c >> 3) * kBlockBytes + swizzle128_offset(p, 8 * (c & 7));
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

// Copies this thread's bytes of position `pos` from `page` to shared memory (its codes to
// `code_dst`, its scales to `scale_dst`): codes when pos < end, scales when the position's row
// group starts before end (swizzled V: the group's 4 plane rows hold the scales of all 4
// positions; rows past end inside the group are read but never used). A copy that is not
// made reads nothing (cp.async's zero fill) from an address inside the cache all the same:
// page ids are clamped into it, and a position past end comes with page 0 (next_page), so no
// select is needed. The offsets inside a page are 32-bit (a page is below 2^31 bytes).
template <int kHead, bool kSwizzle, Layout kLayout>
__device__ __forceinline__ void copy_vector(uint32_t code_dst, uint32_t scale_dst,
                                            const PageView<kLayout>& pv, int32_t page,
                                            uint32_t pos, uint32_t end, uint32_t row, int side,
                                            int part) {
  using R = RaggedShape<kHead>;
  const bool code_valid = pos < end;
  const bool scale_valid = (kSwizzle && side == 1) ? (pos & ~3u) < end : code_valid;
  const uint8_t* const page_bytes = pv.page_address(page);
  const uint32_t plane = uint32_t(pv.plane_row(row));
  const uint32_t side_offset = uint32_t(side) * uint32_t(pv.side_bytes);
  const uint8_t* const codes =
      page_bytes + (side_offset + plane * (kHead / 2) + uint32_t(part * R::kCodeBytes));
  const uint8_t* const scales = page_bytes + (side_offset + uint32_t(pv.side_data) +
                                              plane * R::kScales + uint32_t(part * R::kScaleBytes));
#pragma unroll
  for (int i = 0; i < R::kCodeBytes / 16; ++i)
    copy_async_to<16>(code_dst + 16 * i, codes + 16 * i, code_valid);
  copy_async_to<R::kScaleBytes>(scale_dst, scales, scale_valid);
}

// One thread's page copies of a tile, ring step after ring step (kKv positions from `begin`):
// part `part` of the head vector of position `vector` of the step and side `side`, into ring
// slot step % kSlots; its block-table entry read a step ahead (next_page, then copy_next with
// it), the entries past `end` never read. The calls alternate, next_page() then
// copy_next(page), from step 0 on: a cursor keeps the next step's position, block-table entry
// and row in the page, and moves them by kKv positions a step (kKv / block_size entries and
// kKv % block_size rows, carried), where each step divided its position by the block size
// twice (two FastDivmods) and formed the table entry's address anew (ragged v20).
template <int kHead, bool kSwizzle, Layout kLayout, int kSlots>
struct TileCopies {
  using R = RaggedShape<kHead>;
  PageView<kLayout> pv;
  uint32_t code_dst, scale_dst;  // ring slot 0's shared addresses of this thread's bytes
  int32_t begin;
  uint32_t end;
  int vector, side, part;
  int32_t entries_a_step, rows_a_step;  // kKv / block_size, kKv % block_size
  // The cursor: the next step's ring slot (its offset), position, block-table entry and row.
  uint32_t slot = 0;
  uint32_t position;
  int32_t entry, row;  // (an index, not a pointer: it runs past the table row unread)

  __device__ __forceinline__ TileCopies(uint8_t* ring, const PageView<kLayout>& pv,
                                        const StageSlot<kHead>& staged, int32_t begin,
                                        uint32_t end, int vector, int side, int part)
      : pv(pv),
        code_dst(shared_address(ring) + uint32_t(staged.code_offset)),
        scale_dst(shared_address(ring) + uint32_t(staged.scale_offset + staged.scale_part)),
        begin(begin), end(end), vector(vector), side(side), part(part) {
    entries_a_step = int32_t(pv.block_size.div(uint32_t(R::kKv)));
    rows_a_step = R::kKv - entries_a_step * int32_t(pv.block_size.divisor);
    position = uint32_t(begin + vector);
    uint32_t r;
    entry = int32_t(pv.block_size.divmod(position, &r));
    row = int32_t(r);
  }
  // The position of ring step `s` (the conversion's: position_of(s) < end is a live row).
  __device__ __forceinline__ uint32_t position_of(int s) const {
    return uint32_t(begin + s * R::kKv + vector);
  }
  // The page of the cursor's step (0 where its row group starts at or past end: not read).
  __device__ __forceinline__ int32_t next_page() const {
    return (position & ~3u) < end ? __ldg(pv.table + entry) : 0;
  }
  // Copies the cursor's step from `page` (next_page()'s), then moves the cursor on.
  __device__ __forceinline__ void copy_next(int32_t page) {
    copy_vector<kHead, kSwizzle>(code_dst + slot, scale_dst + slot, pv, page, position, end,
                                 uint32_t(row), side, part);
    slot = slot == (kSlots - 1) * R::kRawStageBytes ? 0 : slot + R::kRawStageBytes;
    position += R::kKv;
    entry += entries_a_step;
    row += rows_a_step;
    if (row >= int32_t(pv.block_size.divisor)) {
      row -= int32_t(pv.block_size.divisor);
      ++entry;
    }
  }
};

// The staged codes times their block scales as fp16 (value * 2^-7 / global scale, exact), 8
// dims per 16-byte store; a position past end is zeros (its staged scale may be a junk row's).
// `position` is the row in side_buffer (kv_chunk, blocks of kBlockBytes), the staged vector's
// position plus a multiple of 64 (so position % 4 is still its place in its scales' row group).
template <int kHead, bool kSwizzle, int kBlockBytes = RaggedShape<kHead>::kBlockBytes>
__device__ __forceinline__ void convert_vector(const uint8_t* stage,
                                               const StageSlot<kHead>& slot, int side,
                                               int position, int part, bool valid,
                                               uint8_t* side_buffer) {
  using R = RaggedShape<kHead>;
  const int chunk0 = part * R::kThreadDims / 8;
  // The 16 bytes of dims [8 c, 8 c + 8) (kv_chunk): the row's first byte is 128-byte aligned
  // (side_buffer 1024-aligned, 128-byte rows), so the swizzle's chunk c % 8 XOR position % 8
  // is the XOR of bits 4-6 of `row` (kv_chunk(position, 0): position % 8 there) with c % 8,
  // and the 64-dim block an immediate offset (was: the row plus one of 8 per-thread registers
  // holding each chunk's swizzled offset, an add a store).
  const uint32_t row =
      shared_address(side_buffer) + uint32_t(kv_chunk<kHead, kBlockBytes>(position, 0));
  const auto store = [&](int w, uint4 v) {
    const int c = chunk0 + w;
    store_shared(((row ^ uint32_t((c & 7) << 4)) + uint32_t((c >> 3) * kBlockBytes)), v);
  };
  if (!valid) {
#pragma unroll
    for (int w = 0; w < R::kCodeWords; ++w) store(w, make_uint4(0, 0, 0, 0));
    return;
  }
  uint32_t scales[R::kScaleBytes / 4];
  if (kSwizzle && side == 1) {
    // Block s of position r: plane row 4 (r / 4) + s / G, column 4 (s % G) + r % 4, G =
    // kScales / 4 (docs/format.md §4). Scale word w of this thread holds blocks s = part x
    // kScaleBytes + 4 w + i, i = 0..3: with G = 1, 2 or 4 (head sizes 64, 128, 256) they are
    // byte r % 4 of the four 4-byte words of the row group's 16-byte piece part x kScaleBytes /
    // 4 + w, so one 16-byte load and three byte permutes gather a word (were four byte loads
    // and three permutes).
    static_assert(R::kScales == 4 || R::kScales == 8 || R::kScales == 16, "G = 1, 2 or 4");
    const uint8_t* group_rows = stage + slot.scale_offset - (position & 3) * R::kScales;
    const uint32_t j = uint32_t(position & 3);
    const uint32_t pick = j | ((j + 4) << 4);  // bytes j of a and of b into bytes 0 and 1
#pragma unroll
    for (int w = 0; w < R::kScaleBytes / 4; ++w) {
      const uint4 v = *reinterpret_cast<const uint4*>(
          group_rows + 16 * (part * R::kScaleBytes / 4 + w));
      scales[w] = prmt(prmt(v.x, v.y, pick), prmt(v.z, v.w, pick), 0x5410);
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
        store(w, make_uint4(hmul2(r[0], scale), hmul2(r[1], scale), hmul2(r[2], scale),
                            hmul2(r[3], scale)));
      }
    }
  }
}

// ------------------------------------------------------------------------------------------
// What both tile kernels set up the same way.

// The pages of sequence `seq` of `member` for kv head `kv_head`, as the tile kernels read them.
template <Layout kLayout>
__device__ __forceinline__ PageView<kLayout> tile_page_view(const RaggedProblem& p,
                                                            const RaggedGrid& grid, int32_t member,
                                                            int32_t seq, int32_t kv_head) {
  PageView<kLayout> pv = sequence_page_view<kLayout>(p, grid, member, seq, kv_head);
  pv.tile_in_page = false;
  return pv;
}

// Half `half` of the dims of query row `q_row` (-1: a padding row, zeros) into `dst` in shared
// memory, by the two threads of the row (adjacent lanes, half 0 and 1): fp16 after the row's
// power-of-two scale, head dims permuted like the converted K, and the sign of the score scale
// qk_scale (k_scale x sm_scale) moved in (exact in fp16), so that each row's scale is >= 0 (or
// NaN) and the loops' unmasked steps can take the max of the unscaled scores. The half's amax,
// then its values. Up to head size 128 the values stay in registers between the two (one round
// trip of loads, all issued together: a CTA's prologue waits for it; ragged v24, v26); at 256
// the half goes in two chunks of 64 and the second pass reads them again. Returns the row's
// exponent.
template <int kHead>
__device__ __forceinline__ int stage_q_half(const RaggedProblem& p, int64_t q_row, int half,
                                            float qk_scale, uint16_t* dst) {
  constexpr int kDims = kHead / 2;
  // The values loaded at once (8 x 16 bytes at 16-bit q types); up to head size 128 that is the
  // whole half, held in registers between the amax and the conversion.
  constexpr int kChunk = kDims < 64 ? kDims : 64;
  constexpr bool kHeld = kChunk == kDims;
  const bool valid = q_row >= 0;
  const int64_t q_at = (valid ? q_row : 0) * kHead + half * kDims;
  float v[kChunk];
  const auto load = [&](int c) {
    if (valid) {
      load_q_values(p.q, p.q_type, q_at + c, v);
    } else {
#pragma unroll
      for (int k = 0; k < kChunk; ++k) v[k] = 0.f;
    }
  };
  float amax = 0.f;
#pragma unroll 1
  for (int c = 0; c < kDims; c += kChunk) {
    load(c);
#pragma unroll
    for (int k = 0; k < kChunk; ++k) amax = fmaxf(amax, fabsf(v[k]));
  }
  amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, 1));
  const int exponent = q_exponent(amax);
  PowerOfTwo times(exponent);
  if (qk_scale < 0.f) times.lo = -times.lo;
#pragma unroll 1
  for (int c = 0; c < kDims; c += kChunk) {
    if constexpr (!kHeld) load(c);
#pragma unroll
    for (int i = 0; i < kChunk; i += 8)
      *reinterpret_cast<uint4*>(dst + c + i) = make_uint4(
          pack_f16x2(times(v[i]), times(v[i + 4])), pack_f16x2(times(v[i + 2]), times(v[i + 6])),
          pack_f16x2(times(v[i + 1]), times(v[i + 5])),
          pack_f16x2(times(v[i + 3]), times(v[i + 7])));
  }
  return exponent;
}

// The row scale of the scores (log2 units) for a row of exponent `exponent`.
__device__ __forceinline__ float row_score_scale(float qk_scale, int exponent) {
  return ldexpf(fabsf(qk_scale) * kLog2e, 7 - exponent);
}

// A tile's q into shared memory, two threads a row (thread t: half t % 2 of row t / 2, rows
// past rows_here zeros), and beside it each row's end in this split, score scale and q row
// among the member's rows (-1: none). Row r is row row0 + r of the sequence, q row q_row_of(r).
template <int kHead, typename QRowOf>
__device__ __forceinline__ void stage_tile_q(const RaggedProblem& p, const RaggedGrid& grid,
                                             const SplitRange& range, int t, int rows_here,
                                             int32_t row0, float qk_scale, int64_t member_rows,
                                             QRowOf&& q_row_of, uint16_t* q_smem,
                                             int32_t* row_end, float* row_scale, int32_t* row_q) {
  using R = RaggedShape<kHead>;
  const int r = t >> 1, half = t & 1;
  const bool valid = r < rows_here;
  const int64_t q_row = valid ? q_row_of(r) : -1;
  const int exponent =
      stage_q_half<kHead>(p, q_row, half, qk_scale, q_smem + r * R::kStride + half * (kHead / 2));
  if (half == 0) {
    row_end[r] = valid ? range.row_end(grid, row0 + r) : 0;
    row_scale[r] = row_score_scale(qk_scale, exponent);
    row_q[r] = valid ? int32_t(q_row - member_rows) : -1;
  }
}

// A warp's two rows in a tile kernel's loop (rows g and g + 8 of its 16: the MMA's C layout, a
// row's 4 lanes share it): where each row's positions end, its score scale (log2 units) and the
// smallest end among the warp's rows (steps below it need no mask). From the tile's row data in
// shared memory (rows_here rows, the warp's from first_row); a warp without rows masks all.
struct WarpRows {
  int32_t limit[2];
  float score_scale[2];
  int32_t min_end;
};

__device__ __forceinline__ WarpRows warp_rows(const int32_t* row_end, const float* row_scale,
                                              int first_row, int rows_here, bool has_rows,
                                              int lane) {
  WarpRows w;
  const int row = first_row + (lane >> 2);
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    w.limit[h] = has_rows ? row_end[row + 8 * h] : 0;
    w.score_scale[h] = row_scale[row + 8 * h];
  }
  w.min_end = INT_MAX;
  if (has_rows) {
    const int r = first_row + (lane & 15);
    w.min_end = r < rows_here ? row_end[r] : INT_MAX;
#pragma unroll
    for (int d = 8; d > 0; d /= 2) w.min_end = min(w.min_end, __shfl_xor_sync(kFullMask, w.min_end, d));
  }
  return w;
}

// One step of the online softmax of the warp's two rows over its scores s (n-tile t, entry c:
// position first + 8 t + 2 qd + (c & 1); the first `count` positions), in two forms. A step that
// reaches past the end of one of the warp's rows scales each score, masks it and exponentiates
// its difference to the max. Every other step (all but the last few of a long tile) needs no
// mask: the row scale is >= 0 (its sign is in q, stage_q_half), so the max of the scaled scores
// is the scaled max of the raw ones, and each exponent is one fused multiply-add, s * scale -
// max. Both keep the max in scaled units. Updates m and l, leaves P in s, and returns the factor
// O must be rescaled by in alpha (rescale_o: the caller applies it, at once or once an
// asynchronous P V still reading O is done). Without kSums, l is left alone: the caller sums P
// itself (the pipelined kernel: on the tensor cores, as P times ones beside P V).
template <int kSTiles, bool kSums = true>
__device__ __forceinline__ void online_softmax(float (&s)[kSTiles][4], int32_t first, int count,
                                               const WarpRows& rows, int qd, float (&m)[2],
                                               float (&l)[2], float (&alpha)[2]) {
  const bool masked = first + count > rows.min_end;
  float top[2] = {m[0], m[1]};
  if (masked) {
#pragma unroll
    for (int t = 0; t < kSTiles; ++t) {
      if (t * 8 >= count) break;
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        float x = s[t][c] * rows.score_scale[c >> 1];
        if (first + 8 * t + 2 * qd + (c & 1) >= rows.limit[c >> 1]) x = -INFINITY;
        s[t][c] = x;
        top[c >> 1] = fmaxf(top[c >> 1], x);
      }
    }
  } else {
    float raw_top[2] = {-INFINITY, -INFINITY};
#pragma unroll
    for (int t = 0; t < kSTiles; ++t) {
      if (t * 8 >= count) break;
#pragma unroll
      for (int c = 0; c < 4; ++c) raw_top[c >> 1] = fmaxf(raw_top[c >> 1], s[t][c]);
    }
#pragma unroll
    for (int h = 0; h < 2; ++h) top[h] = fmaxf(top[h], raw_top[h] * rows.score_scale[h]);
  }
  float offset[2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    top[h] = fmaxf(top[h], __shfl_xor_sync(kFullMask, top[h], 1));
    top[h] = fmaxf(top[h], __shfl_xor_sync(kFullMask, top[h], 2));
    offset[h] = top[h] == -INFINITY ? 0.f : top[h];  // nothing seen yet: no -inf - -inf
    alpha[h] = exp2_approx(m[h] - offset[h]);
    m[h] = top[h];
    if (kSums) l[h] *= alpha[h];
  }
  if (masked) {  // (two loops, not a select per score)
#pragma unroll
    for (int t = 0; t < kSTiles; ++t) {
      if (t * 8 >= count) break;
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        s[t][c] = exp2_approx(s[t][c] - offset[c >> 1]);
        if (kSums) l[c >> 1] += s[t][c];
      }
    }
  } else {
#pragma unroll
    for (int t = 0; t < kSTiles; ++t) {
      if (t * 8 >= count) break;
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        s[t][c] = exp2_approx(__fmaf_rn(s[t][c], rows.score_scale[c >> 1], -offset[c >> 1]));
        if (kSums) l[c >> 1] += s[t][c];
      }
    }
  }
}

// O (n-tiles of the C layout, rows g and g + 8) times alpha, where any row's max moved.
template <int kOTiles>
__device__ __forceinline__ void rescale_o(float (&o)[kOTiles][4], const float (&alpha)[2]) {
  if (__any_sync(kFullMask, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
    for (int t = 0; t < kOTiles; ++t)
#pragma unroll
      for (int c = 0; c < 4; ++c) o[t][c] *= alpha[c >> 1];
  }
}

// P (the softmax's output in the S accumulators) as fp16 A fragments of 16 positions (two
// n-tiles each) for P V.
template <int kPSteps>
__device__ __forceinline__ void pack_p(const float (&s)[2 * kPSteps][4],
                                       uint32_t (&a)[kPSteps][4]) {
#pragma unroll
  for (int k = 0; k < kPSteps; ++k) {
    a[k][0] = pack_f16x2(s[2 * k][0], s[2 * k][1]);
    a[k][1] = pack_f16x2(s[2 * k][2], s[2 * k][3]);
    a[k][2] = pack_f16x2(s[2 * k + 1][0], s[2 * k + 1][1]);
    a[k][3] = pack_f16x2(s[2 * k + 1][2], s[2 * k + 1][3]);
  }
}

// ------------------------------------------------------------------------------------------
// The pipelined prefill kernel (ragged_pipelined.cu): the sequences it takes, which the ragged
// kernel skips when it runs.

constexpr int kPipelinedHead = 128;
// More query rows per kv head than this, and not the few-row kernel's (which takes 17 to 32
// rows too where its wide path runs): the pipelined kernel's sequence (when it runs). Without
// the wide path the sequences of 17 to 32 rows (speculative decoding's 32 x 8) ran 8% faster
// here than on the ragged kernel's mma.sync tiles (benchmarks/NOTES.md, ragged v10b).
constexpr int32_t kPipelinedMinRows = kFewRows;
// Whether the pipelined kernel takes a sequence of q_len query tokens (one over max_q_len too:
// it writes that sequence's NaN rows, so that the ragged kernel need not run for them).
// (kHasWgmma: in code built without sm_90a the kernel is empty, so nothing may be skipped for it;
// the launch also checks, PipelinedPrefillRuns.)
__device__ __forceinline__ bool takes_pipelined(const RaggedProblem& p, int32_t q_len,
                                                int32_t group) {
  return kHasWgmma && p.pipelined && q_len * group > kPipelinedMinRows &&
         !takes_few_rows(p, q_len, group, kPipelinedHead) &&
         !(p.decode_splits > 0 && q_len == 1);
}

}  // namespace
}  // namespace nvfp4
