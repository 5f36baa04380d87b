"""The store as a JAX primitive: abstract evaluation, FFI lowering per platform, batching.

The primitive ``nvfp4_reshape_and_cache`` takes (key, value, kv_cache, slot_mapping, k_scale,
v_scale) and returns the updated cache. Its lowering is an XLA FFI custom call whose result is
aliased to the ``kv_cache`` operand, so with the cache donated XLA updates it in place. Under a
multi-device jit that call is wrapped in custom partitioning (partitioning.py) so that each device
runs it on its own shard.
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir

try:
    from . import _ffi
except ImportError as error:  # pragma: no cover - depends on how the package was installed
    import os as _os

    raise ImportError(
        f"jax_nvfp4's compiled extension (_ffi) is missing from {_os.path.dirname(__file__)}. "
        "This is the source tree, not the installed package: run from another directory (or "
        "use `pytest`, not `python -m pytest`, in the repository root), or install in place "
        "with `pip install -e .`.") from error
from . import checks
from . import layout as _layout
from . import partitioning as _partitioning

#: Name of the FFI target (same string as ffi/store_ffi.h).
STORE_TARGET = _ffi.STORE_TARGET
#: Operand index of kv_cache; the custom call's only result aliases it.
CACHE_OPERAND = 2

for _platform, _capsule in _ffi.registrations().items():
    jax.ffi.register_ffi_target(STORE_TARGET, _capsule, platform=_platform)

store_p = Primitive("nvfp4_reshape_and_cache")


def _bind_under_jit(*args, **params):
    return store_p.bind(*args, **params)


# Outside jit the primitive runs as its own compiled call (no donation: XLA copies the cache).
store_p.def_impl(jax.jit(_bind_under_jit, static_argnames=("layout", "scale_search",
                                                             "v_scale_swizzle")))


def _stacked(key) -> tuple[int, ...]:
    """Shape of the leading stacked axes (layers, head groups) of a call: key is
    ``[*stacked, num_tokens, num_kv_heads, head_size]``."""
    return tuple(key.shape[:-3])


@store_p.def_abstract_eval
def _abstract_eval(key, value, kv_cache, slot_mapping, k_scale, v_scale, *, layout,
                   scale_search, v_scale_swizzle):
    checks.check_store_args(key, value, kv_cache, slot_mapping, k_scale, v_scale, layout=layout,
                            scale_search=scale_search, v_scale_swizzle=v_scale_swizzle,
                            stacked=_stacked(key))
    # The result is the cache itself: same shape, dtype and (through .update) sharding.
    return kv_cache.update(shape=kv_cache.shape, dtype=kv_cache.dtype)


def _ffi_attributes(layout, scale_search, v_scale_swizzle):
    # Attribute types must match the C++ binding exactly: int32_t, int32_t, bool.
    return dict(layout=np.int32(_layout.LAYOUTS.index(layout)),
                scale_search=np.int32(_layout.SCALE_SEARCHES.index(scale_search)),
                v_scale_swizzle=bool(v_scale_swizzle))


_ffi_rule = jax.ffi.ffi_lowering(STORE_TARGET, operand_output_aliases={CACHE_OPERAND: 0})

# The FFI call itself, on whatever shapes it is given (the whole arrays on one device, one
# shard's arrays under a partitioned jit). Only ``store_p``'s lowering binds it.
local_store_p = Primitive("nvfp4_reshape_and_cache_local")
local_store_p.def_abstract_eval(
    lambda key, value, kv_cache, *args, **params: kv_cache.update(shape=kv_cache.shape,
                                                                  dtype=kv_cache.dtype))


def _ffi_lowering(ctx, *args, layout, scale_search, v_scale_swizzle):
    return _ffi_rule(ctx, *args, **_ffi_attributes(layout, scale_search, v_scale_swizzle))


def _missing_cuda_lowering(ctx, *args, **params):
    raise RuntimeError(
        "jax_nvfp4 was built without its CUDA kernel, so reshape_and_cache cannot run on a GPU. "
        "Reinstall it where a CUDA compiler is found (see README: 'Installing for GPUs').")


mlir.register_lowering(local_store_p, _ffi_lowering, platform="cpu")
mlir.register_lowering(local_store_p,
                       _ffi_lowering if _ffi.built_with_cuda() else _missing_cuda_lowering,
                       platform="cuda")


def _bind_local(*args, **params):
    return local_store_p.bind(*args, **params)


def _lowering(ctx, *args, layout, scale_search, v_scale_swizzle):
    """The FFI call under custom partitioning (partitioning.py): on one device (or inside
    shard_map) that is the bare call; under a sharded jit each device stores its own layers
    (or head groups) and pages in place, and operands sharded along any other axis are
    gathered first. Applied here rather than at bind so that vmap re-enters it."""
    partitioned = _partitioning.partitioned_store(_bind_local)
    fun = lambda *a: partitioned(*a, layout, scale_search, v_scale_swizzle)
    return mlir.lower_fun(fun, multiple_results=False)(ctx, *args)


mlir.register_lowering(store_p, _lowering, platform="cpu")
mlir.register_lowering(store_p, _lowering if _ffi.built_with_cuda() else _missing_cuda_lowering,
                       platform="cuda")


def require_devices_during_lowering(primitive):
    """Like custom_partitioning's own primitive: lower with the device assignment known (the
    partitioned lowering needs it)."""
    try:
        from jax._src import dispatch as _dispatch

        _dispatch.prim_requires_devices_during_lowering.add(primitive)
    except (ImportError, AttributeError):  # private API; only AOT lowering without devices
        pass


require_devices_during_lowering(store_p)


def _jvp(primals, tangents, **params):
    raise TypeError(
        "jax_nvfp4.reshape_and_cache is not differentiable: it quantises into a uint8 cache. "
        "If the store sits inside a differentiated function, apply jax.lax.stop_gradient to "
        "every float input that carries a tangent: key, value, and k_scale/v_scale when they "
        "are computed from differentiated values.")


ad.primitive_jvps[store_p] = _jvp


def _batch(args, dims, *, layout, scale_search, v_scale_swizzle):
    """vmap over stacked layers or head groups, nested or not: one launch, in place.

    The primitive takes any number of leading stacked axes, so vmap's members become one more
    of them, with no reshape: a reshape of the aliased cache is free in memory, but XLA's copy
    insertion does not see through it (it copied the cache in and out). The new axis goes
    where the cache has its members when that is among its stacked axes or just after them
    (so an ``[L, G, ...]`` cache vmapped over either axis, in either order, moves no byte);
    otherwise first: an unbatched cache is broadcast (each member then updates its own copy,
    which is what vmap means), a cache batched along a page axis is transposed (a copy).

    Key and value follow the cache. Slots and scales stay shared when no member differs, else
    they get one row per member and stacked index (both scales, when either differs: the
    kernel reads them with one stride).
    """
    key, value, kv_cache, slot_mapping, k_scale, v_scale = args
    not_mapped = None  # what vmap passes for an unbatched argument
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not not_mapped)
    num_stacked = len(kv_cache.shape) - 5 - (dims[2] is not not_mapped)  # before this vmap
    at = dims[2] if dims[2] is not not_mapped and dims[2] <= num_stacked else 0

    def put(x, d):
        """x with the members on axis ``at`` (broadcast when shared)."""
        if d is not_mapped:
            x = jnp.broadcast_to(x, (size,) + x.shape)
            d = 0
        return jnp.moveaxis(x, d, at)

    if size == 0:  # an empty batch stores nothing (and per-member shapes cannot be inferred)
        return put(kv_cache, dims[2]), at

    key, value, kv_cache = (put(x, d) for x, d in zip((key, value, kv_cache), dims[:3]))
    inner = tuple(kv_cache.shape[:num_stacked + 1])  # the stacked axes, members included
    old = inner[:at] + inner[at + 1:]

    def per_member(x, d, tail_ndim):
        """``x`` ([*old, *tail], or [*tail] shared by the old stacked axes) with one row per
        member and stacked index: [*inner, *tail]."""
        if d is not_mapped:
            x, d = jnp.broadcast_to(x, (size,) + x.shape), 0
        x = jnp.moveaxis(x, d, 0)
        tail = x.shape[x.ndim - tail_ndim:]
        if x.ndim != 1 + len(old) + tail_ndim:  # shared by the old stacked axes
            x = x.reshape((size,) + (1,) * len(old) + tail)
        return jnp.moveaxis(jnp.broadcast_to(x, (size,) + old + tail), 0, at)

    if dims[3] is not not_mapped or slot_mapping.ndim > 1:
        slot_mapping = per_member(slot_mapping, dims[3], tail_ndim=1)
    k_scale, v_scale = (s if d is not_mapped and s.size == 1 else per_member(s, d, tail_ndim=0)
                        for s, d in ((k_scale, dims[4]), (v_scale, dims[5])))
    # The kernel reads both scales with one stride: one per member for both, or one for all.
    if k_scale.size != v_scale.size:
        k_scale, v_scale = (jnp.broadcast_to(jnp.reshape(s, (1,) * len(inner)) if s.size == 1
                                             else s, inner) for s in (k_scale, v_scale))
    out = store_p.bind(key, value, kv_cache, slot_mapping, k_scale, v_scale, layout=layout,
                       scale_search=scale_search, v_scale_swizzle=v_scale_swizzle)
    return out, at


batching.primitive_batchers[store_p] = _batch
