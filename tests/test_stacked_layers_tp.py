"""Stacked layers x tensor parallelism on 8 CPU devices (or GPUs where there are enough): the
store and the readers over ``[L, G, ...]`` and ``[G, L, ...]`` caches (L layers, G head groups)
whichever leading axis is sharded, under Shardy and GSPMD, and the documented multi-layer
decode step (README, "Many layers"): a Python loop over per-layer grouped caches, and
``lax.scan`` over a grouped page pool.

Every case checks the compiled HLO (tests/hlo_checks.py): no collective at all, no op but the
store writing a cache-sized uint8 array (global or per device), every store aliased to its
cache operand and the donated caches aliased to the results; and the bytes: the cache equals a
single-device run exactly. The attention outputs (float32 queries) are compared with
``attention_cases.assert_sharded_close``: on CPU devices within float32 rounding (``rtol = atol /
max|ref| = 1e-6``; the per-device dots have other shapes), on GPUs at the kernel's bound (its
split-KV plans depend on the per-device shapes). Within one device, a layer of the vmapped step and the
single-layer step give the same bits.

Before the store took several stacked axes (main at d6a98f4) ``vmap`` over 2 layers of the
grouped step with a ``[L, G]`` cache sharded ``P(None, "tp")`` all-gathered the cache (4
all-gathers), lost the input/output alias and returned the cache replicated; with ``P("l",
"tp")`` it copied the cache in and out (3 cache-sized copies).
"""

from __future__ import annotations


import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_nvfp4 as nv
from jax_nvfp4 import attention_primitive as ap
from jax_nvfp4 import sharding as shd

import hlo_checks as hc
from attention_cases import assert_sharded_close, grouped_decode_step
from meshes import make_mesh

LAYERS, GROUPS, NUM_KV_HEADS, RATIO, HEAD_SIZE, BLOCK_SIZE = 2, 4, 8, 4, 128, 16
NUM_BLOCKS = 16                      # per layer; batch * max_blocks (12) differs: see hlo_checks
LENS = np.array([1, 17, 33, 40], np.int32)
MAX_BLOCKS = 3


class Data:
    """One decode step of L layers: per-layer K/V of every position (the history stored
    before the step, each sequence's last position stored by the step) and per-layer queries;
    pages, slots and block tables shared by the layers (as a model's are)."""

    def __init__(self, seed, layout="HND", groups=GROUPS):
        rng = np.random.default_rng(seed)
        self.layout = layout
        pages = rng.permutation(NUM_BLOCKS)[:len(LENS) * MAX_BLOCKS].reshape(len(LENS), -1)
        self.tables = pages.astype(np.int32)
        slots = [self.tables[b, np.arange(n) // BLOCK_SIZE] * BLOCK_SIZE
                 + np.arange(n) % BLOCK_SIZE for b, n in enumerate(LENS)]
        self.slots = np.concatenate(slots).astype(np.int32)
        tokens = len(self.slots)
        shape = (LAYERS, tokens, NUM_KV_HEADS, HEAD_SIZE)
        self.key = (rng.standard_normal(shape) * 1.5).astype(jnp.bfloat16)
        self.value = rng.standard_normal(shape).astype(jnp.bfloat16)
        self.q = rng.standard_normal((LAYERS, len(LENS), NUM_KV_HEADS * RATIO, HEAD_SIZE)
                                     ).astype(np.float32)
        self.k_scale = np.float32(np.abs(self.key.astype(np.float32)).max() / 448)
        self.v_scale = np.float32(np.abs(self.value.astype(np.float32)).max() / 448)
        self.last = np.cumsum(LENS) - 1
        self.history = np.setdiff1d(np.arange(tokens), self.last)
        self.group_shape = shd.grouped_kv_cache_shape(groups, NUM_BLOCKS, BLOCK_SIZE,
                                                      NUM_KV_HEADS, HEAD_SIZE, layout)
        self.rng = rng

    def stacked_cache(self, order, every_position=False):
        """[L, G, ...] ("LG") or [G, L, ...] ("GL"): random junk, then the history stored
        (or every position)."""
        junk = self.rng.integers(0, 256, (LAYERS,) + self.group_shape, dtype=np.uint8)
        h = np.arange(len(self.slots)) if every_position else self.history
        cache = jax.jit(jax.vmap(self._store, in_axes=(0, 0, 0, None)))(
            self.key[:, h], self.value[:, h], junk, self.slots[h])
        cache = np.asarray(cache)
        return cache if order == "LG" else np.ascontiguousarray(np.swapaxes(cache, 0, 1))

    def _store(self, key, value, cache, slots):
        return shd.reshape_and_cache_grouped(key, value, cache, slots, self.k_scale,
                                             self.v_scale, layout=self.layout)

    def step_inputs(self):
        """q, key, value [L, batch, H, D] of the new tokens; slots [batch]."""
        last = self.last
        return self.q, self.key[:, last], self.value[:, last], self.slots[last]


def _compile_and_run(fn, mesh, args, specs, donate):
    def put(x, spec):                       # a tuple of arrays (caches) gets a tuple of specs
        if isinstance(x, tuple):
            return tuple(put(a, s) for a, s in zip(x, spec))
        return jax.device_put(x, NamedSharding(mesh, spec))

    def placed():
        return [put(a, s) for a, s in zip(args, specs)]

    f = jax.jit(fn, donate_argnums=donate)
    hlo = f.lower(*placed()).compile().as_text()
    return hlo, f(*placed())


def _single_device(fn, mesh, args):
    out = jax.jit(fn)(*jax.device_put(args, mesh.devices.flat[0]))
    return jax.tree.map(np.asarray, out)


# ---------------------------------------------------------------------------------------------
# vmap over the layers of a stacked [L, G] or [G, L] cache.

# Which leading axes are sharded: mesh shape and names, the mesh axis of the layers and groups.
SHARDINGS = {
    "groups": ((GROUPS,), ("tp",), None, "tp"),
    "layers": ((LAYERS,), ("l",), "l", None),
    "both": ((LAYERS, GROUPS), ("l", "tp"), "l", "tp"),
}


# Each cache order with one layout (both layouts are covered by the single-layer tests).
@pytest.mark.parametrize("order,layout", [("LG", "HND"), ("GL", "NHD")])
@pytest.mark.parametrize("sharded", sorted(SHARDINGS))
def test_vmap_over_layers_in_place(partitioner, sharded, order, layout):
    """jax.vmap over the layers of the grouped decode step (store + attention): one store on
    the per-device [L, G] (or [G, L]) cache, aliased, no collective, no copy; cache bytes
    and outputs equal one device's."""
    mesh_shape, names, layer_axis, group_axis = SHARDINGS[sharded]
    mesh = make_mesh(mesh_shape, names)
    data = Data(seed=len(sharded) + 10 * (order == "GL") + 100 * (layout == "NHD"),
                layout=layout)
    cache = data.stacked_cache(order)
    q, key, value, slots = data.step_inputs()
    cache_axis = 0 if order == "LG" else 1         # the layers' axis of the cache
    step = jax.vmap(grouped_decode_step(layout), in_axes=(0, 0, 0, cache_axis) + (None,) * 5,
                    out_axes=(0, cache_axis))
    args = (q, key, value, cache, slots, data.tables, LENS, data.k_scale, data.v_scale)
    heads = P(layer_axis, None, group_axis)            # q, key, value: [L, batch, heads, D]
    cache_spec = P(layer_axis, group_axis) if order == "LG" else P(group_axis, layer_axis)
    specs = (heads, heads, heads, cache_spec) + (P(),) * 5
    hlo, (out, new_cache) = _compile_and_run(step, mesh, args, specs, donate=(3,))

    local = NamedSharding(mesh, cache_spec).shard_shape(cache.shape)
    hc.assert_in_place(hlo, local, aliases={(1,): 3}, cache_shapes=[cache.shape, local])
    assert new_cache.sharding.is_equivalent_to(NamedSharding(mesh, cache_spec), cache.ndim)
    ref_out, ref_cache = _single_device(step, mesh, args)
    np.testing.assert_array_equal(np.asarray(new_cache), ref_cache)
    assert_sharded_close(out, ref_out, mesh)
    # And each layer is the single-layer step on its own cache.
    for l in range(LAYERS):
        layer = (lambda x: x[l]) if order == "LG" else (lambda x: x[:, l])
        one_out, one_cache = _single_device(grouped_decode_step(layout), mesh,
                                            (q[l], key[l], value[l], layer(cache)) + args[4:])
        np.testing.assert_array_equal(layer(ref_cache), one_cache)
        np.testing.assert_array_equal(ref_out[l], one_out)


def test_nested_vmap_ragged_reader_stacked_cache():
    """vmap(vmap(ragged_paged_attention)) over an [L, G] cache sharded along G: one primitive
    with two stacked axes, no collective and no copy of the cache; equal to a loop."""
    mesh = make_mesh((GROUPS,), ("tp",))
    data = Data(seed=7)
    cache = data.stacked_cache("LG", every_position=True)
    # Up to two query tokens per sequence: its last positions.
    cu = np.concatenate([[0], np.cumsum(np.minimum(LENS, 2))]).astype(np.int32)
    tokens = int(cu[-1])
    q = data.rng.standard_normal((LAYERS, GROUPS, tokens, NUM_KV_HEADS * RATIO // GROUPS,
                                  HEAD_SIZE)).astype(np.float32)
    num_seqs = np.int32(len(LENS))

    def attend(q, cache):
        return nv.ragged_paged_attention(q, cache, data.tables, LENS, cu, num_seqs,
                                         data.k_scale, data.v_scale)

    fn = jax.vmap(jax.vmap(attend))
    jaxpr = jax.make_jaxpr(fn)(q, cache)
    calls = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "nvfp4_ragged_paged_attention"]
    assert len(calls) == 1 and calls[0].invars[1].aval.shape[:2] == (LAYERS, GROUPS), calls
    specs = (P(None, "tp"), P(None, "tp"))
    hlo, out = _compile_and_run(fn, mesh, (q, cache), specs, donate=())
    local = NamedSharding(mesh, P(None, "tp")).shard_shape(cache.shape)
    assert hc.collectives(hlo) == []
    assert hc.cache_copies(hlo, [cache.shape, local]) == []
    for l in range(LAYERS):
        for g in range(GROUPS):
            one = _single_device(attend, mesh, (q[l, g], cache[l, g]))
            assert_sharded_close(np.asarray(out)[l, g], one, mesh)


def test_one_stacked_axis_for_the_kernel():
    """What the CUDA lowering does per device (the kernel takes one stacked axis): several
    stacked axes flattened, operands shared along some of them broadcast, results unflattened
    give the same bits as the canonical form read member by member (checked here with the
    jnp path standing in for the kernel)."""
    data = Data(seed=11)
    cache = data.stacked_cache("LG")                      # [L, G, ...]
    q = data.q.reshape(LAYERS, len(LENS), GROUPS, -1, HEAD_SIZE).swapaxes(1, 2)
    tables = np.broadcast_to(data.tables, (LAYERS, 1) + data.tables.shape)   # per layer only
    lens = np.broadcast_to(LENS, (1, GROUPS, len(LENS)))                     # per group only
    scale = lambda s: np.full((1, 1), s, np.float32)                        # noqa: E731
    args = (q, cache, tables, lens, scale(data.k_scale), scale(data.v_scale),
            np.full((LAYERS, GROUPS), HEAD_SIZE ** -0.5, np.float32))

    def canonical(*a, layout, v_scale_swizzle):
        return ap._jnp_canonical(*a, layout=layout, v_scale_swizzle=v_scale_swizzle)

    def one_axis(*a):                                     # the kernel's contract: one axis
        assert a[0].ndim == 4 and all(x.shape[0] in (1, LAYERS * GROUPS) for x in a[:-2])
        return canonical(*a[:-2], layout=a[-2], v_scale_swizzle=a[-1])

    flat = jax.jit(lambda *a: ap.on_one_stacked_axis(one_axis)(*a, "HND", True))(*args)
    ref = jax.jit(lambda *a: canonical(*a, layout="HND", v_scale_swizzle=True))(*args)
    for got, want in zip(flat, ref):
        assert got.shape == want.shape
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))


# ---------------------------------------------------------------------------------------------
# The recipe: L layers x G head groups, groups on the tensor-parallel axis, one layer after
# the other (README, "Many layers").


def _pool_step(layout):
    """lax.scan over layers; the carry is the grouped page pool [G, L * num_blocks, ...]."""
    layer_step = grouped_decode_step(layout)

    def step(q, key, value, pool, slots, tables, lens, k_scale, v_scale):
        def body(pool, x):
            layer, q_l, key_l, value_l = x
            out, pool = layer_step(q_l, key_l, value_l, pool,
                                   shd.layer_slots(slots, layer, NUM_BLOCKS, BLOCK_SIZE),
                                   shd.layer_block_tables(tables, layer, NUM_BLOCKS), lens,
                                   k_scale, v_scale)
            return pool, out

        pool, out = jax.lax.scan(body, pool, (jnp.arange(LAYERS), q, key, value))
        return out, pool

    return step


def _loop_step(layout):
    """A Python loop over layers; one grouped cache per layer, all donated."""
    layer_step = grouped_decode_step(layout)

    def step(q, key, value, caches, slots, tables, lens, k_scale, v_scale):
        outs, new = [], []
        for l, cache in enumerate(caches):
            out, cache = layer_step(q[l], key[l], value[l], cache, slots, tables, lens,
                                    k_scale, v_scale)
            outs.append(out)
            new.append(cache)
        return jnp.stack(outs), tuple(new)

    return step


@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("form", ["scan_pool", "python_loop"])
def test_tensor_parallel_layers_recipe(partitioner, form, layout):
    mesh = make_mesh((GROUPS,), ("tp",))
    data = Data(seed=50 + (form == "scan_pool") + 2 * (layout == "NHD"), layout=layout)
    stacked = data.stacked_cache("LG")                    # [L, G, ...]: the expected bytes
    q, key, value, slots = data.step_inputs()
    heads = P(None, None, "tp")
    if form == "scan_pool":
        # Layer l's pages are blocks l*NUM_BLOCKS .. of each group's pool.
        caches = np.ascontiguousarray(np.swapaxes(stacked, 0, 1)).reshape(
            (GROUPS, LAYERS * NUM_BLOCKS) + data.group_shape[2:])
        cache_specs, step, num_stores = P("tp"), _pool_step(layout), 1
        aliases = {(1,): 3}
    else:
        caches = tuple(stacked)
        cache_specs, step, num_stores = (P("tp"),) * LAYERS, _loop_step(layout), LAYERS
        aliases = {(1 + l,): (3 + l, ()) for l in range(LAYERS)}
    args = (q, key, value, caches, slots, data.tables, LENS, data.k_scale, data.v_scale)
    specs = (heads, heads, heads, cache_specs) + (P(),) * 5
    hlo, (out, new_caches) = _compile_and_run(step, mesh, args, specs, donate=(3,))

    one = shd.grouped_kv_cache_shape(GROUPS, NUM_BLOCKS, BLOCK_SIZE, NUM_KV_HEADS, HEAD_SIZE,
                                     layout)
    shape = caches.shape if form == "scan_pool" else one
    local = NamedSharding(mesh, P("tp")).shard_shape(shape)
    hc.assert_in_place(hlo, local, aliases=aliases, num_stores=num_stores,
                       cache_shapes=[shape, local])
    # The same bytes and outputs as the vmapped step on one device, layer by layer.
    ref_out, ref_cache = _single_device(
        jax.vmap(grouped_decode_step(layout), in_axes=(0, 0, 0, 0) + (None,) * 5), mesh,
        (q, key, value, stacked) + args[4:])
    if form == "scan_pool":
        new = np.asarray(new_caches).reshape((GROUPS, LAYERS) + data.group_shape[1:])
        np.testing.assert_array_equal(np.swapaxes(new, 0, 1), ref_cache)
    else:
        for l in range(LAYERS):
            np.testing.assert_array_equal(np.asarray(new_caches[l]), ref_cache[l])
    assert_sharded_close(out, ref_out, mesh)


def test_layer_block_tables():
    tables = jnp.asarray([[0, 3], [7, 1]], jnp.int32)
    np.testing.assert_array_equal(np.asarray(shd.layer_block_tables(tables, 2, 8)),
                                  [[16, 19], [23, 17]])
    with pytest.raises(TypeError, match="block_tables"):
        shd.layer_block_tables(np.zeros((2, 2), np.float32), 0, 8)


def test_decode_partitioning_rules_with_two_stacked_axes():
    """The decode kernel's custom-partitioning rules (attention_primitive), read directly for
    an [L, G] cache: each stacked axis follows the cache's sharding, one shared along an axis
    is replicated there, the batch axis follows q unless its mesh axis is taken. (On the CPU
    the reader is the jnp path, which custom_partitioning cannot wrap: these rules run end to
    end around the CUDA kernel only.)"""
    mesh = make_mesh((2, 2), ("l", "tp"))
    L, G, B, M = 2, 4, 3, 5
    shapes = [(L, G, B, 8, 64), (L, G, 30, 2, 2, 16, 36), (L, 1, B, M), (1, 1, B), (1, G),
              (1, G), (1, 1)]
    text, extra = ap._sharding_rule("HND", True, mesh, [jax.ShapeDtypeStruct(x, jnp.float32)
                                                         for x in shapes], None)
    assert text == (
        "stack0 stack1 batch q_heads head_size, stack0 stack1 c_blocks c_side c_heads c_rows "
        "c_f, stack0 t_one1 batch pages, l_one0 l_one1 batch, k_one0 stack1, v_one0 stack1, "
        "s_one0 s_one1 -> stack0 stack1 batch q_heads head_size, stack0 stack1 batch q_heads")
    assert not {"stack0", "stack1", "batch"} & set(extra["need_replication_factors"])
    q_sharding = NamedSharding(mesh, P(None, None, "tp"))       # batch over "tp"
    for cache_spec, stack, batch in ((P("l", "tp"), ("l", "tp"), None),
                                     (P(None, "tp"), (None, "tp"), None),
                                     (P("l"), ("l", None), "tp")):
        operands, results = ap._plan("HND", shapes, q_sharding, NamedSharding(mesh, cache_spec))
        assert tuple(operands[0]) == stack + (batch, None, None), cache_spec
        assert tuple(operands[1]) == stack + (None,) * 5
        assert tuple(operands[2]) == (stack[0], None, batch, None)
        assert tuple(operands[4]) == (None, stack[1])
        assert [tuple(r) for r in results] == [stack + (batch, None, None), stack + (batch, None)]
    out = jax.ShapeDtypeStruct((L, G, B, 8, 64), jnp.float32,
                               sharding=NamedSharding(mesh, P("l", None, None, "tp")))
    keep = ap._propagate_user_sharding("HND", True, mesh, (out, None))   # heads not kept
    assert [tuple(s.spec) for s in keep] == [("l", None, None, None, None), ("l", None, None, None)]
