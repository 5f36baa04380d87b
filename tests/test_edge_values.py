"""Edge values: zeros of both signs, subnormals, every e2m1 tie, e4m3 ties and saturation,
+-Inf and NaN (signed, quiet and signalling), largest finite inputs.

Each scenario is one store of up to 128 hand-built 16-element blocks (16 tokens x 2 heads x
64, plus a 17th, padding token) at one k_scale. For every scenario:

* kernel (cpu, and the gpu param) == jnp reference (CPU), byte for byte on the whole cache, and
  nothing outside the stored slots changes;
* every block's codes and scale byte equal an independent numpy model of docs/format.md §2-§3
  (store_cases.spec_quantize_block);
* blocks with a hand-computed expectation (written out below from the spec) match it exactly.

V is stored as -K (sign bit flipped in the input bits): its codes must be K's with bit 3
flipped (the sign of a code is the sign bit of the input, NaN included) and its scale bytes
(swizzled in the page) the same as K's.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

import store_cases as sc

PLATFORMS = ["cpu", pytest.param("gpu", marks=pytest.mark.gpu)]
SEARCHES = ("default", "4over6")
DTYPE_NAMES = ("bf16", "fp16")

NUM_TOKENS, NUM_HEADS, HEAD_SIZE, BLOCK_SIZE = 17, 2, 64, 4
BLOCKS_PER_TOKEN = NUM_HEADS * HEAD_SIZE // 16
# The last token is padding (slot -1): the hand blocks fill the first 16 tokens, in order.
NUM_BLOCKS_IN = (NUM_TOKENS - 1) * BLOCKS_PER_TOKEN  # 128

# Bit patterns (uint16) of special inputs.
QNAN = {"bf16": 0x7FC0, "fp16": 0x7E00}
SNAN = {"bf16": 0x7F81, "fp16": 0x7C01}  # signalling NaN (quiet bit clear)
INF = {"bf16": 0x7F80, "fp16": 0x7C00}
MAX_FINITE = {"bf16": 0x7F7F, "fp16": 0x7BFF}
MAX_SUBNORMAL = {"bf16": 0x007F, "fp16": 0x03FF}
SIGN = 0x8000

# An e2m1 tie block: amax 6 and every tie of docs/format.md §2 step 6, then the same negated.
# With out_scale a power of two (amax = 6p, p and k_scale powers of two) every product is exact.
TIES = np.array([6, 0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5], np.float32)
TIE_BLOCK = np.concatenate([TIES, -TIES])
# default: scale exactly p/k_scale; ties to even: .25->0, .75->1.0, 1.25->1.0, 1.75->2,
# 2.5->2, 3.5->4, 5->4.
TIE_CODES_DEFAULT = [7, 0, 2, 2, 4, 4, 6, 6, 15, 8, 10, 10, 12, 12, 14, 14]
# 4over6: the amax/4 candidate (scale 1.5 p/k_scale) has error 1.5 p^2 against 3.5 p^2 for
# amax/6, so it wins; y = x / 1.5p: 6->4, .25->.17, .75->.5, 1.25->.83, 1.75->1.17, 2.5->1.67,
# 3.5->2.33, 5->3.33.
TIE_CODES_4OVER6 = [6, 0, 1, 2, 2, 3, 4, 5, 14, 8, 9, 10, 10, 11, 12, 13]


def tie_expectation(m):
    """Expected (codes, scale byte) per search of a tie block whose scale is 2**m."""
    byte = sc.e4m3_byte_of_power_of_two(m)
    return {"default": (TIE_CODES_DEFAULT, byte), "4over6": (TIE_CODES_4OVER6, byte | 0x4)}


def both(codes, byte):
    return {"default": (codes, byte), "4over6": (codes, byte)}


def to_bits(values, dtype_name):
    return np.asarray(values, np.float32).astype(sc.DTYPES[dtype_name]).view(np.uint16)


@dataclasses.dataclass
class Block:
    name: str
    bits: np.ndarray                 # uint16 [16]
    expected: dict | None = None     # search -> (codes [16], scale byte)


def _neighbour_block(p, dt):
    """The representable values next to each tie, on the side that rounds away from even."""
    up = lambda v: to_bits([v * p], dt)[0] + 1    # noqa: E731 (positive values: bits + 1)
    down = lambda v: to_bits([v * p], dt)[0] - 1  # noqa: E731
    half = [to_bits([6 * p], dt)[0], up(0.25), down(0.75), up(1.25), down(1.75), up(2.5),
            down(3.5), up(5)]
    return np.array(half + [b | SIGN for b in half], np.uint16)


def unit_scale_blocks(dt):
    """k_scale = 1: out_scale = 1 for amax 6 (e4m3 scale byte 0x38)."""
    rng = np.random.default_rng(1)
    sub = rng.integers(1, MAX_SUBNORMAL[dt] + 1, 16).astype(np.uint16)
    sub[:4] = [1, 1 | SIGN, MAX_SUBNORMAL[dt], MAX_SUBNORMAL[dt] | SIGN]
    sub[4:] |= (rng.random(12) < 0.5).astype(np.uint16) * SIGN
    sub_codes = [8 if b & SIGN else 0 for b in sub]
    mixed_sub = sub.copy()
    mixed_sub[0] = to_bits([6.0], dt)[0]
    mixed_codes = [7] + sub_codes[1:]

    nan_ties = to_bits(TIE_BLOCK, dt)
    nan_ties[1], nan_ties[9], nan_ties[3] = QNAN[dt], QNAN[dt] | SIGN, SNAN[dt]
    nan_codes = list(TIE_CODES_DEFAULT)
    nan_codes[1], nan_codes[9], nan_codes[3] = 7, 15, 7
    nans = np.array([QNAN[dt], QNAN[dt] | SIGN, SNAN[dt], SNAN[dt] | SIGN] * 4, np.uint16)

    small = [6, -0.1, 0.1, -0.0, 0.0, -0.2, 0.25, -0.25, -6, 0.3, -0.3, 0.7, -0.8, 1, -1, 2]
    big = np.array([MAX_FINITE[dt], MAX_FINITE[dt] | SIGN] + list(to_bits([1, -1], dt)) * 7,
                   np.uint16)
    infs = np.array([INF[dt], INF[dt] | SIGN] + list(to_bits([1, -1], dt)) * 7, np.uint16)
    return [
        Block("e2m1 ties", to_bits(TIE_BLOCK, dt), tie_expectation(0)),
        Block("next to the ties", _neighbour_block(1.0, dt),
              {"default": ([7, 1, 1, 3, 3, 5, 5, 7, 15, 9, 9, 11, 11, 13, 13, 15], 0x38)}),
        Block("all 6.0", to_bits([6.0] * 16, dt), both([7] * 16, 0x38)),
        # default: 4/6 -> e4m3 0.6875 (0x33), y = 5.82 -> 6; 4over6: scale 1 exact, code 4.0.
        Block("all 4.0", to_bits([4.0] * 16, dt),
              {"default": ([7] * 16, 0x33), "4over6": ([6] * 16, 0x38)}),
        Block("all +0", to_bits([0.0] * 16, dt), both([0] * 16, 0x00)),
        Block("all -0", to_bits([-0.0] * 16, dt), both([8] * 16, 0x00)),
        Block("+0 -0", to_bits([0.0, -0.0] * 8, dt), both([0, 8] * 8, 0x00)),
        Block("small values, -0.1 -> code 8", to_bits(small, dt),
              {"default": ([7, 8, 0, 8, 0, 8, 0, 8, 15, 1, 9, 1, 10, 2, 10, 4], 0x38)}),
        Block("subnormal inputs", sub, both(sub_codes, 0x00)),
        Block("subnormals next to 6.0", mixed_sub, both(mixed_codes, 0x38)),
        # NaN elements are ignored by the amax and get code 6 with their own sign; with a NaN
        # in the block both 4over6 errors are NaN, so the amax/6 candidate stays.
        Block("NaN among ties", nan_ties, both(nan_codes, 0x38)),
        Block("all +NaN", np.full(16, QNAN[dt], np.uint16), both([7] * 16, 0x7F)),
        Block("all -NaN", np.full(16, QNAN[dt] | SIGN, np.uint16), both([15] * 16, 0x7F)),
        Block("signed quiet and signalling NaN", nans, both([7, 15] * 8, 0x7F)),
        Block("largest finite", big, both([7, 15] + [0, 8] * 7, 0x7E)),
        Block("+-Inf with 1, -1", infs, both([7, 15] + [0, 8] * 7, 0x7E)),
        Block("all +Inf", np.full(16, INF[dt], np.uint16), both([7] * 16, 0x7E)),
        Block("all -Inf", np.full(16, INF[dt] | SIGN, np.uint16), both([15] * 16, 0x7E)),
        Block("-Inf only", np.array([INF[dt] | SIGN] + [0] * 15, np.uint16),
              both([15] + [0] * 15, 0x7E)),
    ]


def inf_step_blocks(dt):
    """k_scale = 2^-8: a block with an Inf saturates its scale at 448, out_scale = 1/1.75."""
    x = [np.inf, -np.inf, 3.5, -3.5, 1.75, 7, 10.5, -10.5, 0, -0.0, 100, 0.5, -0.5, 2, -1, 0.875]
    # y = x / 1.75: 2 -> 4, 1 -> 2, 4 -> 6, 6 -> 7, 57 -> 7, .29 -> 1, 1.14 -> 2, .57 -> 1, .5 -> 1
    codes = [7, 15, 4, 12, 2, 6, 7, 15, 0, 8, 7, 1, 9, 2, 9, 1]
    return [Block("Inf, scale saturated", to_bits(x, dt), both(codes, 0x7E)),
            Block("e2m1 ties, scale 4", to_bits(TIE_BLOCK * 2.0**-6, dt), tie_expectation(2))]


def tiny_step_blocks(dt):
    """k_scale = 2^-20: for fp16 the tie block is made of subnormal inputs (6 * 2^-20)."""
    return [Block("e2m1 ties of 2^-20", to_bits(TIE_BLOCK * 2.0**-20, dt), tie_expectation(0)),
            Block("e2m1 ties of 2^-17", to_bits(TIE_BLOCK * 2.0**-17, dt), tie_expectation(3)),
            Block("next to the ties of 2^-20", _neighbour_block(2.0**-20, dt))]


def coarse_step_blocks(dt):
    """k_scale = 2^6: block scales below 1."""
    return [Block("e2m1 ties, scale 1/4", to_bits(TIE_BLOCK * 2.0**4, dt), tie_expectation(-2)),
            Block("e2m1 ties, scale 1/64", to_bits(TIE_BLOCK * 1.0, dt), tie_expectation(-6)),
            Block("e2m1 ties, scale 8", to_bits(TIE_BLOCK * 2.0**9, dt), tie_expectation(3))]


def saturating_blocks(dt):
    """k_scale = 1e-6: every block scale saturates at 448 (0x7E)."""
    return [Block("e2m1 ties, saturated", to_bits(TIE_BLOCK, dt), both([7] * 8 + [15] * 8, 0x7E)),
            Block("all 4.0, saturated", to_bits([4.0] * 16, dt), both([7] * 16, 0x7E))]


def e4m3_tie_blocks(dt):
    """k_scale = 1: blocks of amax 6t for every e4m3 midpoint t (subnormal ones too, and 464
    past the largest finite 448), so the scale sf = t is an exact e4m3 tie: RNE to the even
    byte, 448 at the top."""
    rng = np.random.default_rng(2)
    values = sc.spec_e4m3_value(np.arange(0x7F, dtype=np.uint8))  # 0 .. 448
    blocks = []
    for c in range(0x7E):
        t = (np.float64(values[c]) + np.float64(values[c + 1])) / 2
        blocks.append((t, c + (c & 1)))
    blocks.append((464.0, 0x7E))
    out = []
    for t, byte in blocks:
        x = 6 * t * rng.uniform(-0.99, 0.99, 16)
        x[rng.integers(16)] = 6 * t * (1 if rng.random() < 0.5 else -1)
        bits = to_bits(x, dt)
        assert sc.amax(bits.view(sc.DTYPES[dt])) == np.float32(6 * t), (t, dt)
        out.append(Block(f"e4m3 tie {t}", bits, {"default": (None, byte)}))
    return out


# scenario -> (k_scale, blocks(dtype name))
SCENARIOS = {
    "unit_scale": (1.0, unit_scale_blocks),
    "inf_step": (2.0**-8, inf_step_blocks),
    "tiny_step": (2.0**-20, tiny_step_blocks),
    "coarse_step": (2.0**6, coarse_step_blocks),
    "saturating": (1e-6, saturating_blocks),
    "e4m3_ties": (1.0, e4m3_tie_blocks),
}


def build(dt, blocks, k_scale, seed=0):
    """The blocks, then random normal filler blocks, as key [17, 2, 64] (the last token is
    padding); value = -key."""
    assert len(blocks) <= NUM_BLOCKS_IN
    rng = np.random.default_rng(seed)
    filler = to_bits(rng.normal(size=(NUM_TOKENS * BLOCKS_PER_TOKEN - len(blocks), 16)) * 3, dt)
    bits = np.concatenate([np.stack([b.bits for b in blocks]), filler]) if blocks else filler
    key = bits.reshape(NUM_TOKENS, NUM_HEADS, HEAD_SIZE).view(sc.DTYPES[dt])
    value = (bits ^ SIGN).reshape(key.shape).view(sc.DTYPES[dt])
    num_blocks = NUM_TOKENS // BLOCK_SIZE + 2
    slots = rng.permutation(num_blocks * BLOCK_SIZE)[:NUM_TOKENS].astype(np.int32)
    slots[-1] = -1  # padding
    cache = rng.integers(0, 256, sc.cache_shape(num_blocks, BLOCK_SIZE, NUM_HEADS, HEAD_SIZE,
                                                "HND"), dtype=np.uint8)
    scale = np.float32(k_scale)
    return sc.StoreCase(key, value, cache, slots, scale, scale, num_blocks, BLOCK_SIZE)


def stored_blocks(case, cache, side):
    """(codes [tokens*heads*4, 16], scale bytes [...]) of the valid tokens, in input order."""
    packed, scales = case.read(cache, side)
    return (sc.unpack(packed).reshape(-1, 16), scales.reshape(-1))


def input_blocks(case, side):
    x = case.key if side == 0 else case.value
    return x[case.valid_tokens()].astype(np.float32).reshape(-1, 16)


@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("scale_search", SEARCHES)
@pytest.mark.parametrize("dt", DTYPE_NAMES)
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_edge_blocks(scenario, dt, scale_search, platform):
    k_scale, make_blocks = SCENARIOS[scenario]
    blocks = make_blocks(dt)
    case = build(dt, blocks, k_scale)
    out = sc.run_kernel(case, platform, scale_search)
    sc.assert_cache_equal(case, out, sc.run_reference(case, scale_search), "kernel vs reference")
    sc.assert_only_expected_bytes_changed(case, out)

    g = np.float32(1) / np.float32(k_scale)
    k_codes, k_scales = stored_blocks(case, out, 0)
    v_codes, v_scales = stored_blocks(case, out, 1)
    np.testing.assert_array_equal(v_codes, k_codes ^ 8, "V = -K: codes differ in the sign bit")
    np.testing.assert_array_equal(v_scales, k_scales, "V = -K: same (unswizzled) scale bytes")

    # Every stored block against the numpy model of docs/format.md §2-§3.
    x = input_blocks(case, 0)
    for i in range(len(x)):
        codes, byte = sc.spec_quantize_block(x[i], g, scale_search)
        assert k_scales[i] == byte, (i, k_scales[i], byte)
        np.testing.assert_array_equal(k_codes[i], codes, f"block {i}")

    # Hand-computed expectations (block b of the input is stored row b: tokens 0..15 in order).
    assert list(case.valid_tokens()) == list(range(NUM_TOKENS - 1))
    checked = 0
    for b, block in enumerate(blocks):
        if not block.expected or scale_search not in block.expected:
            continue
        codes, byte = block.expected[scale_search]
        assert k_scales[b] == byte, f"{block.name}: scale byte {k_scales[b]:#04x} != {byte:#04x}"
        if codes is not None:
            np.testing.assert_array_equal(k_codes[b], codes, block.name)
            np.testing.assert_array_equal(stored_packed(case, out, b), sc.pack(codes),
                                          f"{block.name}: packed bytes")
        checked += 1
    assert checked == sum(scale_search in (b.expected or {}) for b in blocks)


def stored_packed(case, cache, row):
    packed, _ = case.read(cache, 0)
    return packed.reshape(-1, 8)[row]


# ---------------------------------------------------------------------------------------------
# Hand-written bytes, straight from docs/format.md.

@pytest.mark.parametrize("platform", PLATFORMS)
@pytest.mark.parametrize("dt", DTYPE_NAMES)
def test_known_bytes(platform, dt):
    """A block of all 6.0 at k_scale 1 is codes 7 (0x77 bytes) with e4m3 scale 1.0 (0x38);
    the tie block packs as 07 22 44 66 8f aa cc ee; -0.1 is code 8."""
    blocks = [Block("six", to_bits([6.0] * 16, dt)), Block("ties", to_bits(TIE_BLOCK, dt)),
              Block("minus 0.1", to_bits([6.0, -0.1] + [0.0] * 14, dt))]
    case = build(dt, blocks, 1.0)
    out = sc.run_kernel(case, platform)
    sc.assert_cache_equal(case, out, sc.run_reference(case), "kernel vs reference")
    packed, scales = case.read(out, 0, tokens=[0])
    np.testing.assert_array_equal(packed[0, 0, 0:8], [0x77] * 8)
    np.testing.assert_array_equal(packed[0, 0, 8:16],
                                  [0x07, 0x22, 0x44, 0x66, 0x8F, 0xAA, 0xCC, 0xEE])
    np.testing.assert_array_equal(packed[0, 0, 16:24], [0x87] + [0x00] * 7)
    np.testing.assert_array_equal(scales[0, 0, :3], [0x38, 0x38, 0x38])
    # V = -K: every sign bit flipped, same scales (V's sit at swizzled positions).
    v_packed, v_scales = case.read(out, 1, tokens=[0])
    np.testing.assert_array_equal(v_packed[0, 0, 0:8], [0xFF] * 8)
    np.testing.assert_array_equal(v_packed[0, 0, 16:24], [0x0F] + [0x88] * 7)
    np.testing.assert_array_equal(v_scales[0, 0, :3], [0x38, 0x38, 0x38])


# ---------------------------------------------------------------------------------------------
# Float32 subnormals flush to zero, as inputs and as results (docs/format.md §2; this is what
# XLA:CPU does to the jnp reference, and both kernels follow it: see ffi/nvfp4_numerics.h).
# A bf16 block of 2^-127 (subnormal) with k_scale = 2^-126: IEEE arithmetic would give
# amax/6 = 2.6e-39 (subnormal), sf = 0.0833 -> e4m3 byte 0x1B and codes 7; with flushing the
# input is zero, so the scale byte is 0x00 and the codes 0. The GPU must give the same bytes.

@pytest.mark.parametrize("platform", PLATFORMS)
def test_float32_subnormals_flush_to_zero(platform):
    x = np.full(16, 0x0040, np.uint16)  # bf16 2^-127
    case = build("bf16", [Block("2^-127", x)], 2.0**-126)
    codes, byte = sc.spec_quantize_block(x.view(sc.BF16).astype(np.float32), np.float32(2.0**126))
    assert byte == 0x00 and list(codes) == [0] * 16
    out = sc.run_kernel(case, platform)
    sc.assert_cache_equal(case, out, sc.run_reference(case), "kernel vs reference")
    k_codes, k_scales = stored_blocks(case, out, 0)
    assert (k_scales[0], list(k_codes[0])) == (byte, list(codes))
    # Normal inputs whose block-scale product underflows: amax = 2^-100 with k_scale = 2^30
    # gives sf = g * (amax/6) = 2^-130/6, a subnormal, which flushes: byte 0x00.
    y = np.full(16, np.float32(2.0**-100)).astype(sc.BF16).view(np.uint16)
    case = build("bf16", [Block("2^-100", y)], 2.0**30)
    out = sc.run_kernel(case, platform)
    sc.assert_cache_equal(case, out, sc.run_reference(case), "kernel vs reference (underflow)")
    _, k_scales = stored_blocks(case, out, 0)
    assert k_scales[0] == 0x00
