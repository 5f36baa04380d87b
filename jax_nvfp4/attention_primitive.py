"""Decode attention over an NVFP4 cache as a JAX primitive: abstract evaluation, lowering per
platform, batching and partitioning rules, side by side.

``decode_p`` works on one canonical form with leading stacked axes ``S = (S_0, ..., S_{n-1})``,
``n >= 1`` (layers, head groups, both; ``S = (1,)`` for a plain call):

* q ``[*S, batch, num_q_heads, head_size]``, kv_cache ``[*S, num_blocks, 2, ...]`` (uint8),
* block_tables ``[*S', batch, max_blocks_per_seq]`` and seq_lens ``[*S', batch]`` (int32),
* k_scale, v_scale, sm_scale: float32 ``[*S']``,

where each axis of ``S'`` is ``S_i`` or 1 (shared along that axis), and returns ``(out [*S,
batch, num_q_heads, head_size] in q's dtype, lse [*S, batch, num_q_heads] float32)``.
``jax.vmap`` over layers or groups, nested or not, therefore stays one primitive (one launch),
each vmap adding a stacked axis where the cache has its members: no reshape, no transpose of
the cache, so a sharded stacked axis stays where it is.

Lowering: on CUDA, the fused kernel (``ffi/decode_cuda.cu``) behind the XLA FFI target
``jax_nvfp4_paged_attention`` for head sizes 64, 128 and 256 (other head sizes use the jnp path,
or raise with ``impl="kernel"``); on every other platform the jnp path
(:func:`jax_nvfp4.reference.paged_attention`). Under a multi-device ``jit`` the kernel call is
wrapped in custom partitioning: the stacked axes (the cache's leading axes) and the batch axis
split with no communication, every other axis is replicated; per device the kernel sees the
stacked axes as one (a row-major reshape of read-only operands: no copy). The cache is only read: no alias, no
donation needed.
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
import numpy as np
from jax.experimental.custom_partitioning import custom_partitioning
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir
from jax.sharding import NamedSharding, PartitionSpec

from . import checks
from . import layout as _layout
from . import reference as _reference
from . import partitioning as _partitioning
from .primitive import _ffi, require_devices_during_lowering

#: Name of the FFI target (same string as ffi/decode_ffi.h).
DECODE_TARGET = _ffi.DECODE_TARGET
#: Head sizes the CUDA kernel is compiled for.
KERNEL_HEAD_SIZES = (64, 128, 256)
#: Implementations a caller may ask for (``"jnp"`` never reaches the primitive).
IMPLS = checks.IMPLS

# Split-KV policy (see plan_splits).
_TOKENS_PER_CTA_STEP = 128      # one step of a CTA: 4 warps x 32 positions (ffi/decode_cuda.cu)
_MIN_TOKENS_PER_SPLIT = 256     # shorter splits cost more in partial results than they gain
_MAX_SPLITS = 256
_CTA_START_COST = 128           # a CTA's start (q, setup, merge of its warps), in positions
_MERGE_COST = 256               # the merge kernel, in positions per wave of its blocks
_MERGE_ROWS_PER_SM = 16         # merge blocks (one per row, 128 threads) an SM holds at once
_DEFAULT_CTAS_PER_SM = 3        # when the GPU cannot be asked (ffi/decode_cuda.cu, kMinCtasPerSm)
_CLUSTER_MERGE_COST = 32        # the merge inside a cluster (two cluster barriers), in positions
# A batch's lengths are not in its shapes, and a ragged batch finishes when its longest CTA
# does: of the plans within _NEAR_COST of the best modelled cost (every sequence as long as the
# table), the decode plan takes the most splits that keep _SHORT_SPLIT_TOKENS positions or more
# each. H200, forced split counts: ragged32 (32 lengths in 1..32768, a table of 31824
# positions) 360.7 µs with the cheapest plan's 2 splits, 264.2 with the 6 this rule picks; the
# full 32 x 32768 432.7 with 2, 431.6 with this rule's 8 (benchmarks/NOTES.md, "Splits for
# ragged batches").
_NEAR_COST = 0.03
_SHORT_SPLIT_TOKENS = 4096

if _ffi.built_with_cuda():
    jax.ffi.register_ffi_target(DECODE_TARGET, _ffi.decode_registrations()["CUDA"],
                                platform="CUDA")

decode_p = Primitive("nvfp4_paged_attention")
decode_p.multiple_results = True


def _bind_under_jit(*args, **params):
    return decode_p.bind(*args, **params)


decode_p.def_impl(jax.jit(_bind_under_jit, static_argnames=("layout", "v_scale_swizzle", "impl")))


@decode_p.def_abstract_eval
def _abstract_eval(q, kv_cache, block_tables, seq_lens, k_scale, v_scale, sm_scale, *, layout,
                   v_scale_swizzle, impl):
    del kv_cache, block_tables, seq_lens, k_scale, v_scale, sm_scale, layout, v_scale_swizzle
    del impl
    out = jax.core.ShapedArray(q.shape, q.dtype)
    lse = jax.core.ShapedArray(q.shape[:-1], jnp.float32)
    return out, lse


def bind(q, kv_cache, block_tables, seq_lens, k_scale, v_scale, sm_scale, *, layout,
         v_scale_swizzle, impl):
    """One (validated) call in the form users have: q ``[batch, Hq, D]``, one layer's cache,
    block_tables ``[batch, M]``, seq_lens ``[batch]``, scalar scales. Returns ``(out, lse)``."""
    lead = lambda x: jnp.reshape(x, (1,) + tuple(x.shape))  # noqa: E731
    out, lse = decode_p.bind(
        lead(q), lead(kv_cache), lead(checks.to_int32(block_tables)),
        lead(checks.to_int32(seq_lens)), *(jnp.reshape(jnp.asarray(s, jnp.float32), (1,))
                                            for s in (k_scale, v_scale, sm_scale)),
        layout=layout, v_scale_swizzle=bool(v_scale_swizzle), impl=impl)
    return out[0], lse[0]


# ---------------------------------------------------------------------------------------------
# The jnp path on the canonical form (CPU, and GPU shapes the kernel does not cover).


def stacked_jnp(one, args):
    """``one`` (the jnp path of one member: operands without the stacked axes -> ``(out,
    lse)``) over a canonical form's stacked axes (q ``[*S, rows, Hq, D]``), one ``vmap`` per
    axis: along each, operands with ``S_i`` rows are mapped, those with one are shared. Both
    attention primitives' jnp paths."""
    if args[0].ndim == 3:
        return one(*args)
    stacked = args[0].shape[0]
    if stacked == 1:
        out, lse = stacked_jnp(one, [a[0] for a in args])
        return out[None], lse[None]
    in_axes = tuple(0 if a.shape[0] == stacked else None for a in args)
    args = tuple(a if axis == 0 else a[0] for a, axis in zip(args, in_axes))
    return jax.vmap(lambda *a: stacked_jnp(one, a), in_axes=in_axes)(*args)


def on_one_stacked_axis(kernel_call, num_static=2):
    """``kernel_call`` (an attention kernel's FFI call on the canonical form with one stacked
    axis, ``(*operands, *static) -> (out, lse)``, the last ``num_static`` arguments static:
    ``layout, v_scale_swizzle`` and the primitive's own) for any number of stacked axes: they
    are flattened into one (q and the cache row-major: a reshape, no copy; an operand shared
    along some stacked axes but not all is broadcast, it is small) and the results
    unflattened."""

    def call(*args):
        operands, params = args[:-num_static], args[-num_static:]
        n = operands[0].ndim - 3
        if n == 1:
            return kernel_call(*args)
        stacked = operands[0].shape[:n]

        def flat(x):
            if all(d == 1 for d in x.shape[:n]):
                return x.reshape((1,) + x.shape[n:])
            x = jnp.broadcast_to(x, stacked + x.shape[n:])
            return x.reshape((-1,) + x.shape[n:])

        out, lse = kernel_call(*(flat(x) for x in operands), *params)
        return out.reshape(stacked + out.shape[1:]), lse.reshape(stacked + lse.shape[1:])

    return call


def _jnp_canonical(*args, layout, v_scale_swizzle):
    def one(q, kv_cache, block_tables, seq_lens, k_scale, v_scale, sm_scale):
        return _reference.paged_attention(q, kv_cache, block_tables, seq_lens, k_scale, v_scale,
                                          layout=layout, v_scale_swizzle=v_scale_swizzle,
                                          sm_scale=sm_scale, return_lse=True)

    return stacked_jnp(one, args)


def lowerings(op_name, canonical_jnp, kernel_call, partition,
              static=("layout", "v_scale_swizzle")):
    """The two lowering rules of an attention primitive whose operands start with q (head size
    last) and whose parameters are ``impl`` and the ``static`` ones (``layout,
    v_scale_swizzle`` and the primitive's own): the jnp path (``canonical_jnp(*operands,
    **static)``), and on CUDA the kernel (``partition(kernel_call)(*operands, *static)``,
    ``kernel_call`` on one stacked axis: :func:`on_one_stacked_axis`) for the head sizes it
    covers, the jnp path for the others. ``impl="kernel"`` makes a missing kernel an error
    naming ``op_name``. Returns ``(jnp_lowering, cuda_lowering)``."""

    flat_call = on_one_stacked_axis(kernel_call, len(static))

    def jnp_lowering(ctx, *args, impl, **params):
        if impl == "kernel":
            raise ValueError(
                f"{op_name}(impl='kernel') needs the CUDA kernel on a GPU; this computation "
                "runs on a platform without it. Use impl='auto' (the kernel where it exists, the "
                "jnp path elsewhere) or impl='jnp'.")
        fun = functools.partial(canonical_jnp, **params)
        return mlir.lower_fun(fun, multiple_results=True)(ctx, *args)

    def cuda_lowering(ctx, *args, impl, **params):
        head_size = ctx.avals_in[0].shape[-1]
        if not kernel_supports(head_size):
            if impl == "kernel":
                raise ValueError(
                    f"{op_name}(impl='kernel'): the CUDA kernel covers head sizes "
                    f"{KERNEL_HEAD_SIZES}" + ("" if _ffi.built_with_cuda() else
                                              " and jax_nvfp4 was built without it")
                    + f", got head_size {head_size}; use impl='auto' or impl='jnp'")
            return jnp_lowering(ctx, *args, impl="auto", **params)
        values = tuple(params[name] for name in static)
        fun = lambda *a: partition(flat_call)(*a, *values)  # noqa: E731
        return mlir.lower_fun(fun, multiple_results=True)(ctx, *args)

    return jnp_lowering, cuda_lowering


# ---------------------------------------------------------------------------------------------
# The CUDA kernel.


def kernel_supports(head_size: int) -> bool:
    """Whether the CUDA kernel covers this geometry (every layout, block size and GQA group)."""
    return _ffi.built_with_cuda() and head_size in KERNEL_HEAD_SIZES


def _sm_count() -> int:
    try:
        return int(getattr(jax.devices("gpu")[0], "core_count", 0)) or 132
    except RuntimeError:
        return 132


def resident_ctas(ask: str, head_size: int, default: int) -> int:
    """CTAs of a kernel per SM on this GPU for a head size, asked of the CUDA runtime through
    the extension's function ``ask`` (registers and shared memory decide); ``default`` where
    it cannot be asked (no CUDA build, no GPU) or answers 0."""
    try:
        return int(getattr(_ffi, ask)(head_size)) or default
    except (AttributeError, RuntimeError):
        return default


def _resident_ctas(head_size: int) -> int:
    """The decode kernel's CTAs per SM on this GPU."""
    return resident_ctas("decode_resident_ctas_per_sm", head_size, _DEFAULT_CTAS_PER_SM)


def _cluster_merge_splits(head_size: int) -> int:
    """Most splits the decode kernel merges inside one thread-block cluster on this GPU (0:
    none, the merge kernel merges them; also where it cannot be asked: no CUDA build, no
    GPU; and under the developers' switch ``JAX_NVFP4_CLUSTER_MERGE=0``, which
    tests/gpu_checks.sh sets for memcheck's decode group and for the store and rest groups
    under every tool: compute-sanitizer crashed under the cluster launches, TESTING.md)."""
    if os.environ.get("JAX_NVFP4_CLUSTER_MERGE") == "0":
        return 0
    return resident_ctas("decode_cluster_merge_splits", head_size, 0)


def decode_units(stacked: int, batch: int, num_kv_heads: int, num_q_heads: int) -> int:
    """The decode kernel's CTAs per split: one per (stacked member, sequence, kv head, group of
    up to 8 query heads)."""
    return stacked * batch * num_kv_heads * -(-(num_q_heads // num_kv_heads) // 8)


def plan_splits(stacked: int, batch: int, num_kv_heads: int, num_q_heads: int,
                max_tokens: int, sm_count: int, ctas_per_sm: int = _DEFAULT_CTAS_PER_SM,
                cluster_splits: int = 0) -> tuple[int, int]:
    """Split-KV plan: ``(num_splits, tokens_per_split)``.

    One CTA attends for one (stacked member, sequence, kv head, group of up to 8 query heads)
    over ``tokens_per_split`` positions (a multiple of 128); :func:`plan_splits_for_units` picks
    the number of splits. Up to ``cluster_splits`` splits (the GPU's
    ``_ffi.decode_cluster_merge_splits``) run as one thread-block cluster and merge through
    its shared memory, with no merge kernel. The plan depends only on static shapes, so a
    jitted step compiles once; a short sequence skips the splits past its length.
    """
    units = decode_units(stacked, batch, num_kv_heads, num_q_heads)
    return plan_splits_for_units(units, max_tokens, sm_count, ctas_per_sm, _TOKENS_PER_CTA_STEP,
                                 merge_rows=stacked * batch * num_q_heads,
                                 cluster_splits=cluster_splits,
                                 short_splits_from=_SHORT_SPLIT_TOKENS)


def plan_splits_for_units(units: int, max_tokens: int, sm_count: int, ctas_per_sm: int,
                          step: int, *, merge_rows: int,
                          cluster_splits: int = 0,
                          short_splits_from: int = 0) -> tuple[int, int]:
    """The split-KV plan of ``units`` CTAs' worth of work over up to ``max_tokens`` positions
    each: ``(num_splits, tokens_per_split)``, ``tokens_per_split`` a multiple of ``step``.

    Picks the number of splits that minimises the modelled time: whole waves of ``sm_count *
    ctas_per_sm`` CTAs, each as long as its split plus a start cost, plus the merge when there
    are several splits. This fills the GPU at batch 1 and long context as at large batch and
    short context, and avoids a nearly empty last wave. The merge costs a wave per
    ``sm_count * 16`` of its ``merge_rows`` output rows (a block per row whose dependent loads
    take about as long whatever it merges): many rows (a ragged call's prefill chunks) split
    only where the splits gain more than that; where :func:`merges_in_cluster` says so, the
    splits merge inside their cluster instead, for a small fixed cost. At most one split per
    256 positions, and at most 256 splits.

    With ``short_splits_from`` > 0, of the plans whose cost is within ``_NEAR_COST`` (3%) of
    the least, the one with the most splits of at least ``short_splits_from`` positions each
    (if it has more than the cheapest): the model assumes full-length sequences, and in a
    ragged batch shorter splits shorten the longest CTA, which a ragged batch waits for.
    """
    slots = max(sm_count * ctas_per_sm, 1)
    max_tokens = max(max_tokens, 1)
    merge = _MERGE_COST * max(-(-merge_rows // max(sm_count * _MERGE_ROWS_PER_SM, 1)), 1)
    plans = []
    for wanted in range(1, max(1, min(_MAX_SPLITS, -(-max_tokens // _MIN_TOKENS_PER_SPLIT))) + 1):
        splits, per_split = split_evenly(max_tokens, wanted, step)
        waves = -(-(units * splits) // slots)
        if splits == 1:
            merged = 0
        elif merges_in_cluster(units, splits, sm_count, cluster_splits):
            merged = _CLUSTER_MERGE_COST
        else:
            merged = merge
        plans.append((waves * (per_split + _CTA_START_COST) + merged, splits, per_split))
    best = min(plans, key=lambda plan: plan[0])  # the first of equal costs: the fewest splits
    if short_splits_from > 0:
        near = [plan for plan in plans if plan[0] <= best[0] * (1 + _NEAR_COST)
                and plan[2] >= short_splits_from and plan[1] > best[1]]
        best = max(near, key=lambda plan: plan[1], default=best)
    return best[1], best[2]


def split_evenly(max_tokens: int, wanted: int, step: int) -> tuple[int, int]:
    """``max_tokens`` positions (at least 1) cut into about ``wanted`` splits: ``(num_splits,
    tokens_per_split)``, each split a multiple of ``step`` and none past the end (so
    ``num_splits`` may come out below ``wanted``)."""
    per_split = -(-max(max_tokens, 1) // wanted)
    per_split = -(-per_split // step) * step
    return -(-max(max_tokens, 1) // per_split), per_split


def merges_in_cluster(units: int, splits: int, sm_count: int, cluster_splits: int) -> bool:
    """Whether the decode kernel's ``splits`` splits of ``units`` CTAs each merge inside their
    thread-block cluster (no merge kernel): 2 to ``cluster_splits`` splits (what the GPU
    places in a cluster, 0 for none), and only where there is at most one CTA per SM
    (``units * splits <= sm_count``). Measured on an H200 (ncu, 2026-12-01): at 1 x 4096 (128
    CTAs in clusters of 16) the cluster launch took 16.5 µs against 14.3 + 5.9 for the
    kernel and its merge kernel; at 8 x 4096 (384 CTAs in clusters of 6, up to 3 per SM) it
    took 45.4 µs against 28.7 + 5.4: clusters that must share SMs are placed worse."""
    return 1 < splits <= cluster_splits and units * splits <= max(sm_count, 1)


def decode_plan(stacked: int, batch: int, num_kv_heads: int, num_q_heads: int, head_size: int,
                max_tokens: int) -> tuple[int, int, bool]:
    """The decode kernel's plan on this GPU: ``(num_splits, tokens_per_split, cluster_merge)``
    (:func:`plan_splits` with the GPU's SM count, occupancy and cluster limit; whether the
    splits merge in a cluster, :func:`merges_in_cluster`). The decode reader's launch, and the
    ragged reader's for its one-token sequences, so that those are the same computation."""
    sm_count, ctas_per_sm = _sm_count(), _resident_ctas(head_size)
    cluster_splits = _cluster_merge_splits(head_size)
    splits, per_split = plan_splits(stacked, batch, num_kv_heads, num_q_heads, max_tokens,
                                    sm_count, ctas_per_sm, cluster_splits)
    cluster_merge = merges_in_cluster(decode_units(stacked, batch, num_kv_heads, num_q_heads),
                                      splits, sm_count, cluster_splits)
    return splits, per_split, cluster_merge


def split_kv_results(q, splits, cluster_merge=False):
    """The results of an attention kernel's FFI call for q ``[L, rows, Hq, D]``: out, lse, and
    the split-KV workspace (partial outputs and log2 lse, float32; no rows with one split,
    which writes the output directly, nor when the splits merge in a cluster)."""
    partial = splits if splits > 1 and not cluster_merge else 0
    rows = q.shape[:3]
    return (jax.ShapeDtypeStruct(q.shape, q.dtype), jax.ShapeDtypeStruct(rows, jnp.float32),
            jax.ShapeDtypeStruct(rows + (partial, q.shape[3]), jnp.float32),
            jax.ShapeDtypeStruct(rows + (partial,), jnp.float32))


def _kernel_call(q, kv_cache, block_tables, seq_lens, k_scale, v_scale, sm_scale, layout,
                 v_scale_swizzle):
    """The FFI call on whatever (per-device) shapes it gets."""
    geo = _layout.CacheGeometry.from_shape(kv_cache.shape[1:], layout)
    stacked, batch, num_q_heads, head_size = q.shape
    max_tokens = block_tables.shape[2] * geo.block_size
    splits, tokens_per_split, cluster_merge = decode_plan(stacked, batch, geo.num_kv_heads,
                                                         num_q_heads, head_size, max_tokens)
    call = jax.ffi.ffi_call(DECODE_TARGET,
                            split_kv_results(q, splits, cluster_merge))
    # The kernel applies the readers' invalid-scale rule itself (checks.nan_if_invalid).
    out, lse, *_ = call(q, kv_cache, block_tables, seq_lens, k_scale, v_scale, sm_scale,
                        layout=np.int32(_layout.LAYOUTS.index(layout)),
                        v_scale_swizzle=bool(v_scale_swizzle), num_splits=np.int32(splits),
                        tokens_per_split=np.int32(tokens_per_split),
                        cluster_merge=cluster_merge)
    return out, lse


_jnp_lowering, _cuda_lowering = lowerings("paged_attention", _jnp_canonical, _kernel_call,
                                          lambda body: partitioned(body))


mlir.register_lowering(decode_p, _jnp_lowering)
mlir.register_lowering(decode_p, _cuda_lowering, platform="cuda")
require_devices_during_lowering(decode_p)


def _jvp(primals, tangents, **params):
    raise TypeError(
        "jax_nvfp4.paged_attention over an NVFP4 cache is not differentiable (the cache is "
        "quantised); apply jax.lax.stop_gradient to q and the scales, or differentiate "
        "through paged_attention_bf16.")


ad.primitive_jvps[decode_p] = _jvp


# ---------------------------------------------------------------------------------------------
# vmap: one launch for all members.


_NOT_MAPPED = None  # what vmap passes as the batch dimension of an unbatched argument


def members_first(x, d, size):
    """``x`` with vmap's member axis ``d`` first: ``[V, ...]`` (broadcast when shared)."""
    if d is _NOT_MAPPED:
        return jnp.broadcast_to(x, (size,) + x.shape)
    return jnp.moveaxis(x, d, 0)


def empty_batch(q, dims):
    """The batching rules' answer for a vmap over zero members: empty results, no launch."""
    member = q.shape if dims[0] is _NOT_MAPPED else q.shape[:dims[0]] + q.shape[dims[0] + 1:]
    return ((jnp.zeros((0,) + member, q.dtype), jnp.zeros((0,) + member[:-1], jnp.float32)),
            (0, 0))


def num_stacked(q, dims) -> int:
    """Stacked axes of an attention primitive's call before this vmap (q ``[*S, rows, Hq,
    D]``, plus the member axis when q is batched)."""
    return q.ndim - 3 - (dims[0] is not _NOT_MAPPED)


def bind_members_stacked(primitive, args, dims, size, **params):
    """An attention primitive over vmap's ``size`` members, which become one more stacked axis
    of the canonical form: where the cache has them when that is among its stacked axes or
    just after them (no byte of the cache moves), else first (a transpose). q and the cache
    are broadcast where shared; every other operand shared by the members gets a size-1 axis
    there (shared along it). One launch. Returns the batching rule's ``((out, lse), (at,
    at))``."""
    n = num_stacked(args[0], dims)
    at = dims[1] if dims[1] is not _NOT_MAPPED and dims[1] <= n else 0

    def put(x, d, shareable):
        if d is _NOT_MAPPED:
            if shareable:
                return jnp.expand_dims(x, at)
            x, d = jnp.broadcast_to(x, (size,) + x.shape), 0
        return jnp.moveaxis(x, d, at)

    out, lse = primitive.bind(*(put(x, d, shareable=i >= 2)
                                for i, (x, d) in enumerate(zip(args, dims))), **params)
    return (out, lse), (at, at)


def _batch(args, dims, *, layout, v_scale_swizzle, impl):
    """vmap over layers or head groups, nested or not: the members become one more stacked
    axis (one launch; :func:`bind_members_stacked`).

    A batched cache keeps its members where they are when that is among its stacked axes
    (or just after them), else they are moved first (a transpose); q, block tables, lengths
    and scales follow it (broadcast where shared; tables, lengths and scales stay shared
    along the new axis when no member differs). A cache shared by all members is not copied:
    the members become more sequences of the batch, which needs the scales to be shared too
    (otherwise the cache is broadcast, one copy per member).
    """
    q, kv_cache, block_tables, seq_lens, k_scale, v_scale, sm_scale = args
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not _NOT_MAPPED)
    n = num_stacked(q, dims)
    if size == 0:
        return empty_batch(q, dims)
    params = dict(layout=layout, v_scale_swizzle=v_scale_swizzle, impl=impl)

    scales_batched = any(d is not _NOT_MAPPED for d in dims[4:])
    if dims[1] is _NOT_MAPPED and not scales_batched:
        # Fold the members into the batch axis: [V, *S, B, ...] -> [*S, V*B, ...].
        def into_batch(x, d):
            x = jnp.moveaxis(members_first(x, d, size), 0, n)  # [*S (or ones), V, B, ...]
            return x.reshape(x.shape[:n] + (x.shape[n] * x.shape[n + 1],) + x.shape[n + 2:])

        batch = q.shape[-3]
        q2, tables2, lens2 = (into_batch(x, d) for x, d in
                              ((q, dims[0]), (block_tables, dims[2]), (seq_lens, dims[3])))
        out, lse = decode_p.bind(q2, kv_cache, tables2, lens2, k_scale, v_scale, sm_scale,
                                 **params)
        unfold = lambda x: jnp.moveaxis(  # noqa: E731
            x.reshape(x.shape[:n] + (size, batch) + x.shape[n + 1:]), n, 0)
        return (unfold(out), unfold(lse)), (0, 0)

    return bind_members_stacked(decode_p, args, dims, size, **params)


batching.primitive_batchers[decode_p] = _batch


# ---------------------------------------------------------------------------------------------
# Partitioning: the stacked axis and the batch axis split, everything else is replicated.

_SPLITTABLE = ("stack", "batch")


def stacked_factors(q_shape, shape, name):
    """Factor names of an operand's leading stacked axes: ``stack{i}`` where it has q's
    ``S_i`` rows, ``{name}{i}`` (replicated) where it has one, shared."""
    n = len(q_shape) - 3
    return tuple(f"stack{i}" if shape[i] == q_shape[i] else f"{name}{i}" for i in range(n))


def _factors(layout: str, shapes):
    """Factor names of every axis of the seven operands and two results."""
    q, cache, tables, lens, k_scale, v_scale, sm_scale = (tuple(s) for s in shapes)
    lead = functools.partial(stacked_factors, q)
    stack = lead(q, "")
    cache_axes = stack + tuple("c_" + a for a in _layout.CACHE_AXES[layout][:])
    operands = (stack + ("batch", "q_heads", "head_size"), cache_axes,
                lead(tables, "t_one") + ("batch", "pages"), lead(lens, "l_one") + ("batch",),
                lead(k_scale, "k_one"), lead(v_scale, "v_one"), lead(sm_scale, "s_one"))
    return operands, (operands[0], operands[0][:-1]), _partitioning.replicated_factors(operands, _SPLITTABLE)


def _sharding_rule(layout, v_scale_swizzle, mesh, operand_types, result_types):
    del v_scale_swizzle, mesh, result_types
    operands, results, replicated = _factors(layout, [tuple(t.shape) for t in operand_types])
    return rule_text(operands, results), {"need_replication_factors": replicated}


def rule_text(operands, results) -> str:
    """A Shardy sharding rule's text from the factor names of every operand and result."""
    return (", ".join(" ".join(op) for op in operands) + " -> "
            + ", ".join(" ".join(r) for r in results))


def stacked_shardings(shapes, cache_sharding):
    """The mesh axes of each stacked axis as the cache has them (never move the cache):
    ``{"stack{i}": axes}``."""
    n = len(shapes[0]) - 3
    entries = _partitioning.spec_entries(cache_sharding, len(shapes[1]))[:n]
    return {f"stack{i}": _partitioning.mesh_axes(e) for i, e in enumerate(entries)}


def _plan(layout, shapes, q_sharding, cache_sharding):
    """Specs of the operands and results: the stacked axes as the cache has them, the batch
    axis as q has it, everything else replicated."""
    operands, results, _ = _factors(layout, shapes)
    kept = stacked_shardings(shapes, cache_sharding)
    n = len(shapes[0]) - 3
    batch = _partitioning.mesh_axes(_partitioning.spec_entries(q_sharding, len(shapes[0]))[n])
    if set(batch) & {a for axes in kept.values() for a in axes}:
        batch = ()
    kept["batch"] = batch
    return ([_partitioning.specs_of(kept, op) for op in operands],
            [_partitioning.specs_of(kept, r) for r in results])


def _infer_sharding_from_operands(layout, v_scale_swizzle, mesh, arg_shapes, result_shape):
    del v_scale_swizzle, result_shape
    _, results = _plan(layout, [a.shape for a in arg_shapes], arg_shapes[0].sharding,
                       arg_shapes[1].sharding)
    return tuple(NamedSharding(mesh, s) for s in results)


def _propagate_user_sharding(layout, v_scale_swizzle, mesh, user_shape):
    del layout, v_scale_swizzle
    out = user_shape[0]
    entries = _partitioning.spec_entries(out.sharding, len(out.shape))
    keep = PartitionSpec(*entries[:-2], None, None)  # the stacked axes and the batch axis
    return (NamedSharding(mesh, keep), NamedSharding(mesh, PartitionSpec(*keep[:-1])))


@functools.lru_cache(maxsize=None)
def partitioned(body):
    """``body(q, kv_cache, block_tables, seq_lens, k_scale, v_scale, sm_scale, layout,
    v_scale_swizzle) -> (out, lse)`` (the kernel call, on per-device shapes) under custom
    partitioning: each device runs it on its own stacked members and sequences. (Only the
    kernel call can be wrapped: custom_partitioning refuses a body with constants, such as the
    jnp path's tables.)"""

    def partition(layout, v_scale_swizzle, mesh, arg_shapes, result_shape):
        del result_shape
        operands, results = _plan(layout, [a.shape for a in arg_shapes],
                                  arg_shapes[0].sharding, arg_shapes[1].sharding)
        return (mesh, lambda *a: body(*a, layout, v_scale_swizzle),
                tuple(NamedSharding(mesh, s) for s in results),
                tuple(NamedSharding(mesh, s) for s in operands))

    wrapped = custom_partitioning(body, static_argnums=(7, 8))
    wrapped.def_partition(partition=partition,
                          infer_sharding_from_operands=_infer_sharding_from_operands,
                          propagate_user_sharding=_propagate_user_sharding,
                          sharding_rule=_sharding_rule)
    return wrapped


__all__ = ["DECODE_TARGET", "IMPLS", "KERNEL_HEAD_SIZES", "bind", "decode_p", "kernel_supports",
           "bind_members_stacked", "empty_batch", "lowerings", "members_first", "num_stacked",
           "decode_plan", "decode_units", "merges_in_cluster",
           "on_one_stacked_axis", "plan_splits", "plan_splits_for_units", "resident_ctas",
           "rule_text", "split_kv_results", "stacked_factors", "stacked_jnp",
           "stacked_shardings"]
