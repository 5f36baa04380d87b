"""tests/gpu_checks.sh without a GPU, so that a typo does not cost a GPU session: its options,
the commands of its dry run (files that exist, the sanitizers' environment, every GPU test
file in one group per tool, pytest selections that collect), its refusal to run where no GPU
is visible, and its run loop end to end with stand-ins for the GPU machine's Python and
compute-sanitizer (summary lines, statuses, counts, timeouts, the log archive); and the
sanitizer-log summary it prints (tests/sanitizer_log.py) on logs of both report formats.
"""

from __future__ import annotations

import os
import re
import pathlib
import shlex
import signal
import subprocess
import sys
import tarfile
import time

import pytest

import sanitizer_log
from scripts import ROOT

SCRIPT = ROOT / "tests" / "gpu_checks.sh"
SCRIPT_TEST = "test_gpu_checks_script.py"
TOOLS = ("memcheck", "racecheck", "synccheck", "initcheck")
GROUPS = ("store", "decode", "ragged", "ragged-cases", "rest")
SANITIZER_ENV = {"XLA_PYTHON_CLIENT_PREALLOCATE": "false", "CUDA_MODULE_LOADING": "EAGER",
                 "XLA_FLAGS": "--xla_gpu_enable_command_buffer= --xla_gpu_autotune_level=0"}


def run(*args, env=None, timeout=120):
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT,
                          env={**os.environ, "PYTHON": sys.executable, **(env or {})})


def dry_run(*args):
    done = run("--dry-run", *args)
    assert done.returncode == 0, done.stderr
    rows = [line.split("\t") for line in done.stdout.splitlines()]
    assert all(len(r) == 3 for r in rows), done.stdout
    return [(part, int(budget), shlex.split(command)) for part, budget, command in rows]


def split_env(argv):
    """(environment assignments, the rest) of an ``env A=B ... command`` argv."""
    env = {}
    if argv[0] == "env":
        argv = argv[1:]
        while "=" in argv[0] and not argv[0].startswith("-"):
            key, value = argv.pop(0).split("=", 1)
            env[key] = value
    return env, argv


def gpu_test_files():
    """The test files that mark a test gpu (this file only names the marker)."""
    return sorted(f"tests/{p.name}" for p in (ROOT / "tests").glob("test_*.py")
                  if p.name != SCRIPT_TEST and "pytest.mark.gpu" in p.read_text())


# ------------------------------------------------------------------------------ options

def test_help_and_list_name_every_part():
    done = run("--help")
    assert done.returncode == 0 and "Usage: tests/gpu_checks.sh" in done.stdout
    parts = run("--list").stdout.split()
    want = (["suite-gpu", "suite-cpu", "ragged-tile"]
            + [f"{t}:{g}" for t in TOOLS for g in GROUPS]
            + ["properties", "soak"])
    assert parts == want
    for word in ("suite-gpu", "ragged-tile", "properties", "soak", "--budget",
                 "--dry-run", "initcheck runs without\n",
                 "--log-dir", "--parts", "10 minutes"):
        assert word in done.stdout, word
    assert "initcheck-all" not in done.stdout


@pytest.mark.parametrize("args, words", [
    (["--parts", "memchek"], "unknown part 'memchek'"),
    (["--parts", "initcheck-all"], "unknown part 'initcheck-all'"),  # now the initcheck parts
    (["--parts", "initcheck-all:decode"], "unknown part 'initcheck-all:decode'"),
    (["--parts", ""], "--parts is empty"),
    (["--parts", "soak,,suite"], "empty entry"),
    (["--budget", "0"], "--budget must be a positive number of seconds, got '0'"),
    (["--budget", "ten"], "--budget must be a positive number of seconds"),
    (["--budget", "soak=-1"], "--budget soak= needs a positive number of seconds"),
    (["--budget", "soaq=60"], "--budget names an unknown part 'soaq'"),
    (["--budget", "initcheck-all=60"], "--budget names an unknown part 'initcheck-all'"),
    (["--soak-steps", "1e4"], "--soak-steps must be a positive integer"),
    (["--property-examples", "0"], "--property-examples must be a positive integer"),
    (["--retries", "-1"], "--retries must be a count (0 or more), got '-1'"),
    (["--retries", "08"], "--retries must be a count"),  # (bash would read it as octal)
    (["--log-dir"], "--log-dir needs a value"),
    (["--log-dir", "--parts", "soak"], "--log-dir needs a value"),
    (["--frobnicate"], "unknown argument '--frobnicate'"),
])
def test_bad_arguments_exit_2_naming_the_problem(args, words):
    done = run("--dry-run", *args)
    assert done.returncode == 2, done
    assert words in done.stderr and done.stdout == "", done.stderr


def test_part_groups_and_budgets():
    rows = dry_run("--parts", "soak,memcheck,suite", "--budget", "300", "--budget",
                   "memcheck=200", "--budget", "memcheck:rest=100")
    assert [(p, b) for p, b, _ in rows] == (
        [("suite-gpu", 300), ("suite-cpu", 300), ("ragged-tile", 300)]
        + [(f"memcheck:{g}", 200) for g in GROUPS[:-1]]
        + [("memcheck:rest", 100), ("soak", 300)])
    assert len(dry_run()) == len(run("--list").stdout.split())
    assert [p for p, _, _ in dry_run("--parts", "soak,initcheck,sanitizers,soak")] == (
        [f"{t}:{g}" for t in TOOLS for g in GROUPS] + ["soak"])
    assert [(p, b) for p, b, _ in dry_run("--parts", "initcheck:store,memcheck:store",
                                          "--budget", "initcheck=90")] == [
        ("memcheck:store", 540), ("initcheck:store", 90)]


# ---------------------------------------------------------------------------- dry run

def test_dry_run_commands():
    rows = dry_run("--soak-steps", "123", "--property-examples", "7")
    groups = {}
    for part, _, argv in rows:
        env, argv = split_env(argv)
        for arg in argv:                         # every file a command names exists
            path = arg.split("=", 1)[-1]
            if path.startswith("tests/"):
                assert (ROOT / path).exists(), (part, path)
        if ":" not in part:
            assert "compute-sanitizer" not in " ".join(argv), part
            continue
        tool, group = part.split(":")
        expected = dict(SANITIZER_ENV, JAX_NVFP4_SANITIZER=tool)
        # (compute-sanitizer crashed under the cluster launches: TESTING.md)
        if part == "memcheck:decode" or group in ("store", "rest"):
            expected["JAX_NVFP4_CLUSTER_MERGE"] = "0"
        assert env == expected, part
        assert argv[0].endswith("compute-sanitizer") and argv[1:5] == [
            "--tool", tool, "--error-exitcode", "99"], argv
        # initcheck runs with every kernel instrumented: the kernel filter hides XLA's writes
        # of the scalars our kernels read (TESTING.md).
        filtered = argv[5:7] == ["--kernel-name", "kns=nvfp4"]
        assert filtered == (tool != "initcheck"), part
        assert filtered or "--kernel-name" not in argv, part
        program = argv[7 if filtered else 5:]
        assert program[:2] == [sys.executable, "-P"], program
        if group == "ragged-cases":
            assert program[2:] == ["-X", "faulthandler", "tests/ragged_sanitizer_cases.py"]
            continue
        # -v: a test's name is written when it starts, so a log cut short names it
        assert program[2:8] == ["-m", "pytest", "-v", "-p", "no:cacheprovider", "-m"]
        assert program[8] == "gpu", program
        groups.setdefault(tool, {})[group] = program[9:]
    by_part = {p: split_env(a)[1] for p, _, a in rows}
    # The CPU suite: one pytest process per file, several at once.
    cpu = by_part["suite-cpu"]
    assert cpu[:4] == [sys.executable, "-P", "tests/pytest_shards.py", "--jobs"], cpu
    assert 1 <= int(cpu[4]) <= 8 and cpu[5:] == [
        "-q", "-p", "no:cacheprovider", "-m", "not gpu", "--", "tests"], cpu
    assert by_part["soak"][-4:] == ["--device", "gpu", "--steps", "123"]
    env, argv = split_env(dict((p, a) for p, _, a in rows)["ragged-tile"])
    assert env == {"JAX_NVFP4_RAGGED_PIPELINED": "0"}
    assert argv[-3:] == ["-m", "gpu", "tests/test_ragged_attention.py"], argv
    env, argv = split_env(dict((p, a) for p, _, a in rows)["properties"])
    assert env == {"JAX_NVFP4_HYPOTHESIS": "long", "JAX_NVFP4_HYPOTHESIS_EXAMPLES": "7"}
    assert argv[-1] == "tests/test_properties.py" and "-m" in argv and "gpu" in argv
    # Every GPU test file is in exactly one group of each tool (rest = tests minus the others).
    files = gpu_test_files()
    assert {"tests/test_store.py", "tests/test_decode_kernel.py",
            "tests/test_properties.py"} <= set(files)
    for tool in TOOLS:
        named = [f for g in ("store", "decode", "ragged") for f in groups[tool][g]]
        rest = groups[tool]["rest"]
        assert rest[-1] == "tests"
        ignored = [a.removeprefix("--ignore=") for a in rest[:-1]]
        assert sorted(ignored) == sorted(named) and len(set(named)) == len(named), tool
        assert set(named) <= set(files), tool
    assert sorted(groups) == sorted(TOOLS)
    for tool in TOOLS:  # (ragged-cases runs one script, checked above)
        assert groups[tool] == groups["memcheck"], tool
    assert groups["initcheck"]["decode"] == ["tests/test_decode_kernel.py"]
    assert "tests/test_store.py" in groups["initcheck"]["store"]


def _collected(argv, env=None):
    """Node ids pytest collects for a command's pytest arguments (which include -q, or -v:
    made -q here, as --collect-only lists node ids only then)."""
    argv = ["-q" if arg == "-v" else arg for arg in argv]
    done = subprocess.run([sys.executable, "-P", "-m", "pytest", "--collect-only", *argv], capture_output=True, text=True, cwd=ROOT, timeout=300,
                          env={**os.environ, **(env or {})})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return [line for line in done.stdout.splitlines() if "::" in line]


def test_dry_run_pytest_selections_collect():
    """The pytest arguments of suite-gpu, memcheck:rest and properties, as printed, collect
    GPU tests here (they are skipped only when run): no typo in a path, marker or option."""
    rows = {p: split_env(a) for p, _, a in dry_run("--parts", "suite-gpu,memcheck:rest,"
                                                    "properties")}
    every = _collected(rows["suite-gpu"][1][rows["suite-gpu"][1].index("pytest") + 1:])
    assert {i.split("::")[0] for i in every} == set(gpu_test_files())
    env, argv = rows["memcheck:rest"]
    rest = _collected(argv[argv.index("pytest") + 1:], env)
    assert rest and {i.split("::")[0] for i in rest} == set(gpu_test_files()) - {
        "tests/test_store.py", "tests/test_edge_values.py", "tests/test_scales.py",
        "tests/test_inplace.py", "tests/test_roundtrip.py", "tests/test_numerics.py",
        "tests/test_decode_kernel.py", "tests/test_ragged_attention.py"}
    env, argv = rows["properties"]
    props = _collected(argv[argv.index("pytest") + 1:], env)
    assert props and all(i.startswith("tests/test_properties.py::test_gpu_") for i in props)


# ------------------------------------------------------------------------ running it

def test_refuses_quickly_where_no_gpu_is_visible(tmp_path):
    done = run("--parts", "soak", "--log-dir", str(tmp_path), env={"JAX_PLATFORMS": "cpu"})
    assert done.returncode == 2, done
    assert "gpu_checks: cannot run the GPU checks here: no GPU visible to JAX" in done.stderr
    assert not (tmp_path / "summary.txt").exists()


FAKE_PYTHON = """#!/bin/bash
# The GPU machine's Python, as far as the preflight can tell; otherwise the real one.
if [[ "$1" == -P && "$2" == -c ]]; then echo "jax 0.0, 1 x Fake GPU, jax_nvfp4 from here"; exit 0; fi
# A program named by FAKE_SLOW outlasts any budget (exec: the part's timeout kills it at once).
if [[ -n "${{FAKE_SLOW:-}}" && "$*" == *"$FAKE_SLOW"* ]]; then exec sleep 300; fi
exec {python} "$@"
"""
FAKE_SANITIZER = """#!/bin/bash
# compute-sanitizer's options, then the program; reports FAKE_ERRORS errors. Where FAKE_CRASHES
# names a file holding a count above 0, it counts one down and dies of SIGSEGV inside a test
# (compute-sanitizer's own crash: no summary). Where FAKE_RUNS names a folder, run N (counted by
# the argv.N files it leaves there: the program's argv, NUL-separated) prints N.out in place of
# the program where that file exists, then dies of SIGSEGV where N.segv exists, else prints its
# summary and exits with N.rc's status (_canned_runs).
while [[ "$1" == --* ]]; do shift 2; done
if [[ -n "${FAKE_RUNS:-}" ]]; then
    n=1
    while [[ -e "$FAKE_RUNS/argv.$n" ]]; do n=$((n + 1)); done
    printf '%s\\0' "$@" > "$FAKE_RUNS/argv.$n"
    if [[ -e "$FAKE_RUNS/$n.out" ]]; then
        cat "$FAKE_RUNS/$n.out"
        if [[ -e "$FAKE_RUNS/$n.segv" ]]; then kill -SEGV $$; fi
        echo "========= ERROR SUMMARY: 0 errors"
        exit "$(cat "$FAKE_RUNS/$n.rc")"
    fi
fi
if [[ -n "${FAKE_CRASHES:-}" ]] && (( $(cat "$FAKE_CRASHES") > 0 )); then
    echo $(( $(cat "$FAKE_CRASHES") - 1 )) > "$FAKE_CRASHES"
    echo "tests/test_x.py::test_y "
    kill -SEGV $$
fi
"$@"; rc=$?
echo "========= ERROR SUMMARY: ${FAKE_ERRORS:-0} errors"
if (( ${FAKE_ERRORS:-0} > 0 )); then exit 99; fi
exit $rc
"""


@pytest.fixture
def fake_machine(tmp_path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "python").write_text(FAKE_PYTHON.format(python=sys.executable))
    (bin_dir / "compute-sanitizer").write_text(FAKE_SANITIZER)
    for f in bin_dir.iterdir():
        f.chmod(0o755)
    # JAX_PLATFORMS=cpu: the GPU tests skip here even on a GPU machine (suite-cpu runs this).
    return dict(PYTHON=str(bin_dir / "python"), PATH=f"{bin_dir}:{os.environ['PATH']}",
                JAX_PLATFORMS="cpu")


def _summary(log_dir):
    lines = (log_dir / "summary.txt").read_text().splitlines()
    assert lines[0].startswith("gpu_checks ") and "commit " in lines[0]
    assert lines[1] == "jax 0.0, 1 x Fake GPU, jax_nvfp4 from here"
    assert lines[-1].startswith("summary: ")
    return {line.split()[0]: line for line in lines[3:-1]}


def test_run_loop_passes_and_archives_the_logs(tmp_path, fake_machine):
    """A sanitizer part whose tests pass (skipped here) and whose tool reports 0 errors."""
    out = tmp_path / "out"
    done = run("--parts", "memcheck:ragged-cases", env=dict(fake_machine, OUT=str(out)),
               timeout=300)
    # ragged_sanitizer_cases.py needs a GPU: the fake machine's has none, so the part fails
    # although the tool reported nothing, and the script says so.
    assert done.returncode == 1, done
    parts = _summary(out / "gpu_checks")
    assert re.match(r"memcheck:ragged-cases +FAIL +\d+s  rc=1; errors=0 summaries=1 "
                    r"by_kernel=-$", parts["memcheck:ragged-cases"]), parts  # (no "worst" line)
    done = run("--parts", "memcheck:store", "--log-dir", str(tmp_path / "logs"),
               env=fake_machine, timeout=300)
    assert done.returncode == 0, done
    line = _summary(tmp_path / "logs")["memcheck:store"]
    assert re.match(r"memcheck:store +PASS +\d+s  rc=0; errors=0 summaries=1 by_kernel=-; "
                    r"\d+ skipped", line), line
    assert line in done.stdout
    with tarfile.open(tmp_path / "logs" / "logs.tar.gz") as tar:
        names = [n for n in tar.getnames() if n.endswith(".log")]
        assert names == ["./memcheck-store.log"], names
        text = tar.extractfile(names[0]).read().decode()
    assert "ERROR SUMMARY: 0 errors" in text and "--kernel-name kns=nvfp4" in text


def test_run_loop_reports_errors_failures_and_timeouts(tmp_path, fake_machine):
    done = run("--parts", "memcheck:store,soak,properties", "--budget", "soak=1",
               "--budget", "properties=60", "--log-dir", str(tmp_path),
               env=dict(fake_machine, FAKE_ERRORS="3", FAKE_SLOW="device_soak.py"), timeout=600)
    assert done.returncode == 1, done
    parts = _summary(tmp_path)
    assert re.match(r"memcheck:store +FAIL .* rc=99; errors=3 summaries=1 by_kernel=-; "
                    r"sanitizer reported errors; \d+ skipped", parts["memcheck:store"]), parts
    assert re.match(r"soak +TIMEOUT +[0-9]s  rc=124", parts["soak"]), parts
    # The GPU property tests skip here, so every round passes; rounds stop before the budget.
    props = parts["properties"]
    assert re.match(r"properties +PASS +(\d+)s  (\d+) rounds passed of 10 examples per test "
                    r"\(\+ corners\), longest round \d+s; last: \d+ skipped", props), props
    assert int(props.split()[2].rstrip("s")) <= 60


def test_a_sanitizer_crash_is_run_again_and_named(tmp_path, fake_machine):
    """A sanitizer part whose process dies of a signal with no report runs again (--retries,
    default 3) in its own log; the summary names the crash and where it died. (This crash
    comes before any test finished: the next run deselects none.)"""
    crashes = tmp_path / "crashes"
    crashes.write_text("1")
    done = run("--parts", "memcheck:decode", "--log-dir", str(tmp_path / "once"),
               env=dict(fake_machine, FAKE_CRASHES=str(crashes)), timeout=300)
    assert done.returncode == 0, done
    line = _summary(tmp_path / "once")["memcheck:decode"]
    assert re.match(r"memcheck:decode +PASS +\d+s  rc=0; run 1 died: rc=139 after \d+s, errors=0 "
                    r"summaries=0 by_kernel=- unfinished=tests/test_x.py::test_y; run 2 resumed: "
                    r"0 finished tests deselected; errors=0 summaries=1 by_kernel=-; "
                    r"\d+ (passed|skipped)", line), line
    with tarfile.open(tmp_path / "once" / "logs.tar.gz") as tar:
        assert sorted(n for n in tar.getnames() if n.endswith(".log")) == [
            "./memcheck-decode.log", "./memcheck-decode.retry1.log"]
    # Crashing again: no third run; and with --retries 0, none.
    for retries, runs_left in [("1", "2"), ("0", "1")]:
        crashes.write_text(runs_left)
        done = run("--parts", "memcheck:decode", "--retries", retries, "--log-dir",
                   str(tmp_path / retries), env=dict(fake_machine, FAKE_CRASHES=str(crashes)),
                   timeout=300)
        assert done.returncode == 1 and crashes.read_text().strip() == "0", done
        line = _summary(tmp_path / retries)["memcheck:decode"]
        died = "run 1 died: rc=139" in line
        assert re.match(r"memcheck:decode +FAIL +\d+s  rc=139; ", line) and died == (
            retries == "1"), line
        assert line.endswith("errors=0 summaries=0 by_kernel=- unfinished=tests/test_x.py::"
                             "test_y"), line  # (no pytest result line)


RAGGED = "tests/test_ragged_attention.py::"
FEW_ROWS = RAGGED + "test_gpu_max_q_len_few_row_kernel_alone[2-64-NHD-12]"
VMAP = RAGGED + "test_gpu_vmap_stacked_layers_is_one_launch_and_matches"
CHECKED = RAGGED + "test_gpu_checked_and_dynamic_num_seqs"
WIDE = RAGGED + "test_gpu_wide_rows_kernel_occupancy"
SESSION = """============================= test session starts ==============================
platform linux -- Python 3.12.3, pytest-8.3.5, pluggy-1.5.0 -- /usr/bin/python3
rootdir: /src/repo
configfile: pyproject.toml
collecting ... collected 70 items / 27 deselected / 43 selected

"""
INVALID_READ = """========= Invalid __global__ read of size 4 bytes
=========     at 0x70 in /src/ffi/ragged_cuda.cu:10:nvfp4::RaggedKernel(int *)
=========     by thread (0,0,0) in block (0,0,0)
=========
"""


def _canned_runs(folder, *runs):
    """FAKE_RUNS's folder (FAKE_SANITIZER): run N prints runs[N-1]'s pytest -v output, then
    dies of SIGSEGV ("segv") or exits with the status given; runs past these run the program."""
    folder.mkdir()
    for n, (output, end) in enumerate(runs, 1):
        (folder / f"{n}.out").write_text(output)
        (folder / (f"{n}.segv" if end == "segv" else f"{n}.rc")).write_text(str(end))
    return folder


def _argv(folder, n):
    """The program's argv in run n, None where there was no run n."""
    path = folder / f"argv.{n}"
    return path.read_bytes().decode().split("\0")[:-1] if path.exists() else None


def _deselected(argv):
    return [argv[i + 1] for i, arg in enumerate(argv) if arg == "--deselect"]


def _gpu_and_cpu_tests(path):
    """(GPU tests, other tests) in the test file `path` (relative to the repository), as
    pytest collects them."""
    collected = subprocess.run(
        [sys.executable, "-P", "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
         "-m", "gpu", path], cwd=ROOT, capture_output=True, text=True, timeout=300)
    found = re.search(r"(\d+)/(\d+) tests collected \((\d+) deselected\)", collected.stdout)
    assert found, collected.stdout[-2000:] + collected.stderr[-2000:]
    gpu, total, other = map(int, found.groups())
    assert gpu + other == total, found.group(0)
    return gpu, other


def test_a_crashed_sanitizer_part_resumes_where_it_died(tmp_path, fake_machine):
    """memcheck:ragged died in all three runs from the start, each before its end (TESTING.md):
    a pytest part that dies resumes instead, the next run deselecting the tests that PASSED or
    SKIPPED (each id one argv entry, brackets and all), not the one that was running. The
    second run here is real pytest, which must take those ids; the summary names the resume
    and says what the last run's result line covers."""
    runs = _canned_runs(tmp_path / "runs", (SESSION + f"{FEW_ROWS} PASSED [  2%]\n"
                                            f"{VMAP} SKIPPED (no GPU) [  4%]\n{CHECKED} ", "segv"))
    done = run("--parts", "memcheck:ragged", "--log-dir", str(tmp_path / "logs"),
               env=dict(fake_machine, FAKE_RUNS=str(runs)), timeout=300)
    assert done.returncode == 0, done
    first, second = _argv(runs, 1), _argv(runs, 2)
    assert second == first + ["--deselect", FEW_ROWS, "--deselect", VMAP], second
    assert _argv(runs, 3) is None
    line = _summary(tmp_path / "logs")["memcheck:ragged"]
    # (the file's GPU tests all skip here; the CPU ones and the two finished are deselected)
    gpu_tests, cpu_tests = _gpu_and_cpu_tests(RAGGED.removesuffix("::"))
    assert re.fullmatch(
        r"memcheck:ragged +PASS +\d+s  rc=0; run 1 died: rc=139 after \d+s, errors=0 summaries=0 "
        rf"by_kernel=- unfinished={re.escape(CHECKED)}; run 2 resumed: 2 finished tests "
        rf"deselected; errors=0 summaries=1 by_kernel=-; last run: {gpu_tests - 2} skipped, "
        rf"{cpu_tests + 2} deselected in [\d.]+s; all runs: 1 passed, {gpu_tests - 1} skipped",
        line), line
    with tarfile.open(tmp_path / "logs" / "logs.tar.gz") as tar:
        assert sorted(n for n in tar.getnames() if n.endswith(".log")) == [
            "./memcheck-ragged.log", "./memcheck-ragged.retry1.log"]
        resumed = tar.extractfile("./memcheck-ragged.retry1.log").read().decode()
    # The command as run, deselections included; the deselected tests did not run again, the
    # one that was running did.
    command = shlex.split(resumed.splitlines()[1].removeprefix("### "))
    assert command[-4:] == ["--deselect", FEW_ROWS, "--deselect", VMAP], command
    ran = sanitizer_log.outcomes(resumed)
    assert CHECKED in ran and FEW_ROWS not in ran and VMAP not in ran, ran
    assert re.search(r"default\s+3; 0: never", run("--help").stdout)


def test_a_report_in_a_crashed_run_fails_the_part(tmp_path, fake_machine):
    """A report the tool printed before it died is a finding: the part fails at once, with no
    run again to spend the budget on (a crash with 0 reports is the tool's own and resumes)."""
    runs = _canned_runs(tmp_path / "runs",
                        (SESSION + f"{FEW_ROWS} PASSED [  2%]\n{CHECKED} " + INVALID_READ, "segv"),
                        (SESSION + f"{CHECKED} PASSED [ 50%]\n\n"
                         "======================= 1 passed, 1 deselected in 1.00s ========="
                         "==============\n", 0))
    done = run("--parts", "memcheck:ragged", "--log-dir", str(tmp_path),
               env=dict(fake_machine, FAKE_RUNS=str(runs)), timeout=300)
    assert done.returncode == 1, done
    assert _argv(runs, 2) is None  # no second run
    line = _summary(tmp_path)["memcheck:ragged"]
    assert re.fullmatch(
        r"memcheck:ragged +FAIL +\d+s  rc=139; errors=1 summaries=0 by_kernel=RaggedKernel:1 "
        rf"unfinished={re.escape(CHECKED)}(; .*)?", line), line


def test_failed_tests_run_again_and_the_retry_limit_holds(tmp_path, fake_machine):
    """A test that FAILED before the crash is not deselected (it runs again: the last result
    shows it), a test that passes later is; --retries (default 3) still bounds the runs."""
    a, b, c, d = (RAGGED + f"test_gpu_kernel_matches_float64[{i}]" for i in (0, 4, 6, 8))
    runs = _canned_runs(
        tmp_path / "runs",
        (SESSION + f"{a} FAILED [  2%]\n{b} PASSED [  4%]\n{c} ", "segv"),
        (SESSION + f"{a} FAILED [  2%]\n{c} PASSED [  4%]\n{d} ", "segv"),
        (SESSION + f"{a} PASSED [  2%]\n{d} ", "segv"),
        (SESSION + f"{d} ", "segv"),
        (SESSION + f"{d} PASSED\n", 0))  # (a fifth run would pass: there is none)
    done = run("--parts", "memcheck:ragged", "--log-dir", str(tmp_path / "logs"),
               env=dict(fake_machine, FAKE_RUNS=str(runs)), timeout=300)
    assert done.returncode == 1, done
    assert [_deselected(_argv(runs, n)) for n in (1, 2, 3, 4)] == [[], [b], [b, c], [a, b, c]]
    assert _argv(runs, 5) is None
    line = _summary(tmp_path / "logs")["memcheck:ragged"]
    deaths = re.findall(r"run (\d) died: rc=139", line)
    resumes = re.findall(r"run (\d) resumed: (\d) finished tests deselected", line)
    assert deaths == ["1", "2", "3"] and resumes == [("2", "1"), ("3", "2"), ("4", "3")], line
    assert re.match(r"memcheck:ragged +FAIL +\d+s  rc=139; ", line), line
    assert line.endswith(f"errors=0 summaries=0 by_kernel=- unfinished={d}; last run: no result "
                         "line in its log; all runs: 3 passed"), line
    # --retries 1: two runs.
    runs = _canned_runs(tmp_path / "once", *[(SESSION + f"{a} PASSED\n{b} ", "segv")] * 3)
    done = run("--parts", "memcheck:ragged", "--retries", "1", "--log-dir",
               str(tmp_path / "logs1"), env=dict(fake_machine, FAKE_RUNS=str(runs)), timeout=300)
    assert done.returncode == 1 and _argv(runs, 2) and _argv(runs, 3) is None, done


def test_a_resumed_run_with_no_test_left_passes(tmp_path, fake_machine):
    """The tool died after pytest's end (every test finished): the resumed run deselects them
    all, and pytest's "no tests ran" (exit 5) is its pass; the tool's summary comes with it."""
    ended = (SESSION + f"{FEW_ROWS} PASSED [ 50%]\n{VMAP} PASSED [100%]\n\n"
             "============================== 2 passed in 9.00s ==============================\n")
    runs = _canned_runs(tmp_path / "runs", (ended, "segv"),
                        (SESSION.replace("27 deselected / 43", "29 deselected / 0")
                         + "============================ 29 deselected in 0.50s ==="
                           "==========================\n", 5))
    done = run("--parts", "memcheck:ragged", "--log-dir", str(tmp_path),
               env=dict(fake_machine, FAKE_RUNS=str(runs)), timeout=300)
    assert done.returncode == 0, done
    assert _deselected(_argv(runs, 2)) == [FEW_ROWS, VMAP]
    line = _summary(tmp_path)["memcheck:ragged"]
    assert re.search(r"  rc=0; run 1 died: rc=139 after \d+s, errors=0 summaries=0 by_kernel=-; "
                     r"run 2 resumed: 2 finished tests deselected; run 2 had no test left "
                     r"\(pytest's rc=5\); errors=0 summaries=1 by_kernel=-; last run: 29 "
                     r"deselected in 0.50s; all runs: 2 passed$", line), line


def test_ragged_cases_runs_whole_again(tmp_path, fake_machine):
    """ragged-cases is one script, not pytest: a crash runs it again whole."""
    runs = _canned_runs(tmp_path / "runs", (f"{FEW_ROWS} PASSED\ncase 3 ", "segv"))
    done = run("--parts", "memcheck:ragged-cases", "--log-dir", str(tmp_path),
               env=dict(fake_machine, FAKE_RUNS=str(runs)), timeout=300)
    assert _argv(runs, 2) == _argv(runs, 1), done
    line = _summary(tmp_path)["memcheck:ragged-cases"]
    assert "run 1 died: rc=139" in line and "resumed" not in line, line


# ----------------------------------------------------------------- the CPU suite's shards

SHARD_TESTS = {
    "test_one.py": "def test_a():\n    pass\n\ndef test_b():\n    pass\n",
    "test_two.py": ("import pytest\n\ndef test_fails():\n    assert 1 == 2\n\n"
                    "@pytest.mark.skip\ndef test_skipped():\n    pass\n\n"
                    "@pytest.mark.slow\ndef test_deselected():\n    pass\n"),
    "test_three.py": "import pytest\n\n@pytest.mark.slow\ndef test_only_deselected():\n    pass\n",
    "test_warn.py": ("import pytest, warnings\n\n"
                     + "".join(f"def test_w{i}():\n    warnings.warn('w{i}')\n\n" for i in range(3))
                     + "@pytest.mark.xfail\ndef test_x():\n    assert False\n"),
}


def _write_shard_tests(folder):
    for name, text in SHARD_TESTS.items():
        (folder / name).write_text(text)
    (folder / "pytest.ini").write_text("[pytest]\nmarkers =\n    slow: a marker\n")


def _shards(tmp_path, *args, timeout=120):
    _write_shard_tests(tmp_path)
    return subprocess.run([sys.executable, "-P", str(ROOT / "tests" / "pytest_shards.py"), *args],
                          capture_output=True, text=True, cwd=tmp_path, timeout=timeout,
                          env={**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "true"})


def test_pytest_shards_sums_the_files_results(tmp_path):
    """Every file with a selected test runs in a pytest process of its own; the last line
    sums their result lines in pytest's words (what gpu_checks.sh reads); a failure anywhere
    fails the whole and is named."""
    done = _shards(tmp_path, "--jobs", "2", "-q", "-p", "no:cacheprovider", "-m", "not slow",
                   "--", ".")
    assert done.returncode == 1, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    assert lines[0] == "pytest_shards: 3 files, 8 tests, 2 at a time", lines
    headers = sorted(line.split()[1] for line in lines if line.startswith("### "))
    # test_three.py: none selected; warnings and errors summed in pytest's words
    assert headers == ["test_one.py", "test_two.py", "test_warn.py"], lines
    assert re.fullmatch(r"1 failed, 5 passed, 1 skipped, 1 deselected, 1 xfailed, 3 warnings "
                        r"in [\d.]+s", lines[-1]), lines[-1]
    assert lines[-2] == "pytest_shards: not passed: test_two.py (exit 1)"
    assert "assert 1 == 2" in done.stdout  # the failing file's own report, whole
    # One worker: the files largest first.
    done = _shards(tmp_path, "--jobs", "1", "-q", "-m", "not slow", "--", ".")
    assert [line.split()[1] for line in done.stdout.splitlines() if line.startswith("### ")] == [
        "test_warn.py", "test_one.py", "test_two.py"], done.stdout  # (not in name order)
    # A selection that passes; and one that runs one file at a time.
    done = _shards(tmp_path, "--jobs", "1", "-q", "-m", "not slow", "--", "test_one.py")
    assert done.returncode == 0 and re.fullmatch(r"2 passed in [\d.]+s",
                                                 done.stdout.splitlines()[-1]), done.stdout


def test_pytest_shards_runs_without_preallocation(tmp_path):
    """Processes side by side cannot each preallocate most of a GPU: the shards run with
    XLA_PYTHON_CLIENT_PREALLOCATE=false, whatever the caller's environment says."""
    (tmp_path / "test_env.py").write_text(
        "import os\n\ndef test_env():\n"
        "    assert os.environ['XLA_PYTHON_CLIENT_PREALLOCATE'] == 'false'\n")
    done = _shards(tmp_path, "-q", "--", "test_env.py")
    assert done.returncode == 0, done.stdout + done.stderr


def test_pytest_shards_names_a_file_that_died(tmp_path):
    """A file whose pytest dies of a signal (no result line) fails the whole, and the summed
    line says its tests are not in it."""
    (tmp_path / "test_dies.py").write_text(
        "import os, signal\n\ndef test_ok():\n    pass\n\n"
        "def test_dies():\n    os.kill(os.getpid(), signal.SIGKILL)\n")
    done = _shards(tmp_path, "-q", "--", "test_dies.py", "test_one.py")
    assert done.returncode == 1, done.stdout + done.stderr
    last = done.stdout.splitlines()[-1]
    assert re.fullmatch(r"2 passed in [\d.]+s \(no result line: test_dies.py \(exit -9\)\)",
                        last), last


def test_pytest_shards_terminated_names_the_running_files(tmp_path):
    """SIGTERM to the whole process group, twice, as GNU timeout sends it (gpu_checks.sh's
    budget): the files still running are named with their output so far (their pytest may die
    of it first), no file starts after it, the sum so far is marked, exit 124."""
    (tmp_path / "test_slow.py").write_text(
        "import time\n\ndef test_first():\n    print('first done')\n\n"
        "def test_slow():\n    time.sleep(300)\n")
    _write_shard_tests(tmp_path)
    temp = tmp_path / "temp"
    temp.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-P", str(ROOT / "tests" / "pytest_shards.py"), "--jobs", "2", "-v",
         "-m", "not slow", "--", "test_slow.py", "test_one.py"],
        cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
        env={**os.environ, "TMPDIR": str(temp)}, start_new_session=True)
    def log_of(name):
        logs = list(temp.glob(f"pytest_shards-*/{name}.log"))
        return logs[0].read_text() if logs else ""

    deadline = time.time() + 120
    while time.time() < deadline:  # until test_one.py has finished and test_slow.py runs
        time.sleep(0.5)
        if " passed in " in log_of("test_one.py") and "::test_slow" in log_of("test_slow.py"):
            break
    time.sleep(1)  # (test_one.py's worker counts it)
    os.killpg(proc.pid, signal.SIGTERM)
    time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 124, out
    lines = out.splitlines()
    assert "pytest_shards: terminated with 1 files running: test_slow.py" in lines, out
    assert "### test_slow.py (still running when terminated; the tail of its output)" in lines
    assert any(line.startswith("test_slow.py::test_first PASSED") for line in lines), out
    assert re.fullmatch(r"2 passed in [\d.]+s \(terminated: the files that finished only\)",
                        lines[-1]), lines[-1]
    assert not list(temp.iterdir())  # its logs' folder removed


def test_pytest_shards_starts_no_file_after_a_sigterm(tmp_path):
    """The group's SIGTERM kills the running files' pytest before this process's handler runs:
    the workers must not start the next files meanwhile."""
    for name in ("test_s1.py", "test_s2.py"):  # the largest: they start first
        (tmp_path / name).write_text("import time\n\ndef test_x():\n    time.sleep(300)\n\n"
                                     "def test_y():\n    pass\n")
    for name in ("test_q1.py", "test_q2.py"):
        (tmp_path / name).write_text("def test_q():\n    pass\n")
    temp = tmp_path / "temp"
    temp.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-P", str(ROOT / "tests" / "pytest_shards.py"), "--jobs", "2", "-v",
         "--", "."], cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
        text=True, env={**os.environ, "TMPDIR": str(temp)}, start_new_session=True)
    deadline = time.time() + 120
    while time.time() < deadline:
        time.sleep(0.5)
        logs = [p.read_text() for p in temp.glob("pytest_shards-*/test_s*.log")]
        if len(logs) == 2 and all("::test_x" in text for text in logs):
            break
    os.killpg(proc.pid, signal.SIGTERM)
    out, _ = proc.communicate(timeout=60)
    assert proc.returncode == 124, out
    assert "pytest_shards: terminated with 2 files running: test_s1.py test_s2.py" in out, out
    assert "test_q1.py" not in out and "test_q2.py" not in out, out


@pytest.mark.parametrize("args, words", [
    (["-q", "tests"], "'--' must separate"),
    (["-q", "--", "test_one.py::test_a"], "not test ids"),
    (["--jobs", "0", "--", "."], "--jobs must be at least 1"),
    (["-q", "--"], "no paths to collect"),
    (["-q", "--", "no_such_dir"], "collection failed"),
])
def test_pytest_shards_refuses_bad_arguments(tmp_path, args, words):
    done = _shards(tmp_path, *args)
    assert done.returncode == 2 and words in done.stderr + done.stdout, done


# ----------------------------------------------------------------- sanitizer log summary

LOG = """========= COMPUTE-SANITIZER
.....
========= Uninitialized __global__ memory read of size 2 bytes
=========     at void nvfp4::(anonymous namespace)::DecodeKernel<(int)128, (bool)1>(nvfp4::DecodeProblem)+0x6c30
=========     by thread (3,0,0) in block (1,0,0)
=========
========= Uninitialized __global__ memory read of size 2 bytes
=========     at void nvfp4::(anonymous namespace)::DecodeKernel<(int)64, (bool)0>(nvfp4::DecodeProblem)+0x7550 in /src/ffi/decode_cuda.cu:120
=========     by thread (3,0,0) in block (1,0,0)
========= Invalid __global__ read of size 4 bytes
=========     at 0x70 in /src/ffi/store_cuda.cu:10:nvfp4::StoreKernel(int *)
=========     by thread (0,0,0) in block (0,0,0)
========= Uninitialized __global__ memory read of size 4 bytes
=========     at loop_add_fusion+0x1f0
========= Error: Race reported between Write access at void nvfp4::RaggedKernel<1>(P)+0x1b0 in ragged_cuda.cu:12
=========     and Read access at void nvfp4::RaggedKernel<1>(P)+0x1e0 in ragged_cuda.cu:15 [4 hazards]
========= ERROR SUMMARY: 4 errors
.
========= RACECHECK SUMMARY: 1 hazard displayed (1 error, 0 warnings)
"""


def test_sanitizer_log_summary():
    errors, summaries, by_kernel = sanitizer_log.summarize(LOG)
    assert (errors, summaries) == (5, 2)
    assert by_kernel == {"DecodeKernel": 2, "StoreKernel": 1, "loop_add_fusion": 1,
                         "RaggedKernel": 1}
    assert sanitizer_log.line(LOG) == ("errors=5 summaries=2 by_kernel=DecodeKernel:2,"
                                       "StoreKernel:1,loop_add_fusion:1,RaggedKernel:1")
    # A process killed before its summary: no summary line, nothing counted.
    assert sanitizer_log.line(".....\n") == "errors=0 summaries=0 by_kernel=-"
    assert sanitizer_log.line("========= ERROR SUMMARY: 0 errors\n") == (
        "errors=0 summaries=1 by_kernel=-")


CRASH_LOG = """tests/test_store.py ........
Fatal Python error: Segmentation fault

Thread 0x00007f2a01dff640 (most recent call first):
  File "/usr/lib/python3.12/threading.py", line 355 in wait
  File "/src/repo/tests/test_soak.py", line 40 in worker

Current thread 0x00007f2a1b5a8740 (most recent call first):
  File "/usr/lib/python3/dist-packages/jax/_src/interpreters/pxla.py", line 1297 in __call__
  File "/usr/local/lib/python3.12/dist-packages/jax_nvfp4/api.py", line 88 in reshape_and_cache
  File "/src/repo/tests/store_cases.py", line 61 in store_on_gpu
  File "/src/repo/tests/test_store.py", line 123 in test_gpu_store_matches_reference
  File "/usr/lib/python3/dist-packages/_pytest/python.py", line 159 in pytest_pyfunc_call

Extension modules: numpy.core._multiarray_umath (total: 1)
"""


def test_sanitizer_log_names_where_a_process_crashed():
    # The crashing (current) thread's test function, not another thread's frames nor the
    # helper it called; without a test function, the innermost frame in a tests/ file.
    site = "tests/test_store.py:123:test_gpu_store_matches_reference"
    assert sanitizer_log.crash_site(CRASH_LOG) == site
    assert sanitizer_log.line(CRASH_LOG) == f"errors=0 summaries=0 by_kernel=- crashed_in={site}"
    no_test_function = CRASH_LOG.replace("test_gpu_store_matches_reference", "run_case")
    assert sanitizer_log.crash_site(no_test_function) == "tests/store_cases.py:61:store_on_gpu"
    # A dump with no frame in tests/ (a crash in a library's thread) and one without a
    # "Current thread" header (the first thread's frames are the crashing one's).
    no_test = CRASH_LOG.replace("/src/repo/tests/", "/src/repo/lib/")
    assert sanitizer_log.crash_site(no_test) == "?"
    no_current = CRASH_LOG.replace("Current thread", "Thread")
    assert sanitizer_log.crash_site(no_current) == "tests/test_soak.py:40:worker"
    assert sanitizer_log.crash_site("Fatal Python error: Aborted\n\n") == "?"
    assert sanitizer_log.crash_site(LOG) is None


VERBOSE_LOG = """========= COMPUTE-SANITIZER
============================= test session starts ==============================
collecting ... collected 14 items / 3 deselected / 11 selected

tests/test_outliers.py::test_gpu_scale_from_amax_is_the_cpus_bit_for_bit[6] PASSED [  9%]
tests/test_outliers.py::test_gpu_store_kernel_under_a_sink_is_the_reference[4over6] SKIPPED [ 18%]
tests/test_outliers.py::test_rotation_recipe_through_the_readers[gpu-kernel-ragged] """


def test_sanitizer_log_names_the_test_a_log_ends_in():
    """pytest -v names a test when it starts: a log without a summary that ends after a name
    with no outcome names the test that was running (compute-sanitizer died, no traceback)."""
    running = "tests/test_outliers.py::test_rotation_recipe_through_the_readers[gpu-kernel-ragged]"
    assert sanitizer_log.unfinished_test(VERBOSE_LOG) == running
    assert sanitizer_log.line(VERBOSE_LOG) == (
        f"errors=0 summaries=0 by_kernel=- unfinished={running}")
    # Its outcome written: finished; a summary: the process finished, whatever the log holds.
    done = VERBOSE_LOG + "PASSED [ 27%]\n"
    assert sanitizer_log.unfinished_test(done) is None
    assert "unfinished" not in sanitizer_log.line(done)
    summed = VERBOSE_LOG + "\n========= RACECHECK SUMMARY: 0 hazards displayed (0 errors)\n"
    assert sanitizer_log.line(summed) == "errors=0 summaries=1 by_kernel=-"
    # pytest's session ended (its warnings summary names tests again, its result line follows)
    # before the sanitizer died: no test was running.
    ended = (VERBOSE_LOG + "PASSED [ 27%]\n\n=============================== warnings summary "
             "===============================\n" + VERBOSE_LOG.splitlines()[-1]
             + "\n  DeprecationWarning: x\n\n========= Error: process didn't terminate "
             "successfully\n")
    assert sanitizer_log.unfinished_test(ended) is None
    assert sanitizer_log.unfinished_test(VERBOSE_LOG + "\n3 passed in 1.20s\n") is None
    # faulthandler's traceback, where there is one, says more: it wins.
    both = VERBOSE_LOG + "\n" + CRASH_LOG
    assert "crashed_in=tests/test_store.py:123:" in sanitizer_log.line(both)
    assert "unfinished" not in sanitizer_log.line(both)
    assert sanitizer_log.unfinished_test("") is None and sanitizer_log.unfinished_test(LOG) is None


# A pytest -v log of a sanitized run that died in a test: ids with parameters, every outcome
# word, a report written while a test ran (after its name, on its line), the log cut in a test.
RESUME_LOG = ("### memcheck:ragged (budget 540s) 10:00:00\n========= COMPUTE-SANITIZER\n"
              + SESSION
              + f"{RAGGED}test_gpu_kernel_matches_jnp_path[s21-d128-HND-swz-bs16-r4-bfloat16] "
                "PASSED [  2%]\n"
              + f"{RAGGED}test_gpu_kernel_matches_float64[0] FAILED [  4%]\n"
              + f"{RAGGED}test_gpu_one_token_per_sequence_matches_the_decode_kernel[64] SKIPPED "
                "(the decode kernel's layout) [  6%]\n"
              + f"{VMAP} PASSED [  9%]\n"
              + f"{WIDE} XFAIL (occupancy) [ 11%]\n"
              + f"{RAGGED}test_gpu_few_row_kernel_every_row_count[128-HND-16-1] " + INVALID_READ
              + "PASSED [ 13%]\n"
              + f"{FEW_ROWS} ")
RESUME_FINISHED = [
    f"{RAGGED}test_gpu_kernel_matches_jnp_path[s21-d128-HND-swz-bs16-r4-bfloat16]",
    f"{RAGGED}test_gpu_one_token_per_sequence_matches_the_decode_kernel[64]",
    VMAP, WIDE, f"{RAGGED}test_gpu_few_row_kernel_every_row_count[128-HND-16-1]"]


def test_sanitizer_log_finished_tests():
    """The tests a crashed run finished (gpu_checks.sh deselects them in the next run): PASSED,
    SKIPPED and XFAIL ones, whatever the sanitizer wrote between a test's name and its outcome;
    not the FAILED one, nor the one the log stops in."""
    assert sanitizer_log.finished_tests(RESUME_LOG) == RESUME_FINISHED
    found = sanitizer_log.outcomes(RESUME_LOG)
    assert found[f"{RAGGED}test_gpu_kernel_matches_float64[0]"] == "FAILED"
    assert FEW_ROWS not in found and len(found) == 6, found
    assert sanitizer_log.tally([RESUME_LOG]) == "1 failed, 3 passed, 1 skipped, 1 xfailed"
    # The report after the test's name counts (by_kernel; errors too, the log having no summary).
    assert sanitizer_log.line(RESUME_LOG) == (
        f"errors=1 summaries=0 by_kernel=RaggedKernel:1 unfinished={FEW_ROWS}")
    # pytest's closing sections name tests again (the failures', the warnings summary's, the
    # short summary's "FAILED ID"): they are not tests that ran.
    warned = RAGGED + "test_gpu_max_q_len_on_the_ragged_kernel"
    ended = (RESUME_LOG + "PASSED [ 16%]\n\n" + "=" * 20 + " FAILURES " + "=" * 20 + "\n"
             + "_" * 10 + " test_gpu_kernel_matches_float64[0] " + "_" * 10 + "\n"
             "E       assert False\n"
             + "=" * 20 + " warnings summary " + "=" * 20 + f"\n{warned}\n"
             "  /src/repo/jax_nvfp4/ragged.py:12: UserWarning: PASSED along\n\n"
             + "=" * 20 + " short test summary info " + "=" * 20 + "\n"
             f"FAILED {RAGGED}test_gpu_kernel_matches_float64[0] - assert False\n"
             "====== 1 failed, 4 passed, 1 skipped, 1 xfailed, 1 warning in 30.00s ======\n")
    assert sanitizer_log.finished_tests(ended) == RESUME_FINISHED + [FEW_ROWS]
    assert warned not in sanitizer_log.outcomes(ended)
    # Only the result line (-q's closing) ends the session too.
    assert sanitizer_log.finished_tests(
        RESUME_LOG + "PASSED\n3 passed in 1.00s\n" + f"{warned} PASSED\n")[-1] == FEW_ROWS
    # A teardown's error after PASSED (pytest writes the test twice): not finished; XPASS is.
    # An id with a space is not read (a part of it would deselect every test it is the start
    # of). Nothing in an empty log or one with no test.
    torn = SESSION + f"{VMAP} PASSED [ 50%]\n{VMAP} ERROR [ 50%]\n{WIDE} XPASS [100%]\n"
    assert sanitizer_log.outcomes(torn) == {VMAP: "ERROR", WIDE: "XPASS"}
    assert sanitizer_log.finished_tests(torn) == [WIDE]
    assert sanitizer_log.tally([torn]) == "1 xpassed, 1 error"
    spaced = SESSION + "tests/test_x.py::test_y[a b] PASSED [ 50%]\n"
    assert sanitizer_log.finished_tests(spaced) == []
    assert sanitizer_log.finished_tests("") == [] == sanitizer_log.finished_tests(LOG)
    assert sanitizer_log.tally([""]) == ""


def test_sanitizer_log_resumes_over_several_runs(tmp_path):
    """Over a part's runs, first to last: a test's last outcome counts (FAILED in the first,
    PASSED in the second: finished); only ids --deselect names alone are given (pytest deselects
    every id that starts with the option's value); the counts line sums the runs' counts."""
    second = (SESSION + f"{RAGGED}test_gpu_kernel_matches_float64[0] PASSED [  4%]\n"
              + f"{FEW_ROWS} PASSED [ 50%]\n\n=== 2 passed, 6 deselected in 3.00s ===\n"
              "========= ERROR SUMMARY: 0 errors\n")
    both = sanitizer_log.resumable([RESUME_LOG, second], root=str(ROOT))
    assert both == [RESUME_FINISHED[0], f"{RAGGED}test_gpu_kernel_matches_float64[0]",
                    *RESUME_FINISHED[1:], FEW_ROWS], both
    assert sanitizer_log.tally([RESUME_LOG, second]) == "5 passed, 1 skipped, 1 xfailed"
    assert sanitizer_log.line(RESUME_LOG, second) == (
        "errors=1 summaries=1 by_kernel=RaggedKernel:1")
    assert sanitizer_log.line(second, second) == "errors=0 summaries=2 by_kernel=-"
    # test_store.py's test_reference_under_jit is the start of another test's id; a parametrized
    # id (it ends in "]") and a plain one no other starts with are exact; an unreadable file not.
    assert not sanitizer_log.exact("tests/test_store.py::test_reference_under_jit", str(ROOT))
    assert sanitizer_log.exact(VMAP, str(ROOT)) and sanitizer_log.exact(FEW_ROWS, "/nowhere")
    assert not sanitizer_log.exact("tests/no_such_file.py::test_a", str(ROOT))
    held = SESSION + "tests/test_store.py::test_reference_under_jit PASSED [ 50%]\n"
    assert sanitizer_log.finished_tests(held) == ["tests/test_store.py::test_reference_under_jit"]
    assert sanitizer_log.resumable([held], root=str(ROOT)) == []
    # The command line gpu_checks.sh uses, from the repository root.
    logs = []
    for n, text in enumerate((RESUME_LOG, second, held)):
        logs.append(tmp_path / f"{n}.log")
        logs[-1].write_text(text)
    def cli(*args):
        return subprocess.run([sys.executable, "-P", str(ROOT / "tests" / "sanitizer_log.py"),
                               *map(str, args)], capture_output=True, text=True, cwd=ROOT)
    assert cli("--finished", *logs).stdout.splitlines() == both
    assert cli("--tally", *logs).stdout == "6 passed, 1 skipped, 1 xfailed\n"
    assert cli(*logs[:2]).stdout == "errors=1 summaries=1 by_kernel=RaggedKernel:1\n"
    assert cli(logs[0]).stdout == (
        f"errors=1 summaries=0 by_kernel=RaggedKernel:1 unfinished={FEW_ROWS}\n")
    assert cli("--finished").returncode == 2 and cli("--frob", logs[0]).returncode == 2
