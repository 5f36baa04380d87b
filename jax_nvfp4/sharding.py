"""The store on several devices: partitioning rules, and the head-grouped cache for tensor
parallelism.

Which axes of the cache can be split
------------------------------------
A page (one ``block``, one side K or V) holds ``num_kv_heads * block_size * F`` bytes: all the
heads' FP4 data first, then all the heads' E4M3 scales (spec §4). The ``num_kv_heads`` axis of
the cache shape only sizes the page, it does not index it: cut the page in two along that axis
and the first half holds the data of heads 0 .. 0.56*H, the second the rest of the data and every
head's scales. So the store cannot be split along the cache's head axis without moving bytes
between devices, and a cache sharded that way is gathered (correct, one all-gather of the cache
per store: slow). What does split with no communication:

* a leading stacked axis (the layers of a vmapped store, ``[L, num_blocks, 2, ...]``, and the
  head *groups* of the grouped cache below): pass-through;
* the page axis ``num_blocks``: each device writes the slots that fall on its pages (the slots
  are shifted to the shard's first page; other slots write nothing there, like padding).

Every other factor (tokens, heads, head_size, the K/V side, block_size, F, a size-1 scale axis)
must be replicated: the partitioner gathers an operand sharded along one of them (cheap for
key/value/slots: O(num_tokens); a real all-gather for a cache sharded along heads, block_size or
F).

Tensor parallelism: the head-grouped cache
------------------------------------------
For a model whose kv heads are split over ``G`` devices, keep the cache as ``G`` stacked
independent caches, ``[G, num_blocks, 2, num_kv_heads/G, block_size, F]`` (HND; NHD likewise),
group ``g`` holding heads ``g*H/G .. (g+1)*H/G - 1`` in the spec's page format: exactly the
per-rank cache vLLM keeps on each GPU of a tensor-parallel group, and what a trtllm-gen kernel
reads on that GPU. :func:`reshape_and_cache_grouped` stores into it (one launch per device, in
place); shard axis 0 of the cache and the head axis of key/value over the same mesh axis (whose
size must divide G; G = the number of devices along it is the natural choice).
:func:`dequantize_grouped` reads it back with the heads in order.

(Inside ``shard_map`` the store is the bare per-device call, so a plain cache whose head axis
``shard_map`` splits holds the same per-device caches, group ``d`` on device ``d``: the bytes of
that global array are then not those of a single-device store of it.)

Many layers: vmap, or scan over a flat page pool
-------------------------------------------------
``jax.vmap`` of the store over stacked layers (``[L, ...]`` caches batched along axis 0) is one
launch, in place. Inside ``lax.scan`` over layers, slicing layer ``l`` out of a stacked
``[L, num_blocks, ...]`` carry and updating it back copies that layer's cache every step (the
slice is a new buffer for XLA). Keep the layers' pages in one pool instead, a plain cache of
``L * num_blocks`` blocks (layer ``l`` owns blocks ``l*num_blocks .. (l+1)*num_blocks - 1``), and
store layer ``l`` with :func:`layer_slots`: the carry is then updated in place.

How it is built
---------------
``store_p``'s lowering (primitive.py) wraps the FFI call in
:func:`jax.experimental.custom_partitioning` (:func:`partitioned_store`), with a Shardy sharding
rule (jax's default partitioner) and GSPMD callbacks (``jax_use_shardy_partitioner=False``)
that say the above, and one ``partition`` callback that lowers the per-shard store: the same FFI
call on per-shard shapes, its result aliased to the per-shard cache. Because the wrapper is
applied at lowering, not at bind, ``vmap`` batches ``store_p`` with its own rule and the batched
call is partitioned the same way; on one device or inside ``shard_map`` (all axes manual) the
lowering is the bare FFI call.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from . import checks
from . import layout as _layout

#: Factors a store can be split along with no communication.
SPLITTABLE = ("layer", "blocks")


# ---------------------------------------------------------------------------------------------
# The factors of the store's operands.


def _cache_axes(layout: str, layered: bool) -> dict[str, int]:
    """Axis of each named cache axis: layer (if layered), blocks, side, heads, rows, f."""
    o = 1 if layered else 0
    axes = {name: o + i for i, name in enumerate(_layout.CACHE_AXES[layout])}
    if layered:
        axes["layer"] = 0
    return axes


def _factors(layout: str, shapes: Sequence[Sequence[int]]):
    """Factor names of every axis of the six operands, and those that must be replicated.

    A layered (vmapped) call has a rank-4 key ``[L, T, H, D]``; its slots are ``[T]`` (shared)
    or ``[L, T]``, its scales of size 1 (shared) or ``[L]``.
    """
    key, _, _, slots, k_scale, v_scale = (tuple(s) for s in shapes)
    layered = len(key) == 4
    kv = (("layer",) if layered else ()) + ("tokens", "heads", "head_size")
    axes = _cache_axes(layout, layered)
    cache = tuple(sorted(axes, key=axes.get))
    slot = ("layer", "tokens") if len(slots) == 2 else ("tokens",)

    def scale(shape, name):
        if not shape:
            return ()
        return ("layer",) if layered and shape[0] == key[0] else (name,)

    operands = (kv, kv, cache, slot, scale(k_scale, "k_one"), scale(v_scale, "v_one"))
    # In order of first use: Shardy wants special factors sorted by factor index.
    used = dict.fromkeys(f for op in operands for f in op)
    replicated = tuple(f for f in used if f not in SPLITTABLE)
    return operands, replicated


def _sharding_rule(layout, scale_search, v_scale_swizzle, mesh, operand_types, result_types):
    """Shardy rule (einsum-like text): layer and blocks pass through, the rest is replicated."""
    del scale_search, v_scale_swizzle, mesh, result_types
    operands, replicated = _factors(layout, [tuple(t.shape) for t in operand_types])
    text = ", ".join(" ".join(op) for op in operands) + " -> " + " ".join(operands[2])
    return text, {"need_replication_factors": replicated}


# ---------------------------------------------------------------------------------------------
# Shardings.


def _spec_entries(sharding, ndim: int) -> tuple:
    """The PartitionSpec of ``sharding`` padded to ``ndim`` entries."""
    if sharding is None:
        return (None,) * ndim
    if not isinstance(sharding, NamedSharding):
        raise NotImplementedError(
            "jax_nvfp4.reshape_and_cache under a multi-device jit needs its arguments sharded "
            "with jax.sharding.NamedSharding (a Mesh and a PartitionSpec); the partitioner got "
            f"{sharding!r}")
    spec = tuple(sharding.spec)
    return spec + (None,) * (ndim - len(spec))


def _mesh_axes(entry) -> tuple[str, ...]:
    if entry is None:
        return ()
    if isinstance(entry, (tuple, list)):
        return tuple(entry)
    return (entry,)


def _entry(axes: tuple[str, ...]):
    if not axes:
        return None
    return axes[0] if len(axes) == 1 else axes


def _plan(layout, shapes, cache_sharding):
    """PartitionSpecs of the six operands (the GSPMD callbacks): the cache keeps its layer and
    blocks sharding and nothing else; the other operands follow it on the factors they share,
    replicated elsewhere. Returns the specs and the mesh axes of each kept factor.

    Under Shardy the sharding rule states the same factors but gives the cache no priority: an
    operand sharded differently on a shared factor (per-layer slots on another mesh axis than
    the cache's layer axis, say) can make Shardy reshard the cache (correct bytes, collectives
    on the cache). Shard the small operands like the cache, or replicate them."""
    operands, _ = _factors(layout, shapes)
    entries = _spec_entries(cache_sharding, len(operands[2]))
    kept = {f: _mesh_axes(e) for f, e in zip(operands[2], entries) if f in SPLITTABLE}
    specs = [PartitionSpec(*(_entry(kept.get(f, ())) for f in op)) for op in operands]
    return specs, kept


def _infer_sharding_from_operands(layout, scale_search, v_scale_swizzle, mesh, arg_shapes,
                                  result_shape):
    """GSPMD: the result's sharding from the operands' (the cache's layer and blocks axes)."""
    del scale_search, v_scale_swizzle, result_shape
    specs, _ = _plan(layout, [a.shape for a in arg_shapes], arg_shapes[2].sharding)
    return NamedSharding(mesh, specs[2])


def _propagate_user_sharding(layout, scale_search, v_scale_swizzle, mesh, user_shape):
    """GSPMD: what the result's user wants, restricted to the axes the store can split."""
    del scale_search, v_scale_swizzle
    ndim = len(user_shape.shape)
    axes = _cache_axes(layout, layered=ndim == 6)
    keep = {axes[f] for f in SPLITTABLE if f in axes}
    entries = _spec_entries(user_shape.sharding, ndim)
    return NamedSharding(mesh, PartitionSpec(*(e if i in keep else None
                                               for i, e in enumerate(entries))))


def _shard_slots(slot_mapping, block_axes, local_slots: int):
    """Slots relative to this device's pages; -1 (nothing written) for slots on other pages."""
    shard = jax.lax.axis_index(_entry(block_axes))
    dtype = slot_mapping.dtype
    local = slot_mapping - shard.astype(dtype) * jnp.asarray(local_slots, dtype)
    mine = (slot_mapping >= 0) & (local >= 0) & (local < local_slots)
    return jnp.where(mine, local, jnp.asarray(-1, dtype))


def _make_partition(bind_local):
    def partition(layout, scale_search, v_scale_swizzle, mesh, arg_shapes, result_shape):
        del result_shape
        shapes = [a.shape for a in arg_shapes]
        specs, kept = _plan(layout, shapes, arg_shapes[2].sharding)
        arg_shardings = tuple(NamedSharding(mesh, s) for s in specs)
        axes = _cache_axes(layout, layered=len(shapes[0]) == 4)
        block_axes = kept.get("blocks", ())

        def lower_fn(key, value, kv_cache, slot_mapping, k_scale, v_scale):
            if block_axes:
                local_slots = kv_cache.shape[axes["blocks"]] * kv_cache.shape[axes["rows"]]
                slot_mapping = _shard_slots(slot_mapping, block_axes, local_slots)
            return bind_local(key, value, kv_cache, slot_mapping, k_scale, v_scale,
                              layout=layout, scale_search=scale_search,
                              v_scale_swizzle=v_scale_swizzle)

        return mesh, lower_fn, arg_shardings[2], arg_shardings

    return partition


@functools.lru_cache(maxsize=None)
def partitioned_store(bind_local):
    """``bind_local`` (the FFI store on whatever shapes it gets) under custom partitioning.

    Returns ``f(key, value, kv_cache, slot_mapping, k_scale, v_scale, layout, scale_search,
    v_scale_swizzle)`` (the last three static).
    """

    def store(key, value, kv_cache, slot_mapping, k_scale, v_scale, layout, scale_search,
              v_scale_swizzle):
        return bind_local(key, value, kv_cache, slot_mapping, k_scale, v_scale, layout=layout,
                          scale_search=scale_search, v_scale_swizzle=v_scale_swizzle)

    wrapped = custom_partitioning(store, static_argnums=(6, 7, 8))
    wrapped.def_partition(
        partition=_make_partition(bind_local),
        infer_sharding_from_operands=_infer_sharding_from_operands,
        propagate_user_sharding=_propagate_user_sharding,
        sharding_rule=_sharding_rule)
    return wrapped


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
    from . import api  # api -> primitive -> this module

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
    k_scale, v_scale = checks.as_scale(k_scale), checks.as_scale(v_scale)
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
    from . import api

    checks.check_options(layout=layout, v_scale_swizzle=v_scale_swizzle, dtype=dtype,
                         checked=checked)
    if checked:
        k_scale, v_scale = checks.as_scale(k_scale), checks.as_scale(v_scale)
        checks.check_scale(k_scale, "k_scale")
        checks.check_scale(v_scale, "v_scale")
        k_scale = checks.require_checkify(k_scale, "dequantize_grouped")
        checks.check_scale_values((("k_scale", k_scale), ("v_scale", v_scale)),
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
      k_scale, v_scale: the float32 scalars the cache was written with (shared by the groups,
        as :func:`reshape_and_cache_grouped` uses them).
      layout, v_scale_swizzle, sm_scale, return_lse, impl, checked: as for
        ``paged_attention`` (the checks run once, for all groups).

    Returns:
      ``[batch, num_q_heads, head_size]`` in q's dtype, heads in order (and the
      ``[batch, num_q_heads]`` log-sum-exp with ``return_lse=True``).

    Raises:
      TypeError, ValueError: at trace time, naming the offending argument.
    """
    from . import attention as _attention

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
