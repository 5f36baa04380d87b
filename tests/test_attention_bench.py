"""benchmarks/attention_bench.py --quick: the smoke run of the attention benchmark, on the CPU.

Runs the script in a subprocess (its own JAX, on the CPU backend) with a time limit, into a
temporary output folder, and checks that it prints the targets and the table last and writes the
JSON (and the PNG where matplotlib is installed). About 20 s on 2 CPU cores.
"""

import importlib.util
import json

from scripts import run_on_cpu

BENCH_PATH = "benchmarks/attention_bench.py"
TIME_LIMIT_S = 240  # a hang fails; the run itself takes about 20 s


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

    result = json.loads((tmp_path / "attention_bench.json").read_text())
    assert {r["point"] for r in result["rows"]} == {"2x512", "ragged4"}
    assert {r["method"] for r in result["rows"]} == {"kernel", "jnp", "bf16", "dense", "glue"}
    for r in result["rows"]:
        assert len(r["chain_lengths"]) == 3 and r["us_per_call"] >= 0
    assert (tmp_path / "attention_bench.md").exists()
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "attention_bench.png").stat().st_size > 0
