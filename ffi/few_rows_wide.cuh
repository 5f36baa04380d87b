// The few-row kernel's path for 17 to 32 query rows per kv head at head size 128 (speculative
// decoding's 32 x 8: 8 draft tokens x GQA 4), on wgmma (sm_90a), one warpgroup (the CTA's 4
// warps) per (sequence, kv head, split), launched as a kernel of its own (WideRowsKernel,
// ragged_few_rows.cu: 166 registers, 3 CTAs a SM). Where it serves a call alone (a bound past
// 16 rows) it takes the sequences of 1 to 16 rows too: columns past a sequence's rows are
// padding.
//
// Why: with 32 rows a warp's O^T accumulators alone take 128 registers, so the 16-row loop of
// chunk_attention.cuh cannot hold them (it spilled: 514 us at 32 x 8 over 8192, against 346 on
// the pipelined kernel, whose one producer warpgroup converts every position for a half-empty
// tile; benchmarks/NOTES.md). Here the warpgroup shares the work the way wgmma shares its
// operands, and every warp converts, straight into registers:
//   S^T = K Q^T   on m64n32k16: positions in M (warp w converts K for its 16 of each 64), head
//                 dims in K, the query rows in N; q^T in shared memory (K-major), once a CTA;
//   O^T += V^T P^T on m64n32k16: head dims in M (warp w converts V for its 32 of the 128: 4 a
//                 lane, over every position of the step, read with ldmatrix.trans), positions
//                 in K, rows in N; P^T written to shared memory (stmatrix.trans, K-major).
// The accumulators are spread over 128 threads (O^T: 32 registers a thread, S^T: 16 per 64
// positions), each K and V value is converted once, by one lane, and each page is read once
// for all of the sequence's rows. The price is two CTA barriers a step of kWideStep positions:
// the running max of each row over the warps' positions (the softmax's P must share it, since
// one wgmma sums over every warp's positions), and P^T written before the multiply reads it.
//
// A step's raw page bytes (K and V codes and scales of kWideStep positions) are copied with
// cp.async into a ring of kWideStages stages, one position a thread pair (WideCopy): step i's
// refill copies step i + kWideStages into the stage step i has just used. Positions are ordered
// within each 16 so that a lane's V scales are one 4-byte word (wide_position). Numbers as in
// attention_device.cuh and chunk_attention.cuh (q to fp16 after a power-of-two scale per row, K
// and V exact in fp16, float32 softmax and sums, P in fp16).
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "attention_device.cuh"
#include "chunk_attention.cuh"
#include "cuda_common.cuh"
#include "page_chunks.cuh"
#include "ragged_device.cuh"
#include "ragged_ffi.h"
#include "wgmma.cuh"

namespace nvfp4 {
namespace {

constexpr int kWideThreads = 128;    // one warpgroup
// Positions a step: the S^T wgmma's M. (Steps of 128 held twice the A fragments in flight and
// spilled at the kernel's 255 registers.) The ring's stages: -DNVFP4_WIDE_STAGES=N.
constexpr int kWideStep = 64;
#ifndef NVFP4_WIDE_STAGES
#define NVFP4_WIDE_STAGES 3
#endif
constexpr int kWideStages = NVFP4_WIDE_STAGES;
static_assert(kWideStages >= 2, "a step converted while the next lands");
// How far (log2 units) a score may pass its column's shared reference before the warps set a
// new one: P <= 2^8 (attend_wide_rows' softmax).
constexpr float kWideSlack = 8.f;
// A column's reference before it has seen a score: finite, so that P = 2^(x - m) needs no
// check for it (x - kWideUnseen is +huge for any finite score: the vote then always passes
// and sets a true reference; a masked score is -inf, its P 0). No float32 score in log2 units
// is below it: a real reference never equals it.
constexpr float kWideUnseen = -3.402823466e38f;  // -FLT_MAX

struct WideShape {
  static constexpr int kMBlocks = kWideStep / 64;   // S^T's m64 blocks a step
  static constexpr int kKSteps = kWideStep / 16;    // O^T's k16 steps a step
  static constexpr int kCodeBytes = kFewRowsWideHead / 2;  // one position's codes, one side
  static constexpr int kScaleBytes = kFewRowsWideHead / 16;
  // The K-major B operands (q^T and P^T): [blocks of 64 K][32 rows][128 bytes], 128-byte swizzle.
  static constexpr int kBBlockBytes = kFewRowsWide * 128;
  static constexpr int kQBytes = (kFewRowsWideHead / 64) * kBBlockBytes;
  static constexpr int kPBytes = (kWideStep / 64) * kBBlockBytes;
  // A stage: K codes [pos][64] (plain), V codes [pos][64] (16-byte pieces swizzled for
  // ldmatrix: wide_v_code_at), K scales [pos][8], V scales [pos][8] (the page's rows as they
  // are: swizzled scales then hold each block's 4 positions of a group of 4 in one word).
  static constexpr int kKCodeAt = 0;
  static constexpr int kVCodeAt = kKCodeAt + kWideStep * kCodeBytes;
  static constexpr int kKScaleAt = kVCodeAt + kWideStep * kCodeBytes;
  static constexpr int kVScaleAt = kKScaleAt + kWideStep * kScaleBytes;
  static constexpr int kStageBytes = kVScaleAt + kWideStep * kScaleBytes;
  // Shared memory: q^T, P^T (both 1024-byte aligned), the ring, then per row (column of N):
  // its output row (-1 past the sequence's rows), the score scale, the end of its positions,
  // and a float per warp for the exchanges.
  static constexpr int kQAt = 0;
  static constexpr int kPAt = kQAt + kQBytes;
  static constexpr int kRingAt = kPAt + kPBytes;
  static constexpr int kColRowAt = kRingAt + kWideStages * kStageBytes;
  static constexpr int kColScaleAt = kColRowAt + kFewRowsWide * 8;
  static constexpr int kColLimitAt = kColScaleAt + kFewRowsWide * 4;
  static constexpr int kExchangeAt = kColLimitAt + kFewRowsWide * 4;
  static constexpr int kSmemBytes = kExchangeAt + 4 * kFewRowsWide * 4;
  static_assert(kQBytes % 1024 == 0 && kPBytes % 1024 == 0, "whole 128-byte swizzle atoms");
  static_assert(kStageBytes % 16 == 0, "16-byte aligned stages");
  static_assert(kColRowAt % 8 == 0, "the columns' 64-bit rows aligned");
};

// Position (within its 16) of index kk of a k16 step of O^T (and of row kk of a warp's 16 rows
// of S^T): lane quad q's columns 2q, 2q + 1 (its A fragment's registers 0, 1) and 8 + 2q, 9 + 2q
// (registers 2, 3) are positions 4q .. 4q + 3, so its V scale bytes are adjacent.
__device__ __forceinline__ int wide_position(int kk) {
  return ((kk & 6) << 1) | ((kk >> 2) & 2) | (kk & 1);
}

// Byte offset in a stage's V codes of the 16-byte piece c (dims 32c .. 32c + 31) of position
// p: pieces swizzled by p / 4 so that ldmatrix's 8 rows (positions 4r + {0, 1} or + {2, 3}, the
// same piece) hit 8 different bank groups.
__device__ __forceinline__ int wide_v_code_at(int p, int c) {
  return WideShape::kVCodeAt + p * WideShape::kCodeBytes + ((c ^ ((p >> 2) & 3)) << 4);
}

// Where one position of a step is: its page (0 where its group of 4 positions starts at or past
// the end: then nothing of it is read; a position past the end in a group that starts before
// it has its real page, whose swizzled V scale bytes are copied with the group's) and the plane
// rows from the kv head's row to its page row.
struct WideEntry {
  int32_t entry;
  uint32_t row_off;
};

// One thread's share of the ring's copies: position p = t / 2 of each step, and of its K and V
// code rows the 16-byte pieces h and h + 2 (h = t % 2), and the scale bytes of side h (K, V),
// zero-filled at or past `end` (swizzled V scales by groups of 4: lookup). (So a lane pair
// copies a 32-byte sector of a row whole in each instruction: with a position a thread, a piece
// an instruction, each sector was requested twice, in two instructions: ncu, ragged v40.) The
// block-table entry of the step to copy is read ahead (fetch), so that its latency never holds
// up the copies. What does not change from step to step (this thread's places in the cache at
// its kv head and in a stage) is worked out once: a step's copies then cost the page's address
// and the five cp.async.
template <bool kSwizzle, Layout kLayout>
struct WideCopy {
  static_assert(kWideThreads == 2 * kWideStep, "a thread pair per position");
  static_assert(WideShape::kStageBytes % 64 == 0 && WideShape::kRingAt % 64 == 0,
                "stages 64-byte aligned: a position's code pieces are one 64-byte row");
  using W = WideShape;
  const PageView<kLayout>& pv;
  const uint8_t* k_at_head;   // the cache's K side, plane row head_row of page 0, piece h
  const uint8_t* scale_at_head;  // side h's scale bytes of that plane row
  uint32_t end;
  uint32_t p;
  bool v_scales;      // this thread copies V's scale bytes (h = 1), else K's
  uint32_t k_code_to;  // shared address in stage 0 of piece h of this position's K codes
  uint32_t v_code_to;  // and of its V codes (swizzled: wide_v_code_at)
  uint32_t scale_to;   // and of its side h's scale bytes
  WideEntry next{};  // fetched: where this thread's position of the next step to copy is

  __device__ __forceinline__ WideCopy(const PageView<kLayout>& view, uint32_t end_,
                                      const uint8_t* ring)
      : pv(view), end(end_), p(threadIdx.x / 2), v_scales(threadIdx.x % 2 != 0) {
    const int h = int(threadIdx.x % 2);
    k_at_head = pv.cache + int64_t(pv.head_row) * W::kCodeBytes + 16 * h;
    scale_at_head = pv.cache + (v_scales ? pv.side_bytes : 0) + pv.side_data +
                    int64_t(pv.head_row) * W::kScaleBytes;
    // Piece h + 2 is at (piece h) ^ 32 on both sides (V's pieces are swizzled by XOR with a
    // value below 4: wide_v_code_at).
    k_code_to = shared_address(ring) + W::kKCodeAt + int(p) * W::kCodeBytes + 16 * h;
    v_code_to = shared_address(ring) + wide_v_code_at(int(p), h);
    scale_to = shared_address(ring) + (v_scales ? W::kVScaleAt : W::kKScaleAt) +
               p * W::kScaleBytes;
  }

  // Swizzled V scales: rows 4k .. 4k + 3 of a page hold the scales of those 4 positions
  // together, so a group with any position before `end` is copied whole (its rows are in the
  // same page: block sizes are multiples of 4); the reader masks the bytes past `end`.
  __device__ __forceinline__ WideEntry lookup(uint32_t base) const {
    const uint32_t pos = base + p;
    uint32_t row;
    const uint32_t index = pv.block_size.divmod(pos, &row);
    return {(pos & ~3u) < end ? __ldg(pv.table + index) : 0,
            uint32_t(pv.plane_row(row) - pv.head_row)};
  }
  __device__ __forceinline__ void fetch(uint32_t base) { next = lookup(base); }
  // The step's bytes (positions [base, base + kWideStep)) into the stage at byte `stage_at` of
  // the ring, from where `at` says (`next` for the fetched step). (A position past `end` is
  // zero-filled, its codes never read; where its group of 4 starts past `end` too it has
  // entry 0 and a row inside the page, so that every source is an address inside the cache.)
  __device__ __forceinline__ void copy(uint32_t stage_at, uint32_t base,
                                       const WideEntry& at) const {
    const uint32_t pos = base + p;
    const bool valid = pos < end, group_valid = (pos & ~3u) < end;
    const int64_t page = pv.page_offset(at.entry);
    const uint8_t* const k_codes = k_at_head + page + at.row_off * W::kCodeBytes;
    const uint8_t* const v_codes = k_codes + pv.side_bytes;
    copy_async_to<16>(k_code_to + stage_at, k_codes, valid);
    copy_async_to<16>((k_code_to + stage_at) ^ 32u, k_codes + 32, valid);
    copy_async_to<16>(v_code_to + stage_at, v_codes, valid);
    copy_async_to<16>((v_code_to + stage_at) ^ 32u, v_codes + 32, valid);
    copy_async_to<8>(scale_to + stage_at, scale_at_head + page + at.row_off * W::kScaleBytes,
                     v_scales && kSwizzle ? group_valid : valid);
  }
};

// The work of one CTA (one warpgroup) on a sequence of up to 32 query rows at head size 128
// (17 to 32, or any where WideRowsKernel serves the call alone): as attend_few_rows
// (ragged_few_rows.cu), whose arguments it takes.
template <bool kSwizzle, Layout kLayout>
__device__ __forceinline__ void attend_wide_rows(const RaggedProblem& p, const RaggedGrid& grid,
                                                 int32_t b, int32_t kv_head, int32_t member,
                                                 int32_t split, int32_t start, int32_t q_len,
                                                 uint8_t* smem) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using W = WideShape;
  constexpr int kHead = kFewRowsWideHead;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, qd = lane & 3;
  const FewRowsSequence seq(p, grid, b, kv_head, member, split, start, q_len);
  if (seq.nothing_to_attend<kHead, kWideThreads>(split)) return;
  const int rows = seq.rows;
  const PageView<kLayout> pv = sequence_page_view<kLayout>(p, grid, member, b, kv_head);

  uint8_t* const q_t = smem + W::kQAt;
  uint8_t* const p_t = smem + W::kPAt;
  uint8_t* const ring = smem + W::kRingAt;
  float* const col_scale = reinterpret_cast<float*>(smem + W::kColScaleAt);
  uint32_t* const col_limit = reinterpret_cast<uint32_t*>(smem + W::kColLimitAt);
  int64_t* const col_row = reinterpret_cast<int64_t*>(smem + W::kColRowAt);
  float* const exchange = reinterpret_cast<float*>(smem + W::kExchangeAt);  // [warp][column]

  const uint32_t begin = uint32_t(seq.begin), end = uint32_t(seq.last_end);
  const int num_steps = int((end - begin + kWideStep - 1) / kWideStep);
  const auto step_base = [&](int i) { return begin + uint32_t(i * kWideStep); };
  // The ring's first stages, one copy group a step (empty past the last: the waits count groups).
  // Their block-table entries and q's row are loaded together before any copy, so that the
  // prologue waits one round trip for all of them (a stage's copy needs its entry: in a loop of
  // lookup then copy, each stage's entry was a round trip of its own).
  WideCopy<kSwizzle, kLayout> copier(pv, end, ring);
  WideEntry first[kWideStages];
#pragma unroll
  for (int i = 0; i < kWideStages; ++i) first[i] = copier.lookup(step_base(i));
  const int q_r = 8 * warp + g;  // the row of q this lane converts (below)
  const int64_t q_at = (q_r < rows ? seq.q_row(q_r) : 0) * kHead;
  const LaneQ<kHead> q_lane = load_lane_q<kHead>(p.q, p.q_type, q_at, q_r < rows, lane);
  const float k_times_sm_scale =
      p.k_scale[p.k_scale_stacked ? member : 0] * p.sm_scale[p.sm_scale_stacked ? member : 0];
#pragma unroll
  for (int i = 0; i < kWideStages; ++i) {
    if (i < num_steps) copier.copy(uint32_t(i * W::kStageBytes), step_base(i), first[i]);
    copy_async_commit();
  }

  // q^T: warp w converts rows 8w .. 8w + 7 (its lane g's row) as chunk_attention's B fragments
  // and stores them where the K-major operand has them: k-step s's words 0 and 1 at K
  // 16 s + 2 q and 16 s + 8 + 2 q of row 8 w + g.
  {
    uint32_t f[Shape<kHead>::kKTiles][2];
    float scale[2];
    q_fragments<kHead>(q_lane, k_times_sm_scale, lane, f, scale);
#pragma unroll
    for (int s = 0; s < Shape<kHead>::kKTiles; ++s)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int k = 16 * s + 8 * h + 2 * qd;
        *reinterpret_cast<uint32_t*>(q_t + (k >> 6) * W::kBBlockBytes +
                                     swizzle128_offset(q_r, k & 63)) = f[s][h];
      }
    if (g == 0) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        col_scale[8 * warp + 2 * qd + h] = scale[h];
        col_limit[8 * warp + 2 * qd + h] = seq.row_end(8 * warp + 2 * qd + h);
        // (Worked out here, while the sequence's fields are in registers: in the epilogue
        // they had been spilled, two dependent local loads a column.)
        col_row[8 * warp + 2 * qd + h] =
            8 * warp + 2 * qd + h < rows ? seq.q_row(8 * warp + 2 * qd + h) : -1;
      }
    }
  }
  fence_proxy_async_shared();  // q^T is read by wgmma
  copy_async_wait<kWideStages - 1>();  // this thread's copies of step 0
  __syncthreads();

  // This lane's columns c = 8 t + 2 q + h (index 2 t + h): scales, ends; the softmax state.
  // nm: minus the column reference m, the FFMA's addend, held negated (ptxas otherwise works
  // -m out again every step: 8 FADD; ragged v45 review).
  float scale[8], nm[8], l[8];
#pragma unroll
  for (int t = 0; t < 4; ++t)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      scale[2 * t + h] = col_scale[8 * t + 2 * qd + h];
      nm[2 * t + h] = -kWideUnseen;
      l[2 * t + h] = 0.f;
    }
  const uint32_t mask_from = seq.row_end(0);  // every later row sees more
  float o[2][16];  // O^T, m-block j: rows g, g + 8 = dims 32 w + 4 g + 2 j, + 1
#pragma unroll
  for (int j = 0; j < 2; ++j)
#pragma unroll
    for (int r = 0; r < 16; ++r) o[j][r] = 0.f;
  const uint64_t q_desc = swizzled_desc(q_t, 16, 1024);
  const uint64_t p_desc = swizzled_desc(p_t, 16, 1024);
  const int v_block = 2 * warp + (g >> 2);  // the V scale block of this lane's 4 dims
  // This lane's rows of S^T in m-block j (hh = 0: row g, 1: row g + 8) are the positions
  // 64 j + 16 w + wide_position(g) (+ 2) of the step.
  const int my_position = 16 * warp + wide_position(g);
  // This lane's places in a stage and in P^T, worked out once in the source (ptxas works
  // most out again from threadIdx every step, for registers; holding them spilled them to
  // local memory and ran 4-10% slower: benchmarks/NOTES.md, ragged v41):
  // its K codes and scales (row g of m-block 0), its ldmatrix row of V (matrix lane / 8, row
  // lane % 8: k-step mtx / 2, positions of its 16 as wide_position(8 (mtx % 2) + row)), its V
  // scale word (positions 4 q .. 4 q + 3 of k-step 0), its stmatrix rows of P^T (hh = 0, 1).
  const uint32_t k_code_at = W::kKCodeAt + my_position * W::kCodeBytes + 16 * qd;
  const uint32_t k_scale_at = W::kKScaleAt + my_position * W::kScaleBytes + 2 * qd;
  const uint32_t v_row_at =
      wide_v_code_at(16 * (lane >> 4) + wide_position(8 * ((lane >> 3) & 1) + (lane & 7)), warp);
  const uint32_t v_scale_at = W::kVScaleAt + 4 * qd * W::kScaleBytes + 4 * v_block;
  uint32_t p_row_at[2];
#pragma unroll
  for (int hh = 0; hh < 2; ++hh)
    p_row_at[hh] = shared_address(p_t) + swizzle128_offset(lane, 16 * warp + 8 * hh);

  // Step i, its bytes in the ring's stage at byte stage_at. kMasked: the step reaches past the
  // first row's end (positions past each column's end do not count) and maybe past `end` (the
  // V scale bytes of a group past it are not this call's); the other steps skip both checks.
  const auto step = [&](int i, uint32_t stage_at, auto masked_tag) {
    constexpr bool kMasked = decltype(masked_tag)::value;
    const uint8_t* const stage = ring + stage_at;
    const uint32_t base = step_base(i);

    // S^T = K Q^T.
    float s[W::kMBlocks][16];
    uint32_t kf[W::kMBlocks][Shape<kHead>::kKTiles][4];
#pragma unroll
    for (int j = 0; j < W::kMBlocks; ++j) {
      Chunk<kHead> c;  // only its tile 0's K fields are used
#pragma unroll
      for (int hh = 0; hh < 2; ++hh) {
        const int pp = 64 * j + 2 * hh;  // from my_position
        const uint4 v = *reinterpret_cast<const uint4*>(stage + k_code_at + pp * W::kCodeBytes);
        c.k[hh][0] = v.x, c.k[hh][1] = v.y, c.k[hh][2] = v.z, c.k[hh][3] = v.w;
        c.k_scale[hh] = *reinterpret_cast<const uint16_t*>(stage + k_scale_at +
                                                           pp * W::kScaleBytes);
      }
      uint32_t scale_words[2][Shape<kHead>::kKScaleBytes];
      k_tile_scales<kHead>(c, 0, scale_words);
#pragma unroll
      for (int w = 0; w < Shape<kHead>::kKWords; ++w)
        k_word_fragments<kHead>(c, 0, w, scale_words, kf[j][2 * w], kf[j][2 * w + 1]);
#pragma unroll
      for (int r = 0; r < 16; ++r) s[j][r] = 0.f;
    }
#pragma unroll
    for (int j = 0; j < W::kMBlocks; ++j) wgmma_fence_operands(s[j]);
    wgmma_fence();
#pragma unroll
    for (int j = 0; j < W::kMBlocks; ++j)
#pragma unroll
      for (int k = 0; k < Shape<kHead>::kKTiles; ++k)
        wgmma_64x32(s[j], kf[j][k],
                    desc_plus(q_desc, (k >> 2) * W::kBBlockBytes + (k & 3) * 32));
    wgmma_commit();
    // Where this thread's position of step i + kWideStages is (the refill below copies it): loaded
    // here, right after S^T's wgmma fence, because ptxas makes a wgmma fence wait for every load
    // in flight (fetched in the step before's refill, the entry held up the next step's first
    // fence by a round trip: ncu, ragged v40). O^T's fence at the step's end comes after it,
    // ~300 instructions and two barriers later (in the SASS it does not wait for this load).
    if (i + kWideStages < num_steps) copier.fetch(step_base(i + kWideStages));

    wgmma_wait<0>();
#pragma unroll
    for (int j = 0; j < W::kMBlocks; ++j) {
      wgmma_fence_operands(s[j]);
      wgmma_keep_a_operands(kf[j]);
    }

    // The online softmax, scores in log2 units. The warps share each column's reference m (one
    // wgmma sums P over all of their positions), which changes only when a score of any warp
    // passes it by more than kWideSlack: P = 2^(score - m) <= 2^kWideSlack then, exact in fp16
    // as any P is, and the sums are float32. Most steps only vote (the barrier they need
    // anyway); a step whose scores pass sets m to the columns' max through shared memory.
    // x = score - m (+huge where m is still kWideUnseen: the step passes), computed again for
    // P rather than kept (registers); -inf past the column's end.
    uint32_t limit[8];
    if constexpr (kMasked) {
#pragma unroll
      for (int c = 0; c < 8; ++c) limit[c] = col_limit[8 * (c >> 1) + 2 * qd + (c & 1)];
    }
    const auto x_of = [&](int j, int r, const float (&neg_ref)[8]) {
      const int c = 2 * (r >> 2) + (r & 1), hh = (r >> 1) & 1;
      float x = fmaf(s[j][r], scale[c], neg_ref[c]);
      if constexpr (kMasked) {
        if (base + uint32_t(64 * j + my_position + 2 * hh) >= limit[c]) x = -INFINITY;
      }
      return x;
    };
    float over = -INFINITY;
#pragma unroll
    for (int j = 0; j < W::kMBlocks; ++j)
#pragma unroll
      for (int r = 0; r < 16; ++r) over = fmaxf(over, x_of(j, r, nm));
    // A new reference (the rare path, after a vote that some score passed): the columns' max
    // over the warps through shared memory; O and the sums rescaled to it.
    const auto new_reference = [&] {
      float top[8];
      const float neg_zero[8] = {-0.f, -0.f, -0.f, -0.f, -0.f, -0.f, -0.f, -0.f};
#pragma unroll
      for (int c = 0; c < 8; ++c) top[c] = -INFINITY;
#pragma unroll
      for (int j = 0; j < W::kMBlocks; ++j)
#pragma unroll
        for (int r = 0; r < 16; ++r) {
          const int c = 2 * (r >> 2) + (r & 1);
          top[c] = fmaxf(top[c], x_of(j, r, neg_zero));
        }
#pragma unroll
      for (int c = 0; c < 8; ++c)
#pragma unroll
        for (int delta = 4; delta < 32; delta *= 2)
          top[c] = fmaxf(top[c], __shfl_xor_sync(0xFFFFFFFFu, top[c], delta));
      if (g == 0) {
#pragma unroll
        for (int c = 0; c < 8; ++c)
          exchange[warp * kFewRowsWide + 8 * (c >> 1) + 2 * qd + (c & 1)] = top[c];
      }
      __syncthreads();
#pragma unroll
      for (int c = 0; c < 8; ++c) {
        const int col = 8 * (c >> 1) + 2 * qd + (c & 1);
        float most = -nm[c];
#pragma unroll
        for (int w = 0; w < 4; ++w) most = fmaxf(most, exchange[w * kFewRowsWide + col]);
        // (nothing seen before: alpha 0, or 1 where nothing is seen yet; the state is zeros)
        const float alpha = exp2_approx(-nm[c] - most);
        nm[c] = -most;
        l[c] *= alpha;
#pragma unroll
        for (int j = 0; j < 2; ++j)
#pragma unroll
          for (int hh = 0; hh < 2; ++hh) o[j][4 * (c >> 1) + 2 * hh + (c & 1)] *= alpha;
      }
    };
    // P^T (K-major: row = column of N, positions along K) by stmatrix.trans:
    // m-block j's 8 x 8 matrices (this warp's rows 8 hh .. 8 hh + 7, columns 8 t ..), lane L
    // giving the address of row L % 8 of matrix t = L / 8; P added to the sums `l`.
    const auto write_p = [&] {
#pragma unroll
      for (int j = 0; j < W::kMBlocks; ++j)
#pragma unroll
        for (int hh = 0; hh < 2; ++hh) {
          uint32_t packed[4];
#pragma unroll
          for (int t = 0; t < 4; ++t) {
            const float p0 = exp2_approx(x_of(j, 4 * t + 2 * hh, nm));
            const float p1 = exp2_approx(x_of(j, 4 * t + 2 * hh + 1, nm));
            l[2 * t] += p0;
            l[2 * t + 1] += p1;
            packed[t] = pack_f16x2(p0, p1);
          }
          stmatrix_x4_trans(p_row_at[hh] + j * W::kBBlockBytes, packed[0], packed[1], packed[2],
                            packed[3]);
        }
      fence_proxy_async_shared();  // P^T is read by wgmma
    };
    // The copies of step i + kWideStages into this step's stage (every warp done reading it).
    const auto refill = [&] {
      if (i + kWideStages < num_steps)
        copier.copy(stage_at, step_base(i + kWideStages), copier.next);
      copy_async_commit();
    };
    // V^T's A fragments of this step (its stage not yet refilled; after the softmax, so that
    // they are not live through it): k16 step k's 16 positions through ldmatrix.trans, this
    // warp's dims 32 w .. 32 w + 31 (lane g: 4).
    uint32_t vf[2][W::kKSteps][4];  // V^T A fragments of the step
    // O^T += V^T P^T of the step (its P^T written and visible, its V^T converted: the barrier
    // before it), issued and waited for at the step's end (ptxas serialises every wgmma when a
    // product is still in flight across the loop's back edge). (It was issued with the next
    // step's S^T, V^T's fragments converted before the softmax: then they were live through
    // it, the step's register peak, 153 live against 141 now; ragged v45.)
    const auto issue_values = [&] {
#pragma unroll
      for (int j = 0; j < 2; ++j) wgmma_fence_operands(o[j]);
      wgmma_fence();
#pragma unroll
      for (int j = 0; j < 2; ++j)
#pragma unroll
        for (int k = 0; k < W::kKSteps; ++k)
          wgmma_64x32(o[j], vf[j][k],
                      desc_plus(p_desc, (k >> 2) * W::kBBlockBytes + (k & 3) * 32));
      wgmma_commit();
    };
    const auto convert_values = [&] {
#pragma unroll
      for (int k2 = 0; k2 < W::kKSteps / 2; ++k2) {
        uint32_t x[4];  // k-steps 2 k2 (lo, hi), 2 k2 + 1 (lo, hi)
        // (k-step 2 k2 + mtx / 2: 32 positions on per k2, the swizzle unchanged)
        ldmatrix_x4_trans(x, stage + v_row_at + 32 * k2 * W::kCodeBytes);
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int k = 2 * k2 + e;
          const int pp = 16 * k + 4 * qd;  // this lane's positions pp .. pp + 3
          uint32_t bytes;
          if constexpr (kSwizzle) {
            bytes = *reinterpret_cast<const uint32_t*>(stage + v_scale_at + 16 * k * W::kScaleBytes);
            if constexpr (kMasked) {  // the group's bytes past `end` (copied whole) are not ours
              const int valid = min(max(int(end - base) - pp, 0), 4);
              bytes &= valid == 4 ? 0xFFFFFFFFu : (1u << (8 * valid)) - 1u;
            }
          } else {
            const uint8_t* at = stage + W::kVScaleAt + pp * W::kScaleBytes + v_block;
            bytes = uint32_t(at[0]) | (uint32_t(at[W::kScaleBytes]) << 8) |
                    (uint32_t(at[2 * W::kScaleBytes]) << 16) |
                    (uint32_t(at[3 * W::kScaleBytes]) << 24);
          }
          const uint32_t scale_lo = e4m3x2_to_f16x2_x128(bytes);
          const uint32_t scale_hi = e4m3x2_to_f16x2_x128(bytes >> 16);
          uint32_t lo[4], hi[4];
          e2m1x8_to_f16x2(x[2 * e], lo);
          e2m1x8_to_f16x2(x[2 * e + 1], hi);
#pragma unroll
          for (int r = 0; r < 4; ++r) lo[r] = hmul2(lo[r], scale_lo), hi[r] = hmul2(hi[r], scale_hi);
          // registers 0..3 of a converted word: dims +0, +2, +1, +3 of the lane's 4
          vf[0][k][0] = lo[0], vf[0][k][1] = lo[2], vf[0][k][2] = hi[0], vf[0][k][3] = hi[2];
          vf[1][k][0] = lo[1], vf[1][k][1] = lo[3], vf[1][k][2] = hi[1], vf[1][k][3] = hi[3];
        }
      }
    };
    // The vote (every warp's S^T done), P^T and V^T's fragments; then, once every warp has
    // written its P^T and read this stage, O^T += V^T P^T, issued and waited for in this step
    // (ptxas serialises every wgmma when a product is in flight across the loop's back edge),
    // the refill in its shadow.
    if (__syncthreads_or(over > kWideSlack)) new_reference();
    write_p();
    convert_values();
    copy_async_wait<kWideStages - 2>();  // this thread's copies of step i + 1
    __syncthreads();                     // P^T written, this stage read, step i + 1 landed
    issue_values();
    refill();
    wgmma_wait<0>();
#pragma unroll
    for (int j = 0; j < 2; ++j) wgmma_fence_operands(o[j]);
    wgmma_keep_a_operands(vf[0]);
    wgmma_keep_a_operands(vf[1]);
  };
  // The steps before the first row's end, then the others.
  const int unmasked = min(int((mask_from - begin) / kWideStep), num_steps);
  // (The stage's offset follows i % kWideStages without the division.)
  const auto next_stage = [](uint32_t at) {
    return at == (kWideStages - 1) * W::kStageBytes ? 0u : at + W::kStageBytes;
  };
  uint32_t stage_at = 0;
#pragma unroll 1
  for (int i = 0; i < unmasked; ++i, stage_at = next_stage(stage_at))
    step(i, stage_at, std::false_type{});
#pragma unroll 1
  for (int i = unmasked; i < num_steps; ++i, stage_at = next_stage(stage_at))
    step(i, stage_at, std::true_type{});
  copy_async_wait<0>();

  // Each column's sum over its positions: the lanes of a column (g), then the warps.
#pragma unroll
  for (int c = 0; c < 8; ++c)
#pragma unroll
    for (int delta = 4; delta < 32; delta *= 2)
      l[c] += __shfl_xor_sync(0xFFFFFFFFu, l[c], delta);
  __syncthreads();  // (the last step's exchange reads are done)
  if (g == 0) {
#pragma unroll
    for (int c = 0; c < 8; ++c)
      exchange[warp * kFewRowsWide + 8 * (c >> 1) + 2 * qd + (c & 1)] = l[c];
  }
  __syncthreads();
  // Each column's 4 consecutive dims of this lane (32 w + 4 g .. + 3: o[j][.] at 2 j + hh) go
  // in one store (16 bytes of float32, 8 of a 16-bit out), so that a warp's store writes 4
  // rows x 128 contiguous bytes; one division a column (out_scale / sum), then a product a
  // value, as the pipelined kernel's epilogue (ragged v25). (Before: write_result a value, its
  // IEEE division each, 32 scattered 4-byte stores a thread.)
  const bool one_split = p.num_splits == 1;
  const float out_scale = split_out_scale(p, member);
  const int d0 = 32 * warp + 4 * g;
#pragma unroll
  for (int c = 0; c < 8; ++c) {
    const int col = 8 * (c >> 1) + 2 * qd + (c & 1);
    const int64_t row = col_row[col];
    if (row < 0) continue;  // past the sequence's rows (a real row is >= 0: start is clamped)
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < 4; ++w) sum += exchange[w * kFewRowsWide + col];
    // A row saw nothing in this split where its reference is still kWideUnseen and its sum is
    // 0; a row whose every score was NaN (a NaN in q) also keeps kWideUnseen, but its sum is
    // NaN: a NaN row (value and lse), as on every other path.
    const bool empty = nm[c] == -kWideUnseen && !isnan(sum);
    if (d0 == 0) write_row_lse(p, row, split, empty ? -INFINITY : -nm[c] + __log2f(sum));
    if (empty && !one_split) continue;  // an empty partial: the merge skips it by its lse
    const float factor = out_scale / sum;
    float v[4];
#pragma unroll
    for (int j = 0; j < 2; ++j)
#pragma unroll
      for (int hh = 0; hh < 2; ++hh)
        v[2 * j + hh] = empty ? 0.f : o[j][4 * (c >> 1) + 2 * hh + (c & 1)] * factor;
    if (one_split && p.q_type != QType::kF32) {
      *reinterpret_cast<uint2*>(static_cast<uint16_t*>(p.out) + row * kHead + d0) =
          make_uint2(pack_out16x2(p.q_type, v[0], v[1]), pack_out16x2(p.q_type, v[2], v[3]));
    } else {
      *reinterpret_cast<float4*>(row_values_f32(p, row, split, kHead) + d0) =
          make_float4(v[0], v[1], v[2], v[3]);
    }
  }
#else
  __trap();  // launched only where the build has sm_90a code (FewRowsMaxRows)
#endif
}

}  // namespace
}  // namespace nvfp4
