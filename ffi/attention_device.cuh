// Device code shared by the attention kernels over the NVFP4 cache (decode_cuda.cu: one query
// token per sequence; ragged_cuda.cu: many): the tensor-core and register helpers, the E2M1 and
// E4M3 -> fp16 conversions, how a CTA finds a position's bytes in the pages (PageView), q and
// output in their dtypes, and the log-sum-exp merge of split-KV partial results.
//
// Numbers (both kernels): K_f16 = code * 2^-14 * (block scale * 2^7), exact, so K = K_f16 *
// k_scale * 2^7 (likewise V); q is rounded to fp16 after a power-of-two scale 2^e per query row
// that puts its largest element in [2^14, 2^15) (q_exponent); scores are S_acc * k_scale *
// sm_scale * 2^(7-e), in log2 units for exp2; outputs are O_acc / l * v_scale * 2^7.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#include <cuda_runtime.h>

#include <climits>
#include <cmath>
#include <cstdint>
#include <type_traits>

#include "cuda_common.cuh"
#include "ffi_checks.h"
#include "nvfp4_numerics.h"

namespace nvfp4 {
namespace {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;

// ------------------------------------------------------------------------------------------
// Register-level helpers.

__device__ __forceinline__ void mma_16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                          uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
      "{%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Transpose of an 8x8 matrix of 16-bit values held one row-pair per lane (row lane/4, columns
// 2*(lane%4), +1), in the same layout.
__device__ __forceinline__ uint32_t transpose_8x8(uint32_t x) {
  uint32_t y;
  asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;\n" : "=r"(y) : "r"(x));
  return y;
}

// Packed fp16 product, subnormals kept (no .ftz): the products below must be exact.
__device__ __forceinline__ uint32_t hmul2(uint32_t a, uint32_t b) {
  uint32_t d;
  asm("mul.rn.f16x2 %0, %1, %2;\n" : "=r"(d) : "r"(a), "r"(b));
  return d;
}

__device__ __forceinline__ uint32_t prmt(uint32_t a, uint32_t b, uint32_t selector) {
  return __byte_perm(a, b, selector);
}

__device__ __forceinline__ float exp2_approx(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;\n" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ uint32_t pack_f16x2(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

// Eight E2M1 codes (code i in bits 4i..4i+3 of w) as four f16x2 words of value * 2^-14,
// exactly: a code's magnitude bits (e1 e0 m) become the fp16 bits 11..9 (exponent e, mantissa
// m: 2^(e-15) * (1 + m/2), or the subnormal 2^-14 * m/2 for e = 0), its sign bit 15; every
// other bit is 0, so a half is one byte, (sign << 7 | magnitude << 1) << 8.
//   r[0] = (code 0, code 4), r[1] = (code 2, code 6), r[2] = (code 1, code 5),
//   r[3] = (code 3, code 7)   (low half, high half).
// Ten instructions (was 13: two shifts and an and-or per output after two masks): the bytes of
// the even codes (0, 2, 4, 6) and of the odd ones are built whole, each as one bit select
// (c ? b : a, lop3 0xD8) between the signs, S = w & 0x88888888, shifted to bit 7 of their byte,
// and w shifted so that the code's magnitude lands in bits 1..3 of its byte; then each output
// takes two of those bytes into its high bytes, by a byte permute (zeros from RZ) or a mask.
// Fewer instructions, and fewer on the FMA pipe (2 IMAD.SHL, was 6), one more on the ALU pipe.
// decode_cuda.cu's E2m1ToF16Differs checks it against the spec's values on every 32-bit word
// on the GPU (test_numerics).
__device__ __forceinline__ uint32_t select_bits(uint32_t a, uint32_t b) {  // 0x0E: b, else a
  uint32_t d;
  asm("lop3.b32 %0, %1, %2, %3, 0xD8;\n" : "=r"(d) : "r"(a), "r"(b), "n"(0x0E0E0E0E));
  return d;
}

__device__ __forceinline__ void e2m1x8_to_f16x2(uint32_t w, uint32_t (&r)[4]) {
  uint32_t signs;
  asm("lop3.b32 %0, %1, %2, 0, 0xC0;\n" : "=r"(signs) : "r"(w), "n"(0x88888888));
  const uint32_t even = select_bits(signs << 4, w << 1);  // byte k: code 2k
  const uint32_t odd = select_bits(signs, w >> 3);        // byte k: code 2k + 1
  r[0] = prmt(even, 0u, 0x2404);
  r[1] = even & 0xFF00FF00u;
  r[2] = prmt(odd, 0u, 0x2404);
  r[3] = odd & 0xFF00FF00u;
}

// Two E4M3 bytes (low byte -> low half) as f16x2 of value * 2^7: exact (|448 * 2^7| < 65504,
// subnormals included), NaN (0x7F/0xFF) stays NaN.
__device__ __forceinline__ uint32_t e4m3x2_to_f16x2_x128(uint32_t two_bytes) {
  const __half2_raw h =
      __nv_cvt_fp8x2_to_halfraw2(__nv_fp8x2_storage_t(two_bytes & 0xFFFFu), __NV_E4M3);
  return hmul2(uint32_t(h.x) | (uint32_t(h.y) << 16), 0x58005800u);  // x 128
}

template <int kBytes>
__device__ __forceinline__ void load_words(const uint8_t* p, uint32_t* w) {
  if constexpr (kBytes % 16 == 0) {
#pragma unroll
    for (int i = 0; i < kBytes / 16; ++i) {
      const uint4 v = __ldg(reinterpret_cast<const uint4*>(p) + i);
      w[4 * i] = v.x, w[4 * i + 1] = v.y, w[4 * i + 2] = v.z, w[4 * i + 3] = v.w;
    }
  } else if constexpr (kBytes == 8) {
    const uint2 v = __ldg(reinterpret_cast<const uint2*>(p));
    w[0] = v.x, w[1] = v.y;
  } else {
    static_assert(kBytes == 4, "4, 8 or a multiple of 16 bytes");
    w[0] = __ldg(reinterpret_cast<const uint32_t*>(p));
  }
}

template <int kBytes>
__device__ __forceinline__ uint32_t load_small(const uint8_t* p) {
  if constexpr (kBytes == 4) return __ldg(reinterpret_cast<const uint32_t*>(p));
  else if constexpr (kBytes == 2) return __ldg(reinterpret_cast<const uint16_t*>(p));
  else return __ldg(p);
}

// Everything a CTA needs to find a position's bytes.
template <Layout kLayout>
struct PageView {
  const uint8_t* cache;    // this member's cache
  const int32_t* table;    // this sequence's row of block_tables
  int64_t page_bytes;      // 2 * side bytes
  int32_t side_bytes;
  int32_t side_data;       // data region bytes of one side
  int32_t head_row;        // plane row of (this kv head, row 0)
  int32_t num_kv_heads;    // plane rows between consecutive token rows in NHD (1 in HND)
  int32_t last_page;       // num_blocks - 1
  FastDivmod block_size;
  bool tile_in_page;       // block_size % 16 == 0: a 16-token tile never crosses a page (decode)

  // A page id read from the block table, clamped into the cache (never read outside the
  // cache, whatever the table holds): >= 0 wherever a page is read (a cache without pages has
  // no table columns: the handlers check it).
  __device__ __forceinline__ int32_t clamped_page(int32_t page) const {
    return min(max(page, 0), last_page);
  }
  // Byte offset (from `cache`) of a page id read from the block table.
  __device__ __forceinline__ int64_t page_offset(int32_t page) const {
    return int64_t(clamped_page(page)) * page_bytes;
  }
  // The same page's first byte, as one unsigned 32 x 32 -> 64-bit product (the handlers bound
  // a page below 2^31 bytes): the tile kernels' copies use it; the decode loop keeps
  // page_offset, whose signed form ptxas fits in its 128 registers without a spill.
  __device__ __forceinline__ const uint8_t* page_address(int32_t page) const {
    return cache + uint64_t(uint32_t(clamped_page(page))) * uint32_t(page_bytes);
  }
  // The page offset of a position, and its row in the page.
  __device__ __forceinline__ int64_t locate(uint32_t position, uint32_t* row) const {
    const uint32_t index = block_size.divmod(position, row);
    return page_offset(__ldg(table + index));
  }
  __device__ __forceinline__ int32_t plane_row(uint32_t row) const {
    return head_row + int32_t(row) * (kLayout == Layout::kHND ? 1 : num_kv_heads);
  }
  // Offset in a side's scale region of block scale s (of kScales) of page row `row`, for
  // swizzled V scales (docs/format.md §4: plane row 4 (row / 4) + s / G, column 4 (s % G) +
  // row % 4, G = kScales / 4): the bytes of rows 4k .. 4k+3 of one block are adjacent.
  template <int kScales>
  __device__ __forceinline__ int32_t swizzled_scale_offset(uint32_t row, int s) const {
    constexpr int kGroup = kScales / 4;
    return plane_row((row & ~3u) + s / kGroup) * kScales + (s % kGroup) * 4 + int32_t(row & 3u);
  }
  // The same for linear scales (K always; V with v_scale_swizzle=False).
  template <int kScales>
  __device__ __forceinline__ int32_t linear_scale_offset(uint32_t row, int s) const {
    return plane_row(row) * kScales + s;
  }
};


// ------------------------------------------------------------------------------------------
// q and the output in their dtypes.

__device__ __forceinline__ void store_out(void* out, QType type, int64_t i, float x) {
  switch (type) {
    case QType::kBF16:
      static_cast<__nv_bfloat16*>(out)[i] = __float2bfloat16_rn(x);
      break;
    case QType::kF16:
      static_cast<__half*>(out)[i] = __float2half_rn(x);
      break;
    default:
      static_cast<float*>(out)[i] = x;
  }
}

// store_out's rounding for two values of a 16-bit out (bf16 or fp16), packed in one word, lo
// in the low half (for kernels that write 16-byte pieces of a row).
__device__ __forceinline__ uint32_t pack_out16x2(QType type, float lo, float hi) {
  if (type == QType::kBF16) {
    const __nv_bfloat162 b = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<const uint32_t*>(&b);
  }
  return pack_f16x2(lo, hi);
}

// Eight q values at 16 bits (bf16 or fp16, the type's), in one 16-byte word, as float32.
__device__ __forceinline__ void widen_q8(QType type, uint4 v, float* x) {
  const uint32_t w[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
  for (int k = 0; k < 4; ++k) {
    const uint16_t lo = uint16_t(w[k] & 0xFFFFu), hi = uint16_t(w[k] >> 16);
    if (type == QType::kBF16) {
      x[2 * k] = __bfloat162float(__ushort_as_bfloat16(lo));
      x[2 * k + 1] = __bfloat162float(__ushort_as_bfloat16(hi));
    } else {
      x[2 * k] = __half2float(__ushort_as_half(lo));
      x[2 * k + 1] = __half2float(__ushort_as_half(hi));
    }
  }
}

// Eight q values from element i (a multiple of 8) as float32, in 16-byte loads (q is 16-byte
// aligned: ReadAttentionOperands checks it).
__device__ __forceinline__ void load_q8(const void* q, QType type, int64_t i, float (&x)[8]) {
  if (type == QType::kF32) {
    const float4* p = reinterpret_cast<const float4*>(static_cast<const float*>(q) + i);
    const float4 a = __ldg(p), b = __ldg(p + 1);
    x[0] = a.x, x[1] = a.y, x[2] = a.z, x[3] = a.w, x[4] = b.x, x[5] = b.y, x[6] = b.z,
    x[7] = b.w;
    return;
  }
  widen_q8(type, __ldg(reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(q) + i)), x);
}

// kN q values from element i (multiples of 8) as load_q8 gives them, every load issued before
// any value is widened: one branch on the type around them all. (load_q8 a group at a time puts
// a type branch around each load, and the pipelined prefill kernel's consumers waited for each
// load before the next went out: eight round trips between a CTA's start and its first step;
// ragged v26.)
template <int kN>
__device__ __forceinline__ void load_q_values(const void* q, QType type, int64_t i,
                                              float (&x)[kN]) {
  static_assert(kN % 8 == 0, "whole 16-byte loads");
  if (type == QType::kF32) {
    const float4* p = reinterpret_cast<const float4*>(static_cast<const float*>(q) + i);
    float4 a[kN / 4];
#pragma unroll
    for (int j = 0; j < kN / 4; ++j) a[j] = __ldg(p + j);
#pragma unroll
    for (int j = 0; j < kN / 4; ++j)
      x[4 * j] = a[j].x, x[4 * j + 1] = a[j].y, x[4 * j + 2] = a[j].z, x[4 * j + 3] = a[j].w;
    return;
  }
  const uint4* p = reinterpret_cast<const uint4*>(static_cast<const uint16_t*>(q) + i);
  uint4 v[kN / 8];
#pragma unroll
  for (int j = 0; j < kN / 8; ++j) v[j] = __ldg(p + j);
#pragma unroll
  for (int j = 0; j < kN / 8; ++j) widen_q8(type, v[j], x + 8 * j);
}

// The power-of-two exponent e that puts amax * 2^e in [2^14, 2^15) (0 for 0, Inf, NaN): q
// rounded to fp16 after it keeps 11 significant bits and cannot overflow.
__device__ __forceinline__ int q_exponent(float amax) {
  int exponent = 0;
  if (amax > 0.f && amax <= 3.402823466e38f) {
    frexpf(amax, &exponent);  // amax in [2^(x-1), 2^x)
    exponent = 15 - exponent;  // amax * 2^e in [2^14, 2^15)
  }
  return exponent;
}

// x * 2^e for the exponents q_exponent gives (|e| <= 140) as two products by normal powers of
// two: exact where x * 2^e is a normal float, and with flush-to-zero arithmetic zero (of x's
// sign) below that, as ldexpf then gives after the fp16 rounding the callers apply (fp16's
// smallest subnormal is 2^-24). ldexpf's general path is about a dozen instructions a value.
struct PowerOfTwo {
  float lo, hi;
  __device__ __forceinline__ explicit PowerOfTwo(int e)
      : lo(bits_float(uint32_t(e / 2 + 127) << 23)),
        hi(bits_float(uint32_t(e - e / 2 + 127) << 23)) {}
  __device__ __forceinline__ float operator()(float x) const { return x * lo * hi; }
};

// ------------------------------------------------------------------------------------------
// Split-KV: the partial results of `count` splits of one query row (lse(s): the log2-unit lse of
// split s, -inf for a split with nothing in it; partial(s): the split's output normalised by
// its own sum, one value (float) or four adjacent ones (float4)), combined with weights
// 2^(lse_s - max). Returns the combined value(s) (0 where every split is empty, NaN where any
// split's lse is NaN: a NaN score, as the jnp path gives) and sets *lse2 to the combined log2
// lse (-inf, NaN then). The merge kernels read the splits from global memory, the decode
// kernel's cluster merge from its peers' shared memory.
__device__ __forceinline__ void fill_value(float& v, float x) { v = x; }
__device__ __forceinline__ void fill_value(float4& v, float x) { v = make_float4(x, x, x, x); }
__device__ __forceinline__ void add_weighted(float& acc, float w, float x) { acc += w * x; }
__device__ __forceinline__ void add_weighted(float4& acc, float w, float4 x) {
  acc.x += w * x.x, acc.y += w * x.y, acc.z += w * x.z, acc.w += w * x.w;
}
__device__ __forceinline__ float divided(float a, float b) { return a / b; }
__device__ __forceinline__ float4 divided(float4 a, float b) {
  return make_float4(a.x / b, a.y / b, a.z / b, a.w / b);
}
template <typename Lse, typename Partial>
__device__ __forceinline__ auto merge_splits(int count, Lse&& lse, Partial&& partial,
                                             float* lse2) {
  using Value = std::decay_t<decltype(partial(0))>;
  float top = -INFINITY;
  bool nan = false;
  for (int s = 0; s < count; ++s) {
    const float x = lse(s);
    top = fmaxf(top, x);  // fmaxf passes NaN over: counted apart
    nan |= isnan(x);
  }
  Value acc;
  if (nan || top == -INFINITY) {
    *lse2 = nan ? NAN : -INFINITY;
    fill_value(acc, nan ? NAN : 0.f);
    return acc;
  }
  float sum = 0.f;
  fill_value(acc, 0.f);
  for (int s = 0; s < count; ++s) {
    const float x = lse(s);
    if (x == -INFINITY) continue;  // an empty split: its partial output was not written
    const float weight = exp2_approx(x - top);
    sum += weight;
    add_weighted(acc, weight, partial(s));
  }
  *lse2 = top + __log2f(sum);
  return divided(acc, sum);
}

// merge_splits over the split-KV workspace of one row: lse [count], partial [count][stride],
// dimension d.
__device__ __forceinline__ float merge_workspace_splits(const float* lse, const float* partial,
                                                        int64_t stride, int count, int d,
                                                        float* lse2) {
  return merge_splits(
      count, [&](int s) { return lse[s]; }, [&](int s) { return partial[s * stride + d]; },
      lse2);
}

// Rows of out and lse that get the readers' rule for an invalid global scale, or the zeros of
// an empty sequence: `rows` rows of kHead values from first_row, by the CTA's threads.
template <int kHead>
__device__ __forceinline__ void fill_rows(void* out, QType type, float* lse, int64_t first_row,
                                          int rows, float value, float lse_value) {
  for (int i = threadIdx.x; i < rows * kHead; i += blockDim.x)
    store_out(out, type, first_row * kHead + i, value);
  for (int i = threadIdx.x; i < rows; i += blockDim.x) lse[first_row + i] = lse_value;
}

// Sequence b's query tokens [*start, *next) of a ragged call (every lane of the warp gets
// them): start_b = clamp(max(cu_q_lens[0..b]), 0, num_tokens), the rule of
// jax_nvfp4.reference.ragged_token_plan; the caller checks b < num_seqs (b = -1: both are
// clamp(cu_q_lens[0])).
__device__ __forceinline__ void sequence_tokens(const int32_t* cu, int32_t b, int32_t num_tokens,
                                                int lane, int32_t* start, int32_t* next) {
  int32_t m = INT_MIN;
  for (int32_t i = lane; i <= b; i += 32) m = max(m, __ldg(cu + i));
#pragma unroll
  for (int d = 16; d > 0; d /= 2) m = max(m, __shfl_xor_sync(0xFFFFFFFFu, m, d));
  *start = min(max(m, 0), num_tokens);
  *next = min(max(max(m, __ldg(cu + b + 1)), 0), num_tokens);
}

// ------------------------------------------------------------------------------------------
// Host: the kernels take the head size, the V-scale order and the layout as template
// parameters (register arrays and address arithmetic depend on them). These call
// `launch(std::integral_constant<int, head>)` for the head sizes the kernels are built for
// (64, 128, 256; any other value: `otherwise`), and `launch(std::bool_constant<swizzle>,
// std::integral_constant<Layout, layout>)` for the page's options.
template <typename Launch, typename Result>
Result WithHeadSize(int64_t head_size, Launch&& launch, Result otherwise) {
  switch (head_size) {
    case 64: return launch(std::integral_constant<int, 64>{});
    case 128: return launch(std::integral_constant<int, 128>{});
    case 256: return launch(std::integral_constant<int, 256>{});
    default: return otherwise;
  }
}

template <typename Launch>
cudaError_t WithPageOptions(const PageGeometry& page, Launch&& launch) {
  using Hnd = std::integral_constant<Layout, Layout::kHND>;
  using Nhd = std::integral_constant<Layout, Layout::kNHD>;
  const bool hnd = page.layout == Layout::kHND;
  if (page.v_scale_swizzle)
    return hnd ? launch(std::true_type{}, Hnd{}) : launch(std::true_type{}, Nhd{});
  return hnd ? launch(std::false_type{}, Hnd{}) : launch(std::false_type{}, Nhd{});
}

}  // namespace
}  // namespace nvfp4
