"""benchmarks/one_call.py without a GPU: its points (prefill_bench's grids and spec<B>x8 as the
ragged call, attention_bench's BxC and raggedN as the decode reader's), the bound and unbound
ragged calls agreeing, the refusals, and the command line."""

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


@pytest.mark.parametrize("name", ["1x4096", "ragged4", "spec2x7", "nothing"])
def test_not_a_prefill_point(name):
    assert one_call.find_point(name) is None


@pytest.mark.parametrize("name", ["spec2x7", "specx8", "nothing", "0x16"])
def test_unknown_point(name):
    with pytest.raises(SystemExit, match=f"no point '{name}'.*spec32x8.*BxC or raggedN"):
        one_call.call_of(name, bound=False)


def test_bound_is_for_the_ragged_calls():
    with pytest.raises(SystemExit, match="--bound is for prefill_bench's points, not '2x64'"):
        one_call.call_of("2x64", bound=True)


def test_bound_and_unbound_ragged_calls_agree():
    bound = one_call.run("spec2x8", bound=True, calls=1)
    unbound = one_call.run("spec2x8", bound=False, calls=2)
    assert bound.shape == (16, 32, 128)
    assert np.isfinite(bound).all() and np.abs(bound).mean() > 0
    np.testing.assert_allclose(bound, unbound, rtol=1e-5, atol=1e-6)


def test_decode_call_is_the_readers():
    out = one_call.run("2x64", bound=False, calls=2)
    assert out.shape == (2, 32, 128) and np.isfinite(out).all() and np.abs(out).mean() > 0


@pytest.mark.parametrize("args, line", [
    (("--point", "spec2x4", "--bound", "--calls", "1"),
     "spec2x4 (bound): out (8, 32, 128), mean |value|"),
    (("--point", "3x32", "--calls", "1"), "3x32: out (3, 32, 128), mean |value|"),
])
def test_command_line(args, line):
    done = run_on_cpu("benchmarks/one_call.py", *args, time_limit_s=300)
    assert line in done.stdout, done.stdout


def test_calls_must_be_positive(capsys):
    with pytest.raises(SystemExit) as stop:
        one_call.main(["--calls", "0"])
    assert stop.value.code == 2 and "--calls must be at least 1" in capsys.readouterr().err
