"""Partitioning rules of the two primitives under a multi-device ``jit``: the store's, and the
shared helpers that the decode primitive's rules use too (jax_nvfp4/attention_primitive.py).

Which axes of the cache can be split
------------------------------------
A page (one ``block``, one side K or V) holds ``num_kv_heads * block_size * F`` bytes: all the
heads' FP4 codes first, then all the heads' E4M3 scales (docs/format.md §4). The
``num_kv_heads`` axis of the cache shape only sizes the page, it does not index it: cut the page
in two along that axis and the first half holds the codes of heads 0 .. 0.56*H, the second the
rest of the codes and every head's scales. So the store cannot be split along the cache's head
axis without moving bytes between devices, and a cache sharded that way is gathered (correct,
one all-gather of the cache per store: slow). What does split with no communication:

* the leading stacked axes, any number of them (the layers of a vmapped store,
  ``[L, num_blocks, 2, ...]``, the head *groups* of :mod:`jax_nvfp4.sharding`'s grouped cache,
  both: ``[L, G, ...]`` or ``[G, L, ...]``): pass-through, each on its own mesh axis or
  replicated;
* the page axis ``num_blocks``: each device writes the slots that fall on its pages (the slots
  are shifted to the shard's first page; other slots write nothing there, like padding).

Every other factor (tokens, heads, head_size, the K/V side, block_size, F, a size-1 scale axis)
must be replicated: the partitioner gathers an operand sharded along one of them (cheap for
key/value/slots: O(num_tokens); a real all-gather for a cache sharded along heads, block_size or
F).

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

This module imports nothing of the package but ``layout``: both primitives import it, and the
user-facing tensor-parallel API (:mod:`jax_nvfp4.sharding`) sits above them.
"""

from __future__ import annotations

import functools
from typing import Sequence

import jax
import jax.numpy as jnp
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding, PartitionSpec

from . import layout as _layout

#: Factors of the store that split with no communication: every stacked axis (``layer0``,
#: ``layer1``, ...: layers, head groups) and the page axis.
SPLITTABLE = ("layer", "blocks")


def splittable(factor: str, names=SPLITTABLE) -> bool:
    """Whether a factor splits: its name, less the number of a stacked axis (``layer0``,
    ``stack1``), is one of ``names`` (the store's :data:`SPLITTABLE` by default)."""
    return factor.rstrip("0123456789") in names


def replicated_factors(operands, names=SPLITTABLE):
    """The factors of ``operands`` (tuples of factor names) that must be replicated, all but
    the :func:`splittable` ones, in order of first use (Shardy wants special factors sorted by
    factor index)."""
    used = dict.fromkeys(f for op in operands for f in op)
    return tuple(f for f in used if not splittable(f, names))


def specs_of(kept, names):
    """The PartitionSpec of an operand or result with these factor names: the kept factors'
    mesh axes (``kept``: factor -> mesh axes), the others replicated."""
    return PartitionSpec(*(spec_entry(kept.get(f, ())) for f in names))


# ---------------------------------------------------------------------------------------------
# The factors of the store's operands.


def cache_axes(layout: str, num_stacked: int = 0) -> dict[str, int]:
    """Axis of each named cache axis: the stacked axes ``layer0 .. layer{n-1}``, then blocks,
    side, heads, rows, f."""
    axes = {name: num_stacked + i for i, name in enumerate(_layout.CACHE_AXES[layout])}
    axes.update({f"layer{i}": i for i in range(num_stacked)})
    return axes


def _factors(layout: str, shapes: Sequence[Sequence[int]]):
    """Factor names of every axis of the six operands, and those that must be replicated.

    A call with stacked axes S (vmapped, nested or not) has key ``[*S, T, H, D]``; its slots
    are ``[T]`` (shared) or ``[*S, T]``, its scales of size 1 (shared) or of shape S.
    """
    key, _, _, slots, k_scale, v_scale = (tuple(s) for s in shapes)
    stacked = key[:-3]
    layers = tuple(f"layer{i}" for i in range(len(stacked)))
    kv = layers + ("tokens", "heads", "head_size")
    axes = cache_axes(layout, len(stacked))
    cache = tuple(sorted(axes, key=axes.get))
    slot = layers + ("tokens",) if stacked and len(slots) == len(stacked) + 1 else ("tokens",)

    def scale(shape, name):
        if not shape:
            return ()
        return layers if stacked and shape == stacked else (name,)

    operands = (kv, kv, cache, slot, scale(k_scale, "k_one"), scale(v_scale, "v_one"))
    return operands, replicated_factors(operands)


def _sharding_rule(layout, scale_search, v_scale_swizzle, mesh, operand_types, result_types):
    """Shardy rule (einsum-like text): layer and blocks pass through, the rest is replicated."""
    del scale_search, v_scale_swizzle, mesh, result_types
    operands, replicated = _factors(layout, [tuple(t.shape) for t in operand_types])
    text = ", ".join(" ".join(op) for op in operands) + " -> " + " ".join(operands[2])
    return text, {"need_replication_factors": replicated}


# ---------------------------------------------------------------------------------------------
# Shardings.


def spec_entries(sharding, ndim: int) -> tuple:
    """The PartitionSpec of ``sharding`` padded to ``ndim`` entries."""
    if sharding is None:
        return (None,) * ndim
    if not isinstance(sharding, NamedSharding):
        raise NotImplementedError(
            "jax_nvfp4's store and decode attention under a multi-device jit need their "
            "arguments sharded with jax.sharding.NamedSharding (a Mesh and a PartitionSpec); "
            "the partitioner got "
            f"{sharding!r}")
    spec = tuple(sharding.spec)
    return spec + (None,) * (ndim - len(spec))


def mesh_axes(entry) -> tuple[str, ...]:
    """The mesh axes of one PartitionSpec entry (None, a name or a tuple of names)."""
    if entry is None:
        return ()
    if isinstance(entry, (tuple, list)):
        return tuple(entry)
    return (entry,)


def spec_entry(axes: tuple[str, ...]):
    """Inverse of :func:`mesh_axes`: the PartitionSpec entry for these mesh axes."""
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
    entries = spec_entries(cache_sharding, len(operands[2]))
    kept = {f: mesh_axes(e) for f, e in zip(operands[2], entries) if splittable(f)}
    specs = [specs_of(kept, op) for op in operands]
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
    keep = {i for f, i in cache_axes(layout, ndim - 5).items() if splittable(f)}
    entries = spec_entries(user_shape.sharding, ndim)
    return NamedSharding(mesh, PartitionSpec(*(e if i in keep else None
                                               for i, e in enumerate(entries))))


def _shard_slots(slot_mapping, block_axes, local_slots: int):
    """Slots relative to this device's pages; -1 (nothing written) for slots on other pages."""
    shard = jax.lax.axis_index(spec_entry(block_axes))
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
        axes = cache_axes(layout, len(shapes[0]) - 3)
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
