// Decode attention over the NVFP4 paged cache on the GPU (jax_nvfp4.paged_attention), sm_89+.
//
// One CTA (4 warps) attends for one (member, sequence, kv head, group of up to 8 query heads)
// over one split of the sequence's positions (split-KV); each warp takes chunks of 16 or 32
// positions, keeps its own online softmax, and the warps merge through shared memory. With
// several splits their partial results are merged (log-sum-exp weighted) by a second kernel,
// or, where the plan says so (DecodeProblem::cluster_merge, sm_90+), by the splits' CTAs
// themselves: one thread-block cluster per unit, through distributed shared memory. An invalid
// global scale makes every output NaN here (jax_nvfp4.checks.nan_if_invalid's rule).
// In ragged mode (DecodeProblem::cu_q_lens) the same kernels take the sequences of a ragged call
// that own one query token (ragged_cuda.cu launches them), q and out rows being tokens.
//
// Per chunk, on the tensor cores (mma.sync m16n8k16, fp16 in, float32 accumulate; the warp's
// loop is chunk_attention.cuh's, with one n-tile):
//   S^T = K Q^T   tokens in M (16 per tile), head dims in K, query heads in N (8),
//   O^T += V^T P^T  head dims in M, tokens in K, query heads in N.
// K and V never leave registers: each lane loads the code bytes its MMA fragments need and
// turns them into fp16 in a few integer operations (e2m1x8_to_f16x2), exactly: an E2M1 value
// times an E4M3 block scale has at most 6 significant bits and, scaled as below, lies within
// fp16's range down to its subnormals, so it is exact in fp16. Since a dot product does not care in
// which order its terms come, each lane's head dimensions are a permutation chosen so that the
// fragments come straight out of its own loads; q is permuted the same way once per CTA, and
// the output is written back in true order.
//
// Numbers: K_f16 = code * 2^-14 * (block scale * 2^7), so K = K_f16 * k_scale * 2^7 (likewise
// V); q is rounded to fp16 after a power-of-two scale 2^e per head that puts its largest
// element in [2^14, 2^15); scores are S_acc * k_scale * sm_scale * 2^(7-e), in log2 units for
// exp2. P is rounded to fp16 for the second MMA; every sum is float32.
#include <cooperative_groups.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>

#include "attention_device.cuh"
#include "chunk_attention.cuh"
#include "cuda_common.cuh"
#include "decode_ffi.h"
#include "handlers.h"
#include "page_chunks.cuh"

namespace nvfp4 {
namespace {

namespace cg = cooperative_groups;

constexpr int kThreads = kChunkWarps * 32;
// Decode v8: the chunks' bytes staged through shared memory, NVFP4_DECODE_STAGED chunks ahead
// per warp (attend_chunks_staged), for the load latency that one chunk in flight per warp
// left exposed (benchmarks/NOTES.md, decode at 418 x 4096); the loads hold no registers, so
// 4 CTAs a SM fit in 128 registers without spilling. Measured on an H200 (2026-12-02, batch x
// context 1x4096 / 8x4096 / 64x1024 / 32x8192 / 32x32768 / 128x4096): 2 slots at 4 CTAs
// 15.9 / 31.9 / 43.8 / 126.2 / 439.0 / 232.1 us, 3 slots at 3 CTAs 15.9 / 31.8 / 59.7 /
// 132.3 / 436.4 / 233.1, the loads into registers (0) at 3 CTAs 16.3 / 31.8 / 62.5 / 132.1 /
// 446.2 / 246.9 (168 registers; at 4 CTAs they spill and take 16.9 / 33.2 / 50.9 / 164.7 /
// 596.0 / 301.8). Other values: -DNVFP4_DECODE_STAGED=N and -DNVFP4_DECODE_MIN_CTAS=N in
// CMAKE_CUDA_FLAGS.
#ifndef NVFP4_DECODE_STAGED
#define NVFP4_DECODE_STAGED 2
#endif
// CTAs per SM for head sizes 64 and 128.
#ifndef NVFP4_DECODE_MIN_CTAS
#define NVFP4_DECODE_MIN_CTAS (NVFP4_DECODE_STAGED > 0 ? 4 : 3)
#endif
constexpr int kHeadsPerCta = 8;  // query heads of one kv head per CTA: the MMA's N
constexpr int kStagedSlots = NVFP4_DECODE_STAGED;
constexpr bool kStaged = kStagedSlots > 0;
// Dynamic shared memory a CTA takes: the staged slots, which the warps' merge then reuses.
template <int kHead>
constexpr int kDynamicSmem = kStagedSmem<kHead, kStagedSlots, kHeadsPerCta>;


// CTAs per SM the registers are budgeted for (warps to hide latency against registers per
// thread; head size 256 needs more registers).
template <int kHead>
constexpr int kMinCtasPerSm = kHead >= 256 ? 2 : NVFP4_DECODE_MIN_CTAS;

// Ragged mode (p.cu_q_lens set): whether sequence b of `member` owns exactly one query token
// (jax_nvfp4.reference.ragged_token_plan), and which (every lane of the warp gets it).
__device__ __forceinline__ bool one_token_sequence(const DecodeProblem& p, uint32_t member,
                                                   uint32_t b, int lane, int32_t* token) {
  const int32_t ns = min(max(__ldg(p.num_seqs + (p.num_seqs_stacked ? member : 0)), 0), p.batch);
  if (int32_t(b) >= ns) return false;
  const int32_t* cu = p.cu_q_lens + (p.cu_stacked ? int64_t(member) * (p.batch + 1) : 0);
  int32_t next;
  sequence_tokens(cu, int32_t(b), p.num_tokens, lane, token, &next);
  return next - *token == 1;
}

// The row of q, out and lse (times num_q_heads) of sequence b of `member`: the sequence's own,
// or in ragged mode its query token's (-1: not a one-token sequence, nothing to do here).
__device__ __forceinline__ int64_t sequence_out_row(const DecodeProblem& p, uint32_t member,
                                                    uint32_t b, int lane) {
  if (p.cu_q_lens == nullptr) return int64_t(member) * p.batch + b;
  int32_t token;
  if (!one_token_sequence(p, member, b, lane, &token)) return -1;
  return int64_t(member) * p.num_tokens + token;
}

// Divisions fixed at launch: the CTA index into (member, sequence, kv head, head tile), and
// positions into (page, row).
struct Grid {
  FastDivmod head_tiles, num_kv_heads, batch, block_size;
};

// Cluster merge (p.cluster_merge): the CTAs of one cluster are the splits of one (member,
// sequence, kv head, head tile), its rank the split. Each has left its partial result in
// shared memory (split_out [row][dim], normalised by its own sum; split_lse [row], log2, -inf
// for an empty split); the CTAs of the cluster then share the rows' values, each merging every
// split's partial of its values from its peers' shared memory.
template <int kHead>
__device__ __forceinline__ void merge_cluster_splits(const DecodeProblem& p, const float* split_out,
                                                     const float* split_lse, int rows,
                                                     int64_t first_row, float out_scale) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  __trap();  // no clusters before sm_90: the handler never asks for them there
#else
  cg::cluster_group cluster = cg::this_cluster();
  cluster.sync();  // every split's partial result is in its CTA's shared memory
  const int splits = int(cluster.num_blocks()), rank = int(cluster.block_rank());
  for (int i = rank * kThreads + threadIdx.x; i < rows * kHead; i += splits * kThreads) {
    const int row = i / kHead, d = i % kHead;
    // Every split's lse, then the values of the non-empty ones, each read at once (independent
    // remote loads, two round trips, not two per split; an empty split's values were never
    // written).
    float lse[kMaxClusterSplits], value[kMaxClusterSplits];
#pragma unroll
    for (int s = 0; s < kMaxClusterSplits; ++s)
      lse[s] = s < splits ? *cluster.map_shared_rank(split_lse + row, s) : -INFINITY;
#pragma unroll
    for (int s = 0; s < kMaxClusterSplits; ++s)
      value[s] = lse[s] != -INFINITY ? *cluster.map_shared_rank(split_out + i, s) : 0.f;
    float lse2;
    const float merged = merge_splits(
        kMaxClusterSplits, [&](int s) { return lse[s]; }, [&](int s) { return value[s]; },
        &lse2);
    store_out(p.out, p.q_type, (first_row + row) * kHead + d, merged * out_scale);
    if (d == 0) p.lse[first_row + row] = lse2 * kLn2;
  }
  cluster.sync();  // no CTA leaves while a peer still reads its shared memory
#endif
}

template <int kHead, bool kSwizzle, Layout kLayout>
__global__ void __launch_bounds__(kThreads, kMinCtasPerSm<kHead>)
    DecodeKernel(const DecodeProblem p, const Grid grid) {
  using S = Shape<kHead>;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int g = lane >> 2;

  uint32_t head_tile, kv_head, b;
  uint32_t rest = grid.head_tiles.divmod(blockIdx.x, &head_tile);
  rest = grid.num_kv_heads.divmod(rest, &kv_head);
  const uint32_t member = grid.batch.divmod(rest, &b);
  const int split = blockIdx.y;

  const int32_t block_size = int32_t(p.page.block_size);
  const int32_t max_tokens = p.max_blocks * block_size;
  const int32_t seq_len =
      min(max(p.seq_lens[(p.lens_stacked ? member * p.batch : 0) + b], 0), max_tokens);
  const int32_t begin = split * p.tokens_per_split;
  const int32_t end = min(begin + p.tokens_per_split, seq_len);
  const int group = p.num_q_heads / int(p.page.num_kv_heads);
  const int heads_here = min(kHeadsPerCta, group - int(head_tile) * kHeadsPerCta);
  const int64_t out_seq_row = sequence_out_row(p, member, b, lane);
  if (out_seq_row < 0) return;  // ragged mode: the ragged kernel's sequence (CTA-uniform)
  const int32_t first_head = kv_head * group + head_tile * kHeadsPerCta;
  // Rows of q, out and lse; of the split-KV workspace (per sequence, also in ragged mode).
  const int64_t first_q_row = out_seq_row * p.num_q_heads + first_head;
  const int64_t first_split_row = (int64_t(member) * p.batch + b) * p.num_q_heads + first_head;

  const float k_scale = p.k_scale[p.k_scale_stacked ? member : 0];
  const float v_scale = p.v_scale[p.v_scale_stacked ? member : 0];
  const float sm_scale = p.sm_scale[p.sm_scale_stacked ? member : 0];

  // What needs neither the sequence's length nor the scales is read before anything waits for
  // those: this lane's q and the block-table entries of this warp's first chunk (up to the
  // split's end in the table: entries past the length are read, never used). One memory round
  // trip, with seq_len's and the scales', before the first pages are read, where the loads
  // behind the branches below waited for them (benchmarks/NOTES.md, decode v6).
  const LaneQ<kHead> lane_q =
      load_lane_q<kHead>(p.q, p.q_type, (first_q_row + g) * kHead, g < heads_here, lane);
  const int32_t num_kv_heads = int32_t(p.page.num_kv_heads);
  const int32_t side_bytes = int32_t(p.page.side_bytes());
  PageView<kLayout> pv;
  pv.cache = p.kv_cache + int64_t(member) * p.num_blocks * 2 * side_bytes;
  pv.table = p.block_tables + (p.tables_stacked ? int64_t(member) * p.batch : 0) * p.max_blocks +
             int64_t(b) * p.max_blocks;
  pv.page_bytes = 2 * int64_t(side_bytes);
  pv.side_bytes = side_bytes;
  pv.side_data = int32_t(p.page.side_data_bytes());
  pv.head_row = kLayout == Layout::kHND ? int32_t(kv_head) * block_size : int32_t(kv_head);
  pv.num_kv_heads = num_kv_heads;
  pv.last_page = p.num_blocks - 1;
  pv.block_size = grid.block_size;
  pv.tile_in_page = block_size % 16 == 0;
  const int32_t split_end = min(begin + p.tokens_per_split, max_tokens);
  const TilePages<S::kTiles> first_pages =
      first_chunk_pages<kHead>(pv, uint32_t(begin), uint32_t(split_end), warp);

  if (!scale_is_valid(k_scale) || !scale_is_valid(v_scale)) {
    // The readers' rule for an invalid global scale: every output and lse NaN, empty
    // sequences' included (uniform over a cluster: one member's scales). With the merge kernel
    // it writes them.
    if (p.num_splits == 1 || (p.cluster_merge && split == 0))
      fill_rows<kHead>(p.out, p.q_type, p.lse, first_q_row, heads_here, NAN, NAN);
    return;
  }
  const bool empty = begin >= end;
  if (empty && !p.cluster_merge) {
    // No position here. With one split this is a sequence of length 0: zeros, lse -inf.
    // With several, the merge kernel skips the splits past the sequence's length.
    if (p.num_splits == 1)
      fill_rows<kHead>(p.out, p.q_type, p.lse, first_q_row, heads_here, 0.f, -INFINITY);
    return;
  }

  // The cluster merge's partial results: this split's (unused otherwise).
  __shared__ float split_out[kHeadsPerCta * kHead];
  __shared__ float split_lse[kHeadsPerCta];
  static_assert(kDynamicSmem<kHead> + sizeof(split_out) + sizeof(split_lse) <= kMaxSmemPerCta,
                "a CTA's shared memory: the staged slots and the cluster merge's partials");
  const float out_scale = v_scale * 128.f;
  if (empty) {
    if (threadIdx.x < heads_here) split_lse[threadIdx.x] = -INFINITY;
  } else {
    // q of this lane's head (column g) as the B fragments of S^T = K Q^T.
    RegisterQ<kHead, 1> qf;
    float score_scale[1][2];
    q_fragments<kHead>(lane_q, k_scale * sm_scale, lane, qf.f[0], score_scale[0]);

    // Every head sees the split's positions [begin, end).
    WarpState<kHead, 1> st;
    init_state(st);
    const uint32_t limit[1][2] = {{uint32_t(end), uint32_t(end)}};
    float* merge_smem;
    if constexpr (kStaged) {
      extern __shared__ __align__(16) uint8_t staged_slots[];
      attend_chunks_staged<kStagedSlots, kHead, kSwizzle, kLayout, 1>(
          pv, uint32_t(begin), uint32_t(end), uint32_t(end), limit, qf, score_scale, warp, lane,
          first_pages, staged_slots, st);
      __syncthreads();  // every warp is done with its slots
      merge_smem = reinterpret_cast<float*>(staged_slots);
    } else {
      attend_chunks<kHead, kSwizzle, kLayout, 1>(pv, uint32_t(begin), uint32_t(end),
                                                 uint32_t(end), limit, qf, score_scale, warp,
                                                 lane, first_pages, st);
      __shared__ __align__(16) float own_merge_smem[kMergeFloats<kHead, kHeadsPerCta>];
      merge_smem = own_merge_smem;
    }
    merge_warps<kHead, 1>(st, merge_smem, heads_here, warp, lane,
                          [&](int h, int d, float value, float lse2) {
                            if (p.cluster_merge) {
                              split_out[h * kHead + d] = value;
                              if (d == 0) split_lse[h] = lse2;
                            } else if (p.num_splits == 1) {
                              const int64_t row = first_q_row + h;
                              store_out(p.out, p.q_type, row * kHead + d, value * out_scale);
                              if (d == 0) p.lse[row] = lse2 * kLn2;
                            } else {
                              const int64_t row = first_split_row + h;
                              p.partial_out[(row * p.num_splits + split) * kHead + d] = value;
                              if (d == 0) p.partial_lse[row * p.num_splits + split] = lse2;
                            }
                          });
  }
  if (p.cluster_merge)
    merge_cluster_splits<kHead>(p, split_out, split_lse, heads_here, first_q_row, out_scale);
}

// Combines the splits of each (member, sequence, query head): weights 2^(lse_s - max).
template <int kHead>
__global__ void __launch_bounds__(kHead) MergeKernel(const DecodeProblem p) {
  const int64_t row = blockIdx.x;  // (member * batch + b) * num_q_heads + head: the workspace's
  const int64_t sequence = row / p.num_q_heads;
  const int32_t member = int32_t(sequence / p.batch), b = int32_t(sequence % p.batch);
  const int64_t out_seq_row = sequence_out_row(p, member, b, threadIdx.x & 31);
  if (out_seq_row < 0) return;  // ragged mode: the ragged kernel's sequence
  const int64_t out_row = out_seq_row * p.num_q_heads + row % p.num_q_heads;
  const float k_scale = p.k_scale[p.k_scale_stacked ? member : 0];
  const float v_scale = p.v_scale[p.v_scale_stacked ? member : 0];
  if (!scale_is_valid(k_scale) || !scale_is_valid(v_scale)) {
    fill_rows<kHead>(p.out, p.q_type, p.lse, out_row, 1, NAN, NAN);  // as in DecodeKernel
    return;
  }
  const int32_t max_tokens = p.max_blocks * int32_t(p.page.block_size);
  const int32_t seq_len =
      min(max(p.seq_lens[(p.lens_stacked ? member * p.batch : 0) + b], 0), max_tokens);
  const int active = min((seq_len + p.tokens_per_split - 1) / p.tokens_per_split, p.num_splits);
  const int d = threadIdx.x;
  if (active == 0) {
    fill_rows<kHead>(p.out, p.q_type, p.lse, out_row, 1, 0.f, -INFINITY);
    return;
  }
  float lse2;
  const float value = merge_workspace_splits(p.partial_lse + row * p.num_splits,
                                             p.partial_out + row * p.num_splits * kHead, kHead,
                                             active, d, &lse2);
  store_out(p.out, p.q_type, out_row * kHead + d, value * (v_scale * 128.f));
  if (d == 0) p.lse[out_row] = lse2 * kLn2;
}

// Tiles of kHeadsPerCta query heads per kv head; a CTA (per split) for each (member, sequence,
// kv head, tile).
int HeadTiles(const DecodeProblem& p) {
  const int group = p.num_q_heads / int(p.page.num_kv_heads);
  return (group + kHeadsPerCta - 1) / kHeadsPerCta;
}
int64_t CtasPerSplit(const DecodeProblem& p) {
  return int64_t(p.stacked) * p.batch * p.page.num_kv_heads * HeadTiles(p);
}

// Clusters of more than 8 CTAs (the portable size) for this instance of the kernel, once per
// device.
template <int kHead, bool kSwizzle, Layout kLayout>
cudaError_t AllowLargeClusters() {
  static std::atomic<uint64_t> allowed{0};
  return OncePerDevice(allowed, [] {
    return cudaFuncSetAttribute(DecodeKernel<kHead, kSwizzle, kLayout>,
                                cudaFuncAttributeNonPortableClusterSizeAllowed, 1);
  });
}

// The kernel's dynamic shared memory where it takes some (staged), once per device.
template <int kHead, bool kSwizzle, Layout kLayout>
cudaError_t ConfigureDecode() {
  return ConfigureDynamicSmem<DecodeKernel<kHead, kSwizzle, kLayout>>(kDynamicSmem<kHead>);
}

template <int kHead, bool kSwizzle, Layout kLayout>
cudaError_t LaunchKernels(cudaStream_t stream, const DecodeProblem& p) {
  const cudaError_t configured = ConfigureDecode<kHead, kSwizzle, kLayout>();
  if (configured != cudaSuccess) {
    cudaGetLastError();
    return configured;
  }
  constexpr int kSmem = kDynamicSmem<kHead>;
  const int head_tiles = HeadTiles(p);
  const int64_t units = CtasPerSplit(p);
  const Grid grid{FastDivmod(uint32_t(head_tiles)), FastDivmod(uint32_t(p.page.num_kv_heads)),
                  FastDivmod(uint32_t(p.batch)), FastDivmod(uint32_t(p.page.block_size))};
  const dim3 blocks(uint32_t(units), uint32_t(p.num_splits));
  if (p.cluster_merge) {
    // The splits of one unit as one cluster (grid.y = cluster.y = num_splits).
    if (p.num_splits > 8) {
      const cudaError_t allowed = AllowLargeClusters<kHead, kSwizzle, kLayout>();
      if (allowed != cudaSuccess) {
        cudaGetLastError();  // reported here, not by the next launch's check
        return allowed;
      }
    }
    cudaLaunchConfig_t config = {};
    config.gridDim = blocks;
    config.blockDim = dim3(kThreads);
    config.dynamicSmemBytes = kSmem;
    config.stream = stream;
    cudaLaunchAttribute cluster;
    cluster.id = cudaLaunchAttributeClusterDimension;
    cluster.val.clusterDim.x = 1;
    cluster.val.clusterDim.y = uint32_t(p.num_splits);
    cluster.val.clusterDim.z = 1;
    config.attrs = &cluster;
    config.numAttrs = 1;
    const cudaError_t launched =
        cudaLaunchKernelEx(&config, DecodeKernel<kHead, kSwizzle, kLayout>, p, grid);
    if (launched != cudaSuccess) cudaGetLastError();  // likewise
    return launched;
  }
  DecodeKernel<kHead, kSwizzle, kLayout><<<blocks, kThreads, kSmem, stream>>>(p, grid);
  cudaError_t error = cudaGetLastError();
  if (error != cudaSuccess || p.num_splits == 1) return error;
  MergeKernel<kHead><<<uint32_t(int64_t(p.stacked) * p.batch * p.num_q_heads), kHead, 0,
                       stream>>>(p);
  return cudaGetLastError();
}


// Most splits the decode kernel for this head size merges in one cluster on the current GPU:
// the largest cluster of its CTAs the GPU can place, at most kMaxClusterSplits; 0 without
// cluster launch (or if CUDA failed). Every instance of a head size has the same resources.
template <int kHead>
int AskClusterMergeSplits(int device) {
  int clusters = 0;
  if (cudaDeviceGetAttribute(&clusters, cudaDevAttrClusterLaunch, device) != cudaSuccess) {
    cudaGetLastError();  // leave no error of ours behind for the next launch's check
    return 0;
  }
  // The cluster merge's code exists only where the kernel was compiled for sm_90 and up (a
  // build from older PTX, JIT-compiled for this GPU, has the trap instead).
  cudaFuncAttributes attributes;
  if (!clusters ||
      cudaFuncGetAttributes(&attributes, DecodeKernel<kHead, true, Layout::kHND>) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  if (attributes.ptxVersion < 90) return 0;
  // Without the non-portable size the GPU still places clusters of up to 8.
  if (AllowLargeClusters<kHead, true, Layout::kHND>() != cudaSuccess) cudaGetLastError();
  if (ConfigureDecode<kHead, true, Layout::kHND>() != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3(1, uint32_t(kMaxClusterSplits));
  config.blockDim = dim3(kThreads);
  config.dynamicSmemBytes = kDynamicSmem<kHead>;
  int size = 0;
  if (cudaOccupancyMaxPotentialClusterSize(&size, DecodeKernel<kHead, true, Layout::kHND>,
                                           &config) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  return size >= 2 ? std::min(size, int(kMaxClusterSplits)) : 0;
}

// The same, asked once per device (every call's handler checks its plan against it).
template <int kHead>
int ClusterMergeSplitsFor() {
  static std::atomic<int> answers[64];  // answer + 1 per device, 0: not asked yet
  int device = 0;
  if (cudaGetDevice(&device) != cudaSuccess) {
    cudaGetLastError();
    return 0;
  }
  if (device >= 64) return AskClusterMergeSplits<kHead>(device);
  int answer = answers[device].load(std::memory_order_acquire);
  if (answer == 0) {
    answer = AskClusterMergeSplits<kHead>(device) + 1;
    answers[device].store(answer, std::memory_order_release);
  }
  return answer - 1;
}

ffi::Error DecodeCuda(cudaStream_t stream, ffi::AnyBuffer q, ffi::Buffer<ffi::U8> kv_cache,
                      ffi::Buffer<ffi::S32> block_tables, ffi::Buffer<ffi::S32> seq_lens,
                      ffi::Buffer<ffi::F32> k_scale, ffi::Buffer<ffi::F32> v_scale,
                      ffi::Buffer<ffi::F32> sm_scale, ffi::Result<ffi::AnyBuffer> out,
                      ffi::Result<ffi::Buffer<ffi::F32>> lse,
                      ffi::Result<ffi::Buffer<ffi::F32>> partial_out,
                      ffi::Result<ffi::Buffer<ffi::F32>> partial_lse, int32_t layout,
                      bool v_scale_swizzle, int32_t num_splits, int32_t tokens_per_split,
                      bool cluster_merge) {
  DecodeProblem p;
  ffi::Error error = MakeDecodeProblem(q, kv_cache, block_tables, seq_lens, k_scale, v_scale,
                                       sm_scale, out, lse, partial_out, partial_lse, layout,
                                       v_scale_swizzle, num_splits, tokens_per_split,
                                       cluster_merge, &p);
  if (error.failure()) return error;
  if (cluster_merge && num_splits > DecodeClusterMergeSplits(int(p.page.head_size)))
    return DecodeArgumentError("cluster_merge with more splits than this GPU places in a "
                               "cluster of the kernel");
  if (int64_t(p.stacked) * p.batch * p.num_q_heads == 0) return ffi::Error::Success();
  if (p.num_blocks == 0 && p.max_blocks > 0)
    return DecodeArgumentError("kv_cache has no pages but block_tables has columns");
  if (CtasPerSplit(p) >= (int64_t(1) << 31)) return DecodeArgumentError("more than 2^31 CTAs");
  const cudaError_t launched = LaunchDecodeAttention(stream, p);
  if (launched != cudaSuccess) return CudaError("paged_attention", "kernel launch", launched);
  return ffi::Error::Success();
}

// The attention kernels' code conversion (e2m1x8_to_f16x2) on word u of eight codes against
// the spec's values (docs/format.md §1): output i in its documented place, exactly
// e2m1_magnitude(code) * 2^-14 with the code's sign (-0 included).
struct E2m1ToF16Differs {
  __device__ bool operator()(uint32_t u) const {
    uint32_t r[4];
    e2m1x8_to_f16x2(u, r);
    constexpr int kWord[8] = {0, 2, 1, 3, 0, 2, 1, 3}, kHalf[8] = {0, 0, 0, 0, 1, 1, 1, 1};
    bool differs = false;
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      const uint32_t code = (u >> (4 * i)) & 0xFu;
      const uint16_t half = uint16_t(r[kWord[i]] >> (16 * kHalf[i]));
      const float magnitude = e2m1_magnitude(uint8_t(code)) * 0x1p-14f;  // exact
      const float got = __half2float(__ushort_as_half(half));
      differs |= fabsf(got) != magnitude || (half >> 15) != (code >> 3);
    }
    return differs;
  }
};

template <int kHead>
int ResidentCtas() {
  return ResidentCtasPerSm<DecodeKernel<kHead, true, Layout::kHND>>(kThreads,
                                                                     kDynamicSmem<kHead>);
}

}  // namespace

cudaError_t LaunchDecodeAttention(cudaStream_t stream, const DecodeProblem& p) {
  return WithHeadSize(
      p.page.head_size,
      [&](auto head) {
        return WithPageOptions(p.page, [&](auto swizzle, auto layout) {
          return LaunchKernels<decltype(head)::value, decltype(swizzle)::value,
                               decltype(layout)::value>(stream, p);
        });
      },
      cudaErrorInvalidValue);
}

int DecodeClusterMergeSplits(int head_size) {
  return WithHeadSize(
      head_size, [](auto head) { return ClusterMergeSplitsFor<decltype(head)::value>(); }, 0);
}

int64_t E2m1ToF16MismatchesCuda() { return CountOnEvery32Bits(E2m1ToF16Differs{}); }

int DecodeResidentCtasPerSm(int head_size) {
  return WithHeadSize(head_size, [](auto head) { return ResidentCtas<decltype(head)::value>(); },
                      0);
}

}  // namespace nvfp4

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    NvFp4DecodeAttentionCuda, nvfp4::DecodeCuda,
    nvfp4::BindDecode(xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
    {xla::ffi::Traits::kCmdBufferCompatible});
