// The handler symbols the binding module exports: the store on each platform, the decode and
// ragged attention kernels on CUDA.
#pragma once

#include "xla/ffi/api/ffi.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(NvFp4StoreCpu);
#if defined(JAX_NVFP4_WITH_CUDA)
XLA_FFI_DECLARE_HANDLER_SYMBOL(NvFp4StoreCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(NvFp4DecodeAttentionCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(NvFp4RaggedAttentionCuda);

namespace nvfp4 {
// Every float32 through the device's branch-free e2m1 rounding against the comparison ladder,
// on the current GPU: the number that differ, or -1 if CUDA failed.
int64_t E2m1CodeMismatchesCuda();
// Every float32 through the hardware's e4m3 encoding on the current GPU (the store's with
// NVFP4_HW_E4M3), and every byte through its decoding, against the software conversions
// (nvfp4_numerics.h): the number that differ, or -1 if CUDA failed.
int64_t E4m3MismatchesCuda();
// Every 32-bit word of eight E2M1 codes through the attention kernels' conversion to fp16
// (attention_device.cuh, e2m1x8_to_f16x2) against the spec's values, on the current GPU: the
// number of words with a wrong output, or -1 if CUDA failed.
int64_t E2m1ToF16MismatchesCuda();
// CTAs of the decode kernel for this head size that fit on one SM of the current GPU (0 if
// CUDA failed or the head size has no kernel).
int DecodeResidentCtasPerSm(int head_size);
// Most splits the decode kernel for this head size merges inside one thread-block cluster on
// the current GPU (at most decode_ffi.h's kMaxClusterSplits; 0 without cluster launch, for a
// head size with no kernel, or if CUDA failed).
int DecodeClusterMergeSplits(int head_size);
// Likewise for the ragged-attention kernel (its dynamic shared memory included).
int RaggedResidentCtasPerSm(int head_size);
// Likewise for ragged attention's few-row kernel (0 for head sizes it does not take).
int FewRowsResidentCtasPerSm(int head_size);
// CTAs of the few-row kernel's wide path (17 to 32 rows, its own kernel) resident on one SM of
// the current GPU: 0 where it does not run (head sizes other than 128, no sm_90a code).
int WideRowsResidentCtasPerSm(int head_size);
// The most query rows per kv head the few-row kernel takes on the current GPU (16, or 32 at head
// size 128 where the build has sm_90a code for it).
int FewRowsMaxRows(int head_size);
}  // namespace nvfp4
#endif
