"""Shared data for the decode-attention tests (tests/test_attention.py,
tests/test_decode_kernel.py): a filled NVFP4 cache with the exact K/V of every sequence, and the
dense float64 reference attention; and the tensor-parallel decode step of one layer
(:func:`grouped_decode_step`, tests/test_attention_sharding.py, tests/test_stacked_layers_tp.py).

``Case`` fills a cache with ``jax_nvfp4.reshape_and_cache`` from fresh random K/V (bf16, with
outlier dims in K) through a random page assignment, optionally stores junk (large values, whole
NaN head vectors) in every row no sequence attends to, and reads the stored values back with
``jax_nvfp4.dequantize`` (float32, exact). The cache lives on the default device when the case is
built (tests build on the CPU and ``jax.device_put`` where needed).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

import jax_nvfp4
from jax_nvfp4 import sharding as shd
from jax_nvfp4.layout import CacheGeometry

BLOCK_SIZE = 16
#: lengths 1, block_size - 1, block_size, many blocks (and one more ragged length)
LENS = (1, BLOCK_SIZE - 1, BLOCK_SIZE, 5 * BLOCK_SIZE + 3, 40)

#: Every option of paged_attention is static here (a Python sm_scale included).
OPTIONS = ("layout", "v_scale_swizzle", "sm_scale", "return_lse", "impl")
paged_attention_jit = jax.jit(jax_nvfp4.paged_attention, static_argnames=OPTIONS)
_dequantize = jax.jit(jax_nvfp4.dequantize, static_argnames=("layout", "v_scale_swizzle", "dtype"))


@functools.lru_cache(maxsize=None)
def _grouped_store(layout, v_scale_swizzle):
    return jax.jit(functools.partial(shd.reshape_and_cache_grouped, layout=layout,
                                     v_scale_swizzle=v_scale_swizzle))


class Case:
    """A filled NVFP4 cache plus the exact (float64) K/V of every sequence.

    ``block_size``: tokens per page; ``pad_columns``: padding columns of ``tables`` past the
    longest sequence (-1); ``page_seed``: draw the page assignment from its own generator (equal
    seeds and lens give equal tables, e.g. for layers sharing block tables); ``groups``: also
    build ``self.grouped``, a head-grouped cache ``[groups, ...]`` holding the same K/V and junk.
    """

    def __init__(self, seed, lens=LENS, num_kv_heads=2, head_size=128, layout="HND",
                 v_scale_swizzle=True, extra_pages=4, junk=True, scale_div=448.0,
                 block_size=BLOCK_SIZE, pad_columns=2, page_seed=None, groups=None):
        rng = np.random.default_rng(seed)
        self.rng, self.lens, self.layout = rng, list(lens), layout
        self.num_kv_heads, self.head_size, self.swizzle = num_kv_heads, head_size, v_scale_swizzle
        self.block_size, self.groups = block_size, groups
        bs = block_size
        need = [max(math.ceil(n / bs), 0) for n in lens]
        self.num_blocks = sum(need) + extra_pages
        self.max_blocks = max(need) + pad_columns   # padding columns everywhere
        page_rng = rng if page_seed is None else np.random.default_rng(page_seed)
        perm = page_rng.permutation(self.num_blocks)  # random page assignment
        tables = np.full((len(lens), self.max_blocks), -1, np.int32)
        start = 0
        for b, n in enumerate(need):
            tables[b, :n] = perm[start:start + n]
            start += n
        self.tables = tables
        self.need = need
        self.spare_pages = perm[start:]          # pages no sequence owns
        self.slots = [tables[b, np.arange(max(n, 0)) // bs] * bs + np.arange(max(n, 0)) % bs
                      for b, n in enumerate(lens)]

        slots = np.concatenate(self.slots).astype(np.int32)
        shape = (len(slots), num_kv_heads, head_size)
        key = rng.standard_normal(shape) * 1.5
        value = rng.standard_normal(shape)
        key[:, :, :8] += 3.0 * rng.standard_normal((len(slots), num_kv_heads, 1))  # outliers
        key, value = (jnp.asarray(x, jnp.bfloat16) for x in (key, value))
        self.k_scale = jnp.max(jnp.abs(key.astype(jnp.float32))) / scale_div
        self.v_scale = jnp.max(jnp.abs(value.astype(jnp.float32))) / scale_div
        cache = jax_nvfp4.allocate_kv_cache(self.num_blocks, bs, num_kv_heads, head_size, layout)
        stores = [(key, value, slots)]
        if junk:
            stores.append(self._junk())
        for k, v, s in stores:
            cache = self._store(cache, k, v, s)
        self.cache = cache
        if groups is not None:
            grouped = jnp.zeros(shd.grouped_kv_cache_shape(groups, self.num_blocks, bs,
                                                           num_kv_heads, head_size, layout),
                                jnp.uint8)
            store = _grouped_store(layout, v_scale_swizzle)
            for k, v, s in stores:
                grouped = store(k, v, grouped, jnp.asarray(s, jnp.int32), self.k_scale,
                                self.v_scale)
            self.grouped = grouped
        k, v = _dequantize(cache, self.k_scale, self.v_scale, layout=layout,
                           v_scale_swizzle=v_scale_swizzle, dtype=jnp.float32)
        self.k_pages, self.v_pages = k, v            # [num_blocks, block_size, H, D] float32
        flat = (-1, num_kv_heads, head_size)
        k, v = np.asarray(k, np.float64).reshape(flat), np.asarray(v, np.float64).reshape(flat)
        self.k = [k[s] for s in self.slots]
        self.v = [v[s] for s in self.slots]

    @property
    def geometry(self):
        return CacheGeometry.from_shape(self.cache.shape, self.layout)

    def _store(self, cache, key, value, slots):
        return jax_nvfp4.reshape_and_cache(key, value, cache, jnp.asarray(slots, jnp.int32),
                                           self.k_scale, self.v_scale, layout=self.layout,
                                           v_scale_swizzle=self.swizzle)

    def _junk(self):
        """Rows no sequence attends to get large values and NaN: the masks must hide them.
        Returns the (key, value, slots) to store."""
        bs = self.block_size
        owned = {int(p) for row, n in zip(self.tables, self.need) for p in row[:n]}
        pages = owned | set(self.spare_pages.tolist())
        used = {int(s) for s in np.concatenate(self.slots)}
        free = [s for s in range(self.num_blocks * bs) if s not in used and s // bs in pages]
        shape = (len(free), self.num_kv_heads, self.head_size)
        key = 50.0 * self.rng.standard_normal(shape)
        value = 50.0 * self.rng.standard_normal(shape)
        key[::3] = np.nan    # whole NaN head vectors: the E4M3 scale byte becomes NaN
        value[::3] = np.nan
        key, value = (jnp.asarray(x, jnp.bfloat16) for x in (key, value))
        return key, value, np.asarray(free, np.int32)

    def query(self, num_q_heads, dtype, seed=1):
        rng = np.random.default_rng(seed)
        return jnp.asarray(rng.standard_normal((len(self.lens), num_q_heads, self.head_size)),
                           dtype)

    def reference(self, q, sm_scale=None, return_lse=False):
        return dense_reference(q, self.k, self.v, sm_scale, return_lse=return_lse)

    def args(self, q, tables=None, lens=None, cache=None):
        """The positional arguments of paged_attention (tables/lens default to the case's)."""
        tables = self.tables if tables is None else tables
        lens = self.lens if lens is None else lens
        cache = self.cache if cache is None else cache
        return (q, cache, jnp.asarray(tables, jnp.int32), jnp.asarray(lens, jnp.int32),
                self.k_scale, self.v_scale)

    @property
    def options(self):
        return dict(layout=self.layout, v_scale_swizzle=self.swizzle)

    def run(self, q, tables=None, lens=None, eager=False, **kw):
        fn = jax_nvfp4.paged_attention if eager else paged_attention_jit
        return fn(*self.args(q, tables, lens), **self.options, **kw)

    def bf16_caches(self, dtype=jnp.bfloat16):
        """Plain paged caches holding this cache's dequantised values, same pages."""
        return self.k_pages.astype(dtype), self.v_pages.astype(dtype)

    # ----------------------------------------------------------------- raw junk bytes

    def masked_rows(self):
        """(page, row) of every row past seq_len in a sequence's own last page."""
        bs = self.block_size
        return [(int(self.tables[b, n - 1]), r) for b, (n, length) in
                enumerate(zip(self.need, self.lens)) if n > 0
                for r in range(length - (n - 1) * bs, bs)]

    def poisoned(self, rows=(), pages=(), seed=0):
        """The cache (numpy) with raw bytes written over the given (page, row) rows and whole
        pages, K and V sides: random codes, and scale bytes NaN (0x7F/0xFF) or +-448
        (0x7E/0xFE, so values up to 6 * 448 * scale). E2M1/E4M3 have no infinity; NaN scales
        and the largest finite values are the worst a page can hold."""
        rng = np.random.default_rng(seed)
        geo = self.geometry
        cache = np.array(self.cache)
        view = cache.reshape(geo.num_blocks, 2, geo.side_bytes)
        specials = np.array([0x7F, 0xFF, 0x7E, 0xFE], np.uint8)
        for side in (0, 1):
            data = geo.data_offsets()                                    # [H, T, D/2]
            scales = geo.scale_offsets(side == 1, self.swizzle)          # [H, T, D/16]
            for page, row in rows:
                view[page, side, data[:, row]] = rng.integers(0, 256, data[:, row].shape)
                view[page, side, scales[:, row]] = rng.choice(specials, scales[:, row].shape)
            for page in pages:
                view[page, side, :] = rng.integers(0, 256, geo.side_bytes)
                view[page, side, scales] = rng.choice(specials, scales.shape)
        return cache


def dense_reference(q, ks, vs, sm_scale=None, return_lse=False):
    """float64 softmax attention, one sequence and query head at a time (and, with
    ``return_lse``, the natural-log logsumexp of the scaled scores, -inf for no position)."""
    q = np.asarray(jnp.asarray(q, jnp.float32), np.float64)
    batch, num_q_heads, head_size = q.shape
    sm_scale = 1.0 / math.sqrt(head_size) if sm_scale is None else sm_scale
    out = np.zeros_like(q)
    lse = np.full((batch, num_q_heads), -np.inf)
    for b in range(batch):
        k, v = ks[b], vs[b]
        if len(k) == 0:
            continue
        group = num_q_heads // k.shape[1]
        for i in range(num_q_heads):
            h = i // group
            s = (k[:, h] @ q[b, i]) * sm_scale
            p = np.exp(s - s.max())
            out[b, i] = (p @ v[:, h]) / p.sum()
            lse[b, i] = s.max() + np.log(p.sum())
    return (out, lse) if return_lse else out


def grouped_decode_step(layout):
    """One layer's tensor-parallel decode step: store the new tokens' K/V into the head-grouped
    cache, then attend over it. ``step(q, key, value, cache, slots, tables, lens, k_scale,
    v_scale) -> (out, cache)``."""

    def step(q, key, value, cache, slots, tables, lens, k_scale, v_scale):
        cache = shd.reshape_and_cache_grouped(key, value, cache, slots, k_scale, v_scale,
                                              layout=layout)
        out = shd.paged_attention_grouped(q, cache, tables, lens, k_scale, v_scale,
                                          layout=layout)
        return out, cache

    return step


#: Sharded against single-device decode outputs: on CPU devices (the jnp path) they differ by
#: float32 rounding (the per-device dots have other shapes), relative to max|ref|; on GPUs both
#: run the CUDA kernel, whose split-KV plan depends on the per-device shapes: they then differ
#: at the kernel's fp16 level (the bound of tests/test_decode_kernel.py).
SHARDED_RTOL = 1e-6
SHARDED_KERNEL_ATOL = 4e-3


def assert_sharded_close(out, ref, mesh):
    """A sharded run's attention output ``out`` against the single-device ``ref`` on the same
    platform as ``mesh`` (see SHARDED_RTOL)."""
    out, ref = np.asarray(out, np.float32), np.asarray(ref, np.float32)
    assert out.shape == ref.shape
    assert np.isfinite(ref).all() and np.abs(ref).max() > 0
    on_gpu = mesh.devices.flat[0].platform == "gpu"
    atol = (SHARDED_KERNEL_ATOL if on_gpu else SHARDED_RTOL) * np.abs(ref).max()
    np.testing.assert_allclose(out, ref, rtol=0 if on_gpu else SHARDED_RTOL, atol=atol)
