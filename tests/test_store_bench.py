"""benchmarks/store_bench.py on the CPU: a smoke run that says it is one.

Runs a reduced --quick (16 tokens, the NVFP4 store and the jnp reference, no cache-size rows) in
a subprocess on the CPU backend and checks what it prints: the smoke-run note once, first; the
ceiling in units that fit; no share of the ceiling (meaningless off a GPU); the small calls'
profiler time; where the files went; the table last. About 15 s on 2 CPU cores.
"""

import importlib.util
import json

from scripts import run_on_cpu

BENCH_PATH = "benchmarks/store_bench.py"
TIME_LIMIT_S = 240


def test_store_bench_quick_on_cpu(tmp_path):
    out = run_on_cpu(BENCH_PATH, "--quick", "--tokens", "16", "--no-cache-sizes", "--methods",
                     "nvfp4 default", "jnp", "--out", tmp_path, time_limit_s=TIME_LIMIT_S).stdout
    assert out.count("NOTE: this ran on cpu, not on a GPU: a smoke run.") == 1
    assert out.index("NOTE: this ran on cpu") < out.index("ceiling:")
    assert "TB/s" not in out and "GB/s" in out and "% of ceiling" not in out.split("| tokens")[0]
    assert f"wrote {tmp_path / 'store_bench.json'}, {tmp_path / 'store_bench.md'}" in out
    if importlib.util.find_spec("matplotlib") is None:
        assert "no plot: matplotlib is not installed" in out and '.[bench]' in out
    table = out[out.index("| tokens | kv heads |"):]
    assert out.rstrip().endswith(table.rstrip())
    rows = [line for line in table.splitlines() if line.startswith("| 16 |")]
    assert [row.split(" | ")[3] for row in rows] == ["nvfp4 default", "jnp reference (jit)"]
    assert all(row.endswith("| - |") for row in rows)          # no share of a CPU "ceiling"
    result = json.loads((tmp_path / "store_bench.json").read_text())
    assert result["platform"] == "cpu" and all(r["pct_ceiling"] is None for r in result["rows"])
    assert all(r["us_per_call"] > 0 for r in result["rows"])
    # 16 tokens <= --device-time-max-tokens: also the kernels' own time from a profiler trace
    assert all(r["device_us_per_call"] > 0 for r in result["rows"])
    assert table.splitlines()[0].split(" | ")[5] == "kernels' µs / call (profiler)"
