"""Outliers: what a global scale does to a calibration batch (:func:`diagnose`), the
head-dimension rotation (:func:`hadamard_transform`) and per-channel factors for outlier
channels (:func:`channel_factors`).

One float32 global scale covers a whole side (K or V) of a cache. A value far larger than the
rest (an attention-sink token 1e2 to 1e5 times the others) sets that scale, and every ordinary
16-value block then gets an E4M3 block scale near the bottom of E4M3's range: subnormal (1 to 3
significant bits) or zero, and a block whose scale is zero is stored as zeros. Nothing reports
it: the store writes valid bytes and the readers read plausible small numbers. :func:`diagnose`
measures it on a calibration batch with the store's own quantiser; the remedies (README,
"Outliers") are a smaller headroom (``scale_from_amax(amax, headroom=1)``) for token outliers,
power-of-two channel factors for outlier channels and, for outliers confined to a few channels
of a token, the rotation.
"""

from __future__ import annotations

import functools
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

from . import checks
from . import layout as _layout
from . import reference as _reference

#: What :func:`diagnose` takes as key and value (the store takes the first two).
DIAGNOSE_DTYPES = ("bfloat16", "float16", "float32")
#: The smallest block of the block-diagonal transform for head sizes that are not powers of two.
MIN_HADAMARD_BLOCK = _layout.BLOCK_ELEMS


# --------------------------------------------------------------------------- diagnose


class SideDiagnosis(NamedTuple):
    """What the store does to one side (K or V) of a batch at one global scale.

    Every field is a JAX scalar (a pytree leaf): int32 counts, float32 shares in ``[0, 1]``.
    """

    #: 16-value blocks in the batch.
    num_blocks: jax.Array
    #: Blocks whose largest magnitude is nonzero (NaN blocks are not counted).
    nonzero_blocks: jax.Array
    #: Share of the nonzero blocks whose stored E4M3 block scale is subnormal (nonzero, below
    #: 2**-6: 1 to 3 significant bits).
    subnormal_scale_share: jax.Array
    #: Share of the nonzero blocks whose block scale is zero: the whole block reads back as 0.
    zero_scale_share: jax.Array
    #: Share of the nonzero input values (Inf included) that read back as zero.
    zeroed_value_share: jax.Array
    #: Share of all values whose magnitude exceeds ``6 * 448 * scale``, the largest stored one
    #: (Inf included): they read back as that.
    clipped_share: jax.Array
    #: ``||read back - x|| / ||x||`` over all values (0 for an all-zero side; NaN where the
    #: data holds NaN or Inf or the scale is invalid).
    rel_error: jax.Array
    #: The mean over the nonzero blocks of each block's own ``||read back - x|| / ||x||``: an
    #: outlier cannot hide the other blocks' errors in it as it does in ``rel_error`` (about 0.09
    #: for Gaussian data, 1 for blocks stored as zeros; NaN where a block holds NaN or Inf).
    mean_block_rel_error: jax.Array
    #: Largest finite magnitude of the side (NaN and Inf ignored; 0 if there is none).
    amax: jax.Array
    #: The global scale, as float32.
    scale: jax.Array
    #: Whether ``scale`` is a valid global scale (an invalid one makes the store write NaN).
    scale_valid: jax.Array

    def summary(self, name: str = "K") -> str:
        """A few readable lines about this side (eagerly: the fields must be concrete)."""
        s, amax = float(self.scale), float(self.amax)
        nonzero = int(self.nonzero_blocks)
        below = float(self.subnormal_scale_share) + float(self.zero_scale_share)
        lines = [
            f"{name}: scale {s:.4g}{'' if bool(self.scale_valid) else ' (INVALID: stored as NaN)'}"
            f", amax {amax:.4g} (largest stored: 6 * 448 * scale = {_layout.LARGEST_STORED * s:.4g})"
            f"; {int(self.num_blocks)} blocks of {_layout.BLOCK_ELEMS} values, {nonzero} nonzero",
            f"  block scales of the nonzero blocks: {_percent(self.subnormal_scale_share)} "
            f"E4M3-subnormal (below 2**-6), {_percent(self.zero_scale_share)} zero",
            f"  nonzero values stored as zero: {_percent(self.zeroed_value_share)}; values clipped "
            f"(above the largest stored): {_percent(self.clipped_share)}",
            f"  relative L2 error of the round trip: {float(self.rel_error):.4f} over all "
            f"values, {float(self.mean_block_rel_error):.4f} per nonzero block on average",
        ]
        if float(self.clipped_share) > 0:
            lines.append("  -> values are clipped: the scale is too small for this data "
                         "(calibrate with jax_nvfp4.scale_from_amax(amax))")
        if below > SUMMARY_BELOW_NORMAL:
            lines.append(f"  -> {below:.1%} of the nonzero blocks have block scales below E4M3's "
                         f"normal range (subnormal: 1 to 3 significant bits; zero: the block is "
                         f"stored as zeros): values far larger than most (an outlier?) set the "
                         f"global scale. README, 'Outliers', has the remedies")
        return "\n".join(lines)


#: :meth:`SideDiagnosis.summary` points at the remedies when more than this share of the nonzero
#: blocks have block scales below E4M3's normal range (Gaussian data at amax/448: none).
SUMMARY_BELOW_NORMAL = 0.01


def _percent(share) -> str:
    return f"{float(share):.2%}"


class Diagnosis(NamedTuple):
    """:func:`diagnose`'s report: one :class:`SideDiagnosis` per side. A pytree (a tuple of
    tuples of JAX scalars): returned by ``jax.jit(diagnose)`` as it is."""

    key: SideDiagnosis
    value: SideDiagnosis

    def summary(self) -> str:
        """Both sides' :meth:`SideDiagnosis.summary` (eagerly)."""
        return self.key.summary("K") + "\n" + self.value.summary("V")


def diagnose(key, value, k_scale, v_scale, *, scale_search="default"):
    """What the store would do to a calibration batch at the global scales ``k_scale`` and
    ``v_scale``: how many blocks lose their precision to an outlier, how many values are
    stored as zeros or clipped, and the round trip's error. Needs no ``checked=True``.

    The numbers are those of the real store bytes: each side is quantised with the store's
    own quantiser (:func:`jax_nvfp4.reference.quantize_blocks`, the bytes every store kernel
    writes, ``scale_search`` included) and read back as :func:`jax_nvfp4.dequantize` reads it
    (docs/format.md §1), in float32, without a cache. An invalid scale is replaced by NaN as
    the store does (:func:`jax_nvfp4.checks.sanitize_scale`): ``scale_valid`` is then False and
    the error NaN.

    What to look for: Gaussian-like data at ``scale_from_amax(amax)`` has no subnormal or zero
    block scales, nothing clipped, about 7% of its nonzero values stored as zero (small values
    next to larger ones in their block: the format's own rounding) and a relative error of
    about 0.095. A large outlier shows as subnormal or zero block scales and a zeroed share
    near 1; a scale too small for the data as clipped values. ``summary()`` prints it.

    Works eagerly and under ``jax.jit`` (``scale_search`` static). For a float32 batch the
    values are quantised as given; the store takes bf16/fp16 only, whose rounding of the
    float32 values is not included.

    Args:
      key, value: ``[num_tokens, num_kv_heads, head_size]``, as :func:`jax_nvfp4.reshape_and_cache`
        takes them (bfloat16 or float16; float32 is accepted too), same dtype and shape;
        head_size a multiple of 16.
      k_scale, v_scale: the global scales, as the store takes them (any real scalar of shape
        ``()`` or ``(1,)``, used as float32).
      scale_search: ``"default"`` or ``"4over6"``, as for the store.

    Returns:
      A :class:`Diagnosis` ``(key, value)`` of :class:`SideDiagnosis` (int32 and float32
      scalars); ``.summary()`` formats it.

    Raises:
      TypeError, ValueError: at trace time, naming the argument.
    """
    checks.check_options(scale_search=scale_search)
    key, value = (x if hasattr(x, "dtype") else jnp.asarray(x) for x in (key, value))
    checks.check_key_value(key, value, False, dtypes=DIAGNOSE_DTYPES)
    k_scale, v_scale = checks.as_scales(k_scale, v_scale)
    checks.check_scale(k_scale, "k_scale")
    checks.check_scale(v_scale, "v_scale")
    return Diagnosis(_diagnose_side(key, k_scale, scale_search),
                     _diagnose_side(value, v_scale, scale_search))


def _diagnose_side(x, scale, scale_search):
    scale = jnp.reshape(scale, ())
    used = checks.sanitize_scale(scale)
    blocks = x.astype(jnp.float32).reshape(-1, _layout.BLOCK_ELEMS)        # [N, 16]
    codes, scale_bytes = _reference.quantize_blocks(blocks, used, scale_search)
    back = _reference._rounded(_reference.dequantize_blocks(codes, scale_bytes, used))

    block_amax = _reference._block_amax(blocks)
    nonzero = block_amax > 0                                 # NaN and zero blocks excluded
    below = _reference.e4m3_below_normal(scale_bytes)
    zero = scale_bytes == 0
    num_nonzero = jnp.sum(nonzero, dtype=jnp.int32)
    a = jnp.abs(blocks)
    nonzero_values = a > 0
    amax = jnp.max(jnp.where(jnp.isfinite(a), a, 0), initial=0.0)

    err2, ref2 = _squares(back, blocks, amax, axis=None)
    rel_error = _relative(err2, ref2)
    block_err2, block_ref2 = _squares(back, blocks, block_amax[:, None], axis=-1)
    block_rel = jnp.where(nonzero, _relative(block_err2, block_ref2), 0)

    def share(count, total):
        return (count / jnp.maximum(total, 1)).astype(jnp.float32)

    return SideDiagnosis(
        num_blocks=jnp.int32(blocks.shape[0]),
        nonzero_blocks=num_nonzero,
        subnormal_scale_share=share(jnp.sum(nonzero & below & ~zero, dtype=jnp.int32),
                                    num_nonzero),
        zero_scale_share=share(jnp.sum(nonzero & zero, dtype=jnp.int32), num_nonzero),
        zeroed_value_share=share(jnp.sum(nonzero_values & (back == 0), dtype=jnp.int32),
                                 jnp.sum(nonzero_values, dtype=jnp.int32)),
        clipped_share=share(jnp.sum(a > _reference.largest_stored(used), dtype=jnp.int32),
                            blocks.size),
        rel_error=rel_error.astype(jnp.float32),
        mean_block_rel_error=(jnp.sum(block_rel) / jnp.maximum(num_nonzero, 1)).astype(
            jnp.float32),
        amax=amax.astype(jnp.float32),
        scale=scale,
        scale_valid=checks.scale_is_valid(scale),
    )


def _squares(back, x, amax, axis):
    """(sum of squared errors, sum of squares) over ``axis``, each value first scaled by a power
    of two near ``1/amax`` (exact, and itself a normal float32): no overflow for data near
    float32's top, no underflow for tiny data. Each square is rounded on its own (no fused
    multiply-add into the sum: eager and jit agree)."""
    finite = jnp.where(jnp.isfinite(amax), amax, 0)
    unit = jnp.ldexp(jnp.float32(1), -jnp.clip(jnp.frexp(finite)[1], -126, 126))
    err2 = jnp.sum(_reference._rounded(jnp.square((back - x) * unit)), axis=axis)
    ref2 = jnp.sum(_reference._rounded(jnp.square(x * unit)), axis=axis)
    return err2, ref2


def _relative(err2, ref2):
    """sqrt(err2 / ref2), and sqrt(err2) where ref2 is 0 (an all-zero reference: 0 when nothing
    changed)."""
    return jnp.sqrt(err2 / jnp.where(ref2 > 0, ref2, 1))


# --------------------------------------------------------------------------- rotation


def hadamard_block_size(head_size: int) -> int:
    """The size of the Hadamard blocks :func:`hadamard_transform` uses for a last axis of
    ``head_size``: ``head_size`` itself when it is a power of two, else the largest power of
    two dividing it, which must be at least 16 (80 -> 16, 96 -> 32, 192 -> 64).

    Raises ``ValueError`` naming the head size when there is none (e.g. 40, 24)."""
    head_size = _layout.check_int(head_size, "head_size")
    if head_size <= 0:
        raise ValueError(f"head_size must be positive, got {head_size}")
    block = head_size & -head_size                     # the largest power of two dividing it
    if block != head_size and block < MIN_HADAMARD_BLOCK:
        raise ValueError(
            f"head_size {head_size} is not a power of two and the largest power of two "
            f"dividing it, {block}, is below {MIN_HADAMARD_BLOCK}: no block-diagonal Hadamard "
            f"transform of blocks >= {MIN_HADAMARD_BLOCK} fits it")
    return block


@functools.lru_cache(maxsize=None)
def _sylvester(n: int) -> np.ndarray:
    """Orthonormal Sylvester-Hadamard matrix of size n (a power of two), float32, read-only
    (built in float64, divided by sqrt(n), rounded to float32 once; benchmarks/quality_bench.py
    uses it too)."""
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    out = (h / math.sqrt(n)).astype(np.float32)
    out.flags.writeable = False
    return out


def hadamard_matrix(head_size: int) -> np.ndarray:
    """The matrix ``H`` of :func:`hadamard_transform` for a last axis of ``head_size``:
    ``hadamard_transform(x) == x @ H`` (up to float32 rounding). ``[head_size, head_size]``
    float32 NumPy, read-only, cached per size: the orthonormal Sylvester-Hadamard matrix
    (entries ``+-1/sqrt(head_size)``, symmetric, ``H @ H = I``) for a power of two, else the
    block-diagonal matrix of :func:`hadamard_block_size` blocks of it.

    Raises ``ValueError`` naming the head size when it has no such blocks."""
    block = hadamard_block_size(head_size)
    return _block_diagonal(int(head_size), block)


@functools.lru_cache(maxsize=None)
def _block_diagonal(head_size: int, block: int) -> np.ndarray:
    h = _sylvester(block)
    if block != head_size:
        h = np.kron(np.eye(head_size // block, dtype=np.float32), h)
        h.flags.writeable = False
    return h


def hadamard_transform(x):
    """The orthonormal Walsh-Hadamard transform of ``x`` along its last axis (the head size):
    ``x @ H`` with ``H`` of :func:`hadamard_matrix`, its own inverse (``H`` is symmetric and
    orthogonal), computed in float32 and returned in ``x``'s dtype.

    For a last axis that is not a power of two ``H`` is block-diagonal: the largest
    power-of-two block of at least 16 dividing it (:func:`hadamard_block_size`). The transform
    is one small float32 matmul per token with a constant ``[block, block]`` matrix
    (``Precision.HIGHEST``: no TF32 on GPUs), jit-compatible.

    The rotation recipe: attention is unchanged by rotating q and k alike (``(q H) . (k H) = q .
    k`` for an orthogonal ``H``), and a weighted sum of rotated values is the rotated weighted
    sum, undone by one more ``H``. So

    * store ``hadamard_transform(k)`` and ``hadamard_transform(v)`` (after RoPE, as the cache is
      given them), with ``k_scale``/``v_scale`` calibrated on the rotated K and V;
    * attend with ``hadamard_transform(q)`` as the query (``sm_scale`` unchanged);
    * apply ``hadamard_transform`` to the attention output: that is the un-rotated output.

    It happens outside the kernels, so it holds for :func:`jax_nvfp4.paged_attention` and
    :func:`jax_nvfp4.ragged_paged_attention` on every backend (and for ``return_lse``: the
    scores, hence the lse, are the same). What it buys: a value that is an outlier in one
    channel of a token (an attention sink's massive activation) is spread over the whole head,
    which divides its magnitude, hence the global scale it sets, by up to ``sqrt(head_size)``.
    What it does not: outliers in a channel of every token (a few large K channels) are spread
    into every 16-value block, which NVFP4's per-block scales had confined to one block; that
    made the measured error larger, not smaller (README, "Outliers"). Measure first
    (:func:`diagnose`, benchmarks/RESULTS.md).

    Args:
      x: a floating-point array ``[..., head_size]``.

    Returns:
      The transformed array, ``x``'s shape and dtype.

    Raises:
      TypeError: ``x`` is not a floating-point array.
      ValueError: the head size has no power-of-two block >= 16 (naming it), or ``x`` is a
        scalar.
    """
    x = x if hasattr(x, "dtype") else jnp.asarray(x)
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"x must be a floating-point array, got {checks.dtype_name(x.dtype)}")
    if not x.shape:
        raise ValueError("x must have at least one axis (the head size is its last)")
    head_size = int(x.shape[-1])
    block = hadamard_block_size(head_size)
    xf = x.astype(jnp.float32).reshape(*x.shape[:-1], head_size // block, block)
    y = jnp.matmul(xf, jnp.asarray(_sylvester(block)), precision=jax.lax.Precision.HIGHEST)
    return y.reshape(x.shape).astype(x.dtype)


#: Channels whose calibration amax is at least this many times their head's median channel
#: amax get a factor in :func:`channel_factors`.
CHANNEL_FACTOR_THRESHOLD = 8.0
#: The largest factor exponent: 2**126 keeps any float32 amax above the smallest normal.
_MAX_FACTOR_EXPONENT = 126


def channel_factors(channel_amax, *, threshold=CHANNEL_FACTOR_THRESHOLD):
    """Power-of-two factors per channel that bring outlier channels back to their head's size.

    ``channel_amax`` is a calibration batch's largest magnitude per channel, e.g.
    ``jnp.max(jnp.abs(k), axis=0)`` of K ``[tokens, num_kv_heads, head_size]`` (after RoPE, as
    the cache is given it): ``[..., head_size]``. A channel whose amax is at least
    ``threshold`` times the median channel amax of its row (its kv head) gets ``2**round(log2(
    amax / median))``, every other channel 1: float32 ``[..., head_size]``, exact powers of
    two, at least 1.

    The recipe (README, "Outliers"): a few channels of K 10 to 1000 times the rest on every
    token (channel outliers) set the block scale of their 16-value block, whose other values
    then round to zero; no global scale helps and the Hadamard rotation makes it worse. Divide
    them out before the store and put them back where they are used, per kv head ``h`` and
    channel ``c``, with ``f = channel_factors(k_amax)`` (``[num_kv_heads, head_size]``):

    * store ``k / f`` (``k_scale`` calibrated on ``k / f``) and attend with ``q * f_q`` as the
      query, ``f_q = jnp.repeat(f, num_q_heads // num_kv_heads, axis=0)`` (each query head
      takes its kv head's factors): ``(q f) . (k / f) = q . k``;
    * likewise V: store ``v / g`` (``g = channel_factors(v_amax)``) and multiply the attention
      output by ``jnp.repeat(g, group, axis=0)`` (the output is linear in each channel of v).

    Dividing and multiplying by powers of two is exact in bf16, fp16 and float32 (away from
    their range limits), so the recipe changes nothing but what the cache stores; it happens
    outside the kernels, so it holds for every reader and backend. jit-compatible.

    Args:
      channel_amax: a float array ``[..., head_size]`` (NaN or negative entries count as 0:
        factor 1).
      threshold: a Python number > 1.

    Returns:
      float32 factors, ``channel_amax``'s shape.

    Raises:
      TypeError: ``channel_amax`` is not a real array, ``threshold`` not a number.
      ValueError: ``threshold`` not > 1, or ``channel_amax`` a scalar.
    """
    if isinstance(threshold, (bool, np.bool_)) or not isinstance(
            threshold, (int, float, np.integer, np.floating)):
        raise TypeError(f"threshold must be a number > 1, got {threshold!r}")
    if not (math.isfinite(float(threshold)) and float(threshold) > 1):
        raise ValueError(f"threshold must be a finite number > 1, got {threshold!r}")
    a = channel_amax if hasattr(channel_amax, "dtype") else jnp.asarray(channel_amax)
    if not (jnp.issubdtype(a.dtype, jnp.floating) or jnp.issubdtype(a.dtype, jnp.integer)):
        raise TypeError(f"channel_amax must be a real array, got {checks.dtype_name(a.dtype)}")
    if not a.shape:
        raise ValueError("channel_amax must have at least one axis (channels are its last)")
    a = jnp.asarray(a, jnp.float32)
    a = jnp.where(a > 0, a, 0.0)                                   # NaN and negatives: 0
    median = jnp.median(a, axis=-1, keepdims=True)
    ratio = jnp.where(median > 0, a / jnp.where(median > 0, median, 1.0), 0.0)
    exponent = jnp.where(ratio >= np.float32(threshold), jnp.round(jnp.log2(ratio)), 0.0)
    exponent = jnp.clip(exponent, 0, _MAX_FACTOR_EXPONENT).astype(jnp.int32)
    return jnp.ldexp(jnp.ones_like(a), exponent)
