"""Summary of a compute-sanitizer log (a script tests/gpu_checks.sh calls on each sanitizer
part's log, and a module its tests import).

    python3 tests/sanitizer_log.py LOG

prints one line: ``errors=N summaries=S by_kernel=Kernel:n,...`` (and ``crashed_in=...`` where
the process died of a fatal signal, ``unfinished=...`` where the log ends inside a test). N is the sum over the tool's
own summary lines (``ERROR SUMMARY: N errors``; racecheck's ``RACECHECK SUMMARY: N hazards
displayed``), S how many such lines there were (one per sanitized process that finished: 0
means the process never got to its summary, e.g. it was killed). by_kernel counts the reports
per kernel from the ``at ...`` line following each report header, so that an initcheck run
without ``--kernel-name`` says whether the reports are in this package's kernels or in XLA's.
crashed_in names the test the process died in (file:line:function), from the traceback Python's
faulthandler prints on a fatal signal (pytest turns it on; gpu_checks.sh runs the sanitizer cases
script with ``-X faulthandler``): sanitized processes have died with rc 139 and nothing else in
their logs (TESTING.md). unfinished names the test a log without a summary ends in: pytest -v
writes a test's name when it starts and its outcome when it ends, so a name with no outcome
after it is the test that was running when the log stopped (compute-sanitizer's front end has
died of SIGSEGV, leaving no Python traceback: TESTING.md, seventeenth session).
"""

from __future__ import annotations

import collections
import os
import re
import sys

# (its folder, for the shared pytest result-line pattern, also where run as `python3 -P`)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pytest_shards import RESULT  # noqa: E402

PREFIX = "========="
SUMMARY = re.compile(r"(?:ERROR|RACECHECK) SUMMARY: (\d+) (?:errors?|hazards?)")
# A report header: "========= Invalid __global__ read of size 4 bytes", "========= Error: Race
# reported between ...", "========= Uninitialized __global__ memory read of size 2 bytes".
HEADER = re.compile(r"^=+ (?!    )(?!.*SUMMARY)(?:Error: |Warning: )?([A-Z][^\n]*)$")
AT = re.compile(r"^=+\s+at (.*)$")
NAME = re.compile(r"([A-Za-z_][\w:]*)\s*[<(]")
# faulthandler's dump: "Fatal Python error: Segmentation fault", then per thread a header
# ("Current thread 0x... (most recent call first):") and its frames, innermost first.
FATAL = "Fatal Python error"
FRAME = re.compile(r'^\s+File "(?:[^"]*/)?(tests/[^"/]+\.py)", line (\d+) in (\S+)')
# pytest -v: "tests/test_x.py::test_y[a] " when a test starts, its outcome when it ends (not
# compute-sanitizer's "ERROR SUMMARY").
STARTED = re.compile(r"^(tests/[^\s:]+\.py::\S+)", re.MULTILINE)
OUTCOME = re.compile(r"\b(?:PASSED|FAILED|SKIPPED|ERROR|XFAIL|XPASS)\b(?! SUMMARY)")
# pytest's closing sections. With its result line (pytest_shards.RESULT) they end its session:
# test names after them (the warnings summary's) are not tests that started.
CLOSING = re.compile(r"^=+ (?:warnings summary|FAILURES|ERRORS|short test summary info|PASSES)\b",
                     re.MULTILINE)


def kernel_name(frame: str) -> str:
    """The function's short name in an ``at`` frame, whichever order the sanitizer's version
    prints (``at 0x70 in file.cu:10:ns::Kernel(int*)`` or ``at void ns::Kernel<1>(int*)+0x70
    in file.cu:10``); template arguments, parameters and namespaces dropped."""
    frame = frame.replace("(anonymous namespace)::", "")
    for match in NAME.finditer(frame):
        name = match.group(1).split(":")[-1]
        if name and name not in ("void", "in"):
            return name
    return frame.split("+0x")[0].split()[-1] if frame.strip() else "?"


def summarize(text: str):
    """(errors, summaries, Counter of reports per kernel)."""
    errors = summaries = 0
    by_kernel = collections.Counter()
    pending = False
    for line in text.splitlines():
        if not line.startswith(PREFIX):
            continue
        found = SUMMARY.search(line)
        if found:
            errors += int(found.group(1))
            summaries += 1
            pending = False
            continue
        if HEADER.match(line):
            # racecheck names the kernel in the header ("... Write access at <frame>").
            where = line.split(" access at ", 1)
            if len(where) == 2:
                by_kernel[kernel_name(where[1])] += 1
            pending = len(where) == 1
            continue
        at = AT.match(line)
        if at and pending:
            by_kernel[kernel_name(at.group(1))] += 1
            pending = False
    return errors, summaries, by_kernel


def crash_site(text: str):
    """Where the crashing thread was in this repository's tests, from its faulthandler
    traceback (the current thread's where the dump names one, else the first thread's): the
    innermost frame of a test function (``test_*``), else the innermost frame in a tests/ file,
    as ``tests/file.py:line:function``; "?" where no frame is in tests/; None without a fatal
    error."""
    start = text.find(FATAL)
    if start < 0:
        return None
    dump = text[start:]
    header = dump.find("Current thread")
    if header < 0:
        header = dump.find("Thread 0x")
    if header < 0:
        return "?"
    frames = []
    for text_line in dump[header:].splitlines()[1:]:
        if not text_line.lstrip().startswith("File "):
            if frames or text_line.strip():
                break  # the end of this thread's frames
            continue
        frames.append(FRAME.match(text_line))
    ours = [f"{m.group(1)}:{m.group(2)}:{m.group(3)}" for m in frames if m]
    tests = [site for site in ours if site.rsplit(":", 1)[1].startswith("test")]
    return (tests or ours or ["?"])[0]


def unfinished_test(text: str):
    """The pytest -v test a log ends in (its name written, no outcome after it, pytest's session
    not ended), else None."""
    if CLOSING.search(text) or any(RESULT.match(l.strip()) for l in text.splitlines()):
        return None
    started = list(STARTED.finditer(text))
    if not started or OUTCOME.search(text, started[-1].end()):
        return None
    return started[-1].group(1)


def line(text: str) -> str:
    errors, summaries, by_kernel = summarize(text)
    kernels = ",".join(f"{k}:{n}" for k, n in by_kernel.most_common()) or "-"
    crash = crash_site(text)
    unfinished = unfinished_test(text) if summaries == 0 and not crash else None
    return (f"errors={errors} summaries={summaries} by_kernel={kernels}"
            + (f" crashed_in={crash}" if crash else "")
            + (f" unfinished={unfinished}" if unfinished else ""))


if __name__ == "__main__":
    with open(sys.argv[1], errors="replace") as f:
        print(line(f.read()))
