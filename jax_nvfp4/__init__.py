"""jax_nvfp4: an NVFP4 paged KV cache for JAX.

Keys and values are stored as FP4 (E2M1) codes with an FP8 (E4M3) scale per 16 values and a
float32 global scale: 72 bytes per head and token at head_size 128, against 256 in bfloat16.
The store is an XLA FFI kernel (CPU and CUDA) updating the cache in place.
"""

from .api import (allocate_kv_cache, dequantize, reshape_and_cache, scale_from_amax,
                  slot_mapping_problems)
from .attention import paged_attention, paged_attention_bf16, ragged_paged_attention
from .layout import LAYOUTS, MAX_SCALE, MIN_SCALE, SCALE_SEARCHES, head_bytes, kv_cache_shape
from .outliers import channel_factors, diagnose, hadamard_matrix, hadamard_transform
from . import checks, outliers, reference, sharding

__all__ = [
    "LAYOUTS",
    "MAX_SCALE",
    "MIN_SCALE",
    "SCALE_SEARCHES",
    "allocate_kv_cache",
    "channel_factors",
    "checks",
    "dequantize",
    "diagnose",
    "hadamard_matrix",
    "hadamard_transform",
    "head_bytes",
    "kv_cache_shape",
    "outliers",
    "paged_attention",
    "paged_attention_bf16",
    "ragged_paged_attention",
    "reference",
    "reshape_and_cache",
    "scale_from_amax",
    "sharding",
    "slot_mapping_problems",
]
__version__ = "0.1.0"
