"""benchmarks/store_bench.py on the CPU: a smoke run that says it is one.

Runs a reduced --quick (16 tokens, and head size 64 at 256; the NVFP4 store and the jnp
reference, no cache-size rows) in a subprocess on the CPU backend and checks what it prints: the
smoke-run note once, first; the ceiling in units that fit; no share of the ceiling (meaningless
off a GPU); the small calls' profiler time; the head-size rows; where the files went; the table
last. About 15 s on 2 CPU cores. And the chain timing's rule for a difference that noise made
non-positive (no run: its timer is replaced).
"""

import importlib.util
import json
import math

from scripts import load_script, run_on_cpu

BENCH_PATH = "benchmarks/store_bench.py"
TIME_LIMIT_S = 240


def test_store_bench_quick_on_cpu(tmp_path):
    out = run_on_cpu(BENCH_PATH, "--quick", "--tokens", "16", "--head-sizes", "64",
                     "--no-cache-sizes", "--methods", "nvfp4 default", "jnp", "--out", tmp_path,
                     time_limit_s=TIME_LIMIT_S).stdout
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
    # --head-sizes keeps its rows beside --tokens: head size 64 at --quick's 256 tokens
    rows_64 = [line for line in table.splitlines() if line.startswith("| 256 | 8 | 64 |")]
    assert [row.split(" | ")[3] for row in rows_64] == ["nvfp4 default", "jnp reference (jit)"]
    result = json.loads((tmp_path / "store_bench.json").read_text())
    assert result["platform"] == "cpu" and all(r["pct_ceiling"] is None for r in result["rows"])
    assert all(r["us_per_call"] > 0 for r in result["rows"])
    # 16 tokens <= --device-time-max-tokens: also the kernels' own time from a profiler trace
    assert all(r["device_us_per_call"] > 0 for r in result["rows"])
    assert table.splitlines()[0].split(" | ")[5] == "kernels' µs / call (profiler)"


def _chained_time_with(monkeypatch, times):
    """store_bench.chained_time over chains of 2 and 10 calls whose timed runs return ``times``
    in turn (short chain, long chain, short, ...); the timer replaced, nothing compiled or run.
    Returns (seconds per call, the chain length of each timed run in order)."""
    bench = load_script(BENCH_PATH, "store_bench_chained_time")
    calls = iter(times)
    timed = []

    def fake_time_program(fn, state, args, repeats):
        timed.append(len(args[0]))
        return next(calls), state

    monkeypatch.setattr(bench, "_time_program", fake_time_program)
    monkeypatch.setattr(bench, "_chain", lambda step, n: n)
    per_call, state = bench.chained_time(None, "state", [()] * 10, 2, 10, repeats=1)
    assert state == "state"
    return per_call, timed


def test_chained_time_measures_a_non_positive_difference_again(monkeypatch):
    # The first pair's long chain ran no longer than its short one (a loaded host): measured
    # again, and the second pair's difference is the answer.
    per_call, timed = _chained_time_with(monkeypatch, [1.0, 0.9, 1.0, 1.8])
    assert per_call == (1.8 - 1.0) / 8 and timed == [2, 10, 2, 10]
    # A positive first difference is taken at once.
    per_call, timed = _chained_time_with(monkeypatch, [1.0, 1.5])
    assert per_call == 0.5 / 8 and timed == [2, 10]


def test_chained_time_is_nan_when_no_difference_is_positive(monkeypatch):
    per_call, timed = _chained_time_with(monkeypatch, [1.0, 1.0, 2.0, 1.0, 3.0, 2.5])
    assert math.isnan(per_call) and timed == [2, 10] * 3    # three attempts, never 0 µs


def test_async_time_rewinds_a_state_before_measuring_again(monkeypatch):
    # Queued calls of x -> x + 1 (a decode step's length), n1 = 1 and n2 = 3, one run each: the
    # first pair's clock readings give 1.0 s for n1 and 0.5 s for n2 (noise), the second pair's
    # 1.0 and 3.0. The state is rewound once, before the second pair, and the answer is the
    # second pair's (3.0 - 1.0) / 2 seconds a call.
    bench = load_script(BENCH_PATH, "store_bench_async_time")
    readings = iter([0.0, 1.0, 0.0, 0.5, 0.0, 1.0, 0.0, 3.0])
    monkeypatch.setattr(bench.time, "perf_counter", lambda: next(readings))
    rewound = []

    def rewind(x):
        rewound.append(x)
        return 100

    seconds, x = bench._async_time(lambda x: x + 1, 0, 1, 3, repeats=1, rewind=rewind)
    assert seconds == 1.0
    assert rewound == [1 + 1 + 3]          # the warm-up call and the first pair's 4 calls
    assert x == 100 + 1 + 3                # the second pair ran from the rewound state
