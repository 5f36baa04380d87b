"""Shared test data and helpers for the store tests.

* :func:`make_case` builds a random store problem: key/value (bf16 or fp16, never all zero), a
  RANDOM (not zero) initial cache, a slot mapping of distinct valid slots mixed with negative
  padding slots and, optionally, out-of-range slots (``>= num_blocks * block_size``), and
  k_scale/v_scale from the data's amax.
* :func:`run_kernel` runs ``jax_nvfp4.reshape_and_cache`` under ``jax.jit`` on a chosen platform;
  :func:`run_reference` runs the jnp reference, always on the CPU (docs/format.md §8).
* The byte positions a store writes are computed here again, straight from docs/format.md §4
  (:func:`spec_offsets`), independently of ``jax_nvfp4.layout``, so the tests also check
  the library's geometry.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import ml_dtypes
import numpy as np

import jax_nvfp4
from jax_nvfp4 import reference
from jax_nvfp4 import testing as nvt

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
DTYPES = {"bf16": BF16, "fp16": F16}

#: E2M1 magnitudes of the codes 0..7 (docs/format.md §1).
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)


def x64():
    """Context enabling 64-bit types (``jax.experimental.enable_x64`` where it still exists)."""
    try:
        from jax.experimental import enable_x64  # older JAX
        return enable_x64()
    except ImportError:
        return jax.enable_x64(True)


# ---------------------------------------------------------------------------------------------
# Geometry, straight from docs/format.md §4.

def head_bytes(head_size):
    return head_size // 2 + head_size // 16


def cache_shape(num_blocks, block_size, num_kv_heads, head_size, layout):
    f = head_bytes(head_size)
    if layout == "HND":
        return (num_blocks, 2, num_kv_heads, block_size, f)
    return (num_blocks, 2, block_size, num_kv_heads, f)


def spec_offsets(slots, side, *, block_size, num_kv_heads, head_size, layout, v_scale_swizzle):
    """Flat byte offsets in the whole cache where valid ``slots`` [N] store one side (0 = K,
    1 = V): (data [N, num_kv_heads, head_size/2], scales [N, num_kv_heads, head_size/16]).
    Written from docs/format.md §4, independently of ``jax_nvfp4.layout``."""
    d2, s_count = head_size // 2, head_size // 16
    side_bytes = num_kv_heads * block_size * head_bytes(head_size)
    slots = np.asarray(slots, np.int64).reshape(-1, 1, 1)
    block, t = slots // block_size, slots % block_size
    base = (block * 2 + side) * side_bytes
    h = np.arange(num_kv_heads).reshape(1, -1, 1)

    def plane(row):
        return h * block_size + row if layout == "HND" else row * num_kv_heads + h

    data = base + plane(t) * d2 + np.arange(d2).reshape(1, 1, -1)
    s = np.arange(s_count).reshape(1, 1, -1)
    if side == 1 and v_scale_swizzle:
        g = s_count // 4
        row = (t // 4) * 4 + s // g
        col = (s % g) * 4 + t % 4
    else:
        row, col = t, s
    scales = base + num_kv_heads * block_size * d2 + plane(row) * s_count + col
    return data, scales


# ---------------------------------------------------------------------------------------------
# Cases.

@dataclasses.dataclass
class StoreCase:
    key: np.ndarray            # [num_tokens, num_kv_heads, head_size], bf16 or fp16
    value: np.ndarray
    cache: np.ndarray          # uint8, random initial content
    slot_mapping: np.ndarray   # int32 or int64
    k_scale: np.ndarray        # float32, shape () or (1,)
    v_scale: np.ndarray
    num_blocks: int
    block_size: int
    layout: str = "HND"
    v_scale_swizzle: bool = True

    @property
    def num_tokens(self):
        return self.key.shape[0]

    @property
    def num_kv_heads(self):
        return self.key.shape[1]

    @property
    def head_size(self):
        return self.key.shape[2]

    @property
    def num_slots(self):
        return self.num_blocks * self.block_size

    def args(self):
        return (self.key, self.value, self.cache, self.slot_mapping, self.k_scale, self.v_scale)

    def with_args(self, **changes):
        return dataclasses.replace(self, **changes)

    def valid_tokens(self):
        s = self.slot_mapping.astype(np.int64)
        return np.nonzero((s >= 0) & (s < self.num_slots))[0]

    def offsets(self, slots, side):
        """Byte offsets of ``slots`` [N] (docs/format.md §4): (data [N, H, D/2], scales
        [N, H, D/16])."""
        return spec_offsets(slots, side, block_size=self.block_size,
                            num_kv_heads=self.num_kv_heads, head_size=self.head_size,
                            layout=self.layout, v_scale_swizzle=self.v_scale_swizzle)

    def written_mask(self):
        """Bool mask over the cache: the bytes the store of the valid tokens writes."""
        mask = np.zeros(self.cache.size, bool)
        slots = self.slot_mapping[self.valid_tokens()]
        for side in (0, 1):
            data, scales = self.offsets(slots, side)
            mask[data.reshape(-1)] = True
            mask[scales.reshape(-1)] = True
        return mask.reshape(self.cache.shape)

    def read(self, cache, side, tokens=None):
        """Bytes stored for ``tokens`` (default: all valid ones) on one side:
        (packed [N, H, D/2], scale bytes [N, H, D/16]), read at the docs/format.md §4 offsets."""
        tokens = self.valid_tokens() if tokens is None else np.asarray(tokens)
        flat = np.asarray(cache).reshape(-1)
        data, scales = self.offsets(self.slot_mapping[tokens], side)
        return flat[data], flat[scales]


def _random_inputs(rng, shape, dtype, spread):
    """Normal data with a per-(token, head) magnitude (so block scales vary), a few outliers."""
    mag = np.exp(rng.normal(0.0, spread, size=shape[:-1] + (1,)))
    x = rng.normal(size=shape) * mag
    outliers = rng.random(shape) < 0.002
    x = np.where(outliers, x * 8.0, x)
    x = x.astype(np.float32).astype(dtype)
    assert np.count_nonzero(x.astype(np.float32)) > 0
    return x


def amax(x):
    return np.float32(np.max(np.abs(np.asarray(x).astype(np.float32))))


def make_case(seed, *, num_tokens, num_kv_heads=2, head_size=128, block_size=16, dtype="bf16",
              layout="HND", v_scale_swizzle=True, scale_divisor=448.0, num_padding=None,
              num_out_of_range=0, slot_dtype=np.int32, spare_blocks=2, scale_shape=()):
    """A random store problem.

    ``num_padding`` negative slots (default ~15% of the tokens), ``num_out_of_range`` slots
    ``>= num_blocks*block_size``, the rest distinct valid slots spread over a cache with
    ``spare_blocks`` more pages than needed. ``k_scale = amax|key| / scale_divisor`` (448 is the
    calibration default, 2688 = 448*6 the other convention), likewise ``v_scale``.
    """
    rng = np.random.default_rng(seed)
    dtype = DTYPES.get(dtype, dtype)
    if num_padding is None:
        num_padding = int(round(0.15 * num_tokens))
    num_valid = num_tokens - num_padding - num_out_of_range
    assert num_valid >= 0, "more padding/out-of-range tokens than tokens"
    num_blocks = -(-num_valid // block_size) + spare_blocks
    num_slots = num_blocks * block_size

    shape = (num_tokens, num_kv_heads, head_size)
    key = _random_inputs(rng, shape, dtype, spread=0.7)
    value = _random_inputs(rng, shape, dtype, spread=0.5)
    value = (value.astype(np.float32) * 0.3).astype(dtype)

    valid = rng.choice(num_slots, size=num_valid, replace=False)
    padding = np.where(rng.random(num_padding) < 0.7, -1, -rng.integers(2, 10_000, num_padding))
    out_of_range = num_slots + rng.integers(0, 3 * num_slots + 1, num_out_of_range)
    if num_out_of_range:
        out_of_range[0] = num_slots  # the first slot past the end
    slots = np.concatenate([valid, padding, out_of_range])
    slots = slots[rng.permutation(num_tokens)].astype(slot_dtype)

    cache = rng.integers(0, 256, cache_shape(num_blocks, block_size, num_kv_heads, head_size,
                                             layout), dtype=np.uint8)
    k_scale = np.full(scale_shape, amax(key) / np.float32(scale_divisor), np.float32)
    v_scale = np.full(scale_shape, amax(value) / np.float32(scale_divisor), np.float32)
    return StoreCase(key, value, cache, slots, k_scale, v_scale, num_blocks, block_size, layout,
                     v_scale_swizzle)


# ---------------------------------------------------------------------------------------------
# Running the kernel and the reference.

def store_options(case, scale_search="default"):
    return dict(layout=case.layout, scale_search=scale_search,
                v_scale_swizzle=case.v_scale_swizzle)


@functools.lru_cache(maxsize=None)
def _jitted(fn, layout, scale_search, v_scale_swizzle):
    return jax.jit(functools.partial(fn, layout=layout, scale_search=scale_search,
                                     v_scale_swizzle=v_scale_swizzle))


def run_kernel(case, platform="cpu", scale_search="default", args=None):
    """The public store under jax.jit on ``jax.devices(platform)[0]``; returns numpy bytes."""
    device = jax.devices(platform)[0]
    args = jax.device_put(case.args() if args is None else args, device)
    fn = _jitted(jax_nvfp4.reshape_and_cache, **store_options(case, scale_search))
    out = fn(*args)
    assert out.devices() == {device}, (out.devices(), device)
    return np.asarray(out)


#: Run the reference under jax.jit (about 5x faster than eagerly).
REFERENCE_JIT = True


def run_reference(case, scale_search="default", args=None, jit=None):
    """The jnp reference, always on the CPU; returns numpy bytes.

    Under ``jax.jit`` by default (``REFERENCE_JIT``), else eagerly, op by op. Both give the
    same bytes: the reference keeps ``1 / (1 / k_scale)`` from being folded into ``k_scale``
    (docs/format.md §8), which test_store.py::test_reference_under_jit checks on a block where
    the fold would flip a code.
    """
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        args = jax.device_put(case.args() if args is None else args, cpu)
        if REFERENCE_JIT if jit is None else jit:
            fn = _jitted(reference.reshape_and_cache, **store_options(case, scale_search))
        else:
            fn = functools.partial(reference.reshape_and_cache,
                                   **store_options(case, scale_search))
        return np.asarray(fn(*args))


# ---------------------------------------------------------------------------------------------
# Assertions.

def assert_bytes_equal(actual, expected, what="cache"):
    actual, expected = np.asarray(actual), np.asarray(expected)
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert actual.dtype == expected.dtype, f"{what}: dtype {actual.dtype} != {expected.dtype}"
    if not np.array_equal(actual, expected):
        bad = np.argwhere(actual != expected)
        first = ", ".join(f"{tuple(int(i) for i in b)}: {actual[tuple(b)]:#04x} != "
                          f"{expected[tuple(b)]:#04x}" for b in bad[:8])
        raise AssertionError(f"{what}: {len(bad)} of {actual.size} bytes differ; first: {first}")


def assert_cache_equal(case, actual, expected, what="cache"):
    """Whole caches written like ``case``: jax_nvfp4.testing names the first differing block
    (page, K/V, head, row, values) and decodes it on both sides."""
    nvt.assert_caches_equal(actual, expected, layout=case.layout,
                            v_scale_swizzle=case.v_scale_swizzle, k_scale=case.k_scale,
                            v_scale=case.v_scale, what=what)


def assert_only_expected_bytes_changed(case, out, initial=None):
    """Bytes outside the written mask equal the initial cache; returns the mask."""
    initial = case.cache if initial is None else initial
    mask = case.written_mask()
    out = np.asarray(out)
    assert_bytes_equal(out[~mask], initial[~mask], "bytes outside the stored slots")
    changed = out != initial
    # Written bytes may coincide with the random initial byte (p = 1/256 each), not more often.
    assert changed.sum() >= 0.9 * mask.sum(), (changed.sum(), mask.sum())
    return mask


def e4m3_byte_of_power_of_two(exponent):
    """E4M3 (bias 7) byte of 2**exponent, normal range -6..8."""
    assert -6 <= exponent <= 8
    return (exponent + 7) << 3


def pack(codes):
    """16 e2m1 codes -> 8 bytes, element 2k in the low nibble (docs/format.md §2 step 7)."""
    codes = np.asarray(codes, np.uint8)
    return codes[0::2] | (codes[1::2] << 4)


def unpack(packed):
    """[..., n] bytes -> [..., 2n] e2m1 codes (low nibble first)."""
    packed = np.asarray(packed, np.uint8)
    return np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(*packed.shape[:-1], -1)


# ---------------------------------------------------------------------------------------------
# A third, independent model of docs/format.md §2-§3 for single blocks: numpy float32 scalar
# arithmetic (IEEE, correctly rounded, never fused, gradual underflow), used to cross-check
# hand-built edge blocks. Slow (pure Python): only for a few blocks.

_LADDER = ((0.25, True), (0.75, False), (1.25, True), (1.75, False), (2.5, True), (3.5, False),
           (5.0, True))  # (bound, inclusive): |y| <= / < bound stops at that magnitude


def spec_e4m3_byte(x):
    x = np.float32(x)
    if np.isnan(x):
        return 0x7F
    clipped = np.clip(x, np.float32(-448), np.float32(448))
    return int(np.array(clipped, np.float32).astype(ml_dtypes.float8_e4m3fn).view(np.uint8))


def spec_e4m3_value(byte):
    return np.float32(np.array(byte, np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32))


def ftz(v):
    """Float32 subnormals flush to (signed) zero, as inputs and results (ffi/nvfp4_numerics.h)."""
    v = np.float32(v)
    return np.copysign(np.float32(0), v) if 0 < abs(v) < np.float32(2.0**-126) else v


def spec_e2m1_code(x, out_scale):
    a = abs(ftz(ftz(x) * np.float32(out_scale)))
    mag = 7
    for i, (bound, inclusive) in enumerate(_LADDER):
        if (a <= bound) if inclusive else (a < bound):  # NaN: every comparison is False -> 7
            mag = i
            break
    return mag | (8 if np.signbit(np.float32(x)) else 0)


def spec_quantize_block(x, g, scale_search="default"):
    """16 float32 values and g = 1/k_scale -> (16 codes, scale byte), docs/format.md §2-§3, with
    float32 subnormals flushed to zero (ftz) wherever they enter or leave an operation."""
    f32 = np.float32
    raw = [f32(v) for v in np.asarray(x, np.float32)]
    x = [ftz(v) for v in raw]
    g = f32(g)
    with np.errstate(all="ignore"):
        amax = abs(x[0])
        for v in x[1:]:
            if np.isnan(amax) or abs(v) > amax:
                amax = abs(v)

        def candidate(recip):
            byte = spec_e4m3_byte(ftz(g * ftz(amax * recip)))
            sfq = spec_e4m3_value(byte)
            out = ftz(f32(1) / ftz(sfq * ftz(f32(1) / g))) if sfq != 0 else f32(0)
            return byte, out

        def error(out):
            if out == 0:
                d = [-v for v in x]
            else:
                deq = ftz(f32(1) / out)
                d = []
                for v in x:
                    c = spec_e2m1_code(v, out)
                    q = f32(-E2M1[c & 7] if c & 8 else E2M1[c & 7])
                    d.append(ftz(ftz(q * deq) - v))
            err = f32(0)
            for j in range(0, 16, 2):
                err = ftz(err + ftz(ftz(d[j] * d[j]) + ftz(d[j + 1] * d[j + 1])))
            return err

        byte, out = candidate(f32(1) / f32(6))
        if scale_search == "4over6":
            byte4, out4 = candidate(f32(0.25))
            if error(out4) < error(out):
                byte, out = byte4, out4
        return np.array([spec_e2m1_code(v, out) for v in raw], np.uint8), byte
