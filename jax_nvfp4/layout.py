"""Geometry of the NVFP4 paged KV cache (docs/format.md §1 and §4), computed in one place.

A cache is one ``uint8`` array per attention layer:

* ``"HND"``: ``[num_blocks, 2, num_kv_heads, block_size, F]`` (what trtllm-gen reads)
* ``"NHD"``: ``[num_blocks, 2, block_size, num_kv_heads, F]``

with ``F = head_size // 2 + head_size // 16`` bytes per (head, token). Axis 1 is K (0) or V (1).
The ``num_kv_heads * block_size * F`` bytes of one (block, side) are a data region followed by a
scale region; the trailing axes only size the page, they do not index it.
"""

from __future__ import annotations

import dataclasses

import numpy as np

#: Elements that share one FP8 (E4M3) block scale.
BLOCK_ELEMS = 16
#: Packed FP4 codes per byte.
CODES_PER_BYTE = 2
#: Largest finite E4M3 magnitude.
E4M3_MAX = 448.0
#: The page layouts (docs/format.md §4).
LAYOUTS = ("HND", "NHD")
#: Block-scale choices (docs/format.md §2 and §3).
SCALE_SEARCHES = ("default", "4over6")
#: Magnitudes of the eight E2M1 codes (bit 3 is the sign).
E2M1_MAGNITUDES = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0], np.float32)
#: Largest value a cache holds at a global scale of 1: the largest E2M1 magnitude times the
#: largest E4M3 block scale (values beyond ``LARGEST_STORED * scale`` are clipped).
LARGEST_STORED = 6.0 * E4M3_MAX
#: Valid global scales (k_scale, v_scale) are float32 numbers in [MIN_SCALE, MAX_SCALE].
#: MIN_SCALE is the smallest normal float32: every implementation flushes float32 subnormals to
#: zero, so a smaller scale would be a zero scale. At MAX_SCALE the largest stored value,
#: ``LARGEST_STORED * MAX_SCALE``, is still a finite float32. Zero, negative, NaN, infinite and
#: subnormal scales are outside the range; the store and the readers turn such a scale into NaN
#: (see :func:`jax_nvfp4.checks.sanitize_scale`).
MIN_SCALE = 2.0 ** -126
MAX_SCALE = 2.0 ** 116


#: Names of a per-layer cache's axes, in order, for each layout (docs/format.md §4): the one place
#: the HND/NHD axis order is written down in Python (ffi/store_ffi.h reads the same for C++).
CACHE_AXES = {
    "HND": ("blocks", "side", "heads", "rows", "f"),
    "NHD": ("blocks", "side", "rows", "heads", "f"),
}


def check_layout(layout, argument: str = "layout") -> str:
    if layout not in LAYOUTS:
        raise ValueError(f"{argument} must be one of {LAYOUTS}, got {layout!r}")
    return layout


def check_scale_search(scale_search, argument: str = "scale_search") -> str:
    if scale_search not in SCALE_SEARCHES:
        raise ValueError(f"{argument} must be one of {SCALE_SEARCHES}, got {scale_search!r}")
    return scale_search


def head_bytes(head_size: int) -> int:
    """Bytes one (head, token) takes in one side of a page: packed codes plus scales."""
    return head_size // CODES_PER_BYTE + head_size // BLOCK_ELEMS


def check_head_size(head_size: int, v_scale_swizzle: bool, argument: str = "head_size") -> None:
    if head_size <= 0 or head_size % BLOCK_ELEMS:
        raise ValueError(f"{argument} must be a positive multiple of {BLOCK_ELEMS}, got {head_size}")
    if v_scale_swizzle and head_size % (4 * BLOCK_ELEMS):
        raise ValueError(
            f"{argument}={head_size}: swizzled V scales are a bijection only when head_size is a "
            f"multiple of 64 (docs/format.md §4); use v_scale_swizzle=False for this head size")


def check_int(value, argument: str) -> int:
    """A Python or NumPy integer (not a bool, not a float): sizes and counts."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{argument} must be an int, got {value!r}")
    return int(value)


def check_block_size(block_size: int, argument: str = "block_size") -> None:
    if block_size <= 0 or block_size % 4:
        raise ValueError(f"{argument} must be a positive multiple of 4, got {block_size}")


def kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                   layout: str = "HND") -> tuple[int, int, int, int, int]:
    """Shape of one layer's NVFP4 paged cache (``uint8``).

    Args:
      num_blocks: pages in the cache.
      block_size: tokens per page, a multiple of 4.
      num_kv_heads: key/value heads.
      head_size: elements per head vector, a multiple of 16.
      layout: ``"HND"`` (default) or ``"NHD"``.

    Returns:
      ``(num_blocks, 2, num_kv_heads, block_size, F)`` for HND,
      ``(num_blocks, 2, block_size, num_kv_heads, F)`` for NHD, with
      ``F = head_size // 2 + head_size // 16``.
    """
    check_layout(layout)
    for name, value in (("num_blocks", num_blocks), ("block_size", block_size),
                        ("num_kv_heads", num_kv_heads), ("head_size", head_size)):
        check_int(value, name)
    check_block_size(block_size)
    check_head_size(head_size, v_scale_swizzle=False)
    if num_blocks < 0 or num_kv_heads <= 0:
        raise ValueError(f"num_blocks must be >= 0 and num_kv_heads > 0, got {num_blocks}, {num_kv_heads}")
    sizes = dict(blocks=num_blocks, side=2, heads=num_kv_heads, rows=block_size,
                 f=head_bytes(head_size))
    return tuple(sizes[name] for name in CACHE_AXES[layout])


@dataclasses.dataclass(frozen=True)
class CacheGeometry:
    """What a cache's shape and layout say: derived once, used by every reader and writer."""

    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_size: int
    layout: str

    @classmethod
    def from_shape(cls, shape, layout: str, argument: str = "kv_cache") -> "CacheGeometry":
        """Reads a per-layer cache shape (its last five axes); errors name ``argument``, and
        the layout the shape fits when it does not fit ``layout``."""
        check_layout(layout)
        shape = tuple(shape)
        try:
            return cls._read(shape, layout, argument)
        except ValueError as error:
            hint = cls.layout_hint(shape, layout, argument=argument)
            if not hint:
                raise
            raise ValueError(f"{error}{hint}") from None

    @classmethod
    def _read(cls, shape, layout: str, argument: str) -> "CacheGeometry":
        if len(shape) != 5:
            raise ValueError(
                f"{argument} must have rank 5 ([num_blocks, 2, ...] per layer), got shape {shape}")
        if shape[1] != 2:
            raise ValueError(f"{argument} axis 1 must be 2 (K and V), got shape {shape}")
        sizes = dict(zip(CACHE_AXES[layout], shape))
        num_blocks, num_kv_heads, block_size, f = (sizes[n] for n in ("blocks", "heads", "rows", "f"))
        # F = 9 * head_size / 16.
        if f % 9:
            raise ValueError(f"{argument} trailing axis {f} is not head_size/2 + head_size/16 for "
                             f"any head_size (shape {shape})")
        check_block_size(block_size, argument=f"{argument} block_size")
        if num_kv_heads <= 0:
            raise ValueError(f"{argument} must have at least one kv head, got shape {shape}")
        return cls(num_blocks, block_size, num_kv_heads, f // 9 * BLOCK_ELEMS, layout)

    @classmethod
    def other_reading(cls, shape, layout: str) -> "CacheGeometry | None":
        """The geometry of ``shape`` read in the other layout, or None where it does not fit.

        The bytes of a cache do not record its layout: a shape that fits both readings (e.g.
        num_kv_heads == block_size) is read as the caller says."""
        other = LAYOUTS[1 - LAYOUTS.index(layout)]
        try:
            return cls._read(tuple(shape), other, "kv_cache")
        except ValueError:
            return None

    @classmethod
    def layout_hint(cls, shape, layout: str, fits=lambda other: True,
                    argument: str = "kv_cache") -> str:
        """For an error about ``shape`` read in ``layout``: '. <written_as_hint>' when the other
        reading of the shape is a geometry that ``fits`` the caller's other arguments, else ''."""
        other = cls.other_reading(shape, layout)
        if other is None or not fits(other):
            return ""
        return ". " + other.written_as_hint(argument)

    def written_as_hint(self, argument: str = "kv_cache") -> str:
        """'this cache has the HND shape for ...; was it written with layout='HND'?'"""
        return (f"{argument} has the {self.layout} shape for num_kv_heads={self.num_kv_heads}, "
                f"block_size={self.block_size}, head_size={self.head_size}; was it written with "
                f"layout={self.layout!r}? (the bytes do not record the layout: pass the one it "
                f"was written with)")

    @property
    def scales_per_head(self) -> int:
        return self.head_size // BLOCK_ELEMS

    @property
    def head_data_bytes(self) -> int:
        return self.head_size // CODES_PER_BYTE

    @property
    def side_data_bytes(self) -> int:
        return self.num_kv_heads * self.block_size * self.head_data_bytes

    @property
    def side_bytes(self) -> int:
        return self.num_kv_heads * self.block_size * head_bytes(self.head_size)

    @property
    def num_slots(self) -> int:
        return self.num_blocks * self.block_size

    def pages(self, kv_cache):
        """The cache viewed as ``[num_blocks, 2, side bytes]``: how every reader and writer
        addresses it (a reshape, free)."""
        return kv_cache.reshape(self.num_blocks, 2, self.side_bytes)

    def plane_rows(self) -> np.ndarray:
        """``[num_kv_heads, block_size]``: row of (head, token row) in a head/token plane."""
        h = np.arange(self.num_kv_heads)[:, None]
        t = np.arange(self.block_size)[None, :]
        if self.layout == "HND":
            return h * self.block_size + t
        return t * self.num_kv_heads + h

    def data_offsets(self) -> np.ndarray:
        """``[num_kv_heads, block_size, head_size/2]``: byte of each packed pair within a side."""
        rows = self.plane_rows()[:, :, None]
        return rows * self.head_data_bytes + np.arange(self.head_data_bytes)

    def scale_offsets(self, is_value: bool, v_scale_swizzle: bool) -> np.ndarray:
        """``[num_kv_heads, block_size, head_size/16]``: byte of each block scale within a side."""
        s_count = self.scales_per_head
        t = np.arange(self.block_size)[:, None]
        s = np.arange(s_count)[None, :]
        if is_value and v_scale_swizzle:
            group = s_count // 4
            row = (t // 4) * 4 + s // group
            col = (s % group) * 4 + t % 4
        else:
            row = np.broadcast_to(t, (self.block_size, s_count))
            col = np.broadcast_to(s, (self.block_size, s_count))
        h = np.arange(self.num_kv_heads)[:, None, None]
        if self.layout == "HND":
            plane = h * self.block_size + row[None]
        else:
            plane = row[None] * self.num_kv_heads + h
        return self.side_data_bytes + plane * s_count + col[None]
