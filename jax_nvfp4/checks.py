"""Validation shared by every public function: trace-time checks of the store's arguments
(docs/format.md §5; one function, used by the primitive's abstract evaluation and by the jnp
reference, so both refuse the same calls with the same messages), of options
(:func:`check_options`), of host-side integer arrays (:func:`host_integers`), the global-scale
contract (:func:`sanitize_scale`) and the run-time checks of ``checked=True``
(:func:`require_checkify`). Every error names the argument and what was expected."""

from __future__ import annotations

import numpy as np

from . import layout as _layout


_FLOAT_INPUTS = ("bfloat16", "float16")
_SLOT_DTYPES = ("int32", "int64")


def check_store_args(key, value, kv_cache, slot_mapping, k_scale, v_scale, *, layout,
                     scale_search, v_scale_swizzle, stacked: tuple[int, ...] = ()):
    """Validates shapes and dtypes (anything with ``.shape`` and ``.dtype``).

    ``stacked`` is the shape of the leading stacked axes (layers, head groups, both: the
    batched form the vmap rule binds); key/value are ``stacked + [num_tokens, num_kv_heads,
    head_size]`` and kv_cache ``stacked`` + one layer's cache, slot_mapping ``[num_tokens]``
    (shared) or ``stacked + [num_tokens]``, each scale one value (shared) or of shape
    ``stacked``. With ``stacked=()`` (the public call) key/value are ``[num_tokens,
    num_kv_heads, head_size]`` and kv_cache is one layer's cache.

    Returns the cache's ``CacheGeometry``. Raises ``TypeError`` for a wrong dtype and
    ``ValueError`` for a wrong shape or option.
    """
    check_options(layout=layout, scale_search=scale_search, v_scale_swizzle=v_scale_swizzle)
    stacked = tuple(stacked)
    lead = len(stacked)

    num_tokens, num_kv_heads, head_size = check_key_value(key, value, v_scale_swizzle,
                                                          lead=lead)

    if dtype_name(kv_cache.dtype) != "uint8":
        raise TypeError(f"kv_cache must be uint8 (see kv_cache_shape), got {dtype_name(kv_cache.dtype)}")
    cache_shape = tuple(kv_cache.shape)
    if len(cache_shape) != 5 + lead:
        raise ValueError(f"kv_cache must have rank 5, {_layout.kv_cache_shape.__name__}(...) for "
                         f"layout {layout!r}, got shape {cache_shape}")
    if cache_shape[:lead] != stacked:
        raise ValueError(f"kv_cache leading (stacked) axes {cache_shape[:lead]} != key's "
                         f"{stacked}")
    geometry = _layout.CacheGeometry.from_shape(cache_shape[lead:], layout)
    expected = _layout.kv_cache_shape(geometry.num_blocks, geometry.block_size, num_kv_heads,
                                      head_size, layout)
    if cache_shape[lead:] != expected:
        hint = _layout.CacheGeometry.layout_hint(
            cache_shape[lead:], layout,
            lambda other: (other.num_kv_heads, other.head_size) == (num_kv_heads, head_size))
        raise ValueError(
            f"kv_cache shape {cache_shape[lead:]} does not match key (num_kv_heads={num_kv_heads}, "
            f"head_size={head_size}): expected {expected} for layout {layout!r}{hint}")

    if dtype_name(slot_mapping.dtype) not in _SLOT_DTYPES:
        raise TypeError(f"slot_mapping must be int32 or int64, got {dtype_name(slot_mapping.dtype)}")
    slot_shape = tuple(slot_mapping.shape)
    if slot_shape not in ((num_tokens,),) + ((stacked + (num_tokens,),) if lead else ()):
        raise ValueError(f"slot_mapping must have shape [num_tokens] = ({num_tokens},), "
                         f"got {slot_shape}")

    layer_shapes = (stacked,) if lead else ()
    check_scale(k_scale, "k_scale", layer_shapes)
    check_scale(v_scale, "v_scale", layer_shapes)
    return geometry


def check_key_value(key, value, v_scale_swizzle, *, lead=0, dtypes=_FLOAT_INPUTS):
    """key and value as the store takes them: ``[num_tokens, num_kv_heads, head_size]`` (after
    ``lead`` stacked axes), one of ``dtypes`` (bfloat16 or float16 for the store), the same
    dtype and shape, head_size a multiple of 16 (of 64 with ``v_scale_swizzle``). Returns
    ``(num_tokens, num_kv_heads, head_size)``; errors name the argument."""
    for name, x in (("key", key), ("value", value)):
        if dtype_name(x.dtype) not in dtypes:
            raise TypeError(f"{name} must be {_one_of(dtypes)}, got {dtype_name(x.dtype)}")
        if len(x.shape) != 3 + lead:
            raise ValueError(f"{name} must have shape [num_tokens, num_kv_heads, head_size], "
                             f"got shape {tuple(x.shape)}")
    if key.dtype != value.dtype:
        raise TypeError(f"value must have key's dtype {dtype_name(key.dtype)}, "
                        f"got {dtype_name(value.dtype)}")
    if tuple(key.shape) != tuple(value.shape):
        raise ValueError(f"value must have key's shape {tuple(key.shape)}, got {tuple(value.shape)}")
    num_tokens, num_kv_heads, head_size = key.shape[lead:]
    if num_kv_heads <= 0:
        raise ValueError(f"key must have at least one kv head, got shape {tuple(key.shape)}")
    _layout.check_head_size(head_size, v_scale_swizzle, argument="key head_size")
    return num_tokens, num_kv_heads, head_size


def _one_of(names):
    """'bfloat16 or float16', 'bfloat16, float16 or float32'."""
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} or {names[-1]}"


def check_kv_cache(kv_cache, layout, v_scale_swizzle, argument="kv_cache"):
    """Validates a cache on its own (for readers); returns its ``CacheGeometry``."""
    check_options(layout=layout, v_scale_swizzle=v_scale_swizzle)
    if dtype_name(kv_cache.dtype) != "uint8":
        raise TypeError(f"{argument} must be uint8, got {dtype_name(kv_cache.dtype)}")
    geometry = _layout.CacheGeometry.from_shape(kv_cache.shape, layout, argument)
    _layout.check_head_size(geometry.head_size, v_scale_swizzle, argument=f"{argument} head_size")
    return geometry


def dtype_name(dtype) -> str:
    return np.dtype(dtype).name


def check_flag(value, argument):
    """A bool (Python or NumPy): 0, 1, None and strings are refused, not read as truth values."""
    if not isinstance(value, (bool, np.bool_)):
        raise TypeError(f"{argument} must be a bool (True or False), got {value!r}")


def check_float_dtype(dtype, argument="dtype"):
    """A floating-point dtype (bfloat16, float16, float32, float64 ...); returns it as
    ``np.dtype``."""
    try:
        dt = np.dtype(dtype)
    except TypeError:
        raise TypeError(f"{argument} must be a floating-point dtype, got {dtype!r}") from None
    import jax.numpy as jnp

    if not jnp.issubdtype(dt, jnp.floating):
        raise TypeError(f"{argument} must be a floating-point dtype (e.g. jnp.bfloat16, "
                        f"jnp.float32), got {dt.name}")
    return dt


#: Implementations of the decode readers (attention_primitive.IMPLS).
IMPLS = ("auto", "kernel", "jnp")


def check_options(**options):
    """The one validation of keyword options, for every public function: layout and
    scale_search among their values, v_scale_swizzle / checked / return_lse bools, dtype a
    floating-point dtype, impl among :data:`IMPLS`, max_q_len None or an int >= 1. Raises
    ``ValueError`` (unknown value) or ``TypeError`` (wrong type) naming the option."""
    for name, value in options.items():
        if name == "layout":
            _layout.check_layout(value)
        elif name == "scale_search":
            _layout.check_scale_search(value)
        elif name in ("v_scale_swizzle", "checked", "return_lse"):
            check_flag(value, name)
        elif name == "dtype":
            check_float_dtype(value, name)
        elif name == "impl":
            if not isinstance(value, str) or value not in IMPLS:
                raise ValueError(f"impl must be one of {IMPLS}, got {value!r}")
        elif name == "max_q_len":
            if value is None:
                continue
            if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)):
                raise TypeError("max_q_len must be None or a Python int (a static bound on "
                                f"each sequence's query tokens), got {type(value).__name__}")
            if value < 1:
                raise ValueError(f"max_q_len must be >= 1, got {value}")
        else:  # pragma: no cover - a programming error in this package
            raise AssertionError(f"check_options does not know {name!r}")


# --------------------------------------------------------------------------- host integers


def host_integers(x, argument, dtype=None):
    """Integer arguments given on the host (lists, tuples, NumPy arrays or scalars, Python
    ints) are checked to fit the dtype they will be used in, so that nothing wraps.

    ``dtype`` is that dtype (int32 for the readers' block tables and lengths); by default the
    dtype JAX converts the value to (int32 unless ``jax_enable_x64``: a NumPy int64 array would
    otherwise wrap silently, slot 2**32 + 3 becoming slot 3). Returns a NumPy array of that
    dtype for host values; device arrays and tracers are returned as they are (they already
    have a JAX dtype). Non-integer values are returned unchanged, for the callers' dtype checks.
    Raises ``ValueError`` naming ``argument`` and the first value that does not fit.
    """
    if hasattr(x, "dtype") and not isinstance(x, (np.ndarray, np.generic)):
        return x  # a jax.Array or a tracer
    array = np.asarray(x)
    if array.dtype == object:
        raise ValueError(f"{argument} holds values that are not 64-bit integers (e.g. Python "
                         "ints beyond int64): they cannot be slots or page ids")
    if array.dtype.kind not in "iu":
        return x
    import jax

    target = np.dtype(dtype) if dtype is not None else np.dtype(
        jax.dtypes.canonicalize_dtype(array.dtype))
    if array.size and target.kind in "iu":
        info = np.iinfo(target)
        low, high = array.min(), array.max()
        if int(low) < info.min or int(high) > info.max:
            bad = array[(array < info.min) | (array > info.max)].reshape(-1)[0]
            index = tuple(int(i) for i in np.argwhere(array == bad)[0])
            raise ValueError(
                f"{argument} holds {int(bad)} (at index {index}), which does not fit {target.name}"
                f", the dtype it is used in (values outside [{info.min}, {info.max}] would wrap "
                "around to other slots or pages); "
                + ("enable jax_enable_x64 or " if target == np.int32 and dtype is None else "")
                + "fix the value")
    return array.astype(target) if array.dtype != target else array


def to_int32(x):
    """An integer array as int32, values outside int32's range clamped to its ends (a wider
    dtype is never wrapped: an out-of-range page id stays out of range)."""
    import jax.numpy as jnp

    x = jnp.asarray(x)
    if x.dtype == jnp.int32:
        return x
    info = np.iinfo(np.int32)
    if jnp.issubdtype(x.dtype, jnp.unsignedinteger) and x.dtype.itemsize >= 4:
        x = jnp.minimum(x, jnp.asarray(info.max, x.dtype))
    elif x.dtype.itemsize > 4:
        x = jnp.clip(x, info.min, info.max)
    return x.astype(jnp.int32)


# --------------------------------------------------------------------------- global scales


def scale_is_valid(s):
    """Whether global scales (an array) are in the contract's range: a float32 in
    ``[MIN_SCALE, MAX_SCALE]`` (False for zero, negative, NaN, infinite, subnormal and too
    large values). jit-compatible."""
    import jax.numpy as jnp

    s = jnp.asarray(s, jnp.float32)
    return (s >= jnp.float32(_layout.MIN_SCALE)) & (s <= jnp.float32(_layout.MAX_SCALE))


def sanitize_scale(s):
    """A global scale outside the contract's range becomes NaN (a valid one is returned
    unchanged, bit for bit).

    This is the contract for a bad k_scale/v_scale, the same on every backend: the jnp store
    and ``dequantize`` apply it here, the store kernels (C++ and CUDA, ffi/store_kernel.h) the
    same rule themselves. The store quantises with a NaN scale, which writes the NaN block
    scale byte (0x7F) and code +-6 (the input's sign) for every stored value, so those rows
    read back as NaN whatever scale they are read with; the readers return NaN
    (:func:`nan_if_invalid`). A bad scale never quietly reads back as zeros."""
    import jax.numpy as jnp

    return jnp.where(scale_is_valid(s), s, jnp.float32(jnp.nan))


def nan_if_invalid(results, k_scale, v_scale):
    """The readers' rule for an invalid global scale: every output and lse NaN, empty
    sequences' included. ``results``: arrays whose first axis is the members' where the scales
    have one entry per member (shape ``(L,)``); a scalar or ``(1,)`` scale applies to every
    row. The jnp readers apply it here; the decode and ragged kernels apply the rule
    themselves. jit-compatible."""
    import jax.numpy as jnp

    valid = jnp.reshape(scale_is_valid(k_scale) & scale_is_valid(v_scale), (-1,))
    return tuple(jnp.where(jnp.reshape(valid, valid.shape + (1,) * (x.ndim - 1)) if x.ndim
                           else valid[0], x, jnp.asarray(jnp.nan, x.dtype)) for x in results)


def check_scale_values(scales, where):
    """checked=True: reports global scales outside the contract's range (``scales``: pairs of
    (argument name, value))."""
    from jax.experimental import checkify
    import jax.numpy as jnp

    for name, s in scales:
        s = jnp.asarray(s, jnp.float32)
        checkify.check(
            jnp.all(scale_is_valid(s)),
            f"{where}: {name} = {{s}} is not a valid global scale, which must be a float32 in "
            f"[2**-126, 2**116] (not zero, negative, NaN, infinite or subnormal); with it the "
            f"store writes NaN block scales and the readers return NaN. Calibrate with "
            f"jax_nvfp4.scale_from_amax(amax), which never returns 0, NaN or Inf.", s=s)


# --------------------------------------------------------------------------- checked=True


def _make_checkify_marker():
    """An identity primitive that marks a function as holding ``checked=True`` checks.

    ``jax.experimental.checkify.check`` cannot be lowered unless ``checkify.checkify``
    functionalises it, and JAX then fails with a message that does not name the function or
    say what to do. The marker sits before the checks on an operand the result depends on:
    eagerly and under ``checkify.checkify`` (whose rule for it is the identity) it costs
    nothing; under a plain ``jax.jit`` its lowering, which comes first, raises the message of
    :func:`require_checkify`. Uses checkify's table of rules (``jax._src``): where that is
    missing the marker is skipped and JAX's own message remains."""
    try:
        from jax._src import checkify as _checkify_impl
        from jax.extend.core import Primitive
        from jax.interpreters import batching, mlir

        rules = _checkify_impl.error_checks
    except (ImportError, AttributeError):  # pragma: no cover - depends on the JAX version
        return None

    marker = Primitive("nvfp4_needs_checkify")
    marker.def_impl(lambda x, *, where: x)
    marker.def_abstract_eval(lambda x, *, where: x)

    def lowering(ctx, x, *, where):
        raise ValueError(
            f"{where}(checked=True) under jax.jit (or another staging transformation) needs "
            f"jax.experimental.checkify.checkify around the function: "
            f"err, out = jax.jit(checkify.checkify(f))(...), then err.throw() (or err.get()); "
            f"checkify.checkify(jax.jit(f)) works too but traces f again on every call. "
            f"Called eagerly, {where}(checked=True) raises by itself.")

    mlir.register_lowering(marker, lowering)
    batching.primitive_batchers[marker] = lambda args, dims, *, where: (args[0], dims[0])
    # The rule's arguments are (error, enabled_errors, x) up to JAX 0.10 and
    # (ctx, error, enabled_errors, x) from 0.11: take them from the end.
    rules[marker] = lambda *args, where: (args[-3], args[-1])
    return marker


_CHECKIFY_MARKER = _make_checkify_marker()


def require_checkify(x, where):
    """``x`` (an operand the result depends on) passed through the marker of
    :func:`_make_checkify_marker`: call before the checks of ``checked=True``."""
    if _CHECKIFY_MARKER is None:  # pragma: no cover
        return x
    import jax.numpy as jnp

    return _CHECKIFY_MARKER.bind(jnp.asarray(x), where=where)


def checked_dequantize_scales(k_scale, v_scale, where):
    """checked=True of the whole-cache readers: the scales' dtype and shape (trace time) and
    their values (checkify); returns the scales to read with."""
    k_scale, v_scale = as_scales(k_scale, v_scale)
    check_scale(k_scale, "k_scale")
    check_scale(v_scale, "v_scale")
    k_scale = require_checkify(k_scale, where)
    check_scale_values((("k_scale", k_scale), ("v_scale", v_scale)), where)
    return k_scale, v_scale


def as_scale(s, argument):
    """The one dtype rule of a global scale (k_scale, v_scale), the same eagerly and under
    ``jit``: any real number is taken and converted to float32 (rounded to nearest), whether it
    is a Python int or float, a NumPy scalar or array, or a JAX array or tracer, of any integer
    or floating-point dtype (float64 included: ``jit`` converts a NumPy float64 argument to
    float32 at its boundary, so refusing it eagerly only made the two differ). bool, complex
    and non-numbers raise ``TypeError`` naming ``argument``. The shape is checked by
    :func:`check_scale`; the value's validity by :func:`sanitize_scale` / ``checked=True``."""
    import jax.numpy as jnp

    dtype = s.dtype if hasattr(s, "dtype") else np.asarray(s).dtype
    if not (jnp.issubdtype(dtype, jnp.floating) or jnp.issubdtype(dtype, jnp.integer)):
        raise TypeError(f"{argument} must be a real number (an int or float of any precision, "
                        f"used as float32), got {dtype_name(dtype)}")
    return jnp.asarray(s, dtype=jnp.float32)


def as_scales(k_scale, v_scale):
    """:func:`as_scale` of both global scales."""
    return as_scale(k_scale, "k_scale"), as_scale(v_scale, "v_scale")


def check_scale(s, argument, extra_shapes=()):
    """A global scale: float32 (TypeError otherwise: the public functions convert with
    :func:`as_scale` first, so this catches only direct binds of the primitives) of shape ()
    or (1,) (ValueError otherwise; ``extra_shapes`` admits more, e.g. one scale per layer)."""
    if dtype_name(s.dtype) != "float32":
        raise TypeError(f"{argument} must be float32, got {dtype_name(s.dtype)}")
    if tuple(s.shape) not in ((), (1,)) + tuple(extra_shapes):
        raise ValueError(f"{argument} must be a float32 scalar of shape () or (1,), "
                         f"got shape {tuple(s.shape)}")
