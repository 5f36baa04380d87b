"""Paged decode attention over an NVFP4 cache (and its bf16-cache twin).

One query token per sequence (decode). :func:`paged_attention` runs the fused CUDA kernel on a
GPU (``ffi/decode_cuda.cu``: reads the FP4 codes and E4M3 scales straight from the pages, only
the pages each sequence's length needs, split-KV across the GPU) and the jnp path elsewhere;
``impl="jnp"`` asks for the jnp path anywhere: it is the reference the kernel is tested
against. The jnp readers gather the pages of each row of ``block_tables`` (all of that row,
padding included), turn them into float32 K/V (:func:`jax_nvfp4.reference.dequantize_pages`
for NVFP4, a cast for the plain cache) and call the same masked grouped-query softmax
attention, :func:`jax_nvfp4.reference.attend`, so they differ only in what the cache holds.

Head axes stay explicit throughout the attention math: query heads are split as
``[num_kv_heads, q_per_kv]`` (query head ``i`` reads KV head ``i // q_per_kv``) and never merged
with another axis, so a sharding of the head axis along KV-head boundaries carries through.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from . import attention_primitive as _primitive
from . import checks
from . import reference as _reference
from .reference import attend  # noqa: F401  (re-exported: the attention math of every reader)

_Q_DTYPES = ("bfloat16", "float16", "float32")
_CACHE_DTYPES = ("bfloat16", "float16", "float32")


# --------------------------------------------------------------------------- validation


def _check_q(q):
    if not hasattr(q, "dtype") or not hasattr(q, "shape"):
        raise TypeError(f"q must be an array, got {type(q).__name__}")
    if checks.dtype_name(q.dtype) not in _Q_DTYPES:
        raise TypeError(f"q must be bfloat16, float16 or float32, got {checks.dtype_name(q.dtype)}")
    if len(q.shape) != 3:
        raise ValueError(f"q must have shape [batch, num_q_heads, head_size] (one decode token per "
                         f"sequence), got shape {tuple(q.shape)}")
    return q.shape


def _check_heads(num_q_heads, num_kv_heads, head_size_q, head_size_cache, cache_name):
    if head_size_q != head_size_cache:
        raise ValueError(f"q head_size {head_size_q} does not match {cache_name} head_size "
                         f"{head_size_cache}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"q num_q_heads {num_q_heads} must be a multiple of {cache_name} "
                         f"num_kv_heads {num_kv_heads} (grouped-query attention)")


def _check_tables(block_tables, seq_lens, batch):
    """Validates block_tables and seq_lens (lists/NumPy arrays are accepted and converted)."""
    block_tables, seq_lens = (x if hasattr(x, "dtype") else jnp.asarray(x)
                              for x in (block_tables, seq_lens))
    for name, x, rank, what in (("block_tables", block_tables, 2, "[batch, max_blocks_per_seq]"),
                                ("seq_lens", seq_lens, 1, "[batch]")):
        if not hasattr(x, "dtype") or not jnp.issubdtype(x.dtype, jnp.integer):
            got = checks.dtype_name(x.dtype) if hasattr(x, "dtype") else type(x).__name__
            raise TypeError(f"{name} must be an integer array (int32), got {got}")
        if len(x.shape) != rank or x.shape[0] != batch:
            raise ValueError(f"{name} must have shape {what} with batch = {batch} (q's batch), "
                             f"got shape {tuple(x.shape)}")
    return block_tables, seq_lens


def _scale(s, argument):
    s = checks.as_scale(s)
    checks.check_scale(s, argument)
    return jnp.reshape(s, ())


def _sm_scale(sm_scale, head_size):
    if sm_scale is None:
        return _reference.default_sm_scale(head_size)
    if isinstance(sm_scale, (bool, np.bool_)) or not (
            isinstance(sm_scale, (int, float, np.floating, np.integer))
            or (hasattr(sm_scale, "shape") and tuple(sm_scale.shape) == ())):
        raise TypeError(f"sm_scale must be None or a scalar, got {sm_scale!r}")
    return sm_scale


# --------------------------------------------------------------------------- readers


def paged_attention(q, kv_cache, block_tables, seq_lens, k_scale, v_scale, *, layout="HND",
                    v_scale_swizzle=True, sm_scale=None, return_lse=False, impl="auto"):
    """Decode attention reading an NVFP4 paged KV cache (one query token per sequence).

    Sequence ``b`` attends to its first ``seq_lens[b]`` positions; position ``t`` lives in page
    ``block_tables[b, t // block_size]``, row ``t % block_size``. Values are
    ``E2M1 code * E4M3 block scale * k_scale`` (``v_scale`` for V), read straight from the
    pages.

    On a GPU (``impl="auto"``, the default) this is one fused CUDA kernel (plus a small merge
    when a sequence is split across CTAs): only pages ``< ceil(seq_len / block_size)`` of each
    row are read, so a batch costs the sum of its lengths, not ``batch * max_blocks_per_seq``;
    the codes are turned into fp16 in registers (exact: an E2M1 value times an E4M3 scale fits
    fp16) and multiplied on the tensor cores with float32 accumulation; the softmax is float32.
    The query is rounded to fp16 on the way in (with a power-of-two scale per head, so no range
    is lost), so the kernel's output agrees with the jnp path to about fp16 precision (bounds
    in tests/test_decode_kernel.py). Head sizes 64, 128 and 256 use the kernel; other head sizes
    use the jnp path. Elsewhere (CPU) and with ``impl="jnp"`` the jnp path runs: it gathers all
    ``max_blocks_per_seq`` pages of each row of ``block_tables`` (padding included), dequantises
    them in float32 (:func:`jax_nvfp4.reference.dequantize_pages`) and attends in float32
    (:func:`jax_nvfp4.reference.attend`); it is the reference the kernel is tested against.

    Entries of ``block_tables`` past a sequence's pages are padding and may hold anything
    (``-1``, out-of-range ids, other sequences' pages): the kernel never reads them, the jnp
    path clamps them into range and masks them out. Entries *inside* ``seq_len`` are not
    checked: an id outside ``[0, num_blocks)`` is clamped into range (page 0 or the last page)
    by both paths; nothing outside the cache is ever read. Rows of the last page past
    ``seq_len`` are masked, whatever they hold. A sequence with ``seq_len == 0`` gets a zero
    output (and an ``lse`` of ``-inf``).

    Works under ``jax.jit`` (``layout``, ``v_scale_swizzle``, ``return_lse``, ``impl`` and a
    Python ``sm_scale`` are static), ``jax.vmap`` over stacked layers or head groups (one
    launch), ``lax.scan`` and CUDA graphs. The cache is only read: it need not be donated.
    Under a multi-device ``jit`` the kernel splits along a stacked (vmapped) axis of the cache
    and along the batch axis with no communication; see
    :func:`jax_nvfp4.sharding.paged_attention_grouped` for tensor parallelism.

    Args:
      q: ``[batch, num_q_heads, head_size]``, bfloat16, float16 or float32. ``num_q_heads`` is
        a multiple of the cache's ``num_kv_heads`` (grouped-query attention: query head ``i``
        uses KV head ``i // (num_q_heads // num_kv_heads)``).
      kv_cache: one layer's ``uint8`` NVFP4 cache of :func:`jax_nvfp4.kv_cache_shape` for
        ``layout``, as written by :func:`jax_nvfp4.reshape_and_cache`.
      block_tables: ``[batch, max_blocks_per_seq]`` integer (int32) page ids.
      seq_lens: ``[batch]`` integer (int32): tokens of each sequence in the cache, the new
        token included. Values above ``max_blocks_per_seq * block_size`` attend to all
        ``max_blocks_per_seq * block_size`` positions; values below 0 count as 0.
      k_scale, v_scale: the float32 scalars (shape ``()`` or ``(1,)``) the cache was written
        with (dequantisation multipliers).
      layout: ``"HND"`` (default) or ``"NHD"``, as written.
      v_scale_swizzle: as written (default ``True``).
      sm_scale: softmax scale, default ``1 / sqrt(head_size)``; a Python number or a float
        scalar array.
      return_lse: also return the log-sum-exp of each head's scores (natural log, float32,
        ``[batch, num_q_heads]``), e.g. to merge attention over several caches or shards:
        ``out = sum_i exp(lse_i - lse) * out_i`` with ``lse = logsumexp(lse_i)``.
      impl: ``"auto"`` (the CUDA kernel where it runs, the jnp path elsewhere), ``"kernel"``
        (the CUDA kernel or an error when lowering for a platform or head size it does not
        cover) or ``"jnp"`` (the jnp path on every backend).

    Returns:
      ``[batch, num_q_heads, head_size]`` in q's dtype, or ``(out, lse)`` with
      ``return_lse=True``.

    Raises:
      TypeError, ValueError: at trace time, naming the offending argument.
    """
    batch, num_q_heads, head_size = _check_q(q)
    if not hasattr(kv_cache, "dtype"):
        kv_cache = jnp.asarray(kv_cache)
    checks.check_flag(v_scale_swizzle, "v_scale_swizzle")
    checks.check_flag(return_lse, "return_lse")
    if impl not in _primitive.IMPLS:
        raise ValueError(f"impl must be one of {_primitive.IMPLS}, got {impl!r}")
    geo = checks.check_kv_cache(kv_cache, layout, v_scale_swizzle)
    _check_heads(num_q_heads, geo.num_kv_heads, head_size, geo.head_size, "kv_cache")
    block_tables, seq_lens = _check_tables(block_tables, seq_lens, batch)
    k_scale = _scale(k_scale, "k_scale")
    v_scale = _scale(v_scale, "v_scale")
    sm_scale = _sm_scale(sm_scale, head_size)
    max_blocks = block_tables.shape[1]
    if geo.num_blocks == 0 and max_blocks:
        raise ValueError("kv_cache has no pages (num_blocks == 0) but block_tables has "
                         f"{max_blocks} column(s)")

    if impl == "jnp":
        result = _reference.paged_attention(q, kv_cache, block_tables, seq_lens, k_scale,
                                            v_scale, layout=layout,
                                            v_scale_swizzle=bool(v_scale_swizzle),
                                            sm_scale=sm_scale, return_lse=True)
    else:
        result = _primitive.bind(q, kv_cache, block_tables, seq_lens, k_scale, v_scale, sm_scale,
                                 layout=layout, v_scale_swizzle=v_scale_swizzle, impl=impl)
    return result if return_lse else result[0]


def paged_attention_bf16(q, k_cache, v_cache, block_tables, seq_lens, *, sm_scale=None):
    """Decode attention over a plain (bf16) paged cache: the twin of :func:`paged_attention`.

    Same paging, masking, padding rules and attention math (:func:`attend`) as the NVFP4
    reader; only the cache differs. The cache is two arrays, K and V, each
    ``[num_blocks, block_size, num_kv_heads, head_size]`` (token ``slot`` lives at
    ``[slot // block_size, slot % block_size]``; store with e.g.
    ``k_cache.reshape(-1, H, D).at[slots].set(key, mode="drop")``).

    Args:
      q: ``[batch, num_q_heads, head_size]``, bfloat16, float16 or float32.
      k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_size]``, same shape,
        bfloat16, float16 or float32 (K/V are read exactly: widened to float32).
      block_tables: ``[batch, max_blocks_per_seq]`` integer page ids; padding may hold anything.
      seq_lens: ``[batch]`` integer.
      sm_scale: softmax scale, default ``1 / sqrt(head_size)``.

    Returns:
      ``[batch, num_q_heads, head_size]`` in q's dtype; softmax in float32.

    Raises:
      TypeError, ValueError: at trace time, naming the offending argument.
    """
    batch, num_q_heads, head_size = _check_q(q)
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if not hasattr(c, "dtype") or checks.dtype_name(c.dtype) not in _CACHE_DTYPES:
            got = checks.dtype_name(c.dtype) if hasattr(c, "dtype") else type(c).__name__
            raise TypeError(f"{name} must be bfloat16, float16 or float32, got {got}")
        if len(c.shape) != 4:
            raise ValueError(f"{name} must have shape [num_blocks, block_size, num_kv_heads, "
                             f"head_size], got shape {tuple(c.shape)}")
    if tuple(v_cache.shape) != tuple(k_cache.shape):
        raise ValueError(f"v_cache must have k_cache's shape {tuple(k_cache.shape)}, "
                         f"got {tuple(v_cache.shape)}")
    num_blocks, block_size, num_kv_heads, cache_head_size = k_cache.shape
    _check_heads(num_q_heads, num_kv_heads, head_size, cache_head_size, "k_cache")
    block_tables, seq_lens = _check_tables(block_tables, seq_lens, batch)
    sm_scale = _sm_scale(sm_scale, head_size)
    max_blocks = block_tables.shape[1]
    if num_blocks == 0 and max_blocks:
        raise ValueError("k_cache has no pages (num_blocks == 0) but block_tables has "
                         f"{max_blocks} column(s)")

    index = _reference.gather_index(block_tables, num_blocks)
    shape = (batch, max_blocks * block_size, num_kv_heads, head_size)
    k = k_cache[index].reshape(shape)                              # [B, M*T, H, D]
    v = v_cache[index].reshape(shape)
    return attend(q, k, v, seq_lens, sm_scale=sm_scale)
