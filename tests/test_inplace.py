"""The store updates the cache in place (spec §5): under jax.jit with the cache donated, the
compiled module aliases the cache parameter to the result and holds no copy of it; without
donation XLA copies it first (the contrast shows these checks can fail). Also: the store is
not differentiable, and says so."""

from __future__ import annotations

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_nvfp4

import store_cases as sc

PLATFORMS = ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)]
CACHE_OPERAND = 2

_INSTRUCTION = re.compile(
    r"^\s*(?:ROOT\s+)?%?(?P<name>[\w.\-]+)\s*=\s*(?P<type>\w+)\[(?P<dims>[\d,]*)\]\S*\s+"
    r"(?P<opcode>[\w\-]+)\(")


def instructions(hlo_text):
    """(name, element type, dims tuple, opcode, line) of every HLO instruction."""
    for line in hlo_text.splitlines():
        m = _INSTRUCTION.match(line)
        if m:
            dims = tuple(int(d) for d in m["dims"].split(",") if d)
            yield m["name"], m["type"], dims, m["opcode"], line


def cache_copies(hlo_text, cache_shape):
    """Instructions that copy a whole cache: a copy/copy-start of the cache's u8 shape, or a
    fusion of that shape that is a copy (XLA names those copy*)."""
    found = []
    for name, etype, dims, opcode, line in instructions(hlo_text):
        if etype != "u8" or dims != tuple(cache_shape):
            continue
        if opcode in ("copy", "copy-start") or (opcode == "fusion" and "copy" in name):
            found.append(line.strip())
    return found


def store_calls(hlo_text):
    return [line for *_, line in instructions(hlo_text)
            if "custom-call(" in line and "jax_nvfp4_reshape_and_cache" in line]


def compiled_text(case, platform, donate):
    device = jax.devices(platform)[0]
    args = jax.device_put(case.args(), device)
    fn = jax.jit(functools.partial(jax_nvfp4.reshape_and_cache, layout=case.layout),
                 donate_argnums=(CACHE_OPERAND,) if donate else ())
    return fn.lower(*args).compile().as_text()


def _case(layout="HND"):
    return sc.make_case(3, num_tokens=21, num_kv_heads=2, head_size=128, block_size=16,
                        layout=layout)


def test_helpers_parse_hlo():
    text = """
  %p = u8[4,2,2,16,72]{4,3,2,1,0} parameter(0)
  %copy.2 = u8[4,2,2,16,72]{4,3,2,1,0} copy(%p)
  %copy.3 = u8[4,2,2,16,73]{4,3,2,1,0} copy(%p)
  %copy_fusion = u8[4,2,2,16,72]{4,3,2,1,0} fusion(%p), kind=kLoop, calls=%fused_copy
  ROOT %nvfp4 = u8[4,2,2,16,72]{4,3,2,1,0} custom-call(%a, %b, %copy.2), custom_call_target="jax_nvfp4_reshape_and_cache"
"""
    assert len(cache_copies(text, (4, 2, 2, 16, 72))) == 2
    assert len(store_calls(text)) == 1


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_donated_store_has_no_cache_copy(platform, layout):
    case = _case(layout)
    text = compiled_text(case, platform, donate=True)
    assert cache_copies(text, case.cache.shape) == [], cache_copies(text, case.cache.shape)
    calls = store_calls(text)
    assert len(calls) == 1, text
    assert "output_to_operand_aliasing={{}: (2, {})}" in calls[0], calls[0]
    header = text.splitlines()[0] if text.startswith("HloModule") else text
    assert re.search(r"input_output_alias=\{ ?\{\}: \(2, \{\}", header), header


@pytest.mark.parametrize("platform", PLATFORMS)
def test_without_donation_the_cache_is_copied(platform):
    """The contrast: the same checks fail when the cache is not donated."""
    case = _case()
    text = compiled_text(case, platform, donate=False)
    assert len(cache_copies(text, case.cache.shape)) >= 1, text
    header = text.splitlines()[0]
    assert "input_output_alias" not in header, header
    # The custom call still aliases its operand: to the copy.
    assert "output_to_operand_aliasing" in store_calls(text)[0]


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
    sc.assert_bytes_equal(np.asarray(out), sc.run_reference(case), "donated store")

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
    assert cache_copies(text, a.cache.shape) == []
    assert len(store_calls(text)) == 2
    assert "input_output_alias" in text.splitlines()[0]


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
