"""The store updates the cache in place (docs/format.md §5): under jax.jit with the cache donated,
the compiled module aliases the cache parameter to the result and holds no copy of it; without
donation XLA copies it first (the contrast shows these checks can fail). Also: the store is
not differentiable, and says so."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_nvfp4

import hlo_checks as hc
import store_cases as sc

PLATFORMS = ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)]
CACHE_OPERAND = 2


def compiled_text(case, platform, donate):
    device = jax.devices(platform)[0]
    args = jax.device_put(case.args(), device)
    fn = jax.jit(functools.partial(jax_nvfp4.reshape_and_cache, layout=case.layout),
                 donate_argnums=(CACHE_OPERAND,) if donate else ())
    return fn.lower(*args).compile().as_text()


def _case(layout="HND"):
    return sc.make_case(3, num_tokens=21, num_kv_heads=2, head_size=128, block_size=16,
                        layout=layout)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_donated_store_has_no_cache_copy(platform, layout):
    case = _case(layout)
    text = compiled_text(case, platform, donate=True)
    # No copy (any op but the store writing as many bytes as the cache), one aliased store
    # on the cache, the cache argument aliased to the result.
    hc.assert_in_place(text, case.cache.shape, aliases={(): CACHE_OPERAND},
                       cache_shapes=[case.cache.shape])


@pytest.mark.parametrize("platform", PLATFORMS)
def test_without_donation_the_cache_is_copied(platform):
    """The contrast: the same checks fail when the cache is not donated."""
    case = _case()
    text = compiled_text(case, platform, donate=False)
    assert len(hc.cache_copies(text, [case.cache.shape])) >= 1, text
    header = hc.module_header(text)
    assert "input_output_alias" not in header, header
    assert hc.input_output_aliases(text) == {}
    # The custom call still aliases its operand: to the copy.
    (call,) = hc.store_calls(text)
    assert hc.is_aliased(call), call.line
    with pytest.raises(AssertionError):
        hc.assert_in_place(text, case.cache.shape, cache_shapes=[case.cache.shape])


@pytest.mark.parametrize("platform", PLATFORMS)
def test_donated_cache_is_consumed_and_reused(platform):
    case = _case()
    device = jax.devices(platform)[0]
    key, value, _, slots, k_scale, v_scale = jax.device_put(case.args(), device)
    # A cache owned by XLA (a computed array), so its buffer can be handed over.
    cache = jax.jit(lambda c: c + jnp.uint8(0))(jax.device_put(case.cache, device))
    pointer = cache.unsafe_buffer_pointer()
    store = jax.jit(jax_nvfp4.reshape_and_cache, donate_argnums=CACHE_OPERAND)
    out = store(key, value, cache, slots, k_scale, v_scale)
    assert cache.is_deleted()
    assert out.unsafe_buffer_pointer() == pointer  # updated where it was
    with pytest.raises(RuntimeError, match="deleted|donated"):
        np.asarray(cache)
    sc.assert_cache_equal(case, np.asarray(out), sc.run_reference(case), "donated store")

    # A second store into the result, donated again: still the same buffer.
    out2 = store(key, value, out, slots, k_scale * 2, v_scale)
    assert out.is_deleted() and out2.unsafe_buffer_pointer() == pointer


@pytest.mark.parametrize("platform", PLATFORMS)
def test_without_donation_the_input_survives(platform):
    case = _case()
    device = jax.devices(platform)[0]
    args = jax.device_put(case.args(), device)
    out = jax.jit(jax_nvfp4.reshape_and_cache)(*args)
    assert not args[CACHE_OPERAND].is_deleted()
    sc.assert_bytes_equal(np.asarray(args[CACHE_OPERAND]), case.cache, "undonated input")
    assert not np.array_equal(np.asarray(out), case.cache)


def test_donated_store_of_two_layers_in_one_jit():
    """Two caches updated in one jitted step, both donated: no copies of either."""
    a = _case()
    b = sc.make_case(4, num_tokens=21, num_kv_heads=2, head_size=128, block_size=16)
    assert a.cache.shape == b.cache.shape

    def step(ca, cb, key, value, slots, ks, vs):
        ca = jax_nvfp4.reshape_and_cache(key, value, ca, slots, ks, vs)
        cb = jax_nvfp4.reshape_and_cache(value, key, cb, slots, vs, ks)
        return ca, cb

    args = (a.cache, b.cache, a.key, a.value, a.slot_mapping, a.k_scale, a.v_scale)
    text = jax.jit(step, donate_argnums=(0, 1)).lower(*args).compile().as_text()
    # Outputs 0 and 1 are the donated parameters 0 and 1; two aliased stores, no copy.
    hc.assert_in_place(text, a.cache.shape, num_stores=2, aliases={(0,): 0, (1,): 1},
                       cache_shapes=[a.cache.shape])


# ---------------------------------------------------------------------------------------------
# Not differentiable.

def test_grad_raises_clear_error():
    case = _case()
    key, value, cache, slots, k_scale, v_scale = map(jnp.asarray, case.args())

    def loss(key):
        out = jax_nvfp4.reshape_and_cache(key, value, cache, slots, k_scale, v_scale)
        return jnp.sum(out.astype(jnp.float32))

    with pytest.raises(TypeError, match="not differentiable"):
        jax.grad(loss)(key)
    with pytest.raises(TypeError, match="not differentiable"):
        jax.jit(jax.grad(loss))(key)
    with pytest.raises(TypeError, match="not differentiable"):
        jax.grad(lambda s: jnp.sum(jax_nvfp4.reshape_and_cache(
            key, value, cache, slots, s, v_scale).astype(jnp.float32)))(k_scale)
    with pytest.raises(TypeError, match="not differentiable"):
        jax.jvp(lambda k: jax_nvfp4.reshape_and_cache(k, value, cache, slots, k_scale, v_scale),
                (key,), (key,))
    # The advice in the message works: with stop_gradient the store is fine inside a grad.
    stopped = jax.grad(lambda k: jnp.sum(k.astype(jnp.float32)) + jnp.sum(
        jax_nvfp4.reshape_and_cache(jax.lax.stop_gradient(k), value, cache, slots, k_scale,
                                    v_scale).astype(jnp.float32)))(key)
    assert stopped.shape == key.shape
