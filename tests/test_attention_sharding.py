"""Head-sharded (tensor-parallel) paged decode attention: ``sharding.paged_attention_grouped``
over the head-grouped NVFP4 cache, and ``paged_attention`` over a plain cache sharded along
heads.

* On one device the grouped reader equals ``paged_attention`` over a plain cache holding the
  same K/V (both filled by the stores from the same random K/V; different random junk
  elsewhere), for G = 1, 2, 4, 8, both layouts, GQA 1 and 4, ragged seq_lens.
* Under ``jit`` on a mesh of 2/4/8 devices (GPUs where there are some, else the 8 virtual CPU
  devices of conftest.py; larger counts are skipped), grouped cache sharded along groups and q
  along heads: same output as one device, and the compiled HLO holds no collective and no copy
  of the cache (each device gathers only its own groups' pages). Likewise a whole decode step,
  store of the new token then attention, in one jit with the cache donated: the store is one
  custom call on the per-device cache, aliased, and the cache comes back in place.
* A plain NVFP4 cache sharded along its head axis is still read correctly; XLA then
  communicates (see ``test_plain_cache_head_sharded``): a page interleaves all heads' data and
  scales (docs/format.md §4), so a head shard does not hold whole heads.

Grouped and plain single-device outputs are asserted bit-identical (they are on jax 0.10.2 CPU,
where these tests read them: same K/V, same per-head arithmetic). Sharded outputs are compared
with the single-device ones on the mesh's first device: on CPU devices at ``rtol = 1e-6``,
``atol = 1e-6 * max|ref|``, as they differ by float32 rounding only (measured <= 4.8e-7
absolute, 1.4e-7 of max|out|, and exact with 2 devices; the per-device dots have other shapes);
on GPUs, where both run the CUDA kernel with split-KV plans that depend on the per-device
shapes, at the kernel's ``4e-3 * max|ref|``.
"""

from __future__ import annotations

import collections
import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_nvfp4 as nv
from jax_nvfp4 import sharding as shd

import hlo_checks as hc
from attention_cases import assert_sharded_close, grouped_decode_step
from meshes import make_mesh

NUM_KV_HEADS, HEAD_SIZE, BLOCK_SIZE = 8, 128, 16
#: ragged: one token, block_size - 1, block_size, several pages
LENS = (1, BLOCK_SIZE - 1, BLOCK_SIZE, 3 * BLOCK_SIZE + 5, 2 * BLOCK_SIZE + 1)
LAYOUTS = ("HND", "NHD")


def _mesh(count):
    return make_mesh((count,), ("tp",))


# ---------------------------------------------------------------------------------------------
# Data.


class Case:
    """Random page assignment for ragged sequences, fresh random K/V (bf16) for every position,
    the query, and random junk bytes in every cache before the store (unowned pages and rows
    past seq_len keep it: the reader must mask them)."""

    def __init__(self, seed, ratio=1, lens=LENS, q_dtype=jnp.float32):
        rng = np.random.default_rng(seed)
        self.rng, self.lens = rng, np.asarray(lens, np.int32)
        need = [math.ceil(n / BLOCK_SIZE) for n in lens]
        self.num_blocks = sum(need) + 5               # spare pages too
        max_blocks = max(need) + 1                    # a padding column everywhere
        perm = rng.permutation(self.num_blocks)
        tables = rng.integers(-3, 2 * self.num_blocks, (len(lens), max_blocks)).astype(np.int32)
        start = 0
        for b, n in enumerate(need):                  # padding entries: anything
            tables[b, :n] = perm[start:start + n]
            start += n
        self.tables = tables
        self.slots = np.concatenate([tables[b, np.arange(n) // BLOCK_SIZE] * BLOCK_SIZE
                                     + np.arange(n) % BLOCK_SIZE
                                     for b, n in enumerate(lens)]).astype(np.int32)
        shape = (len(self.slots), NUM_KV_HEADS, HEAD_SIZE)
        key = rng.standard_normal(shape) * 1.5
        key[:, :, :4] += 3.0 * rng.standard_normal((len(self.slots), NUM_KV_HEADS, 1))
        self.key = np.asarray(key, jnp.bfloat16)
        self.value = np.asarray(rng.standard_normal(shape), jnp.bfloat16)
        self.k_scale = np.float32(np.abs(self.key.astype(np.float32)).max() / 448)
        self.v_scale = np.float32(np.abs(self.value.astype(np.float32)).max() / 448)
        self.q = np.asarray(rng.standard_normal((len(lens), NUM_KV_HEADS * ratio, HEAD_SIZE)),
                            q_dtype)

    def junk(self, shape):
        return self.rng.integers(0, 256, shape, dtype=np.uint8)

    def plain_cache(self, layout):
        cache = self.junk(nv.kv_cache_shape(self.num_blocks, BLOCK_SIZE, NUM_KV_HEADS,
                                            HEAD_SIZE, layout))
        return np.asarray(_jit(nv.reshape_and_cache, layout)(
            self.key, self.value, cache, self.slots, self.k_scale, self.v_scale))

    def grouped_shape(self, groups, layout):
        return shd.grouped_kv_cache_shape(groups, self.num_blocks, BLOCK_SIZE, NUM_KV_HEADS,
                                          HEAD_SIZE, layout)

    def grouped_cache(self, groups, layout):
        cache = self.junk(self.grouped_shape(groups, layout))
        return np.asarray(_jit(shd.reshape_and_cache_grouped, layout)(
            self.key, self.value, cache, self.slots, self.k_scale, self.v_scale))

    def attention_args(self, cache):
        return (self.q, cache, self.tables, self.lens, self.k_scale, self.v_scale)


@functools.lru_cache(maxsize=None)
def _jit(fn, layout, donate=()):
    return jax.jit(functools.partial(fn, layout=layout), donate_argnums=donate)


def _on_device0(fn, mesh, *args):
    """fn on the mesh's first device alone (the same platform as the sharded run)."""
    out = jax.jit(fn)(*jax.device_put(args, mesh.devices.flat[0]))
    return jax.tree.map(np.asarray, out)


# ---------------------------------------------------------------------------------------------
# Reading the compiled HLO (tests/hlo_checks.py).
#
# The reader's page gather produces uint8 arrays too (of rank >= 5), of ``batch * max_blocks``
# pages: a copy of the cache is an op other than in place writing as many bytes as a cache
# (global or per device), and the cases keep ``batch * max_blocks`` different from
# ``num_blocks`` so a gather is never mistaken for a copy.


def _local(shape, spec, mesh):
    return NamedSharding(mesh, spec).shard_shape(tuple(shape))


# ---------------------------------------------------------------------------------------------
# One device: grouped == plain.


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("ratio", [1, 4])
@pytest.mark.parametrize("groups", [1, 2, 4, 8])
def test_grouped_equals_plain(groups, ratio, layout):
    case = Case(seed=100 * groups + 10 * ratio + (layout == "NHD"), ratio=ratio)
    ref = _jit(nv.paged_attention, layout)(*case.attention_args(case.plain_cache(layout)))
    out = _jit(shd.paged_attention_grouped, layout)(
        *case.attention_args(case.grouped_cache(groups, layout)))
    assert out.shape == case.q.shape and out.dtype == case.q.dtype
    # Same K/V, same per-head arithmetic: bit-identical on jax 0.10.2 CPU (all 16 cases).
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))
    assert np.isfinite(np.asarray(ref)).all() and np.abs(np.asarray(ref)).max() > 0


def test_grouped_equals_plain_bf16_q_and_sm_scale():
    case = Case(seed=7, ratio=2, q_dtype=jnp.bfloat16)
    kw = dict(layout="NHD", sm_scale=0.05)
    ref = jax.jit(functools.partial(nv.paged_attention, **kw))(
        *case.attention_args(case.plain_cache("NHD")))
    out = jax.jit(functools.partial(shd.paged_attention_grouped, **kw))(
        *case.attention_args(case.grouped_cache(4, "NHD")))
    assert out.dtype == jnp.bfloat16
    np.testing.assert_array_equal(np.asarray(out, np.float32), np.asarray(ref, np.float32))


# ---------------------------------------------------------------------------------------------
# Sharded along groups: no collective, no copy.

# (devices, groups): one group per device, and several groups per device.
MESHES = [(2, 2), (4, 4), (8, 8), (2, 8)]
ATTENTION_SPECS = (P(None, "tp"), P("tp"), P(), P(), P(), P())


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("count,groups", MESHES)
def test_grouped_sharded_no_collectives(count, groups, layout):
    mesh = _mesh(count)
    case = Case(seed=200 + 10 * count + groups + (layout == "NHD"), ratio=4)
    cache = case.grouped_cache(groups, layout)
    args = case.attention_args(cache)
    assert len(case.lens) * case.tables.shape[1] != case.num_blocks   # see hlo_checks above
    fn = functools.partial(shd.paged_attention_grouped, layout=layout)
    placed = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, ATTENTION_SPECS)]
    f = jax.jit(fn)
    hlo = f.lower(*placed).compile().as_text()
    out = f(*placed)
    assert_sharded_close(out, _on_device0(fn, mesh, *args), mesh)
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "tp")), 3)
    local = _local(cache.shape, P("tp"), mesh)
    assert hc.collectives(hlo) == [], hc.collectives(hlo)
    copies = hc.cache_copies(hlo, [cache.shape, local])
    assert copies == [], copies
    # Each device reads its own groups' cache, a parameter of the per-device shape.
    assert any(i.opcode == "parameter" and i.u8_arrays == [local]
               for i in hc.instructions(hlo)), local


# The new token of every sequence is its last position (seq_lens count it).
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("count,groups", [(2, 2), (4, 4), (8, 8)])
def test_decode_step_in_place(count, groups, layout):
    """Store the new token's K/V into the donated, group-sharded cache, then attend, in one
    jit: no collective, no copy, the store runs once on the per-device cache and the cache is
    returned aliased to the donated argument; same output and bytes as one device."""
    mesh = _mesh(count)
    case = Case(seed=300 + count + (layout == "NHD"), ratio=4)
    last = np.cumsum(case.lens) - 1                   # each sequence's new token
    history = np.ones(len(case.slots), bool)
    history[last] = False
    cache = case.junk(case.grouped_shape(groups, layout))
    cache = np.asarray(_jit(shd.reshape_and_cache_grouped, layout)(
        case.key[history], case.value[history], cache, case.slots[history], case.k_scale,
        case.v_scale))

    step = grouped_decode_step(layout)
    args = (case.q, case.key[last], case.value[last], cache, case.slots[last], case.tables,
            case.lens, case.k_scale, case.v_scale)
    specs = (P(None, "tp"), P(None, "tp"), P(None, "tp"), P("tp")) + (P(),) * 5
    f = jax.jit(step, donate_argnums=(3,))

    def placed():
        return [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs)]

    hlo = f.lower(*placed()).compile().as_text()
    out, new_cache = f(*placed())
    ref_out, ref_cache = _on_device0(step, mesh, *args)
    np.testing.assert_array_equal(np.asarray(new_cache), ref_cache)
    assert_sharded_close(out, ref_out, mesh)
    # The step's output is the attention over the full K/V (history + new token).
    full = _on_device0(functools.partial(shd.paged_attention_grouped, layout=layout), mesh,
                       *case.attention_args(case.grouped_cache(groups, layout)))
    assert_sharded_close(out, full, mesh)
    assert new_cache.sharding.is_equivalent_to(NamedSharding(mesh, P("tp")), 6)

    # One aliased store on the per-device cache; output 1 (the cache) is the donated
    # argument 3.
    local = _local(cache.shape, P("tp"), mesh)
    hc.assert_in_place(hlo, local, aliases={(1,): 3}, cache_shapes=[cache.shape, local])


# ---------------------------------------------------------------------------------------------
# The plain cache sharded along heads.


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("count", [2, 4, 8])
def test_plain_cache_head_sharded(count, layout):
    """paged_attention on a plain cache whose head axis is sharded (q along heads too) is
    correct, but not communication-free. What XLA (jax 0.10.2, CPU, Shardy) does, measured:

    * HND: each device gathers the sequences' pages from its slice of the cache, then the
      gathered pages are all-gathered, K and V sides (2 all-gathers of u8
      ``[batch, max_blocks, side_bytes]``), with 2 all-gathers of s32 gather indices and 1
      all-reduce of the gathered scale bytes: 4 all-gathers + 1 all-reduce, traffic
      O(batch * max_blocks * page), not O(cache).
    * NHD: 1 all-gather of the whole cache, then a replicated read.

    The output stays sharded along heads. Tensor parallelism should use the grouped cache.
    """
    mesh = _mesh(count)
    case = Case(seed=400 + count + (layout == "NHD"), ratio=4)
    cache = case.plain_cache(layout)
    args = case.attention_args(cache)
    head_axis = 2 if layout == "HND" else 3
    cache_spec = P(*[("tp" if i == head_axis else None) for i in range(5)])
    specs = (P(None, "tp"), cache_spec, P(), P(), P(), P())
    fn = functools.partial(nv.paged_attention, layout=layout)
    placed = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs)]
    f = jax.jit(fn)
    hlo = f.lower(*placed).compile().as_text()
    out = f(*placed)
    assert_sharded_close(out, _on_device0(fn, mesh, *args), mesh)
    # Documented above, not asserted: XLA is free to choose how it communicates.
    print(f"{layout} x{count}: {dict(collections.Counter(hc.collectives(hlo)))}")


# ---------------------------------------------------------------------------------------------
# Argument checks.


def test_grouped_errors():
    case = Case(seed=9, ratio=2, lens=(3, 17))
    cache = case.grouped_cache(2, "HND")
    q, tables, lens, ks, vs = case.q, case.tables, case.lens, case.k_scale, case.v_scale
    attend = shd.paged_attention_grouped
    with pytest.raises(ValueError, match="kv_cache must be a grouped cache"):
        attend(q, cache[0], tables, lens, ks, vs)
    with pytest.raises(TypeError, match="kv_cache.* must be uint8"):
        attend(q, cache.astype(np.int8), tables, lens, ks, vs)
    with pytest.raises(ValueError, match="q must have shape"):
        attend(q[0], cache, tables, lens, ks, vs)
    with pytest.raises(TypeError, match="q must be bfloat16"):
        attend(q.astype(np.int32), cache, tables, lens, ks, vs)
    with pytest.raises(ValueError, match="q num_q_heads 12 must be a multiple of kv_cache's "
                                         "num_kv_heads 8"):
        attend(q[:, :12], cache, tables, lens, ks, vs)
    with pytest.raises(ValueError, match="q head_size 64 does not match kv_cache head_size 128"):
        attend(q[..., :64], cache, tables, lens, ks, vs)
    with pytest.raises(ValueError, match="block_tables must have shape"):
        attend(q, cache, tables[:1], lens, ks, vs)
    with pytest.raises(TypeError, match="seq_lens must be an integer array"):
        attend(q, cache, tables, lens.astype(np.float32), ks, vs)
    with pytest.raises(ValueError, match="k_scale must be a float32 scalar"):
        attend(q, cache, tables, lens, np.ones(2, np.float32), vs)
    with pytest.raises(TypeError, match="v_scale_swizzle must be a bool"):
        attend(q, cache, tables, lens, ks, vs, v_scale_swizzle=1)
    with pytest.raises(ValueError, match="layout"):
        attend(q, cache, tables, lens, ks, vs, layout="XYZ")
