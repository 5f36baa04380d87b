// The handler symbols the binding module exports: the store on each platform, the decode
// attention kernel on CUDA.
#pragma once

#include "xla/ffi/api/ffi.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(NvFp4StoreCpu);
#if defined(JAX_NVFP4_WITH_CUDA)
XLA_FFI_DECLARE_HANDLER_SYMBOL(NvFp4StoreCuda);
XLA_FFI_DECLARE_HANDLER_SYMBOL(NvFp4DecodeAttentionCuda);

namespace nvfp4 {
// Every float32 through the device's branch-free e2m1 rounding against the comparison ladder,
// on the current GPU: the number that differ, or -1 if CUDA failed.
int64_t E2m1CodeMismatchesCuda();
}  // namespace nvfp4
#endif
