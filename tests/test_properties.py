"""Property tests (hypothesis) of the store and, at the end of the file, of the two readers
(decode and ragged attention: the CUDA kernels against the jnp path within the measured bounds
on a GPU, the jnp path against float64 on the CPU).

The store: random valid geometries, inputs full of special
values, slot mappings with padding and out-of-range slots; the kernel equals the jnp reference
(run on the CPU) byte for byte on the whole cache, and every byte outside the stored (slot,
head) positions is untouched.

Drawn per example: kv heads 1-64, head sizes multiples of 16 up to 512, block sizes multiples
of 4 up to 128, 0-5000 tokens (within an element budget), both layouts, both scale searches,
linear and swizzled V scales (swizzled where head_size % 64 == 0), bf16 and fp16; values are
normal data with per-(token, head) magnitudes mixed with NaN (both signs, quiet and
signalling), +-Inf, +-0, subnormals, exact E2M1 tie blocks at power-of-two scales, the largest
finite values; k_scale/v_scale from the data's amax (/448, /2688, scale_from_amax), a power of
two, or invalid (0, NaN, Inf, negative, subnormal: the NaN contract of tests/test_scales.py);
slots distinct and valid, or padding (-1, other negatives), or out of range (up to int32's
largest), int32 or int64 (x64).

Profiles (``JAX_NVFP4_HYPOTHESIS``, tests/conftest.py): ``ci`` (default: 30 examples per test,
derandomized, a bounded problem size: about a minute on 2 CPU cores) and ``long`` (2000
examples, random, problems up to 5000 tokens x 64 heads; for a GPU machine:
``JAX_NVFP4_HYPOTHESIS=long pytest -q -m gpu tests/test_properties.py`` runs the GPU kernel
against the CPU reference, and without ``-m gpu`` the CPU kernel too;
``JAX_NVFP4_HYPOTHESIS_EXAMPLES`` sets its examples per test, which tests/gpu_checks.sh uses to
run it in rounds within a time budget). The reader tests run fewer examples on CI (each
compiles new shapes).
"""

from __future__ import annotations

import contextlib
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, example, given, note, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import jax_nvfp4  # noqa: E402

import store_cases as sc  # noqa: E402

PROFILE = os.environ.get("JAX_NVFP4_HYPOTHESIS", "ci")
#: Largest key elements (tokens x heads x head_size) and cache bytes of one example.
MAX_ELEMENTS = {"ci": 1 << 18, "long": 5000 * 64 * 512}.get(PROFILE, 1 << 18)
MAX_CACHE_BYTES = {"ci": 1 << 23, "long": 1 << 30}.get(PROFILE, 1 << 23)

BITS = {  # special 16-bit patterns per dtype
    "bf16": dict(qnan=0x7FC0, snan=0x7F81, inf=0x7F80, max=0x7F7F, max_sub=0x007F),
    "fp16": dict(qnan=0x7E00, snan=0x7C01, inf=0x7C00, max=0x7BFF, max_sub=0x03FF),
}
SIGN = 0x8000
TIES = np.array([6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5], np.float32)
INVALID_SCALES = (0.0, -0.0, np.nan, np.inf, -np.inf, -1.0, 1e-40, 2.0**117)


@st.composite
def geometries(draw):
    num_kv_heads = draw(st.integers(1, 64))
    head_size = draw(st.sampled_from(range(16, 513, 16)))
    swizzle = draw(st.booleans()) if head_size % 64 == 0 else False
    block_size = draw(st.sampled_from(range(4, 129, 4)))
    per_token = num_kv_heads * head_size
    max_tokens = max(0, min(5000, MAX_ELEMENTS // per_token))
    num_tokens = draw(st.integers(0, max_tokens))
    side = num_kv_heads * block_size * sc.head_bytes(head_size)
    max_blocks = max(1, MAX_CACHE_BYTES // (2 * side))
    num_blocks = draw(st.integers(1, max_blocks))
    return dict(num_kv_heads=num_kv_heads, head_size=head_size, v_scale_swizzle=swizzle,
                block_size=block_size, num_tokens=num_tokens, num_blocks=num_blocks,
                layout=draw(st.sampled_from(jax_nvfp4.LAYOUTS)),
                scale_search=draw(st.sampled_from(jax_nvfp4.SCALE_SEARCHES)),
                dtype=draw(st.sampled_from(("bf16", "fp16"))))


def _values(rng, shape, dtype, special_rate, tie_rate):
    """Normal data with per-(token, head) magnitudes, special values at ``special_rate``, and
    whole 16-element blocks of E2M1 ties (x 2^e, random signs) at ``tie_rate``."""
    np_dtype = sc.DTYPES[dtype]
    mag = np.exp(rng.normal(0.0, 2.0, size=shape[:-1] + (1,)))
    x = (rng.normal(size=shape) * mag).astype(np.float32).astype(np_dtype)
    bits = x.view(np.uint16).reshape(-1, 16)
    if bits.size == 0:
        return x
    b = BITS[dtype]
    specials = np.array([b["qnan"], b["snan"], b["inf"], b["max"], 0, 1, b["max_sub"],
                         rng.integers(1, b["max_sub"] + 1)], np.uint16)
    pick = rng.random(bits.shape) < special_rate
    chosen = rng.choice(specials, bits.shape) | (rng.random(bits.shape) < 0.5) * SIGN
    bits[pick] = chosen[pick].astype(np.uint16)
    ties = rng.random(len(bits)) < tie_rate
    if ties.any():
        e = rng.integers(-20, 8, (ties.sum(), 1))
        block = np.concatenate([TIES, -TIES])[None, :] * np.exp2(e)
        block *= np.where(rng.random(block.shape) < 0.5, -1, 1)
        bits[ties] = block.astype(np.float32).astype(np_dtype).view(np.uint16)
    return bits.reshape(shape).view(np_dtype)


def _scale(rng, x, how):
    with np.errstate(invalid="ignore"):
        a = np.abs(x.astype(np.float32))
    amax = np.float32(np.max(a[np.isfinite(a)], initial=0))
    if how == "amax/448":
        return np.float32(jax_nvfp4.scale_from_amax(amax))
    if how == "amax/2688":
        return np.float32(max(amax / np.float32(2688), np.float32(2.0**-126))) if amax else \
            np.float32(1)
    if how == "power of two":
        return np.float32(2.0 ** int(rng.integers(-30, 20)))
    return np.float32(rng.choice(INVALID_SCALES))


@st.composite
def problems(draw):
    return build(draw(geometries()), seed=draw(st.integers(0, 2**32 - 1)),
                 special_rate=draw(st.sampled_from((0.0, 0.01, 0.2, 1.0))),
                 tie_rate=draw(st.sampled_from((0.0, 0.1, 0.5))),
                 scales=tuple(draw(st.sampled_from(("amax/448", "amax/2688", "power of two",
                                                    "invalid"))) for _ in range(2)),
                 padding_rate=draw(st.sampled_from((0.0, 0.2, 1.0))),
                 out_of_range_rate=draw(st.sampled_from((0.0, 0.1))),
                 slot_dtype=draw(st.sampled_from((np.int32, np.int32, np.int64))))


def build(geo, *, seed, special_rate=0.01, tie_rate=0.1, scales=("amax/448", "amax/448"),
          padding_rate=0.2, out_of_range_rate=0.1, slot_dtype=np.int32):
    """One store problem: (StoreCase, scale_search)."""
    rng = np.random.default_rng(seed)
    t, h, d = geo["num_tokens"], geo["num_kv_heads"], geo["head_size"]
    num_slots = geo["num_blocks"] * geo["block_size"]
    key = _values(rng, (t, h, d), geo["dtype"], special_rate, tie_rate)
    value = _values(rng, (t, h, d), geo["dtype"], special_rate, tie_rate)
    kind = rng.random(t)
    slots = np.where(kind < padding_rate, -rng.integers(1, 2**31 - 1, t),
                     np.where(kind < padding_rate + out_of_range_rate,
                              rng.integers(num_slots, 2**31 - 1, t), -1))
    slots[(kind < padding_rate) & (rng.random(t) < 0.5)] = -1
    stored = np.nonzero(kind >= padding_rate + out_of_range_rate)[0]
    n = min(len(stored), num_slots)                 # distinct valid slots; the rest padding
    slots[stored[:n]] = rng.choice(num_slots, n, replace=False)
    cache = rng.integers(0, 256, sc.cache_shape(geo["num_blocks"], geo["block_size"], h, d,
                                                geo["layout"]), dtype=np.uint8)
    case = sc.StoreCase(key, value, cache, slots.astype(slot_dtype), _scale(rng, key, scales[0]),
                        _scale(rng, value, scales[1]), geo["num_blocks"], geo["block_size"],
                        geo["layout"], geo["v_scale_swizzle"])
    _note(f"geometry {geo}, seed {seed}, specials {special_rate}, ties {tie_rate}, scales "
          f"{scales} = ({case.k_scale}, {case.v_scale}), padding {padding_rate}, out of range "
          f"{out_of_range_rate}, slots {np.dtype(slot_dtype).name}")
    return case, geo["scale_search"]


def _note(text):
    try:
        note(text)
    except hypothesis.errors.InvalidArgument:   # outside a test (a script reproducing one)
        print(text)


def _geo(num_kv_heads, head_size, block_size, num_tokens, num_blocks, layout="HND",
         scale_search="default", v_scale_swizzle=False, dtype="bf16"):
    return dict(num_kv_heads=num_kv_heads, head_size=head_size, v_scale_swizzle=v_scale_swizzle,
                block_size=block_size, num_tokens=num_tokens, num_blocks=num_blocks,
                layout=layout, scale_search=scale_search, dtype=dtype)


#: The corners of the drawn ranges, always run (hypothesis @example).
CORNERS = [
    # 5000 tokens, one small head, pages of 4 (and the padding of a long prefill).
    (_geo(1, 16, 4, 5000, 1300, "NHD", "4over6", dtype="fp16"), dict(seed=1)),
    # 64 kv heads of 512, pages of 128, swizzled, half the tokens out of range or padding.
    (_geo(64, 512, 128, 3, 1, "HND", "default", True), dict(seed=2, padding_rate=0.2,
                                                            out_of_range_rate=0.1)),
    # Everything special, invalid scales, int64 slots.
    (_geo(3, 64, 12, 40, 12, "NHD", "4over6", True), dict(
        seed=3, special_rate=1.0, scales=("invalid", "power of two"), slot_dtype=np.int64)),
    # Tie blocks at power-of-two scales (exact ties).
    (_geo(2, 128, 16, 60, 5, "HND", "4over6", True, "fp16"), dict(
        seed=4, special_rate=0.0, tie_rate=0.5, scales=("power of two", "power of two"))),
    # No token at all; all padding.
    (_geo(5, 48, 8, 0, 2), dict(seed=5)),
    (_geo(5, 48, 8, 30, 2), dict(seed=6, padding_rate=1.0)),
]


def with_corners(test):
    for geo, kw in reversed(CORNERS):
        test = example(("corner", geo, kw))(test)
    return test


def _problem(problem):
    if problem[0] == "corner":
        return build(problem[1], **problem[2])
    return problem


def _x64(case):
    return sc.x64() if case.slot_mapping.dtype == np.int64 else contextlib.nullcontext()


def _check(case, scale_search, platform):
    with _x64(case):
        out = sc.run_kernel(case, platform, scale_search)
        want = sc.run_reference(case, scale_search)
    sc.assert_bytes_equal(out, want, f"{platform} kernel vs reference")
    mask = case.written_mask()
    sc.assert_bytes_equal(out[~mask], case.cache[~mask], "bytes outside the stored slots")


COMMON = dict(suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                     HealthCheck.large_base_example],
              deadline=None)


@settings(**COMMON)
@with_corners
@given(problems())
def test_cpu_kernel_equals_reference(problem):
    _check(*_problem(problem), "cpu")


@pytest.mark.gpu
@settings(**COMMON)
@with_corners
@given(problems())
def test_gpu_kernel_equals_reference(problem):
    _check(*_problem(problem), "gpu")


# =============================================================================== readers
# The decode reader (paged_attention) and the ragged reader over random geometries: head sizes
# of the kernels, block sizes 4-128, 1-4 kv heads with GQA 1-16, both layouts and V-scale
# orders, three q dtypes, sequences of 0 (and negative) length, one token, a page +-1, the
# longest of the profile (4096 tokens in ``long``), padding columns in the block tables, junk
# rows with NaN and large values in every row nobody attends to, invalid global scales (the
# readers' NaN contract); ragged: 0 to 40 query tokens per sequence (decode tokens on the
# decode kernel, few-row drafts, chunks, more queries than cached tokens), padding sequences
# and tokens. At least one sequence attends to something (the bounds scale by its values).
#
# GPU: the CUDA kernels against the jnp path run on the CPU, within the measured bounds of
# tests/test_decode_kernel.py. CPU: the jnp path against float64 attention over the
# dequantised pages, within float32 arithmetic (the bounds of tests/test_attention.py).

from jax_nvfp4.attention_primitive import KERNEL_HEAD_SIZES  # noqa: E402

from attention_cases import Case, paged_attention_jit  # noqa: E402
from ragged_cases import RaggedCase  # noqa: E402
from test_decode_kernel import (F32_LSE_ABS, assert_lse_close, assert_out_close,  # noqa: E402
                                kernel_lse_tol)
from test_ragged_attention import (F32_REL, assert_kernel_matches_jnp,  # noqa: E402
                                   assert_matches_float64)

#: Longest sequence and most cached tokens of one reader example; most ragged query tokens.
MAX_LEN = {"long": 4096}.get(PROFILE, 300)
MAX_CACHED = {"long": 20000}.get(PROFILE, 1200)
MAX_QUERY_TOKENS = {"long": 1024}.get(PROFILE, 160)
Q_DTYPES = ("bfloat16", "float16", "float32")


def _reader_examples(ci):
    """Examples of a reader test: ``ci`` on CI (each example compiles new shapes, ~2 s on 2
    cores), the profile's count otherwise."""
    return min(settings.default.max_examples, ci) if PROFILE == "ci" else \
        settings.default.max_examples


def _lengths(draw, block_size, count):
    edges = (0, -1, 1, block_size - 1, block_size, block_size + 1, MAX_LEN)
    lens = draw(st.lists(st.one_of(st.sampled_from(edges), st.integers(0, MAX_LEN)),
                         min_size=count[0], max_size=count[1]))
    lens[0] = max(lens[0], 1)                    # someone attends to something
    total = 0
    for i, n in enumerate(lens):                 # within the example's budget of tokens
        lens[i] = min(n, MAX_CACHED - total)
        total += max(lens[i], 0)
    return lens


@st.composite
def reader_geometries(draw):
    block_size = draw(st.sampled_from(range(4, 129, 4)))
    num_kv_heads = draw(st.integers(1, 4))
    return dict(block_size=block_size, head_size=draw(st.sampled_from(KERNEL_HEAD_SIZES)),
                num_kv_heads=num_kv_heads, ratio=draw(st.sampled_from((1, 2, 3, 4, 8, 16))),
                layout=draw(st.sampled_from(jax_nvfp4.LAYOUTS)),
                v_scale_swizzle=draw(st.booleans()), q_dtype=draw(st.sampled_from(Q_DTYPES)),
                junk=draw(st.booleans()), pad_columns=draw(st.integers(0, 3)),
                seed=draw(st.integers(0, 2**32 - 1)))


@st.composite
def decode_problems(draw):
    geo = draw(reader_geometries())
    geo["lens"] = _lengths(draw, geo["block_size"], (1, 6))
    # Mostly valid; sometimes an invalid k_scale or v_scale (every output NaN).
    geo["invalid_scale"] = draw(st.sampled_from((None,) * 6 + ("k", "v")))
    return geo


@st.composite
def ragged_problems(draw):
    geo = draw(reader_geometries())
    lens = _lengths(draw, geo["block_size"], (1, 5))
    q_lens = draw(st.lists(st.one_of(st.sampled_from((0, 1, 1, 4, 16)), st.integers(0, 40)),
                           min_size=len(lens), max_size=len(lens)))
    seqs, total = [], 0
    for kv_len, q_len in zip(lens, q_lens):
        q_len = min(q_len, max(kv_len, 0) + 2, MAX_QUERY_TOKENS - total)  # may pass kv_len
        seqs.append((max(kv_len, 0), q_len))
        total += q_len
    geo.update(seqs=tuple(seqs), pad_seqs=draw(st.integers(0, 3)),
               pad_tokens=draw(st.integers(0, 5)))
    return geo


def _decode_case(p):
    note(f"decode problem {p}")
    with jax.default_device(jax.devices("cpu")[0]):
        case = Case(p["seed"] % 2**31, lens=p["lens"], num_kv_heads=p["num_kv_heads"],
                    head_size=p["head_size"], layout=p["layout"],
                    v_scale_swizzle=p["v_scale_swizzle"], block_size=p["block_size"],
                    junk=p["junk"], pad_columns=p["pad_columns"])
        q = case.query(p["num_kv_heads"] * p["ratio"], p["q_dtype"], seed=p["seed"] % 997)
    args = list(case.args(q))
    if p["invalid_scale"]:
        args[4 if p["invalid_scale"] == "k" else 5] = jnp.float32(np.nan)
    return case, q, args


def _run_decode(args, case, device, impl):
    out = paged_attention_jit(*jax.device_put(args, device), **case.options, return_lse=True,
                              impl=impl)
    return jax.device_get(out)


def _assert_all_nan(*arrays):
    for a in arrays:
        assert np.isnan(np.asarray(a, np.float32)).all(), "an invalid scale must give NaN"


@settings(**COMMON, max_examples=_reader_examples(8))
@given(decode_problems())
def test_cpu_decode_reader_matches_float64(problem):
    case, q, args = _decode_case(problem)
    out, lse = _run_decode(args, case, jax.devices("cpu")[0], "auto")
    if problem["invalid_scale"]:
        return _assert_all_nan(out, lse)
    ref_out, ref_lse = case.reference(q, return_lse=True)
    assert_out_close(out, ref_out, q.dtype, roundings=1, rel=F32_REL, l2=2e-6)
    assert_lse_close(lse, ref_lse, F32_LSE_ABS)


@pytest.mark.gpu
@settings(**COMMON, max_examples=_reader_examples(8))
@given(decode_problems())
def test_gpu_decode_kernel_matches_jnp_path(problem):
    case, q, args = _decode_case(problem)
    ref = _run_decode(args, case, jax.devices("cpu")[0], "jnp")
    out, lse = _run_decode(args, case, jax.devices("gpu")[0], "kernel")
    if problem["invalid_scale"]:
        return _assert_all_nan(out, lse, *ref)
    assert_out_close(out, ref[0], q.dtype, roundings=2)
    assert_lse_close(lse, ref[1], kernel_lse_tol(case, q))


def _ragged_case(p):
    note(f"ragged problem {p}")
    with jax.default_device(jax.devices("cpu")[0]):
        case = RaggedCase(p["seed"] % 2**31, p["seqs"], num_kv_heads=p["num_kv_heads"],
                          head_size=p["head_size"], layout=p["layout"],
                          v_scale_swizzle=p["v_scale_swizzle"], block_size=p["block_size"],
                          pad_seqs=p["pad_seqs"], pad_tokens=p["pad_tokens"], junk=p["junk"],
                          pad_columns=p["pad_columns"])
        q = case.query(p["num_kv_heads"] * p["ratio"], p["q_dtype"], seed=p["seed"] % 991)
    return case, q


@settings(**COMMON, max_examples=_reader_examples(6))
@given(ragged_problems())
def test_cpu_ragged_reader_matches_float64(problem):
    case, q = _ragged_case(problem)
    with jax.default_device(jax.devices("cpu")[0]):
        out, lse = jax.device_get(case.run(q, return_lse=True))
    ref, ref_lse = case.reference(q, return_lse=True)
    assert_matches_float64(out, ref, q.dtype, case.token_ends())
    assert_lse_close(lse, ref_lse, F32_LSE_ABS)


@pytest.mark.gpu
@settings(**COMMON, max_examples=_reader_examples(6))
@given(ragged_problems())
def test_gpu_ragged_kernel_matches_jnp_path(problem):
    case, q = _ragged_case(problem)
    assert_kernel_matches_jnp(case, q, label=None)
