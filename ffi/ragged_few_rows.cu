// Ragged paged attention for the sequences of a few query rows (speculative decoding: 2 to 8
// draft tokens x the GQA group, at most kFewRows = 16 rows per kv head; head sizes 64 and
// 128; at head size 128 with sm_90a code also 17 to 32 rows, on wgmma: few_rows_wide.cuh),
// launched with the ragged kernel by its handler (ragged_cuda.cu), which skips them.
//
// Why a kernel of its own: such a tile is memory-bound, and the ragged kernel's path through
// shared memory (every position converted into an fp16 tile, two CTA barriers a step, 2 CTAs
// per SM) spent ~6.6 instructions per K/V value where the decode kernel spends 3.7
// (benchmarks/NOTES.md). Here each warp runs the decode kernel's loop (chunk_attention.cuh)
// with the sequence's rows (query tokens x heads of one kv head) in N, one or two n-tiles of
// 8: it reads its chunks of 32 positions into registers (by default through a ring of 2 chunks
// a warp in shared memory, as the decode kernel does), converts each K and V fragment once for
// all the rows, and keeps its own online softmax, with no barrier until the warps merge at the
// end. Each page is read once for all of the sequence's rows.
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
#include "chunk_attention.cuh"
#include "cuda_common.cuh"
#include "few_rows_wide.cuh"
#include "handlers.h"
#include "page_chunks.cuh"
#include "ragged_device.cuh"
#include "ragged_ffi.h"

namespace nvfp4 {
namespace {

constexpr int kThreads = kChunkWarps * 32;
constexpr int kNTiles = kFewRows / 8;  // n-tiles of the MMAs (8 rows each)
// CTAs per SM the registers are budgeted for (the split plan asks the GPU how many fit:
// FewRowsResidentCtasPerSm). Measured on an H200, 2026-12-01: 2 CTAs, 241-243 registers, spec
// 32 x 4 over 8192 in 185 us; at 3 the kernel spills. To measure another value:
// -DNVFP4_FEW_ROWS_MIN_CTAS=N in CMAKE_CUDA_FLAGS.
#ifndef NVFP4_FEW_ROWS_MIN_CTAS
#define NVFP4_FEW_ROWS_MIN_CTAS 2
#endif
constexpr int kFewRowsCtasPerSm = NVFP4_FEW_ROWS_MIN_CTAS;
// The chunks' bytes staged through shared memory, NVFP4_FEW_ROWS_STAGED chunks ahead per warp
// (attend_chunks_staged, the decode kernel's since decode v8); 0: the loads into registers.
// Measured on an H200, 2026-12-02, spec 32 x 4 over 8192 with max_q_len: 169.4 us with the
// loads into registers, 154.9 with 2 slots, 156.1 with 3 (the decode kernel 127-130 in the
// same runs). -DNVFP4_FEW_ROWS_STAGED=N in CMAKE_CUDA_FLAGS.
#ifndef NVFP4_FEW_ROWS_STAGED
#define NVFP4_FEW_ROWS_STAGED 2
#endif
constexpr int kFewRowsStagedSlots = NVFP4_FEW_ROWS_STAGED;
constexpr bool kFewRowsStaged = kFewRowsStagedSlots > 0;
// Dynamic shared memory a CTA takes when staged: the slots, which the warps' merge then reuses.
template <int kHead>
constexpr int kFewRowsSmem = kStagedSmem<kHead, kFewRowsStagedSlots, kFewRows>;
static_assert(kFewRowsSmem<kFewRowsMaxHead> <= kMaxSmemPerCta, "an sm_90 CTA's shared memory");
// The sequences of 17 to 32 rows (head size 128, sm_90a: few_rows_wide.cuh) have a kernel of
// their own, WideRowsKernel, budgeted for NVFP4_WIDE_MIN_CTAS CTAs per SM (its registers:
// in one kernel with the 16-row path it had that path's 243-255 registers and 2 CTAs per SM).
#ifndef NVFP4_WIDE_MIN_CTAS
#define NVFP4_WIDE_MIN_CTAS 3
#endif
constexpr int kWideCtasPerSm = NVFP4_WIDE_MIN_CTAS;
static_assert(WideShape::kSmemBytes <= kMaxSmemPerCta, "an sm_90 CTA's shared memory");

// The work of one CTA on a sequence of `rows` query rows (kNT n-tiles of 8: a compile-time
// count, so that no loop over the rows branches).
template <int kHead, bool kSwizzle, Layout kLayout, int kNT>
__device__ __forceinline__ void attend_few_rows(const RaggedProblem& p, const RaggedGrid& grid,
                                                int32_t b, int32_t kv_head, int32_t member,
                                                int32_t split, int32_t start, int32_t q_len,
                                                uint8_t* smem) {
  using S = Shape<kHead>;
  static_assert(kNT >= 1 && kNT <= kNTiles, "n-tiles");
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2, qd = lane & 3;
  const FewRowsSequence seq(p, grid, b, kv_head, member, split, start, q_len);
  if (seq.nothing_to_attend<kHead, kThreads>(split)) return;
  const int rows = seq.rows;

  // Per n-tile t: q of row 8t + g (column g) as B fragments, the scores' scales and the ends
  // of the lane's columns 8t + 2q, + 1.
  float score_scale[kNT][2];
  uint32_t limit[kNT][2];
  const float k_times_sm_scale =
      p.k_scale[p.k_scale_stacked ? member : 0] * p.sm_scale[p.sm_scale_stacked ? member : 0];
  RegisterQ<kHead, kNT> qf;
#pragma unroll
  for (int t = 0; t < kNT; ++t) {
    const int r = 8 * t + g;
    uint32_t f[S::kKTiles][2];
    q_fragments<kHead>(p.q, p.q_type, (r < rows ? seq.q_row(r) : 0) * kHead, r < rows,
                       k_times_sm_scale, lane, f, score_scale[t]);
#pragma unroll
    for (int k = 0; k < S::kKTiles; ++k) qf.f[t][k][0] = f[k][0], qf.f[t][k][1] = f[k][1];
    limit[t][0] = seq.row_end(8 * t + 2 * qd);
    limit[t][1] = seq.row_end(8 * t + 2 * qd + 1);
  }

  const PageView<kLayout> pv = sequence_page_view<kLayout>(p, grid, member, b, kv_head);
  const uint32_t begin = uint32_t(seq.begin), last_end = uint32_t(seq.last_end);

  // Positions [begin, last_end): the last row's; chunks reaching past the first row's end are
  // masked per row (every later row sees more).
  WarpState<kHead, kNT> st;
  init_state(st);
  if constexpr (kFewRowsStaged) {
    attend_chunks_staged<kFewRowsStagedSlots, kHead, kSwizzle, kLayout, kNT>(
        pv, begin, last_end, seq.row_end(0), limit, qf, score_scale, warp, lane,
        first_chunk_pages<kHead>(pv, begin, last_end, warp), smem, st);
    __syncthreads();  // every warp is done with its slots: the merge reuses them
  } else {
    attend_chunks<kHead, kSwizzle, kLayout, kNT>(
        pv, begin, last_end, seq.row_end(0), limit, qf, score_scale, warp, lane,
        first_chunk_pages<kHead>(pv, begin, last_end, warp), st);
  }

  const float out_scale = member_out_scale(p, member);
  merge_warps<kHead, kNT>(st, reinterpret_cast<float*>(smem), rows, warp, lane,
                          [&](int r, int d, float value, float lse2) {
                            const int64_t row = seq.q_row(r);
                            if (lse2 == -INFINITY) {  // nothing attended to in this split
                              write_empty(p, row, split, d, kHead);
                            } else {
                              write_result(p, row, split, d, kHead, value, lse2, out_scale);
                            }
                          });
}

// What a CTA of either few-row kernel does before it attends. Block x past the sequences' (only in
// a grid with the fill slots (LaunchFewRows' `fill`): the kernel serves the call alone, or the
// ragged kernel is not launched) is a fill slot: zeros for the tokens nobody owns. A sequence over
// max_q_len gets NaN rows: among those the kernels take, and alone (the kernel then owes every
// sequence its rows, and the handler checked that max_q_len's fit) any they cannot take; so does
// every sequence the kernels take where the member's global scales are invalid
// (member_scales_valid); by the kernel that `owes` them (the one that also takes the sequences of
// up to kFewRows rows). Returns whether the CTA attends for sequence cta.slot, whose tokens are
// [*start, *start + *q_len).
template <int kHead>
__device__ __forceinline__ bool few_rows_sequence(const RaggedProblem& p, const RaggedCta& cta,
                                                  bool owes, int32_t* start, int32_t* q_len) {
  const int lane = threadIdx.x & 31;
  if (cta.slot >= p.max_num_seqs) {
    if (owes)
      zero_unowned_tokens<kHead, kThreads>(p, cta, cta.slot - p.max_num_seqs, lane);
    return false;
  }
  if (cta.slot >= cta.ns) return false;
  int32_t next;
  sequence_tokens(cta.cu, cta.slot, p.num_tokens, lane, start, &next);
  *q_len = next - *start;
  const bool taken = takes_few_rows(p, *q_len, cta.group, kHead);
  if (taken ? exceeds_max_q_len(p, *q_len) || !member_scales_valid(p, cta.member)
            : p.few_rows_only && *q_len > 0) {
    if (owes) {
      for (int32_t i = threadIdx.x; i < *q_len * cta.group * kHead; i += kThreads) {
        const int32_t r = i / kHead;
        const int64_t row = cta.member_rows +
                            int64_t(*start + r / cta.group) * p.num_q_heads +
                            cta.kv_head * cta.group + r % cta.group;
        write_nan(p, row, cta.split, i % kHead, kHead);
      }
    }
    return false;
  }
  return taken;  // (CTA-uniform)
}

template <int kHead, bool kSwizzle, Layout kLayout>
__global__ void __launch_bounds__(kThreads, kFewRowsCtasPerSm)
    FewRowsKernel(const RaggedProblem p, const RaggedGrid grid) {
  // The warps' merge (and where staged, first the slots: dynamic shared memory).
  uint8_t* smem;
  if constexpr (kFewRowsStaged || kHead == kFewRowsWideHead) {
    extern __shared__ __align__(1024) uint8_t few_rows_slots[];
    smem = few_rows_slots;
  } else {
    __shared__ __align__(16) float merge_floats[kMergeFloats<kHead, kFewRows>];
    smem = reinterpret_cast<uint8_t*>(merge_floats);
  }
  const RaggedCta cta = ragged_cta(p, grid);  // (slot b: sequence b)
  int32_t start, q_len;
  if (!few_rows_sequence<kHead>(p, cta, true, &start, &q_len)) return;
  if (q_len * cta.group <= 8)  // one n-tile, or two
    return attend_few_rows<kHead, kSwizzle, kLayout, 1>(p, grid, cta.slot, cta.kv_head,
                                                        cta.member, cta.split, start, q_len,
                                                        smem);
  if (q_len * cta.group <= kFewRows)
    return attend_few_rows<kHead, kSwizzle, kLayout, 2>(p, grid, cta.slot, cta.kv_head,
                                                        cta.member, cta.split, start, q_len,
                                                        smem);
  // 17 to 32 rows (taken at head size 128 only, where the build has sm_90a code:
  // FewRowsMaxRows): WideRowsKernel's
}

// The sequences of 17 to 32 rows the few-row kernels take; where the call is served alone
// under a bound past kFewRows rows (p.few_rows_only: the handler then launches this kernel
// without FewRowsKernel, whose launch, with nothing else to do at speculative decoding's 32
// rows, cost ~6 us of an H200's ~195), every sequence's, the fill and the NaN rows too. (The
// wide path's columns past a sequence's rows are padding: any count of rows up to 32 is
// right on it.)
template <bool kSwizzle, Layout kLayout>
__global__ void __launch_bounds__(kWideThreads, kWideCtasPerSm)
    WideRowsKernel(const RaggedProblem p, const RaggedGrid grid) {
  static_assert(kWideThreads == kThreads, "few_rows_sequence's fill and NaN rows");
  extern __shared__ __align__(1024) uint8_t wide_smem[];
  const RaggedCta cta = ragged_cta(p, grid);
  const bool alone = p.few_rows_only;
  int32_t start, q_len;
  if (!few_rows_sequence<kFewRowsWideHead>(p, cta, alone, &start, &q_len) ||
      (!alone && q_len * cta.group <= kFewRows))
    return;
  attend_wide_rows<kSwizzle, kLayout>(p, grid, cta.slot, cta.kv_head, cta.member, cta.split,
                                      start, q_len, wide_smem);
}

// Whether a call may have sequences of more than kFewRows rows for WideRowsKernel: the build
// and GPU take them (few_rows_max), and the caller's max_q_len (if any) lets them.
inline bool MayHaveWideRows(const RaggedProblem& p) {
  const int64_t group = p.num_q_heads / p.page.num_kv_heads;
  return p.page.head_size == kFewRowsWideHead && p.few_rows_max > kFewRows &&
         (p.max_q_len <= 0 || int64_t(p.max_q_len) * group > kFewRows);
}

// One of the few-row kernels over `blocks`, its dynamic shared memory configured first.
template <auto kKernel>
cudaError_t LaunchConfigured(cudaStream_t stream, dim3 blocks, int threads, int smem_bytes,
                             const RaggedProblem& p, const RaggedGrid& grid) {
  if (const cudaError_t configured = ConfigureDynamicSmem<kKernel>(smem_bytes);
      configured != cudaSuccess) {
    cudaGetLastError();  // reported here, not by the next launch's check
    return configured;
  }
  kKernel<<<blocks, threads, smem_bytes, stream>>>(p, grid);
  return cudaGetLastError();
}

template <int kHead, bool kSwizzle, Layout kLayout>
cudaError_t LaunchFewRowsKernel(cudaStream_t stream, const RaggedProblem& p, bool fill) {
  const RaggedGrid grid{0, FastDivmod(uint32_t(p.page.num_kv_heads)),
                        FastDivmod(uint32_t(p.num_q_heads / p.page.num_kv_heads)),
                        FastDivmod(uint32_t(p.page.block_size))};
  // Both kernels' grid: a CTA per (sequence, kv head); with `fill` (alone, or the ragged
  // kernel not launched), also the fill slots of the ragged kernel's grid.
  const int64_t fill_slots = fill ? FillSlots(p) : 0;
  const dim3 blocks(uint32_t((int64_t(p.max_num_seqs) + fill_slots) * p.page.num_kv_heads), 1,
                    uint32_t(p.stacked * p.num_splits));
  if (blocks.x == 0) return cudaSuccess;
  // Alone under a bound past kFewRows rows, WideRowsKernel does all of it (see there).
  const bool wide = kHead == kFewRowsWideHead && MayHaveWideRows(p);
  if (!(wide && p.few_rows_only)) {
    const cudaError_t error = LaunchConfigured<FewRowsKernel<kHead, kSwizzle, kLayout>>(
        stream, blocks, kThreads, kFewRowsSmem<kHead>, p, grid);
    if (error != cudaSuccess) return error;
  }
  if constexpr (kHead == kFewRowsWideHead) {
    if (wide)
      return LaunchConfigured<WideRowsKernel<kSwizzle, kLayout>>(
          stream, blocks, kWideThreads, WideShape::kSmemBytes, p, grid);
  }
  return cudaSuccess;
}

}  // namespace

int FewRowsResidentCtasPerSm(int head_size) {
  return WithHeadSize(
      head_size,
      [](auto head) {
        if constexpr (decltype(head)::value > kFewRowsMaxHead) {
          return 0;
        } else {
          constexpr int kHeadSize = decltype(head)::value;
          return ResidentCtasPerSm<FewRowsKernel<kHeadSize, true, Layout::kHND>>(
              kThreads, kFewRowsSmem<kHeadSize>);
        }
      },
      0);
}

int WideRowsResidentCtasPerSm(int head_size) {
  if (head_size != kFewRowsWideHead || !WgmmaCodeRuns()) return 0;
  return ResidentCtasPerSm<WideRowsKernel<true, Layout::kHND>>(kWideThreads,
                                                                WideShape::kSmemBytes);
}

int FewRowsMaxRows(int head_size) {
  return head_size == kFewRowsWideHead && WgmmaCodeRuns() ? kFewRowsWide : kFewRows;
}

cudaError_t LaunchFewRows(cudaStream_t stream, const RaggedProblem& p, bool fill) {
  if (p.max_num_seqs == 0 && !fill) return cudaSuccess;
  return WithHeadSize(
      p.page.head_size,
      [&](auto head) {
        if constexpr (decltype(head)::value > kFewRowsMaxHead) {  // not the kernel's
          return cudaSuccess;
        } else {
          return WithPageOptions(p.page, [&](auto swizzle, auto layout) {
            return LaunchFewRowsKernel<decltype(head)::value, decltype(swizzle)::value,
                                       decltype(layout)::value>(stream, p, fill);
          });
        }
      },
      cudaErrorInvalidValue);
}

}  // namespace nvfp4
