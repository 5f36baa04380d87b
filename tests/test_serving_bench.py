"""benchmarks/serving_bench.py: its --quick smoke run on the CPU (the whole path: fill through
each cache's store, the donated decode step, timing, the profile split, the logit check), a
step broken on purpose failing the logit check, the Pallas bf16 reader's cache layout and store
(its interpreter on the CPU) against the library's jnp reader, the profile accounting and the
up-front memory check.

The smoke run is a subprocess (its own JAX, on the CPU backend) with a time limit, into a
temporary folder: about 25 s on 2 CPU cores; the other tests take a few seconds each.
"""

import importlib.util
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from scripts import load_script, run_on_cpu

BENCH_PATH = "benchmarks/serving_bench.py"
TIME_LIMIT_S = 240  # a hang fails; the run itself takes about 25 s


@pytest.fixture(scope="module")
def bench():
    return load_script(BENCH_PATH, "serving_bench")


def test_serving_bench_quick(tmp_path):
    done = run_on_cpu(BENCH_PATH, "--quick", "--out", tmp_path, time_limit_s=TIME_LIMIT_S)
    out, err = done.stdout, done.stderr
    assert err.count("means nothing for a GPU") == 1, err
    assert "Targets: judged on a GPU only" in out
    table = out[out.index("| context | cache |"):]
    assert out.rstrip().endswith(table.rstrip())  # the table is printed last
    for context in (64, 192):
        for label in ("NVFP4 paged", "bf16 paged", "bf16 dense"):
            assert any(line.startswith(f"| {context} | {label} |")
                       for line in table.splitlines()), (context, label, table)

    result = json.loads((tmp_path / "serving_bench.json").read_text())
    assert {(r["context"], r["cache"]) for r in result["rows"]} == {
        (c, k) for c in (64, 192) for k in ("nvfp4", "bf16_paged", "dense")}
    for r in result["rows"]:
        assert r["caches_donated"], r["label"]
        assert 0 < r["steps_run"] <= r["capacity"] - r["context"]
        assert r["ms_per_step"] > 0 and r["tokens_per_s"] > 0
        # Every profiled op is attributed (by its scope or its users'), and attention and the
        # store are seen in every cache's step.
        assert r["shares"]["unattributed"] < 0.01, r["shares"]
        assert r["shares"]["attention"] > 0 and r["shares"]["store"] > 0, r["shares"]
        assert abs(sum(r["shares"].values()) - 1) < 1e-9
        assert 0 < r["attention_floor_share"] < 1
    by = {(r["context"], r["cache"]): r for r in result["rows"]}
    for context in (64, 192):  # the same budget: NVFP4 fits 3.56x the sequences of bf16, less
        # the pages' rounding
        ratio = by[(context, "nvfp4")]["batch"] / by[(context, "bf16_paged")]["batch"]
        assert 3.3 < ratio < 3.9, ratio
    assert len(result["checks"]) == 4 and all(c["ok"] for c in result["checks"])
    assert result["targets"] == []  # no targets on the CPU
    assert (tmp_path / "serving_bench.md").exists()
    if importlib.util.find_spec("matplotlib") is not None:
        assert (tmp_path / "serving_bench.png").stat().st_size > 0


def test_logit_check_fails_a_step_that_misses_the_token_just_stored(bench, monkeypatch,
                                                                      tmp_path):
    attend = bench.NVFP4Cache.attend
    monkeypatch.setattr(bench.NVFP4Cache, "attend",
                        lambda self, q, cache, tables, lens, scale:
                        attend(self, q, cache, tables, lens - 1, scale))
    result, status = bench.main(["--quick", "--contexts", "64", "--caches", "nvfp4,bf16_paged",
                                 "--out", str(tmp_path)])
    assert status == 1
    (check,) = result["checks"]
    assert check["cache"] == "nvfp4" and not check["ok"]
    assert check["rel_l2"] > 2 * check["bound"], check


def _one_step_logits(bench, cache, params, key):
    tables = jnp.asarray(bench.block_tables(cache, 1))
    scales = cache.scales()
    caches, _ = bench.fill_context(cache, cache.allocate(), tables, scales, key, 4096)
    plan = cache.plan
    tokens = bench.first_tokens(jax.random.fold_in(key, 1), plan.batch, cache.model.vocab)
    lens = jnp.full((plan.batch,), plan.context, jnp.int32)
    step = bench.make_step(cache, cache.model)
    (_, _, new_lens), logits = step(params, tables, scales, (caches, tokens, lens))
    assert (np.asarray(new_lens) == plan.context + 1).all()
    return np.asarray(logits)


def test_pallas_bf16_reader_reads_what_its_store_wrote(bench):
    """The GPU's Pallas reader (its [kv heads, pages, page size, D] cache, its store, q scaled
    by 1/sqrt(D), its padded block table), run by its interpreter, gives the jnp reader's logits
    over the same context."""
    model = bench.MODELS["tiny"]
    plan = bench.make_plan(model, "bf16_paged", 40, 4, 6 * 40 * 1024)
    params = bench.tiny_lm.init_params(model, seed=0, dtype=jnp.float32)
    key = jax.random.key(0)
    jnp_reader = bench.BF16PagedCache(model, bench.dataclasses.replace(plan))
    pallas = bench.BF16PagedCache(model, bench.dataclasses.replace(plan), k_splits=4,
                                  interpret=True)
    assert pallas.plan.table_width % bench.PALLAS_TABLE_MULTIPLE == 0
    a = _one_step_logits(bench, jnp_reader, params, key)
    b = _one_step_logits(bench, pallas, params, key)
    # Same bf16 values; the Pallas kernel rounds the softmax weights to the cache's dtype (bf16)
    # before multiplying with V: measured 4.3e-4. A cache read at the wrong pages or positions
    # gives another context (order 1); a missed token, about 1.8 / 40 here.
    assert np.linalg.norm(a - b) / np.linalg.norm(a) < 2e-3


def test_self_times_subtract_nested_events(bench):
    """(store_bench's, which the step's profile split uses)"""
    events = [(0, 100, "while"), (10, 30, "body1"), (40, 70, "body2"), (100, 120, "next")]
    assert sorted(bench.store_bench.self_times(events), key=lambda x: x[1]) == [
        (20, "body1"), (30, "body2"), (20, "next"), (50, "while")]


def test_scopes_follow_metadata_then_users(bench):
    hlo = "\n".join([
        "ENTRY %main (p: bf16[4]) -> f32[4] {",
        "  %p = bf16[4]{0} parameter(0)",
        "  %convert.1 = f32[4]{0} fusion(%p), kind=kLoop, calls=%c1",
        f'  %gather.2 = f32[4]{{0}} gather(%convert.1), metadata={{op_name="jit(step)/'
        f'{bench.ATTENTION_SCOPE}/gather"}}',
        f'  %scatter.3 = f32[4]{{0}} scatter(%gather.2), metadata={{op_name="jit(step)/'
        f'{bench.STORE_SCOPE}/scatter"}}',
        '  ROOT %dot.4 = f32[4]{0} dot(%scatter.3), metadata={op_name="jit(step)/dot_general"}',
        "}"])
    scopes = bench.scopes_of(hlo)
    assert scopes["convert.1"] == "attention"        # no metadata: its only user's scope
    assert scopes["gather.2"] == "attention" and scopes["scatter.3"] == "store"
    assert scopes["dot.4"] == "rest" and scopes["p"] == "attention"


def test_budget_and_weights_are_checked_up_front(bench):
    with pytest.raises(SystemExit, match="--kv-gib"):
        bench.run(bench.parse_args(["--quick", "--kv-gib", "1e6"]))
    with pytest.raises(SystemExit, match="--kv-gib .* holds no sequence"):
        bench.make_plan(bench.MODELS["llama3-8b"], "bf16_paged", 32768, 8, 1 << 30)
    # The default model's weights, from its shapes alone: Llama-3-8B's 8.03e9 parameters.
    assert abs(bench.weight_bytes(bench.MODELS["llama3-8b"], "bfloat16") / 2 - 8.03e9) < 0.01e9


def test_share_target_not_measured_when_the_profile_names_nothing(bench):
    """A profile whose events name no instruction (XLA's command buffers hide them) gives
    attention a share of 0: the target must say "not measured", not "met"."""
    cfg = {"model": "llama3-8b", "dtype": "bfloat16", "kv_gib": bench.TARGET_KV_GIB}

    def result(shares, floor=0.8):
        row = {"context": 4096, "cache": "nvfp4", "tokens_per_s": 1.0,
               "attention_floor_share": floor, "shares": shares}
        return {"rows": [row], "config": cfg, "platform": "gpu"}

    blind = bench.evaluate_targets(result({"attention": 0.0, "store": 0.0, "rest": 0.0,
                                           "unattributed": 1.0}))
    share = [t for t in blind if t["target"].startswith("attention share")]
    assert [t["status"] for t in share] == ["not measured"]
    assert "100.0% of the profiled time unattributed" in share[0]["value"]
    seen = bench.evaluate_targets(result({"attention": 0.85, "store": 0.01, "rest": 0.13,
                                          "unattributed": 0.01}))
    assert [t["status"] for t in seen if t["target"].startswith("attention share")] == ["met"]
    slow = bench.evaluate_targets(result({"attention": 0.99, "store": 0.0, "rest": 0.0,
                                          "unattributed": 0.01}, floor=0.5))
    share = [t for t in slow if t["target"].startswith("attention share")]
    assert share[0]["status"] == "missed" and share[0]["value"].startswith("1.98x")
