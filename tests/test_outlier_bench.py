"""benchmarks/outlier_bench.py on the CPU: its --quick smoke run, and how it puts outliers into
the model.

The smoke run is a subprocess (its own JAX, on the CPU backend) into a temporary folder: about
25 s on 2 CPU cores. It checks what the run prints (the smoke-run note once, first; where the
files went; the tables last), the files, and the measured effects the benchmark exists to show,
at bounds far from the measured values: a token x1e5 erases every ordinary block at headroom 6
and not at headroom 1; the store path agrees with the round trip bit for bit.
"""

import json

import jax.numpy as jnp
import numpy as np
import pytest

from scripts import load_script, run_on_cpu

BENCH_PATH = "benchmarks/outlier_bench.py"
TIME_LIMIT_S = 300  # a hang fails; the run itself takes about 25 s


@pytest.fixture(scope="module")
def bench():
    return load_script(BENCH_PATH, "outlier_bench")


def test_outlier_bench_quick(tmp_path, bench):
    out = run_on_cpu(BENCH_PATH, "--quick", "--out", tmp_path, time_limit_s=TIME_LIMIT_S).stdout
    assert out.count("NOTE: --quick: a smoke run") == 1 and out.startswith("NOTE: --quick")
    json_path, md_path = tmp_path / "outlier_bench.json", tmp_path / "outlier_bench.md"
    assert f"wrote {json_path}, {md_path}" in out
    text = md_path.read_text()
    assert out.rstrip().endswith(text.rstrip())                  # the tables are printed last
    assert "bit for bit (largest difference 0)" in text
    for title in ("K, 64 tokens x 8 kv heads x 128: relative L2 error of the ordinary values",
                  "V, 64 tokens x 8 kv heads x 128: share of ordinary nonzero values",
                  "Δ bits/byte vs float32 with the same outliers", "mean KL(float32 || format)",
                  "argmax agreement with float32", "remedy minus the same without it"):
        assert title in text, title

    result = json.loads(json_path.read_text())
    assert result["quick"] is True and result["store_path_max_difference"] == 0
    for side in ("K", "V"):
        rows = result["synthetic"][side]
        assert set(rows) == {"Gaussian", "token x1e5", "channel x100"}
        assert rows["Gaussian"]["h6 (default)"]["outlier_error"] is None
        assert 0.08 < rows["Gaussian"]["h6 (default)"]["ordinary_error"] < 0.11
        # The issue: one token x1e5 stores every ordinary block as zeros under amax/448 ...
        assert rows["token x1e5"]["h6 (default)"]["ordinary_zero_share"] == 1.0
        # ... and headroom 1 (amax/(448*6)) keeps them.
        assert rows["token x1e5"]["h1"]["ordinary_error"] < 0.2
        assert rows["token x1e5"]["h1"]["ordinary_zero_share"] < 0.2
    model = result["model"]
    # One window from every 20th held-out file: the held-out files are this Python's standard
    # library, so their count depends on its version (4 windows on 3.11.7, 3 on the GPU
    # machine's 3.12, 2026-12-03).
    _, owners = bench.qb.stdlib_corpus.heldout_windows(
        bench.qb.stdlib_corpus.load_split(heldout=True), bench.qb.train_tiny_lm.EVAL_LENGTH,
        bench.WINDOWS_PER_FILE)
    stride = bench.QUICK["model_kwargs"]["file_stride"]
    assert model["windows"] == len(np.unique(owners)[::stride]) >= 2, model["windows"]
    assert model["positions"] == 64
    assert set(model["cases"]) == {"none", "sink x1e5", "K channels x100"}
    for case in model["cases"].values():
        summary = case["summary"]
        assert summary["float32"]["kl_nats"] == 0
        assert all(np.isfinite(r["bits_per_byte"]) for r in summary.values())
    # The injection leaves the float32 model as it was (the same outliers in the reference).
    f32 = [c["summary"]["float32"]["bits_per_byte"] for c in model["cases"].values()]
    assert max(f32) - min(f32) < 1e-3, f32
    sink = model["cases"]["sink x1e5"]["summary"]
    assert (sink["NVFP4 headroom 1"]["kl_nats"] * 5
            < sink["NVFP4 default (headroom 6)"]["kl_nats"])


def test_sink_and_channel_injection_are_invisible_in_float32(bench):
    """The injected outliers reach the cache's K/V, and a float32 forward pass is unchanged:
    the sink sits in channels the (blinded) model cannot see, the channel outliers are
    compensated in q."""
    qb = bench.qb
    cfg, params, _ = qb.tiny_lm.load_weights()
    tokens = qb.calibration_windows(2)[:, :33]
    channels = bench.model_channels(cfg, params, qb.cache_inputs(cfg, params, tokens))
    assert (channels["k_outlier_pair"] != channels["k_blind_pair"]).all()
    none = bench.case_params(cfg, params, channels, bench.Case("none"))
    both = bench.case_params(cfg, params, channels,
                             bench.Case("both", token=1e5, channel=1000))

    def forward(p):
        logits, ks, vs = qb.tiny_lm.forward(cfg, p, jnp.asarray(tokens[:, :-1]),
                                            kv_transform=lambda i, k, v: bench.inject_sink(
                                                p, i, k, v))
        return np.asarray(logits)

    np.testing.assert_allclose(forward(both), forward(none), rtol=0, atol=2e-3)
    plain, inflated = (qb.cache_inputs(cfg, p, tokens, inject=bench.inject_sink)
                       for p in (none, both))
    for i, ((k0, v0), (k1, v1)) in enumerate(zip(plain, inflated)):
        # The sink: position 0's largest |K| and |V| are 1e5 times the calibration amax.
        for x1, amax in ((k1, channels["k_amax"][i]), (v1, channels["v_amax"][i])):
            np.testing.assert_allclose(np.abs(x1[:, 0]).max(axis=(0, 2)), 1e5 * amax,
                                       rtol=1e-2)
        # The channel outliers: the chosen K pair is 1000 times larger; V is unchanged past
        # position 0 (exactly in layer 0; later layers' inputs differ by float32 rounding).
        pair = channels["k_outlier_pair"][i]
        for h in range(cfg.num_kv_heads):
            ratio = (np.abs(k1[:, 1:, h, [pair[h], pair[h] + 32]]).max()
                     / np.abs(k0[:, 1:, h, [pair[h], pair[h] + 32]]).max())
            assert ratio == pytest.approx(1000, rel=1e-2)
        if i == 0:
            np.testing.assert_array_equal(v1[:, 1:], v0[:, 1:])
        np.testing.assert_allclose(v1[:, 1:], v0[:, 1:], rtol=0, atol=1e-3 * np.abs(v0).max())
