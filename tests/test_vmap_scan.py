"""The store over many layers: vmap (one launch, in place) and lax.scan (in place with a page
pool carry), byte for byte equal to a loop of single calls.

Runs on the first GPU where there is one, else on the CPU.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_nvfp4 as nv
from jax_nvfp4 import sharding as shd

import hlo_checks as hc

LAYERS, NUM_TOKENS, NUM_HEADS, HEAD_SIZE, NUM_BLOCKS, BLOCK_SIZE = 3, 10, 4, 64, 6, 8
NUM_SLOTS = NUM_BLOCKS * BLOCK_SIZE


def _device():
    try:
        gpus = jax.devices("gpu")
    except RuntimeError:
        gpus = []
    return (gpus or jax.devices("cpu"))[0]


DEVICE = _device()


def _put(*xs):
    return jax.device_put(xs, DEVICE)


# ---------------------------------------------------------------------------------------------
# Data: per-layer inputs, stacked.


def _layers(seed, layout="HND", *, layers=LAYERS, dtype=jnp.bfloat16, slot_dtype=np.int32,
            lead=()):
    """Stacked random inputs with leading axes ``lead + (layers,)``: key, value, cache, slots
    (with padding and out-of-range entries), k_scale, v_scale (one per layer)."""
    rng = np.random.default_rng(seed)
    shape = lead + (layers,)
    kv = shape + (NUM_TOKENS, NUM_HEADS, HEAD_SIZE)
    key = (rng.standard_normal(kv) * 3).astype(dtype)
    value = (rng.standard_normal(kv) * 2).astype(dtype)
    cache = rng.integers(0, 256, shape + nv.kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE, NUM_HEADS,
                                                           HEAD_SIZE, layout), dtype=np.uint8)
    slots = np.stack([rng.permutation(NUM_SLOTS)[:NUM_TOKENS]
                      for _ in range(int(np.prod(shape)))]).reshape(shape + (NUM_TOKENS,))
    slots = slots.astype(slot_dtype)
    slots[..., 2] = -1
    slots[..., 5] = NUM_SLOTS + 3
    k_scale = rng.uniform(0.002, 0.02, shape).astype(np.float32)
    v_scale = rng.uniform(0.002, 0.02, shape).astype(np.float32)
    return key, value, cache, slots, k_scale, v_scale


def _one(layout="HND", **options):
    return jax.jit(functools.partial(nv.reshape_and_cache, layout=layout, **options))


def _loop(store, key, value, cache, slots, k_scale, v_scale):
    """Single calls, one per layer (slots/scales with a leading layer axis or shared)."""
    def at(x, l, ndim):
        return x[l] if np.ndim(x) == ndim + 1 else x
    return np.stack([np.asarray(store(*_put(key[l], value[l], cache[l], at(slots, l, 1),
                                            at(k_scale, l, 0), at(v_scale, l, 0))))
                     for l in range(key.shape[0])])


# ---------------------------------------------------------------------------------------------
# Reading the compiled HLO.

def _compiled(fn, args, donate=2):
    return jax.jit(fn, donate_argnums=(donate,)).lower(*_put(*args)).compile().as_text()


def assert_one_launch_in_place(hlo, cache_shape):
    """One store on the whole [L, ...] cache (or page pool), aliased, no copy of the cache
    (no op but the store writing a uint8 array of rank >= 5; XLA:GPU's dynamic-slice fusion
    of the store in a scan is the store), the donated cache (argument 2) aliased to the
    result."""
    hc.assert_in_place(hlo, cache_shape, aliases={(): 2})


# ---------------------------------------------------------------------------------------------
# vmap over layers.


@pytest.mark.parametrize("layout", ("HND", "NHD"))
@pytest.mark.parametrize("per_layer_slots", (True, False), ids=("slots_per_layer", "slots_shared"))
@pytest.mark.parametrize("per_layer_scales", (True, False),
                         ids=("scales_per_layer", "scales_shared"))
def test_vmap_is_one_launch_in_place(layout, per_layer_slots, per_layer_scales):
    key, value, cache, slots, ks, vs = _layers(1, layout)
    if not per_layer_slots:
        slots = slots[0]
    if not per_layer_scales:
        ks, vs = ks[0], vs[0]
    in_axes = (0, 0, 0, 0 if per_layer_slots else None) + (0 if per_layer_scales else None,) * 2
    store = jax.vmap(functools.partial(nv.reshape_and_cache, layout=layout), in_axes=in_axes)
    args = (key, value, cache, slots, ks, vs)
    out = jax.jit(store, donate_argnums=(2,))(*_put(*args))
    np.testing.assert_array_equal(np.asarray(out), _loop(_one(layout), *args))
    assert_one_launch_in_place(_compiled(store, args), cache.shape)


@pytest.mark.parametrize("options", [dict(scale_search="4over6", dtype=jnp.float16,
                                          slot_dtype=np.int32),
                                     dict(v_scale_swizzle=False, dtype=jnp.bfloat16,
                                          slot_dtype=np.int32)], ids=("4over6-f16",
                                                                      "linear_v_scales"))
def test_vmap_options(options):
    options = dict(options)
    data = _layers(2, "NHD", dtype=options.pop("dtype"), slot_dtype=options.pop("slot_dtype"))
    store = jax.vmap(functools.partial(nv.reshape_and_cache, layout="NHD", **options))
    out = jax.jit(store)(*_put(*data))
    np.testing.assert_array_equal(np.asarray(out), _loop(_one("NHD", **options), *data))


def test_vmap_options_int64_slots_with_x64():
    """int64 slots through the batching rule (jax_enable_x64 for the test's duration)."""
    with jax.enable_x64(True):
        data = _layers(3, "HND", slot_dtype=np.int64)
        store = jax.vmap(functools.partial(nv.reshape_and_cache, layout="HND"))
        out = jax.jit(store)(*_put(*data))
        np.testing.assert_array_equal(np.asarray(out), _loop(_one("HND"), *data))


def test_vmap_cache_batched_along_another_axis():
    key, value, cache, slots, ks, vs = _layers(4)
    store = jax.vmap(nv.reshape_and_cache, in_axes=(1, 2, 1, 1, 0, 0), out_axes=1)
    out = jax.jit(store)(*_put(np.moveaxis(key, 0, 1), np.moveaxis(value, 0, 2),
                               np.moveaxis(cache, 0, 1), slots.T, ks, vs))
    np.testing.assert_array_equal(np.moveaxis(np.asarray(out), 1, 0),
                                  _loop(_one(), key, value, cache, slots, ks, vs))


def test_vmap_unbatched_cache_is_broadcast():
    """vmap semantics: every member stores into its own copy of a shared cache."""
    key, value, cache, slots, ks, vs = _layers(5)
    store = jax.vmap(nv.reshape_and_cache, in_axes=(0, 0, None, 0, 0, 0))
    out = jax.jit(store)(*_put(key, value, cache[0], slots, ks, vs))
    shared = np.broadcast_to(cache[0], cache.shape)
    np.testing.assert_array_equal(np.asarray(out),
                                  _loop(_one(), key, value, shared, slots, ks, vs))


def test_vmap_unbatched_key_batched_cache():
    key, value, cache, slots, ks, vs = _layers(6)
    store = jax.vmap(nv.reshape_and_cache, in_axes=(None, None, 0, None, None, None))
    args = (key[0], value[0], cache, slots[0], ks[0], vs[0])
    out = jax.jit(store, donate_argnums=(2,))(*_put(*args))
    expected = _loop(_one(), np.broadcast_to(key[0], key.shape),
                     np.broadcast_to(value[0], value.shape), cache, slots[0], ks[0], vs[0])
    np.testing.assert_array_equal(np.asarray(out), expected)
    assert_one_launch_in_place(_compiled(store, args), cache.shape)


@pytest.mark.parametrize("batched", ("k_scale", "v_scale"))
def test_vmap_one_scale_shared_one_per_layer(batched):
    key, value, cache, slots, ks, vs = _layers(7)
    if batched == "k_scale":
        vs = vs[0]
    else:
        ks = ks[0]
    in_axes = (0, 0, 0, 0, 0 if batched == "k_scale" else None,
               0 if batched == "v_scale" else None)
    store = jax.vmap(nv.reshape_and_cache, in_axes=in_axes)
    out = jax.jit(store)(*_put(key, value, cache, slots, ks, vs))
    np.testing.assert_array_equal(np.asarray(out),
                                  _loop(_one(), key, value, cache, slots, ks, vs))


@pytest.mark.parametrize("sharing", ("all_per_member", "shared_by_outer", "shared_by_inner",
                                     "shared_by_all"))
def test_nested_vmap(sharing):
    """vmap(vmap(store)): one launch for all B*L layers, in place; the same bytes as a loop."""
    outer = 2
    key, value, cache, slots, ks, vs = _layers(8, lead=(outer,))
    # Per (outer, inner) member unless shared: slots/scales and their in_axes.
    if sharing == "shared_by_outer":
        slots, ks, vs, outer_ax, inner_ax = slots[0], ks[0], vs[0], None, 0
    elif sharing == "shared_by_inner":
        slots, ks, vs, outer_ax, inner_ax = slots[:, 0], ks[:, 0], vs[:, 0], 0, None
    elif sharing == "shared_by_all":
        slots, ks, vs, outer_ax, inner_ax = slots[0, 0], ks[0, 0], vs[0, 0], None, None
    else:
        outer_ax, inner_ax = 0, 0
    inner = jax.vmap(nv.reshape_and_cache, in_axes=(0, 0, 0) + (inner_ax,) * 3)
    store = jax.vmap(inner, in_axes=(0, 0, 0) + (outer_ax,) * 3)
    args = (key, value, cache, slots, ks, vs)
    out = np.asarray(jax.jit(store, donate_argnums=(2,))(*_put(*args)))

    def member(x, b, l, ndim):
        if outer_ax is not None:
            x = x[b]
        if inner_ax is not None:
            x = x[l]
        return x

    one = _one()
    for b in range(outer):
        for l in range(LAYERS):
            expected = one(*_put(key[b, l], value[b, l], cache[b, l], member(slots, b, l, 1),
                                 member(ks, b, l, 0), member(vs, b, l, 0)))
            np.testing.assert_array_equal(out[b, l], np.asarray(expected))
    # One launch on the [B, L, ...] cache itself (the store takes several stacked axes: no
    # folding reshape, which XLA's copy insertion did not see through), in place, no copy.
    hc.assert_in_place(_compiled(store, args), cache.shape, cache_shapes=[cache.shape])


# ---------------------------------------------------------------------------------------------
# lax.scan over layers.


def _pool(cache):
    """[L, num_blocks, ...] -> the page pool [L*num_blocks, ...] (layer l owns blocks
    l*num_blocks ..)."""
    return cache.reshape((-1,) + cache.shape[2:])


@pytest.mark.parametrize("layout", ("HND", "NHD"))
def test_scan_over_layers_page_pool_in_place(layout):
    """The recommended scan: carry every layer's pages as one pool, store layer l with
    layer_slots. No copy of the cache; the same bytes as a loop over per-layer caches."""
    key, value, cache, slots, ks, vs = _layers(9, layout)

    def forward(key, value, pool, slots, ks, vs):
        def body(pool, x):
            layer, k, v, s, a, b = x
            s = shd.layer_slots(s, layer, NUM_BLOCKS, BLOCK_SIZE)
            return nv.reshape_and_cache(k, v, pool, s, a, b, layout=layout), None
        xs = (jnp.arange(key.shape[0]), key, value, slots, ks, vs)
        return jax.lax.scan(body, pool, xs)[0]

    args = (key, value, _pool(cache), slots, ks, vs)
    out = jax.jit(forward, donate_argnums=(2,))(*_put(*args))
    np.testing.assert_array_equal(np.asarray(out).reshape(cache.shape),
                                  _loop(_one(layout), key, value, cache, slots, ks, vs))
    assert_one_launch_in_place(_compiled(forward, args), _pool(cache).shape)


def test_scan_over_decode_steps_vmapped_layers_in_place():
    """A decode loop: scan over steps carrying the stacked [L, ...] cache, every step storing
    all layers with one vmapped launch: in place."""
    steps = 3
    data = [_layers(20 + s) for s in range(steps)]
    key, value, slots, ks, vs = (np.stack([d[i] for d in data]) for i in (0, 1, 3, 4, 5))
    cache = data[0][2]

    def decode(key, value, cache, slots, ks, vs):
        store = jax.vmap(nv.reshape_and_cache)
        return jax.lax.scan(lambda c, x: (store(x[0], x[1], c, *x[2:]), None), cache,
                            (key, value, slots, ks, vs))[0]

    args = (key, value, cache, slots, ks, vs)
    out = jax.jit(decode, donate_argnums=(2,))(*_put(*args))
    expected = cache
    for s in range(steps):
        expected = _loop(_one(), key[s], value[s], expected, slots[s], ks[s], vs[s])
    np.testing.assert_array_equal(np.asarray(out), expected)
    assert_one_launch_in_place(_compiled(decode, args), cache.shape)


@pytest.mark.parametrize("form", ("carry_update_slice", "xs"))
def test_scan_stacked_cache_other_forms_are_correct(form):
    """Other scan forms give the same bytes (they copy a layer's cache every step: use the
    page pool)."""
    key, value, cache, slots, ks, vs = _layers(10)

    def forward(key, value, cache, slots, ks, vs):
        xs = (jnp.arange(key.shape[0]), key, value, slots, ks, vs)
        if form == "xs":
            return jax.lax.scan(lambda _, x: (None, nv.reshape_and_cache(*x[1:3], x[6], *x[3:6])),
                                None, xs + (cache,))[1]

        def body(c, x):
            layer, k, v, s, a, b = x
            return c.at[layer].set(nv.reshape_and_cache(k, v, c[layer], s, a, b)), None
        return jax.lax.scan(body, cache, xs)[0]

    out = jax.jit(forward, donate_argnums=(2,))(*_put(key, value, cache, slots, ks, vs))
    np.testing.assert_array_equal(np.asarray(out),
                                  _loop(_one(), key, value, cache, slots, ks, vs))
