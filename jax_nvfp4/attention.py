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

import jax.numpy as jnp
import numpy as np

from . import attention_primitive as _primitive
from . import ragged_primitive as _ragged
from . import checks
from . import layout as _layout
from . import reference as _reference
from .reference import attend  # noqa: F401  (re-exported: the attention math of every reader)

_Q_DTYPES = ("bfloat16", "float16", "float32")
_CACHE_DTYPES = ("bfloat16", "float16", "float32")


# --------------------------------------------------------------------------- validation


def _check_q(q, what="[batch, num_q_heads, head_size] (one decode token per sequence)"):
    if not hasattr(q, "dtype") or not hasattr(q, "shape"):
        raise TypeError(f"q must be an array, got {type(q).__name__}")
    if checks.dtype_name(q.dtype) not in _Q_DTYPES:
        raise TypeError(f"q must be bfloat16, float16 or float32, got {checks.dtype_name(q.dtype)}")
    if len(q.shape) != 3:
        raise ValueError(f"q must have shape {what}, got shape {tuple(q.shape)}")
    return q.shape


def _check_heads(num_q_heads, num_kv_heads, head_size_q, head_size_cache, cache_name):
    if head_size_q != head_size_cache:
        raise ValueError(f"q head_size {head_size_q} does not match {cache_name} head_size "
                         f"{head_size_cache}")
    if num_q_heads % num_kv_heads:
        raise ValueError(f"q num_q_heads {num_q_heads} must be a multiple of {cache_name} "
                         f"num_kv_heads {num_kv_heads} (grouped-query attention)")


def _check_nvfp4_cache(kv_cache, num_q_heads, head_size, layout, v_scale_swizzle):
    """The NVFP4 cache against q's heads; returns ``(kv_cache as an array, its geometry)``. A
    cache whose shape fits q only in the other layout gets an error that says so."""
    if not hasattr(kv_cache, "dtype"):
        kv_cache = jnp.asarray(kv_cache)
    geo = checks.check_kv_cache(kv_cache, layout, v_scale_swizzle)
    try:
        _check_heads(num_q_heads, geo.num_kv_heads, head_size, geo.head_size, "kv_cache")
    except ValueError as error:
        # q's heads do not fit the cache read in ``layout``: do they fit the other reading?
        hint = _layout.CacheGeometry.layout_hint(
            kv_cache.shape, layout,
            lambda other: other.head_size == head_size and num_q_heads % other.num_kv_heads == 0)
        if not hint:
            raise
        raise ValueError(f"{error}{hint}") from None
    return kv_cache, geo


def _integer_arrays(*items):
    """``(name, value, fits, what)`` items: each value as an integer array (lists and NumPy
    arrays are accepted and converted; their values must fit int32, the dtype the readers use,
    rather than wrap) whose shape ``fits(shape)``, else an error naming it and saying ``what``
    shape it must have. Returns the arrays."""
    arrays = []
    for name, x, fits, what in items:
        x = checks.host_integers(x, name, np.int32)
        x = x if hasattr(x, "dtype") else jnp.asarray(x)
        if not hasattr(x, "dtype") or not jnp.issubdtype(x.dtype, jnp.integer):
            got = checks.dtype_name(x.dtype) if hasattr(x, "dtype") else type(x).__name__
            raise TypeError(f"{name} must be an integer array (int32), got {got}")
        if not fits(tuple(x.shape)):
            raise ValueError(f"{name} must have shape {what}, got shape {tuple(x.shape)}")
        arrays.append(x)
    return arrays


def _check_tables(block_tables, seq_lens, batch):
    """block_tables ``[batch, max_blocks_per_seq]`` and seq_lens ``[batch]`` of a decode batch
    (``batch``: q's), as integer arrays (:func:`_integer_arrays`)."""
    return _integer_arrays(
        ("block_tables", block_tables, lambda s: len(s) == 2 and s[0] == batch,
         f"[batch, max_blocks_per_seq] with batch = {batch} (q's batch)"),
        ("seq_lens", seq_lens, lambda s: s == (batch,),
         f"[batch] with batch = {batch} (q's batch)"))


def _scale(s, argument):
    s = checks.as_scale(s, argument)
    checks.check_scale(s, argument)
    return jnp.reshape(s, ())


def check_reads(block_tables, seq_lens, num_blocks, block_size, scales, where):
    """The run-time checks of ``checked=True`` for the readers (``jax.experimental.checkify``):
    every page a sequence reads (block-table entries ``< ceil(seq_len / block_size)``) is a page
    id in ``[0, num_blocks)``, ``0 <= seq_len <= max_blocks_per_seq * block_size``, and the
    global scales are valid. Entries past a sequence's pages are padding: not checked."""
    from jax.experimental import checkify

    block_tables, lens = jnp.asarray(block_tables), jnp.asarray(seq_lens)
    max_blocks = block_tables.shape[1]
    capacity = max_blocks * block_size
    if not lens.shape[0]:
        if scales:
            checks.check_scale_values(scales, where)
        return
    over = lens > min(capacity, int(jnp.iinfo(lens.dtype).max))
    for n, bad, what in (
            (jnp.sum(lens < 0, dtype=jnp.int32), lens < 0, "are negative (read as 0)"),
            (jnp.sum(over, dtype=jnp.int32), over,
             f"exceed max_blocks_per_seq * block_size = {max_blocks} * {block_size} = {capacity} "
             f"(block_tables is too narrow: positions past {capacity} are not attended to)")):
        first = jnp.argmax(bad)
        checkify.check(n == 0, f"{where}: {{n}} value(s) of seq_lens {what}; first: "
                               f"seq_lens[{{b}}] = {{value}}", n=n, b=first, value=lens[first])
    if max_blocks:
        top = min(capacity, int(np.iinfo(np.int32).max))
        clipped = jnp.clip(checks.to_int32(lens), 0, top)
        pages = -(-clipped // block_size)                                 # pages each reads
        inside = jnp.arange(max_blocks, dtype=jnp.int32)[None, :] < pages[:, None]
        bad = inside & ((block_tables < 0) | (block_tables >= num_blocks))
        n = jnp.sum(bad, dtype=jnp.int32)
        first = jnp.argmax(bad.reshape(-1))
        b, j = first // max_blocks, first % max_blocks
        checkify.check(
            n == 0,
            f"{where}: {{n}} block_tables entries inside seq_len are not page ids in "
            f"[0, num_blocks = {num_blocks}); first: block_tables[{{b}}, {{j}}] = {{value}} with "
            f"seq_lens[{{b}}] = {{length}} (unchecked, such an entry reads page 0 or page "
            f"{max(num_blocks - 1, 0)}: clamped). Entries past a sequence's "
            f"ceil(seq_len / block_size) pages are padding and may hold anything.",
            n=n, b=b, j=j, value=block_tables.reshape(-1)[first], length=lens[b])
    if scales:
        checks.check_scale_values(scales, where)


def _check_scales_and_pages(k_scale, v_scale, sm_scale, head_size, geo, block_tables):
    """The NVFP4 readers' scales (float32 scalars; sm_scale a number or a scalar array,
    ``1/sqrt(head_size)`` for None) and a cache with pages wherever ``block_tables`` has
    columns. Returns ``(k_scale, v_scale, sm_scale)``."""
    k_scale = _scale(k_scale, "k_scale")
    v_scale = _scale(v_scale, "v_scale")
    sm_scale = _sm_scale(sm_scale, head_size)
    max_blocks = block_tables.shape[1]
    if geo.num_blocks == 0 and max_blocks:
        raise ValueError("kv_cache has no pages (num_blocks == 0) but block_tables has "
                         f"{max_blocks} column(s)")
    return k_scale, v_scale, sm_scale


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
                    v_scale_swizzle=True, sm_scale=None, return_lse=False, impl="auto",
                    checked=False):
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
    path clamps them into range and masks them out. Entries *inside* ``seq_len`` are checked
    only with ``checked=True``: unchecked, an id outside ``[0, num_blocks)`` is clamped into
    range (page 0 or the last page) by both paths, so such a sequence silently attends to
    another page; nothing outside the cache is ever read. Rows of the last page past
    ``seq_len`` are masked, whatever they hold. A sequence with ``seq_len == 0`` gets a zero
    output (and an ``lse`` of ``-inf``). With an invalid global scale (outside ``[2**-126,
    2**116]``: zero, negative, NaN, infinite, subnormal) the whole output and lse are NaN.

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
      k_scale, v_scale: the scalars (shape ``()`` or ``(1,)``) the cache was written with
        (dequantisation multipliers; any real number, used as float32, as for
        :func:`jax_nvfp4.reshape_and_cache`). The bytes do not record them: another scale
        reads every value times the ratio of the two, with no error.
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
      checked: also verify, via ``jax.experimental.checkify``, that every block-table entry a
        sequence reads (``< ceil(seq_len / block_size)``) is a page id in ``[0, num_blocks)``,
        that ``0 <= seq_len <= max_blocks_per_seq * block_size`` and that the scales are valid
        (padding entries stay free). Eagerly a failed check raises
        ``checkify.JaxRuntimeError``; under ``jit`` checkify the function:
        ``jax.jit(checkify.checkify(f))`` (a plain ``jit`` refuses to compile it, saying so).

    Returns:
      ``[batch, num_q_heads, head_size]`` in q's dtype, or ``(out, lse)`` with
      ``return_lse=True``.

    Raises:
      TypeError, ValueError: at trace time, naming the offending argument.
    """
    checks.check_options(layout=layout, v_scale_swizzle=v_scale_swizzle, return_lse=return_lse,
                         impl=impl, checked=checked)
    batch, num_q_heads, head_size = _check_q(q)
    kv_cache, geo = _check_nvfp4_cache(kv_cache, num_q_heads, head_size, layout, v_scale_swizzle)
    block_tables, seq_lens = _check_tables(block_tables, seq_lens, batch)
    k_scale, v_scale, sm_scale = _check_scales_and_pages(k_scale, v_scale, sm_scale, head_size,
                                                         geo, block_tables)
    if checked:
        block_tables = checks.require_checkify(block_tables, "paged_attention")
        check_reads(block_tables, seq_lens, geo.num_blocks, geo.block_size,
                    (("k_scale", k_scale), ("v_scale", v_scale)), "paged_attention")
    # An invalid global scale makes every output NaN (checks.nan_if_invalid): the jnp path
    # and the kernel apply the rule themselves, so no XLA op runs around the kernel's launch.
    if impl == "jnp":
        result = _reference.paged_attention(q, kv_cache, block_tables, seq_lens, k_scale,
                                            v_scale, layout=layout,
                                            v_scale_swizzle=bool(v_scale_swizzle),
                                            sm_scale=sm_scale, return_lse=True)
    else:
        result = _primitive.bind(q, kv_cache, block_tables, seq_lens, k_scale, v_scale, sm_scale,
                                 layout=layout, v_scale_swizzle=v_scale_swizzle, impl=impl)
    return result if return_lse else result[0]


def check_ragged_reads(block_tables, seq_lens, cu_q_lens, num_seqs, num_tokens, num_blocks,
                       block_size, scales, where, max_q_len=None):
    """The run-time checks of ``checked=True`` for the ragged reader (``checkify``): ``0 <=
    num_seqs <= max_num_seqs``; for the sequences ``b < num_seqs``, ``cu_q_lens`` non-decreasing
    from ``cu_q_lens[0] >= 0`` to ``cu_q_lens[num_seqs] <= num_tokens``, ``q_len_b <=
    seq_lens[b]`` (every query token has its position in the cache), ``q_len_b <= max_q_len``
    when it is given, and what :func:`check_reads` checks of a decode batch; the scales. Rows
    of ``block_tables``, ``seq_lens`` and ``cu_q_lens`` past ``num_seqs`` are padding: not
    checked."""
    from jax.experimental import checkify

    max_num_seqs = block_tables.shape[0]
    ns = checks.to_int32(num_seqs)
    checkify.check((ns >= 0) & (ns <= max_num_seqs),
                   f"{where}: num_seqs = {{ns}} is outside [0, max_num_seqs = {max_num_seqs}] "
                   f"(unchecked it is clamped into that range)", ns=ns)
    ns = jnp.clip(ns, 0, max_num_seqs)
    cu = checks.to_int32(cu_q_lens)
    b = jnp.arange(max_num_seqs, dtype=jnp.int32)
    active = b < ns
    q_len = cu[1:] - cu[:-1]
    lens = checks.to_int32(seq_lens)
    for n, bad, what in () if not max_num_seqs else (
            (jnp.sum(active & (q_len < 0), dtype=jnp.int32), active & (q_len < 0),
             "decreases: cu_q_lens[{b} + 1] = {value} < cu_q_lens[{b}] (cu_q_lens must be "
             "non-decreasing up to num_seqs; unchecked, a token belongs to the first sequence "
             "that claims it)"),
            (jnp.sum(active & (q_len > lens), dtype=jnp.int32), active & (q_len > lens),
             "gives sequence {b} more query tokens than seq_lens[{b}]: q_len = {value} (seq_lens "
             "counts the query tokens, which must be stored with reshape_and_cache first; "
             "unchecked, the first query tokens have no position and attend to nothing)"),
            *(() if max_q_len is None else (
                (jnp.sum(active & (q_len > max_q_len), dtype=jnp.int32),
                 active & (q_len > max_q_len),
                 f"gives sequence {{b}} more query tokens than max_q_len = {max_q_len}: q_len = "
                 "{value} (unchecked, that sequence's rows are NaN)"),))):
        first = jnp.argmax(bad)
        checkify.check(n == 0, f"{where}: cu_q_lens {what}; {{n}} such sequence(s)", n=n,
                       b=first, value=q_len[first])
    last = cu[ns]
    checkify.check((cu[0] >= 0) & (last <= num_tokens),
                   f"{where}: cu_q_lens must start at >= 0 and end (cu_q_lens[num_seqs]) at <= "
                   f"num_tokens = {num_tokens}; got cu_q_lens[0] = {{first}}, "
                   f"cu_q_lens[num_seqs] = {{last}} (unchecked, clamped into [0, num_tokens])",
                   first=cu[0], last=last)
    # Padding sequences read nothing.
    check_reads(block_tables, jnp.where(active, lens, 0), num_blocks, block_size, scales, where)


def ragged_paged_attention(q, kv_cache, block_tables, seq_lens, cu_q_lens, num_seqs, k_scale,
                           v_scale, *, layout="HND", v_scale_swizzle=True, sm_scale=None,
                           return_lse=False, impl="auto", checked=False, max_q_len=None):
    """Causal attention of several query tokens per sequence over an NVFP4 paged KV cache.

    The reader for chunked prefill, prefix reuse, speculative decoding and mixed batches, in the
    form of JAX's ragged paged attention (``jax.experimental.pallas.ops.tpu
    .ragged_paged_attention``: ``queries``, ``kv_lens``, ``page_indices``, ``cu_q_lens``,
    ``num_seqs``; vLLM's ``query_start_loc``, ``seq_lens``, ``block_table``). The query tokens
    of all sequences are packed along one axis: sequence ``b < num_seqs`` owns
    ``q[cu_q_lens[b]:cu_q_lens[b + 1]]``, ``q_len_b`` tokens. ``seq_lens[b]`` counts the
    sequence's tokens in the cache *including* its query tokens, whose K/V the caller stores
    first with :func:`jax_nvfp4.reshape_and_cache`. Query ``j`` of sequence ``b`` is at position
    ``seq_lens[b] - q_len_b + j`` and attends causally to the positions up to and including its
    own (position ``t`` in page ``block_tables[b, t // block_size]``, row ``t % block_size``).
    One query token per sequence (``cu_q_lens = arange(batch + 1)``) is decode attention: the
    results equal :func:`paged_attention`'s (the jnp paths bit for bit; on a GPU the one-token
    sequences run on the decode kernel itself, bit for bit with the same ``block_tables`` rows,
    which set its split plan).

    ``num_seqs`` is a device scalar: the batch can change without recompiling, as can
    ``cu_q_lens`` and ``seq_lens``. The static shapes are ``num_tokens`` (pad it to a bucket),
    ``max_num_seqs`` (the rows of ``block_tables``) and ``max_blocks_per_seq``. Tokens that no
    sequence owns (past ``cu_q_lens[num_seqs]``) get zeros (and an lse of ``-inf``), as does a
    query with nothing to attend to. Rows of ``block_tables``/``seq_lens``/``cu_q_lens`` past
    ``num_seqs`` are padding and may hold anything.

    What is not a valid call is checked with ``checked=True`` and otherwise handled so that
    nothing outside the cache is read and every token gets one well-defined result:
    ``num_seqs`` is clamped into ``[0, max_num_seqs]``; ``cu_q_lens`` is read as its running
    maximum clamped into ``[0, num_tokens]`` (so a token never has two owners); a sequence with
    more query tokens than ``seq_lens`` gives its first tokens (those at negative positions)
    nothing to attend to; page ids, lengths and scales follow :func:`paged_attention`'s rules
    (ids inside the pages a sequence reads are clamped into the cache, lengths beyond
    ``max_blocks_per_seq * block_size`` attend to the whole table, an invalid scale makes every
    output NaN). A NaN among the keys a query sees, or in the query, makes that query's row NaN
    (on every path); on the kernel a NaN stored in the V of one of the sequence's own tokens can
    also reach the earlier query rows of the same tile (their weight for it is 0, and 0 x NaN is
    NaN), where the jnp path keeps them finite.

    On a GPU (``impl="auto"``), for head sizes 64, 128 and 256, one call runs CUDA kernels that
    each read a page once for all the query rows (query tokens x query heads of one kv head) of a
    sequence that need it (plus a merge when long contexts are split across CTAs): the ragged
    kernel, whose CTA takes up to 64 rows of one sequence and turns the FP4 codes into fp16 in
    shared memory (exact) for the tensor cores (wgmma on sm_90a for tiles of more than 32 rows,
    mma.sync otherwise), or for head size 128 on an sm_90 GPU (an sm_90a build) the pipelined
    prefill kernel for the sequences of more than 16 rows, where one warpgroup converts the
    pages to fp16 while two multiply on asynchronous wgmma; the decode kernel of
    :func:`paged_attention` for the sequences of one query token; and, for head sizes 64 and
    128, a few-row kernel for sequences of 2 or more
    tokens and at most 16 rows (speculative decoding) that reads the pages straight into its
    tensor-core fragments. Float32 accumulation and online softmax, q and P rounded to fp16 as
    in the decode kernel. Elsewhere, for other head sizes and with ``impl="jnp"``, the jnp path
    runs (:func:`jax_nvfp4.reference.ragged_paged_attention`: every query token is decode
    attention over its own sequence's pages, so its memory is that of a decode batch of
    ``num_tokens`` sequences).

    Args:
      q: ``[num_tokens, num_q_heads, head_size]``, bfloat16, float16 or float32; grouped-query
        attention as in :func:`paged_attention`.
      kv_cache: one layer's ``uint8`` NVFP4 cache for ``layout``.
      block_tables: ``[max_num_seqs, max_blocks_per_seq]`` integer (int32) page ids.
      seq_lens: ``[max_num_seqs]`` integer: each sequence's tokens in the cache, its query
        tokens included.
      cu_q_lens: ``[max_num_seqs + 1]`` integer: where each sequence's query tokens start in
        ``q`` (``cu_q_lens[0] = 0``, non-decreasing).
      num_seqs: integer scalar (shape ``()`` or ``(1,)``, a Python int or a device value): the
        sequences in use.
      k_scale, v_scale: the scales the cache was written with, as for :func:`paged_attention`.
      layout, v_scale_swizzle, sm_scale, impl: as for :func:`paged_attention`.
      return_lse: also return the natural-log log-sum-exp of each query's scores, float32
        ``[num_tokens, num_q_heads]``.
      checked: also verify with ``jax.experimental.checkify`` what
        :func:`check_ragged_reads` lists (page ids and lengths of the sequences in use,
        ``num_seqs``, ``cu_q_lens``, query counts against ``seq_lens`` and ``max_q_len``, the
        scales).
      max_q_len: optional static bound on any sequence's query tokens (a Python int >= 1;
        vLLM's ``max_query_len``, FlashAttention's ``max_seqlen_q``), which lets the call skip
        kernels that cannot have work: on a GPU, when ``max_q_len`` x the GQA group is at most
        16 (32 at head size 128 where the build has sm_90a code) and the head size at most 128
        (speculative decoding's verify step), the few-row kernels alone serve every sequence,
        one-token ones included, and the ragged and decode kernels are not launched. The
        results then agree with the unbounded call's within the kernels' rounding (P in
        fp16, other summation orders; past 16 rows every sequence runs on the wgmma path),
        not bit for bit. A sequence with more query tokens gets NaN rows (out and lse) on
        every path; ``checked=True`` reports it. ``None`` (the default): no bound.

    Returns:
      ``[num_tokens, num_q_heads, head_size]`` in q's dtype, or ``(out, lse)``.

    Raises:
      TypeError, ValueError: at trace time, naming the offending argument.
    """
    checks.check_options(layout=layout, v_scale_swizzle=v_scale_swizzle, return_lse=return_lse,
                         impl=impl, checked=checked, max_q_len=max_q_len)
    max_q_len = None if max_q_len is None else int(max_q_len)
    num_tokens, num_q_heads, head_size = _check_q(
        q, "[num_tokens, num_q_heads, head_size] (the query tokens of all sequences, packed)")
    kv_cache, geo = _check_nvfp4_cache(kv_cache, num_q_heads, head_size, layout, v_scale_swizzle)
    (block_tables,) = _integer_arrays(("block_tables", block_tables, lambda s: len(s) == 2,
                                       "[max_num_seqs, max_blocks_per_seq]"))
    max_num_seqs = block_tables.shape[0]
    seq_lens, cu_q_lens, num_seqs = _integer_arrays(
        ("seq_lens", seq_lens, lambda s: s == (max_num_seqs,),
         f"[max_num_seqs] = ({max_num_seqs},) (max_num_seqs = block_tables' rows)"),
        ("cu_q_lens", cu_q_lens, lambda s: s == (max_num_seqs + 1,),
         f"[max_num_seqs + 1] = ({max_num_seqs + 1},) (max_num_seqs = block_tables' rows)"),
        ("num_seqs", num_seqs, lambda s: s in ((), (1,)), "() or (1,) (a scalar)"))
    num_seqs = jnp.reshape(num_seqs, ())
    k_scale, v_scale, sm_scale = _check_scales_and_pages(k_scale, v_scale, sm_scale, head_size,
                                                         geo, block_tables)
    if checked:
        block_tables = checks.require_checkify(block_tables, "ragged_paged_attention")
        check_ragged_reads(block_tables, seq_lens, cu_q_lens, num_seqs, num_tokens,
                           geo.num_blocks, geo.block_size,
                           (("k_scale", k_scale), ("v_scale", v_scale)), "ragged_paged_attention",
                           max_q_len)
    # The invalid-scale rule (checks.nan_if_invalid) is applied by the jnp path and by the
    # ragged kernels themselves (ffi/ragged_device.cuh, member_scales_valid).
    if impl == "jnp":
        result = _reference.ragged_paged_attention(
            q, kv_cache, block_tables, seq_lens, cu_q_lens, num_seqs, k_scale, v_scale,
            layout=layout, v_scale_swizzle=bool(v_scale_swizzle), sm_scale=sm_scale,
            return_lse=True, max_q_len=max_q_len)
    else:
        result = _ragged.bind(q, kv_cache, block_tables, seq_lens, cu_q_lens, num_seqs, k_scale,
                              v_scale, sm_scale, layout=layout, v_scale_swizzle=v_scale_swizzle,
                              impl=impl, max_q_len=max_q_len)
    return result if return_lse else result[0]


def paged_attention_bf16(q, k_cache, v_cache, block_tables, seq_lens, *, sm_scale=None,
                         checked=False):
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
      checked: as for :func:`paged_attention` (page ids inside ``seq_len`` and the lengths).

    Returns:
      ``[batch, num_q_heads, head_size]`` in q's dtype; softmax in float32.

    Raises:
      TypeError, ValueError: at trace time, naming the offending argument.
    """
    checks.check_options(checked=checked)
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
    if checked:
        block_tables = checks.require_checkify(block_tables, "paged_attention_bf16")
        check_reads(block_tables, seq_lens, num_blocks, block_size, (), "paged_attention_bf16")

    index = _reference.gather_index(block_tables, num_blocks)
    shape = (batch, max_blocks * block_size, num_kv_heads, head_size)
    k = k_cache[index].reshape(shape)                              # [B, M*T, H, D]
    v = v_cache[index].reshape(shape)
    return attend(q, k, v, seq_lens, sm_scale=sm_scale)
