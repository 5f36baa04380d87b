"""benchmarks/decode_trace.py without a GPU: its refusal on a build without the trace (and
prefill_trace.py's: the same helper, attention_bench.trace_refusal), and its reading of a
made-up trace (the variant's word layout: per CTA the global-timer ns of each event, their
clock64, the SM, blockIdx)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

from scripts import ROOT, load_script

trace = load_script("benchmarks/decode_trace.py", "decode_trace_script")


@pytest.mark.parametrize("script,args,variant", [
    ("decode_trace", [], "decode_trace"), ("prefill_trace", [], "prefill_trace"),
    ("prefill_trace", ["--kernel", "wide"], "wide_trace")])
def test_a_build_without_the_trace_exits_2_naming_the_variant(script, args, variant):
    """The trace scripts (attention_bench.trace_refusal): exit 2, naming their variant (the
    wide few-row kernel's for prefill_trace.py --kernel wide)."""
    done = subprocess.run([sys.executable, "-P", str(ROOT / "benchmarks" / f"{script}.py"),
                           *args], cwd=ROOT, env={**os.environ, "JAX_PLATFORMS": "cpu"},
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done
    assert f"{variant}.patch" in done.stderr, done.stderr


def made_up_trace():
    """2 units x 3 splits in clusters; times in ns from 1e9. Unit 0's split 2 starts 2 us late
    and merges 3 us after its peers; unit 1's CTAs are in step. Then a CTA of a third unit that
    returned early (its start only: the buffer is cleared before a launch)."""
    rows = []
    for unit in range(2):
        for split in range(3):
            late = 2000 if (unit, split) == (0, 2) else 0
            start = 1_000_000_000 + late + 100 * split
            chunks = [start + 5000 + 10 * w for w in range(trace.WARPS)]
            merged = start + 6000 + (1000 if (unit, split) == (0, 2) else 0)
            synced = 1_000_000_000 + (9100 if unit == 0 else 6300)
            end = synced + 400
            ns = [start, *chunks, merged, synced, end]
            cycles = [2 * (x - start) for x in ns]
            rows.append(ns + cycles + [10 * unit + split, split << 32 | unit])
    early = [0] * trace.WORDS
    early[trace.ENTRY], early[trace.EVENTS + trace.ENTRY] = 1_000_000_300, 5
    early[2 * trace.EVENTS], early[2 * trace.EVENTS + 1] = 20, 2
    rows.append(early)
    return np.asarray(rows, np.int64)


def test_the_summary_of_a_made_up_trace(capsys):
    t = made_up_trace()
    assert t.shape == (7, trace.WORDS)
    trace.describe(t, verbose=True)
    out = capsys.readouterr().out
    assert "7 CTAs on 7 SMs, 3 units (blockIdx.x) x up to 3 splits" in out, out
    assert "first start to last end 9.50 us; starts spread 2.20 us" in out, out
    assert "1 CTAs returned early" in out, out
    # Unit 0: starts 0, 0.1, 2.2 us (spread 2.2), merges 6.0, 6.1, 9.2 (3.2); unit 1: 0.2 each;
    # unit 2 (one CTA, no merge): starts spread 0, not among the merges.
    assert "starts spread median 0.20 us (max 2.20)" in out, out
    assert "merges spread median 1.70 us (max 3.20)" in out, out
    assert "last warp's chunks done (6 CTAs with chunks): median 5.03 us" in out, out
    # Waits: unit 0 9.1 - (6.0, 6.1, 9.2): 3.1, 3.0, -0.1; unit 1 6.3 - (6.0, 6.1, 6.2): 0.3,
    # 0.2, 0.1.
    assert "synced - merged): median 0.25 us, max 3.10 us" in out, out
    assert "unit    0 split  2 sm   2: start   2.20" in out, out
    assert "CTA lifetimes (clock64): median 14000, min 13000, max 19000 cycles" in out, out
