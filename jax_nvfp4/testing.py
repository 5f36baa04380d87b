"""Assertions for tests of code that writes or reads NVFP4 caches (in the style of ``chex``).

* :func:`assert_caches_equal`: two caches hold the same bytes. A difference is reported where
  it is in the format's own terms (stacked index, page, K or V, head, row, 16-value block, codes
  or scale byte) with the block's values decoded on both sides, not as a raw byte index.
* :func:`assert_read_back_close`: values read back from a cache are within the format's own
  error bound of the values that were stored (:func:`read_back_bound`).

Both take NumPy or JAX arrays and raise ``AssertionError``.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from . import layout as _layout
from .reference import E4M3_VALUES

_BLOCK = _layout.BLOCK_ELEMS
_SIDES = ("K", "V")
#: Lines of differing blocks listed after the first one.
_MAX_LISTED = 8


# ---------------------------------------------------------------------------------------------
# Where a byte of a cache is.


@dataclasses.dataclass(frozen=True)
class BytePlace:
    """What a byte of a cache holds: part of a 16-value block of one (head, row) of a page."""

    stacked: tuple        # index along leading (layer, group) axes; () for a plain cache
    page: int
    side: str             # "K" or "V"
    head: int
    row: int              # token row within the page
    block: int            # 16-value block within the head vector: values 16*block .. +15
    region: str           # "codes" or "scale"

    def __str__(self):
        stacked = f"stacked index {self.stacked}, " if self.stacked else ""
        first = _BLOCK * self.block
        return (f"{stacked}page {self.page}, {self.side}, head {self.head}, row {self.row}, "
                f"values {first}..{first + _BLOCK - 1} (block {self.block}), {self.region}")

    @property
    def block_key(self):
        return self.stacked, self.page, self.side, self.head, self.row, self.block


def _side_maps(geo: _layout.CacheGeometry, v_scale_swizzle: bool):
    """Per side: ``[side bytes, 4]`` int arrays of (head, row, block, region 0 codes/1 scale)
    for every byte offset of a page side (each byte belongs to exactly one block)."""
    maps = []
    heads, rows = np.meshgrid(np.arange(geo.num_kv_heads), np.arange(geo.block_size),
                              indexing="ij")
    for is_value in (False, True):
        table = np.full((geo.side_bytes, 4), -1, np.int64)
        data = geo.data_offsets()                                       # [H, T, D/2]
        scales = geo.scale_offsets(is_value, v_scale_swizzle)           # [H, T, D/16]
        for offsets, per_block, region in ((data, _BLOCK // 2, 0), (scales, 1, 1)):
            n = offsets.shape[-1]
            block = np.broadcast_to(np.arange(n) // per_block, offsets.shape)
            table[offsets.ravel()] = np.stack(
                [np.broadcast_to(heads[..., None], offsets.shape).ravel(),
                 np.broadcast_to(rows[..., None], offsets.shape).ravel(), block.ravel(),
                 np.full(offsets.size, region)], axis=-1)
        maps.append(table)
    return maps


def _decode_block(page_side, geo, is_value, v_scale_swizzle, head, row, block, scale):
    """(16 float32 values, 8 code bytes, scale byte) of one block of one page side."""
    data = geo.data_offsets()[head, row, block * _BLOCK // 2:(block + 1) * _BLOCK // 2]
    scale_byte = page_side[geo.scale_offsets(is_value, v_scale_swizzle)[head, row, block]]
    packed = page_side[data]
    codes = np.stack([packed & 0xF, packed >> 4], axis=-1).reshape(-1)
    mags = _layout.E2M1_MAGNITUDES[codes & 7]
    values = np.where(codes & 8, -mags, mags) * E4M3_VALUES[scale_byte] * np.float32(scale)
    return values.astype(np.float32), packed, int(scale_byte)


def _scalar(x, argument):
    x = np.asarray(x, np.float32).reshape(-1)
    if x.size != 1:
        raise ValueError(f"{argument} must be a scalar, got shape {x.shape}")
    return np.float32(x[0])


def _fmt_values(x):
    return np.array2string(np.asarray(x), precision=4, max_line_width=10_000,
                           separator=", ", floatmode="maxprec")


# ---------------------------------------------------------------------------------------------
# Cache equality.


def assert_caches_equal(actual, expected, *, layout="HND", v_scale_swizzle=True, k_scale=1.0,
                        v_scale=1.0, what="NVFP4 caches"):
    """Asserts that two NVFP4 caches hold the same bytes.

    On a difference the message counts the differing bytes and 16-value blocks, names the first
    differing block by stacked index, page, K/V, head, row and block, and shows its decoded
    values on both sides (``E2M1 code * E4M3 block scale * k_scale``, or ``v_scale`` for V; with
    the default scales of 1 the values are in units of the global scale), its code bytes and its
    scale byte. Further differing blocks are listed by place.

    Args:
      actual, expected: ``uint8`` caches of the same shape: one layer's
        ``[num_blocks, 2, ...]`` (:func:`jax_nvfp4.kv_cache_shape`) or with leading stacked axes
        (layers, head groups).
      layout, v_scale_swizzle: how the caches were written.
      k_scale, v_scale: the global scales, only used to decode values for the message.
      what: how the message names the two caches.
    """
    actual, expected = np.asarray(actual), np.asarray(expected)
    if actual.shape != expected.shape or actual.dtype != expected.dtype:
        raise AssertionError(f"{what}: shape/dtype {actual.shape} {actual.dtype} != "
                             f"{expected.shape} {expected.dtype}")
    if actual.dtype != np.uint8 or actual.ndim < 5:
        raise AssertionError(f"{what}: not NVFP4 caches (uint8 of rank >= 5), got "
                             f"{actual.dtype} of shape {actual.shape}")
    if np.array_equal(actual, expected):
        return
    lead = actual.shape[:-5]
    geo = _layout.CacheGeometry.from_shape(actual.shape[-5:], layout)
    pages_a = actual.reshape(lead + (geo.num_blocks, 2, geo.side_bytes))
    pages_e = expected.reshape(pages_a.shape)
    maps = _side_maps(geo, v_scale_swizzle)
    places = []
    for index in np.argwhere(pages_a != pages_e):
        *stacked, page, side, offset = (int(i) for i in index)
        head, row, block, region = (int(v) for v in maps[side][offset])
        places.append(BytePlace(tuple(stacked), page, _SIDES[side], head, row, block,
                                ("codes", "scale")[region]))
    blocks = list(dict.fromkeys(p.block_key for p in places))
    first = places[0]
    side = _SIDES.index(first.side)
    scale = _scalar(v_scale if side else k_scale, "v_scale" if side else "k_scale")
    decoded = [_decode_block(p[first.stacked + (first.page, side)], geo, side == 1,
                             v_scale_swizzle, first.head, first.row, first.block, scale)
               for p in (pages_a, pages_e)]
    unit = "" if scale != 1 else " (in units of the global scale)"
    lines = [
        f"{what} differ in {len(places)} of {actual.size} bytes, {len(blocks)} 16-value "
        f"block(s). First: {first}",
        f"  actual   values{unit}: {_fmt_values(decoded[0][0])}",
        f"  expected values{unit}: {_fmt_values(decoded[1][0])}",
        f"  code bytes: actual {decoded[0][1].tobytes().hex()}, expected "
        f"{decoded[1][1].tobytes().hex()}; scale byte: actual {decoded[0][2]:#04x} "
        f"({E4M3_VALUES[decoded[0][2]]:g}), expected {decoded[1][2]:#04x} "
        f"({E4M3_VALUES[decoded[1][2]]:g})",
    ]
    later = [p for p in dict((p.block_key, p) for p in places[1:]).values()
             if p.block_key != first.block_key]
    for p in later[:_MAX_LISTED]:
        lines.append(f"  also: {p}")
    if len(later) > _MAX_LISTED:
        lines.append(f"  ... and {len(later) - _MAX_LISTED} more block(s)")
    raise AssertionError("\n".join(lines))


# ---------------------------------------------------------------------------------------------
# Read-back error.


def _e4m3_round(x):
    import ml_dtypes

    clipped = np.clip(np.asarray(x, np.float32), -_layout.E4M3_MAX, _layout.E4M3_MAX)
    return clipped.astype(ml_dtypes.float8_e4m3fn).astype(np.float32)


def read_back_bound(original, scale, scale_search="default"):
    """Per element, how far a value read back from the cache may be from ``original``.

    A block of 16 values with largest magnitude ``amax`` is stored with the step ``s =
    e4m3(amax / c / scale) * scale`` (docs/format.md §2; ``c = 6``, and with ``"4over6"`` the
    store may pick ``c = 4`` instead, so the larger of the two bounds is taken), computed here in
    float32 as the store does. A value ``x`` with ``|x| <= 6 s`` reads back within half a gap of
    the E2M1 grid {0, 0.5, 1, 1.5, 2, 3, 4, 6} at ``|x| / s``: ``s/4`` up to 2, ``s/2`` up to 4,
    ``s`` up to 6; a larger one (block scale rounded down, or saturated at 448) reads back as
    ``6 s`` with its sign. Where ``s`` is 0 the value reads back as 0. A slack of ``2**-16`` of
    ``|x| + s`` covers float32 rounding. Blocks holding an infinity get an infinite bound.

    Args:
      original: ``[..., head_size]`` values as stored (bf16/fp16/float32).
      scale: the global scale (``k_scale`` or ``v_scale``).
      scale_search: ``"default"`` or ``"4over6"``.

    Returns:
      float64 ``[..., head_size]`` bounds.
    """
    _layout.check_scale_search(scale_search)
    x = np.asarray(original).astype(np.float32)
    if x.shape[-1] % _BLOCK:
        raise ValueError(f"original's last axis must be a multiple of {_BLOCK}, got {x.shape}")
    g = np.float32(1) / _scalar(scale, "scale")
    inv_g = np.float32(1) / g
    blocks = x.reshape(x.shape[:-1] + (-1, _BLOCK))
    mag32 = np.abs(blocks)
    amax = np.max(np.where(np.isnan(mag32), np.float32(0), mag32), axis=-1, keepdims=True)
    mag = mag32.astype(np.float64)
    bound = np.zeros_like(mag)
    recips = (np.float32(1) / np.float32(6),) + ((np.float32(0.25),) if scale_search == "4over6"
                                                 else ())
    for recip in recips:
        step = (_e4m3_round(g * (amax * recip)) * inv_g).astype(np.float64)
        safe = np.where(step > 0, step, 1.0)
        y = mag / safe
        half_gap = np.where(y <= 2, 0.25, np.where(y <= 4, 0.5, 1.0))
        b = np.where(y <= 6, half_gap * step, mag - 6 * step)
        b = np.where(step > 0, b, mag)
        bound = np.maximum(bound, b + 2.0 ** -16 * (mag + step))
    bound = np.where(np.isinf(amax), np.inf, bound)
    return bound.reshape(x.shape)


def assert_read_back_close(original, read_back, scale, *, scale_search="default",
                           what="read back"):
    """Asserts that values read back from an NVFP4 cache are within the format's bound of the
    values stored (:func:`read_back_bound`), after rounding to ``read_back``'s dtype.

    Args:
      original: ``[..., head_size]``: the key (or value) vectors that were stored.
      read_back: the same vectors read back (e.g. rows of :func:`jax_nvfp4.dequantize`), same
        shape; a bf16/fp16 read-back also gets half an ulp of its own dtype.
      scale: the global scale they were stored with (``k_scale`` or ``v_scale``).
      scale_search: as stored.
    """
    x = np.asarray(original)
    y = np.asarray(read_back)
    if x.shape != y.shape:
        raise AssertionError(f"{what}: shape {y.shape} != original's {x.shape}")
    x64 = x.astype(np.float32).astype(np.float64)
    y64 = y.astype(np.float32).astype(np.float64)
    bound = read_back_bound(x, scale, scale_search)
    if y.dtype != np.float64:   # rounding of the read-back to its own dtype (bf16, fp16, f32)
        import ml_dtypes

        bound = bound + np.abs(y64) * float(ml_dtypes.finfo(y.dtype).eps) / 2
    err = np.abs(y64 - x64)
    bad = ~(err <= bound) & ~np.isnan(x64)
    if not bad.any():
        return
    index = tuple(int(i) for i in np.argwhere(bad)[0])
    block = index[-1] // _BLOCK
    lo = block * _BLOCK
    lines = [
        f"{what}: {int(bad.sum())} of {x.size} values outside the NVFP4 bound; first at index "
        f"{index} (block of values {lo}..{lo + _BLOCK - 1}): original {x64[index]:.6g}, read "
        f"back {y64[index]:.6g}, |error| {err[index]:.6g} > bound {bound[index]:.6g}",
        f"  original block:  {_fmt_values(x64[index[:-1]][lo:lo + _BLOCK].astype(np.float32))}",
        f"  read-back block: {_fmt_values(y64[index[:-1]][lo:lo + _BLOCK].astype(np.float32))}",
    ]
    raise AssertionError("\n".join(lines))


__all__ = ["BytePlace", "assert_caches_equal", "assert_read_back_close", "read_back_bound"]
