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

// The V scale block of lane row g's head dims, b-th of its kVBlocks.
template <int kHead>
__device__ __forceinline__ int v_scale_block(int g, int b) {
  return (kHead / 16) * g / 8 + b;
}

// ------------------------------------------------------------------------------------------
// Where a chunk's bytes go. The loaders below name each field of a lane's share of a chunk
// and where it is in the pages; a fetch policy puts it somewhere:
//   RegisterFetch: straight into a Chunk's registers;
//   StagedFetch (decode v8, NVFP4_DECODE_STAGED): cp.async copies into the lane's fields of a
//   shared-memory slot, read into a Chunk chunks later (read_staged_chunk).
// A field that is not `valid` (its position at or past `end`) is zero, never read. Scale
// fields: K's kKScaleBytes bytes at `at`; V's bytes of positions (p, p + 1) of one block,
// swizzled the two adjacent bytes at `at`, linear one byte at `at` and one at `at_next`; the
// second only where `second` (p + 1 < end).

template <int kHead, bool kSwizzle>
struct RegisterFetch {
  using S = Shape<kHead>;
  Chunk<kHead>& c;

  __device__ __forceinline__ void k_code(int i, const uint8_t* src, bool valid) const {
    if (valid) {
      load_words<kHead / 8>(src, c.k[i]);
    } else {
#pragma unroll
      for (int w = 0; w < S::kKWords; ++w) c.k[i][w] = 0;
    }
  }
  __device__ __forceinline__ void k_scale(int i, const uint8_t* at, bool valid) const {
    c.k_scale[i] = valid ? load_small<S::kKScaleBytes>(at) : 0u;
  }
  __device__ __forceinline__ void v_code(int i, int t, const uint8_t* src, bool valid) const {
    if (valid) {
      load_words<kHead / 16>(src, c.v[i][t]);
    } else {
#pragma unroll
      for (int w = 0; w < S::kVWords; ++w) c.v[i][t][w] = 0;
    }
  }
  __device__ __forceinline__ void v_scale(int i, int b, const uint8_t* at, const uint8_t* at_next,
                                          bool valid, bool second) const {
    uint32_t bytes = 0;
    if (valid) {
      if constexpr (kSwizzle) {
        bytes = load_small<2>(at);
        if (!second) bytes &= 0xFFu;
      } else {
        bytes = load_small<1>(at);
        if (second) bytes |= load_small<1>(at_next) << 8;
      }
    }
    c.v_scale[i][b] = bytes;
  }
};

// A warp's slot of staged chunk bytes: field after field, each [lane][bytes] of at most 16
// bytes a lane (head 256's 32 bytes of K codes as two fields), so that a field's 4-, 8- or
// 16-byte accesses from 32 lanes are conflict-free. Scale fields hold the aligned 4-byte word
// around the lane's bytes (cp.async copies no fewer); V scales two words a pair, one per
// position, used by linear scales only: one size for both layouts, which the occupancy
// queries assume (decode_cuda.cu asks about one instance per head size). The *_at functions
// are the byte offsets of a lane's fields, for the writer (StagedFetch) and the reader
// (read_staged_chunk) alike.
template <int kHead>
struct StagedSlot {
  using S = Shape<kHead>;
  static constexpr int kFields = 2 * S::kTiles;  // i of Chunk
  static constexpr int kKCode = S::kKWords * 4, kVCode = S::kVWords * 4;  // bytes a lane
  static constexpr int kKPiece = kKCode < 16 ? kKCode : 16, kKPieces = kKCode / kKPiece;
  static_assert(kVCode <= 16, "one V code field a lane");
  static constexpr int kKScaleAt = kFields * 32 * kKCode;
  static constexpr int kVCodeAt = kKScaleAt + kFields * 32 * 4;
  static constexpr int kVScaleAt = kVCodeAt + kFields * 2 * 32 * kVCode;
  static constexpr int kBytes = kVScaleAt + kFields * S::kVBlocks * 2 * 32 * 4;

  // Piece h of position i's K codes; its K scale word; its V codes of position t of the pair;
  // the V scale word of block b of position t of the pair.
  __device__ __forceinline__ static int k_code_at(int i, int h, int lane) {
    return ((i * kKPieces + h) * 32 + lane) * kKPiece;
  }
  __device__ __forceinline__ static int k_scale_at(int i, int lane) {
    return kKScaleAt + (i * 32 + lane) * 4;
  }
  __device__ __forceinline__ static int v_code_at(int i, int t, int lane) {
    return kVCodeAt + ((i * 2 + t) * 32 + lane) * kVCode;
  }
  __device__ __forceinline__ static int v_scale_at(int i, int b, int t, int lane) {
    return kVScaleAt + (((i * S::kVBlocks + b) * 2 + t) * 32 + lane) * 4;
  }
};

__device__ __forceinline__ const uint8_t* aligned_word(const uint8_t* at) {
  return reinterpret_cast<const uint8_t*>(reinterpret_cast<uintptr_t>(at) & ~uintptr_t(3));
}

// A field that is not valid is zero-filled, its source not read (the loaders pass a readable
// address for it all the same).
template <int kHead, bool kSwizzle>
struct StagedFetch {
  using Slot = StagedSlot<kHead>;
  uint8_t* slot;
  int lane;

  __device__ __forceinline__ void k_code(int i, const uint8_t* src, bool valid) const {
#pragma unroll
    for (int h = 0; h < Slot::kKPieces; ++h)
      copy_async<Slot::kKPiece>(slot + Slot::k_code_at(i, h, lane), src + h * Slot::kKPiece,
                                valid);
  }
  __device__ __forceinline__ void k_scale(int i, const uint8_t* at, bool valid) const {
    copy_async<4>(slot + Slot::k_scale_at(i, lane), aligned_word(at), valid);
  }
  __device__ __forceinline__ void v_code(int i, int t, const uint8_t* src, bool valid) const {
    copy_async<Slot::kVCode>(slot + Slot::v_code_at(i, t, lane), src, valid);
  }
  __device__ __forceinline__ void v_scale(int i, int b, const uint8_t* at, const uint8_t* at_next,
                                          bool valid, bool second) const {
    copy_async<4>(slot + Slot::v_scale_at(i, b, 0, lane), aligned_word(at), valid);
    if constexpr (!kSwizzle)
      copy_async<4>(slot + Slot::v_scale_at(i, b, 1, lane), aligned_word(at_next),
                    valid && second);
  }
};

// A lane's fields of a staged chunk (StagedSlot) into c: the Part's codes and scales; `base`
// and `end` as when the chunk was staged (which bytes of the scale words are the lane's, and
// whether the second position of a V pair counts).
template <Part kPart, int kHead, bool kSwizzle>
__device__ __forceinline__ void read_staged_chunk(Chunk<kHead>& c, const uint8_t* slot,
                                                  uint32_t base, uint32_t end, int lane) {
  using S = Shape<kHead>;
  using Slot = StagedSlot<kHead>;
  const int g = lane >> 2, qd = lane & 3;
  const auto word = [&](int at) { return *reinterpret_cast<const uint32_t*>(slot + at); };
#pragma unroll
  for (int i = 0; i < Slot::kFields; ++i) {
    if constexpr (kPart == Part::kK) {
#pragma unroll
      for (int h = 0; h < Slot::kKPieces; ++h) {
        const uint8_t* at = slot + Slot::k_code_at(i, h, lane);
        uint32_t* w = c.k[i] + h * (Slot::kKPiece / 4);
        if constexpr (Slot::kKPiece == 16) {
          const uint4 v = *reinterpret_cast<const uint4*>(at);
          w[0] = v.x, w[1] = v.y, w[2] = v.z, w[3] = v.w;
        } else {
          const uint2 v = *reinterpret_cast<const uint2*>(at);
          w[0] = v.x, w[1] = v.y;
        }
      }
      // The lane's scale bytes start at byte (qd * kKScaleBytes) % 4 of their word.
      const uint32_t k_word = word(Slot::k_scale_at(i, lane));
      if constexpr (S::kKScaleBytes == 4)
        c.k_scale[i] = k_word;
      else
        c.k_scale[i] = (k_word >> (8 * ((qd * S::kKScaleBytes) & 3))) &
                       ((1u << (8 * S::kKScaleBytes)) - 1u);
    } else {
#pragma unroll
      for (int t = 0; t < 2; ++t) {
        const uint8_t* at = slot + Slot::v_code_at(i, t, lane);
        if constexpr (S::kVWords == 4) {
          const uint4 v = *reinterpret_cast<const uint4*>(at);
          c.v[i][t][0] = v.x, c.v[i][t][1] = v.y, c.v[i][t][2] = v.z, c.v[i][t][3] = v.w;
        } else if constexpr (S::kVWords == 2) {
          const uint2 v = *reinterpret_cast<const uint2*>(at);
          c.v[i][t][0] = v.x, c.v[i][t][1] = v.y;
        } else {
          c.v[i][t][0] = *reinterpret_cast<const uint32_t*>(at);
        }
      }
      const uint32_t pos = base + 2 * qd + 8 * i;  // even; its page row is pos modulo 4 too
      const bool second = pos + 1 < end;
#pragma unroll
      for (int b = 0; b < S::kVBlocks; ++b) {
        const uint32_t first_word = word(Slot::v_scale_at(i, b, 0, lane));
        if constexpr (kSwizzle) {
          // The pair's two bytes at byte row % 4 (0 or 2) of the word (swizzled_scale_offset).
          c.v_scale[i][b] = (first_word >> (8 * (pos & 3u))) & (second ? 0xFFFFu : 0xFFu);
        } else {
          // Block s's byte at byte s % 4 of each position's word (linear_scale_offset).
          const int shift = 8 * (v_scale_block<kHead>(g, b) & 3);
          c.v_scale[i][b] = ((first_word >> shift) & 0xFFu) |
                            (((word(Slot::v_scale_at(i, b, 1, lane)) >> shift) & 0xFFu) << 8);
        }
      }
    }
  }
}

// A chunk whose positions are all valid and whose tiles each lie in one page (the common
// case): no per-position checks, one block-table entry per tile, and per tile one 64-bit
// address per region; the other positions are constant offsets from it (HND).
template <Part kPart, int kHead, bool kSwizzle, Layout kLayout, typename Fetch>
__device__ __forceinline__ void fetch_chunk_full(const Fetch& f, const PageView<kLayout>& pv,
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
        f.k_code(i, k_data + rows8 * (kHead / 2), true);
        f.k_scale(i, k_scale + rows8 * S::kScales, true);
        continue;
      }
      f.v_code(i, 0, v_data + rows8 * (kHead / 2), true);
      f.v_code(i, 1, v_data + (rows8 + step) * (kHead / 2), true);
#pragma unroll
      for (int b = 0; b < S::kVBlocks; ++b) {
        const int s = v_scale_block<kHead>(g, b);
        if constexpr (kSwizzle) {
          constexpr int kGroup = S::kScales / 4;
          const uint32_t srow = uint32_t(pv.plane_row((v_pos & ~3u) + s / kGroup));
          f.v_scale(
              i, b, v_scales + ((srow + rows8) * S::kScales + (s % kGroup) * 4 + (v_pos & 3u)),
              nullptr, true, true);
        } else {
          const uint8_t* at = v_scales + ((v_row + rows8) * S::kScales + s);
          f.v_scale(i, b, at, at + step * S::kScales, true, true);
        }
      }
    }
  }
}

// Any chunk: positions past `end` are not read (their K and V scales are zero: V adds
// nothing, K's scores are masked), pages are looked up per position where tiles may cross
// pages.
template <Part kPart, int kHead, bool kSwizzle, Layout kLayout, typename Fetch>
__device__ __forceinline__ void fetch_chunk_checked(const Fetch& f, const PageView<kLayout>& pv,
                                                    const TilePages<Shape<kHead>::kTiles>& pages,
                                                    uint32_t base, uint32_t end, int lane) {
  using S = Shape<kHead>;
  constexpr int kScales = S::kScales;
  const int g = lane >> 2, qd = lane & 3;
  int64_t tile_page[S::kTiles];
#pragma unroll
  for (int tile = 0; tile < S::kTiles; ++tile) tile_page[tile] = pv.page_offset(pages.page[tile]);
#pragma unroll
  for (int i = 0; i < 2 * S::kTiles && kPart == Part::kK; ++i) {
    const uint32_t pos = base + g + 8 * i;
    if (pos < end) {
      uint32_t row = pages.row[i / 2] + g + 8 * (i % 2);
      const int64_t page = pv.tile_in_page ? tile_page[i / 2] : pv.locate(pos, &row);
      const uint8_t* side = pv.cache + page;
      const int32_t prow = pv.plane_row(row);
      f.k_code(i, side + prow * (kHead / 2) + qd * (kHead / 8), true);
      f.k_scale(i, side + pv.side_data + prow * kScales + qd * S::kKScaleBytes, true);
    } else {
      f.k_code(i, pv.cache, false);
      f.k_scale(i, pv.cache, false);
    }
  }
#pragma unroll
  for (int i = 0; i < 2 * S::kTiles && kPart == Part::kV; ++i) {
    const uint32_t pos = base + 2 * qd + 8 * i;  // even: pos and pos + 1 share a page
    if (pos < end) {
      const bool second = pos + 1 < end;
      uint32_t row = pages.row[i / 2] + 2 * qd + 8 * (i % 2);
      const int64_t page = pv.tile_in_page ? tile_page[i / 2] : pv.locate(pos, &row);
      const uint8_t* side = pv.cache + page + pv.side_bytes;
      const uint8_t* region = side + pv.side_data;
      const int32_t prow = pv.plane_row(row), prow1 = pv.plane_row(row + 1);
      f.v_code(i, 0, side + prow * (kHead / 2) + g * (kHead / 16), true);
      f.v_code(i, 1, second ? side + prow1 * (kHead / 2) + g * (kHead / 16) : pv.cache, second);
#pragma unroll
      for (int b = 0; b < S::kVBlocks; ++b) {
        const int s = v_scale_block<kHead>(g, b);
        if constexpr (kSwizzle)
          f.v_scale(
              i, b, region + pv.template swizzled_scale_offset<kScales>(row, s), nullptr, true,
              second);
        else
          f.v_scale(
              i, b, region + pv.template linear_scale_offset<kScales>(row, s),
              region + pv.template linear_scale_offset<kScales>(row + 1, s), true, second);
      }
    } else {
      f.v_code(i, 0, pv.cache, false);
      f.v_code(i, 1, pv.cache, false);
#pragma unroll
      for (int b = 0; b < S::kVBlocks; ++b)
        f.v_scale(i, b, pv.cache, pv.cache, false, false);
    }
  }
}

template <Part kPart, int kHead, bool kSwizzle, Layout kLayout, typename Fetch>
__device__ __forceinline__ void fetch_chunk(const Fetch& f, const PageView<kLayout>& pv,
                                            const TilePages<Shape<kHead>::kTiles>& pages,
                                            uint32_t base, uint32_t end, int lane) {
  if (pv.tile_in_page && base + Shape<kHead>::kChunk <= end)
    fetch_chunk_full<kPart, kHead, kSwizzle>(f, pv, pages, lane);
  else
    fetch_chunk_checked<kPart, kHead, kSwizzle>(f, pv, pages, base, end, lane);
}

// A chunk's Part straight into c's registers.
template <Part kPart, int kHead, bool kSwizzle, Layout kLayout>
__device__ __forceinline__ void load_chunk(Chunk<kHead>& c, const PageView<kLayout>& pv,
                                           const TilePages<Shape<kHead>::kTiles>& pages,
                                           uint32_t base, uint32_t end, int lane) {
  fetch_chunk<kPart, kHead, kSwizzle>(RegisterFetch<kHead, kSwizzle>{c}, pv, pages, base, end,
                                      lane);
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
