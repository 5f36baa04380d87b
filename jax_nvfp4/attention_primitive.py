"""Decode attention over an NVFP4 cache as a JAX primitive: abstract evaluation, lowering per
platform, batching and partitioning rules, side by side.

``decode_p`` works on one canonical form with a leading stacked axis ``L`` (layers or head
groups; ``L = 1`` for a plain call):

* q ``[L, batch, num_q_heads, head_size]``, kv_cache ``[L, num_blocks, 2, ...]`` (uint8),
* block_tables ``[1 or L, batch, max_blocks_per_seq]`` and seq_lens ``[1 or L, batch]`` (int32),
* k_scale, v_scale, sm_scale: float32 ``[1 or L]``,

and returns ``(out [L, batch, num_q_heads, head_size] in q's dtype, lse [L, batch, num_q_heads]
float32)``. ``jax.vmap`` over layers or groups therefore stays one primitive, hence one launch.

Lowering: on CUDA, the fused kernel (``ffi/decode_cuda.cu``) behind the XLA FFI target
``jax_nvfp4_paged_attention`` for head sizes 64, 128 and 256 (other head sizes use the jnp path,
or raise with ``impl="kernel"``); on every other platform the jnp path
(:func:`jax_nvfp4.reference.paged_attention`). Under a multi-device ``jit`` the kernel call is
wrapped in custom partitioning: the stacked axis (the cache's axis 0) and the batch axis split
with no communication, every other axis is replicated. The cache is only read: no alias, no
donation needed.
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
    lse = jax.core.ShapedArray(q.shape[:3], jnp.float32)
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
    """``one`` (the jnp path of one member: operands without the stacked axis -> ``(out,
    lse)``) over a canonical form's stacked axis ``L``: operands with ``L`` leading rows are
    mapped, those with one row are shared. Both attention primitives' jnp paths."""
    stacked = args[0].shape[0]
    if stacked == 1:
        out, lse = one(*(a[0] for a in args))
        return out[None], lse[None]
    in_axes = tuple(0 if a.shape[0] == stacked else None for a in args)
    args = tuple(a if axis == 0 else a[0] for a, axis in zip(args, in_axes))
    return jax.vmap(one, in_axes=in_axes)(*args)


def _jnp_canonical(*args, layout, v_scale_swizzle):
    def one(q, kv_cache, block_tables, seq_lens, k_scale, v_scale, sm_scale):
        return _reference.paged_attention(q, kv_cache, block_tables, seq_lens, k_scale, v_scale,
                                          layout=layout, v_scale_swizzle=v_scale_swizzle,
                                          sm_scale=sm_scale, return_lse=True)

    return stacked_jnp(one, args)


def lowerings(op_name, canonical_jnp, kernel_call, partition):
    """The two lowering rules of an attention primitive whose operands start with q (head size
    last) and whose parameters are ``layout, v_scale_swizzle, impl``: the jnp path
    (``canonical_jnp(*operands, layout=, v_scale_swizzle=)``), and on CUDA the kernel
    (``partition(kernel_call)(*operands, layout, v_scale_swizzle)``) for the head sizes it covers,
    the jnp path for the others. ``impl="kernel"`` makes a missing kernel an error naming
    ``op_name``. Returns ``(jnp_lowering, cuda_lowering)``."""

    def jnp_lowering(ctx, *args, layout, v_scale_swizzle, impl):
        if impl == "kernel":
            raise ValueError(
                f"{op_name}(impl='kernel') needs the CUDA kernel on a GPU; this computation "
                "runs on a platform without it. Use impl='auto' (the kernel where it exists, the "
                "jnp path elsewhere) or impl='jnp'.")
        fun = functools.partial(canonical_jnp, layout=layout, v_scale_swizzle=v_scale_swizzle)
        return mlir.lower_fun(fun, multiple_results=True)(ctx, *args)

    def cuda_lowering(ctx, *args, layout, v_scale_swizzle, impl):
        head_size = ctx.avals_in[0].shape[-1]
        if not kernel_supports(head_size):
            if impl == "kernel":
                raise ValueError(
                    f"{op_name}(impl='kernel'): the CUDA kernel covers head sizes "
                    f"{KERNEL_HEAD_SIZES}" + ("" if _ffi.built_with_cuda() else
                                              " and jax_nvfp4 was built without it")
                    + f", got head_size {head_size}; use impl='auto' or impl='jnp'")
            return jnp_lowering(ctx, *args, layout=layout, v_scale_swizzle=v_scale_swizzle,
                                impl="auto")
        fun = lambda *a: partition(kernel_call)(*a, layout, v_scale_swizzle)  # noqa: E731
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


def _resident_ctas(head_size: int) -> int:
    """CTAs of the kernel per SM on this GPU (asked of the CUDA runtime: registers decide)."""
    try:
        return int(_ffi.decode_resident_ctas_per_sm(head_size)) or _DEFAULT_CTAS_PER_SM
    except (AttributeError, RuntimeError):
        return _DEFAULT_CTAS_PER_SM


def plan_splits(stacked: int, batch: int, num_kv_heads: int, num_q_heads: int,
                max_tokens: int, sm_count: int,
                ctas_per_sm: int = _DEFAULT_CTAS_PER_SM) -> tuple[int, int]:
    """Split-KV plan: ``(num_splits, tokens_per_split)``.

    One CTA attends for one (stacked member, sequence, kv head, group of up to 8 query heads)
    over ``tokens_per_split`` positions (a multiple of 128); :func:`plan_splits_for_units` picks
    the number of splits. The plan depends only on static shapes, so a jitted step compiles
    once; a short sequence skips the splits past its length.
    """
    group = num_q_heads // num_kv_heads
    units = stacked * batch * num_kv_heads * -(-group // 8)
    return plan_splits_for_units(units, max_tokens, sm_count, ctas_per_sm, _TOKENS_PER_CTA_STEP,
                                 merge_rows=stacked * batch * num_q_heads)


def plan_splits_for_units(units: int, max_tokens: int, sm_count: int, ctas_per_sm: int,
                          step: int, *, merge_rows: int) -> tuple[int, int]:
    """The split-KV plan of ``units`` CTAs' worth of work over up to ``max_tokens`` positions
    each: ``(num_splits, tokens_per_split)``, ``tokens_per_split`` a multiple of ``step``.

    Picks the number of splits that minimises the modelled time: whole waves of ``sm_count *
    ctas_per_sm`` CTAs, each as long as its split plus a start cost, plus the merge when there
    are several splits. This fills the GPU at batch 1 and long context as at large batch and
    short context, and avoids a nearly empty last wave. The merge costs a wave per
    ``sm_count * 16`` of its ``merge_rows`` output rows (a block per row whose dependent loads
    take about as long whatever it merges): many rows (a ragged call's prefill chunks) split
    only where the splits gain more than that. At most one split per 256 positions, and at
    most 256 splits.
    """
    slots = max(sm_count * ctas_per_sm, 1)
    max_tokens = max(max_tokens, 1)
    merge = _MERGE_COST * max(-(-merge_rows // max(sm_count * _MERGE_ROWS_PER_SM, 1)), 1)
    best = None
    for wanted in range(1, max(1, min(_MAX_SPLITS, -(-max_tokens // _MIN_TOKENS_PER_SPLIT))) + 1):
        per_split = -(-max_tokens // wanted)
        per_split = -(-per_split // step) * step
        splits = -(-max_tokens // per_split)
        waves = -(-(units * splits) // slots)
        cost = waves * (per_split + _CTA_START_COST) + (merge if splits > 1 else 0)
        if best is None or cost < best[0]:
            best = (cost, splits, per_split)
    return best[1], best[2]


def split_kv_results(q, splits):
    """The results of an attention kernel's FFI call for q ``[L, rows, Hq, D]``: out, lse, and
    the split-KV workspace (partial outputs and log2 lse, float32; no rows with one split,
    which writes the output directly)."""
    partial = splits if splits > 1 else 0
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
    splits, tokens_per_split = plan_splits(stacked, batch, geo.num_kv_heads, num_q_heads,
                                           max_tokens, _sm_count(), _resident_ctas(head_size))
    call = jax.ffi.ffi_call(DECODE_TARGET, split_kv_results(q, splits))
    out, lse, _, _ = call(q, kv_cache, block_tables, seq_lens, k_scale, v_scale, sm_scale,
                          layout=np.int32(_layout.LAYOUTS.index(layout)),
                          v_scale_swizzle=bool(v_scale_swizzle), num_splits=np.int32(splits),
                          tokens_per_split=np.int32(tokens_per_split))
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
    return ((jnp.zeros((0,) + member, q.dtype), jnp.zeros((0,) + member[:3], jnp.float32)),
            (0, 0))


def bind_members_stacked(primitive, args, dims, size, stacked, **params):
    """An attention primitive over vmap's ``size`` members, which join the canonical form's
    stacked axis: ``[V, L, ...] -> [V*L, ...]`` for q and the cache (broadcast where shared),
    and for every other operand unless one row serves every member and layer. One launch.
    Returns the batching rule's ``((out, lse), (0, 0))``."""

    def join(x, d, shareable):
        if shareable and d is _NOT_MAPPED and x.shape[0] == 1:
            return x                                        # shared by every member and layer
        x = members_first(x, d, size)
        if x.shape[1] != stacked:                           # [V, 1, ...] shared by the layers
            x = jnp.broadcast_to(x, (size, stacked) + x.shape[2:])
        return x.reshape((size * stacked,) + x.shape[2:])

    joined = [join(x, d, shareable=i >= 2) for i, (x, d) in enumerate(zip(args, dims))]
    out, lse = primitive.bind(*joined, **params)
    return (out.reshape((size, stacked) + out.shape[1:]),
            lse.reshape((size, stacked) + lse.shape[1:])), (0, 0)


def _batch(args, dims, *, layout, v_scale_swizzle, impl):
    """vmap over layers or head groups: the members join the stacked axis (one launch).

    A batched cache (members along its axis ``d``, moved to the front: free for ``d = 0``, a
    transpose otherwise) joins ``L``; q, block tables, lengths and scales follow it (broadcast
    where shared; tables, lengths and scales stay shared when no member differs). A cache
    shared by all members is not copied: the members become more sequences of the batch, which
    needs the scales to be shared too (otherwise the cache is broadcast, one copy per member).
    """
    q, kv_cache, block_tables, seq_lens, k_scale, v_scale, sm_scale = args
    size = next(a.shape[d] for a, d in zip(args, dims) if d is not _NOT_MAPPED)
    # L of the unbatched canonical form: q's first axis other than the member axis.
    stacked = q.shape[1 if dims[0] == 0 else 0]
    if size == 0:
        return empty_batch(q, dims)
    params = dict(layout=layout, v_scale_swizzle=v_scale_swizzle, impl=impl)

    scales_batched = any(d is not _NOT_MAPPED for d in dims[4:])
    if dims[1] is _NOT_MAPPED and not scales_batched:
        # Fold the members into the batch axis: [V, L, B, ...] -> [L, V*B, ...].
        def into_batch(x, d):
            x = jnp.moveaxis(members_first(x, d, size), 0, 1)  # [L (or 1), V, B, ...]
            return x.reshape((x.shape[0], x.shape[1] * x.shape[2]) + x.shape[3:])

        batch = q.shape[-3]
        q2, tables2, lens2 = (into_batch(x, d) for x, d in
                              ((q, dims[0]), (block_tables, dims[2]), (seq_lens, dims[3])))
        out, lse = decode_p.bind(q2, kv_cache, tables2, lens2, k_scale, v_scale, sm_scale,
                                 **params)
        out = jnp.moveaxis(out.reshape((stacked, size, batch) + out.shape[2:]), 1, 0)
        lse = jnp.moveaxis(lse.reshape((stacked, size, batch) + lse.shape[2:]), 1, 0)
        return (out, lse), (0, 0)

    # Members join the stacked axis: [V, L, ...] -> [V*L, ...].
    return bind_members_stacked(decode_p, args, dims, size, stacked, **params)


batching.primitive_batchers[decode_p] = _batch


# ---------------------------------------------------------------------------------------------
# Partitioning: the stacked axis and the batch axis split, everything else is replicated.

_SPLITTABLE = ("stack", "batch")


def _factors(layout: str, shapes):
    """Factor names of every axis of the seven operands and two results."""
    q, cache, tables, lens, k_scale, v_scale, sm_scale = (tuple(s) for s in shapes)
    stacked = q[0]

    def lead(shape, name):
        return "stack" if shape[0] == stacked else name

    cache_axes = ("stack",) + tuple("c_" + a for a in _layout.CACHE_AXES[layout][:])
    operands = (("stack", "batch", "q_heads", "head_size"), cache_axes,
                (lead(tables, "t_one"), "batch", "pages"), (lead(lens, "l_one"), "batch"),
                (lead(k_scale, "k_one"),), (lead(v_scale, "v_one"),), (lead(sm_scale, "s_one"),))
    return operands, (operands[0], operands[0][:3]), replicated_factors(operands, _SPLITTABLE)


def replicated_factors(operands, splittable):
    """The factors of ``operands`` (in order of first use: Shardy wants them sorted) that must
    be replicated: all but ``splittable``."""
    used = dict.fromkeys(f for op in operands for f in op)
    return tuple(f for f in used if f not in splittable)


def _sharding_rule(layout, v_scale_swizzle, mesh, operand_types, result_types):
    del v_scale_swizzle, mesh, result_types
    operands, results, replicated = _factors(layout, [tuple(t.shape) for t in operand_types])
    return rule_text(operands, results), {"need_replication_factors": replicated}


def rule_text(operands, results) -> str:
    """A Shardy sharding rule's text from the factor names of every operand and result."""
    return (", ".join(" ".join(op) for op in operands) + " -> "
            + ", ".join(" ".join(r) for r in results))


def _plan(layout, shapes, q_sharding, cache_sharding):
    """Specs of the operands and results: the stacked axis as the cache has it (never move the
    cache), the batch axis as q has it, everything else replicated."""
    operands, results, _ = _factors(layout, shapes)
    stack = _partitioning.mesh_axes(
        _partitioning.spec_entries(cache_sharding, len(shapes[1]))[0])
    batch = _partitioning.mesh_axes(_partitioning.spec_entries(q_sharding, len(shapes[0]))[1])
    if set(stack) & set(batch):
        batch = ()
    kept = {"stack": stack, "batch": batch}

    def spec(names):
        return PartitionSpec(*(_partitioning.spec_entry(kept.get(f, ())) for f in names))

    return [spec(op) for op in operands], [spec(r) for r in results]


def _infer_sharding_from_operands(layout, v_scale_swizzle, mesh, arg_shapes, result_shape):
    del v_scale_swizzle, result_shape
    _, results = _plan(layout, [a.shape for a in arg_shapes], arg_shapes[0].sharding,
                       arg_shapes[1].sharding)
    return tuple(NamedSharding(mesh, s) for s in results)


def _propagate_user_sharding(layout, v_scale_swizzle, mesh, user_shape):
    del layout, v_scale_swizzle
    out = user_shape[0]
    entries = _partitioning.spec_entries(out.sharding, len(out.shape))
    keep = PartitionSpec(entries[0], entries[1], None, None)
    return (NamedSharding(mesh, keep), NamedSharding(mesh, PartitionSpec(*keep[:3])))


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
           "bind_members_stacked", "empty_batch", "lowerings", "members_first", "plan_splits",
           "plan_splits_for_units", "replicated_factors", "rule_text", "split_kv_results",
           "stacked_jnp"]
