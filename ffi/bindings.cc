// Python binding: hands the FFI handlers to jax.ffi.register_ffi_target as capsules.
#include <nanobind/nanobind.h>

#include "decode_ffi.h"
#include "handlers.h"
#include "ragged_ffi.h"
#include "store_ffi.h"

namespace nb = nanobind;

namespace {

template <typename T>
nb::capsule EncapsulateFfiHandler(T* fn) {
  static_assert(std::is_invocable_r_v<XLA_FFI_Error*, T, XLA_FFI_CallFrame*>,
                "an XLA FFI handler has type XLA_FFI_Error*(XLA_FFI_CallFrame*)");
  return nb::capsule(reinterpret_cast<void*>(fn));
}

}  // namespace

NB_MODULE(_ffi, m) {
  m.attr("STORE_TARGET") = nvfp4::kStoreTarget;
  m.attr("DECODE_TARGET") = nvfp4::kDecodeTarget;
  m.attr("RAGGED_TARGET") = nvfp4::kRaggedTarget;
  // The valid range of a global scale (jax_nvfp4.layout.MIN_SCALE, MAX_SCALE; a test compares).
  m.attr("MIN_SCALE") = nvfp4::kMinScale;
  m.attr("MAX_SCALE") = nvfp4::kMaxScale;
  m.attr("STORE_SMALL_BLOCKS") = nvfp4::kSmallStoreBlocks;
  m.def("registrations", []() {
    nb::dict platforms;
    platforms["cpu"] = EncapsulateFfiHandler(NvFp4StoreCpu);
#if defined(JAX_NVFP4_WITH_CUDA)
    platforms["CUDA"] = EncapsulateFfiHandler(NvFp4StoreCuda);
#endif
    return platforms;
  }, "Store handlers by XLA platform name, as capsules for jax.ffi.register_ffi_target.");
  m.def("decode_registrations", []() {
    nb::dict platforms;
#if defined(JAX_NVFP4_WITH_CUDA)
    platforms["CUDA"] = EncapsulateFfiHandler(NvFp4DecodeAttentionCuda);
#endif
    return platforms;
  }, "Decode-attention handlers by XLA platform name (CUDA only; the CPU runs the jnp path).");
  m.def("ragged_registrations", []() {
    nb::dict platforms;
#if defined(JAX_NVFP4_WITH_CUDA)
    platforms["CUDA"] = EncapsulateFfiHandler(NvFp4RaggedAttentionCuda);
#endif
    return platforms;
  }, "Ragged-attention handlers by XLA platform name (CUDA only; the CPU runs the jnp path).");
  m.def("_e2m1_code_mismatches", []() {
    // Every float32 y (both signs, infinities, NaNs): the branch-free e2m1 rounding against
    // the comparison table of docs/format.md §2 step 6 on |y|, all of its bits (2^23 + code,
    // as block_codes packs them); and each code's value read off those bits
    // (e2m1_magnitude_of_bits, 4over6's error) against the table's. Returns how many differ
    // (the test expects 0).
    uint64_t mismatches = 0;
    for (uint32_t u = 0; u <= 0x7FFFFFFFu; ++u) {
      const uint32_t want =
          nvfp4::kE2m1MagnitudeBase + nvfp4::e2m1_magnitude_code_ladder(nvfp4::bits_float(u));
      mismatches += nvfp4::e2m1_magnitude_bits(nvfp4::bits_float(u)) != want;
      mismatches += nvfp4::e2m1_magnitude_bits(nvfp4::bits_float(u | 0x80000000u)) != want;
    }
    for (uint32_t code = 0; code < 8; ++code)
      mismatches += nvfp4::float_bits(nvfp4::e2m1_magnitude_of_bits(
                        nvfp4::kE2m1MagnitudeBase + code)) !=
                    nvfp4::float_bits(nvfp4::e2m1_magnitude(uint8_t(code)));
    return mismatches;
  }, "Self-check of the numerics header (slow: every non-negative float).");
#if defined(JAX_NVFP4_WITH_CUDA)
  m.def("_e2m1_code_mismatches_cuda", &nvfp4::E2m1CodeMismatchesCuda,
        "The self-check above on the current GPU (-1 if CUDA failed).");
  m.def("_e4m3_mismatches_cuda", &nvfp4::E4m3MismatchesCuda,
        "The hardware's e4m3 conversions (the store's with NVFP4_HW_E4M3) on the current GPU "
        "against the software's, every float and byte (-1 if CUDA failed).");
  m.def("_e2m1_to_f16_mismatches_cuda", &nvfp4::E2m1ToF16MismatchesCuda,
        "The attention kernels' E2M1 -> fp16 code conversion on the current GPU against the "
        "spec's values, every 32-bit word of eight codes (-1 if CUDA failed).");
  m.def("decode_resident_ctas_per_sm", &nvfp4::DecodeResidentCtasPerSm,
        "CTAs of the decode kernel for a head size resident on one SM of the current GPU.");
  m.def("decode_cluster_merge_splits", &nvfp4::DecodeClusterMergeSplits,
        "Most splits the decode kernel for a head size merges in one thread-block cluster on "
        "the current GPU (0: none, the merge kernel merges them).");
  m.def("ragged_resident_ctas_per_sm", &nvfp4::RaggedResidentCtasPerSm,
        "CTAs of the ragged-attention kernel for a head size resident on one SM of the current GPU.");
  m.def("few_rows_resident_ctas_per_sm", &nvfp4::FewRowsResidentCtasPerSm,
        "CTAs of ragged attention's few-row kernel for a head size resident on one SM of the "
        "current GPU.");
  m.def("wide_rows_resident_ctas_per_sm", &nvfp4::WideRowsResidentCtasPerSm,
        "CTAs of ragged attention's few-row kernel for 17 to 32 rows (its own kernel) resident on "
        "one SM of the current GPU (0 where it does not run).");
  m.def("few_rows_max_rows", &nvfp4::FewRowsMaxRows,
        "Most query rows per kv head ragged attention's few-row kernel takes for a head size on "
        "the current GPU (16, or 32 at head size 128 where the build has sm_90a code).");
#endif
  m.def("built_with_cuda", []() {
#if defined(JAX_NVFP4_WITH_CUDA)
    return true;
#else
    return false;
#endif
  }, "Whether this build contains the CUDA kernel.");
}
