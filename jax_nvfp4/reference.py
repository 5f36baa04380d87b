"""Pure-jnp reference of the store and its reader: the authority for the kernels' bytes.

Run it on the CPU to get the bytes the kernels must produce (docs/format.md §8: on a GPU, XLA
may keep excess precision in places this code cannot see, and it does not flush float32
subnormals to zero as XLA:CPU and both kernels do; see ffi/nvfp4_numerics.h). Every float32
operation whose rounding docs/format.md §2-§3 fixes is kept apart from its neighbours
(``_rounded``) because XLA contracts ``a*b + c`` into a fused multiply-add; E4M3 bytes are
decoded through a table rather than a float8 round
trip that XLA may delete.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from . import checks
from . import layout as _layout

_BLOCK = _layout.BLOCK_ELEMS
_RECIP6 = np.float32(1.0) / np.float32(6.0)
_RECIP4 = np.float32(0.25)


def _e4m3_table() -> np.ndarray:
    import ml_dtypes  # shipped with jax

    return np.arange(256, dtype=np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float32)


#: float32 value of each E4M3 byte (0x7F and 0xFF are NaN).
E4M3_VALUES = _e4m3_table()


def _rounded(x):
    """x, computed on its own: XLA cannot contract it into the consumer's add.

    A select on a runtime comparison sits between the product and its use; neither
    ``lax.optimization_barrier`` nor a bitcast round trip stops the contraction on XLA:CPU.
    """
    return jnp.where(x != x, jnp.float32(jnp.nan), x)


def e4m3_encode(x):
    """float32 -> E4M3 byte: round to nearest even, saturate to +-448, NaN -> 0x7F."""
    clipped = jnp.clip(x, -_layout.E4M3_MAX, _layout.E4M3_MAX)
    byte = jax.lax.bitcast_convert_type(clipped.astype(jnp.float8_e4m3fn), jnp.uint8)
    return jnp.where(jnp.isnan(x), jnp.uint8(0x7F), byte)


def e4m3_decode(byte):
    return jnp.take(jnp.asarray(E4M3_VALUES), byte.astype(jnp.int32))


def e2m1_codes(x, out_scale):
    """Codes of x*out_scale (docs/format.md §2 step 6): magnitude by comparisons, x's sign."""
    a = jnp.abs(x * out_scale)
    mag = ((a > 0.25).astype(jnp.uint8) + (a >= 0.75) + (a > 1.25) + (a >= 1.75) + (a > 2.5)
           + (a >= 3.5) + (a > 5.0)).astype(jnp.uint8)
    mag = jnp.where(jnp.isnan(a), jnp.uint8(7), mag)
    return jnp.where(jnp.signbit(x), mag | jnp.uint8(8), mag)


def e2m1_values(codes):
    mags = jnp.take(jnp.asarray(_layout.E2M1_MAGNITUDES), (codes & 7).astype(jnp.int32))
    return jnp.where((codes & 8) != 0, -mags, mags)


def _block_amax(x):
    """maxNum over the last axis of |x|, NaN ignored unless all are (docs/format.md §2 step 2)."""
    a = jnp.abs(x)
    nan = jnp.isnan(a)
    m = jnp.max(jnp.where(nan, -jnp.inf, a), axis=-1)
    return jnp.where(jnp.all(nan, axis=-1), jnp.float32(jnp.nan), m)


def _block_scale(amax, g, inv_g, recip):
    # amax * recip on its own: under jit XLA reassociates g * (amax * 1/6) into
    # (g * 1/6) * amax (recip is a constant), which can round differently.
    sf = g * _rounded(amax * recip)
    byte = e4m3_encode(sf)
    sfq = e4m3_decode(byte)
    safe = jnp.where(sfq != 0, sfq, jnp.float32(1))
    out_scale = jnp.where(sfq != 0, jnp.float32(1) / (safe * inv_g), jnp.float32(0))
    return byte, out_scale


def _block_error(x, out_scale):
    """Squared reconstruction error, pairwise in element order, unfused (docs/format.md §3)."""
    out = out_scale[..., None]
    safe = jnp.where(out != 0, out, jnp.float32(1))
    deq = jnp.float32(1) / safe
    d = _rounded(e2m1_values(e2m1_codes(x, out)) * deq) - x
    d = jnp.where(out != 0, d, -x)  # out_scale == 0: err = sum x^2
    sq = _rounded(d * d)
    pairs = sq[..., 0::2] + sq[..., 1::2]
    err = jnp.zeros(pairs.shape[:-1], jnp.float32)
    for j in range(_BLOCK // 2):
        err = err + pairs[..., j]
    return err


def store_factor(scale):
    """g = 1/scale and 1/g, each a correctly rounded float32 division (docs/format.md §2).

    Both are kept apart (``_rounded``): XLA simplifies ``1/(1/s)`` to ``s`` otherwise, which
    is not the same float32 number.
    """
    g = _rounded(jnp.float32(1) / _scalar(scale))
    return g, _rounded(jnp.float32(1) / g)


def quantize_blocks(x, scale, scale_search="default"):
    """Quantises x [..., 16] (float32) for the global scale ``scale`` (docs/format.md §2, §3).

    Returns (codes uint8 [..., 16] with the sign in bit 3, scale bytes uint8 [...]).
    """
    g, inv_g = store_factor(scale)
    amax = _block_amax(x)
    byte, out_scale = _block_scale(amax, g, inv_g, _RECIP6)
    if scale_search == "4over6":
        byte4, out4 = _block_scale(amax, g, inv_g, _RECIP4)
        take4 = _block_error(x, out4) < _block_error(x, out_scale)
        byte = jnp.where(take4, byte4, byte)
        out_scale = jnp.where(take4, out4, out_scale)
    return e2m1_codes(x, out_scale[..., None]), byte


def dequantize_blocks(codes, scale_bytes, scale):
    """Codes ``[..., 16]`` (sign in bit 3) and their block scale bytes ``[...]`` -> the float32
    values they stand for at the global scale ``scale`` (docs/format.md §1). Left to right as
    §1 writes it: E2M1 * E4M3 is exact, then one rounding."""
    return (e2m1_values(codes) * e4m3_decode(scale_bytes)[..., None]) * _scalar(scale)


def largest_stored(scale):
    """``6 * 448 * scale`` in float32, rounded on its own: the largest magnitude a cache holds
    at the global scale ``scale`` (larger values, Inf included, are stored as it)."""
    return _rounded(jnp.float32(_layout.LARGEST_STORED) * _scalar(scale))


def e4m3_below_normal(byte):
    """Whether E4M3 bytes are subnormal or zero: exponent field 0, below 2**-6, where a block
    scale keeps 0 to 3 significant bits (NaN bytes are not)."""
    return (byte & 0x78) == 0


def pack_codes(codes):
    """[..., 2n] codes -> [..., n] bytes, element 2k in the low nibble of byte k."""
    return codes[..., 0::2] | (codes[..., 1::2] << 4)


def unpack_codes(packed):
    lo = packed & 0xF
    hi = packed >> 4
    return jnp.stack([lo, hi], axis=-1).reshape(*packed.shape[:-1], packed.shape[-1] * 2)


def _scalar(s):
    return jnp.reshape(jnp.asarray(s, jnp.float32), ())


def quantize_head_vectors(x, scale, scale_search="default"):
    """[..., head_size] bf16/fp16 -> (packed [..., head_size/2], scale bytes [..., head_size/16])."""
    xf = x.astype(jnp.float32).reshape(*x.shape[:-1], x.shape[-1] // _BLOCK, _BLOCK)
    codes, scales = quantize_blocks(xf, scale, scale_search)
    return pack_codes(codes).reshape(*x.shape[:-1], x.shape[-1] // 2), scales


def reshape_and_cache(key, value, kv_cache, slot_mapping, k_scale, v_scale, *, layout="HND",
                      scale_search="default", v_scale_swizzle=True):
    """jnp twin of :func:`jax_nvfp4.reshape_and_cache` (same signature less ``checked``, same
    bytes; an invalid global scale becomes NaN here too)."""
    slot_mapping = checks.host_integers(slot_mapping, "slot_mapping")
    key, value, kv_cache, slot_mapping = map(jnp.asarray, (key, value, kv_cache, slot_mapping))
    k_scale, v_scale = checks.as_scales(k_scale, v_scale)
    geo = checks.check_store_args(key, value, kv_cache, slot_mapping, k_scale, v_scale,
                                  layout=layout, scale_search=scale_search,
                                  v_scale_swizzle=v_scale_swizzle)
    k_scale, v_scale = checks.sanitize_scale(k_scale), checks.sanitize_scale(v_scale)
    slots = slot_mapping
    valid = (slots >= 0) & (slots < geo.num_slots)
    # Tokens that must not write go to a block past the end, which the scatter drops.
    block = jnp.where(valid, slots // geo.block_size, geo.num_blocks).astype(jnp.int32)
    row = jnp.where(valid, slots % geo.block_size, 0).astype(jnp.int32)

    pages = geo.pages(kv_cache)
    data_offsets = jnp.asarray(geo.data_offsets(), jnp.int32)          # [H, T, D/2]
    tok_data = jnp.moveaxis(data_offsets[:, row], 1, 0)                # [tokens, H, D/2]
    for side, (x, scale) in enumerate(((key, k_scale), (value, v_scale))):
        packed, scale_bytes = quantize_head_vectors(x, scale, scale_search)
        scale_offsets = jnp.asarray(geo.scale_offsets(side == 1, v_scale_swizzle), jnp.int32)
        tok_scale = jnp.moveaxis(scale_offsets[:, row], 1, 0)          # [tokens, H, D/16]
        b = block[:, None, None]
        pages = pages.at[b, side, tok_data].set(packed, mode="drop")
        pages = pages.at[b, side, tok_scale].set(scale_bytes, mode="drop")
    return pages.reshape(kv_cache.shape)


def dequantize_pages(pages, geo, k_scale, v_scale, *, v_scale_swizzle=True, dtype=jnp.bfloat16):
    """Pages [..., 2, side bytes] of a cache -> (k, v), each [..., block_size, H, D] in dtype."""
    lead = pages.shape[:-2]
    out = []
    for side, scale in ((0, k_scale), (1, v_scale)):
        flat = pages[..., side, :]
        packed = jnp.take(flat, jnp.asarray(geo.data_offsets(), jnp.int32), axis=-1)
        scale_bytes = jnp.take(flat, jnp.asarray(geo.scale_offsets(side == 1, v_scale_swizzle),
                                                 jnp.int32), axis=-1)
        codes = unpack_codes(packed)                                   # [..., H, T, D]
        codes = codes.reshape(*codes.shape[:-1], geo.scales_per_head, _BLOCK)
        x = dequantize_blocks(codes, scale_bytes, scale)
        x = x.reshape(*lead, geo.num_kv_heads, geo.block_size, geo.head_size)
        out.append(jnp.swapaxes(x, -3, -2).astype(dtype))             # [..., T, H, D]
    return tuple(out)


def dequantize(kv_cache, k_scale, v_scale, *, layout="HND", v_scale_swizzle=True,
               dtype=jnp.bfloat16):
    """Reads a whole cache back: (k, v), each [num_blocks, block_size, num_kv_heads, head_size]
    (an invalid global scale reads NaN)."""
    checks.check_options(layout=layout, v_scale_swizzle=v_scale_swizzle, dtype=dtype)
    kv_cache = jnp.asarray(kv_cache)
    geo = checks.check_kv_cache(kv_cache, layout, v_scale_swizzle)
    k_scale, v_scale = checks.as_scales(k_scale, v_scale)
    checks.check_scale(k_scale, "k_scale")
    checks.check_scale(v_scale, "v_scale")
    k_scale, v_scale = checks.sanitize_scale(k_scale), checks.sanitize_scale(v_scale)
    pages = geo.pages(kv_cache)
    return dequantize_pages(pages, geo, k_scale, v_scale, v_scale_swizzle=v_scale_swizzle,
                            dtype=dtype)


# ---------------------------------------------------------------------------------------------
# Decode attention: the jnp path of jax_nvfp4.paged_attention (impl="jnp"), the reference its
# CUDA kernel is tested against, and the CPU implementation.


def attend(q, k, v, seq_lens, *, sm_scale=None, return_lse=False):
    """Masked grouped-query softmax attention of one query token per sequence.

    Shared by every jnp reader (NVFP4 and plain caches).

    Args:
      q: ``[batch, num_q_heads, head_size]``.
      k, v: ``[batch, max_len, num_kv_heads, head_size]``: each sequence's tokens in position
        order (gathered pages); positions ``>= seq_lens[b]`` may hold anything, NaN included.
      seq_lens: ``[batch]`` integer; a sequence attends to positions ``0 .. seq_len - 1``
        (clamped to ``max_len``). ``seq_len <= 0`` gives a zero output.
      sm_scale: score multiplier, default ``1 / sqrt(head_size)``.
      return_lse: also return the log-sum-exp of the scores.

    Returns:
      ``[batch, num_q_heads, head_size]`` in q's dtype (and, with ``return_lse``, the float32
      ``[batch, num_q_heads]`` natural log of ``sum(exp(score))``, ``-inf`` where nothing is
      attended to). Scores, softmax and the weighted sum of values are computed in float32
      (``Precision.HIGHEST``); query head ``i`` uses KV head
      ``i // (num_q_heads // num_kv_heads)``.
    """
    checks.check_options(return_lse=return_lse)
    batch, num_q_heads, head_size = q.shape
    max_len, num_kv_heads = k.shape[1], k.shape[2]
    group = num_q_heads // num_kv_heads
    scale = default_sm_scale(head_size) if sm_scale is None else sm_scale
    if max_len == 0:
        out = jnp.zeros(q.shape, q.dtype)
        return (out, jnp.full(q.shape[:2], -jnp.inf, jnp.float32)) if return_lse else out

    hi = jax.lax.Precision.HIGHEST
    qg = q.astype(jnp.float32).reshape(batch, num_kv_heads, group, head_size)
    valid = jnp.arange(max_len, dtype=jnp.int32)[None, :] < checks.to_int32(seq_lens)[:, None]
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
    out = out.reshape(batch, num_q_heads, head_size).astype(q.dtype)
    if not return_lse:
        return out
    lse = jnp.where(denom > 0, top + jnp.log(jnp.where(denom > 0, denom, 1.0)), -jnp.inf)
    return out, lse.reshape(batch, num_q_heads)


def default_sm_scale(head_size: int) -> float:
    """The softmax scale when none is given: ``1 / sqrt(head_size)``."""
    return 1.0 / float(np.sqrt(head_size))


def gather_index(block_tables, num_blocks: int):
    """Page ids for a gather: padding entries may hold anything, so they are clamped into range
    (the ``seq_len`` mask hides them). Entries inside ``seq_len`` are clamped the same way: an
    out-of-range id there reads page 0 or the last page (``checked=True`` of the readers
    reports them). int64 ids are clamped, never wrapped, to int32."""
    return jnp.clip(checks.to_int32(block_tables), 0, max(num_blocks - 1, 0))


def paged_attention(q, kv_cache, block_tables, seq_lens, k_scale, v_scale, *, layout="HND",
                    v_scale_swizzle=True, sm_scale=None, return_lse=False):
    """Decode attention over an NVFP4 paged cache in pure jnp (no argument checks).

    The computation behind ``jax_nvfp4.paged_attention(..., impl="jnp")``, which validates the
    arguments first; same arguments and result. Every sequence gathers all
    ``max_blocks_per_seq`` pages of its row of ``block_tables`` (padding entries clamped into
    range), dequantises them to float32 (:func:`dequantize_pages`) and attends with
    :func:`attend`. Options are validated (:func:`jax_nvfp4.checks.check_options`); an
    invalid global scale makes every output (and lse) NaN (:func:`jax_nvfp4.checks.nan_if_invalid`).
    """
    checks.check_options(layout=layout, v_scale_swizzle=v_scale_swizzle, return_lse=return_lse)
    geo = _layout.CacheGeometry.from_shape(kv_cache.shape, layout)
    batch = q.shape[0]
    max_blocks = block_tables.shape[1]
    pages = geo.pages(kv_cache)[gather_index(block_tables, geo.num_blocks)]  # [B, M, 2, side]
    k, v = dequantize_pages(pages, geo, k_scale, v_scale, v_scale_swizzle=bool(v_scale_swizzle),
                            dtype=jnp.float32)
    shape = (batch, max_blocks * geo.block_size, geo.num_kv_heads, geo.head_size)
    result = checks.nan_if_invalid(attend(q, k.reshape(shape), v.reshape(shape), seq_lens,
                                          sm_scale=sm_scale, return_lse=True), k_scale, v_scale)
    return result if return_lse else result[0]


# ---------------------------------------------------------------------------------------------
# Ragged paged attention (several query tokens per sequence): the jnp path of
# jax_nvfp4.ragged_paged_attention (impl="jnp"), the reference its CUDA kernel is tested against.


def ragged_token_plan(cu_q_lens, num_seqs, seq_lens, num_tokens: int, capacity: int,
                      with_q_len: bool = False):
    """Which sequence each query token belongs to, and how many positions it attends to.

    The rules of :func:`jax_nvfp4.ragged_paged_attention`, in one place (the CUDA kernel
    follows the same ones, ``ffi/ragged_cuda.cu``):

    * ``num_seqs`` is clamped to ``[0, max_num_seqs]``; sequence ``b < num_seqs`` owns the query
      tokens ``[start_b, start_{b+1})`` with ``start_b = clip(max(cu_q_lens[:b + 1]), 0,
      num_tokens)``: ``cu_q_lens[b]`` itself when it is non-decreasing and inside
      ``[0, num_tokens]`` (``checked=True`` reports otherwise), and never two owners for one
      token whatever it holds.
    * Query ``j`` of sequence ``b`` (``q_len_b = start_{b+1} - start_b`` tokens) is at position
      ``kv_len_b - q_len_b + j`` (``kv_len_b = max(seq_lens[b], 0)`` includes the query tokens,
      stored first) and attends to the positions ``t <= kv_len_b - q_len_b + j`` with
      ``t < capacity = max_blocks_per_seq * block_size``: it attends to
      ``end = clip(kv_len_b - (q_len_b - 1 - j), 0, capacity)`` positions.
    * Tokens no sequence owns attend to nothing (``end = 0``: zero output, lse ``-inf``).

    Args:
      cu_q_lens: ``[max_num_seqs + 1]`` integer. num_seqs: integer scalar (shape ``()`` or
      ``(1,)``). seq_lens: ``[max_num_seqs]`` integer. num_tokens, capacity: static ints.
      with_q_len: also return each token's ``q_len`` (its sequence's query tokens; 0 for
      tokens nobody owns).

    Returns:
      ``(seq, end)`` or ``(seq, end, q_len)``: int32 ``[num_tokens]`` each; ``seq`` is the
      owning sequence (clamped into ``[0, max_num_seqs - 1]`` for tokens nobody owns, whose
      ``end`` is 0).
    """
    max_num_seqs = seq_lens.shape[0]
    if max_num_seqs == 0:                         # no sequence: no token is owned
        return (jnp.zeros(num_tokens, jnp.int32),) * (3 if with_q_len else 2)
    cu = checks.to_int32(cu_q_lens)
    ns = jnp.clip(jnp.reshape(checks.to_int32(num_seqs), ()), 0, max_num_seqs)
    starts = jnp.clip(jax.lax.cummax(cu, axis=0), 0, num_tokens)           # [S + 1]
    starts = jnp.where(jnp.arange(max_num_seqs + 1) <= ns, starts, starts[ns])
    t = jnp.arange(num_tokens, dtype=jnp.int32)
    owner = jnp.searchsorted(starts[1:], t, side="right").astype(jnp.int32)  # [0, S]
    owned = (t >= starts[0]) & (owner < ns)
    seq = jnp.minimum(owner, max(max_num_seqs - 1, 0))
    q_len = starts[seq + 1] - starts[seq]
    kv_len = jnp.maximum(checks.to_int32(seq_lens)[seq], 0)
    # kv_len - (q_len - 1 - j): never overflows int32 (0 <= q_len - 1 - j < num_tokens).
    end = jnp.clip(kv_len - (q_len - 1 - (t - starts[seq])), 0, capacity)
    plan = seq, jnp.where(owned, end, 0).astype(jnp.int32)
    return plan + (jnp.where(owned, q_len, 0).astype(jnp.int32),) if with_q_len else plan


def ragged_paged_attention(q, kv_cache, block_tables, seq_lens, cu_q_lens, num_seqs, k_scale,
                           v_scale, *, layout="HND", v_scale_swizzle=True, sm_scale=None,
                           return_lse=False, max_q_len=None):
    """Ragged paged attention over an NVFP4 cache in pure jnp (no argument checks).

    The computation behind ``jax_nvfp4.ragged_paged_attention(..., impl="jnp")``, which
    validates the arguments first; same arguments and result. Each query token is decode
    attention of its own: :func:`ragged_token_plan` gives its sequence and the number of
    positions it sees, and :func:`paged_attention` attends with that sequence's row of
    ``block_tables`` and that length. So one query token per sequence is the decode reader
    exactly, and the memory is that of a decode batch of ``num_tokens`` sequences (every token
    gathers all ``max_blocks_per_seq`` pages of its row). With ``max_q_len`` (a static int),
    the rows of a sequence with more query tokens are NaN (out and lse), as on the kernels.
    """
    geo = _layout.CacheGeometry.from_shape(kv_cache.shape, layout)
    num_tokens = q.shape[0]
    max_num_seqs, max_blocks = block_tables.shape
    if max_num_seqs == 0 or num_tokens == 0:
        out, lse = checks.nan_if_invalid((jnp.zeros(q.shape, q.dtype),
                                          jnp.full(q.shape[:2], -jnp.inf, jnp.float32)),
                                         k_scale, v_scale)
        return (out, lse) if return_lse else out
    seq, end, q_len = ragged_token_plan(cu_q_lens, num_seqs, seq_lens, num_tokens,
                                        max_blocks * geo.block_size, with_q_len=True)
    out, lse = paged_attention(q, kv_cache, checks.to_int32(block_tables)[seq], end, k_scale,
                               v_scale, layout=layout, v_scale_swizzle=v_scale_swizzle,
                               sm_scale=sm_scale, return_lse=True)
    if max_q_len is not None:   # the caller's bound broken: NaN rows, as on the kernels
        over = (q_len > max_q_len)[:, None]
        out = jnp.where(over[..., None], jnp.asarray(jnp.nan, out.dtype), out)
        lse = jnp.where(over, jnp.nan, lse)
    return (out, lse) if return_lse else out
