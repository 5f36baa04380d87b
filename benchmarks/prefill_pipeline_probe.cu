// Timing probe for the next prefill kernel (issue 17; benchmarks/NOTES.md, "Prefill: the next
// kernel"): how fast can one SM turn NVFP4 K/V into fp16 and run a 64-row FlashAttention step on
// wgmma, organised three ways? No attention result is checked: each variant does the real work
// of a prefill step on synthetic pages (the conversion of ffi/attention_device.cuh, the wgmma
// helpers and shared-memory layout of ffi/wgmma.cuh and ffi/ragged_cuda.cu, an online softmax
// over the scores), and the printed TFLOP/s count 4 x 64 x 64 x 128 per 64-row tile per step.
//
//   A  "today": one warpgroup per CTA converts a step's 64 positions of K and V into shared
//      memory, waits at a barrier, then runs S = Q K^T, the softmax and O += P V (synchronous
//      wgmma); 2 CTAs per SM (the ragged kernel's wgmma path, its 94 KB of shared memory).
//   B  warp-specialised, one tile: a producer warpgroup converts steps into a ring of fp16
//      stages while two consumer warpgroups take alternate steps of the same 64-row tile
//      (each its own softmax state; they would merge at the end); named barriers hand the
//      stages over; 1 CTA per SM.
//   C  warp-specialised, two tiles: the same producer, but both consumers read every stage,
//      each with its own 64 rows (a CTA of 128 rows: half the conversion per FLOP).
//   B0, C0  B and C with the producer copying without converting: the structure's ceiling.
//   D  C with asynchronous consumers (FlashAttention-3's intra-warpgroup overlap): a consumer
//      issues S = Q K^T of step n and O += P V of step n - 1 together, waits for S only, runs
//      step n's softmax while P V runs on the tensor cores, then waits for P V, frees stage
//      n - 1 and rescales O.
//   E  D with the two consumers taking turns to issue their products (named barriers: one
//      warpgroup's softmax runs while the other's products do; FlashAttention-3's ping-pong).
//
// Build and run on a Hopper GPU, from the repository root:
//   nvcc -gencode arch=compute_90a,code=sm_90a -O3 -std=c++17 -I ffi \
//     -I "$(python3 -c 'import jax.ffi; print(jax.ffi.include_dir())')" \
//     -o prefill_pipeline_probe benchmarks/prefill_pipeline_probe.cu
//   ./prefill_pipeline_probe [steps per CTA, default 512]
// Compare with prefill_bench.py's chunked rows (the kernel: 232-256 TFLOP/s on an H200; cuDNN's
// dense bf16 560-650; the issue's target 0.8x cuDNN).
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

#include "attention_device.cuh"
#include "cuda_check.h"
#include "wgmma.cuh"


namespace prefill_probe {

using namespace nvfp4;

constexpr int kHead = 128;                      // head size
constexpr int kKv = 64;                         // positions a step
constexpr int kBlockBytes = kKv * 128;          // one 64-dim block of one side, fp16
constexpr int kSideBytes = 2 * kBlockBytes;     // K or V of a step
constexpr int kStageBytes = 2 * kSideBytes;     // K then V: 32 KB
constexpr int kRecordCodes = kHead / 2;         // code bytes of one (position, side)
constexpr int kRecordScales = kHead / 16;       // scale bytes of one (position, side)
constexpr int kRecords = 1 << 18;               // synthetic page records (16 MB of codes)
constexpr int kWarpgroup = 128;

// Byte offset in a side of the 16 bytes holding dims [8c, 8c + 8) of position p (ragged_cuda.cu
// kv_chunk: 64-dim blocks of 128-byte rows, 128-byte swizzle).
__device__ __forceinline__ int kv_chunk(int p, int c) {
  return (c >> 3) * kBlockBytes + swizzle128_offset(p, 8 * (c & 7));
}

// One (position, side) head vector as read from the pages: 64 code bytes, 8 scale bytes.
struct Raw {
  uint4 code[4];
  uint2 scale;
};

__device__ __forceinline__ Raw load_raw(const uint8_t* codes, const uint8_t* scales,
                                        int64_t record) {
  Raw r;
  const uint4* c = reinterpret_cast<const uint4*>(codes + record * kRecordCodes);
#pragma unroll
  for (int i = 0; i < 4; ++i) r.code[i] = __ldg(c + i);
  r.scale = __ldg(reinterpret_cast<const uint2*>(scales + record * kRecordScales));
  return r;
}

// The head vector as fp16 codes times block scales into a side of a stage (the conversion of
// ragged_cuda.cu's convert_vector for linear scales); with kConvert false the code words are
// stored as they are (the structure's ceiling).
template <bool kConvert>
__device__ __forceinline__ void convert(const Raw& r, int position, uint8_t* side) {
  const uint32_t words[16] = {r.code[0].x, r.code[0].y, r.code[0].z, r.code[0].w,
                              r.code[1].x, r.code[1].y, r.code[1].z, r.code[1].w,
                              r.code[2].x, r.code[2].y, r.code[2].z, r.code[2].w,
                              r.code[3].x, r.code[3].y, r.code[3].z, r.code[3].w};
  const uint32_t scale_words[2] = {r.scale.x, r.scale.y};
#pragma unroll
  for (int pair = 0; pair < 4; ++pair) {
    const uint32_t scale2 = e4m3x2_to_f16x2_x128(scale_words[pair / 2] >> (16 * (pair % 2)));
#pragma unroll
    for (int half = 0; half < 2; ++half) {
      const uint32_t scale = prmt(scale2, scale2, half ? 0x3232 : 0x1010);
#pragma unroll
      for (int k = 0; k < 2; ++k) {
        const int w = 4 * pair + 2 * half + k;
        uint4* dst = reinterpret_cast<uint4*>(side + kv_chunk(position, w));
        if constexpr (kConvert) {
          uint32_t x[4];
          e2m1x8_to_f16x2(words[w], x);
          *dst = make_uint4(hmul2(x[0], scale), hmul2(x[1], scale), hmul2(x[2], scale),
                            hmul2(x[3], scale));
        } else {
          *dst = make_uint4(words[w], words[w] ^ scale, words[w], words[w]);
        }
      }
    }
  }
}

// A consumer warpgroup's state: its 64 rows' q as wgmma A fragments, the online softmax and O.
struct Consumer {
  uint32_t qf[kHead / 16][4];
  float m[2], l[2];
  float o[kHead / 8][4];

  __device__ __forceinline__ void init(int seed) {
    const int lane = threadIdx.x & 31;
#pragma unroll
    for (int k = 0; k < kHead / 16; ++k)
#pragma unroll
      for (int c = 0; c < 4; ++c)
        qf[k][c] = pack_f16x2(float((lane + 3 * k + c + seed) % 7) - 3.f,
                              float((lane * 5 + k + 2 * c) % 9) - 4.f);
    m[0] = m[1] = -INFINITY;
    l[0] = l[1] = 0.f;
#pragma unroll
    for (int t = 0; t < kHead / 8; ++t)
#pragma unroll
      for (int c = 0; c < 4; ++c) o[t][c] = 0.f;
  }

  // One step over a stage: S = Q K^T, the online softmax, O += P V (ragged_cuda.cu's wgmma
  // path, synchronous).
  __device__ __forceinline__ void step(const uint8_t* stage, float score_scale) {
    const uint8_t* k_tile = stage;
    const uint8_t* v_tile = stage + kSideBytes;
    float s[kKv / 8][4];
#pragma unroll
    for (int t = 0; t < kKv / 8; ++t)
#pragma unroll
      for (int c = 0; c < 4; ++c) s[t][c] = 0.f;
    float(&acc)[32] = reinterpret_cast<float(&)[32]>(s);
    wgmma_fence_operands(acc);
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < kHead / 16; ++k)
      wgmma_64x64<0>(acc, qf[k],
                     swizzled_desc(k_tile + (k / 4) * kBlockBytes + (k % 4) * 32, 16, 1024));
    wgmma_commit_and_wait();
    wgmma_fence_operands(acc);

    float top[2] = {m[0], m[1]};
#pragma unroll
    for (int t = 0; t < kKv / 8; ++t)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        s[t][c] *= score_scale;
        top[c >> 1] = fmaxf(top[c >> 1], s[t][c]);
      }
    float alpha[2], offset[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      top[h] = fmaxf(top[h], __shfl_xor_sync(0xFFFFFFFFu, top[h], 1));
      top[h] = fmaxf(top[h], __shfl_xor_sync(0xFFFFFFFFu, top[h], 2));
      offset[h] = top[h] == -INFINITY ? 0.f : top[h];
      alpha[h] = exp2_approx(m[h] - offset[h]);
      m[h] = top[h];
      l[h] *= alpha[h];
    }
    if (__any_sync(0xFFFFFFFFu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
      for (int t = 0; t < kHead / 8; ++t)
#pragma unroll
        for (int c = 0; c < 4; ++c) o[t][c] *= alpha[c >> 1];
    }
#pragma unroll
    for (int t = 0; t < kKv / 8; ++t)
#pragma unroll
      for (int c = 0; c < 4; ++c) {
        s[t][c] = exp2_approx(s[t][c] - offset[c >> 1]);
        l[c >> 1] += s[t][c];
      }
    uint32_t a[kKv / 16][4];
#pragma unroll
    for (int k = 0; k < kKv / 16; ++k) {
      a[k][0] = pack_f16x2(s[2 * k][0], s[2 * k][1]);
      a[k][1] = pack_f16x2(s[2 * k][2], s[2 * k][3]);
      a[k][2] = pack_f16x2(s[2 * k + 1][0], s[2 * k + 1][1]);
      a[k][3] = pack_f16x2(s[2 * k + 1][2], s[2 * k + 1][3]);
    }
    float(&oacc)[kHead / 2] = reinterpret_cast<float(&)[kHead / 2]>(o);
    wgmma_fence_operands(oacc);
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < kKv / 16; ++k)
      wgmma_64x128<1>(oacc, a[k], swizzled_desc(v_tile + 16 * k * 128, kBlockBytes, 1024));
    wgmma_commit_and_wait();
    wgmma_fence_operands(oacc);
  }

  // Something of every accumulator reaches global memory (nothing is dead code).
  __device__ __forceinline__ void finish(float* out) {
    float sum = l[0] + l[1];
#pragma unroll
    for (int t = 0; t < kHead / 8; ++t)
#pragma unroll
      for (int c = 0; c < 4; ++c) sum += o[t][c];
    atomicAdd(out, sum);
  }
};

// The register split of D and E (setmaxnreg): the producer needs few, a pipelined consumer more
// than the 168 a thread that 384 threads get at launch (128 x 56 + 256 x 224 <= 64 K; at 24
// registers the producer spilled 102 times a step).
constexpr int kProducerRegisters = 56, kConsumerRegisters = 224;

// A consumer with FlashAttention-3's intra-warpgroup overlap (D, E): the scores of step n and
// the P V of step n - 1 in flight together; the softmax of step n between their waits.
struct PipelinedConsumer {
  Consumer c;                    // q, the softmax state, O
  float s[kKv / 8][4];           // the scores of the step in flight
  uint32_t a[kKv / 16][4];       // P of the step before (wgmma A fragments)

  // (descriptors from bases built once, stage offsets compile-time: the loop below is unrolled
  // over the stages so that no stage arithmetic lands in uniform registers while a product is
  // in flight, which makes ptxas wait for it)
  __device__ __forceinline__ void issue_scores(uint64_t k_desc) {
#pragma unroll
    for (int t = 0; t < kKv / 8; ++t)
#pragma unroll
      for (int k = 0; k < 4; ++k) s[t][k] = 0.f;
    float(&acc)[32] = reinterpret_cast<float(&)[32]>(s);
    wgmma_fence_operands(acc);
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < kHead / 16; ++k)
      wgmma_64x64<0>(acc, c.qf[k], desc_plus(k_desc, (k / 4) * kBlockBytes + (k % 4) * 32));
    wgmma_commit();
  }
  __device__ __forceinline__ void issue_values(uint64_t v_desc) {
    float(&oacc)[kHead / 2] = reinterpret_cast<float(&)[kHead / 2]>(c.o);
    wgmma_fence_operands(oacc);
    wgmma_fence();
#pragma unroll
    for (int k = 0; k < kKv / 16; ++k)
      wgmma_64x128<1>(oacc, a[k], desc_plus(v_desc, 16 * k * 128));
    wgmma_commit();
  }
  // The online softmax of the scores (landed): the new max and sum, P into `a` after O's
  // rescale, which waits for the P V in flight (waited for by the caller first).
  __device__ __forceinline__ void softmax(float score_scale, float (&alpha)[2]) {
    float(&acc)[32] = reinterpret_cast<float(&)[32]>(s);
    wgmma_fence_operands(acc);
    float top[2] = {c.m[0], c.m[1]};
#pragma unroll
    for (int t = 0; t < kKv / 8; ++t)
#pragma unroll
      for (int k = 0; k < 4; ++k) top[k >> 1] = fmaxf(top[k >> 1], s[t][k] * score_scale);
    float offset[2];
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      top[h] = fmaxf(top[h], __shfl_xor_sync(0xFFFFFFFFu, top[h], 1));
      top[h] = fmaxf(top[h], __shfl_xor_sync(0xFFFFFFFFu, top[h], 2));
      offset[h] = top[h] == -INFINITY ? 0.f : top[h];
      alpha[h] = exp2_approx(c.m[h] - offset[h]);
      c.m[h] = top[h];
      c.l[h] *= alpha[h];
    }
#pragma unroll
    for (int t = 0; t < kKv / 8; ++t)
#pragma unroll
      for (int k = 0; k < 4; ++k) {
        s[t][k] = exp2_approx(__fmaf_rn(s[t][k], score_scale, -offset[k >> 1]));
        c.l[k >> 1] += s[t][k];
      }
    // (an empty asm that takes the results: the compiler must finish the softmax before the
    // caller's wait for P V, which it would otherwise sink it past)
    wgmma_fence_operands(acc);
  }
  __device__ __forceinline__ void rescale_and_pack(const float (&alpha)[2]) {
    float(&oacc)[kHead / 2] = reinterpret_cast<float(&)[kHead / 2]>(c.o);
    wgmma_fence_operands(oacc);
    if (__any_sync(0xFFFFFFFFu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
      for (int t = 0; t < kHead / 8; ++t)
#pragma unroll
        for (int k = 0; k < 4; ++k) c.o[t][k] *= alpha[k >> 1];
    }
#pragma unroll
    for (int k = 0; k < kKv / 16; ++k) {
      a[k][0] = pack_f16x2(s[2 * k][0], s[2 * k][1]);
      a[k][1] = pack_f16x2(s[2 * k][2], s[2 * k][3]);
      a[k][2] = pack_f16x2(s[2 * k + 1][0], s[2 * k + 1][1]);
      a[k][3] = pack_f16x2(s[2 * k + 1][2], s[2 * k + 1][3]);
    }
  }
};

// The record (position, side) thread t of a converting warpgroup takes in step s of CTA b.
__device__ __forceinline__ int64_t record_of(int b, int s, int t) {
  return (int64_t(b) * 977 + int64_t(s) * 2 * kKv + t) & (kRecords - 1);
}

// A: one warpgroup converts, then multiplies; 2 CTAs per SM (its dynamic shared memory is sized
// like the ragged kernel's, 94 KB, of which it uses one stage).
template <bool kConvert>
__global__ void __launch_bounds__(kWarpgroup, 2)
    ProbeToday(const uint8_t* codes, const uint8_t* scales, int steps, float* out) {
  extern __shared__ __align__(1024) uint8_t smem[];
  const int t = threadIdx.x;
  const int side = t / kKv, position = t % kKv;
  Consumer c;
  c.init(blockIdx.x);
  Raw next = load_raw(codes, scales, record_of(blockIdx.x, 0, t));
  for (int s = 0; s < steps; ++s) {
    const Raw raw = next;
    if (s + 1 < steps) next = load_raw(codes, scales, record_of(blockIdx.x, s + 1, t));
    __syncthreads();  // the stage's previous step has been read
    convert<kConvert>(raw, position, smem + side * kSideBytes);
    fence_proxy_async_shared();
    __syncthreads();  // the stage is complete
    c.step(smem, 0.0625f);
  }
  c.finish(out + blockIdx.x);
}

// Named barriers of B to E (0 is __syncthreads): stage i full (the producer arrives, the
// stage's consumers sync) and empty (the consumers arrive, the producer syncs before it writes
// the stage again).
__device__ __forceinline__ int full_barrier(int stage) { return 1 + stage; }
template <int kStages>
__device__ __forceinline__ int empty_barrier(int stage) { return 1 + kStages + stage; }

// The producer of B, C, D and E (warpgroup 0, thread t): each step's raw records loaded a step
// ahead into registers, converted into stage s % kStages once its consumers have handed it
// back (empty), then handed over (full); `users` threads take part in each barrier.
template <bool kConvert, int kStages>
__device__ __forceinline__ void produce(const uint8_t* codes, const uint8_t* scales, int steps,
                                        int t, uint8_t* smem, int users) {
  const int side = t / kKv, position = t % kKv;
  Raw next = load_raw(codes, scales, record_of(blockIdx.x, 0, t));
  for (int s = 0; s < steps; ++s) {
    const int stage = s % kStages;
    const Raw raw = next;
    if (s + 1 < steps) next = load_raw(codes, scales, record_of(blockIdx.x, s + 1, t));
    if (s >= kStages) named_sync(empty_barrier<kStages>(stage), users);
    convert<kConvert>(raw, position, smem + stage * kStageBytes + side * kSideBytes);
    fence_proxy_async_shared();
    named_arrive(full_barrier(stage), users);
  }
}

// B (kShared false) and C (kShared true): warpgroup 0 converts into kStages stages; warpgroups
// 1 and 2 consume (B: alternate steps of one tile; C: every step, a tile each); named barriers
// as in full_barrier and empty_barrier.
template <bool kConvert, bool kShared, int kStages>
__global__ void __launch_bounds__(3 * kWarpgroup, 1)
    ProbeSpecialised(const uint8_t* codes, const uint8_t* scales, int steps, float* out) {
  extern __shared__ __align__(1024) uint8_t smem[];
  static_assert(kShared || kStages % 2 == 0, "B: each stage is consumed by one warpgroup");
  constexpr int kUsers = kWarpgroup * (kShared ? 3 : 2);  // threads at each stage's barriers
  const int wg = threadIdx.x / kWarpgroup, t = threadIdx.x % kWarpgroup;
  const auto full = full_barrier;
  const auto empty = empty_barrier<kStages>;
  if (wg == 0) return produce<kConvert, kStages>(codes, scales, steps, t, smem, kUsers);
  const int consumer = wg - 1;
  Consumer c;
  c.init(blockIdx.x * 2 + consumer);
  for (int s = kShared ? 0 : consumer; s < steps; s += kShared ? 1 : 2) {
    const int stage = s % kStages;
    named_sync(full(stage), kUsers);
    c.step(smem + stage * kStageBytes, 0.0625f);
    named_arrive(empty(stage), kUsers);
  }
  c.finish(out + blockIdx.x);
}

// D (kPingPong false) and E (true): C's producer and stages; the consumers pipelined. Named
// barriers as in C, plus turn(0), turn(1) = 1 + 2 kStages, 2 + 2 kStages for E's order.
template <int kStages, bool kPingPong>
__global__ void __launch_bounds__(3 * kWarpgroup, 1)
    ProbePipelined(const uint8_t* codes, const uint8_t* scales, int steps, float* out) {
  extern __shared__ __align__(1024) uint8_t smem[];
  static_assert(2 * kStages + 2 <= 16, "named barriers");
  constexpr int kUsers = 3 * kWarpgroup;
  const int wg = threadIdx.x / kWarpgroup, t = threadIdx.x % kWarpgroup;
  const auto full = full_barrier;
  const auto empty = empty_barrier<kStages>;
  const auto turn = [](int consumer) { return 1 + 2 * kStages + consumer; };
  if (wg == 0) {
    setmaxnreg_dec<kProducerRegisters>();
    return produce<true, kStages>(codes, scales, steps, t, smem, kUsers);
  }
  setmaxnreg_inc<kConsumerRegisters>();
  const int consumer = wg - 1;
  PipelinedConsumer pc;
  pc.c.init(blockIdx.x * 2 + consumer);
  const float score_scale = 0.0625f;
  float alpha[2];
  const uint64_t k_desc = swizzled_desc(smem, 16, 1024);
  const uint64_t v_desc = swizzled_desc(smem + kSideBytes, kBlockBytes, 1024);
  // Step 0 alone (nothing to multiply by V yet), then whole rounds of the stages.
  named_sync(full(0), kUsers);
  if (kPingPong && consumer == 1) named_sync(turn(1), 2 * kWarpgroup);
  pc.issue_scores(k_desc);
  if (kPingPong) named_arrive(turn(1 - consumer), 2 * kWarpgroup);
  wgmma_wait<0>();
  pc.softmax(score_scale, alpha);
  pc.rescale_and_pack(alpha);
  // Consumer 0 issues first (it skipped its first wait); each arrives at the other's turn after
  // it has issued; consumer 0 takes consumer 1's last arrival at the end (every arrival is
  // waited for).
  for (int s0 = 0; s0 < steps; s0 += kStages) {
#pragma unroll
    for (int j = 1; j <= kStages; ++j) {
      const int s = s0 + j;
      if (s >= steps) break;
      const int stage = j % kStages, before = j - 1;  // compile-time after unrolling
      named_sync(full(stage), kUsers);
      if (kPingPong) named_sync(turn(consumer), 2 * kWarpgroup);
      pc.issue_scores(desc_plus(k_desc, stage * kStageBytes));
      pc.issue_values(desc_plus(v_desc, before * kStageBytes));
      if (kPingPong) named_arrive(turn(1 - consumer), 2 * kWarpgroup);
      wgmma_wait<1>();
      pc.softmax(score_scale, alpha);
      wgmma_wait<0>();
      named_arrive(empty(before), kUsers);
      pc.rescale_and_pack(alpha);
    }
  }
  const int last = (steps - 1) % kStages;
  pc.issue_values(desc_plus(v_desc, last * kStageBytes));
  wgmma_wait<0>();
  named_arrive(empty(last), kUsers);
  if (kPingPong && consumer == 0) named_sync(turn(0), 2 * kWarpgroup);
  float(&oacc)[kHead / 2] = reinterpret_cast<float(&)[kHead / 2]>(pc.c.o);
  wgmma_fence_operands(oacc);
  pc.c.finish(out + blockIdx.x);
}

template <typename Kernel>
float time_kernel(Kernel kernel, int ctas, int threads, int smem, const uint8_t* codes,
                  const uint8_t* scales, int steps, float* out) {
  CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem));
  cudaEvent_t start, stop;
  CHECK(cudaEventCreate(&start));
  CHECK(cudaEventCreate(&stop));
  kernel<<<ctas, threads, smem>>>(codes, scales, steps, out);  // warm-up
  CHECK(cudaGetLastError());
  CHECK(cudaDeviceSynchronize());
  std::vector<float> ms;
  for (int r = 0; r < 7; ++r) {
    CHECK(cudaEventRecord(start));
    kernel<<<ctas, threads, smem>>>(codes, scales, steps, out);
    CHECK(cudaEventRecord(stop));
    CHECK(cudaEventSynchronize(stop));
    CHECK(cudaGetLastError());
    float t = 0.f;
    CHECK(cudaEventElapsedTime(&t, start, stop));
    ms.push_back(t);
  }
  std::sort(ms.begin(), ms.end());
  CHECK(cudaEventDestroy(start));
  CHECK(cudaEventDestroy(stop));
  return ms[ms.size() / 2];
}

}  // namespace prefill_probe

using namespace prefill_probe;

int main(int argc, char** argv) {
  const int steps = argc > 1 ? atoi(argv[1]) : 512;
  int device = 0, sms = 0;
  CHECK(cudaGetDevice(&device));
  CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  std::vector<uint8_t> host_codes(size_t(kRecords) * kRecordCodes),
      host_scales(size_t(kRecords) * kRecordScales);
  uint32_t x = 12345u;
  for (auto& b : host_codes) b = uint8_t((x = x * 1664525u + 1013904223u) >> 24);
  for (auto& b : host_scales) b = uint8_t(0x30 + ((x = x * 1664525u + 1013904223u) >> 24) % 0x29);
  uint8_t *codes = nullptr, *scales = nullptr;
  float* out = nullptr;
  CHECK(cudaMalloc(&codes, host_codes.size()));
  CHECK(cudaMalloc(&scales, host_scales.size()));
  CHECK(cudaMalloc(&out, 4 * sms * sizeof(float)));
  CHECK(cudaMemcpy(codes, host_codes.data(), host_codes.size(), cudaMemcpyHostToDevice));
  CHECK(cudaMemcpy(scales, host_scales.data(), host_scales.size(), cudaMemcpyHostToDevice));
  CHECK(cudaMemset(out, 0, 4 * sms * sizeof(float)));

  const double tile_step_flops = 4.0 * 64 * kKv * kHead;
  using Kernel = void (*)(const uint8_t*, const uint8_t*, int, float*);
  struct Variant {
    const char* name;
    Kernel kernel;
    int ctas_per_sm, threads, smem;
    double tiles_per_cta;
  };
  constexpr int kTodaySmem = 96000;  // the ragged kernel's (head 128): 2 CTAs per SM
  const Variant variants[] = {
      {"A  today: 1 warpgroup converts + multiplies, 2 CTAs/SM", ProbeToday<true>, 2,
       kWarpgroup, kTodaySmem, 1},
      {"A0 today without the conversion", ProbeToday<false>, 2, kWarpgroup, kTodaySmem, 1},
      // B: one tile per CTA, the consumers taking alternate steps.
      {"B  producer + 2 consumers, alternate steps, 2 stages",
       ProbeSpecialised<true, false, 2>, 1, 3 * kWarpgroup, 2 * kStageBytes, 1},
      {"B  producer + 2 consumers, alternate steps, 4 stages",
       ProbeSpecialised<true, false, 4>, 1, 3 * kWarpgroup, 4 * kStageBytes, 1},
      {"B0 the same (4 stages) without the conversion", ProbeSpecialised<false, false, 4>, 1,
       3 * kWarpgroup, 4 * kStageBytes, 1},
      // C: two tiles per CTA sharing every stage.
      {"C  producer + 2 consumers on 2 tiles, 2 stages", ProbeSpecialised<true, true, 2>, 1,
       3 * kWarpgroup, 2 * kStageBytes, 2},
      {"C  producer + 2 consumers on 2 tiles, 3 stages", ProbeSpecialised<true, true, 3>, 1,
       3 * kWarpgroup, 3 * kStageBytes, 2},
      {"C0 the same (3 stages) without the conversion", ProbeSpecialised<false, true, 3>, 1,
       3 * kWarpgroup, 3 * kStageBytes, 2},
      // D, E: C with pipelined consumers (stage n - 1 is read by P V while n is scored).
      {"D  C + async consumers (S(n) with PV(n-1)), 4 stages", ProbePipelined<4, false>, 1, 3 * kWarpgroup,
       4 * kStageBytes, 2},
      {"E  D + ping-pong consumers, 4 stages", ProbePipelined<4, true>, 1, 3 * kWarpgroup,
       4 * kStageBytes, 2},
  };
  for (const Variant& v : variants) {
    const int ctas = v.ctas_per_sm * sms;
    const float ms = time_kernel(v.kernel, ctas, v.threads, v.smem, codes, scales, steps, out);
    printf("%-58s %9.3f ms  %7.1f TFLOP/s\n", v.name, ms,
           ctas * v.tiles_per_cta * steps * tile_step_flops / (ms * 1e-3) / 1e12);
  }
  float check = 0.f;
  CHECK(cudaMemcpy(&check, out, sizeof(float), cudaMemcpyDeviceToHost));
  printf("(checksum %g; %d SMs, %d steps of %d positions per CTA)\n", check, sms, steps, kKv);
  CHECK(cudaFree(codes));
  CHECK(cudaFree(scales));
  CHECK(cudaFree(out));
  return 0;
}
