"""Summary of a compute-sanitizer log (a script tests/gpu_checks.sh calls on each sanitizer
part's log, and a module its tests import).

    python3 tests/sanitizer_log.py LOG [LOG ...]
    python3 tests/sanitizer_log.py --finished LOG [LOG ...]
    python3 tests/sanitizer_log.py --tally LOG [LOG ...]

The first prints one line: ``errors=N summaries=S by_kernel=Kernel:n,...`` (and ``crashed_in=...``
where the process died of a fatal signal, ``unfinished=...`` where the log ends inside a test).
N is the sum over the tool's own summary lines (``ERROR SUMMARY: N errors``; racecheck's
``RACECHECK SUMMARY: N hazards displayed``), or, in a log without one, the reports it holds (those
by_kernel counts: the tool died before it could count them, and a report is a finding whatever
happened after it). S is how many summary lines there were (one per sanitized process that
finished: 0 means the process never got to its summary, e.g. it was killed). Given several logs
(one part's runs, first to last: gpu_checks.sh runs a crashed part again), it prints one line
for all of them: N, S and by_kernel summed, crashed_in and unfinished the last log's; so a report
in a run that crashed fails the part even when a later run passes. by_kernel counts the reports
per kernel from the ``at ...`` line following each report header, so that an initcheck run
without ``--kernel-name`` says whether the reports are in this package's kernels or in XLA's.
crashed_in names the test the process died in (file:line:function), from the traceback Python's
faulthandler prints on a fatal signal (pytest turns it on; gpu_checks.sh runs the sanitizer cases
script with ``-X faulthandler``): sanitized processes have died with rc 139 and nothing else in
their logs (TESTING.md). unfinished names the test a log without a summary ends in: pytest -v
writes a test's name when it starts and its outcome when it ends, so a name with no outcome
after it is the test that was running when the log stopped (compute-sanitizer's front end has
died of SIGSEGV, leaving no Python traceback: TESTING.md, seventeenth session).

``--finished`` prints, one a line, the tests that finished (PASSED, SKIPPED, XFAIL, XPASS; each
test's last outcome in the logs) which ``pytest --deselect ID`` names exactly: gpu_checks.sh runs
a crashed pytest part again without them, so that a run resumes where the last one died instead
of redoing the tests that passed (compute-sanitizer has died in every run of a part, each time
before its end: TESTING.md, twenty-fifth session). A test that FAILED or ended in ERROR runs
again, and so does the one that was running when the log stopped. ``--tally`` prints the tests'
outcomes over the logs in pytest's words (``40 passed, 2 skipped``), each test counted once at
its last outcome: the last run's result line covers only the tests it was left.
"""

from __future__ import annotations

import collections
import os
import re
import sys

# (its folder, for the shared pytest result-line pattern, also where run as `python3 -P`)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from pytest_shards import ORDER, RESULT, SINGULAR  # noqa: E402

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
# A started test whose id is whole: "tests/test_x.py::test_y[a] " followed by its outcome, by the
# sanitizer's output (a report written while the test ran) or by the end of the line. An id with
# a space in it ("test_y[a b]") does not match, so its test never counts as finished: a part of
# it passed to --deselect would deselect every test it is the start of.
TEST_LINE = re.compile(r"^(tests/[^\s:]+\.py::\S+) (?:(?=" + OUTCOME.pattern + r")|(?==)|$)",
                       re.MULTILINE)
# The outcomes of a finished test (it need not run again), and every outcome's word in pytest's
# result line.
FINISHED = ("PASSED", "SKIPPED", "XFAIL", "XPASS")
RESULT_WORD = {"FAILED": "failed", "PASSED": "passed", "SKIPPED": "skipped", "XFAIL": "xfailed",
               "XPASS": "xpassed", "ERROR": "errors"}
# A test function's definition (exact() reads a test's file for the names it is the start of).
DEF = re.compile(r"^[ \t]*(?:async[ \t]+)?def[ \t]+(test\w*)[ \t]*\(", re.MULTILINE)


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
            # pytest -v writes a test's name and no newline when it starts: the first report
            # printed while the test runs follows the name on its line.
            at = line.find(" " + PREFIX + " ")
            if at < 0:
                continue
            line = line[at + 1:]
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


def session(text: str) -> str:
    """A pytest -v log up to pytest's closing sections or its result line, whichever comes
    first: the test names after them (the warnings summary's, the short summary's FAILED lines)
    are not tests that ran."""
    closing = CLOSING.search(text)
    text = text[:closing.start()] if closing else text
    offset = 0
    for text_line in text.splitlines(keepends=True):
        if RESULT.match(text_line.strip()):
            return text[:offset]
        offset += len(text_line)
    return text


def outcomes(text: str) -> dict:
    """{test id: its outcome word} of a pytest -v log, in the order the tests started. A test's
    last outcome counts (a test that PASSED and then failed in its teardown is written twice,
    the second time ERROR); a test with no outcome after its name (the log stops in it) is not
    in it, nor is one whose id has a space (TEST_LINE)."""
    text = session(text)
    starts = list(STARTED.finditer(text))
    found = {}
    for i, start in enumerate(starts):
        whole = TEST_LINE.match(text, start.start())
        end = starts[i + 1].start() if i + 1 < len(starts) else len(text)
        word = OUTCOME.search(text, start.end(), end)
        if whole and word:
            found[whole.group(1)] = word.group(0)
    return found


def merged_outcomes(texts) -> dict:
    """outcomes() over several logs, first to last: a test's last outcome in any of them."""
    found = {}
    for text in texts:
        found.update(outcomes(text))
    return found


def finished_tests(*texts: str) -> list:
    """The tests of pytest -v logs (one run's, or a part's runs first to last) whose last
    outcome finished them (PASSED, SKIPPED, XFAIL, XPASS), in the order they started: not the
    ones that FAILED or ended in ERROR, nor the one running when a log stopped."""
    return [test for test, word in merged_outcomes(texts).items() if word in FINISHED]


def exact(test_id: str, root: str = ".") -> bool:
    """Whether ``pytest --deselect TEST_ID`` deselects that test only. pytest deselects every
    test whose id starts with the option's value, so ``tests/f.py::test_a`` would take
    ``test_a_b`` along, never run. A parametrized id ends in ``]``: no other starts with it. A
    plain id is the start of another test's only where that test's function name starts with
    this one's: the test's file (from ``root``, pytest's rootdir) is read for such names (any
    in it, whatever class they are in); a file that cannot be read says no."""
    if test_id.endswith("]"):
        return True
    path, _, rest = test_id.partition("::")
    name = rest.rsplit("::", 1)[-1]
    try:
        with open(os.path.join(root, path), errors="replace") as f:
            names = DEF.findall(f.read())
    except OSError:
        return False
    return not any(other != name and other.startswith(name) for other in names)


def resumable(texts, root: str = ".") -> list:
    """The tests a run after these logs' runs can leave out (--deselect): those whose last
    outcome finished them and that exact() says --deselect names alone."""
    return [test for test in finished_tests(*texts) if exact(test, root)]


def tally(texts) -> str:
    """The tests' outcomes over the logs in pytest's words and order (``1 failed, 40 passed,
    2 skipped``), each test once at its last outcome; "" where no test has one."""
    counts = collections.Counter(RESULT_WORD[w] for w in merged_outcomes(texts).values())
    words = [w for w in ORDER if counts[w]]
    return ", ".join(f"{counts[w]} {SINGULAR[w] if counts[w] == 1 and w in SINGULAR else w}"
                     for w in words)


def line(*texts: str) -> str:
    """The counts line of one log, or of one part's runs' logs, first to last (the module's
    docstring)."""
    errors = summaries = 0
    by_kernel = collections.Counter()
    for text in texts:
        found, lines, kernels = summarize(text)
        # A log without a summary: the reports it holds (the tool never counted them).
        errors += found if lines else sum(kernels.values())
        summaries += lines
        by_kernel += kernels
    kernels = ",".join(f"{k}:{n}" for k, n in by_kernel.most_common()) or "-"
    last = texts[-1]
    crash = crash_site(last)
    unfinished = unfinished_test(last) if summarize(last)[1] == 0 and not crash else None
    return (f"errors={errors} summaries={summaries} by_kernel={kernels}"
            + (f" crashed_in={crash}" if crash else "")
            + (f" unfinished={unfinished}" if unfinished else ""))


def main(argv) -> int:
    mode = argv.pop(0) if argv and argv[0] in ("--finished", "--tally") else None
    if not argv or any(arg.startswith("--") for arg in argv):
        print("usage: sanitizer_log.py [--finished | --tally] LOG [LOG ...]", file=sys.stderr)
        return 2
    texts = []
    for path in argv:
        with open(path, errors="replace") as f:
            texts.append(f.read())
    if mode == "--finished":
        for test in resumable(texts):
            print(test)
    elif mode == "--tally":
        print(tally(texts))
    else:
        print(line(*texts))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
