"""The store kernel against the jnp reference, byte for byte on the whole cache.

Every comparison is of the full uint8 cache (jax_nvfp4.testing.assert_caches_equal, which
names the first differing block), starting from a RANDOM initial cache; besides, the bytes
outside the stored (slot, head) positions (computed from docs/format.md §4 in store_cases,
independently of the library) must equal the initial cache, and running the same store on the
bitwise complement of the initial cache proves that every expected byte was written (a written
byte cannot coincide with both c and ~c).

The kernel runs on ``jax.devices(platform)[0]`` under ``jax.jit``; the reference always runs on
the CPU. The ``gpu`` parameter is skipped where no GPU is visible (tests/conftest.py).
"""

from __future__ import annotations

import functools
import itertools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

import jax_nvfp4

import store_cases as sc

PLATFORMS = ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)]
SCALE_SEARCHES = ("default", "4over6")

# ---------------------------------------------------------------------------------------------
# The covering design. A full cartesian product recompiles for every shape and takes far too
# long, so: every layout x scale_search x dtype combination appears (rows 0-7 are exactly those
# eight), and every value of every other axis appears at least once, rotated across the rows.
# test_covering_design_is_complete checks both properties, so the coverage stays visible.
#
#   layout  search   dtype  head  swizzle  block  tokens  k_scale=amax/  heads  scale  oob
COVER = [
    ("HND", "default", "bf16", 128, True,  16,   21,    448,  2, (),   0),
    ("HND", "default", "fp16", 64,  True,  4,    1000,  2688, 4, (1,), 7),
    ("HND", "4over6",  "bf16", 256, True,  32,   1000,  448,  1, (),   0),
    ("HND", "4over6",  "fp16", 80,  False, 8,    1,     2688, 2, (),   0),
    ("NHD", "default", "bf16", 96,  False, 32,   21,    2688, 3, (1,), 2),
    ("NHD", "default", "fp16", 256, True,  8,    21,    448,  2, (),   0),
    ("NHD", "4over6",  "bf16", 64,  True,  16,   1,     2688, 8, (1,), 0),
    ("NHD", "4over6",  "fp16", 128, False, 4,    1000,  448,  2, (),   3),
    ("HND", "default", "bf16", 80,  False, 4,    21,    448,  1, (),   0),
    ("NHD", "4over6",  "bf16", 128, True,  8,    21,    2688, 4, (),   1),
    ("HND", "4over6",  "fp16", 96,  False, 16,   21,    448,  2, (1,), 0),
]
AXES = ("layout", "scale_search", "dtype", "head_size", "v_scale_swizzle", "block_size",
        "num_tokens", "scale_divisor", "num_kv_heads", "scale_shape", "num_out_of_range")
REQUIRED_VALUES = {
    "layout": {"HND", "NHD"},
    "scale_search": {"default", "4over6"},
    "dtype": {"bf16", "fp16"},
    "head_size": {64, 128, 256, 80, 96},
    "v_scale_swizzle": {True, False},
    "block_size": {4, 8, 16, 32},
    "num_tokens": {1, 21, 1000},
    "scale_divisor": {448, 2688},
    "scale_shape": {(), (1,)},
}


def _case_id(row):
    d = dict(zip(AXES, row))
    return (f"{d['layout']}-{d['scale_search']}-{d['dtype']}-D{d['head_size']}"
            f"{'' if d['v_scale_swizzle'] else '-linearV'}-bs{d['block_size']}-"
            f"T{d['num_tokens']}-div{d['scale_divisor']}")


def _build(seed, row):
    d = dict(zip(AXES, row))
    case = sc.make_case(seed, num_tokens=d["num_tokens"], num_kv_heads=d["num_kv_heads"],
                        head_size=d["head_size"], block_size=d["block_size"], dtype=d["dtype"],
                        layout=d["layout"], v_scale_swizzle=d["v_scale_swizzle"],
                        scale_divisor=d["scale_divisor"], scale_shape=d["scale_shape"],
                        num_out_of_range=d["num_out_of_range"])
    return case, d["scale_search"]


def test_covering_design_is_complete():
    rows = [dict(zip(AXES, r)) for r in COVER]
    combos = {(r["layout"], r["scale_search"], r["dtype"]) for r in rows}
    assert combos == set(itertools.product(("HND", "NHD"), SCALE_SEARCHES, ("bf16", "fp16")))
    for axis, values in REQUIRED_VALUES.items():
        assert {r[axis] for r in rows} >= values, axis
    for r in rows:  # swizzled V scales need head_size % 64 == 0 (docs/format.md §4)
        assert r["head_size"] % 64 == 0 or not r["v_scale_swizzle"]
    assert any(r["num_out_of_range"] for r in rows)


def check_store(case, platform, scale_search):
    """Kernel == reference on the whole cache, only the expected bytes written, all of them."""
    ref = sc.run_reference(case, scale_search)
    out = sc.run_kernel(case, platform, scale_search)
    sc.assert_cache_equal(case, out, ref, "kernel vs reference")

    mask = case.written_mask()
    assert mask.sum() == (len(case.valid_tokens()) * case.num_kv_heads * 2
                          * sc.head_bytes(case.head_size))
    sc.assert_bytes_equal(out[~mask], case.cache[~mask], "bytes outside the stored slots")

    # Same store on the complement of the initial cache: same written bytes, and every byte of
    # the mask changed in at least one of the two runs.
    flipped = case.with_args(cache=~case.cache)
    out_flipped = sc.run_kernel(flipped, platform, scale_search)
    sc.assert_cache_equal(case, out_flipped, sc.run_reference(flipped, scale_search),
                          "kernel vs reference (complemented initial cache)")
    sc.assert_bytes_equal(out_flipped[~mask], flipped.cache[~mask], "bytes outside (complement)")
    sc.assert_bytes_equal(out[mask], out_flipped[mask], "written bytes depend on the old cache")
    changed = (out != case.cache) | (out_flipped != flipped.cache)
    assert np.array_equal(changed, mask), (changed.sum(), mask.sum())
    return out


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("index", range(len(COVER)), ids=[_case_id(r) for r in COVER])
def test_kernel_equals_reference_whole_cache(index, platform):
    case, scale_search = _build(100 + index, COVER[index])
    check_store(case, platform, scale_search)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("scale_search", SCALE_SEARCHES)
def test_int64_slot_mapping(platform, scale_search):
    with sc.x64():
        case = sc.make_case(7, num_tokens=37, num_kv_heads=2, head_size=128, block_size=8,
                            dtype="bf16", slot_dtype=np.int64, num_out_of_range=3)
        assert case.slot_mapping.dtype == np.int64
        # Slots beyond int32 must be skipped, not wrapped around into the cache.
        case.slot_mapping[np.nonzero(case.slot_mapping >= case.num_slots)[0][0]] = 2**32 + 3
        # A negative int64 slot whose low 32 bits are a valid slot is still padding.
        case.slot_mapping[np.nonzero(case.slot_mapping < 0)[0][0]] = -(2**32) + 5
        out = check_store(case, platform, scale_search)
        # Same bytes as the same store with int32 slots (wrap-free ones).
        slots32 = np.where(case.slot_mapping >= case.num_slots, -1, case.slot_mapping)
        slots32 = np.maximum(slots32, -1)
        out32 = sc.run_kernel(case.with_args(slot_mapping=slots32.astype(np.int32)), platform,
                              scale_search)
    sc.assert_cache_equal(case, out, out32, "int64 vs int32 slot_mapping")


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("layout", ["HND", "NHD"])
def test_out_of_range_slots_write_nothing(platform, layout):
    case = sc.make_case(8, num_tokens=24, num_kv_heads=2, head_size=64, block_size=4,
                        layout=layout, num_padding=4, num_out_of_range=6)
    oob = case.slot_mapping >= case.num_slots
    assert oob.sum() == 6 and (case.slot_mapping == case.num_slots).any()
    out = check_store(case, platform, "default")
    # Dropping the out-of-range tokens gives the same cache.
    kept = ~oob
    trimmed = case.with_args(key=case.key[kept], value=case.value[kept],
                             slot_mapping=case.slot_mapping[kept])
    sc.assert_cache_equal(case, out, sc.run_kernel(trimmed, platform),
                          "without the out-of-range tokens")
    # Only out-of-range and padding slots: the cache comes back unchanged.
    nothing = case.with_args(slot_mapping=np.where(oob, case.slot_mapping, -1).astype(np.int32))
    sc.assert_cache_equal(case, sc.run_kernel(nothing, platform), case.cache, "no valid slot")
    sc.assert_cache_equal(case, sc.run_reference(nothing), case.cache, "reference, no valid slot")


@pytest.mark.parametrize("platform", PLATFORMS)
def test_scale_is_a_runtime_value(platform):
    """k_scale shape () and (1,) give the same bytes; a new k_scale needs no recompilation."""
    case = sc.make_case(9, num_tokens=21, num_kv_heads=2, head_size=64, block_size=8)
    out = sc.run_kernel(case, platform)
    as_vector = case.with_args(k_scale=case.k_scale.reshape(1), v_scale=case.v_scale.reshape(1))
    sc.assert_cache_equal(case, sc.run_kernel(as_vector, platform), out, "k_scale shape (1,)")

    fn = jax.jit(jax_nvfp4.reshape_and_cache)
    device = jax.devices(platform)[0]
    args = list(jax.device_put(case.args(), device))
    fn(*args)
    before = fn._cache_size()
    args[4] = jax.device_put(case.k_scale * np.float32(3.0), device)
    out3 = np.asarray(fn(*args))
    assert fn._cache_size() == before
    sc.assert_cache_equal(case, out3, sc.run_reference(case.with_args(k_scale=case.k_scale * 3)),
                          "new k_scale")


def test_spec_offsets_are_a_bijection():
    """The test helper's docs/format.md §4 geometry covers every cache byte exactly once."""
    for layout, head_size, swizzle, block_size in [("HND", 128, True, 8), ("NHD", 64, True, 4),
                                                   ("HND", 80, False, 4), ("NHD", 96, False, 8)]:
        case = sc.make_case(1, num_tokens=3, num_kv_heads=3, head_size=head_size,
                            block_size=block_size, layout=layout, v_scale_swizzle=swizzle)
        everything = np.concatenate([
            a.reshape(-1) for side in (0, 1) for a in case.offsets(np.arange(case.num_slots), side)])
        assert np.array_equal(np.sort(everything), np.arange(case.cache.size))


# ---------------------------------------------------------------------------------------------
# chex variants: the public call with and without jit equals the reference.

class StoreVariantsTest(chex.TestCase):

    @chex.variants(with_jit=True, without_jit=True)
    def test_public_call_equals_reference(self):
        for index, scale_search in ((0, "default"), (4, "4over6")):
            case, _ = _build(200 + index, COVER[index])
            store = self.variant(functools.partial(jax_nvfp4.reshape_and_cache,
                                                   **sc.store_options(case, scale_search)))
            out = store(*map(jnp.asarray, case.args()))
            chex.assert_shape(out, case.cache.shape)
            chex.assert_type(out, jnp.uint8)
            sc.assert_cache_equal(case, np.asarray(out), sc.run_reference(case, scale_search))


# ---------------------------------------------------------------------------------------------
# GPU only.

@pytest.mark.gpu
@pytest.mark.parametrize("scale_search", SCALE_SEARCHES)
def test_gpu_large(scale_search):
    # 32768 tokens x 32 heads x 128 (134M values per side). The (eager) CPU reference takes
    # 12 s (default) / 38 s (4over6) and 5 GB for this on a 2-core machine (measured; the CPU
    # kernel gives the same bytes there), so the GPU kernel is compared with the CPU reference
    # itself, on the whole 150 MB cache.
    case = sc.make_case(11, num_tokens=32768, num_kv_heads=32, head_size=128, block_size=16,
                        dtype="bf16", layout="HND", num_padding=300, num_out_of_range=20)
    ref = sc.run_reference(case, scale_search)
    out = sc.run_kernel(case, "gpu", scale_search)
    sc.assert_cache_equal(case, out, ref, "gpu kernel vs cpu reference")
    mask = case.written_mask()
    sc.assert_bytes_equal(out[~mask], case.cache[~mask], "bytes outside the stored slots")
    assert (out != case.cache).sum() >= 0.99 * mask.sum()


@pytest.mark.gpu
@pytest.mark.parametrize("scale_search", SCALE_SEARCHES)
@pytest.mark.parametrize("dtype,layout,v_scale_swizzle", [("bf16", "HND", True),
                                                         ("fp16", "NHD", False)])
@pytest.mark.parametrize("extra_tokens", [0, 1], ids=["one_block_a_thread", "two"])
def test_gpu_one_and_two_blocks_a_thread(scale_search, dtype, layout, v_scale_swizzle,
                                         extra_tokens):
    """The CUDA store quantises one 16-value block a thread up to _ffi.STORE_SMALL_BLOCKS
    blocks in a call and two a thread above (head sizes with an even block count): the
    reference's bytes on both sides of the bound."""
    from jax_nvfp4.primitive import _ffi
    heads, head_size = 2, 128
    blocks_per_token = 2 * heads * head_size // 16               # K and V
    tokens = _ffi.STORE_SMALL_BLOCKS // blocks_per_token + extra_tokens
    case = sc.make_case(13, num_tokens=tokens, num_kv_heads=heads, head_size=head_size,
                        block_size=16, dtype=dtype, layout=layout,
                        v_scale_swizzle=v_scale_swizzle)
    assert (case.key.size * 2 // 16 > _ffi.STORE_SMALL_BLOCKS) == bool(extra_tokens)
    check_store(case, "gpu", scale_search)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("num_kv_heads,head_size", [(1, 128), (3, 64), (3, 256)])
def test_gpu_two_blocks_a_thread_where_a_warp_spans_tokens_and_sides(num_kv_heads, head_size,
                                                                     layout):
    """Two blocks a thread (above _ffi.STORE_SMALL_BLOCKS) where a warp's 32 consecutive items
    (two blocks each, in the order block pair, head, side, token) are not one token's heads of
    one side: 4, 6 and 24 items a (token, side), so a warp's items cross K/V and tokens, at 4
    and 6 also inside each group of 8 lanes. A kernel that hands inputs between the
    lanes of a warp (store v21's loads, benchmarks/NOTES.md) must still give every item its own;
    padding slots included. The reference's bytes."""
    from jax_nvfp4.primitive import _ffi
    blocks_per_token = 2 * num_kv_heads * head_size // 16
    tokens = _ffi.STORE_SMALL_BLOCKS // blocks_per_token + 37
    case = sc.make_case(17 + num_kv_heads + head_size, num_tokens=tokens,
                        num_kv_heads=num_kv_heads, head_size=head_size, block_size=16,
                        dtype="bf16", layout=layout, v_scale_swizzle=True)
    assert case.key.size * 2 // 16 > _ffi.STORE_SMALL_BLOCKS
    check_store(case, "gpu", "default")


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("layout", ["HND", "NHD"])
@pytest.mark.parametrize("head_size", [192, 320])
@pytest.mark.parametrize("extra_tokens", [0, 1], ids=["one_block_a_thread", "two"])
def test_swizzled_v_scales_with_a_group_of_three_or_five(platform, layout, head_size,
                                                         extra_tokens):
    """Swizzled V scales where the swizzle's group G = S / 4 (docs/format.md §4) is not a power
    of two: 3 at head size 192, 5 at 320 (the other tests' swizzled sizes have G = 1, 2, 4). The
    CUDA store divides the block index by G (store v22's FastDivmod, benchmarks/NOTES.md);
    on the GPU both sides of _ffi.STORE_SMALL_BLOCKS (one and two blocks a thread)."""
    from jax_nvfp4.primitive import _ffi
    heads = 2
    blocks_per_token = 2 * heads * head_size // 16
    tokens = _ffi.STORE_SMALL_BLOCKS // blocks_per_token + extra_tokens
    case = sc.make_case(400 + head_size + extra_tokens, num_tokens=tokens, num_kv_heads=heads,
                        head_size=head_size, block_size=8, dtype="bf16", layout=layout,
                        v_scale_swizzle=True, num_padding=5, num_out_of_range=3)
    assert (case.key.size * 2 // 16 > _ffi.STORE_SMALL_BLOCKS) == bool(extra_tokens)
    check_store(case, platform, "default")


@pytest.mark.gpu
@pytest.mark.parametrize("scale_search", SCALE_SEARCHES)
def test_gpu_one_token(scale_search):
    case = sc.make_case(12, num_tokens=1, num_kv_heads=4, head_size=128, block_size=16,
                        dtype="bf16")
    check_store(case, "gpu", scale_search)


# ---------------------------------------------------------------------------------------------
# Regression: under jax.jit, XLA's algebraic simplifier rewrote the reference's
# ``1 / (safe * (1 / g))`` with ``g = 1 / k_scale`` so that ``1 / g`` became ``k_scale``; in
# float32 ``1 / (1 / 0.210798) = 0.21079798 != 0.210798``, so out_scale changed in its last bit
# (1.3553938 instead of 1.3553939) and an element whose x * out_scale is 0.25000003 (code 1)
# became <= 0.25 (code 0). The reference now keeps g and 1/g apart (reference.store_factor).

# Found by the covering design (row 7, token 80, head 1, K block 2); fp16.
_JIT_FOLD_BLOCK = np.array(
    [1.51953125, 2.6015625, 4.53515625, 1.15234375, 2.1875, 0.97021484375, -0.3369140625,
     -0.82861328125, -1.9189453125, 0.1844482421875, -0.0986328125, -0.88720703125,
     -2.048828125, 3.384765625, -0.802734375, 3.0625], np.float16)
_JIT_FOLD_K_SCALE = np.float32(0.210798)


def _jit_fold_case():
    x = np.tile(_JIT_FOLD_BLOCK, 4).reshape(1, 1, 64)
    cache = np.random.default_rng(5).integers(0, 256, sc.cache_shape(1, 4, 1, 64, "HND"),
                                              dtype=np.uint8)
    return sc.StoreCase(x, x, cache, np.array([2], np.int32), _JIT_FOLD_K_SCALE,
                        _JIT_FOLD_K_SCALE, num_blocks=1, block_size=4)


@pytest.mark.parametrize("scale_search", SCALE_SEARCHES)
def test_reference_eager_on_jit_fold_block(scale_search):
    case = _jit_fold_case()
    out = sc.run_kernel(case, "cpu", scale_search)
    sc.assert_cache_equal(case, out, sc.run_reference(case, scale_search),
                          "kernel vs eager reference")
    packed, _ = case.read(out, 0)
    # Element 9: 0.18444824 * out_scale(1.3553939) = 0.25000003 > 0.25 -> code 1
    # (docs/format.md §2 step 6).
    assert packed[0, 0, 4] == 0x1D


@pytest.mark.parametrize("scale_search", SCALE_SEARCHES)
def test_reference_under_jit(scale_search):
    case = _jit_fold_case()
    sc.assert_cache_equal(case, sc.run_reference(case, scale_search, jit=True),
                          sc.run_reference(case, scale_search),
                          "jitted reference vs eager reference")


# Regression: under jax.jit XLA reassociated the reference's ``g * (amax * R6)`` into
# ``(g * R6) * amax`` (R6 = 1/6 is a constant), which rounds differently: here the block scale
# came out as e4m3 0x63 instead of 0x62 and five codes one step lower. The reference now rounds
# ``amax * R6`` on its own. Found by tests/test_properties.py (bf16, k_scale = amax / 2688).
_REASSOCIATION_BLOCK = np.array(
    [1.078125, 0.2255859375, 0.08154296875, -0.033935546875, 0.2734375, -0.88671875, -0.765625,
     1.0, 0.1162109375, 0.65234375, -0.46484375, 1.0546875, 0.265625, 0.369140625, 0.421875,
     -0.61328125], np.float32)
_REASSOCIATION_K_SCALE = np.array(999043267, np.uint32).view(np.float32)   # 0.00427827


@pytest.mark.parametrize("scale_search", SCALE_SEARCHES)
def test_reference_under_jit_keeps_the_block_scale_product_order(scale_search):
    x = np.tile(_REASSOCIATION_BLOCK, 4).astype(sc.BF16).reshape(1, 1, 64)
    cache = np.random.default_rng(6).integers(0, 256, sc.cache_shape(1, 4, 1, 64, "HND"),
                                              dtype=np.uint8)
    case = sc.StoreCase(x, x, cache, np.array([1], np.int32), _REASSOCIATION_K_SCALE,
                        _REASSOCIATION_K_SCALE, num_blocks=1, block_size=4)
    out = sc.run_kernel(case, "cpu", scale_search)
    for jit in (True, False):
        sc.assert_bytes_equal(sc.run_reference(case, scale_search, jit=jit), out,
                              f"reference (jit={jit}) vs kernel")
    codes, byte = sc.spec_quantize_block(_REASSOCIATION_BLOCK,
                                         np.float32(1) / _REASSOCIATION_K_SCALE, scale_search)
    _, scales = case.read(out, 0)
    assert scales[0, 0, 0] == byte
    if scale_search == "default":
        assert byte == 0x62


# ---------------------------------------------------------------------------------------------
# The CPU kernel splits stores of more than 2^17 values into pieces run on XLA's thread pool
# (ffi/store_cpu.cc): pieces of the flattened (layer, token) axis, cut wherever the count says,
# so inside a layer and across layers. Each piece must write what the whole store writes.

@pytest.mark.parametrize("scale_search", SCALE_SEARCHES)
@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_cpu_kernel_threaded_pieces_equal_reference(dtype, scale_search):
    layers, tokens, heads, head_size = 3, 700, 4, 64   # 3 * 700 * 2 * 4 * 64 = 1.1M values
    cases = [sc.make_case(300 + layer, num_tokens=tokens, num_kv_heads=heads, head_size=head_size,
                          block_size=16, dtype=dtype, num_out_of_range=5)
             for layer in range(layers)]
    # One cache geometry for all layers (make_case sizes each cache for its own slots).
    num_blocks = max(c.num_blocks for c in cases)
    cases = [c.with_args(cache=np.random.default_rng(layer).integers(
                 0, 256, sc.cache_shape(num_blocks, 16, heads, head_size, "HND"), np.uint8),
                 num_blocks=num_blocks)
             for layer, c in enumerate(cases)]
    stacked = [np.stack([getattr(c, name) for c in cases])
               for name in ("key", "value", "cache", "slot_mapping", "k_scale", "v_scale")]
    store = jax.jit(jax.vmap(functools.partial(jax_nvfp4.reshape_and_cache,
                                               scale_search=scale_search)))
    out = np.asarray(store(*map(jnp.asarray, stacked)))
    for layer, case in enumerate(cases):
        sc.assert_cache_equal(case, out[layer], sc.run_reference(case, scale_search),
                              f"layer {layer}: threaded kernel vs reference")
