"""benchmarks/tp_bench.py on the CPU: a smoke run (2 CPU devices, tiny shapes) that says it is
one, checks the step (no collective on 2 devices, the two meshes' pools equal and stored into,
outputs within rounding) and writes its files. About 10 s on 2 CPU cores."""

import json
import os
import subprocess
import sys

from scripts import ROOT, run_on_cpu

TIME_LIMIT_S = 240


def test_tp_bench_quick_on_cpu(tmp_path):
    # Chains of 8 against 2 steps: at 4 the difference is ~0.5 ms, under a loaded host's noise.
    out = run_on_cpu("benchmarks/tp_bench.py", "--quick", "--repeats", "2", "--chain", "8",
                     "--out", tmp_path, time_limit_s=TIME_LIMIT_S).stdout
    assert out.count("NOTE: this ran on cpu, not on a GPU: a smoke run.") == 1
    assert "2 x cpu; 2 layers, 2 sequences x 48 positions" in out
    assert "no collective in the 2-device step; pools equal after the runs (and stored into)" in out
    assert f"wrote {tmp_path / 'tp_bench.json'}, {tmp_path / 'tp_bench.md'}" in out
    result = json.loads((tmp_path / "tp_bench.json").read_text())
    assert result["platform"] == "cpu" and result["shapes"]["groups"] == 2
    assert [r["devices"] for r in result["rows"]] == [2, 1]
    # NaN where noise made every chain pair's difference non-positive (store_bench._per_call)
    assert all(not r["us_per_step"] <= 0 and r["collectives"] == [] for r in result["rows"])
    assert result["output_difference"] <= 2e-2
    table = (tmp_path / "tp_bench.md").read_text()
    assert "| devices | µs / step | vs one device |" in table


def test_tp_bench_rejects_groups_that_do_not_divide_the_heads(tmp_path):
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks/tp_bench.py"), "--quick",
                           "--devices", "3", "--out", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=TIME_LIMIT_S,
                          env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert done.returncode == 2 and "--devices 3 must divide num_kv_heads 4" in done.stderr
