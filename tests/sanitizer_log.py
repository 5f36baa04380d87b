"""Summary of a compute-sanitizer log (a script tests/gpu_checks.sh calls on each sanitizer
part's log, and a module its tests import).

    python3 tests/sanitizer_log.py LOG

prints one line: ``errors=N summaries=S by_kernel=Kernel:n,...``. N is the sum over the tool's
own summary lines (``ERROR SUMMARY: N errors``; racecheck's ``RACECHECK SUMMARY: N hazards
displayed``), S how many such lines there were (one per sanitized process that finished: 0
means the process never got to its summary, e.g. it was killed). by_kernel counts the reports
per kernel from the ``at ...`` line following each report header, so that an initcheck run
without ``--kernel-name`` says whether the reports are in this package's kernels or in XLA's.
"""

from __future__ import annotations

import collections
import re
import sys

PREFIX = "========="
SUMMARY = re.compile(r"(?:ERROR|RACECHECK) SUMMARY: (\d+) (?:errors?|hazards?)")
# A report header: "========= Invalid __global__ read of size 4 bytes", "========= Error: Race
# reported between ...", "========= Uninitialized __global__ memory read of size 2 bytes".
HEADER = re.compile(r"^=+ (?!    )(?!.*SUMMARY)(?:Error: |Warning: )?([A-Z][^\n]*)$")
AT = re.compile(r"^=+\s+at (.*)$")
NAME = re.compile(r"([A-Za-z_][\w:]*)\s*[<(]")


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


def line(text: str) -> str:
    errors, summaries, by_kernel = summarize(text)
    kernels = ",".join(f"{k}:{n}" for k, n in by_kernel.most_common()) or "-"
    return f"errors={errors} summaries={summaries} by_kernel={kernels}"


if __name__ == "__main__":
    with open(sys.argv[1], errors="replace") as f:
        print(line(f.read()))
