// CUDA XLA FFI handler of the store (docs/format.md §5), for sm_90 and newer. The e2m1
// conversion is the software ladder of nvfp4_numerics.h on every architecture, so Hopper and
// Blackwell write the same bytes as the CPU kernel and the jnp reference.
#include <cuda_runtime.h>

#include <algorithm>

#include "cuda_common.cuh"
#include "handlers.h"
#include "store_ffi.h"

namespace nvfp4 {
namespace {

constexpr int kThreadsPerBlock = 256;
// Four CTAs of 256 threads per SM (64 registers a thread): enough warps to hide load latency.
constexpr int kMinBlocksPerSm = 4;
// The 4over6 kernel's: at 4 it spills 72-144 bytes a thread (two candidates' codes and errors);
// at 2 (119-127 registers) it does not, at half the warps, and measured 2.4% faster on an H200
// (810 against 830 us at 131072 tokens, within run-to-run spread: benchmarks/NOTES.md, v8).
// -DNVFP4_STORE_4OVER6_MIN_CTAS=2 in CMAKE_CUDA_FLAGS builds it.
#ifndef NVFP4_STORE_4OVER6_MIN_CTAS
#define NVFP4_STORE_4OVER6_MIN_CTAS 4
#endif
template <ScaleSearch kSearch>
constexpr int kMinCtasPerSm =
    kSearch == ScaleSearch::k4Over6 ? NVFP4_STORE_4OVER6_MIN_CTAS : kMinBlocksPerSm;

struct WorkShape {
  FastDivmod blocks_per_head;  // D/16
  FastDivmod num_kv_heads;
  FastDivmod num_tokens;
  FastDivmod block_size;
};

// StoreProblem::page for the kernels' address arithmetic (place_block's, docs/format.md §4): a
// block's bytes are a 64-bit page-side base plus an offset inside the side, which the handler
// checks is below 2^31, so the kernel works the offsets out in 32 bits from these (where
// place_block multiplies 64-bit fields: ~70 instructions an item, store v22). The CPU kernel
// keeps place_block; the tests compare the bytes of both.
struct PagePlacement {
  uint64_t layer_bytes;       // one member's cache: num_blocks page pairs
  uint32_t side_bytes;        // one page side: its data, then its scales
  uint32_t side_data_bytes;   // where a side's scales start
  uint32_t head_stride;       // PageGeometry's: plane row of (head, row) =
  uint32_t row_stride;        //   head * head_stride + row * row_stride
  uint32_t data_bytes_per_row;  // D / 2
  uint32_t scales_per_row;      // S = D / 16
  FastDivmod scale_group;       // G = S / 4 of the V-scale swizzle (S % 4 == 0 where swizzled)
  bool v_scale_swizzle;

  explicit PagePlacement(const StoreProblem& p)
      : layer_bytes(uint64_t(p.layer_cache_bytes())),
        side_bytes(uint32_t(p.page.side_bytes())),
        side_data_bytes(uint32_t(p.page.side_data_bytes())),
        head_stride(uint32_t(p.page.head_stride())),
        row_stride(uint32_t(p.page.row_stride())),
        data_bytes_per_row(uint32_t(p.page.data_bytes_per_head_token())),
        scales_per_row(uint32_t(p.page.scales_per_head_token())),
        scale_group(uint32_t(std::max<int64_t>(p.page.scales_per_head_token() / 4, 1))),
        v_scale_swizzle(p.page.v_scale_swizzle) {}

  __device__ __forceinline__ uint32_t plane_row(uint32_t head, uint32_t row) const {
    return head * head_stride + row * row_stride;
  }

  // place_block's offsets, as a page side's first byte in the cache and offsets inside it: the
  // side of (layer, page `block`, side), then block b's codes and scale byte of (head, row).
  __device__ __forceinline__ uint64_t side_base(uint32_t layer, uint32_t block, int side) const {
    return uint64_t(layer) * layer_bytes + uint64_t(block * 2u + uint32_t(side)) * side_bytes;
  }
  __device__ __forceinline__ uint32_t data_offset(uint32_t head, uint32_t row, uint32_t b) const {
    return plane_row(head, row) * data_bytes_per_row + b * kBlockBytes;
  }
  __device__ __forceinline__ uint32_t scale_offset(int side, uint32_t head, uint32_t row,
                                                   uint32_t b) const {
    uint32_t col = b;
    if (side == 1 && v_scale_swizzle) {
      uint32_t b_lo;
      const uint32_t b_hi = scale_group.divmod(b, &b_lo);
      PageGeometry::swizzle_scale(b_hi, b_lo, &row, &col);
    }
    return side_data_bytes + plane_row(head, row) * scales_per_row + col;
  }
};

// A work item: kBlocks consecutive 16-element blocks of one head vector. Consecutive items are
// consecutive block groups of a head vector, then heads, then K/V, then tokens, so that the
// loads (16 bytes each) and the packed stores of consecutive threads are contiguous across a
// warp. Work items and slots are below 2^31 (the handler checks), so index arithmetic is
// 32-bit.
struct WorkItem {
  uint32_t first;  // the item's first block in its head vector
  uint32_t head, token, layer;
  uint32_t vector;  // (layer, token, head)'s head vector in key or value, [L, T, H] flat
  int side;         // 0: K, 1: V
};

template <int kBlocks>
__device__ __forceinline__ WorkItem work_item(const WorkShape& shape, uint32_t work) {
  WorkItem w;
  uint32_t group;
  uint32_t rest = shape.blocks_per_head.divmod(work, &group);
  rest = shape.num_kv_heads.divmod(rest, &w.head);
  w.side = int(rest & 1u);
  w.vector = (rest >> 1) * shape.num_kv_heads.divisor + w.head;
  w.layer = shape.num_tokens.divmod(rest >> 1, &w.token);
  w.first = group * kBlocks;
  return w;
}

// The item's inputs: 32 bytes per block, 32-byte aligned.
__device__ __forceinline__ const uint4* item_input(const StoreProblem& p, const WorkItem& w) {
  return reinterpret_cast<const uint4*>(
      static_cast<const uint16_t*>(w.side == 0 ? p.key : p.value) +
      p.vector_input_offset(w.vector, w.first));
}

// Two blocks a thread: where a warp's 32 items, 64 bytes each, pass through its part of shared
// memory (kStagedPieces 16-byte pieces), the piece `chunk` of `item` (both of the warp) lies. A
// 16-byte pad after every second item spreads both the writes (8 lanes: 2 items x 4 chunks) and
// the reads (8 lanes: 8 items, one chunk) over the 8 distinct 16-byte bank groups of a 128-byte
// row: no bank conflicts either way; an item's pieces stay adjacent (one address, offsets).
constexpr int kStagedPieces = 32 * 4 + 32 / 2;
__device__ __forceinline__ int staged_piece(int item, int chunk) {
  return 4 * item + item / 2 + chunk;
}

// The thread's inputs (`src`: its item's) into `in`. One block a thread: its own two 16-byte
// loads. Two blocks (store v21, benchmarks/NOTES.md): a thread's own four loads would each take
// 16 bytes of 16 different 128-byte lines across its warp (lane t's 64 bytes lie at 64t), two
// L2 requests a line where one will do. Instead load i of lane t takes piece t % 4 of the item
// of lane 8i + t / 4 (its address by shuffle), so each load of the warp reads whole lines
// wherever the warp's items are contiguous (one token's heads of one side); the pieces then go
// to their owners through the warp's 2 KB of shared memory (one __syncwarp, no CTA barrier).
// Every lane of the warp takes part: a lane past the call's items loads item 0's inputs, as
// before. (Not in the 4over6 kernel: there the shuffled addresses cost a 16-byte spill.)
template <int kBlocks, ScaleSearch kSearch>
__device__ __forceinline__ void load_inputs(const uint4* src, uint4 (&in)[2 * kBlocks]) {
  if constexpr (kBlocks == 2 && kSearch == ScaleSearch::kDefault) {
    __shared__ uint4 staged[kThreadsPerBlock / 32 * kStagedPieces];
    const int lane = int(threadIdx.x % 32u);
    uint4* warp_staged = staged + threadIdx.x / 32u * kStagedPieces;
    const int chunk = lane % 4;
    uint4 piece[4];  // all loads issued before any use
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const auto from = __shfl_sync(~0u, reinterpret_cast<unsigned long long>(src),
                                    8 * i + lane / 4);
      piece[i] = __ldg(reinterpret_cast<const uint4*>(from) + chunk);
    }
#pragma unroll
    for (int i = 0; i < 4; ++i)  // (item 8 i + lane / 4: staged_piece's + 36 i)
      warp_staged[staged_piece(lane / 4, chunk) + i * staged_piece(8, 0)] = piece[i];
    __syncwarp();
#pragma unroll
    for (int c = 0; c < 4; ++c) in[c] = warp_staged[staged_piece(lane, c)];
  } else {
#pragma unroll
    for (int i = 0; i < 2 * kBlocks; ++i) in[i] = __ldg(src + i);
  }
}

// 4over6's products q * (1/f) (block_codes_and_error's CodeProducts) as a table: a candidate's
// eight codes' values times its 1/f, written once a block into shared memory (8 FMUL, 8 STS),
// then read by each element's code (an address from the code's bits and one LDS), where the
// arithmetic reads the value off the bits and multiplies (6 instructions) for each of the
// block's 16 elements. Each entry is the same one product, so the same float. The thread's
// own column: entry (candidate, code) at column[(8 candidate + code) kThreadsPerBlock], so a
// warp's 32 lanes read 32 consecutive words whatever their codes (no bank conflict), and the
// code's offset is its bits times the row's bytes: bits = 2^23 + code, and 2^23 times
// 2^10 or more wraps to 0 in 32 bits.
struct CodeProductTable {
  static constexpr uint32_t kRowBytes = kThreadsPerBlock * sizeof(float);
  static_assert(kRowBytes % 1024 == 0, "the code's row from its bits needs 2^10 | row bytes");
  float* column;
  __device__ __forceinline__ void set(int candidate, float deq) {
#pragma unroll
    for (int c = 0; c < 8; ++c)
      column[(8 * candidate + c) * kThreadsPerBlock] = mul_rn(e2m1_magnitude(uint8_t(c)), deq);
  }
  __device__ __forceinline__ float of(int candidate, uint32_t bits) const {
    return *reinterpret_cast<const float*>(reinterpret_cast<const char*>(column) +
                                           8u * kRowBytes * uint32_t(candidate) +
                                           bits * kRowBytes);
  }
};

// Quantises the item's blocks (inputs `in`, two 16-byte words a block) and writes them to the
// cache at `slot` (>= 0), codes `data_bytes` at a time (16, 8 or 1: StoreCuda's choice). Two blocks
// of one head vector are adjacent in the page (docs/format.md §4): at 16 their codes go as one
// store, and their two scale bytes as one 16-bit store where the scales are linear (K, or V
// with v_scale_swizzle=False; swizzled V scales of adjacent blocks are 4 bytes apart). A warp's
// code stores then write whole 32-byte sectors, two lanes each, where 8-byte stores wrote each
// sector in pieces of 8 bytes: the L2 is the store's busiest unit (benchmarks/NOTES.md, v20).
template <bool kIsF16, int kBlocks, ScaleSearch kSearch>
__device__ __forceinline__ void store_item(const StoreProblem& p, const WorkShape& shape,
                                           const PagePlacement& page, const WorkItem& w,
                                           int64_t slot,
                                           const uint4 (&in)[2 * kBlocks], StoreFactor factor,
                                           int data_bytes) {
  uint32_t row;
  const uint32_t block = shape.block_size.divmod(uint32_t(slot), &row);
  QuantizedBlock q[kBlocks];
  // 4over6's products from the thread's column of the table; the default search takes none.
  const auto products = [] {
    if constexpr (kSearch == ScaleSearch::k4Over6) {
      __shared__ float table[2 * 8 * kThreadsPerBlock];
      return CodeProductTable{table + threadIdx.x};
    } else {
      return CodeProducts{};
    }
  }();
#pragma unroll
  for (int blk = 0; blk < kBlocks; ++blk) {
    const uint32_t words[8] = {in[2 * blk].x,     in[2 * blk].y,     in[2 * blk].z,
                               in[2 * blk].w,     in[2 * blk + 1].x, in[2 * blk + 1].y,
                               in[2 * blk + 1].z, in[2 * blk + 1].w};
    float x[kBlockElems];
#pragma unroll
    for (int i = 0; i < 8; ++i) {
      x[2 * i] = widen(uint16_t(words[i] & 0xFFFFu), kIsF16);
      x[2 * i + 1] = widen(uint16_t(words[i] >> 16), kIsF16);
    }
    uint32_t signs[2];
    block_signs_of_halves(words, signs);
    q[blk] = quantize_block(x, signs, factor, kSearch, products);
  }
  uint8_t* const side = p.kv_cache + page.side_base(w.layer, block, w.side);
  const bool pair = kBlocks == 2 && data_bytes == 16;
  if (pair) {
    *reinterpret_cast<uint4*>(side + page.data_offset(w.head, row, w.first)) =
        make_uint4(q[0].packed[0], q[0].packed[1], q[1].packed[0], q[1].packed[1]);
  } else {
#pragma unroll
    for (int blk = 0; blk < kBlocks; ++blk) {
      uint8_t* const data = side + page.data_offset(w.head, row, w.first + uint32_t(blk));
      if (data_bytes >= kBlockBytes) {
        *reinterpret_cast<uint2*>(data) = make_uint2(q[blk].packed[0], q[blk].packed[1]);
      } else {
#pragma unroll
        for (int k = 0; k < kBlockBytes; ++k)
          data[k] = uint8_t(q[blk].packed[k / 4] >> (8 * (k % 4)));
      }
    }
  }
  if (pair && (w.side == 0 || !page.v_scale_swizzle)) {
    *reinterpret_cast<uint16_t*>(side + page.scale_offset(w.side, w.head, row, w.first)) =
        uint16_t(q[0].scale | (uint32_t(q[kBlocks - 1].scale) << 8));
  } else {
#pragma unroll
    for (int blk = 0; blk < kBlocks; ++blk)
      side[page.scale_offset(w.side, w.head, row, w.first + uint32_t(blk))] = q[blk].scale;
  }
}

// One work item per thread (the grid covers them all): a CTA lives for one item, so what it
// waits for is on the critical path of every CTA. A thread's slot, global scale and inputs are
// loaded independently of each other, and only then does it look at its slot. With two blocks a
// thread (the default search) the inputs' pieces pass through shared memory before that, so all
// the loads are in flight together: one memory round trip (store v21). Elsewhere ptxas tests
// the slot first and issues the other loads behind it, past the exit of a skipped slot: two
// trips. (ptxas moves non-coherent loads past the exit even from volatile asm; `ld.relaxed.gpu`
// stays ahead but bypasses L1, where the second and fourth of a lane's own loads hit.) The
// inputs of a token with a skipped slot are then read too (the call's own operands, never the
// cache) and not used.
template <bool kIsF16, int kBlocks, ScaleSearch kSearch>
__global__ void __launch_bounds__(kThreadsPerBlock, kMinCtasPerSm<kSearch>)
    StoreKernel(const StoreProblem p, const WorkShape shape, const PagePlacement page,
                uint32_t num_work, int data_bytes) {
  const uint32_t work = blockIdx.x * blockDim.x + threadIdx.x;
  const bool live = work < num_work;
  const WorkItem w = work_item<kBlocks>(shape, live ? work : 0u);
  const int64_t any_slot = p.valid_slot(w.layer, w.token);
  const float scale = *p.scale_of(w.layer, w.side);
  uint4 in[2 * kBlocks];
  load_inputs<kBlocks, kSearch>(item_input(p, w), in);

  const int64_t slot = live ? any_slot : -1;
  if (slot < 0) return;
  // g = 1/scale for the item's layer and side, worked out by each thread (a warp's lanes load
  // one or two words: broadcasts): no CTA barrier, so no warp waits for another's load and
  // divisions (store v16; one division a CTA behind a __syncthreads before, benchmarks/NOTES.md).
  const StoreFactor factor = StoreProblem::factor_of_scale(scale);
  store_item<kIsF16, kBlocks, kSearch>(p, shape, page, w, slot, in, factor, data_bytes);
}

template <bool kIsF16, int kBlocks, ScaleSearch kSearch>
void Launch(cudaStream_t stream, const StoreProblem& p, int64_t num_blocks_total,
            int data_bytes) {
  const int64_t num_work = num_blocks_total / kBlocks;
  const WorkShape shape{FastDivmod(uint32_t(p.page.head_size / kBlockElems / kBlocks)),
                        FastDivmod(uint32_t(p.page.num_kv_heads)),
                        FastDivmod(uint32_t(p.num_tokens)),
                        FastDivmod(uint32_t(p.page.block_size))};
  const int64_t grid = (num_work + kThreadsPerBlock - 1) / kThreadsPerBlock;  // < 2^23
  StoreKernel<kIsF16, kBlocks, kSearch>
      <<<grid, kThreadsPerBlock, 0, stream>>>(p, shape, PagePlacement(p), uint32_t(num_work),
                                              data_bytes);
}

// The dtype, the blocks per thread and the scale search are compile-time in the kernel.
template <bool kIsF16, int kBlocks>
void LaunchForSearch(cudaStream_t stream, const StoreProblem& p, int64_t num_blocks_total,
                     int data_bytes) {
  if (p.scale_search == ScaleSearch::k4Over6)
    Launch<kIsF16, kBlocks, ScaleSearch::k4Over6>(stream, p, num_blocks_total, data_bytes);
  else
    Launch<kIsF16, kBlocks, ScaleSearch::kDefault>(stream, p, num_blocks_total, data_bytes);
}

ffi::Error StoreCuda(cudaStream_t stream, ffi::AnyBuffer key, ffi::AnyBuffer value,
                     ffi::Buffer<ffi::U8> kv_cache, ffi::AnyBuffer slot_mapping,
                     ffi::Buffer<ffi::F32> k_scale, ffi::Buffer<ffi::F32> v_scale,
                     ffi::Result<ffi::Buffer<ffi::U8>> kv_cache_out, int32_t layout,
                     int32_t scale_search, bool v_scale_swizzle) {
  StoreProblem p;
  ffi::Error error = MakeStoreProblem(key, value, kv_cache, slot_mapping, k_scale, v_scale,
                                      kv_cache_out, layout, scale_search, v_scale_swizzle, &p);
  if (error.failure()) return error;
  // XLA aliases the result to kv_cache; should it ever hand over two buffers, start from a copy.
  if (kv_cache.untyped_data() != kv_cache_out->untyped_data()) {
    const cudaError_t copied =
        cudaMemcpyAsync(kv_cache_out->untyped_data(), kv_cache.untyped_data(),
                        kv_cache.size_bytes(), cudaMemcpyDeviceToDevice, stream);
    if (copied != cudaSuccess) return CudaError("reshape_and_cache", "copying kv_cache", copied);
  }
  const int64_t num_blocks_total =
      p.num_layers * p.num_tokens * 2 * p.page.num_kv_heads * (p.page.head_size / kBlockElems);
  if (num_blocks_total == 0) return ffi::Error::Success();
  constexpr int64_t kIndexLimit = int64_t(1) << 31;
  if (num_blocks_total >= kIndexLimit || p.num_blocks * p.page.block_size >= kIndexLimit)
    return InvalidArgument("more than 2^31 blocks of 16 values or cache slots in one call");
  if (p.page.side_bytes() >= kIndexLimit)  // PagePlacement's offsets inside a page side
    return InvalidArgument("a page side of 2^31 bytes or more");
  // The widest code store every block of the call allows: 16 bytes (a thread's two blocks)
  // where every page side and the cache start 16-byte aligned, 8 (a block) where the sides
  // start 8-byte aligned, else bytes.
  const int data_bytes = p.page.side_bytes() % 16 == 0 &&
                                 reinterpret_cast<uintptr_t>(p.kv_cache) % 16 == 0
                             ? 16
                             : p.page.side_bytes() % kBlockBytes == 0 ? kBlockBytes : 1;
  // Two blocks a thread where a head vector has an even number of them: more loads in flight
  // and the index arithmetic shared. (Four measured 1.7x slower on an H200: benchmarks/NOTES.md,
  // store v10.) A small store (kSmallStoreBlocks: a decode step's few tokens; at most 256 CTAs,
  // under one wave of 4 per SM on an H100/H200) is one partial wave either way, and its time is
  // one thread's chain of instructions: one block a thread halves it.
  const bool pairs = (p.page.head_size / kBlockElems) % 2 == 0 &&
                     num_blocks_total > kSmallStoreBlocks;
  if (p.is_f16) {
    if (pairs) LaunchForSearch<true, 2>(stream, p, num_blocks_total, data_bytes);
    else LaunchForSearch<true, 1>(stream, p, num_blocks_total, data_bytes);
  } else {
    if (pairs) LaunchForSearch<false, 2>(stream, p, num_blocks_total, data_bytes);
    else LaunchForSearch<false, 1>(stream, p, num_blocks_total, data_bytes);
  }
  const cudaError_t launched = cudaGetLastError();
  if (launched != cudaSuccess) return CudaError("reshape_and_cache", "kernel launch", launched);
  return ffi::Error::Success();
}

// The self-checks (counted by CountOnEvery32Bits, cuda_common.cuh). The device's e2m1 rounding
// against the comparison ladder, all bits, and (u < 8) each code's value read off those bits
// against the table's.
struct E2m1Differs {
  __device__ bool operator()(uint32_t u) const {
    const float y = bits_float(u);
    bool differs =
        e2m1_magnitude_bits(y) != kE2m1MagnitudeBase + e2m1_magnitude_code_ladder(abs_f(y));
    if (u < 8u)
      differs |= float_bits(e2m1_magnitude_of_bits(kE2m1MagnitudeBase + u)) !=
                 float_bits(e2m1_magnitude(uint8_t(u)));
    return differs;
  }
};

// The hardware's e4m3 conversions (what the store uses with NVFP4_HW_E4M3) against the
// software's, on every sm_89+ build whatever the option: every float encoded, and (u < 256)
// every byte decoded, the same bits or both NaN. (Without them, the store's own against the
// software's: the same functions.)
struct E4m3Differs {
  __device__ bool operator()(uint32_t u) const {
#if NVFP4_HAS_HW_E4M3
    const auto encode = e4m3_encode_hardware;
    const auto decode = e4m3_decode_hardware;
#else
    const auto encode = e4m3_encode;
    const auto decode = e4m3_decode;
#endif
    const float x = bits_float(u);
    bool differs = encode(x) != e4m3_encode_software(x);
    if (u < 256u) {
      const float a = decode(uint8_t(u)), b = e4m3_decode_software(uint8_t(u));
      differs |= !(is_nan(a) && is_nan(b)) && float_bits(a) != float_bits(b);
    }
    return differs;
  }
};

}  // namespace

int64_t E2m1CodeMismatchesCuda() { return CountOnEvery32Bits(E2m1Differs{}); }

int64_t E4m3MismatchesCuda() { return CountOnEvery32Bits(E4m3Differs{}); }

}  // namespace nvfp4

XLA_FFI_DEFINE_HANDLER_SYMBOL(
    NvFp4StoreCuda, nvfp4::StoreCuda,
    nvfp4::BindStore(xla::ffi::Ffi::Bind().Ctx<xla::ffi::PlatformStream<cudaStream_t>>()),
    {xla::ffi::Traits::kCmdBufferCompatible});
