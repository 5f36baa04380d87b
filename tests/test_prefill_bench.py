"""benchmarks/prefill_bench.py: its --quick smoke run on the CPU, and its accounting (FLOPs, the
bytes of a shared prefix counted once) and causal masking checked against direct computations.

The smoke run is a subprocess (its own JAX, on the CPU backend) with a time limit, into a
temporary folder: about 50 s on 2 CPU cores; the other tests take a few seconds.
"""

import importlib.util
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scripts import load_script, run_on_cpu

BENCH_PATH = "benchmarks/prefill_bench.py"
TIME_LIMIT_S = 300  # a hang fails; the run itself takes about 50 s
QUICK_POINTS = ("chunked1x32", "chunked2x16", "prefix2x16", "spec2x4", "spec2x8", "mixed2+2x16")


@pytest.fixture(scope="module")
def bench():
    return load_script(BENCH_PATH, "prefill_bench")


def _run_quick(out_dir):
    return run_on_cpu(BENCH_PATH, "--quick", "--out", out_dir, time_limit_s=TIME_LIMIT_S).stdout


def test_prefill_bench_quick(tmp_path):
    out = _run_quick(tmp_path)
    assert out.count("NOTE: this ran on cpu, not on a GPU: a smoke run.") == 1
    assert "Targets (ragged_paged_attention): not evaluated on cpu (GPU targets)" in out
    assert "missed" not in out and "0.00 TB/s" not in out
    assert "decode kernel (paged_attention)" not in out and "ragged nvfp4 (impl=auto)" not in out
    assert f"wrote {tmp_path / 'prefill_bench.json'}, {tmp_path / 'prefill_bench.md'}" in out
    table = out[out.index("| point | bound | method |"):]
    assert out.rstrip().endswith(table.rstrip())  # the table is printed last
    for point in QUICK_POINTS:
        rows = [line for line in table.splitlines() if line.startswith(f"| {point} |")]
        for label in ("ragged nvfp4 jnp path (impl=auto: no kernel on cpu)", "exact causal",
                      "no mask over the same",
                      "chain glue", "floor: NVFP4 pages", "floor: FLOPs"):
            assert any(label in row for row in rows), (point, label, table)

    result = json.loads((tmp_path / "prefill_bench.json").read_text())
    assert [p["name"] for p in result["points"]] == list(QUICK_POINTS)
    expected = {"ragged", "dense", "dense_nc", "glue"}
    for p in result["points"]:
        methods = {r["method"] for r in result["rows"] if r["point"] == p["name"]}
        extra = {"spec": {"decode", "ragged_bound"},
                 "mixed": {"part_decode", "part_chunks", "parts"}}
        assert methods == expected | extra.get(p["kind"], set()), (p["name"], methods)
        # The exact dense attention over the same (dequantised) values agrees with the jnp path
        # (bf16 K/V, outputs and lse: ~5e-3); a mask one position off would be ~1e-2 or more.
        assert p["sanity"]["ragged_vs_dense"] < 1.5e-2, p
    mixed = next(p for p in result["points"] if p["kind"] == "mixed")
    assert mixed["sanity"]["ragged_vs_parts"] < 1e-6  # the jnp paths agree bit for bit
    # Each row's kernels' time a call from a profiler trace of its longest chain (the parts row:
    # its two parts' summed), the table's last column
    for r in result["rows"]:
        assert r["kernels_us_per_call"] > 0, r
    (parts,) = [r for r in result["rows"] if r["method"] == "parts"]
    assert parts["kernels_us_per_call"] == pytest.approx(
        sum(r["kernels_us_per_call"] for r in result["rows"] if r["method"].startswith("part_")))
    header = table.splitlines()[0].strip("| ").split(" | ")
    assert header[-1] == "kernels' µs / call (profiler)", header
    for r in result["rows"]:
        # The benchmarks' two-length rule (store_bench._per_call): a chain difference that is
        # never positive gives NaN, never 0 or below. On a loaded CPU that can happen to the glue
        # row (a few tiny ops a call; it did in CI once); the attention rows are long enough to
        # time, so they must come out positive.
        if r["method"] == "glue" and np.isnan(r["us_per_call"]):
            assert np.isnan(r["spread_pct"]) and r["tflops"] is None and r["pct_floor"] is None
            continue
        assert r["us_per_call"] > 0, r
        if r["method"] != "parts":
            assert len(r["chain_lengths"]) == 3
        if r["method"] != "glue":
            assert r["flops"] > 0
        assert r["spread_pct"] >= 0
        if r["method"] != "glue":
            assert r["tflops"] is not None and r["pct_floor"] is not None
    ragged = {r["point"]: r for r in result["rows"] if r["method"] == "ragged"}
    for name in QUICK_POINTS:
        assert ragged[name]["vs_dense"] is not None
    for name in ("spec2x4", "spec2x8", "mixed2+2x16"):
        assert ragged[name]["x_ref"] is not None
    bound = {r["point"]: r for r in result["rows"] if r["method"] == "ragged_bound"}
    assert set(bound) == {"spec2x4", "spec2x8"}
    for r in bound.values():   # the same call told its longest query: the same values
        assert "max_q_len = q" in r["label"] and r["x_ref"] is not None
    assert result["targets"] == []            # GPU targets: test_targets_from_rows checks them
    assert (tmp_path / "prefill_bench.md").read_text().startswith("Targets")
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "prefill_bench.png").stat().st_size > 0


def test_mask_and_positions(bench):
    for q_len, kv_len in ((1, 1), (1, 9), (4, 4), (3, 10), (16, 40)):
        mask = bench.bottom_right_mask(q_len, kv_len)
        direct = np.zeros((q_len, kv_len), bool)
        for i in range(q_len):  # query i is at position kv_len - q_len + i
            for j in range(kv_len):
                direct[i, j] = j <= kv_len - q_len + i
        np.testing.assert_array_equal(mask, direct)
        assert mask.sum() == bench.attended_positions(q_len, kv_len)


def test_flops_and_bytes(bench):
    page = 2 * bench.NUM_KV_HEADS * bench.BLOCK_SIZE * 72  # both sides, 8 heads, 16 tokens
    per_position = 4 * bench.HEAD_SIZE * bench.NUM_Q_HEADS
    p = bench.make_point("t", "mixed", [(2, 1, 40), (3, 5, 37)], 0)
    positions = 2 * 40 + 3 * sum(37 - 5 + j + 1 for j in range(5))
    assert p["work"]["flops"] == per_position * positions
    assert p["work"]["unique_pages"] == 2 * 3 + 3 * 3 and p["num_blocks"] == 15
    assert p["work"]["nvfp4_bytes"] == 15 * page
    assert p["groups"] == [{"rows": (0, 2), "tokens": (0, 2), "q_len": 1, "seq_len": 40},
                           {"rows": (2, 5), "tokens": (2, 17), "q_len": 5, "seq_len": 37}]

    # A shared prefix is counted once: 4 sequences over 64 shared tokens (4 pages) + 20 own.
    p = bench.make_point("s", "prefix", [(4, 20, 84)], 64)
    assert p["work"]["unique_pages"] == p["num_blocks"] == 4 + 4 * 2
    assert p["work"]["nvfp4_bytes"] == 12 * page
    assert p["work"]["dense_bytes"] == 4 * 84 * 8 * 128 * 2 * 2  # dense reads it 4 times

    full = {q["name"]: q for q in bench.make_points(quick=False)}
    assert full["chunked1x2048"]["work"]["flops"] == per_position * (2048 * 32768
                                                                     + 2048 * 2049 // 2)
    assert full["prefix16x1024"]["work"]["unique_pages"] == 1024 + 16 * 64
    assert full["spec32x4"]["work"]["unique_pages"] == 32 * 513
    assert full["mixed16+2x1024"]["work"]["num_tokens"] == 16 + 2 * 1024
    assert abs(full["chunked1x2048"]["extra_noncausal_pct"] - 3.03) < 0.01
    # --spec-batches: spec32x8's shape at other batch sizes, after the grid's points.
    more = bench.make_points(quick=False, spec_batches=(16, 48))
    assert [q["name"] for q in more[-2:]] == ["spec16x8", "spec48x8"]
    assert more[-1]["work"]["num_tokens"] == 48 * 8
    assert more[-1]["work"]["unique_pages"] == 48 * full["spec32x8"]["work"]["unique_pages"] // 32
    assert bench.parse_args(["--spec-batches", "16,48", "--points", "spec48x8"]).points[0][
        "name"] == "spec48x8"


def test_shared_prefix_survives_the_page_permutation(bench):
    p = bench.make_point("s", "prefix", [(3, 16, 80)], 48)  # 3 shared pages, 2 own per row
    index = p["index"]
    assert (index[:, :3] == index[0, :3]).all()
    tables = np.asarray(bench.ab._tables(jax.random.key(0), jnp.asarray(index, jnp.int32),
                                         p["num_blocks"], 4))
    for table in tables:
        assert (table[:, :3] == table[0, :3]).all()
        assert len(set(table[:, 3:].ravel()) | set(table[0, :3])) == p["num_blocks"]


def _causal_reference(q, k, v):
    """Plain float64 grouped-query attention, causal aligned to the bottom right."""
    batch, q_len, heads, _ = q.shape
    kv_len, kv_heads = k.shape[1], k.shape[2]
    k = np.repeat(k, heads // kv_heads, axis=2)
    v = np.repeat(v, heads // kv_heads, axis=2)
    s = np.einsum("bthd,bshd->bhts", q, k) / np.sqrt(q.shape[-1])
    visible = np.arange(kv_len)[None, :] <= (kv_len - q_len + np.arange(q_len))[:, None]
    s = np.where(visible, s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    return np.einsum("bhts,bshd->bthd", p / p.sum(-1, keepdims=True), v)


def test_dense_masking_matches_causal_reference(bench):
    rng = np.random.default_rng(0)
    q_len, kv_len = 5, 12
    q = rng.standard_normal((2, q_len, 4, 8))
    k, v = rng.standard_normal((2, 2, kv_len, 2, 8))
    ref = _causal_reference(q, k, v)
    qf, kf, vf = (jnp.asarray(x, jnp.float32) for x in (q, k, v))
    cut = kv_len - q_len
    split = bench.bottom_right_attention(qf, kf[:, :cut], vf[:, :cut], kf[:, cut:], vf[:, cut:],
                                         implementation="xla")
    np.testing.assert_allclose(np.asarray(split), ref, rtol=1e-5, atol=1e-5)
    arrays = {"k_past": kf[:, :cut], "v_past": vf[:, :cut], "k_new": kf[:, cut:],
              "v_new": vf[:, cut:]}
    for masking in ("split", "mask"):
        out = bench.dense_group(qf, arrays, masking, "xla")
        np.testing.assert_allclose(np.asarray(out), ref, rtol=1e-5, atol=1e-5)
    # One token (no mask) and a chunk that is the whole sequence (plain causal):
    for ql, kl in ((1, kv_len), (q_len, q_len)):
        out = bench.dense_group(qf[:, :ql], {"k": kf[:, :kl], "v": vf[:, :kl]}, "split", "xla")
        np.testing.assert_allclose(np.asarray(out), _causal_reference(q[:, :ql], k[:, :kl],
                                                                      v[:, :kl]),
                                   rtol=1e-5, atol=1e-5)
    # Why two calls: JAX's is_causal is aligned to the top left when q_len < kv_len.
    top_left = jax.nn.dot_product_attention(qf, kf, vf, is_causal=True, implementation="xla")
    assert not np.allclose(np.asarray(top_left), ref, atol=1e-3)


def test_targets_from_rows(bench):
    def row(point, kind, method, us, label=None, implementation="cudnn"):
        return {"point": point, "kind": kind, "method": method, "label": label or method,
                "us_per_call": us, "spread_pct": 1.0, "implementation": implementation}

    rows = [row("c", "chunked", "ragged", 100.0), row("c", "chunked", "dense", 90.0),
            row("c", "chunked", "dense_nc", 85.0),
            row("s", "spec", "ragged", 120.0), row("s", "spec", "decode", 100.0),
            row("m", "mixed", "ragged", 130.0), row("m", "mixed", "parts", 100.0)]
    bench.add_ratios(rows)
    result = {"rows": rows, "points": [{"name": "c", "kind": "chunked"},
                                       {"name": "s", "kind": "spec"},
                                       {"name": "m", "kind": "mixed"},
                                       {"name": "p", "kind": "prefix"}]}
    checks = {c["point"]: c for c in bench.evaluate_targets(result)}
    assert rows[0]["vs_dense"] == pytest.approx(0.85)  # against the faster dense row
    assert checks["c"]["status"] == "met" and "0.85x" in checks["c"]["value"]
    assert checks["s"]["status"] == "met" and checks["s"]["ratio"] == pytest.approx(1.2)
    assert checks["m"]["status"] == "missed" and checks["m"]["ratio"] == pytest.approx(1.3)
    assert checks["p"]["status"] == "not run"
    # Speculative decoding: the faster of the ragged rows, with or without max_q_len.
    rows.append(row("s", "spec", "ragged_bound", 110.0, label="bounded"))
    bench.add_ratios(rows)
    checks = {c["point"]: c for c in bench.evaluate_targets(result)}
    assert checks["s"]["ratio"] == pytest.approx(1.1) and "bounded" in checks["s"]["value"]
    assert "not run" not in checks["c"]["value"]           # both cuDNN forms ran at "c"
    # One of cuDNN's two forms left out (--only ragged,dense): the check says so.
    rows = [r for r in rows if r["method"] != "dense_nc"]
    bench.add_ratios(rows)
    checks = {c["point"]: c for c in bench.evaluate_targets({**result, "rows": rows})}
    assert checks["c"]["ratio"] == pytest.approx(0.9)
    assert checks["c"]["value"].endswith(
        "(cuDNN's unmasked row (dense_nc) not run; the target takes the faster of both)")
