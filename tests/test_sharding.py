"""The store under a multi-device jit: correct bytes for every sharding, and no collective and
no copy of the cache for the shardings it can split (the rules: jax_nvfp4/partitioning.py; the
head-grouped cache: jax_nvfp4/sharding.py).

The meshes use the devices of one platform: the GPUs where there are some, else the 8 virtual
CPU devices of conftest.py. Cases needing more devices than there are are skipped.

Why the plain cache's head axis is not one of those: a page holds all heads' FP4 data, then all
heads' scales (docs/format.md §4), so a shard of the head axis does not hold whole heads
(``test_head_axis_does_not_split_a_page``). Tensor parallelism uses the head-grouped cache.

In place (``hlo_checks.assert_in_place``): no collective, no op but the store (or XLA:GPU's
dynamic-slice fusion of it) writing a uint8 array of rank >= 5, one store on the per-shard
cache, aliased to the donated cache argument.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_nvfp4 as nv
from jax_nvfp4 import partitioning, sharding as shd
from jax_nvfp4.layout import CacheGeometry

import hlo_checks as hc

NUM_TOKENS, NUM_HEADS, HEAD_SIZE, NUM_BLOCKS, BLOCK_SIZE = 24, 8, 128, 8, 16
LAYOUTS = ("HND", "NHD")
COUNTS = (2, 4, 8)


from meshes import DEVICES, make_mesh as _mesh  # noqa: E402


# ---------------------------------------------------------------------------------------------
# Data.


def _inputs(seed, layout, *, cache_shape=None, num_heads=NUM_HEADS):
    """Fresh random key/value/cache (numpy), slots with padding and out-of-range entries."""
    rng = np.random.default_rng(seed)
    shape = (NUM_TOKENS, num_heads, HEAD_SIZE)
    key = (rng.standard_normal(shape) * 3).astype(jnp.bfloat16)
    value = (rng.standard_normal(shape) * 2).astype(jnp.bfloat16)
    if cache_shape is None:
        cache_shape = nv.kv_cache_shape(NUM_BLOCKS, BLOCK_SIZE, num_heads, HEAD_SIZE, layout)
    cache = rng.integers(0, 256, cache_shape, dtype=np.uint8)
    slots = rng.permutation(NUM_BLOCKS * BLOCK_SIZE)[:NUM_TOKENS].astype(np.int32)
    slots[3] = -1  # padding
    slots[7] = NUM_BLOCKS * BLOCK_SIZE + 5  # out of range: skipped
    k_scale = np.float32(np.abs(key.astype(np.float32)).max() / 448)
    v_scale = np.float32(np.abs(value.astype(np.float32)).max() / (448 * 6))
    return key, value, cache, slots, k_scale, v_scale


def _single_device(fn, *args):
    return np.asarray(jax.jit(fn)(*jax.device_put(args, DEVICES[0])))


def _run_sharded(fn, mesh, specs, args, *, donate=2):
    """Places fresh copies of ``args`` with ``specs`` and runs jit(fn) with the cache donated.

    Returns (result as numpy, result sharding, compiled HLO text)."""
    def placed():
        return [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs)]

    f = jax.jit(fn, donate_argnums=(donate,))
    hlo = f.lower(*placed()).compile().as_text()
    out = f(*placed())
    return np.asarray(out), out.sharding, hlo


def _local(shape, spec, mesh):
    return NamedSharding(mesh, spec).shard_shape(tuple(shape))


# ---------------------------------------------------------------------------------------------
# The plain cache's head axis.


@pytest.mark.parametrize("layout", LAYOUTS)
def test_head_axis_does_not_split_a_page(layout):
    """Half the head axis of a page does not hold half the heads' bytes: that is why the store
    cannot run per head shard on a plain cache (docs/format.md §4: codes of all heads,
    then scales)."""
    geo = CacheGeometry(NUM_BLOCKS, BLOCK_SIZE, NUM_HEADS, HEAD_SIZE, layout)
    half = geo.side_bytes // 2
    first = np.concatenate([geo.data_offsets()[: NUM_HEADS // 2].ravel(),
                            geo.scale_offsets(False, True)[: NUM_HEADS // 2].ravel()])
    assert (first >= half).any()


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("count", COUNTS)
def test_plain_cache_head_sharded_is_correct(layout, count):
    """A plain cache sharded along heads is gathered, not split: same bytes as one device."""
    mesh = _mesh((count,), ("tp",))
    args = _inputs(10 + count, layout)
    store = functools.partial(nv.reshape_and_cache, layout=layout)
    head_axis = 2 if layout == "HND" else 3
    cache_spec = P(*[("tp" if i == head_axis else None) for i in range(5)])
    specs = (P(None, "tp"), P(None, "tp"), cache_spec, P(), P(), P())
    out, sharding, _ = _run_sharded(store, mesh, specs, args)
    np.testing.assert_array_equal(out, _single_device(store, *args))
    assert out.shape == args[2].shape and out.dtype == np.uint8


# ---------------------------------------------------------------------------------------------
# Tensor parallelism: the head-grouped cache.


def _grouped_store(layout):
    return functools.partial(shd.reshape_and_cache_grouped, layout=layout)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_grouped_cache_is_independent_caches(layout):
    """Group g of a grouped cache is the plain store of heads g*H/G .. (g+1)*H/G - 1."""
    groups = 4
    shape = shd.grouped_kv_cache_shape(groups, NUM_BLOCKS, BLOCK_SIZE, NUM_HEADS, HEAD_SIZE, layout)
    key, value, cache, slots, ks, vs = _inputs(1, layout, cache_shape=shape)
    out = _single_device(_grouped_store(layout), key, value, cache, slots, ks, vs)
    per = NUM_HEADS // groups
    store = functools.partial(nv.reshape_and_cache, layout=layout)
    for g in range(groups):
        heads = slice(g * per, (g + 1) * per)
        np.testing.assert_array_equal(
            out[g], _single_device(store, key[:, heads], value[:, heads], cache[g], slots, ks, vs))
    # And it reads back as the heads in order.
    k, v = jax.jit(functools.partial(shd.dequantize_grouped, layout=layout))(out, ks, vs)
    k1, v1 = jax.jit(functools.partial(nv.dequantize, layout=layout))(out[1], ks, vs)
    bits = lambda x: np.asarray(x).view(np.uint16)  # bfloat16 bits (NaN == NaN)
    np.testing.assert_array_equal(bits(k)[:, :, per:2 * per], bits(k1))
    np.testing.assert_array_equal(bits(v)[:, :, per:2 * per], bits(v1))


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("count,groups", [(2, 2), (4, 4), (8, 8), (2, 8)])
def test_grouped_cache_head_sharded_in_place(layout, count, groups):
    """Key/value sharded along heads, the grouped cache along groups: each device stores its
    groups with no collective and no copy; bytes equal the single-device store."""
    mesh = _mesh((count,), ("tp",))
    shape = shd.grouped_kv_cache_shape(groups, NUM_BLOCKS, BLOCK_SIZE, NUM_HEADS, HEAD_SIZE,
                                       layout)
    args = _inputs(20 + count + groups, layout, cache_shape=shape)
    specs = (P(None, "tp"), P(None, "tp"), P("tp"), P(), P(), P())
    store = _grouped_store(layout)
    out, sharding, hlo = _run_sharded(store, mesh, specs, args)
    np.testing.assert_array_equal(out, _single_device(store, *args))
    assert sharding.is_equivalent_to(NamedSharding(mesh, P("tp")), len(shape))
    hc.assert_in_place(hlo, _local(shape, P("tp"), mesh))


# ---------------------------------------------------------------------------------------------
# Pages (num_blocks) sharded: split with shard-local slots.


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("count", COUNTS)
def test_blocks_sharded_in_place(layout, count):
    mesh = _mesh((count,), ("pages",))
    args = _inputs(30 + count, layout)
    store = functools.partial(nv.reshape_and_cache, layout=layout)
    specs = (P(), P(), P("pages"), P(), P(), P())
    out, sharding, hlo = _run_sharded(store, mesh, specs, args)
    np.testing.assert_array_equal(out, _single_device(store, *args))
    assert sharding.is_equivalent_to(NamedSharding(mesh, P("pages")), 5)
    hc.assert_in_place(hlo, _local(args[2].shape, P("pages"), mesh))


def test_blocks_and_groups_on_a_2d_mesh():
    """Grouped cache: groups over one mesh axis, pages over the other."""
    mesh = _mesh((2, 2), ("tp", "pages"))
    shape = shd.grouped_kv_cache_shape(2, NUM_BLOCKS, BLOCK_SIZE, NUM_HEADS, HEAD_SIZE)
    args = _inputs(40, "HND", cache_shape=shape)
    spec = P("tp", "pages")
    specs = (P(None, "tp"), P(None, "tp"), spec, P(), P(), P())
    out, _, hlo = _run_sharded(_grouped_store("HND"), mesh, specs, args)
    np.testing.assert_array_equal(out, _single_device(_grouped_store("HND"), *args))
    hc.assert_in_place(hlo, _local(shape, spec, mesh))


# ---------------------------------------------------------------------------------------------
# Shardings the store cannot split: gathered, and still the same bytes.


def _cache_spec(layout, **named):
    """Cache PartitionSpec with mesh axes on named cache axes (blocks, side, heads, rows, f)."""
    axes = partitioning.cache_axes(layout)
    entries = [None] * 5
    for name, mesh_axis in named.items():
        entries[axes[name]] = mesh_axis
    return P(*entries)


UNSPLITTABLE = {
    # name: (key/value spec, cache axes, slots spec)
    "tokens": (P("x"), {}, P("x")),
    "head_size": (P(None, None, "x"), {"f": "x"}, P()),
    "block_size": (P(), {"rows": "x"}, P()),
    "side": (P(), {"side": "x"}, P()),
    "slots_only": (P(), {}, P("x")),
    "heads_and_blocks_same_axis": (P(None, "x"), {"blocks": "x"}, P()),
}


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("case", sorted(UNSPLITTABLE))
def test_unsplittable_shardings_are_correct(layout, case):
    mesh = _mesh((2,), ("x",))
    kv_spec, cache_axes, slot_spec = UNSPLITTABLE[case]
    args = _inputs(50, layout)
    store = functools.partial(nv.reshape_and_cache, layout=layout)
    specs = (kv_spec, kv_spec, _cache_spec(layout, **cache_axes), slot_spec, P(), P())
    out, _, _ = _run_sharded(store, mesh, specs, args)
    np.testing.assert_array_equal(out, _single_device(store, *args))


# ---------------------------------------------------------------------------------------------
# The GSPMD partitioner (jax_use_shardy_partitioner=False).


@pytest.fixture
def gspmd():
    before = jax.config.jax_use_shardy_partitioner
    jax.config.update("jax_use_shardy_partitioner", False)
    try:
        yield
    finally:
        jax.config.update("jax_use_shardy_partitioner", before)


@pytest.mark.parametrize("case", ["grouped", "blocks", "plain_heads", "tokens"])
def test_gspmd_partitioner(gspmd, case):
    mesh = _mesh((2,), ("x",))
    layout = "NHD"
    if case == "grouped":
        shape = shd.grouped_kv_cache_shape(2, NUM_BLOCKS, BLOCK_SIZE, NUM_HEADS, HEAD_SIZE,
                                           layout)
        args = _inputs(60, layout, cache_shape=shape)
        store = _grouped_store(layout)
        specs = (P(None, "x"), P(None, "x"), P("x"), P(), P(), P())
    else:
        args = _inputs(61, layout)
        store = functools.partial(nv.reshape_and_cache, layout=layout)
        kv, cache = {"blocks": (P(), _cache_spec(layout, blocks="x")),
                     "plain_heads": (P(None, "x"), _cache_spec(layout, heads="x")),
                     "tokens": (P("x"), P())}[case]
        specs = (kv, kv, cache, P("x") if case == "tokens" else P(), P(), P())
    out, _, hlo = _run_sharded(store, mesh, specs, args)
    np.testing.assert_array_equal(out, _single_device(store, *args))
    if case in ("grouped", "blocks"):
        hc.assert_in_place(hlo, _local(args[2].shape, specs[2], mesh))


# ---------------------------------------------------------------------------------------------
# With vmap, scan and shard_map.


@pytest.mark.parametrize("count", (2, 4))
def test_vmap_over_layers_sharded_along_layers(count):
    """Stacked layers [L, ...] sharded along L (per-layer slots and scales): in place, split."""
    mesh = _mesh((count,), ("layers",))
    layers, layout = 4, "HND"
    per = [_inputs(100 * count + l, layout) for l in range(layers)]
    stacked = [np.stack([p[i] for p in per]) for i in range(6)]
    store = jax.vmap(functools.partial(nv.reshape_and_cache, layout=layout))
    spec = P("layers")
    out, _, hlo = _run_sharded(store, mesh, (spec,) * 6, stacked)
    single = functools.partial(nv.reshape_and_cache, layout=layout)
    for l in range(layers):
        np.testing.assert_array_equal(out[l], _single_device(single, *[s[l] for s in stacked]))
    hc.assert_in_place(hlo, _local(stacked[2].shape, spec, mesh))


def test_scan_over_layers_grouped_page_pool():
    """Tensor-parallel decode loop: lax.scan over layers, the grouped cache holding every
    layer's pages (layer_slots), sharded along groups: no collective, no copy."""
    mesh = _mesh((2,), ("tp",))
    layers, groups, layout = 3, 2, "HND"
    shape = shd.grouped_kv_cache_shape(groups, layers * NUM_BLOCKS, BLOCK_SIZE, NUM_HEADS,
                                       HEAD_SIZE, layout)
    per = [_inputs(200 + l, layout) for l in range(layers)]
    key, value = np.stack([p[0] for p in per]), np.stack([p[1] for p in per])
    slots = np.stack([p[3] for p in per])
    cache = np.random.default_rng(7).integers(0, 256, shape, dtype=np.uint8)
    ks, vs = per[0][4], per[0][5]

    def step(key, value, cache, slots, ks, vs):
        def body(pool, x):
            layer, k, v, s = x
            s = shd.layer_slots(s, layer, NUM_BLOCKS, BLOCK_SIZE)
            return shd.reshape_and_cache_grouped(k, v, pool, s, ks, vs, layout=layout), None
        return jax.lax.scan(body, cache, (jnp.arange(layers), key, value, slots))[0]

    specs = (P(None, None, "tp"), P(None, None, "tp"), P("tp"), P(), P(), P())
    out, _, hlo = _run_sharded(step, mesh, specs, (key, value, cache, slots, ks, vs))
    np.testing.assert_array_equal(out, _single_device(step, key, value, cache, slots, ks, vs))
    hc.assert_in_place(hlo, _local(shape, P("tp"), mesh))


def test_shard_map_stores_per_device():
    """Inside shard_map the store is the bare per-device call: a plain cache whose head axis is
    split by shard_map holds one independent cache per device (group d of the grouped cache),
    NOT the single-device bytes of that array."""
    mesh = _mesh((2,), ("tp",))
    layout = "HND"
    args = _inputs(80, layout)
    spec = _cache_spec(layout, heads="tp")
    fn = jax.shard_map(functools.partial(nv.reshape_and_cache, layout=layout), mesh=mesh,
                       in_specs=(P(None, "tp"), P(None, "tp"), spec, P(), P(), P()),
                       out_specs=spec)
    specs = (P(None, "tp"), P(None, "tp"), spec, P(), P(), P())
    out, _, hlo = _run_sharded(fn, mesh, specs, args)
    hc.assert_in_place(hlo, _local(args[2].shape, spec, mesh))
    key, value, cache, slots, ks, vs = args
    per = NUM_HEADS // 2
    grouped = np.stack([cache[:, :, d * per:(d + 1) * per] for d in range(2)])
    expected = _single_device(_grouped_store(layout), key, value, grouped, slots, ks, vs)
    for d in range(2):
        np.testing.assert_array_equal(out[:, :, d * per:(d + 1) * per], expected[d])


def test_explicit_mesh_axes():
    """Sharding in types (AxisType.Explicit): the grouped store keeps the cache's sharding."""
    mesh = jax.make_mesh((2,), ("tp",), axis_types=(jax.sharding.AxisType.Explicit,),
                         devices=_mesh((2,), ("tp",)).devices.ravel())
    shape = shd.grouped_kv_cache_shape(2, NUM_BLOCKS, BLOCK_SIZE, NUM_HEADS, HEAD_SIZE)
    args = _inputs(90, "HND", cache_shape=shape)
    with jax.set_mesh(mesh):
        specs = (P(None, "tp"), P(None, "tp"), P("tp"), P(), P(), P())
        out, sharding, hlo = _run_sharded(_grouped_store("HND"), mesh, specs, args)
    np.testing.assert_array_equal(out, _single_device(_grouped_store("HND"), *args))
    assert sharding.spec[0] == "tp"
    hc.assert_in_place(hlo, _local(shape, P("tp"), mesh))


def test_eager_sharded_call():
    """Outside jit (no donation: the cache is copied, then stored per shard)."""
    mesh = _mesh((2,), ("tp",))
    shape = shd.grouped_kv_cache_shape(2, NUM_BLOCKS, BLOCK_SIZE, NUM_HEADS, HEAD_SIZE)
    key, value, cache, slots, ks, vs = _inputs(95, "HND", cache_shape=shape)
    kv = NamedSharding(mesh, P(None, "tp"))
    out = shd.reshape_and_cache_grouped(jax.device_put(key, kv), jax.device_put(value, kv),
                                        jax.device_put(cache, NamedSharding(mesh, P("tp"))),
                                        slots, ks, vs)
    np.testing.assert_array_equal(np.asarray(out), _single_device(_grouped_store("HND"), key,
                                                                  value, cache, slots, ks, vs))
    assert out.sharding.spec[0] == "tp"


def test_layer_slots():
    slots = jnp.asarray([0, 5, -1, 127, 128, 300, -7], jnp.int32)
    np.testing.assert_array_equal(np.asarray(shd.layer_slots(slots, 2, 8, 16)),
                                  [256, 261, -1, 383, -1, -1, -1])


def test_grouped_errors():
    key = jnp.zeros((4, 6, 64), jnp.bfloat16)
    cache = jnp.zeros(shd.grouped_kv_cache_shape(2, 2, 4, 6, 64), jnp.uint8)
    with pytest.raises(ValueError, match="num_groups must divide"):
        shd.grouped_kv_cache_shape(4, 2, 4, 6, 64)
    with pytest.raises(ValueError, match="grouped cache"):
        shd.reshape_and_cache_grouped(key, key, cache[0], jnp.zeros(4, jnp.int32), 1.0, 1.0)
    with pytest.raises(ValueError, match="multiple of the cache's 2 groups"):
        shd.reshape_and_cache_grouped(key[:, :5], key[:, :5], cache, jnp.zeros(4, jnp.int32),
                                      1.0, 1.0)
