"""Quiet failures that are now caught or decided (the global scale has tests/test_scales.py):

* readers' ``checked=True``: block-table entries inside ``seq_len`` that are not page ids, and
  lengths outside ``[0, max_blocks_per_seq * block_size]``, are reported; padding stays free;
  unchecked they are clamped (documented), never wrapped;
* layout mix-ups: an error that names the layout the cache's shape fits;
* options: one validation for every public function (bools are bools, dtypes float dtypes,
  sizes ints);
* host slot mappings, block tables and lengths that do not fit the dtype they are used in are
  an error, never a wrap;
* ``jax.vmap`` over an empty batch; ``checked=True`` under a plain ``jit`` says what to do.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import jax_nvfp4
from jax_nvfp4 import reference
from jax_nvfp4 import sharding as shd

import store_cases as sc
from attention_cases import Case

PLATFORMS = ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)]
WRAP = 2**32 + 3          # wraps to 3 in int32


@functools.lru_cache(maxsize=None)
def _case(groups=None, layout="HND"):
    """Every page owned (no spare pages): a clamped read is finite, so only the check sees it."""
    return Case(21, lens=(40, 83, 16, 33, 0), layout=layout, junk=False, extra_pages=0,
                groups=groups)


def _checked(fn, **options):
    return checkify.checkify(jax.jit(functools.partial(fn, **options, checked=True)))


# ------------------------------------------------------------------------- readers, checked


def _bad_tables(case):
    tables = case.tables.copy()
    tables[1, 3] = case.num_blocks        # inside seq_len 83 (6 pages)
    tables[2, 0] = -1                     # inside seq_len 16 (1 page)
    return tables


@pytest.mark.parametrize("impl", ["auto", "jnp"])
def test_checked_paged_attention_reports_pages_inside_seq_len(impl):
    case = _case()
    q = case.query(8, jnp.float32)
    tables = _bad_tables(case)
    # Eagerly it raises, naming the first bad entry.
    with pytest.raises(checkify.JaxRuntimeError,
                       match=r"paged_attention: 2 block_tables entries inside seq_len are not "
                             r"page ids in \[0, num_blocks = 13\); first: block_tables\[1, 3\] "
                             r"= 13 with seq_lens\[1\] = 83"):
        jax_nvfp4.paged_attention(*case.args(q, tables=tables), **case.options, impl=impl,
                                  checked=True)
    err, out = _checked(jax_nvfp4.paged_attention, **case.options, impl=impl)(
        *case.args(q, tables=tables))
    assert "block_tables[1, 3] = 13" in err.get()
    # Unchecked (the documented behaviour): clamped to page 0 / the last page.
    clamped = np.clip(tables, 0, case.num_blocks - 1)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(case.run(q, tables=clamped,
                                                                        impl=impl)))
    assert not np.allclose(np.asarray(out), case.reference(q), atol=1e-2)


@pytest.mark.parametrize("value", [-1, -7, 13, 1000, 2**31 - 1, -2**31])
def test_checked_reader_reports_every_kind_of_bad_id(value):
    case = _case()
    q = case.query(8, jnp.float32)
    tables = case.tables.copy()
    tables[3, 2] = value                  # seq_len 33: pages 0..2
    err, _ = _checked(jax_nvfp4.paged_attention, **case.options)(*case.args(q, tables=tables))
    assert f"block_tables[3, 2] = {value}" in err.get()


def test_checked_reader_leaves_padding_free():
    case = _case()
    q = case.query(8, jnp.float32)
    tables = case.tables.copy()
    pad = tables < 0                      # past every sequence's pages, and the seq_len 0 row
    assert pad[4].all() and pad.sum() > 8
    rng = np.random.default_rng(3)
    tables[pad] = rng.choice(np.array([-1, -9, 16, 99, 2**31 - 1, -2**31], np.int64),
                             pad.sum()).astype(np.int32)
    err, out = _checked(jax_nvfp4.paged_attention, **case.options)(*case.args(q, tables=tables))
    assert err.get() is None
    np.testing.assert_array_equal(np.asarray(out), np.asarray(case.run(q)))
    # The last page of a sequence counts from ceil(seq_len / block_size): seq_len 33 reads 3
    # pages, so column 3 of row 3 is padding.
    tables = case.tables.copy()
    tables[3, 3] = -1
    assert _checked(jax_nvfp4.paged_attention, **case.options)(
        *case.args(q, tables=tables))[0].get() is None


@pytest.mark.parametrize("lens, words", [
    ([40, 83, -1, 33, 0], "1 value(s) of seq_lens are negative (read as 0); first: "
                          "seq_lens[2] = -1"),
    ([40, 83, 16, 33, 97], "1 value(s) of seq_lens exceed max_blocks_per_seq * block_size = "
                           "8 * 16 = 128"),
])
def test_checked_reader_reports_lengths(lens, words):
    case = _case()
    q = case.query(8, jnp.float32)
    if "exceed" in words:
        lens[4] = case.max_blocks * 16 + 1
        words = words.replace("8 * 16 = 128", f"{case.max_blocks} * 16 = "
                                              f"{case.max_blocks * 16}")
    err, _ = _checked(jax_nvfp4.paged_attention, **case.options)(*case.args(q, lens=lens))
    assert words in err.get(), err.get()


def test_checked_grouped_and_bf16_readers():
    case = _case(groups=2)
    q = case.query(8, jnp.float32)
    tables = _bad_tables(case)
    grouped = _checked(shd.paged_attention_grouped, **case.options)
    assert grouped(*case.args(q, cache=case.grouped))[0].get() is None
    message = grouped(*case.args(q, tables=tables, cache=case.grouped))[0].get()
    assert "paged_attention_grouped: 2 block_tables entries" in message
    k, v = case.bf16_caches()
    twin = _checked(jax_nvfp4.paged_attention_bf16)
    assert twin(q, k, v, jnp.asarray(case.tables), jnp.asarray(case.lens))[0].get() is None
    message = twin(q, k, v, jnp.asarray(tables), jnp.asarray(case.lens))[0].get()
    assert "paged_attention_bf16: 2 block_tables entries" in message
    with pytest.raises(checkify.JaxRuntimeError, match="paged_attention_bf16: 2 block_tables"):
        jax_nvfp4.paged_attention_bf16(q, k, v, tables, case.lens, checked=True)


@pytest.mark.gpu
def test_gpu_checked_kernel_reports_pages_inside_seq_len():
    case = _case()
    gpu = jax.devices("gpu")[0]
    q = case.query(8, jnp.bfloat16)
    args = jax.device_put(case.args(q, tables=_bad_tables(case)), gpu)
    err, out = _checked(jax_nvfp4.paged_attention, **case.options, impl="kernel")(*args)
    assert "block_tables[1, 3] = 13" in err.get()
    err, _ = _checked(jax_nvfp4.paged_attention, **case.options, impl="kernel")(
        *jax.device_put(case.args(q), gpu))
    assert err.get() is None


# ------------------------------------------------------------------------- int64 ids: no wrap


def test_host_block_tables_and_lengths_must_fit_int32():
    case = _case()
    q = case.query(8, jnp.float32)
    for x64 in (False, True):
        with sc.x64() if x64 else _nothing():
            tables = case.tables.astype(np.int64)
            tables[0, 0] = WRAP
            with pytest.raises(ValueError, match=r"block_tables holds 4294967299 \(at index "
                                                 r"\(0, 0\)\), which does not fit int32"):
                jax_nvfp4.paged_attention(*case.args(q)[:2], tables, case.lens,
                                          case.k_scale, case.v_scale)
            lens = np.array(case.lens, np.int64)
            lens[1] = -WRAP
            with pytest.raises(ValueError, match="seq_lens holds -4294967299"):
                jax_nvfp4.paged_attention(q, case.cache, case.tables, lens, case.k_scale,
                                          case.v_scale)
            with pytest.raises(ValueError, match="block_tables holds 4294967299"):
                shd.paged_attention_grouped(q, _case(groups=2).grouped, tables, case.lens,
                                            case.k_scale, case.v_scale)
            with pytest.raises(ValueError, match="block_tables holds 4294967299"):
                jax_nvfp4.paged_attention_bf16(q, *case.bf16_caches(), tables.tolist(),
                                               case.lens)


def test_device_int64_block_tables_are_clamped_not_wrapped():
    """With x64 on, an int64 id of 2**32 + 3 inside seq_len reads the last page (clamped, as
    any out-of-range id), not page 3 (wrapped); checked=True reports it."""
    case = _case()
    q = case.query(8, jnp.float32)
    with sc.x64():
        tables = jnp.asarray(case.tables, jnp.int64).at[1, 2].set(WRAP)
        out = jax_nvfp4.paged_attention(q, case.cache, tables, jnp.asarray(case.lens, jnp.int64),
                                        case.k_scale, case.v_scale, **case.options)
        err, _ = _checked(jax_nvfp4.paged_attention, **case.options)(
            q, case.cache, tables, jnp.asarray(case.lens), case.k_scale, case.v_scale)
    clamped = case.tables.copy()
    clamped[1, 2] = case.num_blocks - 1
    np.testing.assert_array_equal(np.asarray(out), np.asarray(case.run(q, tables=clamped)))
    assert f"block_tables[1, 2] = {WRAP}" in err.get()


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


# ------------------------------------------------------------------------- slots: no wrap


def _store_case():
    return sc.make_case(31, num_tokens=12, num_kv_heads=2, head_size=64, block_size=4,
                        num_padding=2)


@pytest.mark.parametrize("form", ["numpy int64", "list", "numpy uint64"])
@pytest.mark.parametrize("checked", [False, True])
def test_host_slots_that_would_wrap_are_an_error(form, checked):
    case = _store_case()
    slots = case.slot_mapping.astype(np.int64)
    slots[5] = WRAP
    if form == "list":
        slots = slots.tolist()
    elif form == "numpy uint64":
        slots = np.where(slots < 0, 0, slots).astype(np.uint64)
    args = list(case.args())
    args[3] = slots
    target = "uint32" if form == "numpy uint64" else "int32"   # what JAX would make of it
    with pytest.raises(ValueError, match=rf"slot_mapping holds 4294967299 \(at index \(5,\)\), "
                                         rf"which does not fit {target}.*wrap"):
        jax_nvfp4.reshape_and_cache(*args, checked=checked)


def test_host_slots_that_would_wrap_every_entry_point():
    case = _store_case()
    slots = case.slot_mapping.astype(np.int64)
    slots[2] = -WRAP                         # would wrap to -3 + 2**32 ... any wrap is refused
    args = list(case.args())
    args[3] = slots
    calls = {
        "reshape_and_cache": lambda: jax_nvfp4.reshape_and_cache(*args),
        "reference": lambda: reference.reshape_and_cache(*args),
        "grouped": lambda: shd.reshape_and_cache_grouped(
            args[0], args[1], jnp.zeros((2,) + case.cache.shape, jnp.uint8), slots,
            args[4], args[5]),
        "slot_mapping_problems": lambda: jax_nvfp4.slot_mapping_problems(slots, case.num_slots),
        "layer_slots": lambda: shd.layer_slots(slots, 1, case.num_blocks, case.block_size),
    }
    for name, call in calls.items():
        with pytest.raises(ValueError, match="slot_mapping holds -4294967299"):
            call()


def test_host_slots_that_fit_are_unchanged():
    """int64 slots that fit int32 (out-of-range ones included: skipped) give the int32 bytes;
    with x64 on, 2**32 + 3 fits int64 and is skipped (out of range), not wrapped."""
    case = _store_case()
    want = sc.run_reference(case)
    args = list(case.args())
    args[3] = case.slot_mapping.astype(np.int64)
    sc.assert_bytes_equal(jax_nvfp4.reshape_and_cache(*args), want, "int64 host slots")
    with sc.x64():
        slots = case.slot_mapping.astype(np.int64)
        slots[slots < 0] = WRAP
        args[3] = slots
        out = jax_nvfp4.reshape_and_cache(*args, checked=False)
        sc.assert_bytes_equal(out, want, "x64: 2**32 + 3 skipped")
        with pytest.raises(checkify.JaxRuntimeError, match=">= num_blocks\\*block_size"):
            jax_nvfp4.reshape_and_cache(*args, checked=True)


# ------------------------------------------------------------------------- layouts


def _hnd_store_args(num_kv_heads, block_size, head_size=64):
    rng = np.random.default_rng(4)
    key = jnp.asarray(rng.standard_normal((5, num_kv_heads, head_size)), jnp.bfloat16)
    cache = jax_nvfp4.allocate_kv_cache(4, block_size, num_kv_heads, head_size, "HND")
    return key, key, cache, jnp.arange(5, dtype=jnp.int32), 0.01, 0.01


@pytest.mark.parametrize("fn", [jax_nvfp4.reshape_and_cache, reference.reshape_and_cache])
def test_store_with_the_other_layout_names_it(fn):
    # 2 heads x 16 rows: read as NHD, block_size would be 2.
    with pytest.raises(ValueError, match=r"kv_cache block_size must be a positive multiple of "
                                         r"4, got 2\. kv_cache has the HND shape for "
                                         r"num_kv_heads=2, block_size=16, head_size=64; was it "
                                         r"written with layout='HND'\?"):
        fn(*_hnd_store_args(2, 16), layout="NHD")
    # 4 heads x 8 rows: read as NHD it is a valid cache of 8 heads x 4 rows, not key's 4 heads.
    with pytest.raises(ValueError, match=r"does not match key \(num_kv_heads=4.*kv_cache has "
                                         r"the HND shape for num_kv_heads=4, block_size=8"):
        fn(*_hnd_store_args(4, 8), layout="NHD")


def test_readers_with_the_other_layout_name_it():
    cache = jax_nvfp4.allocate_kv_cache(4, 16, 2, 64, "NHD")   # [4, 2, 16, 2, 36]
    with pytest.raises(ValueError, match="kv_cache has the NHD shape for num_kv_heads=2, "
                                         "block_size=16.*layout='NHD'"):
        jax_nvfp4.dequantize(cache, 1.0, 1.0)
    q = jnp.zeros((1, 4, 64), jnp.float32)
    with pytest.raises(ValueError, match="kv_cache has the NHD shape"):
        jax_nvfp4.paged_attention(q, cache, np.zeros((1, 1), np.int32), [1], 1.0, 1.0)
    # Both readings are valid caches but only the other one fits q's heads.
    cache = jax_nvfp4.allocate_kv_cache(4, 8, 4, 64, "HND")    # [4, 2, 4, 8, 36]
    q = jnp.zeros((1, 4, 64), jnp.float32)                     # 4 q heads: not a multiple of 8
    with pytest.raises(ValueError, match="multiple of kv_cache num_kv_heads 8.*HND shape for "
                                         "num_kv_heads=4, block_size=8"):
        jax_nvfp4.paged_attention(q, cache, np.zeros((1, 1), np.int32), [1], 1.0, 1.0,
                                  layout="NHD")


def test_a_shape_that_fits_both_layouts_is_read_as_told():
    """The documented limit: the bytes do not record the layout. A cache with num_kv_heads ==
    block_size has the same shape in both layouts; read with the wrong one it gives other
    values, with no error."""
    key = jnp.asarray(np.random.default_rng(5).standard_normal((8, 4, 64)), jnp.bfloat16)
    cache = jax_nvfp4.allocate_kv_cache(2, 4, 4, 64, "HND")
    assert cache.shape == jax_nvfp4.kv_cache_shape(2, 4, 4, 64, "NHD")
    cache = jax_nvfp4.reshape_and_cache(key, key, cache, jnp.arange(8, dtype=jnp.int32),
                                        0.01, 0.01)
    right, _ = jax_nvfp4.dequantize(cache, 0.01, 0.01, layout="HND", dtype=jnp.float32)
    wrong, _ = jax_nvfp4.dequantize(cache, 0.01, 0.01, layout="NHD", dtype=jnp.float32)
    assert not np.array_equal(np.asarray(right), np.asarray(wrong))


# ------------------------------------------------------------------------- options


def _store_call(fn=jax_nvfp4.reshape_and_cache):
    args = _hnd_store_args(2, 8)
    return lambda **kw: fn(*args, **kw)


def _cache():
    return jax_nvfp4.allocate_kv_cache(4, 8, 2, 64)


def _attention(fn, grouped=False):
    cache = jnp.zeros((2,) + _cache().shape, jnp.uint8) if grouped else _cache()
    q = jnp.zeros((1, 4, 64), jnp.float32)
    return lambda **kw: fn(q, cache, np.zeros((1, 1), np.int32), np.ones(1, np.int32), 1.0, 1.0,
                           **kw)


def _grouped_store(**kw):
    key, value, _, slots, k, v = _hnd_store_args(2, 8)
    cache = jnp.zeros(shd.grouped_kv_cache_shape(2, 4, 8, 2, 64), jnp.uint8)
    return shd.reshape_and_cache_grouped(key, value, cache, slots, k, v, **kw)


def _bf16(**kw):
    k = jnp.zeros((4, 8, 2, 64), jnp.bfloat16)
    return jax_nvfp4.paged_attention_bf16(jnp.zeros((1, 4, 64), jnp.float32), k, k,
                                          np.zeros((1, 1), np.int32), np.ones(1, np.int32), **kw)


#: Every public function taking options -> the options it takes.
PUBLIC = {
    "reshape_and_cache": (_store_call(), ("layout", "scale_search", "v_scale_swizzle",
                                          "checked")),
    "reference.reshape_and_cache": (_store_call(reference.reshape_and_cache),
                                    ("layout", "scale_search", "v_scale_swizzle")),
    "dequantize": (lambda **kw: jax_nvfp4.dequantize(_cache(), 1.0, 1.0, **kw),
                   ("layout", "v_scale_swizzle", "dtype", "checked")),
    "reference.dequantize": (lambda **kw: reference.dequantize(_cache(), 1.0, 1.0, **kw),
                             ("layout", "v_scale_swizzle", "dtype")),
    "paged_attention": (_attention(jax_nvfp4.paged_attention),
                        ("layout", "v_scale_swizzle", "return_lse", "impl", "checked")),
    "reference.paged_attention": (_attention(reference.paged_attention),
                                  ("layout", "v_scale_swizzle", "return_lse")),
    "paged_attention_bf16": (_bf16, ("checked",)),
    "sharding.reshape_and_cache_grouped": (_grouped_store, ("layout", "scale_search",
                                                            "v_scale_swizzle", "checked")),
    "sharding.dequantize_grouped": (
        lambda **kw: shd.dequantize_grouped(jnp.zeros((2,) + _cache().shape, jnp.uint8), 1.0,
                                            1.0, **kw),
        ("layout", "v_scale_swizzle", "dtype", "checked")),
    "sharding.paged_attention_grouped": (_attention(shd.paged_attention_grouped, grouped=True),
                                         ("layout", "v_scale_swizzle", "return_lse", "impl",
                                          "checked")),
}
BAD = {
    "layout": [("hnd", ValueError), (None, ValueError), (0, ValueError)],
    "scale_search": [("4/6", ValueError), (None, ValueError)],
    "v_scale_swizzle": [(0, TypeError), (1, TypeError), (None, TypeError), ("no", TypeError),
                        ("yes", TypeError), (1.0, TypeError)],
    "checked": [("no", TypeError), (0, TypeError), (None, TypeError)],
    "return_lse": [("no", TypeError), (1, TypeError)],
    "dtype": [(jnp.int8, TypeError), (bool, TypeError), (np.uint8, TypeError), ("int32", TypeError),
              ("nonsense", TypeError), (object, TypeError)],
    "impl": [("cuda", ValueError), (None, ValueError)],
}
CASES = [(fn, option, bad, error) for fn, (_, options) in PUBLIC.items() for option in options
         for bad, error in BAD[option]]


@pytest.mark.parametrize("fn, option, bad, error", CASES,
                         ids=[f"{f}-{o}={b!r}" for f, o, b, _ in CASES])
def test_every_public_function_validates_its_options(fn, option, bad, error):
    call, _ = PUBLIC[fn]
    with pytest.raises(error, match=option):
        call(**{option: bad})


@pytest.mark.parametrize("fn", list(PUBLIC))
def test_numpy_bools_and_float_dtypes_are_accepted(fn):
    call, options = PUBLIC[fn]
    kw = {o: np.bool_(o == "v_scale_swizzle") for o in options
          if o in ("v_scale_swizzle", "checked", "return_lse")}
    if "dtype" in options:
        kw["dtype"] = np.float32
    call(**kw)


@pytest.mark.parametrize("call, words", [
    (lambda: jax_nvfp4.kv_cache_shape(4.0, 16, 2, 64), "num_blocks must be an int"),
    (lambda: jax_nvfp4.kv_cache_shape(4, True, 2, 64), "block_size must be an int"),
    (lambda: jax_nvfp4.allocate_kv_cache(4, 16, 2.0, 64), "num_kv_heads must be an int"),
    (lambda: jax_nvfp4.kv_cache_shape(4, 16, 2, "64"), "head_size must be an int"),
    (lambda: shd.grouped_kv_cache_shape(2.0, 4, 16, 2, 64), "num_groups must be an int"),
    (lambda: shd.split_heads(jnp.zeros((3, 4, 16)), True), "num_groups must be an int"),
    (lambda: shd.layer_slots(np.arange(3), 1, 4.0, 16), "num_blocks must be an int"),
    (lambda: jax_nvfp4.slot_mapping_problems(np.arange(3), 64.0), "num_slots must be an int"),
])
def test_sizes_must_be_ints(call, words):
    with pytest.raises(TypeError, match=words):
        call()


# ------------------------------------------------------------------------- vmap, plain jit


@pytest.mark.parametrize("cache_batched", [True, False])
def test_vmap_over_an_empty_batch(cache_batched):
    key = jnp.zeros((0, 5, 2, 64), jnp.bfloat16)
    cache = _cache()
    caches = jnp.zeros((0,) + cache.shape, jnp.uint8) if cache_batched else cache
    store = jax.vmap(jax_nvfp4.reshape_and_cache,
                     in_axes=(0, 0, 0 if cache_batched else None, None, 0, 0))
    args = (key, key, caches, jnp.arange(5, dtype=jnp.int32), jnp.ones(0), jnp.ones(0))
    assert store(*args).shape == (0,) + cache.shape
    assert jax.jit(store)(*args).shape == (0,) + cache.shape
    q = jnp.zeros((0, 3, 4, 64), jnp.float32)
    read = jax.vmap(jax_nvfp4.paged_attention,
                    in_axes=(0, 0 if cache_batched else None, None, None, 0, 0))
    args = (q, caches, jnp.zeros((3, 2), jnp.int32), jnp.ones(3, jnp.int32), jnp.ones(0),
            jnp.ones(0))
    assert read(*args).shape == jax.jit(read)(*args).shape == (0, 3, 4, 64)


@pytest.mark.parametrize("name", ["reshape_and_cache", "reshape_and_cache_grouped",
                                  "dequantize", "dequantize_grouped", "paged_attention",
                                  "paged_attention_grouped", "paged_attention_bf16"])
def test_checked_under_plain_jit_says_what_to_do(name):
    case = _case(groups=2)
    q = case.query(8, jnp.float32)
    key = jnp.zeros((3, 2, 128), jnp.bfloat16)
    slots = jnp.arange(3, dtype=jnp.int32)
    calls = {
        "reshape_and_cache": (jax_nvfp4.reshape_and_cache,
                              (key, key, case.cache, slots, case.k_scale, case.v_scale)),
        "reshape_and_cache_grouped": (shd.reshape_and_cache_grouped,
                                      (key, key, case.grouped, slots, case.k_scale,
                                       case.v_scale)),
        "dequantize": (jax_nvfp4.dequantize, (case.cache, case.k_scale, case.v_scale)),
        "dequantize_grouped": (shd.dequantize_grouped, (case.grouped, case.k_scale,
                                                        case.v_scale)),
        "paged_attention": (jax_nvfp4.paged_attention, case.args(q)),
        "paged_attention_grouped": (shd.paged_attention_grouped,
                                    case.args(q, cache=case.grouped)),
        "paged_attention_bf16": (jax_nvfp4.paged_attention_bf16,
                                 (q, *case.bf16_caches(), jnp.asarray(case.tables),
                                  jnp.asarray(case.lens))),
    }
    fn, args = calls[name]
    with pytest.raises(ValueError, match=rf"{name}\(checked=True\) under jax.jit .* needs "
                                         rf"jax.experimental.checkify.checkify around"):
        jax.jit(functools.partial(fn, checked=True))(*args)
    err, _ = checkify.checkify(jax.jit(functools.partial(fn, checked=True)))(*args)
    assert err.get() is None
    err, _ = jax.jit(checkify.checkify(functools.partial(fn, checked=True)))(*args)
    assert err.get() is None


def test_checkify_marker_rule_takes_both_argument_conventions():
    """checkify calls a rule as (error, enabled_errors, x) up to JAX 0.10 and as (ctx, error,
    enabled_errors, x) from 0.11 (found on jax 0.11.2): the marker's rule serves both, whichever
    JAX runs the suite."""
    from jax._src import checkify as checkify_impl

    from jax_nvfp4 import checks

    rule = checkify_impl.error_checks[checks._CHECKIFY_MARKER]
    error, x = object(), jnp.arange(3)
    for args in [(error, frozenset(), x), (object(), error, frozenset(), x)]:
        out_error, out = rule(*args, where="f")
        assert out_error is error and out is x


@pytest.mark.gpu
def test_gpu_vmap_over_an_empty_batch():
    gpu = jax.devices("gpu")[0]
    cache = jax.device_put(jnp.zeros((0,) + _cache().shape, jnp.uint8), gpu)
    key = jax.device_put(jnp.zeros((0, 5, 2, 64), jnp.bfloat16), gpu)
    store = jax.jit(jax.vmap(jax_nvfp4.reshape_and_cache, in_axes=(0, 0, 0, None, 0, 0)))
    assert store(key, key, cache, jnp.arange(5, dtype=jnp.int32), jnp.ones(0),
                 jnp.ones(0)).shape == cache.shape
    read = jax.jit(jax.vmap(functools.partial(jax_nvfp4.paged_attention, impl="kernel"),
                            in_axes=(0, 0, None, None, 0, 0)))
    q = jax.device_put(jnp.zeros((0, 3, 4, 64), jnp.bfloat16), gpu)
    assert read(q, cache, jnp.zeros((3, 2), jnp.int32), jnp.ones(3, jnp.int32), jnp.ones(0),
                jnp.ones(0)).shape == (0, 3, 4, 64)
