"""Soak and concurrency on the CPU backend.

* Soak: 10^4 jitted decode steps, each a store (cache donated, new slots and key/value every
  step) and a read (paged_attention over the pages written so far), with no growth of the
  process's resident memory or of the live device buffers between step 1000 and step 10^4;
  likewise 10^3 steps of the checked store and reader under checkify. The numbers are printed
  (``pytest -s``) and recorded in TESTING.md.
* Concurrency: several Python threads store at the same time into their own caches, with the
  same compiled store; each cache ends up with the jnp reference's bytes.
"""

from __future__ import annotations

import functools
import gc
import os
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import jax_nvfp4

import store_cases as sc

STEPS = int(os.environ.get("JAX_NVFP4_SOAK_STEPS", 10_000))
CHECKED_STEPS = max(STEPS // 10, 10)
#: Largest growth allowed between the first measurement and the end (a leak of 1 KiB per
#: call would be 20 MiB over 10^4 steps of two calls).
MAX_RSS_GROWTH = 8 << 20

BATCH, HEADS, Q_HEADS, D, BS, PAGES = 4, 2, 8, 64, 16, 8


def rss_bytes() -> int:
    """Resident set size of this process (Linux /proc; elsewhere the peak from resource)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # pragma: no cover - not Linux
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _inputs(steps, seed=0):
    """Per step: key/value [BATCH, HEADS, D], slots [BATCH] (one new token per sequence),
    seq_lens [BATCH]; block tables [BATCH, PAGES] fixed."""
    rng = np.random.default_rng(seed)
    num_blocks = BATCH * PAGES
    tables = rng.permutation(num_blocks).reshape(BATCH, PAGES).astype(np.int32)
    capacity = PAGES * BS
    pos = np.arange(steps) % capacity                                  # wraps: reuses slots
    slots = tables[:, pos // BS].T * BS + (pos % BS)[:, None]          # [steps, BATCH]
    lens = np.minimum(np.arange(steps) + 1, capacity)[:, None].repeat(BATCH, 1)
    keys = rng.standard_normal((16, BATCH, HEADS, D)).astype(np.float32)  # cycled
    return num_blocks, tables, slots.astype(np.int32), lens.astype(np.int32), keys


def _measure(run_step, steps, warmup):
    for i in range(warmup):
        run_step(i)
    jax.effects_barrier()
    gc.collect()
    rss0, live0 = rss_bytes(), len(jax.live_arrays())
    t0 = time.perf_counter()
    trace = []                                     # RSS every tenth of the run
    every = max((steps - warmup) // 10, 1)
    for i in range(warmup, steps):
        run_step(i)
        if (i - warmup) % every == every - 1:
            trace.append(rss_bytes())
    jax.effects_barrier()
    gc.collect()
    return dict(rss_before=rss0, rss_after=rss_bytes(), live_before=live0,
                live_after=len(jax.live_arrays()), seconds=time.perf_counter() - t0,
                steps=steps - warmup, trace=trace)


def _report(name, m):
    growth = m["rss_after"] - m["rss_before"]
    print(f"\n{name}: {m['steps']} steps in {m['seconds']:.1f} s "
          f"({1e6 * m['seconds'] / m['steps']:.0f} us/step); RSS {m['rss_before'] / 2**20:.1f} "
          f"-> {m['rss_after'] / 2**20:.1f} MiB ({growth / 2**10:+.0f} KiB); live arrays "
          f"{m['live_before']} -> {m['live_after']}; RSS every {m['steps'] // 10} steps "
          f"(KiB over the first): {[(r - m['rss_before']) >> 10 for r in m['trace']]}")
    return growth


def test_soak_store_and_read():
    num_blocks, tables, slots, lens, keys = _inputs(STEPS)
    k_scale = v_scale = jnp.float32(4.0 / 448)
    tables_d = jnp.asarray(tables)

    @functools.partial(jax.jit, donate_argnums=(0,))
    def step(cache, key, slots, lens, q):
        cache = jax_nvfp4.reshape_and_cache(key, key * 0.5, cache, slots, k_scale, v_scale)
        out = jax_nvfp4.paged_attention(q, cache, tables_d, lens, k_scale, v_scale)
        return cache, out

    state = dict(cache=jax_nvfp4.allocate_kv_cache(num_blocks, BS, HEADS, D))
    q = jnp.asarray(np.random.default_rng(1).standard_normal((BATCH, Q_HEADS, D)), jnp.float32)
    keys_d = jnp.asarray(keys, jnp.bfloat16)

    def run_step(i):
        state["cache"], out = step(state["cache"], keys_d[i % len(keys)], slots[i], lens[i], q)
        if i % 100 == 99:
            assert np.isfinite(np.asarray(out)).all()

    m = _measure(run_step, STEPS, warmup=min(1000, STEPS // 2))
    growth = _report("soak, store + paged_attention", m)
    assert m["live_after"] == m["live_before"], m
    assert growth < MAX_RSS_GROWTH, m


def test_soak_checked_store_and_read():
    num_blocks, tables, slots, lens, keys = _inputs(CHECKED_STEPS, seed=2)
    k_scale = v_scale = jnp.float32(4.0 / 448)
    tables_d = jnp.asarray(tables)

    def step(cache, key, slots, lens, q):
        cache = jax_nvfp4.reshape_and_cache(key, key, cache, slots, k_scale, v_scale,
                                            checked=True)
        out = jax_nvfp4.paged_attention(q, cache, tables_d, lens, k_scale, v_scale,
                                        checked=True)
        return cache, out

    # jit outside checkify: compiled once. (checkify.checkify(jax.jit(step)) traces the
    # checkified function again on every call: ~10 ms a step here, and JAX's caches grow.)
    checked_step = jax.jit(checkify.checkify(step), donate_argnums=(0,))
    state = dict(cache=jax_nvfp4.allocate_kv_cache(num_blocks, BS, HEADS, D))
    q = jnp.asarray(np.random.default_rng(3).standard_normal((BATCH, Q_HEADS, D)), jnp.float32)
    keys_d = jnp.asarray(keys, jnp.bfloat16)

    def run_step(i):
        err, (state["cache"], _) = checked_step(state["cache"], keys_d[i % len(keys)], slots[i],
                                                lens[i], q)
        if i % 100 == 99:
            err.throw()

    m = _measure(run_step, CHECKED_STEPS, warmup=CHECKED_STEPS // 2)
    growth = _report("soak, checked store + checked paged_attention", m)
    assert m["live_after"] == m["live_before"], m
    assert growth < MAX_RSS_GROWTH, m


@pytest.mark.parametrize("threads", [4, 8])
def test_concurrent_stores_into_distinct_caches(threads):
    """Threads store batches into their own caches at the same time (one compiled store,
    caches donated); each final cache equals the reference's sequential stores."""
    rounds = 12
    cases = [sc.make_case(100 + t, num_tokens=96, num_kv_heads=2, head_size=128, block_size=16,
                          num_out_of_range=3, spare_blocks=6) for t in range(threads)]
    # Every round stores new key/value into new slots of the same cache geometry.
    rng = np.random.default_rng(7)
    batches = []
    for case in cases:
        mine = []
        for r in range(rounds):
            scale = np.float32(0.5 + r)
            mine.append(case.with_args(
                key=(case.key.astype(np.float32) * scale).astype(case.key.dtype),
                slot_mapping=rng.permutation(case.slot_mapping)))
        batches.append(mine)
    store = jax.jit(jax_nvfp4.reshape_and_cache, donate_argnums=(2,))
    results = [None] * threads
    errors = []
    barrier = threading.Barrier(threads)

    def work(t):
        try:
            cache = jnp.asarray(cases[t].cache)
            barrier.wait()
            for b in batches[t]:
                cache = store(b.key, b.value, cache, b.slot_mapping, b.k_scale, b.v_scale)
            results[t] = np.asarray(cache)
        except BaseException as error:  # pragma: no cover - reported below
            errors.append(error)

    workers = [threading.Thread(target=work, args=(t,)) for t in range(threads)]
    for w in workers:
        w.start()
    for w in workers:
        w.join(timeout=300)
    assert not errors, errors
    for t in range(threads):
        want = cases[t].cache
        for b in batches[t]:
            want = sc.run_reference(b.with_args(cache=want))
        sc.assert_bytes_equal(results[t], want, f"thread {t}")
