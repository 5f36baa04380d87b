"""The command line of examples/paged_decode.py: options that cannot run are refused with a
message naming the option (argparse's usage error, exit status 2), before anything runs;
``--help`` says what every option does and shows its default."""

import os
import subprocess
import sys

import pytest
from scripts import ROOT, load_script

EXAMPLE = ROOT / "examples" / "paged_decode.py"


@pytest.fixture(scope="module")
def example():
    return load_script("examples/paged_decode.py", "paged_decode_cli")


# Model sizes only apply to the random-weight model (the trained model's sizes are fixed).
@pytest.mark.parametrize("argv, words", [
    (["--steps", "0"], "--steps must be >= 1, got 0"),
    (["--batch", "0"], "--batch must be >= 1, got 0"),
    (["--batch", "-3"], "--batch must be >= 1, got -3"),
    (["--random-weights", "--layers", "0"], "--layers must be >= 1"),
    (["--random-weights", "--vocab", "0"], "--vocab must be >= 1"),
    (["--block-size", "0"], "--block-size must be a positive multiple of 4 (the NVFP4 page "
                            "layout), got 0"),
    (["--block-size", "6"], "--block-size must be a positive multiple of 4 (the NVFP4 page "
                            "layout), got 6"),
    (["--random-weights", "--num-q-heads", "6", "--num-kv-heads", "4"],
     "--num-q-heads (6) must be a multiple of --num-kv-heads (4)"),
    (["--random-weights", "--num-kv-heads", "0"], "--num-kv-heads must be >= 1"),
    (["--random-weights", "--head-size", "80"], "--head-size must be a positive multiple of 64, got 80"),
    (["--random-weights", "--head-size", "96"], "v_scale_swizzle=False"),
    (["--random-weights", "--head-size", "0"], "--head-size must be a positive multiple of 64, got 0"),
    (["--prompt-lens", "3", "0"], "--prompt-lens must all be >= 1"),
    (["--extra-blocks", "-1"], "--extra-blocks must be >= 0"),
    (["--long-context", "--warmup", "0"], "--warmup must be >= 1"),
    (["--long-context", "--repeats", "0"], "--repeats must be >= 1"),
    (["--long-context", "--context", "-5"], "--context must be >= 0"),
    (["--steps", "0", "--batch", "0"], "--batch must be >= 1, got 0; --steps must be >= 1"),
    (["--prefill-chunk", "0"], "--prefill-chunk must be >= 1, got 0"),
    (["--prefill-chunk", "-2"], "--prefill-chunk must be >= 1, got -2"),
    (["--draft-tokens", "0"], "--draft-tokens must be >= 1, got 0"),
])
def test_bad_options_are_refused_by_name(example, capsys, argv, words):
    with pytest.raises(SystemExit) as info:
        example.parse_args(argv)
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert "usage:" in err and words in err, err


def test_good_options_pass(example):
    assert example.config_problems(example.Config()) == []
    cfg = example.parse_args(["--random-weights", "--head-size", "128", "--block-size", "4",
                              "--num-q-heads", "12", "--num-kv-heads", "3", "--extra-blocks", "0"])
    assert (cfg.head_size, cfg.block_size, cfg.num_q_heads, cfg.num_kv_heads) == (128, 4, 12, 3)
    assert example.parse_args(["--long-context"]).warmup == 2
    cfg = example.parse_args(["--prefill-chunk", "1", "--draft-tokens", "100"])
    assert (cfg.prefill_chunk, cfg.draft_tokens) == (1, 100)   # at most --steps drafts are used
    assert (example.Config().prefill_chunk, example.Config().draft_tokens) == (24, 4)


def test_help_describes_every_option_with_its_default():
    env = dict(os.environ, COLUMNS="300")                   # one line per option
    out = subprocess.run([sys.executable, str(EXAMPLE), "--help"], capture_output=True,
                         text=True, check=True, timeout=120, env=env).stdout
    flat = " ".join(out.split())
    options = [word.rstrip(",") for word in flat.split() if word.startswith("--")]
    for option in ("--batch", "--prompt-lens", "--steps", "--prefill-chunk", "--draft-tokens",
                   "--layers", "--d-model",
                   "--num-q-heads", "--num-kv-heads", "--head-size", "--mlp", "--vocab",
                   "--block-size", "--layout", "--scale-search", "--extra-blocks",
                   "--teacher-force", "--seed", "--no-progress", "--long-context", "--context",
                   "--repeats", "--warmup", "--nvfp4-jnp", "--random-weights", "--verbose"):
        assert option in options, option
    for default in ("(default 4 (32 with --long-context))", "(default 64 96 128 160)",
                    "(default 16)", "(default 'HND')", "(default 'default')", "(default 8)",
                    "(default 0)", "(default 32768)", "(default 5)", "(default 2)",
                    "chunked-prefill step of the NVFP4 run (default 24)",
                    "verify step (at most --steps are used) (default 4)"):
        assert default in flat, default
    # Every option line has a description: no option is followed directly by the next one.
    lines = [line for line in out.splitlines() if line.strip().startswith("--")]
    for line in lines:
        assert len(line.split()) > 1 or line.strip().endswith("...]"), line
