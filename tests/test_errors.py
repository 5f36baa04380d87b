"""Wrong arguments are refused at trace time with a TypeError/ValueError naming the argument:
eagerly, under jax.jit, under jax.eval_shape with abstract inputs, and by the jnp reference.
Slot handling: out-of-range slots write nothing, negative slots are padding, checked=True
reports out-of-range and duplicate slots, slot_mapping_problems counts them."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import jax_nvfp4
from jax_nvfp4 import reference

import store_cases as sc

BF16, F16 = jnp.bfloat16, jnp.float16
T, H, D, NB, BS = 5, 2, 128, 4, 8
ARG_NAMES = ("key", "value", "kv_cache", "slot_mapping", "k_scale", "v_scale")


def spec(shape, dtype):
    return jax.ShapeDtypeStruct(tuple(shape), jnp.dtype(dtype))


def valid_specs(head_size=D, layout="HND"):
    return dict(key=spec((T, H, head_size), BF16), value=spec((T, H, head_size), BF16),
                kv_cache=spec(sc.cache_shape(NB, BS, H, head_size, layout), np.uint8),
                slot_mapping=spec((T,), np.int32), k_scale=spec((), np.float32),
                v_scale=spec((), np.float32))


@dataclasses.dataclass
class ErrorCase:
    id: str
    changes: dict                  # argument name -> ShapeDtypeStruct
    error: type
    words: tuple                   # all must appear in str(error)
    options: dict = dataclasses.field(default_factory=dict)
    head_size: int = D


CASES = [
    ErrorCase("key float32", dict(key=spec((T, H, D), np.float32), value=spec((T, H, D), np.float32)),
              TypeError, ("key", "float32")),
    ErrorCase("value float32", dict(value=spec((T, H, D), np.float32)), TypeError, ("value",)),
    ErrorCase("key int8", dict(key=spec((T, H, D), np.int8)), TypeError, ("key",)),
    ErrorCase("kv_cache int8", dict(kv_cache=spec(sc.cache_shape(NB, BS, H, D, "HND"), np.int8)),
              TypeError, ("kv_cache", "uint8")),
    ErrorCase("kv_cache bf16", dict(kv_cache=spec(sc.cache_shape(NB, BS, H, D, "HND"), BF16)),
              TypeError, ("kv_cache", "uint8")),
    ErrorCase("slot_mapping float32", dict(slot_mapping=spec((T,), np.float32)), TypeError,
              ("slot_mapping",)),
    ErrorCase("slot_mapping uint32", dict(slot_mapping=spec((T,), np.uint32)), TypeError,
              ("slot_mapping",)),
    # Scales of any integer or floating-point dtype are converted to float32
    # (test_scales.py::test_scale_dtype_rule_is_the_same_eagerly_and_under_jit); not these:
    ErrorCase("k_scale bool", dict(k_scale=spec((), np.bool_)), TypeError,
              ("k_scale", "real number", "bool")),
    ErrorCase("v_scale complex64", dict(v_scale=spec((), np.complex64)), TypeError,
              ("v_scale", "real number", "complex64")),
    ErrorCase("key rank 2", dict(key=spec((T, H * D), BF16), value=spec((T, H * D), BF16)),
              ValueError, ("key", "shape")),
    ErrorCase("key rank 4", dict(key=spec((1, T, H, D), BF16), value=spec((1, T, H, D), BF16)),
              ValueError, ("key",)),
    ErrorCase("kv_cache rank 4", dict(kv_cache=spec((NB, 2, H, BS * 72), np.uint8)), ValueError,
              ("kv_cache", "rank")),
    ErrorCase("kv_cache axis 1 is 3", dict(kv_cache=spec((NB, 3, H, BS, 72), np.uint8)),
              ValueError, ("kv_cache", "axis 1")),
    ErrorCase("value shape", dict(value=spec((T, H + 1, D), BF16)), ValueError, ("value", "shape")),
    ErrorCase("value dtype", dict(value=spec((T, H, D), F16)), TypeError, ("value", "dtype")),
    ErrorCase("head size 72", dict(key=spec((T, H, 72), BF16), value=spec((T, H, 72), BF16)),
              ValueError, ("head_size", "16", "72")),
    ErrorCase("head size 72, linear V", dict(key=spec((T, H, 72), BF16),
                                             value=spec((T, H, 72), BF16)),
              ValueError, ("head_size", "16"), options=dict(v_scale_swizzle=False)),
    ErrorCase("head size 80 swizzled", {}, ValueError, ("head_size", "v_scale_swizzle", "64"),
              head_size=80),
    ErrorCase("head size 96 swizzled", {}, ValueError, ("head_size", "v_scale_swizzle", "64"),
              head_size=96),
    ErrorCase("block size 6", dict(kv_cache=spec((NB, 2, H, 6, 72), np.uint8)), ValueError,
              ("kv_cache", "block_size", "6")),
    ErrorCase("block size 6 NHD", dict(kv_cache=spec((NB, 2, 6, H, 72), np.uint8)), ValueError,
              ("kv_cache", "block_size", "6"), options=dict(layout="NHD")),
    ErrorCase("cache heads != key heads",
              dict(kv_cache=spec(sc.cache_shape(NB, BS, H + 2, D, "HND"), np.uint8)),
              ValueError, ("kv_cache", "num_kv_heads")),
    ErrorCase("cache head size != key head size",
              dict(kv_cache=spec(sc.cache_shape(NB, BS, H, 64, "HND"), np.uint8)),
              ValueError, ("kv_cache", "head_size")),
    ErrorCase("cache trailing axis not 9*D/16", dict(kv_cache=spec((NB, 2, H, BS, 70), np.uint8)),
              ValueError, ("kv_cache",)),
    ErrorCase("NHD cache read as HND",
              dict(kv_cache=spec(sc.cache_shape(NB, BS, H, D, "NHD"), np.uint8)),
              ValueError, ("kv_cache",)),
    ErrorCase("unknown layout", {}, ValueError, ("layout", "HDN"), options=dict(layout="HDN")),
    ErrorCase("unknown scale_search", {}, ValueError, ("scale_search", "4over5"),
              options=dict(scale_search="4over5")),
    ErrorCase("v_scale_swizzle not a bool", {}, TypeError, ("v_scale_swizzle",),
              options=dict(v_scale_swizzle="yes")),
    ErrorCase("slot_mapping too short", dict(slot_mapping=spec((T - 1,), np.int32)), ValueError,
              ("slot_mapping", "num_tokens")),
    ErrorCase("slot_mapping 2-D", dict(slot_mapping=spec((1, T), np.int32)), ValueError,
              ("slot_mapping",)),
    ErrorCase("k_scale shape (2,)", dict(k_scale=spec((2,), np.float32)), ValueError,
              ("k_scale", "shape")),
    ErrorCase("v_scale shape (1, 1)", dict(v_scale=spec((1, 1), np.float32)), ValueError,
              ("v_scale", "shape")),
]

MODES = ("eager", "jit", "eval_shape", "reference")


def concrete(specs, seed=0):
    rng = np.random.default_rng(seed)
    out = []
    for s in specs:
        dtype = np.dtype(s.dtype)
        if dtype.kind == "f" or dtype == jnp.bfloat16:
            x = (rng.normal(size=s.shape) * 0.3 + 0.1).astype(np.float32).astype(dtype)
        elif dtype == np.uint8 or dtype == np.int8:
            x = rng.integers(0, 100, s.shape).astype(dtype)
        else:
            x = rng.integers(0, NB * BS, s.shape).astype(dtype)
        if s.shape == () and dtype.kind == "f":
            x = np.asarray(0.01, dtype)
        out.append(x)
    return out


def call(mode, specs, options):
    if mode == "eval_shape":
        return jax.eval_shape(functools.partial(jax_nvfp4.reshape_and_cache, **options), *specs)
    args = concrete(specs)
    if mode == "eager":
        return jax_nvfp4.reshape_and_cache(*args, **options)
    if mode == "jit":
        # The scales are passed as jax arrays so that jit sees their dtype (a numpy float64
        # argument would be converted to float32 by jit without x64).
        args = [jnp.asarray(a) for a in args]
        return jax.jit(functools.partial(jax_nvfp4.reshape_and_cache, **options))(*args)
    return reference.reshape_and_cache(*args, **options)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_arguments(case, mode):
    specs = valid_specs(case.head_size)
    specs.update(case.changes)
    with pytest.raises(case.error) as info:
        call(mode, [specs[n] for n in ARG_NAMES], case.options)
    message = str(info.value)
    for word in case.words:
        assert word in message, f"{word!r} not in {message!r}"


def test_valid_specs_are_valid():
    """The base arguments of test_bad_arguments pass: every failure there is the change's."""
    for head_size, options in ((D, {}), (80, dict(v_scale_swizzle=False)),
                               (96, dict(v_scale_swizzle=False))):
        specs = [valid_specs(head_size)[n] for n in ARG_NAMES]
        for mode in MODES:
            out = call(mode, specs, options)
            assert out.shape == specs[2].shape and out.dtype == jnp.uint8
    nhd = valid_specs(layout="NHD")
    out = call("eval_shape", [nhd[n] for n in ARG_NAMES], dict(layout="NHD"))
    assert out.shape == nhd["kv_cache"].shape


def test_reference_and_kernel_give_the_same_message():
    specs = valid_specs(72)
    args = concrete([specs[n] for n in ARG_NAMES])
    messages = []
    for fn in (jax_nvfp4.reshape_and_cache, reference.reshape_and_cache):
        with pytest.raises(ValueError) as info:
            fn(*args)
        messages.append(str(info.value).split("\n")[0])
    assert messages[0] == messages[1]


def test_kv_cache_shape_and_allocate_refuse_bad_geometry():
    with pytest.raises(ValueError, match="block_size"):
        jax_nvfp4.kv_cache_shape(4, 6, 2, 128, "HND")
    with pytest.raises(ValueError, match="head_size"):
        jax_nvfp4.kv_cache_shape(4, 8, 2, 72, "HND")
    with pytest.raises(ValueError, match="layout"):
        jax_nvfp4.kv_cache_shape(4, 8, 2, 128, "NDH")
    with pytest.raises(ValueError, match="block_size"):
        jax_nvfp4.allocate_kv_cache(4, 6, 2, 128)
    # Head sizes 80/96 are valid cache geometries (with linear V scales).
    assert jax_nvfp4.kv_cache_shape(4, 8, 2, 80, "NHD") == (4, 2, 8, 2, 45)


def test_dequantize_refuses_swizzled_head_size_80():
    cache = np.zeros(sc.cache_shape(2, 4, 1, 80, "HND"), np.uint8)
    with pytest.raises(ValueError, match="v_scale_swizzle"):
        jax_nvfp4.dequantize(cache, np.float32(1), np.float32(1))
    k, v = jax_nvfp4.dequantize(cache, np.float32(1), np.float32(1), v_scale_swizzle=False)
    assert k.shape == (2, 4, 1, 80)


# ---------------------------------------------------------------------------------------------
# Slots: padding, out of range, checked mode.

def _slot_case(slots, seed=21):
    case = sc.make_case(seed, num_tokens=len(slots), num_kv_heads=2, head_size=64, block_size=4,
                        num_padding=0, spare_blocks=3)
    return case.with_args(slot_mapping=np.asarray(slots, np.int32))


def test_out_of_range_and_negative_slots_write_nothing():
    probe = _slot_case([0] * 8)
    n = probe.num_slots
    # Only padding and out-of-range slots: the cache comes back unchanged.
    case = _slot_case([-1, -2, -n, n, n + 1, 2 * n, 2**31 - 1, -(2**31)])
    assert case.num_slots == n
    for fn in (sc.run_kernel, sc.run_reference):
        sc.assert_bytes_equal(fn(case), case.cache, fn.__name__)
    # Mixed: the same bytes as storing only the valid tokens.
    slots = np.array([3, -1, n, 7, n + 5, 0, -3, n - 1], np.int32)
    mixed = _slot_case(slots)
    keep = (slots >= 0) & (slots < n)
    only_valid = mixed.with_args(key=mixed.key[keep], value=mixed.value[keep],
                                 slot_mapping=slots[keep])
    out = sc.run_kernel(mixed)
    sc.assert_cache_equal(mixed, out, sc.run_kernel(only_valid), "mixed vs valid tokens only")
    sc.assert_cache_equal(mixed, out, sc.run_reference(mixed), "kernel vs reference")
    sc.assert_only_expected_bytes_changed(mixed, out)


def test_checked_accepts_valid_slots():
    case = _slot_case([3, -1, 7, 0, 15, -5, 1, 2])
    out = jax_nvfp4.reshape_and_cache(*case.args(), checked=True)
    sc.assert_bytes_equal(np.asarray(out), sc.run_kernel(case), "checked vs unchecked")


@pytest.mark.parametrize("slots, words", [
    ([3, -1, 7, 0, 10_000, -5, 1, 2], ("1 slot(s)", ">= num_blocks*block_size")),
    ([3, -1, 7, 0, 64, 65, 1, 2], ("2 slot(s)",)),
    ([3, -1, 7, 3, 15, -5, 1, 7], ("repeats 2 slot(s)",)),
], ids=["out of range", "two at the end", "duplicates"])
def test_checked_raises(slots, words):
    case = _slot_case(slots)
    assert case.num_slots <= 64
    with pytest.raises(checkify.JaxRuntimeError) as info:
        jax_nvfp4.reshape_and_cache(*case.args(), checked=True)
    for word in words:
        assert word in str(info.value), str(info.value)
    # Under jit: functionalised with checkify.checkify, the error comes back as a value.
    store = checkify.checkify(jax.jit(functools.partial(jax_nvfp4.reshape_and_cache,
                                                        checked=True)))
    err, out = store(*case.args())
    assert err.get() is not None and words[0] in err.get()
    with pytest.raises(checkify.JaxRuntimeError):
        err.throw()
    # The store still happened, skipping what it must skip.
    sc.assert_cache_equal(case, np.asarray(out), sc.run_reference(case), "checked store under jit")


def test_checked_under_plain_jit_needs_checkify():
    case = _slot_case([3, -1, 7, 0, 15, -5, 1, 2])
    with pytest.raises(ValueError, match="checkify"):
        jax.jit(functools.partial(jax_nvfp4.reshape_and_cache, checked=True))(*case.args())


def _numpy_problems(slots, num_slots):
    slots = np.asarray(slots, np.int64)
    out_of_range = int(np.sum(slots >= num_slots))
    valid = slots[(slots >= 0) & (slots < num_slots)]
    _, counts = np.unique(valid, return_counts=True)
    return out_of_range, int(np.sum(counts - 1))


def test_slot_mapping_problems_counts():
    slots = np.array([0, 1, 1, 1, -1, -1, 100, 64, 63, 5, 5, -64], np.int32)
    assert _numpy_problems(slots, 64) == (2, 3)
    counts = jax_nvfp4.slot_mapping_problems(slots, 64)
    assert tuple(int(c) for c in counts) == (2, 3)
    assert all(c.dtype == jnp.int32 and c.shape == () for c in counts)
    # jit-compatible (num_slots static), no problem for a clean mapping, and random mappings.
    problems = jax.jit(jax_nvfp4.slot_mapping_problems, static_argnums=1)
    assert tuple(int(c) for c in problems(np.array([3, -1, 0, 2], np.int32), 4)) == (0, 0)
    rng = np.random.default_rng(4)
    for _ in range(5):
        s = rng.integers(-20, 80, 200).astype(np.int32)
        assert tuple(int(c) for c in problems(s, 64)) == _numpy_problems(s, 64)
    with sc.x64():
        s64 = np.array([2**40, 5, 5, -(2**40), 63, 64], np.int64)
        assert tuple(int(c) for c in jax_nvfp4.slot_mapping_problems(s64, 64)) == (2, 1)


# ---------------------------------------------------------------------------------------------
# The FFI handler's own checks: a call that bypasses the Python validation (a raw
# jax.ffi.ffi_call) gets an error from the handler, not a write with a degenerate geometry.

def _raw_store(cache_shape, key_shape=(2, 2, 64)):
    key = jnp.zeros(key_shape, jnp.bfloat16) + 1
    call = jax.ffi.ffi_call(jax_nvfp4.primitive.STORE_TARGET,
                            jax.ShapeDtypeStruct(cache_shape, jnp.uint8),
                            input_output_aliases={2: 0})
    return call(key, key, jnp.zeros(cache_shape, jnp.uint8), jnp.array([0, 1], jnp.int32),
                jnp.float32(1), jnp.float32(1), layout=np.int32(0), scale_search=np.int32(0),
                v_scale_swizzle=True)


# (A cache with block_size 0 has no elements; XLA does not run the call at all, so the
# handler's refusal of it cannot be observed from here.)
@pytest.mark.parametrize("cache_shape, message", [
    ((4, 2, 2, 6, 36), "block_size"),        # not a multiple of 4
    ((4, 2, 3, 4, 36), "kv_cache shape"),    # heads differ from key's
])
def test_ffi_handler_refuses_degenerate_geometry(cache_shape, message):
    with pytest.raises(Exception, match=message):
        jax.block_until_ready(_raw_store(cache_shape))


def test_zero_kv_heads_named():
    with pytest.raises(ValueError, match="key must have at least one kv head"):
        jax_nvfp4.reshape_and_cache(jnp.zeros((2, 0, 64), jnp.bfloat16),
                                    jnp.zeros((2, 0, 64), jnp.bfloat16),
                                    jnp.zeros((4, 2, 1, 4, 36), jnp.uint8),
                                    jnp.array([0, 1], jnp.int32), 1.0, 1.0)
    with pytest.raises(ValueError, match="at least one kv head"):
        jax_nvfp4.dequantize(jnp.zeros((4, 2, 0, 4, 36), jnp.uint8), 1.0, 1.0)


def test_python_sequences_are_accepted_like_arrays():
    case = _slot_case([3, -1, 7, 0, 15, -5, 1, 2])
    args = list(case.args())
    args[3] = [int(s) for s in np.asarray(args[3])]  # slot_mapping as a list
    out = jax_nvfp4.reshape_and_cache(*args)
    sc.assert_cache_equal(case, np.asarray(out), sc.run_reference(case), "list slot_mapping")


def _docstring_sections(doc):
    """{section title: text} of a Google-style docstring (``Args:``, ``Returns:``, ...)."""
    sections, title = {}, None
    for line in doc.splitlines():
        stripped = line.strip()
        if stripped.endswith(":") and stripped[:-1] in ("Args", "Returns", "Raises", "Yields"):
            title = stripped[:-1]
            sections[title] = ""
        elif title is not None:
            sections[title] += line + "\n"
    return sections


def test_public_docstrings_list_errors_under_raises():
    """help(f) says what f raises under "Raises:", not in the middle of "Returns:" (as the
    store's docstring once did)."""
    import inspect

    from jax_nvfp4 import sharding

    functions = [getattr(jax_nvfp4, n) for n in jax_nvfp4.__all__] + [
        getattr(sharding, n) for n in dir(sharding) if not n.startswith("_")]
    checked = 0
    for f in functions:
        if not inspect.isfunction(f) or not f.__doc__:
            continue
        sections = _docstring_sections(inspect.getdoc(f))
        if "Returns" in sections:
            checked += 1
            assert "Error" not in sections["Returns"], (f.__qualname__, sections["Returns"])
    assert checked >= 5
