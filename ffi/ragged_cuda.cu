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
// further ceil(T / 64) slots write zeros for the tokens no sequence owns. Where the other
// kernels take every sequence (RaggedTilesIdle) the kernel is not launched and the few-row
// kernel's grid writes those zeros. The rules (which tokens a sequence owns, which positions a
// query sees) are those of jax_nvfp4.reference.ragged_token_plan; every kernel of the call
// applies the readers' invalid-scale rule itself (member_scales_valid).
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
#include "ragged_tiles.cuh"
#include "wgmma.cuh"

namespace nvfp4 {
namespace {
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
  const RaggedCta cta = ragged_cta(p, grid);
  const int32_t slot = cta.slot, kv_head = cta.kv_head, member = cta.member, split = cta.split;
  const int32_t group = cta.group, ns = cta.ns, num_tokens = p.num_tokens;
  const int32_t* const cu = cta.cu;
  const int64_t member_rows = cta.member_rows;

  if (slot >= grid.tile_slots) {  // a fill slot: zeros for the tokens nobody owns
    zero_unowned_tokens<kHead, kThreads>(p, cta, slot - grid.tile_slots, lane);
    return;
  }

  TileWork work;
  if (!find_tile(cu, ns, num_tokens, group, slot, lane, &work)) return;

  // The tile's rows: row r is row row0 + r of the sequence, i.e. query token j = (row0 + r) /
  // group, query head kv_head * group + (row0 + r) % group; it sees positions < its end.
  const int32_t rows_seq = work.q_len * group;
  const int32_t row0 = work.tile * kRows;
  const int rows_here = min(kRows, rows_seq - row0);
  const SplitRange range = split_range(p, grid, member, work.seq, work.q_len, split);
  const int32_t begin = range.begin;
  const int32_t last_end = range.row_end(grid, row0 + rows_here - 1);
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
  // A sequence over max_q_len, or the member's global scales invalid: NaN rows.
  if (exceeds_max_q_len(p, work.q_len) || !member_scales_valid(p, member)) {
    for (int i = threadIdx.x; i < rows_here * kHead; i += kThreads)
      write_nan(p, q_row_of(i / kHead), split, i % kHead, kHead);
    return;
  }
  if (begin >= last_end) {  // nothing to attend to in this split
    for (int i = threadIdx.x; i < rows_here * kHead; i += kThreads)
      write_empty(p, q_row_of(i / kHead), split, i % kHead, kHead);
    return;
  }

  // q into shared memory; the rows' ends, score scales and q rows beside it.
  stage_tile_q<kHead>(
      p, grid, range, threadIdx.x, rows_here, row0,
      p.k_scale[p.k_scale_stacked ? member : 0] * p.sm_scale[p.sm_scale_stacked ? member : 0],
      member_rows, q_row_of, q_smem, row_end, row_scale, row_q);


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
  const PageView<kLayout> pv = tile_page_view<kLayout>(p, grid, member, work.seq, kv_head);
  const int side = threadIdx.x / (kThreads / 2);
  const int vector = (threadIdx.x % (kThreads / 2)) / R::kThreadsPerVector;  // position in step
  const int part = threadIdx.x % R::kThreadsPerVector;
  uint8_t* const convert_dst = kv_smem + side * R::kSideBytes;
  const StageSlot<kHead> staged = stage_slot<kHead>(side, vector, part);

  const int num_steps = (last_end - begin + R::kKv - 1) / R::kKv;
  const uint32_t end = uint32_t(last_end);
  TileCopies<kHead, kSwizzle, kLayout, R::kStages> copies(ring, pv, staged, begin, end, vector,
                                                          side, part);
#pragma unroll
  for (int step = 0; step < R::kStages - 1; ++step) {
    if (step < num_steps) copies.copy_next(copies.next_page());
    copy_async_commit();
  }
  int32_t page_ahead = copies.next_page();

  __syncthreads();  // q and the row data

  uint32_t qf[R::kQInRegisters ? R::kKSteps : 1][4];
  if constexpr (R::kQInRegisters) {
#pragma unroll
    for (int k = 0; k < R::kKSteps; ++k)
      ldmatrix_x4(qf[k], q_smem + (mt * 16 + (lane & 15)) * R::kStride + 16 * k + (lane >> 4) * 8);
  }
  const WarpRows rows = warp_rows(row_end, row_scale, mt * 16, rows_here, has_rows, lane);

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
                                    side, vector, part, copies.position_of(step) < end,
                                    convert_dst);
    // The stage converted a step ago is free: the copies of step + kStages - 1 go there.
    const int ahead = step + R::kStages - 1;
    if (ahead < num_steps) {
      copies.copy_next(page_ahead);
      page_ahead = copies.next_page();
    }
    copy_async_commit();
    if constexpr (R::kWgmma) {
      // The converted K/V are read by the tensor cores (the async proxy) next.
      fence_proxy_async_shared();
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

    // Online softmax (online_softmax), O rescaled at once.
    float alpha[2];
    online_softmax(s, step_base + kv0, part_len, rows, qd, m, l, alpha);
    rescale_o(o, alpha);

    // O += P V: P from the S accumulators (the A fragment of 16 positions is two n-tiles).
    if (wgmma_tile) {
      if constexpr (R::kWgmma) {
        uint32_t a[R::kPSteps][4];
        pack_p(s, a);
        float(&acc)[R::kOTiles * 4] = reinterpret_cast<float(&)[R::kOTiles * 4]>(o);
        wgmma_fence_operands(acc);
        wgmma_fence();
#pragma unroll
        for (int k = 0; k < R::kPSteps; ++k) {  // MN-major B: positions 16 k .. 16 k + 15
          const uint64_t b = desc_plus(v_desc, 16 * k * 128);
          if constexpr (kHead == 128)
            wgmma_64x128<1>(acc, a[k], b);
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
    write_result(p, row, split, d, kHead, value, lse2, v_scale * 128.f);
  }
}

// Combines the splits of each (member, token, query head) row: kMergeRows<kHead> rows a block,
// four values a thread, read 16 bytes at a time (a row of the workspace is kHead floats). (One
// row a block of kHead threads took ~13 us for spec 32 x 8's 8192 rows of 3 splits on an H200:
// 8192 blocks of two dependent rounds of 4-byte loads.)
constexpr int kMergeThreads = 128;
template <int kHead>
constexpr int kMergeRows = kMergeThreads / (kHead / 4);
template <int kHead>
__global__ void __launch_bounds__(kMergeThreads) RaggedMergeKernel(const RaggedProblem p) {
  static_assert(kHead % 4 == 0 && kMergeThreads % (kHead / 4) == 0, "whole rows a block");
  constexpr int kThreadsPerRow = kHead / 4;
  const int64_t row =
      int64_t(blockIdx.x) * kMergeRows<kHead> + int32_t(threadIdx.x) / kThreadsPerRow;
  if (row >= int64_t(p.stacked) * p.num_tokens * p.num_q_heads) return;
  const int d = 4 * (int32_t(threadIdx.x) % kThreadsPerRow);
  const int32_t member = int32_t(row / (int64_t(p.num_tokens) * p.num_q_heads));
  const float* const lse = p.partial_lse + row * p.num_splits;
  const float* const partial = p.partial_out + row * p.num_splits * kHead + d;
  float lse2;
  const float4 value = merge_splits(
      p.num_splits, [&](int s) { return lse[s]; },
      [&](int s) { return *reinterpret_cast<const float4*>(partial + s * kHead); }, &lse2);
  const float out_scale = member_out_scale(p, member);
  const int64_t at = row * kHead + d;
  store_out(p.out, p.q_type, at, value.x * out_scale);
  store_out(p.out, p.q_type, at + 1, value.y * out_scale);
  store_out(p.out, p.q_type, at + 2, value.z * out_scale);
  store_out(p.out, p.q_type, at + 3, value.w * out_scale);
  if (d == 0) p.lse[row] = lse2 * kLn2;
}

// Slots of the grid's x axis: query tiles (an upper bound whatever cu_q_lens holds), then the
// zero fill of unowned tokens, 64 tokens a slot.
int64_t TileSlots(const RaggedProblem& p) {
  const int64_t group = p.num_q_heads / p.page.num_kv_heads;
  return (int64_t(p.num_tokens) * group + kRows - 1) / kRows +
         std::min<int64_t>(p.max_num_seqs, p.num_tokens);
}

// Whether every tile of the ragged kernel would be skipped, so that it is not launched and the
// few-row kernels' grid takes its fill slots (LaunchFewRows' `fill`): the pipelined kernel runs
// (head size 128, an sm_90 GPU and sm_90a code: it set p.pipelined) and takes every sequence of
// more than kPipelinedMinRows rows (those over max_q_len too: it writes their NaN rows), the
// few-row kernel those of 2 tokens up to its few_rows_max >= kPipelinedMinRows rows, the decode
// kernel those of one; and there is one split (with several, the ragged kernel writes the one-token
// rows' empty partial results, which the merge reads before the decode kernel's rows replace them).
// Launched empty it cost 6 to 38 us a call on an H100 (chunk 2048 to prefix 16 x 1024: thousands of
// 64-row tile slots at two CTAs a SM; benchmarks/NOTES.md, ragged v23).
bool RaggedTilesIdle(const RaggedProblem& p) {
  return p.pipelined && p.num_splits == 1 && p.decode_splits > 0 &&
         p.page.head_size <= kFewRowsMaxHead && p.few_rows_max >= kPipelinedMinRows;
}

// More than 48 KB of dynamic shared memory, and all of L1 as shared memory (two CTAs of ~100 KB
// per SM).
template <int kHead, bool kSwizzle, Layout kLayout>
cudaError_t Configure() {
  return ConfigureSharedMemory<RaggedKernel<kHead, kSwizzle, kLayout>>(
      RaggedShape<kHead>::kSmemBytes);
}

template <int kHead, bool kSwizzle, Layout kLayout>
cudaError_t Launch(cudaStream_t stream, const RaggedProblem& caller_problem) {
  using R = RaggedShape<kHead>;
  const auto kernel = RaggedKernel<kHead, kSwizzle, kLayout>;
  const cudaError_t configured = Configure<kHead, kSwizzle, kLayout>();
  if (configured != cudaSuccess) return configured;
  // The long sequences on the pipelined prefill kernel where it runs (it sets p.pipelined),
  // before the ragged kernel, which then skips them.
  RaggedProblem p = caller_problem;
  cudaError_t error = LaunchPipelinedPrefill(stream, &p);
  if (error != cudaSuccess) return error;
  const RaggedGrid grid{int32_t(TileSlots(p)), FastDivmod(uint32_t(p.page.num_kv_heads)),
                        FastDivmod(uint32_t(p.num_q_heads / p.page.num_kv_heads)),
                        FastDivmod(uint32_t(p.page.block_size))};
  const dim3 blocks(uint32_t((TileSlots(p) + FillSlots(p)) * p.page.num_kv_heads), 1,
                    uint32_t(p.stacked * p.num_splits));
  // Alone, the few-row kernel takes every sequence and the fill; with the ragged kernel's tiles
  // idle, the fill.
  const bool few_rows_fill = p.few_rows_only || RaggedTilesIdle(p);
  if (!few_rows_fill) {
    kernel<<<blocks, kThreads, R::kSmemBytes, stream>>>(p, grid);
    error = cudaGetLastError();
  }
  if (error == cudaSuccess) error = LaunchFewRows(stream, p, few_rows_fill);
  if (error == cudaSuccess && p.num_splits > 1) {
    const int64_t rows = int64_t(p.stacked) * p.num_tokens * p.num_q_heads;
    RaggedMergeKernel<kHead>
        <<<uint32_t((rows + kMergeRows<kHead> - 1) / kMergeRows<kHead>), kMergeThreads, 0,
           stream>>>(p);
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
  p.few_rows_max = FewRowsMaxRows(int(p.page.head_size));
  if (few_rows_only &&
      int64_t(max_q_len) * (p.num_q_heads / int64_t(p.page.num_kv_heads)) > p.few_rows_max)
    return RaggedArgumentError("few_rows_only with max_q_len x the GQA group over the " +
                               std::to_string(p.few_rows_max) +
                               " rows the few-row kernel takes on this GPU");
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
  return ResidentCtasPerSm<RaggedKernel<kHead, true, Layout::kHND>>(
      kThreads, RaggedShape<kHead>::kSmemBytes);
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
