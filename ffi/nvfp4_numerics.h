// NVFP4 numerics and page layout shared by the CPU and CUDA store kernels.
//
// Everything here follows docs/format.md (cited as "docs/format.md §N"). The functions are
// inline and usable from host and device code so that both kernels compute the same bytes.
// Every float operation whose rounding matters goes through mul_rn/add_rn/div_rn: on the
// device these are the correctly rounded intrinsics (never contracted into an FMA); on the
// host the library is compiled with -ffp-contract=off, so plain operators are exact IEEE
// float32 operations.
//
// Float32 subnormals flush to zero, as inputs and as results of every operation
// (docs/format.md §2): this is what XLA:CPU does to the jnp reference (it runs with FTZ and DAZ
// set) and what GPU kernels commonly do. The CUDA code is compiled with --ftz=true and the
// CPU handler sets FTZ/DAZ itself (FlushDenormalsScope), so all three agree on such inputs.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#include <cuda_fp16.h>
#include <cuda_fp8.h>
#endif

// The e4m3 conversions of the block scales on the device: 1 (the default), the hardware's (cvt
// with satfinite, sm_89 and newer), which must give the software's bytes (E4m3MismatchesCuda
// checks every float and byte on any sm_89+ build: 0 mismatches on an H200, 2026-12-02); 0, the
// software's below on every architecture (CMAKE_CUDA_FLAGS=-DNVFP4_HW_E4M3=0). The store with
// the hardware's: 24 fewer instructions a block, 72.2 / 259.4 us against 75.1 / 261.0 at 32768 /
// 131072 tokens x 8 kv heads (H200, benchmarks/RESULTS.md, store v14).
#ifndef NVFP4_HW_E4M3
#define NVFP4_HW_E4M3 1
#endif
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 890
#define NVFP4_HAS_HW_E4M3 1
#else
#define NVFP4_HAS_HW_E4M3 0
#endif
#define NVFP4_DEVICE_E4M3 (NVFP4_HAS_HW_E4M3 && NVFP4_HW_E4M3)

#if defined(__CUDACC__)
#define NVFP4_HD __host__ __device__ __forceinline__
#else
#define NVFP4_HD inline
#endif

namespace nvfp4 {

// Elements per FP8 block scale (docs/format.md §1).
constexpr int kBlockElems = 16;
// Packed bytes of one 16-element block: two e2m1 codes per byte (docs/format.md §2 step 7).
constexpr int kBlockBytes = kBlockElems / 2;
// Largest finite e4m3fn magnitude; the block scale saturates here (docs/format.md §2 step 4).
constexpr float kE4M3Max = 448.0f;
// The byte stored for a NaN block scale: positive e4m3fn NaN.
constexpr uint8_t kE4M3NaN = 0x7F;

// Valid global scales (k_scale, v_scale): float32 numbers in [kMinScale, kMaxScale], the range of
// jax_nvfp4.layout.MIN_SCALE and MAX_SCALE (bindings.cc exports these two; a test compares
// them). The readers' kernels make every output NaN when either scale is outside it.
constexpr float kMinScale = 0x1p-126f;
constexpr float kMaxScale = 0x1p116f;
NVFP4_HD bool scale_is_valid(float s) { return s >= kMinScale && s <= kMaxScale; }

enum class Layout : int32_t { kHND = 0, kNHD = 1 };
enum class ScaleSearch : int32_t { kDefault = 0, k4Over6 = 1 };

// ---------------------------------------------------------------------------------------
// Correctly rounded float32 operations, never fused.
NVFP4_HD float mul_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fmul_rn(a, b);
#else
  return a * b;
#endif
}
NVFP4_HD float add_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fadd_rn(a, b);
#else
  return a + b;
#endif
}
NVFP4_HD float sub_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fsub_rn(a, b);
#else
  return a - b;
#endif
}
NVFP4_HD float div_rn(float a, float b) {
#if defined(__CUDA_ARCH__)
  return __fdiv_rn(a, b);
#else
  return a / b;
#endif
}

NVFP4_HD uint32_t float_bits(float x) {
#if defined(__CUDA_ARCH__)
  return __float_as_uint(x);
#else
  uint32_t u;
  std::memcpy(&u, &x, sizeof(u));
  return u;
#endif
}
NVFP4_HD float bits_float(uint32_t u) {
#if defined(__CUDA_ARCH__)
  return __uint_as_float(u);
#else
  float x;
  std::memcpy(&x, &u, sizeof(x));
  return x;
#endif
}
NVFP4_HD bool is_nan(float x) { return (float_bits(x) & 0x7FFFFFFFu) > 0x7F800000u; }
NVFP4_HD float abs_f(float x) { return bits_float(float_bits(x) & 0x7FFFFFFFu); }

// Widening of the 16-bit inputs: exact.
NVFP4_HD float bf16_bits_to_float(uint16_t h) { return bits_float(uint32_t(h) << 16); }
NVFP4_HD float f16_bits_to_float(uint16_t h) {
#if defined(__CUDA_ARCH__)
  // Exact; the hardware conversion returns a canonical (positive) NaN, so put the sign back:
  // a code's sign bit is the input's (docs/format.md §2 step 6), NaNs included.
  return bits_float(float_bits(__half2float(__ushort_as_half(h))) | (uint32_t(h & 0x8000u) << 16));
#else
  // All three cases computed and one selected (a form the compiler vectorises).
  const uint32_t sign = uint32_t(h & 0x8000u) << 16;
  const uint32_t exp = (h >> 10) & 0x1Fu;
  const uint32_t man = h & 0x3FFu;
  const uint32_t inf_nan = 0x7F800000u | (man << 13);
  const uint32_t normal = ((exp + 112u) << 23) | (man << 13);
  // Zero or subnormal: man * 2^-24, exact in float32 (and normal there: no flush).
  const uint32_t small = float_bits(mul_rn(float(man), 5.9604644775390625e-08f));
  uint32_t magnitude = exp != 0 ? normal : small;
  magnitude = exp == 0x1Fu ? inf_nan : magnitude;
  return bits_float(sign | magnitude);
#endif
}

// ---------------------------------------------------------------------------------------
// E2M1 (docs/format.md §1, §2 step 6).
NVFP4_HD float e2m1_magnitude(uint8_t code) {
  // The table as arithmetic (every value exact): m / 2 for codes 0..3, m - 2 for 4..6, and 6.
  // Branch-free on both sides: the host's compiler vectorises it, and on the device a switch
  // compiled to a divergent branch tree in 4over6's error loop.
  const uint32_t m = code & 7u;
  const float f = float(m);
  const float half = mul_rn(f, 0.5f), less_two = sub_rn(f, 2.0f);
  return m < 4u ? half : (m == 7u ? 6.0f : less_two);
}

// Magnitude code of |y| with the rounding of the comparison ladder of docs/format.md §2 step 6
// (`<= 0.25 -> 0, < 0.75 -> 1, <= 1.25 -> 2, ... <= 5 -> 6, else 7`; NaN -> 7), in a few
// branch-free operations (the ladder itself, e2m1_magnitude_code_ladder, is what tests compare
// this with, on every float):
//   a = min(|y|, 6)                               (NaN -> 6: code 7)
//   code = min(RNE(2a), RNE(a) + 2, RNE(a/2) + 4)
// The three are the codes of the e2m1 grid's three steps (0.5 below 2, 1 in [2, 4), 2 in
// [4, 6]), each counting from where its step starts; the minimum is the one of a's range
// (2a <= a + 2 exactly when a <= 2, a + 2 <= a/2 + 4 exactly when a <= 4, and RNE is
// monotonic). Each RNE(z) + c is the low bits of z + (2^23 + c) in one correctly rounded
// operation: z = a * 2^(1-k) is exact, so mul-then-add here equals the device's fused
// multiply-add; the three sums share the exponent of 2^23, so their minimum as floats is that
// of their low bits. 3 FFMA + 2 FMNMX a value (v4's one FFMA needed the exponent of max(a, 1)
// and two constants built from it).
// The minimum's bits are those of 2^23 + code: kE2m1MagnitudeBase + code, never more (a is in
// [0, 6]: NaN and Inf clamp to 6; a signalling NaN y too, as fminf and the host's integer
// minimum return the number), which block_codes' packing relies on; the self-checks
// (bindings.cc, store_cuda.cu) compare all of these bits with the ladder on every float.
constexpr uint32_t kE2m1MagnitudeBase = 0x4B000000u;  // float bits of 2^23

NVFP4_HD uint32_t e2m1_magnitude_bits(float y) {
  constexpr float kMagic = 8388608.0f;  // 2^23: the ulp of [2^23, 2^24) is 1
#if defined(__CUDA_ARCH__)
  // fminf(|y|, 6) is one instruction with the |.| folded in, and returns 6 for NaN.
  const float a = fminf(fabsf(y), 6.0f);
  const float fine = __fmaf_rn(a, 2.0f, kMagic);
  const float unit = __fadd_rn(a, kMagic + 2.0f);
  const float coarse = __fmaf_rn(a, 0.5f, kMagic + 4.0f);
  return float_bits(fminf(fminf(fine, unit), coarse));
#else
  // min(|y|, 6) on the bits: non-negative floats order as integers, and NaN (above +Inf) -> 6.
  const uint32_t u = float_bits(y) & 0x7FFFFFFFu;
  const float a = bits_float(u < 0x40C00000u ? u : 0x40C00000u);
  const uint32_t fine = float_bits(add_rn(mul_rn(a, 2.0f), kMagic));
  const uint32_t unit = float_bits(add_rn(a, kMagic + 2.0f));
  const uint32_t coarse = float_bits(add_rn(mul_rn(a, 0.5f), kMagic + 4.0f));
  const uint32_t low = fine < unit ? fine : unit;
  return low < coarse ? low : coarse;
#endif
}

// The value of the magnitude code whose e2m1_magnitude_bits are `bits` (the float m = 2^23 +
// code), exactly, without taking the code out: the grid's values are convex in the code, so a
// code's value is the largest of the three lines through its steps, code / 2, code - 2 and
// 2 code - 8 (docs/format.md §1's table), each one exact operation on m (m / 2 - 2^22,
// m - (2^23 + 2), 2 m - (2^24 + 8): every term and result is a float). 4over6's error takes
// it for each element and candidate (block_codes_and_error); e2m1_magnitude(code) needs the
// code as an integer, an int-to-float conversion on the device (a slow pipe there).
NVFP4_HD float e2m1_magnitude_of_bits(uint32_t bits) {
  const float m = bits_float(bits);
#if defined(__CUDA_ARCH__)
  const float fine = __fmaf_rn(m, 0.5f, -4194304.0f);
  const float unit = __fadd_rn(m, -8388610.0f);
  const float coarse = __fmaf_rn(m, 2.0f, -16777224.0f);
  return fmaxf(fmaxf(fine, unit), coarse);
#else
  const float fine = add_rn(mul_rn(m, 0.5f), -4194304.0f);
  const float unit = add_rn(m, -8388610.0f);
  const float coarse = add_rn(mul_rn(m, 2.0f), -16777224.0f);
  const float high = fine > unit ? fine : unit;
  return high > coarse ? high : coarse;
#endif
}

NVFP4_HD uint8_t e2m1_magnitude_code_ladder(float a) {
  if (a <= 0.25f) return 0;
  if (a < 0.75f) return 1;
  if (a <= 1.25f) return 2;
  if (a < 1.75f) return 3;
  if (a <= 2.5f) return 4;
  if (a < 3.5f) return 5;
  if (a <= 5.0f) return 6;
  return 7;
}

// ---------------------------------------------------------------------------------------
// E4M3 ("e4m3fn": bias 7, no infinities, 0x7F/0xFF NaN) (docs/format.md §2 step 4).

// Round to nearest even, saturate finite values and infinities to +-448, NaN -> 0x7F.
// Branch-free (selects): normal results keep 3 of the 23 mantissa bits with ties to even on
// the bits; results below the smallest normal 2^-6 are multiples of 2^-9, rounded by adding
// 2^23 to a * 512 (exact) in one rounding.
NVFP4_HD uint8_t e4m3_encode_software(float x) {
  const uint32_t bits = float_bits(x);
  const uint32_t u = bits & 0x7FFFFFFFu;
  // Normal: f32 exponent bias 127 -> e4m3 bias 7 is 120 << 3 in the 8-bit code.
  const uint32_t normal = ((u + 0x7FFFFu + ((u >> 20) & 1u)) >> 20) - (120u << 3);
#if defined(__CUDA_ARCH__)
  const float sub = __fmaf_rn(bits_float(u), 512.0f, 8388608.0f);
#else
  const float sub = add_rn(mul_rn(bits_float(u), 512.0f), 8388608.0f);
#endif
  const uint32_t subnormal = float_bits(sub) & 0xFu;
  uint32_t code = u < 0x3C800000u ? subnormal : normal;  // 2^-6
  code = u >= float_bits(kE4M3Max) ? 0x7Eu : code;      // >= 448, +Inf
  code |= (bits >> 24) & 0x80u;
  return uint8_t(u > 0x7F800000u ? uint32_t(kE4M3NaN) : code);
}

NVFP4_HD float e4m3_decode_software(uint8_t byte) {
  const uint32_t sign = uint32_t(byte & 0x80u) << 24;
  const uint32_t exp = (byte >> 3) & 0xFu;
  const uint32_t man = byte & 7u;
  // Subnormal man * 2^-9: man is read exactly off 2^23 + man, the product is exact.
  const float subnormal = mul_rn(sub_rn(bits_float(0x4B000000u | man), 8388608.0f), 0.001953125f);
  const uint32_t magnitude =
      exp == 0 ? float_bits(subnormal) : ((exp + 120u) << 23) | (man << 20);
  return bits_float((byte & 0x7Fu) == 0x7Fu ? 0x7FC00000u | sign : sign | magnitude);
}

#if NVFP4_HAS_HW_E4M3
// The hardware's conversions (sm_89 and newer): the same bytes as the software's (the PTX ISA
// leaves the sign of a NaN's byte open, so any NaN becomes kE4M3NaN here as there), and the
// same floats for every byte but 0xFF, which decodes to the canonical (positive) NaN.
__device__ __forceinline__ uint8_t e4m3_encode_hardware(float x) {
  const uint8_t byte = __nv_cvt_float_to_fp8(x, __NV_SATFINITE, __NV_E4M3);
  return is_nan(x) ? kE4M3NaN : byte;
}

__device__ __forceinline__ float e4m3_decode_hardware(uint8_t byte) {
  return __half2float(__half(__nv_cvt_fp8_to_halfraw(byte, __NV_E4M3)));
}
#endif

// The conversions the store uses: the hardware's on the device where NVFP4_HW_E4M3 asks for
// them, the software's elsewhere.
#if NVFP4_DEVICE_E4M3
NVFP4_HD uint8_t e4m3_encode(float x) { return e4m3_encode_hardware(x); }
NVFP4_HD float e4m3_decode(uint8_t byte) { return e4m3_decode_hardware(byte); }
#else
NVFP4_HD uint8_t e4m3_encode(float x) { return e4m3_encode_software(x); }
NVFP4_HD float e4m3_decode(uint8_t byte) { return e4m3_decode_software(byte); }
#endif

// ---------------------------------------------------------------------------------------
// One 16-element block (docs/format.md §2, §3).

// 1/6 and 1/4 rounded to float32 (docs/format.md §2 step 3, §3).
constexpr float kRecip6 = 1.0f / 6.0f;
constexpr float kRecip4 = 0.25f;

// maxNum of |x| over the block: a NaN element is ignored unless every element is NaN
// (docs/format.md §2 step 2), the semantics of CUDA's fmaxf (signalling NaNs included).
NVFP4_HD float block_amax(const float* x) {
#if defined(__CUDA_ARCH__)
  float m = fabsf(x[0]);  // fabsf, not abs_f: folds into the max instruction
  for (int i = 1; i < kBlockElems; ++i) m = fmaxf(m, fabsf(x[i]));
  return m;
#else
  // C's fmaxf may return NaN for a signalling NaN, so the host spells the rule out, on the
  // bits (a loop the compiler vectorises): non-negative floats order as their bit patterns, and
  // |NaN| is above +Inf's. A subnormal maximum stands for zero (inputs are flushed, §2: it
  // only enters products, which flush it).
  uint32_t m = 0;
  bool all_nan = true;
  for (int i = 0; i < kBlockElems; ++i) {
    const uint32_t u = float_bits(x[i]) & 0x7FFFFFFFu;
    const bool nan = u > 0x7F800000u;
    const uint32_t v = nan ? 0u : u;
    m = v > m ? v : m;
    all_nan &= nan;
  }
  return bits_float(all_nan ? 0x7FC00000u : m);
#endif
}

struct BlockScale {
  uint8_t byte;     // stored e4m3 byte
  float out_scale;  // multiplier applied to each element before e2m1 rounding
};

// The global store factor g = 1/scale and its reciprocal 1/g, each a correctly rounded
// division; computed once per (layer, side), used by every block.
struct StoreFactor {
  float g;
  float inv_g;
};

NVFP4_HD StoreFactor store_factor(float scale) {
  const float g = div_rn(1.0f, scale);
  return {g, div_rn(1.0f, g)};
}

// docs/format.md §2 steps 3-4 for one candidate denominator (given as its float32 reciprocal):
// the e4m3 byte of the block scale.
NVFP4_HD uint8_t scale_byte(float amax, StoreFactor f, float recip_denominator) {
  return e4m3_encode(mul_rn(f.g, mul_rn(amax, recip_denominator)));
}

// docs/format.md §2 step 5: the multiplier applied to each element of a block stored with scale
// byte `byte`, 1 / (its decoded scale * 1/g), and 0 for a zero scale. A function of the byte
// and the global factor only (a per-CTA table of the 256 values would give the same bytes: the
// store's v11 tried one and was slower, benchmarks/NOTES.md).
NVFP4_HD float out_scale_of(uint8_t byte, StoreFactor f) {
  const float sfq = e4m3_decode(byte);
  return sfq != 0.0f ? div_rn(1.0f, mul_rn(sfq, f.inv_g)) : 0.0f;
}

// docs/format.md §2 steps 3-5 for one candidate denominator.
NVFP4_HD BlockScale block_scale(float amax, StoreFactor f, float recip_denominator) {
  const uint8_t byte = scale_byte(amax, f, recip_denominator);
  return {byte, out_scale_of(byte, f)};
}

// The block's 16 codes at out_scale, packed as stored: two little-endian words, element 2k in
// the low nibble of byte k (docs/format.md §2 step 7). Packed, two candidates' codes take 4
// registers, not 32 (4over6 spilled with byte arrays).
//
// Each word's magnitudes in one instruction a value: the bits of e2m1_magnitude_bits
// (kE2m1MagnitudeBase + code) shifted and added whole, one shift-add each, and the constant
// their high bits leave removed once (shifts and sums distribute modulo 2^32; the codes'
// nibbles never carry). The sign bits come in whole words (block_signs): the same for every
// candidate scale. (Masking each magnitude to its 3 bits, then or-ing in its sign and the
// shifted code took four instructions a value.)
NVFP4_HD uint32_t packed_magnitude_base() {
  uint32_t base = 0;
  for (int j = 0; j < 8; ++j) base += kE2m1MagnitudeBase << (4 * j);
  return base;
}

NVFP4_HD void block_codes(const float* x, float out_scale, const uint32_t (&signs)[2],
                          uint32_t (&packed)[2]) {
  for (int w = 0; w < 2; ++w) {
    uint32_t magnitudes = 0;
    for (int j = 7; j >= 0; --j)
      magnitudes = (magnitudes << 4) + e2m1_magnitude_bits(mul_rn(x[8 * w + j], out_scale));
    packed[w] = (magnitudes - packed_magnitude_base()) | signs[w];
  }
}

// The codes' sign bits (docs/format.md §2 step 6), each element's at bit 3 of its nibble of
// block_codes' words: the sign of x, not of the product x * out_scale. out_scale is never
// negative (§2 step 5 divides two factors of the same sign), so the two agree wherever the
// product is a number, and a NaN product's sign is not portable between x86, CUDA and XLA.
NVFP4_HD uint32_t code_sign_bit(float x) { return (float_bits(x) >> 28) & 8u; }

NVFP4_HD void block_signs(const float* x, uint32_t (&signs)[2]) {
  for (int w = 0; w < 2; ++w) {
    signs[w] = 0;
    for (int j = 0; j < 8; ++j) signs[w] |= code_sign_bit(x[8 * w + j]) << (4 * j);
  }
}

#if defined(__CUDACC__)
// The same from the block's 16-bit inputs (bf16 or fp16 bits, element 2k in the low half of
// word k), whose sign bits the widening keeps: byte permutes gather the bytes that hold them,
// even elements' and odd elements' apart, and two masks place them (7 instructions a word
// where block_signs takes 16).
__device__ __forceinline__ void block_signs_of_halves(const uint32_t (&words)[8],
                                                      uint32_t (&signs)[2]) {
#pragma unroll
  for (int w = 0; w < 2; ++w) {
    // Bytes 1 and 3 of each word hold the signs of its low and high half in their bit 7.
    const uint32_t e0213 = __byte_perm(words[4 * w], words[4 * w + 1], 0x7351);
    const uint32_t e4657 = __byte_perm(words[4 * w + 2], words[4 * w + 3], 0x7351);
    const uint32_t even = __byte_perm(e0213, e4657, 0x5410);  // elements 0 2 4 6, bit 8k + 7
    const uint32_t odd = __byte_perm(e0213, e4657, 0x7632);   // elements 1 3 5 7, bit 8k + 7
    signs[w] = ((even >> 4) & 0x08080808u) | (odd & 0x80808080u);
  }
}
#endif

// The products q * (1/f) that block_codes_and_error's differences take, for the code whose
// e2m1_magnitude_bits are `bits` and the candidate's 1/f (`deq`, given to `set` first): the
// code's value read off its bits (e2m1_magnitude_of_bits), times deq, for each element. The
// CUDA store's 4over6 kernel passes instead a table of each candidate's eight products in
// shared memory (store_cuda.cu, CodeProductTable: the same floats, each the same one product).
struct CodeProducts {
  float deq[2];
  NVFP4_HD void set(int candidate, float d) { deq[candidate] = d; }
  NVFP4_HD float of(int candidate, uint32_t bits) const {
    return mul_rn(e2m1_magnitude_of_bits(bits), deq[candidate]);
  }
};

// block_codes, and the reconstruction error of docs/format.md §3 of the block so stored, in
// one pass over the block (4over6's candidates, `candidate` 0 for 6 and 1 for 4): each
// element's difference from its code's value times 1/f (`products`), then the squares pairwise
// in element order, each operation rounded alone. The difference is taken on magnitudes,
// |q| * (1/f) - |x|: the code carries x's sign and round-to-nearest is symmetric, so that is d
// or -d and the square is the same float (store v24: one instruction a value and candidate
// less than signing q). With out_scale == 0 (f == 0) the multiplier is 0, so each difference
// is 0 * |q| - |x|, the spec's -x up to its sign, which squares away.
template <class Products>
NVFP4_HD float block_codes_and_error(const float* x, float out_scale, const uint32_t (&signs)[2],
                                     uint32_t (&packed)[2], Products& products, int candidate) {
  products.set(candidate, out_scale != 0.0f ? div_rn(1.0f, out_scale) : 0.0f);
  float err = 0.0f;
  for (int w = 0; w < 2; ++w) {
    uint32_t magnitudes = 0;
    for (int j = 0; j < 8; j += 2) {
      float d[2];
      for (int e = 0; e < 2; ++e) {
        const float xi = x[8 * w + j + e];
        const uint32_t bits = e2m1_magnitude_bits(mul_rn(xi, out_scale));
        magnitudes += bits << (4 * (j + e));  // block_codes' packing, in the other order
        d[e] = sub_rn(products.of(candidate, bits), fabsf(xi));  // d or -d
      }
      err = add_rn(err, add_rn(mul_rn(d[0], d[0]), mul_rn(d[1], d[1])));
    }
    packed[w] = (magnitudes - packed_magnitude_base()) | signs[w];
  }
  return err;
}

// Quantises x[0..15] with the global store factor g = 1/k_scale: returns the e4m3 scale byte
// and the 8 packed bytes as two little-endian words (element 2k in the low nibble of byte k).
struct QuantizedBlock {
  uint8_t scale;
  uint32_t packed[2];
};

// The block scale a block of x[0..15] is stored with (docs/format.md §2 steps 2-5, §3) and
// its codes (`signs`: block_signs'): with 4over6 each candidate's codes are computed once, for
// its error and, if chosen, the output.
template <class Products = CodeProducts>
NVFP4_HD BlockScale chosen_block(const float* x, const uint32_t (&signs)[2], StoreFactor f,
                                 ScaleSearch search, uint32_t (&code)[2],
                                 Products products = {}) {
  const float amax = block_amax(x);
  BlockScale chosen = block_scale(amax, f, kRecip6);
  if (search != ScaleSearch::k4Over6) {
    block_codes(x, chosen.out_scale, signs, code);
    return chosen;
  }
  const float six_error = block_codes_and_error(x, chosen.out_scale, signs, code, products, 0);
  const BlockScale four = block_scale(amax, f, kRecip4);
  uint32_t four_code[2];
  if (block_codes_and_error(x, four.out_scale, signs, four_code, products, 1) < six_error) {
    chosen = four;
    code[0] = four_code[0], code[1] = four_code[1];
  }
  return chosen;
}

template <class Products = CodeProducts>
NVFP4_HD QuantizedBlock quantize_block(const float* x, const uint32_t (&signs)[2],
                                       StoreFactor f, ScaleSearch search,
                                       Products products = {}) {
  uint32_t code[2];
  const BlockScale chosen = chosen_block(x, signs, f, search, code, products);
  return {chosen.byte, {code[0], code[1]}};
}

#if !defined(__CUDACC__)
// The same for n <= kMaxBatchBlocks consecutive blocks x[0 .. 16n) at once, on the host:
// quantize_block's steps as loops over blocks and over elements, which the compiler
// vectorises (the CPU kernel's path); each block gets quantize_block's bytes. Writes the n
// scale bytes and the 8n packed bytes (docs/format.md §2 step 7: value 2k in the low nibble).
constexpr int kMaxBatchBlocks = 16;

template <ScaleSearch kSearch>
inline void quantize_blocks(const float* x, int n, StoreFactor f, uint8_t* scales,
                            uint8_t* packed) {
  if constexpr (kSearch == ScaleSearch::kDefault) {
    // The scales first, then each block's codes as one loop over its elements (a code an
    // element: the magnitude less its base, the sign of x at bit 3, as block_codes packs them),
    // which the compiler vectorises, then the nibbles paired. (Through chosen_block's packed
    // words, as 4over6 goes below, the CPU store's default ran about 2x slower:
    // benchmarks/RESULTS.md, "On the CPU".)
    float out_scale[kMaxBatchBlocks];
    for (int b = 0; b < n; ++b) {
      const BlockScale chosen = block_scale(block_amax(x + b * kBlockElems), f, kRecip6);
      scales[b] = chosen.byte;
      out_scale[b] = chosen.out_scale;
    }
    for (int b = 0; b < n; ++b) {
      uint8_t code[kBlockElems];
      for (int i = 0; i < kBlockElems; ++i) {
        const float xi = x[b * kBlockElems + i];
        code[i] = uint8_t((e2m1_magnitude_bits(mul_rn(xi, out_scale[b])) - kE2m1MagnitudeBase) |
                          code_sign_bit(xi));
      }
      for (int k = 0; k < kBlockBytes; ++k)
        packed[b * kBlockBytes + k] = uint8_t(code[2 * k] | (code[2 * k + 1] << 4));
    }
  } else {
    // 4over6 picks each block's scale from both candidates' codes and errors: its codes come
    // from chosen_block.
    uint32_t code[kMaxBatchBlocks][2];
    for (int b = 0; b < n; ++b) {
      uint32_t signs[2];
      block_signs(x + b * kBlockElems, signs);
      scales[b] = chosen_block(x + b * kBlockElems, signs, f, kSearch, code[b]).byte;
    }
    for (int b = 0; b < n; ++b)
      for (int k = 0; k < kBlockBytes; ++k)
        packed[b * kBlockBytes + k] = uint8_t(code[b][k / 4] >> (8 * (k % 4)));
  }
}
#endif

// ---------------------------------------------------------------------------------------
// Page layout (docs/format.md §4). One page side (K or V of one block) is
// [data: num_kv_heads*block_size*head_size/2 | scales: num_kv_heads*block_size*head_size/16].
struct PageGeometry {
  int64_t num_kv_heads;
  int64_t block_size;
  int64_t head_size;
  Layout layout;
  bool v_scale_swizzle;

  NVFP4_HD int64_t data_bytes_per_head_token() const { return head_size / 2; }
  NVFP4_HD int64_t scales_per_head_token() const { return head_size / kBlockElems; }
  NVFP4_HD int64_t side_data_bytes() const {
    return num_kv_heads * block_size * data_bytes_per_head_token();
  }
  NVFP4_HD int64_t side_bytes() const {
    return num_kv_heads * block_size * (data_bytes_per_head_token() + scales_per_head_token());
  }
  // Row of (head, row-in-page) in a [heads, block_size] (HND) or [block_size, heads] (NHD)
  // plane: head * head_stride() + row * row_stride().
  NVFP4_HD int64_t head_stride() const { return layout == Layout::kHND ? block_size : 1; }
  NVFP4_HD int64_t row_stride() const { return layout == Layout::kHND ? 1 : num_kv_heads; }
  NVFP4_HD int64_t plane_row(int64_t head, int64_t row) const {
    return head * head_stride() + row * row_stride();
  }
  // Byte offset, within the side, of the packed data of (head, token row).
  NVFP4_HD int64_t data_offset(int64_t head, int64_t row) const {
    return plane_row(head, row) * data_bytes_per_head_token();
  }
  // Byte offset, within the side, of scale s of (head, token row). V scales may be swizzled.
  // The in-page indices are small: 32-bit arithmetic (a 64-bit division is slow on GPUs).
  NVFP4_HD int64_t scale_offset(bool is_value, int64_t head, int32_t row, int32_t s) const {
    const int32_t num_scales = int32_t(scales_per_head_token());
    uint32_t row_in_plane = uint32_t(row), col = uint32_t(s);
    if (is_value && v_scale_swizzle) {
      // row, s >= 0: unsigned division, which costs the GPU about half of a signed one.
      const uint32_t group = uint32_t(num_scales) / 4u;
      const uint32_t s_hi = uint32_t(s) / group;
      swizzle_scale(s_hi, uint32_t(s) - s_hi * group, &row_in_plane, &col);
    }
    return side_data_bytes() + plane_row(head, row_in_plane) * num_scales + col;
  }

  // docs/format.md §4's V-scale swizzle, G = S / 4: block scale s = s_hi * G + s_lo of page row
  // `row` (in: *row, *col = s) lies at plane row 4 (row / 4) + s_hi, column 4 s_lo + row % 4 of
  // the scale plane, so the bytes of rows 4k .. 4k+3 of one block are adjacent.
  NVFP4_HD static void swizzle_scale(uint32_t s_hi, uint32_t s_lo, uint32_t* row, uint32_t* col) {
    *col = s_lo * 4u + (*row & 3u);
    *row = (*row & ~3u) + s_hi;
  }
};

}  // namespace nvfp4
