"""The fused CUDA decode-attention kernel (``paged_attention(impl="kernel"/"auto")``, primitive
``nvfp4_paged_attention`` in jax_nvfp4/attention_primitive.py) against the jnp path and dense
float64 attention.

CPU part (runs everywhere): on the CPU ``impl="auto"`` is the jnp path, bit for bit (outputs and
lse); ``return_lse`` against a float64 logsumexp; ``impl="kernel"`` refuses to lower; option
errors; the batching rule (vmap over stacked layers, over q only, lax.scan) against loops; the
grouped reader's lse; the split-KV plan ``plan_splits``.

GPU part (``@pytest.mark.gpu``, on ``jax.devices("gpu")[0]``): caches are built on the CPU with
the store (tests/attention_cases.py ``Case``: random K/V, random pages, junk with NaN in every
row nobody attends to) and ``jax.device_put``; the kernel is compared with the jnp path run on
the CPU on the same cache (``roundings=2``: both outputs rounded to q's dtype) and with the
float64 reference over the dequantised pages (``roundings=1``).

Multi-device part (GPUs when there are enough, else the virtual CPU devices): grouped tensor
parallel and batch-sharded decode equal one device, with no collective and no copy of the cache,
under Shardy and GSPMD.

Kernel bounds (chosen from the kernel's design, q and P rounded to fp16, K/V exact in fp16,
float32 sums; then checked against the H200 run below):

* out, per sequence b: ``|out - ref| <= KERNEL_REL * max|ref[b]| + roundings * u * |ref|``
  elementwise (u: unit roundoff of q's dtype, the output's rounding), and relative L2 of the
  sequence's output ``< KERNEL_L2 + roundings * u``; a sequence with nothing to attend to is
  exactly 0.
* lse: ``|lse - ref| <= KERNEL_LSE_ABS`` plus, for a float32 q, the largest score change that
  rounding q to fp16 can make (``q_rounding_bound``: 2^-11 * sm_scale * max_t sum |q||k_t|);
  ``-inf`` exactly where nothing is attended to.

A model of the kernel's arithmetic (the jnp path with q rounded to fp16 after a power-of-two
scale per head and P rounded to fp16 in P.V, run in place of the kernel over the GPU tests of
this file on the CPU) gave: out excess <= 7.9e-4 of the sequence max, relative L2 <= 6.9e-4
(float32 q; 2.2e-3 for bf16 q vs float64, the output's own rounding), lse up to 1.8e-3 for
float32 q (<= 0.18 of the tolerance above; 2e-3 alone would have left a margin of 10%), ~0 for
bf16/fp16 q.
* the jnp path on the GPU (head sizes the kernel does not cover) vs on the CPU: ``JNP_GPU_REL``
  and ``JNP_GPU_LSE_ABS`` (float32 arithmetic in another order).

Measured on an NVIDIA H200 (jax 0.11.2, 2026-11-30, every GPU test of this file, 265 passed
together with test_attention/test_attention_sharding/test_vmap_scan/test_store): kernel vs the
CPU jnp path, out excess over the output rounding <= 7.9e-4 of the sequence max (float32 q;
1.3e-4 bf16/fp16), relative L2 <= 1.4e-3 (bf16 q), 7.2e-4 (float32), 3.1e-4 (fp16); lse
<= 2.9e-6 (bf16/fp16 q) and 1.6e-3 for float32 q (0.15 of its tolerance); kernel vs kernel
(vmap, loops) bit-identical; the jnp path on the GPU vs the CPU: out 1.3e-7, lse 9.5e-7. The
bounds keep a margin of 5x (out) and 1.4x (L2, bf16 q, which includes the output's rounding).

To measure them: ``JAX_NVFP4_BOUNDS_REPORT=errors.json pytest -q -s tests/test_decode_kernel.py``
writes the largest error of every kind and q dtype the assertions saw (failing ones included).

CPU bounds (measured on jax 0.10.2 CPU): lse of the jnp path vs float64 <= 1.3e-6 over the
``CPU_CASES`` and <= 2.4e-6 over 18 probe cases (block sizes 4/12/16, head sizes 64-256, three q
dtypes, both layouts; |lse| <= 7.4); asserted ``F32_LSE_ABS = 2e-5``. vmap / scan / sharded vs
loop / one device were bit-identical on the CPU; asserted to ``F32_CLOSE`` of the row maximum.
"""

from __future__ import annotations

import functools
import itertools
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

import jax_nvfp4 as nv
from jax_nvfp4 import attention_primitive as ap
from jax_nvfp4 import layout as nv_layout
from jax_nvfp4 import sharding as shd

import hlo_checks as hc
from attention_cases import Case, paged_attention_jit
from meshes import make_mesh

# --------------------------------------------------------------------------------- bounds

#: Kernel vs reference, elementwise, fraction of the sequence's max|ref| (measured 7.9e-4).
KERNEL_REL = 4e-3
#: Kernel vs reference, relative L2 of one sequence's output (measured 1.4e-3 with bf16 q).
KERNEL_L2 = 2e-3
#: Kernel lse vs reference lse, absolute (natural log; measured 2.9e-6), plus for a float32 q the
#: largest score change rounding q to fp16 can make (``q_rounding_bound``).
KERNEL_LSE_ABS = 2e-3
#: The jnp path on a GPU vs on the CPU (measured 1.3e-7 / 1.0e-7 / 9.5e-7): elementwise / L2 / lse.
JNP_GPU_REL = 2e-5
JNP_GPU_LSE_ABS = 2e-5
#: CPU: jnp-path lse vs float64 logsumexp (measured <= 2.4e-6).
F32_LSE_ABS = 2e-5
#: CPU: results that differ at most by float32 rounding (measured: identical).
F32_CLOSE = 1e-6
#: Unit roundoff of each output dtype (the output is the float32 result rounded once).
UNIT_ROUNDOFF = {"bfloat16": 2.0 ** -8, "float16": 2.0 ** -11, "float32": 2.0 ** -24}
FP16_UNIT = 2.0 ** -11

TARGET = f'custom_call_target="{ap.DECODE_TARGET}"'
LAYOUTS = ("HND", "NHD")
CPU = jax.devices("cpu")[0]

# Measuring the bounds: with JAX_NVFP4_BOUNDS_REPORT=<path>, the largest error of every kind
# seen by the assertions below (recorded before asserting, so failures are measured too) is
# written to <path> as JSON when the module finishes (and printed; see it with -s).
_MEASURED: dict[str, float] = {}


def _measure(label, kind, dtype, value):
    if label is not None:
        key = f"{label}/{kind}/{np.dtype(dtype).name}"
        _MEASURED[key] = max(_MEASURED.get(key, 0.0), float(value))


@pytest.fixture(autouse=True, scope="module")
def _report_measured_bounds():
    yield
    path = os.environ.get("JAX_NVFP4_BOUNDS_REPORT")
    if path and _MEASURED:
        with open(path, "w") as f:
            json.dump(dict(sorted(_MEASURED.items())), f, indent=1)
        print("\nmeasured errors:", json.dumps(dict(sorted(_MEASURED.items())), indent=1))


def _f64(x):
    return np.asarray(np.asarray(x).astype(np.float32), np.float64)


def assert_out_close(out, ref, dtype, *, roundings, rel=KERNEL_REL, l2=KERNEL_L2, label=None):
    """Per sequence b: |out - ref| <= rel * max|ref[b]| + roundings * u * |ref| and relative
    L2 < l2 + roundings * u; a sequence whose reference is 0 (nothing attended) is exactly 0.
    ``label``: record the errors (excess over the rounding term / max|ref[b]|, relative L2)."""
    out, ref = _f64(out), _f64(ref)
    assert out.shape == ref.shape, (out.shape, ref.shape)
    assert np.isfinite(out).all(), "non-finite output"
    u = roundings * UNIT_ROUNDOFF[np.dtype(dtype).name]
    checks = []
    for b in range(len(ref)):
        scale = np.abs(ref[b]).max()
        if scale == 0:
            np.testing.assert_array_equal(out[b], 0.0, err_msg=f"sequence {b}")
            continue
        err = np.abs(out[b] - ref[b])
        excess = (err - u * np.abs(ref[b])).max() / scale
        rel_l2 = np.linalg.norm(out[b] - ref[b]) / np.linalg.norm(ref[b])
        _measure(label, "out_excess_rel", dtype, excess)
        _measure(label, "out_rel_l2", dtype, rel_l2)
        checks.append((b, excess, rel_l2, err.max(), scale))
    for b, excess, rel_l2, err, scale in checks:
        assert excess <= rel, f"sequence {b}: excess {excess:.3g} (max err {err:.3g}, " \
                              f"max|ref| {scale:.3g})"
        assert rel_l2 < l2 + u, f"sequence {b}: relative L2 {rel_l2:.3g}"


def assert_lse_close(lse, ref, tol, *, label=None, dtype=None):
    """-inf at the same places; elsewhere finite and within tol (absolute; scalar or array
    like ref)."""
    lse, ref = np.asarray(lse, np.float64), np.asarray(ref, np.float64)
    assert lse.shape == ref.shape, (lse.shape, ref.shape)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(ref))
    finite = np.isfinite(ref)
    assert np.isfinite(lse[finite]).all()
    err = np.abs(lse - np.where(finite, ref, 0.0))[finite]
    tol = np.broadcast_to(np.asarray(tol, np.float64), ref.shape)[finite]
    if err.size:
        _measure(label, "lse_abs", dtype, err.max())
        _measure(label, "lse_abs_over_tol", dtype, (err / tol).max())
    assert (err <= tol).all(), f"lse error {err.max():.3g}, worst excess {(err - tol).max():.3g}"


def q_rounding_bound(case, q, sm_scale=None):
    """[batch, num_q_heads]: the largest change of a score that rounding q to fp16 can make,
    2^-11 * sm_scale * max_t sum_d |q_d| |k_td| over every token t of the case; 0 for a bf16 or
    fp16 q (exact in fp16 after the kernel's power-of-two scale)."""
    if np.dtype(q.dtype) != np.float32:
        return np.zeros(q.shape[:2])
    qa = np.abs(_f64(q))
    batch, heads, head_size = qa.shape
    ks = np.abs(np.concatenate([k for k in case.k if len(k)]))        # [N, kv heads, D]
    kv = ks.shape[1]
    qa = qa.reshape(batch, kv, heads // kv, head_size)
    top = np.stack([(qa[:, h] @ ks[:, h].T).max(axis=-1) for h in range(kv)], axis=1)
    sm = 1.0 / math.sqrt(head_size) if sm_scale is None else sm_scale
    return FP16_UNIT * sm * top.reshape(batch, heads)


def kernel_lse_tol(case, q, sm_scale=None):
    return KERNEL_LSE_ABS + q_rounding_bound(case, q, sm_scale)


def assert_rows_close(a, b, tol=F32_CLOSE):
    """Equal up to float32 rounding: |a - b| <= tol * max|b| (-inf where b is)."""
    a, b = _f64(a), _f64(b)
    assert a.shape == b.shape
    np.testing.assert_array_equal(np.isneginf(a), np.isneginf(b))
    finite = np.isfinite(b)
    scale = max(np.abs(b[finite]).max(initial=0.0), 1.0)
    np.testing.assert_allclose(a[finite], b[finite], rtol=0, atol=tol * scale)


def _lens(bs, long=40):
    """Ragged: 1, bs - 1, exact page multiples, several pages, one longer, and 0 and negative
    (nothing to attend to)."""
    return (1, bs - 1, bs, 4 * bs, 5 * bs + 3, long, 0, -3)


def _primitive_eqns(jaxpr):
    """Every nvfp4_paged_attention equation, sub-jaxprs (jit, scan, vmap) included."""
    found = []
    for eqn in jaxpr.eqns:
        if eqn.primitive is ap.decode_p:
            found.append(eqn)
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    found += _primitive_eqns(inner)
    return found


# =============================================================================== CPU

# (layout, block_size, head_size, num_kv_heads, GQA ratio, q dtype, v_scale_swizzle)
CPU_CASES = [
    ("HND", 16, 128, 2, 4, jnp.bfloat16, True),
    ("NHD", 12, 64, 2, 3, jnp.float16, False),
    ("HND", 4, 64, 1, 1, jnp.float32, False),
    ("NHD", 16, 128, 1, 8, jnp.float32, True),
]
CPU_IDS = [f"{c[0]}-bs{c[1]}-d{c[2]}-r{c[4]}-{np.dtype(c[5]).name}" for c in CPU_CASES]


@functools.lru_cache(maxsize=None)
def _cpu_case(index):
    """(case, q, auto (out, lse), jnp (out, lse), jnp out without lse), computed once."""
    layout, bs, head_size, kv, ratio, dtype, swizzle = CPU_CASES[index]
    with jax.default_device(CPU):
        case = Case(seed=500 + index, lens=_lens(bs), num_kv_heads=kv, head_size=head_size,
                    layout=layout, v_scale_swizzle=swizzle, block_size=bs)
        q = case.query(kv * ratio, dtype, seed=index)
        auto = jax.device_get(case.run(q, return_lse=True, impl="auto"))
        ref = jax.device_get(case.run(q, return_lse=True, impl="jnp"))
        plain = np.asarray(case.run(q, impl="jnp"))
    return case, q, auto, ref, plain


@pytest.mark.parametrize("index", range(len(CPU_CASES)), ids=CPU_IDS)
def test_cpu_auto_is_jnp_path_bit_for_bit(index):
    """On the CPU impl="auto" is the jnp path: identical outputs and lse."""
    case, q, (out, lse), (ref_out, ref_lse), plain = _cpu_case(index)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert lse.dtype == np.float32 and lse.shape == q.shape[:2]
    np.testing.assert_array_equal(out, ref_out)
    np.testing.assert_array_equal(lse, ref_lse)
    np.testing.assert_array_equal(plain, ref_out)     # return_lse=False: the same output


@pytest.mark.parametrize("index", range(len(CPU_CASES)), ids=CPU_IDS)
def test_cpu_lse_matches_float64_logsumexp(index):
    """return_lse: natural-log logsumexp of sm_scale * q.k over the attended positions."""
    case, q, (out, lse), _, _ = _cpu_case(index)
    ref_out, ref_lse = case.reference(q, return_lse=True)
    assert_lse_close(lse, ref_lse, F32_LSE_ABS, label="jnp_cpu~f64", dtype=q.dtype)
    assert np.isfinite(ref_lse).sum() > 0
    assert_out_close(out, ref_out, q.dtype, roundings=1, rel=4e-6, l2=2e-6, label="jnp_cpu~f64")


@pytest.mark.parametrize("index", range(len(CPU_CASES)), ids=CPU_IDS)
def test_cpu_seq_len_zero_gives_zeros_and_minus_inf(index):
    """seq_len 0 (and negative) rows: output exactly 0, lse -inf; the other rows finite."""
    case, q, (out, lse), _, _ = _cpu_case(index)
    empty = np.asarray(case.lens) <= 0
    assert empty.sum() == 2
    np.testing.assert_array_equal(_f64(out[empty]), 0.0)
    assert np.isneginf(lse[empty]).all()
    assert np.isfinite(lse[~empty]).all() and np.isfinite(_f64(out)).all()


def test_cpu_sm_scale_in_lse():
    """A custom sm_scale scales the scores the lse sums (auto == jnp, both vs float64)."""
    case, q, *_ = _cpu_case(0)
    auto = case.run(q, sm_scale=0.3, return_lse=True, impl="auto")
    ref = case.run(q, sm_scale=0.3, return_lse=True, impl="jnp")
    for a, r in zip(auto, ref):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(r))
    assert_lse_close(auto[1], case.reference(q, sm_scale=0.3, return_lse=True)[1], F32_LSE_ABS)


def _small_case(layout="HND", seed=0):
    with jax.default_device(CPU):
        case = Case(seed=seed, lens=_lens(16), layout=layout)
        return case, case.query(8, jnp.bfloat16)


def test_cpu_impl_kernel_refused_when_lowering():
    """impl="kernel" traces (eval_shape) but refuses to lower for the CPU, naming impl='kernel'."""
    case, q = _small_case()
    args = jax.device_put(case.args(q), CPU)
    fn = functools.partial(nv.paged_attention, impl="kernel", return_lse=True)
    out, lse = jax.eval_shape(fn, *args)
    assert out.shape == q.shape and lse.shape == q.shape[:2]
    with pytest.raises(ValueError, match="impl='kernel'"):
        jax.jit(fn).lower(*args)
    with pytest.raises(ValueError, match="impl='kernel'"):
        fn(*args)                                          # eager: jitted, so lowered too
    grouped = functools.partial(shd.paged_attention_grouped, impl="kernel")
    gcache = jnp.stack([case.cache, case.cache])           # 2 groups of 2 kv heads
    gq = jnp.concatenate([q, q], axis=1)
    with pytest.raises(ValueError, match="impl='kernel'"):
        jax.jit(grouped).lower(gq, gcache, *args[2:])


@pytest.mark.parametrize("fn", [nv.paged_attention, shd.paged_attention_grouped],
                         ids=["plain", "grouped"])
@pytest.mark.parametrize("change,error,match", [
    (dict(impl="cuda"), ValueError, "impl"),
    (dict(impl=None), ValueError, "impl"),
    (dict(impl="Kernel"), ValueError, "impl"),
    (dict(return_lse=1), TypeError, "return_lse"),
    (dict(return_lse="yes"), TypeError, "return_lse"),
    (dict(return_lse=None), TypeError, "return_lse"),
])
def test_option_errors_at_trace_time(fn, change, error, match):
    """A bad impl or a non-bool return_lse raises when traced (eval_shape), naming it."""
    case, q = _small_case()
    args = case.args(q)
    if fn is shd.paged_attention_grouped:
        args = (jnp.concatenate([q, q], axis=1), jnp.stack([case.cache, case.cache])) + args[2:]
    with pytest.raises(error, match=match):
        jax.eval_shape(functools.partial(fn, **change), *args)
    with pytest.raises(error, match=match):
        fn(*args, **change)


# ------------------------------------------------------------------------ vmap and scan

LAYERS = 3


@functools.lru_cache(maxsize=None)
def _layers(shared_tables):
    """LAYERS cases of equal shapes; with shared_tables, the same page assignment."""
    with jax.default_device(CPU):
        return tuple(Case(seed=600 + l, lens=_lens(16), page_seed=77 if shared_tables else None)
                     for l in range(LAYERS))


def _stacked(shared_tables, shared_scales, q_dtype=jnp.float32):
    cases = _layers(shared_tables)
    with jax.default_device(CPU):
        q = jnp.stack([c.query(8, q_dtype, seed=l) for l, c in enumerate(cases)])
        cache = jnp.stack([c.cache for c in cases])
        tables = jnp.asarray(np.stack([c.tables for c in cases]))
        lens = jnp.asarray(np.stack([c.lens for c in cases]), jnp.int32)
        ks = jnp.stack([c.k_scale for c in cases])
        vs = jnp.stack([c.v_scale for c in cases])
    if shared_tables:
        assert all((c.tables == cases[0].tables).all() for c in cases)
        tables, lens = tables[0], lens[0]
    if shared_scales:
        ks, vs = ks[0], vs[0]
    axes = (0, 0, None if shared_tables else 0, None if shared_tables else 0,
            None if shared_scales else 0, None if shared_scales else 0)
    return (q, cache, tables, lens, ks, vs), axes


def _member(args, axes, l):
    return tuple(a if ax is None else a[l] for a, ax in zip(args, axes))


def _loop(fn, args, axes, count):
    results = [jax.device_get(fn(*_member(args, axes, l))) for l in range(count)]
    return tuple(np.stack(r) for r in zip(*results))


def _check_layers_against_jnp(out, lse, ref, cases, args, dtype):
    """Every layer's kernel output and lse against the jnp path's (ref = (outs, lses))."""
    for l, case in enumerate(cases):
        assert_out_close(out[l], ref[0][l], dtype, roundings=2, label="kernel~jnp")
        assert_lse_close(lse[l], ref[1][l], kernel_lse_tol(case, args[0][l]),
                         label="kernel~jnp", dtype=dtype)


STACKED_VARIANTS = [(True, False), (False, False), (False, True)]
STACKED_IDS = ["tables_shared-scales_per_layer", "tables_per_layer-scales_per_layer",
               "tables_per_layer-scales_shared"]


@pytest.mark.parametrize("shared_tables,shared_scales", STACKED_VARIANTS, ids=STACKED_IDS)
def test_cpu_vmap_over_layers_equals_loop(shared_tables, shared_scales):
    """vmap over a stacked [L, ...] cache: one primitive on the [L, ...] cache, = a loop."""
    args, axes = _stacked(shared_tables, shared_scales)
    one = functools.partial(nv.paged_attention, return_lse=True)
    batched = jax.vmap(one, in_axes=axes)
    eqns = _primitive_eqns(jax.make_jaxpr(batched)(*args).jaxpr)
    assert len(eqns) == 1, eqns
    # The members are one more stacked axis of the canonical form, next to the plain call's
    # size-1 one: the cache itself, no reshape or copy of it.
    assert eqns[0].invars[1].aval.shape == (LAYERS, 1) + args[1].shape[1:]
    out, lse = jax.jit(batched)(*args)
    loop_out, loop_lse = _loop(jax.jit(one), args, axes, LAYERS)
    assert_rows_close(out, loop_out)
    assert_rows_close(lse, loop_lse)
    assert np.isneginf(np.asarray(lse)).any()       # the seq_len 0 rows went through too


# (q, tables+lens, scales) batched: the shared cache is folded into the batch unless the scales
# are per member (then it is broadcast).
Q_ONLY_VARIANTS = [(0, None, None), (0, 0, None), (0, None, 0)]


@pytest.mark.parametrize("q_axis,tables_axis,scales_axis", Q_ONLY_VARIANTS,
                         ids=["q", "q+tables", "q+scales"])
def test_cpu_vmap_over_q_with_shared_cache_equals_loop(q_axis, tables_axis, scales_axis):
    """vmap over q (members) with one shared cache: one primitive; members folded into the
    batch (cache not broadcast) when the scales are shared; = a loop."""
    case, q = _small_case(seed=3)
    members = 3
    rng = np.random.default_rng(9)
    with jax.default_device(CPU):
        qs = jnp.asarray(rng.standard_normal((members,) + q.shape), jnp.float32)
        # Member m: its rows rolled by m (other sequences per row), shorter lengths.
        tables = jnp.asarray(np.stack([np.roll(case.tables, m, axis=0) for m in range(members)]))
        lens = jnp.asarray(np.stack([np.roll(np.minimum(case.lens, m * 30 + 5), m)
                                     for m in range(members)]), jnp.int32)
        scales = jnp.stack([case.k_scale * (1 + m / 4) for m in range(members)])
    args = (qs, case.cache, tables if tables_axis == 0 else tables[0],
            lens if tables_axis == 0 else lens[0],
            scales if scales_axis == 0 else case.k_scale,
            scales if scales_axis == 0 else case.v_scale)
    axes = (q_axis, None, tables_axis, tables_axis, scales_axis, scales_axis)
    one = functools.partial(nv.paged_attention, return_lse=True)
    batched = jax.vmap(one, in_axes=axes)
    eqns = _primitive_eqns(jax.make_jaxpr(batched)(*args).jaxpr)
    assert len(eqns) == 1, eqns
    cache_shape = eqns[0].invars[1].aval.shape
    if scales_axis is None:     # folded: the cache as it is, the members in the batch axis
        assert cache_shape == (1,) + case.cache.shape
        assert eqns[0].invars[0].aval.shape == (1, members * q.shape[0]) + q.shape[1:]
    out, lse = jax.jit(batched)(*args)
    loop_out, loop_lse = _loop(jax.jit(one), args, axes, members)
    assert_rows_close(out, loop_out)
    assert_rows_close(lse, loop_lse)


def test_cpu_scan_over_layers_equals_loop():
    """lax.scan over layers (cache, q and scales per layer, tables shared) = a loop."""
    args, axes = _stacked(True, False)
    q, cache, tables, lens, ks, vs = args

    def step(q, cache, ks, vs):
        def body(carry, x):
            q_l, cache_l, k_l, v_l = x
            return carry, nv.paged_attention(q_l, cache_l, tables, lens, k_l, v_l,
                                              return_lse=True)
        return jax.lax.scan(body, 0, (q, cache, ks, vs))[1]

    out, lse = jax.jit(step)(q, cache, ks, vs)
    one = functools.partial(nv.paged_attention, return_lse=True)
    loop_out, loop_lse = _loop(jax.jit(one), args, axes, LAYERS)
    assert_rows_close(out, loop_out)
    assert_rows_close(lse, loop_lse)


@pytest.mark.parametrize("layout,groups", [("HND", 2), ("NHD", 4)])
def test_cpu_grouped_return_lse_equals_plain(layout, groups):
    """paged_attention_grouped(return_lse=True) = paged_attention on the plain cache holding
    the same K/V (outputs and lse, heads in order)."""
    with jax.default_device(CPU):
        case = Case(seed=700 + groups, lens=_lens(16), num_kv_heads=4, layout=layout,
                    groups=groups)
        q = case.query(16, jnp.float32)
    grouped = jax.jit(functools.partial(shd.paged_attention_grouped, layout=layout,
                                        return_lse=True))
    out, lse = grouped(*case.args(q, cache=case.grouped))
    ref_out, ref_lse = case.run(q, return_lse=True)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref_out))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(ref_lse))
    plain = jax.jit(functools.partial(shd.paged_attention_grouped, layout=layout))(
        *case.args(q, cache=case.grouped))
    np.testing.assert_array_equal(np.asarray(plain), np.asarray(out))
    assert_lse_close(lse, case.reference(q, return_lse=True)[1], F32_LSE_ABS)


# ------------------------------------------------------------------------- plan_splits

#: The benchmark's shapes: (batch, context), 8 kv / 32 q heads, page 16, 132 SMs x 3 CTAs
#: (H200, head size 128) = 396 slots, with the plans of the cost model (whole waves of
#: split + 128 positions, + 256 per wave of 2112 merged rows). By hand for three: (1, 131072):
#: 8 CTAs per split; 49 splits of ceil(131072/49) = 2675 -> 2688 positions fill one wave (392
#: CTAs), cost 2688 + 128 + 256 = 3072, while 64 splits of 2048 need two waves (cost 4608).
#: (128, 1024): 1024 CTAs already need 3 waves; splitting only adds waves: one split.
#: (128, 4096): 4096 rows to merge are two merge waves (512), so 3 splits (8 waves x 1536 +
#: 512 = 12800) lose to one (3 waves x 4224 = 12672). (32, 32768): 3 splits of 11008 cost
#: 2 x 11136 + 256 = 22528, the least; 6 splits of 5504 (4 waves of 1536 CTAs) 4 x 5632 + 256
#: = 22784, within 3% and of splits >= 4096 positions: the shorter splits are taken.
BENCHMARK_PLANS = {
    (1, 131072): (49, 2688),
    (8, 32768): (6, 5504),
    (32, 8192): (3, 2816),
    (32, 32768): (6, 5504),
    (128, 1024): (1, 1024),
    (128, 4096): (1, 4096),
}


def _check_plan(plan, max_tokens):
    splits, per_split = plan
    assert isinstance(splits, int) and isinstance(per_split, int), plan
    assert 1 <= splits <= 256, plan
    assert per_split > 0 and per_split % 128 == 0, plan
    assert splits * per_split >= max_tokens, plan             # the whole table is covered
    if max_tokens >= 1:
        assert (splits - 1) * per_split < max_tokens, plan    # no split starts past the end


@pytest.mark.parametrize("batch,context", sorted(BENCHMARK_PLANS))
def test_plan_splits_benchmark_shapes(batch, context):
    """The benchmark's shapes give the hand-derived plans."""
    max_tokens = math.ceil(context / 16) * 16
    plan = ap.plan_splits(1, batch, 8, 32, max_tokens, 132)
    _check_plan(plan, max_tokens)
    assert plan == BENCHMARK_PLANS[batch, context]


def test_plan_splits_properties():
    """Over a grid of shapes: a positive multiple of 128 per split, 1..256 splits covering the
    table with no empty split, at most one split per 256 positions (a table of <= 256 is not
    split); pure (same answer twice)."""
    heads = [(8, 32), (8, 8), (1, 16), (4, 12), (2, 32), (1, 1), (32, 32)]
    tokens = [0, 1, 4, 127, 128, 129, 511, 512, 513, 1000, 4096, 8192, 20032, 32768, 100032,
              131072, 10 ** 6]
    for stacked, batch, (kv, hq), max_tokens, sms in itertools.product(
            (1, 4, 32), (1, 2, 5, 8, 32, 128), heads, tokens, (1, 132, 144)):
        plan = ap.plan_splits(stacked, batch, kv, hq, max_tokens, sms)
        _check_plan(plan, max_tokens)
        assert plan == ap.plan_splits(stacked, batch, kv, hq, max_tokens, sms)
        assert plan[0] <= max(1, math.ceil(max_tokens / 256)), (max_tokens, plan)


def test_plan_splits_hand_checked():
    """A few plans by hand: empty and tiny tables, just over one split, one huge sequence."""
    assert ap.plan_splits(1, 1, 8, 32, 0, 132) == (1, 128)
    assert ap.plan_splits(1, 1, 8, 32, 1, 132) == (1, 128)
    # 512 positions, 8 CTAs a split: 1 split costs 512 + 128 = 640, 2 splits 256 + 128 + 256
    # = 640 too: the tie keeps one.
    assert ap.plan_splits(1, 1, 8, 32, 512, 132) == (1, 512)
    # 513: one split of 640 costs 768; three of 256 cost 256 + 128 + 256 = 640.
    assert ap.plan_splits(1, 1, 8, 32, 513, 132) == (3, 256)
    # 1 CTA of work, 10^6 positions: capped at 256 splits (one wave of 396 slots);
    # ceil(10^6/256) = 3907 -> 3968, ceil(10^6/3968) = 253 splits.
    assert ap.plan_splits(1, 1, 1, 1, 10 ** 6, 132) == (253, 3968)
    # Stacking members multiplies the work like the batch does.
    assert ap.plan_splits(4, 2, 8, 32, 32768, 132) == ap.plan_splits(1, 8, 8, 32, 32768, 132)


def test_plan_splits_prefers_short_splits_at_near_cost():
    """The decode plan takes more, shorter splits (>= 4096 positions each) where they cost
    within 3% of the cheapest plan, since a ragged batch waits for its longest CTA; the
    ragged kernels' plans (``plan_splits_for_units`` without ``short_splits_from``) keep the
    cheapest. H200 (132 SMs x 4 CTAs, head size 128), 256 CTAs a split: 32 x 32768 costs
    16384 + 128 + 256 = 16768 with 2 splits (one wave of 512 CTAs) and 4 x (4096 + 128) + 256
    = 17152 with 8 (+2.3%): 8 splits of 4096, measured even on the full batch. At 31824
    positions (the table of the benchmark's 32 lengths uniform in 1..32768) 8 splits cost 4.7%
    more: 6 of 5376 (3 x 5504 + 256 = 16768, +2.3%) are taken, measured 27% faster there than
    the cheapest plan's 2 (benchmarks/NOTES.md). At 32 x 8192 the cheapest, 2 splits of 4096, stays (4 splits of 2048 are too
    short, and measured 4% slower)."""
    assert ap.plan_splits(1, 32, 8, 32, 32768, 132, 4) == (8, 4096)
    assert ap.plan_splits(1, 32, 8, 32, 31824, 132, 4) == (6, 5376)
    assert ap.plan_splits(1, 32, 8, 32, 8192, 132, 4) == (2, 4096)
    units = ap.decode_units(1, 32, 8, 32)
    assert ap.plan_splits_for_units(units, 32768, 132, 4, 128, merge_rows=32 * 32) == (2, 16384)
    assert ap.plan_splits_for_units(units, 32768, 132, 4, 128, merge_rows=32 * 32,
                                    short_splits_from=4096) == (8, 4096)
    # Never more splits than positions allow, nor splits shorter than asked for.
    for max_tokens in (4096, 8191, 20000, 65536, 131072):
        for batch in (1, 8, 32, 64, 128):
            cheapest = ap.plan_splits_for_units(ap.decode_units(1, batch, 8, 32), max_tokens,
                                                132, 4, 128, merge_rows=batch * 32)
            splits, per_split = ap.plan_splits(1, batch, 8, 32, max_tokens, 132, 4)
            _check_plan((splits, per_split), max_tokens)
            assert (splits, per_split) == cheapest or (per_split >= 4096
                                                       and splits > cheapest[0])


def test_plan_splits_with_cluster_merges():
    """Splits that merge inside a cluster (at most one CTA per SM) cost 32 positions instead of
    the merge kernel's 256: 512 positions at batch 1 split in two with clusters (256 + 128 +
    32 = 416 against one split's 640) and not without (2 splits: 256 + 128 + 256 = 640, the
    tie keeps one); batch 1 x 4096 (8 CTAs a split) takes 16 splits of 256 either way (with
    clusters of 16 at 416, with the merge kernel at 640; 8 splits in clusters cost 512 + 128
    + 32 = 672)."""
    assert ap.plan_splits(1, 1, 8, 32, 512, 132, 3, cluster_splits=16) == (2, 256)
    assert ap.plan_splits(1, 1, 8, 32, 512, 132, 3) == (1, 512)
    assert ap.plan_splits(1, 1, 8, 32, 4096, 132, 3, cluster_splits=16) == (16, 256)
    assert ap.plan_splits(1, 1, 8, 32, 4096, 132, 3, cluster_splits=8) == (16, 256)
    assert ap.plan_splits(1, 1, 8, 32, 4096, 132, 3) == (16, 256)
    # 8 x 4096: 6 splits of 768 fill one wave (384 CTAs) either way.
    assert ap.plan_splits(1, 8, 8, 32, 4096, 132, 3, cluster_splits=16) == (6, 768)
    assert ap.merges_in_cluster(ap.decode_units(1, 1, 8, 32), 16, 132, 16)   # 128 CTAs
    assert not ap.merges_in_cluster(ap.decode_units(1, 8, 8, 32), 6, 132, 16)  # 384
    # Over several waves the merge kernel's term stays: the benchmark's plans are unchanged.
    for (batch, context), plan in BENCHMARK_PLANS.items():
        max_tokens = math.ceil(context / 16) * 16
        assert ap.plan_splits(1, batch, 8, 32, max_tokens, 132, 3, cluster_splits=16) == plan
    assert not ap.merges_in_cluster(ap.decode_units(1, 32, 8, 32), 3, 132, 16)
    assert not ap.merges_in_cluster(ap.decode_units(1, 1, 8, 32), 17, 132, 16)
    assert not ap.merges_in_cluster(ap.decode_units(1, 1, 8, 32), 4, 132, 0)


def test_split_kv_results_without_workspace_for_cluster_merges():
    q = jax.ShapeDtypeStruct((1, 3, 8, 64), jnp.bfloat16)
    out, lse, partial, partial_lse = ap.split_kv_results(q, 4, cluster_merge=True)
    assert partial.shape == (1, 3, 8, 0, 64) and partial_lse.shape == (1, 3, 8, 0)
    assert ap.split_kv_results(q, 4)[2].shape == (1, 3, 8, 4, 64)
    # The decode reader's call: out and lse first, then whatever workspace its plan needs.
    out, lse, *_ = ap.split_kv_results(q, 4, False)
    assert (out.shape, out.dtype, lse.shape) == ((1, 3, 8, 64), jnp.bfloat16, (1, 3, 8))


# ================================================================== multi-device (any)


# (The partitioner fixture, Shardy and GSPMD, is tests/conftest.py's.)


SHARDED_LENS = (1, 15, 16, 83, 40, 7, 100, 64)


def _sharded_run(fn, mesh, specs, args):
    placed = [jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs)]
    f = jax.jit(fn)
    hlo = f.lower(*placed).compile().as_text()
    out, lse = f(*placed)
    single = jax.jit(fn)(*jax.device_put(args, mesh.devices.flat[0]))   # same platform
    return (out, lse), jax.device_get(single), hlo


def _assert_sharded_close(result, single, mesh, dtype):
    (out, lse), (ref_out, ref_lse) = result, single
    if mesh.devices.flat[0].platform == "cpu":
        assert_rows_close(out, ref_out)
        assert_rows_close(lse, ref_lse)
    else:   # the kernel, with another split plan per device: kernel-level differences
        assert_out_close(out, ref_out, dtype, roundings=2, label="kernel~kernel")
        assert_lse_close(lse, ref_lse, KERNEL_LSE_ABS, label="kernel~kernel", dtype=dtype)


@pytest.mark.parametrize("count,layout", [(2, "HND"), (4, "NHD")])
def test_grouped_tensor_parallel_decode(partitioner, count, layout):
    """Grouped cache sharded on groups, q on heads, the rest replicated: = one device, output
    and lse sharded on heads, no collective and no copy of the cache."""
    mesh = make_mesh((count,), ("tp",))
    with jax.default_device(CPU):
        case = Case(seed=800 + count, lens=SHARDED_LENS, num_kv_heads=8, layout=layout,
                    groups=count)
        q = case.query(32, jnp.float32)
    args = case.args(q, cache=case.grouped)
    fn = functools.partial(shd.paged_attention_grouped, layout=layout, return_lse=True)
    specs = (P(None, "tp"), P("tp"), P(), P(), P(), P())
    result, single, hlo = _sharded_run(fn, mesh, specs, args)
    _assert_sharded_close(result, single, mesh, q.dtype)
    out, lse = result
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "tp")), 3)
    assert lse.sharding.is_equivalent_to(NamedSharding(mesh, P(None, "tp")), 2)
    assert hc.collectives(hlo) == [], hc.collectives(hlo)
    local = NamedSharding(mesh, P("tp")).shard_shape(case.grouped.shape)
    assert len(case.lens) * case.max_blocks != case.num_blocks   # a gather is not a copy
    assert hc.cache_copies(hlo, [case.grouped.shape, local]) == []


@pytest.mark.parametrize("count", [2, 4])
def test_batch_sharded_decode(partitioner, count):
    """q, block_tables and seq_lens sharded on batch, the cache replicated: = one device,
    output sharded on batch, no collective and no copy of the cache."""
    mesh = make_mesh((count,), ("dp",))
    with jax.default_device(CPU):
        case = Case(seed=900 + count, lens=SHARDED_LENS, num_kv_heads=2, layout="HND")
        q = case.query(8, jnp.bfloat16)
    args = case.args(q)
    fn = functools.partial(nv.paged_attention, return_lse=True)
    specs = (P("dp"), P(), P("dp"), P("dp"), P(), P())
    result, single, hlo = _sharded_run(fn, mesh, specs, args)
    _assert_sharded_close(result, single, mesh, q.dtype)
    out, lse = result
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, P("dp")), 3)
    assert hc.collectives(hlo) == [], hc.collectives(hlo)
    for b in (len(case.lens), len(case.lens) // count):          # a gather is not a copy
        assert b * case.max_blocks != case.num_blocks
    assert hc.cache_copies(hlo, [case.cache.shape]) == []


# =============================================================================== GPU


@pytest.fixture
def gpu():
    """The first GPU; arrays not put elsewhere stay on the CPU (cases are built there)."""
    device = jax.devices("gpu")[0]
    with jax.default_device(CPU):
        yield device


def _sm_count(device):
    return int(getattr(device, "core_count", 0) or 132)


def _kernel_and_jnp(case, q, gpu, *, tables=None, lens=None, cache=None, **kw):
    """(kernel on the GPU, jnp path on the CPU), each (out, lse) as numpy, same arguments."""
    args = case.args(q, tables, lens, cache)
    options = dict(case.options, return_lse=True, **kw)
    ref = jax.device_get(paged_attention_jit(*jax.device_put(args, CPU), impl="jnp", **options))
    got = jax.device_get(paged_attention_jit(*jax.device_put(args, gpu), impl="kernel",
                                             **options))
    return got, ref


def _check_kernel(case, q, got, ref, *, sm_scale=None, float64=True):
    """Kernel (out, lse) vs the jnp path (out, lse) and (float64=True) vs float64 over the
    dequantised pages of the case's own tables and lengths."""
    (out, lse), (ref_out, ref_lse) = got, ref
    assert out.dtype == q.dtype and out.shape == q.shape
    assert lse.dtype == np.float32 and lse.shape == q.shape[:2]
    tol = kernel_lse_tol(case, q, sm_scale)
    assert_out_close(out, ref_out, q.dtype, roundings=2, label="kernel~jnp")
    assert_lse_close(lse, ref_lse, tol, label="kernel~jnp", dtype=q.dtype)
    if float64:
        f64_out, f64_lse = case.reference(q, sm_scale=sm_scale, return_lse=True)
        assert_out_close(out, f64_out, q.dtype, roundings=1, label="kernel~f64")
        assert_lse_close(lse, f64_lse, tol, label="kernel~f64", dtype=q.dtype)


def _gpu_matrix():
    """Per layout, every (block size, head size) pair, with the GQA ratio, kv heads, q dtype,
    V scale layout and long length cycling so that every value meets both layouts (the cycles
    are shifted between layouts, so the combinations differ)."""
    ratios, kv_heads = (1, 3, 4, 8, 16), (1, 2, 4)
    dtypes = (jnp.bfloat16, jnp.float16, jnp.float32)
    cases = []
    for shift, layout in enumerate(LAYOUTS):
        for i, (bs, hs) in enumerate(itertools.product((4, 8, 12, 16, 32, 64), (64, 128, 256))):
            j = i + shift
            ratio, kv, dtype = ratios[j % 5], kv_heads[(j // 2) % 3], dtypes[(j + j // 3) % 3]
            swizzle, long = j % 4 < 2, (300, 1000)[j % 2]
            name = (f"{layout}-bs{bs}-d{hs}-r{ratio}-kv{kv}-{np.dtype(dtype).name}-"
                    f"{'swz' if swizzle else 'lin'}-L{long}")
            cases.append(pytest.param(layout, bs, hs, ratio, kv, dtype, swizzle, long, id=name))
    return cases


@pytest.mark.gpu
@pytest.mark.parametrize("layout,block_size,head_size,ratio,num_kv_heads,q_dtype,swizzle,long",
                         _gpu_matrix())
def test_gpu_kernel_matrix(gpu, layout, block_size, head_size, ratio, num_kv_heads, q_dtype,
                           swizzle, long):
    """Kernel vs jnp path (CPU) and float64, outputs and lse, ragged lengths incl. 0 and < 0."""
    case = Case(seed=1000 + 37 * block_size + head_size + (layout == "NHD"),
                lens=_lens(block_size, long), num_kv_heads=num_kv_heads, head_size=head_size,
                layout=layout, v_scale_swizzle=swizzle, block_size=block_size)
    q = case.query(num_kv_heads * ratio, q_dtype, seed=block_size)
    got, ref = _kernel_and_jnp(case, q, gpu)
    _check_kernel(case, q, got, ref)
    empty = np.asarray(case.lens) <= 0
    np.testing.assert_array_equal(_f64(got[0][empty]), 0.0)
    assert np.isneginf(got[1][empty]).all()


@pytest.mark.gpu
def test_gpu_sm_scale_and_return_lse_false(gpu):
    """A custom sm_scale (Python float) vs references; return_lse=False gives the same out."""
    case = Case(seed=1100, lens=_lens(16, 700), num_kv_heads=2)
    q = case.query(8, jnp.bfloat16)
    got, ref = _kernel_and_jnp(case, q, gpu, sm_scale=0.3)
    _check_kernel(case, q, got, ref, sm_scale=0.3)
    args = jax.device_put(case.args(q), gpu)
    plain = paged_attention_jit(*args, **case.options, sm_scale=0.3, impl="kernel")
    np.testing.assert_array_equal(np.asarray(plain), got[0])


@pytest.mark.gpu
@pytest.mark.parametrize("layout,q_dtype", [("HND", jnp.bfloat16), ("NHD", jnp.float32)])
def test_gpu_long_sequence_among_short(gpu, layout, q_dtype):
    """One 20000-token sequence among short ones: several splits, partial last splits."""
    lens = (1, 15, 20000, 16, 517, 1000, 0)
    case = Case(seed=1200 + (layout == "NHD"), lens=lens, num_kv_heads=2, layout=layout)
    splits, per_split = ap.plan_splits(1, len(lens), 2, 8, case.max_blocks * 16, _sm_count(gpu))
    assert splits > 1 and 20000 % per_split, (splits, per_split)   # the last split partial
    q = case.query(8, q_dtype)
    got, ref = _kernel_and_jnp(case, q, gpu)
    _check_kernel(case, q, got, ref)


@pytest.mark.gpu
def test_gpu_batch_one_100k_tokens(gpu):
    """Batch 1, 99997 tokens: many splits (and their merge)."""
    case = Case(seed=1300, lens=(99997,), num_kv_heads=2)
    splits, _ = ap.plan_splits(1, 1, 2, 8, case.max_blocks * 16, _sm_count(gpu))
    assert splits >= 64, splits
    q = case.query(8, jnp.bfloat16)
    got, ref = _kernel_and_jnp(case, q, gpu)
    _check_kernel(case, q, got, ref)


def _forced_plan(case, q, gpu, splits, cluster_merge, *, k_scale=None, v_scale=None):
    """The decode kernel's FFI call on the GPU with a given split count (ceil(capacity /
    splits) positions each, rounded up to 128) merged inside a cluster or by the merge kernel:
    (out, lse) as numpy. The plan of paged_attention picks one of these for the shape; this
    runs the others too."""
    q, cache, tables, lens, ks, vs = case.args(q)
    ks = ks if k_scale is None else jnp.float32(k_scale)
    vs = vs if v_scale is None else jnp.float32(v_scale)
    capacity = tables.shape[1] * case.block_size
    per_split = math.ceil(math.ceil(capacity / splits) / 128) * 128   # a multiple of 128
    assert math.ceil(capacity / per_split) == splits, (capacity, splits, per_split)
    lead = lambda x: jnp.reshape(jnp.asarray(x), (1,) + tuple(jnp.shape(x)))  # noqa: E731
    sm_scale = jnp.float32(1.0 / math.sqrt(case.head_size))
    args = [lead(x) for x in (q, cache, tables, lens)] + [
        jnp.reshape(s, (1,)) for s in (ks, vs, sm_scale)]
    call = jax.ffi.ffi_call(ap.DECODE_TARGET, ap.split_kv_results(args[0], splits, cluster_merge))
    fn = jax.jit(lambda *a: call(
        *a, layout=np.int32(nv_layout.LAYOUTS.index(case.layout)),
        v_scale_swizzle=bool(case.swizzle), num_splits=np.int32(splits),
        tokens_per_split=np.int32(per_split), cluster_merge=cluster_merge)[:2])
    out, lse = jax.device_get(fn(*jax.device_put(args, gpu)))
    return out[0], lse[0]


#: Sequences over `longest` positions (the table's capacity): long ones whose last split is
#: partial, short ones with every split but the first empty, and empty ones (length 0 and
#: negative).
def _split_lens(longest=2048):
    return (longest, 1, 15, 300, 517, longest - 49, 0, -3, 1024)


_SPLIT_LENS = _split_lens()


@pytest.mark.gpu
@pytest.mark.parametrize("splits,cluster_merge", [(2, True), (3, True), (6, True), (8, True),
                                                  (12, True), (16, True), (2, False),
                                                  (8, False), (16, False), (72, False)])
def test_gpu_split_merges(gpu, splits, cluster_merge):
    """Split counts the plan may give, merged inside a cluster (up to the GPU's largest
    cluster: 16 on an H200; 12 a non-portable size) and without one (72: a long sequence's
    plan, more splits than a cluster or a CTA merges): the same results as the jnp path and the
    float64 reference, zeros and lse -inf for empty sequences, and the merges bit for bit the
    same (the same sums in the same order)."""
    limit = ap._cluster_merge_splits(128)
    if cluster_merge and splits > limit:
        pytest.skip(f"this GPU merges at most {limit} splits in a cluster")
    # (12 splits of 256; 72 of 128)
    lens = _split_lens({12: 3072, 72: 72 * 128}.get(splits, 2048))
    case = Case(seed=1250 + splits, lens=lens, num_kv_heads=2, pad_columns=0)
    q = case.query(8, jnp.bfloat16)
    got = _forced_plan(case, q, gpu, splits, cluster_merge)
    ref = jax.device_get(paged_attention_jit(*jax.device_put(case.args(q), CPU), impl="jnp",
                                             **case.options, return_lse=True))
    _check_kernel(case, q, got, ref)
    empty = np.asarray(lens) <= 0
    np.testing.assert_array_equal(_f64(got[0][empty]), 0.0)
    assert np.isneginf(got[1][empty]).all()
    if splits <= limit:
        other = _forced_plan(case, q, gpu, splits, not cluster_merge)
        np.testing.assert_array_equal(other[0], got[0])
        np.testing.assert_array_equal(other[1], got[1])


@pytest.mark.gpu
def test_gpu_plan_merges_in_a_cluster(gpu):
    """On an sm_90 GPU the decode kernel merges up to 16 splits in a cluster, and batch 1 x 4096
    (8 of 32 heads: 128 CTAs) takes 16 of them: no merge kernel."""
    if gpu.compute_capability.split(".")[0] != "9":
        pytest.skip("the cluster size limits are an sm_90 GPU's")
    if os.environ.get("JAX_NVFP4_CLUSTER_MERGE") == "0":
        pytest.skip("the cluster merge switched off (JAX_NVFP4_CLUSTER_MERGE=0)")
    limit = ap._cluster_merge_splits(128)
    assert limit == 16, limit
    assert ap.plan_splits(1, 1, 8, 32, 4096, _sm_count(gpu), ap._resident_ctas(128),
                          limit) == (16, 256)
    assert ap.merges_in_cluster(ap.decode_units(1, 1, 8, 32), 16, _sm_count(gpu), limit)


@pytest.mark.gpu
@pytest.mark.parametrize("splits,cluster_merge", [(1, False), (4, True), (4, False)])
@pytest.mark.parametrize("which,bad", [("k", 0.0), ("v", np.nan), ("k", 2.0 ** 117),
                                       ("v", 1e-40)])
def test_gpu_invalid_scale_in_every_merge(gpu, splits, cluster_merge, which, bad):
    """The kernel applies the readers' invalid-scale rule itself, with one split, a cluster
    merge and the merge kernel: every output and lse NaN, empty sequences' included."""
    if cluster_merge and splits > ap._cluster_merge_splits(128):
        pytest.skip("this GPU does not place clusters of that size")
    case = Case(seed=1260, lens=_SPLIT_LENS, num_kv_heads=2, pad_columns=0)
    q = case.query(8, jnp.float16)
    out, lse = _forced_plan(case, q, gpu, splits, cluster_merge,
                            **{f"{which}_scale": bad})
    assert np.isnan(_f64(out)).all() and np.isnan(lse).all()


@pytest.mark.gpu
@pytest.mark.parametrize("lens", [(40, 1, 0, 700), (3000, 1, 0, 2500) * 4])
def test_gpu_per_member_invalid_scale(gpu, lens):
    """vmap over three members with their own k_scale, the middle one invalid: that member's
    outputs and lse all NaN (its empty sequences' too), the others the jnp path's. Few
    sequences (the plan merges splits in a cluster) and many (the merge kernel)."""
    case = Case(seed=1270 + len(lens), lens=lens, num_kv_heads=2)
    splits, _, cluster = ap.decode_plan(3, len(lens), 2, 8, 128, case.max_blocks * 16)
    clusters = ap._cluster_merge_splits(128) > 0  # (where the GPU and the switch allow)
    assert splits > 1 and cluster == (len(lens) == 4 and clusters), (splits, cluster)
    q, cache, tables, seq_lens, ks, vs = case.args(case.query(8, jnp.bfloat16))
    k_scales = jnp.stack([ks, jnp.float32(0.0), ks * 2])
    members = (jnp.stack([q] * 3), jnp.stack([cache] * 3), k_scales)

    def run(impl, device):
        fn = jax.jit(jax.vmap(lambda q, c, k: nv.paged_attention(
            q, c, tables, seq_lens, k, vs, **case.options, impl=impl, return_lse=True)))
        return jax.device_get(fn(*jax.device_put(members, device)))

    out, lse = run("kernel", gpu)
    ref_out, ref_lse = run("jnp", CPU)
    assert np.isnan(_f64(out[1])).all() and np.isnan(lse[1]).all()
    assert np.isnan(_f64(ref_out[1])).all() and np.isnan(ref_lse[1]).all()
    for m in (0, 2):
        assert_out_close(out[m], ref_out[m], q.dtype, roundings=2)
        assert_lse_close(lse[m], ref_lse[m], kernel_lse_tol(case, q, None))


@pytest.mark.gpu
@pytest.mark.parametrize("layout,lens", [("HND", (0, 37, 0, 1, 300, -3, 0)),
                                         ("NHD", (0, 3000, -1, 1, 0))])
def test_gpu_seq_len_zero_rows(gpu, layout, lens):
    """seq_len 0 / negative rows mixed with others (one and several splits): exact zeros and
    lse -inf there, the other rows as the references."""
    case = Case(seed=1400 + len(lens), lens=lens, layout=layout)
    q = case.query(8, jnp.float16)
    got, ref = _kernel_and_jnp(case, q, gpu)
    _check_kernel(case, q, got, ref)
    empty = np.asarray(lens) <= 0
    np.testing.assert_array_equal(_f64(got[0][empty]), 0.0)
    assert np.isneginf(got[1][empty]).all() and np.isfinite(got[1][~empty]).all()


@pytest.mark.gpu
def test_gpu_no_pages_at_all(gpu):
    """max_blocks_per_seq == 0: nothing to attend to whatever seq_lens says: zeros, lse -inf."""
    case, q = _small_case(seed=7)
    tables = np.zeros((len(case.lens), 0), np.int32)
    got, ref = _kernel_and_jnp(case, q, gpu, tables=tables, lens=np.full(len(case.lens), 5))
    for (out, lse) in (got, ref):
        np.testing.assert_array_equal(_f64(out), 0.0)
        assert np.isneginf(lse).all()


@pytest.mark.gpu
@pytest.mark.parametrize("layout,block_size", [("HND", 16), ("NHD", 12)])
def test_gpu_padding_never_read(gpu, layout, block_size):
    """Padding entries past seq_len (-1, other sequences' pages, poisoned spare pages, huge and
    negative ids) change nothing: bit-identical outputs, finite, as the references."""
    bs = block_size
    case = Case(seed=1500 + bs, lens=(1, bs - 1, bs, 5 * bs + 3, 40, 700), layout=layout,
                block_size=bs, extra_pages=6)
    poisoned = case.poisoned(rows=case.masked_rows(), pages=case.spare_pages, seed=bs)
    q = case.query(16, jnp.bfloat16)
    base, ref = _kernel_and_jnp(case, q, gpu, cache=poisoned)
    _check_kernel(case, q, base, ref)
    rng = np.random.default_rng(bs)
    pad = case.tables < 0
    wild = np.array([-1, -7, case.num_blocks, case.num_blocks + 100, 2 ** 31 - 1, -2 ** 31],
                    np.int64)
    fills = {"spare": rng.choice(case.spare_pages, pad.sum()),
             "owned": rng.choice(case.tables[~pad], pad.sum()),
             "wild": rng.choice(wild, pad.sum())}
    for name, fill in fills.items():
        tables = case.tables.copy()
        tables[pad] = fill.astype(np.int32)
        got, _ = _kernel_and_jnp(case, q, gpu, tables=tables, cache=poisoned)
        np.testing.assert_array_equal(got[0], base[0], err_msg=name)
        np.testing.assert_array_equal(got[1], base[1], err_msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", LAYOUTS)
def test_gpu_out_of_range_inside_seq_len_clamped(gpu, layout):
    """Out-of-range ids inside seq_len are clamped to [0, num_blocks - 1] like the jnp path:
    the same bits as the clamped table, and the jnp path's result."""
    case = Case(seed=1600 + (layout == "NHD"), lens=(40, 83, 16, 33, 70), layout=layout,
                junk=False, extra_pages=0)        # every page owned: clamped reads are finite
    q = case.query(8, jnp.float32)
    tables = case.tables.copy()
    tables[0, 0], tables[1, 3], tables[3, 1], tables[4, 2] = (
        -5, case.num_blocks + 7, 2 ** 31 - 1, -2 ** 31)
    clamped = np.clip(tables, 0, case.num_blocks - 1)
    got, ref = _kernel_and_jnp(case, q, gpu, tables=tables)
    want, ref_clamped = _kernel_and_jnp(case, q, gpu, tables=clamped)
    for a, b in zip(got + ref, want + ref_clamped):
        np.testing.assert_array_equal(a, b)
    _check_kernel(case, q, got, ref, float64=False)   # the float64 twin reads the true pages


@pytest.mark.gpu
@pytest.mark.parametrize("layout,swizzle,block_size", [
    ("HND", True, 16), ("NHD", False, 12), ("HND", False, 4), ("NHD", True, 64)])
def test_gpu_masked_rows_never_leak(gpu, layout, swizzle, block_size):
    """Rows past seq_len in a sequence's last page holding NaN / largest values (stored junk,
    then raw bytes), and spare pages of raw junk: the same bits as a clean cache, finite."""
    bs = block_size
    kw = dict(lens=(1, bs - 1, 3 * bs + 1, 2 * bs + bs // 2, 600), layout=layout,
              v_scale_swizzle=swizzle, block_size=bs)
    junk = Case(seed=1700 + bs, junk=True, **kw)
    clean = Case(seed=1700 + bs, junk=False, **kw)
    poisoned = junk.poisoned(rows=junk.masked_rows(), pages=junk.spare_pages, seed=bs)
    assert np.isnan(np.asarray(junk.k_pages)).any()
    q = junk.query(8, jnp.bfloat16)
    base, ref = _kernel_and_jnp(clean, q, gpu)
    _check_kernel(clean, q, base, ref)
    for name, cache in (("stored junk", junk.cache), ("raw bytes", poisoned)):
        got, _ = _kernel_and_jnp(junk, q, gpu, cache=cache)
        np.testing.assert_array_equal(got[0], base[0], err_msg=name)
        np.testing.assert_array_equal(got[1], base[1], err_msg=name)


@pytest.mark.gpu
@pytest.mark.parametrize("block_size", [16, 12])
def test_gpu_seq_len_beyond_table(gpu, block_size):
    """seq_len > max_blocks * block_size attends to all max_blocks * block_size positions."""
    bs = block_size
    full = 5 * bs
    case = Case(seed=1800 + bs, lens=(full,) * 4, pad_columns=0, block_size=bs)
    assert case.max_blocks * bs == full
    q = case.query(8, jnp.bfloat16)
    base, ref = _kernel_and_jnp(case, q, gpu)
    _check_kernel(case, q, base, ref)
    got, _ = _kernel_and_jnp(case, q, gpu, lens=(full, full + 1, 10 * full, 2 ** 31 - 1))
    np.testing.assert_array_equal(got[0], base[0])
    np.testing.assert_array_equal(got[1], base[1])


def _count_targets(fn, *args):
    return jax.jit(fn).lower(*args).compile().as_text().count(TARGET)


@pytest.mark.gpu
@pytest.mark.parametrize("shared_tables,shared_scales", STACKED_VARIANTS, ids=STACKED_IDS)
def test_gpu_vmap_over_layers_one_launch(gpu, shared_tables, shared_scales):
    """vmap over a stacked [L, ...] cache: one custom call; each layer as the jnp path on the
    CPU and as a loop of kernel calls."""
    args, axes = _stacked(shared_tables, shared_scales, jnp.bfloat16)
    one = functools.partial(nv.paged_attention, return_lse=True, impl="kernel")
    batched = jax.vmap(one, in_axes=axes)
    on_gpu = jax.device_put(args, gpu)
    assert _count_targets(batched, *on_gpu) == 1
    out, lse = jax.device_get(jax.jit(batched)(*on_gpu))
    loop = _loop(jax.jit(one), on_gpu, axes, LAYERS)
    ref = _loop(jax.jit(functools.partial(nv.paged_attention, return_lse=True, impl="jnp")),
                args, axes, LAYERS)
    _check_layers_against_jnp(out, lse, ref, _layers(shared_tables), args, jnp.bfloat16)
    for l in range(LAYERS):
        assert_out_close(out[l], loop[0][l], jnp.bfloat16, roundings=2, label="kernel~kernel")
        assert_lse_close(lse[l], loop[1][l], KERNEL_LSE_ABS, label="kernel~kernel",
                         dtype=jnp.bfloat16)


@pytest.mark.gpu
def test_gpu_vmap_over_q_shared_cache_one_launch(gpu):
    """vmap over q and tables with one shared cache (members folded into the batch): one
    custom call; each member as the jnp path on the CPU."""
    case, q = _small_case(seed=4)
    members = 3
    qs = jnp.asarray(np.random.default_rng(5).standard_normal((members,) + q.shape),
                     jnp.bfloat16)
    lens = jnp.asarray(np.stack([np.roll(np.minimum(case.lens, 20 * m + 3), m)
                                 for m in range(members)]), jnp.int32)
    tables = jnp.asarray(np.stack([np.roll(case.tables, m, axis=0) for m in range(members)]))
    args = (qs, case.cache, tables, lens, case.k_scale, case.v_scale)
    axes = (0, None, 0, 0, None, None)
    batched = jax.vmap(functools.partial(nv.paged_attention, return_lse=True, impl="kernel"),
                       in_axes=axes)
    on_gpu = jax.device_put(args, gpu)
    assert _count_targets(batched, *on_gpu) == 1
    out, lse = jax.device_get(jax.jit(batched)(*on_gpu))
    ref = _loop(jax.jit(functools.partial(nv.paged_attention, return_lse=True, impl="jnp")),
                args, axes, members)
    for m in range(members):
        assert_out_close(out[m], ref[0][m], jnp.bfloat16, roundings=2, label="kernel~jnp")
        assert_lse_close(lse[m], ref[1][m], kernel_lse_tol(case, qs[m]), label="kernel~jnp",
                         dtype=jnp.bfloat16)


@pytest.mark.gpu
def test_gpu_scan_over_layers(gpu):
    """lax.scan over layers on the GPU (the kernel in the loop body) = the jnp path per layer."""
    args, axes = _stacked(False, False, jnp.float32)
    q, cache, tables, lens, ks, vs = jax.device_put(args, gpu)

    def step(q, cache, tables, lens, ks, vs):
        def body(carry, x):
            return carry, nv.paged_attention(*x, return_lse=True, impl="kernel")
        return jax.lax.scan(body, 0, (q, cache, tables, lens, ks, vs))[1]

    out, lse = jax.device_get(jax.jit(step)(q, cache, tables, lens, ks, vs))
    ref = _loop(jax.jit(functools.partial(nv.paged_attention, return_lse=True, impl="jnp")),
                args, axes, LAYERS)
    _check_layers_against_jnp(out, lse, ref, _layers(False), args, jnp.float32)


@pytest.mark.gpu
@pytest.mark.parametrize("groups", [2, 4])
def test_gpu_grouped_one_launch(gpu, groups):
    """paged_attention_grouped on the GPU: one custom call; = the jnp path over the plain
    cache holding the same K/V (outputs and lse, heads in order)."""
    case = Case(seed=1900 + groups, lens=_lens(16, 900), num_kv_heads=4, groups=groups)
    q = case.query(16, jnp.bfloat16)
    fn = functools.partial(shd.paged_attention_grouped, return_lse=True, impl="kernel")
    on_gpu = jax.device_put(case.args(q, cache=case.grouped), gpu)
    assert _count_targets(fn, *on_gpu) == 1
    got = jax.device_get(jax.jit(fn)(*on_gpu))
    _, ref = _kernel_and_jnp(case, q, gpu)
    _check_kernel(case, q, got, ref)


@pytest.mark.gpu
def test_gpu_jit_compiles_once(gpu):
    """Same shapes, other q / tables / lengths: one trace, one compilation."""
    traces = []

    def step(*args):
        traces.append(1)
        return nv.paged_attention(*args, return_lse=True, impl="kernel")

    f = jax.jit(step)
    for seed in range(3):
        case = Case(seed=2000 + seed, lens=(1, 15, 16, 83, 40 + seed, 3 + seed))
        q = case.query(8, jnp.bfloat16, seed=seed)
        got = jax.device_get(f(*jax.device_put(case.args(q), gpu)))
        ref = jax.device_get(paged_attention_jit(*case.args(q), return_lse=True, impl="jnp"))
        _check_kernel(case, q, got, ref)
    assert len(traces) == 1
    if hasattr(f, "_cache_size"):
        assert f._cache_size() == 1


@pytest.mark.gpu
def test_gpu_cache_not_donated_and_unchanged(gpu):
    """The kernel only reads the cache: no input/output alias, the buffer stays alive and
    unchanged, and a second call gives the same bits."""
    case, q = _small_case(seed=5)
    before = np.asarray(case.cache).copy()
    args = jax.device_put(case.args(q), gpu)
    f = jax.jit(functools.partial(nv.paged_attention, return_lse=True, impl="kernel"))
    hlo = f.lower(*args).compile().as_text()
    assert hc.input_output_aliases(hlo) == {}
    first = jax.device_get(f(*args))
    assert not args[1].is_deleted()
    np.testing.assert_array_equal(np.asarray(args[1]), before)
    second = jax.device_get(f(*args))
    for a, b in zip(first, second):
        np.testing.assert_array_equal(a, b)


@pytest.mark.gpu
def test_gpu_auto_uses_the_kernel(gpu):
    """impl="auto" on the GPU lowers to the kernel (same bits as impl="kernel"); impl="jnp"
    does not."""
    case, q = _small_case(seed=6)
    args = jax.device_put(case.args(q), gpu)
    auto = functools.partial(nv.paged_attention, return_lse=True)
    assert _count_targets(auto, *args) == 1
    assert _count_targets(functools.partial(auto, impl="jnp"), *args) == 0
    got = jax.device_get(jax.jit(auto)(*args))
    kernel = jax.device_get(jax.jit(functools.partial(auto, impl="kernel"))(*args))
    for a, b in zip(got, kernel):
        np.testing.assert_array_equal(a, b)


@pytest.mark.gpu
def test_gpu_head_size_80_falls_back(gpu):
    """head_size 80 (linear V scales): impl="auto" lowers to the jnp path on the GPU (no
    custom call), matching the CPU; impl="kernel" refuses it, naming the head size."""
    case = Case(seed=2100, lens=_lens(16, 300), head_size=80, v_scale_swizzle=False,
                layout="NHD")
    q = case.query(8, jnp.float32)
    args = jax.device_put(case.args(q), gpu)
    auto = functools.partial(nv.paged_attention, layout="NHD", v_scale_swizzle=False,
                             return_lse=True)
    assert _count_targets(auto, *args) == 0
    out, lse = jax.device_get(jax.jit(auto)(*args))
    ref_out, ref_lse = jax.device_get(case.run(q, return_lse=True, impl="jnp"))
    assert_out_close(out, ref_out, q.dtype, roundings=2, rel=JNP_GPU_REL, l2=JNP_GPU_REL,
                     label="jnp_gpu~jnp_cpu")
    assert_lse_close(lse, ref_lse, JNP_GPU_LSE_ABS, label="jnp_gpu~jnp_cpu", dtype=q.dtype)
    with pytest.raises(ValueError, match="impl='kernel'.*head_size 80"):
        jax.jit(functools.partial(auto, impl="kernel")).lower(*args)
