"""benchmarks/attention_bench.py: its --quick smoke run on the CPU, and the Pallas row's
GPU-only path checked without a GPU.

The smoke run is a subprocess (its own JAX, on the CPU backend) with a time limit, into a
temporary output folder: it prints the targets and the table last, writes the JSON (and the PNG
where matplotlib is installed) and reports the Pallas row skipped with its reason. About 20 s on
2 CPU cores. The Pallas tests check the call the benchmark makes on a GPU
(jax.experimental.pallas.ops.gpu.paged_attention) without one: its k_splits candidates against
the kernel's constraints, the call lowered for CUDA (Pallas's checks and its Triton lowering
run; XLA's GPU compiler does not), its pages against the bf16 row's, its output in Pallas's
interpreter (interpret=True) against the bf16 row's, and the row's choice of k_splits; about
17 s.
"""

import argparse
import functools
import importlib.util
import json
import math
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scripts import load_script, run_on_cpu

BENCH_PATH = "benchmarks/attention_bench.py"
TIME_LIMIT_S = 240  # a hang fails; the run itself takes about 20 s


@pytest.fixture(scope="module")
def bench():
    return load_script(BENCH_PATH, "attention_bench")


def test_attention_bench_quick(tmp_path):
    out = run_on_cpu(BENCH_PATH, "--quick", "--out", tmp_path, time_limit_s=TIME_LIMIT_S).stdout
    assert "sanity: kernel output finite" in out
    # On a CPU: said once, first; no GPU target evaluated (no PASS/FAIL); rows labelled by what
    # ran; the ceiling in its own units; where the files went.
    assert out.count("NOTE: this ran on cpu, not on a GPU: a smoke run.") == 1
    assert out.index("NOTE: this ran on cpu") < out.index("ceiling:")
    assert "Targets (kernel, NVFP4 bytes): not evaluated on cpu (GPU targets)" in out
    assert " FAIL" not in out and " PASS" not in out and "0.00 TB/s" not in out
    assert "nvfp4 kernel (impl=auto)" not in out
    pallas_why = ("GPU only: jax.experimental.pallas.ops.gpu.paged_attention lowers through "
                  "Triton; this is cpu")
    assert out.count(f"skip bf16 paged (Pallas): {pallas_why}") == 2  # once per point
    assert f"wrote {tmp_path / 'attention_bench.json'}, {tmp_path / 'attention_bench.md'}" in out
    if importlib.util.find_spec("matplotlib") is None:
        assert 'no plot: matplotlib is not installed' in out and '.[bench]' in out
    table = out[out.index("| point | method |"):]
    assert out.rstrip().endswith(table.rstrip())  # the table is printed last
    methods = ("nvfp4 jnp path (impl=auto: no kernel on cpu)", "nvfp4 jnp (impl=jnp)",
               "bf16 paged (jnp)",
               "dense dpa (", "chain glue (no attention)", "floor: NVFP4 bytes",
               "floor: bf16 bytes")
    for point in ("2x512", "ragged4"):
        rows = [line for line in table.splitlines() if line.startswith(f"| {point} |")]
        for method in methods:
            assert any(method in row for row in rows), (point, method, table)
    assert "Pallas" not in table

    result = json.loads((tmp_path / "attention_bench.json").read_text())
    assert {r["point"] for r in result["rows"]} == {"2x512", "ragged4"}
    assert {r["method"] for r in result["rows"]} == {"kernel", "jnp", "bf16", "dense", "glue"}
    # The Pallas row: skipped at every point, with its reason, never timed.
    assert [s for s in result["skipped"] if s["method"] == "pallas"] == [
        {"point": p, "method": "pallas", "why": pallas_why} for p in ("2x512", "ragged4")]
    for r in result["rows"]:
        # NaN where a chain difference never came out positive (the benchmarks' two-length
        # rule, store_bench._per_call): only the glue row's few tiny ops a call can be that
        # short against a loaded CPU's jitter (test_prefill_bench's glue row was, in CI once)
        assert len(r["chain_lengths"]) == 3
        assert r["us_per_call"] > 0 or (r["method"] == "glue" and np.isnan(r["us_per_call"])), r
        # and each method's longest chain under the profiler: its kernels' time a call
        assert r["kernels_us_per_call"] > 0, r
    header = table.splitlines()[0].split(" | ")
    assert header[4] == "kernels' µs / call (profiler)", header
    row = next(line for line in table.splitlines() if "chain glue" in line).split(" | ")
    glue = next(r for r in result["rows"] if r["method"] == "glue" and r["point"] == "2x512")
    assert row[4] == f"{glue['kernels_us_per_call']:.2f}", (row, glue)
    assert (tmp_path / "attention_bench.md").exists()
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "attention_bench.png").stat().st_size > 0


def test_full_grid_has_the_serving_points_in_order(bench):
    names = [p["name"] for p in bench.make_points(False, 0)]
    assert names == ["1x4096", "1x131072", "8x4096", "8x8192", "8x32768", "32x8192", "32x32768",
                     "64x1024", "128x1024", "128x4096", "ragged32"]  # by batch, then context


def test_points_off_the_grid_by_name(bench):
    """--points takes BxC and raggedN / raggedNxL off the grid: raggedN draws its lengths as the
    grid's ragged batch does (ragged32 is the grid's own), raggedNxL from 1..L; other names are
    none of these."""
    grid = {p["name"]: p for p in bench.make_points(False, 0)}
    for name in ("ragged32", "32x32768", "1x4096"):
        named, ours = bench.named_point(name, 0), grid[name]
        assert named.keys() == ours.keys()
        for key, value in ours.items():
            assert np.array_equal(named[key], value), (name, key)
    p = bench.named_point("3x1000", 0)
    assert (p["batch"], p["context"], p["tokens"]) == (3, 1000, 3000)
    assert p["pages"].tolist() == [63] * 3 and p["padded_tokens"] == 3 * 63 * 16
    assert p["nvfp4_bytes"] == 3 * 63 * 2 * 8 * 16 * 72 and p["bf16_bytes"] == 3000 * 8 * 128 * 4
    r = bench.named_point("ragged16x8192", 1)
    assert r["batch"] == 16 and 1 <= r["lens"].min() and r["lens"].max() <= 8192
    assert r["tokens"] == int(r["lens"].sum()) and r["context"] == int(r["lens"].max())
    assert not np.array_equal(r["lens"], bench.named_point("ragged16x8192", 2)["lens"])
    assert len(bench.named_point("ragged7", 0)["lens"]) == 7
    for bad in ("x4096", "0x4096", "4x0", "ragged", "ragged0", "ragged4x", "4096", "32x32768 "):
        assert bench.named_point(bad, 0) is None, bad


def test_unknown_points_are_refused_by_name(bench, capsys):
    with pytest.raises(SystemExit) as info:
        bench.main(["--quick", "--points", "2x512,nope,ragged0"])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "unknown point: nope, ragged0" in err and "raggedNxL" in err, err


def _is_power_of_2(n):
    return n > 0 and n & (n - 1) == 0


@pytest.mark.parametrize("candidates", [(1, 2, 4, 8, 16), (3, 5, 32, 64)])
def test_pallas_k_splits_meet_the_kernels_constraints(bench, candidates):
    """Every k_splits kept for a block table of any width meets Pallas's constraints (its
    paged_attention_unbatched's asserts and its Triton lowering's power-of-2 tiles) on the
    padded table, which holds the whole table, leaves no partition empty and pads less than
    one compute block per partition."""
    block = bench.PALLAS_PAGES_PER_COMPUTE_BLOCK
    grid = {int(p["pages"].max()) for quick in (True, False) for p in bench.make_points(quick, 0)}
    for max_blocks in sorted(set(range(1, 600)) | grid):
        kept = bench.pallas_k_splits(max_blocks, candidates)
        assert (1 in kept) == (1 in candidates)  # one partition always holds a page
        for k in kept:
            per_partition = bench.pallas_pages_per_partition(max_blocks, k)
            width = k * per_partition
            assert width >= max_blocks and width % k == 0, (max_blocks, k)
            compute_block = min(per_partition, block)
            assert per_partition % compute_block == 0, (max_blocks, k)
            tile = compute_block * bench.BLOCK_SIZE * bench.HEAD_SIZE  # K/V values loaded at once
            assert _is_power_of_2(tile), (max_blocks, k)
            assert (k - 1) * per_partition < max_blocks, (max_blocks, k)  # no empty partition
            assert per_partition - -(-max_blocks // k) < compute_block, (max_blocks, k)
        for k in set(candidates) - set(kept):  # left out only for an empty partition
            assert (k - 1) * bench.pallas_pages_per_partition(max_blocks, k) >= max_blocks
    if candidates == bench.PALLAS_K_SPLITS:  # the GPU tries every default at the full grid
        for p in bench.make_points(False, 0):
            assert bench.pallas_k_splits(int(p["pages"].max())) == list(candidates), p["name"]


# The GPU Pallas's Triton lowering targets. From jax 0.11 it takes the compute capability from
# the default device's kind, which here is the CPU (conftest), even on a GPU machine, and
# refuses to lower ("No supported GPU devices found": the H200, 2026-12-03); an abstract
# device names one. jax 0.10 ignores it and falls back to compute capability 9.0 itself.
_ABSTRACT_H200 = jax.sharding.AbstractMesh(
    (1,), ("lowering",), abstract_device=jax.sharding.AbstractDevice(
        device_kind="NVIDIA H200", num_cores=None, platform="cuda"))


def _lower_for_cuda(fn, *shapes):
    """StableHLO of fn for a CUDA GPU (an H200), lowered on this (CPU) machine: Pallas's
    asserts and its Triton lowering (the kernel's Triton IR) run; XLA's GPU compiler does
    not."""
    with jax.sharding.use_abstract_mesh(_ABSTRACT_H200):
        return jax.jit(fn).trace(*shapes).lower(lowering_platforms=("cuda",)).as_text()


def _pallas_shapes(bench, point):
    """Abstract inputs of one Pallas call at a grid point (nothing allocated)."""
    S = jax.ShapeDtypeStruct
    pages = S((bench.NUM_KV_HEADS, int(point["pages"].sum()), bench.BLOCK_SIZE,
               bench.HEAD_SIZE), jnp.bfloat16)
    return (S((point["batch"], bench.NUM_Q_HEADS, bench.HEAD_SIZE), jnp.bfloat16),
            S((point["batch"], int(point["pages"].max())), jnp.int32),
            S((point["batch"],), jnp.int32), {"k_pages": pages, "v_pages": pages})


def test_pallas_call_lowers_for_cuda_at_every_point(bench):
    """The benchmark's Pallas call at every grid point (full and quick) and every k_splits it
    tries there passes Pallas's checks and its Triton lowering, lowered for CUDA on the CPU: one
    Triton kernel per call, one program per kv head, partition and sequence; a chain of calls
    lowers too. Without the table's padding the ragged batch's odd width does not lower."""
    for quick in (True, False):
        for point in bench.make_points(quick, 0):
            shapes = _pallas_shapes(bench, point)
            for k in bench.pallas_k_splits(int(point["pages"].max())):
                text = _lower_for_cuda(bench.pallas_attn(k), *shapes)
                assert text.count("stablehlo.custom_call @__gpu$xla.gpu.triton") == 1, (point, k)
                grid = re.search(r"grid_x = (\d+) : i32, grid_y = (\d+) : i32, "
                                 r"grid_z = (\d+) : i32", text).groups()
                # One program per (kv head, partition, sequence); Triton's launch grid may
                # order them otherwise (a batch of 1 comes last).
                assert math.prod(map(int, grid)) == bench.NUM_KV_HEADS * k * point["batch"]
    point = next(p for p in bench.make_points(False, 0) if p["name"] == "ragged32")
    q, table, lens, arrays = _pallas_shapes(bench, point)
    assert table.shape[1] % bench.PALLAS_PAGES_PER_COMPUTE_BLOCK  # an odd width: needs padding
    chain = bench.chain_program(bench.make_step(bench.pallas_attn(4)), 3)
    qs, tables = (jax.ShapeDtypeStruct((3, *x.shape), x.dtype) for x in (q, table))
    assert "__gpu$xla.gpu.triton" in _lower_for_cuda(chain, q, qs, tables, lens, arrays)
    from jax.experimental.pallas.ops.gpu import paged_attention as pallas_paged
    with pytest.raises((AssertionError, ValueError)):  # pages_per_partition not whole blocks
        _lower_for_cuda(functools.partial(pallas_paged.paged_attention, k_splits=1),
                        q, arrays["k_pages"], arrays["v_pages"], table, lens)


def _quick_inputs(bench, methods, name="ragged4"):
    point = next(p for p in bench.make_points(True, 0) if p["name"] == name)
    return point, bench.make_inputs(point, methods, 2, jax.random.key(3))


def test_pallas_pages_hold_the_bf16_rows_values(bench):
    """k_pages[h, p, t, d] == k_bf16[p, t, h, d], element by element, and the Pallas row's pages
    do not depend on whether the bf16 row runs."""
    _, both = _quick_inputs(bench, ["bf16", "pallas"])
    _, alone = _quick_inputs(bench, ["pallas"])
    assert "k_bf16" not in alone["arrays"]
    for side in "kv":
        pages = np.asarray(both["arrays"][f"{side}_pages"])
        bf16 = np.asarray(both["arrays"][f"{side}_bf16"])
        num_blocks, block_size, num_kv_heads, head_size = bf16.shape
        assert pages.shape == (num_kv_heads, num_blocks, block_size, head_size)
        assert pages.dtype == bf16.dtype == jnp.bfloat16
        for h in range(num_kv_heads):
            for p in range(num_blocks):
                for t in range(block_size):
                    assert (pages[h, p, t] == bf16[p, t, h]).all(), (side, h, p, t)
        np.testing.assert_array_equal(np.asarray(alone["arrays"][f"{side}_pages"]), pages)


def _first_outputs(bench, attn, inputs, lens=None):
    q, table = inputs["qs"][0], inputs["tables"][0]
    lens = inputs["lens"] if lens is None else lens
    return np.asarray(jax.jit(attn)(q, table, lens, inputs["arrays"]).astype(jnp.float32))


@pytest.mark.parametrize("name", ["2x512", "ragged4"])
def test_pallas_reads_what_the_bf16_row_reads(bench, name):
    """The benchmark's Pallas call (q scaled, table padded) in Pallas's interpreter, at every
    k_splits kept for the point, against the bf16 row over the same values, q and block table
    (random page order; ragged lengths): within the benchmark's sanity tolerance; one token
    left out of every sequence is not."""
    point, inputs = _quick_inputs(bench, ["bf16", "pallas"], name)
    ref = _first_outputs(bench, bench.bf16_attn, inputs)
    k_splits = bench.pallas_k_splits(int(point["pages"].max()))
    assert len(k_splits) >= 3
    for k in k_splits:
        out = _first_outputs(bench, bench.pallas_attn(k, interpret=True), inputs)
        assert bench._rel_err(out, ref) < bench.PALLAS_SANITY_TOLERANCE, k  # measured < 4.1e-3
    short = _first_outputs(bench, bench.pallas_attn(1, interpret=True), inputs,
                           inputs["lens"] - 1)
    assert bench._rel_err(short, ref) > bench.PALLAS_SANITY_TOLERANCE  # measured >= 3.2e-2


def test_pallas_row_on_a_gpu_picks_the_fastest_k_splits(bench, monkeypatch):
    """run_point's GPU path of the Pallas row, on the CPU: the platform check says GPU and the
    call runs in Pallas's interpreter. Each k_splits is started and timed briefly, the fastest
    one is the row (its k_splits in the label and the row), timed in two rounds, and the sanity
    check compares it with the bf16 row."""
    monkeypatch.setattr(bench.store_bench, "on_gpu", lambda: True)
    monkeypatch.setattr(bench, "pallas_attn", functools.partial(bench.pallas_attn,
                                                                interpret=True))
    point = next(p for p in bench.make_points(True, 0) if p["name"] == "ragged4")
    args = argparse.Namespace(only=["bf16", "pallas"], pallas_k_splits=[1, 4, 64], repeats=1,
                              target_seconds=0.0, max_chain=3, min_chain=3, max_chain_jnp=16,
                              max_chain_dense=64, step_layers=0, profiler=False)
    lines = []
    rows, skipped = bench.run_point(point, args, 1e9, 1 << 40, jax.random.key(0), lines.append)
    assert skipped == []
    assert all(r["kernels_us_per_call"] is None for r in rows)  # --no-profiler
    (row,) = [r for r in rows if r["method"] == "pallas"]
    tried = {bench.pallas_label(k) for k in (1, 4)}  # 64 leaves partitions empty: not tried
    assert set(row["variants_us"]) == tried
    assert row["label"] == bench.pallas_label(row["k_splits"]) and row["label"] in tried
    assert row["variants_us"][row["label"]] == min(row["variants_us"].values())
    assert len(row["chain_lengths"]) == 3 and row["us_per_call"] >= 0
    assert row["bytes"] == point["bf16_bytes"]
    bench.add_speedups(rows)
    (bf16,) = [r for r in rows if r["method"] == "bf16"]
    if row["us_per_call"] > 0 and bf16["us_per_call"] > 0:  # a CPU's jitter can give 0
        assert row["vs_bf16"] == bf16["us_per_call"] / row["us_per_call"]
    log = "\n".join(lines)
    assert f"(brief): keeping {row['label']}" in log
    (err,) = re.findall(r"sanity: \|pallas - bf16\| / \|bf16\| = (\S+)", log)
    assert float(err) < bench.PALLAS_SANITY_TOLERANCE and "WARNING" not in log


# ---------------------------------------------------------------------------------------------
# The decode-step mode (--step-layers L).


def test_attention_bench_step_quick(tmp_path):
    """--step-layers 2 --quick on the CPU: every method's step timed at both quick points (Pallas
    skipped as in the attention mode), rows labelled as steps, the bytes of a step (2 layers'
    reads and the new tokens' cache bytes), the targets left to a GPU, its own output files."""
    out = run_on_cpu(BENCH_PATH, "--quick", "--step-layers", "2", "--out", tmp_path,
                     time_limit_s=TIME_LIMIT_S).stdout
    assert "decode-step mode: a call is one step of 2 layers" in out
    assert ("Targets (decode step of 4 layers, NVFP4 against dense cuDNN): not evaluated on cpu "
            "(GPU targets)") in out
    assert "sanity: kernel output finite" in out and "WARNING" not in out
    assert (f"wrote {tmp_path / 'attention_bench_step.json'}, "
            f"{tmp_path / 'attention_bench_step.md'}") in out
    table = out[out.index("| point | method |"):]
    assert "| µs / step |" in table and "one step of 2 layers" in out
    for point in ("2x512", "ragged4"):
        rows = [line for line in table.splitlines() if line.startswith(f"| {point} |")]
        for method in ("nvfp4 step: store + jnp path (impl=auto: no kernel on cpu)",
                       "nvfp4 step: store + jnp read (impl=jnp)",
                       "bf16 paged step: scatter + jnp read", "dense step: scatter + dpa (",
                       "step glue (no store, no attention)", "floor: NVFP4 bytes"):
            assert any(method in row for row in rows), (point, method, table)
    result = json.loads((tmp_path / "attention_bench_step.json").read_text())
    assert result["config"]["step_layers"] == 2 and result["targets"] == []
    assert {r["method"] for r in result["rows"]} == {"kernel", "jnp", "bf16", "dense", "glue"}
    points = {p["name"]: p for p in result["points"]}
    assert set(points) == {"2x512", "ragged4"}
    for r in result["rows"]:
        assert r["layers"] == 2 and len(r["chain_lengths"]) == 3
        assert r["us_per_call"] > 0 or (r["method"] == "glue" and np.isnan(r["us_per_call"])), r
        p = points[r["point"]]
        if r["method"] == "glue":
            assert r["bytes"] is None
            continue
        kind = "nvfp4" if r["method"] in ("kernel", "jnp") else "bf16"
        per_token = 2 * 8 * (72 if kind == "nvfp4" else 256)
        assert p[f"{kind}_store_bytes"] == p["batch"] * per_token
        assert r["bytes"] == 2 * (p[f"{kind}_bytes"] + p[f"{kind}_store_bytes"]), r


def test_step_grid_is_the_serving_points(bench):
    names = [p["name"] for p in bench.make_points(False, 0, step=True)]
    assert names == ["1x4096", "8x4096", "64x1024", "8x8192", "32x8192"]
    assert set(bench.STEP_TARGET_VS_DENSE) == set(names)
    assert [p["name"] for p in bench.make_points(True, 0, step=True)] == ["2x512", "ragged4"]


def test_last_slots_are_the_last_positions(bench):
    table = np.array([[7, 3, 9], [2, 5, 0], [4, 1, 6]], np.int32)
    lens = np.array([33, 16, 1], np.int32)  # pages 2, 0, 0; rows 0, 15, 0
    slots = np.asarray(bench.last_slots(jnp.asarray(table), jnp.asarray(lens)))
    assert slots.tolist() == [9 * 16 + 0, 2 * 16 + 15, 4 * 16 + 0]


def _dense_variant(bench):
    """A dense attention that runs on the CPU (XLA's), with the ragged lengths masked."""
    variants = [v for v in bench.dense_variants(True) if v[0] != "cudnn"]
    return variants[0]


@pytest.mark.parametrize("key", ["kernel", "bf16", "dense", "pallas"])
def test_decode_step_stores_then_attends(bench, key):
    """One decode step of 2 layers through the benchmark's Method, against its parts called
    directly: each layer's own caches (copies: the inputs' stay alive) hold the new token (the
    query's first 2 x num_kv_heads heads) at each sequence's last position and nothing else
    changed, byte for byte; the output is the reader's over the stored caches (every layer
    stores the same token, so the second layer's output is the first's)."""
    point, inputs = _quick_inputs(bench, [key], "ragged4")
    attn = {"kernel": bench.nvfp4_attn("jnp"), "bf16": bench.bf16_attn,
            "dense": bench.dense_attn(*_dense_variant(bench)),
            "pallas": bench.pallas_attn(1, interpret=True)}[key]
    arrays = inputs["arrays"]
    q, table, lens = inputs["qs"][0], inputs["tables"][0], inputs["lens"]
    k, v = q[:, :bench.NUM_KV_HEADS], q[:, bench.NUM_KV_HEADS:2 * bench.NUM_KV_HEADS]
    slots = np.asarray(bench.last_slots(table, lens))
    before = {name: np.asarray(arrays[name]) for name in bench._CACHES[key]}
    stored = jax.jit(bench.STORES[key])(k, v, {n: arrays[n] for n in before}, jnp.asarray(slots),
                                        lens, arrays)
    # The store against numpy: the token's rows where they belong, the rest unchanged (the
    # NVFP4 store is the library's own, tested in tests/test_store.py: here the same call).
    if key == "kernel":
        import jax_nvfp4

        want = jax_nvfp4.reshape_and_cache(k, v, arrays["nvfp4"], jnp.asarray(slots),
                                           arrays["k_scale"], arrays["v_scale"], layout="HND",
                                           v_scale_swizzle=True)
        np.testing.assert_array_equal(np.asarray(stored["nvfp4"]), np.asarray(want))
        assert (np.asarray(want) != before["nvfp4"]).any()
    else:
        lens_np, bs = np.asarray(lens), bench.BLOCK_SIZE
        for cache, x in zip(bench._CACHES[key], (np.asarray(k), np.asarray(v))):
            want = before[cache].copy()
            for b, slot in enumerate(slots):
                if key == "bf16":
                    want[slot // bs, slot % bs] = x[b]
                elif key == "pallas":
                    want[:, slot // bs, slot % bs] = x[b]
                else:
                    want[b, lens_np[b] - 1] = x[b]
            assert (want != before[cache]).any()
            np.testing.assert_array_equal(np.asarray(stored[cache]), want)
    expected = np.asarray(jax.jit(attn)(q, table, lens, {**arrays, **stored}).astype(jnp.float32))

    method = bench.Method(key, "step", attn, inputs, layers=2)
    try:
        method.start()
        out, caches = method.carry  # the fourth call's: the same token stored again, same output
        assert len(caches) == 2
        for layer in caches:
            for name in before:
                np.testing.assert_array_equal(np.asarray(layer[name]), np.asarray(stored[name]))
        np.testing.assert_allclose(method.first_out, expected, rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(np.asarray(out.astype(jnp.float32)), expected, rtol=1e-5,
                                   atol=1e-6)
        for name in before:  # the inputs' caches were copied, not donated
            assert not arrays[name].is_deleted()
            np.testing.assert_array_equal(np.asarray(arrays[name]), before[name])
    finally:
        method.close()


def test_step_targets(bench):
    """The step targets from rows: dense cuDNN's time over the NVFP4 step's against each
    point's ratio, PASS / FAIL, not run without a row or a cuDNN dense row, and only for steps of
    STEP_TARGET_LAYERS layers."""
    def row(point, method, us, label="x"):
        return {"point": point, "method": method, "us_per_call": us, "spread_pct": 1.0,
                "label": label}
    rows = [row("1x4096", "kernel", 50.0), row("1x4096", "dense", 60.0, "dense step (cudnn)"),
            row("8x4096", "kernel", 100.0), row("8x4096", "dense", 150.0, "dense step (cudnn)"),
            row("64x1024", "kernel", 100.0), row("64x1024", "dense", 500.0, "dense step (xla)")]
    points = [bench.named_point(name, 0) for name in ("1x4096", "8x4096", "64x1024")]
    result = {"rows": rows, "points": points,
              "config": {"step_layers": bench.STEP_TARGET_LAYERS}}
    checks = {c["point"]: c for c in bench.evaluate_targets(result)}
    assert checks["1x4096"]["status"] == "PASS" and checks["1x4096"]["value"] == "1.20x"
    # 4 layers of 4.7 MB of pages fit a 50 MB L2 cache; 4 of 37.7 MB do not
    assert checks["1x4096"]["note"] == "the 4 layers' NVFP4 pages (19 MB) fit the L2 cache"
    assert checks["8x4096"]["status"] == "FAIL" and checks["8x4096"]["value"] == "1.50x"
    assert "note" not in checks["8x4096"]
    assert checks["64x1024"]["status"].startswith("not run") and "not cuDNN" in \
        checks["64x1024"]["status"]
    assert checks["32x8192"]["status"] == "not run"
    result["config"]["step_layers"] = 2
    assert all(c["status"].startswith("not run (the targets are for 4 layers)")
               for c in bench.evaluate_targets(result))


def test_kernel_targets_are_issue_18s(bench):
    """The kernel's targets from rows: 1 x 4096 by its time (<= 6 us), the serving points and
    128 x 1024 at >= 60% of the ceiling (the NVFP4 bytes floor over the time), the long points at
    >= 75%, the ragged batch by its floor; PASS / FAIL at the boundary, not run without a row."""
    def row(point, us, pct=None, x_floor=None):
        return {"point": point, "method": "kernel", "us_per_call": us, "spread_pct": 1.0,
                "pct_ceiling": pct, "x_floor": x_floor}
    rows = [row("1x4096", 6.0, 8.0), row("8x4096", 30.0, 59.9), row("64x1024", 30.0, 60.0),
            row("32x8192", 100.0, 74.0), row("32x32768", 380.0, 75.0),
            row("ragged32", 200.0, 50.0, 1.31)]
    result = {"rows": rows, "points": [], "config": {"step_layers": 0}}
    checks = {c["point"]: c for c in bench.evaluate_targets(result)}
    assert checks["1x4096"] == {"point": "1x4096", "target": "<= 6 us a call",
                                "value": "6.00 us", "status": "PASS", "within_noise": True}
    assert checks["8x4096"]["status"] == "FAIL" and checks["8x4096"]["target"] == \
        ">= 60% of ceiling"
    assert checks["64x1024"]["status"] == "PASS"
    assert checks["32x8192"]["status"] == "FAIL" and checks["32x8192"]["target"] == \
        ">= 75% of ceiling"
    assert checks["32x32768"]["status"] == "PASS"
    assert checks["ragged32"]["status"] == "FAIL" and checks["ragged32"]["value"] == "1.31x"
    for name in ("128x1024", "8x8192", "8x32768", "128x4096", "1x131072"):
        assert checks[name]["status"] == "not run"
    assert set(checks) == {*bench.TARGET_US, *bench.TARGET_PCT, "ragged32"}
    rows[0]["us_per_call"] = 6.5
    assert {c["point"]: c for c in bench.evaluate_targets(result)}["1x4096"]["status"] == "FAIL"


def test_time_targets_give_the_profilers_kernels_beside_the_verdict(bench):
    """A time target's line says the call's kernels' device time (the profiler's) and the
    chain glue's share where the rows have them; the verdict stays the chain's time."""
    kernel = {"point": "1x4096", "method": "kernel", "us_per_call": 14.5, "spread_pct": 1.0,
              "pct_ceiling": 10.0, "x_floor": 9.0, "kernels_us_per_call": 12.25}
    glue = {"point": "1x4096", "method": "glue", "us_per_call": 2.6, "spread_pct": 1.0,
            "pct_ceiling": None, "x_floor": None, "kernels_us_per_call": 1.5}
    result = {"rows": [kernel, glue], "points": [], "config": {"step_layers": 0}}
    check = {c["point"]: c for c in bench.evaluate_targets(result)}["1x4096"]
    assert check["status"] == "FAIL" and check["value"] == "14.50 us"
    assert check["note"] == "profiler: 12.25 us of kernels a call, 1.50 of them the chain's glue"
    result = {"rows": [{**kernel, "kernels_us_per_call": None}, glue], "points": [],
              "config": {"step_layers": 0}, "platform": "gpu"}
    result["targets"] = bench.evaluate_targets(result)
    assert "note" not in {c["point"]: c for c in result["targets"]}["1x4096"]
    result["rows"] = [kernel]  # no glue row: the kernels' time alone
    result["targets"] = bench.evaluate_targets(result)
    assert {c["point"]: c for c in result["targets"]}["1x4096"]["note"] == \
        "profiler: 12.25 us of kernels a call"
    assert "(profiler: 12.25 us of kernels a call)" in bench.targets_text(result)


def _time_round_with(bench, monkeypatch, times, lengths=(2, 5, 8)):
    """Method.time_round over chains of ``lengths`` whose timed runs return ``times`` in turn;
    the timer replaced, nothing compiled or run. Returns (seconds per call, the method)."""
    calls = iter(times)
    monkeypatch.setattr(bench.store_bench, "_time_program",
                        lambda fn, state, args, repeats: (next(calls), state))
    inputs = {"qs": None, "tables": None, "lens": None, "arrays": {}}
    method = bench.Method("glue", "x", bench.glue_attn, inputs)
    return method.time_round(lengths, repeats=1), method


def test_time_round_measures_a_non_positive_difference_again(bench, monkeypatch):
    """The benchmarks' one rule (store_bench._per_call): a longest chain that ran no longer than
    the shortest (a loaded host) is timed again, and NaN if it never runs longer, never 0."""
    per_call, method = _time_round_with(bench, monkeypatch, [1.0, 1.2, 0.9, 1.0, 1.3, 1.6])
    assert per_call == pytest.approx((1.6 - 1.0) / 6) and method.rounds == [per_call]
    assert method.linearity == pytest.approx((0.3 / 3) / (0.3 / 3))
    per_call, method = _time_round_with(bench, monkeypatch, [1.0, 1.0, 0.9] * 3)
    assert math.isnan(per_call) and math.isnan(method.rounds[0])
    per_call, _ = _time_round_with(bench, monkeypatch, [1.0, 1.4], lengths=(2, 8))
    assert per_call == pytest.approx(0.4 / 6)


def test_decode_step_layers_apart_dependent_and_donated(bench):
    """The step's carry (the caches of every layer) is donated; each layer stores into its own
    caches (layers given different starting caches end as a store into each one's own); and
    each layer's K/V come from the layer before's output: a NaN previous output makes every
    layer's stored token NaN (a float times 0 is not folded away)."""
    point, inputs = _quick_inputs(bench, ["bf16"], "ragged4")
    arrays = inputs["arrays"]
    method = bench.Method("bf16", "step", bench.bf16_attn, inputs, layers=2)
    q, table, lens = inputs["qs"][0], inputs["tables"][0], inputs["lens"]
    k, v = q[:, :bench.NUM_KV_HEADS], q[:, bench.NUM_KV_HEADS:2 * bench.NUM_KV_HEADS]
    slots = bench.last_slots(table, lens)
    starts = [{name: arrays[name] + layer for name in ("k_bf16", "v_bf16")} for layer in (0, 1)]
    want = [jax.jit(bench.bf16_store)(k, v, start, slots, lens, arrays) for start in starts]
    one = method.program(1)
    carry = (jnp.zeros(q.shape, q.dtype), tuple({n: jnp.copy(x) for n, x in start.items()}
                                                 for start in starts))
    out, caches = one(carry, *method.args)
    assert all(x.is_deleted() for x in jax.tree_util.tree_leaves(carry))  # donated
    for layer, cache in enumerate(caches):
        for name in cache:
            np.testing.assert_array_equal(np.asarray(cache[name]), np.asarray(want[layer][name]))
    nan_prev = jnp.full(q.shape, jnp.nan, q.dtype)
    _, caches = one((nan_prev, caches), *method.args)
    rows = np.asarray(slots)
    bs = bench.BLOCK_SIZE
    for cache in caches:
        for name in cache:
            stored = np.asarray(cache[name].astype(jnp.float32))[rows // bs, rows % bs]
            assert np.isnan(stored).all(), name
    free = bench.free
    free(caches)
    free(starts)
    free(want)


def test_store_calls_counts_one_store_a_layer(bench):
    """The kernel row's sanity line on a GPU counts the store calls in the compiled HLO: the
    same count on the CPU's (the C++ store under the same FFI target), one a layer a call."""
    _, inputs = _quick_inputs(bench, ["kernel"], "2x512")
    method = bench.Method("kernel", "step", bench.nvfp4_attn("jnp"), inputs, layers=3)
    try:
        method.start(check_hlo=True)
        assert bench.store_calls(method.lowered_text) == 3
    finally:
        method.close()
