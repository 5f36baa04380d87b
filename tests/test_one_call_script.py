"""benchmarks/one_call.py without a GPU: its points (prefill_bench's, and spec<B>x8), the
bound and unbound calls agreeing, and the command line."""

from __future__ import annotations

import numpy as np
import pytest

from scripts import load_script, run_on_cpu

one_call = load_script("benchmarks/one_call.py", "one_call_script")


@pytest.mark.parametrize("name, rows", [("spec2x8", 2), ("mixed2+2x16", 4), ("spec32x8", 32),
                                        ("spec64x8", 64)])
def test_find_point(name, rows):
    point = one_call.find_point(name)
    assert point["name"] == name and len(point["seq_lens"]) == rows
    assert point["cu_q_lens"][-1] == point["work"]["num_tokens"] == sum(point["q_lens"])


@pytest.mark.parametrize("name", ["spec2x7", "specx8", "nothing"])
def test_unknown_point(name):
    with pytest.raises(SystemExit, match=f"no point '{name}'.*spec32x8"):
        one_call.find_point(name)


def test_bound_and_unbound_calls_agree():
    point = one_call.find_point("spec2x8")
    bound = one_call.run(point, bound=True, calls=1)
    unbound = one_call.run(point, bound=False, calls=2)
    assert bound.shape == (point["work"]["num_tokens"], 32, 128)
    assert np.isfinite(bound).all() and np.abs(bound).mean() > 0
    np.testing.assert_allclose(bound, unbound, rtol=1e-5, atol=1e-6)


def test_command_line():
    done = run_on_cpu("benchmarks/one_call.py", "--point", "spec2x4", "--bound", "--calls", "1",
                      time_limit_s=300)
    assert "spec2x4 (bound): out (8, 32, 128), mean |value|" in done.stdout, done.stdout


def test_calls_must_be_positive(capsys):
    with pytest.raises(SystemExit) as stop:
        one_call.main(["--calls", "0"])
    assert stop.value.code == 2 and "--calls must be at least 1" in capsys.readouterr().err
