// A warp's online-softmax attention over its chunks of positions, K and V straight from its
// registers (page_chunks.cuh) into the tensor cores, for kNT n-tiles of 8 query rows: the decode
// kernel's body (decode_cuda.cu: kNT = 1, the query heads of one token) and the few-row kernel's
// (ragged_few_rows.cu: kNT = 1 or 2, the query rows of a few tokens, speculative decoding).
//
// Per chunk, on the tensor cores (mma.sync m16n8k16, fp16 in, float32 accumulate):
//   S^T = K Q^T   positions in M (16 per tile), head dims in K, query rows in N (8 per n-tile),
//   O^T += V^T P^T  head dims in M, positions in K, query rows in N.
// Each converted K or V fragment serves every n-tile, so the conversion (most of a chunk's
// instructions) is paid once for up to 16 rows. Numbers as in attention_device.cuh.
#pragma once

#include <cmath>
#include <cstdint>
#include <type_traits>

#include "attention_device.cuh"
#include "page_chunks.cuh"

namespace nvfp4 {
namespace {

constexpr int kChunkWarps = 4;  // warps of a CTA, each with its own chunks and softmax state

// The online-softmax state of one warp: per n-tile t, the query rows 8t + 2q and 8t + 2q + 1
// of this lane (columns of the MMA's N), running max m (log2 units, the same in every lane of a
// column), the lane's part of the running sum l, and the O^T accumulators (m-tile i: rows g and
// g + 8 are head dims lane_dim(g, i) and lane_dim(g, i) + 1, the columns the two rows).
template <int kHead, int kNT>
struct WarpState {
  float m[kNT][2], l[kNT][2];
  float o[Shape<kHead>::kKTiles][kNT][4];
};

template <int kHead, int kNT>
__device__ __forceinline__ void init_state(WarpState<kHead, kNT>& st) {
#pragma unroll
  for (int t = 0; t < kNT; ++t) {
    st.m[t][0] = st.m[t][1] = -INFINITY;
    st.l[t][0] = st.l[t][1] = 0.f;
#pragma unroll
    for (int i = 0; i < Shape<kHead>::kKTiles; ++i)
#pragma unroll
      for (int r = 0; r < 4; ++r) st.o[i][t][r] = 0.f;
  }
}

// Head dim of row g of m-tile i (row g + 8 is the next dim): lane g holds dims
// 2*(D/16)*g .. +2*(D/16)-1, two per m-tile.
template <int kHead>
__device__ __forceinline__ int lane_dim(int g, int i) {
  return 2 * (kHead / 16) * g + 2 * i;
}

// One n-tile's q as a lane reads it: lane (g, q) holds the row whose elements start at q_at
// (column g; zeros where !valid), dims q*D/4 .. +D/4, as floats. A step of its own so that a
// kernel can issue these loads before it waits for anything else (decode_cuda.cu).
template <int kHead>
struct LaneQ {
  float v[kHead / 4];
};

template <int kHead>
__device__ __forceinline__ LaneQ<kHead> load_lane_q(const void* q, QType q_type, int64_t q_at,
                                                    bool valid, int lane) {
  constexpr int kDims = kHead / 4;
  const int qd = lane & 3;
  LaneQ<kHead> x;
#pragma unroll
  for (int i = 0; i < kDims; i += 8) {
    if (valid) {
      load_q8(q, q_type, q_at + qd * kDims + i, *reinterpret_cast<float(*)[8]>(x.v + i));
    } else {
#pragma unroll
      for (int k = 0; k < 8; ++k) x.v[i + k] = 0.f;
    }
  }
  return x;
}

// The lane's q scaled by 2^e into fp16 (e from the row's amax) and laid out as the B fragments
// of S^T = K Q^T (k-step 2w + e: dims 8w + e + {0, 4} and {2, 6}, the order of the K
// fragments). score_scale gets the scales of the lane's columns 2q and 2q + 1:
// k_scale * sm_scale * log2(e) * 2^(7 - e_row).
template <int kHead>
__device__ __forceinline__ void q_fragments(const LaneQ<kHead>& x, float k_times_sm_scale,
                                            int lane, uint32_t (&qf)[Shape<kHead>::kKTiles][2],
                                            float (&score_scale)[2]) {
  constexpr int kDims = kHead / 4;
  const int qd = lane & 3;
  const float* qv = x.v;
  float amax = 0.f;
#pragma unroll
  for (int i = 0; i < kDims; ++i) amax = fmaxf(amax, fabsf(qv[i]));
  amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, 1));
  amax = fmaxf(amax, __shfl_xor_sync(0xFFFFFFFFu, amax, 2));
  const int exponent = q_exponent(amax);
  const PowerOfTwo times(exponent);
#pragma unroll
  for (int w = 0; w < kDims / 8; ++w)
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const float* v = qv + 8 * w + e;
      qf[2 * w + e][0] = pack_f16x2(times(v[0]), times(v[4]));
      qf[2 * w + e][1] = pack_f16x2(times(v[2]), times(v[6]));
    }
  const float mine = ldexpf(k_times_sm_scale * kLog2e, 7 - exponent);
  score_scale[0] = __shfl_sync(0xFFFFFFFFu, mine, 8 * qd);      // column 2q: lane 4 * (2q)
  score_scale[1] = __shfl_sync(0xFFFFFFFFu, mine, 8 * qd + 4);  // column 2q + 1
}

// Both steps at once.
template <int kHead>
__device__ __forceinline__ void q_fragments(const void* q, QType q_type, int64_t q_at, bool valid,
                                            float k_times_sm_scale, int lane,
                                            uint32_t (&qf)[Shape<kHead>::kKTiles][2],
                                            float (&score_scale)[2]) {
  q_fragments<kHead>(load_lane_q<kHead>(q, q_type, q_at, valid, lane), k_times_sm_scale, lane,
                     qf, score_scale);
}

// q's B fragments, kept in registers through a warp's loop (in shared memory instead, the
// few-row kernel still spilled at 3 CTAs/SM and ran 1.33x slower: benchmarks/NOTES.md, v5),
// read as the words of k-steps 2w and 2w + 1 of n-tile t.
template <int kHead, int kNT>
struct RegisterQ {
  uint32_t f[kNT][Shape<kHead>::kKTiles][2];
  __device__ __forceinline__ uint4 words(int t, int w) const {
    return make_uint4(f[t][2 * w][0], f[t][2 * w][1], f[t][2 * w + 1][0], f[t][2 * w + 1][1]);
  }
};

// S^T = K Q^T for a chunk: s[tile][t][r] is the score (log2 units) of position 16 tile + g
// (r = 0, 1) or + 8 (r = 2, 3) with row 8t + 2q (r even) or 8t + 2q + 1 (r odd).
template <int kHead, int kNT, typename QFragments>
__device__ __forceinline__ void chunk_scores(const Chunk<kHead>& c, const QFragments& qf,
                                             const float (&score_scale)[kNT][2],
                                             float (&s)[Shape<kHead>::kTiles][kNT][4]) {
  using S = Shape<kHead>;
  // Two accumulator chains per n-tile where one n-tile alone would wait on its MMAs. With two
  // n-tiles (the few-row kernel) two chains each also fit (245 registers either way, no
  // spills) but measured within noise of one (H200, spec 32x4: 175.6 against 181.6 us, spread
  // 4.9%: benchmarks/NOTES.md): -DNVFP4_TWO_N_TILE_CHAINS=2 in CMAKE_CUDA_FLAGS builds it.
#ifndef NVFP4_TWO_N_TILE_CHAINS
#define NVFP4_TWO_N_TILE_CHAINS 1
#endif
  constexpr int kChains = kNT == 1 ? 2 : NVFP4_TWO_N_TILE_CHAINS;
#pragma unroll
  for (int tile = 0; tile < S::kTiles; ++tile) {
    float acc[kNT][kChains][4];
#pragma unroll
    for (int t = 0; t < kNT; ++t)
#pragma unroll
      for (int k = 0; k < kChains; ++k)
#pragma unroll
        for (int r = 0; r < 4; ++r) acc[t][k][r] = 0.f;
    uint32_t scale_words[2][S::kKScaleBytes];
    k_tile_scales<kHead>(c, tile, scale_words);
#pragma unroll
    for (int w = 0; w < S::kKWords; ++w) {
      uint32_t a0[4], a1[4];
      k_word_fragments<kHead>(c, tile, w, scale_words, a0, a1);
#pragma unroll
      for (int t = 0; t < kNT; ++t) {
        const uint4 b = qf.words(t, w);  // k-steps 2w and 2w + 1
        mma_16816(acc[t][0], a0, b.x, b.y);
        mma_16816(acc[t][kChains - 1], a1, b.z, b.w);
      }
    }
#pragma unroll
    for (int t = 0; t < kNT; ++t)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        const float sum = kChains == 2 ? acc[t][0][r] + acc[t][kChains - 1][r] : acc[t][0][r];
        s[tile][t][r] = sum * score_scale[t][r & 1];
      }
  }
}

// The online softmax over a chunk's scores: updates the warp's max, sum and O scale, and
// returns P^T as the B operand of the second MMA (p0: positions 2q, 2q+1; p1: 2q+8, 2q+9).
// Where `masked`, positions at or past a column's limit (limit[t][h]: row 8t + 2q + h) never
// count, whatever they hold.
template <int kHead, int kNT>
__device__ __forceinline__ void chunk_softmax(float (&s)[Shape<kHead>::kTiles][kNT][4],
                                              WarpState<kHead, kNT>& st, uint32_t base,
                                              bool masked, const uint32_t (&limit)[kNT][2],
                                              int lane,
                                              uint32_t (&p0)[kNT][Shape<kHead>::kTiles],
                                              uint32_t (&p1)[kNT][Shape<kHead>::kTiles]) {
  using S = Shape<kHead>;
  const int g = lane >> 2;
  if (masked) {
#pragma unroll
    for (int tile = 0; tile < S::kTiles; ++tile)
#pragma unroll
      for (int t = 0; t < kNT; ++t)
#pragma unroll
        for (int r = 0; r < 4; ++r) {
          const uint32_t pos = base + 16 * tile + g + 8 * (r >> 1);
          if (pos >= limit[t][r & 1]) s[tile][t][r] = -INFINITY;
        }
  }

  bool rescale = false;
  float alpha[kNT][2];
#pragma unroll
  for (int t = 0; t < kNT; ++t) {
    float top[2] = {st.m[t][0], st.m[t][1]};
#pragma unroll
    for (int tile = 0; tile < S::kTiles; ++tile)
#pragma unroll
      for (int r = 0; r < 4; ++r) top[r & 1] = fmaxf(top[r & 1], s[tile][t][r]);
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int delta = 4; delta < 32; delta *= 2)
        top[h] = fmaxf(top[h], __shfl_xor_sync(0xFFFFFFFFu, top[h], delta));
    float offset[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      offset[h] = top[h] == -INFINITY ? 0.f : top[h];  // nothing seen yet: no -inf - -inf
      alpha[t][h] = exp2_approx(st.m[t][h] - offset[h]);
      st.m[t][h] = top[h];
      st.l[t][h] *= alpha[t][h];
      rescale |= alpha[t][h] != 1.f;
    }
    float p[S::kTiles][4];
#pragma unroll
    for (int tile = 0; tile < S::kTiles; ++tile)
#pragma unroll
      for (int r = 0; r < 4; ++r) {
        p[tile][r] = exp2_approx(s[tile][t][r] - offset[r & 1]);
        st.l[t][r & 1] += p[tile][r];
      }
#pragma unroll
    for (int tile = 0; tile < S::kTiles; ++tile) {
      // P^T as the B operand: column (row) g, positions 2q, 2q+1 and 2q+8, 2q+9.
      p0[t][tile] = transpose_8x8(pack_f16x2(p[tile][0], p[tile][1]));
      p1[t][tile] = transpose_8x8(pack_f16x2(p[tile][2], p[tile][3]));
    }
  }
  // The running max changes in the first chunks and rarely after: rescale only then.
  if (__any_sync(0xFFFFFFFFu, rescale)) {
#pragma unroll
    for (int i = 0; i < S::kKTiles; ++i)
#pragma unroll
      for (int t = 0; t < kNT; ++t)
#pragma unroll
        for (int r = 0; r < 4; ++r) st.o[i][t][r] *= alpha[t][r & 1];
  }
}

// O^T += V^T P^T for a chunk.
template <int kHead, int kNT>
__device__ __forceinline__ void chunk_accumulate(const Chunk<kHead>& c, WarpState<kHead, kNT>& st,
                                                 const uint32_t (&p0)[kNT][Shape<kHead>::kTiles],
                                                 const uint32_t (&p1)[kNT][Shape<kHead>::kTiles]) {
  using S = Shape<kHead>;
#pragma unroll
  for (int tile = 0; tile < S::kTiles; ++tile) {
    uint32_t scale[2][S::kVBlocks];
#pragma unroll
    for (int half = 0; half < 2; ++half)
#pragma unroll
      for (int b = 0; b < S::kVBlocks; ++b)
        scale[half][b] = e4m3x2_to_f16x2_x128(c.v_scale[2 * tile + half][b]);
#pragma unroll
    for (int w = 0; w < S::kVWords; ++w) {
      // Each register pairs one head dim of positions (2q, 2q+1) (half 0) or (2q+8, 2q+9).
      uint32_t x[2][2][4];  // [position pair][bytes 0-1 | 2-3][register]
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        const uint32_t wa = c.v[2 * tile + half][0][w], wb = c.v[2 * tile + half][1][w];
        e2m1x8_to_f16x2(prmt(wa, wb, 0x5410), x[half][0]);
        e2m1x8_to_f16x2(prmt(wa, wb, 0x7632), x[half][1]);
#pragma unroll
        for (int k = 0; k < 2; ++k)
#pragma unroll
          for (int r = 0; r < 4; ++r) x[half][k][r] = hmul2(x[half][k][r], scale[half][w / 2]);
      }
      // m-tile 4w + 2k + j: rows g, g+8 = lane dims 8w + 4k + 2j, +1 (see lane_dim).
#pragma unroll
      for (int k = 0; k < 2; ++k)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
          const uint32_t a[4] = {x[0][k][j], x[0][k][j + 2], x[1][k][j], x[1][k][j + 2]};
#pragma unroll
          for (int t = 0; t < kNT; ++t)
            mma_16816(st.o[4 * w + 2 * k + j][t], a, p0[t][tile], p1[t][tile]);
        }
    }
  }
}

// The block-table entries of warp w's first chunk (positions begin + 32 w ..), for positions
// below `end`: attend_chunks' `first`. A kernel may read them before it knows the sequence's
// length, with `end` a bound on it (entries past the length are read, never used).
template <int kHead, Layout kLayout>
__device__ __forceinline__ TilePages<Shape<kHead>::kTiles> first_chunk_pages(
    const PageView<kLayout>& pv, uint32_t begin, uint32_t end, int warp) {
  return fetch_pages<Shape<kHead>::kTiles>(pv, begin + uint32_t(warp * Shape<kHead>::kChunk),
                                           end);
}

// The lanes' shares of l -> each column's (the end of a chunk loop).
template <int kHead, int kNT>
__device__ __forceinline__ void column_sums(WarpState<kHead, kNT>& st) {
#pragma unroll
  for (int t = 0; t < kNT; ++t)
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int delta = 4; delta < 32; delta *= 2)
        st.l[t][h] += __shfl_xor_sync(0xFFFFFFFFu, st.l[t][h], delta);
}

// One chunk's attention, from the chunk's registers (c: K before the scores, V before the
// values) into the warp's state: S^T, the online softmax, O^T += V^T P^T. after_scores runs
// once c's K has been used, after_values once its V has (the loops refill c or its slot
// there); `masked`: the chunk reaches past mask_from.
template <int kHead, int kNT, typename QFragments, typename AfterScores, typename AfterValues>
__device__ __forceinline__ void attend_chunk(const Chunk<kHead>& c, const QFragments& qf,
                                             const float (&score_scale)[kNT][2],
                                             const uint32_t (&limit)[kNT][2], uint32_t base,
                                             bool masked, int lane, WarpState<kHead, kNT>& st,
                                             AfterScores&& after_scores,
                                             AfterValues&& after_values) {
  using S = Shape<kHead>;
  float s[S::kTiles][kNT][4];
  chunk_scores<kHead, kNT>(c, qf, score_scale, s);
  after_scores();
  uint32_t p0[kNT][S::kTiles], p1[kNT][S::kTiles];
  chunk_softmax<kHead, kNT>(s, st, base, masked, limit, lane, p0, p1);
  chunk_accumulate<kHead, kNT>(c, st, p0, p1);
  after_values();
}

// The chunk loop of one warp over positions [begin, end): warp w takes chunks w, w + 4, ...
// One set of chunk registers: the next chunk's K is loaded as soon as this chunk's scores are
// computed, its V once this chunk's values are accumulated; block-table entries are read a
// chunk ahead of that (the first chunk's, `first`, from first_chunk_pages). `mask_from`: chunks
// reaching past it are masked by the columns' limits (positions past `end` are never loaded:
// zeros).
template <int kHead, bool kSwizzle, Layout kLayout, int kNT, typename QFragments>
__device__ __forceinline__ void attend_chunks(const PageView<kLayout>& pv, uint32_t begin,
                                              uint32_t end, uint32_t mask_from,
                                              const uint32_t (&limit)[kNT][2],
                                              const QFragments& qf,
                                              const float (&score_scale)[kNT][2], int warp,
                                              int lane,
                                              const TilePages<Shape<kHead>::kTiles>& first,
                                              WarpState<kHead, kNT>& st) {
  using S = Shape<kHead>;
  const int num_chunks = int((end - begin + S::kChunk - 1) / S::kChunk);
  const auto chunk_base = [&](int chunk) { return begin + uint32_t(chunk * S::kChunk); };
  Chunk<kHead> c;
  int chunk = warp;
  TilePages<S::kTiles> pages = first;
  if (chunk < num_chunks) {
    load_chunk<Part::kK, kHead, kSwizzle>(c, pv, pages, chunk_base(chunk), end, lane);
    load_chunk<Part::kV, kHead, kSwizzle>(c, pv, pages, chunk_base(chunk), end, lane);
  }
  pages = fetch_pages<S::kTiles>(pv, chunk_base(chunk + kChunkWarps), end);
#pragma unroll 1
  for (; chunk < num_chunks; chunk += kChunkWarps) {
    const TilePages<S::kTiles> later =
        fetch_pages<S::kTiles>(pv, chunk_base(chunk + 2 * kChunkWarps), end);
    const uint32_t base = chunk_base(chunk), next = chunk_base(chunk + kChunkWarps);
    const bool has_next = chunk + kChunkWarps < num_chunks;
    attend_chunk<kHead, kNT>(
        c, qf, score_scale, limit, base, base + S::kChunk > mask_from, lane, st,
        [&] {
          if (has_next) load_chunk<Part::kK, kHead, kSwizzle>(c, pv, pages, next, end, lane);
        },
        [&] {
          if (has_next) load_chunk<Part::kV, kHead, kSwizzle>(c, pv, pages, next, end, lane);
        });
    pages = later;
  }
  column_sums(st);
}

// Shared memory a CTA's attend_chunks_staged takes (`ring`): kSlots slots per warp.
template <int kHead, int kSlots>
constexpr int kStagedBytes = kChunkWarps * kSlots * StagedSlot<kHead>::kBytes;

// Decode v8 (NVFP4_DECODE_STAGED): the same loop with the chunks' bytes staged through shared
// memory, kSlots of a warp's chunks in flight where attend_chunks has one. Each lane copies
// its own fields (cp.async, StagedFetch) into its warp's slot of the chunk, waits for its own
// copies (cp.async.wait_group) and reads them back (read_staged_chunk): no barrier, and no
// registers held by the loads in flight, so the depth costs shared memory only (StagedSlot).
// A slot's K fields are copied over once this chunk's scores are computed, its V fields once
// its values are accumulated. Every copy is waited for before it returns.
template <int kSlots, int kHead, bool kSwizzle, Layout kLayout, int kNT, typename QFragments>
__device__ __forceinline__ void attend_chunks_staged(
    const PageView<kLayout>& pv, uint32_t begin, uint32_t end, uint32_t mask_from,
    const uint32_t (&limit)[kNT][2], const QFragments& qf, const float (&score_scale)[kNT][2],
    int warp, int lane, const TilePages<Shape<kHead>::kTiles>& first, uint8_t* ring,
    WarpState<kHead, kNT>& st) {
  using S = Shape<kHead>;
  using Slot = StagedSlot<kHead>;
  static_assert(kSlots >= 2, "a chunk read while the next lands");
  const int num_chunks = int((end - begin + S::kChunk - 1) / S::kChunk);
  // This warp's k-th chunk is chunk warp + kChunkWarps k of the range.
  const int my_chunks =
      num_chunks > warp ? (num_chunks - warp + kChunkWarps - 1) / kChunkWarps : 0;
  const auto my_chunk_base = [&](int k) {
    return begin + uint32_t((warp + k * kChunkWarps) * S::kChunk);
  };
  uint8_t* const my_ring = ring + warp * kSlots * Slot::kBytes;
  const auto stage = [&](int k, const TilePages<S::kTiles>& pages, auto part) {
    const StagedFetch<kHead, kSwizzle> f{my_ring + (k % kSlots) * Slot::kBytes, lane};
    fetch_chunk<decltype(part)::value, kHead, kSwizzle>(f, pv, pages, my_chunk_base(k), end,
                                                        lane);
  };
  using K = std::integral_constant<Part, Part::kK>;
  using V = std::integral_constant<Part, Part::kV>;
  // The first kSlots chunks' bytes, one copy group per chunk (empty past the last: the wait
  // counts groups), each chunk's block-table entries read a chunk before its copies (a loop:
  // each copy of fetch_chunk is large). The last step reads no entries (`later` only keeps
  // `after`): chunk kSlots + 1's are the main loop's first read.
  TilePages<S::kTiles> ahead = first, after = fetch_pages<S::kTiles>(pv, my_chunk_base(1), end);
#pragma unroll 1
  for (int k = 0; k < kSlots; ++k) {
    const TilePages<S::kTiles> later =
        k + 2 <= kSlots ? fetch_pages<S::kTiles>(pv, my_chunk_base(k + 2), end) : after;
    if (k < my_chunks) {
      stage(k, ahead, K{});
      stage(k, ahead, V{});
    }
    copy_async_commit();
    ahead = after;
    after = later;
  }
  // Now `ahead` is chunk kSlots's, staged in step 0.
  Chunk<kHead> c;
#pragma unroll 1
  for (int k = 0; k < my_chunks; ++k) {
    const TilePages<S::kTiles> later =
        fetch_pages<S::kTiles>(pv, my_chunk_base(k + kSlots + 1), end);
    const uint32_t base = my_chunk_base(k);
    const uint8_t* const slot = my_ring + (k % kSlots) * Slot::kBytes;
    const bool refill = k + kSlots < my_chunks;
    copy_async_wait<kSlots - 1>();  // this lane's copies of chunk k have landed
    read_staged_chunk<Part::kK, kHead, kSwizzle>(c, slot, base, end, lane);
    attend_chunk<kHead, kNT>(
        c, qf, score_scale, limit, base, base + S::kChunk > mask_from, lane, st,
        [&] {
          read_staged_chunk<Part::kV, kHead, kSwizzle>(c, slot, base, end, lane);
          // The compiler keeps the slot's reads before the copies into it below (the
          // barrier). That the reads have returned before a copy lands is not a PTX guarantee:
          // it rests on the copy landing a memory round trip after it is issued (and, in the
          // SASS, on the copies' registers reusing the reads' destinations).
          asm volatile("" ::: "memory");
          if (refill) stage(k + kSlots, ahead, K{});
        },
        [&] {
          if (refill) stage(k + kSlots, ahead, V{});
        });
    copy_async_commit();
    ahead = later;
  }
  copy_async_wait<0>();
  column_sums(st);
}

// The warps' merge keeps a row of O in shared memory kMergeRowFloats apart, with 2 floats of
// padding after each lane column's kHead / 8 dims (merge_dim): a warp's 8-byte stores of one
// (n-tile, k-tile, row half) then fall on 16 distinct bank pairs per half warp. Unpadded
// (row stride kHead, a lane column every 2 kHead / 16 floats) its 32 lanes hit 2 banks: a
// 16-way conflict on every store (decode v12, benchmarks/NOTES.md). The row stride is
// kHead + 16 of padded dims + 4: 4 mod 16, so the 4 lanes of a column group (qd) land 4 bank
// pairs apart.
template <int kHead>
constexpr int kMergeRowFloats = kHead + 20;

// Where head dim d of a row lies in the merge's row (the padding above).
template <int kHead>
__device__ __forceinline__ int merge_dim(int d) {
  return d + 2 * (d / (kHead / 8));
}

// Shared memory (floats) the warps' merge takes for kRows rows.
template <int kHead, int kRows>
constexpr int kMergeFloats = kChunkWarps * kRows * (2 + kMergeRowFloats<kHead>);

// Dynamic shared memory of a CTA whose warps run attend_chunks_staged with kSlots slots each,
// then merge_warps over kRows rows in the same bytes (after a barrier): the larger of the two.
// 0 for kSlots = 0 (attend_chunks: the loads into registers).
template <int kHead, int kSlots, int kRows>
constexpr int kStagedSmem =
    kSlots == 0 ? 0
                : (kStagedBytes<kHead, kSlots> >= 4 * kMergeFloats<kHead, kRows>
                       ? kStagedBytes<kHead, kSlots>
                       : 4 * kMergeFloats<kHead, kRows>);

// Merges the warps' states: each writes its state to `smem` (kMergeFloats<kHead, 8 kNT> floats),
// then for each of the first `rows` rows and each head dim one thread combines the warps
// (weights 2^(m_w - max)) and calls emit(row, dim, value, lse2): value = the row's output
// over its sum (0/0 = NaN where no position counted), lse2 its log2 lse (-inf then).
template <int kHead, int kNT, typename Emit>
__device__ __forceinline__ void merge_warps(const WarpState<kHead, kNT>& st, float* smem,
                                            int rows, int warp, int lane, Emit&& emit) {
  constexpr int kRows = 8 * kNT;
  float* shared_m = smem;                             // [warp][row]
  float* shared_l = shared_m + kChunkWarps * kRows;   // [warp][row]
  float* shared_o = shared_l + kChunkWarps * kRows;   // [warp][row][dim]
  const int g = lane >> 2, qd = lane & 3;
#pragma unroll
  for (int t = 0; t < kNT; ++t) {
    if (g == 0) {
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        shared_m[warp * kRows + 8 * t + 2 * qd + h] = st.m[t][h];
        shared_l[warp * kRows + 8 * t + 2 * qd + h] = st.l[t][h];
      }
    }
#pragma unroll
    for (int i = 0; i < Shape<kHead>::kKTiles; ++i) {
      // dims lane_dim and lane_dim + 1 of a row are adjacent (merge_dim pads between lane
      // columns only): one 8-byte store per row half.
      const int dim = merge_dim<kHead>(lane_dim<kHead>(g, i));
#pragma unroll
      for (int h = 0; h < 2; ++h)
        *reinterpret_cast<float2*>(
            &shared_o[(warp * kRows + 8 * t + 2 * qd + h) * kMergeRowFloats<kHead> + dim]) =
            make_float2(st.o[i][t][h], st.o[i][t][h + 2]);
    }
  }
  __syncthreads();

  // Up to kCombineUnroll of a thread's (row, dim) values at a time: their shared-memory reads,
  // exponentials and divisions are independent, so they overlap where a loop of one at a time
  // waits for each in turn (decode v13: the merge was a latency chain at one warp a scheduler).
  constexpr int kCombineUnroll = 4;
  constexpr int kStride = kChunkWarps * 32;
#pragma unroll 1
  for (int base = threadIdx.x; base < rows * kHead; base += kCombineUnroll * kStride) {
#pragma unroll
    for (int u = 0; u < kCombineUnroll; ++u) {
      const int i = base + u * kStride;
      if (i >= rows * kHead) break;
      const int row = i / kHead, d = i % kHead;
      float top = -INFINITY;
#pragma unroll
      for (int w = 0; w < kChunkWarps; ++w) top = fmaxf(top, shared_m[w * kRows + row]);
      const float offset = top == -INFINITY ? 0.f : top;
      float sum = 0.f, acc = 0.f;
#pragma unroll
      for (int w = 0; w < kChunkWarps; ++w) {
        const float weight = exp2_approx(shared_m[w * kRows + row] - offset);
        sum += weight * shared_l[w * kRows + row];
        acc += weight * shared_o[(w * kRows + row) * kMergeRowFloats<kHead> + merge_dim<kHead>(d)];
      }
      emit(row, d, acc / sum, offset + __log2f(sum));
    }
  }
}

}  // namespace
}  // namespace nvfp4
