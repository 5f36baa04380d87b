"""Ragged paged attention over an NVFP4 cache as a JAX primitive: abstract evaluation, lowering
per platform, batching and partitioning rules, side by side (the multi-token twin of
attention_primitive.py).

``ragged_p`` works on one canonical form with leading stacked axes ``S`` (layers, head groups,
both; ``S = (1,)`` for a plain call), as the decode primitive's (attention_primitive.py):

* q ``[*S, num_tokens, num_q_heads, head_size]``, kv_cache ``[*S, num_blocks, 2, ...]`` (uint8),
* block_tables ``[*S', max_num_seqs, max_blocks_per_seq]``, seq_lens ``[*S', max_num_seqs]``,
  cu_q_lens ``[*S', max_num_seqs + 1]`` and num_seqs ``[*S']`` (int32),
* k_scale, v_scale, sm_scale: float32 ``[*S']``,

each axis of ``S'`` being ``S_i`` or 1 (shared along it), and returns ``(out [*S, num_tokens,
num_q_heads, head_size] in q's dtype, lse [*S, num_tokens, num_q_heads] float32)``.

Lowering: on CUDA the kernel of ``ffi/ragged_cuda.cu`` (FFI target
``jax_nvfp4_ragged_paged_attention``) for head sizes 64, 128 and 256; elsewhere, and for other
head sizes, the jnp path (:func:`jax_nvfp4.reference.ragged_paged_attention`). The same FFI
call runs the decode kernel of ``ffi/decode_cuda.cu`` for the sequences that own one query token
(:func:`plan_one_token_splits`), so a mixed batch's decode tokens cost what they cost in a
decode step. Under a
multi-device ``jit`` the kernel call is wrapped in custom partitioning: the stacked axes split
with no communication, every other axis is replicated (the token axis cannot split on its own:
a sequence's query tokens and its pages go together). The cache is only read.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.custom_partitioning import custom_partitioning
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir
from jax.sharding import NamedSharding, PartitionSpec

from . import attention_primitive as _decode
from . import checks
from . import layout as _layout
from . import partitioning as _partitioning
from . import reference as _reference
from .primitive import _ffi, require_devices_during_lowering

#: Name of the FFI target (same string as ffi/ragged_ffi.h).
RAGGED_TARGET = _ffi.RAGGED_TARGET
#: Head sizes the CUDA kernel is compiled for.
KERNEL_HEAD_SIZES = _decode.KERNEL_HEAD_SIZES

#: Query rows (query tokens x query heads of one kv head) of one CTA (ffi/ragged_cuda.cu).
ROWS_PER_CTA = 64
#: Positions a CTA converts per step; a split is a multiple of it (ffi/ragged_cuda.cu).
KV_TILE = 64
#: CTAs per SM when the GPU cannot be asked (shared memory decides: ffi/ragged_cuda.cu).
_DEFAULT_CTAS_PER_SM = 2
#: Query rows (tokens x query heads of one kv head) of a sequence that the few-row kernel
#: takes, its largest head size (ffi/ragged_ffi.h, kFewRows, kFewRowsMaxHead), and its
#: CTAs per SM when the GPU cannot be asked (its launch bounds, ffi/ragged_few_rows.cu). At
#: head size 128 it takes up to ``FEW_ROWS_WIDE`` rows (kFewRowsWide) where the build has
#: sm_90a code for the GPU (ffi/few_rows_wide.cuh; :func:`few_rows_max` asks).
FEW_ROWS = 16
FEW_ROWS_WIDE = 32
FEW_ROWS_MAX_HEAD_SIZE = 128
_DEFAULT_FEW_ROWS_CTAS_PER_SM = 2
#: Largest split-KV workspace (partial outputs, float32) the plan may ask for.
MAX_WORKSPACE_BYTES = 256 << 20
#: Most stacked members x splits: the kernel's grid puts them on its z axis.
MAX_GRID_Z = 65535

if _ffi.built_with_cuda():
    jax.ffi.register_ffi_target(RAGGED_TARGET, _ffi.ragged_registrations()["CUDA"],
                                platform="CUDA")

ragged_p = Primitive("nvfp4_ragged_paged_attention")
ragged_p.multiple_results = True

_STATIC = ("layout", "v_scale_swizzle", "impl", "max_q_len")


def _bind_under_jit(*args, **params):
    return ragged_p.bind(*args, **params)


ragged_p.def_impl(jax.jit(_bind_under_jit, static_argnames=_STATIC))


@ragged_p.def_abstract_eval
def _abstract_eval(q, *args, layout, v_scale_swizzle, impl, max_q_len):
    del args, layout, v_scale_swizzle, impl, max_q_len
    return jax.core.ShapedArray(q.shape, q.dtype), jax.core.ShapedArray(q.shape[:-1], jnp.float32)


def bind(q, kv_cache, block_tables, seq_lens, cu_q_lens, num_seqs, k_scale, v_scale, sm_scale,
         *, layout, v_scale_swizzle, impl, max_q_len=None):
    """One (validated) call in the form users have: q ``[num_tokens, Hq, D]``, one layer's
    cache, block_tables ``[S, M]``, seq_lens ``[S]``, cu_q_lens ``[S + 1]``, scalar num_seqs
    and scales; ``max_q_len`` None or the caller's bound on each sequence's query tokens (a
    Python int: attention.py validates and converts it).
    Returns ``(out, lse)``."""
    lead = lambda x: jnp.reshape(x, (1,) + tuple(x.shape))  # noqa: E731
    ints = (checks.to_int32(x) for x in (block_tables, seq_lens, cu_q_lens))
    out, lse = ragged_p.bind(
        lead(q), lead(kv_cache), *(lead(x) for x in ints),
        jnp.reshape(checks.to_int32(num_seqs), (1,)),
        *(jnp.reshape(jnp.asarray(s, jnp.float32), (1,)) for s in (k_scale, v_scale, sm_scale)),
        layout=layout, v_scale_swizzle=bool(v_scale_swizzle), impl=impl, max_q_len=max_q_len)
    return out[0], lse[0]


# ---------------------------------------------------------------------------------------------
# The jnp path on the canonical form.


def _jnp_canonical(*args, layout, v_scale_swizzle, max_q_len):
    def one(q, kv_cache, block_tables, seq_lens, cu_q_lens, num_seqs, k_scale, v_scale,
            sm_scale):
        return _reference.ragged_paged_attention(
            q, kv_cache, block_tables, seq_lens, cu_q_lens, num_seqs, k_scale, v_scale,
            layout=layout, v_scale_swizzle=v_scale_swizzle, sm_scale=sm_scale, return_lse=True,
            max_q_len=max_q_len)

    return _decode.stacked_jnp(one, args)


# ---------------------------------------------------------------------------------------------
# The CUDA kernel.

#: Whether the CUDA kernel covers a head size: the decode kernel's rule (the same head sizes).
kernel_supports = _decode.kernel_supports


def _resident_ctas(head_size: int) -> int:
    """The ragged kernel's CTAs per SM on this GPU."""
    return _decode.resident_ctas("ragged_resident_ctas_per_sm", head_size, _DEFAULT_CTAS_PER_SM)


def _few_rows_resident_ctas(head_size: int) -> int:
    """The few-row kernel's CTAs per SM on this GPU."""
    return _decode.resident_ctas("few_rows_resident_ctas_per_sm", head_size,
                                 _DEFAULT_FEW_ROWS_CTAS_PER_SM)


def _wide_rows_resident_ctas(head_size: int) -> int:
    """The CTAs per SM on this GPU of the few-row kernel's wide path (17 to 32 rows, its own
    kernel); the 16-row kernel's where the wide path does not run."""
    return _decode.resident_ctas("wide_rows_resident_ctas_per_sm", head_size,
                                 _few_rows_resident_ctas(head_size))


def few_rows_plan_ctas(alone: bool, max_q_len, num_q_heads: int, num_kv_heads: int,
                       head_size: int) -> int:
    """The few-row work's CTAs per SM for the split plan: where the few-row kernels serve the
    call ``alone`` with a bound ``max_q_len`` of more than ``FEW_ROWS`` rows per kv head, the
    wide path's kernel does the work (its own occupancy); otherwise (up to ``FEW_ROWS`` rows, or
    no bound: the sequences' rows are not known) the 16-row kernel's."""
    wide = alone and max_q_len * (num_q_heads // num_kv_heads) > FEW_ROWS
    return (_wide_rows_resident_ctas if wide else _few_rows_resident_ctas)(head_size)


def few_rows_max(head_size: int) -> int:
    """The most query rows per kv head the few-row kernel takes on this GPU for a head size:
    ``FEW_ROWS_WIDE`` at head size 128 where the build has sm_90a code for it, else
    ``FEW_ROWS`` (also where the GPU cannot be asked)."""
    return _decode.resident_ctas("few_rows_max_rows", head_size, FEW_ROWS)


def tile_slots(num_tokens: int, max_num_seqs: int, group: int) -> int:
    """CTAs (per kv head, stacked member and split) the kernel's grid has for query tiles: an
    upper bound on ``sum_b ceil(q_len_b * group / ROWS_PER_CTA)`` whatever ``cu_q_lens`` holds
    (each sequence adds at most one partial tile). Slots past the real tiles exit at once."""
    return -(-num_tokens * group // ROWS_PER_CTA) + min(max_num_seqs, num_tokens)


def few_rows_only(max_q_len, num_q_heads: int, num_kv_heads: int, head_size: int,
                  few_rows: int = FEW_ROWS) -> bool:
    """Whether the caller's bound ``max_q_len`` (None: none) lets the few-row kernel serve a
    whole call alone: 2 or more tokens (a bound of 1 is a decode step, the decode kernel's),
    at most ``few_rows`` query rows per kv head (what it takes on the GPU:
    :func:`few_rows_max`), a head size it covers (ffi/ragged_ffi.h)."""
    return (max_q_len is not None and max_q_len >= 2 and head_size <= FEW_ROWS_MAX_HEAD_SIZE
            and max_q_len * (num_q_heads // num_kv_heads) <= few_rows)


def plan_splits(stacked: int, num_tokens: int, max_num_seqs: int, num_kv_heads: int,
                num_q_heads: int, head_size: int, max_tokens: int, sm_count: int,
                ctas_per_sm: int = _DEFAULT_CTAS_PER_SM,
                few_rows_ctas_per_sm: int = _DEFAULT_FEW_ROWS_CTAS_PER_SM,
                alone: bool = False, few_rows: int = FEW_ROWS) -> tuple[int, int]:
    """Split-KV plan of the ragged kernel: ``(num_splits, tokens_per_split)``.

    The work is counted as :func:`tile_slots` query tiles per kv head (the static bound: how
    the query tokens fall into sequences is only known on the device), each over up to
    ``max_tokens`` positions, or, when the tokens are few enough for every sequence to have at
    most ``few_rows`` query rows per kv head (speculative decoding; what the few-row kernel takes
    on the GPU, :func:`few_rows_max`), or when the few-row kernel
    serves the call ``alone`` (:func:`few_rows_only`), as one CTA of the few-row
    kernel per (sequence, kv head) at that kernel's occupancy (``few_rows_ctas_per_sm``; the
    ragged kernel's is ``ctas_per_sm``);
    :func:`jax_nvfp4.attention_primitive.plan_splits_for_units` picks the splits. Few tiles over long contexts (speculative decoding, small batches) split;
    prefill chunks fill the GPU with tiles and do not. The partial results of the splits
    (float32 ``[L, num_tokens, num_q_heads, splits, head_size]``) are kept under
    ``MAX_WORKSPACE_BYTES``, and members x splits under ``MAX_GRID_Z``.
    """
    group = num_q_heads // num_kv_heads
    if alone or (head_size <= FEW_ROWS_MAX_HEAD_SIZE and
                 num_tokens * group <= max_num_seqs * few_rows):
        # Few tokens per sequence on average (speculative decoding): the work is the few-row
        # kernel's, a CTA per (sequence, kv head) at its own occupancy.
        units, ctas_per_sm = stacked * num_kv_heads * max_num_seqs, few_rows_ctas_per_sm
    else:
        units = stacked * num_kv_heads * max(tile_slots(num_tokens, max_num_seqs, group), 1)
    splits, per_split = _decode.plan_splits_for_units(
        units, max_tokens, sm_count, ctas_per_sm, KV_TILE,
        merge_rows=stacked * num_tokens * num_q_heads)
    row_bytes = stacked * num_tokens * num_q_heads * head_size * 4   # one split's workspace
    most = max(min(MAX_WORKSPACE_BYTES // max(row_bytes, 1), MAX_GRID_Z // max(stacked, 1)), 1)
    if splits > most:   # fewer, longer splits (a multiple of KV_TILE, each starting inside)
        per_split = -(-max(max_tokens, 1) // most)
        per_split = -(-per_split // KV_TILE) * KV_TILE
        splits = -(-max(max_tokens, 1) // per_split)
    return splits, per_split


def plan_one_token_splits(stacked: int, max_num_seqs: int, num_kv_heads: int, num_q_heads: int,
                          head_size: int, max_tokens: int) -> tuple[int, int, bool]:
    """Split-KV plan ``(decode_splits, tokens_per_split, cluster_merge)`` of the decode kernel
    for the sequences of a ragged call that own one query token (the decode tokens of a mixed
    batch, or every sequence of a decode step called through ragged attention): the decode
    reader's own plan for a batch of ``max_num_seqs``
    (:func:`jax_nvfp4.attention_primitive.decode_plan`, the merge of its splits included), so
    one token per sequence is that reader's launch exactly. ``(0, 0, False)`` (no decode
    launch) when there is no sequence."""
    if max_num_seqs == 0:
        return 0, 0, False
    return _decode.decode_plan(stacked, max_num_seqs, num_kv_heads, num_q_heads, head_size,
                               max_tokens)


def _kernel_call(q, kv_cache, block_tables, seq_lens, cu_q_lens, num_seqs, k_scale, v_scale,
                 sm_scale, layout, v_scale_swizzle, max_q_len):
    """The FFI call on whatever (per-device) shapes it gets."""
    geo = _layout.CacheGeometry.from_shape(kv_cache.shape[1:], layout)
    stacked, num_tokens, num_q_heads, head_size = q.shape
    max_num_seqs, max_blocks = block_tables.shape[1:]
    max_tokens = max_blocks * geo.block_size
    few_rows = few_rows_max(head_size)
    alone = few_rows_only(max_q_len, num_q_heads, geo.num_kv_heads, head_size, few_rows)
    splits, tokens_per_split = plan_splits(
        stacked, num_tokens, max_num_seqs, geo.num_kv_heads, num_q_heads, head_size, max_tokens,
        _decode._sm_count(), _resident_ctas(head_size),
        few_rows_plan_ctas(alone, max_q_len, num_q_heads, geo.num_kv_heads, head_size),
        alone=alone, few_rows=few_rows)
    # The sequences that own one query token go to the decode kernel (launched by the same
    # call, after the ragged kernel), planned as a decode batch of max_num_seqs sequences;
    # unless the few-row kernel serves the call alone.
    decode_splits, decode_per_split, decode_cluster_merge = (
        (0, 0, False) if alone else plan_one_token_splits(
            stacked, max_num_seqs, geo.num_kv_heads, num_q_heads, head_size, max_tokens))
    by_sequence = jax.ShapeDtypeStruct((stacked, max_num_seqs, num_q_heads, head_size), q.dtype)
    results = (_decode.split_kv_results(q, splits) +
               _decode.split_kv_results(by_sequence, decode_splits, decode_cluster_merge)[2:])
    out, lse, *_ = jax.ffi.ffi_call(RAGGED_TARGET, results)(
        q, kv_cache, block_tables, seq_lens, cu_q_lens, num_seqs, k_scale, v_scale, sm_scale,
        layout=np.int32(_layout.LAYOUTS.index(layout)), v_scale_swizzle=bool(v_scale_swizzle),
        num_splits=np.int32(splits), tokens_per_split=np.int32(tokens_per_split),
        decode_splits=np.int32(decode_splits), decode_tokens_per_split=np.int32(decode_per_split),
        decode_cluster_merge=decode_cluster_merge,
        max_q_len=np.int32(max_q_len or 0), few_rows_only=alone)
    # The kernels apply the readers' invalid-scale rule themselves (checks.nan_if_invalid): no
    # select over the output after them (it cost 11 to 90 us a call at the prefill points).
    return out, lse


_jnp_lowering, _cuda_lowering = _decode.lowerings(
    "ragged_paged_attention", _jnp_canonical, _kernel_call, lambda body: partitioned(body),
    static=("layout", "v_scale_swizzle", "max_q_len"))


mlir.register_lowering(ragged_p, _jnp_lowering)
mlir.register_lowering(ragged_p, _cuda_lowering, platform="cuda")
require_devices_during_lowering(ragged_p)


def _jvp(primals, tangents, **params):
    raise TypeError(
        "jax_nvfp4.ragged_paged_attention over an NVFP4 cache is not differentiable (the cache "
        "is quantised); apply jax.lax.stop_gradient to q and the scales.")


ad.primitive_jvps[ragged_p] = _jvp


# ---------------------------------------------------------------------------------------------
# vmap: members of a stacked cache join the stacked axis (one launch); with one cache shared
# by every member, one call per member (a loop: nothing is copied).


_NOT_MAPPED = None


def _batch(args, dims, *, layout, v_scale_swizzle, impl, max_q_len):
    q = args[0]
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not _NOT_MAPPED)
    params = dict(layout=layout, v_scale_swizzle=v_scale_swizzle, impl=impl,
                  max_q_len=max_q_len)
    if size == 0:
        return _decode.empty_batch(q, dims)
    if dims[1] is _NOT_MAPPED:
        # One cache for every member: a loop over the members, the cache closed over.
        cache = args[1]
        mapped = [i for i, d in enumerate(dims) if d is not _NOT_MAPPED]

        def one(xs):
            call = list(args)
            call[1] = cache
            for i, x in zip(mapped, xs):
                call[i] = x
            return tuple(ragged_p.bind(*call, **params))

        out, lse = jax.lax.map(one, [_decode.members_first(args[i], dims[i], size)
                                     for i in mapped])
        return (out, lse), (0, 0)
    return _decode.bind_members_stacked(ragged_p, args, dims, size, **params)


batching.primitive_batchers[ragged_p] = _batch


# ---------------------------------------------------------------------------------------------
# Partitioning: the stacked axis splits, everything else is replicated.

_SPLITTABLE = ("stack",)


def _factors(layout: str, shapes):
    q, cache, tables, lens, cu, num_seqs, k_scale, v_scale, sm_scale = (tuple(s) for s in shapes)
    lead = functools.partial(_decode.stacked_factors, q)
    stack = lead(q, "")
    cache_axes = stack + tuple("c_" + a for a in _layout.CACHE_AXES[layout])
    operands = (stack + ("tokens", "q_heads", "head_size"), cache_axes,
                lead(tables, "t_one") + ("seqs", "pages"), lead(lens, "l_one") + ("seqs",),
                lead(cu, "u_one") + ("seqs_1",), lead(num_seqs, "n_one"),
                lead(k_scale, "k_one"), lead(v_scale, "v_one"), lead(sm_scale, "s_one"))
    return (operands, (operands[0], operands[0][:-1]),
            _partitioning.replicated_factors(operands, _SPLITTABLE))


def _sharding_rule(layout, v_scale_swizzle, max_q_len, mesh, operand_types, result_types):
    del v_scale_swizzle, max_q_len, mesh, result_types
    operands, results, replicated = _factors(layout, [tuple(t.shape) for t in operand_types])
    return _decode.rule_text(operands, results), {"need_replication_factors": replicated}


def _plan(layout, shapes, cache_sharding):
    """Specs of the operands and results: the stacked axes as the cache has them (never move
    the cache), everything else replicated."""
    operands, results, _ = _factors(layout, shapes)
    kept = _decode.stacked_shardings(shapes, cache_sharding)
    return ([_partitioning.specs_of(kept, op) for op in operands],
            [_partitioning.specs_of(kept, r) for r in results])


def _infer_sharding_from_operands(layout, v_scale_swizzle, max_q_len, mesh, arg_shapes,
                                  result_shape):
    del v_scale_swizzle, max_q_len, result_shape
    _, results = _plan(layout, [a.shape for a in arg_shapes], arg_shapes[1].sharding)
    return tuple(NamedSharding(mesh, s) for s in results)


def _propagate_user_sharding(layout, v_scale_swizzle, max_q_len, mesh, user_shape):
    del layout, v_scale_swizzle, max_q_len
    out = user_shape[0]
    entries = _partitioning.spec_entries(out.sharding, len(out.shape))
    keep = PartitionSpec(*entries[:-3], None, None, None)  # the stacked axes
    return (NamedSharding(mesh, keep), NamedSharding(mesh, PartitionSpec(*keep[:-1])))


@functools.lru_cache(maxsize=None)
def partitioned(body):
    """``body(q, kv_cache, block_tables, seq_lens, cu_q_lens, num_seqs, k_scale, v_scale,
    sm_scale, layout, v_scale_swizzle, max_q_len) -> (out, lse)`` under custom partitioning:
    each device runs it on its own stacked members."""

    def partition(layout, v_scale_swizzle, max_q_len, mesh, arg_shapes, result_shape):
        del result_shape
        operands, results = _plan(layout, [a.shape for a in arg_shapes], arg_shapes[1].sharding)
        return (mesh, lambda *a: body(*a, layout, v_scale_swizzle, max_q_len),
                tuple(NamedSharding(mesh, s) for s in results),
                tuple(NamedSharding(mesh, s) for s in operands))

    wrapped = custom_partitioning(body, static_argnums=(9, 10, 11))
    wrapped.def_partition(partition=partition,
                          infer_sharding_from_operands=_infer_sharding_from_operands,
                          propagate_user_sharding=_propagate_user_sharding,
                          sharding_rule=_sharding_rule)
    return wrapped


__all__ = ["KERNEL_HEAD_SIZES", "RAGGED_TARGET", "ROWS_PER_CTA", "bind", "few_rows_max",
           "few_rows_only", "kernel_supports", "plan_one_token_splits", "plan_splits", "ragged_p",
           "tile_slots"]
