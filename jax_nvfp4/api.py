"""Public API: the NVFP4 store, the cache allocator and the reader."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from . import checks
from . import layout as _layout
from . import reference as _reference
from .primitive import store_p


def reshape_and_cache(key, value, kv_cache, slot_mapping, k_scale, v_scale, *, layout="HND",
                      scale_search="default", v_scale_swizzle=True, checked=False):
    """Quantises key/value to NVFP4 and writes them into their slots of a paged cache.

    Token ``i`` goes to page ``slot_mapping[i] // block_size``, row ``slot_mapping[i] %
    block_size``. Negative slots are padding and slots ``>= num_blocks * block_size`` are skipped:
    nothing is written for them. Every other byte of the cache is left as it was. Duplicate slots
    in one call are undefined (which token wins is not specified); ``checked=True`` detects them.

    The result is the cache itself (the XLA custom call aliases it): under ``jax.jit`` with the
    cache donated (``donate_argnums``) the update happens in place and costs O(num_tokens).
    Without donation (and when called eagerly) XLA first copies the whole cache, on every
    call: O(cache size), e.g. about 900x slower for a decode step into a 144 MiB cache on a
    2-core CPU (benchmarks/RESULTS.md). Donate the cache: ``jax.jit(step,
    donate_argnums=...)``, several layers' caches as one tuple (README, "A decode step over
    several layers").

    The global scales belong to the cache for its whole life (docs/format.md §1): the bytes do
    not record them, so every reader must be passed the ``k_scale``/``v_scale`` the rows were
    written with, and a row read with another scale reads back multiplied by the ratio of the
    two, with no error. Calibrate once, before the first store, and keep the scales with the
    cache; a new calibration means a new cache (or every row written again).

    Under a multi-device ``jit`` the store runs per shard, in place and with no collective,
    when the cache is sharded along its ``num_blocks`` axis or its leading stacked axes (layers
    under ``vmap``, nested or not, head groups of
    :func:`jax_nvfp4.sharding.reshape_and_cache_grouped`, the tensor-parallel form, or both).
    A page holds all heads' data and then all heads' scales, so the head axis of a plain cache
    cannot be split: a cache (or any operand) sharded along another axis is gathered first:
    correct, not fast. See :mod:`jax_nvfp4.partitioning` (the rules) and
    :mod:`jax_nvfp4.sharding` (the head-grouped cache).

    Args:
      key, value: ``[num_tokens, num_kv_heads, head_size]``, bfloat16 or float16, same dtype.
        head_size must be a multiple of 16 (of 64 with ``v_scale_swizzle=True``).
      kv_cache: ``uint8`` cache of :func:`kv_cache_shape` for ``layout``.
      slot_mapping: ``[num_tokens]`` int32 or int64.
      k_scale, v_scale: scalars (shape ``()`` or ``(1,)``): the *dequantisation* multipliers,
        e.g. ``amax(|K|) / 448`` (:func:`jax_nvfp4.scale_from_amax`); the store divides by
        them. Any real number is taken and used as float32, eagerly and under ``jit`` alike
        (a Python int or float, a NumPy or JAX scalar or array of any integer or floating-point
        dtype; bool and complex are a ``TypeError``: :func:`jax_nvfp4.checks.as_scale`). They
        are operands, not constants: a scale computed at run time does not recompile. The
        cache keeps them for its whole life (above).
        A valid scale is a float32 in ``[2**-126, 2**116]`` (``MIN_SCALE``, ``MAX_SCALE``);
        any other (zero, negative, NaN, infinite, subnormal, larger) is replaced by NaN, so
        the tokens stored with it get NaN block scales and read back as NaN, on every
        backend (:func:`jax_nvfp4.checks.sanitize_scale`).
      layout: ``"HND"`` (default, what trtllm-gen reads) or ``"NHD"``.
      scale_search: ``"default"`` (block scale from amax/6) or ``"4over6"`` (also tries amax/4
        and keeps the scale with the smaller squared error).
      v_scale_swizzle: V block scales in the swizzled order SM100 trtllm-gen kernels read
        (default) or linear.
      checked: also verify, via ``jax.experimental.checkify``, that every non-negative slot is
        in range, that no slot repeats, that k_scale and v_scale are valid scales and suit the
        data: no finite value of key (value) beyond ``6 * 448 * k_scale`` (clipped: the scale
        is too small), not every block of a nonzero key (value) stored as zeros and not most
        of its nonzero blocks stored with an E4M3-subnormal block scale (the scale is too
        large for most of the data: e.g. ``448 / amax`` for ``amax / 448``, or an outlier far
        larger than the rest; :func:`jax_nvfp4.diagnose` measures it without checkify, README
        "Outliers"). Eagerly a failed check raises
        ``checkify.JaxRuntimeError``; under ``jit`` checkify the function: ``err, out =
        jax.jit(checkify.checkify(f))(...)`` (a plain ``jit`` refuses to compile it, saying
        so).

    Returns:
      The updated cache (same shape and dtype as ``kv_cache``).

    Raises:
      TypeError, ValueError: at trace time, naming the offending argument.
      ValueError: also for a host (NumPy, list) slot_mapping with values that do not fit the
        dtype JAX gives it (int32 unless x64 is on): they would wrap around to other slots.
        (Under ``jax.jit`` JAX converts NumPy arguments at the ``jit`` boundary, before this
        function sees them: pass device int32 arrays, or enable x64.)
    """
    checks.check_options(layout=layout, scale_search=scale_search,
                         v_scale_swizzle=v_scale_swizzle, checked=checked)
    slot_mapping = checks.host_integers(slot_mapping, "slot_mapping")
    key, value, kv_cache, slot_mapping = (
        x if hasattr(x, "dtype") else jnp.asarray(x) for x in (key, value, kv_cache, slot_mapping))
    k_scale, v_scale = checks.as_scales(k_scale, v_scale)
    # Validate here too so that errors point at the caller's line, not into the primitive.
    geo = checks.check_store_args(key, value, kv_cache, slot_mapping, k_scale, v_scale,
                                  layout=layout, scale_search=scale_search,
                                  v_scale_swizzle=v_scale_swizzle)
    if checked:
        slot_mapping = checks.require_checkify(slot_mapping, "reshape_and_cache")
        _check_slots(slot_mapping, geo.num_slots)
        _check_store_scales(key, value, k_scale, v_scale, scale_search)
    # The kernels make an invalid scale NaN themselves (checks.sanitize_scale's rule): no XLA
    # op runs before the store's launch.
    return store_p.bind(key, value, kv_cache, slot_mapping, k_scale, v_scale, layout=layout,
                        scale_search=scale_search, v_scale_swizzle=bool(v_scale_swizzle))


def scale_from_amax(amax, *, fallback=1.0, headroom=6.0):
    """The global scale (k_scale / v_scale) for data whose largest magnitude is ``amax``.

    ``amax * headroom / (6 * 448)`` in float32: the largest magnitude the cache then holds,
    ``6 * 448 * scale`` (the largest E2M1 code times the largest E4M3 block scale), is
    ``headroom * amax``.

    * ``headroom=6`` (the default) is ``amax / 448``, bit for bit: the convention of vLLM and
      FlashInfer, where the largest E4M3 block scale (448) covers the largest value with the
      E2M1 codes' factor 6 to spare: data up to 6 times the calibration batch's amax is stored
      unclipped. The block holding ``amax`` gets a block scale near 448 / 6 = 75.
    * ``headroom=1`` is ``amax / (448 * 6)``: the calibrated ``amax`` maps to the largest block
      scale, so every other block's scale sits ``log2(6)``, about 2.6, binades higher in E4M3's
      range than with the default. Under a large outlier (an attention-sink token 1e5 times the
      rest) that is the difference between the ordinary blocks keeping a few significant bits
      and being stored as zeros (README, "Outliers"; :func:`jax_nvfp4.diagnose` measures it);
      the price is that anything larger than the calibration amax is clipped to it.
    * Values in between trade the two; with no strong outliers the choice changes next to
      nothing (benchmarks/RESULTS.md, "Calibration of the global scale").

    It is computed as ``amax / d`` with ``d = 6 * 448 / headroom`` rounded to float32 once, so
    the result is the correctly rounded quotient whenever ``d`` is a float32 (``headroom`` 1,
    6, any power of two times either, ...): exactly ``amax / 448`` for 6 and ``amax / 2688``
    for 1, the same bits on every backend (the division is done in integers: XLA's float32
    division on GPUs is not correctly rounded). The result is always a valid scale (a float32
    in ``[MIN_SCALE, MAX_SCALE]``), never 0, NaN or Inf, whatever ``headroom``:

    * an ``amax`` of 0 (an all-zero or all-padding calibration batch), or one that is negative,
      NaN, infinite or below the smallest normal float32 (data the store flushes to zero
      anyway) gives ``fallback`` (1.0, vLLM's default when nothing is calibrated: values up to
      ``6 * 448 = 2688`` are stored);
    * a tiny ``amax`` gives at least ``MIN_SCALE``, a huge one at most ``MAX_SCALE``.

    Compute ``amax`` with ``jnp.max(jnp.abs(x))`` (NaN in the data makes it NaN: use
    ``jnp.nanmax`` to skip NaN, as the store's block amax does). jit-compatible; works
    elementwise on arrays of amaxes (one scale per layer).

    Args:
      amax: a number or a float array.
      fallback: the scale for an unusable ``amax``; must itself be a valid scale.
      headroom: a Python number ``>= 1`` (finite): how many times ``amax`` the largest stored
        magnitude is. Static (not traced).

    Returns:
      float32 array of ``amax``'s shape.

    Raises:
      ValueError: ``fallback`` not a valid scale, or ``headroom`` below 1, NaN or infinite.
      TypeError: ``amax`` not real, ``headroom`` not a real number.
    """
    fallback_value = float(fallback)
    if not _layout.MIN_SCALE <= fallback_value <= _layout.MAX_SCALE:
        raise ValueError(f"fallback must be a valid global scale in [2**-126, 2**116], "
                         f"got {fallback!r}")
    divisor_value = _headroom_divisor(headroom)
    amax = jnp.asarray(amax)
    if not jnp.issubdtype(amax.dtype, jnp.floating) and not jnp.issubdtype(amax.dtype,
                                                                          jnp.integer):
        raise TypeError(f"amax must be a real number or array, got {checks.dtype_name(amax.dtype)}")
    amax = amax.astype(jnp.float32)
    usable = jnp.isfinite(amax) & (amax >= jnp.float32(_layout.MIN_SCALE))
    scale = _divide_rounded(jnp.where(usable, amax, 1), divisor_value)
    scale = jnp.clip(scale, jnp.float32(_layout.MIN_SCALE), jnp.float32(_layout.MAX_SCALE))
    return jnp.where(usable, scale, jnp.float32(fallback_value))


def _divide_rounded(a, divisor):
    """``a / divisor`` correctly rounded (to nearest, ties to even) in float32 on every backend,
    for positive normal float32 ``a`` and a positive normal host float32 ``divisor``: a long
    division of the significands in int32. XLA's float32 division is not correctly rounded on
    GPUs (an H200, jax 0.11.2: 55% of 2^20 random ``a / 448`` an ulp off), and XLA turns a
    division by a constant into a multiplication by its rounded reciprocal; the scale a store
    uses must be the same bits on every backend. A quotient below the float32 normal range
    comes back as 0, one above it as inf (the caller clamps)."""
    d_bits = int(np.asarray(divisor, np.float32).view(np.uint32))
    d_sig = (d_bits & 0x7FFFFF) | 0x800000                     # 24-bit significands
    d_exp = (d_bits >> 23) & 0xFF
    bits = jax.lax.bitcast_convert_type(a, jnp.int32)
    a_sig = (bits & 0x7FFFFF) | 0x800000
    a_exp = (bits >> 23) & 0xFF
    # q = floor(a_sig * 2^25 / d_sig), one bit a step; the remainder stays below 2^26.
    q, r = jnp.zeros_like(a_sig), a_sig
    for _ in range(26):
        bit = (r >= d_sig).astype(jnp.int32)
        q, r = (q << 1) | bit, (r - bit * d_sig) << 1
    # a_sig / d_sig is in (1/2, 2): q has 26 bits (quotient >= 1) or 25; keep 24.
    wide = (q >> 25).astype(jnp.int32)                          # 1: 26 bits
    shift = 1 + wide
    kept = q >> shift
    guard = (q >> (shift - 1)) & 1
    sticky = ((q & wide) | (r != 0).astype(jnp.int32)) != 0     # bits below the guard
    up = (guard == 1) & (sticky | ((kept & 1) == 1))
    kept = kept + up.astype(jnp.int32)
    carry = (kept >> 24).astype(jnp.int32)                      # rounded up to 2^24
    kept = kept >> carry
    exponent = a_exp - d_exp + 127 - 1 + wide + carry           # biased
    out = jax.lax.bitcast_convert_type((jnp.clip(exponent, 1, 254) << 23) | (kept & 0x7FFFFF),
                                       jnp.float32)
    out = jnp.where(exponent < 1, jnp.float32(0), out)
    return jnp.where(exponent > 254, jnp.float32(np.inf), out)


def _headroom_divisor(headroom):
    """``6 * 448 / headroom`` as a float32 (448 exactly for the default 6), after checking
    ``headroom`` (a real Python or NumPy number, finite, ``>= 1``). Never below ``MIN_SCALE``
    (an absurd headroom gives MAX_SCALE-clamped scales, not a division by a subnormal)."""
    if isinstance(headroom, (bool, np.bool_)) or not isinstance(headroom, (int, float,
                                                                           np.integer,
                                                                           np.floating)):
        raise TypeError(f"headroom must be a real number >= 1 (a Python float), got "
                        f"{headroom!r}")
    value = float(headroom)
    if not (math.isfinite(value) and value >= 1.0):
        raise ValueError(f"headroom must be a finite number >= 1 (the largest stored "
                         f"magnitude is headroom * amax; 6 is amax / 448, 1 is "
                         f"amax / (448 * 6)), got {headroom!r}")
    return np.float32(max(_layout.LARGEST_STORED / value, _layout.MIN_SCALE))


def slot_mapping_problems(slot_mapping, num_slots: int):
    """Counts the slots a store would skip or race on (jit-compatible).

    Returns ``(num_out_of_range, num_duplicates)`` as int32 scalars: slots ``>= num_slots`` and
    non-negative slots that appear more than once (each repeat counted once). Negative slots
    (padding) count as neither.
    """
    num_slots = _layout.check_int(num_slots, "num_slots")
    slot_mapping = jnp.asarray(checks.host_integers(slot_mapping, "slot_mapping"))
    valid = (slot_mapping >= 0) & (slot_mapping < num_slots)
    out_of_range = jnp.sum(slot_mapping >= num_slots, dtype=jnp.int32)
    # Invalid slots become distinct negative numbers so they never pair up.
    keyed = jnp.where(valid, slot_mapping, -1 - jnp.arange(slot_mapping.shape[0],
                                                           dtype=slot_mapping.dtype))
    ordered = jnp.sort(keyed)
    duplicates = jnp.sum((ordered[1:] == ordered[:-1]) & (ordered[1:] >= 0), dtype=jnp.int32)
    return out_of_range, duplicates


def _check_store_scales(key, value, k_scale, v_scale, scale_search):
    """checked=True: the scales are valid, and suit the data (nothing clipped, not everything
    zero)."""
    from jax.experimental import checkify

    checks.check_scale_values((("k_scale", k_scale), ("v_scale", v_scale)), "reshape_and_cache")
    for name, x, scale_name, s in (("key", key, "k_scale", k_scale),
                                   ("value", value, "v_scale", v_scale)):
        a = jnp.abs(x.astype(jnp.float32))
        amax = jnp.max(jnp.where(jnp.isfinite(a), a, 0), initial=0.0)    # finite values
        amax_all = jnp.max(jnp.where(jnp.isnan(a), 0, a), initial=0.0)   # Inf included
        s = jnp.reshape(s, ())
        largest = _reference.largest_stored(s)
        clipped = jnp.sum(jnp.isfinite(a) & (a > largest), dtype=jnp.int32)
        valid = checks.scale_is_valid(s)
        checkify.check(
            ~valid | (clipped == 0),
            f"reshape_and_cache: {{n}} finite value(s) of {name} exceed 6 * 448 * {scale_name} "
            f"= {{top}}, the largest magnitude the cache holds at this scale, and are clipped to "
            f"it (the largest is {{amax}}): {scale_name} is too small for this data; calibrate "
            f"with jax_nvfp4.scale_from_amax(amax)", n=clipped, top=largest, amax=amax)
        # The block holding amax gets the largest block scale: if even that is 0, every block
        # of x is stored as zeros.
        g, inv_g = _reference.store_factor(s)
        top_byte = _reference._block_scale(amax_all, g, inv_g, _reference._RECIP6)[0]
        if scale_search == "4over6":
            top_byte = top_byte | _reference._block_scale(amax_all, g, inv_g,
                                                          _reference._RECIP4)[0]
        checkify.check(
            ~valid | (amax_all == 0) | (top_byte != 0),
            f"reshape_and_cache: every value of {name} is stored as zero: its largest finite "
            f"magnitude {{amax}} is below the smallest block scale 2**-10 * 6 * {scale_name} "
            f"({scale_name} = {{s}} is too large for this data); calibrate with "
            f"jax_nvfp4.scale_from_amax(amax)", amax=amax, s=s)
        # A scale far too large short of that (e.g. 448 / amax for amax / 448, or amax / 448
        # under an outlier 1e5 times the rest) still sends most blocks below E4M3's normal
        # range, where a block scale keeps 1 to 3 significant bits.
        subnormal, nonzero = _subnormal_block_scales(x, g, inv_g, scale_search)
        checkify.check(
            ~valid | (2 * subnormal <= nonzero),
            f"reshape_and_cache: {{n}} of the {{total}} nonzero 16-value blocks of {name} get a "
            f"subnormal E4M3 block scale (below 2**-6: 1 to 3 significant bits, a large "
            f"rounding error): {scale_name} = {{s}} is far too large for most of this data "
            f"(largest magnitude {{amax}}). Either the scale is upside down (the global scale "
            f"is amax / 448, jax_nvfp4.scale_from_amax, not 448 / amax) or a few values far "
            f"larger than the rest (an outlier) set it: jax_nvfp4.diagnose measures what is "
            f"lost, README 'Outliers' has the remedies", n=subnormal, total=nonzero, s=s,
            amax=amax)


def _subnormal_block_scales(x, g, inv_g, scale_search):
    """(blocks whose block scale is E4M3-subnormal or zero, blocks with a nonzero amax) of x
    [..., head_size] stored with the factors g, 1/g. With ``"4over6"`` the larger candidate
    (amax/4) is the one counted: when it is subnormal, so is the stored scale."""
    blocks = x.astype(jnp.float32).reshape(*x.shape[:-1], -1, _layout.BLOCK_ELEMS)
    amax = _reference._block_amax(blocks)
    recip = _reference._RECIP4 if scale_search == "4over6" else _reference._RECIP6
    byte = _reference._block_scale(amax, g, inv_g, recip)[0]
    nonzero = amax > 0                                     # NaN blocks and zero blocks excluded
    exponent_zero = _reference.e4m3_below_normal(byte)     # E4M3 exponent field 0
    return (jnp.sum(nonzero & exponent_zero, dtype=jnp.int32),
            jnp.sum(nonzero, dtype=jnp.int32))


def _check_slots(slot_mapping, num_slots):
    from jax.experimental import checkify

    out_of_range, duplicates = slot_mapping_problems(slot_mapping, num_slots)
    checkify.check(out_of_range == 0,
                   "reshape_and_cache: {n} slot(s) in slot_mapping are >= num_blocks*block_size "
                   f"= {num_slots}; they are skipped", n=out_of_range)
    checkify.check(duplicates == 0,
                   "reshape_and_cache: slot_mapping repeats {n} slot(s); which token is stored "
                   "there is undefined", n=duplicates)


def allocate_kv_cache(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                      layout: str = "HND", *, device=None, sharding=None):
    """A zero-filled ``uint8`` cache of :func:`kv_cache_shape`, on ``device`` or ``sharding``."""
    shape = _layout.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size, layout)
    if sharding is not None:
        return jax.jit(lambda: jnp.zeros(shape, jnp.uint8), out_shardings=sharding)()
    return jnp.zeros(shape, jnp.uint8, device=device)


def dequantize(kv_cache, k_scale, v_scale, *, layout="HND", v_scale_swizzle=True,
               dtype=jnp.bfloat16, checked=False):
    """Reads a whole NVFP4 cache back to floats.

    Value = E2M1 code * E4M3 block scale * k_scale (v_scale for V), docs/format.md §1.

    Args:
      kv_cache: ``uint8`` cache of :func:`kv_cache_shape` for ``layout``.
      k_scale, v_scale: the scales the cache was written with (the bytes do not record them:
        another scale reads every value times the ratio, silently; any real number, used as
        float32, as for :func:`reshape_and_cache`); an invalid scale (outside
        ``[2**-126, 2**116]``: zero, negative, NaN, infinite, subnormal) reads NaN.
      layout, v_scale_swizzle: as the cache was written (the bytes do not record them: a
        cache whose shape fits both layouts is read as told).
      dtype: output floating-point dtype.
      checked: also report invalid scales (``jax.experimental.checkify``, as for the store).

    Returns:
      ``(k, v)``, each ``[num_blocks, block_size, num_kv_heads, head_size]`` in ``dtype``.
    """
    checks.check_options(layout=layout, v_scale_swizzle=v_scale_swizzle, dtype=dtype,
                         checked=checked)
    if checked:
        k_scale, v_scale = checks.checked_dequantize_scales(k_scale, v_scale, "dequantize")
    return _reference.dequantize(kv_cache, k_scale, v_scale, layout=layout,
                                 v_scale_swizzle=v_scale_swizzle, dtype=dtype)
