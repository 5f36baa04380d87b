"""The global-scale contract (issue: a bad k_scale/v_scale destroyed the cache silently).

A valid global scale is a float32 in [MIN_SCALE, MAX_SCALE] = [2**-126, 2**116]. Any other
(zero of either sign, negative, NaN, +-Inf, subnormal, larger than 2**116) counts as NaN on
every backend (the jnp store and dequantize replace it by NaN, the jnp readers and the ragged
kernels' call select NaN over their results, the store kernels and the decode kernel apply
the rule themselves), so:

* the store writes, for every stored (token, head) of that side, the NaN block scale 0x7F and
  the code +-6 with the input's sign: those rows read back as NaN with any scale, and the kernel
  (CPU and GPU) equals the jnp reference byte for byte; the other side, other layers and every
  unwritten byte are untouched;
* the readers (dequantize, paged_attention, the grouped variants) return NaN;
* ``checked=True`` reports the scale by name (store and readers), and the store also reports a
  scale that does not suit the data (values clipped; every value stored as zero).

``scale_from_amax`` maps a calibration amax to a valid scale (amax / 448), never 0/NaN/Inf.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import jax_nvfp4
from jax_nvfp4 import sharding as shd

import store_cases as sc
from attention_cases import Case

PLATFORMS = ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)]
F32 = np.float32

#: Outside the contract: each is replaced by NaN.
INVALID = {
    "0": 0.0, "-0": -0.0, "negative": -0.01, "NaN": np.nan, "-NaN": -np.nan, "+Inf": np.inf,
    "-Inf": -np.inf, "subnormal 1e-40": 1e-40, "largest subnormal": 2.0**-126 - 2.0**-149,
    "2**117": 2.0**117, "float32 max": float(np.finfo(np.float32).max),
}
#: Inside, boundaries included.
VALID = {"2**-126": 2.0**-126, "1e-30": 1e-30, "amax/448": None, "1": 1.0, "2**116": 2.0**116}


def _bits(x):
    return np.asarray(x, np.float32).view(np.uint32)


# ------------------------------------------------------------------------- the contract itself


def test_constants():
    assert jax_nvfp4.MIN_SCALE == 2.0**-126 == float(np.finfo(np.float32).tiny)
    assert jax_nvfp4.MAX_SCALE == 2.0**116
    # The kernels' copy of the range (ffi/nvfp4_numerics.h: the store and the decode kernel
    # apply the rule themselves).
    from jax_nvfp4.primitive import _ffi
    assert (_ffi.MIN_SCALE, _ffi.MAX_SCALE) == (jax_nvfp4.MIN_SCALE, jax_nvfp4.MAX_SCALE)
    # The largest stored value at MAX_SCALE is finite, at the next power of two it is not.
    assert np.isfinite(F32(6 * 448) * F32(2.0**116))
    with np.errstate(over="ignore"):
        assert not np.isfinite(F32(6 * 448) * F32(2.0**117))


def test_sanitize_keeps_every_valid_scale_bit_for_bit():
    rng = np.random.default_rng(0)
    # Random float32 bit patterns of every exponent, plus the boundaries and their neighbours.
    bits = rng.integers(0, 2**32, 20000, dtype=np.uint64).astype(np.uint32)
    edges = np.array([2.0**-126, 2.0**116, 1.0, 1 / 448], np.float32)
    x = np.concatenate([bits.view(np.float32), edges, np.nextafter(edges, np.float32(0)),
                        np.nextafter(edges, np.float32(np.inf)),
                        np.array(list(INVALID.values()), np.float32)])
    with np.errstate(invalid="ignore"):
        valid = (x >= 2.0**-126) & (x <= 2.0**116)
    out = np.asarray(jax.jit(jax_nvfp4.checks.sanitize_scale)(x))
    np.testing.assert_array_equal(_bits(out[valid]), _bits(x[valid]))
    assert np.isnan(out[~valid]).all()
    np.testing.assert_array_equal(np.asarray(jax_nvfp4.checks.scale_is_valid(x)), valid)
    assert valid.sum() > 1000 and (~valid).sum() > 1000


# ------------------------------------------------------------------------- the store


def _case(seed=3, **kw):
    kw = dict(num_tokens=40, num_kv_heads=2, head_size=64, block_size=8, num_out_of_range=2) | kw
    return sc.make_case(seed, **kw)


def _poisoned_bytes(case, side):
    """What the store writes for every valid token of ``side`` with a NaN scale: scale byte
    0x7F, codes 7 with the input's sign bit."""
    x = (case.key if side == 0 else case.value)[case.valid_tokens()]
    sign = (x.view(np.uint16) >> 15).astype(np.uint8)                # [N, H, D]
    codes = 7 | (sign << 3)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    scales = np.full(x.shape[:-1] + (x.shape[-1] // 16,), 0x7F, np.uint8)
    return packed, scales


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("bad", list(INVALID), ids=list(INVALID))
def test_invalid_k_scale_poisons_k_rows(platform, bad):
    case = _case()
    good = sc.run_kernel(case, platform)
    bad_case = case.with_args(k_scale=np.float32(INVALID[bad]))
    out = sc.run_kernel(bad_case, platform)
    sc.assert_bytes_equal(out, sc.run_reference(bad_case), "kernel vs reference")
    sc.assert_only_expected_bytes_changed(case, out)
    packed, scales = case.read(out, 0)
    want_packed, want_scales = _poisoned_bytes(case, 0)
    np.testing.assert_array_equal(scales, want_scales)
    np.testing.assert_array_equal(packed, want_packed)
    # V was stored with its own (valid) scale: the same bytes as with a valid k_scale.
    for got, want in zip(case.read(out, 1), case.read(good, 1)):
        np.testing.assert_array_equal(got, want)
    # The poisoned rows read back NaN with any scale, V reads back finite.
    k, v = jax_nvfp4.dequantize(out, case.k_scale, case.v_scale, dtype=jnp.float32)
    slots = case.slot_mapping[case.valid_tokens()]
    flat = (-1,) + k.shape[2:]
    assert np.isnan(np.asarray(k).reshape(flat)[slots]).all()
    assert np.isfinite(np.asarray(v).reshape(flat)[slots]).all()


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("scale_search", ("default", "4over6"))
def test_invalid_v_scale_poisons_v_rows_fp16_nhd(platform, scale_search):
    case = _case(seed=5, dtype="fp16", layout="NHD", head_size=128, v_scale_swizzle=True)
    bad_case = case.with_args(v_scale=np.float32(0.0))
    out = sc.run_kernel(bad_case, platform, scale_search)
    sc.assert_bytes_equal(out, sc.run_reference(bad_case, scale_search), "kernel vs reference")
    sc.assert_only_expected_bytes_changed(case, out)
    for got, want in zip(case.read(out, 1), _poisoned_bytes(case, 1)):
        np.testing.assert_array_equal(got, want)
    _, k_scales = case.read(out, 0)
    assert not (k_scales == 0x7F).any()


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("name", list(VALID), ids=list(VALID))
def test_valid_scales_are_not_touched(platform, name):
    """Boundary scales are used as they are: kernel == reference == the independent numpy
    model of the spec (no NaN byte anywhere)."""
    case = _case(seed=8, num_tokens=6, num_out_of_range=0, num_padding=1)
    scale = VALID[name]
    if scale is not None:
        case = case.with_args(k_scale=np.float32(scale), v_scale=np.float32(scale))
    out = sc.run_kernel(case, platform)
    sc.assert_bytes_equal(out, sc.run_reference(case), "kernel vs reference")
    packed, scales = case.read(out, 0)
    assert not (scales == 0x7F).any()
    g = np.float32(1) / np.float32(case.k_scale)
    blocks = case.key[case.valid_tokens()].astype(np.float32).reshape(-1, 16)
    codes = sc.unpack(packed).reshape(-1, 16)
    for i in range(0, len(blocks), 7):
        want_codes, want_byte = sc.spec_quantize_block(blocks[i], g)
        assert scales.reshape(-1)[i] == want_byte
        np.testing.assert_array_equal(codes[i], want_codes)


def test_per_layer_scales_poison_only_their_layer():
    """vmap over stacked layers with one scale per layer: layer 1's NaN scale poisons layer 1
    only; the other layers' bytes equal separate stores."""
    case = _case(seed=11)
    layers = 3
    k_scales = np.array([case.k_scale, np.nan, case.k_scale * 2], np.float32)
    caches = np.stack([case.cache] * layers)
    store = jax.jit(jax.vmap(jax_nvfp4.reshape_and_cache, in_axes=(None, None, 0, None, 0, None)))
    out = np.asarray(store(case.key, case.value, caches, case.slot_mapping, k_scales,
                           case.v_scale))
    for layer in range(layers):
        one = case.with_args(k_scale=k_scales[layer])
        sc.assert_bytes_equal(out[layer], sc.run_reference(one), f"layer {layer}")
    assert (case.read(out[1], 0)[1] == 0x7F).all()
    assert not (case.read(out[0], 0)[1] == 0x7F).any()


# ------------------------------------------------------------------------- the readers


@pytest.mark.parametrize("bad", ["0", "NaN", "+Inf", "negative", "subnormal 1e-40", "2**117"])
def test_dequantize_reads_nan_with_an_invalid_scale(bad):
    case = _case()
    cache = sc.run_kernel(case)
    for name in ("k_scale", "v_scale"):
        scales = dict(k_scale=case.k_scale, v_scale=case.v_scale)
        scales[name] = INVALID[bad]
        k, v = jax_nvfp4.dequantize(cache, scales["k_scale"], scales["v_scale"],
                                    dtype=jnp.float32)
        poisoned, clean = (k, v) if name == "k_scale" else (v, k)
        assert np.isnan(np.asarray(poisoned)).all()
        assert not np.isnan(np.asarray(clean)).all()


@functools.lru_cache(maxsize=None)
def _attention_case(groups=None):
    return Case(7, lens=(1, 15, 40, 0), groups=groups)


@pytest.mark.parametrize("impl", ["auto", "jnp"])
@pytest.mark.parametrize("which", ["k_scale", "v_scale"])
@pytest.mark.parametrize("bad", ["0", "NaN", "-Inf", "negative", "subnormal 1e-40"])
def test_paged_attention_is_nan_with_an_invalid_scale(impl, which, bad):
    case = _attention_case()
    q = case.query(8, jnp.float32)
    args = list(case.args(q))
    out, lse = case.run(q, impl=impl, return_lse=True)
    assert np.isfinite(np.asarray(out)).all()
    args[4 if which == "k_scale" else 5] = jnp.float32(INVALID[bad])
    out, lse = jax_nvfp4.paged_attention(*args, **case.options, impl=impl, return_lse=True)
    assert np.isnan(np.asarray(out)).all() and np.isnan(np.asarray(lse)).all()
    # The grouped reader follows.
    grouped = _attention_case(groups=2)
    gargs = list(grouped.args(q, cache=grouped.grouped))
    gargs[4 if which == "k_scale" else 5] = jnp.float32(INVALID[bad])
    out = shd.paged_attention_grouped(*gargs, **grouped.options, impl=impl)
    assert np.isnan(np.asarray(out)).all()


@pytest.mark.gpu
@pytest.mark.parametrize("which", ["k_scale", "v_scale"])
@pytest.mark.parametrize("bad", ["0", "NaN", "+Inf", "negative", "subnormal 1e-40"])
def test_gpu_kernel_is_nan_with_an_invalid_scale(which, bad):
    case = _attention_case()
    gpu = jax.devices("gpu")[0]
    q = case.query(8, jnp.bfloat16)
    args = list(jax.device_put(case.args(q), gpu))
    args[4 if which == "k_scale" else 5] = jax.device_put(jnp.float32(INVALID[bad]), gpu)
    out, lse = jax.jit(functools.partial(jax_nvfp4.paged_attention, **case.options,
                                         impl="kernel", return_lse=True))(*args)
    assert np.isnan(np.asarray(out, np.float32)).all() and np.isnan(np.asarray(lse)).all()


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("which,bad", [("k_scale", "0"), ("v_scale", "NaN"),
                                       ("k_scale", "subnormal 1e-40")])
def test_ragged_paged_attention_is_nan_with_an_invalid_scale(platform, which, bad):
    """Every row of a ragged call (prefill chunks, drafts, one-token sequences, padding tokens)
    is NaN, lse too, on the jnp path and (GPU) the kernels; also with no sequence rows at all
    (max_num_seqs 0: zeros otherwise)."""
    from ragged_cases import RaggedCase
    device = jax.devices(platform)[0]
    case = RaggedCase(17, ((300, 40), (200, 3), (90, 1), (0, 1), (700, 1)))
    q = case.query(8, jnp.bfloat16)
    args = list(case.args(q))
    args[6 if which == "k_scale" else 7] = jnp.float32(INVALID[bad])
    impls = ["jnp", "auto"] + (["kernel"] if platform == "gpu" else [])
    for impl in impls:
        out, lse = jax.jit(functools.partial(jax_nvfp4.ragged_paged_attention, **case.options,
                                             impl=impl, return_lse=True))(
            *jax.device_put(args, device))
        assert np.isnan(np.asarray(out, np.float32)).all(), impl
        assert np.isnan(np.asarray(lse)).all(), impl
    # No sequence rows: the jnp path's early return follows the rule too.
    empty = (q[:3], case.cache, jnp.zeros((0, 4), jnp.int32), jnp.zeros((0,), jnp.int32),
             jnp.zeros((1,), jnp.int32), jnp.int32(0), jnp.float32(INVALID[bad]),
             case.v_scale)
    out, lse = jax_nvfp4.ragged_paged_attention(*jax.device_put(empty, device), **case.options,
                                                impl="jnp", return_lse=True)
    assert np.isnan(np.asarray(out, np.float32)).all() and np.isnan(np.asarray(lse)).all()


# ------------------------------------------------------------------------- checked=True


def _checked_store(case, scale_search="default"):
    return functools.partial(jax_nvfp4.reshape_and_cache, **sc.store_options(case, scale_search),
                             checked=True)


@functools.lru_cache(maxsize=None)
def _checkified_store(layout, scale_search, v_scale_swizzle):
    return checkify.checkify(jax.jit(functools.partial(
        jax_nvfp4.reshape_and_cache, layout=layout, scale_search=scale_search,
        v_scale_swizzle=v_scale_swizzle, checked=True)))


def _run_checked(case, scale_search="default"):
    """(error message or None, cache) of the checked store under checkify(jit)."""
    err, out = _checkified_store(**sc.store_options(case, scale_search))(
        *(jnp.asarray(a) for a in case.args()))
    return err.get(), out


def test_checked_store_reports_an_invalid_scale():
    case = _in_range(_case())
    for name in ("k_scale", "v_scale"):
        for bad, value in INVALID.items():
            message, _ = _run_checked(case.with_args(**{name: np.float32(value)}))
            assert message is not None and f"reshape_and_cache: {name} = " in message, bad
            assert "is not a valid global scale" in message and "scale_from_amax" in message
        # Eagerly the check raises.
        with pytest.raises(checkify.JaxRuntimeError, match=f"{name} = .* is not a valid "
                                                           f"global scale.*scale_from_amax"):
            _checked_store(case)(*case.with_args(**{name: np.float32(0)}).args())


def _in_range(case):
    return case.with_args(slot_mapping=np.where(case.slot_mapping < case.num_slots,
                                                case.slot_mapping, -1).astype(np.int32))


@pytest.mark.parametrize("divisor", [448.0, 2688.0])
@pytest.mark.parametrize("scale_search", ("default", "4over6"))
def test_checked_store_accepts_calibrated_scales(divisor, scale_search):
    for seed in range(4):
        case = _in_range(_case(seed=seed, scale_divisor=divisor,
                               dtype=("bf16", "fp16")[seed % 2]))
        message, out = _run_checked(case, scale_search)
        assert message is None, message
        sc.assert_bytes_equal(out, sc.run_reference(case, scale_search), "checked store")


@pytest.mark.parametrize("scale_search", ("default", "4over6"))
def test_checked_store_reports_a_scale_too_small_for_the_data(scale_search):
    case = _in_range(_case())
    amax = sc.amax(case.key)
    # 1e-30 (the case): everything clips. amax / 448 / 10: only the largest values.
    for k_scale, words in ((1e-30, "finite value(s) of key exceed 6 * 448 * k_scale"),
                           (amax / 448 / 10, "clipped")):
        message, _ = _run_checked(case.with_args(k_scale=np.float32(k_scale)), scale_search)
        assert "too small for this data" in message and words in message, message
    # v_scale likewise, named; eagerly it raises.
    bad = case.with_args(v_scale=np.float32(1e-30))
    with pytest.raises(checkify.JaxRuntimeError, match="of value exceed 6 \\* 448 \\* v_scale"):
        _checked_store(bad)(*bad.args())


@pytest.mark.parametrize("scale_search", ("default", "4over6"))
def test_checked_store_reports_a_scale_that_stores_only_zeros(scale_search):
    case = _in_range(_case())
    bad = case.with_args(k_scale=np.float32(1e30))
    assert "every value of key is stored as zero" in _run_checked(bad, scale_search)[0]
    # It is true: the stored K reads back as zeros.
    out = sc.run_kernel(bad, scale_search=scale_search)
    assert (case.read(out, 0)[1] == 0).all()
    # An all-zero key with the fallback scale is not an error (nothing to lose).
    zero = case.with_args(key=np.zeros_like(case.key),
                          k_scale=np.asarray(jax_nvfp4.scale_from_amax(0.0)))
    assert _run_checked(zero)[0] is None


@pytest.mark.parametrize("scale_search", ("default", "4over6"))
def test_checked_store_reports_an_inverted_scale(scale_search):
    """k_scale = 448 / amax (the calibration upside down) stores Gaussian data with mostly
    E4M3-subnormal block scales, not all zeros: reported by the count of such blocks."""
    rng = np.random.default_rng(20)
    key = rng.standard_normal((64, 2, 64)).astype(np.float32).astype(jnp.bfloat16)
    value = (0.7 * rng.standard_normal((64, 2, 64))).astype(np.float32).astype(jnp.bfloat16)
    case = sc.StoreCase(key, value, np.zeros(sc.cache_shape(8, 8, 2, 64, "HND"), np.uint8),
                        np.arange(64, dtype=np.int32), sc.amax(key) / F32(448),
                        sc.amax(value) / F32(448), num_blocks=8, block_size=8)
    assert _run_checked(case, scale_search)[0] is None
    for name, x in (("k_scale", key), ("v_scale", value)):
        inverted = case.with_args(**{name: F32(448) / sc.amax(x)})
        message, out = _run_checked(inverted, scale_search)
        side = "key" if name == "k_scale" else "value"
        assert message is not None, name
        assert f"blocks of {side} get a subnormal E4M3 block scale" in message, message
        assert f"{name} = " in message and "not 448 / amax" in message, message
        # What it reports is real: most stored block scales are subnormal, some are not zero,
        # and the read-back error is well above that of the calibrated scale.
        side_index = 0 if name == "k_scale" else 1
        scales = inverted.read(out, side_index)[1]
        assert np.mean((scales & 0x78) == 0) > 0.5 and np.any(scales != 0)
        errors = []
        for c in (case, inverted):
            k, v = jax_nvfp4.dequantize(sc.run_reference(c, scale_search), c.k_scale,
                                        c.v_scale, dtype=jnp.float32)
            back = np.asarray((k, v)[side_index]).reshape(-1, 2, 64)[:64]
            errors.append(np.linalg.norm(back - x.astype(np.float32))
                          / np.linalg.norm(x.astype(np.float32)))
        assert errors[1] > 1.2 * errors[0], errors  # measured: 0.095 -> 0.14-0.17 (4over6:
        #                                            0.087 -> 0.11-0.12)
    # Eagerly it raises.
    bad = case.with_args(k_scale=F32(448) / sc.amax(key))
    with pytest.raises(checkify.JaxRuntimeError, match="subnormal E4M3 block scale"):
        _checked_store(bad, scale_search)(*bad.args())


def test_checked_readers_report_an_invalid_scale():
    case = _attention_case()
    q = case.query(8, jnp.float32)
    grouped = _attention_case(groups=2)
    readers = {
        "paged_attention": lambda k, v: jax_nvfp4.paged_attention(
            *case.args(q)[:4], k, v, **case.options, checked=True),
        "paged_attention_grouped": lambda k, v: shd.paged_attention_grouped(
            *grouped.args(q, cache=grouped.grouped)[:4], k, v, **grouped.options, checked=True),
        "dequantize": lambda k, v: jax_nvfp4.dequantize(case.cache, k, v, **case.options,
                                                        checked=True),
        "dequantize_grouped": lambda k, v: shd.dequantize_grouped(
            grouped.grouped, k, v, **grouped.options, checked=True),
    }
    for where, read in readers.items():
        read(case.k_scale, case.v_scale)                  # valid: no error
        err, _ = checkify.checkify(jax.jit(read))(case.k_scale, case.v_scale)
        assert err.get() is None, (where, err.get())
        for name, bad in (("k_scale", 0.0), ("v_scale", np.nan), ("k_scale", -1.0)):
            scales = dict(k=case.k_scale, v=case.v_scale)
            scales[name[0]] = jnp.float32(bad)
            with pytest.raises(checkify.JaxRuntimeError,
                               match=f"{where}: {name} = .* is not a valid global scale"):
                read(scales["k"], scales["v"])
            err, _ = checkify.checkify(jax.jit(read))(scales["k"], scales["v"])
            assert f"{where}: {name} = " in err.get()


def test_checked_grouped_store_reports_scales():
    case = Case(7, lens=(1, 15, 40), groups=2)
    rng = np.random.default_rng(1)
    key = jnp.asarray(rng.standard_normal((3, 2, 128)), jnp.bfloat16)
    slots = jnp.array([0, 1, 2], jnp.int32)
    store = functools.partial(shd.reshape_and_cache_grouped, checked=True)
    store(key, key, case.grouped, slots, case.k_scale, case.v_scale)
    with pytest.raises(checkify.JaxRuntimeError, match="v_scale = .* is not a valid"):
        store(key, key, case.grouped, slots, case.k_scale, jnp.float32(0))
    with pytest.raises(checkify.JaxRuntimeError, match="of key exceed"):
        store(key, key, case.grouped, slots, jnp.float32(1e-30), case.v_scale)


# ------------------------------------------------------------------------- the scale's dtype
# One rule (checks.as_scale), the same eagerly and under jit: any real number is taken as
# float32. Before it, an eager np.float64 scale raised TypeError while under jit (which converts
# NumPy float64 arguments to float32) it worked.


def _scale_forms():
    """A scale as a caller may hand it over, each with the float32 it stands for (0.013 is not
    a float32: the float64 forms round)."""
    value = 0.013
    forms = {
        "python float": value, "numpy float64": np.float64(value),
        "numpy float64 (1,)": np.array([value], np.float64), "numpy float32": F32(value),
        "numpy float16": np.float16(value), "jnp bfloat16": jnp.bfloat16(value),
        "jnp float16 array": jnp.asarray(value, jnp.float16), "list": [value],
        "python int": 1, "numpy int32": np.int32(1), "jnp int32 array": jnp.asarray(1, jnp.int32),
    }
    return {name: (x, F32(np.asarray(x, np.float64).reshape(())))
            for name, x in forms.items()}


def _dtype_rule_calls():
    store_case = _in_range(_case())
    read_case = _attention_case()
    q = read_case.query(8, jnp.float32)

    def store(fn, k):
        return fn(*store_case.args()[:4], k, k, **sc.store_options(store_case))

    def attend(fn, k):
        return fn(*read_case.args(q)[:4], k, k, **read_case.options)

    def deq(fn, k):
        return fn(read_case.cache, k, k, **read_case.options, dtype=jnp.float32)

    return {"reshape_and_cache": functools.partial(store, jax_nvfp4.reshape_and_cache),
            "reference.reshape_and_cache": functools.partial(
                store, jax_nvfp4.reference.reshape_and_cache),
            "paged_attention": functools.partial(attend, jax_nvfp4.paged_attention),
            "dequantize": functools.partial(deq, jax_nvfp4.dequantize),
            "reshape_and_cache_grouped": lambda k: shd.reshape_and_cache_grouped(
                *store_case.args()[:2], jnp.zeros((1,) + store_case.cache.shape, jnp.uint8),
                store_case.slot_mapping, k, k, **sc.store_options(store_case))}


def _same(a, b):
    for x, y in zip(jax.tree.leaves(a), jax.tree.leaves(b)):
        assert np.array_equal(np.asarray(x), np.asarray(y), equal_nan=True)


def test_scale_dtype_rule_is_the_same_eagerly_and_under_jit():
    """Each form gives what its float32 value gives (eagerly, through jit's boundary, and as a
    constant under jit; each compared with the float32 scale run the same way: attention under
    jit may round differently from attention op by op)."""
    for where, call in _dtype_rule_calls().items():
        for name, (scale, as_float32) in _scale_forms().items():
            f32 = jnp.asarray(as_float32)
            _same(call(scale), call(f32))
            if not isinstance(scale, list):                            # jit takes no lists
                _same(jax.jit(call)(scale), jax.jit(call)(f32))
            _same(jax.jit(lambda: call(scale))(), jax.jit(lambda: call(f32))())


def test_scale_dtype_rule_with_x64():
    """With 64-bit types on, jit keeps a float64 scale float64: it is converted all the same."""
    with sc.x64():
        calls = _dtype_rule_calls()
        for scale in (np.float64(0.013), jnp.asarray(0.013, jnp.float64)):
            for where, call in calls.items():
                f32 = jnp.asarray(0.013, jnp.float32)
                _same(call(scale), call(f32))
                _same(jax.jit(call)(scale), jax.jit(call)(f32))


@pytest.mark.parametrize("bad", [True, np.bool_(False), jnp.asarray([True]), 1j,
                                 np.complex64(1), "0.01", None])
def test_scale_dtype_rule_refuses_what_is_not_a_real_number(bad):
    for where, call in _dtype_rule_calls().items():
        name = "k_scale"
        with pytest.raises(TypeError, match=f"{name} must be a real number"):
            call(bad)
        if hasattr(bad, "dtype") and not isinstance(bad, str):
            with pytest.raises(TypeError, match=f"{name} must be a real number"):
                jax.jit(call)(bad)


# ------------------------------------------------------------------------- scale_from_amax


@pytest.mark.parametrize("amax, expected", [
    (0.0, 1.0), (-0.0, 1.0), (np.nan, 1.0), (np.inf, 1.0), (-np.inf, 1.0), (-3.0, 1.0),
    (1e-40, 1.0),                                  # subnormal data is flushed to zero anyway
    (448.0, 1.0), (1.0, np.float32(1) / np.float32(448)), (3.5, np.float32(3.5) / np.float32(448)),
    (2.0**-126, 2.0**-126),                        # amax/448 would be subnormal: MIN_SCALE
    (3.0e38, 2.0**116),                            # amax/448 beyond MAX_SCALE
])
def test_scale_from_amax(amax, expected):
    got = jax_nvfp4.scale_from_amax(amax)
    assert got.dtype == jnp.float32 and got.shape == ()
    assert _bits(got) == _bits(np.float32(expected)), (float(got), expected)


def test_scale_from_amax_arrays_jit_and_fallback():
    rng = np.random.default_rng(2)
    amax = np.concatenate([np.abs(rng.standard_normal(64)).astype(np.float32) * 10,
                           [0, np.nan, np.inf, 1e-45, 3e38]]).astype(np.float32)
    got = np.asarray(jax.jit(jax_nvfp4.scale_from_amax)(amax.reshape(-1, 1)))
    assert got.shape == (69, 1)
    assert np.asarray(jax_nvfp4.checks.scale_is_valid(got)).all()
    np.testing.assert_array_equal(got[:64, 0], amax[:64] / np.float32(448))
    got = jax_nvfp4.scale_from_amax(jnp.zeros(3, jnp.bfloat16), fallback=0.5)
    np.testing.assert_array_equal(np.asarray(got), [0.5] * 3)
    for fallback in (0.0, np.nan, np.inf, 1e-40, -1.0):
        with pytest.raises(ValueError, match="fallback"):
            jax_nvfp4.scale_from_amax(1.0, fallback=fallback)
    with pytest.raises(TypeError, match="amax"):
        jax_nvfp4.scale_from_amax(jnp.zeros(2, jnp.bool_))


def test_all_zero_calibration_batch_then_real_data():
    """amax / 448 over an all-zero (padding) batch was 0 and destroyed the cache; with
    scale_from_amax the fallback scale stores later data (|x| <= 2688) with the usual error."""
    case = _in_range(_case(seed=13))
    zeros = np.zeros_like(case.key)
    scale = jax_nvfp4.scale_from_amax(jnp.max(jnp.abs(jnp.asarray(zeros, jnp.float32))))
    assert float(scale) == 1.0
    real = case.with_args(k_scale=np.asarray(scale), v_scale=np.asarray(scale))
    out = sc.run_kernel(real)
    k, _ = jax_nvfp4.dequantize(out, scale, scale, dtype=jnp.float32)
    slots = real.slot_mapping[real.valid_tokens()]
    got = np.asarray(k).reshape(-1, *k.shape[2:])[slots]
    want = case.key[real.valid_tokens()].astype(np.float32)
    assert np.linalg.norm(got - want) / np.linalg.norm(want) < 0.15
