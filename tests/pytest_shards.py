"""Runs a pytest selection as one pytest process per test file, several at once, and prints one
pytest-style result line for the whole: how tests/gpu_checks.sh's suite-cpu part uses a GPU
machine's CPU cores (the CPU suite takes ~19 min on CI's 2 cores, and a device call is limited to
10 minutes).

    python3 -P tests/pytest_shards.py --jobs 4 -q -p no:cacheprovider -m "not gpu" -- tests

Everything before ``--`` is passed to every pytest process, everything after it names what to
collect. The files with selected tests are taken largest first (by collected test count) by
``--jobs`` workers, each running ``pytest OPTIONS FILE`` for one file at a time, so a slow file
delays one worker only. Each file's output is printed whole when it ends, under a ``### FILE``
header; the last line sums the files' result lines (``3 failed, 200 passed, ... in 120.52s``),
then the files that did not pass are listed. Exit status: 0 when every file's pytest exited 0,
else 1 (2 for a usage or collection error). Terminated (gpu_checks.sh's budget), it prints the
files still running and exits 124.

The pytest processes run without JAX's GPU memory preallocation: several processes that each
preallocate most of a GPU cannot start side by side.
"""

from __future__ import annotations

import argparse
import collections
import concurrent.futures
import os
import re
import signal
import subprocess
import sys
import threading
import time

# A pytest result line, "==== 2 failed, 10 passed, 1 warning in 3.21s ====" or without the
# rules (-q): the counts and the seconds.
RESULT = re.compile(r"^=*\s*((?:\d+ [a-z]+(?:, )?)+) in ([\d.]+)s")
COUNT = re.compile(r"(\d+) ([a-z]+)")
# pytest's order of the words in its result line.
ORDER = ("failed", "passed", "skipped", "deselected", "xfailed", "xpassed", "warnings",
         "warning", "errors", "error")


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
    return args.jobs, options, paths


def collect(options, paths, env):
    """{file: selected test count}, in pytest's order, from ``--collect-only -qq``."""
    done = subprocess.run([sys.executable, "-P", "-m", "pytest", *options, "--collect-only",
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
    return counts


def result_counts(output):
    """The counts of the last pytest result line in ``output`` (empty if there is none)."""
    counts = collections.Counter()
    for line in reversed(output.splitlines()):
        found = RESULT.match(line.strip())
        if found:
            for number, word in COUNT.findall(found.group(1)):
                counts[word] += int(number)
            break
    return counts


def summary_line(counts, seconds):
    words = sorted(counts, key=lambda w: ORDER.index(w) if w in ORDER else len(ORDER))
    text = ", ".join(f"{counts[w]} {w}" for w in words if counts[w]) or "no tests ran"
    return f"{text} in {seconds:.2f}s"


def main(argv=None) -> int:
    jobs, options, paths = parse_args(sys.argv[1:] if argv is None else argv)
    env = {**os.environ, "XLA_PYTHON_CLIENT_PREALLOCATE": "false"}
    start = time.perf_counter()
    counts = collect(options, paths, env)
    files = sorted(counts, key=lambda f: -counts[f])
    print(f"pytest_shards: {len(files)} files, {sum(counts.values())} tests, {jobs} at a time",
          flush=True)
    running, lock = {}, threading.Lock()

    def run_file(path):
        proc = subprocess.Popen([sys.executable, "-P", "-m", "pytest", *options, path],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=env)
        with lock:
            running[path] = proc
        output, _ = proc.communicate()
        with lock:
            del running[path]
            print(f"### {path} (exit {proc.returncode})\n{output.rstrip()}", flush=True)
        return path, proc.returncode, result_counts(output)

    def terminated(signum, frame):
        with lock:
            names = sorted(running)
            for proc in running.values():
                proc.kill()
        print(f"pytest_shards: terminated with {len(names)} files running: {' '.join(names)}",
              flush=True)
        os._exit(124)

    signal.signal(signal.SIGTERM, terminated)
    total, failed = collections.Counter(), []
    with concurrent.futures.ThreadPoolExecutor(jobs) as pool:
        for path, code, file_counts in pool.map(run_file, files):
            total.update(file_counts)
            if code != 0:
                failed.append(f"{path} (exit {code})")
    print(summary_line(total, time.perf_counter() - start))
    if failed:
        print("pytest_shards: not passed: " + ", ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
