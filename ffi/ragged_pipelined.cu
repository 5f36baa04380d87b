// The pipelined prefill kernel of ragged paged attention (sm_90a, head size 128;
// benchmarks/NOTES.md, ragged v9 to v10): the sequences of more than kPipelinedMinRows query
// rows per kv head, two 64-row tiles of one sequence per CTA (design D of "Prefill: the next
// kernel", whose structure benchmarks/prefill_pipeline_probe.cu measured at 516 TFLOP/s on an
// H200 against 355 for the ragged kernel's). Three warpgroups: the producer copies the raw page
// bytes (the ragged kernel's cp.async ring, 64 positions a ring step) and converts them into
// one of PipeShape::kStages fp16 K/V stages of kStep positions (128, or 64 when switched so:
// Switches); each consumer multiplies its tile's rows by every stage on wgmma,
// asynchronously: the scores of step n and P V of step n - 1 are issued together, the softmax
// of step n runs while P V does, and a stage goes back to the producer (named barrier) once its
// P V is done. The two consumers take turns issuing their products (v15), so that one's
// softmax runs under the other's products. Registers move from the producer to the consumers
// (setmaxnreg). Each consumer keeps every position of its rows, so it writes them itself (no
// merge between warps). The file's rules hold, with one widening: a NaN in the V of a position
// that only rows of consumer 0's (later) tile may see reaches consumer 1's rows too when it
// lies in the step where consumer 1's rows end (through 0 x NaN in P V; the ragged kernel
// converts such positions as zeros).
// Launched by the ragged handler (ragged_cuda.cu) before the ragged kernel wherever
// PipelinedPrefillRuns: on an H200, 1.5x the ragged kernel's speed on long chunks (ragged v9).
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <string_view>

#include "attention_device.cuh"
#include "cuda_common.cuh"
#include "handlers.h"
#include "ragged_device.cuh"
#include "ragged_ffi.h"
#include "ragged_tiles.cuh"
#include "wgmma.cuh"

namespace nvfp4 {
namespace {

constexpr int kPipeThreads = 3 * kThreads;
// 128 x 56 + 256 x 224 registers <= 64 K (the probe: at 24 the producer spilled, D ran 0.64x)
constexpr int kProducerRegisters = 56, kConsumerRegisters = 224;

// A step of kStep positions (64, or 128: benchmarks/NOTES.md, ragged v10): the fp16 K/V stages
// handed from the producer to the consumers hold kStep positions each, in RaggedShape's layout
// with blocks of kStep rows; the raw ring holds RaggedShape's 64-position ring steps, kStep / 64
// of them converted per step. A consumer holds two stages at once (the scores of step n, P V of
// step n - 1), so the producer runs ahead only with three or more: 4 stages of 64 positions, or
// 3 of 128, which fit beside a raw ring of 3 slots (not RaggedShape's 4) only with both tiles'
// q in the last stage (q is in registers before that stage is first written: an extra phase of
// its empty barrier, kQInStage). Shared memory: the stages (1024-byte aligned), the raw ring,
// q (64: its own), row data, the consumers' ones: 207.75 KiB (64) or 226.75 KiB (128) of the
// 227 KiB a CTA may have.
template <int kStep>
struct PipeShape {
  using R = RaggedShape<kPipelinedHead>;
  static_assert(kStep == 64 || kStep == 128, "steps of 64 or 128 positions");
  static constexpr int kRawSteps = kStep / R::kKv;     // ring steps per step
  static constexpr int kStages = kStep == 64 ? 4 : 3;  // fp16 stages
  static constexpr int kRingSlots = kStep == 64 ? R::kStages : 3;
  static constexpr bool kQInStage = kStep == 128;
  static constexpr int kSTiles = kStep / 8;            // n-tiles of S
  static constexpr int kPSteps = kStep / 16;           // k-steps of P V
  static constexpr int kBlockBytes = kStep * 128;      // one 64-dim block of one side
  static constexpr int kSideBytes = kPipelinedHead / 64 * kBlockBytes;
  static constexpr int kStageBytes = 2 * kSideBytes;
  static constexpr int kQBytes = 2 * kRows * R::kStride * 2;
  static constexpr int kRingOffset = kStages * kStageBytes;
  static constexpr int kRingBytes = kRingSlots * R::kRawStageBytes;
  static constexpr int kQOffset =
      kQInStage ? (kStages - 1) * kStageBytes : kRingOffset + kRingBytes;
  static constexpr int kRowOffset = kRingOffset + kRingBytes + (kQInStage ? 0 : kQBytes);
  // 16 x 8 fp16 ones (two 8 x 16-byte core matrices): the B of the consumers' row sums.
  static constexpr int kOnesBytes = 256;
  static constexpr int kOnesOffset = kRowOffset + 2 * kRows * 3 * 4;
  static constexpr int kSmemBytes = kOnesOffset + kOnesBytes;
  static_assert(kOnesOffset % 16 == 0, "wgmma descriptors address 16-byte units");
  static_assert(kRingSlots >= 3, "a ring step converted, one landing, one in flight");
  static_assert(!kQInStage || kQBytes <= kStageBytes, "q fits a stage");
  static_assert(kSmemBytes <= kMaxSmemPerCta, "an sm_90 CTA's shared memory");
};

// Named barriers (0 is __syncthreads): stage i full (the producer arrives, the consumers wait)
// and empty (the consumers arrive, the producer waits), the producer's own, each consumer's.
constexpr int kMaxPipeStages = 4;
__device__ __forceinline__ int full_barrier(int stage) { return 1 + stage; }
__device__ __forceinline__ int empty_barrier(int stage) { return 1 + kMaxPipeStages + stage; }
constexpr int kProducerBarrier = 1 + 2 * kMaxPipeStages;
__device__ __forceinline__ int consumer_barrier(int c) { return 2 + 2 * kMaxPipeStages + c; }
// Consumer c's turn to issue its products (ragged v15): the consumers take turns, so that one's
// softmax runs while the other's products do (FlashAttention-3's ping-pong).
constexpr int kTurnBarrier = 4 + 2 * kMaxPipeStages;  // consumer 0's; consumer 1's the last id
__device__ __forceinline__ int turn_barrier(int c) { return kTurnBarrier + c; }
static_assert(kTurnBarrier + 1 < 16, "16 named barriers a CTA");

template <bool kSwizzle, Layout kLayout, int kStep>
__global__ void __launch_bounds__(kPipeThreads, 1)
    PipelinedPrefillKernel(const RaggedProblem p, const RaggedGrid grid, const bool turns) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  constexpr int kHead = kPipelinedHead;
  using R = RaggedShape<kHead>;
  using P = PipeShape<kStep>;
  static_assert(P::kStages <= kMaxPipeStages, "barrier ids");
  extern __shared__ __align__(1024) uint8_t smem[];
  uint8_t* const ring = smem + P::kRingOffset;
  uint16_t* const q_smem = reinterpret_cast<uint16_t*>(smem + P::kQOffset);
  int32_t* const row_end = reinterpret_cast<int32_t*>(smem + P::kRowOffset);
  float* const row_scale = reinterpret_cast<float*>(row_end + 2 * kRows);
  int32_t* const row_q = row_end + 4 * kRows;

  const int lane = threadIdx.x & 31;
  const int wg = threadIdx.x / kThreads, t = threadIdx.x % kThreads;
  const RaggedCta cta = ragged_cta(p, grid);
  const int32_t slot = cta.slot, kv_head = cta.kv_head, member = cta.member, split = cta.split;
  const int32_t group = cta.group, ns = cta.ns, num_tokens = p.num_tokens;
  const int32_t* const cu = cta.cu;
  const int64_t member_rows = cta.member_rows;

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

  const SplitRange range = split_range(p, grid, member, work.seq, work.q_len, split);
  const int32_t begin = range.begin;
  // Consumer 0's tile is the later one: its last row ends last.
  const int32_t last_end = range.row_end(grid, first_tile * kRows + rows_of(0) - 1);
  const auto q_row_of = [&](int c, int r) {  // row r of consumer c's tile among [T, Hq]
    uint32_t qh;
    const uint32_t j = grid.group.divmod(uint32_t((first_tile - c) * kRows + r), &qh);
    return member_rows + int64_t(work.start + int32_t(j)) * p.num_q_heads + kv_head * group +
           int32_t(qh);
  };
  // A sequence over max_q_len, or the member's global scales invalid: NaN rows.
  if (exceeds_max_q_len(p, work.q_len) || !member_scales_valid(p, member)) {
    if (wg > 0)
      for (int i = t; i < rows_of(wg - 1) * kHead; i += kThreads)
        write_nan(p, q_row_of(wg - 1, i / kHead), split, i % kHead, kHead);
    return;
  }
  if (begin >= last_end) {  // nothing to attend to in this split
    if (wg > 0)
      for (int i = t; i < rows_of(wg - 1) * kHead; i += kThreads)
        write_empty(p, q_row_of(wg - 1, i / kHead), split, i % kHead, kHead);
    return;
  }
  const int num_steps = (last_end - begin + kStep - 1) / kStep;
  const uint32_t end = uint32_t(last_end);

  if (wg == 0) {
    // The producer.
    setmaxnreg_dec<kProducerRegisters>();
    // The ones the consumers' row sums multiply P by: handed over with the first stage (the
    // fence before each full arrive covers them; a consumer issues P V only after that).
    if (t < P::kOnesBytes / 16)
      reinterpret_cast<uint4*>(smem + P::kOnesOffset)[t] =
          make_uint4(0x3C003C00u, 0x3C003C00u, 0x3C003C00u, 0x3C003C00u);  // fp16 1.0
    const PageView<kLayout> pv = tile_page_view<kLayout>(p, grid, member, work.seq, kv_head);
    static_assert(R::kThreadsPerVector == 1, "one producer thread per (position, side)");
    // Ring steps of 64 positions: kRawSteps of them per step.
    const int side = t / R::kKv, vector = t % R::kKv;
    const StageSlot<kHead> staged = stage_slot<kHead>(side, vector, 0);
    const int num_raw = num_steps * P::kRawSteps;
    TileCopies<kHead, kSwizzle, kLayout, P::kRingSlots> copies(ring, pv, staged, begin, end,
                                                               vector, side, 0);
#pragma unroll
    for (int raw = 0; raw < P::kRingSlots - 1; ++raw) {
      if (raw < num_raw) copies.copy_next(copies.next_page());
      copy_async_commit();
    }
    int32_t page_ahead = copies.next_page();
#pragma unroll 1
    for (int step = 0; step < num_steps; ++step) {
      const int stage = step % P::kStages;
#pragma unroll
      for (int h = 0; h < P::kRawSteps; ++h) {
        const int raw = step * P::kRawSteps + h;
        // This ring step's bytes have landed (the barrier: every producer thread's; also every
        // producer thread is done converting the ring step before, whose slot is reused below).
        copy_async_wait<P::kRingSlots - 2>();
        named_sync(kProducerBarrier, kThreads);
        // The stage's last reader is done (with q in the last stage, its first writing waits
        // for the consumers' q loads: that barrier's first phase).
        if (h == 0 && (step >= P::kStages || (P::kQInStage && step == P::kStages - 1)))
          named_sync(empty_barrier(stage), kPipeThreads);
        convert_vector<kHead, kSwizzle, P::kBlockBytes>(
            ring + (raw % P::kRingSlots) * R::kRawStageBytes, staged, side, h * R::kKv + vector, 0,
            copies.position_of(raw) < end, smem + stage * P::kStageBytes + side * P::kSideBytes);
        if (h == P::kRawSteps - 1) {
          fence_proxy_async_shared();  // read by wgmma next
          named_arrive(full_barrier(stage), kPipeThreads);
        }
        // The copies ahead only after the conversion (and after the hand-over where there is
        // one): the fence waits for this thread's memory operations in flight, and a copy
        // issued just before it made every step wait for its own global load (ncu, chunk 2048
        // over 32768: the fence and the arrive were 10% of the producer's stall samples, all
        // long scoreboard; ragged v9.1).
        const int ahead = raw + P::kRingSlots - 1;
        if (ahead < num_raw) {
          copies.copy_next(page_ahead);
          page_ahead = copies.next_page();
        }
        copy_async_commit();
      }
    }
    copy_async_wait<0>();
    // The stages' last hand-backs, so that no barrier is left mid-phase.
    for (int step = max(num_steps - P::kStages, 0); step < num_steps; ++step)
      named_sync(empty_barrier(step % P::kStages), kPipeThreads);
    if (P::kQInStage && num_steps < P::kStages)  // the q phase, where no step used the stage
      named_sync(empty_barrier(P::kStages - 1), kPipeThreads);
    return;
  }

  // A consumer.
  setmaxnreg_inc<kConsumerRegisters>();
  const int c = wg - 1;
  // Turns (when `turns`): every consumer takes one at each of the num_steps steps, issuing that
  // step's products in it (none past its own steps), consumer 0 first; consumer 1 passes no
  // turn after its last, so that no barrier is left mid-phase.
  const auto take_turn = [&] {
    if (turns) named_sync(turn_barrier(c), 2 * kThreads);
  };
  const auto pass_turn = [&](int step) {
    if (turns && (c == 0 || step < num_steps - 1)) named_arrive(turn_barrier(1 - c), 2 * kThreads);
  };
  if (turns && c == 1) named_arrive(turn_barrier(0), 2 * kThreads);
  const int rows_here = rows_of(c);
  const int warp = t >> 5, g = lane >> 2, qd = lane & 3;
  const float k_scale = p.k_scale[p.k_scale_stacked ? member : 0];
  const float sm_scale = p.sm_scale[p.sm_scale_stacked ? member : 0];
  const float qk_scale = k_scale * sm_scale;
  uint16_t* const my_q = q_smem + c * kRows * R::kStride;
  int32_t* const my_end = row_end + c * kRows;
  float* const my_scale = row_scale + c * kRows;
  int32_t* const my_q_row = row_q + c * kRows;
  // q into shared memory; the rows' ends, score scales and q rows beside it.
  stage_tile_q<kHead>(p, grid, range, t, rows_here, (first_tile - c) * kRows, qk_scale,
                      member_rows, [&](int r) { return q_row_of(c, r); }, my_q, my_end,
                      my_scale, my_q_row);

  named_sync(consumer_barrier(c), kThreads);

  uint32_t qf[R::kKSteps][4];
#pragma unroll
  for (int k = 0; k < R::kKSteps; ++k)
    ldmatrix_x4(qf[k], my_q + (warp * 16 + (lane & 15)) * R::kStride + 16 * k + (lane >> 4) * 8);
  const WarpRows rows = warp_rows(my_end, my_scale, warp * 16, rows_here, true, lane);
  // q is in registers: its shared memory, in the last stage, may be written (PipeShape).
  if (P::kQInStage) named_arrive(empty_barrier(P::kStages - 1), kPipeThreads);

  float m[2] = {-INFINITY, -INFINITY}, l[2] = {0.f, 0.f};
  // O's accumulators and, as one more tile of the same layout, the rows' sums of P: P times a
  // B of ones on the tensor cores beside P V (each of its columns is the row's sum), rescaled
  // with O. They sum the fp16 P that P V multiplies, with no FADD a score and no shuffles.
  float o[R::kOTiles + 1][4];
  float(&sums)[4] = o[R::kOTiles];
#pragma unroll
  for (int i = 0; i < R::kOTiles + 1; ++i)
#pragma unroll
    for (int k = 0; k < 4; ++k) o[i][k] = 0.f;
  using Accumulators = float[(R::kOTiles + 1) * 4];
  float s[P::kSTiles][4];
  uint32_t a[P::kPSteps][4];  // P of the step before, wgmma A fragments
  const uint64_t k_desc = swizzled_desc(smem, 16, 1024);
  const uint64_t v_desc = swizzled_desc(smem + P::kSideBytes, P::kBlockBytes, 1024);
  // (every byte of the tile is a one, so any reading of the two core matrices reads ones)
  const uint64_t ones_desc = interleaved_desc(smem + P::kOnesOffset, 128, 128);

  const auto issue_scores = [&](int stage) {
#pragma unroll
    for (int i = 0; i < P::kSTiles; ++i)
#pragma unroll
      for (int k = 0; k < 4; ++k) s[i][k] = 0.f;
    float(&acc)[kStep / 2] = reinterpret_cast<float(&)[kStep / 2]>(s);
    wgmma_fence_operands(acc);
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < R::kKSteps; ++k) {
      const uint64_t b = desc_plus(k_desc, stage * P::kStageBytes + (k / 4) * P::kBlockBytes +
                                               (k % 4) * 32);
      if constexpr (kStep == 64)
        wgmma_64x64<0>(acc, qf[k], b);
      else
        wgmma_64x128<0>(acc, qf[k], b);
    }
    wgmma_commit();
  };
  const auto issue_values = [&](int stage) {
    float(&acc)[R::kOTiles * 4] = reinterpret_cast<float(&)[R::kOTiles * 4]>(o);
    wgmma_fence_operands(reinterpret_cast<Accumulators&>(o));
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < P::kPSteps; ++k) {
      wgmma_64x128<1>(acc, a[k], desc_plus(v_desc, stage * P::kStageBytes + 16 * k * 128));
      wgmma_64x8(sums, a[k], ones_desc);
    }
    wgmma_commit();
  };
  // The online softmax of step `step`'s scores (landed), fenced on both sides by empty asms that
  // take the scores: it starts after the wait for S and is done before the wait for P V.
  const auto softmax = [&](int step, float (&alpha)[2]) {
    float(&acc)[kStep / 2] = reinterpret_cast<float(&)[kStep / 2]>(s);
    wgmma_fence_operands(acc);
    online_softmax<P::kSTiles, false>(s, begin + step * kStep, kStep, rows, qd, m, l, alpha);
    wgmma_fence_operands(acc);
  };
  // After the P V of the step before is done: O rescaled to the new max, P packed.
  const auto rescale_and_pack = [&](const float (&alpha)[2]) {
    wgmma_fence_operands(reinterpret_cast<Accumulators&>(o));
    rescale_o(o, alpha);  // and the sums
    pack_p(s, a);
  };

  // This consumer's own steps: up to the end of its last row (consumer 1's tile ends before
  // consumer 0's; a consumer without a tile has none). Past them it hands the stages back
  // unread, so that the positions only consumer 0's rows see never enter consumer 1's P V.
  const int32_t own_end =
      rows_here > 0 ? range.row_end(grid, (first_tile - c) * kRows + rows_here - 1) : begin;
  const int my_steps = own_end > begin ? (own_end - begin + kStep - 1) / kStep : 0;
  if (my_steps > 0) {
    float alpha[2];
    named_sync(full_barrier(0), kPipeThreads);
    take_turn();
    issue_scores(0);
    pass_turn(0);
    wgmma_wait<0>();
    softmax(0, alpha);
    rescale_and_pack(alpha);
    // Then whole rounds of the stages, unrolled: the stage offsets are constants (stage
    // arithmetic in uniform registers while a product is in flight made ptxas wait for it).
#pragma unroll 1
    for (int round = 0; round < my_steps; round += P::kStages) {
#pragma unroll
      for (int j = 1; j <= P::kStages; ++j) {
        const int step = round + j;
        if (step >= my_steps) break;
        const int stage = j % P::kStages, before = j - 1;
        named_sync(full_barrier(stage), kPipeThreads);
        take_turn();
        issue_scores(stage);
        issue_values(before);
        pass_turn(step);
        wgmma_wait<1>();
        softmax(step, alpha);
        wgmma_wait<0>();
        named_arrive(empty_barrier(before), kPipeThreads);
        rescale_and_pack(alpha);
      }
    }
    const int last = (my_steps - 1) % P::kStages;
    issue_values(last);
    wgmma_wait<0>();
    named_arrive(empty_barrier(last), kPipeThreads);
    wgmma_fence_operands(reinterpret_cast<Accumulators&>(o));
  }
  for (int step = my_steps; step < num_steps; ++step) {
    named_sync(full_barrier(step % P::kStages), kPipeThreads);
    take_turn();
    pass_turn(step);
    named_arrive(empty_barrier(step % P::kStages), kPipeThreads);
  }

  // The epilogue by quad shuffles (ragged v25): each row's 128 dims lie in the 4 lanes of a
  // quad, lane qd holding dims pde(qd) and pde(qd) + 4 of every 8-dim group (pde =
  // permuted_dim_even), so a 4 x 4 transpose of packed words inside the quad gives each lane
  // whole groups (4m + qd, m = 0..3) and it writes them in 16-byte stores; no shared memory, no
  // barrier (v24 staged the rows through the stages behind two barriers: 6 us a CTA against
  // 1.3 on an H100). One division a row (out_scale / l), then a product a value. Each row's sum
  // is its column 2 qd of the sums tile; a row that saw nothing in this split gets the empty
  // result (zeros, lse -inf). The shuffles run in every lane (full mask); rows past rows_here
  // store nothing.
  l[0] = sums[0];
  l[1] = sums[2];
  const bool one_split = p.num_splits == 1;
  const bool wide_values = !one_split || p.q_type == QType::kF32;  // float32 out
  const float out_scale = split_out_scale(p, member);
  const bool low_bit = qd & 1, high_bit = qd & 2;
  // a[j]: this lane's word of group 4m + j -> lane j's word of group 4m + qd.
  const auto quad_transpose = [&](uint32_t(&a)[4]) {
#pragma unroll
    for (int j = 0; j < 2; ++j) {
      const uint32_t got = __shfl_xor_sync(kFullMask, high_bit ? a[j] : a[j + 2], 2);
      a[j] = high_bit ? got : a[j];
      a[j + 2] = high_bit ? a[j + 2] : got;
    }
#pragma unroll
    for (int j = 0; j < 4; j += 2) {
      const uint32_t got = __shfl_xor_sync(kFullMask, low_bit ? a[j] : a[j + 1], 1);
      a[j] = low_bit ? got : a[j];
      a[j + 1] = low_bit ? a[j + 1] : got;
    }
  };
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int r = warp * 16 + g + 8 * h;
    const bool here = r < rows_here;
    const bool empty = m[h] == -INFINITY && !isnan(l[h]);
    const float lse2 = m[h] + __log2f(l[h]);
    const int64_t row = member_rows + (here ? my_q_row[r] : 0);
    if (here && qd == 0) write_row_lse(p, row, split, empty ? -INFINITY : lse2);
    const float factor = out_scale / l[h];
    const auto value = [&](int i, int k) { return empty ? 0.f : o[i][2 * h + k] * factor; };
    if (wide_values) {
      float* const to = row_values_f32(p, row, split, kHead);
#pragma unroll
      for (int mq = 0; mq < R::kOTiles / 4; ++mq) {
        uint32_t lo[4], hi[4];  // dims pde(j) and pde(j) + 4 of group 4 mq + j
#pragma unroll
        for (int j = 0; j < 4; ++j)
          lo[j] = __float_as_uint(value(4 * mq + j, 0)),
          hi[j] = __float_as_uint(value(4 * mq + j, 1));
        quad_transpose(lo);
        quad_transpose(hi);
        // lane j's words hold dims pde(j) (lo) and + 4 (hi): pde = 0, 2, 1, 3
        if (here) {
          uint4* const at = reinterpret_cast<uint4*>(to + 8 * (4 * mq + qd));
          at[0] = make_uint4(lo[0], lo[2], lo[1], lo[3]);
          at[1] = make_uint4(hi[0], hi[2], hi[1], hi[3]);
        }
      }
    } else {
      uint8_t* const to = static_cast<uint8_t*>(p.out) + row * kHead * 2;
#pragma unroll
      for (int mq = 0; mq < R::kOTiles / 4; ++mq) {
        uint32_t a[4];  // (dim pde(j), dim pde(j) + 4) of group 4 mq + j, low half first
#pragma unroll
        for (int j = 0; j < 4; ++j)
          a[j] = pack_out16x2(p.q_type, value(4 * mq + j, 0), value(4 * mq + j, 1));
        quad_transpose(a);
        if (here)
          *reinterpret_cast<uint4*>(to + 16 * (4 * mq + qd)) =
              make_uint4(prmt(a[0], a[2], 0x5410), prmt(a[1], a[3], 0x5410),
                         prmt(a[0], a[2], 0x7632), prmt(a[1], a[3], 0x7632));
      }
    }
  }
#else
  __trap();  // launched only where the build has sm_90a code (PipelinedPrefillRuns)
#endif
}

// The developers' switches in the environment of the process, read once (one build then
// measures and tests both sides):
// - JAX_NVFP4_RAGGED_PIPELINED: 0 leaves the long sequences to the ragged kernel
//   (tests/gpu_checks.sh part ragged-tile), 64 runs the kernel in steps of 64 positions
//   (the default until the thirtieth session; benchmarks/NOTES.md, "steps of 128"), anything
//   else or nothing in steps of 128 (2-3.5% faster on an H200 at every prefill point since
//   v15's turns and v18's row sums; ragged v10, before them, was not);
// - JAX_NVFP4_RAGGED_PINGPONG: 0 lets the consumers issue their products whenever their stage
//   is full (ragged v9 to v14), anything else or nothing makes them take turns (v15).
struct PipelinedSwitches {
  int step;
  bool turns;
};

const PipelinedSwitches& Switches() {
  static const PipelinedSwitches switches = [] {
    const auto value = [](const char* name) {
      const char* v = std::getenv(name);
      return v == nullptr ? std::string_view() : std::string_view(v);
    };
    const std::string_view step = value("JAX_NVFP4_RAGGED_PIPELINED");
    return PipelinedSwitches{step == "0" ? 0 : step == "64" ? 64 : 128,
                             value("JAX_NVFP4_RAGGED_PINGPONG") != "0"};
  }();
  return switches;
}

// Whether the current GPU runs the pipelined prefill kernel in steps of kStep: an sm_90 device,
// and the build's code for it the sm_90a kernel, whose register hand-over (setmaxnreg) needs
// exactly the launch's 168 registers a thread: asked once per device (an attribute query,
// allowed while XLA captures a command buffer).
template <bool kSwizzle, Layout kLayout, int kStep>
bool PipelinedPrefillRuns() {
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
        cudaFuncGetAttributes(&attributes, PipelinedPrefillKernel<kSwizzle, kLayout, kStep>) ==
            cudaSuccess &&
        attributes.numRegs * kPipeThreads ==
            kThreads * (kProducerRegisters + 2 * kConsumerRegisters);
    if (!ok) cudaGetLastError();  // (a failed query is an answer, not an error of the call)
    if (ok) runs.fetch_or(bit, std::memory_order_release);
    asked.fetch_or(bit, std::memory_order_release);
  }
  return runs.load(std::memory_order_acquire) & bit;
}

template <bool kSwizzle, Layout kLayout, int kStep>
cudaError_t LaunchPipelinedPrefillKernel(cudaStream_t stream, RaggedProblem* p) {
  // A CTA per pair of tiles (slots past the last pair exit after the scan). A sequence it takes
  // has r > kPipelinedMinRows rows and ceil(r / 128) <= r / 128 + 1 pairs, so with R rows in all
  // and at most min(S, R / (kPipelinedMinRows + 1)) such sequences, R / 128 plus that count
  // bounds the pairs (and with a max_q_len bound below them, nothing is launched).
  const int32_t group = p->num_q_heads / int32_t(p->page.num_kv_heads);
  const int64_t rows = int64_t(p->num_tokens) * group;
  const int64_t row_bound = p->max_q_len > 0 ? int64_t(p->max_q_len) * group : rows;
  const int64_t long_seqs = std::min<int64_t>(p->max_num_seqs, rows / (kPipelinedMinRows + 1));
  const int64_t pair_slots = long_seqs == 0 ? 0 : rows / (2 * kRows) + long_seqs;
  // (under few_rows_max, >= kPipelinedMinRows, every sequence is the few-row or decode kernel's)
  if (p->few_rows_only || row_bound <= p->few_rows_max || pair_slots == 0 ||
      !PipelinedPrefillRuns<kSwizzle, kLayout, kStep>())
    return cudaSuccess;
  constexpr int kSmemBytes = PipeShape<kStep>::kSmemBytes;
  const cudaError_t configured =
      ConfigureSharedMemory<PipelinedPrefillKernel<kSwizzle, kLayout, kStep>>(kSmemBytes);
  if (configured != cudaSuccess) return configured;
  p->pipelined = 1;
  const RaggedGrid grid{0, FastDivmod(uint32_t(p->page.num_kv_heads)),
                        FastDivmod(uint32_t(group)), FastDivmod(uint32_t(p->page.block_size))};
  PipelinedPrefillKernel<kSwizzle, kLayout, kStep>
      <<<dim3(uint32_t(pair_slots * p->page.num_kv_heads), 1,
              uint32_t(p->stacked * p->num_splits)),
         kPipeThreads, kSmemBytes, stream>>>(*p, grid, Switches().turns);
  return cudaGetLastError();
}

}  // namespace

bool WgmmaCodeRuns() { return PipelinedPrefillRuns<true, Layout::kHND, 64>(); }

cudaError_t LaunchPipelinedPrefill(cudaStream_t stream, RaggedProblem* p) {
  const int step = Switches().step;
  if (p->page.head_size != kPipelinedHead || step == 0) return cudaSuccess;
  return WithPageOptions(p->page, [&](auto swizzle, auto layout) {
    constexpr bool kSwizzle = decltype(swizzle)::value;
    constexpr Layout kLayout = decltype(layout)::value;
    return step == 128 ? LaunchPipelinedPrefillKernel<kSwizzle, kLayout, 128>(stream, p)
                       : LaunchPipelinedPrefillKernel<kSwizzle, kLayout, 64>(stream, p);
  });
}

}  // namespace nvfp4
