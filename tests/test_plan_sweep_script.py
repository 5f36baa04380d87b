"""benchmarks/plan_sweep.py without a GPU: the forced plan's arithmetic, and that it replaces
the split plan of the few-row kernels' calls only (``alone=True``), printing both plans."""

from __future__ import annotations

import pytest

import jax_nvfp4.ragged_primitive as rp
from scripts import load_script

sweep = load_script("benchmarks/plan_sweep.py", "plan_sweep_script")


@pytest.mark.parametrize("max_tokens, splits, plan", [
    (8256, 3, (3, 2752)),   # spec 32 x 8's table: the model's own plan at 3 CTAs a SM
    (8256, 2, (2, 4160)),
    (8256, 4, (4, 2112)),
    (8256, 1, (1, 8256)),
    (100, 4, (2, 64)),      # splits of whole 64-position steps: fewer where one would be empty
    (0, 2, (1, 64)),
])
def test_forced_plan(max_tokens, splits, plan):
    assert sweep.forced_plan(max_tokens, splits) == plan
    num_splits, per_split = plan
    assert per_split % rp.KV_TILE == 0 and num_splits * per_split >= max_tokens


def test_force_splits_replaces_only_the_alone_plan(capsys):
    args = (1, 256, 32, 8, 32, 128, 8256, 132, 2, 3)
    alone_model = rp.plan_splits(*args, alone=True, few_rows=rp.FEW_ROWS_WIDE)
    mixed_model = rp.plan_splits(*args)
    original = sweep.force_splits(2)
    try:
        assert rp.plan_splits(*args, alone=True, few_rows=rp.FEW_ROWS_WIDE) == (2, 4160)
        assert rp.plan_splits(*args) == mixed_model
    finally:
        rp.plan_splits = original
    assert rp.plan_splits(*args, alone=True, few_rows=rp.FEW_ROWS_WIDE) == alone_model
    out = capsys.readouterr().out
    assert f"alone=True: model {alone_model}, run (2, 4160)" in out, out
    assert f"alone=False: model {mixed_model}, run {mixed_model}" in out, out


def test_splits_must_be_positive(capsys):
    with pytest.raises(SystemExit) as stop:
        sweep.main(["--splits", "0"])
    assert stop.value.code == 2 and "--splits must be at least 1" in capsys.readouterr().err
