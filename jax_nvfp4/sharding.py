"""Tensor parallelism and many layers: the head-grouped cache, and slots for a page pool.

How the store and decode attention split over devices on their own (which cache axes split
with no communication, and why the head axis of a plain cache does not) is in
:mod:`jax_nvfp4.partitioning`; this module is the user-facing API built on top of them.

Tensor parallelism: the head-grouped cache
------------------------------------------
For a model whose kv heads are split over ``G`` devices, keep the cache as ``G`` stacked
independent caches, ``[G, num_blocks, 2, num_kv_heads/G, block_size, F]`` (HND; NHD likewise),
group ``g`` holding heads ``g*H/G .. (g+1)*H/G - 1`` in the page format of docs/format.md §4:
exactly the per-rank cache vLLM keeps on each GPU of a tensor-parallel group, and what a
trtllm-gen kernel reads on that GPU. :func:`reshape_and_cache_grouped` stores into it (one
launch per device, in place); shard axis 0 of the cache and the head axis of key/value over the
same mesh axis (whose size must divide G; G = the number of devices along it is the natural
choice). :func:`paged_attention_grouped` attends over it, each device with its own query heads,
and :func:`dequantize_grouped` reads it back with the heads in order.

(Inside ``shard_map`` the store is the bare per-device call, so a plain cache whose head axis
``shard_map`` splits holds the same per-device caches, group ``d`` on device ``d``: the bytes of
that global array are then not those of a single-device store of it.)

Many layers: vmap, or scan over a flat page pool
-------------------------------------------------
The store and the readers take any number of leading stacked axes, so ``jax.vmap`` over
stacked layers, nested or not, over ``[L, G, ...]`` or ``[G, L, ...]`` caches (layers and head
groups), is one launch per device, in place, with no collective whichever of the leading axes
is sharded: each vmap adds a stacked axis where the cache has its members, nothing is
reshaped or transposed.

A model's layers run one after the other, though. Inside ``lax.scan`` over layers, slicing
layer ``l`` out of a stacked ``[L, ...]`` carry and updating it back copies that layer's cache
every step (the slice is a new buffer for XLA). Keep the layers' pages in one pool instead: a
cache of ``L * num_blocks`` blocks (layer ``l`` owns blocks ``l*num_blocks .. (l+1)*num_blocks -
1``), grouped for tensor parallelism (:func:`grouped_kv_cache_shape` with ``L * num_blocks``
blocks), store layer ``l`` with :func:`layer_slots` and read it with
:func:`layer_block_tables`: the carry is then updated in place. A Python loop over the layers
with one cache per layer (a tuple of grouped caches, donated) is in place too (README, "Many
layers").
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from . import api
from . import attention as _attention
from . import checks
from . import layout as _layout
# Re-exported: these lived here before the partitioning rules got their own module.
from .partitioning import SPLITTABLE, partitioned_store  # noqa: F401

# ---------------------------------------------------------------------------------------------
# The head-grouped cache (tensor parallelism).


def grouped_kv_cache_shape(num_groups: int, num_blocks: int, block_size: int, num_kv_heads: int,
                           head_size: int, layout: str = "HND") -> tuple[int, ...]:
    """Shape of a head-grouped cache: ``(num_groups,) + kv_cache_shape(..., num_kv_heads //
    num_groups, ...)``, i.e. ``num_groups`` independent caches of ``num_kv_heads / num_groups``
    heads each (group ``g`` holds heads ``g*H/G .. (g+1)*H/G - 1``)."""
    _layout.check_int(num_groups, "num_groups")
    _layout.check_int(num_kv_heads, "num_kv_heads")
    if num_groups <= 0 or num_kv_heads % num_groups:
        raise ValueError(f"num_groups must divide num_kv_heads={num_kv_heads}, got {num_groups}")
    return (num_groups,) + _layout.kv_cache_shape(num_blocks, block_size,
                                                  num_kv_heads // num_groups, head_size, layout)


def split_heads(x, num_groups: int):
    """``[..., H, D]`` -> ``[num_groups, ..., H/num_groups, D]`` (group-major, heads in order).

    Keeps a head-sharded ``x`` on its devices when the mesh axis size divides ``num_groups``.
    """
    _layout.check_int(num_groups, "num_groups")
    *lead, heads, d = x.shape
    if num_groups <= 0 or heads % num_groups:
        raise ValueError(f"num_groups={num_groups} must divide the head axis of {x.shape}")
    x = x.reshape(*lead, num_groups, heads // num_groups, d)
    return jnp.moveaxis(x, -3, 0)


def merge_heads(x):
    """Inverse of :func:`split_heads`: ``[G, ..., H/G, D]`` -> ``[..., H, D]``."""
    x = jnp.moveaxis(x, 0, -3)
    return x.reshape(*x.shape[:-3], x.shape[-3] * x.shape[-2], x.shape[-1])


def reshape_and_cache_grouped(key, value, kv_cache, slot_mapping, k_scale, v_scale, *,
                              layout="HND", scale_search="default", v_scale_swizzle=True,
                              checked=False):
    """:func:`jax_nvfp4.reshape_and_cache` into a head-grouped cache.

    Args:
      key, value: ``[num_tokens, num_kv_heads, head_size]`` (all heads).
      kv_cache: ``[G, ...]`` of :func:`grouped_kv_cache_shape`; G divides num_kv_heads.
      slot_mapping, k_scale, v_scale, layout, scale_search, v_scale_swizzle, checked: as for
        ``reshape_and_cache`` (slots and scales are shared by the groups).

    Returns:
      The updated grouped cache. Under ``jit`` with key/value sharded along heads and the cache
      along axis 0 over the same mesh axis (whose size divides G), every device stores its own
      groups in place: no collective, no copy (with the cache donated).
    """
    checks.check_options(layout=layout, scale_search=scale_search,
                         v_scale_swizzle=v_scale_swizzle, checked=checked)
    slot_mapping = checks.host_integers(slot_mapping, "slot_mapping")
    num_groups = kv_cache.shape[0] if kv_cache.ndim == 6 else None
    if num_groups is None:
        raise ValueError(f"kv_cache must be a grouped cache [G, ...] of rank 6 "
                         f"(grouped_kv_cache_shape), got shape {tuple(kv_cache.shape)}")
    if key.ndim != 3 or key.shape[1] % num_groups:
        raise ValueError(f"key must be [num_tokens, num_kv_heads, head_size] with num_kv_heads a "
                         f"multiple of the cache's {num_groups} groups, got {tuple(key.shape)}")
    if tuple(value.shape) != tuple(key.shape):
        raise ValueError(f"value must have key's shape {tuple(key.shape)}, got {tuple(value.shape)}")
    k_scale, v_scale = checks.as_scales(k_scale, v_scale)
    checks.check_scale(k_scale, "k_scale")   # before the checked=True checks read them
    checks.check_scale(v_scale, "v_scale")
    if checked:
        geometry = _layout.CacheGeometry.from_shape(kv_cache.shape[1:], layout)
        slot_mapping = checks.require_checkify(slot_mapping, "reshape_and_cache_grouped")
        api._check_slots(slot_mapping, geometry.num_slots)
        api._check_store_scales(key, value, k_scale, v_scale, scale_search)
    store = functools.partial(api.reshape_and_cache, layout=layout, scale_search=scale_search,
                              v_scale_swizzle=v_scale_swizzle)
    return jax.vmap(store, in_axes=(0, 0, 0, None, None, None))(
        split_heads(key, num_groups), split_heads(value, num_groups), kv_cache, slot_mapping,
        k_scale, v_scale)


def dequantize_grouped(kv_cache, k_scale, v_scale, *, layout="HND", v_scale_swizzle=True,
                       dtype=jnp.bfloat16, checked=False):
    """Reads a head-grouped cache back: ``(k, v)``, each ``[num_blocks, block_size,
    num_kv_heads, head_size]`` with the groups' heads in order (as :func:`jax_nvfp4.dequantize`
    for an ungrouped cache, ``checked`` included)."""
    checks.check_options(layout=layout, v_scale_swizzle=v_scale_swizzle, dtype=dtype,
                         checked=checked)
    if checked:
        k_scale, v_scale = checks.checked_dequantize_scales(k_scale, v_scale,
                                                            "dequantize_grouped")
    read = functools.partial(api.dequantize, k_scale=k_scale, v_scale=v_scale, layout=layout,
                             v_scale_swizzle=v_scale_swizzle, dtype=dtype)
    k, v = jax.vmap(lambda c: read(c))(kv_cache)  # [G, num_blocks, block_size, H/G, D]
    return merge_heads(k), merge_heads(v)


# ---------------------------------------------------------------------------------------------
# Many layers in one page pool.


def layer_slots(slot_mapping, layer, num_blocks: int, block_size: int):
    """Slots of layer ``layer`` in a page pool of ``num_layers * num_blocks`` blocks.

    ``slot_mapping`` addresses one layer's ``num_blocks * block_size`` slots; the result
    addresses the same slots in layer ``layer``'s blocks of the pool (``layer`` may be traced,
    e.g. a ``lax.scan`` index). Padding (negative) slots and slots ``>= num_blocks *
    block_size`` become -1, so they write nothing and never spill into the next layer's pages.
    """
    num_blocks = _layout.check_int(num_blocks, "num_blocks")
    block_size = _layout.check_int(block_size, "block_size")
    slot_mapping = jnp.asarray(checks.host_integers(slot_mapping, "slot_mapping"))
    dtype = slot_mapping.dtype
    per_layer = num_blocks * block_size
    shifted = slot_mapping + jnp.asarray(layer, dtype) * jnp.asarray(per_layer, dtype)
    valid = (slot_mapping >= 0) & (slot_mapping < per_layer)
    return jnp.where(valid, shifted, jnp.asarray(-1, dtype))


def layer_block_tables(block_tables, layer, num_blocks: int):
    """Block tables of layer ``layer`` in a page pool of ``num_layers * num_blocks`` blocks:
    the reader's counterpart of :func:`layer_slots`.

    ``block_tables`` holds one layer's page numbers (``0 .. num_blocks - 1``); the result
    holds the same pages in layer ``layer``'s blocks of the pool (``layer`` may be traced).
    Entries past a sequence's length are never read, whatever they hold.
    """
    num_blocks = _layout.check_int(num_blocks, "num_blocks")
    (block_tables,) = _attention._integer_arrays(
        ("block_tables", block_tables, lambda shape: True, "any"))
    dtype = block_tables.dtype
    return block_tables + jnp.asarray(layer, dtype) * jnp.asarray(num_blocks, dtype)


# ---------------------------------------------------------------------------------------------
# Decode attention over the head-grouped cache (tensor parallelism).


def paged_attention_grouped(q, kv_cache, block_tables, seq_lens, k_scale, v_scale, *,
                            layout="HND", v_scale_swizzle=True, sm_scale=None, return_lse=False,
                            impl="auto", checked=False):
    """:func:`jax_nvfp4.paged_attention` over a head-grouped cache: one call per group.

    Group ``g`` of the cache holds kv heads ``g*H/G .. (g+1)*H/G - 1``; query head ``i``
    belongs to group ``i // (num_q_heads / G)``, which are exactly the query heads that
    grouped-query attention maps to those kv heads (query head ``i`` uses kv head
    ``i // (num_q_heads / H)``). So the result is the same as ``paged_attention`` over the
    plain cache holding the same K/V, and every group's attention reads only its own cache.

    It is ``jax.vmap`` of ``paged_attention`` over the group axis of the cache and of ``q``
    split into ``[G, batch, num_q_heads/G, head_size]`` (:func:`split_heads`): on a GPU one
    kernel launch for all groups. The groups' outputs are merged back with the heads in order
    (:func:`merge_heads`). Under ``jit`` with
    the cache sharded along axis 0 and ``q`` along its head axis over the same mesh axis (whose
    size divides G), with block_tables, seq_lens and the scales replicated, each device attends
    with its own groups: no collective and no copy of the cache; the output is sharded along
    its head axis.

    Args:
      q: ``[batch, num_q_heads, head_size]``, bfloat16, float16 or float32; ``num_q_heads`` a
        multiple of the cache's total ``num_kv_heads = G * (num_kv_heads / G)``.
      kv_cache: ``uint8`` ``[G, ...]`` of :func:`grouped_kv_cache_shape` for ``layout``, as
        written by :func:`reshape_and_cache_grouped`.
      block_tables, seq_lens: as for ``paged_attention`` (shared by the groups).
      k_scale, v_scale: the scales the cache was written with (shared by the groups,
        as :func:`reshape_and_cache_grouped` uses them).
      layout, v_scale_swizzle, sm_scale, return_lse, impl, checked: as for
        ``paged_attention`` (the checks run once, for all groups).

    Returns:
      ``[batch, num_q_heads, head_size]`` in q's dtype, heads in order (and the
      ``[batch, num_q_heads]`` log-sum-exp with ``return_lse=True``).

    Raises:
      TypeError, ValueError: at trace time, naming the offending argument.
    """
    checks.check_options(layout=layout, v_scale_swizzle=v_scale_swizzle, return_lse=return_lse,
                         impl=impl, checked=checked)
    batch, num_q_heads, head_size = _attention._check_q(q)
    if not hasattr(kv_cache, "dtype"):
        kv_cache = jnp.asarray(kv_cache)
    if kv_cache.ndim != 6:
        raise ValueError(f"kv_cache must be a grouped cache [G, num_blocks, 2, ...] of rank 6 "
                         f"(grouped_kv_cache_shape), got shape {tuple(kv_cache.shape)}")
    num_groups = kv_cache.shape[0]
    if num_groups == 0:
        raise ValueError(f"kv_cache has no groups (axis 0 is 0), shape {tuple(kv_cache.shape)}")
    # One group's cache (its shape and dtype); errors name it kv_cache[g].
    geo = checks.check_kv_cache(jax.ShapeDtypeStruct(kv_cache.shape[1:], kv_cache.dtype),
                                 layout, v_scale_swizzle, argument="kv_cache[g]")
    num_kv_heads = num_groups * geo.num_kv_heads
    if head_size != geo.head_size:
        raise ValueError(f"q head_size {head_size} does not match kv_cache head_size "
                         f"{geo.head_size}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"q num_q_heads {num_q_heads} must be a multiple of kv_cache's "
                         f"num_kv_heads {num_kv_heads} ({num_groups} groups of "
                         f"{geo.num_kv_heads}; grouped-query attention)")
    block_tables, seq_lens = _attention._check_tables(block_tables, seq_lens, batch)
    k_scale = _attention._scale(k_scale, "k_scale")
    v_scale = _attention._scale(v_scale, "v_scale")
    sm_scale = _attention._sm_scale(sm_scale, head_size)
    if checked:
        block_tables = checks.require_checkify(block_tables, "paged_attention_grouped")
        _attention.check_reads(block_tables, seq_lens, geo.num_blocks, geo.block_size,
                               (("k_scale", k_scale), ("v_scale", v_scale)),
                               "paged_attention_grouped")

    def attend_group(q_g, cache_g):
        return _attention.paged_attention(q_g, cache_g, block_tables, seq_lens, k_scale,
                                          v_scale, layout=layout,
                                          v_scale_swizzle=bool(v_scale_swizzle),
                                          sm_scale=sm_scale, return_lse=True, impl=impl)

    out, lse = jax.vmap(attend_group)(split_heads(q, num_groups), kv_cache)  # [G, B, Q/G, D]
    out = merge_heads(out)
    if not return_lse:
        return out
    return out, merge_heads(lse[..., None])[..., 0]
