"""Trace-time validation of the store's arguments (docs/format.md §5): one function, used by the
primitive's abstract evaluation and by the jnp reference, so both refuse the same calls with
the same messages, each naming the argument and what was expected."""

from __future__ import annotations

import numpy as np

from . import layout as _layout



_FLOAT_INPUTS = ("bfloat16", "float16")
_SLOT_DTYPES = ("int32", "int64")


def check_store_args(key, value, kv_cache, slot_mapping, k_scale, v_scale, *, layout,
                     scale_search, v_scale_swizzle, num_layers: int | None = None):
    """Validates shapes and dtypes (anything with ``.shape`` and ``.dtype``).

    With ``num_layers`` set, every per-layer operand may carry that leading axis (the batched
    form the vmap rule binds); otherwise key/value are ``[num_tokens, num_kv_heads, head_size]``
    and kv_cache is one layer's cache.

    Returns the cache's ``CacheGeometry``. Raises ``TypeError`` for a wrong dtype and
    ``ValueError`` for a wrong shape or option.
    """
    _layout.check_layout(layout)
    _layout.check_scale_search(scale_search)
    check_flag(v_scale_swizzle, "v_scale_swizzle")
    lead = 0 if num_layers is None else 1

    for name, x in (("key", key), ("value", value)):
        if dtype_name(x.dtype) not in _FLOAT_INPUTS:
            raise TypeError(f"{name} must be bfloat16 or float16, got {dtype_name(x.dtype)}")
        if len(x.shape) != 3 + lead:
            raise ValueError(f"{name} must have shape [num_tokens, num_kv_heads, head_size], "
                             f"got shape {tuple(x.shape)}")
    if key.dtype != value.dtype:
        raise TypeError(f"value must have key's dtype {dtype_name(key.dtype)}, "
                        f"got {dtype_name(value.dtype)}")
    if tuple(key.shape) != tuple(value.shape):
        raise ValueError(f"value must have key's shape {tuple(key.shape)}, got {tuple(value.shape)}")
    num_tokens, num_kv_heads, head_size = key.shape[lead:]
    if num_kv_heads <= 0:
        raise ValueError(f"key must have at least one kv head, got shape {tuple(key.shape)}")
    _layout.check_head_size(head_size, v_scale_swizzle, argument="key head_size")

    if dtype_name(kv_cache.dtype) != "uint8":
        raise TypeError(f"kv_cache must be uint8 (see kv_cache_shape), got {dtype_name(kv_cache.dtype)}")
    cache_shape = tuple(kv_cache.shape)
    if len(cache_shape) != 5 + lead:
        raise ValueError(f"kv_cache must have rank 5, {_layout.kv_cache_shape.__name__}(...) for "
                         f"layout {layout!r}, got shape {cache_shape}")
    if lead and cache_shape[0] != num_layers:
        raise ValueError(f"kv_cache leading (layer) axis {cache_shape[0]} != {num_layers}")
    geometry = _layout.CacheGeometry.from_shape(cache_shape[lead:], layout)
    expected = _layout.kv_cache_shape(geometry.num_blocks, geometry.block_size, num_kv_heads,
                                      head_size, layout)
    if cache_shape[lead:] != expected:
        raise ValueError(
            f"kv_cache shape {cache_shape[lead:]} does not match key (num_kv_heads={num_kv_heads}, "
            f"head_size={head_size}): expected {expected} for layout {layout!r}")

    if dtype_name(slot_mapping.dtype) not in _SLOT_DTYPES:
        raise TypeError(f"slot_mapping must be int32 or int64, got {dtype_name(slot_mapping.dtype)}")
    slot_shape = tuple(slot_mapping.shape)
    if slot_shape not in ((num_tokens,),) + (((num_layers, num_tokens),) if lead else ()):
        raise ValueError(f"slot_mapping must have shape [num_tokens] = ({num_tokens},), "
                         f"got {slot_shape}")

    layer_shapes = ((num_layers,),) if lead else ()
    check_scale(k_scale, "k_scale", layer_shapes)
    check_scale(v_scale, "v_scale", layer_shapes)
    return geometry


def check_kv_cache(kv_cache, layout, v_scale_swizzle, argument="kv_cache"):
    """Validates a cache on its own (for readers); returns its ``CacheGeometry``."""
    _layout.check_layout(layout)
    if dtype_name(kv_cache.dtype) != "uint8":
        raise TypeError(f"{argument} must be uint8, got {dtype_name(kv_cache.dtype)}")
    geometry = _layout.CacheGeometry.from_shape(kv_cache.shape, layout, argument)
    _layout.check_head_size(geometry.head_size, v_scale_swizzle, argument=f"{argument} head_size")
    return geometry


def dtype_name(dtype) -> str:
    return np.dtype(dtype).name


def check_flag(value, argument):
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{argument} must be a bool, got {value!r}")


def as_scale(s):
    """A Python number becomes a float32 scalar; arrays are left for check_scale as they are."""
    import jax.numpy as jnp

    return s if hasattr(s, "dtype") else jnp.asarray(s, dtype=jnp.float32)


def check_scale(s, argument, extra_shapes=()):
    """A global scale: float32 (TypeError otherwise) of shape () or (1,) (ValueError otherwise;
    ``extra_shapes`` admits more, e.g. one scale per layer)."""
    if dtype_name(s.dtype) != "float32":
        raise TypeError(f"{argument} must be float32, got {dtype_name(s.dtype)}")
    if tuple(s.shape) not in ((), (1,)) + tuple(extra_shapes):
        raise ValueError(f"{argument} must be a float32 scalar of shape () or (1,), "
                         f"got shape {tuple(s.shape)}")
