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


def _num_layers(key) -> int | None:
    return key.shape[0] if len(key.shape) == 4 else None


@store_p.def_abstract_eval
def _abstract_eval(key, value, kv_cache, slot_mapping, k_scale, v_scale, *, layout,
                   scale_search, v_scale_swizzle):
    checks.check_store_args(key, value, kv_cache, slot_mapping, k_scale, v_scale, layout=layout,
                            scale_search=scale_search, v_scale_swizzle=v_scale_swizzle,
                            num_layers=_num_layers(key))
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
    """vmap over stacked layers: one launch for all of them, the cache updated in place.

    Key, value and cache get a leading batch axis of size B (an unbatched cache is broadcast:
    each member then updates its own copy, which is what vmap means; a cache batched along
    another axis is transposed: a copy). Slots and scales stay shared when no member differs,
    else they get one row per member (both scales, when either differs: the kernel reads them
    with one stride). With the cache batched along axis 0 the single launch updates it in place.

    A call that already carries a layer axis L (nested vmap) folds B and L into one axis. That
    reshape is free in memory, but XLA's copy insertion does not see through a reshape of the
    aliased operand: a nested vmap copies the cache once in and once out (measured; the
    handler would need to accept several leading axes to avoid it).
    """
    key, value, kv_cache, slot_mapping, k_scale, v_scale = args
    not_mapped = None  # what vmap passes for an unbatched argument
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not not_mapped)
    layered = len(key.shape) - (dims[0] is not not_mapped) == 4

    def leading(x, d):
        if d is not_mapped:
            return jnp.broadcast_to(x, (size,) + x.shape)
        return jnp.moveaxis(x, d, 0)

    if size == 0:  # an empty batch stores nothing (and per-member shapes cannot be inferred)
        return leading(kv_cache, dims[2]), 0

    key, value, kv_cache = (leading(x, d) for x, d in zip((key, value, kv_cache), dims[:3]))
    num_layers = key.shape[1] if layered else None
    out_shape = kv_cache.shape

    def per_member(x, d, shared_ndim):
        """x shared by all (returned as is) or [B, (L,) ...] folded to [B*L, ...]."""
        if d is not_mapped and (not layered or x.ndim == shared_ndim):
            return x
        x = leading(x, d)
        if layered and x.ndim == shared_ndim + 1:  # shared across the inner layers
            x = jnp.broadcast_to(x[:, None], (size, num_layers) + x.shape[1:])
        return x.reshape((-1,) + x.shape[2:]) if layered else x

    slot_mapping = per_member(slot_mapping, dims[3], shared_ndim=1)

    def scales(s, d):
        if d is not_mapped:
            if s.size == 1:
                return s  # shared by every member and layer
            return jnp.broadcast_to(s, (size,) + s.shape).reshape(-1)  # per inner layer
        s = jnp.moveaxis(s, d, 0).reshape(size, -1)  # [B, 1] or [B, L]
        if layered and s.shape[1] == 1:
            s = jnp.broadcast_to(s, (size, num_layers))
        return s.reshape(-1)

    k_scale, v_scale = scales(k_scale, dims[4]), scales(v_scale, dims[5])
    # The kernel reads both scales with one stride: one per layer for both, or one for all.
    if k_scale.size != v_scale.size:
        k_scale, v_scale = (jnp.broadcast_to(s.reshape(-1), (max(k_scale.size, v_scale.size),))
                            for s in (k_scale, v_scale))
    if layered:
        key, value, kv_cache = (x.reshape((-1,) + x.shape[2:]) for x in (key, value, kv_cache))
    out = store_p.bind(key, value, kv_cache, slot_mapping, k_scale, v_scale, layout=layout,
                       scale_search=scale_search, v_scale_swizzle=v_scale_swizzle)
    return out.reshape(out_shape), 0


batching.primitive_batchers[store_p] = _batch
