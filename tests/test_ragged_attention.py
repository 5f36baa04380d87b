"""Ragged paged attention (``jax_nvfp4.ragged_paged_attention``): several query tokens per
sequence, causal, against dense float64 attention per query token, the decode reader, and
itself under jit, vmap and checkify.

Cases (tests/ragged_cases.py ``RaggedCase``) mix what a server sends in one call: decode tokens
(q_len 1), speculative-decoding drafts (q_len 4), prefill chunks over cached prefixes, a whole
prompt from scratch (q_len == kv_len), an empty sequence, then padding sequences whose tables,
lengths and offsets are junk, and padding tokens nobody owns.

CPU part: the jnp path (``impl="auto"`` on the CPU) against float64 within float32 arithmetic
(and the output's rounding for bf16/fp16 q): the bounds of tests/test_attention.py, measured
here too on jax 0.10.2 (float32 q: max |out - ref| / max|ref| per token <= 8.4e-7, relative L2
<= 6.6e-7; lse <= 1.9e-6 absolute); one query token per sequence against ``paged_attention``
bit for bit; the token plan's rules for invalid layouts; one compilation for changing
``num_seqs``/``cu_q_lens``; ``checked=True``; errors; vmap.

GPU part (``@pytest.mark.gpu``): the CUDA kernel against the jnp path run on the CPU over the
same cache, with the decode kernel's bounds (tests/test_decode_kernel.py: same arithmetic, q and
P rounded to fp16, K/V exact in fp16, float32 sums), over head sizes 64/128/256, both layouts,
both V-scale orders, block sizes 8/12/16/32, GQA 1/4/8, the three q dtypes, split-KV plans and
tiles of 16, 32 and 64 rows; one query token per sequence against the decode kernel.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental import checkify

import jax_nvfp4 as nv
from jax_nvfp4 import ragged_primitive as rp
from jax_nvfp4 import reference

from jax.sharding import NamedSharding, PartitionSpec as P

import hlo_checks as hc
from attention_cases import Case, paged_attention_jit
from meshes import make_mesh
from ragged_cases import MANY_UNITS, ragged_jit, shared_case
from test_decode_kernel import (FP16_UNIT, KERNEL_LSE_ABS, UNIT_ROUNDOFF, _f64,
                                assert_lse_close, assert_out_close)

F32_REL = 4e-6
# The relative L2 error per token of the float32 jnp path against float64: up to 2.6e-6 measured
# (head size 256, a few hundred positions: the property test's examples, hypothesis 6.170,
# 2026-12-02), so the bound is the elementwise one.
F32_L2 = 4e-6
F32_LSE_ABS = 2e-5
CPU = jax.devices("cpu")[0]

#: (kv_len, q_len) of the mixed batch: decode, drafts, a chunk over a cached prefix, a prompt
#: from scratch, a sequence with no query token, a chunk crossing pages at odd offsets.
MIXED = ((37, 1), (50, 4), (70, 23), (21, 21), (9, 0), (33, 11), (16, 1))
#: A verify step of speculative decoding under a bound (max_q_len = 4): drafts of 4, 3 and 2,
#: a sequence with one token and one with none.
SPEC = ((300, 4), (37, 3), (90, 1), (16, 2), (9, 0), (520, 4))


def _cpu(fn, *args, **kw):
    with jax.default_device(CPU):
        return fn(*args, **kw)


def assert_matches_float64(out, ref, dtype, ends, rel=F32_REL, l2=F32_L2):
    """Per query token: within float32 arithmetic of the float64 reference (plus the output's
    rounding for bf16/fp16); tokens that attend to nothing are exactly 0."""
    out = _f64(out)
    u = UNIT_ROUNDOFF[np.dtype(dtype).name] if np.dtype(dtype) != np.float32 else 0.0
    for t in range(len(ref)):
        if ends[t] == 0:
            np.testing.assert_array_equal(out[t], 0.0, err_msg=f"token {t}")
            continue
        scale = np.abs(ref[t]).max()
        excess = (np.abs(out[t] - ref[t]) - u * np.abs(ref[t])).max()
        assert excess <= rel * scale, (t, excess / scale)
        rel_l2 = np.linalg.norm(out[t] - ref[t]) / np.linalg.norm(ref[t])
        assert rel_l2 < l2 + u, (t, rel_l2)


# =============================================================================== CPU


@pytest.mark.parametrize("layout,swizzle,ratio,dtype,bs", [
    ("HND", True, 4, jnp.float32, 16),
    ("NHD", False, 1, jnp.bfloat16, 12),
    ("HND", False, 8, jnp.float16, 8),
    ("NHD", True, 4, jnp.float32, 32),
])
def test_cpu_matches_dense_float64(layout, swizzle, ratio, dtype, bs):
    case = shared_case(3, MIXED, layout=layout, v_scale_swizzle=swizzle, block_size=bs,
                       head_size=64)
    q = case.query(case.num_kv_heads * ratio, dtype, seed=ratio)
    out, lse = _cpu(case.run, q, return_lse=True)
    assert out.dtype == q.dtype and out.shape == q.shape
    assert lse.dtype == jnp.float32 and lse.shape == q.shape[:2]
    ref, ref_lse = case.reference(q, return_lse=True)
    ends = case.token_ends()
    assert_matches_float64(out, ref, dtype, ends)
    assert_lse_close(lse, ref_lse, F32_LSE_ABS)


def test_cpu_sm_scale_and_padding_tokens():
    case = shared_case(5, MIXED, pad_tokens=9)
    q = case.query(8, jnp.float32, seed=2)
    out = _cpu(case.run, q, sm_scale=0.3)
    assert_matches_float64(out, case.reference(q, sm_scale=0.3), jnp.float32, case.token_ends())
    np.testing.assert_array_equal(np.asarray(out)[-9:], 0.0)


def test_cpu_one_token_per_sequence_is_paged_attention_bit_for_bit():
    """cu_q_lens = arange(batch + 1): the decode reader's results, outputs and lse."""
    case = _cpu(Case, 11, lens=(1, 15, 16, 83, 40, 0), num_kv_heads=2, head_size=128)
    batch = len(case.lens)
    q = case.query(8, jnp.bfloat16, seed=4)
    tables, lens = jnp.asarray(case.tables), jnp.asarray(case.lens, jnp.int32)
    cu = jnp.arange(batch + 1, dtype=jnp.int32)
    out, lse = _cpu(ragged_jit, q, case.cache, tables, lens, cu, batch, case.k_scale,
                    case.v_scale, return_lse=True)
    ref, ref_lse = _cpu(paged_attention_jit, q, case.cache, tables, lens, case.k_scale,
                        case.v_scale, return_lse=True)
    np.testing.assert_array_equal(np.asarray(out), np.asarray(ref))
    np.testing.assert_array_equal(np.asarray(lse), np.asarray(ref_lse))


def test_cpu_max_q_len_changes_nothing_or_gives_nan_rows():
    """A bound at the batch's longest sequence changes nothing (bit for bit); one below gives
    the longer sequences NaN rows (out and lse) and leaves every other row as it was."""
    case = shared_case(13, SPEC, pad_tokens=5)
    q = case.query(8, jnp.float32, seed=3)
    ref, ref_lse = (np.asarray(x) for x in _cpu(case.run, q, return_lse=True))
    for bound in (4, 9):
        out, lse = _cpu(case.run, q, return_lse=True, max_q_len=bound)
        np.testing.assert_array_equal(np.asarray(out), ref)
        np.testing.assert_array_equal(np.asarray(lse), ref_lse)
    over = case.rows_over(3)
    assert over.sum() == 8
    out, lse = (np.asarray(x) for x in _cpu(case.run, q, return_lse=True, max_q_len=3))
    assert np.isnan(out[over]).all() and np.isnan(lse[over]).all()
    np.testing.assert_array_equal(out[~over], ref[~over])
    np.testing.assert_array_equal(lse[~over], ref_lse[~over])


def test_checked_reports_a_broken_max_q_len():
    case = shared_case(13, SPEC)
    q = case.query(8, jnp.float32)

    def error_of(bound):
        run = functools.partial(nv.ragged_paged_attention, **case.options, checked=True,
                                max_q_len=bound)
        err, _ = _cpu(jax.jit(checkify.checkify(run)), *case.args(q))
        return err.get()

    assert error_of(4) is None
    message = error_of(3)
    assert "more query tokens than max_q_len = 3" in message and "sequence 0" in message
    assert "q_len = 4" in message and "2 such sequence(s)" in message


def test_few_rows_only_rule():
    """The few-row kernel serves a call alone for bounds of 2 or more whose rows per kv head
    fit its 16 (ffi/ragged_ffi.h kFewRows), head sizes up to 128."""
    assert rp.few_rows_only(4, 32, 8, 128) and rp.few_rows_only(16, 8, 8, 64)
    assert rp.few_rows_only(2, 64, 8, 128)                       # 2 tokens x GQA 8
    assert not rp.few_rows_only(5, 32, 8, 128)                   # 20 rows
    assert not rp.few_rows_only(1, 32, 8, 128)                   # a decode step
    assert not rp.few_rows_only(None, 32, 8, 128)
    assert not rp.few_rows_only(4, 32, 8, 256)
    # Where the kernel takes 32 rows (head size 128 on sm_90a: rp.few_rows_max), 8 tokens x 4.
    assert rp.few_rows_only(8, 32, 8, 128, rp.FEW_ROWS_WIDE)
    assert not rp.few_rows_only(9, 32, 8, 128, rp.FEW_ROWS_WIDE)
    assert rp.few_rows_max(128) in (rp.FEW_ROWS, rp.FEW_ROWS_WIDE)
    assert rp.few_rows_max(64) == rp.FEW_ROWS and rp.few_rows_max(256) == rp.FEW_ROWS
    # The plan counts 32 x 8 tokens x GQA 4 (32 rows a sequence) as a few-row CTA per (sequence,
    # kv head), as 32 x 4, where the kernel takes 32 rows; as query tiles where it does not.
    assert (rp.plan_splits(1, 256, 32, 8, 32, 128, 8192, 132, 2, 2, few_rows=rp.FEW_ROWS_WIDE)
            == rp.plan_splits(1, 128, 32, 8, 32, 128, 8192, 132, 2, 2) == (1, 8192))
    assert rp.plan_splits(1, 256, 32, 8, 32, 128, 8192, 132, 2, 2) == (2, 4096)
    # Alone, the plan counts the few-row kernel's CTAs whatever num_tokens says.
    assert (rp.plan_splits(1, 2048, 32, 8, 32, 128, 8192, 132, 2, 2, alone=True) ==
            rp.plan_splits(1, 128, 32, 8, 32, 128, 8192, 132, 2, 2))


def test_few_rows_plan_ctas_rule(monkeypatch):
    """The plan's occupancy for the few-row work: the wide path's own kernel's (17 to 32 rows)
    only where the few-row kernels serve the call alone with a bound past 16 rows per kv head;
    the 16-row kernel's otherwise (a smaller bound, or no bound: the rows are not known)."""
    monkeypatch.setattr(rp, "_few_rows_resident_ctas", lambda head_size: 2)
    monkeypatch.setattr(rp, "_wide_rows_resident_ctas", lambda head_size: 3)
    assert rp.few_rows_plan_ctas(True, 8, 32, 8, 128) == 3       # 32 rows
    assert rp.few_rows_plan_ctas(True, 5, 32, 8, 128) == 3       # 20 rows
    assert rp.few_rows_plan_ctas(True, 4, 32, 8, 128) == 2       # 16 rows
    assert rp.few_rows_plan_ctas(True, 16, 8, 8, 128) == 2       # 16 rows, GQA 1
    assert rp.few_rows_plan_ctas(False, None, 32, 8, 128) == 2
    # 32 x 8 over 8192 at 3 CTAs per SM: 3 splits (768 CTAs, 1.94 waves of 396 slots) where 2
    # CTAs per SM plan 1 (256 CTAs on 264 slots).
    assert rp.plan_splits(1, 256, 32, 8, 32, 128, 8192, 132, 2, 3, alone=True,
                          few_rows=rp.FEW_ROWS_WIDE) == (3, 2752)
    assert rp.plan_splits(1, 256, 32, 8, 32, 128, 8192, 132, 2, 2, alone=True,
                          few_rows=rp.FEW_ROWS_WIDE) == (1, 8192)
    # At 4 CTAs per SM (528 slots) the same call fits 2 splits in one wave (512 CTAs).
    assert rp.plan_splits(1, 256, 32, 8, 32, 128, 8192, 132, 2, 4, alone=True,
                          few_rows=rp.FEW_ROWS_WIDE) == (2, 4096)


def test_token_plan_rules():
    """Non-decreasing cu_q_lens inside [0, T] as given; otherwise its running maximum clamped
    into [0, T] (one owner per token); num_seqs clamped; queries at negative positions and
    tokens nobody owns attend to nothing; lengths past the table's capacity are clamped."""
    plan = lambda cu, ns, lens, T, cap: tuple(np.asarray(x) for x in reference.ragged_token_plan(  # noqa: E731
        jnp.asarray(cu, jnp.int32), jnp.asarray(ns, jnp.int32), jnp.asarray(lens, jnp.int32), T,
        cap))
    seq, end = plan([0, 3, 3, 7, 9], 3, [5, 2, 10, 4], 10, 64)
    np.testing.assert_array_equal(seq[:7], [0, 0, 0, 2, 2, 2, 2])
    np.testing.assert_array_equal(end, [3, 4, 5, 7, 8, 9, 10, 0, 0, 0])
    # Decreasing, starting late, ending past T; q_len 6 over kv_len 5; kv_len past capacity 8.
    seq, end = plan([2, 8, 5, 12, 9], 4, [5, 2, 10, 4], 10, 8)
    np.testing.assert_array_equal(end, [0, 0, 0, 1, 2, 3, 4, 5, 8, 8])
    np.testing.assert_array_equal(seq[2:], [0, 0, 0, 0, 0, 0, 2, 2])
    # num_seqs beyond max_num_seqs is clamped; negative num_seqs owns nothing.
    _, end = plan([0, 2, 4], 7, [3, 3], 5, 16)
    np.testing.assert_array_equal(end, [2, 3, 2, 3, 0])
    _, end = plan([0, 2, 4], -1, [3, 3], 5, 16)
    np.testing.assert_array_equal(end, 0)


def test_cpu_invalid_layouts_follow_the_plan():
    """Whatever cu_q_lens and num_seqs hold, each token's result is that of the plan's
    sequence and length (decode attention of its own)."""
    case = shared_case(3, MIXED, head_size=64)
    q = case.query(8, jnp.float32, seed=9)
    T = case.num_tokens
    cu = np.array(case.cu_q_lens)
    cu[2] = cu[1] - 2               # decreasing
    cu[4] = T + 5                   # past the end
    for ns in (case.num_seqs, case.num_seqs + 5, 0):
        args = list(case.args(q, num_seqs=ns))
        args[4] = jnp.asarray(cu)
        out = np.asarray(_cpu(ragged_jit, *args, **case.options))
        seq, end = reference.ragged_token_plan(args[4], args[5], args[3], T, case.capacity)
        ref = _cpu(paged_attention_jit, q, case.cache, jnp.asarray(case.tables)[seq], end,
                   case.k_scale, case.v_scale, **case.options)
        np.testing.assert_array_equal(out, np.asarray(ref))


def test_one_compilation_for_changing_batches():
    """num_seqs, cu_q_lens and seq_lens are device values: a new batch layout reuses the
    compiled call."""
    traces = []

    @jax.jit
    def step(*args):
        traces.append(1)
        return nv.ragged_paged_attention(*args)

    case = shared_case(3, MIXED, head_size=64)
    q = case.query(8, jnp.bfloat16)
    for ns in (7, 3, 0, 9):
        args = list(case.args(q, num_seqs=ns))
        args[4] = args[4].at[1].set(ns % 3)
        _cpu(step, *args)
    assert len(traces) == 1


def test_checked_reports_invalid_layouts():
    case = shared_case(3, MIXED, head_size=64)
    q = case.query(8, jnp.float32)
    run = functools.partial(nv.ragged_paged_attention, **case.options, checked=True)

    def error_of(**changes):
        args = dict(zip(("q", "kv_cache", "block_tables", "seq_lens", "cu_q_lens", "num_seqs",
                         "k_scale", "v_scale"), case.args(q)))
        args.update(changes)
        err, _ = _cpu(jax.jit(checkify.checkify(lambda a: run(**a))), args)
        return err.get()

    assert error_of() is None                        # padding rows hold junk: not checked
    cu = np.array(case.cu_q_lens)
    cu[3] = cu[2] - 1
    assert "decreases" in error_of(cu_q_lens=jnp.asarray(cu))
    lens = np.array(case.seq_lens)
    lens[1] = 2                                      # 4 query tokens over 2 cached
    assert "more query tokens than seq_lens[1]" in error_of(seq_lens=jnp.asarray(lens))
    assert "num_seqs" in error_of(num_seqs=jnp.asarray(case.num_seqs + 3, jnp.int32))
    cu = np.array(case.cu_q_lens)
    cu[case.num_seqs] = case.num_tokens + 1
    assert "num_tokens" in error_of(cu_q_lens=jnp.asarray(cu))
    tables = np.array(case.tables)
    tables[2, 0] = 10 ** 6
    assert "block_tables[2, 0]" in error_of(block_tables=jnp.asarray(tables))
    assert "k_scale" in error_of(k_scale=jnp.float32(0.0))


def test_argument_errors_name_the_argument():
    case = shared_case(3, MIXED, head_size=64)
    q = case.query(8, jnp.float32)
    args = case.args(q)

    def raises(exc, match, *changes, **kw):
        a = list(args)
        for i, x in changes:
            a[i] = x
        with pytest.raises(exc, match=match):
            nv.ragged_paged_attention(*a, **case.options, **kw)

    raises(ValueError, "q must have shape \\[num_tokens", (0, q[0]))
    raises(TypeError, "q must be", (0, q.astype(jnp.int32)))
    raises(ValueError, "cu_q_lens must have shape", (4, args[4][:-1]))
    raises(TypeError, "cu_q_lens must be an integer", (4, args[4].astype(jnp.float32)))
    raises(ValueError, "num_seqs must have shape", (5, jnp.zeros((2,), jnp.int32)))
    raises(ValueError, "seq_lens must have shape", (3, args[3][:-1]))
    raises(ValueError, "block_tables must have shape", (2, args[2][0]))
    raises(ValueError, "num_q_heads 5 must be a multiple", (0, q[:, :5]))
    raises(ValueError, "cu_q_lens holds", (4, np.array([0, 2 ** 40] + [0] * 8, np.int64)))
    raises(ValueError, "impl must be", impl="fast")
    raises(ValueError, "max_q_len must be >= 1", max_q_len=0)
    raises(TypeError, "max_q_len must be None or a Python int", max_q_len=True)
    raises(TypeError, "max_q_len must be None or a Python int", max_q_len=4.0)
    raises(TypeError, "checked must be a bool", checked=1)


def test_impl_kernel_refuses_on_the_cpu():
    case = shared_case(3, MIXED, head_size=64)
    with pytest.raises(ValueError, match="needs the CUDA kernel"):
        _cpu(case.run, case.query(8, jnp.float32), impl="kernel")


@pytest.mark.parametrize("max_q_len", [None, 11], ids=["no-bound", "bound-11"])
def test_cpu_vmap_over_stacked_layers_and_over_q(max_q_len):
    """vmap over a stacked cache (one primitive) and over q with one shared cache (a loop):
    each member equals its own call (with a bound too: its NaN rows go through both)."""
    case = shared_case(3, MIXED, head_size=64)
    qs = jnp.stack([case.query(8, jnp.float32, seed=s) for s in (1, 2)])
    args = case.args(qs[0])
    caches = jnp.stack([case.cache, case.cache])
    f = lambda q, c: nv.ragged_paged_attention(q, c, *args[2:], **case.options,  # noqa: E731
                                               max_q_len=max_q_len)
    stacked = _cpu(jax.jit(jax.vmap(f)), qs, caches)
    shared = _cpu(jax.jit(jax.vmap(f, in_axes=(0, None))), qs, case.cache)
    for i in range(2):
        one = _cpu(jax.jit(f), qs[i], case.cache)
        assert np.isnan(np.asarray(one)).any() == (max_q_len is not None)
        np.testing.assert_array_equal(np.asarray(stacked[i]), np.asarray(one))
        np.testing.assert_array_equal(np.asarray(shared[i]), np.asarray(one))


def test_token_plan_without_sequences():
    seq, end = reference.ragged_token_plan(jnp.zeros((1,), jnp.int32), jnp.int32(0),
                                           jnp.zeros((0,), jnp.int32), 5, 16)
    np.testing.assert_array_equal(np.asarray(end), 0)
    assert seq.shape == end.shape == (5,)


def _with_nan_keys(case, positions):
    """The case's cache with a NaN key vector (and a finite value) stored at each (sequence,
    position) of ``positions``, every head (the store writes the NaN block scale there)."""
    bs = case.case.block_size
    slots = np.array([case.tables[b, t // bs] * bs + t % bs for b, t in positions], np.int32)
    shape = (len(slots), case.num_kv_heads, case.head_size)
    with jax.default_device(CPU):
        return nv.reshape_and_cache(jnp.full(shape, jnp.nan, jnp.bfloat16),
                                    jnp.ones(shape, jnp.bfloat16), case.cache,
                                    jnp.asarray(slots), case.k_scale, case.v_scale,
                                    **case.options)


def _nan_case():
    """MIXED with a NaN key vector stored at position 40 of sequence 2 (its chunk's queries are
    at 47..69: all see it) and at position 8 of sequence 1 (its 4 drafts are at 46..49: all see
    it), and a NaN query row (token 5, head 3). Returns (case, q, rows that must be NaN)."""
    case = shared_case(3, MIXED, head_size=64)
    cache = _with_nan_keys(case, ((2, 40), (1, 8)))
    q = np.array(case.query(8, jnp.float32, seed=7))
    q[5, 3, 0] = np.nan
    nan_rows = np.zeros(q.shape[:2], bool)
    nan_rows[case.starts[1]:case.starts[2]] = True      # every query of sequence 1
    nan_rows[case.starts[2]:case.starts[3]] = True      # every query of sequence 2
    nan_rows[5, 3] = True
    return case, cache, jnp.asarray(q), nan_rows


def test_cpu_nan_scores_give_nan_rows_and_nothing_else():
    """A NaN key among the positions a query sees, or a NaN in the query, makes exactly those
    rows NaN (as the decode reader does); the other rows are unchanged."""
    case, cache, q, nan_rows = _nan_case()
    out = np.asarray(_cpu(ragged_jit, *case.args(q, cache=cache), **case.options))
    np.testing.assert_array_equal(np.isnan(out).any(axis=-1), nan_rows)
    clean = np.asarray(_cpu(ragged_jit, *case.args(jnp.where(jnp.isnan(q), 0.0, q)),
                            **case.options))
    np.testing.assert_array_equal(out[~nan_rows], clean[~nan_rows])


def _stacked_args(count):
    """``count`` layers' caches stacked ``[L, ...]`` (each the MIXED case with its own K/V) and
    one q per layer, sharing the batch layout."""
    cases = [shared_case(81 + i, MIXED, head_size=64) for i in range(count)]
    q = jnp.stack([c.query(8, jnp.float32, seed=i) for i, c in enumerate(cases)])
    cache = jnp.stack([c.cache for c in cases])
    rest = cases[0].args(q[0])[2:6]
    scales = tuple(jnp.stack([getattr(c, n) for c in cases]) for n in ("k_scale", "v_scale"))
    return cases, (q, cache) + tuple(rest) + scales


@pytest.mark.parametrize("count", [2, 4])
def test_stacked_layers_sharded_no_collectives(partitioner, count):
    """vmap over layers with the stacked cache sharded on its layer axis: each device reads its
    own layers, with no collective and no copy of the cache; = one device."""
    mesh = make_mesh((count,), ("l",))
    cases, args = _stacked_args(count)
    layer = P("l")
    specs = (layer, layer, P(), P(), P(), P(), layer, layer)
    f = jax.jit(jax.vmap(lambda q, c, t, n, u, s, k, v: nv.ragged_paged_attention(
        q, c, t, n, u, s, k, v, return_lse=True), in_axes=(0, 0, None, None, None, None, 0, 0)))
    placed = [jax.device_put(a, NamedSharding(mesh, sp)) for a, sp in zip(args, specs)]
    hlo = f.lower(*placed).compile().as_text()
    out, lse = f(*placed)
    ref_out, ref_lse = jax.device_get(f(*jax.device_put(args, mesh.devices.flat[0])))
    assert hc.collectives(hlo) == [], hc.collectives(hlo)
    local = NamedSharding(mesh, layer).shard_shape(args[1].shape)
    assert hc.cache_copies(hlo, [args[1].shape, local]) == []
    assert out.sharding.is_equivalent_to(NamedSharding(mesh, layer), 4)
    if mesh.devices.flat[0].platform == "cpu":
        np.testing.assert_array_equal(np.asarray(out), ref_out)
        np.testing.assert_array_equal(np.asarray(lse), ref_lse)
    else:  # the kernel on each GPU: another split plan, kernel-level differences
        for i in range(count):
            assert_out_close(np.asarray(out[i]), ref_out[i], jnp.float32, roundings=2)


def test_partitioning_rules_split_the_stacked_axis():
    """The kernel's custom-partitioning rules (ragged_primitive: the Shardy rule and the GSPMD
    plan), read directly: the stacked axis follows the cache's sharding, a shared operand (one
    row) and every other axis are replicated. (custom_partitioning refuses a body with
    constants, such as the jnp path, so the rules run end to end only around the kernel: on two
    GPUs, issue 24.)"""
    mesh = make_mesh((2,), ("l",))
    L, T, S, M = 2, 40, 9, 8
    shapes = [(L, T, 8, 64), (L, 30, 2, 2, 16, 36), (1, S, M), (1, S), (1, S + 1), (1,),
              (L,), (L,), (1,)]
    text, extra = rp._sharding_rule("HND", True, None, mesh,
                                    [jax.ShapeDtypeStruct(x, jnp.float32) for x in shapes], None)
    assert text == ("stack0 tokens q_heads head_size, stack0 c_blocks c_side c_heads c_rows c_f, "
                    "t_one0 seqs pages, l_one0 seqs, u_one0 seqs_1, n_one0, stack0, stack0, "
                    "s_one0 -> stack0 tokens q_heads head_size, stack0 tokens q_heads")
    assert "stack0" not in extra["need_replication_factors"]
    assert set(extra["need_replication_factors"]) >= {"tokens", "seqs", "pages", "c_blocks"}
    operands, results = rp._plan("HND", shapes, NamedSharding(mesh, P("l")))
    assert [tuple(o) for o in operands] == [
        ("l", None, None, None), ("l", None, None, None, None, None), (None, None, None),
        (None, None), (None, None), (None,), ("l",), ("l",), (None,)]
    assert [tuple(r) for r in results] == [("l", None, None, None), ("l", None, None)]
    operands, _ = rp._plan("HND", shapes, NamedSharding(mesh, P()))   # a replicated cache
    assert all(e is None for o in operands for e in o)
    # Two stacked axes ([L, G] cache: nested vmap), the second one sharded; tables shared
    # along it, scales per (layer, group).
    G = 2
    shapes = [(L, G, T, 8, 64), (L, G, 30, 2, 2, 16, 36), (L, 1, S, M), (1, 1, S),
              (1, 1, S + 1), (1, 1), (L, G), (L, G), (1, 1)]
    text, extra = rp._sharding_rule("HND", True, None, mesh,
                                    [jax.ShapeDtypeStruct(x, jnp.float32) for x in shapes], None)
    assert text.startswith("stack0 stack1 tokens q_heads head_size, stack0 stack1 c_blocks ")
    assert "stack0 t_one1 seqs pages" in text
    assert not {"stack0", "stack1"} & set(extra["need_replication_factors"])
    operands, results = rp._plan("HND", shapes, NamedSharding(mesh, P(None, "l")))
    assert [tuple(o) for o in operands] == [
        (None, "l", None, None, None), (None, "l") + (None,) * 5, (None,) * 4, (None,) * 3,
        (None,) * 3, (None, None), (None, "l"), (None, "l"), (None, None)]
    assert [tuple(r) for r in results] == [(None, "l", None, None, None), (None, "l", None, None)]


def test_plan_splits():
    """Few tiles over long contexts split; prefill chunks do not; the workspace stays bounded."""
    # 32 sequences x 4 drafts, 8 kv heads, GQA 4, 8192 positions: 40 tile slots x 8 heads.
    assert rp.plan_splits(1, 128, 32, 8, 32, 128, 8192, 132, 2)[0] >= 1
    # One sequence of 4 drafts over 32768 positions: few CTAs, so many splits.
    splits, per = rp.plan_splits(1, 4, 1, 8, 32, 128, 32768, 132, 2)
    assert splits > 8 and per % rp.KV_TILE == 0 and splits * per >= 32768
    # A chunk of 2048 tokens: 136 tiles per kv head, no split.
    assert rp.plan_splits(1, 2048, 1, 8, 32, 128, 34816, 132, 2) == (1, 34816)
    # The workspace bound.
    splits, per = rp.plan_splits(1, 16384, 1, 1, 1, 256, 2 ** 20, 132, 2)
    assert splits * 16384 * 256 * 4 <= rp.MAX_WORKSPACE_BYTES and splits * per >= 2 ** 20
    # The grid: members x splits <= 65535; every split starts inside the table.
    for stacked, tokens in ((10000, 2 ** 22), (3, 2 ** 20), (1, 64), (1, 0)):
        splits, per = rp.plan_splits(stacked, 1, 1, 1, 1, 64, tokens, 132, 2)
        assert stacked * splits <= rp.MAX_GRID_Z and splits * per >= tokens
        assert (splits - 1) * per < max(tokens, 1) and per % rp.KV_TILE == 0


def test_plan_one_token_splits_is_the_decode_readers_plan():
    """The one-token sequences of a ragged call are planned as the decode reader plans a batch
    of max_num_seqs (so one token per sequence is that reader's launch); no sequence, no
    launch."""
    from jax_nvfp4 import attention_primitive as ap
    for stacked, seqs, kv, hq, tokens in ((1, 32, 8, 32, 8192), (1, 1, 8, 32, 32768),
                                          (2, 16, 2, 8, 1000)):
        assert rp.plan_one_token_splits(stacked, seqs, kv, hq, 128, tokens) == ap.decode_plan(
            stacked, seqs, kv, hq, 128, tokens)
    assert rp.plan_one_token_splits(1, 0, 8, 32, 128, 8192) == (0, 0, False)


# =============================================================================== GPU


def _gpu_cases():
    # (seed, seqs, head_size, layout, swizzle, block_size, kv heads, GQA ratio, q dtype)
    long = ((1100, 4), (900, 8), (2000, 1))             # drafts and decode over longer contexts
    chunk = ((700, 150), (300, 300), (64, 17))           # chunks, a prompt from scratch
    return [
        (21, MIXED, 128, "HND", True, 16, 2, 4, jnp.bfloat16),
        (22, MIXED, 128, "NHD", False, 12, 2, 4, jnp.float32),
        (23, MIXED, 64, "HND", False, 8, 1, 8, jnp.float16),
        (24, MIXED, 256, "NHD", True, 32, 2, 1, jnp.bfloat16),
        (25, long, 128, "HND", True, 16, 2, 4, jnp.bfloat16),
        (26, long, 64, "NHD", True, 16, 4, 2, jnp.float32),
        (27, chunk, 128, "HND", True, 16, 2, 4, jnp.bfloat16),
        (28, chunk, 256, "HND", False, 16, 1, 8, jnp.float16),
        (29, chunk, 64, "NHD", False, 12, 2, 1, jnp.float32),
    ]


GPU_CASES = _gpu_cases()
GPU_IDS = [f"s{c[0]}-d{c[2]}-{c[3]}-{'swz' if c[4] else 'lin'}-bs{c[5]}-r{c[7]}-"
           f"{np.dtype(c[8]).name}" for c in GPU_CASES]


@functools.lru_cache(maxsize=None)
def _gpu_case(index):
    seed, seqs, head_size, layout, swizzle, bs, kv, ratio, dtype = GPU_CASES[index]
    case = shared_case(seed, seqs, head_size=head_size, layout=layout, v_scale_swizzle=swizzle,
                       block_size=bs, num_kv_heads=kv)
    q = case.query(kv * ratio, dtype, seed=seed)
    ref = _cpu(case.run, q, return_lse=True)           # the jnp path, on the CPU
    return case, q, jax.device_get(ref)


def q_rounding_bound(case, q):
    """[T, Hq]: 2^-11 * sm_scale * max_t sum_d |q_d| |k_td| (float32 q; 0 otherwise)."""
    if np.dtype(q.dtype) != np.float32:
        return np.zeros(q.shape[:2])
    qa = np.abs(_f64(q))
    ks = np.abs(np.concatenate([k for k in case.case.k if len(k)]))
    kv = ks.shape[1]
    T, heads, head_size = qa.shape
    qa = qa.reshape(T, kv, heads // kv, head_size)
    top = np.stack([(qa[:, h] @ ks[:, h].T).max(axis=-1) for h in range(kv)], axis=1)
    return FP16_UNIT / np.sqrt(head_size) * top.reshape(T, heads)


def assert_kernel_matches_jnp(case, q, label):
    """The kernel on the GPU against the jnp path on the CPU: out and lse within the decode
    kernel's bounds (a bf16/fp16 q: no rounding term in the lse bound)."""
    ref, ref_lse = _cpu(case.run, q, return_lse=True)
    out, lse = ragged_jit(*jax.device_put(case.args(q), jax.devices("gpu")[0]), **case.options,
                          return_lse=True, impl="kernel")
    assert_out_close(jax.device_get(out), ref, q.dtype, roundings=2, label=label)
    assert_lse_close(jax.device_get(lse), ref_lse, KERNEL_LSE_ABS + q_rounding_bound(case, q))


@pytest.mark.gpu
@pytest.mark.parametrize("index", range(len(GPU_CASES)), ids=GPU_IDS)
def test_gpu_kernel_matches_jnp_path(index):
    case, q, (ref, ref_lse) = _gpu_case(index)
    gpu = jax.devices("gpu")[0]
    args = jax.device_put(case.args(q), gpu)
    out, lse = ragged_jit(*args, **case.options, return_lse=True, impl="kernel")
    out, lse = jax.device_get((out, lse))
    assert out.dtype == q.dtype and out.shape == q.shape
    assert_out_close(out, ref, q.dtype, roundings=2, label="ragged")
    assert_lse_close(lse, ref_lse, KERNEL_LSE_ABS + q_rounding_bound(case, q), label="ragged",
                     dtype=q.dtype)
    np.testing.assert_array_equal(out[case.token_ends() == 0], 0)


@pytest.mark.gpu
@pytest.mark.parametrize("index", [0, 4, 6])
def test_gpu_kernel_matches_float64(index):
    case, q, _ = _gpu_case(index)
    out = ragged_jit(*jax.device_put(case.args(q), jax.devices("gpu")[0]), **case.options,
                     impl="kernel")
    assert_out_close(jax.device_get(out), case.reference(q), q.dtype, roundings=1,
                     label="ragged_f64")


@pytest.mark.gpu
@pytest.mark.parametrize("head_size", [64, 128, 256])
def test_gpu_one_token_per_sequence_matches_the_decode_kernel(head_size):
    case = _cpu(Case, 31, lens=(1, 15, 16, 83, 700, 0, 40), num_kv_heads=2,
                head_size=head_size)
    batch = len(case.lens)
    q = case.query(8, jnp.bfloat16, seed=4)
    gpu = jax.devices("gpu")[0]
    tables, lens = jnp.asarray(case.tables), jnp.asarray(case.lens, jnp.int32)
    cu = jnp.arange(batch + 1, dtype=jnp.int32)
    args = jax.device_put((q, case.cache, tables, lens, cu, jnp.int32(batch), case.k_scale,
                           case.v_scale), gpu)
    out, lse = ragged_jit(*args, return_lse=True, impl="kernel")
    dec, dec_lse = paged_attention_jit(*jax.device_put((q, case.cache, tables, lens,
                                                        case.k_scale, case.v_scale), gpu),
                                       return_lse=True, impl="kernel")
    # The one-token sequences run on the decode kernel with the decode reader's plan: the
    # same launch, the same bits.
    np.testing.assert_array_equal(jax.device_get(out), jax.device_get(dec))
    np.testing.assert_array_equal(jax.device_get(lse), jax.device_get(dec_lse))


@pytest.mark.gpu
def test_gpu_mixed_batch_with_split_kv_on_both_kernels():
    """Drafts and decode tokens over long contexts: the ragged kernel and the decode kernel
    (which takes the one-token sequences) both split; the ragged merge leaves the one-token
    rows to the decode kernel, which writes them after it."""
    seqs = ((6000, 4), (5000, 1), (0, 1), (4100, 1), (300, 2))
    case = shared_case(43, seqs, head_size=128, pad_tokens=2)
    tables = len(case.tables)
    assert rp.plan_splits(1, case.num_tokens, tables, 2, 8, 128, case.capacity, 132, 2)[0] > 1
    assert rp.plan_one_token_splits(1, tables, 2, 8, 128, case.capacity)[0] > 1
    assert_kernel_matches_jnp(case, case.query(8, jnp.bfloat16, seed=5), "ragged_mixed_split")


@pytest.mark.gpu
def test_gpu_split_kv_plan_is_used_and_matches():
    """Four drafts of one sequence over 6000 positions: the plan splits; the result matches."""
    case = shared_case(41, ((6000, 4),), head_size=128, pad_tokens=2)
    assert rp.plan_splits(1, case.num_tokens, len(case.tables), 2, 8, 128,
                          case.capacity, 132, 2)[0] > 1
    assert_kernel_matches_jnp(case, case.query(8, jnp.bfloat16, seed=3), "ragged_split")


@pytest.mark.gpu
def test_gpu_invalid_layouts_follow_the_plan():
    """Decreasing cu_q_lens, num_seqs past max_num_seqs, a query count above seq_lens: the
    kernel gives every token the plan's result, like the jnp path."""
    case, q, _ = _gpu_case(0)
    cu = np.array(case.cu_q_lens)
    cu[2] = cu[1] - 2
    lens = np.array(case.seq_lens)
    lens[2] = 5                                   # 23 query tokens over 5 cached
    args = list(case.args(q, num_seqs=case.num_seqs + 5))
    args[4], args[3] = jnp.asarray(cu), jnp.asarray(lens)
    ref = _cpu(ragged_jit, *args, **case.options)
    out = ragged_jit(*jax.device_put(args, jax.devices("gpu")[0]), **case.options,
                     impl="kernel")
    assert_out_close(jax.device_get(out), jax.device_get(ref), q.dtype, roundings=2)


@pytest.mark.gpu
def test_gpu_vmap_stacked_layers_is_one_launch_and_matches():
    case, q, _ = _gpu_case(0)
    gpu = jax.devices("gpu")[0]
    args = jax.device_put(case.args(q), gpu)
    caches = jnp.stack([args[1], args[1]])
    qs = jnp.stack([args[0], 2 * args[0]])
    f = lambda q, c: nv.ragged_paged_attention(q, c, *args[2:], **case.options)  # noqa: E731
    both = jax.jit(jax.vmap(f))(qs, caches)
    text = jax.jit(jax.vmap(f)).lower(qs, caches).compile().as_text()
    assert text.count(f'custom_call_target="{rp.RAGGED_TARGET}"') == 1
    for i in range(2):
        np.testing.assert_array_equal(np.asarray(both[i]), np.asarray(jax.jit(f)(qs[i], args[1])))


@pytest.mark.gpu
def test_gpu_checked_and_dynamic_num_seqs():
    case, q, _ = _gpu_case(0)
    gpu = jax.devices("gpu")[0]
    traces = []

    def step(*args):
        traces.append(1)
        return nv.ragged_paged_attention(*args, **case.options, checked=True)

    checked = jax.jit(checkify.checkify(step))
    for ns in (case.num_seqs, 2):
        err, out = checked(*jax.device_put(case.args(q, num_seqs=ns), gpu))
        assert err.get() is None
    assert len(traces) == 1
    tables = np.array(case.tables)
    tables[1, 0] = -4
    args = list(case.args(q))
    args[2] = jnp.asarray(tables)
    err, _ = checked(*jax.device_put(args, gpu))
    assert "block_tables[1, 0]" in err.get()


@pytest.mark.gpu
@pytest.mark.parametrize("seed,seqs,kv,ratio,bs", [
    # 40 sequences: the tile scan runs more than once; decode, drafts and chunks mixed.
    (51, tuple((30 + 7 * i, (1, 4, 9, 0)[i % 4]) for i in range(40)), 2, 4, 16),
    (52, MIXED, 4, 3, 4),              # GQA 3 (rows of a tile split tokens), pages of 4
    (53, MIXED, 2, 6, 12),             # GQA 6
], ids=["s40", "gqa3-bs4", "gqa6-bs12"])
def test_gpu_more_sequences_groups_and_pages(seed, seqs, kv, ratio, bs):
    case = shared_case(seed, seqs, head_size=128, num_kv_heads=kv, block_size=bs)
    assert_kernel_matches_jnp(case, case.query(kv * ratio, jnp.bfloat16, seed=seed), "ragged")


def _pipelined_units(seqs, group, num_kv_heads):
    """The pipelined kernel's units of a batch: a pair of query tiles a kv head, for each
    sequence of more rows a kv head than the few-row kernel takes where the pipelined kernel
    runs (sm_90a code: ``FEW_ROWS_WIDE``)."""
    tiles = lambda rows: -(-rows // rp.ROWS_PER_CTA)  # noqa: E731
    return num_kv_heads * sum((tiles(q * group) + 1) // 2 for _, q in seqs
                              if q * group > rp.FEW_ROWS_WIDE)


@pytest.mark.gpu
@pytest.mark.parametrize("max_q_len", [None, 40])
def test_gpu_pipelined_units_past_the_sm_count(max_q_len):
    """More pipelined units than the GPU has SMs twice over (several waves of CTAs, one a
    unit; a persistent grid, as ragged v46 and v47 tried, would take several a CTA): every
    row matches the jnp path, and under a bound the longer sequences' rows are NaN, between
    units that attend. Stacked, a member with an invalid k_scale gives the jnp path's NaN rows
    in every unit of its own and leaves the other member's equal to its own call."""
    from jax_nvfp4 import attention_primitive as ap
    assert _pipelined_units(MANY_UNITS, 4, 8) >= 2 * ap._sm_count()
    case = shared_case(61, MANY_UNITS, head_size=128, num_kv_heads=8)
    q = case.query(32, jnp.bfloat16, seed=61)
    bound = {} if max_q_len is None else {"max_q_len": max_q_len}
    ref, ref_lse = _cpu(case.run, q, return_lse=True, **bound)
    gpu = jax.devices("gpu")[0]
    args = jax.device_put(case.args(q), gpu)
    out, lse = jax.device_get(ragged_jit(*args, **case.options, return_lse=True,
                                         impl="kernel", **bound))
    over = case.rows_over(max_q_len) if max_q_len else np.zeros(case.num_tokens, bool)
    if max_q_len:
        assert over.any() and np.isnan(out[over]).all() and np.isnan(lse[over]).all()
    assert_out_close(out[~over], ref[~over], q.dtype, roundings=2, label="ragged_units")
    assert_lse_close(lse[~over], ref_lse[~over], KERNEL_LSE_ABS, label="ragged_units",
                     dtype=q.dtype)
    np.testing.assert_array_equal(out[case.token_ends() == 0], 0)

    def member(q, cache, k_scale):
        return nv.ragged_paged_attention(q, cache, *args[2:6], k_scale, args[7],
                                         **case.options, **bound)

    k_scales = jnp.stack([jnp.float32(case.k_scale), jnp.float32(jnp.nan)])
    both = jax.device_get(jax.jit(jax.vmap(member))(
        jnp.stack([args[0], args[0]]), jnp.stack([args[1], args[1]]), k_scales))
    # Compared widened (_f64): NumPy's NaN-equals-NaN rule covers its own float types only, and
    # on the GPU machine's NumPy a bfloat16 NaN compared unequal to itself.
    np.testing.assert_array_equal(_f64(both[0]), _f64(out))
    invalid = _cpu(ragged_jit, *case.args(q)[:6], jnp.float32(jnp.nan), case.v_scale,
                   **case.options, **bound)
    assert np.isnan(both[1][case.token_ends() > 0]).all()
    np.testing.assert_array_equal(_f64(both[1]), _f64(invalid))


@pytest.mark.gpu
@pytest.mark.parametrize("ratio", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("head_size,layout,bs", [(128, "HND", 16), (64, "NHD", 12)])
def test_gpu_few_row_kernel_every_row_count(ratio, head_size, layout, bs):
    """Every sequence shape the few-row kernel takes (2 or more query tokens, at most 16 rows per
    kv head: one n-tile of 8 rows or two, full or partial), each over a context as short as its
    query tokens (the first row sees one position), one ending inside a chunk and one of
    several chunks; beside them a one-token sequence and one a token too long for the kernel."""
    most = 16 // ratio
    seqs = tuple((kv, q) for q in range(2, most + 1) for kv in (q, 37, 700))
    seqs += ((300, 1), (300, most + 1))
    case = shared_case(60 + ratio, seqs, head_size=head_size, layout=layout, num_kv_heads=2,
                       block_size=bs)
    q = case.query(2 * ratio, jnp.bfloat16, seed=ratio)
    assert_kernel_matches_jnp(case, q, f"few-rows-r{ratio}")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [jnp.float16, jnp.float32], ids=["f16", "f32"])
@pytest.mark.parametrize("seqs", [((1100, 4), (900, 8), (2000, 1)), ((40, 8),) * 48],
                         ids=["splits", "one-split"])
def test_gpu_wide_kernel_writes_every_q_type(seqs, dtype):
    """The wide path (17 to 32 rows per kv head: 8 tokens x GQA 4 at head size 128, sm_90a) with
    a 16-bit and a float32 q, where the deterministic cases above have bf16: its outputs in the
    call's type with one split (48 short sequences: the plan's one split, so the kernel writes
    out itself) and its float32 partials with split-KV (a few long contexts), unbound and under
    max_q_len (the wide kernel alone, the decode token's sequence included); against the jnp
    path."""
    if rp.few_rows_max(128) < 32:
        pytest.skip("this GPU or build has no wide path (sm_90a code)")
    case = shared_case(33, seqs, head_size=128, layout="HND", v_scale_swizzle=True,
                       block_size=16, num_kv_heads=2)
    q = case.query(8, dtype, seed=33)
    splits, _ = rp.plan_splits(1, case.num_tokens, len(case.tables), 2, 8, 128, case.capacity,
                               jax.devices("gpu")[0].core_count, rp._resident_ctas(128),
                               rp.few_rows_plan_ctas(True, 8, 8, 2, 128), alone=True,
                               few_rows=rp.few_rows_max(128))
    assert (splits == 1) == (len(seqs) == 48), splits
    ref, ref_lse = _cpu(case.run, q, return_lse=True)
    gpu = jax.device_put(case.args(q), jax.devices("gpu")[0])
    bound_q = q_rounding_bound(case, q)
    for max_q_len in (None, 8):
        out, lse = (jax.device_get(x) for x in ragged_jit(
            *gpu, **case.options, return_lse=True, impl="kernel", max_q_len=max_q_len))
        assert out.dtype == q.dtype and out.shape == q.shape
        label = f"wide-{np.dtype(dtype).name}-{max_q_len}"
        assert_out_close(out, ref, q.dtype, roundings=2, label=label)
        assert_lse_close(lse, ref_lse, KERNEL_LSE_ABS + bound_q, label=label, dtype=q.dtype)


@pytest.mark.gpu
def test_gpu_wide_kernel_negative_sm_scale():
    """The wide kernel under a negative sm_scale (a traced value: any sign; a negative k_scale
    is an invalid global scale, NaN rows on every path): the jnp path's attention over the
    negated scores, unbound and under max_q_len (the wide kernel alone); contexts of several
    steps and one ending mid-step."""
    if rp.few_rows_max(128) < 32:
        pytest.skip("this GPU or build has no wide path (sm_90a code)")
    case = shared_case(34, ((1100, 8), (900, 8), (300, 1), (45, 8)), head_size=128,
                       layout="HND", v_scale_swizzle=True, block_size=16, num_kv_heads=2)
    q = case.query(8, jnp.bfloat16, seed=34)
    sm_scale = -1.0 / np.sqrt(128)
    ref, ref_lse = _cpu(case.run, q, sm_scale=sm_scale, return_lse=True)
    gpu = jax.device_put(case.args(q), jax.devices("gpu")[0])
    for max_q_len in (None, 8):
        out, lse = (jax.device_get(x) for x in ragged_jit(
            *gpu, **case.options, sm_scale=sm_scale, return_lse=True, impl="kernel",
            max_q_len=max_q_len))
        label = f"wide-negative-sm-scale-{max_q_len}"
        assert_out_close(out, ref, q.dtype, roundings=2, label=label)
        assert_lse_close(lse, ref_lse, KERNEL_LSE_ABS, label=label, dtype=q.dtype)


@pytest.mark.gpu
@pytest.mark.parametrize("ratio,head_size,layout,bs", [(4, 128, "HND", 16), (2, 64, "NHD", 12),
                                                       (1, 128, "HND", 16), (8, 128, "NHD", 8)])
def test_gpu_max_q_len_few_row_kernel_alone(ratio, head_size, layout, bs):
    """A bound of max_q_len x the group at the few-row kernel's most rows (16; 32 at head size
    128 on an sm_90 GPU, its wgmma path): the few-row kernel alone serves drafts, one-token
    sequences, an empty sequence and the padding tokens, with split-KV (a few sequences over
    long contexts); against the jnp path. (Past 16 rows the wide kernel is launched alone and
    takes all of them, those of up to 16 rows too.) A bound one token short gives the longest
    sequences NaN rows, every other row unchanged."""
    few_rows = rp.few_rows_max(head_size)
    most = few_rows // ratio
    seqs = ((300, most), (37, 1), (1500, max(most - 1, 1)), (9, 0), (16, most), (700, 2))
    case = shared_case(70 + ratio, seqs, head_size=head_size, layout=layout, num_kv_heads=2,
                       block_size=bs, pad_tokens=70)
    q = case.query(2 * ratio, jnp.bfloat16, seed=ratio)
    assert rp.few_rows_only(most, 2 * ratio, 2, head_size, few_rows)
    splits, _ = rp.plan_splits(1, case.num_tokens, len(case.tables), 2, 2 * ratio, head_size,
                               case.capacity, jax.devices("gpu")[0].core_count,
                               rp._resident_ctas(head_size),
                               rp.few_rows_plan_ctas(True, most, 2 * ratio, 2, head_size),
                               alone=True, few_rows=few_rows)
    assert splits > 1                                   # the merge runs too
    ref, ref_lse = _cpu(case.run, q, return_lse=True)
    gpu = jax.device_put(case.args(q), jax.devices("gpu")[0])
    run = functools.partial(ragged_jit, *gpu, **case.options, return_lse=True, impl="kernel")
    out, lse = (jax.device_get(x) for x in run(max_q_len=most))
    assert_out_close(out, ref, q.dtype, roundings=2, label=f"alone-r{ratio}")
    assert_lse_close(lse, ref_lse, KERNEL_LSE_ABS)
    over = case.rows_over(most - 1)
    out, lse = (jax.device_get(x) for x in run(max_q_len=most - 1))
    assert np.isnan(out[over]).all() and np.isnan(lse[over]).all()
    assert_out_close(out[~over], np.asarray(ref)[~over], q.dtype, roundings=2)
    assert_lse_close(lse[~over], np.asarray(ref_lse)[~over], KERNEL_LSE_ABS)


@pytest.mark.gpu
def test_gpu_wide_rows_kernel_occupancy():
    """Where the few-row kernel takes 32 rows (head size 128 with sm_90a code), its wide path is
    a kernel of its own that fits 3 CTAs per SM (its launch bounds; with the 16-row path in one
    kernel it had 2), which a bounded call past 16 rows plans with; the 16-row kernel keeps 2."""
    if rp.few_rows_max(128) != rp.FEW_ROWS_WIDE:
        pytest.skip("no sm_90a code for this GPU: the few-row kernel takes 16 rows")
    assert rp._wide_rows_resident_ctas(128) == 3
    assert rp._few_rows_resident_ctas(128) == 2
    assert rp.few_rows_plan_ctas(True, 8, 32, 8, 128) == 3
    assert rp._wide_rows_resident_ctas(64) == rp._few_rows_resident_ctas(64)  # no wide path


@pytest.mark.gpu
def test_gpu_max_q_len_on_the_ragged_kernel():
    """A bound over the ragged kernel's tiles (the mixed batch): at the longest sequence the
    results are those without a bound, bit for bit; below it the longer sequences' rows are NaN
    (the ragged kernel's tiles and the few-row kernel's drafts), the rest unchanged."""
    case, q, _ = _gpu_case(0)
    gpu = jax.device_put(case.args(q), jax.devices("gpu")[0])
    run = functools.partial(ragged_jit, *gpu, **case.options, return_lse=True, impl="kernel")
    ref, ref_lse = (jax.device_get(x) for x in run())
    out, lse = (jax.device_get(x) for x in run(max_q_len=23))
    np.testing.assert_array_equal(out, ref)
    np.testing.assert_array_equal(lse, ref_lse)
    for bound in (11, 3):
        over = case.rows_over(bound)
        out, lse = (jax.device_get(x) for x in run(max_q_len=bound))
        assert np.isnan(out[over]).all() and np.isnan(lse[over]).all()
        np.testing.assert_array_equal(out[~over], ref[~over])
        np.testing.assert_array_equal(lse[~over], ref_lse[~over])


@pytest.mark.gpu
def test_gpu_vmap_per_member_tables_and_layouts():
    """vmap over stacked caches with each member's own block tables, lengths, offsets and
    num_seqs: one launch, each member equal to its own call."""
    a = shared_case(61, MIXED, head_size=64)
    b = shared_case(62, ((80, 3), (17, 17), (5, 1), (44, 9), (3, 0), (60, 30), (12, 2)),
                    head_size=64)
    gpu = jax.devices("gpu")[0]
    qa, qb = a.query(8, jnp.bfloat16, seed=1), b.query(8, jnp.bfloat16, seed=2)
    T = max(a.num_tokens, b.num_tokens)
    pad = lambda x: jnp.pad(x, ((0, T - x.shape[0]), (0, 0), (0, 0)))  # noqa: E731
    nb = max(a.cache.shape[0], b.cache.shape[0])
    cpad = lambda c: jnp.pad(c, ((0, nb - c.shape[0]),) + ((0, 0),) * 4)  # noqa: E731
    cols = max(a.tables.shape[1], b.tables.shape[1])
    tpad = lambda t: np.pad(t, ((0, 0), (0, cols - t.shape[1])), constant_values=-1)  # noqa: E731
    stack = lambda f: jnp.stack([jnp.asarray(f(a)), jnp.asarray(f(b))])  # noqa: E731
    args = (jnp.stack([pad(qa), pad(qb)]), stack(lambda c: cpad(c.cache)),
            stack(lambda c: tpad(c.tables)), stack(lambda c: c.seq_lens),
            stack(lambda c: c.cu_q_lens), jnp.asarray([a.num_seqs, b.num_seqs], jnp.int32),
            stack(lambda c: c.k_scale), stack(lambda c: c.v_scale))
    args = jax.device_put(args, gpu)
    f = jax.vmap(lambda *x: nv.ragged_paged_attention(*x, impl="kernel"))
    both = jax.jit(f)(*args)
    text = jax.jit(f).lower(*args).compile().as_text()
    assert text.count(f'custom_call_target="{rp.RAGGED_TARGET}"') == 1
    one = jax.jit(lambda *x: nv.ragged_paged_attention(*x, impl="kernel"))
    for i in range(2):
        member = one(*(x[i] for x in args))
        np.testing.assert_array_equal(np.asarray(both[i]), np.asarray(member))


def _long_nan_case():
    """Two long sequences (4 drafts over 6000, 2 over 5000: the plan splits them), a NaN key at
    position 3000 of the first (all its queries see it, in one split only) and a NaN query row
    (sequence 1's first token, head 2). Returns (case, cache, q, rows that must be NaN)."""
    case = shared_case(71, ((6000, 4), (5000, 2)), head_size=128, pad_tokens=2)
    cache = _with_nan_keys(case, ((0, 3000),))
    q = np.array(case.query(8, jnp.bfloat16, seed=3).astype(jnp.float32))
    q[case.starts[1], 2, 5] = np.nan
    nan_rows = np.zeros(q.shape[:2], bool)
    nan_rows[case.starts[0]:case.starts[1]] = True
    nan_rows[case.starts[1], 2] = True
    return case, cache, jnp.asarray(q, jnp.bfloat16), nan_rows


def _wide_nan_case():
    """Drafts of 8 and 6 tokens x GQA 4 (32 and 24 rows: the few-row kernel's wgmma path where
    it runs), a NaN key at position 700 of the second (its queries all see it) and a NaN query
    row (the first sequence's third token, head 5: every score of that row NaN). Returns (case,
    cache, q, rows that must be NaN)."""
    case = shared_case(72, ((3000, 8), (900, 6)), head_size=128, pad_tokens=2)
    cache = _with_nan_keys(case, ((1, 700),))
    q = np.array(case.query(8, jnp.bfloat16, seed=4).astype(jnp.float32))
    q[case.starts[0] + 2, 5, :] = np.nan
    nan_rows = np.zeros(q.shape[:2], bool)
    nan_rows[case.starts[1]:case.starts[2]] = True
    nan_rows[case.starts[0] + 2, 5] = True
    return case, cache, jnp.asarray(q, jnp.bfloat16), nan_rows


@pytest.mark.gpu
@pytest.mark.parametrize("make", [_nan_case, _long_nan_case, _wide_nan_case],
                         ids=["one-split", "split-kv", "wide"])
def test_gpu_nan_scores_give_nan_rows_and_nothing_else(make):
    """As on the CPU: exactly the rows that see a NaN key (or have a NaN query) are NaN, also
    when the long context is split across CTAs and merged; the other rows match the jnp path."""
    case, cache, q, nan_rows = make()
    if make is _long_nan_case:
        assert rp.plan_splits(1, case.num_tokens, len(case.tables), case.num_kv_heads,
                              8, 128, case.capacity, 132, 2)[0] > 1
    args = case.args(q, cache=cache)
    out = np.asarray(jax.device_get(ragged_jit(*jax.device_put(args, jax.devices("gpu")[0]),
                                               **case.options, impl="kernel")), np.float32)
    ref = np.asarray(_cpu(ragged_jit, *args, **case.options), np.float32)
    np.testing.assert_array_equal(np.isnan(ref).any(axis=-1), nan_rows)
    np.testing.assert_array_equal(np.isnan(out).any(axis=-1), nan_rows)
    assert_out_close(np.where(nan_rows[..., None], 0, out), np.where(nan_rows[..., None], 0, ref),
                     q.dtype, roundings=2)
