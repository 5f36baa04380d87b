// The handler symbols the binding module exports, one per platform.
#pragma once

#include "xla/ffi/api/ffi.h"

XLA_FFI_DECLARE_HANDLER_SYMBOL(NvFp4StoreCpu);
#if defined(JAX_NVFP4_WITH_CUDA)
XLA_FFI_DECLARE_HANDLER_SYMBOL(NvFp4StoreCuda);
#endif
