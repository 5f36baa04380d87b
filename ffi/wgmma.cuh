// Hopper's warpgroup matrix multiply (wgmma, sm_90a) as the ragged-attention kernel uses it
// (ffi/ragged_cuda.cu), in a header of its own so that benchmarks/wgmma_probe.cu checks the very
// same code against the CPU. Nothing here depends on XLA.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

namespace nvfp4 {
namespace {

// wgmma exists in device code compiled for sm_90a (CMakeLists.txt builds 90a).
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
constexpr bool kHasWgmma = true;
#else
constexpr bool kHasWgmma = false;
#endif

__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return uint32_t(__cvta_generic_to_shared(p));
}

// Byte offset of element (row, col) of a [rows x 64] 16-bit block with 128-byte rows in the
// 128-byte swizzle: 16-byte chunk c of row r is stored at chunk c ^ (r % 8) (rows of a block
// 1024-byte aligned in groups of 8).
__host__ __device__ __forceinline__ int swizzle128_offset(int row, int col) {
  // (row, col >= 0; bit operations rather than / and %, which cost more on signed ints)
  return row * 128 + ((((col * 2) >> 4) ^ (row & 7)) << 4) + ((col * 2) & 15);
}

// wgmma (sm_90a): one warpgroup (the CTA's 4 warps) multiplies a 64-row A held in registers
// (the mma.sync A-fragment layout, warp w holding rows 16 w .. 16 w + 15) by a B in shared
// memory read through a descriptor; the accumulators have the mma.sync C layout, 8 columns per
// group of 4 registers.
// A shared-memory matrix descriptor without swizzle (8 x 16-byte core matrices): start
// address, the byte offsets between core matrices along the leading and along the strided
// dimension.
__device__ __forceinline__ uint64_t interleaved_desc(const void* p, uint32_t leading_bytes,
                                                     uint32_t stride_bytes) {
  const uint32_t a = shared_address(p);
  return uint64_t((a & 0x3FFFF) >> 4) | (uint64_t((leading_bytes >> 4) & 0x3FFF) << 16) |
         (uint64_t((stride_bytes >> 4) & 0x3FFF) << 32);
}

// The same fields with the 128-byte swizzle (layout type 1 in bits 62-63): the byte offset
// between 64-element blocks along the leading dimension (MN-major B) and between 8-row groups.
__device__ __forceinline__ uint64_t swizzled_desc(const void* p, uint32_t leading_bytes,
                                                  uint32_t stride_bytes) {
  return interleaved_desc(p, leading_bytes, stride_bytes) | (uint64_t(1) << 62);
}

// The descriptor `desc` moved `bytes` further on in shared memory (a multiple of 16): the start
// address field is the address / 16 in the low 14 bits, and shared addresses stay below 256 KB,
// so the sum does not carry out of it. Lets a loop build its descriptors once.
__device__ __forceinline__ uint64_t desc_plus(uint64_t desc, uint32_t bytes) {
  return desc + (bytes >> 4);
}

// Pins accumulator registers in place around the wgmma that owns them (CUTLASS's
// warpgroup_fence_operand): an empty asm that "modifies" each one, so the compiler moves no read
// or write of them across the asynchronous multiply, its commit or its wait. No instruction.
template <int N>
__device__ __forceinline__ void wgmma_fence_operands(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

__device__ __forceinline__ void wgmma_fence() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.fence.sync.aligned;\n" ::: "memory");
#endif
}
// Commit the wgmma issued since the last commit as a group; wait until at most N committed
// groups are pending (asynchronous use: the pipelined prefill kernel); or both, synchronous.
__device__ __forceinline__ void wgmma_commit() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.commit_group.sync.aligned;\n" ::: "memory");
#endif
}
template <int N>
__device__ __forceinline__ void wgmma_wait() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("wgmma.wait_group.sync.aligned %0;\n" ::"n"(N) : "memory");
#endif
}
__device__ __forceinline__ void wgmma_commit_and_wait() {
  wgmma_commit();
  wgmma_wait<0>();
}

// Shared memory written by threads (the generic proxy) and read next by wgmma (the async
// proxy): each writing thread fences before the barrier that hands the data over.
__device__ __forceinline__ void fence_proxy_async_shared() {
  asm volatile("fence.proxy.async.shared::cta;\n" ::: "memory");
}

// Registers handed between the warpgroups of a CTA (sm_90a; every warp of the warpgroup runs
// it): down to N a thread, or up to N once others have given theirs.
template <int N>
__device__ __forceinline__ void setmaxnreg_dec() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(N));
#endif
}
template <int N>
__device__ __forceinline__ void setmaxnreg_inc() {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(N));
#endif
}

// Named barriers between warpgroups: `threads` threads (a multiple of 32) take part, some
// waiting (sync), the others only arriving. The unaligned forms: `bar.sync` and `bar.arrive`
// are `barrier.sync.aligned` and `barrier.arrive.aligned`, which promise that every thread
// taking part executes the same instruction; here one phase of a barrier is reached from
// several places (the producer's arrive, a consumer's main loop, a consumer's drain loop),
// which only the unaligned forms allow (compute-sanitizer synccheck reports the aligned ones).
__device__ __forceinline__ void named_sync(int id, int threads) {
  asm volatile("barrier.sync %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}
__device__ __forceinline__ void named_arrive(int id, int threads) {
  asm volatile("barrier.arrive %0, %1;\n" ::"r"(id), "r"(threads) : "memory");
}

// Keeps registers that an asynchronous wgmma reads (its A fragments) alive and unchanged until
// this point (after its wait): an empty asm that "modifies" them (no instruction).
template <int N>
__device__ __forceinline__ void wgmma_keep_a_operands(uint32_t (&a)[N][4]) {
#pragma unroll
  for (int i = 0; i < N; ++i)
#pragma unroll
    for (int r = 0; r < 4; ++r) asm volatile("" : "+r"(a[i][r])::"memory");
}

// d[64 x 8] += a[64 x 16] b[16 x 8], b K-major (the pipelined prefill kernel's row sums: b all
// ones, ragged_pipelined.cu).
__device__ __forceinline__ void wgmma_64x8(float (&d)[4], const uint32_t (&a)[4], uint64_t b) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n8k16.f32.f16.f16 {%0,%1,%2,%3}, {%4,%5,%6,%7}, %8, 1, 1, "
      "1, 0;\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
#endif
}

// d[64 x 32] += a[64 x 16] b[16 x 32], b K-major (the few-row kernel's wide path,
// few_rows_wide.cuh).
__device__ __forceinline__ void wgmma_64x32(float (&d)[16], const uint32_t (&a)[4], uint64_t b) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n32k16.f32.f16.f16 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15}, {%16,%17,%18,%19}, %20, 1, 1, 1, "
      "0;\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b));
#endif
}

// d[64 x 64] += a[64 x 16] b[16 x 64]; kTransB: b is MN-major (else K-major).
template <int kTransB>
__device__ __forceinline__ void wgmma_64x64(float (&d)[32], const uint32_t (&a)[4], uint64_t b) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.f16.f16 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,"
      "%24,%25,%26,%27,%28,%29,%30,%31}, {%32,%33,%34,%35}, %36, 1, 1, 1, %37;\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]),
        "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]),
        "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(kTransB));
#endif
}

// d[64 x 128] += a[64 x 16] b[16 x 128]; kTransB: b is MN-major (else K-major).
template <int kTransB>
__device__ __forceinline__ void wgmma_64x128(float (&d)[64], const uint32_t (&a)[4], uint64_t b) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  asm volatile(
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.f16.f16 "
      "{%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,%16,%17,%18,%19,%20,%21,%22,%23,"
      "%24,%25,%26,%27,%28,%29,%30,%31,%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,"
      "%46,%47,%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63}, "
      "{%64,%65,%66,%67}, %68, 1, 1, 1, %69;\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]),
        "+f"(d[7]), "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]),
        "+f"(d[14]), "+f"(d[15]), "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]),
        "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]), "+f"(d[24]), "+f"(d[25]),
        "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]),
        "+f"(d[38]), "+f"(d[39]), "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]),
        "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]), "+f"(d[48]), "+f"(d[49]),
        "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]),
        "+f"(d[62]), "+f"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(b), "n"(kTransB));
#endif
}

}  // namespace
}  // namespace nvfp4
