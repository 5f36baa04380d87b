// A warp's chunk of positions read from the NVFP4 pages straight into registers, laid out for
// the MMA fragments that convert them (the decode kernel's loads, decode_cuda.cu; also those of
// the few-row kernel of ragged attention, ragged_few_rows.cu): per lane the K code words of
// positions g + 8i and the V code words of position pairs 2q + 8i (+1), i < 2 * kTiles
// (g = lane / 4, q = lane % 4), with their E4M3 scales. Positions past `end` are zeros, never
// loads; one block-table entry per 16-position tile where tiles do not cross pages.
#pragma once

#include <cstdint>

#include "attention_device.cuh"

namespace nvfp4 {
namespace {

// ------------------------------------------------------------------------------------------
// Shapes derived from the head size.

template <int kHead>
struct Shape {
  static constexpr int kKTiles = kHead / 16;        // MMA k-steps of S (= m-tiles of O)
  static constexpr int kScales = kHead / 16;        // E4M3 scales per (head, token)
  static constexpr int kKWords = kHead / 32;        // K code words a lane loads per token
  static constexpr int kKScaleBytes = kHead / 64;   // its K scales (contiguous, linear)
  static constexpr int kVWords = kHead / 64;        // V code words a lane loads per token
  static constexpr int kVBlocks = kHead >= 256 ? kHead / 128 : 1;  // V scale blocks a lane needs
  static constexpr int kTiles = kHead >= 256 ? 1 : 2;  // 16-token tiles per chunk
  static constexpr int kChunk = 16 * kTiles;
};

// Which half of a chunk's bytes a load fetches: K is loaded as soon as the previous chunk's
// scores are computed, V once its values are accumulated, so one set of registers serves
// (the loads of chunk c+1 overlap the rest of chunk c's arithmetic).
enum class Part { kK, kV };

// The positions a lane loads in a chunk: K of tokens g + 8i, V of token pairs 2q + 8i (+1),
// i < 2 * kTiles (g = lane / 4, q = lane % 4), with their scales.
template <int kHead>
struct Chunk {
  using S = Shape<kHead>;
  uint32_t k[2 * S::kTiles][S::kKWords];
  uint32_t k_scale[2 * S::kTiles];
  uint32_t v[2 * S::kTiles][2][S::kVWords];
  uint32_t v_scale[2 * S::kTiles][S::kVBlocks];  // low byte: token 2q + 8i; next: its pair
};


// The block-table entries of a chunk's tiles when tiles do not cross pages, read one step
// before the chunk's bytes are (their latency then never stalls the data loads).
template <int kTiles>
struct TilePages {
  int32_t page[kTiles];
  uint32_t row[kTiles];  // row of the tile's first position in its page
};

template <int kTiles, Layout kLayout>
__device__ __forceinline__ TilePages<kTiles> fetch_pages(const PageView<kLayout>& pv, uint32_t base,
                                                         uint32_t end) {
  TilePages<kTiles> t;
#pragma unroll
  for (int tile = 0; tile < kTiles; ++tile) {
    t.page[tile] = 0;
    t.row[tile] = 0;
    const uint32_t pos = base + 16 * tile;
    if (pv.tile_in_page && pos < end)
      t.page[tile] = __ldg(pv.table + pv.block_size.divmod(pos, &t.row[tile]));
  }
  return t;
}

// The V scale bytes of positions (row, row + 1) of one scale block s: swizzled, the pair is
// adjacent (row 4(row/4) + s/G, column (s%G)*4 + row%4, row even); linear, two bytes.
template <int kHead, bool kSwizzle, Layout kLayout>
__device__ __forceinline__ uint32_t load_v_scales(const PageView<kLayout>& pv,
                                                  const uint8_t* side, uint32_t row, int s,
                                                  bool second) {
  constexpr int kScales = Shape<kHead>::kScales;
  const uint8_t* region = side + pv.side_data;
  if constexpr (kSwizzle) {
    const uint32_t bytes = load_small<2>(region + pv.template swizzled_scale_offset<kScales>(row, s));
    return second ? bytes : (bytes & 0xFFu);
  } else {
    uint32_t bytes = load_small<1>(region + pv.template linear_scale_offset<kScales>(row, s));
    if (second)
      bytes |= load_small<1>(region + pv.template linear_scale_offset<kScales>(row + 1, s)) << 8;
    return bytes;
  }
}

// A chunk whose positions are all valid and whose tiles each lie in one page (the common
// case): no per-position checks, one block-table entry per tile, and per tile one 64-bit
// address per region; the other positions are constant offsets from it (HND).
template <Part kPart, int kHead, bool kSwizzle, Layout kLayout>
__device__ __forceinline__ void load_chunk_full(Chunk<kHead>& c, const PageView<kLayout>& pv,
                                                const TilePages<Shape<kHead>::kTiles>& pages,
                                                int lane) {
  using S = Shape<kHead>;
  const int g = lane >> 2, qd = lane & 3;
  // Plane rows between a position and the next one.
  const uint32_t step = kLayout == Layout::kHND ? 1u : uint32_t(pv.num_kv_heads);
#pragma unroll
  for (int tile = 0; tile < S::kTiles; ++tile) {
    const uint8_t* page = pv.cache + pv.page_offset(pages.page[tile]);
    const uint32_t k_row = uint32_t(pv.plane_row(pages.row[tile] + g));
    const uint32_t v_pos = pages.row[tile] + 2 * qd;
    const uint32_t v_row = uint32_t(pv.plane_row(v_pos));
    const uint8_t* k_data = page + (k_row * (kHead / 2) + qd * (kHead / 8));
    const uint8_t* k_scale = page + (uint32_t(pv.side_data) + k_row * S::kScales +
                                     qd * S::kKScaleBytes);
    const uint8_t* v_side = page + uint32_t(pv.side_bytes);
    const uint8_t* v_data = v_side + (v_row * (kHead / 2) + g * (kHead / 16));
    const uint8_t* v_scales = v_side + uint32_t(pv.side_data);
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const int i = 2 * tile + half;
      const uint32_t rows8 = 8 * half * step;  // plane rows of 8 positions
      if constexpr (kPart == Part::kK) {
        load_words<kHead / 8>(k_data + rows8 * (kHead / 2), c.k[i]);
        c.k_scale[i] = load_small<S::kKScaleBytes>(k_scale + rows8 * S::kScales);
        continue;
      }
      load_words<kHead / 16>(v_data + rows8 * (kHead / 2), c.v[i][0]);
      load_words<kHead / 16>(v_data + (rows8 + step) * (kHead / 2), c.v[i][1]);
#pragma unroll
      for (int b = 0; b < S::kVBlocks; ++b) {
        const int s = (kHead / 16) * g / 8 + b;
        if constexpr (kSwizzle) {
          constexpr int kGroup = S::kScales / 4;
          const uint32_t srow = uint32_t(pv.plane_row((v_pos & ~3u) + s / kGroup));
          c.v_scale[i][b] = load_small<2>(v_scales + ((srow + rows8) * S::kScales +
                                                      (s % kGroup) * 4 + (v_pos & 3u)));
        } else {
          const uint8_t* at = v_scales + ((v_row + rows8) * S::kScales + s);
          c.v_scale[i][b] = load_small<1>(at) | (load_small<1>(at + step * S::kScales) << 8);
        }
      }
    }
  }
}

// Any chunk: positions past `end` are not read (their K and V scales are zero: V adds
// nothing, K's scores are masked), pages are looked up per position where tiles may cross
// pages.
template <Part kPart, int kHead, bool kSwizzle, Layout kLayout>
__device__ __forceinline__ void load_chunk_checked(Chunk<kHead>& c, const PageView<kLayout>& pv,
                                                   const TilePages<Shape<kHead>::kTiles>& pages,
                                                   uint32_t base, uint32_t end, int lane) {
  using S = Shape<kHead>;
  const int g = lane >> 2, qd = lane & 3;
  int64_t tile_page[S::kTiles];
#pragma unroll
  for (int tile = 0; tile < S::kTiles; ++tile) tile_page[tile] = pv.page_offset(pages.page[tile]);
#pragma unroll
  for (int i = 0; i < 2 * S::kTiles && kPart == Part::kK; ++i) {
    const uint32_t pos = base + g + 8 * i;
#pragma unroll
    for (int w = 0; w < S::kKWords; ++w) c.k[i][w] = 0;
    c.k_scale[i] = 0;
    if (pos < end) {
      uint32_t row = pages.row[i / 2] + g + 8 * (i % 2);
      const int64_t page = pv.tile_in_page ? tile_page[i / 2] : pv.locate(pos, &row);
      const uint8_t* side = pv.cache + page;
      const int32_t prow = pv.plane_row(row);
      load_words<kHead / 8>(side + prow * (kHead / 2) + qd * (kHead / 8), c.k[i]);
      c.k_scale[i] = load_small<S::kKScaleBytes>(side + pv.side_data + prow * S::kScales +
                                                 qd * S::kKScaleBytes);
    }
  }
#pragma unroll
  for (int i = 0; i < 2 * S::kTiles && kPart == Part::kV; ++i) {
    const uint32_t pos = base + 2 * qd + 8 * i;  // even: pos and pos + 1 share a page
#pragma unroll
    for (int t = 0; t < 2; ++t)
#pragma unroll
      for (int w = 0; w < S::kVWords; ++w) c.v[i][t][w] = 0;
#pragma unroll
    for (int b = 0; b < S::kVBlocks; ++b) c.v_scale[i][b] = 0;
    if (pos < end) {
      const bool second = pos + 1 < end;
      uint32_t row = pages.row[i / 2] + 2 * qd + 8 * (i % 2);
      const int64_t page = pv.tile_in_page ? tile_page[i / 2] : pv.locate(pos, &row);
      const uint8_t* side = pv.cache + page + pv.side_bytes;
      const int32_t prow = pv.plane_row(row), prow1 = pv.plane_row(row + 1);
      load_words<kHead / 16>(side + prow * (kHead / 2) + g * (kHead / 16), c.v[i][0]);
      if (second)
        load_words<kHead / 16>(side + prow1 * (kHead / 2) + g * (kHead / 16), c.v[i][1]);
#pragma unroll
      for (int b = 0; b < S::kVBlocks; ++b)
        c.v_scale[i][b] = load_v_scales<kHead, kSwizzle>(pv, side, row,
                                                         (kHead / 16) * g / 8 + b, second);
    }
  }
}

template <Part kPart, int kHead, bool kSwizzle, Layout kLayout>
__device__ __forceinline__ void load_chunk(Chunk<kHead>& c, const PageView<kLayout>& pv,
                                           const TilePages<Shape<kHead>::kTiles>& pages,
                                           uint32_t base, uint32_t end, int lane) {
  if (pv.tile_in_page && base + Shape<kHead>::kChunk <= end)
    load_chunk_full<kPart, kHead, kSwizzle>(c, pv, pages, lane);
  else
    load_chunk_checked<kPart, kHead, kSwizzle>(c, pv, pages, base, end, lane);
}

// K of a chunk's 16-position tile as the A fragments of S^T = K Q^T (positions in M, head
// dims in K): first the tile's block scales as f16x2 words (rows g and g + 8), then per code
// word w the fragments of k-steps 2w (a0) and 2w + 1 (a1), exact (codes times scales in fp16).
// The lane's head dims come in the order e2m1x8_to_f16x2 gives; q's B fragments must follow it.
template <int kHead>
__device__ __forceinline__ void k_tile_scales(const Chunk<kHead>& c, int tile,
                                              uint32_t (&scale_words)[2][Shape<kHead>::kKScaleBytes]) {
  using S = Shape<kHead>;
#pragma unroll
  for (int t = 0; t < 2; ++t) {
    const uint32_t bytes = c.k_scale[2 * tile + t];
#pragma unroll
    for (int b = 0; b < S::kKScaleBytes; b += 2) {
      const uint32_t pair = e4m3x2_to_f16x2_x128(bytes >> (8 * b));
      scale_words[t][b] = prmt(pair, pair, 0x1010);
      if (b + 1 < S::kKScaleBytes) scale_words[t][b + 1] = prmt(pair, pair, 0x3232);
    }
  }
}

template <int kHead>
__device__ __forceinline__ void k_word_fragments(
    const Chunk<kHead>& c, int tile, int w,
    const uint32_t (&scale_words)[2][Shape<kHead>::kKScaleBytes], uint32_t (&a0)[4],
    uint32_t (&a1)[4]) {
  uint32_t ra[4], rb[4];  // rows g and g + 8 of the tile
  e2m1x8_to_f16x2(c.k[2 * tile][w], ra);
  e2m1x8_to_f16x2(c.k[2 * tile + 1][w], rb);
#pragma unroll
  for (int r = 0; r < 4; ++r) {
    ra[r] = hmul2(ra[r], scale_words[0][w / 2]);
    rb[r] = hmul2(rb[r], scale_words[1][w / 2]);
  }
  a0[0] = ra[0], a0[1] = rb[0], a0[2] = ra[1], a0[3] = rb[1];
  a1[0] = ra[2], a1[1] = rb[2], a1[2] = ra[3], a1[3] = rb[3];
}

}  // namespace
}  // namespace nvfp4
