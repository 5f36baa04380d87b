"""Runs a pytest selection as one pytest process per test file, several at once, and prints one
pytest-style result line for the whole: how tests/gpu_checks.sh's suite-cpu part uses a GPU
machine's CPU cores (the CPU suite takes ~19 min on CI's 2 cores, and a device call is limited to
10 minutes).

    python3 -P tests/pytest_shards.py --jobs 4 -q -p no:cacheprovider -m "not gpu" -- tests

Run it from pytest's rootdir (the repository root): the files are collected, and run, by the
paths pytest prints. Everything before ``--`` is passed to every pytest process, everything after
it (folders or files, not test ids) names what to collect. The files with selected tests are
taken largest first (by collected test count) by ``--jobs`` workers, each running ``pytest
OPTIONS FILE`` for one file at a time, so a slow file delays one worker only. Each file's output
is printed whole when it ends, under a ``### FILE`` header. The last line sums the files' result
lines (``3 failed, 200 passed, 2 warnings in 120.52s``; files whose pytest ended without one,
e.g. killed by a signal, named after it), preceded by the files that did not pass. Exit status: 0
when every file's pytest exited 0, else 1; 2 for a usage or collection error. Terminated
(gpu_checks.sh's budget: SIGTERM), it prints the files still running with the tail of their
output, the sum so far marked as such, and exits 124.

The pytest processes run without JAX's GPU memory preallocation: several processes that each
preallocate most of a GPU cannot start side by side. A test's ``deselected`` count covers the
files that ran only (a file with nothing selected does not run).
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time

# A pytest result line, "==== 2 failed, 10 passed, 1 warning in 3.21s ====" or without the
# rules (-q): the counts and the seconds.
RESULT = re.compile(r"^=*\s*((?:\d+ [a-z]+(?:, )?)+) in ([\d.]+)s")
COUNT = re.compile(r"(\d+) ([a-z]+)")
# pytest's words, in the order of its result line; "warning" and "error" are the singulars.
ORDER = ("failed", "passed", "skipped", "deselected", "xfailed", "xpassed", "warnings",
         "errors")
PLURAL = {"warning": "warnings", "error": "errors"}
SINGULAR = {plural: singular for singular, plural in PLURAL.items()}
# Verbosity flags: collection needs -qq's per-file counts whatever the run's verbosity.
VERBOSITY = re.compile(r"^(?:-[vq]+|--verbose|--quiet)$")
TAIL_BYTES = 3000  # of a running file's output, printed when terminated


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], usage=(
        "pytest_shards.py [--jobs N] [PYTEST OPTIONS] -- PATHS"))
    p.add_argument("--jobs", type=int, default=os.cpu_count() or 1,
                   help="pytest processes at a time (default: the CPU count)")
    if "--" not in argv:
        p.error("'--' must separate pytest's options from the paths to collect")
    split = argv.index("--")
    args, options = p.parse_known_args(argv[:split])
    paths = argv[split + 1:]
    if args.jobs < 1:
        p.error(f"--jobs must be at least 1, got {args.jobs}")
    if not paths:
        p.error("no paths to collect after '--'")
    if any("::" in path for path in paths):
        p.error("paths name folders or files, not test ids ('::'): a file runs whole")
    return args.jobs, options, paths


def collect(options, paths, env):
    """{file: selected test count}, in pytest's order, from ``--collect-only -qq``."""
    quiet = [o for o in options if not VERBOSITY.match(o)]
    done = subprocess.run([sys.executable, "-P", "-m", "pytest", *quiet, "--collect-only",
                           "-qq", *paths], capture_output=True, text=True, env=env)
    counts = {}
    for line in done.stdout.splitlines():
        name, sep, count = line.rpartition(": ")
        if sep and count.isdigit() and name.endswith(".py"):
            counts[name] = int(count)
    if done.returncode not in (0, 5) or (done.returncode == 0 and not counts):
        sys.stdout.write(done.stdout + done.stderr)
        print(f"pytest_shards: collection failed (pytest exit {done.returncode})",
              file=sys.stderr)
        raise SystemExit(2)
    missing = [name for name in counts if not os.path.isfile(name)]
    if missing:
        print(f"pytest_shards: {missing[0]} (as pytest names it) is not a file here: run from "
              "pytest's rootdir", file=sys.stderr)
        raise SystemExit(2)
    return counts


def result_counts(output):
    """The counts of the last pytest result line in ``output`` (None if there is none)."""
    for line in reversed(output.splitlines()):
        found = RESULT.match(line.strip())
        if found:
            counts = collections.Counter()
            for number, word in COUNT.findall(found.group(1)):
                counts[PLURAL.get(word, word)] += int(number)
            return counts
    return None


def summary_line(counts, seconds, note=""):
    """pytest's result line for summed counts (its words, its order, its singulars)."""
    words = sorted(counts, key=lambda w: ORDER.index(w) if w in ORDER else len(ORDER))
    parts = []
    for word in words:
        if counts[word]:
            one = counts[word] == 1 and word in SINGULAR
            parts.append(f"{counts[word]} {SINGULAR[word] if one else word}")
    return f"{', '.join(parts) or 'no tests ran'} in {seconds:.2f}s{note}"


def main(argv=None) -> int:
    jobs, options, paths = parse_args(sys.argv[1:] if argv is None else argv)
    # (unbuffered: a file's output so far is in its log when it is terminated)
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false", "PYTHONUNBUFFERED": "1"}
    start = time.perf_counter()
    work = tempfile.mkdtemp(prefix="pytest_shards-")
    running = {}  # file -> (process, its output file); changed by the workers only
    total, failed, no_result = collections.Counter(), [], []
    # Files whose pytest a SIGTERM ended: GNU timeout signals the whole process group, so the
    # children may die before this process's handler runs; none starts after.
    interrupted, stopping = [], threading.Event()
    lock = threading.Lock()  # the workers' results and prints (not the signal handler's)

    def run_file(path):
        if stopping.is_set():
            return None
        log_path = os.path.join(work, path.replace(os.sep, "_") + ".log")
        with open(log_path, "w+") as log:
            proc = subprocess.Popen([sys.executable, "-P", "-m", "pytest", *options, path],
                                    stdout=log, stderr=subprocess.STDOUT, text=True, env=env)
            running[path] = (proc, log_path)
            if stopping.is_set():  # (the handler's copy of `running` may have missed it)
                proc.kill()
            code = proc.wait()
            log.seek(0)
            output = log.read()
        if code == -signal.SIGTERM:
            stopping.set()
            interrupted.append(path)
            return code  # (left in `running`: the handler prints it as running)
        del running[path]
        file_counts = result_counts(output)
        with lock:
            sys.stdout.write(f"### {path} (exit {code})\n{output.rstrip()}\n")
            sys.stdout.flush()
            if file_counts is not None:
                total.update(file_counts)
            else:
                no_result.append(f"{path} (exit {code})")
            if code != 0:
                failed.append(f"{path} (exit {code})")
        return code

    def terminated(signum, frame):
        # GNU timeout signals this process and then its group: once is enough.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        stopping.set()
        now = list(running.items())  # (a copy taken under the GIL: no lock to wait for)
        for _, (proc, _) in now:
            proc.kill()
        for path, (_, log_path) in sorted(now):
            with open(log_path, errors="replace") as log:
                tail = log.read()[-TAIL_BYTES:]
            print(f"### {path} (still running when terminated; the tail of its output)\n"
                  f"{tail.rstrip()}")
        print(f"pytest_shards: terminated with {len(now)} files running: "
              f"{' '.join(sorted(p for p, _ in now))}")
        print(summary_line(total, time.perf_counter() - start,
                           " (terminated: the files that finished only)"), flush=True)
        shutil.rmtree(work, ignore_errors=True)
        os._exit(124)

    signal.signal(signal.SIGTERM, terminated)
    try:
        counts = collect(options, paths, env)
    except SystemExit:
        shutil.rmtree(work, ignore_errors=True)
        raise
    files = sorted(counts, key=lambda f: -counts[f])
    print(f"pytest_shards: {len(files)} files, {sum(counts.values())} tests, {jobs} at a time",
          flush=True)
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        list(pool.map(run_file, files))
    if interrupted:  # (a SIGTERM reached the children only: this process was not signalled)
        terminated(signal.SIGTERM, None)
    if failed:
        print("pytest_shards: not passed: " + ", ".join(failed))
    shutil.rmtree(work, ignore_errors=True)
    note = f" (no result line: {', '.join(no_result)})" if no_result else ""
    print(summary_line(total, time.perf_counter() - start, note))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
