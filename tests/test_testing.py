"""jax_nvfp4.testing: the cache-equality message names the differing block and decodes it; the
read-back bound holds for every value the store writes (and is tight), and catches a wrong one."""

import re

import jax.numpy as jnp
import numpy as np
import pytest

import jax_nvfp4
from jax_nvfp4 import testing as nvt

T, H, D, NB, BS = 40, 2, 128, 8, 16


def _stored(layout="HND", scale_search="default", divisor=448, seed=0, dtype=jnp.bfloat16,
            spread=3.0):
    rng = np.random.default_rng(seed)
    # Blocks of very different sizes, so that some block scales are E4M3 subnormals or saturate.
    magnitude = np.exp(rng.uniform(-spread, spread, (T, H, D // 16, 1)))
    k = jnp.asarray((rng.standard_normal((T, H, D // 16, 16)) * magnitude).reshape(T, H, D), dtype)
    slots = jnp.asarray(rng.permutation(NB * BS)[:T], jnp.int32)
    scale = jnp.max(jnp.abs(k.astype(jnp.float32))) / divisor
    cache = jax_nvfp4.reshape_and_cache(k, -k, jax_nvfp4.allocate_kv_cache(NB, BS, H, D, layout),
                                        slots, scale, scale, layout=layout,
                                        scale_search=scale_search)
    return k, slots, scale, cache


@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_cache_difference_is_named_and_decoded(layout):
    _, _, scale, cache = _stored(layout)
    geo = jax_nvfp4.layout.CacheGeometry.from_shape(cache.shape, layout)
    tampered = np.array(geo.pages(cache))
    # V, head 1, row 7, values 96..111: its code byte 50 (values 100, 101) ...
    tampered[3, 1, geo.data_offsets()[1, 7, 50]] ^= 0x11
    # ... and K, head 0, row 2: the scale byte of values 32..47.
    tampered[5, 0, geo.scale_offsets(False, True)[0, 2, 2]] += 1
    tampered = tampered.reshape(cache.shape)
    with pytest.raises(AssertionError) as error:
        nvt.assert_caches_equal(tampered, cache, layout=layout, k_scale=scale, v_scale=scale)
    message = str(error.value)
    assert message.startswith("NVFP4 caches differ in 2 of 36864 bytes, 2 16-value block(s). "
                              "First: page 3, V, head 1, row 7, values 96..111 (block 6), codes")
    assert "also: page 5, K, head 0, row 2, values 32..47 (block 2), scale" in message
    actual, expected = (np.array(eval(m)) for m in re.findall(r"values: (\[.*\])", message))
    k, v = jax_nvfp4.dequantize(cache, scale, scale, layout=layout, dtype=jnp.float32)
    row = geo.block_size * 3 + 7
    np.testing.assert_allclose(expected, np.asarray(v).reshape(-1, H, D)[row, 1, 96:112],
                               rtol=1e-3)
    same = np.ones(16, bool)
    same[4:6] = False                                   # values 100 and 101 (byte 50 of 64)
    np.testing.assert_array_equal(actual[same], expected[same])
    assert not (actual[~same] == expected[~same]).any()
    nvt.assert_caches_equal(cache, np.asarray(cache), layout=layout)


def test_stacked_caches_and_shape_mismatch():
    _, _, _, cache = _stored()
    other = np.array(cache)
    other[7, 0, 1, 15, 71] ^= 1
    with pytest.raises(AssertionError, match=r"First: stacked index \(1, 0\), page 7, K, head 1, "
                                             r"row 15, values 112..127 \(block 7\), scale"):
        nvt.assert_caches_equal(np.stack([[cache], [cache]]), np.stack([[cache], [other]]))
    with pytest.raises(AssertionError, match="shape"):
        nvt.assert_caches_equal(cache, np.asarray(cache)[:-1])


@pytest.mark.parametrize("scale_search", ["default", "4over6"])
@pytest.mark.parametrize("divisor", [448, 2688, 20, 1e6])
def test_read_back_within_bound(scale_search, divisor):
    """Every stored value (K, and V = -K) reads back within the bound; the bound is tight (the
    largest error is more than 90% of it)."""
    for seed, layout in ((0, "HND"), (1, "NHD")):
        k, slots, scale, cache = _stored(layout, scale_search, divisor, seed)
        for dtype in (jnp.float32, jnp.bfloat16):
            kk, vv = jax_nvfp4.dequantize(cache, scale, scale, layout=layout, dtype=dtype)
            rows = lambda x: np.asarray(x).reshape(-1, H, D)[np.asarray(slots)]  # noqa: E731
            nvt.assert_read_back_close(k, rows(kk), scale, scale_search=scale_search)
            nvt.assert_read_back_close(-k, rows(vv), scale, scale_search=scale_search)
        kk, _ = jax_nvfp4.dequantize(cache, scale, scale, layout=layout, dtype=jnp.float32)
        err = np.abs(rows(kk).astype(np.float64) - np.asarray(k, np.float64))
        ratio = err / nvt.read_back_bound(k, scale, scale_search)
        assert 0.9 < ratio.max() <= 1.0, ratio.max()


def test_read_back_outside_bound_is_reported():
    k, slots, scale, cache = _stored()
    kk, _ = jax_nvfp4.dequantize(cache, scale, scale, dtype=jnp.float32)
    back = np.asarray(kk).reshape(-1, H, D)[np.asarray(slots)].copy()
    bound = nvt.read_back_bound(k, scale)
    back[3, 1, 40] = np.float32(k[3, 1, 40]) + 1.5 * bound[3, 1, 40]
    with pytest.raises(AssertionError, match=r"1 of 10240 values outside the NVFP4 bound; first "
                                             r"at index \(3, 1, 40\) \(block of values 32..47\)"):
        nvt.assert_read_back_close(k, back, scale)
