"""Paged decode attention over an NVFP4 cache (and its bf16-cache twin), in pure jnp.

One query token per sequence (decode). Each sequence reads only the pages of its row of
``block_tables`` (all of that row, padding included); positions at or past its ``seq_len`` are masked. Both readers gather the
pages, turn them into float32 K/V (:func:`jax_nvfp4.reference.dequantize_pages` for NVFP4, a
cast for the plain cache) and call the same masked grouped-query softmax attention,
:func:`attend`, so they differ only in what the cache holds.

Head axes stay explicit throughout the attention math: query heads are split as
``[num_kv_heads, q_per_kv]`` (query head ``i`` reads KV head ``i // q_per_kv``) and never merged
with another axis, so a sharding of the head axis along KV-head boundaries carries through.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np

from . import checks
from . import reference as _reference

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
        return 1.0 / math.sqrt(head_size)
    if isinstance(sm_scale, (bool, np.bool_)) or not (
            isinstance(sm_scale, (int, float, np.floating, np.integer))
            or (hasattr(sm_scale, "shape") and tuple(sm_scale.shape) == ())):
        raise TypeError(f"sm_scale must be None or a scalar, got {sm_scale!r}")
    return sm_scale


def _gather_index(block_tables, num_blocks):
    """Padding entries may hold anything: clamp into range, the seq_len mask hides them."""
    return jnp.clip(block_tables.astype(jnp.int32), 0, num_blocks - 1)


# --------------------------------------------------------------------------- attention math


def attend(q, k, v, seq_lens, *, sm_scale=None):
    """Masked grouped-query softmax attention of one query token per sequence.

    Shared by :func:`paged_attention` and :func:`paged_attention_bf16`.

    Args:
      q: ``[batch, num_q_heads, head_size]``.
      k, v: ``[batch, max_len, num_kv_heads, head_size]``: each sequence's tokens in position
        order (gathered pages); positions ``>= seq_lens[b]`` may hold anything, NaN included.
      seq_lens: ``[batch]`` integer; a sequence attends to positions ``0 .. seq_len - 1``
        (clamped to ``max_len``). ``seq_len <= 0`` gives a zero output.
      sm_scale: score multiplier, default ``1 / sqrt(head_size)``.

    Returns:
      ``[batch, num_q_heads, head_size]`` in q's dtype. Scores, softmax and the weighted sum of
      values are computed in float32 (``Precision.HIGHEST``); query head ``i`` uses KV head
      ``i // (num_q_heads // num_kv_heads)``.
    """
    batch, num_q_heads, head_size = q.shape
    max_len, num_kv_heads = k.shape[1], k.shape[2]
    group = num_q_heads // num_kv_heads
    scale = _sm_scale(sm_scale, head_size)
    if max_len == 0:
        return jnp.zeros(q.shape, q.dtype)

    hi = jax.lax.Precision.HIGHEST
    qg = q.astype(jnp.float32).reshape(batch, num_kv_heads, group, head_size)
    valid = jnp.arange(max_len, dtype=jnp.int32)[None, :] < seq_lens.astype(jnp.int32)[:, None]
    # Masked positions may hold garbage (stale rows, other pages, NaN): their scores are
    # replaced below; their values are zeroed so that 0 * NaN never reaches the sum.
    v = jnp.where(valid[:, :, None, None], v.astype(jnp.float32), 0.0)

    scores = jnp.einsum("bhgd,blhd->bhgl", qg, k.astype(jnp.float32), precision=hi)
    scores = scores * jnp.asarray(scale, jnp.float32)
    mask = valid[:, None, None, :]
    scores = jnp.where(mask, scores, -jnp.inf)
    top = jnp.max(scores, axis=-1, keepdims=True)
    top = jnp.where(jnp.isfinite(top), top, 0.0)           # every position masked: no -inf - -inf
    p = jnp.where(mask, jnp.exp(scores - top), 0.0)
    denom = jnp.sum(p, axis=-1, keepdims=True)
    out = jnp.einsum("bhgl,blhd->bhgd", p, v, precision=hi)
    out = out / jnp.where(denom > 0, denom, 1.0)           # seq_len 0: 0 / 1 = 0, not NaN
    return out.reshape(batch, num_q_heads, head_size).astype(q.dtype)


# --------------------------------------------------------------------------- readers


def paged_attention(q, kv_cache, block_tables, seq_lens, k_scale, v_scale, *, layout="HND",
                    v_scale_swizzle=True, sm_scale=None):
    """Decode attention reading an NVFP4 paged KV cache (one query token per sequence).

    Sequence ``b`` reads the pages ``block_tables[b, :ceil(seq_lens[b] / block_size)]`` and
    attends to its first ``seq_lens[b]`` positions (position ``t`` lives in page
    ``block_tables[b, t // block_size]``, row ``t % block_size``). The ``max_blocks_per_seq``
    pages of each row of ``block_tables`` are gathered and dequantised (spec §1:
    ``E2M1 * E4M3 block scale * k_scale``, by :func:`jax_nvfp4.reference.dequantize_pages`),
    padding entries included (clamped into range, then masked); no other page is read. The cost
    of a step is ``batch * max_blocks_per_seq`` pages, whatever ``seq_lens`` says: size the
    block table to the longest sequence of the batch.

    Entries of ``block_tables`` past a sequence's pages are padding and may hold anything
    (``-1``, out-of-range ids, other sequences' pages): they are clamped into range for the
    gather and masked out. Rows of the last page past ``seq_len`` are masked too, whatever they
    hold. A sequence with ``seq_len == 0`` gets a zero output.

    Pure jnp, so it runs on any backend and under ``jax.jit``/``vmap`` (``layout``,
    ``v_scale_swizzle`` and a Python ``sm_scale`` are static).

    Args:
      q: ``[batch, num_q_heads, head_size]``, bfloat16, float16 or float32. ``num_q_heads`` is
        a multiple of the cache's ``num_kv_heads`` (grouped-query attention: query head ``i``
        uses KV head ``i // (num_q_heads // num_kv_heads)``).
      kv_cache: one layer's ``uint8`` NVFP4 cache of :func:`jax_nvfp4.kv_cache_shape` for
        ``layout``, as written by :func:`jax_nvfp4.reshape_and_cache`.
      block_tables: ``[batch, max_blocks_per_seq]`` integer (int32) page ids.
      seq_lens: ``[batch]`` integer (int32): tokens of each sequence in the cache, the new
        token included. Values above ``max_blocks_per_seq * block_size`` attend to all gathered
        positions.
      k_scale, v_scale: the float32 scalars (shape ``()`` or ``(1,)``) the cache was written
        with (dequantisation multipliers).
      layout: ``"HND"`` (default) or ``"NHD"``, as written.
      v_scale_swizzle: as written (default ``True``).
      sm_scale: softmax scale, default ``1 / sqrt(head_size)``.

    Returns:
      ``[batch, num_q_heads, head_size]`` in q's dtype; softmax in float32.

    Raises:
      TypeError, ValueError: at trace time, naming the offending argument.
    """
    batch, num_q_heads, head_size = _check_q(q)
    if not hasattr(kv_cache, "dtype"):
        kv_cache = jnp.asarray(kv_cache)
    checks.check_flag(v_scale_swizzle, "v_scale_swizzle")
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

    pages = geo.pages(kv_cache)
    pages = pages[_gather_index(block_tables, geo.num_blocks)]     # [B, M, 2, side_bytes]
    k, v = _reference.dequantize_pages(pages, geo, k_scale, v_scale,
                                       v_scale_swizzle=bool(v_scale_swizzle), dtype=jnp.float32)
    shape = (batch, max_blocks * geo.block_size, geo.num_kv_heads, geo.head_size)
    return attend(q, k.reshape(shape), v.reshape(shape), seq_lens, sm_scale=sm_scale)


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

    index = _gather_index(block_tables, num_blocks)
    shape = (batch, max_blocks * block_size, num_kv_heads, head_size)
    k = k_cache[index].reshape(shape)                              # [B, M*T, H, D]
    v = v_cache[index].reshape(shape)
    return attend(q, k, v, seq_lens, sm_scale=sm_scale)
