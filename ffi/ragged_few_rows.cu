// Ragged paged attention for the sequences of a few query rows (speculative decoding: 2 to 8
// draft tokens x the GQA group, at most kFewRows = 16 rows per kv head; head sizes 64 and
// 128), launched with the ragged kernel by its handler (ragged_cuda.cu), which skips them.
//
// Why a kernel of its own: such a tile is memory-bound, and the ragged kernel's path through
// shared memory (every position converted into an fp16 tile, two CTA barriers a step, 2 CTAs
// per SM) spent ~6.6 instructions per K/V value where the decode kernel spends 3.7
// (benchmarks/NOTES.md). Here, as in the decode kernel, each warp reads its chunk of 32
// positions straight into registers (page_chunks.cuh) and turns K into the A fragments of
//   S^T = K Q^T   positions in M (16 per tile), head dims in K, the query rows in N (<= 16),
// so K never goes through shared memory. Each page is read once for all of the sequence's rows.
// The warps then agree on each row's running max (one exchange through shared memory per step
// of 4 x 32 positions), write P (fp16) and their V (fp16) to shared memory, and after one
// barrier each warp accumulates the step's 128 positions for its quarter of the head dims:
//   O^T += V^T P^T   head dims in M (kHead / 4 per warp), positions in K, rows in N,
// so the O accumulators of the rows are spread over the CTA's registers (16 per thread at head
// size 128) instead of needing 64 in each warp. Every warp works with the same max, so the
// row sums of the warps simply add at the end.
//
// Numbers as in attention_device.cuh (q to fp16 after a power-of-two scale per row, K and V
// exact in fp16, float32 softmax and sums, P rounded to fp16). The rules (which tokens a
// sequence owns, which positions a row sees, NaN scores giving NaN rows, empty rows) are those
// of the ragged kernel and jax_nvfp4.reference.ragged_token_plan. With several splits the
// partial results go to the ragged kernel's workspace and its merge kernel combines them.
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>

#include "attention_device.cuh"
#include "cuda_common.cuh"
#include "page_chunks.cuh"
#include "ragged_device.cuh"
#include "ragged_ffi.h"
#include "wgmma.cuh"

namespace nvfp4 {
namespace {

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kNTiles = kFewRows / 8;  // n-tiles of the MMAs (8 rows each)
constexpr uint32_t kFullMask = 0xFFFFFFFFu;

template <int kHead>
struct FewShape {
  using S = Shape<kHead>;
  static_assert(S::kTiles == 2 && S::kVBlocks == 1, "head sizes 64 and 128");
  static constexpr int kStep = kWarps * S::kChunk;     // positions per step (128)
  static constexpr int kWarpDims = kHead / kWarps;     // O^T rows (head dims) per warp
  static constexpr int kOTiles = kWarpDims / 16;       // its m-tiles
  static constexpr int kPSteps = kStep / 16;           // k-steps of O^T += V^T P^T
  static constexpr int kPStride = 2 * kFewRows + 16;   // bytes per position of P (+16: no bank
                                                       // conflicts for the stores and ldmatrix)
  // Shared memory: V of the step, fp16 [kHead / 64 blocks][kStep positions][64 dims], 128-byte
  // rows with the 128-byte swizzle (conflict-free 16-byte stores and ldmatrix); P of the step,
  // fp16 [kStep][kFewRows]; q^T as B fragments [n-tile][code word][lane] (uint4: k-steps 2w and
  // 2w + 1); per row its end, score scale, max exchange and sum exchange.
  static constexpr int kBlockBytes = kStep * 128;
  static constexpr int kVBytes = kHead / 64 * kBlockBytes;
  static constexpr int kPBytes = kStep * kPStride;
  static constexpr int kQBytes = kNTiles * S::kKWords * 32 * 16;
  static constexpr int kRowBytes = (2 + 2 * kWarps) * kFewRows * 4;
  static constexpr int kSmemBytes = kVBytes + kPBytes + kQBytes + kRowBytes;
  static_assert(kVBytes % 1024 == 0 && kPBytes % 16 == 0 && kQBytes % 16 == 0,
                "aligned regions");
};

// Byte offset in the V buffer of the 16 bytes of dims [8 c, 8 c + 8) of step position p.
template <int kHead>
__device__ __forceinline__ int v_chunk(int p, int c) {
  return (c >> 3) * FewShape<kHead>::kBlockBytes + swizzle128_offset(p, 8 * (c & 7));
}

// V of this warp's chunk (positions 32 warp + 2q + 8i (+1), the lane's dims) into the V buffer
// as fp16, exact (code x block scale, as the ragged kernel converts).
template <int kHead>
__device__ __forceinline__ void store_v(const Chunk<kHead>& c, uint8_t* v_smem, int warp,
                                        int lane) {
  using S = Shape<kHead>;
  const int g = lane >> 2, qd = lane & 3;
#pragma unroll
  for (int i = 0; i < 2 * S::kTiles; ++i) {
    const uint32_t scale2 = e4m3x2_to_f16x2_x128(c.v_scale[i][0]);
#pragma unroll
    for (int t = 0; t < 2; ++t) {
      const uint32_t scale = prmt(scale2, scale2, t ? 0x3232 : 0x1010);
      const int pos = S::kChunk * warp + 8 * i + 2 * qd + t;
#pragma unroll
      for (int w = 0; w < S::kVWords; ++w) {
        uint32_t r[4];
        e2m1x8_to_f16x2(c.v[i][t][w], r);
        *reinterpret_cast<uint4*>(v_smem + v_chunk<kHead>(pos, g * S::kVWords + w)) =
            make_uint4(hmul2(r[0], scale), hmul2(r[1], scale), hmul2(r[2], scale),
                       hmul2(r[3], scale));
      }
    }
  }
}

// The work of one CTA on a sequence of `rows` query rows (kNT n-tiles of 8: a compile-time
// count, so that no loop over the rows branches).
template <int kHead, bool kSwizzle, Layout kLayout, int kNT>
__device__ __forceinline__ void attend_few_rows(const RaggedProblem& p, const RaggedGrid& grid,
                                                int32_t b, int32_t kv_head, int32_t member,
                                                int32_t split, int32_t start, int32_t q_len) {
  using S = Shape<kHead>;
  using F = FewShape<kHead>;
  static_assert(kNT >= 1 && kNT <= kNTiles, "n-tiles");
  extern __shared__ __align__(1024) uint8_t smem[];

  uint8_t* v_smem = smem;
  uint8_t* p_smem = smem + F::kVBytes;
  uint4* q_smem = reinterpret_cast<uint4*>(smem + F::kVBytes + F::kPBytes);
  int32_t* row_end = reinterpret_cast<int32_t*>(smem + F::kVBytes + F::kPBytes + F::kQBytes);
  float* row_scale = reinterpret_cast<float*>(row_end + kFewRows);
  float* warp_max = row_scale + kFewRows;        // [warp][row]
  float* warp_sum = warp_max + kWarps * kFewRows;  // [warp][row]

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, qd = lane & 3;
  const int32_t max_num_seqs = p.max_num_seqs;
  const int32_t group = int32_t(grid.group.divisor);
  const int rows = q_len * group;

  const int32_t block_size = int32_t(grid.block_size.divisor);
  const int32_t capacity = p.max_blocks * block_size;
  const int32_t kv_len =
      max(__ldg(p.seq_lens + (p.lens_stacked ? int64_t(member) * max_num_seqs : 0) + b), 0);
  const auto row_limit = [&](int32_t j) {  // positions query j attends to
    return min(max(kv_len - (q_len - 1 - j), 0), capacity);
  };
  // (int64: the FFI checks that every split starts inside the table, so begin fits int32)
  const int32_t begin = int32_t(min(int64_t(split) * p.tokens_per_split, int64_t(capacity)));
  const int32_t split_end =
      int32_t(min(int64_t(split) * p.tokens_per_split + p.tokens_per_split, int64_t(capacity)));
  const int32_t last_end = min(row_limit(q_len - 1), split_end);
  const int64_t member_rows = int64_t(member) * p.num_tokens * p.num_q_heads;
  const auto q_row_of = [&](int r) {  // row r's index among the member's [T, Hq] rows
    uint32_t h;
    const uint32_t j = grid.group.divmod(uint32_t(r), &h);
    return member_rows + int64_t(start + int32_t(j)) * p.num_q_heads + kv_head * group +
           int32_t(h);
  };

  if (begin >= last_end) {  // nothing to attend to in this split
    for (int i = threadIdx.x; i < rows * kHead; i += kThreads)
      write_empty(p, q_row_of(i / kHead), split, i % kHead, kHead);
    return;
  }

  // q^T as B fragments, warp w building n-tile w: lane (g, q) holds row 8 w + g, dims
  // q D/4 .. q D/4 + D/4 - 1, scaled by 2^e into fp16, in the order of the K fragments (the
  // decode kernel's packing); the row's end and score scale beside it.
  if (warp < kNT) {
    constexpr int kDims = kHead / 4;
    const int r = 8 * warp + g;
    const bool valid = r < rows;
    const int64_t q_at = (valid ? q_row_of(r) : 0) * kHead + qd * kDims;
    float qv[kDims];
    float amax = 0.f;
#pragma unroll
    for (int i = 0; i < kDims; ++i) {
      qv[i] = valid ? load_q(p.q, p.q_type, q_at + i) : 0.f;
      amax = fmaxf(amax, fabsf(qv[i]));
    }
    amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, 1));
    amax = fmaxf(amax, __shfl_xor_sync(kFullMask, amax, 2));
    const int exponent = q_exponent(amax);
#pragma unroll
    for (int w = 0; w < S::kKWords; ++w) {
      uint32_t f[4];
#pragma unroll
      for (int e = 0; e < 2; ++e) {
        const float* x = qv + 8 * w + e;
        f[2 * e] = pack_f16x2(ldexpf(x[0], exponent), ldexpf(x[4], exponent));
        f[2 * e + 1] = pack_f16x2(ldexpf(x[2], exponent), ldexpf(x[6], exponent));
      }
      q_smem[(warp * S::kKWords + w) * 32 + lane] = make_uint4(f[0], f[1], f[2], f[3]);
    }
    if (qd == 0) {
      const float k_scale = p.k_scale[p.k_scale_stacked ? member : 0];
      const float sm_scale = p.sm_scale[p.sm_scale_stacked ? member : 0];
      row_end[r] = valid ? min(row_limit(grid.group.div(uint32_t(r))), split_end) : 0;
      row_scale[r] = ldexpf(k_scale * sm_scale * kLog2e, 7 - exponent);
    }
  }

  PageView<kLayout> pv;
  const int32_t side_bytes = int32_t(p.page.side_bytes());
  pv.cache = p.kv_cache + int64_t(member) * p.num_blocks * 2 * side_bytes;
  pv.table = p.block_tables +
             ((p.tables_stacked ? int64_t(member) * max_num_seqs : 0) + b) * p.max_blocks;
  pv.page_bytes = 2 * int64_t(side_bytes);
  pv.side_bytes = side_bytes;
  pv.side_data = int32_t(p.page.side_data_bytes());
  pv.head_row = kLayout == Layout::kHND ? kv_head * block_size : kv_head;
  pv.num_kv_heads = int32_t(p.page.num_kv_heads);
  pv.last_page = p.num_blocks - 1;
  pv.block_size = grid.block_size;
  pv.tile_in_page = block_size % 16 == 0;

  // Chunks of 32 positions from begin; warp w takes chunk 4 s + w in step s (the decode
  // kernel's order). One set of chunk registers: the next chunk's K is loaded once this
  // chunk's scores are computed, its V once this chunk's V is in shared memory.
  const uint32_t end = uint32_t(last_end);
  const int num_steps = (last_end - begin + F::kStep - 1) / F::kStep;
  const auto chunk_base = [&](int chunk) { return uint32_t(begin + chunk * S::kChunk); };
  Chunk<kHead> c;
  int chunk = warp;
  TilePages<S::kTiles> pages = fetch_pages<S::kTiles>(pv, chunk_base(chunk), end);
  load_chunk<Part::kK, kHead, kSwizzle>(c, pv, pages, chunk_base(chunk), end, lane);
  load_chunk<Part::kV, kHead, kSwizzle>(c, pv, pages, chunk_base(chunk), end, lane);
  pages = fetch_pages<S::kTiles>(pv, chunk_base(chunk + kWarps), end);

  __syncthreads();  // q fragments and row data

  // Steps below the first row's end need no mask (every later row sees more).
  const int32_t min_end = row_end[0];

  float m[kNT][2], l[kNT][2];
  float o[F::kOTiles][kNT][4];
#pragma unroll
  for (int t = 0; t < kNT; ++t) {
    m[t][0] = m[t][1] = -INFINITY;
    l[t][0] = l[t][1] = 0.f;
#pragma unroll
    for (int mt = 0; mt < F::kOTiles; ++mt)
#pragma unroll
      for (int k = 0; k < 4; ++k) o[mt][t][k] = 0.f;
  }

#pragma unroll 1
  for (int step = 0; step < num_steps; ++step, chunk += kWarps) {
    const TilePages<S::kTiles> later =
        fetch_pages<S::kTiles>(pv, chunk_base(chunk + 2 * kWarps), end);
    // (a chunk past the end loads nothing: zeros, so a warp with no chunk left adds nothing)
    const uint32_t base = chunk_base(chunk), following = chunk_base(chunk + kWarps);

    // S^T for this warp's 32 positions and the tile's rows: s[tile][t][k] is position
    // 16 tile + g (k < 2) or + 8 (k >= 2), row 8 t + 2 q + (k & 1).
    float s[S::kTiles][kNT][4];
#pragma unroll
    for (int tile = 0; tile < S::kTiles; ++tile)
#pragma unroll
      for (int t = 0; t < kNT; ++t)
#pragma unroll
        for (int k = 0; k < 4; ++k) s[tile][t][k] = 0.f;
    // (tile by tile: the q fragments are read from shared memory twice, which costs fewer
    // registers than holding both tiles' K fragments)
#pragma unroll
    for (int tile = 0; tile < S::kTiles; ++tile) {
      uint32_t scale_words[2][S::kKScaleBytes];
      k_tile_scales<kHead>(c, tile, scale_words);
#pragma unroll
      for (int w = 0; w < S::kKWords; ++w) {
        uint32_t a0[4], a1[4];
        k_word_fragments<kHead>(c, tile, w, scale_words, a0, a1);
#pragma unroll
        for (int t = 0; t < kNT; ++t) {
          const uint4 qf = q_smem[(t * S::kKWords + w) * 32 + lane];
          mma_16816(s[tile][t], a0, qf.x, qf.y);
          mma_16816(s[tile][t], a1, qf.z, qf.w);
        }
      }
    }
    load_chunk<Part::kK, kHead, kSwizzle>(c, pv, pages, following, end, lane);

    // Scores in log2 units, masked past each row's end; the warp's max per row.
    const bool masked = int32_t(base) + S::kChunk > min_end;
    float top[kNT][2];
#pragma unroll
    for (int t = 0; t < kNT; ++t) {
      // The lane's rows 8 t + 2 q (h = 0) and + 1 (h = 1): their score scales (from shared
      // memory each step: registers are short) and ends.
      const float2 score_scale = *reinterpret_cast<const float2*>(row_scale + 8 * t + 2 * qd);
      int32_t limit[2] = {INT_MAX, INT_MAX};
      if (masked) limit[0] = row_end[8 * t + 2 * qd], limit[1] = row_end[8 * t + 2 * qd + 1];
      top[t][0] = m[t][0], top[t][1] = m[t][1];
#pragma unroll
      for (int tile = 0; tile < S::kTiles; ++tile)
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const int32_t pos = int32_t(base) + 16 * tile + g + 8 * (k >> 1);
          float x = s[tile][t][k] * ((k & 1) ? score_scale.y : score_scale.x);
          if (pos >= limit[k & 1]) x = -INFINITY;
          s[tile][t][k] = x;
          top[t][k & 1] = fmaxf(top[t][k & 1], x);
        }
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int d = 4; d < 32; d *= 2)
          top[t][h] = fmaxf(top[t][h], __shfl_xor_sync(kFullMask, top[t][h], d));
      if (g == 0)
        *reinterpret_cast<float2*>(warp_max + warp * kFewRows + 8 * t + 2 * qd) =
            make_float2(top[t][0], top[t][1]);
    }
    // Every warp's max is in shared memory, and every warp is done with the step before (its
    // P V), so P and V may be overwritten.
    __syncthreads();

    // The CTA's max per row (the same in every warp), P = 2^(s - max) into shared memory.
#pragma unroll
    for (int t = 0; t < kNT; ++t) {
#pragma unroll
      for (int w = 0; w < kWarps; ++w) {
        const float2 other =
            *reinterpret_cast<const float2*>(warp_max + w * kFewRows + 8 * t + 2 * qd);
        top[t][0] = fmaxf(top[t][0], other.x);
        top[t][1] = fmaxf(top[t][1], other.y);
      }
      float alpha[2];
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float offset = top[t][h] == -INFINITY ? 0.f : top[t][h];  // no -inf - -inf
        alpha[h] = exp2_approx(m[t][h] - offset);
        m[t][h] = top[t][h];
        l[t][h] *= alpha[h];
#pragma unroll
        for (int tile = 0; tile < S::kTiles; ++tile)
#pragma unroll
          for (int k = h; k < 4; k += 2) {
            s[tile][t][k] = exp2_approx(s[tile][t][k] - offset);
            l[t][h] += s[tile][t][k];
          }
      }
#pragma unroll
      for (int tile = 0; tile < S::kTiles; ++tile)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int pos = S::kChunk * warp + 16 * tile + g + 8 * half;
          *reinterpret_cast<uint32_t*>(p_smem + pos * F::kPStride + (8 * t + 2 * qd) * 2) =
              pack_f16x2(s[tile][t][2 * half], s[tile][t][2 * half + 1]);
        }
      if (alpha[0] != 1.f || alpha[1] != 1.f) {  // the max changed (rarely after a few steps)
#pragma unroll
        for (int mt = 0; mt < F::kOTiles; ++mt)
#pragma unroll
          for (int k = 0; k < 4; ++k) o[mt][t][k] *= alpha[k & 1];
      }
    }
    store_v<kHead>(c, v_smem, warp, lane);
    load_chunk<Part::kV, kHead, kSwizzle>(c, pv, pages, following, end, lane);
    pages = later;
    __syncthreads();  // P and V of the step are complete

    // O^T += V^T P^T over the step's positions, for this warp's head dims.
#pragma unroll
    for (int kk = 0; kk < F::kPSteps; ++kk) {
      uint32_t a[F::kOTiles][4];
#pragma unroll
      for (int mt = 0; mt < F::kOTiles; ++mt)
        ldmatrix_x4_trans(a[mt], v_smem + v_chunk<kHead>(16 * kk + (lane & 7) + (lane >> 4) * 8,
                                                          F::kWarpDims / 8 * warp + 2 * mt +
                                                              ((lane >> 3) & 1)));
#pragma unroll
      for (int t = 0; t < kNT; t += 2) {
          uint32_t bf[4];
        ldmatrix_x4_trans(bf, p_smem + (16 * kk + (lane & 7) + ((lane >> 3) & 1) * 8) * F::kPStride +
                                  (8 * (t + (lane >> 4))) * 2);
#pragma unroll
        for (int mt = 0; mt < F::kOTiles; ++mt) {
          mma_16816(o[mt][t], a[mt], bf[0], bf[1]);
          if (t + 1 < kNT) mma_16816(o[mt][t + 1], a[mt], bf[2], bf[3]);
        }
      }
    }
  }

  // Row sums: over the lanes of a row, then over the warps (which all used the same max).
#pragma unroll
  for (int t = 0; t < kNT; ++t) {
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int d = 4; d < 32; d *= 2) l[t][h] += __shfl_xor_sync(kFullMask, l[t][h], d);
    if (g == 0)
      *reinterpret_cast<float2*>(warp_sum + warp * kFewRows + 8 * t + 2 * qd) =
          make_float2(l[t][0], l[t][1]);
  }
  __syncthreads();

  // Each warp writes its head dims of every row (dims in true order: see permuted_dim_even).
  const float v_scale = p.v_scale[p.v_scale_stacked ? member : 0];
#pragma unroll
  for (int t = 0; t < kNT; ++t) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int r = 8 * t + 2 * qd + h;
      if (r >= rows) continue;
      float sum = 0.f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) sum += warp_sum[w * kFewRows + r];
      const int64_t row = q_row_of(r);
      const float top = m[t][h];
      const bool empty = top == -INFINITY && !isnan(sum);  // nothing attended to in this split
      const float lse2 = top + __log2f(sum);
      const float inv = 1.f / sum;
#pragma unroll
      for (int mt = 0; mt < F::kOTiles; ++mt)
#pragma unroll
        for (int half = 0; half < 2; ++half) {
          const int chunk8 = F::kWarpDims / 8 * warp + 2 * mt + half;
          const int dim = 8 * chunk8 + permuted_dim_even(g >> 1) + 4 * (g & 1);
          const float value = o[mt][t][2 * half + h] * inv;
          if (empty) {
            write_empty(p, row, split, dim, kHead);
          } else if (p.num_splits == 1) {
            store_out(p.out, p.q_type, row * kHead + dim, value * (v_scale * 128.f));
            if (dim == 0) p.lse[row] = lse2 * kLn2;
          } else {
            p.partial_out[(row * p.num_splits + split) * kHead + dim] = value;
            if (dim == 0) p.partial_lse[row * p.num_splits + split] = lse2;
          }
        }
    }
  }
}

template <int kHead, bool kSwizzle, Layout kLayout>
__global__ void __launch_bounds__(kThreads, 3)
    FewRowsKernel(const RaggedProblem p, const RaggedGrid grid) {
  const int lane = threadIdx.x & 31;
  uint32_t head;
  const int32_t b = int32_t(grid.num_kv_heads.divmod(blockIdx.x, &head));
  const int32_t kv_head = int32_t(head);
  const int32_t member = blockIdx.z / p.num_splits, split = blockIdx.z % p.num_splits;
  const int32_t max_num_seqs = p.max_num_seqs;
  const int32_t ns =
      min(max(__ldg(p.num_seqs + (p.num_seqs_stacked ? member : 0)), 0), max_num_seqs);
  if (b >= ns) return;
  const int32_t* cu = p.cu_q_lens + (p.cu_stacked ? int64_t(member) * (max_num_seqs + 1) : 0);
  int32_t start, next;
  sequence_tokens(cu, b, p.num_tokens, lane, &start, &next);
  const int32_t q_len = next - start;
  const int32_t group = int32_t(grid.group.divisor);
  if (!takes_few_rows(q_len, group, kHead)) return;  // (CTA-uniform) another kernel's sequence
  if (q_len * group <= 8)  // one n-tile, or two
    return attend_few_rows<kHead, kSwizzle, kLayout, 1>(p, grid, b, kv_head, member, split,
                                                        start, q_len);
  attend_few_rows<kHead, kSwizzle, kLayout, 2>(p, grid, b, kv_head, member, split, start, q_len);
}

template <int kHead, bool kSwizzle, Layout kLayout>
cudaError_t LaunchFewRowsKernel(cudaStream_t stream, const RaggedProblem& p) {
  constexpr auto kernel = FewRowsKernel<kHead, kSwizzle, kLayout>;
  const cudaError_t configured = ConfigureSharedMemory<kernel>(FewShape<kHead>::kSmemBytes);
  if (configured != cudaSuccess) return configured;
  const RaggedGrid grid{0, FastDivmod(uint32_t(p.page.num_kv_heads)),
                        FastDivmod(uint32_t(p.num_q_heads / p.page.num_kv_heads)),
                        FastDivmod(uint32_t(p.page.block_size))};
  const dim3 blocks(uint32_t(int64_t(p.max_num_seqs) * p.page.num_kv_heads), 1,
                    uint32_t(p.stacked * p.num_splits));
  kernel<<<blocks, kThreads, FewShape<kHead>::kSmemBytes, stream>>>(p, grid);
  return cudaGetLastError();
}

}  // namespace

cudaError_t LaunchFewRows(cudaStream_t stream, const RaggedProblem& p) {
  if (p.max_num_seqs == 0) return cudaSuccess;
  return WithHeadSize(
      p.page.head_size,
      [&](auto head) {
        if constexpr (decltype(head)::value > kFewRowsMaxHead) {  // not the kernel's
          return cudaSuccess;
        } else {
          return WithPageOptions(p.page, [&](auto swizzle, auto layout) {
            return LaunchFewRowsKernel<decltype(head)::value, decltype(swizzle)::value,
                                       decltype(layout)::value>(stream, p);
          });
        }
      },
      cudaErrorInvalidValue);
}

}  // namespace nvfp4
