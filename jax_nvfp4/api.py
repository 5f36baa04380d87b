"""Public API: the NVFP4 store, the cache allocator and the reader."""

from __future__ import annotations

import jax
import jax.numpy as jnp

from . import checks
from . import layout as _layout
from . import reference as _reference
from .primitive import store_p


def reshape_and_cache(key, value, kv_cache, slot_mapping, k_scale, v_scale, *, layout="HND",
                      scale_search="default", v_scale_swizzle=True, checked=False):
    """Quantises key/value to NVFP4 and writes them into their slots of a paged cache.

    Token ``i`` goes to page ``slot_mapping[i] // block_size``, row ``slot_mapping[i] %
    block_size``. Negative slots are padding and slots ``>= num_blocks * block_size`` are skipped:
    nothing is written for them. Every other byte of the cache is left as it was. Duplicate slots
    in one call are undefined (which token wins is not specified); ``checked=True`` detects them.

    The result is the cache itself (the XLA custom call aliases it): under ``jax.jit`` with the
    cache donated (``donate_argnums``) the update happens in place and costs O(num_tokens).
    Without donation XLA first copies the cache.

    Under a multi-device ``jit`` the store runs per shard, in place and with no collective,
    when the cache is sharded along its ``num_blocks`` axis or a leading stacked axis (layers
    under ``vmap``, head groups of :func:`jax_nvfp4.sharding.reshape_and_cache_grouped`, the
    tensor-parallel form). A page holds all heads' data and then all heads' scales, so the head
    axis of a plain cache cannot be split: a cache (or any operand) sharded along another axis
    is gathered first: correct, not fast. See :mod:`jax_nvfp4.partitioning` (the rules) and
    :mod:`jax_nvfp4.sharding` (the head-grouped cache).

    Args:
      key, value: ``[num_tokens, num_kv_heads, head_size]``, bfloat16 or float16, same dtype.
        head_size must be a multiple of 16 (of 64 with ``v_scale_swizzle=True``).
      kv_cache: ``uint8`` cache of :func:`kv_cache_shape` for ``layout``.
      slot_mapping: ``[num_tokens]`` int32 or int64.
      k_scale, v_scale: float32 scalars (shape ``()`` or ``(1,)``, device values: a new
        calibration does not recompile): the *dequantisation* multipliers, e.g.
        ``amax(|K|) / 448``. The store divides by them.
      layout: ``"HND"`` (default, what trtllm-gen reads) or ``"NHD"``.
      scale_search: ``"default"`` (block scale from amax/6) or ``"4over6"`` (also tries amax/4
        and keeps the scale with the smaller squared error).
      v_scale_swizzle: V block scales in the swizzled order SM100 trtllm-gen kernels read
        (default) or linear.
      checked: also verify that every non-negative slot is in range and that no slot repeats,
        via ``jax.experimental.checkify`` (eagerly this raises; under ``jit`` wrap the function
        in ``checkify.checkify``).

    Returns:
      The updated cache (same shape and dtype as ``kv_cache``).

    Raises:
      TypeError, ValueError: at trace time, naming the offending argument.
    """
    key, value, kv_cache, slot_mapping = (
        x if hasattr(x, "dtype") else jnp.asarray(x) for x in (key, value, kv_cache, slot_mapping))
    k_scale, v_scale = checks.as_scale(k_scale), checks.as_scale(v_scale)
    # Validate here too so that errors point at the caller's line, not into the primitive.
    geo = checks.check_store_args(key, value, kv_cache, slot_mapping, k_scale, v_scale,
                                  layout=layout, scale_search=scale_search,
                                  v_scale_swizzle=v_scale_swizzle)
    if checked:
        _check_slots(slot_mapping, geo.num_slots)
    return store_p.bind(key, value, kv_cache, slot_mapping, k_scale, v_scale, layout=layout,
                        scale_search=scale_search, v_scale_swizzle=bool(v_scale_swizzle))


def slot_mapping_problems(slot_mapping, num_slots: int):
    """Counts the slots a store would skip or race on (jit-compatible).

    Returns ``(num_out_of_range, num_duplicates)`` as int32 scalars: slots ``>= num_slots`` and
    non-negative slots that appear more than once (each repeat counted once). Negative slots
    (padding) count as neither.
    """
    slot_mapping = jnp.asarray(slot_mapping)
    valid = (slot_mapping >= 0) & (slot_mapping < num_slots)
    out_of_range = jnp.sum(slot_mapping >= num_slots, dtype=jnp.int32)
    # Invalid slots become distinct negative numbers so they never pair up.
    keyed = jnp.where(valid, slot_mapping, -1 - jnp.arange(slot_mapping.shape[0],
                                                           dtype=slot_mapping.dtype))
    ordered = jnp.sort(keyed)
    duplicates = jnp.sum((ordered[1:] == ordered[:-1]) & (ordered[1:] >= 0), dtype=jnp.int32)
    return out_of_range, duplicates


def _check_slots(slot_mapping, num_slots):
    from jax.experimental import checkify

    out_of_range, duplicates = slot_mapping_problems(slot_mapping, num_slots)
    checkify.check(out_of_range == 0,
                   "reshape_and_cache: {n} slot(s) in slot_mapping are >= num_blocks*block_size "
                   f"= {num_slots}; they are skipped", n=out_of_range)
    checkify.check(duplicates == 0,
                   "reshape_and_cache: slot_mapping repeats {n} slot(s); which token is stored "
                   "there is undefined", n=duplicates)


def allocate_kv_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                      layout: str = "HND", *, device=None, sharding=None):
    """A zero-filled ``uint8`` cache of :func:`kv_cache_shape`, on ``device`` or ``sharding``."""
    shape = _layout.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, layout)
    if sharding is not None:
        return jax.jit(lambda: jnp.zeros(shape, jnp.uint8), out_shardings=sharding)()
    return jnp.zeros(shape, jnp.uint8, device=device)


def dequantize(kv_cache, k_scale, v_scale, *, layout="HND", v_scale_swizzle=True,
               dtype=jnp.bfloat16):
    """Reads a whole NVFP4 cache back to floats.

    Value = E2M1 code * E4M3 block scale * k_scale (v_scale for V), docs/format.md §1.

    Args:
      kv_cache: ``uint8`` cache of :func:`kv_cache_shape` for ``layout``.
      k_scale, v_scale: the float32 scalars the cache was written with.
      layout, v_scale_swizzle: as the cache was written.
      dtype: output float dtype.

    Returns:
      ``(k, v)``, each ``[num_blocks, block_size, num_kv_heads, head_size]`` in ``dtype``.
    """
    return _reference.dequantize(kv_cache, k_scale, v_scale, layout=layout,
                                 v_scale_swizzle=v_scale_swizzle, dtype=dtype)
